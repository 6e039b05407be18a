//! Format v1 constants, header and section table (the normative text is `FORMAT.md`).
//!
//! Everything is little-endian. Parsing here is O(1) in the size of the body: it reads the
//! 256-byte header and the section table, checks their CRCs, and checks that every section
//! lies inside the file and has exactly the length implied by the header counts. The body is
//! only checked by [`crate::Index::verify`]; the reader never trusts it for memory safety
//! (every body read is bounds-checked and degrades to "not found" / a format error).

use crate::error::{Error, Result};

/// File magic.
pub const MAGIC: [u8; 8] = *b"DARTNGRM";
/// The version this build writes and reads.
pub const VERSION: u32 = 1;
/// Fixed header length in bytes.
pub const HEADER_LEN: usize = 256;
/// Bytes of one section-table entry.
pub const SECTION_ENTRY_LEN: usize = 32;
/// Contexts with more than `TOPK_K` children carry a precomputed top-`TOPK_K` permutation.
pub const TOPK_K: usize = 32;
/// Nodes per rank block (escape ranks, large-context and end-count bitmaps).
pub const BLOCK: usize = 64;
/// Bytes of one level-3 block record: base, large_bits, large_rank, ends_bits, ends_rank,
/// wide (u64 each; wide = u64::MAX when the block's deltas fit u16).
pub const BLOCK3_LEN: usize = 48;
/// Bytes of one top-K row: escape base u64 + K node words.
pub const TOPK_ROW: usize = 8 + 4 * TOPK_K;
/// `Verify::Quick` checks the CRC of every section of at most this many bytes (a CRC covers a
/// whole section, so a larger one would cost a read of all of it).
pub const QUICK_CRC_BYTES: u64 = 16 << 20;
/// `Verify::Quick` checks this many sampled places (a context, or a window of
/// [`QUICK_WINDOW`] nodes of a larger one) per large section.
pub const QUICK_SAMPLES: usize = 1024;
/// Nodes checked around one sampled place of a context larger than this.
pub const QUICK_WINDOW: usize = 256;
/// The largest token width the builder supports (3 × 21 bits fit one u64 sort key).
pub const MAX_TOKEN_BITS: u32 = 21;

/// Section ids, in file order.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sec {
    Meta = 1,
    Uni = 2,
    UniOrder = 3,
    L2Nodes = 4,
    L2EscRank = 5,
    L2Esc = 6,
    L3Blocks = 7,
    L3Delta = 8,
    L3Nodes = 9,
    L3EscRank = 10,
    L3Esc = 11,
    Ends = 12,
    TopK1 = 13,
    TopK2 = 14,
    TopKEsc = 15,
    L3Wide = 16,
}

/// All sections in file order.
pub const SECTIONS: [Sec; 16] = [
    Sec::Meta,
    Sec::Uni,
    Sec::UniOrder,
    Sec::L2Nodes,
    Sec::L2EscRank,
    Sec::L2Esc,
    Sec::L3Blocks,
    Sec::L3Delta,
    Sec::L3Nodes,
    Sec::L3EscRank,
    Sec::L3Esc,
    Sec::Ends,
    Sec::TopK1,
    Sec::TopK2,
    Sec::TopKEsc,
    Sec::L3Wide,
];

/// Bytes of one UNI record: l2_start u64, count u64, total u64, n_children u32, large u32.
/// One record per token plus a sentinel; 32 bytes and a 64-aligned section, so the whole
/// one-token context is one cache line (measured: 3 separate arrays cost ~3 misses).
pub const UNI_LEN: usize = 32;

impl Sec {
    pub fn name(self) -> &'static str {
        match self {
            Sec::Meta => "META",
            Sec::Uni => "UNI",
            Sec::UniOrder => "UNI_ORDER",
            Sec::L2Nodes => "L2_NODES",
            Sec::L2EscRank => "L2_ESC_RANK",
            Sec::L2Esc => "L2_ESC",
            Sec::L3Blocks => "L3_BLOCKS",
            Sec::L3Delta => "L3_DELTA",
            Sec::L3Nodes => "L3_NODES",
            Sec::L3EscRank => "L3_ESC_RANK",
            Sec::L3Esc => "L3_ESC",
            Sec::Ends => "ENDS",
            Sec::TopK1 => "TOPK1",
            Sec::TopK2 => "TOPK2",
            Sec::TopKEsc => "TOPK_ESC",
            Sec::L3Wide => "L3_WIDE",
        }
    }
    /// Required alignment of the section's offset.
    pub fn align(self) -> u64 {
        match self {
            Sec::Uni => 64,
            _ => 8,
        }
    }
}

/// The fixed header (256 bytes; layout in FORMAT.md).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub token_bits: u32,
    pub vocab_size: u32,
    pub documents: u64,
    pub tokens: u64,
    pub n_unigram: u64,
    pub n_bigram: u64,
    pub n_trigram: u64,
    pub n_esc2: u64,
    pub n_esc3: u64,
    pub n_ends: u64,
    pub n_large1: u64,
    pub n_large2: u64,
    pub file_len: u64,
    pub table_crc: u32,
    pub n_wide: u64,
    pub n_topk_esc: u64,
}

/// One section-table entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Section {
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
}

/// Number of rank blocks covering `n` nodes (plus one sentinel is stored).
pub fn blocks(n: u64) -> u64 {
    n.div_ceil(BLOCK as u64)
}

impl Header {
    /// Bits of the count code in a node word.
    pub fn count_bits(&self) -> u32 {
        32 - self.token_bits
    }
    /// The escape code: the count is in the ESC table.
    pub fn esc_code(&self) -> u32 {
        (1u32 << self.count_bits()) - 1
    }

    /// Exact byte length each section must have.
    pub fn expected_len(&self, s: Sec, meta_len: u64) -> Option<u64> {
        let v = self.vocab_size as u64;
        let l = match s {
            Sec::Meta => meta_len,
            Sec::Uni => (v + 1).checked_mul(UNI_LEN as u64)?,
            Sec::UniOrder => self.n_unigram.checked_mul(4)?,
            Sec::L2Nodes => self.n_bigram.checked_mul(4)?,
            Sec::L3Delta => self.n_bigram.checked_mul(2)?,
            Sec::L3Wide => self.n_wide.checked_mul(4 * BLOCK as u64)?,
            Sec::TopKEsc => self.n_topk_esc.checked_mul(8)?,
            Sec::L2EscRank => (blocks(self.n_bigram) + 1).checked_mul(8)?,
            Sec::L2Esc => self.n_esc2.checked_mul(8)?,
            Sec::L3Blocks => (blocks(self.n_bigram) + 1).checked_mul(BLOCK3_LEN as u64)?,
            Sec::L3Nodes => self.n_trigram.checked_mul(4)?,
            Sec::L3EscRank => (blocks(self.n_trigram) + 1).checked_mul(8)?,
            Sec::L3Esc => self.n_esc3.checked_mul(8)?,
            Sec::Ends => self.n_ends.checked_mul(8)?,
            Sec::TopK1 => self.n_large1.checked_mul(TOPK_ROW as u64)?,
            Sec::TopK2 => self.n_large2.checked_mul(TOPK_ROW as u64)?,
        };
        Some(l)
    }

    /// Serialise (the CRC of bytes 0..252 is stored at 252).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&MAGIC);
        put32(&mut h, 8, VERSION);
        put32(&mut h, 12, HEADER_LEN as u32);
        put32(&mut h, 16, self.token_bits);
        put32(&mut h, 20, self.vocab_size);
        put32(&mut h, 24, TOPK_K as u32);
        put32(&mut h, 28, SECTIONS.len() as u32);
        put64(&mut h, 32, HEADER_LEN as u64);
        put64(&mut h, 40, self.documents);
        put64(&mut h, 48, self.tokens);
        put64(&mut h, 56, self.n_unigram);
        put64(&mut h, 64, self.n_bigram);
        put64(&mut h, 72, self.n_trigram);
        put64(&mut h, 80, self.n_esc2);
        put64(&mut h, 88, self.n_esc3);
        put64(&mut h, 96, self.n_ends);
        put64(&mut h, 104, self.n_large1);
        put64(&mut h, 112, self.n_large2);
        put64(&mut h, 120, self.file_len);
        put32(&mut h, 128, self.table_crc);
        put32(&mut h, 132, BLOCK as u32);
        put64(&mut h, 136, self.n_wide);
        put64(&mut h, 144, self.n_topk_esc);
        let crc = crc32fast::hash(&h[..252]);
        put32(&mut h, 252, crc);
        h
    }
}

pub(crate) fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
#[inline]
pub(crate) fn get32(b: &[u8], off: usize) -> Option<u32> {
    let s = b.get(off..off.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}
#[inline]
pub(crate) fn get64(b: &[u8], off: usize) -> Option<u64> {
    let s = b.get(off..off.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

/// Encode the section table.
pub fn encode_table(sections: &[Section]) -> Vec<u8> {
    let mut t = vec![0u8; sections.len() * SECTION_ENTRY_LEN];
    for (i, (s, id)) in sections.iter().zip(SECTIONS).enumerate() {
        let o = i * SECTION_ENTRY_LEN;
        put32(&mut t, o, id as u32);
        put64(&mut t, o + 8, s.offset);
        put64(&mut t, o + 16, s.len);
        put32(&mut t, o + 24, s.crc);
    }
    t
}

/// Parse and check header + section table. O(1): reads at most 256 + 17·32 bytes.
pub fn parse(data: &[u8]) -> Result<(Header, Vec<Section>)> {
    fn fmt(m: impl Into<String>) -> Error {
        Error::format(m)
    }
    if data.len() < 8 || data[..8] != MAGIC {
        return Err(fmt(
            "wrong magic: this is not a dartcore trigram index (expected 'DARTNGRM'); build one with ngram-build",
        ));
    }
    if data.len() < HEADER_LEN {
        return Err(fmt(format!("truncated: {} bytes, the header alone is {HEADER_LEN}", data.len())));
    }
    let h = &data[..HEADER_LEN];
    let version = get32(h, 8).unwrap_or(0);
    if version != VERSION {
        return Err(fmt(format!("index version {version}, this build reads {VERSION}: rebuild the index with ngram-build or upgrade dartcore")));
    }
    let crc = crc32fast::hash(&h[..252]);
    if get32(h, 252) != Some(crc) {
        return Err(fmt("header checksum mismatch: the file is corrupt"));
    }
    let g32 = |o| get32(h, o).unwrap_or(0);
    let g64 = |o| get64(h, o).unwrap_or(0);
    if g32(12) as usize != HEADER_LEN || g32(24) as usize != TOPK_K || g32(132) as usize != BLOCK {
        return Err(fmt("unsupported header layout (header length, top-k width or block size)"));
    }
    let nsec = g32(28) as usize;
    if nsec != SECTIONS.len() || g64(32) != HEADER_LEN as u64 {
        return Err(fmt(format!("section table: {nsec} sections, expected {}", SECTIONS.len())));
    }
    let hd = Header {
        token_bits: g32(16),
        vocab_size: g32(20),
        documents: g64(40),
        tokens: g64(48),
        n_unigram: g64(56),
        n_bigram: g64(64),
        n_trigram: g64(72),
        n_esc2: g64(80),
        n_esc3: g64(88),
        n_ends: g64(96),
        n_large1: g64(104),
        n_large2: g64(112),
        file_len: g64(120),
        table_crc: g32(128),
        n_wide: g64(136),
        n_topk_esc: g64(144),
    };
    if hd.token_bits == 0 || hd.token_bits > MAX_TOKEN_BITS {
        return Err(fmt(format!("token width {} bits is outside 1..={MAX_TOKEN_BITS}", hd.token_bits)));
    }
    if hd.vocab_size == 0 || (hd.vocab_size as u64) > (1u64 << hd.token_bits) {
        return Err(fmt(format!("vocabulary size {} does not fit {} token bits", hd.vocab_size, hd.token_bits)));
    }
    if hd.file_len != data.len() as u64 {
        return Err(fmt(format!("truncated or extended: header says {} bytes, file has {}", hd.file_len, data.len())));
    }
    if hd.n_unigram > hd.vocab_size as u64
        || hd.n_large1 > hd.vocab_size as u64
        || hd.n_esc2 > hd.n_bigram
        || hd.n_esc3 > hd.n_trigram
        || hd.n_ends > hd.n_bigram
        || hd.n_large2 > hd.n_bigram
        || hd.n_wide > blocks(hd.n_bigram)
        || hd.n_topk_esc > (hd.n_large1 + hd.n_large2).saturating_mul(TOPK_K as u64)
    {
        return Err(fmt("inconsistent node counts in the header"));
    }
    let tend = HEADER_LEN + nsec * SECTION_ENTRY_LEN;
    let table = data.get(HEADER_LEN..tend).ok_or_else(|| fmt("truncated section table"))?;
    if crc32fast::hash(table) != hd.table_crc {
        return Err(fmt("section table checksum mismatch: the file is corrupt"));
    }
    let mut secs = Vec::with_capacity(nsec);
    let mut prev_end = tend as u64;
    for (i, id) in SECTIONS.iter().enumerate() {
        let o = i * SECTION_ENTRY_LEN;
        let sid = get32(table, o).unwrap_or(0);
        if sid != *id as u32 {
            return Err(fmt(format!("section {i} has id {sid}, expected {} ({})", *id as u32, id.name())));
        }
        let s = Section {
            offset: get64(table, o + 8).unwrap_or(0),
            len: get64(table, o + 16).unwrap_or(0),
            crc: get32(table, o + 24).unwrap_or(0),
        };
        let end = s.offset.checked_add(s.len).ok_or_else(|| fmt("section bounds overflow"))?;
        if s.offset < prev_end || !s.offset.is_multiple_of(id.align()) || end > data.len() as u64 {
            return Err(fmt(format!(
                "section {} [{}, {end}) is out of bounds, misaligned or overlapping (file has {} bytes)",
                id.name(),
                s.offset,
                data.len()
            )));
        }
        let meta_len = if *id == Sec::Meta { s.len } else { 0 };
        if hd.expected_len(*id, meta_len) != Some(s.len) {
            return Err(fmt(format!(
                "section {} has {} bytes, the header implies {:?}",
                id.name(),
                s.len,
                hd.expected_len(*id, meta_len)
            )));
        }
        prev_end = end;
        secs.push(s);
    }
    Ok((hd, secs))
}
