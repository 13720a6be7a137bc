//! `SafetensorsFile` (an opened, validated, privately mapped file exposing the buffer protocol) and
//! `parse_header` (validate an in-memory file).

use std::ffi::c_int;
use std::path::PathBuf;
use std::ptr::NonNull;

use fastckpt_core::{Header, TensorInfo, DEFAULT_CHUNK_BYTES};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::to_py;

/// `(name, dtype, shape, begin, end)`, offsets relative to the data section.
type TensorTuple = (String, &'static str, Vec<u64>, u64, u64);

fn tensor_tuples(tensors: &[TensorInfo]) -> Vec<TensorTuple> {
    tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype.name(),
                t.shape.clone(),
                t.begin,
                t.end,
            )
        })
        .collect()
}

fn metadata_dict<'py>(
    py: Python<'py>,
    metadata: Option<&[(String, String)]>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    metadata
        .map(|m| {
            let d = PyDict::new(py);
            for (k, v) in m {
                d.set_item(k, v)?;
            }
            Ok(d)
        })
        .transpose()
}

/// An opened, validated safetensors file mapped privately (copy-on-write) and writably.
#[pyclass(frozen, module = "fastckpt._core")]
pub struct SafetensorsFile {
    inner: fastckpt_core::SafetensorsFile,
}

#[pymethods]
impl SafetensorsFile {
    /// Open `path` and validate its header fully; raises HeaderError, TruncatedFileError, DtypeError, OSError.
    /// `mmap=False` maps nothing: tensors are read with `read_into` / `read_ranges` only.
    /// `open_path`: open that path instead (a folder-handle-relative path), naming the file `path`.
    #[new]
    #[pyo3(signature = (path, *, mmap = true, open_path = None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        mmap: bool,
        open_path: Option<PathBuf>,
    ) -> PyResult<Self> {
        let source = open_path.unwrap_or_else(|| path.clone());
        let inner = py
            .detach(|| fastckpt_core::SafetensorsFile::open_with(&source, &path, mmap))
            .map_err(to_py)?;
        Ok(SafetensorsFile { inner })
    }

    /// The path it was opened with.
    #[getter]
    fn path(&self) -> &std::ffi::OsStr {
        self.inner.path().as_os_str()
    }

    /// The file's size in bytes.
    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_size()
    }

    /// 8 + the header length: tensor offsets are relative to it.
    #[getter]
    fn data_start(&self) -> u64 {
        self.inner.data_start()
    }

    /// `__metadata__` as a dict (file order), or None when the file has none.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        metadata_dict(py, self.inner.metadata())
    }

    /// `[(name, dtype, shape, begin, end)]` in file (offset) order, offsets relative to `data_start`.
    fn tensors(&self) -> Vec<TensorTuple> {
        tensor_tuples(self.inner.tensors())
    }

    /// Fill each `(name, buffer)` target (writable, C-contiguous, exactly the tensor's size) with the
    /// tensor's bytes by parallel positional reads, GIL released. `expect`: one recorded crc32c (or None) per
    /// target: each target's bytes are summed as they are read and compared (IntegrityError naming every
    /// damaged tensor, `recorded_in` the record's file; the targets hold what was read).
    #[pyo3(signature = (targets, *, threads = 0, expect = None, recorded_in = "fastckpt.json"))]
    fn read_into(
        &self,
        py: Python<'_>,
        targets: &Bound<'_, PyList>,
        threads: usize,
        expect: Option<Vec<Option<u32>>>,
        recorded_in: &str,
    ) -> PyResult<()> {
        if let Some(e) = &expect {
            if e.len() != targets.len() {
                return Err(PyValueError::new_err(format!(
                    "{}: {} recorded crc32c values for {} targets",
                    self.inner.path().display(),
                    e.len(),
                    targets.len()
                )));
            }
        }
        let mut held: Vec<(String, PyUntypedBuffer)> = Vec::with_capacity(targets.len());
        for item in targets.iter() {
            let (name, obj): (String, Bound<'_, PyAny>) = item.extract()?;
            let buf = PyUntypedBuffer::get(&obj)?;
            if buf.readonly() || !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "{}: the target buffer for tensor {name:?} must be writable and C-contiguous",
                    self.inner.path().display()
                )));
            }
            held.push((name, buf));
        }
        // Targets may alias (a float buffer and its int view share storage): read them in rounds, so that no
        // two overlapping targets are ever filled at once; a later target in the list is filled later.
        let spans: Vec<(usize, usize)> = held
            .iter()
            .map(|(_, b)| (b.buf_ptr() as usize, b.len_bytes()))
            .collect();
        let rounds = overlap_rounds(&spans);
        let last_round = rounds.iter().copied().max().unwrap_or(0);
        let names: Vec<&str> = held.iter().map(|(n, _)| n.as_str()).collect();
        py.detach(|| {
            for round in 0..=last_round {
                let targets: Vec<(String, &mut [u8])> = (0..spans.len())
                    .filter(|&i| rounds[i] == round)
                    .map(|i| {
                        let (addr, len) = spans[i];
                        let ptr = NonNull::new(addr as *mut u8)
                            .filter(|_| len > 0)
                            .unwrap_or(NonNull::dangling());
                        // SAFETY: each buffer is exported (held in `held` until this call returns), writable
                        // and C-contiguous; targets of one round never overlap (overlap_rounds), and each
                        // round's slices are dropped before the next round's are made. Zero lengths use a
                        // dangling, aligned pointer.
                        let slice = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
                        (names[i].to_string(), slice)
                    })
                    .collect();
                match &expect {
                    None => self
                        .inner
                        .read_into(targets, threads, DEFAULT_CHUNK_BYTES)?,
                    Some(e) => {
                        let want: Vec<Option<u32>> = (0..spans.len())
                            .filter(|&i| rounds[i] == round)
                            .map(|i| e[i])
                            .collect();
                        self.inner.read_into_checked(
                            targets,
                            &want,
                            recorded_in,
                            threads,
                            DEFAULT_CHUNK_BYTES,
                        )?
                    }
                }
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Fill each `(name, offset, buffer)` target (writable, C-contiguous, not overlapping another) with the
    /// tensor's bytes `[offset, offset + len(buffer))` by parallel positional reads, GIL released.
    #[pyo3(signature = (targets, *, threads = 0))]
    fn read_ranges(
        &self,
        py: Python<'_>,
        targets: &Bound<'_, PyList>,
        threads: usize,
    ) -> PyResult<()> {
        let mut held: Vec<(String, u64, PyUntypedBuffer)> = Vec::with_capacity(targets.len());
        for item in targets.iter() {
            let (name, offset, obj): (String, u64, Bound<'_, PyAny>) = item.extract()?;
            let buf = PyUntypedBuffer::get(&obj)?;
            if buf.readonly() || !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "{}: the target buffer for tensor {name:?} must be writable and C-contiguous",
                    self.inner.path().display()
                )));
            }
            held.push((name, offset, buf));
        }
        let spans: Vec<(usize, usize)> = held
            .iter()
            .map(|(_, _, b)| (b.buf_ptr() as usize, b.len_bytes()))
            .collect();
        if let Some(i) = overlap_rounds(&spans).iter().position(|&r| r > 0) {
            return Err(PyValueError::new_err(format!(
                "{}: the target buffer for tensor {:?} overlaps another target of the same call",
                self.inner.path().display(),
                held[i].0
            )));
        }
        py.detach(|| {
            let targets: Vec<(String, u64, &mut [u8])> = held
                .iter()
                .zip(&spans)
                .map(|((name, offset, _), &(addr, len))| {
                    let ptr = NonNull::new(addr as *mut u8)
                        .filter(|_| len > 0)
                        .unwrap_or(NonNull::dangling());
                    // SAFETY: each buffer is exported (held in `held` until this call returns), writable and
                    // C-contiguous, and no two overlap (checked above). Zero lengths use a dangling, aligned
                    // pointer.
                    let slice = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
                    (name.clone(), *offset, slice)
                })
                .collect();
            self.inner
                .read_ranges_into(targets, threads, DEFAULT_CHUNK_BYTES)
        })
        .map_err(to_py)
    }

    /// Sum the bytes of `tensors` (`[(name, recorded crc32c)]`; with `file_crc32c` the header and every tensor)
    /// by parallel positional reads, GIL released, and compare with the recorded values; raises IntegrityError
    /// naming the file and every damaged tensor. Returns `(bytes read, tensors compared)`.
    /// `summed`: `[(name, crc32c)]` of tensors already summed by `read_into(expect=...)`: not read again.
    #[pyo3(signature = (tensors, *, file_crc32c = None, recorded_in = "fastckpt.json", threads = 0, summed = None))]
    fn verify(
        &self,
        py: Python<'_>,
        tensors: Vec<(String, u32)>,
        file_crc32c: Option<u32>,
        recorded_in: &str,
        threads: usize,
        summed: Option<Vec<(String, u32)>>,
    ) -> PyResult<(u64, usize)> {
        let expected = fastckpt_core::Expected {
            file_crc32c,
            tensors,
            recorded_in: recorded_in.to_string(),
            summed: summed.unwrap_or_default(),
        };
        let done = py
            .detach(|| self.inner.verify(&expected, threads, DEFAULT_CHUNK_BYTES))
            .map_err(to_py)?;
        Ok((done.bytes, done.tensors))
    }

    /// Whether the data section looks cached (its pages at 1/5..4/5 are in the page cache).
    fn looks_cached(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.data_looks_cached())
    }

    /// Start reading the tensors' bytes into the page cache without waiting (`posix_fadvise(WILLNEED)`, at most
    /// `max_bytes`; nothing when they look cached or the file is closed), for a load about to touch all of them.
    #[pyo3(signature = (*, max_bytes = u64::MAX))]
    fn prefetch(&self, py: Python<'_>, max_bytes: u64) {
        py.detach(|| self.inner.prefetch(max_bytes));
    }

    /// Drop the file handle; the mapping (and every view of it) stays valid.
    fn close(&self) {
        self.inner.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "SafetensorsFile({:?}, tensors={}, file_size={})",
            self.inner.path().display().to_string(),
            self.inner.tensors().len(),
            self.inner.file_size()
        )
    }

    /// The whole private mapping as a writable 1-D unsigned-byte buffer; every view keeps this object (and so
    /// the mapping) alive.
    // SAFETY: (contract) the interpreter calls this with a valid, writable `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("a NULL Py_buffer"));
        }
        if !slf.get().inner.is_mapped() {
            return Err(PyBufferError::new_err(format!(
                "{}: opened with mmap=False, so it has no mapping to view; use read_into",
                slf.get().inner.path().display()
            )));
        }
        let (ptr, len) = slf.get().inner.mapping();
        // SAFETY: `view` is a non-NULL Py_buffer supplied by the interpreter; the mapping is `len` bytes,
        // readable and writable (private), and lives as long as `slf`, which PyBuffer_FillInfo stores in
        // `view.obj` with a new reference. FillInfo uses a static "B" format, so nothing needs freeing.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr.as_ptr().cast(),
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// Nothing to free per view: the mapping lives as long as the object.
    // SAFETY: (contract) the interpreter calls this once per view filled by `__getbuffer__`; it touches nothing.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// For each `(address, length)` span, the round it is read in: 0 unless it overlaps an earlier span, then one
/// more than the latest round of the earlier spans it overlaps. Spans of one round never overlap.
fn overlap_rounds(spans: &[(usize, usize)]) -> Vec<usize> {
    let mut by_start: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    by_start.sort_unstable_by_key(|&i| spans[i].0);
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    for &i in &by_start {
        open.retain(|&j| spans[j].0 + spans[j].1 > spans[i].0);
        pairs.extend(open.iter().map(|&j| (j.min(i), j.max(i))));
        open.push(i);
    }
    pairs.sort_unstable_by_key(|&(_, later)| later);
    let mut rounds = vec![0; spans.len()];
    for (earlier, later) in pairs {
        rounds[later] = rounds[later].max(rounds[earlier] + 1);
    }
    rounds
}

/// Validate a whole in-memory file; returns `(metadata, tensors, data_start)`.
#[pyfunction]
pub fn parse_header<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<(Option<Bound<'py, PyDict>>, Vec<TensorTuple>, u64)> {
    let buf = PyUntypedBuffer::get(data)?;
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(
            "parse_header needs a C-contiguous buffer",
        ));
    }
    let len = buf.len_bytes();
    let ptr = NonNull::new(buf.buf_ptr().cast::<u8>())
        .filter(|_| len > 0)
        .unwrap_or(NonNull::dangling());
    // SAFETY: the buffer is exported (held by `buf` for this whole call) and C-contiguous; the caller must not
    // resize or write to it meanwhile. A zero length uses a dangling, aligned pointer.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
    let header: Header = py
        .detach(|| fastckpt_core::parse_file(bytes, "<bytes>"))
        .map_err(to_py)?;
    Ok((
        metadata_dict(py, header.metadata.as_deref())?,
        tensor_tuples(&header.tensors),
        header.data_start,
    ))
}

#[cfg(test)]
mod tests {
    use super::overlap_rounds;

    #[test]
    fn rounds_separate_overlapping_spans_in_list_order() {
        // 0: [0,10)  1: [20,30)  2: [5,15) overlaps 0  3: [8,9) overlaps 0 and 2  4: empty  5: [29,40) overlaps 1
        let spans = [(0, 10), (20, 10), (5, 10), (8, 1), (3, 0), (29, 11)];
        assert_eq!(overlap_rounds(&spans), [0, 0, 1, 2, 0, 1]);
        assert_eq!(overlap_rounds(&[(0, 4), (4, 4)]), [0, 0]);
        assert_eq!(overlap_rounds(&[]), Vec::<usize>::new());
    }
}
