//! The reduce side over run files: k-way merges into a run (one key range) or an index.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::builder::files::check_output;
use crate::builder::options::{BuildOptions, BuildSummary};
use crate::builder::runs::{write_run, RunReader};
use crate::builder::writer::IndexWriter;
use crate::error::{Error, Result};

/// One partition of a partitioned reduce: the k-way merge of the entries with
/// `lo <= key < hi` of every run into one sorted run at `output` (keys are
/// `a << 42 | b << 21 | c`, so a range of first tokens `a0..a1` is `a0 << 42 .. a1 << 42`;
/// `hi = u64::MAX`: to the end). The partitions of disjoint ranges that cover the key space
/// are merged by [`merge_runs`] into the same index, byte for byte, as the runs themselves:
/// the writer sees the same sorted, aggregated stream. The partition with `lo == 0` carries
/// the documents of all runs (the others 0), so the final merge counts them once.
/// Memory: read buffers share a quarter of `options.memory_limit_bytes`, as in `merge_runs`.
pub fn merge_run_range(
    runs: &[PathBuf],
    output: &Path,
    options: &BuildOptions,
    lo: u64,
    hi: u64,
) -> Result<BuildSummary> {
    let started = Instant::now();
    options.check()?;
    if lo >= hi {
        return Err(Error::Run { path: output.to_path_buf(), reason: format!("empty key range {lo}..{hi}") });
    }
    if runs.iter().any(|r| r == output) {
        return Err(Error::Run { path: output.to_path_buf(), reason: "the output is one of the input runs".into() });
    }
    let buf = ((options.memory_limit_bytes / 4) / runs.len().max(1) as u64).clamp(64 << 10, 1 << 20) as usize;
    let mut readers = Vec::with_capacity(runs.len());
    let mut documents = 0u64;
    for p in runs {
        let r = RunReader::open_range(p, buf, lo, hi)?;
        r.check_vocab(p, options.vocab_size)?;
        documents += r.documents;
        readers.push(r);
    }
    let mut heap = BinaryHeap::with_capacity(readers.len());
    for (i, r) in readers.iter_mut().enumerate() {
        if let Some((k, c)) = r.next()? {
            heap.push(Reverse((k, i, c)));
        }
    }
    let mut err: Option<Error> = None;
    let mut prev_key_of: Vec<Option<u64>> = vec![None; readers.len()];
    let mut tokens = 0u64;
    let merged = std::iter::from_fn(|| {
        if err.is_some() {
            return None;
        }
        let mut cur: Option<(u64, u64)> = None;
        loop {
            let Some(&Reverse((k, i, c))) = heap.peek() else {
                return cur;
            };
            if let Some((ck, _)) = cur {
                if ck != k {
                    return cur;
                }
            }
            heap.pop();
            if prev_key_of[i].is_some_and(|p| p >= k) {
                err = Some(Error::Run { path: runs[i].clone(), reason: "keys are not sorted".into() });
                return None;
            }
            prev_key_of[i] = Some(k);
            cur = Some(match cur {
                Some((ck, cc)) => (ck, cc + c),
                None => (k, c),
            });
            match readers[i].next() {
                Ok(Some((k2, c2))) => heap.push(Reverse((k2, i, c2))),
                Ok(None) => {}
                Err(e) => {
                    err = Some(e);
                    return None;
                }
            }
        }
    })
    .inspect(|&(_, c)| tokens += c);
    let documents = if lo == 0 { documents } else { 0 };
    write_run(output, options.vocab_size, documents, merged)?;
    if let Some(e) = err {
        let _ = std::fs::remove_file(output);
        return Err(e);
    }
    let bytes = std::fs::metadata(output).map_err(|e| Error::io(output, e))?.len();
    let seconds = started.elapsed().as_secs_f64();
    Ok(BuildSummary {
        output: output.to_path_buf(),
        documents,
        tokens,
        bytes,
        runs: runs.len(),
        seconds,
        write_seconds: seconds,
        ..BuildSummary::default()
    })
}

/// Reduce side of a sharded build: k-way merge of run files (from one or many builders with
/// the same vocabulary) into the index at `output`.
pub fn merge_runs(
    runs: &[PathBuf],
    output: &Path,
    options: &BuildOptions,
    metadata_json: &str,
) -> Result<BuildSummary> {
    let started = Instant::now();
    options.check()?;
    check_output(output, runs)?;
    let mut readers = Vec::with_capacity(runs.len());
    let mut documents = 0u64;
    // Read buffers share a quarter of the memory limit (64 KiB .. 1 MiB each), so the merge
    // stays within the limit for any number of runs.
    let buf = ((options.memory_limit_bytes / 4) / runs.len().max(1) as u64).clamp(64 << 10, 1 << 20) as usize;
    for p in runs {
        let r = RunReader::open(p, buf)?;
        r.check_vocab(p, options.vocab_size)?;
        documents += r.documents;
        readers.push(r);
    }
    let expect_tokens: u64 = readers.iter().map(|r| r.tokens).sum();
    let mut heap = BinaryHeap::with_capacity(readers.len());
    for (i, r) in readers.iter_mut().enumerate() {
        if let Some((k, c)) = r.next()? {
            heap.push(Reverse((k, i, c)));
        }
    }
    let mut w = IndexWriter::new(options, output)?;
    let mut cur: Option<(u64, u64)> = None;
    let mut prev_key_of: Vec<Option<u64>> = vec![None; readers.len()];
    while let Some(Reverse((k, i, c))) = heap.pop() {
        if prev_key_of[i].is_some_and(|p| p >= k) {
            return Err(Error::Run { path: runs[i].clone(), reason: "keys are not sorted".into() });
        }
        prev_key_of[i] = Some(k);
        match &mut cur {
            Some((ck, cc)) if *ck == k => *cc += c,
            _ => {
                if let Some((ck, cc)) = cur.take() {
                    w.push(ck, cc)?;
                }
                cur = Some((k, c));
            }
        }
        if let Some((k2, c2)) = readers[i].next()? {
            heap.push(Reverse((k2, i, c2)));
        }
    }
    if let Some((ck, cc)) = cur {
        w.push(ck, cc)?;
    }
    if w.tokens != expect_tokens {
        return Err(Error::Run { path: runs[0].clone(), reason: "token totals disagree with the run headers".into() });
    }
    let mut s = w.finish(output, metadata_json, documents)?;
    s.runs = runs.len();
    s.seconds = started.elapsed().as_secs_f64();
    s.write_seconds = s.seconds;
    Ok(s)
}

/// Merge indexes into one at `output` (temporary file + rename; never over an input): its
/// counts are the sums of theirs, so it equals, byte for byte, the index built from all their
/// documents with the same options. Every input is fully verified first and must have
/// `options.vocab_size` and keep every n-gram (see [`crate::Keys`]); `options.min_count` and
/// `max_children_per_context` apply to the merged counts. Memory: the writer's, plus the keys
/// of one two-token context per input.
pub fn merge_indexes<D: AsRef<[u8]>>(
    inputs: &[&crate::Index<D>],
    output: &Path,
    options: &BuildOptions,
    metadata_json: &str,
) -> Result<BuildSummary> {
    let started = Instant::now();
    options.check()?;
    if inputs.is_empty() {
        return Err(Error::Merge("no input index".into()));
    }
    let paths: Vec<PathBuf> = inputs.iter().filter_map(|ix| ix.path().map(Path::to_path_buf)).collect();
    check_output(output, &paths)?;
    let name = |i: usize| inputs[i].path().map_or_else(|| format!("input {i}"), |p| p.display().to_string());
    for (i, ix) in inputs.iter().enumerate() {
        if ix.vocab_size() != options.vocab_size {
            return Err(Error::Merge(format!(
                "{} has vocabulary size {}, the merge {}: indexes of different tokenizers cannot be merged",
                name(i),
                ix.vocab_size(),
                options.vocab_size
            )));
        }
        ix.check(crate::Verify::Full)?;
    }
    let documents = inputs.iter().fold(0u64, |d, ix| d.saturating_add(ix.header().documents));
    let mut streams: Vec<_> = inputs.iter().map(|ix| ix.keys()).collect();
    let mut heap = BinaryHeap::with_capacity(streams.len());
    for (i, s) in streams.iter_mut().enumerate() {
        if let Some(x) = s.next() {
            let (k, c) = x?;
            heap.push(Reverse((k, i, c)));
        }
    }
    let mut w = IndexWriter::new(options, output)?;
    let mut cur: Option<(u64, u64)> = None;
    while let Some(Reverse((k, i, c))) = heap.pop() {
        match &mut cur {
            Some((ck, cc)) if *ck == k => *cc = cc.saturating_add(c),
            _ => {
                if let Some((ck, cc)) = cur.take() {
                    w.push(ck, cc)?;
                }
                cur = Some((k, c));
            }
        }
        if let Some(x) = streams[i].next() {
            let (k2, c2) = x?;
            heap.push(Reverse((k2, i, c2)));
        }
    }
    if let Some((ck, cc)) = cur {
        w.push(ck, cc)?;
    }
    let mut s = w.finish(output, metadata_json, documents)?;
    s.runs = inputs.len();
    s.seconds = started.elapsed().as_secs_f64();
    s.write_seconds = s.seconds;
    Ok(s)
}
