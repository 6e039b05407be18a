//! A decoder's whole layer stack for a block of a few rows in one call: per layer the
//! residual add + RMSNorm, the q|k|v product, the block attention of each sequence over its
//! own cache, the output product, the add + RMSNorm, the gate|up product, SiLU · up and the
//! down product; then the final norm. The products are [`crate::linear`]'s, the rest
//! [`crate::ops`]'s, so the results are bit for bit those of the same calls made one at a time
//! (the caller's loop) -- without a return to the caller between them: from Python, ~7 calls
//! and a few framework ops per layer cost ~3-4 ms of a ~10 ms SmolLM2 step.
//!
//! The products' numerics are the held weights': the products of the weights' f32 values (f32,
//! fp16, bf16, and GGML blocks formed exactly: [`Weights::Packed`]), or the integer path for
//! GGML blocks ([`Weights::Int8`]: each product quantises its input rows once, int8 per
//! 32-value block, and runs integer block dot products, [`crate::int8`]); a stack may mix
//! them (a tensor type without an integer kernel stays exact). The attention, the norms and
//! SiLU are f32 either way. Every output row is the same bits whatever the other rows of the
//! block and the threads, on either numerics.
//!
//! Llama-family layers (Llama, Qwen2/3, Mistral): pre-norm, RMSNorm, rotate-half RoPE,
//! grouped-query attention with optional q/k norms (Qwen3), a gated SiLU MLP.

use std::ops::Range;

use crate::ops::{self, Heads};
use crate::{ShapeError, Weights, MAX_ROWS};

/// A product `out = x @ wᵀ + bias` of a layer: `w` `[n, k]` in any [`Weights`] format.
#[derive(Clone, Copy, Debug)]
pub struct Product<'a> {
    pub w: Weights<'a>,
    pub n: usize,
    pub k: usize,
    pub bias: Option<&'a [f32]>,
}

/// One decoder layer's weights.
#[derive(Clone, Copy, Debug)]
pub struct Layer<'a> {
    /// RMSNorm weights `[hidden]` before the attention and before the MLP.
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
    /// Per-head RMSNorm weights `[head_dim]` of q and k (Qwen3), or None.
    pub qk_norm: Option<(&'a [f32], &'a [f32])>,
    /// `[(heads + 2 kv_heads) · head_dim, hidden]`: q rows, then k, then v.
    pub qkv: Product<'a>,
    /// `[hidden, heads · head_dim]`.
    pub o: Product<'a>,
    /// `[2 · inter, hidden]`: the gate rows, then the up rows (no bias).
    pub gate_up: Product<'a>,
    /// `[hidden, inter]`.
    pub down: Product<'a>,
}

/// The stack's dimensions and constants.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub heads: Heads,
    pub inter: usize,
    /// Every RMSNorm's epsilon.
    pub eps: f32,
    /// The attention's score scale (`head_dim^-0.5`).
    pub scale: f32,
}

/// One sequence of the packed block: its rows, its cache (`[layers, kv_heads, capacity,
/// head_dim]`, both), the cached rows the block follows, and its block mask (`[m, m]` for its
/// `m` rows; None: causal).
#[derive(Debug)]
pub struct Segment<'a> {
    pub rows: Range<usize>,
    pub k_cache: &'a mut [f32],
    pub v_cache: &'a mut [f32],
    pub prefix: usize,
    pub mask: Option<&'a [u8]>,
}

/// Checks a stack's weights against its shape (once, when it is assembled).
pub fn check_layers(layers: &[Layer<'_>], shape: &Shape, final_norm: &[f32]) -> Result<(), ShapeError> {
    let Shape { hidden, heads, inter, .. } = *shape;
    let Heads { heads: nh, kv_heads: nkv, head_dim: d } = heads;
    if layers.is_empty() || hidden == 0 || inter == 0 || nh == 0 || nkv == 0 || d == 0 || !nh.is_multiple_of(nkv) {
        return Err(ShapeError(format!(
            "layer stack: {} layers, hidden {hidden}, inter {inter}, {heads:?}",
            layers.len()
        )));
    }
    if final_norm.len() != hidden {
        return Err(ShapeError(format!(
            "layer stack: final norm has {} weights, hidden size {hidden}",
            final_norm.len()
        )));
    }
    for (i, l) in layers.iter().enumerate() {
        let fail = |what: String| Err(ShapeError(format!("layer stack: layer {i}: {what}")));
        if l.input_norm.len() != hidden || l.post_norm.len() != hidden {
            return fail(format!(
                "norm weights of {} / {} elements, hidden size {hidden}",
                l.input_norm.len(),
                l.post_norm.len()
            ));
        }
        if l.qk_norm.is_some_and(|(q, k)| q.len() != d || k.len() != d) {
            return fail(format!("q/k norm weights need {d} elements"));
        }
        for (what, p, n, k) in [
            ("qkv", &l.qkv, (nh + 2 * nkv) * d, hidden),
            ("o", &l.o, hidden, nh * d),
            ("gate_up", &l.gate_up, 2 * inter, hidden),
            ("down", &l.down, hidden, inter),
        ] {
            if p.n != n || p.k != k {
                return fail(format!("{what} is [{}, {}], expected [{n}, {k}]", p.n, p.k));
            }
            p.w.check(n, k).or_else(|e| fail(format!("{what}: {}", e.0)))?;
            if p.bias.is_some_and(|b| b.len() != n) {
                return fail(format!("{what}: bias of {} elements, expected {n}", p.bias.map_or(0, <[f32]>::len)));
            }
        }
        if l.gate_up.bias.is_some() {
            return fail("gate_up has a bias (the gated MLP has none)".into());
        }
    }
    Ok(())
}

/// The block's rows through every layer and the final norm.
///
/// * `h` `[n, hidden]`: the embedded rows in; the residual stream after the last layer out.
/// * `cos`, `sin` `[n, head_dim]`: each row's RoPE.
/// * `segments`: the sequences, in order, whose rows cover `0..n`.
/// * `taps` (distinct layer indices) and `tap_out` `[taps, n, hidden]`: the input of those
///   layers (the residual stream) is copied there.
/// * `out` `[n, hidden]`: the final normed states.
/// * `threads`: the products' and attentions' (the calling thread and the spinning helpers of
///   [`crate::Team`]).
///
/// Everything is checked before the first cache slot is written; `layers` should have passed
/// [`check_layers`] with `shape` and `final_norm` (the products check again).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    layers: &[Layer<'_>],
    shape: &Shape,
    final_norm: &[f32],
    h: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    segments: &mut [Segment<'_>],
    taps: &[usize],
    tap_out: &mut [f32],
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    let Shape { hidden, heads, inter, eps, scale } = *shape;
    let Heads { heads: nh, kv_heads: nkv, head_dim: d } = heads;
    let n = h.len() / hidden.max(1);
    let fail = |what: String| Err(ShapeError(format!("layer stack: {what}")));
    if n == 0 || n > MAX_ROWS || h.len() != n * hidden || out.len() != h.len() {
        return fail(format!("h has {} elements, out {}: 1..={MAX_ROWS} rows of {hidden}", h.len(), out.len()));
    }
    if cos.len() != n * d || sin.len() != n * d {
        return fail(format!("cos / sin have {} / {} elements, expected {n} x {d}", cos.len(), sin.len()));
    }
    let layer_count = layers.len();
    if taps.iter().any(|&t| t >= layer_count)
        || (1..taps.len()).any(|i| taps[..i].contains(&taps[i]))
        || tap_out.len() != taps.len() * n * hidden
    {
        return fail(format!("taps {taps:?} of {layer_count} layers into {} elements", tap_out.len()));
    }
    let mut next = 0;
    for s in segments.iter() {
        let m = s.rows.len();
        let per_layer = s.k_cache.len() / layer_count;
        let capacity = per_layer / (nkv * d).max(1);
        if s.rows.start != next || m == 0 {
            return fail(format!("segment rows {:?} after row {next}: the segments cover the rows in order", s.rows));
        }
        if s.k_cache.len() != layer_count * nkv * capacity * d || s.v_cache.len() != s.k_cache.len() {
            return fail(format!(
                "caches of {} / {} elements do not hold {layer_count} layers x {nkv} kv heads x {d}",
                s.k_cache.len(),
                s.v_cache.len()
            ));
        }
        if s.prefix + m > capacity {
            return fail(format!("{m} rows after {} cached exceed the cache's {capacity} slots", s.prefix));
        }
        if s.mask.is_some_and(|mk| mk.len() != m * m) {
            return fail(format!("a mask of {} elements for a segment of {m} rows", s.mask.map_or(0, <[u8]>::len)));
        }
        next = s.rows.end;
    }
    if next != n {
        return fail(format!("the segments cover {next} of {n} rows"));
    }
    let width = (nh + 2 * nkv) * d;
    let mut x = vec![0f32; n * hidden];
    let mut qkv = vec![0f32; n * width];
    let mut att = vec![0f32; n * nh * d];
    let mut proj = vec![0f32; n * hidden];
    let mut gu = vec![0f32; n * 2 * inter];
    let mut act = vec![0f32; n * inter];
    let product =
        |p: &Product<'_>, x: &[f32], out: &mut [f32]| crate::linear(x, n, p.k, p.w, p.n, p.bias, out, threads);
    for (i, layer) in layers.iter().enumerate() {
        ops::add_rms_norm(h, (i > 0).then_some(&proj[..]), layer.input_norm, eps, &mut x)?;
        if let Some(j) = taps.iter().position(|&t| t == i) {
            tap_out[j * n * hidden..(j + 1) * n * hidden].copy_from_slice(h);
        }
        product(&layer.qkv, &x, &mut qkv)?;
        let norms = layer.qk_norm.map(|(q, k)| (q, k, eps));
        for s in segments.iter_mut() {
            let per_layer = s.k_cache.len() / layer_count;
            let cache = i * per_layer..(i + 1) * per_layer;
            let Range { start: a, end: b } = s.rows;
            ops::block_attention(
                &qkv[a * width..b * width],
                b - a,
                heads,
                norms,
                &cos[a * d..b * d],
                &sin[a * d..b * d],
                &mut s.k_cache[cache.clone()],
                &mut s.v_cache[cache],
                s.prefix,
                s.mask,
                scale,
                &mut att[a * nh * d..b * nh * d],
                threads,
            )?;
        }
        product(&layer.o, &att, &mut proj)?;
        ops::add_rms_norm(h, Some(&proj), layer.post_norm, eps, &mut x)?;
        product(&layer.gate_up, &x, &mut gu)?;
        ops::silu_mul(&gu, n, inter, &mut act)?;
        product(&layer.down, &act, &mut proj)?;
    }
    ops::add_rms_norm(h, Some(&proj), final_norm, eps, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::data;

    const LAYERS: usize = 3;
    const HEADS: Heads = Heads { heads: 4, kv_heads: 2, head_dim: 64 };
    const SHAPE: Shape = Shape { hidden: 96, heads: HEADS, inter: 72, eps: 1e-5, scale: 0.125 };

    /// Random weights of a small stack, q/k norms and biases on the attention products.
    struct Owned {
        norms: Vec<Vec<f32>>,
        mats: Vec<Vec<f32>>,
        biases: Vec<Vec<f32>>,
    }

    fn owned() -> Owned {
        let Shape { hidden, inter, .. } = SHAPE;
        let d = HEADS.head_dim;
        let width = (HEADS.heads + 2 * HEADS.kv_heads) * d;
        let mut seed = 100;
        let mut next = |len: usize, scale: f32, base: f32| {
            seed += 1;
            data(len, seed).into_iter().map(|v| base + scale * v).collect::<Vec<f32>>()
        };
        let mut o = Owned { norms: vec![], mats: vec![], biases: vec![] };
        for _ in 0..LAYERS {
            o.norms.extend([next(hidden, 0.2, 1.0), next(hidden, 0.2, 1.0), next(d, 0.2, 1.0), next(d, 0.2, 1.0)]);
            o.mats.extend([
                next(width * hidden, 0.3, 0.0),
                next(hidden * HEADS.heads * d, 0.3, 0.0),
                next(2 * inter * hidden, 0.3, 0.0),
                next(hidden * inter, 0.3, 0.0),
            ]);
            o.biases.extend([next(width, 0.1, 0.0), next(hidden, 0.1, 0.0)]);
        }
        o.norms.push(next(hidden, 0.2, 1.0));
        o
    }

    fn layers(o: &Owned) -> Vec<Layer<'_>> {
        let Shape { hidden, inter, .. } = SHAPE;
        let d = HEADS.head_dim;
        let width = (HEADS.heads + 2 * HEADS.kv_heads) * d;
        (0..LAYERS)
            .map(|i| {
                let (nm, m, b) = (&o.norms[4 * i..], &o.mats[4 * i..], &o.biases[2 * i..]);
                Layer {
                    input_norm: &nm[0],
                    post_norm: &nm[1],
                    qk_norm: Some((&nm[2], &nm[3])),
                    qkv: p(&m[0], width, hidden, Some(&b[0])),
                    o: p(&m[1], hidden, HEADS.heads * d, Some(&b[1])),
                    gate_up: p(&m[2], 2 * inter, hidden, None),
                    down: p(&m[3], hidden, inter, None),
                }
            })
            .collect()
    }

    fn p<'a>(w: &'a [f32], n: usize, k: usize, bias: Option<&'a [f32]>) -> Product<'a> {
        Product { w: Weights::F32(w), n, k, bias }
    }

    fn rope(n: usize, first: usize) -> (Vec<f32>, Vec<f32>) {
        let d = HEADS.head_dim;
        let (mut c, mut s) = (vec![0f32; n * d], vec![0f32; n * d]);
        for i in 0..n {
            for t in 0..d {
                let a = (first + i) as f32 / 10f32.powf((t % (d / 2)) as f32 / (d / 2) as f32);
                (c[i * d + t], s[i * d + t]) = (a.cos(), a.sin());
            }
        }
        (c, s)
    }

    /// The same layers as separate calls, the way a caller's loop makes them (a causal block
    /// into empty caches).
    fn one_call_at_a_time(
        ls: &[Layer<'_>],
        final_norm: &[f32],
        h: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        kc: &mut [f32],
        vc: &mut [f32],
    ) -> Vec<f32> {
        let Shape { hidden, inter, eps, scale, .. } = SHAPE;
        let n = h.len() / hidden;
        let per = kc.len() / LAYERS;
        let mut x = vec![0f32; h.len()];
        let mut delta: Option<Vec<f32>> = None;
        for (i, l) in ls.iter().enumerate() {
            ops::add_rms_norm(h, delta.as_deref(), l.input_norm, eps, &mut x).unwrap();
            let mut qkv = vec![0f32; n * l.qkv.n];
            crate::linear(&x, n, hidden, l.qkv.w, l.qkv.n, l.qkv.bias, &mut qkv, 1).unwrap();
            let mut att = vec![0f32; n * l.o.k];
            let (q, k) = l.qk_norm.unwrap();
            ops::block_attention(
                &qkv,
                n,
                HEADS,
                Some((q, k, eps)),
                cos,
                sin,
                &mut kc[i * per..(i + 1) * per],
                &mut vc[i * per..(i + 1) * per],
                0,
                None,
                scale,
                &mut att,
                1,
            )
            .unwrap();
            let mut o = vec![0f32; n * hidden];
            crate::linear(&att, n, l.o.k, l.o.w, hidden, l.o.bias, &mut o, 1).unwrap();
            ops::add_rms_norm(h, Some(&o), l.post_norm, eps, &mut x).unwrap();
            let mut gu = vec![0f32; n * 2 * inter];
            crate::linear(&x, n, hidden, l.gate_up.w, 2 * inter, None, &mut gu, 1).unwrap();
            let mut act = vec![0f32; n * inter];
            ops::silu_mul(&gu, n, inter, &mut act).unwrap();
            let mut down = vec![0f32; n * hidden];
            crate::linear(&act, n, inter, l.down.w, hidden, None, &mut down, 1).unwrap();
            delta = Some(down);
        }
        let mut out = vec![0f32; h.len()];
        ops::add_rms_norm(h, delta.as_deref(), final_norm, eps, &mut out).unwrap();
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn the_stack_is_the_calls_one_at_a_time_and_each_row_its_own_step() {
        if crate::isa().is_none() {
            return; // the products need AVX-512F or AVX2 (the portable ops alone cannot run it)
        }
        let o = owned();
        let ls = layers(&o);
        the_stack_is_its_calls(&ls, o.norms.last().unwrap());
    }

    /// `n` rows of `k` random block weights of `format` (scales about 2^-5).
    fn blocks(format: crate::quant::Format, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut b: Vec<u8> =
            data(n * format.row_bytes(k).unwrap(), seed).iter().map(|v| (v.to_bits() >> 9) as u8).collect();
        for (i, block) in b.chunks_exact_mut(format.block_bytes()).enumerate() {
            block[..2].copy_from_slice(&(0x2800u16 + (i % 97) as u16).to_le_bytes());
            if format == crate::quant::Format::Q4_1 {
                block[2..4].copy_from_slice(&(0xa400u16 + (i % 89) as u16).to_le_bytes());
            }
        }
        b
    }

    #[test]
    fn the_stack_on_the_integer_path_is_its_calls_and_each_row_its_own_step() {
        use crate::int8;
        use crate::quant::Format;
        if int8::kernel().is_none() {
            return;
        }
        // Q4_0 q|k|v, Q4_1 o and gate|up, Q8_0 nowhere the inner size is not whole blocks
        // (down stays f32): the int8 numerics mixed with an exact product, as a GGUF file
        // with a tensor type without an integer kernel is run.
        let o = owned();
        let Shape { hidden, inter, .. } = SHAPE;
        let d = HEADS.head_dim;
        let width = (HEADS.heads + 2 * HEADS.kv_heads) * d;
        let mut held = Vec::new();
        for i in 0..LAYERS {
            let s = 50 + 10 * i as u64;
            for (f, n, k, seed) in [
                (Format::Q4_0, width, hidden, s),
                (Format::Q4_1, hidden, HEADS.heads * d, s + 1),
                (Format::Q8_0, 2 * inter, hidden, s + 2),
            ] {
                held.push((f, n, k, int8::interleave(f, &blocks(f, n, k, seed), n, k).unwrap()));
            }
        }
        let mut ls = layers(&o);
        for (i, l) in ls.iter_mut().enumerate() {
            let q = |j: usize| {
                let (f, n, k, ref w) = held[3 * i + j];
                Product { w: Weights::Int8(f, w), n, k, bias: None }
            };
            l.qkv = Product { bias: l.qkv.bias, ..q(0) };
            l.o = Product { bias: l.o.bias, ..q(1) };
            l.gate_up = q(2);
        }
        the_stack_is_its_calls(&ls, o.norms.last().unwrap());
    }

    fn the_stack_is_its_calls(ls: &[Layer<'_>], final_norm: &[f32]) {
        let ls = ls.to_vec();
        check_layers(&ls, &SHAPE, final_norm).unwrap();
        let hidden = SHAPE.hidden;
        let (n, capacity) = (5, 12);
        let cache_len = LAYERS * HEADS.kv_heads * capacity * HEADS.head_dim;
        let embedded = data(n * hidden, 7);
        let (cos, sin) = rope(n, 0);
        for threads in [1, 2] {
            // the block causally in one forward, against the calls one at a time
            let (mut kc, mut vc) = (vec![0f32; cache_len], vec![0f32; cache_len]);
            let mut h = embedded.clone();
            let mut out = vec![0f32; n * hidden];
            let mut tap = vec![0f32; 2 * n * hidden];
            let mut segs = [Segment { rows: 0..n, k_cache: &mut kc, v_cache: &mut vc, prefix: 0, mask: None }];
            forward(&ls, &SHAPE, final_norm, &mut h, &cos, &sin, &mut segs, &[2, 0], &mut tap, &mut out, threads)
                .unwrap();
            let (mut kw, mut vw) = (vec![0f32; cache_len], vec![0f32; cache_len]);
            let mut hw = embedded.clone();
            let want = one_call_at_a_time(&ls, final_norm, &mut hw, &cos, &sin, &mut kw, &mut vw);
            assert_eq!(bits(&out), bits(&want), "{threads} threads");
            assert_eq!((bits(&h), bits(&kc), bits(&vc)), (bits(&hw), bits(&kw), bits(&vw)));
            assert_eq!(&tap[n * hidden..], &embedded[..], "the input of layer 0");

            // the same rows one decoding step at a time: the same bits row by row
            let (mut ks, mut vs) = (vec![0f32; cache_len], vec![0f32; cache_len]);
            for i in 0..n {
                let mut hi = embedded[i * hidden..(i + 1) * hidden].to_vec();
                let mut oi = vec![0f32; hidden];
                let mut segs = [Segment { rows: 0..1, k_cache: &mut ks, v_cache: &mut vs, prefix: i, mask: None }];
                let (c, s) = (
                    &cos[i * HEADS.head_dim..(i + 1) * HEADS.head_dim],
                    &sin[i * HEADS.head_dim..(i + 1) * HEADS.head_dim],
                );
                forward(&ls, &SHAPE, final_norm, &mut hi, c, s, &mut segs, &[], &mut [], &mut oi, threads).unwrap();
                assert_eq!(bits(&oi), bits(&out[i * hidden..(i + 1) * hidden]), "row {i}, {threads} threads");
            }
            assert_eq!((bits(&ks), bits(&vs)), (bits(&kc), bits(&vc)));

            // two sequences packed: each as if alone (rows 0..2 of one, rows 0..3 of another)
            let (mut k1, mut v1, mut k2, mut v2) =
                (vec![0f32; cache_len], vec![0f32; cache_len], vec![0f32; cache_len], vec![0f32; cache_len]);
            let mut packed = embedded.clone();
            let mut pout = vec![0f32; n * hidden];
            let cos2: Vec<f32> = [&cos[..2 * HEADS.head_dim], &cos[..3 * HEADS.head_dim]].concat();
            let sin2: Vec<f32> = [&sin[..2 * HEADS.head_dim], &sin[..3 * HEADS.head_dim]].concat();
            let mut segs = [
                Segment { rows: 0..2, k_cache: &mut k1, v_cache: &mut v1, prefix: 0, mask: None },
                Segment { rows: 2..5, k_cache: &mut k2, v_cache: &mut v2, prefix: 0, mask: None },
            ];
            forward(&ls, &SHAPE, final_norm, &mut packed, &cos2, &sin2, &mut segs, &[], &mut [], &mut pout, threads)
                .unwrap();
            let mut alone = embedded[2 * hidden..].to_vec();
            let mut aout = vec![0f32; 3 * hidden];
            let (mut k3, mut v3) = (vec![0f32; cache_len], vec![0f32; cache_len]);
            let mut segs = [Segment { rows: 0..3, k_cache: &mut k3, v_cache: &mut v3, prefix: 0, mask: None }];
            forward(
                &ls,
                &SHAPE,
                final_norm,
                &mut alone,
                &cos[..3 * HEADS.head_dim],
                &sin[..3 * HEADS.head_dim],
                &mut segs,
                &[],
                &mut [],
                &mut aout,
                threads,
            )
            .unwrap();
            assert_eq!(bits(&pout[2 * hidden..]), bits(&aout));
            assert_eq!(bits(&pout[..2 * hidden]), bits(&out[..2 * hidden]));
        }
    }

    #[test]
    fn bad_calls_are_refused_before_a_cache_slot_is_written() {
        let o = owned();
        let ls = layers(&o);
        let final_norm = o.norms.last().unwrap();
        let hidden = SHAPE.hidden;
        let (n, capacity) = (3, 4);
        let cache_len = LAYERS * HEADS.kv_heads * capacity * HEADS.head_dim;
        let (cos, sin) = rope(n, 0);
        let run = |prefix: usize, mask: Option<&[u8]>, rows: Range<usize>, taps: &[usize], tap_len: usize| {
            let (mut kc, mut vc) = (vec![0.5f32; cache_len], vec![0.5f32; cache_len]);
            let mut h = data(n * hidden, 3);
            let mut out = vec![0f32; n * hidden];
            let mut tap = vec![0f32; tap_len];
            let mut segs = [Segment { rows, k_cache: &mut kc, v_cache: &mut vc, prefix, mask }];
            let err = forward(&ls, &SHAPE, final_norm, &mut h, &cos, &sin, &mut segs, taps, &mut tap, &mut out, 1)
                .unwrap_err();
            assert!(kc.iter().chain(&vc).all(|&v| v == 0.5), "{err:?} after a write");
            err.0
        };
        assert!(run(2, None, 0..n, &[], 0).contains("exceed"));
        assert!(run(0, Some(&[1, 0, 1]), 0..n, &[], 0).contains("mask"));
        assert!(run(0, None, 0..2, &[], 0).contains("cover"));
        assert!(run(0, None, 0..n, &[LAYERS], n * hidden).contains("taps"));
        assert!(run(0, None, 0..n, &[1, 1], 2 * n * hidden).contains("taps"));
        let mut bad = ls.clone();
        bad[1].down.n = hidden + 1;
        assert!(check_layers(&bad, &SHAPE, final_norm).unwrap_err().0.contains("layer 1: down"));
        assert!(check_layers(&ls, &SHAPE, &final_norm[1..]).is_err());
    }
}
