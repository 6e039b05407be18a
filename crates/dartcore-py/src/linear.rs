//! Bindings of dart-linear: the small-batch fp32 linear layer the CPU decoder runs its
//! projections and LM head through (`dartcore.kernels.linear`). Thin: check, release the
//! GIL, run on the calling thread (and dart-linear's helper threads).

use dart_linear::quant::Format;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{c_slice, c_slice_mut};
use crate::errors::{self, guard};

/// How a GGML block weight's rows are laid out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// As the GGUF file stores them.
    File,
    /// dart-linear's packed layout (`pack_rows`): the exact path streams it.
    Packed,
    /// The integer path's interleaved layout (`interleave_rows`, whole groups of 8 rows).
    Int8,
}

/// A GGML block format by name: "q4_0", "q4_1", "q8_0" (rows as the GGUF file stores them),
/// with "_packed" (rows in dart-linear's packed layout, `pack_rows`), or with "_int8" (the
/// integer path's interleaved rows, `interleave_rows`); None otherwise.
pub(crate) fn block_format(name: &str) -> Option<(Format, Layout)> {
    let (base, layout) = if let Some(b) = name.strip_suffix("_packed") {
        (b, Layout::Packed)
    } else if let Some(b) = name.strip_suffix("_int8") {
        (b, Layout::Int8)
    } else {
        (name, Layout::File)
    };
    Format::from_name(base).map(|f| (f, layout))
}

/// [`block_format`], or the error naming the formats for the function `what`.
fn block_format_of(name: &str, what: &str) -> PyResult<(Format, Layout)> {
    block_format(name).ok_or_else(|| {
        errors::value(format!("{what}: unknown block format {name:?} (q4_0, q4_1, q8_0, each with _packed or _int8)"))
    })
}

/// The rows of an interleaved weight array (`[groups * 8, row bytes]`) for `n` output rows:
/// its shape's first dimension is `n` rounded up to whole groups.
pub(crate) fn interleaved_rows(held: usize, n: usize, what: &str) -> PyResult<()> {
    if held != n.div_ceil(dart_linear::int8::GROUP) * dart_linear::int8::GROUP || n == 0 {
        return Err(errors::value(format!("{what}: an _int8 weight of {held} rows cannot hold {n} output rows (interleave_rows pads to whole groups of 8)")));
    }
    Ok(())
}

/// linear_rows(x float32[m, k], w [n, k], bias float32[n] | None, out float32[m, n],
/// threads=1, format="f32"): out = x @ w.T + bias, m <= 16, every array C-contiguous. `w` is
/// float32 for format "f32", or uint16 bit patterns for "f16" (IEEE half) and "bf16" (each
/// converted to f32 exactly), or for a GGML block format ("q4_0", "q4_1", "q8_0") uint8
/// `[n, k / 32 * block bytes]`: the rows' blocks as the GGUF file stores them (packed for the
/// call), or with "_packed" ("q4_1_packed", ...) the same rows packed by `pack_rows`, which
/// the kernel streams; bit for bit the products of their dequantised f32 values. With "_int8"
/// ("q4_1_int8", ...) `w` holds the rows interleaved by `interleave_rows` (padded to whole
/// groups of 8, `n` = out's columns) and the product runs on the integer path: `x`'s rows
/// quantised to int8 per 32-value block, integer block dot products (another numerics, each
/// row the same bits whatever the others). On the
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
        if let Some((fmt, layout)) = block_format(format) {
            let blocks = w.extract::<PyReadonlyArray2<'_, u8>>().map_err(|_| wrong_w(format))?;
            let (rows, k) = (x.shape()[0], x.shape()[1]);
            let n = if layout == Layout::Int8 { out.shape()[1] } else { blocks.shape()[0] };
            if layout == Layout::Int8 {
                interleaved_rows(blocks.shape()[0], n, "linear_rows")?;
            }
            if out.shape() != [rows, n] {
                return Err(errors::value(format!(
                    "linear_rows: x {:?}, w {:?} ({format}), out {:?} do not fit out = x @ w.T",
                    x.shape(),
                    blocks.shape(),
                    out.shape()
                )));
            }
            let xs = c_slice(&x, "linear_rows: x")?;
            let bytes = c_slice(&blocks, "linear_rows: w")?;
            let ws = match layout {
                Layout::File => dart_linear::Weights::Blocks(fmt, bytes),
                Layout::Packed => dart_linear::Weights::Packed(fmt, bytes),
                Layout::Int8 => dart_linear::Weights::Int8(fmt, bytes),
            };
            let bs = bias.as_ref().map(|b| c_slice(b, "linear_rows: bias")).transpose()?;
            let os = c_slice_mut(&mut out, "linear_rows: out")?;
            return py
                .detach(|| dart_linear::linear(xs, rows, k, ws, n, bs, os, threads))
                .map_err(|e| errors::value(format!("linear_rows: {}", e.0)));
        }
        let (w32, w16) = match format {
            "f32" => (Some(w.extract::<PyReadonlyArray2<'_, f32>>().map_err(|_| wrong_w(format))?), None),
            "f16" | "bf16" => (None, Some(w.extract::<PyReadonlyArray2<'_, u16>>().map_err(|_| wrong_w(format))?)),
            _ => return Err(errors::value(format!("linear_rows: unknown weight format {format:?} (f32, f16, bf16, q4_0, q4_1, q8_0, each q with _packed or _int8)"))),
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
/// rows packed by `pack_rows`; "q4_1_int8" etc.: rows interleaved by `interleave_rows` (`out`'s
/// `n` rows of them).
#[pyfunction]
fn dequantize_rows(
    py: Python<'_>,
    w: PyReadonlyArray2<'_, u8>,
    mut out: PyReadwriteArray2<'_, f32>,
    format: &str,
) -> PyResult<()> {
    guard("dequantize_rows", || {
        let (fmt, layout) = block_format_of(format, "dequantize_rows")?;
        let (n, k) = (out.shape()[0], out.shape()[1]);
        if layout == Layout::Int8 {
            interleaved_rows(w.shape()[0], n, "dequantize_rows")?;
        } else if w.shape()[0] != n {
            return Err(errors::value(format!("dequantize_rows: w has {} rows, out {n}", w.shape()[0])));
        }
        let ws = c_slice(&w, "dequantize_rows: w")?;
        let os = c_slice_mut(&mut out, "dequantize_rows: out")?;
        let run = |ws, os: &mut [f32]| match layout {
            Layout::File => dart_linear::quant::dequantize(fmt, ws, n, k, os),
            Layout::Packed => dart_linear::quant::dequantize_packed(fmt, ws, n, k, os),
            Layout::Int8 => dart_linear::int8::deinterleave(fmt, ws, n, k)
                .and_then(|file| dart_linear::quant::dequantize(fmt, &file, n, k, os)),
        };
        py.detach(|| run(ws, os)).map_err(|e| errors::value(format!("dequantize_rows: {}", e.0)))
    })
}

/// dequantize_rows_at(w uint8[held, k / 32 * block bytes], ids int64[m], out float32[m, k],
/// format): rows `ids` of a GGML block weight as f32 (an embedding's lookups), each
/// `dequantize_rows`'s values of that row bit for bit, reading only those rows' blocks; `format`
/// as for `dequantize_rows` ("_int8": `w`'s rows padded to whole groups of 8, every id below
/// `held`).
#[pyfunction]
fn dequantize_rows_at(
    py: Python<'_>,
    w: PyReadonlyArray2<'_, u8>,
    ids: PyReadonlyArray1<'_, i64>,
    mut out: PyReadwriteArray2<'_, f32>,
    format: &str,
) -> PyResult<()> {
    guard("dequantize_rows_at", || {
        let (fmt, layout) = block_format_of(format, "dequantize_rows_at")?;
        let (held, k) = (w.shape()[0], out.shape()[1]);
        let ids = c_slice(&ids, "dequantize_rows_at: ids")?
            .iter()
            .map(|&j| usize::try_from(j).map_err(|_| errors::value(format!("dequantize_rows_at: row {j}"))))
            .collect::<PyResult<Vec<usize>>>()?;
        let layout = match layout {
            Layout::File => dart_linear::rows::Layout::File,
            Layout::Packed => dart_linear::rows::Layout::Packed,
            Layout::Int8 => dart_linear::rows::Layout::Interleaved,
        };
        let ws = c_slice(&w, "dequantize_rows_at: w")?;
        let os = c_slice_mut(&mut out, "dequantize_rows_at: out")?;
        py.detach(|| dart_linear::rows::dequantize_rows_at(fmt, layout, ws, held, k, &ids, os))
            .map_err(|e| errors::value(format!("dequantize_rows_at: {}", e.0)))
    })
}

/// pack_rows(w uint8[n, k / 32 * block bytes], out uint8[n, same], format): GGML block rows
/// ("q4_0", "q4_1", "q8_0", as the file stores them) in dart-linear's packed layout, which
/// the kernel streams (format name + "_packed"): the same bytes, each row's scales first.
#[pyfunction]
fn pack_rows(
    py: Python<'_>,
    w: PyReadonlyArray2<'_, u8>,
    mut out: PyReadwriteArray2<'_, u8>,
    format: &str,
) -> PyResult<()> {
    guard("pack_rows", || {
        let fmt = Format::from_name(format)
            .ok_or_else(|| errors::value(format!("pack_rows: unknown block format {format:?} (q4_0, q4_1, q8_0)")))?;
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
        py.detach(|| dart_linear::quant::pack(fmt, ws, n, k, os))
            .map_err(|e| errors::value(format!("pack_rows: {}", e.0)))
    })
}

/// interleave_rows(w uint8[n, k / 32 * block bytes], format) -> uint8[ceil(n / 8) * 8, same]:
/// GGML block rows ("q4_0", "q4_1", "q8_0", as the file stores them) in the integer path's
/// interleaved layout (format name + "_int8"): eight rows at a time, four bytes of each in
/// turn, the last group padded with zero rows.
#[pyfunction]
fn interleave_rows<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, u8>,
    format: &str,
) -> PyResult<Bound<'py, numpy::PyArray2<u8>>> {
    guard("interleave_rows", || {
        let fmt = Format::from_name(format).ok_or_else(|| {
            errors::value(format!("interleave_rows: unknown block format {format:?} (q4_0, q4_1, q8_0)"))
        })?;
        let (n, bytes) = (w.shape()[0], w.shape()[1]);
        if bytes % fmt.block_bytes() != 0 || bytes == 0 {
            return Err(errors::value(format!("interleave_rows: rows of {bytes} bytes are not whole {format} blocks")));
        }
        let k = bytes / fmt.block_bytes() * dart_linear::quant::BLOCK_WEIGHTS;
        let ws = c_slice(&w, "interleave_rows: w")?;
        let out = py
            .detach(|| dart_linear::int8::interleave(fmt, ws, n, k))
            .map_err(|e| errors::value(format!("interleave_rows: {}", e.0)))?;
        let rows = out.len() / bytes;
        numpy::PyArrayMethods::reshape(&numpy::PyArray1::from_vec(py, out), [rows, bytes])
    })
}

/// deinterleave_rows(w uint8[ceil(n / 8) * 8, row bytes], n, format) -> uint8[n, row bytes]:
/// rows interleaved by `interleave_rows` back as the file stores them.
#[pyfunction]
fn deinterleave_rows<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, u8>,
    n: usize,
    format: &str,
) -> PyResult<Bound<'py, numpy::PyArray2<u8>>> {
    guard("deinterleave_rows", || {
        let fmt = Format::from_name(format).ok_or_else(|| {
            errors::value(format!("deinterleave_rows: unknown block format {format:?} (q4_0, q4_1, q8_0)"))
        })?;
        let bytes = w.shape()[1];
        if bytes % fmt.block_bytes() != 0 || bytes == 0 {
            return Err(errors::value(format!(
                "deinterleave_rows: rows of {bytes} bytes are not whole {format} blocks"
            )));
        }
        interleaved_rows(w.shape()[0], n, "deinterleave_rows")?;
        let k = bytes / fmt.block_bytes() * dart_linear::quant::BLOCK_WEIGHTS;
        let ws = c_slice(&w, "deinterleave_rows: w")?;
        let out = py
            .detach(|| dart_linear::int8::deinterleave(fmt, ws, n, k))
            .map_err(|e| errors::value(format!("deinterleave_rows: {}", e.0)))?;
        numpy::PyArrayMethods::reshape(&numpy::PyArray1::from_vec(py, out), [n, bytes])
    })
}

/// The integer path's kernel here: "vnni" (AVX-512 VNNI), "avxvnni" (AVX-VNNI, without
/// AVX-512 or with DARTCORE_LINEAR_ISA=avx2), "avx2", "amx" (AMX-INT8 from eight rows, VNNI for
/// fewer; only where DARTCORE_INT8_KERNEL names it), or None (the kernels do not run, or
/// DARTCORE_LINEAR_ISA turned them off); DARTCORE_INT8_KERNEL also picks a slower one.
#[pyfunction]
fn int8_kernel() -> Option<&'static str> {
    dart_linear::int8::kernel().map(dart_linear::int8::Kernel::name)
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
    m.add_function(wrap_pyfunction!(dequantize_rows_at, m)?)?;
    m.add_function(wrap_pyfunction!(pack_rows, m)?)?;
    m.add_function(wrap_pyfunction!(linear_isa, m)?)?;
    m.add_function(wrap_pyfunction!(interleave_rows, m)?)?;
    m.add_function(wrap_pyfunction!(int8_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(deinterleave_rows, m)?)?;
    Ok(())
}
