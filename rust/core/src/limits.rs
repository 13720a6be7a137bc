//! The limits readers enforce, one constant each, shared by the writers so that whatever fastckpt writes it
//! reads: a writer refuses (before anything is written) what a reader would refuse.
//!
//! - [`MAX_HEADER_BYTES`]: a safetensors header (the JSON after the 8-byte length), as the official reader.
//!   Checked by [`crate::header::header_len`] on read and [`crate::header::encode`] on write (the writer, the
//!   sharded writer, `serialize`, consolidation through [`crate::assemble`]).
//! - [`MAX_INDEX_BYTES`]: a `*.safetensors.index.json` shard index (read and written in Python).
//! - [`MAX_DCP_METADATA_BYTES`] and [`MAX_DCP_RANK`]: a DCP `.metadata` JSON file and the dimensions of a tensor
//!   it describes (read and written in Python, `fastckpt._format.dcp_metadata`).

/// Bytes a safetensors header may have (100 MB, as the official reader).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Bytes a shard index file (`*.safetensors.index.json`) may have.
pub const MAX_INDEX_BYTES: u64 = 100_000_000;

/// Bytes a DCP metadata file (`.metadata`, fastckpt's JSON) may have.
pub const MAX_DCP_METADATA_BYTES: u64 = 1_000_000_000;

/// Dimensions a tensor of a DCP metadata file may have.
pub const MAX_DCP_RANK: usize = 64;
