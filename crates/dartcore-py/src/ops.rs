//! Bindings of dart-linear's decoder-layer ops (`dart_linear::ops`): the residual add + RMSNorm
//! and the block attention the CPU decoder runs between its native products
//! (`TargetModel`'s `NativeLayerOps`, `DartDrafter`'s native draft). Thin: check C order,
//! release the GIL, call.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyReadwriteArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{c_slice, c_slice_mut};
use crate::errors::{self, guard};
use dart_linear::ops;

/// add_rms_norm(h float32[m, H], delta float32[m, H] | None, weight float32[H], eps, out
/// float32[m, H]): h += delta (in place), out = RMSNorm(h) * weight.
#[pyfunction]
fn add_rms_norm(
    py: Python<'_>,
    mut h: PyReadwriteArray2<'_, f32>,
    delta: Option<PyReadonlyArray2<'_, f32>>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArray2<'_, f32>,
) -> PyResult<()> {
    guard("add_rms_norm", || {
        let d = delta.as_ref().map(|a| c_slice(a, "delta")).transpose()?;
        let w = c_slice(&weight, "weight")?;
        let hs = c_slice_mut(&mut h, "h")?;
        let os = c_slice_mut(&mut out, "out")?;
        py.detach(|| ops::add_rms_norm(hs, d, w, eps, os)).map_err(|e| errors::value(e.0))
    })
}

/// block_attention(qkv float32[n, (heads + 2 kv) * D], heads, kv_heads, cos float32[n, D],
/// sin float32[n, D], k_cache float32[kv, capacity, D], v_cache (same), prefix, mask
/// bool[n, n] | None, scale, out float32[n, heads * D], q_norm float32[D] | None, k_norm
/// float32[D] | None, norm_eps=1e-6, threads=1): a layer's attention for a block of n rows
/// after `prefix` cached ones; writes the block's roped keys and values to the cache slots
/// prefix..prefix + n; `threads` split the heads (the products' team; see
/// dart_linear::ops::block_attention).
#[pyfunction]
#[pyo3(signature = (qkv, heads, kv_heads, cos, sin, k_cache, v_cache, prefix, mask, scale, out, q_norm=None, k_norm=None, norm_eps=1e-6, threads=1))]
#[allow(clippy::too_many_arguments)]
fn block_attention(
    py: Python<'_>,
    qkv: PyReadonlyArray2<'_, f32>,
    heads: usize,
    kv_heads: usize,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
    mut k_cache: PyReadwriteArray3<'_, f32>,
    mut v_cache: PyReadwriteArray3<'_, f32>,
    prefix: usize,
    mask: Option<PyReadonlyArray2<'_, bool>>,
    scale: f32,
    mut out: PyReadwriteArray2<'_, f32>,
    q_norm: Option<PyReadonlyArray1<'_, f32>>,
    k_norm: Option<PyReadonlyArray1<'_, f32>>,
    norm_eps: f32,
    threads: usize,
) -> PyResult<()> {
    guard("block_attention", || {
        let n = qkv.shape()[0];
        let head_dim = k_cache.shape()[2];
        if k_cache.shape()[0] != kv_heads || v_cache.shape() != k_cache.shape() {
            return Err(errors::value(format!(
                "block_attention: caches {:?} / {:?} do not hold {kv_heads} kv heads alike",
                k_cache.shape(),
                v_cache.shape()
            )));
        }
        let norms = match (&q_norm, &k_norm) {
            (Some(q), Some(k)) => Some((c_slice(q, "q_norm")?, c_slice(k, "k_norm")?, norm_eps)),
            (None, None) => None,
            _ => return Err(errors::value("block_attention: give both q_norm and k_norm, or neither")),
        };
        let m = mask.as_ref().map(|a| c_slice(a, "mask")).transpose()?;
        // bool is one byte, 0 or 1, in numpy and in Rust
        let m: Option<&[u8]> = m.map(|b| {
            // SAFETY: a bool slice reinterpreted as bytes of the same length.
            unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), b.len()) }
        });
        let (q, c, s) = (c_slice(&qkv, "qkv")?, c_slice(&cos, "cos")?, c_slice(&sin, "sin")?);
        let kc = c_slice_mut(&mut k_cache, "k_cache")?;
        let vc = c_slice_mut(&mut v_cache, "v_cache")?;
        let o = c_slice_mut(&mut out, "out")?;
        let layout = ops::Heads { heads, kv_heads, head_dim };
        py.detach(|| ops::block_attention(q, n, layout, norms, c, s, kc, vc, prefix, m, scale, o, threads.max(1)))
            .map_err(|e| errors::value(e.0))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(block_attention, m)?)?;
    Ok(())
}
