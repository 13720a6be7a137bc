//! The readers' limits (`fastckpt_core::limits`) as module constants, so Python's readers and writers use the
//! same numbers as the core's.

use pyo3::prelude::*;

/// Add the limit constants to the module `m`.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use fastckpt_core::limits;
    m.add("MAX_HEADER_BYTES", limits::MAX_HEADER_BYTES)?;
    m.add("MAX_INDEX_BYTES", limits::MAX_INDEX_BYTES)?;
    m.add("MAX_DCP_METADATA_BYTES", limits::MAX_DCP_METADATA_BYTES)?;
    m.add("MAX_DCP_RANK", limits::MAX_DCP_RANK)?;
    Ok(())
}
