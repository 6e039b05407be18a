//! Binding of dart-linear's layer stack (`dart_linear::stack`): a target's decoder layers held
//! once as views of its weight arrays, and a forward of a block of up to 16 packed rows through
//! all of them in one call (`TargetModel`'s native path). Thin: check, hold, release the GIL,
//! call.

use dart_linear::ops::Heads;
use dart_linear::quant::Format;
use dart_linear::stack::{self, Layer, Product, Segment, Shape};
use dart_linear::Weights;
use numpy::{
    Element, PyReadonlyArray2, PyReadonlyArrayDyn, PyReadwriteArray2, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::arrays::{c_slice, c_slice_mut};
use crate::errors::{self, guard};
use crate::linear::Layout;

/// The elements of a C-contiguous array the stack holds a reference to.
#[derive(Clone, Copy)]
struct Span<T> {
    ptr: *const T,
    len: usize,
}

impl<T> Span<T> {
    /// # Safety
    /// The array the span was taken from is alive (the stack holds it) and keeps its buffer:
    /// numpy does not resize an array that other references see.
    unsafe fn get<'a>(self) -> &'a [T] {
        // SAFETY: as for this function.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[derive(Clone, Copy)]
enum HeldWeights {
    F32(Span<f32>),
    F16(Span<u16>),
    Bf16(Span<u16>),
    Blocks(Format, Span<u8>),
    Packed(Format, Span<u8>),
    Int8(Format, Span<u8>),
}

#[derive(Clone, Copy)]
struct HeldProduct {
    w: HeldWeights,
    n: usize,
    k: usize,
    bias: Option<Span<f32>>,
}

struct HeldLayer {
    input_norm: Span<f32>,
    post_norm: Span<f32>,
    qk_norm: Option<(Span<f32>, Span<f32>)>,
    products: [HeldProduct; 4],
}

/// LayerStack(layers, final_norm, heads, kv_heads, head_dim, inter, eps, scale, threads=1): a
/// Llama-family decoder's layers, each `(input_norm, post_norm, q_norm | None, k_norm | None,
/// qkv, o, gate_up, down)` with float32 norm weights and each product `(w, format, bias |
/// None)` as `linear_rows` takes it (`w` `[n, k]` float32, uint16 bit patterns of "f16" /
/// "bf16", or uint8 GGML block rows of "q4_0" / "q4_1" / "q8_0", or packed ones of
/// "q4_1_packed" etc.: the layout the kernel streams; file rows are packed per product; or
/// interleaved ones of "q4_1_int8" etc. (`interleave_rows`): the integer path, see
/// dart_linear::stack);
/// every array C-contiguous.
/// The stack keeps references to the arrays and reads them in place (no copy): they must not be
/// written while a forward runs.
#[pyclass(frozen, name = "LayerStack", module = "dartcore._native")]
pub struct PyLayerStack {
    layers: Vec<HeldLayer>,
    final_norm: Span<f32>,
    shape: Shape,
    threads: usize,
    _owners: Vec<Py<PyAny>>,
}

// SAFETY: the spans point into arrays kept alive by `_owners` and are only read.
unsafe impl Send for PyLayerStack {}
unsafe impl Sync for PyLayerStack {}

/// One layer as the Python tuple gives it.
type LayerArgs<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
    ProductArgs<'py>,
    ProductArgs<'py>,
    ProductArgs<'py>,
    ProductArgs<'py>,
);
type ProductArgs<'py> = (Bound<'py, PyAny>, String, Option<Bound<'py, PyAny>>);

/// What a forward's segment is, from Python: (k_cache, v_cache, prefix, start, end, mask | None).
type SegmentArgs<'py> =
    (Bound<'py, PyAny>, Bound<'py, PyAny>, usize, usize, usize, Option<PyReadonlyArray2<'py, bool>>);

struct Holder {
    owners: Vec<Py<PyAny>>,
}

impl Holder {
    /// The span of a C-contiguous array of `T` (any dimensions), kept alive.
    fn hold<T: Element>(&mut self, a: &Bound<'_, PyAny>, what: &str, dtype: &str) -> PyResult<(Span<T>, Vec<usize>)> {
        let arr = a
            .extract::<PyReadonlyArrayDyn<'_, T>>()
            .map_err(|_| errors::value(format!("LayerStack: {what} must be a {dtype} array")))?;
        let s = c_slice(&arr, &format!("LayerStack: {what}"))?;
        let span = Span { ptr: s.as_ptr(), len: s.len() };
        self.owners.push(a.clone().unbind());
        Ok((span, arr.shape().to_vec()))
    }

    fn vector(&mut self, a: &Bound<'_, PyAny>, what: &str) -> PyResult<Span<f32>> {
        let (span, shape) = self.hold::<f32>(a, what, "float32")?;
        if shape.len() != 1 {
            return Err(errors::value(format!("LayerStack: {what} must be 1-D, got shape {shape:?}")));
        }
        Ok(span)
    }

    fn product(&mut self, (w, format, bias): &ProductArgs<'_>, what: &str) -> PyResult<HeldProduct> {
        let two_d = |shape: &[usize]| -> PyResult<(usize, usize)> {
            match shape {
                [n, k] => Ok((*n, *k)),
                _ => Err(errors::value(format!("LayerStack: {what} weight must be 2-D, got shape {shape:?}"))),
            }
        };
        let (w, n, k) = match format.as_str() {
            "f32" => {
                let (s, shape) = self.hold::<f32>(w, what, "float32")?;
                let (n, k) = two_d(&shape)?;
                (HeldWeights::F32(s), n, k)
            }
            "f16" | "bf16" => {
                let (s, shape) = self.hold::<u16>(w, what, "uint16 (bit patterns)")?;
                let (n, k) = two_d(&shape)?;
                (if format == "f16" { HeldWeights::F16(s) } else { HeldWeights::Bf16(s) }, n, k)
            }
            name => {
                let (fmt, layout) = crate::linear::block_format(name).ok_or_else(|| errors::value(format!("LayerStack: {what}: unknown weight format {name:?} (f32, f16, bf16, q4_0, q4_1, q8_0, each q with _packed or _int8)")))?;
                let (s, shape) = self.hold::<u8>(w, what, "uint8 (block rows)")?;
                let (n, bytes) = two_d(&shape)?;
                if bytes % fmt.block_bytes() != 0 {
                    return Err(errors::value(format!(
                        "LayerStack: {what}: rows of {bytes} bytes are not whole {name} blocks"
                    )));
                }
                // (an _int8 weight's rows are padded to whole groups: `new` sets its `n`)
                let held = match layout {
                    Layout::File => HeldWeights::Blocks(fmt, s),
                    Layout::Packed => HeldWeights::Packed(fmt, s),
                    Layout::Int8 => HeldWeights::Int8(fmt, s),
                };
                (held, n, bytes / fmt.block_bytes() * dart_linear::quant::BLOCK_WEIGHTS)
            }
        };
        let bias = bias.as_ref().map(|b| self.vector(b, &format!("{what} bias"))).transpose()?;
        Ok(HeldProduct { w, n, k, bias })
    }
}

impl PyLayerStack {
    /// The held layers as dart-linear's.
    fn layers(&self) -> Vec<Layer<'_>> {
        // SAFETY (all spans): held by `self._owners` (see `Span::get`).
        let product = |p: HeldProduct| Product {
            w: match p.w {
                HeldWeights::F32(s) => Weights::F32(unsafe { s.get() }),
                HeldWeights::F16(s) => Weights::F16(unsafe { s.get() }),
                HeldWeights::Bf16(s) => Weights::Bf16(unsafe { s.get() }),
                HeldWeights::Blocks(f, s) => Weights::Blocks(f, unsafe { s.get() }),
                HeldWeights::Packed(f, s) => Weights::Packed(f, unsafe { s.get() }),
                HeldWeights::Int8(f, s) => Weights::Int8(f, unsafe { s.get() }),
            },
            n: p.n,
            k: p.k,
            bias: p.bias.map(|b| unsafe { b.get() }),
        };
        self.layers
            .iter()
            .map(|l| Layer {
                input_norm: unsafe { l.input_norm.get() },
                post_norm: unsafe { l.post_norm.get() },
                qk_norm: l.qk_norm.map(|(q, k)| unsafe { (q.get(), k.get()) }),
                qkv: product(l.products[0]),
                o: product(l.products[1]),
                gate_up: product(l.products[2]),
                down: product(l.products[3]),
            })
            .collect()
    }
}

#[pymethods]
impl PyLayerStack {
    #[new]
    #[pyo3(signature = (layers, final_norm, heads, kv_heads, head_dim, inter, eps, scale, threads = 1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: Vec<LayerArgs<'_>>,
        final_norm: Bound<'_, PyAny>,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        inter: usize,
        eps: f32,
        scale: f32,
        threads: usize,
    ) -> PyResult<Self> {
        guard("LayerStack", || {
            let mut holder = Holder { owners: Vec::new() };
            let final_span = holder.vector(&final_norm, "final_norm")?;
            let mut held = Vec::with_capacity(layers.len());
            for (i, (input, post, q, k, qkv, o, gu, down)) in layers.iter().enumerate() {
                let qk_norm = match (q, k) {
                    (Some(q), Some(k)) => Some((
                        holder.vector(q, &format!("layer {i} q_norm"))?,
                        holder.vector(k, &format!("layer {i} k_norm"))?,
                    )),
                    (None, None) => None,
                    _ => {
                        return Err(errors::value(format!(
                            "LayerStack: layer {i}: give both q_norm and k_norm, or neither"
                        )))
                    }
                };
                held.push(HeldLayer {
                    input_norm: holder.vector(input, &format!("layer {i} input_norm"))?,
                    post_norm: holder.vector(post, &format!("layer {i} post_norm"))?,
                    qk_norm,
                    products: [
                        holder.product(qkv, &format!("layer {i} qkv"))?,
                        holder.product(o, &format!("layer {i} o"))?,
                        holder.product(gu, &format!("layer {i} gate_up"))?,
                        holder.product(down, &format!("layer {i} down"))?,
                    ],
                });
            }
            let shape = Shape { hidden: final_span.len, heads: Heads { heads, kv_heads, head_dim }, inter, eps, scale };
            // An _int8 product's array holds its rows padded to whole groups of 8: its output
            // rows are the layer's (q|k|v, hidden, gate|up, hidden).
            let wants = [(heads + 2 * kv_heads) * head_dim, final_span.len, 2 * inter, final_span.len];
            for (i, l) in held.iter_mut().enumerate() {
                for (p, &n) in l.products.iter_mut().zip(&wants) {
                    if matches!(p.w, HeldWeights::Int8(..)) {
                        crate::linear::interleaved_rows(p.n, n, &format!("LayerStack: layer {i}"))?;
                        p.n = n;
                    }
                }
            }
            let stack = PyLayerStack {
                layers: held,
                final_norm: final_span,
                shape,
                threads: threads.max(1),
                _owners: holder.owners,
            };
            // SAFETY: held above.
            stack::check_layers(&stack.layers(), &stack.shape, unsafe { stack.final_norm.get() })
                .map_err(|e| errors::value(e.0))?;
            Ok(stack)
        })
    }

    /// forward(h float32[n, hidden], cos float32[n, head_dim], sin, segments, taps, tap_out
    /// float32[len(taps), n, hidden] | None, out float32[n, hidden]): the block's `n <= 16` rows
    /// (`h` embedded; the residual stream after the last layer on return) through every layer
    /// and the final norm into `out`. `segments`: per sequence, in row order, `(k_cache,
    /// v_cache, prefix, start, end, mask | None)` -- its caches float32 `[layers, kv_heads,
    /// capacity, head_dim]` (the block's keys and values are written to slots `prefix ..
    /// prefix + end - start`), its rows `start..end`, its bool mask `[m, m]` (None: causal).
    /// `taps`: layer indices whose input is copied to `tap_out`. Everything is checked before
    /// a cache slot is written.
    #[pyo3(signature = (h, cos, sin, segments, taps, tap_out, out))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        mut h: PyReadwriteArray2<'_, f32>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        segments: Vec<SegmentArgs<'_>>,
        taps: Vec<usize>,
        tap_out: Option<PyReadwriteArrayDyn<'_, f32>>,
        mut out: PyReadwriteArray2<'_, f32>,
    ) -> PyResult<()> {
        guard("LayerStack.forward", || {
            let mut caches = Vec::with_capacity(segments.len());
            for (k, v, _, _, _, _) in &segments {
                let k = k.extract::<PyReadwriteArrayDyn<'_, f32>>().map_err(|e| {
                    errors::value(format!(
                        "LayerStack.forward: k_cache: a writable float32 array not in use elsewhere ({e})"
                    ))
                })?;
                let v = v.extract::<PyReadwriteArrayDyn<'_, f32>>().map_err(|e| {
                    errors::value(format!(
                        "LayerStack.forward: v_cache: a writable float32 array not in use elsewhere ({e})"
                    ))
                })?;
                caches.push((k, v));
            }
            let mut masks = Vec::with_capacity(segments.len());
            for (.., mask) in &segments {
                masks.push(match mask {
                    Some(m) => {
                        let b = c_slice(m, "LayerStack.forward: mask")?;
                        // SAFETY: a bool slice reinterpreted as bytes of the same length (bool is one byte, 0 or 1, in numpy and in Rust).
                        Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), b.len()) })
                    }
                    None => None,
                });
            }
            let mut segs = Vec::with_capacity(segments.len());
            // (rows start > end are an empty range, which the stack refuses)
            for (((k, v), mask), (_, _, prefix, start, end, _)) in caches.iter_mut().zip(masks).zip(&segments) {
                segs.push(Segment {
                    rows: *start..*end,
                    k_cache: c_slice_mut(k, "LayerStack.forward: k_cache")?,
                    v_cache: c_slice_mut(v, "LayerStack.forward: v_cache")?,
                    prefix: *prefix,
                    mask,
                });
            }
            let mut tap_out = tap_out;
            let taps_slice: &mut [f32] = match tap_out.as_mut() {
                Some(t) => c_slice_mut(t, "LayerStack.forward: tap_out")?,
                None => &mut [],
            };
            let (c, s) = (c_slice(&cos, "LayerStack.forward: cos")?, c_slice(&sin, "LayerStack.forward: sin")?);
            let hs = c_slice_mut(&mut h, "LayerStack.forward: h")?;
            let os = c_slice_mut(&mut out, "LayerStack.forward: out")?;
            let layers = self.layers();
            // SAFETY: held by the stack.
            let final_norm = unsafe { self.final_norm.get() };
            py.detach(|| {
                stack::forward(
                    &layers,
                    &self.shape,
                    final_norm,
                    hs,
                    c,
                    s,
                    &mut segs,
                    &taps,
                    taps_slice,
                    os,
                    self.threads,
                )
            })
            .map_err(|e| errors::value(e.0))
        })
    }

    /// Number of layers.
    fn __len__(&self) -> usize {
        self.layers.len()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLayerStack>()
}
