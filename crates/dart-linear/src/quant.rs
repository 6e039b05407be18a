//! GGML block formats (the weights of a GGUF file), read as they are stored: rows of `k / 32`
//! blocks of 32 weights each, every block its fp16 scale(s) and the quantised values.
//!
//! | format | block bytes | weight `i` of a block |
//! |---|---|---|
//! | Q4_0 | 18: `d` f16, 16 bytes | `d · (q_i − 8)`, `q_i` = low nibble of byte `i` (i < 16), high nibble of byte `i − 16` |
//! | Q4_1 | 20: `d`, `m` f16, 16 bytes | `d · q_i + m` (nibbles as Q4_0) |
//! | Q8_0 | 34: `d` f16, 32 i8 | `d · q_i` |
//!
//! The value of each weight is what the `gguf` package's numpy dequantiser computes: the fp16
//! scales widened to f32 (exact), the integer converted to f32 (exact), then an f32 multiply and
//! (Q4_1) a separate f32 add -- two roundings. [`dequantize`] writes those values; the kernel
//! ([`crate::linear`]) forms the same values in registers, so a product over block weights is
//! bit for bit the product over their f32 values.
//!
//! The kernel streams the blocks in a *packed* layout ([`pack`]): the same bytes, each row
//! reordered as its blocks' fp16 scales (`d`, or `d, m` for Q4_1, block after block) followed
//! by their quantised bytes (16 or 32 per block, block after block), so a row is exactly as
//! many bytes as in the file. The kernel widens a row's scales sixteen at a time into a
//! small f32 buffer and reaches every vector lane with a broadcast load from it, instead of
//! a shuffle and a conversion per scale per block: on AVX-512 those were most of the work
//! (shuffle-port instructions per Q4_1 block 7 -> 3).
//!
//! The product `d · q` is exact in f32 in every format (an fp16 scale has at most 11
//! significant bits, `q` at most 8, and the product's exponent stays in f32's normal range),
//! so `d · q + m` rounded once (a fused multiply-add) equals the reference's multiply and
//! separate add: the kernel uses the fused form.

use crate::ShapeError;

/// Weights per block in every format here.
pub const BLOCK_WEIGHTS: usize = 32;

/// A GGML block format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Format {
    /// Bytes per block of 32 weights.
    pub const fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
        }
    }

    /// Bytes of a block's scales (`d`, or `d, m`: fp16 each).
    pub const fn scale_bytes(self) -> usize {
        if matches!(self, Format::Q4_1) {
            4
        } else {
            2
        }
    }

    /// `"q4_0"`, `"q4_1"`, `"q8_0"`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Q4_0 => "q4_0",
            Format::Q4_1 => "q4_1",
            Format::Q8_0 => "q8_0",
        }
    }

    /// The format of a name ([`Format::name`], any case).
    pub fn from_name(name: &str) -> Option<Format> {
        [Format::Q4_0, Format::Q4_1, Format::Q8_0].into_iter().find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of one row of `k` weights; an error unless `k` is a whole number of blocks.
    pub fn row_bytes(self, k: usize) -> Result<usize, ShapeError> {
        if k == 0 || !k.is_multiple_of(BLOCK_WEIGHTS) {
            return Err(ShapeError(format!(
                "{}: rows of {k} weights are not a whole number of {BLOCK_WEIGHTS}-weight blocks",
                self.name()
            )));
        }
        Ok(k / BLOCK_WEIGHTS * self.block_bytes())
    }

    /// Checks that `bytes` holds `n` rows of `k` weights.
    pub fn check(self, bytes: usize, n: usize, k: usize) -> Result<(), ShapeError> {
        let row = self.row_bytes(k)?;
        if Some(bytes) != row.checked_mul(n) {
            return Err(ShapeError(format!(
                "{}: w has {bytes} bytes, expected {n} rows x {} blocks x {} bytes = {}",
                self.name(),
                k / BLOCK_WEIGHTS,
                self.block_bytes(),
                n.saturating_mul(row)
            )));
        }
        Ok(())
    }
}

/// IEEE binary16 bits widened to f32 (exact; infinities and NaNs kept).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // subnormal: man · 2^-24, normalised
            let shift = man.leading_zeros() - 21; // bring the top set bit to bit 10
            let man = (man << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (man << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// The f32 values of one block (see the module docs).
#[inline]
pub fn dequantize_block(format: Format, block: &[u8], out: &mut [f32; BLOCK_WEIGHTS]) {
    let d = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
    match format {
        Format::Q4_0 => {
            let qs = &block[2..18];
            for i in 0..16 {
                out[i] = d * ((qs[i] & 0x0f) as i32 - 8) as f32;
                out[i + 16] = d * ((qs[i] >> 4) as i32 - 8) as f32;
            }
        }
        Format::Q4_1 => {
            let m = f16_to_f32(u16::from_le_bytes([block[2], block[3]]));
            let qs = &block[4..20];
            for i in 0..16 {
                out[i] = d * (qs[i] & 0x0f) as f32 + m;
                out[i + 16] = d * (qs[i] >> 4) as f32 + m;
            }
        }
        Format::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
    }
}

/// The f32 values of `n` rows of `k` block weights (`bytes`) into `out` (`[n, k]`).
pub fn dequantize(format: Format, bytes: &[u8], n: usize, k: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    format.check(bytes.len(), n, k)?;
    if Some(out.len()) != n.checked_mul(k) {
        return Err(ShapeError(format!("dequantize: out has {} elements, expected {n} x {k}", out.len())));
    }
    let mut block = [0f32; BLOCK_WEIGHTS];
    for (b, o) in bytes.chunks_exact(format.block_bytes()).zip(out.chunks_exact_mut(BLOCK_WEIGHTS)) {
        dequantize_block(format, b, &mut block);
        o.copy_from_slice(&block);
    }
    Ok(())
}

/// `n` rows of `k` weights' blocks as the file stores them (`file`) in the packed layout
/// (`out`, the same number of bytes; see the module docs).
pub fn pack(format: Format, file: &[u8], n: usize, k: usize, out: &mut [u8]) -> Result<(), ShapeError> {
    format.check(file.len(), n, k)?;
    if out.len() != file.len() {
        return Err(ShapeError(format!(
            "pack {}: out has {} bytes, the blocks {}",
            format.name(),
            out.len(),
            file.len()
        )));
    }
    let (bb, sb, nb) = (format.block_bytes(), format.scale_bytes(), k / BLOCK_WEIGHTS);
    let row = nb * bb;
    for (f, o) in file.chunks_exact(row).zip(out.chunks_exact_mut(row)) {
        let (scales, quants) = o.split_at_mut(nb * sb);
        for ((b, s), q) in f.chunks_exact(bb).zip(scales.chunks_exact_mut(sb)).zip(quants.chunks_exact_mut(bb - sb)) {
            s.copy_from_slice(&b[..sb]);
            q.copy_from_slice(&b[sb..]);
        }
    }
    Ok(())
}

/// [`pack`] into a new buffer.
pub fn pack_vec(format: Format, file: &[u8], n: usize, k: usize) -> Result<Vec<u8>, ShapeError> {
    let mut out = vec![0u8; file.len()];
    pack(format, file, n, k, &mut out)?;
    Ok(out)
}

/// The f32 values of `n` packed rows of `k` block weights (`bytes`) into `out` (`[n, k]`):
/// the values of the file's blocks they were packed from.
pub fn dequantize_packed(format: Format, bytes: &[u8], n: usize, k: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    format.check(bytes.len(), n, k)?;
    if Some(out.len()) != n.checked_mul(k) {
        return Err(ShapeError(format!("dequantize: out has {} elements, expected {n} x {k}", out.len())));
    }
    let (bb, sb, nb) = (format.block_bytes(), format.scale_bytes(), k / BLOCK_WEIGHTS);
    let mut file = vec![0u8; bb];
    let mut block = [0f32; BLOCK_WEIGHTS];
    for (row, o) in bytes.chunks_exact(nb * bb).zip(out.chunks_exact_mut(k)) {
        let (scales, quants) = row.split_at(nb * sb);
        for ((s, q), ob) in
            scales.chunks_exact(sb).zip(quants.chunks_exact(bb - sb)).zip(o.chunks_exact_mut(BLOCK_WEIGHTS))
        {
            file[..sb].copy_from_slice(s);
            file[sb..].copy_from_slice(q);
            dequantize_block(format, &file, &mut block);
            ob.copy_from_slice(&block);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_is_exact_for_every_pattern() {
        for h in 0..=u16::MAX {
            let v = f16_to_f32(h);
            let (e, m) = ((h >> 10) & 0x1f, (h & 0x3ff) as f64);
            let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
            let want = match e {
                0 => sign * m * 2f64.powi(-24),
                0x1f if m == 0.0 => sign * f64::INFINITY,
                0x1f => f64::NAN,
                _ => sign * (1.0 + m / 1024.0) * 2f64.powi(e as i32 - 15),
            };
            if want.is_nan() {
                assert!(v.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(v as f64, want, "{h:#06x}");
                assert_eq!(v.is_sign_negative(), h >> 15 == 1, "{h:#06x}");
            }
        }
    }

    #[test]
    fn blocks_decode_as_documented() {
        // d = 0.5 (0x3800), m = -1.0 (0xbc00); byte i = i | (15 - i) << 4
        let qs: Vec<u8> = (0..16u8).map(|i| i | ((15 - i) << 4)).collect();
        let mut out = [0f32; 32];
        let q41: Vec<u8> = [0x00, 0x38, 0x00, 0xbc].into_iter().chain(qs.iter().copied()).collect();
        dequantize_block(Format::Q4_1, &q41, &mut out);
        for i in 0..16 {
            assert_eq!(out[i], 0.5 * i as f32 - 1.0);
            assert_eq!(out[i + 16], 0.5 * (15 - i) as f32 - 1.0);
        }
        let q40: Vec<u8> = [0x00, 0x38].into_iter().chain(qs.iter().copied()).collect();
        dequantize_block(Format::Q4_0, &q40, &mut out);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[15], 3.5);
        assert_eq!(out[16], 3.5);
        let q80: Vec<u8> = [0x00, 0x38].into_iter().chain((0..32).map(|i| (i as i8 - 16) as u8)).collect();
        dequantize_block(Format::Q8_0, &q80, &mut out);
        assert!((0..32).all(|i| out[i] == 0.5 * (i as f32 - 16.0)));
    }

    #[test]
    fn packed_blocks_hold_the_same_values() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        };
        for f in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            let (n, k) = (3, 96);
            let file: Vec<u8> = (0..n * f.row_bytes(k).unwrap()).map(|_| next()).collect();
            let packed = pack_vec(f, &file, n, k).unwrap();
            assert_eq!(packed.len(), file.len());
            assert_ne!(packed, file);
            let (mut a, mut b) = (vec![0f32; n * k], vec![0f32; n * k]);
            dequantize(f, &file, n, k, &mut a).unwrap();
            dequantize_packed(f, &packed, n, k, &mut b).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())), "{f:?}");
            // the first block's scales lead the row, its quants follow all of the row's scales
            let sb = f.scale_bytes();
            assert_eq!(packed[..sb], file[..sb]);
            assert_eq!(packed[3 * sb..3 * sb + 4], file[sb..sb + 4]);
            assert!(pack(f, &file[1..], n, k, &mut vec![0u8; packed.len() - 1]).is_err());
            assert!(pack(f, &file, n, k, &mut vec![0u8; packed.len() - 1]).unwrap_err().0.contains("out"));
            assert!(pack_vec(f, &file, n, k + 32).is_err());
        }
    }

    #[test]
    fn a_scaled_quant_is_exact_so_one_rounding_equals_two() {
        // d · q is exact in f32 for every fp16 d and every quant q, so fma(d, q, m) equals the
        // reference's (d · q) + m rounded twice (the kernel's fused form).
        let qs: Vec<f32> = (-128..128).map(|q| q as f32).collect();
        for h in (0..=u16::MAX).step_by(7) {
            let d = f16_to_f32(h);
            if !d.is_finite() {
                continue;
            }
            let m = f16_to_f32(h.rotate_left(5));
            for &q in &qs {
                assert_eq!((d as f64 * q as f64) as f32 as f64, d as f64 * q as f64, "{h:#06x} {q}");
                if (0.0..16.0).contains(&q) && m.is_finite() {
                    assert_eq!(d.mul_add(q, m).to_bits(), (d * q + m).to_bits(), "{h:#06x} {q}");
                }
            }
        }
    }

    #[test]
    fn shapes_that_are_not_whole_blocks_are_errors() {
        assert!(Format::Q4_1.row_bytes(576).is_ok());
        assert!(Format::Q4_1.row_bytes(40).unwrap_err().0.contains("whole number"));
        assert!(Format::Q4_1.row_bytes(0).is_err());
        assert!(Format::Q8_0.check(34 * 2 * 3, 3, 64).is_ok());
        assert!(Format::Q8_0.check(34 * 2 * 3 - 1, 3, 64).unwrap_err().0.contains("bytes"));
        let mut out = vec![0f32; 64];
        assert!(dequantize(Format::Q4_0, &[0u8; 36], 1, 64, &mut out[..63]).is_err());
        assert!(dequantize(Format::Q4_0, &[0u8; 36], 1, 64, &mut out).is_ok());
        assert_eq!(Format::from_name("Q4_1"), Some(Format::Q4_1));
        assert_eq!(Format::from_name("q5_0"), None);
    }
}
