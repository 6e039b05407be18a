//! The rest of a decoder layer for a few new rows, so that a decoding forward is a handful of
//! native calls per layer instead of ~60 small framework ops (each a few microseconds of
//! dispatch: ~17 ms of a 49 ms SmolLM2 step on one core of the dev box went there).
//!
//! * [`add_rms_norm`]: the residual add and the next RMSNorm (Llama / Qwen3 `RMSNorm`).
//! * [`block_attention`]: q/k RMSNorm (Qwen3), RoPE, the block's keys and values written to
//!   the layer's cache, and attention of the block over the cached prefix and itself under a
//!   block mask (a tree's ancestor mask, or causal), with grouped-query heads.
//!
//! Same arithmetic as the PyTorch forward where it is elementwise (RoPE: `x·cos + rot(x)·sin`
//! with separate roundings, the residual add); reductions (sums of squares, dot products,
//! softmax sums) in a fixed order of their own, so results agree with the framework's to
//! float32 rounding, and do not depend on the other rows of the block.

use crate::ShapeError;

fn shape_error<T>(msg: String) -> Result<T, ShapeError> {
    Err(ShapeError(msg))
}

/// Sum of `a[i] * b[i]` in sixteen interleaved partial sums (vectorisable, fixed order).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, at) = a.as_chunks::<16>();
    let (bc, bt) = b.as_chunks::<16>();
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in at.iter().zip(bt).enumerate() {
        acc[l] += x * y;
    }
    fold16(acc)
}

/// The sixteen partial sums added pairwise: (i, i + 8), (i, i + 4), (i, i + 2), (i, i + 1).
#[inline(always)]
fn fold16(mut acc: [f32; 16]) -> f32 {
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `out = x · rsqrt(mean(x²) + eps) · weight` for one row (HF `LlamaRMSNorm` in float32).
#[inline(always)]
fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(weight) {
        *o = g * (v * inv);
    }
}

/// For each row of `h` (`[rows, H]`, `H = weight.len()`): `h += delta` (when given), then
/// `out = RMSNorm(h) · weight`.
pub fn add_rms_norm(
    h: &mut [f32],
    delta: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let width = weight.len();
    if width == 0 || !h.len().is_multiple_of(width) || out.len() != h.len() || delta.is_some_and(|d| d.len() != h.len())
    {
        return shape_error(format!(
            "add_rms_norm: h {} / delta {:?} / out {} elements do not fit rows of width {width}",
            h.len(),
            delta.map(<[f32]>::len),
            out.len()
        ));
    }
    for (r, (row, o)) in h.chunks_exact_mut(width).zip(out.chunks_exact_mut(width)).enumerate() {
        if let Some(d) = delta {
            for (x, &y) in row.iter_mut().zip(&d[r * width..(r + 1) * width]) {
                *x += y;
            }
        }
        rms_norm_row(row, weight, eps, o);
    }
    Ok(())
}

/// Head layout of a layer: `heads` query heads sharing `kv_heads` key/value heads (GQA),
/// `head_dim` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// A layer's attention for a block of `n` new rows after `prefix` cached ones.
///
/// * `qkv` `[n, (heads + 2 kv_heads) · head_dim]`: each row's projections, q | k | v.
/// * `qk_norm`: per-head RMSNorm weights `[head_dim]` of q and k and their eps (Qwen3).
/// * `cos`, `sin` `[n, head_dim]`: RoPE of each row's position (rotate-half convention).
/// * `k_cache`, `v_cache` `[kv_heads, capacity, head_dim]`: the layer's cache; slots
///   `prefix..prefix + n` receive the block's roped keys and its values.
/// * `mask` `[n, n]`: row i sees new key j where nonzero (the prefix is always visible);
///   None: causal.
/// * `out` `[n, heads · head_dim]`: softmax(q kᵀ · scale) v per head.
/// * `threads`: the SIMD path (head sizes 64 and 128) splits the query heads
///   between this many threads -- the calling thread and the spinning helpers of the [`crate::Team`] the
///   products use (same results whatever the count: each head is computed by one thread, in
///   one order). The portable path runs on the calling thread.
#[allow(clippy::too_many_arguments)]
pub fn block_attention(
    qkv: &[f32],
    n: usize,
    heads: Heads,
    qk_norm: Option<(&[f32], &[f32], f32)>,
    cos: &[f32],
    sin: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    prefix: usize,
    mask: Option<&[u8]>,
    scale: f32,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    block_attention_on(
        crate::isa(),
        qkv,
        n,
        heads,
        qk_norm,
        cos,
        sin,
        k_cache,
        v_cache,
        prefix,
        mask,
        scale,
        out,
        threads,
    )
}

/// [`block_attention`] with the fast path of `isa` (None: the portable loops): tests run each
/// path this CPU has.
#[allow(clippy::too_many_arguments)]
fn block_attention_on(
    isa: Option<crate::Isa>,
    qkv: &[f32],
    n: usize,
    heads: Heads,
    qk_norm: Option<(&[f32], &[f32], f32)>,
    cos: &[f32],
    sin: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    prefix: usize,
    mask: Option<&[u8]>,
    scale: f32,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    let Heads { heads: nh, kv_heads: nkv, head_dim: d } = heads;
    if n == 0 || nh == 0 || nkv == 0 || d == 0 || d % 2 != 0 || !nh.is_multiple_of(nkv) {
        return shape_error(format!(
            "block_attention: bad layout: {n} rows, {heads:?} (heads a multiple of kv_heads, head_dim even)"
        ));
    }
    let width = (nh + 2 * nkv) * d;
    let capacity = k_cache.len() / (nkv * d);
    let wants = [
        ("qkv", qkv.len(), n * width),
        ("cos", cos.len(), n * d),
        ("sin", sin.len(), n * d),
        ("k_cache", k_cache.len(), nkv * capacity * d),
        ("v_cache", v_cache.len(), nkv * capacity * d),
        ("out", out.len(), n * nh * d),
    ];
    for (what, got, want) in wants {
        if got != want {
            return shape_error(format!("block_attention: {what} has {got} elements, expected {want}"));
        }
    }
    if let Some(m) = mask {
        if m.len() != n * n {
            return shape_error(format!("block_attention: mask has {} elements, expected {n} x {n}", m.len()));
        }
    }
    if let Some((qw, kw, _)) = qk_norm {
        if qw.len() != d || kw.len() != d {
            return shape_error(format!("block_attention: q/k norm weights need {d} elements"));
        }
    }
    if prefix + n > capacity {
        return shape_error(format!(
            "block_attention: {n} rows after {prefix} cached exceed the cache's {capacity} slots"
        ));
    }
    let call = Call { qkv, n, heads, qk_norm, cos, sin, capacity, prefix, mask, scale };
    attend_on(isa, &call, k_cache, v_cache, out, threads);
    Ok(())
}

/// The checked attention with the fast path of `isa` where it has one for the head size,
/// else the portable loops (tests run each path of the CPU).
fn attend_on(
    isa: Option<crate::Isa>,
    call: &Call<'_>,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    out: &mut [f32],
    threads: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = isa.filter(|i| i.supported() && fast::supports(call.heads.head_dim)) {
        // SAFETY: the CPU runs `isa` and it has this head size (checked just above).
        unsafe { fast::attend(isa, call, k_cache, v_cache, out, threads) };
        return;
    }
    let _ = (isa, threads);
    attend(call, k_cache, v_cache, out);
}

/// The gated MLP's activation for `rows` rows of a fused gate | up product (`gate_up`
/// `[rows, 2 · inter]`, each row its `inter` gate values then its `inter` up values):
/// `out[r, j] = silu(gate[r, j]) · up[r, j]` with `silu(x) = x / (1 + e^-x)`, rounded as the
/// framework computes it (the division, then the product). e^-x within 2 ulp (the SIMD path
/// of the CPU, else the portable loop); each row's results do not depend on the other rows.
pub fn silu_mul(gate_up: &[f32], rows: usize, inter: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    silu_mul_on(crate::isa(), gate_up, rows, inter, out)
}

/// [`silu_mul`] with the fast path of `isa` (None: the portable loop).
fn silu_mul_on(
    isa: Option<crate::Isa>,
    gate_up: &[f32],
    rows: usize,
    inter: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    if Some(gate_up.len()) != rows.checked_mul(2 * inter) || out.len() != rows * inter {
        return shape_error(format!(
            "silu_mul: gate_up {} / out {} elements do not fit {rows} rows of {inter}",
            gate_up.len(),
            out.len()
        ));
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = isa.filter(|i| i.supported()) {
        // SAFETY: the CPU runs `isa`; shapes checked above.
        unsafe { fast::silu_mul(isa, gate_up, rows, inter, out) };
        return Ok(());
    }
    let _ = isa;
    for (g, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (gate, up) = g.split_at(inter);
        for ((o, &x), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = silu(x) * u;
        }
    }
    Ok(())
}

/// `x / (1 + e^-x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// The checked arguments of [`block_attention`] (besides the buffers it writes).
struct Call<'a> {
    qkv: &'a [f32],
    n: usize,
    heads: Heads,
    qk_norm: Option<(&'a [f32], &'a [f32], f32)>,
    cos: &'a [f32],
    sin: &'a [f32],
    capacity: usize,
    prefix: usize,
    mask: Option<&'a [u8]>,
    scale: f32,
}

/// The block's queries `[n, heads, head_dim]`, normed (Qwen3) and roped; its keys (normed,
/// roped) and values written to cache slots `prefix..prefix + n`.
#[inline(always)]
fn prepare(call: &Call<'_>, k_cache: &mut [f32], v_cache: &mut [f32]) -> Vec<f32> {
    let Call { qkv, n, heads, qk_norm, cos, sin, capacity, prefix, .. } = *call;
    let Heads { heads: nh, kv_heads: nkv, head_dim: d } = heads;
    let width = (nh + 2 * nkv) * d;
    let mut q = vec![0f32; n * nh * d];
    let mut tmp = vec![0f32; d];
    for i in 0..n {
        let row = &qkv[i * width..(i + 1) * width];
        let (c, s) = (&cos[i * d..(i + 1) * d], &sin[i * d..(i + 1) * d]);
        for h in 0..nh {
            let src = &row[h * d..(h + 1) * d];
            let x: &[f32] = match qk_norm {
                Some((qw, _, eps)) => {
                    rms_norm_row(src, qw, eps, &mut tmp);
                    &tmp
                }
                None => src,
            };
            rope(x, c, s, &mut q[(i * nh + h) * d..(i * nh + h + 1) * d]);
        }
        for g in 0..nkv {
            let slot = (g * capacity + prefix + i) * d;
            let src = &row[(nh + g) * d..(nh + g + 1) * d];
            let x: &[f32] = match qk_norm {
                Some((_, kw, eps)) => {
                    rms_norm_row(src, kw, eps, &mut tmp);
                    &tmp
                }
                None => src,
            };
            rope(x, c, s, &mut k_cache[slot..slot + d]);
            v_cache[slot..slot + d].copy_from_slice(&row[(nh + nkv + g) * d..(nh + nkv + g + 1) * d]);
        }
    }
    q
}

/// Whether row i of the block sees the block's key jj.
#[inline(always)]
fn sees(mask: Option<&[u8]>, n: usize, i: usize, jj: usize) -> bool {
    match mask {
        Some(m) => m[i * n + jj] != 0,
        None => jj <= i,
    }
}

/// The portable attention (any head size): plain loops in a fixed order.
fn attend(call: &Call<'_>, k_cache: &mut [f32], v_cache: &mut [f32], out: &mut [f32]) {
    let q = prepare(call, k_cache, v_cache);
    let Call { n, heads, capacity, prefix, mask, scale, .. } = *call;
    let Heads { heads: nh, kv_heads: nkv, head_dim: d } = heads;
    let total = prefix + n;

    // Attention per kv head over the group's query rows (head-major: row = hg * n + i).
    let group = nh / nkv;
    let rows = group * n;
    let mut scores = vec![0f32; rows * total];
    let mut acc = vec![0f32; rows * d];
    for g in 0..nkv {
        let keys = &k_cache[g * capacity * d..(g * capacity + total) * d];
        let values = &v_cache[g * capacity * d..(g * capacity + total) * d];
        for (j, key) in keys.chunks_exact(d).enumerate() {
            for hg in 0..group {
                let h = g * group + hg;
                for i in 0..n {
                    scores[(hg * n + i) * total + j] = dot(&q[(i * nh + h) * d..(i * nh + h + 1) * d], key) * scale;
                }
            }
        }
        for r in 0..rows {
            softmax(&mut scores[r * total..(r + 1) * total], prefix, |jj| sees(mask, n, r % n, jj));
        }
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (j, value) in values.chunks_exact(d).enumerate() {
            for r in 0..rows {
                let p = scores[r * total + j]; // 0 for a hidden key: adds exactly nothing
                for (a, &v) in acc[r * d..(r + 1) * d].iter_mut().zip(value) {
                    *a += p * v;
                }
            }
        }
        for hg in 0..group {
            let h = g * group + hg;
            for i in 0..n {
                let r = hg * n + i;
                out[(i * nh + h) * d..(i * nh + h + 1) * d].copy_from_slice(&acc[r * d..(r + 1) * d]);
            }
        }
    }
}

/// The attention with SIMD for head sizes of L · DV (L the lanes of the instruction set), per
/// query head (heads split between threads): the scores of L keys against one query row in L
/// accumulators reduced together, a vectorised exp, and P·V for a few query rows sharing each
/// value's loads. Fused multiply-adds: not bit-identical to [`attend`], both within float32
/// rounding of the exact result.
#[cfg(target_arch = "x86_64")]
mod fast {
    use super::{prepare, sees, Call, Heads};
    use crate::simd::{Avx2, Avx512, Lanes};
    use crate::{Isa, OutPart, Team};
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

    /// Query heads `h0..h1` with one instruction set (the signature of [`heads512`] /
    /// [`heads256`]).
    type HeadsFn = unsafe fn(&Call<'_>, &[f32], &[f32], &[f32], &OutPart, usize, usize);

    /// Whether `isa` has a fast attention for head size `d`.
    pub(super) fn supports(d: usize) -> bool {
        d == 64 || d == 128
    }

    /// A score row's length: `total` padded to whole vectors of `lanes`.
    fn stride(total: usize, lanes: usize) -> usize {
        total.div_ceil(lanes) * lanes
    }

    /// # Safety
    /// The CPU runs `isa`; `call` checked by [`super::block_attention`]; `supports(isa, d)`.
    pub(super) unsafe fn attend(
        isa: Isa,
        call: &Call<'_>,
        k_cache: &mut [f32],
        v_cache: &mut [f32],
        out: &mut [f32],
        threads: usize,
    ) {
        // P·V: AVX-512 keeps a row's whole output in DV registers, six rows at a time (four at
        // head size 128); AVX2 (16 registers) takes 4-vector column chunks (32 floats), two
        // rows at a time.
        let f: HeadsFn = match (isa, call.heads.head_dim) {
            (Isa::Avx512, 64) => heads512::<4, 4, 6>,
            (Isa::Avx512, _) => heads512::<8, 8, 4>,
            (Isa::Avx2, 64) => heads256::<8>,
            (Isa::Avx2, _) => heads256::<16>,
        };
        let q = prepare(call, k_cache, v_cache);
        let (keys, values): (&[f32], &[f32]) = (k_cache, v_cache);
        let nh = call.heads.heads;
        let part = OutPart::new(out);
        if threads <= 1 {
            // SAFETY: as for this function; `part` is all of `out`.
            unsafe { f(call, &q, keys, values, &part, 0, nh) };
            return;
        }
        // Whole heads per thread (the products' team: same size, same spinning helpers); a
        // thread takes its heads kv group by group.
        let per = nh.div_ceil(threads);
        Team::get(threads).run(&|t| {
            let (h0, h1) = ((t * per).min(nh), ((t + 1) * per).min(nh));
            // SAFETY: as for this function; the parts write disjoint heads of `out`.
            unsafe { f(call, &q, keys, values, &part, h0, h1) };
        });
    }

    /// [`heads`] with AVX-512F.
    ///
    /// # Safety
    /// As [`heads`], on a CPU with AVX-512F and FMA.
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn heads512<const DV: usize, const CV: usize, const RMAX: usize>(
        call: &Call<'_>,
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        out: &OutPart,
        h0: usize,
        h1: usize,
    ) {
        // SAFETY: as for this function.
        unsafe { heads::<Avx512, DV, CV, RMAX>(call, q, k_cache, v_cache, out, h0, h1) }
    }

    /// [`heads`] with AVX2.
    ///
    /// # Safety
    /// As [`heads`], on a CPU with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn heads256<const DV: usize>(
        call: &Call<'_>,
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        out: &OutPart,
        h0: usize,
        h1: usize,
    ) {
        // SAFETY: as for this function.
        unsafe { heads::<Avx2, DV, 4, 2>(call, q, k_cache, v_cache, out, h0, h1) }
    }

    /// L scores (keys `j0..j0 + L`, a last partial chunk repeating the last key in its padding
    /// lanes, which the softmax then hides) of `pairs` (head, row) pairs of kv group `g`, pair
    /// r = (h - ha) · n + i: q kᵀ · scale, a pair's L keys in L accumulators reduced together,
    /// stored at `dst + r · stride + j0`. The keys are loaded once for all the pairs.
    ///
    /// # Safety
    /// The CPU runs `S`; `call` checked, head size `S::L · DV`; `keys` the group's `[total, d]`
    /// keys; `dst` has room for `pairs` rows of `stride >= j0 + L` floats.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn score_chunk<S: Lanes, const DV: usize>(
        call: &Call<'_>,
        q: &[f32],
        keys: &[f32],
        j0: usize,
        ha: usize,
        pairs: usize,
        dst: *mut f32,
        stride: usize,
    ) {
        let Call { n, heads, prefix, scale, .. } = *call;
        let (nh, d, lanes, total) = (heads.heads, heads.head_dim, S::L, prefix + n);
        let load = |s: &[f32], at: usize| -> S::V {
            debug_assert!(at + lanes <= s.len());
            // SAFETY: L floats at `at` (callers stay inside the slices they index); the CPU
            // runs S (caller).
            unsafe { S::load(s.as_ptr().add(at)) }
        };
        let ko: [usize; 16] = std::array::from_fn(|jj| (j0 + jj).min(total - 1) * d);
        for r in 0..pairs {
            let (h, i) = (ha + r / n, r % n);
            let qo = (i * nh + h) * d;
            let qv: [S::V; DV] = std::array::from_fn(|t| load(q, qo + lanes * t));
            let mut acc = [unsafe { S::zero() }; 16];
            for (a, &o) in acc.iter_mut().zip(&ko).take(lanes) {
                for (t, &qt) in qv.iter().enumerate() {
                    *a = unsafe { S::fmadd(qt, load(keys, o + lanes * t), *a) };
                }
            }
            // SAFETY: L floats inside pair r's score row (caller).
            unsafe {
                let s = S::mul(S::reduce(&acc), S::set1(scale));
                S::store(dst.add(r * stride + j0), s);
            }
        }
    }

    /// Softmax of `pairs` score rows at `scores` (`stride` apart) of kv group head `ha`
    /// onwards, pair r = (h - ha) · n + i showing row i's visible keys.
    ///
    /// # Safety
    /// The CPU runs `S`; `scores.len() >= pairs · stride`, `stride` a multiple of L.
    #[inline(always)]
    unsafe fn softmax_pairs<S: Lanes>(call: &Call<'_>, scores: &mut [f32], stride: usize, pairs: usize) {
        let Call { n, prefix, mask, .. } = *call;
        for r in 0..pairs {
            let i = r % n;
            // SAFETY: the CPU runs S; a whole padded row.
            unsafe {
                softmax::<S>(&mut scores[r * stride..(r + 1) * stride], prefix + n, prefix, |jj| sees(mask, n, i, jj))
            };
        }
    }

    /// `out = P V` for `pairs` (head, row) pairs over `total` keys with the values at `values`
    /// (`[total, d]`), vectors `c0..c0 + CV` of the columns: up to RMAX pairs at a time (as
    /// even as their count allows) share each value's loads, every pair still summing over the
    /// keys in order, in its own registers. Pair k's probabilities at `scores[k · stride..]`,
    /// its output row at `out_at(k)`.
    ///
    /// # Safety
    /// The CPU runs `S`; as [`pv`] for every pair; RMAX <= 6.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_pairs<S: Lanes, const CV: usize, const RMAX: usize>(
        scores: &[f32],
        stride: usize,
        total: usize,
        values: &[f32],
        d: usize,
        c0: usize,
        pairs: usize,
        out_at: &impl Fn(usize) -> usize,
        out: &OutPart,
    ) {
        debug_assert!((1..=6).contains(&RMAX));
        let per = pairs.div_ceil(pairs.div_ceil(RMAX));
        let mut r0 = 0;
        while r0 < pairs {
            let take = per.min(pairs - r0);
            let sc = &scores[r0 * stride..];
            let oo = |k: usize| out_at(r0 + k);
            // SAFETY (all): as for this function.
            unsafe {
                match take {
                    1 => pv::<S, CV, 1>(sc, stride, total, values, d, c0, oo, out),
                    2 => pv::<S, CV, 2>(sc, stride, total, values, d, c0, oo, out),
                    3 => pv::<S, CV, 3>(sc, stride, total, values, d, c0, oo, out),
                    4 => pv::<S, CV, 4>(sc, stride, total, values, d, c0, oo, out),
                    5 => pv::<S, CV, 5>(sc, stride, total, values, d, c0, oo, out),
                    _ => pv::<S, CV, 6>(sc, stride, total, values, d, c0, oo, out),
                }
            }
            r0 += take;
        }
    }

    /// Query heads `h0..h1` of the attention (the block's queries `q` prepared, its keys and
    /// values in the caches), a kv group's heads together: per chunk of L keys
    /// (loaded once for all of the group's heads and rows, its values prefetched for P·V),
    /// each (head, row)'s scores; each row's softmax; and P·V in chunks of CV vectors of the
    /// columns for up to RMAX (head, row) pairs at a time; written to those heads' columns of
    /// `out`. Every row's arithmetic, in its order, is the same whichever heads and rows share
    /// a pass, whichever thread runs it.
    ///
    /// # Safety
    /// The CPU runs `S`; `call` checked, head size `S::L · DV`, CV divides DV, RMAX <= 6;
    /// `out` is the `[n, heads · d]` output, no other thread writing heads `h0..h1`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn heads<S: Lanes, const DV: usize, const CV: usize, const RMAX: usize>(
        call: &Call<'_>,
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        out: &OutPart,
        h0: usize,
        h1: usize,
    ) {
        let Call { n, heads, capacity, prefix, .. } = *call;
        let Heads { heads: nh, kv_heads: nkv, head_dim: d } = heads;
        let lanes = S::L;
        debug_assert_eq!(d, lanes * DV);
        debug_assert!(DV.is_multiple_of(CV) && out.len >= n * nh * d);
        let total = prefix + n;
        let group = nh / nkv;
        let stride = stride(total, lanes);
        // the score rows of a group's (head, row) pairs, pair r = (h - ha) · n + i
        let mut scores = vec![0f32; group.min(h1 - h0) * n * stride];
        let mut ha = h0;
        while ha < h1 {
            let g = ha / group;
            let hb = h1.min((g + 1) * group);
            let pairs = (hb - ha) * n;
            let keys = &k_cache[g * capacity * d..(g * capacity + total) * d];
            let values = &v_cache[g * capacity * d..(g * capacity + total) * d];
            for j0 in (0..total).step_by(lanes) {
                // the chunk's values, wanted by P·V next, come in from memory meanwhile
                for at in (j0 * d..(j0 + lanes).min(total) * d).step_by(16) {
                    // SAFETY: an address inside `values` (a hint: no load, no fault).
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(values.as_ptr().add(at).cast()) };
                }
                // SAFETY: as for this function; `pairs` rows of `stride` in `scores`.
                unsafe { score_chunk::<S, DV>(call, q, keys, j0, ha, pairs, scores.as_mut_ptr(), stride) };
            }
            // SAFETY (both): as for this function.
            unsafe { softmax_pairs::<S>(call, &mut scores, stride, pairs) };
            let out_at = |r: usize| ((r % n) * nh + ha + r / n) * d;
            for c0 in (0..DV).step_by(CV) {
                unsafe { pv_pairs::<S, CV, RMAX>(&scores, stride, total, values, d, c0, pairs, &out_at, out) };
            }
            ha = hb;
        }
    }

    /// R (head, row) pairs, vectors `c0..c0 + CV` of the head's `d` columns: `out = P V` over
    /// `total` keys with the values at `values` (`[total, d]`); pair k's probabilities at
    /// `scores[k · stride..]`, its output row at `out_at(k)`.
    ///
    /// # Safety
    /// The CPU runs `S`; `out_at(k) + d` inside `out` for k < R, `(c0 + CV) · L <= d`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv<S: Lanes, const CV: usize, const R: usize>(
        scores: &[f32],
        stride: usize,
        total: usize,
        values: &[f32],
        d: usize,
        c0: usize,
        out_at: impl Fn(usize) -> usize,
        out: &OutPart,
    ) {
        let lanes = S::L;
        let col = c0 * lanes;
        debug_assert!(col + CV * lanes <= d && values.len() >= total * d && scores.len() >= (R - 1) * stride + total);
        let mut acc = [[unsafe { S::zero() }; CV]; R];
        for j in 0..total {
            // SAFETY: key j's values inside `values` (checked above).
            let v: [S::V; CV] =
                std::array::from_fn(|t| unsafe { S::load(values.as_ptr().add(j * d + col + lanes * t)) });
            for (r, row) in acc.iter_mut().enumerate() {
                let p = unsafe { S::set1(*scores.get_unchecked(r * stride + j)) };
                for (a, &vt) in row.iter_mut().zip(&v) {
                    *a = unsafe { S::fmadd(p, vt, *a) };
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let oo = out_at(r) + col;
            debug_assert!(oo + CV * lanes <= out.len);
            for (t, &a) in row.iter().enumerate() {
                // SAFETY: L floats of pair r's output row inside out (caller).
                unsafe { S::store(out.ptr.add(oo + lanes * t), a) };
            }
        }
    }

    /// Softmax over `row[..total]` (`row` padded to whole vectors): the prefix always visible,
    /// block key jj where `visible(jj)`; everything else, padding included, becomes 0.
    ///
    /// # Safety
    /// The CPU runs `S`; `row.len()` a multiple of L.
    #[inline(always)]
    unsafe fn softmax<S: Lanes>(row: &mut [f32], total: usize, prefix: usize, visible: impl Fn(usize) -> bool) {
        let lanes = S::L;
        for jj in 0..total - prefix {
            if !visible(jj) {
                row[prefix + jj] = f32::NEG_INFINITY;
            }
        }
        for s in &mut row[total..] {
            *s = f32::NEG_INFINITY;
        }
        // SAFETY (all): whole L-float chunks of `row`, read then written.
        unsafe {
            let mut mx = S::set1(f32::NEG_INFINITY);
            for c in row.chunks_exact(lanes) {
                mx = S::max(mx, S::load(c.as_ptr()));
            }
            let mx = S::set1(S::hmax(mx));
            let mut sum = S::zero();
            for c in row.chunks_exact_mut(lanes) {
                let s = S::load(c.as_ptr());
                // hidden keys (-inf) get exactly 0, not e^-87.3
                let e = S::zero_where_neg_inf(s, exp::<S>(S::sub(s, mx)));
                S::store(c.as_mut_ptr(), e);
                sum = S::add(sum, e);
            }
            // The sum's lanes follow the keys' slots: where a hidden block key comes before a
            // visible one (a tree's sibling), the visible keys are summed packed together, in
            // the slots a plain step would give them -- so a tree node's softmax (and with it
            // its whole row: the scores and P·V skip a hidden key exactly) is its plain step's
            // bit for bit. (Without it the rounding differed in the last bits, which the
            // integer path's activation rounding can turn into a different token.)
            let mut hidden_before = false;
            let mut holes = false;
            for jj in 0..total - prefix {
                let v = visible(jj);
                holes |= v && hidden_before;
                hidden_before |= !v;
            }
            if holes {
                let mut packed = vec![0f32; row.len()];
                packed[..prefix].copy_from_slice(&row[..prefix]);
                let mut at = prefix;
                for jj in 0..total - prefix {
                    if visible(jj) {
                        packed[at] = row[prefix + jj];
                        at += 1;
                    }
                }
                sum = S::zero();
                for c in packed.chunks_exact(lanes) {
                    sum = S::add(sum, S::load(c.as_ptr()));
                }
            }
            let inv = S::set1(1.0 / S::hsum(sum));
            for c in row.chunks_exact_mut(lanes) {
                S::store(c.as_mut_ptr(), S::mul(S::load(c.as_ptr()), inv));
            }
        }
    }

    /// [`super::silu_mul`] with `isa`.
    ///
    /// # Safety
    /// The CPU runs `isa`; `gate_up` holds `rows · 2 · inter` values, `out` `rows · inter`.
    pub(super) unsafe fn silu_mul(isa: Isa, gate_up: &[f32], rows: usize, inter: usize, out: &mut [f32]) {
        match isa {
            // SAFETY (both): as for this function.
            Isa::Avx512 => unsafe { silu_mul512(gate_up, rows, inter, out) },
            Isa::Avx2 => unsafe { silu_mul256(gate_up, rows, inter, out) },
        }
    }

    #[target_feature(enable = "avx512f,fma")]
    unsafe fn silu_mul512(gate_up: &[f32], rows: usize, inter: usize, out: &mut [f32]) {
        // SAFETY: the CPU runs AVX-512F (caller).
        unsafe { silu_mul_lanes::<Avx512>(gate_up, rows, inter, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn silu_mul256(gate_up: &[f32], rows: usize, inter: usize, out: &mut [f32]) {
        // SAFETY: the CPU runs AVX2 (caller).
        unsafe { silu_mul_lanes::<Avx2>(gate_up, rows, inter, out) }
    }

    /// L columns at a time, the row's last `inter % L` columns by the portable loop (the same
    /// split in every row).
    ///
    /// # Safety
    /// As [`silu_mul`], the CPU running `S`.
    #[inline(always)]
    unsafe fn silu_mul_lanes<S: Lanes>(gate_up: &[f32], rows: usize, inter: usize, out: &mut [f32]) {
        let lanes = S::L;
        let whole = inter - inter % lanes;
        for r in 0..rows {
            let (g, o) = (&gate_up[r * 2 * inter..(r + 1) * 2 * inter], &mut out[r * inter..(r + 1) * inter]);
            for j in (0..whole).step_by(lanes) {
                // SAFETY: L floats at j of the gate, the up values and the output row.
                unsafe {
                    let x = S::load(g.as_ptr().add(j));
                    let e = exp::<S>(S::sub(S::zero(), x));
                    let s = S::div(x, S::add(S::set1(1.0), e));
                    S::store(o.as_mut_ptr().add(j), S::mul(s, S::load(g.as_ptr().add(inter + j))));
                }
            }
            for j in whole..inter {
                o[j] = super::silu(g[j]) * g[inter + j];
            }
        }
    }

    /// [`super::exp`] on L lanes (same steps, fused multiply-adds in the polynomial).
    ///
    /// # Safety
    /// The CPU runs `S`.
    #[inline(always)]
    unsafe fn exp<S: Lanes>(x: S::V) -> S::V {
        unsafe {
            let x = S::min(S::max(x, S::set1(-87.3)), S::set1(88.0));
            let round = S::set1(12_582_912.0);
            let k = S::sub(S::fmadd(x, S::set1(std::f32::consts::LOG2_E), round), round);
            let r = S::fnmadd(k, S::set1(-2.121_944_4e-4), S::fnmadd(k, S::set1(0.693_359_4), x));
            let mut p = S::set1(1.0 / 5040.0);
            for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = S::fmadd(p, r, S::set1(c));
            }
            S::mul(p, S::pow2i(k))
        }
    }
}

/// `out = x · cos + rotate_half(x) · sin`, rotate_half(x) = (-x[d/2..], x[..d/2]); products and
/// sum rounded separately, as the framework computes them.
#[inline(always)]
fn rope(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = x.len() / 2;
    for t in 0..x.len() {
        let rot = if t < half { -x[t + half] } else { x[t - half] };
        out[t] = x[t] * cos[t] + rot * sin[t];
    }
}

/// Softmax of a row of scores over its first `prefix` entries (always visible) and the block's
/// entries `prefix + jj` with `visible(jj)`; hidden entries become exactly 0.
#[inline(always)]
fn softmax(row: &mut [f32], prefix: usize, visible: impl Fn(usize) -> bool) {
    let mut max = f32::NEG_INFINITY;
    for (j, &s) in row.iter().enumerate() {
        if (j < prefix || visible(j - prefix)) && s > max {
            max = s;
        }
    }
    for s in row.iter_mut() {
        *s = exp(*s - max);
    }
    for (jj, s) in row[prefix..].iter_mut().enumerate() {
        if !visible(jj) {
            *s = 0.0;
        }
    }
    let mut sum = 0f32;
    for &s in row.iter() {
        sum += s;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|s| *s *= inv);
}

/// e^x, branch-free so that loops of it vectorise: x = k·ln2 + r with |r| <= ln2 / 2, e^r by
/// its degree-7 Taylor polynomial (relative error < 2e-8 before rounding), times 2^k. Within 2
/// ulp of e^x for x in [-87.3, 88]; below (e^x < 1.2e-38) it returns e^-87.3, above e^88.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 355 / 512: k · LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding and subtracting it rounds to an integer
    let x = x.clamp(-87.3, 88.0);
    let k = (x * LOG2E + ROUND) - ROUND;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    // 2^k, k in [-126, 127], as a float's exponent field.
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::data;

    #[test]
    fn a_tree_row_after_a_hidden_sibling_is_its_plain_steps_row_bit_for_bit() {
        // rows: root, child a, child b (b does not see a); b alone after the root must give
        // the same bits (the softmax's sum over its visible keys as if they were contiguous)
        let hd = Heads { heads: 4, kv_heads: 2, head_dim: 64 };
        let (d, w) = (hd.head_dim, (hd.heads + 2 * hd.kv_heads) * hd.head_dim);
        for isa in [None].into_iter().chain(crate::Isa::supported_here().into_iter().map(Some)) {
            for prefix in [0usize, 5, 16, 37] {
                let capacity = prefix + 3;
                let cache = data(hd.kv_heads * capacity * d, 3);
                let qkv = data(3 * w, 4);
                let (cos, sin) = (data(3 * d, 5), data(3 * d, 6));
                let (mut k1, mut v1) = (cache.clone(), cache.iter().map(|v| v * 0.5).collect::<Vec<f32>>());
                let (mut k2, mut v2) = (k1.clone(), v1.clone());
                let mut tree = vec![0f32; 3 * hd.heads * d];
                let mask = [1u8, 0, 0, 1, 1, 0, 1, 0, 1];
                block_attention_on(
                    isa,
                    &qkv,
                    3,
                    hd,
                    None,
                    &cos,
                    &sin,
                    &mut k1,
                    &mut v1,
                    prefix,
                    Some(&mask),
                    0.125,
                    &mut tree,
                    1,
                )
                .unwrap();
                let pick = |a: &[f32], rows: [usize; 2], width: usize| -> Vec<f32> {
                    rows.iter().flat_map(|&r| a[r * width..(r + 1) * width].to_vec()).collect()
                };
                let mut steps = vec![0f32; 2 * hd.heads * d];
                block_attention_on(
                    isa,
                    &pick(&qkv, [0, 2], w),
                    2,
                    hd,
                    None,
                    &pick(&cos, [0, 2], d),
                    &pick(&sin, [0, 2], d),
                    &mut k2,
                    &mut v2,
                    prefix,
                    None,
                    0.125,
                    &mut steps,
                    1,
                )
                .unwrap();
                let row = |a: &[f32], r: usize| {
                    a[r * hd.heads * d..(r + 1) * hd.heads * d].iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                };
                assert_eq!(row(&tree, 0), row(&steps, 0), "{isa:?} prefix {prefix}: root");
                assert_eq!(row(&tree, 2), row(&steps, 1), "{isa:?} prefix {prefix}: the second child");
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut x = 88.0f32;
        while x > -88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            if x >= -87.3 {
                assert!((got - want).abs() <= 2.0 * f32::EPSILON as f64 * want, "exp({x}) = {got}, want {want}");
            }
            x -= 0.001_37;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-100.0) < 1.3e-38 && exp(f32::NEG_INFINITY) < 1.3e-38);
    }

    #[test]
    fn silu_mul_matches_a_float64_reference_on_every_path() {
        // inter not a multiple of the lanes: the portable tail too; gate values over [-100, 100]
        let (rows, inter) = (3, 45);
        let mut gu = data(rows * 2 * inter, 9);
        for (i, v) in gu.iter_mut().enumerate() {
            if (i / inter) % 2 == 0 {
                *v *= if i % 7 == 0 { 200.0 } else { 24.0 };
            }
        }
        let paths = std::iter::once(None).chain(crate::Isa::supported_here().into_iter().map(Some));
        for isa in paths {
            let mut out = vec![0f32; rows * inter];
            silu_mul_on(isa, &gu, rows, inter, &mut out).unwrap();
            for r in 0..rows {
                for j in 0..inter {
                    let (x, u) = (gu[r * 2 * inter + j] as f64, gu[r * 2 * inter + inter + j] as f64);
                    let want = x / (1.0 + (-x).exp()) * u;
                    let got = out[r * inter + j] as f64;
                    assert!(
                        (got - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-30,
                        "{isa:?} row {r} [{j}]: silu({x}) * {u} = {got}, want {want}"
                    );
                }
            }
            // one row alone: the same bits as inside the block
            let mut one = vec![0f32; inter];
            silu_mul_on(isa, &gu[2 * inter..4 * inter], 1, inter, &mut one).unwrap();
            assert!(one.iter().zip(&out[inter..2 * inter]).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(silu_mul_on(isa, &gu[1..], rows, inter, &mut out).is_err());
        }
        let mut z = [7f32; 1];
        silu_mul(&[0.0, 3.0], 1, 1, &mut z).unwrap();
        assert_eq!(z[0], 0.0);
    }

    #[test]
    fn add_rms_norm_matches_a_float64_reference() {
        let (rows, width) = (3, 37);
        let mut h = data(rows * width, 1);
        let delta = data(rows * width, 2);
        let weight = data(width, 3);
        let mut want_h = h.clone();
        let mut out = vec![0f32; rows * width];
        add_rms_norm(&mut h, Some(&delta), &weight, 1e-5, &mut out).unwrap();
        for r in 0..rows {
            for i in 0..width {
                want_h[r * width + i] += delta[r * width + i];
            }
            let row = &want_h[r * width..(r + 1) * width];
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / width as f64;
            for i in 0..width {
                let want = weight[i] as f64 * row[i] as f64 / (ms + 1e-5).sqrt();
                assert!((out[r * width + i] as f64 - want).abs() < 1e-5, "row {r} [{i}]");
                assert_eq!(h[r * width + i], want_h[r * width + i]);
            }
        }
        assert!(add_rms_norm(&mut h, None, &weight[..5], 1e-5, &mut out).is_err());
        assert!(add_rms_norm(&mut h, Some(&delta[1..]), &weight, 1e-5, &mut out).is_err());
    }

    /// Float64 attention of one block, written out plainly.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        qkv: &[f32],
        n: usize,
        hd: Heads,
        cos: &[f32],
        sin: &[f32],
        prefix_k: &[f32],
        prefix_v: &[f32],
        prefix: usize,
        mask: &[u8],
        scale: f32,
    ) -> Vec<f64> {
        let Heads { heads: nh, kv_heads: nkv, head_dim: d } = hd;
        let width = (nh + 2 * nkv) * d;
        let rope64 = |x: &[f32], i: usize| -> Vec<f64> {
            (0..d)
                .map(|t| {
                    let rot = if t < d / 2 { -x[t + d / 2] } else { x[t - d / 2] };
                    x[t] as f64 * cos[i * d + t] as f64 + rot as f64 * sin[i * d + t] as f64
                })
                .collect()
        };
        let mut out = vec![0f64; n * nh * d];
        for i in 0..n {
            let row = &qkv[i * width..(i + 1) * width];
            for h in 0..nh {
                let g = h / (nh / nkv);
                let q = rope64(&row[h * d..(h + 1) * d], i);
                let mut keys: Vec<(Vec<f64>, Vec<f64>)> = (0..prefix)
                    .map(|j| {
                        let at = (g * prefix + j) * d;
                        (
                            prefix_k[at..at + d].iter().map(|&v| v as f64).collect(),
                            prefix_v[at..at + d].iter().map(|&v| v as f64).collect(),
                        )
                    })
                    .collect();
                for j in 0..n {
                    if mask[i * n + j] != 0 {
                        let r = &qkv[j * width..(j + 1) * width];
                        keys.push((
                            rope64(&r[(nh + g) * d..(nh + g + 1) * d], j),
                            r[(nh + nkv + g) * d..(nh + nkv + g + 1) * d].iter().map(|&v| v as f64).collect(),
                        ));
                    }
                }
                let s: Vec<f64> = keys
                    .iter()
                    .map(|(k, _)| k.iter().zip(&q).map(|(a, b)| a * b).sum::<f64>() * scale as f64)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (p, (_, v)) in e.iter().zip(&keys) {
                    for t in 0..d {
                        out[(i * nh + h) * d + t] += p / z * v[t];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn block_attention_matches_a_float64_reference_and_fills_the_cache() {
        // head size 16: the portable loops; 64 and 128: the SIMD path of each instruction set
        // this CPU runs, and the portable loops
        let paths = std::iter::once(None).chain(crate::Isa::supported_here().into_iter().map(Some));
        for isa in paths {
            for head_dim in [16, 64, 128] {
                attention_case(isa, Heads { heads: 6, kv_heads: 2, head_dim }, 5, 21, 40);
                attention_case(isa, Heads { heads: 4, kv_heads: 4, head_dim }, 3, 0, 8);
            }
            // SmolLM2's layout after a longer prefix
            attention_case(isa, Heads { heads: 9, kv_heads: 3, head_dim: 64 }, 5, 117, 130);
        }
    }

    fn attention_case(isa: Option<crate::Isa>, hd: Heads, n: usize, prefix: usize, capacity: usize) {
        let width = (hd.heads + 2 * hd.kv_heads) * hd.head_dim;
        let qkv = data(n * width, 4);
        let cos = data(n * hd.head_dim, 5);
        let sin = data(n * hd.head_dim, 6);
        let prefix_k = data(hd.kv_heads * prefix * hd.head_dim, 7);
        let prefix_v = data(hd.kv_heads * prefix * hd.head_dim, 8);
        // a tree: 0 <- 1 <- 2, 0 <- 3, 1 <- 4
        let parents = [usize::MAX, 0, 1, 0, 1];
        let mut mask = vec![0u8; n * n];
        for i in 0..n {
            let mut a = i;
            loop {
                mask[i * n + a] = 1;
                if parents[a] == usize::MAX {
                    break;
                }
                a = parents[a];
            }
        }
        for (m, causal) in [(Some(&mask[..]), false), (None, true)] {
            let mut kc = vec![0f32; hd.kv_heads * capacity * hd.head_dim];
            let mut vc = kc.clone();
            for g in 0..hd.kv_heads {
                for j in 0..prefix {
                    let (src, dst) = ((g * prefix + j) * hd.head_dim, (g * capacity + j) * hd.head_dim);
                    kc[dst..dst + hd.head_dim].copy_from_slice(&prefix_k[src..src + hd.head_dim]);
                    vc[dst..dst + hd.head_dim].copy_from_slice(&prefix_v[src..src + hd.head_dim]);
                }
            }
            let mut out = vec![0f32; n * hd.heads * hd.head_dim];
            block_attention_on(isa, &qkv, n, hd, None, &cos, &sin, &mut kc, &mut vc, prefix, m, 0.25, &mut out, 1)
                .unwrap();
            // heads split between threads (2, or more threads than heads): the same bits
            for threads in [2, 3, 8] {
                let (mut kt, mut vt) = (kc.clone(), vc.clone());
                let mut split = vec![0f32; out.len()];
                block_attention_on(
                    isa, &qkv, n, hd, None, &cos, &sin, &mut kt, &mut vt, prefix, m, 0.25, &mut split, threads,
                )
                .unwrap();
                assert!(
                    split.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?}: {threads} threads, {hd:?}"
                );
                assert_eq!((kt, vt), (kc.clone(), vc.clone()));
            }
            let dense: Vec<u8> =
                if causal { (0..n * n).map(|x| u8::from(x % n <= x / n)).collect() } else { mask.clone() };
            let want = reference(&qkv, n, hd, &cos, &sin, &prefix_k, &prefix_v, prefix, &dense, 0.25);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{isa:?} {hd:?}: {a} vs {b}");
            }
            // the block's values landed in their slots
            let v0 = &qkv[(hd.heads + hd.kv_heads) * hd.head_dim..(hd.heads + hd.kv_heads + 1) * hd.head_dim];
            assert_eq!(&vc[prefix * hd.head_dim..(prefix + 1) * hd.head_dim], v0);
        }
        let mut kc = vec![0f32; hd.kv_heads * capacity * hd.head_dim];
        let mut vc = kc.clone();
        let mut out = vec![0f32; n * hd.heads * hd.head_dim];
        let err = block_attention_on(
            isa,
            &qkv,
            n,
            hd,
            None,
            &cos,
            &sin,
            &mut kc,
            &mut vc,
            capacity - 2,
            None,
            0.25,
            &mut out,
            1,
        );
        assert!(err.unwrap_err().0.contains("exceed"));
        assert!(block_attention_on(
            isa,
            &qkv[1..],
            n,
            hd,
            None,
            &cos,
            &sin,
            &mut kc,
            &mut vc,
            0,
            None,
            0.25,
            &mut out,
            1
        )
        .is_err());
    }
}
