//! The options of a build and the summary it returns.

use std::path::PathBuf;
use std::sync::Arc;

use rayon::ThreadPool;

use crate::builder::runs::END;
use crate::error::{Error, Result};
use crate::format::MAX_TOKEN_BITS;

/// Options of a build.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    /// Token ids must be below this (at most 2^21 − 1 = 2,097,151).
    pub vocab_size: u32,
    /// Memory the builder may use (default 2 GiB): keys + radix scratch take half, merge
    /// read buffers a quarter; the rest is headroom for vocabulary arrays and one context.
    pub memory_limit_bytes: u64,
    /// Where runs and section files go (default: the output's directory for sections, the
    /// system temp dir for runs).
    pub temp_dir: Option<PathBuf>,
    /// Bigram and trigram nodes with a count below this are dropped (unigrams are kept).
    pub min_count: u64,
    /// Keep at most this many children per context (the highest counts; ties: lower token id).
    /// A bigram dropped from a one-token context takes its trigram children with it.
    pub max_children_per_context: Option<u32>,
    /// Threads: `None` uses the shared pool ([`crate::pool::get`]); a count must be in
    /// 1..=[`crate::pool::MAX_THREADS`] and is capped at the CPUs this process may use.
    pub threads: Option<usize>,
    /// Width of token ids in node words; default: the fewest bits that hold `vocab_size − 1`
    /// (at least 18, so Qwen-size vocabularies share one layout). Tests force 21 to
    /// exercise the count escape table with small counts.
    pub token_bits: Option<u32>,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            vocab_size: 0,
            memory_limit_bytes: 2 << 30,
            temp_dir: None,
            min_count: 1,
            max_children_per_context: None,
            threads: None,
            token_bits: None,
        }
    }
}

impl BuildOptions {
    pub(super) fn check(&self) -> Result<u32> {
        if self.vocab_size == 0 || self.vocab_size as u64 >= END {
            return Err(Error::InvalidOption(format!(
                "vocab_size must be in 1..={}, got {}",
                END - 1,
                self.vocab_size
            )));
        }
        if self.memory_limit_bytes < 1 << 20 {
            return Err(Error::InvalidOption(format!(
                "memory_limit of {} bytes is too small (at least 1 MiB)",
                self.memory_limit_bytes
            )));
        }
        if self.min_count == 0 {
            return Err(Error::InvalidOption("min_count must be at least 1".into()));
        }
        if self.max_children_per_context == Some(0) {
            return Err(Error::InvalidOption("max_children_per_context must be at least 1".into()));
        }
        if let Some(n) = self.threads {
            crate::pool::check_threads(n, "threads")?;
        }
        let need = (32 - (self.vocab_size - 1).leading_zeros()).max(1);
        let bits = self.token_bits.unwrap_or(need.max(18));
        if bits < need || bits > MAX_TOKEN_BITS {
            return Err(Error::InvalidOption(format!(
                "token_bits {bits} must be in {need}..={MAX_TOKEN_BITS} for vocab_size {}",
                self.vocab_size
            )));
        }
        Ok(bits)
    }

    pub(super) fn pool(&self) -> Result<Arc<ThreadPool>> {
        match self.threads {
            None => Ok(crate::pool::get()),
            // A builder is CPU-bound: threads beyond the CPUs this process may use only
            // contend (rayon's idle workers spin). Measured on 2 CPUs, a 100-token build:
            // 2 threads 0.02 s, 4096 threads 70 s. So an explicit count is capped there.
            Some(n) => rayon::ThreadPoolBuilder::new()
                .num_threads(crate::pool::check_threads(n, "threads")?.min(crate::pool::available_cpus()))
                .thread_name(|i| format!("dart-ngram-{i}"))
                .build()
                .map(Arc::new)
                .map_err(|e| Error::InvalidOption(format!("cannot start {n} threads: {e}"))),
        }
    }
}

/// What a build produced.
#[derive(Clone, Debug, Default)]
pub struct BuildSummary {
    pub output: PathBuf,
    pub documents: u64,
    pub tokens: u64,
    pub unigram_nodes: u64,
    pub bigram_nodes: u64,
    pub trigram_nodes: u64,
    pub bytes: u64,
    pub runs: usize,
    /// Wall time of the whole build (from `Builder::new`, or of `merge_runs`).
    pub seconds: f64,
    /// Of which: filling the key buffer (`add_*`), sorting + spilling it, merging + writing.
    pub count_seconds: f64,
    pub sort_seconds: f64,
    pub write_seconds: f64,
}
