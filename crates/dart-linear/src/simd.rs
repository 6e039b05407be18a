//! The two instruction sets the kernels run on, behind one trait ([`Lanes`]): AVX-512F (16 f32
//! lanes, 32 registers) and AVX2 + FMA + F16C (8 lanes, 16 registers; AMD Zen 1-3, most Intel
//! client chips). The kernels are written once over the trait; each instruction set gets its
//! entry points compiled with its target features (`crate::run_part`, `ops::fast`), into
//! which the trait's `#[inline(always)]` operations inline.

use std::arch::x86_64::*;

/// Weight formats (the kernel's const parameter), see [`crate::Weights`].
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;
/// GGML block formats in the packed layout (`crate::quant`): rows of 32-weight blocks, the
/// row's fp16 scales, then its quantised bytes.
pub(crate) const Q4_0: u8 = 3;
pub(crate) const Q4_1: u8 = 4;
pub(crate) const Q8_0: u8 = 5;

/// Bytes per weight element (the plain formats).
pub(crate) const fn width(fmt: u8) -> usize {
    if fmt == F32 {
        4
    } else {
        2
    }
}

/// Whether `fmt` is a block format.
pub(crate) const fn blocked(fmt: u8) -> bool {
    fmt >= Q4_0
}

/// Bytes per 32-weight block of a block format (packed or not).
pub(crate) const fn block_bytes(fmt: u8) -> usize {
    match fmt {
        Q4_0 => 18,
        Q4_1 => 20,
        _ => 34,
    }
}

/// Bytes of a block's fp16 scales (`d`, or `d, m` for Q4_1), which lead a packed row.
pub(crate) const fn scale_bytes(fmt: u8) -> usize {
    if fmt == Q4_1 {
        4
    } else {
        2
    }
}

/// The byte offset of weight `i` (a multiple of 32 for a block format: its block's start)
/// in a row.
#[inline(always)]
pub(crate) const fn offset(fmt: u8, i: usize) -> usize {
    if blocked(fmt) {
        i / 32 * block_bytes(fmt)
    } else {
        i * width(fmt)
    }
}

/// An instruction set's f32 vector and the operations the kernels use. Every function is
/// unsafe: it needs the CPU features of its instruction set, which the caller (an entry point
/// compiled with them) guarantees; pointer arguments must cover the lanes they read or write.
pub(crate) trait Lanes {
    type V: Copy;
    /// f32 lanes per vector.
    const L: usize;

    /// Vectors per row and per step of a full block's loop: one 64-byte line of each weight
    /// row, so that a row is prefetched once per line.
    fn unroll(fmt: u8) -> usize;

    unsafe fn zero() -> Self::V;
    unsafe fn set1(v: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// The first `lanes` (< L) floats at `p`, zeros in the other lanes.
    unsafe fn load_tail(p: *const f32, lanes: usize) -> Self::V;
    /// L consecutive weights of format `FMT` at `p` as f32 (exact conversions).
    unsafe fn load_w<const FMT: u8>(p: *const u8) -> Self::V;
    /// L fp16 bit patterns at `p` (unaligned) widened to f32 at `out` (exact).
    unsafe fn widen(p: *const u8, out: *mut f32);
    /// What [`Lanes::load_q`] needs of a block's scales, widened to f32 (`p`: `d`, then `m`
    /// for Q4_1), once per block: its scale and offset in every lane, `(d, m)` for Q4_1 and
    /// `(d, 0)` for Q4_0 and Q8_0; or (AVX-512, 4-bit formats) the block's sixteen possible
    /// weights.
    unsafe fn scales<const FMT: u8>(p: *const f32) -> (Self::V, Self::V);
    /// Weights `u·L .. (u+1)·L` of the block whose quantised bytes are at `p` (`u < 32 / L`)
    /// as f32, with its [`Lanes::scales`]: `d · q + m` (Q4_1), `d · (q − 8)` (Q4_0), `d · q`
    /// (Q8_0), the values the reference dequantiser's roundings give.
    unsafe fn load_q<const FMT: u8>(p: *const u8, sc: (Self::V, Self::V), u: usize) -> Self::V;
    /// `a · b + c`, one rounding.
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `c - a · b`, one rounding.
    unsafe fn fnmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// The horizontal sums of `v[..L]`: lane j = the sum of `v[j]`'s lanes, every one by the
    /// same tree (lanes (i, i + L/2), then (i, i + L/4), ... (i, i + 1)); `v[L..]` unused.
    unsafe fn reduce(v: &[Self::V; 16]) -> Self::V;
    /// The sum of the lanes (the tree of [`Lanes::reduce`]).
    unsafe fn hsum(v: Self::V) -> f32;
    unsafe fn hmax(v: Self::V) -> f32;
    /// `e` where `x` is not -inf, else 0.
    unsafe fn zero_where_neg_inf(x: Self::V, e: Self::V) -> Self::V;
    /// `2^k` for integral `k` in [-126, 127] (as the exponent field).
    unsafe fn pow2i(k: Self::V) -> Self::V;
}

/// AVX-512F (with FMA).
pub(crate) struct Avx512;

/// AVX2 with FMA and F16C.
pub(crate) struct Avx2;

impl Lanes for Avx512 {
    type V = __m512;
    const L: usize = 16;

    #[inline(always)]
    fn unroll(fmt: u8) -> usize {
        // One vector per step whatever the plain format: 64 bytes of f32, 32 of a 16-bit
        // format (the prefetch of the second half-line is redundant, measured as cheap); a
        // whole block (two vectors) of a block format, its scales read once.
        if blocked(fmt) {
            2
        } else {
            1
        }
    }

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn set1(v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_tail(p: *const f32, lanes: usize) -> __m512 {
        unsafe { _mm512_maskz_loadu_ps(((1u32 << lanes) - 1) as __mmask16, p) }
    }
    #[inline(always)]
    unsafe fn load_w<const FMT: u8>(p: *const u8) -> __m512 {
        unsafe {
            match FMT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))),
            }
        }
    }
    #[inline(always)]
    unsafe fn widen(p: *const u8, out: *mut f32) {
        unsafe { _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn scales<const FMT: u8>(p: *const f32) -> (__m512, __m512) {
        unsafe {
            // broadcast loads: no shuffle-port work
            let d = _mm512_set1_ps(*p);
            match FMT {
                // A 4-bit block's sixteen possible weights, one per lane: lane q holds
                // `d · q + m` (Q4_1) or `d · (q − 8)` (Q4_0), rounded as the reference rounds
                // them (`d · q` is exact, so one fused rounding is the reference's multiply and
                // add: see `crate::quant`); `load_q` picks lanes by nibble.
                Q4_1 => {
                    let m = _mm512_set1_ps(*p.add(1));
                    let q = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
                    (_mm512_fmadd_ps(d, q, m), _mm512_setzero_ps())
                }
                Q4_0 => {
                    let q = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
                    (_mm512_mul_ps(d, q), _mm512_setzero_ps())
                }
                _ => (d, _mm512_setzero_ps()),
            }
        }
    }
    #[inline(always)]
    unsafe fn load_q<const FMT: u8>(p: *const u8, (t, _): (__m512, __m512), u: usize) -> __m512 {
        unsafe {
            match FMT {
                Q8_0 => {
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16 * u).cast()))), t)
                }
                _ => {
                    // the 16 bytes' low nibbles (u = 0) or high nibbles (u = 1) pick lanes of
                    // the block's table (a permute reads only an index's low four bits)
                    let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
                    let b = if u == 0 { b } else { _mm512_srli_epi32::<4>(b) };
                    _mm512_permutexvar_ps(b, t)
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }

    /// Sixteen vectors folded pairwise (45 instructions instead of 16 x 8; the reduction was a
    /// third of the work of a 5-row product out of cache).
    #[inline(always)]
    unsafe fn reduce(v: &[__m512; 16]) -> __m512 {
        // Pairs folded into one: lanes 0..8 = `a[i] + a[i + 8]`, lanes 8..16 = the same of b.
        let fold8 = |a, b| unsafe {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
        };
        // Per 8-lane owner: `x[i] + x[i + 4]` (128-bit quarters 0 + 1 and 2 + 3).
        let fold4 = |a, b| unsafe {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
        };
        // Per 4-lane owner (a 128-bit quarter): `x[i] + x[i + 2]`; then per 2-lane owner.
        let fold2 = |a, b| unsafe {
            _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b))
        };
        let fold1 = |a, b| unsafe {
            _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(a, b), _mm512_shuffle_ps::<0b11_01_11_01>(a, b))
        };
        let s: [__m512; 8] = std::array::from_fn(|i| fold8(v[2 * i], v[2 * i + 1]));
        let t: [__m512; 4] = std::array::from_fn(|i| fold4(s[2 * i], s[2 * i + 1]));
        let f = fold1(fold2(t[0], t[1]), fold2(t[2], t[3]));
        // Lane L now holds the sum of v[L / 4 + 4 * (L % 4)].
        unsafe { _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn hmax(v: __m512) -> f32 {
        unsafe { _mm512_reduce_max_ps(v) }
    }
    #[inline(always)]
    unsafe fn zero_where_neg_inf(x: __m512, e: __m512) -> __m512 {
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(x, _mm512_set1_ps(f32::NEG_INFINITY)), e) }
    }
    #[inline(always)]
    unsafe fn pow2i(k: __m512) -> __m512 {
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(k),
                _mm512_set1_epi32(127),
            )))
        }
    }
}

impl Lanes for Avx2 {
    type V = __m256;
    const L: usize = 8;

    #[inline(always)]
    fn unroll(fmt: u8) -> usize {
        // 32 bytes of f32 or 16 of a 16-bit format per vector: 2 or 4 vectors per line; a
        // whole block (four vectors) of a block format, its scales read once.
        if blocked(fmt) {
            4
        } else {
            64 / (8 * width(fmt))
        }
    }

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn set1(v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_tail(p: *const f32, lanes: usize) -> __m256 {
        // lane i loaded where i < lanes (the mask's sign bit)
        unsafe {
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            _mm256_maskload_ps(p, mask)
        }
    }
    #[inline(always)]
    unsafe fn load_w<const FMT: u8>(p: *const u8) -> __m256 {
        unsafe {
            match FMT {
                F32 => _mm256_loadu_ps(p.cast()),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))),
            }
        }
    }
    #[inline(always)]
    unsafe fn widen(p: *const u8, out: *mut f32) {
        unsafe { _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn scales<const FMT: u8>(p: *const f32) -> (__m256, __m256) {
        unsafe {
            let d = _mm256_set1_ps(*p);
            let m = if FMT == Q4_1 { _mm256_set1_ps(*p.add(1)) } else { _mm256_setzero_ps() };
            (d, m)
        }
    }
    #[inline(always)]
    unsafe fn load_q<const FMT: u8>(p: *const u8, (d, m): (__m256, __m256), u: usize) -> __m256 {
        unsafe {
            match FMT {
                Q8_0 => {
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * u).cast()))), d)
                }
                _ => {
                    // bytes (u % 2) * 8 .. + 8: their low nibbles (u < 2) or high nibbles
                    let qs = p.add(8 * (u % 2));
                    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.cast()));
                    let b = if u < 2 { b } else { _mm256_srli_epi32::<4>(b) };
                    let q = _mm256_and_si256(b, _mm256_set1_epi32(0x0f));
                    if FMT == Q4_1 {
                        // exact product, so one rounding is the reference's two (`crate::quant`)
                        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m)
                    } else {
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))))
                    }
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_div_ps(a, b) }
    }

    /// Eight vectors folded pairwise: 7 + 4 + 2 additions and a permute instead of 8 x 3 +
    /// extractions.
    #[inline(always)]
    unsafe fn reduce(v: &[__m256; 16]) -> __m256 {
        // Pairs folded into one: lanes 0..4 = `a[i] + a[i + 4]`, lanes 4..8 = the same of b.
        let fold4 =
            |a, b| unsafe { _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b)) };
        // Per 4-lane owner (a 128-bit half): `x[i] + x[i + 2]`; then per 2-lane owner.
        let fold2 = |a, b| unsafe {
            _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(a, b), _mm256_shuffle_ps::<0b11_10_11_10>(a, b))
        };
        let fold1 = |a, b| unsafe {
            _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(a, b), _mm256_shuffle_ps::<0b11_01_11_01>(a, b))
        };
        let s: [__m256; 4] = std::array::from_fn(|i| fold4(v[2 * i], v[2 * i + 1]));
        let f = fold1(fold2(s[0], s[1]), fold2(s[2], s[3]));
        // Lanes 0..4 now hold the sums of v[0], v[2], v[4], v[6]; lanes 4..8 of v[1], v[3], ...
        unsafe { _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }
    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }
    #[inline(always)]
    unsafe fn zero_where_neg_inf(x: __m256, e: __m256) -> __m256 {
        unsafe { _mm256_and_ps(_mm256_cmp_ps::<_CMP_NEQ_OQ>(x, _mm256_set1_ps(f32::NEG_INFINITY)), e) }
    }
    #[inline(always)]
    unsafe fn pow2i(k: __m256) -> __m256 {
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(k),
                _mm256_set1_epi32(127),
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `reduce` and `hsum` of one instruction set against plain sums (test values whose sums
    /// are exact in f32, so any tree gives them).
    unsafe fn check<S: Lanes>() {
        let vals: Vec<f32> = (0..16 * 16).map(|i| (i % 37) as f32 - 11.0).collect();
        unsafe {
            let v: [S::V; 16] = std::array::from_fn(|j| S::load(vals.as_ptr().add(j * S::L)));
            let mut got = [0f32; 16];
            S::store(got.as_mut_ptr(), S::reduce(&v));
            for j in 0..S::L {
                let want: f32 = vals[j * S::L..(j + 1) * S::L].iter().sum();
                assert_eq!(got[j], want, "lane {j} of {} lanes", S::L);
                assert_eq!(S::hsum(v[j]), want);
                let mx = vals[j * S::L..(j + 1) * S::L].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(S::hmax(v[j]), mx);
            }
            for lanes in 0..S::L {
                let mut t = [0f32; 16];
                S::store(t.as_mut_ptr(), S::load_tail(vals.as_ptr(), lanes));
                assert!((0..S::L).all(|i| t[i] == if i < lanes { vals[i] } else { 0.0 }));
            }
        }
    }

    #[test]
    fn reductions_and_tails_of_every_instruction_set_this_cpu_runs() {
        for isa in crate::Isa::supported_here() {
            // SAFETY: the CPU runs `isa`; each check runs inside an entry point with its features.
            match isa {
                crate::Isa::Avx512 => unsafe { check512() },
                crate::Isa::Avx2 => unsafe { check256() },
            }
        }
    }

    #[target_feature(enable = "avx512f,fma")]
    unsafe fn check512() {
        unsafe { check::<Avx512>() }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn check256() {
        unsafe { check::<Avx2>() }
    }
}
