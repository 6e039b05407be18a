//! Conversion of the official DART `.trie` (a `TrieNgram(3)` written by `TrieNgram::save`) into
//! a dartcore index, streaming in bounded memory.
//!
//! The file: `order` u64, `node_count` u64, then per node `token` i32, `parent` u64, `freq` i32,
//! `n_children` u64 and `n_children` × (`token` i32, `child` u64), little-endian, packed.
//! Node 0 is the root; nodes are stored in creation order, so a parent precedes its children.
//! Depth-1 nodes count unigrams, depth-2 bigrams, depth-3 trigrams: plain n-gram counts of
//! documents, no n-gram crossing a document (each window of up to 3 tokens was inserted).
//!
//! The index builder counts padded trigram keys `(a, b|END, c|END)` (see the `builder` module), and the
//! trie determines them exactly: `(a,b,c)` = freq(abc), `(a,b,END)` = freq(ab) − Σ_c freq(abc)
//! (bigrams that end a document), `(a,END,END)` = freq(a) − Σ_b freq(ab) (document-final
//! tokens, whose sum is the number of documents). A negative difference means a wrapped int32
//! count and is an error naming the node; so is a negative `freq`. The root's `freq` (every
//! token of the corpus, the first to wrap on a large corpus) is not used.
//!
//! A trigram node knows only its parent's id, not the bigram `(a, b)`: that is a join, done
//! on disk. Pass 1 reads the file once, front to back: unigrams go to a vocabulary-sized table,
//! bigrams `(id, a, b, freq)` to a sequential temporary file (in id order), trigrams
//! `(parent, c, freq)` to an external sort by parent (sorted chunks spilled to disk). Pass 2
//! merges the two by id and emits the padded keys with their counts into sorted run files,
//! which [`merge_runs`] turns into the index (temp file + rename), with its `--memory` limit.
//!
//! Memory: two 16-byte-pair buffers of `memory_limit / 4` each (trigram sort, key runs; never
//! both full at once in pass 1), the merges' read buffers (`memory_limit / 4` shared), and
//! vocabulary-sized tables (~20 bytes per entry); independent of the file's size. Disk: ~16
//! bytes per trie node twice (sorted trigrams, key runs) plus 24 per bigram, all temporary.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::builder::{merge_runs, write_run, BuildOptions, BuildSummary};
use crate::error::{Error, Result, TrieProblem};
use crate::format::MAX_TOKEN_BITS;

const F: u32 = MAX_TOKEN_BITS;
const END: u64 = (1 << F) - 1;
const NODE_BYTES: u64 = 24;
const CHILD_BYTES: u64 = 12;
/// Progress is reported every this many nodes.
const PROGRESS_EVERY: u64 = 1 << 20;

/// Where a conversion is (for a progress bar): `stage` "read" counts bytes of the input,
/// "join" bigram nodes, "write" is reported once before the index is written.
#[derive(Clone, Debug)]
pub struct TrieProgress {
    pub stage: &'static str,
    pub done: u64,
    pub total: u64,
}

/// What a conversion read and wrote.
#[derive(Clone, Debug, Default)]
pub struct TrieSummary {
    pub build: BuildSummary,
    pub trie_nodes: u64,
    pub trie_unigrams: u64,
    pub trie_bigrams: u64,
    pub trie_trigrams: u64,
    pub input_bytes: u64,
    pub read_seconds: f64,
    pub join_seconds: f64,
}

/// The depth-1 table's hasher: node ids are distinct integers, so one multiply spreads them
/// (the default SipHash costs ~2 s per 100 M nodes in pass 1, which looks up every parent).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

fn trie_err(path: &Path, problem: TrieProblem) -> Error {
    Error::Trie { path: path.to_path_buf(), problem }
}

#[inline]
fn key(a: u64, b: u64, c: u64) -> u64 {
    (a << (2 * F)) | (b << F) | c
}

/// A buffer of (key, value) pairs sorted and spilled as raw 16-byte records when full.
struct Spiller {
    buf: Vec<(u64, u64)>,
    cap: usize,
    dir: PathBuf,
    name: &'static str,
    files: Vec<PathBuf>,
}

impl Spiller {
    fn new(cap: usize, dir: &Path, name: &'static str) -> Self {
        Spiller { buf: Vec::new(), cap, dir: dir.to_path_buf(), name, files: Vec::new() }
    }

    #[inline]
    fn push(&mut self, k: u64, v: u64) -> Result<()> {
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(self.cap);
        }
        self.buf.push((k, v));
        if self.buf.len() >= self.cap {
            self.spill()?;
        }
        Ok(())
    }

    fn spill(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.buf.sort_unstable_by_key(|p| p.0);
        let path = self.dir.join(format!("{}-{:05}.bin", self.name, self.files.len()));
        let f = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        for &(k, v) in &self.buf {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&k.to_le_bytes());
            b[8..].copy_from_slice(&v.to_le_bytes());
            w.write_all(&b).map_err(|e| Error::io(&path, e))?;
        }
        w.flush().map_err(|e| Error::io(&path, e))?;
        self.buf.clear();
        self.files.push(path);
        Ok(())
    }

    /// Spill the rest, free the buffer, and merge the sorted files (read buffers share `read_bytes`).
    fn into_merged(mut self, read_bytes: u64) -> Result<Merged> {
        self.spill()?;
        self.buf = Vec::new();
        let buf = (read_bytes / self.files.len().max(1) as u64).clamp(64 << 10, 1 << 20) as usize;
        let mut readers = Vec::with_capacity(self.files.len());
        let mut heap = BinaryHeap::new();
        for (i, p) in self.files.iter().enumerate() {
            let f = File::open(p).map_err(|e| Error::io(p, e))?;
            let mut r = (BufReader::with_capacity(buf, f), p.clone());
            if let Some(kv) = read_pair(&mut r)? {
                heap.push(Reverse((kv, i)));
            }
            readers.push(r);
        }
        Ok(Merged { readers, heap })
    }
}

fn read_pair(r: &mut (BufReader<File>, PathBuf)) -> Result<Option<(u64, u64)>> {
    let mut b = [0u8; 16];
    match r.0.read_exact(&mut b) {
        Ok(()) => Ok(Some((
            u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8])),
            u64::from_le_bytes(b[8..].try_into().unwrap_or([0; 8])),
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(Error::io(&r.1, e)),
    }
}

/// The k-way merge of a [`Spiller`]'s files, in key order.
struct Merged {
    readers: Vec<(BufReader<File>, PathBuf)>,
    heap: BinaryHeap<Reverse<((u64, u64), usize)>>,
}

impl Merged {
    fn peek(&self) -> Option<(u64, u64)> {
        self.heap.peek().map(|Reverse((kv, _))| *kv)
    }
    fn pop(&mut self) -> Result<Option<(u64, u64)>> {
        let Some(Reverse((kv, i))) = self.heap.pop() else {
            return Ok(None);
        };
        if let Some(next) = read_pair(&mut self.readers[i])? {
            self.heap.push(Reverse((next, i)));
        }
        Ok(Some(kv))
    }
}

/// Sorted (key, count) runs for [`merge_runs`].
struct Runs {
    buf: Vec<(u64, u64)>,
    cap: usize,
    dir: PathBuf,
    input: PathBuf,
    vocab: u32,
    files: Vec<PathBuf>,
}

impl Runs {
    fn push(&mut self, k: u64, c: u64) -> Result<()> {
        if c == 0 {
            return Ok(());
        }
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(self.cap);
        }
        self.buf.push((k, c));
        if self.buf.len() >= self.cap {
            self.spill(0, false)?;
        }
        Ok(())
    }
    /// Write the buffer as a run; the last run carries the document count (and is written
    /// even when empty, so a trie of only a root still makes an index).
    fn spill(&mut self, documents: u64, last: bool) -> Result<()> {
        if self.buf.is_empty() && !last {
            return Ok(());
        }
        self.buf.sort_unstable_by_key(|p| p.0);
        if let Some(w) = self.buf.windows(2).find(|w| w[0].0 == w[1].0) {
            let k = w[0].0;
            return Err(Error::Trie {
                path: self.input.clone(),
                problem: TrieProblem::Structure {
                    node: 0,
                    reason: format!("the n-gram ({}, {}, {}) has two nodes", k >> (2 * F), (k >> F) & END, k & END),
                },
            });
        }
        let path = self.dir.join(format!("keys-{:05}.dartrun", self.files.len()));
        write_run(&path, self.vocab, documents, self.buf.iter().copied())?;
        self.buf.clear();
        self.files.push(path);
        Ok(())
    }
}

/// A buffered little-endian reader of the `.trie` that knows where it is.
struct TrieReader {
    r: BufReader<File>,
    pos: u64,
}

impl TrieReader {
    #[inline]
    fn exact<const N: usize>(&mut self) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).ok()?;
        self.pos += N as u64;
        Some(b)
    }
    fn skip(&mut self, mut n: u64) -> bool {
        let mut scratch = [0u8; 4096];
        while n > 0 {
            let k = n.min(scratch.len() as u64) as usize;
            if self.r.read_exact(&mut scratch[..k]).is_err() {
                return false;
            }
            n -= k as u64;
            self.pos += k as u64;
        }
        true
    }
}

/// Convert the `.trie` at `input` into the index at `output` (see the module docs). `opts`
/// are the index builder's (vocabulary size, memory limit, temp dir, pruning). `progress`
/// is called every ~1 M nodes.
pub fn convert_dart_trie(
    input: &Path,
    output: &Path,
    opts: &BuildOptions,
    metadata_json: &str,
    progress: &mut dyn FnMut(&TrieProgress),
) -> Result<TrieSummary> {
    let t0 = Instant::now();
    let f = File::open(input).map_err(|e| Error::io(input, e))?;
    let len = f.metadata().map_err(|e| Error::io(input, e))?.len();
    if let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize()) {
        if a == b {
            return Err(Error::InvalidOption(format!(
                "output {} is the input trie: write the index to another file",
                output.display()
            )));
        }
    }
    if opts.vocab_size == 0 || opts.vocab_size as u64 >= END {
        return Err(Error::InvalidOption(format!("vocab_size must be in 1..={}, got {}", END - 1, opts.vocab_size)));
    }
    let vocab = opts.vocab_size as u64;
    let mut r = TrieReader { r: BufReader::with_capacity(1 << 20, f), pos: 0 };
    let foreign = |reason: String| trie_err(input, TrieProblem::Foreign { reason });
    let (Some(h0), Some(h1)) = (r.exact::<8>(), r.exact::<8>()) else {
        return Err(foreign(format!("{len} bytes, shorter than the 16-byte header")));
    };
    let (order, nodes) = (u64::from_le_bytes(h0), u64::from_le_bytes(h1));
    if order != 3 {
        return Err(foreign(format!(
            "order field {order}; dartcore's index holds trigrams and converts TrieNgram(3) files only"
        )));
    }
    // every node takes at least 24 bytes and is the child of one other
    let least = nodes.checked_mul(NODE_BYTES).and_then(|b| b.checked_add(16 + nodes.saturating_sub(1) * CHILD_BYTES));
    match least {
        None => return Err(foreign(format!("node count {nodes} is impossible"))),
        Some(_) if nodes == 0 => return Err(foreign("no nodes (not even the root)".into())),
        Some(need) if need > len => {
            let whole = (len.saturating_sub(16)) / (NODE_BYTES + CHILD_BYTES);
            return Err(trie_err(input, TrieProblem::Truncated { node: whole.min(nodes - 1), nodes, len }));
        }
        _ => {}
    }
    let tmp_parent = opts.temp_dir.clone().unwrap_or_else(|| {
        output.parent().filter(|p| !p.as_os_str().is_empty()).map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    });
    let tmp = tempfile::Builder::new()
        .prefix("dart-trie-convert-")
        .tempdir_in(&tmp_parent)
        .map_err(|e| Error::io(&tmp_parent, e))?;
    let quarter = (opts.memory_limit_bytes / 4).max(1 << 18);
    let cap = (quarter / 16) as usize;

    // ---- pass 1: read the file once
    let mut uni_node: HashMap<u64, u32, BuildHasherDefault<IdHasher>> = HashMap::default(); // depth-1 id -> token
    let mut uni_of_token: Vec<u64> = vec![u64::MAX; vocab as usize]; // token -> depth-1 node id
    let mut uni_freq: Vec<u64> = vec![0; vocab as usize]; // freq(a)
    let mut uni_kids: Vec<u64> = vec![0; vocab as usize]; // sum_b freq(ab)
    let bigram_path = tmp.path().join("bigrams.bin");
    let bf = File::create(&bigram_path).map_err(|e| Error::io(&bigram_path, e))?;
    let mut bigrams = BufWriter::with_capacity(1 << 20, bf);
    let mut tri = Spiller::new(cap, tmp.path(), "trigrams");
    let (mut n1, mut n2, mut n3, mut children_total) = (0u64, 0u64, 0u64, 0u64);
    for id in 0..nodes {
        let truncated = || trie_err(input, TrieProblem::Truncated { node: id, nodes, len });
        let rec = r.exact::<24>().ok_or_else(truncated)?;
        let token = i32::from_le_bytes(rec[0..4].try_into().unwrap_or([0; 4]));
        let parent = u64::from_le_bytes(rec[4..12].try_into().unwrap_or([0; 8]));
        let freq = i32::from_le_bytes(rec[12..16].try_into().unwrap_or([0; 4]));
        let nch = u64::from_le_bytes(rec[16..24].try_into().unwrap_or([0; 8]));
        if nch > nodes {
            return Err(foreign(format!("node {id} claims {nch} children of {nodes} nodes")));
        }
        if !r.skip(nch * CHILD_BYTES) {
            return Err(truncated());
        }
        children_total += nch;
        if id % PROGRESS_EVERY == 0 {
            progress(&TrieProgress { stage: "read", done: r.pos, total: len });
        }
        if id == 0 {
            continue; // the root: its freq (all tokens) is not needed
        }
        let structure = |reason: String| trie_err(input, TrieProblem::Structure { node: id, reason });
        if parent >= id {
            return Err(structure(format!(
                "its parent {parent} does not precede it (TrieNgram::save writes parents first)"
            )));
        }
        let depth = if parent == 0 {
            1
        } else if uni_node.contains_key(&parent) {
            2
        } else {
            3
        };
        if freq < 0 {
            return Err(trie_err(input, TrieProblem::NegativeCount { node: id, token, depth, freq }));
        }
        if token < 0 || token as u64 >= vocab {
            return Err(structure(format!(
                "token {token} is outside the vocabulary [0, {vocab}): convert with the tokenizer the trie was built with"
            )));
        }
        let (t, fq) = (token as u64, freq as u64);
        match depth {
            1 => {
                if uni_of_token[t as usize] != u64::MAX {
                    return Err(structure(format!("token {t} has a second unigram node")));
                }
                uni_of_token[t as usize] = id;
                uni_node.insert(id, t as u32);
                uni_freq[t as usize] = fq;
                n1 += 1;
            }
            2 => {
                let a = uni_node[&parent] as u64;
                uni_kids[a as usize] += fq;
                let mut b = [0u8; 24];
                b[..8].copy_from_slice(&id.to_le_bytes());
                b[8..16].copy_from_slice(&key(a, t, 0).to_le_bytes());
                b[16..].copy_from_slice(&fq.to_le_bytes());
                bigrams.write_all(&b).map_err(|e| Error::io(&bigram_path, e))?;
                n2 += 1;
            }
            _ => {
                if parent >= 1 << (64 - F) {
                    return Err(structure(format!("parent id {parent} is too large")));
                }
                tri.push((parent << F) | t, fq)?;
                n3 += 1;
            }
        }
    }
    progress(&TrieProgress { stage: "read", done: r.pos, total: len });
    if r.pos != len {
        return Err(foreign(format!("{} bytes follow the last of its {nodes} nodes", len - r.pos)));
    }
    if children_total != nodes - 1 {
        return Err(foreign(format!("its nodes list {children_total} children, {} expected", nodes - 1)));
    }
    bigrams.flush().map_err(|e| Error::io(&bigram_path, e))?;
    drop(bigrams);
    let read_seconds = t0.elapsed().as_secs_f64();

    // ---- pass 2: join trigrams to their bigrams, emit the padded keys
    let t1 = Instant::now();
    let mut tris = tri.into_merged(quarter)?;
    let mut runs = Runs {
        buf: Vec::new(),
        cap,
        dir: tmp.path().to_path_buf(),
        input: input.to_path_buf(),
        vocab: opts.vocab_size,
        files: Vec::new(),
    };
    let bf = File::open(&bigram_path).map_err(|e| Error::io(&bigram_path, e))?;
    let mut br = BufReader::with_capacity(1 << 20, bf);
    let orphan = |parent: u64| {
        trie_err(
            input,
            TrieProblem::Structure {
                node: parent,
                reason: "it has children of depth 3 but is not a bigram node".into(),
            },
        )
    };
    for j in 0..n2 {
        let mut b = [0u8; 24];
        br.read_exact(&mut b).map_err(|e| Error::io(&bigram_path, e))?;
        let id = u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]));
        let ab = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
        let fq = u64::from_le_bytes(b[16..].try_into().unwrap_or([0; 8]));
        let mut sum = 0u64;
        while let Some((pk, _)) = tris.peek() {
            let parent = pk >> F;
            if parent < id {
                return Err(orphan(parent));
            }
            if parent > id {
                break;
            }
            let (_, c) = tris.pop()?.unwrap_or((0, 0));
            runs.push(ab | (pk & END), c)?;
            sum += c;
        }
        if sum > fq {
            return Err(trie_err(
                input,
                TrieProblem::CountBelowChildren {
                    node: id,
                    token: ((ab >> F) & END) as u32,
                    depth: 2,
                    count: fq,
                    children: sum,
                },
            ));
        }
        runs.push(ab | END, fq - sum)?;
        if j % PROGRESS_EVERY == 0 {
            progress(&TrieProgress { stage: "join", done: j, total: n2 });
        }
    }
    if let Some((pk, _)) = tris.peek() {
        return Err(orphan(pk >> F));
    }
    drop(tris);
    let mut documents = 0u64;
    for (a, &id) in uni_of_token.iter().enumerate() {
        let (count, children) = (uni_freq[a], uni_kids[a]);
        if id == u64::MAX {
            continue;
        }
        if children > count {
            return Err(trie_err(
                input,
                TrieProblem::CountBelowChildren { node: id, token: a as u32, depth: 1, count, children },
            ));
        }
        runs.push(key(a as u64, END, END), count - children)?; // the documents that end with a
        documents += count - children;
    }
    runs.spill(documents, true)?;
    progress(&TrieProgress { stage: "join", done: n2, total: n2 });
    let join_seconds = t1.elapsed().as_secs_f64();
    progress(&TrieProgress { stage: "write", done: 0, total: 1 });
    let mut build = merge_runs(&runs.files, output, opts, metadata_json)?;
    build.seconds = t0.elapsed().as_secs_f64();
    progress(&TrieProgress { stage: "write", done: 1, total: 1 });
    Ok(TrieSummary {
        build,
        trie_nodes: nodes,
        trie_unigrams: n1,
        trie_bigrams: n2,
        trie_trigrams: n3,
        input_bytes: len,
        read_seconds,
        join_seconds,
    })
}
