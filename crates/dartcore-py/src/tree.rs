//! Bindings of dart-tree: Eq. (10) beam search (single and batched), the n-gram tree,
//! DARTree's top-B, DDTree's best-first heap and ancestor bitmasks.
//! Thin: convert, release the GIL (`py.detach`), call one core function, convert back.
//! Trees cross as four numpy arrays (tokens, parents, depths int64; scores float64) built
//! from Rust vectors without per-element Python objects.

use std::sync::Arc;

use dart_ngram::{Index, Mmap};
use dart_tree::{Candidates, NgramScorer, NoNgram, SearchParams, TopkRows, Tree};
use numpy::ndarray::ArrayView2;
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::c_slice;
use crate::errors::{self, guard};
use crate::index::PyNgramIndex;
use crate::live::PyLiveLayer;
use dart_live::Mixed;

type TreeArrays<'py> =
    (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<f64>>);

fn tree_arrays(py: Python<'_>, t: Tree) -> TreeArrays<'_> {
    (
        PyArray1::from_vec(py, t.tokens.into_iter().map(i64::from).collect()),
        PyArray1::from_vec(py, t.parents.into_iter().map(i64::from).collect()),
        PyArray1::from_vec(py, t.depths.into_iter().map(i64::from).collect()),
        PyArray1::from_vec(py, t.scores),
    )
}

/// Search parameters as the Python wrapper passes them: `dartcore.tree.SearchParams.native()`,
/// a dict with every key, validated there first.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct Params {
    beam_width: usize,
    max_nodes: usize,
    level_decay: f64,
    ngram_weight: f64,
    depth_exponent: f64,
    eps: f64,
    ngram_first_level: bool,
    unigram_backoff: bool,
    eos_token_ids: Vec<i64>,
    /// "beam" or "all"; absent: `SearchParams::default()`'s.
    #[pyo3(default)]
    candidates: Option<String>,
}

impl Params {
    pub(crate) fn into_core(self) -> PyResult<SearchParams> {
        Ok(SearchParams {
            beam_width: self.beam_width,
            max_nodes: self.max_nodes,
            level_decay: self.level_decay,
            ngram_weight: self.ngram_weight,
            depth_exponent: self.depth_exponent,
            eps: self.eps,
            ngram_first_level: self.ngram_first_level,
            unigram_backoff: self.unigram_backoff,
            // EOS ids outside u32 can never match a token: drop them.
            eos: self.eos_token_ids.into_iter().filter_map(|t| u32::try_from(t).ok()).collect(),
            candidates: match self.candidates.as_deref() {
                None => SearchParams::default().candidates,
                Some("beam") => Candidates::Beam,
                Some("all") => Candidates::All,
                Some(other) => {
                    return Err(errors::tree_msg(format!("candidates must be 'beam' or 'all', got {other:?}")))
                }
            },
        })
    }
}

/// Every field of `p` but the EOS ids, by name.
fn params_dict(py: Python<'_>, p: SearchParams) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("beam_width", p.beam_width)?;
    out.set_item("max_nodes", p.max_nodes)?;
    out.set_item("level_decay", p.level_decay)?;
    out.set_item("ngram_weight", p.ngram_weight)?;
    out.set_item("depth_exponent", p.depth_exponent)?;
    out.set_item("eps", p.eps)?;
    out.set_item("ngram_first_level", p.ngram_first_level)?;
    out.set_item("unigram_backoff", p.unigram_backoff)?;
    out.set_item(
        "candidates",
        match p.candidates {
            Candidates::Beam => "beam",
            Candidates::All => "all",
        },
    )?;
    Ok(out)
}

/// search_defaults() -> dict: `SearchParams::default()`, the defaults `dartcore.tree.SearchParams`
/// reads (written once, in dart-tree).
#[pyfunction]
fn search_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    guard("search_defaults", || params_dict(py, SearchParams::default()))
}

/// search_official() -> dict: `SearchParams::official()`, the official DART searcher's tree
/// (`dartcore.tree.SearchParams.official()`).
#[pyfunction]
fn search_official(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    guard("search_official", || params_dict(py, SearchParams::official()))
}

pub(crate) fn id(t: i64, what: &str) -> PyResult<u32> {
    u32::try_from(t)
        .map_err(|_| errors::tree_msg(format!("token id {t} in {what} is not a valid token id (0 ..= 2^32-1)")))
}

pub(crate) fn ids<'a>(it: impl IntoIterator<Item = &'a i64>, what: &str) -> PyResult<Vec<u32>> {
    it.into_iter().map(|&t| id(t, what)).collect()
}

/// The last (up to) two context tokens: all the searches read.
fn context_tail(context: &PyReadonlyArray1<'_, i64>) -> PyResult<Vec<u32>> {
    let a = context.as_array();
    let n = a.len();
    ids(a.iter().skip(n.saturating_sub(2)), "context")
}

fn rows2(a: ArrayView2<'_, i64>, what: &str) -> PyResult<Vec<u32>> {
    ids(a.iter(), what)
}

/// Either the index or the absent model (only valid with ngram_weight = 0).
fn scorer(index: Option<&Bound<'_, PyNgramIndex>>, p: &SearchParams) -> PyResult<Option<Arc<Index<Mmap>>>> {
    match index {
        Some(ix) => Ok(Some(ix.get().inner.clone())),
        None if p.ngram_weight == 0.0 => Ok(None),
        None => Err(errors::tree_msg(format!(
            "ngram_weight = {} needs an n-gram index: pass one, or ngram_weight=0 for the drafter-only tree",
            p.ngram_weight
        ))),
    }
}

/// Run `f` on the index (or the absent model), mixed with the live layer's snapshot and shared
/// deltas when one is given (`dart_live::Mixed`, weight `live_weight`). Dynamic dispatch costs one indirect
/// call per index query (about 200 per search), not measurable next to the search itself.
fn run<T>(
    ix: &Option<Arc<Index<Mmap>>>,
    live: &Option<LivePart>,
    unigram_backoff: bool,
    f: impl FnOnce(&dyn NgramScorer) -> T,
) -> T {
    let base: &dyn NgramScorer = match ix {
        Some(i) => &**i,
        None => &NoNgram,
    };
    match live {
        Some((w, shared, weight)) => f(&Mixed { base, live: w, shared, weight: *weight, unigram_backoff }),
        None => f(base),
    }
}

/// What one search reads of a live layer: its window, its shared deltas, the weight.
type LivePart = (Arc<dart_live::Window>, Arc<[Arc<dart_live::Delta>]>, f64);

/// The live layer's snapshot for one search, with its weight checked.
fn live_part(live: Option<&Bound<'_, PyLiveLayer>>, weight: f64) -> PyResult<Option<LivePart>> {
    if !(0.0..=1.0).contains(&weight) {
        return Err(errors::tree_msg(format!("live_weight = {weight}: must be in [0, 1]")));
    }
    Ok(live.map(|l| (l.get().inner.snapshot(), l.get().inner.shared(), weight)))
}

/// beam_search(index, context int64[L], topk_tokens int64[d,k], topk_logprobs float32[d,k], params) -> tree
#[pyfunction]
#[pyo3(signature = (index, context, topk_tokens, topk_logprobs, params, live=None, live_weight=dart_live::LIVE_WEIGHT))]
#[allow(clippy::too_many_arguments)]
fn beam_search<'py>(
    py: Python<'py>,
    index: Option<Bound<'py, PyNgramIndex>>,
    context: PyReadonlyArray1<'py, i64>,
    topk_tokens: PyReadonlyArray2<'py, i64>,
    topk_logprobs: PyReadonlyArray2<'py, f32>,
    params: Params,
    live: Option<Bound<'py, PyLiveLayer>>,
    live_weight: f64,
) -> PyResult<TreeArrays<'py>> {
    guard("beam_search", || {
        let p = params.into_core()?;
        let ix = scorer(index.as_ref(), &p)?;
        let lv = live_part(live.as_ref(), live_weight)?;
        let (ts, ls) = (topk_tokens.shape(), topk_logprobs.shape());
        if ts != ls {
            return Err(errors::tree_msg(format!("topk_tokens has shape {ts:?} but topk_logprobs {ls:?}")));
        }
        let (d, k) = (ts[0], ts[1]);
        let ctx = context_tail(&context)?;
        let toks = rows2(topk_tokens.as_array(), "topk_tokens")?;
        let lps: Vec<f32> = topk_logprobs.as_array().iter().copied().collect();
        let t = py
            .detach(|| {
                run(&ix, &lv, p.unigram_backoff, |s| {
                    dart_tree::beam_search(s, &ctx, TopkRows::new(&toks, &lps, d, k), &p)
                })
            })
            .map_err(errors::tree)?;
        Ok(tree_arrays(py, t))
    })
}

/// beam_search_batch(index, ctx_flat int64[*], ctx_offsets int64[B+1], topk_tokens int64[B,d,k],
/// topk_logprobs float32[B,d,k], params) -> list of trees
#[pyfunction]
#[pyo3(signature = (index, ctx_flat, ctx_offsets, topk_tokens, topk_logprobs, params, live=None, live_weight=dart_live::LIVE_WEIGHT))]
#[allow(clippy::too_many_arguments)]
fn beam_search_batch<'py>(
    py: Python<'py>,
    index: Option<Bound<'py, PyNgramIndex>>,
    ctx_flat: PyReadonlyArray1<'py, i64>,
    ctx_offsets: PyReadonlyArray1<'py, i64>,
    topk_tokens: PyReadonlyArray3<'py, i64>,
    topk_logprobs: PyReadonlyArray3<'py, f32>,
    params: Params,
    live: Option<Bound<'py, PyLiveLayer>>,
    live_weight: f64,
) -> PyResult<Vec<TreeArrays<'py>>> {
    guard("beam_search_batch", || {
        let p = params.into_core()?;
        let ix = scorer(index.as_ref(), &p)?;
        let lv = live_part(live.as_ref(), live_weight)?;
        let (ts, ls) = (topk_tokens.shape(), topk_logprobs.shape());
        if ts != ls {
            return Err(errors::tree_msg(format!("topk_tokens has shape {ts:?} but topk_logprobs {ls:?}")));
        }
        let (b, d, k) = (ts[0], ts[1], ts[2]);
        let flat = ids(ctx_flat.as_array().iter(), "contexts")?;
        let offs: Vec<i64> = ctx_offsets.as_array().iter().copied().collect();
        if offs.len() != b + 1 || offs[0] != 0 || offs.windows(2).any(|w| w[1] < w[0]) || offs[b] as usize != flat.len()
        {
            return Err(errors::tree_msg(format!(
                "{} context offsets do not describe {b} contexts of {} tokens",
                offs.len(),
                flat.len()
            )));
        }
        let contexts: Vec<&[u32]> = offs.windows(2).map(|w| &flat[w[0] as usize..w[1] as usize]).collect();
        let toks: Vec<u32> = ids(topk_tokens.as_array().iter(), "topk_tokens")?;
        let lps: Vec<f32> = topk_logprobs.as_array().iter().copied().collect();
        let trees = py
            .detach(|| {
                run(&ix, &lv, p.unigram_backoff, |s| {
                    dart_tree::beam_search_batch(s, &contexts, TopkRows::new(&toks, &lps, d, k), &p)
                })
            })
            .map_err(errors::tree)?;
        Ok(trees.into_iter().map(|t| tree_arrays(py, t)).collect())
    })
}

/// ngram_tree(index, context int64[L], depth, k, params) -> tree
#[pyfunction]
#[pyo3(signature = (index, context, depth, k, params, live=None, live_weight=dart_live::LIVE_WEIGHT))]
#[allow(clippy::too_many_arguments)]
fn ngram_tree<'py>(
    py: Python<'py>,
    index: Bound<'py, PyNgramIndex>,
    context: PyReadonlyArray1<'py, i64>,
    depth: usize,
    k: usize,
    params: Params,
    live: Option<Bound<'py, PyLiveLayer>>,
    live_weight: f64,
) -> PyResult<TreeArrays<'py>> {
    guard("ngram_tree", || {
        let p = params.into_core()?;
        let ix = Some(index.get().inner.clone());
        let lv = live_part(live.as_ref(), live_weight)?;
        let ctx = context_tail(&context)?;
        let t = py
            .detach(|| run(&ix, &lv, p.unigram_backoff, |s| dart_tree::ngram_tree(s, &ctx, depth, k, &p)))
            .map_err(errors::tree)?;
        Ok(tree_arrays(py, t))
    })
}

/// top_b(parents int64[n], scores float64[n], b) -> int64[<=b] node indices, rank order
#[pyfunction]
fn top_b<'py>(
    py: Python<'py>,
    parents: PyReadonlyArray1<'py, i64>,
    scores: PyReadonlyArray1<'py, f64>,
    b: usize,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    guard("top_b", || {
        let par: Vec<i64> = parents.as_array().iter().copied().collect();
        let sc: Vec<f64> = scores.as_array().iter().copied().collect();
        let sel = py.detach(|| dart_tree::top_b(&par, &sc, b)).map_err(errors::tree)?;
        Ok(PyArray1::from_vec(py, sel.into_iter().map(|i| i as i64).collect()))
    })
}

/// best_first(tokens int64[d,K], logprobs float32[d,K], root, b) -> tree
#[pyfunction]
fn best_first<'py>(
    py: Python<'py>,
    tokens: PyReadonlyArray2<'py, i64>,
    logprobs: PyReadonlyArray2<'py, f32>,
    root: i64,
    b: usize,
) -> PyResult<TreeArrays<'py>> {
    guard("best_first", || {
        let (ts, ls) = (tokens.shape(), logprobs.shape());
        if ts != ls {
            return Err(errors::tree_msg(format!("tokens has shape {ts:?} but logprobs {ls:?}")));
        }
        let (d, k) = (ts[0], ts[1]);
        let toks = rows2(tokens.as_array(), "tokens")?;
        let root = id(root, "root")?;
        let lps: Vec<f32> = logprobs.as_array().iter().copied().collect();
        let t = py.detach(|| dart_tree::best_first(&toks, &lps, d, k, root, b)).map_err(errors::tree)?;
        Ok(tree_arrays(py, t))
    })
}

/// Top-k ids and their log-probabilities, `[d, k]` each.
type TopK<'py> = (Bound<'py, PyArray2<i64>>, Bound<'py, PyArray2<f32>>);

/// topk_logprobs(logits float32[d, V], k, id_map int64[V] | None) -> (int64[d, k], float32[d, k]):
/// each row's top-k ids (descending; equal logits: lower id first) and the log-softmax over
/// those k logits (dart_tree::topk_logprobs); `id_map` maps the ids (a drafter's reduced
/// vocabulary to the target's).
#[pyfunction]
#[pyo3(signature = (logits, k, id_map=None))]
fn topk_logprobs<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
    k: usize,
    id_map: Option<PyReadonlyArray1<'py, i64>>,
) -> PyResult<TopK<'py>> {
    guard("topk_logprobs", || {
        let rows = logits.shape()[0];
        let x = c_slice(&logits, "logits")?;
        let map = id_map.as_ref().map(|m| c_slice(m, "id_map")).transpose()?;
        if let Some(m) = map {
            if m.len() != logits.shape()[1] {
                return Err(errors::tree_msg(format!(
                    "id_map has {} entries for {} logits a row",
                    m.len(),
                    logits.shape()[1]
                )));
            }
        }
        let (ids, lps) = py.detach(|| dart_tree::topk_logprobs(x, rows.max(1), k)).map_err(errors::tree)?;
        let ids: Vec<i64> = match map {
            Some(m) => ids.iter().map(|&i| m[i as usize]).collect(),
            None => ids.into_iter().map(i64::from).collect(),
        };
        Ok((PyArray1::from_vec(py, ids).reshape([rows, k])?, PyArray1::from_vec(py, lps).reshape([rows, k])?))
    })
}

/// ancestor_bits(parents int64[n]) -> uint64[n, ceil(n/64)]; parents must be -1 (root) or earlier.
#[pyfunction]
fn ancestor_bits<'py>(py: Python<'py>, parents: PyReadonlyArray1<'py, i64>) -> PyResult<Bound<'py, PyArray2<u64>>> {
    guard("ancestor_bits", || {
        let par: Vec<i32> = parents
            .as_array()
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                if p == -1 || (p >= 0 && (p as usize) < i) {
                    Ok(p as i32)
                } else {
                    Err(errors::tree_msg(format!(
                        "parents[{i}] = {p}: must be -1 or the index of an earlier node (depth order)"
                    )))
                }
            })
            .collect::<PyResult<_>>()?;
        let n = par.len();
        let bits = dart_tree::ancestor_bits(&par);
        PyArray1::from_vec(py, bits).reshape([n, n.div_ceil(64)])
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(search_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(search_official, m)?)?;
    m.add_function(wrap_pyfunction!(beam_search, m)?)?;
    m.add_function(wrap_pyfunction!(beam_search_batch, m)?)?;
    m.add_function(wrap_pyfunction!(ngram_tree, m)?)?;
    m.add_function(wrap_pyfunction!(top_b, m)?)?;
    m.add_function(wrap_pyfunction!(best_first, m)?)?;
    m.add_function(wrap_pyfunction!(ancestor_bits, m)?)?;
    m.add_function(wrap_pyfunction!(topk_logprobs, m)?)?;
    Ok(())
}
