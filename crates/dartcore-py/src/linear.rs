//! Bindings of dart-linear: the small-batch fp32 linear layer the CPU decoder runs its
//! projections and LM head through (`dartcore.kernels.linear`). Thin: check, release the
//! GIL, run on the calling thread (and dart-linear's helper threads).

use dart_linear::quant::Format;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{c_slice, c_slice_mut};
use crate::errors::{self, guard};

/// A GGML block format by name: "q4_0", "q4_1", "q8_0" (rows as the GGUF file stores them),
/// or with "_packed" (rows in dart-linear's packed layout, `pack_rows`); None otherwise.
pub(crate) fn block_format(name: &str) -> Option<(Format, bool)> {
    match name.strip_suffix("_packed") {
        Some(base) => Format::from_name(base).map(|f| (f, true)),
        None => Format::from_name(name).map(|f| (f, false)),
    }
}

/// linear_rows(x float32[m, k], w [n, k], bias float32[n] | None, out float32[m, n],
/// threads=1, format="f32"): out = x @ w.T + bias, m <= 16, every array C-contiguous. `w` is
/// float32 for format "f32", or uint16 bit patterns for "f16" (IEEE half) and "bf16" (each
/// converted to f32 exactly), or for a GGML block format ("q4_0", "q4_1", "q8_0") uint8
/// `[n, k / 32 * block bytes]`: the rows' blocks as the GGUF file stores them (packed for the
/// call), or with "_packed" ("q4_1_packed", ...) the same rows packed by `pack_rows`, which
/// the kernel streams; bit for bit the products of their dequantised f32 values. On the
/// calling thread, or with `threads > 1` on it and the spinning helpers of dart-linear's team.
#[pyfunction]
#[pyo3(signature = (x, w, bias, out, threads = 1, format = "f32"))]
#[allow(clippy::too_many_arguments)]
fn linear_rows(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    w: &Bound<'_, PyAny>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
    format: &str,
) -> PyResult<()> {
    guard("linear_rows", || {
        if let Some((fmt, packed)) = block_format(format) {
            let blocks = w.extract::<PyReadonlyArray2<'_, u8>>().map_err(|_| wrong_w(format))?;
            let (rows, k) = (x.shape()[0], x.shape()[1]);
            let n = blocks.shape()[0];
            if out.shape() != [rows, n] {
                return Err(errors::value(format!("linear_rows: x {:?}, w {:?} ({format}), out {:?} do not fit out = x @ w.T", x.shape(), blocks.shape(), out.shape())));
            }
            let xs = c_slice(&x, "linear_rows: x")?;
            let bytes = c_slice(&blocks, "linear_rows: w")?;
            let ws = if packed { dart_linear::Weights::Packed(fmt, bytes) } else { dart_linear::Weights::Blocks(fmt, bytes) };
            let bs = bias.as_ref().map(|b| c_slice(b, "linear_rows: bias")).transpose()?;
            let os = c_slice_mut(&mut out, "linear_rows: out")?;
            return py.detach(|| dart_linear::linear(xs, rows, k, ws, n, bs, os, threads)).map_err(|e| errors::value(format!("linear_rows: {}", e.0)));
        }
        let (w32, w16) = match format {
            "f32" => (Some(w.extract::<PyReadonlyArray2<'_, f32>>().map_err(|_| wrong_w(format))?), None),
            "f16" | "bf16" => (None, Some(w.extract::<PyReadonlyArray2<'_, u16>>().map_err(|_| wrong_w(format))?)),
            _ => return Err(errors::value(format!("linear_rows: unknown weight format {format:?} (f32, f16, bf16, q4_0, q4_1, q8_0, each q with _packed)"))),
        };
        let w_shape = match (&w32, &w16) {
            (Some(a), _) => a.shape().to_vec(),
            (_, Some(a)) => a.shape().to_vec(),
            _ => unreachable!("one of the two weights was extracted"),
        };
        let (rows, k) = (x.shape()[0], x.shape()[1]);
        let n = w_shape[0];
        if w_shape[1] != k || out.shape() != [rows, n] {
            return Err(errors::value(format!(
                "linear_rows: x {:?}, w {:?}, out {:?} do not fit out = x @ w.T",
                x.shape(),
                w_shape,
                out.shape()
            )));
        }
        let xs = c_slice(&x, "linear_rows: x")?;
        let ws = match (&w32, &w16, format) {
            (Some(a), _, _) => dart_linear::Weights::F32(c_slice(a, "linear_rows: w")?),
            (_, Some(a), "f16") => dart_linear::Weights::F16(c_slice(a, "linear_rows: w")?),
            (_, Some(a), _) => dart_linear::Weights::Bf16(c_slice(a, "linear_rows: w")?),
            _ => unreachable!("one of the two weights was extracted"),
        };
        let bs = bias.as_ref().map(|b| c_slice(b, "linear_rows: bias")).transpose()?;
        let os = c_slice_mut(&mut out, "linear_rows: out")?;
        py.detach(|| dart_linear::linear(xs, rows, k, ws, n, bs, os, threads)).map_err(|e| errors::value(e.0))
    })
}

/// dequantize_rows(w uint8[n, k / 32 * block bytes], out float32[n, k], format): the f32
/// values of GGML block rows ("q4_0", "q4_1", "q8_0"), as the `gguf` package's dequantiser
/// computes them (fp16 scales widened; a multiply, then a separate add); "q4_1_packed" etc.:
/// rows packed by `pack_rows`.
#[pyfunction]
fn dequantize_rows(py: Python<'_>, w: PyReadonlyArray2<'_, u8>, mut out: PyReadwriteArray2<'_, f32>, format: &str) -> PyResult<()> {
    guard("dequantize_rows", || {
        let (fmt, packed) = block_format(format).ok_or_else(|| errors::value(format!("dequantize_rows: unknown block format {format:?} (q4_0, q4_1, q8_0, each with _packed)")))?;
        let (n, k) = (out.shape()[0], out.shape()[1]);
        if w.shape()[0] != n {
            return Err(errors::value(format!("dequantize_rows: w has {} rows, out {n}", w.shape()[0])));
        }
        let ws = c_slice(&w, "dequantize_rows: w")?;
        let os = c_slice_mut(&mut out, "dequantize_rows: out")?;
        let run = |ws, os: &mut [f32]| if packed { dart_linear::quant::dequantize_packed(fmt, ws, n, k, os) } else { dart_linear::quant::dequantize(fmt, ws, n, k, os) };
        py.detach(|| run(ws, os)).map_err(|e| errors::value(format!("dequantize_rows: {}", e.0)))
    })
}

/// pack_rows(w uint8[n, k / 32 * block bytes], out uint8[n, same], format): GGML block rows
/// ("q4_0", "q4_1", "q8_0", as the file stores them) in dart-linear's packed layout, which
/// the kernel streams (format name + "_packed"): the same bytes, each row's scales first.
#[pyfunction]
fn pack_rows(py: Python<'_>, w: PyReadonlyArray2<'_, u8>, mut out: PyReadwriteArray2<'_, u8>, format: &str) -> PyResult<()> {
    guard("pack_rows", || {
        let fmt = Format::from_name(format).ok_or_else(|| errors::value(format!("pack_rows: unknown block format {format:?} (q4_0, q4_1, q8_0)")))?;
        let (n, bytes) = (w.shape()[0], w.shape()[1]);
        if out.shape() != w.shape() {
            return Err(errors::value(format!("pack_rows: w {:?}, out {:?}: the same shape", w.shape(), out.shape())));
        }
        if bytes % fmt.block_bytes() != 0 {
            return Err(errors::value(format!("pack_rows: rows of {bytes} bytes are not whole {format} blocks")));
        }
        let k = bytes / fmt.block_bytes() * dart_linear::quant::BLOCK_WEIGHTS;
        let ws = c_slice(&w, "pack_rows: w")?;
        let os = c_slice_mut(&mut out, "pack_rows: out")?;
        py.detach(|| dart_linear::quant::pack(fmt, ws, n, k, os)).map_err(|e| errors::value(format!("pack_rows: {}", e.0)))
    })
}

fn wrong_w(format: &str) -> PyErr {
    let dtype = match format {
        "f32" => "float32",
        "f16" | "bf16" => "uint16 (bit patterns)",
        _ => "uint8 (the rows' blocks)",
    };
    errors::value(format!("linear_rows: w must be a 2-D {dtype} array for format {format:?}"))
}

/// Whether this CPU runs linear_rows (AVX-512F + FMA, or AVX2 + FMA + F16C).
#[pyfunction]
fn linear_available() -> bool {
    dart_linear::available()
}

/// The instruction set linear_rows and the layer ops run with: "avx512", "avx2", or None
/// (not on this CPU, or turned off by DARTCORE_LINEAR_ISA=none).
#[pyfunction]
fn linear_isa() -> Option<&'static str> {
    dart_linear::isa().map(dart_linear::Isa::name)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(linear_rows, m)?)?;
    m.add_function(wrap_pyfunction!(linear_available, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_rows, m)?)?;
    m.add_function(wrap_pyfunction!(pack_rows, m)?)?;
    m.add_function(wrap_pyfunction!(linear_isa, m)?)?;
    Ok(())
}
