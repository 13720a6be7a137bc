//! Map the core's one error enum onto the classes of `fastckpt.errors` (imported lazily, cached), and plain
//! I/O failures onto the builtin `OSError` subclass for the errno, with the path as `filename`.

use fastckpt_core::Error;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The `fastckpt.errors` classes the core raises, each imported once.
static HEADER: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TRUNCATED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DTYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static KEY_MISMATCH: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INTEGRITY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Raise `class_name` from `fastckpt.errors` with `message`; if that module cannot be imported, the import
/// error is raised instead (it names what is missing).
fn raise(
    py: Python<'_>,
    cell: &PyOnceLock<Py<PyType>>,
    class_name: &str,
    message: String,
) -> PyErr {
    match cell.import(py, "fastckpt.errors", class_name) {
        Ok(cls) => PyErr::from_type(cls.clone(), message),
        Err(import_error) => import_error,
    }
}

/// `fastckpt.errors.IntegrityError(message)` (bytes of another size or checksum than recorded).
pub fn integrity_error(message: String) -> PyErr {
    Python::attach(|py| raise(py, &INTEGRITY, "IntegrityError", message))
}

/// Turn a core error into the Python exception CORE_API.md names for it.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| {
        let message = err.to_string();
        match err {
            Error::Header(_) => raise(py, &HEADER, "HeaderError", message),
            Error::Truncated { .. } => raise(py, &TRUNCATED, "TruncatedFileError", message),
            Error::Dtype(_) => raise(py, &DTYPE, "DtypeError", message),
            Error::KeyMismatch(_) => raise(py, &KEY_MISMATCH, "KeyMismatchError", message),
            Error::Integrity(_) => raise(py, &INTEGRITY, "IntegrityError", message),
            Error::InvalidArgument(_) => PyValueError::new_err(message),
            Error::Io {
                path,
                context,
                source,
            } => match source.raw_os_error() {
                // OSError(errno, strerror, filename) becomes FileNotFoundError, PermissionError, ...
                Some(errno) => {
                    let strerror = std::io::Error::from_raw_os_error(errno).to_string();
                    let strerror = strerror
                        .strip_suffix(&format!(" (os error {errno})"))
                        .unwrap_or(&strerror)
                        .to_string();
                    PyOSError::new_err((
                        errno,
                        format!("{context}: {strerror}"),
                        path.into_os_string(),
                    ))
                }
                None => PyOSError::new_err(message),
            },
        }
    })
}
