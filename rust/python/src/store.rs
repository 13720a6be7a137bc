//! `ObjectStore`: one bucket of an S3 API store (`fastckpt-store`). Arguments are converted with the GIL held;
//! every request runs with it released. Errors: a missing object is `FileNotFoundError`, a conditional create
//! that lost `FileExistsError`, bytes of another size `fastckpt.errors.IntegrityError`, a bad setting
//! `ValueError`, everything else (after the bounded retries) `OSError`; each message names the object's URL.

use std::path::PathBuf;

use fastckpt_store::{Store, StoreError};
use pyo3::exceptions::{PyFileExistsError, PyFileNotFoundError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::integrity_error;

fn to_py(err: StoreError) -> PyErr {
    let message = err.to_string();
    match err {
        StoreError::Config(_) => PyValueError::new_err(message),
        StoreError::NotFound { .. } => PyFileNotFoundError::new_err(message),
        StoreError::AlreadyExists { .. } => PyFileExistsError::new_err(message),
        StoreError::Integrity { .. } => integrity_error(message),
        StoreError::Io { .. } | StoreError::Store { .. } => PyOSError::new_err(message),
    }
}

/// One bucket; see `fastckpt/_core.pyi`.
#[pyclass(frozen, module = "fastckpt._core")]
pub struct ObjectStore {
    store: Store,
}

#[pymethods]
impl ObjectStore {
    #[new]
    #[pyo3(signature = (bucket, options = Vec::new()))]
    fn new(py: Python<'_>, bucket: String, options: Vec<(String, String)>) -> PyResult<Self> {
        let store = py
            .detach(|| Store::open(&bucket, &options))
            .map_err(to_py)?;
        Ok(ObjectStore { store })
    }

    /// `(part_size in bytes, concurrency)`.
    #[getter]
    fn transfer(&self) -> (u64, usize) {
        let t = self.store.transfer();
        (t.part_size, t.concurrency)
    }

    fn url(&self, key: &str) -> String {
        self.store.url(key)
    }

    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let got = py.detach(|| self.store.get(key)).map_err(to_py)?;
        Ok(got.map(|data| PyBytes::new(py, &data)))
    }

    #[pyo3(signature = (key, data, *, create_only = false))]
    fn put(&self, py: Python<'_>, key: &str, data: Vec<u8>, create_only: bool) -> PyResult<()> {
        py.detach(|| self.store.put(key, data, create_only))
            .map_err(to_py)
    }

    fn list(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<(String, u64)>> {
        py.detach(|| self.store.list(prefix)).map_err(to_py)
    }

    fn list_dirs(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
        py.detach(|| self.store.list_dirs(prefix)).map_err(to_py)
    }

    fn delete(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<()> {
        py.detach(|| self.store.delete(&keys)).map_err(to_py)
    }

    fn abort_upload(&self, py: Python<'_>, key: &str, upload_id: &str) -> PyResult<()> {
        py.detach(|| self.store.abort_upload(key, upload_id))
            .map_err(to_py)
    }

    /// `[(size, crc32c)]` of each `(local file, key)` uploaded.
    fn upload_files(
        &self,
        py: Python<'_>,
        jobs: Vec<(PathBuf, String)>,
    ) -> PyResult<Vec<(u64, u32)>> {
        let done = py
            .detach(|| self.store.upload_files(&jobs))
            .map_err(to_py)?;
        Ok(done.into_iter().map(|u| (u.size, u.crc32c)).collect())
    }

    /// `[crc32c]` of each `(key, local file, size)` downloaded.
    fn download_files(
        &self,
        py: Python<'_>,
        jobs: Vec<(String, PathBuf, u64)>,
    ) -> PyResult<Vec<u32>> {
        py.detach(|| self.store.download_files(&jobs))
            .map_err(to_py)
    }
}
