//! The reader: O(1) open over any bytes, and the queries.
//!
//! Layout recap (FORMAT.md): children of every context are stored **sorted by token id**
//! (node word = `token << count_bits | count_code`, so word order is token order), which makes
//! the hot path of the Eq. (10) search — `cond_probs`, 25 sorted candidate tokens against one
//! context — a galloping merge. Top-k is served by a stored top-32 permutation for contexts
//! with more than 32 children and by a selection over at most 32 decoded nodes otherwise.
//!
//! Robustness: `open` checks only the header and the section table (O(1)); the body may be
//! garbage in a hostile file, so every body read below is bounds-checked (`get`), and an
//! inconsistent value degrades to "context not found" (probabilities) or `Error::Format`
//! (`children`). Nothing here can panic or read out of bounds on any input bytes.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::{Advice, Mmap, MmapOptions};

use crate::error::{Error, Result};
use crate::format::{self, get32, get64, Header, Sec, BLOCK, BLOCK3_LEN, SECTIONS, TOPK_K, TOPK_ROW, UNI_LEN};

#[path = "reader_keys.rs"]
mod keys;
pub use keys::Keys;

/// Options of [`Index::open_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenOptions {
    /// Fault the whole file in at open (`MAP_POPULATE` + `MADV_WILLNEED`): costs a read of
    /// the file at start-up, removes page faults from the first queries.
    pub prefault: bool,
    /// Advise transparent huge pages (`MADV_HUGEPAGE`); ignored where unsupported.
    pub hugepages: bool,
    /// How much of the file to check before the index is returned ([`Verify`]).
    pub verify: Verify,
}

/// How much of an index file is checked ([`Index::check`], [`OpenOptions::verify`]).
///
/// Every level keeps queries memory-safe on any bytes (every body read is bounds-checked);
/// they differ in how much *accidental* damage they rule out before the first answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verify {
    /// Header and section table only (their CRCs, bounds and lengths): O(1), what every open
    /// does. A damaged body goes unnoticed and can give wrong probabilities.
    #[default]
    Header,
    /// [`Verify::Header`], plus the CRC of every section of at most
    /// [`crate::format::QUICK_CRC_BYTES`] (on small indexes, the whole file), the O(vocabulary)
    /// invariants of the unigram tables, and the structural invariants of
    /// [`crate::format::QUICK_SAMPLES`] sampled places of each larger section. Damage inside
    /// a larger section is caught only where it breaks a sampled place or its invariants.
    Quick,
    /// Every section's CRC and every invariant of FORMAT.md: O(file size), [`Index::verify`].
    Full,
}

impl Verify {
    /// The level's name as the Python API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Verify::Header => "header",
            Verify::Quick => "quick",
            Verify::Full => "full",
        }
    }
}

impl std::str::FromStr for Verify {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "header" => Ok(Verify::Header),
            "quick" => Ok(Verify::Quick),
            "full" => Ok(Verify::Full),
            _ => Err(Error::InvalidOption(format!("verify = {s:?}: use \"header\", \"quick\" or \"full\""))),
        }
    }
}

/// Which context answered a query.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Match {
    /// 3: the two-token (trigram) context, 2: the one-token (bigram) context, 1: the empty
    /// context (unigram). 0 only for a query on an empty index.
    pub order: u8,
    /// total(c): occurrences of the context followed by a token (sum of its children's counts
    /// before pruning); for the unigram context, the number of tokens.
    pub total: u64,
}

/// A reusable result buffer for [`Index::children`]: no heap allocation per query once its
/// capacity covers `k` (and, for `k > 32` on big contexts, the context's size).
#[derive(Clone, Debug, Default)]
pub struct Children {
    tokens: Vec<u32>,
    counts: Vec<u64>,
    scratch: Vec<(u64, u32)>,
}

impl Children {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with_capacity(k: usize) -> Self {
        Children {
            tokens: Vec::with_capacity(k),
            counts: Vec::with_capacity(k),
            scratch: Vec::with_capacity(TOPK_K.max(k)),
        }
    }
    /// Child tokens, by descending count (ties: ascending token id).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Their counts.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    fn clear(&mut self) {
        self.tokens.clear();
        self.counts.clear();
    }
}

/// Flattened result of [`Index::children_batch`]: row `i` is `tokens[i*k..(i+1)*k]`, padded
/// with token `u32::MAX` and count 0.
#[derive(Clone, Debug, Default)]
pub struct BatchChildren {
    pub k: usize,
    pub tokens: Vec<u32>,
    pub counts: Vec<u64>,
    pub totals: Vec<u64>,
    pub orders: Vec<u8>,
}

/// The largest answer [`Index::children_batch`] allocates (12 bytes per cell).
pub const MAX_BATCH_BYTES: usize = 1 << 30;

/// `vec![v; n]` whose allocation failure is an error instead of an abort.
fn filled<T: Clone>(n: usize, v: T) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| Error::InvalidOption(format!("cannot allocate {n} result cells: ask for fewer")))?;
    out.resize(n, v);
    Ok(out)
}

/// Size figures of an index.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub vocab_size: u32,
    pub token_bits: u32,
    pub documents: u64,
    pub tokens: u64,
    pub unigram_nodes: u64,
    pub bigram_nodes: u64,
    pub trigram_nodes: u64,
    /// unigram + bigram + trigram nodes.
    pub nodes: u64,
    /// File size.
    pub bytes: u64,
    pub bytes_per_node: f64,
    pub escaped_counts: u64,
    pub large_contexts: u64,
    /// (section name, bytes) in file order.
    pub sections: Vec<(&'static str, u64)>,
}

/// A trigram index over bytes `D` (`Vec<u8>`, `&[u8]`, `Mmap`).
pub struct Index<D: AsRef<[u8]>> {
    data: D,
    h: Header,
    sec: [Range<usize>; 16],
    path: Option<PathBuf>,
}

impl<D: AsRef<[u8]>> std::fmt::Debug for Index<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index").field("header", &self.h).field("path", &self.path).finish()
    }
}

/// One level's node array and its escape tables.
#[derive(Clone, Copy)]
struct Level<'a> {
    nodes: &'a [u8],
    esc_rank: &'a [u8],
    esc: &'a [u8],
    cb: u32,
    esc_code: u32,
}

impl<'a> Level<'a> {
    #[inline]
    fn len(&self) -> usize {
        self.nodes.len() / 4
    }
    #[inline]
    fn word(&self, i: usize) -> Option<u32> {
        get32(self.nodes, i.checked_mul(4)?)
    }
    #[inline]
    fn token_of(&self, w: u32) -> u32 {
        w >> self.cb
    }
    /// Count of node `i` whose word is `w`.
    #[inline]
    fn count_of(&self, i: usize, w: u32) -> u64 {
        let code = w & self.esc_code;
        if code != self.esc_code {
            return code as u64;
        }
        let blk = i / BLOCK;
        let Some(base) = get64(self.esc_rank, blk * 8) else {
            return 0;
        };
        base.checked_add(self.escapes(blk * BLOCK, i))
            .and_then(|x| usize::try_from(x).ok()?.checked_mul(8))
            .and_then(|o| get64(self.esc, o))
            .unwrap_or(0)
    }
    /// Escaped nodes among `s..e` (the part inside the node array).
    ///
    /// A count over the words sliced once, which the compiler vectorises: a per-node
    /// `Option`-checked loop cost ~30 instructions per node scanned, ~30 k per search of
    /// tools/bench_tree.py (real rows: the candidates found have large, escaped counts, and
    /// the rank of an escape scans up to 63 nodes of its block).
    #[inline]
    fn escapes(&self, s: usize, e: usize) -> u64 {
        let e = e.min(self.len());
        let Some(words) = self.nodes.get(s.min(e) * 4..e * 4) else {
            return 0;
        };
        let esc = self.esc_code;
        words.chunks_exact(4).map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & esc == esc)).sum()
    }

    /// Decode nodes `s..e` in order, with an incremental escape rank.
    fn decode(&self, s: usize, e: usize, mut f: impl FnMut(u32, u64)) {
        let mut rank: Option<u64> = None;
        for i in s..e {
            let Some(w) = self.word(i) else { return };
            let code = w & self.esc_code;
            let c = if code != self.esc_code {
                code as u64
            } else {
                let r = match rank {
                    Some(r) => r,
                    None => {
                        // rank of the first escape in the range: block base + scan
                        let blk = i / BLOCK;
                        get64(self.esc_rank, blk * 8).unwrap_or(u64::MAX / 2) + self.escapes(blk * BLOCK, i)
                    }
                };
                rank = Some(r + 1);
                usize::try_from(r).ok().and_then(|r| get64(self.esc, r.checked_mul(8)?)).unwrap_or(0)
            };
            f(w >> self.cb, c);
        }
    }
    /// Position of token `t` in `s..e`, if present.
    #[inline]
    fn find(&self, s: usize, e: usize, t: u32) -> Option<usize> {
        // A single lookup has no cursor for galloping to exploit: a binary search, branch-free
        // (Khuong & Morin: `base += half` by a conditional move; the answer stays in
        // base ..= base + len) over the range sliced once. The lists searched are long (the
        // search's two-token contexts look b up among a's 1k to over 8k children), and the branches of
        // a plain bisection are coin flips: ~450 mispredicted per search on tools/bench_tree.py.
        // (As written, LLVM turns `usize::from(..) * half` back into a branch (x86 cmov
        // conversion: the search advances by speculation, which also fetches ahead). A form
        // that stays branch-free, `half & ` the sign of a subtraction of the tokens shifted
        // into the top bits, removed ~2.4 M mispredicted branches per 2,000 searches here
        // and in `seen_sorted` (cachegrind) and measured no faster: not kept.)
        let words = words_of(self.nodes.get(s.checked_mul(4)?..e.checked_mul(4)?)?);
        let n = words.len();
        if n == 0 {
            return None;
        }
        let tok = |i: usize| u32::from_le_bytes(words[i]) >> self.cb;
        let (mut base, mut len) = (0usize, n);
        while len > 1 {
            let half = len / 2;
            base += usize::from(tok(base + half) < t) * half;
            len -= half;
        }
        base += usize::from(tok(base) < t);
        (base < n && tok(base) == t).then_some(s + base)
    }
}

/// A node range as whole little-endian words: word `i` is `u32::from_le_bytes(words[i])`,
/// whose only bounds check is `i < words.len()` (indexing the bytes also checked `4 * i + 3`:
/// search CPU p50 -3 % on tools/bench_tree.py, real rows, in-process A/B of 8 interleaved runs).
#[inline]
fn words_of(bytes: &[u8]) -> &[[u8; 4]] {
    bytes.as_chunks::<4>().0
}

impl Level<'_> {
    /// count(c, v)/total(c) for every v = `cands[i]` (ascending, repeats allowed) where
    /// `out[i]` is NaN on entry and v is a child of `c` with a non-zero count, into `out[i]`;
    /// other entries are left as they are (and not searched).
    ///
    /// A galloping merge: each candidate's position is searched from the previous one's, by
    /// an exponential probe and then a bisection of the bracket. Measured against a branch-free
    /// binary search on the 55 M-node bench index, galloping was faster (2.0 vs 2.9 µs random
    /// contexts, 1.1 vs 1.7 µs hot), and so it was again against all candidates' branch-free
    /// searches advanced in lock step (search CPU p50 124 -> 145 µs on tools/bench_tree.py,
    /// real rows); an interpolation guess before galloping was slower too (hot 1.33 vs 0.87
    /// µs). The context's node words are sliced once (a range outside the node array, i.e. a
    /// corrupt body, is a context without children), so a probe has no `Option` or overflow
    /// checks, and the bisection is written branch-free (`base += half` by a conditional move;
    /// its probes are coin flips for the branch predictor; but see `find`: the compiler
    /// makes it a branch again): search CPU p50 117 -> 110 µs (min of 8 interleaved runs,
    /// real rows) against the per-candidate `Option`-checked gallop.
    fn seen_sorted(&self, c: Ctx, cands: &[u32], out: &mut [f64]) {
        let Some(words) = c.s.checked_mul(4).zip(c.e.checked_mul(4)).and_then(|(a, b)| self.nodes.get(a..b)) else {
            return;
        };
        let words = words_of(words);
        let n = words.len();
        let word = |i: usize| u32::from_le_bytes(words[i]);
        let cb = self.cb;
        let total = c.total as f64;
        let mut lo = 0usize;
        for (&v, o) in cands.iter().zip(out.iter_mut()) {
            if !o.is_nan() {
                continue;
            }
            let lt = |i: usize| (word(i) >> cb) < v;
            // first position >= lo whose token is >= v: exponential probe from lo ...
            if lo >= n {
                break;
            }
            if lt(lo) {
                let mut step = 1usize;
                let mut top = lo + 1;
                while top < n && lt(top) {
                    lo = top;
                    step *= 2;
                    top = lo + step;
                }
                // ... then the answer is in lo + 1 ..= min(top, n): branch-free bisection.
                // (Khuong & Morin's form: the answer stays in base ..= base + len.)
                let mut base = lo + 1;
                let mut len = top.min(n) - base;
                if len > 0 {
                    while len > 1 {
                        let half = len / 2;
                        base += usize::from(lt(base + half)) * half;
                        len -= half;
                    }
                    base += usize::from(lt(base));
                }
                lo = base;
            }
            if lo < n {
                let w = word(lo);
                if w >> cb == v {
                    let cnt = self.count_of(c.s + lo, w);
                    if cnt > 0 {
                        *o = cnt as f64 / total;
                    }
                }
            }
        }
    }
}

/// A resolved context: its node range at one level and its total.
#[derive(Clone, Copy)]
struct Ctx {
    s: usize,
    e: usize,
    total: u64,
    /// Rank in the top-k permutation table, if the context has one.
    large: Option<usize>,
}

impl Index<Mmap> {
    /// Map `path` read-only and validate header + section bounds (O(1)).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, OpenOptions::default())
    }

    /// [`Index::open`] with prefault / huge-page options and a [`Verify`] level. Only regular
    /// files are opened: a directory, FIFO, socket or device is [`Error::NotAFile`].
    pub fn open_with(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Self> {
        let path = path.as_ref();
        let file = open_regular(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            return Err(Error::format(format!("{} is empty (0 bytes)", path.display())));
        }
        let mut mo = MmapOptions::new();
        if opts.prefault {
            mo.populate();
        }
        // SAFETY: the mapping is read-only and an index file is never modified in place:
        // builders write a temporary file and rename it over the output path, so a mapped
        // file keeps its inode and bytes for the life of the mapping. Writing over a mapped
        // file in place (`cp new.idx live.idx`, truncation) is outside the contract, as for
        // any mmap-based reader: every process mapping it reads the new bytes or dies of
        // SIGBUS (FORMAT.md, "Replacing an index"). Every read of the body is bounds-checked
        // against the mapping's length.
        let mmap = unsafe { mo.map(&file) }.map_err(|e| Error::io(path, e))?;
        if opts.prefault {
            let _ = mmap.advise(Advice::WillNeed);
        }
        if opts.hugepages {
            // Transparent huge pages for file mappings need kernel support; best effort.
            let _ = mmap.advise(Advice::HugePage);
        }
        let mut idx = Index::from_bytes(mmap).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            e => e,
        })?;
        idx.path = Some(path.to_path_buf());
        if !opts.prefault {
            idx.check_mapped(opts.verify)?;
        } else {
            idx.check(opts.verify)?;
        }
        Ok(idx)
    }

    /// [`Index::check`] on the mapping. For `Verify::Quick` the sections it samples are
    /// advised `MADV_RANDOM` while it runs: with the kernel's read-ahead, each of its few
    /// thousand scattered reads of a cold file fetched up to 128 KiB (1.9 s on a cold 1.3 GB
    /// index).
    pub fn check_mapped(&self, level: Verify) -> Result<()> {
        if level != Verify::Quick {
            return self.check(level);
        }
        let sampled: Vec<Range<usize>> =
            self.sec.iter().filter(|r| r.len() as u64 > format::QUICK_CRC_BYTES).cloned().collect();
        for r in &sampled {
            let _ = self.data.advise_range(Advice::Random, r.start, r.len());
        }
        let res = self.check(level);
        for r in &sampled {
            let _ = self.data.advise_range(Advice::Normal, r.start, r.len());
        }
        res
    }
}

/// What a non-regular file is, for the error message.
fn not_a_file(ft: &std::fs::FileType) -> Option<&'static str> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if ft.is_socket() {
            return Some("a socket");
        }
        if ft.is_block_device() {
            return Some("a block device");
        }
        if ft.is_char_device() {
            return Some("a character device");
        }
    }
    if ft.is_dir() {
        Some("a directory")
    } else if !ft.is_file() {
        Some("not a regular file")
    } else {
        None
    }
}

/// Open `path` for reading if it is a regular file. The type is checked with stat before the
/// open (opening a FIFO blocks until a writer appears, and ignores Ctrl-C while it waits) and
/// again on the opened descriptor, which is opened non-blocking in case the path was
/// replaced in between.
fn open_regular(path: &Path) -> Result<File> {
    let refuse = |ft: &std::fs::FileType| match not_a_file(ft) {
        Some(kind) => Err(Error::NotAFile { path: path.to_path_buf(), kind }),
        None => Ok(()),
    };
    refuse(&std::fs::metadata(path).map_err(|e| Error::io(path, e))?.file_type())?;
    let mut oo = std::fs::OpenOptions::new();
    oo.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        oo.custom_flags(libc::O_NONBLOCK);
    }
    let file = oo.open(path).map_err(|e| Error::io(path, e))?;
    refuse(&file.metadata().map_err(|e| Error::io(path, e))?.file_type())?;
    Ok(file)
}

impl<D: AsRef<[u8]>> Index<D> {
    /// Validate header and section table and wrap the bytes. O(1) in the body size.
    pub fn from_bytes(data: D) -> Result<Self> {
        let (h, secs) = format::parse(data.as_ref())?;
        let sec: [Range<usize>; 16] = std::array::from_fn(|i| {
            let s = secs[i];
            s.offset as usize..(s.offset + s.len) as usize
        });
        if std::str::from_utf8(&data.as_ref()[sec[0].clone()]).is_err() {
            return Err(Error::format("metadata block is not valid UTF-8"));
        }
        Ok(Index { data, h, sec, path: None })
    }

    /// The bytes behind the index.
    pub fn bytes(&self) -> &[u8] {
        self.data.as_ref()
    }
    /// The file path, when opened from a file.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
    pub fn header(&self) -> &Header {
        &self.h
    }
    pub fn vocab_size(&self) -> u32 {
        self.h.vocab_size
    }
    /// The metadata block (JSON written by the builder's caller).
    pub fn metadata_json(&self) -> &str {
        std::str::from_utf8(self.s(Sec::Meta)).unwrap_or("")
    }

    #[inline]
    fn s(&self, s: Sec) -> &[u8] {
        let r = &self.sec[s as usize - 1];
        self.data.as_ref().get(r.clone()).unwrap_or(&[])
    }
    #[inline]
    fn l2(&self) -> Level<'_> {
        Level {
            nodes: self.s(Sec::L2Nodes),
            esc_rank: self.s(Sec::L2EscRank),
            esc: self.s(Sec::L2Esc),
            cb: self.h.count_bits(),
            esc_code: self.h.esc_code(),
        }
    }
    #[inline]
    fn l3(&self) -> Level<'_> {
        Level {
            nodes: self.s(Sec::L3Nodes),
            esc_rank: self.s(Sec::L3EscRank),
            esc: self.s(Sec::L3Esc),
            cb: self.h.count_bits(),
            esc_code: self.h.esc_code(),
        }
    }

    /// Unigram count of `t` (0 when out of range).
    #[inline]
    fn uni_count(&self, t: u32) -> u64 {
        get64(self.s(Sec::Uni), t as usize * UNI_LEN + 8).unwrap_or(0)
    }

    /// The bigram context `a` (its children at level 2).
    #[inline]
    fn ctx1(&self, a: u32) -> Option<Ctx> {
        let rec = self.s(Sec::Uni).get(a as usize * UNI_LEN..(a as usize + 1) * UNI_LEN)?;
        let s = get64(rec, 0)?;
        let e = s.checked_add(get32(rec, 24)? as u64)?;
        if e > self.h.n_bigram {
            return None;
        }
        let total = get64(rec, 16)?;
        let lr = get32(rec, 28)?;
        Some(Ctx { s: s as usize, e: e as usize, total, large: (lr != u32::MAX).then_some(lr as usize) })
    }

    /// Level-3 start of bigram node `j` (j == n_bigram gives the end).
    #[inline]
    fn start3(&self, j: usize) -> Option<u64> {
        let blocks = self.s(Sec::L3Blocks);
        let n = self.h.n_bigram as usize;
        if j == n {
            return get64(blocks, format::blocks(n as u64) as usize * BLOCK3_LEN);
        }
        let bo = (j / BLOCK) * BLOCK3_LEN;
        let base = get64(blocks, bo)?;
        let wide = get64(blocks, bo + 40)?;
        let d = if wide == u64::MAX {
            let b = self.s(Sec::L3Delta).get(j * 2..j * 2 + 2)?;
            u16::from_le_bytes([b[0], b[1]]) as u64
        } else {
            let w = usize::try_from(wide).ok()?;
            get32(self.s(Sec::L3Wide), w.checked_mul(BLOCK)?.checked_add(j % BLOCK)?.checked_mul(4)?)? as u64
        };
        base.checked_add(d)
    }

    /// The trigram context of bigram node `j` (whose word is `w`).
    #[inline]
    fn ctx2(&self, j: usize, w: u32) -> Option<Ctx> {
        let s = self.start3(j)?;
        let e = self.start3(j + 1)?;
        if s > e || e > self.h.n_trigram {
            return None;
        }
        let blocks = self.s(Sec::L3Blocks);
        let bo = (j / BLOCK) * BLOCK3_LEN;
        let below = (1u64 << (j % BLOCK)) - 1;
        let bit = 1u64 << (j % BLOCK);
        let large_bits = get64(blocks, bo + 8)?;
        let large = if large_bits & bit != 0 {
            let r = get64(blocks, bo + 16)?.checked_add((large_bits & below).count_ones() as u64)?;
            Some(usize::try_from(r).ok()?)
        } else {
            None
        };
        let ends_bits = get64(blocks, bo + 24)?;
        let ends = if ends_bits & bit != 0 {
            let r = get64(blocks, bo + 32)?.checked_add((ends_bits & below).count_ones() as u64)?;
            get64(self.s(Sec::Ends), usize::try_from(r).ok()?.checked_mul(8)?)?
        } else {
            0
        };
        let total = self.l2().count_of(j, w).checked_sub(ends)?;
        Some(Ctx { s: s as usize, e: e as usize, total, large })
    }

    /// The trigram context (a, b): bigram node index, and the context.
    #[inline]
    fn ctx2_of(&self, a: u32, b: u32) -> Option<Ctx> {
        let j = self.node2_of(a, b)?;
        self.ctx2(j, self.l2().word(j)?)
    }

    /// The bigram node of b after a.
    #[inline]
    fn node2_of(&self, a: u32, b: u32) -> Option<usize> {
        let c1 = self.ctx1(a)?;
        self.l2().find(c1.s, c1.e, b)
    }

    /// The largest count among the children of `c` (nodes of `lv`, top-k rows in `perm`):
    /// the first entry of its stored top-k row, or a scan of at most `TOPK_K` children.
    fn max_count(&self, lv: Level<'_>, c: Ctx, perm: Sec) -> Option<u64> {
        match c.large {
            Some(r) => {
                let row = self.s(perm).get(r.checked_mul(TOPK_ROW)?..)?.get(..TOPK_ROW)?;
                let w = get32(row, 8)?;
                if w & lv.esc_code != lv.esc_code {
                    Some((w & lv.esc_code) as u64)
                } else {
                    // escaped entries are a prefix of the row: the first is at the row's base
                    get64(self.s(Sec::TopKEsc), usize::try_from(get64(row, 0)?).ok()?.checked_mul(8)?)
                }
            }
            None if c.e - c.s <= TOPK_K => {
                let mut m = 0u64;
                lv.decode(c.s, c.e, |_, cnt| m = m.max(cnt));
                Some(m)
            }
            None => None,
        }
    }

    fn check_tokens(&self, ts: &[u32]) -> Result<()> {
        for &t in ts {
            if t >= self.h.vocab_size {
                return Err(Error::TokenOutOfRange { token: t, vocab_size: self.h.vocab_size });
            }
        }
        Ok(())
    }

    /// Top-`k` children of the longest suffix of `context` (last two tokens, then the last
    /// one, then the empty context) that has children, by descending count (ties: ascending
    /// token id). Tokens before the last two are ignored. Errors on token ids ≥ vocab and on
    /// a corrupt body.
    pub fn children(&self, context: &[u32], k: usize, out: &mut Children) -> Result<Match> {
        self.check_tokens(context)?;
        out.clear();
        let n = context.len();
        if n >= 2 {
            if let Some(c) = self.ctx2_of(context[n - 2], context[n - 1]) {
                if c.e > c.s {
                    self.topk(self.l3(), c, Sec::TopK2, k, out)?;
                    return Ok(Match { order: 3, total: c.total });
                }
            }
        }
        if n >= 1 {
            if let Some(c) = self.ctx1(context[n - 1]) {
                if c.e > c.s {
                    self.topk(self.l2(), c, Sec::TopK1, k, out)?;
                    return Ok(Match { order: 2, total: c.total });
                }
            }
        }
        let order = self.s(Sec::UniOrder);
        let m = (k as u64).min(self.h.n_unigram) as usize;
        for i in 0..m {
            let t = get32(order, i * 4).ok_or_else(|| Error::format("corrupt unigram order"))?;
            out.tokens.push(t);
            out.counts.push(self.uni_count(t));
        }
        Ok(Match { order: if self.h.tokens > 0 { 1 } else { 0 }, total: self.h.tokens })
    }

    fn topk(&self, lv: Level<'_>, c: Ctx, perm: Sec, k: usize, out: &mut Children) -> Result<()> {
        let n = c.e - c.s;
        let k = k.min(n);
        if k == 0 {
            return Ok(());
        }
        if let (Some(r), true) = (c.large, k <= TOPK_K) {
            // a prefix read of the stored top-K row (136 contiguous bytes)
            let row = r
                .checked_mul(TOPK_ROW)
                .and_then(|o| self.s(perm).get(o..o + TOPK_ROW))
                .ok_or_else(|| Error::format("corrupt top-k table"))?;
            let esc_base = get64(row, 0).unwrap_or(0);
            let esc = self.s(Sec::TopKEsc);
            for i in 0..k {
                let w = get32(row, 8 + i * 4).unwrap_or(0);
                let code = w & lv.esc_code;
                let cnt = if code != lv.esc_code {
                    code as u64
                } else {
                    // escaped entries are a prefix of the row (they hold the largest counts)
                    esc_base
                        .checked_add(i as u64)
                        .and_then(|x| usize::try_from(x).ok()?.checked_mul(8))
                        .and_then(|o| get64(esc, o))
                        .ok_or_else(|| Error::format("corrupt top-k escape table"))?
                };
                out.tokens.push(lv.token_of(w));
                out.counts.push(cnt);
            }
            return Ok(());
        }
        let sc = &mut out.scratch;
        sc.clear();
        lv.decode(c.s, c.e, |t, cnt| sc.push((cnt, t)));
        let by = |x: &(u64, u32), y: &(u64, u32)| y.0.cmp(&x.0).then(x.1.cmp(&y.1));
        if k < sc.len() {
            sc.select_nth_unstable_by(k - 1, by);
            sc.truncate(k);
        }
        sc.sort_unstable_by(by);
        for &(cnt, t) in sc.iter() {
            out.tokens.push(t);
            out.counts.push(cnt);
        }
        Ok(())
    }

    /// `(count(context, token), total(context))` for exactly that context: the empty context
    /// (unigram), one token, or two tokens (longer contexts use their last two). `(0, 0)` when
    /// the context is not in the index; `(0, total)` when it is but `token` never followed it.
    pub fn count(&self, context: &[u32], token: u32) -> (u64, u64) {
        let n = context.len();
        match n {
            0 => (self.uni_count(token), self.h.tokens),
            1 => match self.ctx1(context[0]) {
                Some(c) => {
                    let l2 = self.l2();
                    let cnt = l2.find(c.s, c.e, token).and_then(|j| Some(l2.count_of(j, l2.word(j)?)));
                    (cnt.unwrap_or(0), c.total)
                }
                None => (0, 0),
            },
            _ => match self.ctx2_of(context[n - 2], context[n - 1]) {
                Some(c) => {
                    let l3 = self.l3();
                    let cnt = l3.find(c.s, c.e, token).and_then(|j| Some(l3.count_of(j, l3.word(j)?)));
                    (cnt.unwrap_or(0), c.total)
                }
                None => (0, 0),
            },
        }
    }

    /// [`Index::count`] for many tokens of one context, resolved once: `out[i]` =
    /// count(context, `tokens[i]`) (any order); returns total(context) (0 when the context is
    /// not in the index, and then every count is 0).
    ///
    /// # Panics
    /// If `out.len() != tokens.len()` (a programming error of the caller).
    pub fn counts(&self, context: &[u32], tokens: &[u32], out: &mut [u64]) -> u64 {
        assert_eq!(out.len(), tokens.len(), "counts: out and tokens differ in length");
        out.fill(0);
        let n = context.len();
        let (lv, c) = match n {
            0 => {
                for (o, &t) in out.iter_mut().zip(tokens) {
                    *o = self.uni_count(t);
                }
                return self.h.tokens;
            }
            1 => (self.l2(), self.ctx1(context[0])),
            _ => (self.l3(), self.ctx2_of(context[n - 2], context[n - 1])),
        };
        let Some(c) = c else { return 0 };
        for (o, &t) in out.iter_mut().zip(tokens) {
            *o = lv.find(c.s, c.e, t).and_then(|j| Some(lv.count_of(j, lv.word(j)?))).unwrap_or(0);
        }
        c.total
    }

    /// g(v|c) of docs/architecture.md: count(c,v)/total(c) for the longest suffix c of `context`
    /// (last two tokens, then the last one, then — if `unigram_backoff` or the context is
    /// empty — the empty context) after which `token` has been seen; 0.0 if never seen.
    pub fn prob(&self, context: &[u32], token: u32, unigram_backoff: bool) -> f64 {
        let mut out = [0.0f64];
        self.cond_probs(context, &[token], unigram_backoff, &mut out);
        out[0]
    }

    /// [`Index::prob`] for many candidates at once: `candidates_sorted` ascending (repeats
    /// allowed), `out[i]` = g(candidates_sorted[i] | context). The hot path of the Eq. (10)
    /// search: two context lookups, then one galloping merge per level; no allocation.
    ///
    /// # Panics
    /// If `out.len() != candidates_sorted.len()` (a programming error of the caller).
    pub fn cond_probs(&self, context: &[u32], candidates_sorted: &[u32], unigram_backoff: bool, out: &mut [f64]) {
        assert_eq!(out.len(), candidates_sorted.len(), "cond_probs: out and candidates differ in length");
        let n = context.len();
        let c3 = if n >= 2 { self.ctx2_of(context[n - 2], context[n - 1]) } else { None };
        let c3 = c3.filter(|c| c.e > c.s && c.total > 0);
        let c2 = if n >= 1 { self.ctx1(context[n - 1]) } else { None };
        let c2 = c2.filter(|c| c.e > c.s && c.total > 0);
        let uni = (unigram_backoff || n == 0) && self.h.tokens > 0;
        out.fill(f64::NAN);
        if let Some(c) = c3 {
            self.l3().seen_sorted(c, candidates_sorted, out);
        }
        if let Some(c) = c2 {
            self.l2().seen_sorted(c, candidates_sorted, out);
        }
        let utot = self.h.tokens as f64;
        for (&v, o) in candidates_sorted.iter().zip(out.iter_mut()) {
            if o.is_nan() {
                *o = if uni { self.uni_count(v) as f64 / utot } else { 0.0 };
            }
        }
    }

    /// The two-token level of [`Index::cond_probs`] alone: `out[i]` = count(a, b, v)/total(a, b)
    /// for v = `candidates_sorted[i]` (ascending) when v has followed (a, b), NaN otherwise.
    /// Where it is NaN, `cond_probs(&[a, b], ..)` backs off to exactly `cond_probs(&[b], ..)`,
    /// so a caller can memoise that one-token column per `b` and share it between contexts.
    ///
    /// # Panics
    /// If `out.len() != candidates_sorted.len()` (a programming error of the caller).
    pub fn trigram_probs(&self, a: u32, b: u32, candidates_sorted: &[u32], out: &mut [f64]) {
        assert_eq!(out.len(), candidates_sorted.len(), "trigram_probs: out and candidates differ in length");
        out.fill(f64::NAN);
        let Some(c) = self.ctx2_of(a, b).filter(|c| c.e > c.s && c.total > 0) else {
            return;
        };
        self.l3().seen_sorted(c, candidates_sorted, out);
    }

    /// An upper bound of `cond_probs(&[b], [v], unigram_backoff)` over every token v: the
    /// largest of count(b, v)/total(b) (b's most frequent child) and, where the query would back
    /// off to it, the largest unigram probability. O(1) for contexts with a stored top-k row,
    /// else a scan of at most `TOPK_K` children. 1.0 where the body cannot be read.
    pub fn max_backoff_prob(&self, b: u32, unigram_backoff: bool) -> f64 {
        let mut best = 0.0f64;
        if unigram_backoff && self.h.tokens > 0 {
            let Some(top) = get32(self.s(Sec::UniOrder), 0) else {
                return 1.0;
            };
            best = self.uni_count(top) as f64 / self.h.tokens as f64;
        }
        let Some(c) = self.ctx1(b).filter(|c| c.e > c.s && c.total > 0) else {
            return best;
        };
        match self.max_count(self.l2(), c, Sec::TopK1) {
            Some(m) => best.max(m as f64 / c.total as f64),
            None => 1.0,
        }
    }

    /// Resolve the two-token context (a, b) once for [`Index::trigram_probs_at`]: returns its
    /// handle (the bigram node of b after a; `u64::MAX` when (a, b) has no children, where
    /// every [`Index::trigram_probs`] value is NaN) and an upper bound of those values, the
    /// largest count(a, b, v)/total(a, b) (1.0 where the body cannot be read).
    pub fn trigram_context(&self, a: u32, b: u32) -> (u64, f64) {
        self.resolve2(a, b).map_or((u64::MAX, 0.0), |(j, _, bound)| (j as u64, bound))
    }

    /// The bigram node of b after a, its children at the two-token level (a context with
    /// some) and the bound of [`Index::trigram_context`].
    fn resolve2(&self, a: u32, b: u32) -> Option<(usize, Ctx, f64)> {
        let j = self.node2_of(a, b)?;
        let c = self.l2().word(j).and_then(|w| self.ctx2(j, w)).filter(|c| c.e > c.s && c.total > 0)?;
        let bound = self.max_count(self.l3(), c, Sec::TopK2).map_or(1.0, |m| m as f64 / c.total as f64);
        Some((j, c, bound))
    }

    /// [`Index::trigram_probs`] of the context resolved by [`Index::trigram_context`]
    /// (`node` is its handle): the same values, without searching the context again.
    ///
    /// # Panics
    /// If `out.len() != candidates_sorted.len()` (a programming error of the caller).
    pub fn trigram_probs_at(&self, node: u64, candidates_sorted: &[u32], out: &mut [f64]) {
        let c = usize::try_from(node)
            .ok()
            .filter(|&j| (j as u64) < self.h.n_bigram)
            .and_then(|j| self.l2().word(j).and_then(|w| self.ctx2(j, w)))
            .filter(|c| c.e > c.s && c.total > 0);
        self.trigram_probs_of(c, candidates_sorted, out, "trigram_probs_at");
    }

    /// The two-token level's probabilities of the candidates after the resolved context `c`
    /// (NaN where not seen, and everywhere for None).
    fn trigram_probs_of(&self, c: Option<Ctx>, candidates_sorted: &[u32], out: &mut [f64], what: &str) {
        assert_eq!(out.len(), candidates_sorted.len(), "{what}: out and candidates differ in length");
        out.fill(f64::NAN);
        if let Some(c) = c {
            self.l3().seen_sorted(c, candidates_sorted, out);
        }
    }

    /// [`Index::trigram_context`] with the whole resolution as the handle: `[start, end,
    /// total]` of the context's children at the two-token level (`[0, 0, 0]` when (a, b) has
    /// none), for [`Index::trigram_probs_in`], which then looks nothing up but the candidates.
    /// (Re-deriving the range and total from the bigram node at each
    /// [`Index::trigram_probs_at`], two block lookups and often an escaped count's rank, cost
    /// ~17 k instructions per search on tools/bench_tree.py, real rows (690 k -> 673 k under
    /// cachegrind, ~53 calls); search CPU p50 min 98.0 -> 95.8 µs, median 99.5 -> 97.9 µs over
    /// 16 interleaved runs.)
    pub fn trigram_context_range(&self, a: u32, b: u32) -> ([u64; 3], f64) {
        self.resolve2(a, b).map_or(([0; 3], 0.0), |(_, c, bound)| ([c.s as u64, c.e as u64, c.total], bound))
    }

    /// [`Index::trigram_probs`] of the context whose [`Index::trigram_context_range`] is
    /// `range`: the same values. A range that is not one (outside the node array) reads as
    /// a context without children.
    ///
    /// # Panics
    /// If `out.len() != candidates_sorted.len()` (a programming error of the caller).
    pub fn trigram_probs_in(&self, range: [u64; 3], candidates_sorted: &[u32], out: &mut [f64]) {
        let [s, e, total] = range;
        let c = usize::try_from(s)
            .ok()
            .zip(usize::try_from(e).ok())
            .filter(|&(s, e)| e > s && total > 0)
            .map(|(s, e)| Ctx { s, e, total, large: None });
        self.trigram_probs_of(c, candidates_sorted, out, "trigram_probs_in");
    }

    /// [`Index::children`] for `n` two-token contexts on `pool`; rows of
    /// `min(k, max_children())` cells (the result's `k`), padded with token `u32::MAX`, count 0.
    /// An answer over [`MAX_BATCH_BYTES`] is an `InvalidOption` error.
    pub fn children_batch(&self, contexts: &[[u32; 2]], k: usize, pool: &rayon::ThreadPool) -> Result<BatchChildren>
    where
        D: Sync,
    {
        use rayon::prelude::*;
        for c in contexts {
            self.check_tokens(c)?;
        }
        let n = contexts.len();
        // Rows are as wide as the most any context can return, whatever `k` asks for; the
        // buffers are reserved fallibly and bounded, so an absurd request is an error, not an abort.
        let k = k.min(self.max_children());
        let cells = n.checked_mul(k).filter(|&c| c.saturating_mul(12) <= MAX_BATCH_BYTES).ok_or_else(|| {
            Error::InvalidOption(format!(
                "children_batch of {n} contexts × k = {k} would return more than {} GiB: split the contexts or lower k",
                MAX_BATCH_BYTES >> 30
            ))
        })?;
        let mut b = BatchChildren {
            k,
            tokens: filled(cells, u32::MAX)?,
            counts: filled(cells, 0)?,
            totals: filled(n, 0)?,
            orders: filled(n, 0)?,
        };
        if n == 0 || k == 0 {
            // still report totals/orders
            let mut ch = Children::new();
            for (i, c) in contexts.iter().enumerate() {
                let m = self.children(c, 0, &mut ch)?;
                b.totals[i] = m.total;
                b.orders[i] = m.order;
            }
            return Ok(b);
        }
        // ~0.3 µs per context: chunks of 32 keep the fork/join overhead (a few µs) amortised.
        const CHUNK: usize = 32;
        type Rows<'r> = (((&'r [[u32; 2]], &'r mut [u32]), &'r mut [u64]), (&'r mut [u64], &'r mut [u8]));
        let run = |(((ctx, tok), cnt), (tot, ord)): Rows<'_>| -> Result<()> {
            let mut ch = Children::with_capacity(k);
            for (i, c) in ctx.iter().enumerate() {
                let m = self.children(c, k, &mut ch)?;
                tok[i * k..i * k + ch.len()].copy_from_slice(ch.tokens());
                cnt[i * k..i * k + ch.len()].copy_from_slice(ch.counts());
                tot[i] = m.total;
                ord[i] = m.order;
            }
            Ok(())
        };
        let BatchChildren { tokens, counts, totals, orders, .. } = &mut b;
        let work = contexts
            .par_chunks(CHUNK)
            .zip(tokens.par_chunks_mut(CHUNK * k))
            .zip(counts.par_chunks_mut(CHUNK * k))
            .zip(totals.par_chunks_mut(CHUNK).zip(orders.par_chunks_mut(CHUNK)));
        if n <= CHUNK {
            // one chunk: running it here is cheaper than a hand-off to the pool
            run((((contexts, &mut tokens[..]), &mut counts[..]), (&mut totals[..], &mut orders[..])))?;
        } else {
            pool.install(|| work.try_for_each(run))?;
        }
        Ok(b)
    }

    /// Size figures (O(1)).
    pub fn stats(&self) -> Stats {
        let h = &self.h;
        let nodes = h.n_unigram + h.n_bigram + h.n_trigram;
        let bytes = self.data.as_ref().len() as u64;
        Stats {
            vocab_size: h.vocab_size,
            token_bits: h.token_bits,
            documents: h.documents,
            tokens: h.tokens,
            unigram_nodes: h.n_unigram,
            bigram_nodes: h.n_bigram,
            trigram_nodes: h.n_trigram,
            nodes,
            bytes,
            bytes_per_node: if nodes > 0 { bytes as f64 / nodes as f64 } else { 0.0 },
            escaped_counts: h.n_esc2 + h.n_esc3,
            large_contexts: h.n_large1 + h.n_large2,
            sections: SECTIONS.iter().zip(self.sec.iter()).map(|(s, r)| (s.name(), r.len() as u64)).collect(),
        }
    }

    /// Full check of the body: section CRCs and every structural invariant (sorted children,
    /// token ids, ranges, escape ranks, totals, top-k tables). O(file size).
    pub fn verify(&self) -> Result<()> {
        crate::reader_verify::verify(self)
    }

    /// The check of `level` ([`Verify`]); `Header` has nothing to add to what opening did.
    pub fn check(&self, level: Verify) -> Result<()> {
        match level {
            Verify::Header => Ok(()),
            Verify::Quick => crate::reader_verify::quick(self),
            Verify::Full => crate::reader_verify::verify(self),
        }
    }

    /// The most children any query can return: the number of distinct tokens seen (every
    /// child of every context is one of them). Bounds the `k` of [`Index::children`].
    pub fn max_children(&self) -> usize {
        self.h.n_unigram as usize
    }

    // ---- accessors for verify ----
    pub(crate) fn section(&self, s: Sec) -> &[u8] {
        self.s(s)
    }
    pub(crate) fn section_crc_ok(&self, i: usize) -> Option<bool> {
        let (_, secs) = format::parse(self.data.as_ref()).ok()?;
        Some(crc32fast::hash(&self.data.as_ref()[self.sec[i].clone()]) == secs[i].crc)
    }
    pub(crate) fn level_view(&self, level: u8) -> (usize, u32, u32) {
        let l = if level == 2 { self.l2() } else { self.l3() };
        (l.len(), l.cb, l.esc_code)
    }
    pub(crate) fn ctx1_pub(&self, a: u32) -> Option<(usize, usize, u64, Option<usize>)> {
        self.ctx1(a).map(|c| (c.s, c.e, c.total, c.large))
    }
    pub(crate) fn ctx2_pub(&self, j: usize) -> Option<(usize, usize, u64, Option<usize>)> {
        let w = self.l2().word(j)?;
        self.ctx2(j, w).map(|c| (c.s, c.e, c.total, c.large))
    }
    pub(crate) fn decode_all(&self, level: u8, s: usize, e: usize, f: impl FnMut(u32, u64)) {
        let l = if level == 2 { self.l2() } else { self.l3() };
        l.decode(s, e, f)
    }
    /// The count of token `t` among the nodes `s..e` of `level`, if it is there.
    pub(crate) fn find_pub(&self, level: u8, s: usize, e: usize, t: u32) -> Option<u64> {
        let l = if level == 2 { self.l2() } else { self.l3() };
        let j = l.find(s, e, t)?;
        Some(l.count_of(j, l.word(j)?))
    }
    pub(crate) fn topk_row_pub(&self, sec: Sec, r: usize, out: &mut Children) -> Result<()> {
        out.clear();
        let lv = if sec == Sec::TopK1 { self.l2() } else { self.l3() };
        self.topk(lv, Ctx { s: 0, e: TOPK_K + 1, total: 0, large: Some(r) }, sec, TOPK_K, out)
    }
    pub(crate) fn uni_count_pub(&self, t: u32) -> u64 {
        self.uni_count(t)
    }
}
