//! Bindings of dart-live: the live n-gram layer (`dartcore._native.LiveLayer`).
//! Inserts and queries release the GIL; the search functions of `tree.rs` take a layer too.
use std::sync::Arc;

use dart_live::{live_probs, LiveLayer};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::errors::{self, guard, Kind};
use crate::tree::ids;

/// Map a dart-live error to `dartcore.DartError` (bad parameters, foreign ids).
pub(crate) fn live_err(e: dart_live::Error) -> PyErr {
    errors::new(Kind::Dart, e.to_string())
}

#[pyclass(frozen, name = "LiveLayer", module = "dartcore._native")]
pub struct PyLiveLayer {
    pub(crate) inner: Arc<LiveLayer>,
}

#[pymethods]
impl PyLiveLayer {
    #[new]
    fn new(capacity: usize, vocab_size: u32) -> PyResult<Self> {
        guard("LiveLayer", || {
            Ok(PyLiveLayer { inner: Arc::new(LiveLayer::new(capacity, vocab_size).map_err(live_err)?) })
        })
    }

    /// Append one document (token ids, int64); ids outside the vocabulary change nothing.
    fn insert(&self, py: Python<'_>, tokens: PyReadonlyArray1<'_, i64>) -> PyResult<()> {
        guard("LiveLayer.insert", || {
            let t = ids(tokens.as_array().iter(), "tokens")?;
            let inner = self.inner.clone();
            py.detach(move || inner.insert(&t)).map_err(live_err)
        })
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        guard("LiveLayer.clear", || {
            let inner = self.inner.clone();
            py.detach(move || inner.clear());
            Ok(())
        })
    }

    /// The continuation of the longest earlier match of the context's end (see dart-live).
    fn suffix_match<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        max_len: usize,
        min_match: usize,
        max_match: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        guard("LiveLayer.suffix_match", || {
            let a = context.as_array();
            let n = a.len();
            let ctx = ids(a.iter().skip(n.saturating_sub(max_match)), "context")?;
            let snap = self.inner.snapshot();
            let out = py.detach(|| snap.suffix_match(&ctx, max_len, min_match, max_match));
            Ok(PyArray1::from_vec(py, out.into_iter().map(i64::from).collect()))
        })
    }

    /// The layer's own g(v | context) for each of `candidates` (any order).
    fn probs<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        candidates: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        guard("LiveLayer.probs", || {
            let a = context.as_array();
            let ctx = ids(a.iter().skip(a.len().saturating_sub(2)), "context")?;
            let c = ids(candidates.as_array().iter(), "candidates")?;
            let mut order: Vec<usize> = (0..c.len()).collect();
            order.sort_by_key(|&i| c[i]);
            let sorted: Vec<u32> = order.iter().map(|&i| c[i]).collect();
            let mut out = vec![0.0; c.len()];
            live_probs(&self.inner.snapshot(), &ctx, &sorted, &mut out);
            let mut res = vec![0.0; c.len()];
            for (k, &i) in order.iter().enumerate() {
                res[i] = out[k];
            }
            Ok(PyArray1::from_vec(py, res))
        })
    }

    /// Tokens (and document separators) held now.
    fn __len__(&self) -> usize {
        self.inner.snapshot().len()
    }

    #[getter]
    fn inserted(&self) -> u64 {
        self.inner.snapshot().inserted()
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.inner.snapshot().capacity()
    }

    #[getter]
    fn vocab_size(&self) -> u32 {
        self.inner.snapshot().vocab_size()
    }

    /// Bytes held by both copies' tables.
    fn nbytes(&self) -> usize {
        2 * self.inner.snapshot().nbytes()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLiveLayer>()
}
