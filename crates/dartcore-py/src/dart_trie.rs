//! Binding of the DART `.trie` converter (`dart_ngram::convert_dart_trie`).

use std::path::PathBuf;

use dart_ngram::TrieProgress;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{self, guard};
use crate::index::{options, summary_dict};

/// Convert a DART `.trie` into an index; `progress(stage, done, total)` is called from time
/// to time (with the GIL). Returns the build summary plus the trie's node counts.
#[pyfunction]
#[pyo3(signature = (input, output, *, vocab_size, metadata_json = "{}", memory_limit = 2u64 << 30, temp_dir = None, min_count = 1, max_children = None, threads = None, progress = None))]
#[allow(clippy::too_many_arguments)]
fn convert_dart_trie<'py>(
    py: Python<'py>,
    input: PathBuf,
    output: PathBuf,
    vocab_size: u32,
    metadata_json: &str,
    memory_limit: u64,
    temp_dir: Option<PathBuf>,
    min_count: u64,
    max_children: Option<u32>,
    threads: Option<usize>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    guard("convert_dart_trie", || {
        let opts = options(vocab_size, memory_limit, temp_dir, min_count, max_children, threads, None);
        let mut failed: Option<PyErr> = None;
        let mut report = |p: &TrieProgress| {
            if let (Some(cb), None) = (&progress, &failed) {
                failed = Python::attach(|py| cb.call1(py, (p.stage, p.done, p.total)).err());
            }
        };
        let s = py
            .detach(|| dart_ngram::convert_dart_trie(&input, &output, &opts, metadata_json, &mut report))
            .map_err(errors::ngram)?;
        if let Some(e) = failed {
            return Err(e);
        }
        // The build summary as merge_runs reports it, plus the trie's own counts and stages.
        let d = summary_dict(py, &s.build)?;
        d.set_item("trie_nodes", s.trie_nodes)?;
        d.set_item("trie_unigrams", s.trie_unigrams)?;
        d.set_item("trie_bigrams", s.trie_bigrams)?;
        d.set_item("trie_trigrams", s.trie_trigrams)?;
        d.set_item("input_bytes", s.input_bytes)?;
        d.set_item("read_seconds", s.read_seconds)?;
        d.set_item("join_seconds", s.join_seconds)?;
        Ok(d)
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(convert_dart_trie, m)?)
}
