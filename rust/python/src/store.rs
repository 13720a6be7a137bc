//! `ObjectStore`: one bucket of an S3 API store (`fastckpt-store`). Arguments are converted with the GIL held;
//! every request runs with it released. Errors: a missing object is `FileNotFoundError`, a conditional create
//! that lost `FileExistsError`, bytes of another size `fastckpt.errors.IntegrityError`, a bad setting
//! `ValueError`, refused credentials `PermissionError`, a missing bucket `FileNotFoundError`, an unreachable
//! endpoint `ConnectionError` (each saying what to fix), everything else (after the bounded retries) `OSError`;
//! each message names the object's URL.

use std::path::PathBuf;

use fastckpt_core::{FileLayout, TensorSource};
use fastckpt_store::{Store, StoreError};
use pyo3::exceptions::{
    PyConnectionError, PyFileExistsError, PyFileNotFoundError, PyOSError, PyPermissionError,
    PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::integrity_error;
use crate::write::{extract_sources, FileDigest, HeldSource};

fn to_py(err: StoreError) -> PyErr {
    let message = err.to_string();
    match err {
        StoreError::Config(_) => PyValueError::new_err(message),
        StoreError::NotFound { .. } => PyFileNotFoundError::new_err(message),
        StoreError::AlreadyExists { .. } => PyFileExistsError::new_err(message),
        StoreError::Integrity { .. } => integrity_error(message),
        StoreError::Denied { .. } | StoreError::NoCredentials { .. } => {
            PyPermissionError::new_err(message)
        }
        StoreError::NoBucket { .. } => PyFileNotFoundError::new_err(message),
        StoreError::Unreachable { .. } => PyConnectionError::new_err(message),
        StoreError::Io { .. } | StoreError::Store { .. } => PyOSError::new_err(message),
    }
}

/// One object of `upload_tensors`, converted: `(key, url, sources, metadata)`.
type HeldJob = (
    String,
    String,
    Vec<HeldSource>,
    Option<Vec<(String, String)>>,
);

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

    /// `[(size, crc32c, [(tensor, crc32c)], [(tensor, xxh3-128 hex)])]` of each `(key, tensors, metadata)`
    /// uploaded straight from the tensors' memory (the safetensors file `write_files_checked` would write).
    #[pyo3(signature = (jobs, *, threads = 0))]
    fn upload_tensors(
        &self,
        py: Python<'_>,
        jobs: &Bound<'_, PyAny>,
        threads: usize,
    ) -> PyResult<Vec<FileDigest>> {
        type Job<'py> = (String, Bound<'py, PyAny>, Option<Vec<(String, String)>>);
        let mut held: Vec<HeldJob> = Vec::new();
        for job in jobs.try_iter()? {
            let (key, tensors, metadata): Job<'_> = job?.extract()?;
            let url = self.store.url(&key);
            let sources = extract_sources(&tensors, &url)?;
            held.push((key, url, sources, metadata));
        }
        py.detach(|| {
            let sources: Vec<Vec<TensorSource<'_>>> = held
                .iter()
                .map(|(_, _, s, _)| s.iter().map(HeldSource::source).collect())
                .collect();
            let mut layouts = Vec::with_capacity(held.len());
            let mut hashes = Vec::with_capacity(held.len());
            for ((_, url, _, metadata), sources) in held.iter().zip(&sources) {
                layouts.push(
                    FileLayout::plan(sources, metadata.as_deref(), url)
                        .map_err(crate::errors::to_py)?,
                );
                let names = sources.iter().map(|s| s.name.clone());
                let found = fastckpt_core::content_hash::hash_sources(sources, threads)
                    .map_err(crate::errors::to_py)?;
                let mut pairs: Vec<(String, u128)> = names.zip(found).collect();
                pairs.sort();
                hashes.push(pairs);
            }
            let jobs: Vec<(String, &FileLayout<'_>)> = held
                .iter()
                .zip(&layouts)
                .map(|((key, ..), layout)| (key.clone(), layout))
                .collect();
            let sums = self.store.upload_layouts(&jobs).map_err(to_py)?;
            Ok(sums
                .into_iter()
                .zip(hashes)
                .map(|(c, pairs)| {
                    let hex = pairs
                        .into_iter()
                        .map(|(name, h)| (name, format!("{h:032x}")))
                        .collect();
                    (c.file_size, c.file_crc32c, c.tensors, hex)
                })
                .collect())
        })
    }
}
