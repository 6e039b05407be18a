//! The builder: token-id documents → index file, in bounded memory.
//!
//! Map: every token position i of a document emits one 63-bit key
//! `(d[i], d[i+1] or END, d[i+2] or END)` (21 bits each, END = 2^21 − 1) into a buffer of
//! `memory_limit / 16` keys. A full buffer is sorted on the owned pool and spilled as a run
//! file of (key, count) pairs (sorted, aggregated, CRC-checked, self-describing). These padded
//! trigram keys carry every figure of the index: count(a) = Σ (a,*,*); total(a) = count(a)
//! minus the document-final (a,END,END); count(a,b) = Σ (a,b,*); total(a,b) = count(a,b)
//! minus (a,b,END); trigram counts = (a,b,c≠END). No n-gram crosses a document boundary.
//!
//! Reduce: a k-way merge of the runs (or the in-memory buffer when nothing was spilled)
//! streams sorted (key, count) pairs into [`IndexWriter`], which writes each section to its
//! own temporary file and finally assembles header + table + sections into a temporary file
//! next to the output and renames it over the output (a crash never leaves a partial index).
//!
//! Memory: the key buffer and its radix scratch (memory_limit / 4 each), read buffers of the
//! merge (memory_limit / 4 shared by all runs, at least 64 KiB each), vocabulary-sized arrays
//! (~60 bytes per vocabulary entry), and the children of one context (with a per-context
//! cap: of one first token, 16 bytes per trigram child).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use rayon::ThreadPool;

use crate::error::{Error, Result};
use crate::radix::MergeChunks;
use crate::format::{self, Header, Sec, Section, BLOCK, HEADER_LEN, MAX_TOKEN_BITS, SECTIONS, SECTION_ENTRY_LEN, TOPK_K};

const F: u32 = MAX_TOKEN_BITS;
const END: u64 = (1 << F) - 1;
const FMASK: u64 = (1 << F) - 1;
const RUN_MAGIC: [u8; 8] = *b"DARTRUN1";
const RUN_HEADER: usize = 64;
const RUN_VERSION: u32 = 1;

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
    fn check(&self) -> Result<u32> {
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

    fn pool(&self) -> Result<Arc<ThreadPool>> {
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

#[inline]
fn key(a: u32, b: u64, c: u64) -> u64 {
    ((a as u64) << (2 * F)) | (b << F) | c
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
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
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

pub(crate) fn write_run(path: &Path, vocab: u32, documents: u64, pairs: impl Iterator<Item = (u64, u64)>) -> Result<()> {
    let io = |e| Error::io(path, e);
    let tmp = path.with_extension("partial");
    let f = File::create(&tmp).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, f);
    w.write_all(&[0u8; RUN_HEADER]).map_err(io)?;
    let mut crc = crc32fast::Hasher::new();
    let mut n = 0u64;
    let mut tokens = 0u64;
    let mut buf = [0u8; 16];
    for (k, c) in pairs {
        buf[..8].copy_from_slice(&k.to_le_bytes());
        buf[8..].copy_from_slice(&c.to_le_bytes());
        crc.update(&buf);
        w.write_all(&buf).map_err(io)?;
        n += 1;
        tokens += c;
    }
    let crc = crc.finalize();
    w.write_all(&crc.to_le_bytes()).map_err(io)?;
    let mut f = w.into_inner().map_err(|e| Error::io(path, e.into_error()))?;
    let mut h = [0u8; RUN_HEADER];
    h[..8].copy_from_slice(&RUN_MAGIC);
    format::put32(&mut h, 8, RUN_VERSION);
    format::put32(&mut h, 12, F);
    format::put32(&mut h, 16, vocab);
    format::put64(&mut h, 24, n);
    format::put64(&mut h, 32, documents);
    format::put64(&mut h, 40, tokens);
    let hc = crc32fast::hash(&h[..60]);
    format::put32(&mut h, 60, hc);
    f.seek(SeekFrom::Start(0)).map_err(io)?;
    f.write_all(&h).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

/// A streaming reader of one run file.
struct RunReader {
    path: PathBuf,
    r: BufReader<File>,
    left: u64,
    crc: crc32fast::Hasher,
    vocab: u32,
    documents: u64,
    tokens: u64,
    /// Opened by `open_range`: the whole-file checksum is not checked at the end.
    ranged: bool,
}

impl RunReader {
    /// A merge takes runs of one vocabulary only.
    fn check_vocab(&self, path: &Path, vocab_size: u32) -> Result<()> {
        if self.vocab != vocab_size {
            return Err(Error::Run {
                path: path.to_path_buf(),
                reason: format!("built for vocab_size {}, this merge uses {}", self.vocab, vocab_size),
            });
        }
        Ok(())
    }
    fn open(path: &Path, buf: usize) -> Result<Self> {
        let bad = |reason: String| Error::Run { path: path.to_path_buf(), reason };
        let f = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut r = BufReader::with_capacity(buf, f);
        let mut h = [0u8; RUN_HEADER];
        r.read_exact(&mut h).map_err(|_| bad("truncated header".into()))?;
        if h[..8] != RUN_MAGIC {
            return Err(bad("not a dart-ngram run file (wrong magic)".into()));
        }
        if format::get32(&h, 60) != Some(crc32fast::hash(&h[..60])) {
            return Err(bad("header checksum mismatch".into()));
        }
        let g32 = |o| format::get32(&h, o).unwrap_or(0);
        let g64 = |o| format::get64(&h, o).unwrap_or(0);
        if g32(8) != RUN_VERSION || g32(12) != F {
            return Err(bad(format!("run version {} / key width {}, this build reads {RUN_VERSION} / {F}", g32(8), g32(12))));
        }
        let n = g64(24);
        if n.checked_mul(16).and_then(|b| b.checked_add(RUN_HEADER as u64 + 4)) != Some(len) {
            return Err(bad(format!("truncated: {len} bytes for {n} entries")));
        }
        Ok(RunReader {
            path: path.to_path_buf(),
            r,
            left: n,
            crc: crc32fast::Hasher::new(),
            vocab: g32(16),
            documents: g64(32),
            tokens: g64(40),
            ranged: false,
        })
    }

    fn next(&mut self) -> Result<Option<(u64, u64)>> {
        let bad = |p: &Path, reason: &str| Error::Run { path: p.to_path_buf(), reason: reason.into() };
        if self.left == 0 && self.ranged {
            return Ok(None);
        }
        if self.left == 0 {
            let mut t = [0u8; 4];
            self.r.read_exact(&mut t).map_err(|_| bad(&self.path, "truncated checksum"))?;
            if u32::from_le_bytes(t) != self.crc.clone().finalize() {
                return Err(bad(&self.path, "checksum mismatch: the run file is corrupt"));
            }
            return Ok(None);
        }
        let mut b = [0u8; 16];
        self.r.read_exact(&mut b).map_err(|_| bad(&self.path, "truncated"))?;
        self.crc.update(&b);
        self.left -= 1;
        let k = u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]));
        let c = u64::from_le_bytes(b[8..].try_into().unwrap_or([0; 8]));
        Ok(Some((k, c)))
    }
}

impl RunReader {
    /// The entries with `lo <= key < hi` only: binary searches over the fixed-size entries
    /// find the range, the reader seeks to it and stops at its end. The run's checksum
    /// covers the whole file, so a ranged read cannot check it; the header is checked, and
    /// the merged output carries its own checksum.
    fn open_range(path: &Path, buf: usize, lo: u64, hi: u64) -> Result<Self> {
        let mut r = RunReader::open(path, buf)?;
        let n = r.left;
        let f = r.r.get_mut();
        let key_at = |f: &mut File, i: u64| -> Result<u64> {
            let mut b = [0u8; 8];
            f.seek(SeekFrom::Start(RUN_HEADER as u64 + 16 * i)).map_err(|e| Error::io(path, e))?;
            f.read_exact(&mut b).map_err(|e| Error::io(path, e))?;
            Ok(u64::from_le_bytes(b))
        };
        let lower_bound = |f: &mut File, x: u64| -> Result<u64> {
            let (mut a, mut b) = (0u64, n);
            while a < b {
                let m = a + (b - a) / 2;
                if key_at(f, m)? < x {
                    a = m + 1;
                } else {
                    b = m;
                }
            }
            Ok(a)
        };
        let first = lower_bound(f, lo)?;
        let end = if hi == u64::MAX { n } else { lower_bound(f, hi)?.max(first) };
        r.r.seek(SeekFrom::Start(RUN_HEADER as u64 + 16 * first)).map_err(|e| Error::io(path, e))?;
        r.left = end - first;
        r.ranged = true;
        Ok(r)
    }
}

/// One partition of a partitioned reduce: the k-way merge of the entries with
/// `lo <= key < hi` of every run into one sorted run at `output` (keys are
/// `a << 42 | b << 21 | c`, so a range of first tokens `a0..a1` is `a0 << 42 .. a1 << 42`;
/// `hi = u64::MAX`: to the end). The partitions of disjoint ranges that cover the key space
/// are merged by [`merge_runs`] into the same index, byte for byte, as the runs themselves:
/// the writer sees the same sorted, aggregated stream. The partition with `lo == 0` carries
/// the documents of all runs (the others 0), so the final merge counts them once.
/// Memory: read buffers share a quarter of `options.memory_limit_bytes`, as in `merge_runs`.
pub fn merge_run_range(runs: &[PathBuf], output: &Path, options: &BuildOptions, lo: u64, hi: u64) -> Result<BuildSummary> {
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
            let Some(&Reverse((k, i, c))) = heap.peek() else { return cur };
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
    Ok(BuildSummary { output: output.to_path_buf(), documents, tokens, bytes, runs: runs.len(), seconds,
                      write_seconds: seconds, ..BuildSummary::default() })
}

/// Reduce side of a sharded build: k-way merge of run files (from one or many builders with
/// the same vocabulary) into the index at `output`.
pub fn merge_runs(runs: &[PathBuf], output: &Path, options: &BuildOptions, metadata_json: &str) -> Result<BuildSummary> {
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

/// One section being written to its own temporary file. Writes are gathered in a 64 KiB
/// buffer and checksummed per buffer: per-word `write_all` + CRC cost ~30 % of a build.
struct SecFile {
    f: File,
    buf: Vec<u8>,
    len: u64,
    crc: crc32fast::Hasher,
}

impl SecFile {
    fn new(f: File) -> Self {
        SecFile { f, buf: Vec::with_capacity(1 << 16), len: 0, crc: crc32fast::Hasher::new() }
    }
    #[inline]
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.buf.extend_from_slice(b);
        self.len += b.len() as u64;
        if self.buf.len() >= 1 << 16 {
            self.flush()?;
        }
        Ok(())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.crc.update(&self.buf);
        self.f.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
    #[inline]
    fn u32(&mut self, v: u32) -> std::io::Result<()> {
        self.put(&v.to_le_bytes())
    }
    #[inline]
    fn u64(&mut self, v: u64) -> std::io::Result<()> {
        self.put(&v.to_le_bytes())
    }
    fn finish(mut self) -> std::io::Result<(File, u64, u32)> {
        self.flush()?;
        Ok((self.f, self.len, self.crc.finalize()))
    }
}

/// Children of the current (a, b) while it streams in.
#[derive(Default)]
struct BigramAcc {
    b: u64,
    count: u64,
    total: u64,
    kids: Vec<(u32, u64)>,
}

/// A bigram kept for emission (staged when a per-context cap needs the whole first-token group).
struct Staged {
    b: u32,
    count: u64,
    total: u64,
    from: usize,
    to: usize,
}

/// Consumes sorted (key, count) pairs and writes the sections.
struct IndexWriter {
    dir: tempfile::TempDir,
    /// Held while `dir` exists (see [`stale`]).
    _dir_lock: File,
    token_bits: u32,
    cb: u32,
    esc_code: u32,
    vocab: u32,
    min_count: u64,
    cap: Option<usize>,
    tokens: u64,
    uni_count: Vec<u64>,
    uni_total: Vec<u64>,
    l2_start: Vec<u64>,
    large1: Vec<u32>,
    files: Vec<Option<SecFile>>, // indexed by Sec as usize - 1
    n_bigram: u64,
    n_trigram: u64,
    n_esc2: u64,
    n_esc3: u64,
    n_ends: u64,
    n_large1: u64,
    n_large2: u64,
    // current level-3 block
    blk_base: u64,
    blk_large: u64,
    blk_large_rank: u64,
    blk_ends: u64,
    blk_ends_rank: u64,
    blk_deltas: Vec<u32>,
    n_wide: u64,
    n_topk_esc: u64,
    // stream state
    cur_a: Option<u32>,
    next_a: u32,
    acc: Option<BigramAcc>,
    staged: Vec<Staged>,
    staged_kids: Vec<(u32, u64)>,
    a_children: Vec<(u32, u64)>,
    last_key: Option<u64>,
    order_scratch: Vec<(u64, u32, u32)>,
}

/// The sections after META, UNI and UNI_ORDER, which are streamed to spill files while merging.
const STREAMED: &[Sec] = SECTIONS.split_at(3).1;

impl IndexWriter {
    fn new(opts: &BuildOptions, output: &Path) -> Result<Self> {
        let token_bits = opts.check()?;
        let parent = parent_dir(output);
        let base = opts.temp_dir.clone().unwrap_or_else(|| parent.clone());
        stale::sweep(&parent);
        if base != parent {
            stale::sweep(&base);
        }
        let (dir, dir_lock) = stale::locked_tempdir(&base, SECTIONS_PREFIX)?;
        let mut files: Vec<Option<SecFile>> = (0..SECTIONS.len()).map(|_| None).collect();
        for &s in STREAMED {
            let p = dir.path().join(s.name());
            let f = File::options().read(true).write(true).create_new(true).open(&p).map_err(|e| Error::io(&p, e))?;
            files[s as usize - 1] = Some(SecFile::new(f));
        }
        let v = opts.vocab_size as usize;
        let cb = 32 - token_bits;
        Ok(IndexWriter {
            dir,
            _dir_lock: dir_lock,
            token_bits,
            cb,
            esc_code: (1u32 << cb) - 1,
            vocab: opts.vocab_size,
            min_count: opts.min_count,
            cap: opts.max_children_per_context.map(|c| c as usize),
            tokens: 0,
            uni_count: vec![0; v],
            uni_total: vec![0; v],
            l2_start: vec![0; v + 1],
            large1: vec![u32::MAX; v],
            files,
            n_bigram: 0,
            n_trigram: 0,
            n_esc2: 0,
            n_esc3: 0,
            n_ends: 0,
            n_large1: 0,
            n_large2: 0,
            blk_base: 0,
            blk_large: 0,
            blk_large_rank: 0,
            blk_ends: 0,
            blk_ends_rank: 0,
            blk_deltas: Vec::with_capacity(BLOCK),
            n_wide: 0,
            n_topk_esc: 0,
            cur_a: None,
            next_a: 0,
            acc: None,
            staged: Vec::new(),
            staged_kids: Vec::new(),
            a_children: Vec::new(),
            last_key: None,
            order_scratch: Vec::new(),
        })
    }

    #[inline]
    fn f(&mut self, s: Sec) -> &mut SecFile {
        self.files[s as usize - 1].as_mut().expect("streamed section")
    }

    fn ioerr(&self, s: Sec, e: std::io::Error) -> Error {
        Error::io(self.dir.path().join(s.name()), e)
    }

    /// One aggregated (key, count) pair, keys strictly increasing.
    fn push(&mut self, key: u64, count: u64) -> Result<()> {
        if self.last_key.is_some_and(|k| k >= key) {
            return Err(Error::format("builder input is not sorted (internal error)"));
        }
        self.last_key = Some(key);
        let a = (key >> (2 * F)) as u32;
        let b = (key >> F) & FMASK;
        let c = key & FMASK;
        if a >= self.vocab || (b != END && b >= self.vocab as u64) || (c != END && c >= self.vocab as u64) || (b == END && c != END) {
            return Err(Error::format(format!("run key {key:#x} is out of range for vocab_size {}", self.vocab)));
        }
        if self.cur_a != Some(a) {
            self.end_a()?;
            self.begin_a(a);
        }
        self.tokens += count;
        self.uni_count[a as usize] += count;
        if b == END {
            return Ok(()); // document-final token: counted in count(a), not in total(a)
        }
        self.uni_total[a as usize] += count;
        if self.acc.as_ref().is_some_and(|x| x.b != b) {
            self.end_b()?;
        }
        let acc = self.acc.get_or_insert_with(|| BigramAcc { b, ..Default::default() });
        acc.count += count;
        if c != END {
            acc.total += count;
            if count >= self.min_count {
                acc.kids.push((c as u32, count));
            }
        }
        Ok(())
    }

    fn begin_a(&mut self, a: u32) {
        for x in self.next_a..=a {
            self.l2_start[x as usize] = self.n_bigram;
        }
        self.next_a = a + 1;
        self.cur_a = Some(a);
        self.a_children.clear();
        self.staged.clear();
        self.staged_kids.clear();
    }

    /// Close the current (a, b): prune, cap, emit or stage.
    fn end_b(&mut self) -> Result<()> {
        let Some(mut acc) = self.acc.take() else { return Ok(()) };
        if acc.count < self.min_count {
            return Ok(());
        }
        if let Some(cap) = self.cap {
            cap_children(&mut acc.kids, cap);
            let from = self.staged_kids.len();
            self.staged_kids.extend_from_slice(&acc.kids);
            self.staged.push(Staged { b: acc.b as u32, count: acc.count, total: acc.total, from, to: self.staged_kids.len() });
        } else {
            let kids = std::mem::take(&mut acc.kids);
            self.emit_bigram(acc.b as u32, acc.count, acc.total, &kids)?;
            let mut kids = kids;
            kids.clear();
            acc.kids = kids; // keep the allocation
        }
        // reuse the kids buffer
        self.acc = None;
        Ok(())
    }

    /// Close the current first token `a`: apply the cap to its bigrams, write its top-k.
    fn end_a(&mut self) -> Result<()> {
        self.end_b()?;
        let Some(a) = self.cur_a else { return Ok(()) };
        if let Some(cap) = self.cap {
            let mut staged = std::mem::take(&mut self.staged);
            if staged.len() > cap {
                staged.sort_unstable_by(|x, y| y.count.cmp(&x.count).then(x.b.cmp(&y.b)));
                staged.truncate(cap);
                staged.sort_unstable_by_key(|s| s.b);
            }
            let kids = std::mem::take(&mut self.staged_kids);
            for s in &staged {
                self.emit_bigram(s.b, s.count, s.total, &kids[s.from..s.to])?;
            }
            self.staged_kids = kids;
            self.staged = staged;
        }
        let n = self.a_children.len();
        if n > TOPK_K {
            self.large1[a as usize] = self.n_large1 as u32;
            self.n_large1 += 1;
            let kids = std::mem::take(&mut self.a_children);
            self.write_topk_row(Sec::TopK1, &kids)?;
            self.a_children = kids;
        }
        self.cur_a = None;
        Ok(())
    }

    /// One top-K row: escape base, then the K best children as node words (FORMAT.md).
    fn write_topk_row(&mut self, sec: Sec, kids: &[(u32, u64)]) -> Result<()> {
        let top = top_positions(kids, &mut self.order_scratch);
        let base = self.n_topk_esc;
        let mut row = [0u8; format::TOPK_ROW];
        format::put64(&mut row, 0, base);
        for (i, p) in top.iter().enumerate() {
            let (t, c) = kids[*p as usize];
            let (code, esc) = self.code(c);
            format::put32(&mut row, 8 + 4 * i, (t << self.cb) | code);
            if esc {
                self.f(Sec::TopKEsc).u64(c).map_err(|e| Error::io(PathBuf::from("TOPK_ESC"), e))?;
                self.n_topk_esc += 1;
            }
        }
        self.f(sec).put(&row).map_err(|e| Error::io(PathBuf::from(sec.name()), e))
    }

    fn code(&self, count: u64) -> (u32, bool) {
        if count >= self.esc_code as u64 {
            (self.esc_code, true)
        } else {
            (count as u32, false)
        }
    }

    fn emit_bigram(&mut self, b: u32, count: u64, total: u64, kids: &[(u32, u64)]) -> Result<()> {
        let j = self.n_bigram;
        if j % BLOCK as u64 == 0 {
            if j > 0 {
                self.flush_block()?;
            }
            self.blk_base = self.n_trigram;
            self.blk_large = 0;
            self.blk_ends = 0;
            self.blk_large_rank = self.n_large2;
            self.blk_ends_rank = self.n_ends;
            let r = self.n_esc2;
            self.f(Sec::L2EscRank).u64(r).map_err(|e| self.ioerr(Sec::L2EscRank, e))?;
        }
        let bit = 1u64 << (j % BLOCK as u64);
        let (code, esc) = self.code(count);
        let word = (b << self.cb) | code;
        let delta = (self.n_trigram - self.blk_base) as u32;
        let io = |s: Sec| move |e| Error::io(PathBuf::from(s.name()), e);
        self.f(Sec::L2Nodes).u32(word).map_err(io(Sec::L2Nodes))?;
        if esc {
            self.f(Sec::L2Esc).u64(count).map_err(io(Sec::L2Esc))?;
            self.n_esc2 += 1;
        }
        self.blk_deltas.push(delta);
        let ends = count - total;
        if ends > 0 {
            self.blk_ends |= bit;
            self.f(Sec::Ends).u64(ends).map_err(io(Sec::Ends))?;
            self.n_ends += 1;
        }
        for &(c, cnt) in kids {
            if self.n_trigram % BLOCK as u64 == 0 {
                let r = self.n_esc3;
                self.f(Sec::L3EscRank).u64(r).map_err(io(Sec::L3EscRank))?;
            }
            let (code, esc) = self.code(cnt);
            let word = (c << self.cb) | code;
            self.f(Sec::L3Nodes).u32(word).map_err(io(Sec::L3Nodes))?;
            if esc {
                self.f(Sec::L3Esc).u64(cnt).map_err(io(Sec::L3Esc))?;
                self.n_esc3 += 1;
            }
            self.n_trigram += 1;
        }
        if kids.len() > TOPK_K {
            self.blk_large |= bit;
            self.n_large2 += 1;
            self.write_topk_row(Sec::TopK2, kids)?;
        }
        self.a_children.push((b, count));
        self.n_bigram += 1;
        Ok(())
    }

    /// UNI section: one 32-byte record per token plus the sentinel (FORMAT.md).
    fn uni_records(&self) -> Vec<u8> {
        let v = self.vocab as usize;
        let mut out = vec![0u8; (v + 1) * format::UNI_LEN];
        for a in 0..=v {
            let r = &mut out[a * format::UNI_LEN..(a + 1) * format::UNI_LEN];
            format::put64(r, 0, self.l2_start[a]);
            if a < v {
                format::put64(r, 8, self.uni_count[a]);
                format::put64(r, 16, self.uni_total[a]);
                format::put32(r, 24, (self.l2_start[a + 1] - self.l2_start[a]) as u32);
                format::put32(r, 28, self.large1[a]);
            } else {
                format::put32(r, 28, u32::MAX);
            }
        }
        out
    }

    fn flush_block(&mut self) -> Result<()> {
        // u16 deltas when the block's trigram span allows (nearly always), else a u32 row
        let io = |e| Error::io(PathBuf::from("L3_DELTA"), e);
        let deltas = std::mem::take(&mut self.blk_deltas);
        let wide = if deltas.last().is_some_and(|&d| d > u16::MAX as u32) {
            let w = self.n_wide;
            let mut row = [0u8; 4 * BLOCK];
            for (i, d) in deltas.iter().enumerate() {
                format::put32(&mut row, 4 * i, *d);
                self.f(Sec::L3Delta).put(&[0, 0]).map_err(io)?;
            }
            self.f(Sec::L3Wide).put(&row).map_err(io)?;
            self.n_wide += 1;
            w
        } else {
            for d in &deltas {
                self.f(Sec::L3Delta).put(&(*d as u16).to_le_bytes()).map_err(io)?;
            }
            u64::MAX
        };
        self.blk_deltas = deltas;
        self.blk_deltas.clear();
        let mut rec = [0u8; format::BLOCK3_LEN];
        format::put64(&mut rec, 0, self.blk_base);
        format::put64(&mut rec, 8, self.blk_large);
        format::put64(&mut rec, 16, self.blk_large_rank);
        format::put64(&mut rec, 24, self.blk_ends);
        format::put64(&mut rec, 32, self.blk_ends_rank);
        format::put64(&mut rec, 40, wide);
        self.f(Sec::L3Blocks).put(&rec).map_err(|e| Error::io(PathBuf::from("L3_BLOCKS"), e))
    }

    fn finish(mut self, output: &Path, metadata_json: &str, documents: u64) -> Result<BuildSummary> {
        self.end_a()?;
        let v = self.vocab as usize;
        for x in self.next_a as usize..=v {
            self.l2_start[x] = self.n_bigram;
        }
        let ioe = |e| Error::io(PathBuf::from("section"), e);
        if self.n_bigram > 0 {
            self.flush_block()?;
        }
        // sentinels
        self.blk_base = self.n_trigram;
        self.blk_large = 0;
        self.blk_ends = 0;
        self.blk_large_rank = self.n_large2;
        self.blk_ends_rank = self.n_ends;
        self.flush_block()?;
        let (e2, e3) = (self.n_esc2, self.n_esc3);
        self.f(Sec::L2EscRank).u64(e2).map_err(ioe)?;
        self.f(Sec::L3EscRank).u64(e3).map_err(ioe)?;

        // in-memory sections
        let mut order: Vec<u32> = (0..self.vocab).filter(|&t| self.uni_count[t as usize] > 0).collect();
        order.sort_unstable_by(|&x, &y| self.uni_count[y as usize].cmp(&self.uni_count[x as usize]).then(x.cmp(&y)));
        let meta = if metadata_json.is_empty() { "{}" } else { metadata_json };
        let mem: Vec<(Sec, Vec<u8>)> = vec![
            (Sec::Meta, meta.as_bytes().to_vec()),
            (Sec::Uni, self.uni_records()),
            (Sec::UniOrder, order.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ];
        let header = Header {
            token_bits: self.token_bits,
            vocab_size: self.vocab,
            documents,
            tokens: self.tokens,
            n_unigram: order.len() as u64,
            n_bigram: self.n_bigram,
            n_trigram: self.n_trigram,
            n_esc2: self.n_esc2,
            n_esc3: self.n_esc3,
            n_ends: self.n_ends,
            n_large1: self.n_large1,
            n_large2: self.n_large2,
            file_len: 0,
            table_crc: 0,
            n_wide: self.n_wide,
            n_topk_esc: self.n_topk_esc,
        };
        // lay out
        let mut secs = vec![Section::default(); SECTIONS.len()];
        let mut off = (HEADER_LEN + SECTIONS.len() * SECTION_ENTRY_LEN) as u64;
        let mut files: Vec<Option<File>> = (0..SECTIONS.len()).map(|_| None).collect();
        for (i, s) in SECTIONS.iter().enumerate() {
            off = off.next_multiple_of(s.align());
            let (len, crc) = if let Some((_, b)) = mem.iter().find(|(m, _)| m == s) {
                (b.len() as u64, crc32fast::hash(b))
            } else {
                let sf = self.files[i].take().expect("streamed section");
                let (f, len, crc) = sf.finish().map_err(|e| Error::io(self.dir.path(), e))?;
                files[i] = Some(f);
                (len, crc)
            };
            secs[i] = Section { offset: off, len, crc };
            off += len;
        }
        let mut header = header;
        header.file_len = off;
        let table = format::encode_table(&secs);
        header.table_crc = crc32fast::hash(&table);
        for (i, s) in SECTIONS.iter().enumerate() {
            if header.expected_len(*s, secs[0].len) != Some(secs[i].len) {
                return Err(Error::format(format!("internal: section {} has an unexpected length", s.name())));
            }
        }
        // write temp file next to the output, then rename
        let parent = parent_dir(output);
        let mut tmp = tempfile::Builder::new()
            .prefix(PARTIAL_PREFIX)
            .suffix(".partial")
            .tempfile_in(&parent)
            .map_err(|e| Error::io(&parent, e))?;
        // Locked until this process exits or the file is renamed into place: a later build
        // removes a `.partial` only when its lock is free (a killed build's).
        stale::try_lock(tmp.as_file());
        {
            // Header, table and the small in-memory sections are written directly; the
            // streamed sections are copied file-to-file (copy_file_range on Linux: no
            // round trip through user space).
            let io = |e| Error::io(output, e);
            let w = tmp.as_file_mut();
            w.write_all(&header.encode()).map_err(io)?;
            w.write_all(&table).map_err(io)?;
            let mut pos = (HEADER_LEN + table.len()) as u64;
            for (i, s) in SECTIONS.iter().enumerate() {
                let pad = secs[i].offset - pos;
                w.write_all(&vec![0u8; pad as usize]).map_err(io)?;
                if let Some((_, b)) = mem.iter().find(|(m, _)| m == s) {
                    w.write_all(b).map_err(io)?;
                } else if let Some(f) = files[i].as_mut() {
                    f.seek(SeekFrom::Start(0)).map_err(io)?;
                    let n = std::io::copy(&mut std::io::Read::by_ref(f).take(secs[i].len), w).map_err(io)?;
                    if n != secs[i].len {
                        return Err(Error::format(format!("internal: section {} short by {} bytes", s.name(), secs[i].len - n)));
                    }
                }
                pos = secs[i].offset + secs[i].len;
            }
            w.flush().map_err(io)?;
        }
        tmp.as_file().sync_all().map_err(|e| Error::io(output, e))?;
        tmp.persist(output).map_err(|e| Error::io(output, e.error))?;
        Ok(BuildSummary {
            output: output.to_path_buf(),
            documents,
            tokens: header.tokens,
            unigram_nodes: header.n_unigram,
            bigram_nodes: header.n_bigram,
            trigram_nodes: header.n_trigram,
            bytes: header.file_len,
            ..Default::default()
        })
    }
}

const SECTIONS_PREFIX: &str = ".dart-ngram-sections-";
const RUNS_PREFIX: &str = "dart-ngram-runs-";
const PARTIAL_PREFIX: &str = ".dart-ngram-";

/// Fail before any work when the index cannot be written at `output`: a directory, a
/// missing parent directory, or one of the runs being merged (writing over an input).
fn check_output(output: &Path, inputs: &[PathBuf]) -> Result<()> {
    if output.is_dir() {
        return Err(Error::InvalidOption(format!(
            "output {} is a directory; give a file path such as {}",
            output.display(),
            output.join("corpus.idx").display()
        )));
    }
    let parent = parent_dir(output);
    if !parent.is_dir() {
        return Err(Error::InvalidOption(format!(
            "cannot write {}: directory {} does not exist; create it first",
            output.display(),
            parent.display()
        )));
    }
    if let Ok(out) = std::fs::metadata(output) {
        use std::os::unix::fs::MetadataExt;
        for p in inputs {
            if let Ok(m) = std::fs::metadata(p) {
                if m.dev() == out.dev() && m.ino() == out.ino() {
                    return Err(Error::InvalidOption(format!(
                        "output {} is one of the inputs ({}); write the index to another path",
                        output.display(),
                        p.display()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Temporary files of builds: each is created locked (flock) and a later build removes the
/// ones whose lock is free, i.e. whose process died (kill -9, a crash) before cleaning up.
/// Only names this builder makes are touched, in the directories it writes to.
mod stale {
    use super::*;
    use std::os::unix::io::AsRawFd;

    const LOCK: &str = ".lock";

    /// `flock(LOCK_EX | LOCK_NB)`: true when this process now holds the lock.
    pub(super) fn try_lock(f: &File) -> bool {
        // SAFETY: flock only reads the descriptor, which `f` keeps open for the call.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    }

    /// A fresh temp dir `base/<prefix>XXXX` holding a locked `.lock`. The lock file is made
    /// under another name, locked, then renamed to `.lock`, so a `.lock` is never seen
    /// unlocked while its builder lives.
    pub(super) fn locked_tempdir(base: &Path, prefix: &str) -> Result<(tempfile::TempDir, File)> {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(base).map_err(|e| Error::io(base, e))?;
        let tmp = dir.path().join(".lock.new");
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        try_lock(&f);
        std::fs::rename(&tmp, dir.path().join(LOCK)).map_err(|e| Error::io(&tmp, e))?;
        Ok((dir, f))
    }

    /// Remove the stale temporary files of builds in `dir` (errors are ignored: cleaning
    /// up is best effort and must never fail a build).
    pub(super) fn sweep(dir: &Path) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            if meta.is_dir() && (name.starts_with(SECTIONS_PREFIX) || name.starts_with(RUNS_PREFIX)) {
                // A dir without `.lock` is still being set up by a live builder (a
                // microsecond window), unless it is old.
                let lock = path.join(LOCK);
                let stale = match File::open(&lock) {
                    Ok(f) => try_lock(&f),
                    Err(_) => older_than(&meta, 600),
                };
                if stale {
                    let _ = std::fs::remove_dir_all(&path);
                }
            } else if meta.is_file() && name.starts_with(PARTIAL_PREFIX) && name.ends_with(".partial") {
                // Locked right after creation; the age check covers that window.
                if older_than(&meta, 2) && File::open(&path).is_ok_and(|f| try_lock(&f)) {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }

    fn older_than(meta: &std::fs::Metadata, secs: u64) -> bool {
        meta.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|d| d.as_secs() >= secs)
    }
}

fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Keep the `cap` highest-count children (ties: lower token), back in token order.
fn cap_children(kids: &mut Vec<(u32, u64)>, cap: usize) {
    if kids.len() <= cap {
        return;
    }
    kids.sort_unstable_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    kids.truncate(cap);
    kids.sort_unstable_by_key(|k| k.0);
}

/// Relative positions of the top-`TOPK_K` children (count desc, token asc) of a token-sorted list.
fn top_positions(kids: &[(u32, u64)], scratch: &mut Vec<(u64, u32, u32)>) -> Vec<u32> {
    scratch.clear();
    scratch.extend(kids.iter().enumerate().map(|(i, &(t, c))| (c, t, i as u32)));
    let by = |x: &(u64, u32, u32), y: &(u64, u32, u32)| y.0.cmp(&x.0).then(x.1.cmp(&y.1));
    if scratch.len() > TOPK_K {
        scratch.select_nth_unstable_by(TOPK_K - 1, by);
        scratch.truncate(TOPK_K);
    }
    scratch.sort_unstable_by(by);
    scratch.iter().map(|x| x.2).collect()
}
