//! `fastckpt._core`: thin PyO3 bindings over `fastckpt-core`. Each file holds one Python-facing concern:
//! errors (mapping), write (write_file, write_files, write_files_checked, serialize), read (SafetensorsFile,
//! parse_header), progress (WriteProgress), commit, integrity (checksum_files, crc32c, hash_pieces), assemble (write_assembled), limits
//! (the readers' limits), store (ObjectStore: s3:// buckets, over `fastckpt-store`).
#![deny(clippy::undocumented_unsafe_blocks)]

mod assemble;
mod commit;
mod errors;
mod integrity;
mod limits;
mod progress;
mod read;
mod store;
mod write;

use pyo3::prelude::*;

/// The Rust core of fastckpt: safetensors writing, reading and committing. See `fastckpt/_core.pyi`.
#[pymodule]
mod _core {
    #[pymodule_export]
    use super::assemble::write_assembled;
    #[pymodule_export]
    use super::commit::commit_dir;
    #[pymodule_export]
    use super::integrity::{checksum_files, crc32c, hash_files, hash_pieces};
    #[pymodule_export]
    use super::progress::WriteProgress;
    #[pymodule_export]
    use super::read::{parse_header, SafetensorsFile};
    #[pymodule_export]
    use super::store::ObjectStore;
    #[pymodule_export]
    use super::write::{hash_tensors, serialize, write_file, write_files, write_files_checked};

    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        super::limits::add(m)
    }
}
