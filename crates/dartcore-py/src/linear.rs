//! Bindings of dart-linear: the small-batch fp32 linear layer the CPU decoder runs its
//! projections and LM head through (`dartcore.kernels.linear`). Thin: check, release the
//! GIL, run on the calling thread (and dart-linear's helper threads).

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors;

/// linear_rows(x float32[m, k], w float32[n, k], bias float32[n] | None, out float32[m, n],
/// threads=1): out = x @ w.T + bias, m <= 16, every array C-contiguous; on the calling thread,
/// or with `threads > 1` on it and the spinning helpers of dart-linear's team.
#[pyfunction]
#[pyo3(signature = (x, w, bias, out, threads = 1))]
fn linear_rows(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, f32>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (rows, k) = (x.shape()[0], x.shape()[1]);
    let n = w.shape()[0];
    if w.shape()[1] != k || out.shape() != [rows, n] {
        return Err(errors::value(format!(
            "linear_rows: x {:?}, w {:?}, out {:?} do not fit out = x @ w.T",
            x.shape(),
            w.shape(),
            out.shape()
        )));
    }
    // as_slice also accepts Fortran order, which the kernel would misread.
    for (ok, what) in [(x.is_c_contiguous(), "x"), (w.is_c_contiguous(), "w"), (out.is_c_contiguous(), "out")] {
        if !ok {
            return Err(errors::value(format!("linear_rows: {what} must be C-contiguous")));
        }
    }
    let xs = x.as_slice().map_err(|_| errors::value("linear_rows: x must be C-contiguous"))?;
    let ws = w.as_slice().map_err(|_| errors::value("linear_rows: w must be C-contiguous"))?;
    let bs = match &bias {
        Some(b) => Some(b.as_slice().map_err(|_| errors::value("linear_rows: bias must be C-contiguous"))?),
        None => None,
    };
    let os = out.as_slice_mut().map_err(|_| errors::value("linear_rows: out must be C-contiguous"))?;
    py.detach(|| dart_linear::linear(xs, rows, k, ws, n, bs, os, threads)).map_err(|e| errors::value(e.0))
}

/// Whether this CPU runs linear_rows (AVX-512F + FMA).
#[pyfunction]
fn linear_available() -> bool {
    dart_linear::available()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(linear_rows, m)?)?;
    m.add_function(wrap_pyfunction!(linear_available, m)?)?;
    Ok(())
}
