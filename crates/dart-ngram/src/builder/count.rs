//! The map side: documents → keys in a bounded buffer, sorted and spilled as run files.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use rayon::ThreadPool;

use crate::builder::files::{check_output, stale, RUNS_PREFIX};
use crate::builder::merge::merge_runs;
use crate::builder::options::{BuildOptions, BuildSummary};
use crate::builder::runs::{key, write_run, END};
use crate::builder::writer::IndexWriter;
use crate::error::{Error, Result};
use crate::radix::MergeChunks;

/// Streaming builder (see the module docs).
pub struct Builder {
    opts: BuildOptions,
    keys: Vec<u64>,
    scratch: Vec<u64>,
    cap: usize,
    runs: Vec<PathBuf>,
    spill_dir: Option<tempfile::TempDir>,
    /// Held while the spill dir exists: a later build removes only unlocked leftovers.
    spill_lock: Option<File>,
    documents: u64,
    docs_unspilled: u64,
    pool: Arc<ThreadPool>,
    started: Instant,
    count_s: f64,
    sort_s: f64,
}

/// Fill `out` with the keys of positions `from..from+out.len()` of `doc`.
#[inline]
fn fill_keys(doc: &[u32], from: usize, out: &mut [u64]) {
    let n = doc.len();
    for (j, o) in out.iter_mut().enumerate() {
        let i = from + j;
        let b = if i + 1 < n { doc[i + 1] as u64 } else { END };
        let c = if i + 2 < n { doc[i + 2] as u64 } else { END };
        *o = key(doc[i], b, c);
    }
}

impl Builder {
    pub fn new(opts: BuildOptions) -> Result<Self> {
        opts.check()?;
        // keys + an equal radix scratch buffer take 2 × 8 bytes per key: half the limit
        let cap = ((opts.memory_limit_bytes / 4) / 8).max(1 << 16) as usize;
        let pool = opts.pool()?;
        Ok(Builder {
            opts,
            keys: Vec::new(),
            scratch: Vec::new(),
            cap,
            runs: Vec::new(),
            spill_dir: None,
            spill_lock: None,
            documents: 0,
            docs_unspilled: 0,
            pool,
            started: Instant::now(),
            count_s: 0.0,
            sort_s: 0.0,
        })
    }

    pub fn options(&self) -> &BuildOptions {
        &self.opts
    }
    pub fn documents(&self) -> u64 {
        self.documents
    }

    fn check_doc(&self, doc: &[u32]) -> Result<()> {
        let v = self.opts.vocab_size;
        match doc.iter().find(|&&t| t >= v) {
            Some(&t) => Err(Error::TokenOutOfRange { token: t, vocab_size: v }),
            None => Ok(()),
        }
    }

    /// Count one document (the caller appends EOS if it wants one).
    pub fn add_document(&mut self, doc: &[u32]) -> Result<()> {
        self.add_documents(&[doc])
    }

    /// Count many documents in parallel on the pool. Validates all of them first: on an
    /// out-of-vocabulary id nothing of this batch is counted.
    pub fn add_documents(&mut self, docs: &[&[u32]]) -> Result<()> {
        let (t0, sort0) = (Instant::now(), self.sort_s);
        let r = self.add_documents_inner(docs);
        self.count_s += t0.elapsed().as_secs_f64() - (self.sort_s - sort0);
        r
    }

    fn add_documents_inner(&mut self, docs: &[&[u32]]) -> Result<()> {
        let pool = self.pool.clone();
        pool.install(|| docs.par_iter().try_for_each(|d| self.check_doc(d)))?;
        // Segments (doc, from, to) that fit the free buffer space; spill when full.
        let mut seg: Vec<(usize, usize, usize)> = Vec::new();
        let mut di = 0;
        let mut pos = 0;
        while di < docs.len() {
            let free = self.cap - self.keys.len();
            seg.clear();
            let mut take = 0;
            while di < docs.len() && take < free {
                let rest = docs[di].len() - pos;
                let t = rest.min(free - take);
                if t > 0 {
                    seg.push((di, pos, pos + t));
                }
                take += t;
                pos += t;
                if pos == docs[di].len() {
                    di += 1;
                    pos = 0;
                    self.documents += 1;
                    self.docs_unspilled += 1;
                }
            }
            let base = self.keys.len();
            if self.keys.capacity() < self.cap {
                // exactly the budget (untouched pages cost no memory); no doubling past it
                self.keys.reserve_exact(self.cap - self.keys.len());
            }
            self.keys.resize(base + take, 0);
            let mut slices: Vec<(&mut [u64], &[u32], usize)> = Vec::with_capacity(seg.len());
            let mut rest = &mut self.keys[base..];
            for &(d, f, t) in &seg {
                let (head, tail) = rest.split_at_mut(t - f);
                slices.push((head, docs[d], f));
                rest = tail;
            }
            if take >= 1 << 15 {
                pool.install(|| slices.into_par_iter().for_each(|(o, d, f)| fill_keys(d, f, o)));
            } else {
                slices.into_iter().for_each(|(o, d, f)| fill_keys(d, f, o));
            }
            if self.keys.len() >= self.cap {
                self.spill()?;
            }
        }
        Ok(())
    }

    /// Sort the buffer as per-thread chunks (radix); returns the chunk bounds.
    fn sort_keys(&mut self) -> Vec<usize> {
        let t = Instant::now();
        let (keys, scratch) = (&mut self.keys, &mut self.scratch);
        let threads = self.pool.current_num_threads();
        let b = self.pool.install(|| crate::radix::sort_chunks(keys, scratch, threads));
        // the scratch buffer is only needed while sorting
        *scratch = Vec::new();
        self.sort_s += t.elapsed().as_secs_f64();
        b
    }

    fn spill_dir(&mut self) -> Result<PathBuf> {
        if self.spill_dir.is_none() {
            let base = self.opts.temp_dir.clone().unwrap_or_else(std::env::temp_dir);
            stale::sweep(&base);
            let (d, lock) = stale::locked_tempdir(&base, RUNS_PREFIX)?;
            self.spill_dir = Some(d);
            self.spill_lock = Some(lock);
        }
        Ok(self.spill_dir.as_ref().map(|d| d.path().to_path_buf()).unwrap_or_default())
    }

    /// Sort the buffer and write it as a run file in the spill directory.
    fn spill(&mut self) -> Result<()> {
        if self.keys.is_empty() && self.docs_unspilled == 0 {
            return Ok(());
        }
        let dir = self.spill_dir()?;
        let path = dir.join(format!("run-{:05}.dartrun", self.runs.len()));
        let bounds = self.sort_keys();
        let t = Instant::now();
        write_run(&path, self.opts.vocab_size, self.docs_unspilled, MergeChunks::new(&self.keys, &bounds))?;
        self.sort_s += t.elapsed().as_secs_f64();
        self.keys.clear();
        self.docs_unspilled = 0;
        self.runs.push(path);
        Ok(())
    }

    /// Map side of a sharded build: spill what is buffered and move every run into `dir`.
    /// Returns the run paths (sorted, checksummed, self-describing); feed them to
    /// [`merge_runs`] later, possibly with the runs of other shards.
    pub fn write_runs(mut self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        self.spill()?;
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let mut out = Vec::new();
        for (i, r) in self.runs.iter().enumerate() {
            let dst = dir.join(format!("run-{}-{stamp:x}-{i:05}.dartrun", std::process::id()));
            let tmp = dst.with_extension("dartrun.tmp");
            if std::fs::rename(r, &tmp).is_err() {
                std::fs::copy(r, &tmp).map_err(|e| Error::io(&tmp, e))?;
            }
            std::fs::rename(&tmp, &dst).map_err(|e| Error::io(&dst, e))?;
            out.push(dst);
        }
        Ok(out)
    }

    /// Reduce: write the index to `output` (temp file + rename) with `metadata_json`.
    pub fn finish(mut self, output: &Path, metadata_json: &str) -> Result<BuildSummary> {
        check_output(output, &[])?;
        if self.runs.is_empty() {
            // Everything fit in memory: sort once and stream the buffer straight to the writer.
            let bounds = self.sort_keys();
            let tw = Instant::now();
            let mut w = IndexWriter::new(&self.opts, output)?;
            for (k, c) in MergeChunks::new(&self.keys, &bounds) {
                w.push(k, c)?;
            }
            self.keys = Vec::new();
            let mut s = w.finish(output, metadata_json, self.documents)?;
            s.write_seconds = tw.elapsed().as_secs_f64();
            s.seconds = self.started.elapsed().as_secs_f64();
            s.count_seconds = self.count_s;
            s.sort_seconds = self.sort_s;
            return Ok(s);
        }
        self.spill()?;
        let mut s = merge_runs(&self.runs, output, &self.opts, metadata_json)?;
        s.seconds = self.started.elapsed().as_secs_f64();
        s.count_seconds = self.count_s;
        s.sort_seconds = self.sort_s;
        Ok(s)
    }
}
