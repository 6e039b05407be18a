//! Bindings of dart-live: the live n-gram layer (`dartcore._native.LiveLayer`) and the delta
//! indexes it writes and shares (`dartcore._native.LiveDelta`). Inserts, queries, saves and
//! opens release the GIL; the search functions of `tree.rs` take a layer too.
use std::path::PathBuf;
use std::sync::Arc;

use dart_live::{context_match as match_in_context, live_probs, open_delta, write_delta, Delta, LiveLayer};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList};

use crate::errors::{self, guard, Kind};
use crate::index::summary_dict;
use crate::tree::{id, ids};

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

    /// Append one document given as a list of Python ints, read as it is (no array made on
    /// the caller's side). False, changing nothing, when an element is not exactly an int
    /// within i64 (a numpy integer, a bool): the caller converts those to an array instead.
    fn insert_list(&self, py: Python<'_>, tokens: &Bound<'_, PyList>) -> PyResult<bool> {
        guard("LiveLayer.insert_list", || {
            let mut t = Vec::with_capacity(tokens.len());
            for x in tokens.iter() {
                if !x.is_exact_instance_of::<PyInt>() {
                    return Ok(false);
                }
                let Ok(v) = x.extract::<i64>() else {
                    return Ok(false);
                };
                t.push(id(v, "tokens")?);
            }
            let inner = self.inner.clone();
            py.detach(move || inner.insert(&t)).map_err(live_err)?;
            Ok(true)
        })
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        guard("LiveLayer.clear", || {
            let inner = self.inner.clone();
            py.detach(move || inner.clear());
            Ok(())
        })
    }

    /// The continuation of the longest earlier match of the context's end (see dart-live) and
    /// the length of that match (0 when nothing matched).
    fn suffix_lookup<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        max_len: usize,
        min_match: usize,
        max_match: usize,
    ) -> PyResult<(usize, Bound<'py, PyArray1<i64>>)> {
        guard("LiveLayer.suffix_lookup", || {
            let a = context.as_array();
            let n = a.len();
            let ctx = ids(a.iter().skip(n.saturating_sub(max_match)), "context")?;
            let snap = self.inner.snapshot();
            let (m, out) = py.detach(|| snap.suffix_lookup(&ctx, max_len, min_match, max_match));
            Ok((m, PyArray1::from_vec(py, out.into_iter().map(i64::from).collect())))
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
            live_probs(&self.inner.snapshot(), &self.inner.shared(), &ctx, &sorted, &mut out);
            let mut res = vec![0.0; c.len()];
            for (k, &i) in order.iter().enumerate() {
                res[i] = out[k];
            }
            Ok(PyArray1::from_vec(py, res))
        })
    }

    /// Write the window as a delta index at `path` (temporary file, then rename).
    #[pyo3(signature = (path, metadata_json = "{}"))]
    fn save<'py>(&self, py: Python<'py>, path: PathBuf, metadata_json: &str) -> PyResult<Bound<'py, PyDict>> {
        guard("LiveLayer.save", || {
            let snap = self.inner.snapshot();
            let s = py.detach(|| write_delta(&snap, &path, metadata_json)).map_err(errors::ngram)?;
            summary_dict(py, &s)
        })
    }

    /// Read these deltas (other layers' saves) together with the window from now on.
    fn set_shared(&self, deltas: Vec<PyRef<'_, PyLiveDelta>>) -> PyResult<()> {
        guard("LiveLayer.set_shared", || {
            self.inner.set_shared(deltas.iter().map(|d| d.inner.clone()).collect()).map_err(live_err)
        })
    }

    /// Shared deltas read now.
    #[getter]
    fn shared_count(&self) -> usize {
        self.inner.shared().len()
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

/// A delta index mapped for sharing (fully verified at open, of one vocabulary).
#[pyclass(frozen, name = "LiveDelta", module = "dartcore._native")]
pub struct PyLiveDelta {
    inner: Arc<Delta>,
}

#[pymethods]
impl PyLiveDelta {
    #[new]
    fn new(py: Python<'_>, path: PathBuf, vocab_size: u32) -> PyResult<Self> {
        guard("LiveDelta", || {
            let d = py.detach(|| open_delta(&path, vocab_size)).map_err(errors::ngram)?;
            Ok(PyLiveDelta { inner: Arc::new(d) })
        })
    }

    /// Tokens the delta counts.
    #[getter]
    fn tokens(&self) -> u64 {
        self.inner.header().tokens
    }

    #[getter]
    fn documents(&self) -> u64 {
        self.inner.header().documents
    }

    fn metadata_json(&self) -> String {
        self.inner.metadata_json().to_string()
    }
}

/// Prompt lookup (see `dart_live::context_match`): `(depth, continuation)`, the tokens (at
/// most `max_len`) after the latest earlier occurrence of the context's longest recurring end
/// of `max_match` down to `min_match` tokens, and how deep that occurrence matches (counted up
/// to `measure`); `(0, [])` when none recurs or `max_len` is 0.
#[pyfunction]
fn context_match<'py>(
    py: Python<'py>,
    context: PyReadonlyArray1<'py, i64>,
    max_len: usize,
    min_match: usize,
    max_match: usize,
    measure: usize,
) -> PyResult<(usize, Bound<'py, PyArray1<i64>>)> {
    guard("context_match", || {
        let a = context.as_array();
        let owned;
        let ctx = match a.as_slice() {
            Some(s) => s,
            None => {
                owned = a.to_vec();
                &owned[..]
            }
        };
        let found = if max_len == 0 { None } else { match_in_context(ctx, min_match, max_match, measure) };
        Ok(match found {
            Some((depth, start)) => {
                let end = ctx.len().min(start.saturating_add(max_len));
                (depth, PyArray1::from_slice(py, &ctx[start..end]))
            }
            None => (0, PyArray1::from_vec(py, Vec::new())),
        })
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(context_match, m)?)?;
    m.add("LIVE_WEIGHT", dart_live::LIVE_WEIGHT)?;
    m.add_class::<PyLiveLayer>()?;
    m.add_class::<PyLiveDelta>()
}
