//! Binding of dart-linear's LM-head refinement (`dart_linear::screen`): a drafter's screened
//! head (`dartcore.kernels.linear.ScreenedWeight`). Thin: check C order, release the GIL, call.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{c_slice, c_slice_mut};
use crate::errors::{self, guard};

/// refine_top(values float32[rows, n], x float32[rows, k], w float32[n, k], bias float32[n] |
/// None, m): each row's m largest values (ties: the lower index first) made again as x[r] ·
/// w[j] (+ bias[j]) from the float weight, in place (see dart_linear::screen::refine_top).
#[pyfunction]
fn refine_top(
    py: Python<'_>,
    mut values: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, f32>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    m: usize,
) -> PyResult<()> {
    guard("refine_top", || {
        let (rows, n) = (values.shape()[0], values.shape()[1]);
        let k = x.shape()[1];
        if x.shape()[0] != rows || w.shape() != [n, k] {
            return Err(errors::value(format!(
                "refine_top: values {:?}, x {:?}, w {:?} do not fit values = x @ w.T",
                values.shape(),
                x.shape(),
                w.shape()
            )));
        }
        let xs = c_slice(&x, "refine_top: x")?;
        let ws = c_slice(&w, "refine_top: w")?;
        let bs = bias.as_ref().map(|b| c_slice(b, "refine_top: bias")).transpose()?;
        let vs = c_slice_mut(&mut values, "refine_top: values")?;
        py.detach(|| dart_linear::screen::refine_top(vs, rows, n, m, xs, k, ws, bs)).map_err(|e| errors::value(e.0))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(refine_top, m)?)?;
    Ok(())
}
