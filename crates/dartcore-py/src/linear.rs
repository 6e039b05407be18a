//! Bindings of dart-linear: the small-batch fp32 linear layer the CPU decoder runs its
//! projections and LM head through (`dartcore.kernels.linear`). Thin: check, release the
//! GIL, run on the calling thread (and dart-linear's helper threads).

use numpy::ndarray::Dimension;
use numpy::{PyReadonlyArray, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
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
    let xs = c_slice(&x, "x")?;
    let ws = c_slice(&w, "w")?;
    let bs = bias.as_ref().map(|b| c_slice(b, "bias")).transpose()?;
    if !out.is_c_contiguous() {
        return Err(errors::value("linear_rows: out must be C-contiguous"));
    }
    let os = out.as_slice_mut().map_err(|_| errors::value("linear_rows: out must be C-contiguous"))?;
    py.detach(|| dart_linear::linear(xs, rows, k, ws, n, bs, os, threads)).map_err(|e| errors::value(e.0))
}

/// The elements of a C-contiguous array (`as_slice` alone also takes Fortran order, which the
/// kernel would misread).
fn c_slice<'a, D: Dimension>(a: &'a PyReadonlyArray<'_, f32, D>, what: &str) -> PyResult<&'a [f32]> {
    let err = || errors::value(format!("linear_rows: {what} must be C-contiguous"));
    if !a.is_c_contiguous() {
        return Err(err());
    }
    a.as_slice().map_err(|_| err())
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
