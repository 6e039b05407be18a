//! Binding of the DART `.trie` converter (`dart_ngram::convert_dart_trie`).

use std::path::PathBuf;

use dart_ngram::{BuildOptions, TrieProgress};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors;

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
    let opts = BuildOptions {
        vocab_size,
        memory_limit_bytes: memory_limit,
        temp_dir,
        min_count,
        max_children_per_context: max_children,
        threads,
        token_bits: None,
    };
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
    let d = PyDict::new(py);
    let b = &s.build;
    d.set_item("output", b.output.display().to_string())?;
    d.set_item("documents", b.documents)?;
    d.set_item("tokens", b.tokens)?;
    d.set_item("unigram_nodes", b.unigram_nodes)?;
    d.set_item("bigram_nodes", b.bigram_nodes)?;
    d.set_item("trigram_nodes", b.trigram_nodes)?;
    d.set_item("bytes", b.bytes)?;
    d.set_item("seconds", b.seconds)?;
    d.set_item("trie_nodes", s.trie_nodes)?;
    d.set_item("trie_unigrams", s.trie_unigrams)?;
    d.set_item("trie_bigrams", s.trie_bigrams)?;
    d.set_item("trie_trigrams", s.trie_trigrams)?;
    d.set_item("input_bytes", s.input_bytes)?;
    d.set_item("read_seconds", s.read_seconds)?;
    d.set_item("join_seconds", s.join_seconds)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(convert_dart_trie, m)?)
}
