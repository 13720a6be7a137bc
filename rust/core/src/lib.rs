//! fastckpt-core: the safetensors format (header build, parse and validation), a parallel zero-copy writer
//! and a private-mmap reader. Pure Rust; the PyO3 bindings live in the `fastckpt-python` crate.
//!
//! - [`header`]: header bytes identical to safetensors 0.8, and full validation of read headers.
//! - [`source`]: tensor sources (contiguous or strided) with bounds checks, gathered in logical order.
//! - [`layout`]: a file planned before writing (order, offsets, chunks), and in-memory [`serialize`].
//! - [`direct`]: durable writes through `O_DIRECT`, block-aligned chunks from aligned bounce buffers.
//! - [`job`]: one file to write (its path, tensors and metadata), what the writer and the progress share.
//! - [`writer`]: temp file + preallocate + parallel positional writes + fsync + rename.
//! - [`progress`]: per-tensor progress of a write from live memory; the caller takes unwritten tensors over.
//! - [`reader`]: open, validate, map privately, parallel `read_into`.
//! - [`verify`]: a load's bytes checked against the recorded crc32c as they are read, before they are used.
//! - [`commit`]: put a staging folder in place atomically.
//! - [`checksum`]: crc32c per tensor and per file, summed while writing and by `verify`.
//! - [`content_hash`]: xxh3-128 content hashes per tensor, computed while writing (shared frozen weights).
//! - [`convert`]: floating dtype conversion while writing (round to nearest even, as torch does).
//! - [`assemble`]: a file assembled from byte ranges of other files (consolidating sharded checkpoints).
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod assemble;
pub mod checksum;
mod coalesce;
pub mod commit;
pub mod content_hash;
pub mod convert;
pub mod direct;
pub mod dtype;
pub mod error;
mod file_open;
pub mod header;
pub mod job;
pub mod layout;
pub mod limits;
pub mod pool;
pub mod progress;
mod readahead;
pub mod reader;
pub mod source;
mod sys;
mod temp_file;
pub mod verify;
pub mod writer;

/// Default bytes per positional write or read: 8 MiB.
pub const DEFAULT_CHUNK_BYTES: u64 = 8 << 20;

pub use assemble::{write_assembled, AssembledTensor, CopyRange};
pub use checksum::{checksum_files, FileCheck, FileChecksums};
pub use commit::commit_dir;
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use header::{parse_file, Header, TensorInfo};
pub use layout::{serialize, FileLayout};
pub use progress::Progress;
pub use reader::SafetensorsFile;
pub use source::TensorSource;
pub use verify::{Expected, Verified};
pub use writer::{write_file, write_files, FileJob, ReadyGate, WriteOptions, WriteStats};
