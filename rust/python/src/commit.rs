//! `commit_dir`: put a finished staging folder at its target in one step.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::errors::to_py;

/// Put the finished folder `staging` at `target`: a rename when `target` does not exist, otherwise
/// renameat2(RENAME_EXCHANGE) and removal of the old tree; fsync the parent folder when `durable`.
#[pyfunction]
#[pyo3(signature = (staging, target, *, durable = true))]
pub fn commit_dir(
    py: Python<'_>,
    staging: PathBuf,
    target: PathBuf,
    durable: bool,
) -> PyResult<()> {
    py.detach(|| fastckpt_core::commit_dir(&staging, &target, durable))
        .map_err(to_py)
}
