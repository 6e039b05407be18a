//! The one place where Rust errors become Python exceptions. The classes live in
//! `dartcore.errors` (python/dartcore/errors.py); they are looked up there, never redefined.
//!
//! | Rust                                   | Python                      |
//! |----------------------------------------|-----------------------------|
//! | `dart_ngram::Error::NotFound`          | `FileNotFoundError`         |
//! | `dart_ngram::Error::Io`                | `OSError`                   |
//! | `dart_ngram::Error::Format`, `Trie`    | `dartcore.IndexFormatError` |
//! | `dart_ngram::Error::Run`               | `dartcore.IndexBuildError`  |
//! | `TokenOutOfRange`, `InvalidOption`     | `ValueError`                |
//! | anything else                          | `dartcore.DartError`        |

use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

/// An instance of `dartcore.errors.<class>` with `msg` (RuntimeError if the module is missing).
pub(crate) fn dart_error(class: &str, msg: String) -> PyErr {
    Python::attach(|py| {
        match py.import("dartcore.errors").and_then(|m| m.getattr(class)).map(|c| c.cast_into::<PyType>()) {
            Ok(Ok(ty)) => PyErr::from_type(ty, msg),
            _ => PyRuntimeError::new_err(format!("{class}: {msg}")),
        }
    })
}

/// Map a dart-ngram error.
pub(crate) fn ngram(e: dart_ngram::Error) -> PyErr {
    use dart_ngram::Error as E;
    let msg = e.to_string();
    match e {
        E::NotFound { path } => PyFileNotFoundError::new_err((2, msg, path.display().to_string())),
        E::Io { .. } => PyOSError::new_err(msg),
        E::Format(_) | E::Trie { .. } => dart_error("IndexFormatError", msg),
        E::Run { .. } => dart_error("IndexBuildError", msg),
        E::TokenOutOfRange { .. } | E::InvalidOption(_) => PyValueError::new_err(msg),
        _ => dart_error("DartError", msg),
    }
}

/// A `ValueError` for a bad argument detected in the bindings.
pub(crate) fn value(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

// ---- dart-tree (issue 4) ------------------------------------------------------------------
// | `dart_tree::Error::Index(e)` | as `dart_ngram` above  |
// | every other `dart_tree::Error` | `dartcore.TreeError` (a `ValueError`) |

/// Map a dart-tree error.
pub(crate) fn tree(e: dart_tree::Error) -> PyErr {
    match e {
        dart_tree::Error::Index(inner) => ngram(inner),
        other => dart_error("TreeError", other.to_string()),
    }
}

/// A `dartcore.TreeError` for a bad argument detected in the tree bindings.
pub(crate) fn tree_msg(msg: impl Into<String>) -> PyErr {
    dart_error("TreeError", msg.into())
}
