//! `dartcore._native`: thin conversions only. Every function converts its
//! arguments, releases the GIL, calls one core function and converts the result;
//! errors are mapped to Python exceptions in `errors.rs` and nowhere else.
use pyo3::prelude::*;

mod arrays;
mod dart_trie;
mod errors;
mod index;
mod linear;
mod ops;
mod tree;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    index::register(m)?;
    tree::register(m)?;
    linear::register(m)?;
    ops::register(m)?;
    dart_trie::register(m)?;
    Ok(())
}
