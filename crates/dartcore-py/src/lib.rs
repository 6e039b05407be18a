//! `dartcore._native`: thin conversions only. Every function converts its arguments,
//! releases the GIL, calls one core function and converts the result, inside
//! `errors::guard` (a Rust panic becomes `dartcore.InternalError`); errors are mapped to
//! Python exceptions in `errors.rs` and nowhere else. Benchmark timers and test hooks live in
//! the private submodules `_bench` and `_testing` (bench.rs).
use pyo3::prelude::*;

mod arrays;
mod bench;
mod dart_trie;
mod errors;
mod index;
mod linear;
mod live;
mod ops;
mod screen;
mod stack;
mod tree;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::init(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    index::register(m)?;
    tree::register(m)?;
    linear::register(m)?;
    live::register(m)?;
    ops::register(m)?;
    screen::register(m)?;
    stack::register(m)?;
    bench::register(m)?;
    dart_trie::register(m)?;
    Ok(())
}
