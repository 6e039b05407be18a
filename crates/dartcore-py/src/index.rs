//! Bindings of dart-ngram: `NgramIndex`, `IndexBuilder`, `merge_runs`, `merge_indexes`, pool
//! controls.
//! Thin: convert, release the GIL (`py.detach`), call one core function, convert back; every
//! body runs inside `errors::guard`, so a panic is an `InternalError`, never `PanicException`.
//! Arguments are validated (types, shapes, ranges) by the wrapper `dartcore.index`; the ranges
//! are checked again here, and no buffer is sized from an argument before it is capped.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dart_ngram::{BuildOptions, BuildSummary, Builder, Children, Index, Mmap, OpenOptions, Verify};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{self, guard, Kind};

/// A memory-mapped trigram index (wrapped by `dartcore.index.NgramIndex`).
///
/// `inner` is `pub(crate)` so that other bindings of this crate (tree.rs) can borrow the
/// Rust index without a copy: `idx.get().inner.as_ref()`.
#[pyclass(frozen, name = "NgramIndex", module = "dartcore._native")]
pub struct PyNgramIndex {
    pub(crate) inner: Arc<Index<Mmap>>,
}

/// What `children` returns: (tokens, counts, total, order).
type ChildrenArrays<'py> = (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray1<u64>>, u64, u8);

/// Token ids of the argument `what`, each in `0..vocab`.
fn ids_u32(ids: Vec<i64>, vocab: u32, what: &str) -> PyResult<Vec<u32>> {
    ids.into_iter()
        .map(|t| {
            if t < 0 || t >= vocab as i64 {
                Err(errors::value(format!("{what}: token id {t} is out of range for vocabulary size {vocab}")))
            } else {
                Ok(t as u32)
            }
        })
        .collect()
}

#[pymethods]
impl PyNgramIndex {
    #[new]
    #[pyo3(signature = (path, *, prefault = false, hugepages = false, verify = "header"))]
    fn new(py: Python<'_>, path: PathBuf, prefault: bool, hugepages: bool, verify: &str) -> PyResult<Self> {
        guard("NgramIndex", || {
            let verify: Verify = verify.parse().map_err(errors::ngram)?;
            let idx = py
                .detach(|| Index::open_with(&path, OpenOptions { prefault, hugepages, verify }))
                .map_err(errors::ngram)?;
            Ok(PyNgramIndex { inner: Arc::new(idx) })
        })
    }

    #[getter]
    fn vocab_size(&self) -> u32 {
        self.inner.vocab_size()
    }

    /// The most children any query returns (the distinct tokens seen): the cap of `k`.
    #[getter]
    fn max_children(&self) -> usize {
        self.inner.max_children()
    }

    #[getter]
    fn path(&self) -> Option<String> {
        self.inner.path().map(|p| p.display().to_string())
    }

    fn metadata_json(&self) -> String {
        self.inner.metadata_json().to_string()
    }

    /// (tokens uint32[k'], counts uint64[k'], total, order); k' <= min(k, max_children)
    #[pyo3(signature = (context, k = 25))]
    fn children<'py>(&self, py: Python<'py>, context: Vec<i64>, k: usize) -> PyResult<ChildrenArrays<'py>> {
        guard("NgramIndex.children", || {
            let ctx = ids_u32(context, self.inner.vocab_size(), "context")?;
            let mut ch = Children::with_capacity(k.min(self.inner.max_children()));
            let m = self.inner.children(&ctx, k, &mut ch).map_err(errors::ngram)?;
            Ok((PyArray1::from_slice(py, ch.tokens()), PyArray1::from_slice(py, ch.counts()), m.total, m.order))
        })
    }

    /// contexts: uint32 [n, 2] (C-contiguous) -> (tokens [n,k'], counts [n,k'], totals [n],
    /// orders [n]) with k' = min(k, max_children)
    #[allow(clippy::type_complexity)]
    fn children_batch<'py>(
        &self,
        py: Python<'py>,
        contexts: PyReadonlyArray2<'py, u32>,
        k: usize,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u8>>)> {
        guard("NgramIndex.children_batch", || {
            let ctx = pairs(&contexts)?;
            let n = ctx.len();
            let inner = &self.inner;
            let b = py
                .detach(|| {
                    let pool = dart_ngram::pool::get();
                    inner.children_batch(&ctx, k, &pool)
                })
                .map_err(errors::ngram)?;
            let w = b.k;
            let tokens = PyArray1::from_vec(py, b.tokens).reshape([n, w])?.into_any();
            let counts = PyArray1::from_vec(py, b.counts).reshape([n, w])?.into_any();
            Ok((tokens, counts, PyArray1::from_vec(py, b.totals), PyArray1::from_vec(py, b.orders)))
        })
    }

    #[pyo3(signature = (context, token, unigram_backoff = true))]
    fn prob(&self, context: Vec<i64>, token: i64, unigram_backoff: bool) -> PyResult<f64> {
        guard("NgramIndex.prob", || {
            let v = self.inner.vocab_size();
            let ctx = ids_u32(context, v, "context")?;
            let t = ids_u32(vec![token], v, "token")?[0];
            Ok(self.inner.prob(&ctx, t, unigram_backoff))
        })
    }

    /// g(v|context) for sorted candidate ids (each < vocab_size) -> float64[len]
    #[pyo3(signature = (context, candidates_sorted, unigram_backoff = true))]
    fn cond_probs<'py>(
        &self,
        py: Python<'py>,
        context: Vec<i64>,
        candidates_sorted: PyReadonlyArray1<'py, u32>,
        unigram_backoff: bool,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        guard("NgramIndex.cond_probs", || {
            let v = self.inner.vocab_size();
            let ctx = ids_u32(context, v, "context")?;
            let c = sorted_candidates(&candidates_sorted, v)?;
            let mut out = vec![0.0; c.len()];
            self.inner.cond_probs(&ctx, c, unigram_backoff, &mut out);
            Ok(PyArray1::from_vec(py, out))
        })
    }

    /// (count(context, token), total(context)) for exactly that context (len 0..=2).
    fn count(&self, context: Vec<i64>, token: i64) -> PyResult<(u64, u64)> {
        guard("NgramIndex.count", || {
            let v = self.inner.vocab_size();
            let ctx = ids_u32(context, v, "context")?;
            if ctx.len() > 2 {
                return Err(errors::value(format!("context: count() takes at most 2 tokens, got {}", ctx.len())));
            }
            let t = ids_u32(vec![token], v, "token")?[0];
            Ok(self.inner.count(&ctx, t))
        })
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard("NgramIndex.stats", || {
            let s = self.inner.stats();
            let d = PyDict::new(py);
            d.set_item("vocab_size", s.vocab_size)?;
            d.set_item("token_bits", s.token_bits)?;
            d.set_item("documents", s.documents)?;
            d.set_item("tokens", s.tokens)?;
            d.set_item("unigram_nodes", s.unigram_nodes)?;
            d.set_item("bigram_nodes", s.bigram_nodes)?;
            d.set_item("trigram_nodes", s.trigram_nodes)?;
            d.set_item("nodes", s.nodes)?;
            d.set_item("bytes", s.bytes)?;
            d.set_item("bytes_per_node", s.bytes_per_node)?;
            d.set_item("escaped_counts", s.escaped_counts)?;
            d.set_item("large_contexts", s.large_contexts)?;
            let secs = PyDict::new(py);
            for (name, b) in s.sections {
                secs.set_item(name, b)?;
            }
            d.set_item("sections", secs)?;
            Ok(d)
        })
    }

    /// The check of `level` ("header", "quick", "full"; see dart_ngram::Verify).
    #[pyo3(signature = (level = "full"))]
    fn verify(&self, py: Python<'_>, level: &str) -> PyResult<()> {
        guard("NgramIndex.verify", || {
            let level: Verify = level.parse().map_err(errors::ngram)?;
            let inner = &self.inner;
            py.detach(|| inner.check_mapped(level)).map_err(errors::ngram)
        })
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "NgramIndex(path={:?}, vocab_size={}, nodes={}, bytes={})",
            self.inner.path().map(|p| p.display().to_string()).unwrap_or_default(),
            s.vocab_size,
            s.nodes,
            s.bytes
        )
    }
}

/// The candidates of `cond_probs`: contiguous, ascending, each below the vocabulary size.
pub(crate) fn sorted_candidates<'a>(c: &'a PyReadonlyArray1<'_, u32>, vocab: u32) -> PyResult<&'a [u32]> {
    let c = c.as_slice().map_err(|_| errors::value("candidates_sorted must be contiguous"))?;
    if c.windows(2).any(|w| w[0] > w[1]) {
        return Err(errors::value("candidates_sorted must be sorted ascending"));
    }
    if let Some(&t) = c.last().filter(|&&t| t >= vocab) {
        return Err(errors::value(format!(
            "candidates_sorted: token id {t} is out of range for vocabulary size {vocab}"
        )));
    }
    Ok(c)
}

pub(crate) fn summary_dict<'py>(py: Python<'py>, s: &BuildSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("output", s.output.display().to_string())?;
    d.set_item("documents", s.documents)?;
    d.set_item("tokens", s.tokens)?;
    d.set_item("unigram_nodes", s.unigram_nodes)?;
    d.set_item("bigram_nodes", s.bigram_nodes)?;
    d.set_item("trigram_nodes", s.trigram_nodes)?;
    d.set_item("nodes", s.unigram_nodes + s.bigram_nodes + s.trigram_nodes)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("runs", s.runs)?;
    d.set_item("seconds", s.seconds)?;
    d.set_item("count_seconds", s.count_seconds)?;
    d.set_item("sort_seconds", s.sort_seconds)?;
    d.set_item("write_seconds", s.write_seconds)?;
    Ok(d)
}

/// The seven options of a build as Python passes them, keyword arguments that
/// `dartcore.index` checks first (as `Params` is the search's): every entry point that builds
/// an index reads them here, once, into `BuildOptions`.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct BuildArgs {
    vocab_size: u32,
    #[pyo3(default = 2u64 << 30)]
    memory_limit: u64,
    #[pyo3(default)]
    temp_dir: Option<PathBuf>,
    #[pyo3(default = 1)]
    min_count: u64,
    #[pyo3(default)]
    max_children: Option<u32>,
    #[pyo3(default)]
    threads: Option<usize>,
    #[pyo3(default)]
    token_bits: Option<u32>,
}

impl BuildArgs {
    const NAMES: [&'static str; 7] =
        ["vocab_size", "memory_limit", "temp_dir", "min_count", "max_children", "threads", "token_bits"];

    /// The options among a function's keyword arguments `kwargs` (plus `vocab_size` where it
    /// is positional). `without`: options the entry point does not take. An unknown or
    /// missing name is a `TypeError`, as for a declared keyword.
    pub(crate) fn options(
        py: Python<'_>,
        func: &str,
        kwargs: Option<&Bound<'_, PyDict>>,
        vocab_size: Option<u32>,
        without: &[&str],
    ) -> PyResult<BuildOptions> {
        let d = PyDict::new(py);
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                let name: String = k.extract()?;
                if !Self::NAMES.contains(&name.as_str()) || without.contains(&name.as_str()) {
                    return Err(PyTypeError::new_err(format!("{func}() got an unexpected keyword argument '{name}'")));
                }
                d.set_item(k, v)?;
            }
        }
        if let Some(v) = vocab_size {
            d.set_item("vocab_size", v)?;
        } else if !d.contains("vocab_size")? {
            return Err(PyTypeError::new_err(format!("{func}() missing required keyword argument: 'vocab_size'")));
        }
        let a: BuildArgs = d.extract()?;
        Ok(BuildOptions {
            vocab_size: a.vocab_size,
            memory_limit_bytes: a.memory_limit,
            temp_dir: a.temp_dir,
            min_count: a.min_count,
            max_children_per_context: a.max_children,
            threads: a.threads,
            token_bits: a.token_bits,
        })
    }
}

/// Streaming index builder (wrapped by `dartcore.index.IndexBuilder`).
#[pyclass(frozen, name = "IndexBuilder", module = "dartcore._native")]
pub struct PyIndexBuilder {
    inner: Mutex<Option<Builder>>,
}

impl PyIndexBuilder {
    fn slot(&self) -> PyResult<std::sync::MutexGuard<'_, Option<Builder>>> {
        self.inner.lock().map_err(|_| errors::new(Kind::IndexBuild, "builder poisoned by an earlier panic"))
    }
    fn finished() -> PyErr {
        errors::new(Kind::IndexBuild, "builder already finished")
    }
    fn with<R>(&self, f: impl FnOnce(&mut Builder) -> dart_ngram::Result<R>) -> PyResult<R> {
        let mut g = self.slot()?;
        f(g.as_mut().ok_or_else(Self::finished)?).map_err(errors::ngram)
    }
    fn take(&self) -> PyResult<Builder> {
        self.slot()?.take().ok_or_else(Self::finished)
    }
}

#[pymethods]
impl PyIndexBuilder {
    #[new]
    /// IndexBuilder(vocab_size, *, memory_limit, temp_dir, min_count, max_children, threads,
    /// token_bits) ([`BuildArgs`]).
    #[pyo3(signature = (vocab_size, **options))]
    fn new(py: Python<'_>, vocab_size: u32, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        guard("IndexBuilder", || {
            let opts = BuildArgs::options(py, "IndexBuilder", options, Some(vocab_size), &[])?;
            let b = Builder::new(opts).map_err(errors::ngram)?;
            Ok(PyIndexBuilder { inner: Mutex::new(Some(b)) })
        })
    }

    /// Count one document (uint32 array).
    fn add(&self, py: Python<'_>, doc: PyReadonlyArray1<'_, u32>) -> PyResult<()> {
        guard("IndexBuilder.add", || {
            let d = doc.as_slice().map_err(|_| errors::value("document must be contiguous"))?;
            py.detach(|| self.with(|b| b.add_document(d)))
        })
    }

    /// Count many documents (list of uint32 arrays) in parallel, GIL released.
    fn add_many(&self, py: Python<'_>, docs: Vec<PyReadonlyArray1<'_, u32>>) -> PyResult<()> {
        guard("IndexBuilder.add_many", || {
            let slices: Vec<&[u32]> = docs
                .iter()
                .map(|d| d.as_slice().map_err(|_| errors::value("documents must be contiguous")))
                .collect::<PyResult<_>>()?;
            py.detach(|| self.with(|b| b.add_documents(&slices)))
        })
    }

    #[getter]
    fn documents(&self) -> PyResult<u64> {
        self.with(|b| Ok(b.documents()))
    }

    /// Spill and move the sorted runs into `dir`; the builder is consumed.
    fn write_runs(&self, py: Python<'_>, dir: PathBuf) -> PyResult<Vec<String>> {
        guard("IndexBuilder.write_runs", || {
            let b = self.take()?;
            let runs = py.detach(|| b.write_runs(&dir)).map_err(errors::ngram)?;
            Ok(runs.into_iter().map(|p| p.display().to_string()).collect())
        })
    }

    /// Write the index (temp file + rename); the builder is consumed.
    fn finish<'py>(&self, py: Python<'py>, output: PathBuf, metadata_json: &str) -> PyResult<Bound<'py, PyDict>> {
        guard("IndexBuilder.finish", || {
            let b = self.take()?;
            let s = py.detach(|| b.finish(&output, metadata_json)).map_err(errors::ngram)?;
            summary_dict(py, &s)
        })
    }
}

/// k-way merge of run files into an index: merge_runs(runs, output, *, metadata_json, and the
/// build options ([`BuildArgs`], `vocab_size` required)).
#[pyfunction]
#[pyo3(signature = (runs, output, *, metadata_json = "{}", **options))]
fn merge_runs<'py>(
    py: Python<'py>,
    runs: Vec<PathBuf>,
    output: PathBuf,
    metadata_json: &str,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    guard("merge_runs", || {
        let opts = BuildArgs::options(py, "merge_runs", options, None, &[])?;
        let s = py.detach(|| dart_ngram::merge_runs(&runs, &output, &opts, metadata_json)).map_err(errors::ngram)?;
        summary_dict(py, &s)
    })
}

/// Merge index files into one: merge_indexes(inputs, output, *, metadata_json, and the build
/// options ([`BuildArgs`], `vocab_size` required)); see `dart_ngram::merge_indexes`.
#[pyfunction]
#[pyo3(signature = (inputs, output, *, metadata_json = "{}", **options))]
fn merge_indexes<'py>(
    py: Python<'py>,
    inputs: Vec<PathBuf>,
    output: PathBuf,
    metadata_json: &str,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    guard("merge_indexes", || {
        let opts = BuildArgs::options(py, "merge_indexes", options, None, &[])?;
        let s = py
            .detach(|| {
                let ixs = inputs.iter().map(Index::open).collect::<dart_ngram::Result<Vec<_>>>()?;
                let refs: Vec<&Index<Mmap>> = ixs.iter().collect();
                dart_ngram::merge_indexes(&refs, &output, &opts, metadata_json)
            })
            .map_err(errors::ngram)?;
        summary_dict(py, &s)
    })
}

/// One partition of a partitioned reduce: the runs' entries with `lo <= key < hi`, merged
/// into one sorted run at `output` (see `dart_ngram::merge_run_range`).
#[pyfunction]
#[pyo3(signature = (runs, output, *, vocab_size, lo, hi, memory_limit = 2u64 << 30))]
fn merge_run_range<'py>(
    py: Python<'py>,
    runs: Vec<PathBuf>,
    output: PathBuf,
    vocab_size: u32,
    lo: u64,
    hi: u64,
    memory_limit: u64,
) -> PyResult<Bound<'py, PyDict>> {
    guard("merge_run_range", || {
        let opts =
            BuildOptions { vocab_size, memory_limit_bytes: memory_limit, threads: Some(1), ..BuildOptions::default() };
        let s = py.detach(|| dart_ngram::merge_run_range(&runs, &output, &opts, lo, hi)).map_err(errors::ngram)?;
        summary_dict(py, &s)
    })
}

/// Size the shared dart-ngram pool (rebuilt on next use).
#[pyfunction]
fn set_num_threads(n: usize) -> PyResult<()> {
    guard("set_num_threads", || dart_ngram::pool::set_num_threads(n).map_err(errors::ngram))
}

/// Threads of the shared pool (API setting, else DART_NUM_THREADS, else all CPUs).
#[pyfunction]
fn num_threads() -> usize {
    dart_ngram::pool::num_threads()
}

/// NUMA nodes under `sys_root` (default /sys): list of (node id, [cpus]).
#[pyfunction]
#[pyo3(signature = (sys_root = None))]
fn numa_topology(sys_root: Option<PathBuf>) -> PyResult<Vec<(usize, Vec<usize>)>> {
    guard("numa_topology", || {
        let root = sys_root.unwrap_or_else(|| PathBuf::from("/sys"));
        Ok(dart_ngram::pool::numa_topology(&root).into_iter().map(|n| (n.id, n.cpus)).collect())
    })
}

/// Pin the pool's workers to the CPUs of a NUMA node (None: unpin).
#[pyfunction]
#[pyo3(signature = (node = None))]
fn pin_numa_node(node: Option<usize>) -> PyResult<()> {
    guard("pin_numa_node", || match node {
        Some(n) => dart_ngram::pool::set_pin_node(n).map_err(errors::ngram),
        None => {
            dart_ngram::pool::set_pin_cpus(None);
            Ok(())
        }
    })
}

pub(crate) fn pairs(contexts: &PyReadonlyArray2<'_, u32>) -> PyResult<Vec<[u32; 2]>> {
    let shape = contexts.shape();
    if shape[1] != 2 {
        return Err(errors::value(format!("contexts must have shape [n, 2], got {shape:?}")));
    }
    let flat = contexts.as_slice().map_err(|_| errors::value("contexts must be C-contiguous"))?;
    Ok(flat.chunks_exact(2).map(|c| [c[0], c[1]]).collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNgramIndex>()?;
    m.add_class::<PyIndexBuilder>()?;
    m.add_function(wrap_pyfunction!(merge_runs, m)?)?;
    m.add_function(wrap_pyfunction!(merge_indexes, m)?)?;
    m.add_function(wrap_pyfunction!(merge_run_range, m)?)?;
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(numa_topology, m)?)?;
    m.add_function(wrap_pyfunction!(pin_numa_node, m)?)?;
    Ok(())
}
