//! Chosen rows of a GGML block weight as f32 (an embedding table's lookups): only the asked
//! rows' blocks are read, from the file's layout, the packed one ([`quant::pack`]) or the
//! integer path's interleaved one ([`int8::interleave`]); each row's values are
//! [`quant::dequantize`]'s of the file's bytes, bit for bit.

use crate::int8::{self, GROUP};
use crate::quant::{self, Format};
use crate::ShapeError;

/// How a block weight's rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// As the GGUF file stores them.
    File,
    /// [`quant::pack`]'s layout.
    Packed,
    /// [`int8::interleave`]'s layout (whole groups of [`GROUP`] rows).
    Interleaved,
}

/// Rows `ids` of a weight of `held` stored rows of `k` weights (`bytes` in `layout`; for
/// [`Layout::Interleaved`] the padded rows, a whole number of groups) into `out`
/// (`[ids.len(), k]`, in the order of `ids`).
pub fn dequantize_rows_at(
    format: Format,
    layout: Layout,
    bytes: &[u8],
    held: usize,
    k: usize,
    ids: &[usize],
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let row = format.row_bytes(k)?;
    match layout {
        Layout::Interleaved if !held.is_multiple_of(GROUP) => {
            return Err(ShapeError(format!("{held} interleaved rows are not whole groups of {GROUP}")));
        }
        Layout::Interleaved => int8::check_interleaved(format, bytes.len(), held, k)?,
        _ => format.check(bytes.len(), held, k)?,
    }
    if Some(out.len()) != ids.len().checked_mul(k) {
        return Err(ShapeError(format!(
            "dequantize_rows_at: out has {} elements, expected {} x {k}",
            out.len(),
            ids.len()
        )));
    }
    if let Some(&bad) = ids.iter().find(|&&j| j >= held) {
        return Err(ShapeError(format!("dequantize_rows_at: row {bad} of a weight of {held} rows")));
    }
    for (&j, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
        match layout {
            Layout::File => quant::dequantize(format, &bytes[j * row..][..row], 1, k, o)?,
            Layout::Packed => quant::dequantize_packed(format, &bytes[j * row..][..row], 1, k, o)?,
            Layout::Interleaved => {
                // the row's group back as the file stores it, up to the row
                let (g, r) = (j / GROUP, j % GROUP);
                let file = int8::deinterleave(format, &bytes[g * GROUP * row..][..GROUP * row], r + 1, k)?;
                quant::dequantize(format, &file[r * row..], 1, k, o)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 33) as u8
            })
            .collect()
    }

    #[test]
    fn rows_equal_the_whole_weights_dequantised_rows() {
        let (n, k) = (21, 96);
        for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            let file = bytes(n * format.row_bytes(k).unwrap(), 7);
            let mut whole = vec![0f32; n * k];
            quant::dequantize(format, &file, n, k, &mut whole).unwrap();
            let ids = [20usize, 0, 7, 8, 7, 15, 16, 3];
            let packed = quant::pack_vec(format, &file, n, k).unwrap();
            let inter = int8::interleave(format, &file, n, k).unwrap();
            let held = n.div_ceil(GROUP) * GROUP;
            for (layout, data, held) in
                [(Layout::File, &file, n), (Layout::Packed, &packed, n), (Layout::Interleaved, &inter, held)]
            {
                let mut out = vec![0f32; ids.len() * k];
                dequantize_rows_at(format, layout, data, held, k, &ids, &mut out).unwrap();
                for (i, &j) in ids.iter().enumerate() {
                    let (got, want) = (&out[i * k..][..k], &whole[j * k..][..k]);
                    assert!(
                        got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} {layout:?} row {j}",
                        format.name()
                    );
                }
            }
        }
    }

    #[test]
    fn out_of_range_rows_and_bad_shapes_are_refused() {
        let (n, k) = (8, 32);
        let file = bytes(n * Format::Q8_0.row_bytes(k).unwrap(), 1);
        let mut out = vec![0f32; k];
        assert!(dequantize_rows_at(Format::Q8_0, Layout::File, &file, n, k, &[8], &mut out).is_err());
        assert!(dequantize_rows_at(Format::Q8_0, Layout::File, &file, n, k, &[0, 1], &mut out).is_err());
        assert!(dequantize_rows_at(Format::Q8_0, Layout::File, &file, n + 1, k, &[0], &mut out).is_err());
        assert!(dequantize_rows_at(Format::Q8_0, Layout::Interleaved, &file[..7 * 34], 7, k, &[0], &mut out).is_err());
    }
}
