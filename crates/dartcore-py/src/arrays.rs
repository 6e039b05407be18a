//! C-contiguous element slices of numpy arrays for the kernels (`as_slice` alone also takes
//! Fortran order, which a row-major kernel would misread).

use numpy::ndarray::Dimension;
use numpy::{PyReadonlyArray, PyReadwriteArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors;

fn not_c(what: &str) -> PyErr {
    errors::value(format!("{what} must be C-contiguous"))
}

/// The elements of a C-contiguous array; `what` names it in the error.
pub(crate) fn c_slice<'a, T: numpy::Element, D: Dimension>(
    a: &'a PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    if !a.is_c_contiguous() {
        return Err(not_c(what));
    }
    a.as_slice().map_err(|_| not_c(what))
}

/// The elements of a writable C-contiguous array; `what` names it in the error.
pub(crate) fn c_slice_mut<'a, T: numpy::Element, D: Dimension>(
    a: &'a mut PyReadwriteArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a mut [T]> {
    if !a.is_c_contiguous() {
        return Err(not_c(what));
    }
    a.as_slice_mut().map_err(|_| not_c(what))
}
