//! Binding of the DART `.trie` converter (`dart_ngram::convert_dart_trie`).

use std::path::PathBuf;

use dart_ngram::TrieProgress;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{self, guard};
use crate::index::{summary_dict, BuildArgs};

/// Convert a DART `.trie` into an index; `progress(stage, done, total)` is called from time
/// to time (with the GIL). Returns the build summary plus the trie's node counts.
/// Options: the build options ([`BuildArgs`], `vocab_size` required) but `token_bits`.
#[pyfunction]
#[pyo3(signature = (input, output, *, metadata_json = "{}", progress = None, **options))]
fn convert_dart_trie<'py>(
    py: Python<'py>,
    input: PathBuf,
    output: PathBuf,
    metadata_json: &str,
    progress: Option<Py<PyAny>>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    guard("convert_dart_trie", || {
        let opts = BuildArgs::options(py, "convert_dart_trie", options, None, &["token_bits"])?;
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
