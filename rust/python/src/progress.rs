//! `WriteProgress`: the core's per-tensor [`Progress`] of a write from live memory, shared between the writer
//! (passed to `write_files_checked(progress=...)`) and the Python code that takes unwritten tensors over at an
//! optimizer step. Every wait runs with the GIL released.

use std::sync::Arc;

use fastckpt_core::progress::CopyBytes;
use fastckpt_core::Progress;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;

/// A held, C-contiguous Python buffer as the bytes of a copy.
struct HeldCopy(PyUntypedBuffer);

impl AsRef<[u8]> for HeldCopy {
    fn as_ref(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the buffer is exported (held by `self.0`) and C-contiguous (checked in `provide`), so `len`
        // bytes from its start stay valid while `self` lives; the caller must not write to it (documented).
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr().cast::<u8>(), len) }
    }
}

/// Progress of every tensor of one write. See `_core.pyi`.
#[pyclass(module = "fastckpt._core", frozen)]
pub struct WriteProgress {
    pub(crate) inner: Arc<Progress>,
}

#[pymethods]
impl WriteProgress {
    #[new]
    fn new(sizes: Vec<u64>) -> Self {
        WriteProgress {
            inner: Arc::new(Progress::new(&sizes)),
        }
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn is_written(&self, id: usize) -> PyResult<bool> {
        self.inner.is_written(id).map_err(to_py)
    }

    fn claim(&self, py: Python<'_>, ids: Vec<usize>) -> PyResult<Vec<usize>> {
        let inner = self.inner.clone();
        py.detach(move || inner.claim(&ids)).map_err(to_py)
    }

    fn wait_written(&self, py: Python<'_>, ids: Vec<usize>) -> PyResult<()> {
        let inner = self.inner.clone();
        py.detach(move || inner.wait_written(&ids)).map_err(to_py)
    }

    fn provide(&self, id: usize, copy: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = PyUntypedBuffer::get(copy)?;
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "the copy of tensor {id} is not a C-contiguous buffer"
            )));
        }
        let bytes: CopyBytes = Arc::new(HeldCopy(buffer));
        self.inner.provide(id, bytes).map_err(to_py)
    }

    fn abort(&self, message: &str) {
        self.inner.abort(message);
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}
