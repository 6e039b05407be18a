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
//! (20 accumulators for 5 rows); the next weight rows are prefetched into L2 two blocks ahead
//! and into L1 one block ahead (the four rows are four interleaved short streams, too short
//! for the hardware prefetcher to run ahead), and the sums of sixteen accumulators at a time
//! are reduced together (transposed, 45 instructions instead of 128). The 30 layers' products
//! from Python, one thread, with a decoding job on the other core: MKL 33.2 ms for 1 row;
//! here 31.5 / 31.9 / 35.7 / 40.1 ms for 1 / 2 / 5 / 8 rows (before the L1 prefetch and the
//! transposed reduction: 5 rows 36.8 ms, 1 row about MKL's; without any prefetch 5 rows took
//! 47 ms).
//!
//! Weights may also be stored as fp16 or bf16 ([`Weights`]) and are converted exactly on the
//! fly: a weight whose values are exactly representable there (the DART drafter ships fp16)
//! gives bit for bit its f32 results while half the bytes stream.
//!
//! Every output element is computed by the same instructions whatever the number of rows and
//! however the weight rows are split between threads: sixteen lane-wise fused multiply-add
//! chains over `k` in order, a fixed reduction tree, then the bias. So a row's result does not
//! depend on the other rows of the call (bit for bit).
//!
//! The kernel needs AVX-512F ([`available`]); elsewhere callers use their framework's GEMM.

pub mod ops;
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

/// A weight matrix `[n, k]` (row-major) in one of the storage formats the kernel reads. Each
/// element converts to f32 exactly, so a weight stored narrower than f32 whose values are
/// exactly representable there (fp16 exports, bf16-trained embeddings) gives bit for bit the
/// results of its f32 copy while streaming half the bytes.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    /// IEEE 754 binary16, as bit patterns.
    F16(&'a [u16]),
    /// bfloat16 (the upper 16 bits of an f32), as bit patterns.
    Bf16(&'a [u16]),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::F16(w) | Weights::Bf16(w) => w.len(),
        }
    }

    fn ptr(&self) -> *const u8 {
        match self {
            Weights::F32(w) => w.as_ptr().cast(),
            Weights::F16(w) | Weights::Bf16(w) => w.as_ptr().cast(),
        }
    }
}

impl<'a> From<&'a [f32]> for Weights<'a> {
    fn from(w: &'a [f32]) -> Self {
        Weights::F32(w)
    }
}

/// `out[m, n] = x[m, :] · w[n, :] (+ bias[n])` for `m < rows`; `x` is `[rows, k]`, `w` is
/// `[n, k]` (f32, or a narrower format, see [`Weights`]), `out` is `[rows, n]`, all
/// row-major. The weight rows are split between `threads` threads: the calling thread and the
/// spinning helpers of a [`Team`].
#[allow(clippy::too_many_arguments)]
pub fn linear<'w>(
    x: &[f32],
    rows: usize,
    k: usize,
    w: impl Into<Weights<'w>>,
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    let w = w.into();
    check(x, rows, k, w.len(), n, bias, out)?;
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

fn check(x: &[f32], rows: usize, k: usize, w_len: usize, n: usize, bias: Option<&[f32]>, out: &[f32]) -> Result<(), ShapeError> {
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
    want("w", w_len, n, k)?;
    want("out", out.len(), rows, n)?;
    if let Some(b) = bias {
        want("bias", b.len(), n, 1)?;
    }
    Ok(())
}

/// Weight rows per block: the kernel's register tile for up to 4 rows of `x`.
const BLOCK: usize = 4;

/// An output buffer shared by threads that write disjoint parts of it (columns of a product,
/// heads of an attention).
#[derive(Clone)]
pub(crate) struct OutPart {
    pub(crate) ptr: *mut f32,
    pub(crate) len: usize,
}

// SAFETY: threads write disjoint ranges (columns `n0..n1` of the rows in `linear`, heads in
// `ops::block_attention`), and `Team::run` returns (every part done) before the `&mut` borrow
// it came from ends.
unsafe impl Send for OutPart {}
unsafe impl Sync for OutPart {}

impl OutPart {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        OutPart { ptr: out.as_mut_ptr(), len: out.len() }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_part(x: &[f32], rows: usize, k: usize, w: Weights<'_>, n: usize, bias: Option<&[f32]>, out: OutPart, n0: usize, n1: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use avx512::{BF16, F16, F32};
        let fmt = match w {
            Weights::F32(_) => F32,
            Weights::F16(_) => F16,
            Weights::Bf16(_) => BF16,
        };
        let wp = w.ptr();
        macro_rules! go {
            ($m:literal, $r:literal) => {
                // SAFETY: `available()` was checked by `linear`; shapes by `check` (`wp` holds
                // n x k elements of the format); `out` covers rows x n and this call writes
                // columns n0..n1 only.
                match fmt {
                    F32 => unsafe { avx512::kernel::<$m, $r, F32>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    F16 => unsafe { avx512::kernel::<$m, $r, F16>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    _ => unsafe { avx512::kernel::<$m, $r, BF16>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                }
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
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// Weight formats (the kernel's const parameter), see [`super::Weights`].
    pub(super) const F32: u8 = 0;
    pub(super) const F16: u8 = 1;
    pub(super) const BF16: u8 = 2;

    /// Blocks of weight rows prefetched ahead into L2 (`_MM_HINT_T1`), and the next block from
    /// L2 into L1 (`T0`). Measured on SmolLM2's 30 layers + LM head, one thread, 1 / 5 rows:
    /// two blocks ahead into L1 alone 34.9 / 41.0 ms (a wide matrix's two blocks, 8 x 6 KB
    /// for the MLP's down projection, plus the rows of x overflow L1's 48 KB); into L2 alone
    /// 34.0 / 38.8; both 34.5 / 37.8 (4 or 6 blocks ahead alike; `NTA`: 2.4x slower).
    const AHEAD: usize = 2;

    /// Pairs of vectors folded into one: lanes 0..8 = `a[i] + a[i + 8]`, lanes 8..16 = the
    /// same of `b`. With [`fold4`], [`fold2`], [`fold1`]: the steps of [`reduce16`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold8(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
    }

    /// Per 8-lane owner: `x[i] + x[i + 4]` (128-bit quarters 0 + 1 and 2 + 3).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold4(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
    }

    /// Per 4-lane owner (a 128-bit quarter): `x[i] + x[i + 2]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold2(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b))
    }

    /// Per 2-lane owner: `x[0] + x[1]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold1(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(a, b), _mm512_shuffle_ps::<0b11_01_11_01>(a, b))
    }

    /// The horizontal sums of sixteen vectors: lane j = sum of `v[j]`'s lanes. Every sum takes
    /// the same tree, whatever the other vectors: lanes (i, i + 8), then (i, i + 4), (i, i + 2),
    /// (i, i + 1) -- the tree of `_mm512_reduce_add_ps`, for 45 instructions instead of 16 x 8
    /// (the reduction was a third of the work of a 5-row product out of cache).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn reduce16(v: &[__m512; 16]) -> __m512 {
        let s: [__m512; 8] = std::array::from_fn(|i| fold8(v[2 * i], v[2 * i + 1]));
        let t: [__m512; 4] = std::array::from_fn(|i| fold4(s[2 * i], s[2 * i + 1]));
        let f = fold1(fold2(t[0], t[1]), fold2(t[2], t[3]));
        // Lane L now holds the sum of v[L / 4 + 4 * (L % 4)].
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f)
    }

    /// Bytes per weight element.
    const fn width(fmt: u8) -> usize {
        if fmt == F32 { 4 } else { 2 }
    }

    /// Sixteen consecutive weights at `p` as f32 (exact conversions).
    ///
    /// # Safety
    /// AVX-512F; `p` points to 16 elements of the format.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<const FMT: u8>(p: *const u8) -> __m512 {
        unsafe {
            match FMT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))),
            }
        }
    }

    /// The last `lanes` (< 16) weights of a row at `p`, zeros in the other lanes.
    ///
    /// # Safety
    /// AVX-512F; `p` points to `lanes` elements of the format.
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_tail<const FMT: u8>(p: *const u8, lanes: usize) -> __m512 {
        let mut buf = [0u8; 64];
        // SAFETY: `lanes` elements at p (caller), into a 64-byte buffer (lanes < 16, <= 4 bytes).
        unsafe {
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), lanes * width(FMT));
            load16::<FMT>(buf.as_ptr())
        }
    }

    /// Columns `n0..n1` of `out` (`[M, n]` at `out`), `R` weight rows at a time, weights in
    /// format `FMT` at `w`.
    ///
    /// # Safety
    /// AVX-512F and FMA available; `x` is `[M, k]`, `w` points to `[n, k]` elements of format
    /// `FMT`, `bias` `[n]`, `out` points to `len >= M * n` floats, `n0 <= n1 <= n`.
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles by index
    pub(super) unsafe fn kernel<const M: usize, const R: usize, const FMT: u8>(
        x: &[f32],
        k: usize,
        w: *const u8,
        n: usize,
        bias: Option<&[f32]>,
        out: *mut f32,
        len: usize,
        n0: usize,
        n1: usize,
    ) {
        assert!(x.len() >= M * k && len >= M * n && n0 <= n1 && n1 <= n);
        let xp = x.as_ptr();
        let row_bytes = k * width(FMT);
        let full = k / 16 * 16;
        // Lanes of the last partial vector (k % 16 of them): loaded masked, zeros elsewhere,
        // so the tail joins the same 16 chains.
        let tail: __mmask16 = ((1u32 << (k - full)) - 1) as __mmask16;
        let mut r0 = n0;
        while r0 < n1 {
            let rr = (n1 - r0).min(R);
            let mut acc = [[_mm512_setzero_ps(); M]; R];
            let mut kb = 0;
            if rr == R {
                // A whole block of R rows: the full 16-wide steps without a branch (the generic
                // loop below then does only the row's last partial step, if any).
                // SAFETY: rows r0..r0 + R < n1 <= n of w; prefetch addresses are computed with
                // wrapping arithmetic and only used by prefetches, which never fault.
                let rows: [*const u8; R] = std::array::from_fn(|r| unsafe { w.add((r0 + r) * row_bytes) });
                let far_on = r0 + AHEAD * R + R <= n1;
                let near_on = r0 + 2 * R <= n1;
                while kb < full {
                    let off = kb * width(FMT);
                    let wv: [__m512; R] = std::array::from_fn(|r| unsafe { load16::<FMT>(rows[r].add(off)) });
                    for r in 0..R {
                        if far_on {
                            _mm_prefetch::<_MM_HINT_T1>(rows[r].wrapping_add(AHEAD * R * row_bytes + off) as *const i8);
                        }
                        if near_on {
                            _mm_prefetch::<_MM_HINT_T0>(rows[r].wrapping_add(R * row_bytes + off) as *const i8);
                        }
                    }
                    for m in 0..M {
                        // SAFETY: row m < M of x, columns kb..kb + 16 <= full <= k.
                        let xv = unsafe { _mm512_loadu_ps(xp.add(m * k + kb)) };
                        for r in 0..R {
                            acc[r][m] = _mm512_fmadd_ps(xv, wv[r], acc[r][m]);
                        }
                    }
                    kb += 16;
                }
            }
            while kb < k {
                let mut wv = [_mm512_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    if r < rr {
                        // SAFETY: row r0 + r < n1 <= n and kb < k: inside w (the tail reads
                        // only the k - kb elements left).
                        let p = unsafe { w.add((r0 + r) * row_bytes + kb * width(FMT)) };
                        *v = if kb < full { unsafe { load16::<FMT>(p) } } else { unsafe { load_tail::<FMT>(p, k - kb) } };
                        // SAFETY (both): prefetches of addresses inside w; they never fault.
                        let ahead = r0 + AHEAD * R + r;
                        if ahead < n1 {
                            unsafe { _mm_prefetch::<_MM_HINT_T1>(w.add(ahead * row_bytes + kb * width(FMT)) as *const i8) };
                        }
                        let near = r0 + R + r;
                        if near < n1 {
                            unsafe { _mm_prefetch::<_MM_HINT_T0>(w.add(near * row_bytes + kb * width(FMT)) as *const i8) };
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
            // The M x R sums, sixteen at a time (accumulator i = m * R + r).
            let mut g0 = 0;
            while g0 < M * R {
                let v: [__m512; 16] = std::array::from_fn(|j| {
                    let i = g0 + j;
                    if i < M * R { acc[i % R][i / R] } else { _mm512_setzero_ps() }
                });
                let mut sums = [0f32; 16];
                // SAFETY: 16 floats into a 16-float array.
                unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), reduce16(&v)) };
                for (j, &y) in sums.iter().enumerate().take(M * R - g0) {
                    let (m, r) = ((g0 + j) / R, (g0 + j) % R);
                    if r < rr {
                        let b = bias.map_or(0.0, |b| b[r0 + r]);
                        // SAFETY: m < M and r0 + r < n: inside out's M x n floats.
                        unsafe { *out.add(m * n + r0 + r) = y + b };
                    }
                }
                g0 += 16;
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

    /// Deterministic test values in [-0.5, 0.5) (xorshift).
    pub(crate) fn data(len: usize, seed: u64) -> Vec<f32> {
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
                linear(&x[m * k..(m + 1) * k], 1, k, &w[..], n, Some(&b), row, 1).unwrap();
            }
            for rows in 1..=MAX_ROWS {
                for p in [1, 2, 3] {
                    let mut y = vec![0f32; rows * n];
                    linear(&x[..rows * k], rows, k, &w[..], n, Some(&b), &mut y, p).unwrap();
                    let r = reference(&x[..rows * k], rows, k, &w, n, Some(&b));
                    for (i, (&a, &e)) in y.iter().zip(&r).enumerate() {
                        assert!((a as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()), "k {k} n {n} rows {rows} [{i}]: {a} vs {e}");
                        assert_eq!(a.to_bits(), single[i / n][i % n].to_bits(), "row {} differs from its 1-row call", i / n);
                    }
                }
            }
            let mut y = vec![0f32; n];
            linear(&x[..k], 1, k, &w[..], n, None, &mut y, 1).unwrap();
            let r = reference(&x[..k], 1, k, &w, n, None);
            assert!(y.iter().zip(&r).all(|(&a, &e)| (a as f64 - e).abs() <= 1e-5 * (1.0 + e.abs())));
        }
    }

    /// IEEE binary16 bits to f32 (finite values), independently of the kernel's conversion.
    fn f16_value(h: u16) -> f32 {
        let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
        let (e, m) = (((h >> 10) & 0x1f) as i32, (h & 0x3ff) as f32);
        sign * if e == 0 { m * 2f32.powi(-24) } else { (1.0 + m / 1024.0) * 2f32.powi(e - 15) }
    }

    #[test]
    fn narrow_weights_give_the_results_of_their_f32_values_bit_for_bit() {
        if !available() {
            return;
        }
        for &(k, n) in &[(576, 37), (33, 7), (1, 1), (100, 13)] {
            let bits: Vec<u16> = data(n * k, 5)
                .iter()
                .map(|v| {
                    let b = (v.to_bits() >> 8) as u16; // arbitrary patterns ...
                    if (b >> 10) & 0x1f == 0x1f { b & !0x4000 } else { b } // ... but finite
                })
                .collect();
            let x = data(MAX_ROWS * k, 6);
            let b = data(n, 7);
            let cases: [(Weights, Vec<f32>); 2] = [
                (Weights::F16(&bits), bits.iter().map(|&h| f16_value(h)).collect()),
                (Weights::Bf16(&bits), bits.iter().map(|&h| f32::from_bits((h as u32) << 16)).collect()),
            ];
            for (narrow, wide) in cases {
                assert!(wide.iter().all(|v| v.is_finite()));
                for rows in [1, 2, 5, 8, 16] {
                    for threads in [1, 2] {
                        let (mut a, mut e) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                        linear(&x[..rows * k], rows, k, narrow, n, Some(&b), &mut a, threads).unwrap();
                        linear(&x[..rows * k], rows, k, &wide[..], n, Some(&b), &mut e, threads).unwrap();
                        let same = a.iter().zip(&e).all(|(p, q)| p.to_bits() == q.to_bits());
                        assert!(same, "{narrow:?} k {k} n {n} rows {rows}: differs from its f32 values");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let (x, w, mut y) = (vec![0f32; 8], vec![0f32; 12], vec![0f32; 6]);
        assert!(linear(&x, 2, 4, &w[..], 3, None, &mut y, 1).is_ok() || !available());
        assert!(linear(&x, 2, 4, &w[..], 4, None, &mut y, 1).is_err());
        assert!(linear(&x, 2, 3, &w[..], 3, None, &mut y, 1).is_err());
        assert!(linear(&x, 2, 4, &w[..], 3, Some(&[0.0; 2]), &mut y, 1).is_err());
        assert!(linear(&x, 2, 4, Weights::F16(&[0u16; 12]), 3, None, &mut y, 1).is_ok() || !available());
        assert!(linear(&x, 2, 4, Weights::Bf16(&[0u16; 11]), 3, None, &mut y, 1).is_err());
        let big = vec![0f32; (MAX_ROWS + 1) * 4];
        let mut out = vec![0f32; (MAX_ROWS + 1) * 3];
        assert!(linear(&big, MAX_ROWS + 1, 4, &w[..], 3, None, &mut out, 1).unwrap_err().0.contains("at most"));
    }
}
