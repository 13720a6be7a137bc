//! Durable writes that bypass the page cache: `O_DIRECT`, block-aligned chunks from an aligned bounce buffer.
//!
//! A durable save must reach the disk anyway; through the page cache every byte is copied into cache pages,
//! throttled as dirty memory and written back later, which on many machines (VMs, network block devices) runs at
//! a fraction of the device's own rate. Here each worker copies (or gathers) a chunk's bytes into its own
//! 4096-aligned buffer and writes it with one `pwrite` on a second, `O_DIRECT` descriptor of the temp file.
//!
//! Chunks are cut in *file* coordinates, so every write starts at a multiple of the chunk size (a multiple of
//! [`BLOCK`]): chunk 0 carries the header bytes and the first data bytes, the last chunk is padded with zeros to a
//! whole block and the file is cut back to its size (`ftruncate`) before the fsync. Checksums are summed over
//! the same source bytes as the buffered path. File systems without `O_DIRECT` (tmpfs) fall back to the buffered
//! path at open.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::layout::FileLayout;

/// Alignment and length granularity of every direct write: 4096 bytes (any logical block size up to a page).
pub const BLOCK: u64 = 4096;

/// A second descriptor of `path` opened with `O_DIRECT`, or `None` where the file system refuses it: at the
/// open (tmpfs), or at a first aligned write of one zero block at offset 0 (some FUSE and network file systems
/// accept the flag and fail the writes). That block is overwritten by chunk 0, or by the buffered header write.
pub fn open_direct(path: &Path) -> Option<File> {
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()?;
    let mut probe = WorkerBuffers::default();
    let (block, _) = probe.bounce(BLOCK as usize);
    file.write_all_at(block, 0).ok()?;
    Some(file)
}

/// `chunk_bytes` rounded up to a whole number of blocks (at least one).
pub fn chunk_size(chunk_bytes: u64) -> u64 {
    chunk_bytes.div_ceil(BLOCK).max(1) * BLOCK
}

/// Chunks of `chunk` bytes (from [`chunk_size`]) that cover the whole file of `layout`, header included.
pub fn chunk_count(layout: &FileLayout<'_>, chunk: u64) -> usize {
    layout.file_size().div_ceil(chunk) as usize
}

/// What chunk `k` covers: its file range, the header bytes in it, and the data-section range in it.
pub fn chunk_parts(
    layout: &FileLayout<'_>,
    k: usize,
    chunk: u64,
) -> (Range<u64>, Range<usize>, Range<u64>) {
    let head = layout.data_start();
    let start = k as u64 * chunk;
    let end = (start + chunk).min(layout.file_size());
    let header = (start.min(head) as usize)..(end.min(head) as usize);
    let data = start.max(head) - head..end.max(head) - head;
    (start..end, header, data)
}

/// A worker's buffers: the aligned bounce buffer of direct writes and the gather buffer of buffered ones.
#[derive(Default)]
pub struct WorkerBuffers {
    raw: Vec<u8>,
    /// Gather buffer of the buffered path (strided tensors).
    pub gather: Vec<u8>,
    /// Scratch for content-hash blocks that run past a chunk (see `writer::piece_blocks`).
    pub scratch: Vec<u8>,
}

impl WorkerBuffers {
    /// A `BLOCK`-aligned buffer of `len` bytes (allocated on first use, reused), and whether it was allocated now.
    pub fn bounce(&mut self, len: usize) -> (&mut [u8], bool) {
        let fresh = self.raw.len() < len + BLOCK as usize;
        if fresh {
            self.raw = vec![0u8; len + BLOCK as usize];
        }
        let skew = self.raw.as_ptr() as usize % BLOCK as usize;
        let at = if skew == 0 { 0 } else { BLOCK as usize - skew };
        (&mut self.raw[at..at + len], fresh)
    }
}

/// Write `bytes` (a whole chunk, zero-padded to whole blocks) at `offset` through the direct descriptor (one
/// `pwritev`, the call the buffered path makes too).
pub fn write_chunk(file: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    crate::sys::write_all_vectored_at(file, &[bytes], offset)
}

/// Bytes of `len` rounded up to whole blocks.
pub fn padded(len: usize) -> usize {
    (len as u64).div_ceil(BLOCK) as usize * BLOCK as usize
}

#[cfg(test)]
#[path = "direct_tests.rs"]
mod tests;
