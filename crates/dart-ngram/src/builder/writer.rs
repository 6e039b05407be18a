//! [`IndexWriter`]: sorted (key, count) pairs → the sections of an index file, assembled and
//! renamed over the output.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::builder::files::{parent_dir, stale, PARTIAL_PREFIX, SECTIONS_PREFIX};
use crate::builder::options::{BuildOptions, BuildSummary};
use crate::builder::runs::{END, F, FMASK};
use crate::error::{Error, Result};
use crate::format::{self, Header, Sec, Section, BLOCK, HEADER_LEN, SECTIONS, SECTION_ENTRY_LEN, TOPK_K};

/// One section being written to its own temporary file. Writes are gathered in a 64 KiB
/// buffer and checksummed per buffer: per-word `write_all` + CRC cost ~30 % of a build.
struct SecFile {
    f: File,
    buf: Vec<u8>,
    len: u64,
    crc: crc32fast::Hasher,
}

impl SecFile {
    pub(super) fn new(f: File) -> Self {
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
    pub(super) fn finish(mut self) -> std::io::Result<(File, u64, u32)> {
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
pub(super) struct IndexWriter {
    dir: tempfile::TempDir,
    /// Held while `dir` exists (see [`stale`]).
    _dir_lock: File,
    token_bits: u32,
    cb: u32,
    esc_code: u32,
    vocab: u32,
    min_count: u64,
    cap: Option<usize>,
    pub(super) tokens: u64,
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
    pub(super) fn new(opts: &BuildOptions, output: &Path) -> Result<Self> {
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
    pub(super) fn push(&mut self, key: u64, count: u64) -> Result<()> {
        if self.last_key.is_some_and(|k| k >= key) {
            return Err(Error::format("builder input is not sorted (internal error)"));
        }
        self.last_key = Some(key);
        let a = (key >> (2 * F)) as u32;
        let b = (key >> F) & FMASK;
        let c = key & FMASK;
        if a >= self.vocab
            || (b != END && b >= self.vocab as u64)
            || (c != END && c >= self.vocab as u64)
            || (b == END && c != END)
        {
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
        let Some(mut acc) = self.acc.take() else {
            return Ok(());
        };
        if acc.count < self.min_count {
            return Ok(());
        }
        if let Some(cap) = self.cap {
            cap_children(&mut acc.kids, cap);
            let from = self.staged_kids.len();
            self.staged_kids.extend_from_slice(&acc.kids);
            self.staged.push(Staged {
                b: acc.b as u32,
                count: acc.count,
                total: acc.total,
                from,
                to: self.staged_kids.len(),
            });
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
        if j.is_multiple_of(BLOCK as u64) {
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
            if self.n_trigram.is_multiple_of(BLOCK as u64) {
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

    pub(super) fn finish(mut self, output: &Path, metadata_json: &str, documents: u64) -> Result<BuildSummary> {
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
                        return Err(Error::format(format!(
                            "internal: section {} short by {} bytes",
                            s.name(),
                            secs[i].len - n
                        )));
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
