//! `write_file`, `write_files`, `serialize`: tensor sources are converted and checked with the GIL held (the
//! Python buffers are kept alive in [`HeldSource`]), then all copying and I/O runs with the GIL released.

use std::path::PathBuf;
use std::ptr::NonNull;

use std::sync::{Arc, Mutex};

use fastckpt_core::{Dtype, FileJob, ReadyGate, TensorSource, WriteOptions, DEFAULT_CHUNK_BYTES};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py;
use crate::progress::WriteProgress;

/// `(name, dtype, shape, buffer, byte_offset, byte_strides)` as Python passes it.
type SourceTuple<'py> = (
    String,
    String,
    Vec<i64>,
    Bound<'py, PyAny>,
    i64,
    Option<Vec<i64>>,
);

/// The same with a seventh entry: the dtype name to convert to while writing (or None).
type ConvertingTuple<'py> = (
    String,
    String,
    Vec<i64>,
    Bound<'py, PyAny>,
    i64,
    Option<Vec<i64>>,
    Option<String>,
);

/// `(path, tensors, metadata)`: one file of `write_files`.
type JobTuple<'py> = (PathBuf, Bound<'py, PyAny>, Option<Vec<(String, String)>>);

/// A tensor source whose Python buffer is held (exported) for as long as this lives.
pub struct HeldSource {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    buffer: PyUntypedBuffer,
    byte_offset: u64,
    byte_strides: Option<Vec<u64>>,
    convert_to: Option<Dtype>,
}

fn non_negative(values: &[i64], what: &str, name: &str) -> PyResult<Vec<u64>> {
    values
        .iter()
        .map(|&v| u64::try_from(v))
        .collect::<Result<_, _>>()
        .map_err(|_| {
            PyValueError::new_err(format!(
                "tensor {name:?}: {what} {values:?} has a negative entry"
            ))
        })
}

impl HeldSource {
    /// Convert and check one source tuple (`file` names the file in messages).
    pub fn extract(obj: &Bound<'_, PyAny>, file: &str) -> PyResult<Self> {
        let (name, dtype, shape, buf, offset, strides, convert) =
            match obj.extract::<ConvertingTuple<'_>>() {
                Ok(t) => t,
                Err(_) => {
                    let (n, d, s, b, o, st): SourceTuple<'_> = obj.extract()?;
                    (n, d, s, b, o, st, None)
                }
            };
        let dtype = Dtype::parse_for(&dtype, &name, file).map_err(to_py)?;
        let convert_to = convert
            .map(|c| Dtype::parse_for(&c, &name, file))
            .transpose()
            .map_err(to_py)?;
        let shape = non_negative(&shape, "shape", &name)?;
        let byte_strides = strides
            .map(|s| non_negative(&s, "byte_strides", &name))
            .transpose()?;
        let byte_offset = u64::try_from(offset).map_err(|_| {
            PyValueError::new_err(format!("tensor {name:?}: negative byte_offset {offset}"))
        })?;
        let buffer = PyUntypedBuffer::get(&buf)?;
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "tensor {name:?}: its buffer is not C-contiguous (pass the tensor's whole storage as bytes)"
            )));
        }
        Ok(HeldSource {
            name,
            dtype,
            shape,
            buffer,
            byte_offset,
            byte_strides,
            convert_to,
        })
    }

    /// The core's view of this source; borrows the held buffer.
    pub fn source(&self) -> TensorSource<'_> {
        let len = self.buffer.len_bytes();
        let ptr = NonNull::new(self.buffer.buf_ptr().cast::<u8>())
            .filter(|_| len > 0)
            .unwrap_or(NonNull::dangling());
        // SAFETY: the buffer is exported (held by `self.buffer`) and C-contiguous, so `len` bytes from its
        // start are valid for as long as `self` lives; a zero length uses a dangling, aligned pointer. The
        // caller must not resize or write to the object while it is being written (documented in _core.pyi).
        let data = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
        TensorSource {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            data,
            byte_offset: self.byte_offset,
            byte_strides: self.byte_strides.clone(),
            convert_to: self.convert_to,
        }
    }
}

/// Extract a list of source tuples.
pub fn extract_sources(tensors: &Bound<'_, PyAny>, file: &str) -> PyResult<Vec<HeldSource>> {
    tensors
        .try_iter()?
        .map(|t| HeldSource::extract(&t?, file))
        .collect()
}

fn options(durable: bool, threads: usize, chunk_bytes: u64) -> WriteOptions {
    WriteOptions {
        durable,
        threads,
        chunk_bytes,
        ..WriteOptions::default()
    }
}

/// A Python callable `ready(spans: list[tuple[int, int]]) -> None` as the core's [`ReadyGate`]: called from the
/// writer's workers with the GIL taken for the call. Its exception is kept in `raised` (and re-raised by the
/// caller) while the core sees a generic error that stops the write.
fn python_gate(ready: Py<PyAny>, raised: Arc<Mutex<Option<PyErr>>>) -> ReadyGate {
    ReadyGate(Arc::new(move |spans: &[(usize, usize)]| {
        Python::attach(|py| ready.call1(py, (spans.to_vec(),)).map(|_| ())).map_err(|e| {
            let msg = format!("the ready callback raised {e}");
            raised.lock().expect("gate lock").get_or_insert(e);
            fastckpt_core::Error::InvalidArgument(msg)
        })
    }))
}

/// `options` plus the `ready` gate; run `write` and prefer the callback's own exception to the core's error.
fn with_gate<T>(
    opts: WriteOptions,
    ready: Option<Py<PyAny>>,
    write: impl FnOnce(&WriteOptions) -> PyResult<T>,
) -> PyResult<T> {
    let raised = Arc::new(Mutex::new(None));
    let opts = WriteOptions {
        ready: ready.map(|r| python_gate(r, raised.clone())),
        ..opts
    };
    let result = write(&opts);
    let callback_error = raised.lock().expect("gate lock").take();
    match callback_error {
        Some(e) if result.is_err() => Err(e),
        _ => result,
    }
}

/// Write one safetensors file; returns its size in bytes. See `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata, *, durable = true, threads = 0, chunk_bytes = 8_388_608))]
pub fn write_file(
    py: Python<'_>,
    path: PathBuf,
    tensors: &Bound<'_, PyAny>,
    metadata: Option<Vec<(String, String)>>,
    durable: bool,
    threads: usize,
    chunk_bytes: u64,
) -> PyResult<u64> {
    let held = extract_sources(tensors, &path.display().to_string())?;
    let opts = options(durable, threads, chunk_bytes);
    let sources: Vec<TensorSource<'_>> = held.iter().map(HeldSource::source).collect();
    let stats = py
        .detach(|| fastckpt_core::write_file(&path, sources, metadata, &opts))
        .map_err(to_py)?;
    Ok(stats.file_sizes[0])
}

/// `(file_size, file_crc32c, [(tensor, crc32c)], [(tensor, xxh3-128 content hash as 32 hex digits)])` of one
/// written file, tensors in file order.
pub type FileDigest = (u64, u32, Vec<(String, u32)>, Vec<(String, String)>);

/// Convert `jobs` with the GIL held, then write them all with it released.
fn run_write_files(
    py: Python<'_>,
    jobs: &Bound<'_, PyAny>,
    opts: &WriteOptions,
) -> PyResult<fastckpt_core::WriteStats> {
    let mut held = Vec::new();
    for job in jobs.try_iter()? {
        let (path, tensors, metadata): JobTuple<'_> = job?.extract()?;
        let sources = extract_sources(&tensors, &path.display().to_string())?;
        held.push((path, sources, metadata));
    }
    let file_jobs: Vec<FileJob<'_>> = held
        .iter()
        .map(|(path, sources, metadata)| FileJob {
            path: path.clone(),
            tensors: sources.iter().map(HeldSource::source).collect(),
            metadata: metadata.clone(),
        })
        .collect();
    py.detach(|| fastckpt_core::write_files(&file_jobs, opts))
        .map_err(to_py)
}

/// Write several files in one parallel pass; returns each file's size. See `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (jobs, *, durable = true, threads = 0, chunk_bytes = 8_388_608, ready = None))]
pub fn write_files(
    py: Python<'_>,
    jobs: &Bound<'_, PyAny>,
    durable: bool,
    threads: usize,
    chunk_bytes: u64,
    ready: Option<Py<PyAny>>,
) -> PyResult<Vec<u64>> {
    let stats = with_gate(options(durable, threads, chunk_bytes), ready, |o| {
        run_write_files(py, jobs, o)
    })?;
    Ok(stats.file_sizes)
}

/// `write_files`, also returning each file's crc32c checksums, summed while the bytes were written; with
/// `progress`, the writer reports each tensor's progress there and writes tensors taken over from their copies.
/// See `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (jobs, *, durable = true, threads = 0, chunk_bytes = 8_388_608, ready = None, progress = None))]
pub fn write_files_checked(
    py: Python<'_>,
    jobs: &Bound<'_, PyAny>,
    durable: bool,
    threads: usize,
    chunk_bytes: u64,
    ready: Option<Py<PyAny>>,
    progress: Option<PyRef<'_, WriteProgress>>,
) -> PyResult<Vec<FileDigest>> {
    let opts = WriteOptions {
        progress: progress.map(|p| p.inner.clone()),
        ..options(durable, threads, chunk_bytes)
    };
    let stats = with_gate(opts, ready, |o| run_write_files(py, jobs, o))?;
    Ok(stats
        .checksums
        .into_iter()
        .map(|c| {
            let hashes = c
                .tensors
                .iter()
                .zip(&c.tensor_hashes)
                .map(|((name, _), h)| (name.clone(), format!("{h:032x}")))
                .collect();
            (c.file_size, c.file_crc32c, c.tensors, hashes)
        })
        .collect())
}

/// The content hashes (xxh3-128, 32 hex digits) of tensor sources in memory, as they would be written. See
/// `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (tensors, *, threads = 0))]
pub fn hash_tensors(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<Vec<String>> {
    let held = extract_sources(tensors, "<memory>")?;
    let sources: Vec<TensorSource<'_>> = held.iter().map(HeldSource::source).collect();
    let hashes = py
        .detach(|| fastckpt_core::content_hash::hash_sources(&sources, threads))
        .map_err(to_py)?;
    Ok(hashes.into_iter().map(|h| format!("{h:032x}")).collect())
}

/// The bytes `write_file` would write, as a `bytes` object. See `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (tensors, metadata))]
pub fn serialize<'py>(
    py: Python<'py>,
    tensors: &Bound<'py, PyAny>,
    metadata: Option<Vec<(String, String)>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let held = extract_sources(tensors, "<bytes>")?;
    let sources: Vec<TensorSource<'_>> = held.iter().map(HeldSource::source).collect();
    let layout = py
        .detach(|| fastckpt_core::FileLayout::plan(&sources, metadata.as_deref(), "<bytes>"))
        .map_err(to_py)?;
    let size = usize::try_from(layout.file_size())
        .map_err(|_| PyValueError::new_err("serialized size does not fit in memory"))?;
    PyBytes::new_with(py, size, |out| {
        // The new bytes object is not visible to any other Python code yet, so filling it unlocked is safe.
        py.detach(|| layout.serialize_into(out, 0, DEFAULT_CHUNK_BYTES))
            .map_err(to_py)
    })
}
