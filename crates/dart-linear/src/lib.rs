//! Small-batch fp32 linear layers: `y[m, n] = sum_k x[m, k] · w[n, k] (+ b[n])` for a few
//! rows of `x` (1..=[`MAX_ROWS`]) and a weight in the `nn.Linear` layout (`[out, in]`,
//! row-major). This is what the target forwards while decoding: one row per plain step, the
//! tree's rows (root + a few nodes) per verification.
//!
//! Why not the BLAS the framework ships: on the 2-vCPU dev box (Xeon, AVX-512), MKL's fp32
//! GEMM over SmolLM2's 30 layers (106 M weights, streamed from memory) costs 1.45–1.6× as much
//! for 5 rows as for 1 (one thread: 46 vs 30 ms), although 5 rows need only five FMAs per
//! weight loaded — far below what a core can do while the weights stream in. Here each
//! weight is loaded once into a register and used for every row, four weight rows at a time
//! (20 accumulators for 5 rows), and the next weight rows are prefetched two blocks ahead
//! (the four rows are four interleaved short streams, too short for the hardware prefetcher
//! to run ahead): one thread, 28.7 / 30.8 / 32.9 / 37.1 ms for 1 / 2 / 5 / 8 rows (without
//! the prefetch, 5 rows took 47 ms).
//!
//! Every output element is computed by the same instructions whatever the number of rows and
//! however the weight rows are split between threads: sixteen lane-wise fused multiply-add
//! chains over `k` in order, a fixed reduction tree, then the bias. So a row's result does not
//! depend on the other rows of the call (bit for bit).
//!
//! The kernel needs AVX-512F ([`available`]); elsewhere callers use their framework's GEMM.

mod team;

pub use team::Team;

/// Most rows per call (the accumulators of one weight row per row of x, plus the weight and
/// x vectors, fit the 32 vector registers).
pub const MAX_ROWS: usize = 16;

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

/// Whether this CPU runs the kernel (AVX-512F with FMA).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[m, n] = x[m, :] · w[n, :] (+ bias[n])` for `m < rows`; `x` is `[rows, k]`, `w` is
/// `[n, k]`, `out` is `[rows, n]`, all row-major. The weight rows are split between
/// `threads` threads: the calling thread and the spinning helpers of a [`Team`].
#[allow(clippy::too_many_arguments)]
pub fn linear(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    check(x, rows, k, w, n, bias, out)?;
    if !available() {
        return Err(ShapeError("this CPU has no AVX-512F: use the framework's GEMM".into()));
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    if threads <= 1 || n <= BLOCK {
        run_part(x, rows, k, w, n, bias, OutPart::new(out), 0, n);
        return Ok(());
    }
    // Whole blocks of weight rows per thread, so that each thread's prefetches stay in its
    // part; a small product leaves the last threads without a part (one team per size).
    let per = n.div_ceil(BLOCK).div_ceil(threads) * BLOCK;
    let part = OutPart::new(out);
    let team = Team::get(threads);
    team.run(&|t| {
        let (n0, n1) = (t * per, ((t + 1) * per).min(n));
        if n0 < n1 {
            run_part(x, rows, k, w, n, bias, part.clone(), n0, n1);
        }
    });
    Ok(())
}

fn check(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>, out: &[f32]) -> Result<(), ShapeError> {
    if rows > MAX_ROWS {
        return Err(ShapeError(format!("{rows} rows: at most {MAX_ROWS} per call")));
    }
    let want = |what: &str, got: usize, a: usize, b: usize| {
        if Some(got) == a.checked_mul(b) {
            Ok(())
        } else {
            Err(ShapeError(format!("{what} has {got} elements, expected {a} x {b}")))
        }
    };
    want("x", x.len(), rows, k)?;
    want("w", w.len(), n, k)?;
    want("out", out.len(), rows, n)?;
    if let Some(b) = bias {
        want("bias", b.len(), n, 1)?;
    }
    Ok(())
}

/// Weight rows per block: the kernel's register tile for up to 4 rows of `x`.
const BLOCK: usize = 4;

/// The output matrix, shared by threads that write disjoint columns.
#[derive(Clone)]
struct OutPart {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: threads write disjoint column ranges `n0..n1` of the rows (see `linear`), and
// `Team::run` returns (every part done) before the `&mut` borrow it came from ends.
unsafe impl Send for OutPart {}
unsafe impl Sync for OutPart {}

impl OutPart {
    fn new(out: &mut [f32]) -> Self {
        OutPart { ptr: out.as_mut_ptr(), len: out.len() }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_part(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>, out: OutPart, n0: usize, n1: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! go {
            ($m:literal, $r:literal) => {
                // SAFETY: `available()` was checked by `linear`; shapes by `check`; `out` covers
                // rows x n and this call writes columns n0..n1 only.
                unsafe { avx512::kernel::<$m, $r>(x, k, w, n, bias, out.ptr, out.len, n0, n1) }
            };
        }
        match rows {
            1 => go!(1, 4),
            2 => go!(2, 4),
            3 => go!(3, 4),
            4 => go!(4, 4),
            5 => go!(5, 4),
            6 => go!(6, 2),
            7 => go!(7, 2),
            8 => go!(8, 2),
            9 => go!(9, 2),
            10 => go!(10, 2),
            11 => go!(11, 2),
            12 => go!(12, 2),
            13 => go!(13, 1),
            14 => go!(14, 1),
            15 => go!(15, 1),
            16 => go!(16, 1),
            _ => unreachable!("checked: 1..=MAX_ROWS"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, rows, k, w, n, bias, out, n0, n1);
        unreachable!("available() is false off x86_64");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Blocks of weight rows prefetched ahead (measured: 1 and 2 alike, 4 slower).
    const AHEAD: usize = 2;

    /// Columns `n0..n1` of `out` (`[M, n]` at `out`), `R` weight rows at a time.
    ///
    /// # Safety
    /// AVX-512F and FMA available; `x` is `[M, k]`, `w` `[n, k]`, `bias` `[n]`, `out` points to
    /// `len >= M * n` floats, `n0 <= n1 <= n`.
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles by index
    pub(super) unsafe fn kernel<const M: usize, const R: usize>(
        x: &[f32],
        k: usize,
        w: &[f32],
        n: usize,
        bias: Option<&[f32]>,
        out: *mut f32,
        len: usize,
        n0: usize,
        n1: usize,
    ) {
        assert!(x.len() >= M * k && w.len() >= n * k && len >= M * n && n0 <= n1 && n1 <= n);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let full = k / 16 * 16;
        // Lanes of the last partial vector (k % 16 of them): loaded masked, zeros elsewhere,
        // so the tail joins the same 16 chains.
        let tail: __mmask16 = ((1u32 << (k - full)) - 1) as __mmask16;
        let mut r0 = n0;
        while r0 < n1 {
            let rr = (n1 - r0).min(R);
            let mut acc = [[_mm512_setzero_ps(); M]; R];
            let mut kb = 0;
            while kb < k {
                let mut wv = [_mm512_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    if r < rr {
                        // SAFETY: row r0 + r < n1 <= n and kb < k: inside w (masked past k).
                        let p = unsafe { wp.add((r0 + r) * k + kb) };
                        *v = if kb < full { unsafe { _mm512_loadu_ps(p) } } else { unsafe { _mm512_maskz_loadu_ps(tail, p) } };
                        let ahead = r0 + AHEAD * R + r;
                        if ahead < n1 {
                            // SAFETY: a prefetch of an address inside w; it never faults.
                            unsafe { _mm_prefetch::<_MM_HINT_T0>(wp.add(ahead * k + kb) as *const i8) };
                        }
                    }
                }
                for m in 0..M {
                    // SAFETY: row m < M of x, columns kb.. < k (masked past k).
                    let p = unsafe { xp.add(m * k + kb) };
                    let xv = if kb < full { unsafe { _mm512_loadu_ps(p) } } else { unsafe { _mm512_maskz_loadu_ps(tail, p) } };
                    for r in 0..R {
                        acc[r][m] = _mm512_fmadd_ps(xv, wv[r], acc[r][m]);
                    }
                }
                kb += 16;
            }
            for r in 0..rr {
                let b = bias.map_or(0.0, |b| b[r0 + r]);
                for m in 0..M {
                    let y = _mm512_reduce_add_ps(acc[r][m]) + b;
                    // SAFETY: m < M and r0 + r < n: inside out's M x n floats.
                    unsafe { *out.add(m * n + r0 + r) = y };
                }
            }
            r0 += rr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>) -> Vec<f64> {
        let mut y = vec![0f64; rows * n];
        for m in 0..rows {
            for j in 0..n {
                let mut s = bias.map_or(0.0, |b| b[j] as f64);
                for i in 0..k {
                    s += x[m * k + i] as f64 * w[j * k + i] as f64;
                }
                y[m * n + j] = s;
            }
        }
        y
    }

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn equals_a_float64_reference_and_each_row_is_independent_of_the_others() {
        if !available() {
            return;
        }
        for &(k, n) in &[(576, 960), (33, 7), (16, 4), (1, 1), (100, 13), (1536, 576)] {
            let w = data(n * k, 1);
            let b = data(n, 2);
            let x = data(MAX_ROWS * k, 3);
            let mut single = vec![vec![0f32; n]; MAX_ROWS];
            for (m, row) in single.iter_mut().enumerate() {
                linear(&x[m * k..(m + 1) * k], 1, k, &w, n, Some(&b), row, 1).unwrap();
            }
            for rows in 1..=MAX_ROWS {
                for p in [1, 2, 3] {
                    let mut y = vec![0f32; rows * n];
                    linear(&x[..rows * k], rows, k, &w, n, Some(&b), &mut y, p).unwrap();
                    let r = reference(&x[..rows * k], rows, k, &w, n, Some(&b));
                    for (i, (&a, &e)) in y.iter().zip(&r).enumerate() {
                        assert!((a as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()), "k {k} n {n} rows {rows} [{i}]: {a} vs {e}");
                        assert_eq!(a.to_bits(), single[i / n][i % n].to_bits(), "row {} differs from its 1-row call", i / n);
                    }
                }
            }
            let mut y = vec![0f32; n];
            linear(&x[..k], 1, k, &w, n, None, &mut y, 1).unwrap();
            let r = reference(&x[..k], 1, k, &w, n, None);
            assert!(y.iter().zip(&r).all(|(&a, &e)| (a as f64 - e).abs() <= 1e-5 * (1.0 + e.abs())));
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let (x, w, mut y) = (vec![0f32; 8], vec![0f32; 12], vec![0f32; 6]);
        assert!(linear(&x, 2, 4, &w, 3, None, &mut y, 1).is_ok() || !available());
        assert!(linear(&x, 2, 4, &w, 4, None, &mut y, 1).is_err());
        assert!(linear(&x, 2, 3, &w, 3, None, &mut y, 1).is_err());
        assert!(linear(&x, 2, 4, &w, 3, Some(&[0.0; 2]), &mut y, 1).is_err());
        let big = vec![0f32; (MAX_ROWS + 1) * 4];
        let mut out = vec![0f32; (MAX_ROWS + 1) * 3];
        assert!(linear(&big, MAX_ROWS + 1, 4, &w, 3, None, &mut out, 1).unwrap_err().0.contains("at most"));
    }
}
