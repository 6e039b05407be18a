//! A window as a delta index: the static index's own mapped format (`dart-ngram`), built from
//! the documents the window holds, so that `dart_ngram::merge_indexes` adds it to a base index
//! and other processes map it (the shared deltas of [`crate::Mixed`]).
use std::path::Path;

use dart_ngram::{BuildOptions, BuildSummary, Builder, Error, Index, Mmap, OpenOptions, Result, Verify};

use crate::Window;

/// A delta index mapped read-only.
pub type Delta = Index<Mmap>;

/// Write `w` as an index at `path` (a temporary file next to it, then a rename: a reader that
/// mapped the previous file keeps it). Its counts are the window's: every bigram and trigram
/// inside one document, the unigrams of the tokens held. Vocabularies above the index format's
/// 2,097,151 ids are refused.
pub fn write_delta(w: &Window, path: &Path, metadata_json: &str) -> Result<BuildSummary> {
    // The builder keeps its keys in memory below a quarter of the limit (8 bytes each), so a
    // window of n tokens never spills with 64 n bytes; at least the builder's minimum.
    let memory = (64 * w.len() as u64).max(16 << 20);
    let opts =
        BuildOptions { vocab_size: w.vocab_size(), memory_limit_bytes: memory, threads: Some(1), ..Default::default() };
    let mut b = Builder::new(opts)?;
    for doc in w.documents() {
        b.add_document(&doc)?;
    }
    b.finish(path, metadata_json)
}

/// Map the delta at `path` for reading beside a window over `vocab` ids: fully verified (a
/// truncated, corrupt or foreign file is an error, never a wrong count), of the same vocabulary.
pub fn open_delta(path: &Path, vocab: u32) -> Result<Delta> {
    let d = Index::open_with(path, OpenOptions { verify: Verify::Full, ..Default::default() })?;
    if d.vocab_size() != vocab {
        return Err(Error::Merge(format!(
            "delta {} has vocabulary size {}, this layer {}: it comes from another tokenizer",
            path.display(),
            d.vocab_size(),
            vocab
        )));
    }
    Ok(d)
}
