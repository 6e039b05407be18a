//! The one place where Rust errors become Python exceptions. The classes live in
//! `dartcore.errors` (python/dartcore/errors.py); [`init`] resolves each of them once, when
//! the module is imported, into [`CLASSES`], and every raise below uses those objects.
//!
//! | Rust                                   | Python                      |
//! |----------------------------------------|-----------------------------|
//! | `dart_ngram::Error::NotFound`          | `FileNotFoundError`         |
//! | `dart_ngram::Error::NotAFile`          | `dartcore.IndexPathError`   |
//! | `dart_ngram::Error::Io`                | `OSError`                   |
//! | `dart_ngram::Error::Format`, `Trie`    | `dartcore.IndexFormatError` |
//! | `dart_ngram::Error::Run`, `Merge`      | `dartcore.IndexBuildError`  |
//! | `TokenOutOfRange`, `InvalidOption`     | `ValueError`                |
//! | any other `dart_ngram::Error`          | `dartcore.DartError`        |
//! | `dart_tree::Error::Index(e)`           | as `dart_ngram` above       |
//! | any other `dart_tree::Error`           | `dartcore.TreeError` (a `ValueError`) |
//! | a Rust panic inside an entry point     | `dartcore.InternalError`    |

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception classes of `dartcore.errors` that the bindings raise.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    Dart,
    IndexFormat,
    IndexBuild,
    IndexPath,
    Tree,
    Internal,
}

impl Kind {
    const ALL: [Kind; 6] =
        [Kind::Dart, Kind::IndexFormat, Kind::IndexBuild, Kind::IndexPath, Kind::Tree, Kind::Internal];

    fn class_name(self) -> &'static str {
        match self {
            Kind::Dart => "DartError",
            Kind::IndexFormat => "IndexFormatError",
            Kind::IndexBuild => "IndexBuildError",
            Kind::IndexPath => "IndexPathError",
            Kind::Tree => "TreeError",
            Kind::Internal => "InternalError",
        }
    }
}

/// The classes, in the order of [`Kind::ALL`].
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// Resolve the classes of `dartcore.errors` (called once, by the module's initialisation).
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let m = py.import("dartcore.errors")?;
    let classes = Kind::ALL
        .iter()
        .map(|k| {
            let c = m.getattr(k.class_name()).map_err(|_| {
                pyo3::exceptions::PyImportError::new_err(format!(
                    "dartcore._native raises dartcore.errors.{}, which python/dartcore/errors.py does not define",
                    k.class_name()
                ))
            })?;
            Ok(c.cast_into::<PyType>()?.unbind())
        })
        .collect::<PyResult<Vec<_>>>()?;
    let _ = CLASSES.set(py, classes);
    Ok(())
}

/// An instance of the `dartcore.errors` class of `kind` with `msg`.
pub(crate) fn new(kind: Kind, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| match CLASSES.get(py) {
        Some(c) => PyErr::from_type(c[kind as usize].bind(py).clone(), msg),
        // Unreachable once the module is imported: init() runs before any entry point.
        None => PyRuntimeError::new_err(format!("{}: {msg}", kind.class_name())),
    })
}

/// Map a dart-ngram error.
pub(crate) fn ngram(e: dart_ngram::Error) -> PyErr {
    use dart_ngram::Error as E;
    let msg = e.to_string();
    match e {
        E::NotFound { path } => PyFileNotFoundError::new_err((2, msg, path.display().to_string())),
        E::NotAFile { .. } => new(Kind::IndexPath, msg),
        E::Io { .. } => PyOSError::new_err(msg),
        E::Format(_) | E::Trie { .. } => new(Kind::IndexFormat, msg),
        E::Run { .. } | E::Merge(_) => new(Kind::IndexBuild, msg),
        E::TokenOutOfRange { .. } | E::InvalidOption(_) => PyValueError::new_err(msg),
        _ => new(Kind::Dart, msg),
    }
}

/// A `ValueError` for a bad argument detected in the bindings.
pub(crate) fn value(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// Map a dart-tree error.
pub(crate) fn tree(e: dart_tree::Error) -> PyErr {
    match e {
        dart_tree::Error::Index(inner) => ngram(inner),
        other => new(Kind::Tree, other.to_string()),
    }
}

/// A `dartcore.TreeError` for a bad argument detected in the tree bindings.
pub(crate) fn tree_msg(msg: impl Into<String>) -> PyErr {
    new(Kind::Tree, msg)
}

/// Run the body of the entry point `call`, turning a Rust panic into `dartcore.InternalError`
/// (pyo3 would raise its `PanicException`, a `BaseException` that `except Exception` misses).
/// Panics of the pool's workers reach here too: rayon resumes them on the calling thread.
pub(crate) fn guard<T>(call: &'static str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(panicked(call, &*payload)))
}

fn panicked(call: &str, payload: &(dyn Any + Send)) -> PyErr {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    new(
        Kind::Internal,
        format!("dartcore._native.{call} failed inside Rust ({what}): this is a bug in dartcore, please report it with the call's arguments"),
    )
}
