//! `write_assembled`: a safetensors file assembled from byte ranges of other files (consolidation). Arguments
//! are converted with the GIL held; the copying runs with it released.

use std::path::PathBuf;

use fastckpt_core::{AssembledTensor, CopyRange, Dtype, DEFAULT_CHUNK_BYTES};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;

/// `(name, dtype, shape, src_indices, src_offsets, dst_offsets, lengths)` as Python passes it.
type AssembledTuple = (
    String,
    String,
    Vec<u64>,
    Vec<usize>,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
);

/// Write `path` from byte ranges of `sources`; see `fastckpt/_core.pyi`.
#[pyfunction]
#[pyo3(signature = (path, sources, tensors, metadata, *, durable = true, threads = 0, chunk_bytes = DEFAULT_CHUNK_BYTES))]
#[allow(clippy::too_many_arguments)]
pub fn write_assembled(
    py: Python<'_>,
    path: PathBuf,
    sources: Vec<PathBuf>,
    tensors: Vec<AssembledTuple>,
    metadata: Option<Vec<(String, String)>>,
    durable: bool,
    threads: usize,
    chunk_bytes: u64,
) -> PyResult<u64> {
    let file = path.display().to_string();
    let mut out = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, src, src_off, dst_off, lens) in tensors {
        let n = src.len();
        if src_off.len() != n || dst_off.len() != n || lens.len() != n {
            return Err(PyValueError::new_err(format!(
                "{file}: tensor {name:?}: the range lists have {n}, {}, {} and {} entries; they must be equal",
                src_off.len(),
                dst_off.len(),
                lens.len()
            )));
        }
        let dtype = Dtype::parse_for(&dtype, &name, &file).map_err(to_py)?;
        let ranges = (0..n)
            .map(|i| CopyRange {
                src: src[i],
                src_offset: src_off[i],
                dst_offset: dst_off[i],
                len: lens[i],
            })
            .collect();
        out.push(AssembledTensor {
            name,
            dtype,
            shape,
            ranges,
        });
    }
    py.detach(|| {
        fastckpt_core::write_assembled(
            &path,
            &sources,
            &out,
            metadata.as_deref(),
            durable,
            threads,
            chunk_bytes,
        )
    })
    .map_err(to_py)
}
