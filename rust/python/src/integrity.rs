//! Checksums for `verify`: `checksum_files` (parallel crc32c of files on disk, GIL released) and `crc32c` (of
//! one in-memory buffer, for the small JSON files of a checkpoint), `hash_pieces` (content hashes of tensors held in
//! several buffers).

use std::path::PathBuf;
use std::ptr::NonNull;

use fastckpt_core::DEFAULT_CHUNK_BYTES;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;

/// `(file_size, file_crc32c, [(tensor, crc32c)] | None, header_error | None)` of one file.
type FileCheckTuple = (u64, u32, Option<Vec<(String, u32)>>, Option<String>);

/// Sum every file of `paths` in one parallel pass; see `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (paths, *, threads = 0, chunk_bytes = DEFAULT_CHUNK_BYTES))]
pub fn checksum_files(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    threads: usize,
    chunk_bytes: u64,
) -> PyResult<Vec<FileCheckTuple>> {
    let checks = py
        .detach(|| fastckpt_core::checksum_files(&paths, threads, chunk_bytes))
        .map_err(to_py)?;
    Ok(checks
        .into_iter()
        .map(|c| {
            let tensors = c.header_error.is_none().then_some(c.checksums.tensors);
            let error = c.header_error.map(|e| e.to_string());
            (
                c.checksums.file_size,
                c.checksums.file_crc32c,
                tensors,
                error,
            )
        })
        .collect())
}

/// `([(tensor, hash)] | None, header_error | None)` of one file.
type FileHashTuple = (Option<Vec<(String, String)>>, Option<String>);

/// Each safetensors file's tensor content hashes from disk: `[(tensor, 32 hex digits)]` in offset order, or the
/// header's error message; see `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (paths, *, threads = 0))]
pub fn hash_files(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    threads: usize,
) -> PyResult<Vec<FileHashTuple>> {
    let files = py
        .detach(|| fastckpt_core::content_hash::hash_files(&paths, threads))
        .map_err(to_py)?;
    Ok(files
        .into_iter()
        .map(|f| match f {
            Ok(t) => (
                Some(
                    t.into_iter()
                        .map(|(n, h)| (n, format!("{h:032x}")))
                        .collect(),
                ),
                None,
            ),
            Err(e) => (None, Some(e.to_string())),
        })
        .collect())
}

/// The crc32c of `data` (any C-contiguous buffer) appended to `value` (0 to start).
#[pyfunction]
#[pyo3(signature = (data, value = 0))]
pub fn crc32c(py: Python<'_>, data: &Bound<'_, PyAny>, value: u32) -> PyResult<u32> {
    let buf = PyUntypedBuffer::get(data)?;
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("crc32c needs a C-contiguous buffer"));
    }
    let len = buf.len_bytes();
    let ptr = NonNull::new(buf.buf_ptr().cast::<u8>())
        .filter(|_| len > 0)
        .unwrap_or(NonNull::dangling());
    // SAFETY: the buffer is exported (held by `buf` for this whole call) and C-contiguous, so `len` bytes from
    // its start are valid; the caller must not resize or write to it meanwhile (as for every buffer passed
    // with the GIL released). A zero length uses a dangling, aligned pointer.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
    Ok(py.detach(|| fastckpt_core::checksum::crc32c_append(value, bytes)))
}

/// The content hash (32 hex digits) of each tensor whose bytes are the concatenation of its buffers; see
/// `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (tensors, *, threads = 0))]
pub fn hash_pieces(
    py: Python<'_>,
    tensors: Vec<Vec<Bound<'_, PyAny>>>,
    threads: usize,
) -> PyResult<Vec<String>> {
    let mut held = Vec::with_capacity(tensors.len());
    for pieces in &tensors {
        let mut bufs = Vec::with_capacity(pieces.len());
        for p in pieces {
            let buf = PyUntypedBuffer::get(p)?;
            if !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(
                    "hash_pieces needs C-contiguous buffers",
                ));
            }
            bufs.push(buf);
        }
        held.push(bufs);
    }
    let slices: Vec<Vec<&[u8]>> = held
        .iter()
        .map(|bufs| {
            bufs.iter()
                .map(|buf| {
                    let len = buf.len_bytes();
                    let ptr = NonNull::new(buf.buf_ptr().cast::<u8>())
                        .filter(|_| len > 0)
                        .unwrap_or(NonNull::dangling());
                    // SAFETY: as in `crc32c`: the buffer is exported (held in `held` for this whole call) and
                    // C-contiguous; a zero length uses a dangling, aligned pointer.
                    unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) }
                })
                .collect()
        })
        .collect();
    let hashes = py
        .detach(|| fastckpt_core::content_hash::hash_pieces(&slices, threads))
        .map_err(to_py)?;
    Ok(hashes.into_iter().map(|h| format!("{h:032x}")).collect())
}
