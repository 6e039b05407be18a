//! Run files: a builder's sorted, aggregated (key, count) pairs on disk, and the key layout
//! they share with the writer (`(a, b, c)` packed in 21 bits each, END for "no token").

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{self, MAX_TOKEN_BITS};

pub(super) const F: u32 = MAX_TOKEN_BITS;
pub(crate) const END: u64 = (1 << F) - 1;
pub(super) const FMASK: u64 = (1 << F) - 1;
const RUN_MAGIC: [u8; 8] = *b"DARTRUN1";
const RUN_HEADER: usize = 64;
const RUN_VERSION: u32 = 1;

#[inline]
pub(crate) fn key(a: u32, b: u64, c: u64) -> u64 {
    ((a as u64) << (2 * F)) | (b << F) | c
}

pub(crate) fn write_run(
    path: &Path,
    vocab: u32,
    documents: u64,
    pairs: impl Iterator<Item = (u64, u64)>,
) -> Result<()> {
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
pub(super) struct RunReader {
    path: PathBuf,
    r: BufReader<File>,
    left: u64,
    crc: crc32fast::Hasher,
    vocab: u32,
    pub(super) documents: u64,
    pub(super) tokens: u64,
    /// Opened by `open_range`: the whole-file checksum is not checked at the end.
    ranged: bool,
}

impl RunReader {
    /// A merge takes runs of one vocabulary only.
    pub(super) fn check_vocab(&self, path: &Path, vocab_size: u32) -> Result<()> {
        if self.vocab != vocab_size {
            return Err(Error::Run {
                path: path.to_path_buf(),
                reason: format!("built for vocab_size {}, this merge uses {}", self.vocab, vocab_size),
            });
        }
        Ok(())
    }
    pub(super) fn open(path: &Path, buf: usize) -> Result<Self> {
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
            return Err(bad(format!(
                "run version {} / key width {}, this build reads {RUN_VERSION} / {F}",
                g32(8),
                g32(12)
            )));
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

    pub(super) fn next(&mut self) -> Result<Option<(u64, u64)>> {
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
    pub(super) fn open_range(path: &Path, buf: usize, lo: u64, hi: u64) -> Result<Self> {
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
