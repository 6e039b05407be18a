//! The private submodules `dartcore._native._bench` (latencies timed in Rust, for
//! tools/bench_index.py and tools/bench_tree.py: a Python call costs more than the query it
//! would time) and `dartcore._native._testing` (hooks of the test suite). Neither is part
//! of the public API; both go through `errors::guard` like every other entry point.

use dart_tree::TopkRows;
use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{self, guard};
use crate::index::{pairs, sorted_candidates, PyNgramIndex};
use crate::tree::{ids, Params};

/// ns per `children(ctx, k)` call, timed in Rust, one thread.
#[pyfunction]
#[pyo3(signature = (index, contexts, k = 25, warmup = 1))]
fn bench_children<'py>(
    py: Python<'py>,
    index: &PyNgramIndex,
    contexts: PyReadonlyArray2<'py, u32>,
    k: usize,
    warmup: usize,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    guard("_bench.bench_children", || {
        let ctx = pairs(&contexts)?;
        let inner = &index.inner;
        let k = k.min(inner.max_children());
        let ns = py.detach(|| dart_ngram::timing::time_children(inner, &ctx, k, warmup));
        Ok(PyArray1::from_vec(py, ns))
    })
}

/// ns per `cond_probs(ctx, candidates)` call, timed in Rust, one thread.
#[pyfunction]
#[pyo3(signature = (index, contexts, candidates_sorted, warmup = 1))]
fn bench_cond_probs<'py>(
    py: Python<'py>,
    index: &PyNgramIndex,
    contexts: PyReadonlyArray2<'py, u32>,
    candidates_sorted: PyReadonlyArray1<'py, u32>,
    warmup: usize,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    guard("_bench.bench_cond_probs", || {
        let ctx = pairs(&contexts)?;
        let inner = &index.inner;
        let c = sorted_candidates(&candidates_sorted, inner.vocab_size())?;
        let ns = py.detach(|| dart_ngram::timing::time_cond_probs(inner, &ctx, c, warmup));
        Ok(PyArray1::from_vec(py, ns))
    })
}

/// Same inputs as `beam_search_batch`; times every search alone on the calling thread,
/// replays their index queries, and times batches of `batch` on the pool. -> dict(search_ns,
/// search_cpu_ns: uint64[B], search_total_cpu_ns, ngram_total_cpu_ns, ngram_queries,
/// ngram_candidates, batch_ns: uint64[*])
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn bench_beam_search<'py>(
    py: Python<'py>,
    index: Bound<'py, PyNgramIndex>,
    ctx_flat: PyReadonlyArray1<'py, i64>,
    ctx_offsets: PyReadonlyArray1<'py, i64>,
    topk_tokens: PyReadonlyArray3<'py, i64>,
    topk_logprobs: PyReadonlyArray3<'py, f32>,
    params: Params,
    batch: usize,
) -> PyResult<Bound<'py, PyDict>> {
    guard("_bench.bench_beam_search", || {
        let p = params.into_core()?;
        let ix = index.get().inner.clone();
        let (b, d, k) = {
            let s = topk_tokens.shape();
            (s[0], s[1], s[2])
        };
        if topk_logprobs.shape() != topk_tokens.shape() {
            return Err(errors::tree_msg("topk_tokens and topk_logprobs differ in shape"));
        }
        let flat = ids(ctx_flat.as_array().iter(), "contexts")?;
        let offs: Vec<usize> = ctx_offsets.as_array().iter().map(|&o| o.max(0) as usize).collect();
        if offs.len() != b + 1 || offs.windows(2).any(|w| w[1] < w[0]) || offs[b] != flat.len() {
            return Err(errors::tree_msg("context offsets do not match the batch"));
        }
        let contexts: Vec<&[u32]> = offs.windows(2).map(|w| &flat[w[0]..w[1]]).collect();
        let toks = ids(topk_tokens.as_array().iter(), "topk_tokens")?;
        let lps: Vec<f32> = topk_logprobs.as_array().iter().copied().collect();
        let t = py
            .detach(|| {
                dart_tree::timing::time_beam_search(&*ix, &contexts, TopkRows::new(&toks, &lps, d, k), &p, batch)
            })
            .map_err(errors::tree)?;
        let out = PyDict::new(py);
        out.set_item("search_ns", PyArray1::from_vec(py, t.search_ns))?;
        out.set_item("search_cpu_ns", PyArray1::from_vec(py, t.search_cpu_ns))?;
        out.set_item("search_total_cpu_ns", t.search_total_cpu_ns)?;
        out.set_item("ngram_total_cpu_ns", t.ngram_total_cpu_ns)?;
        out.set_item("ngram_queries", t.ngram_queries)?;
        out.set_item("ngram_candidates", t.ngram_candidates)?;
        out.set_item("batch_ns", PyArray1::from_vec(py, t.batch_ns))?;
        Ok(out)
    })
}

/// Run a trivial fork/join job on every worker of the pool -> the number of leaves (tests of
/// fork safety).
#[pyfunction]
fn pool_ping(py: Python<'_>) -> PyResult<usize> {
    guard("_testing.pool_ping", || {
        Ok(py.detach(|| {
            let pool = dart_ngram::pool::get();
            pool.install(|| fork_join(0, pool.current_num_threads().max(1) * 4))
        }))
    })
}

fn fork_join(lo: usize, hi: usize) -> usize {
    if hi - lo <= 1 {
        return hi - lo;
    }
    let mid = (lo + hi) / 2;
    let (a, b) = dart_ngram::pool::join(|| fork_join(lo, mid), || fork_join(mid, hi));
    a + b
}

/// Panic with `message`, on the calling thread or (`in_pool`) on a worker of the pool: the
/// test that a panic reaches Python as `dartcore.InternalError`.
#[pyfunction]
#[pyo3(signature = (message, in_pool = false))]
fn panic(py: Python<'_>, message: String, in_pool: bool) -> PyResult<()> {
    guard("_testing.panic", || {
        py.detach(
            || {
                if in_pool {
                    dart_ngram::pool::get().install(|| panic!("{message}"))
                } else {
                    panic!("{message}")
                }
            },
        )
    })
}

/// Add `name` as a submodule of `m`, importable as `dartcore._native.<name>` too.
fn submodule<'py>(m: &Bound<'py, PyModule>, name: &str) -> PyResult<Bound<'py, PyModule>> {
    let py = m.py();
    let sub = PyModule::new(py, name)?;
    m.add_submodule(&sub)?;
    py.import("sys")?.getattr("modules")?.set_item(format!("dartcore._native.{name}"), &sub)?;
    Ok(sub)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let b = submodule(m, "_bench")?;
    b.add_function(wrap_pyfunction!(bench_children, &b)?)?;
    b.add_function(wrap_pyfunction!(bench_cond_probs, &b)?)?;
    b.add_function(wrap_pyfunction!(bench_beam_search, &b)?)?;
    let t = submodule(m, "_testing")?;
    t.add_function(wrap_pyfunction!(pool_ping, &t)?)?;
    t.add_function(wrap_pyfunction!(panic, &t)?)?;
    Ok(())
}
