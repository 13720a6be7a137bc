//! Coalesced positional reads: the loads' read jobs (pieces of tensors, sorted by file offset) are grouped into
//! runs of touching byte ranges of up to a few MiB, and each run is one `preadv` into the pieces' own
//! destinations; [`read_span`] reads one whole byte range of a file into one buffer in [`BLOCK`] pieces with
//! many reads in flight (a cold `fastckpt.torch.load_file`). Free functions of an open file and the path that
//! names it in errors: the reader and the verifier build on them (nothing here knows a safetensors header).
//!
//! Why: a training state of many small and medium tensors (GPT-2 small: 593 tensors, most under 3 MiB) was read
//! as one blocking `pread` per tensor piece on min(8, cores) workers: on a 2-core machine two small reads in flight
//! at a time, each waiting the device's latency. One `preadv` per run of touching tensors turns 593 reads into
//! about as many as the bytes need at [`BLOCK`] each, and a cold whole-file read keeps [`IO_THREADS`] of them in
//! flight (run:ai's model streamer does the same: 16 workers of large reads into one buffer).

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::pool;
use crate::readahead::{cached, with_readahead};

/// The largest coalesced read (bytes) when nothing is summed.
pub(crate) const BLOCK: u64 = 8 << 20;
/// Workers for a cold read: blocking reads in flight at the device (more than cores is the point: they wait).
pub(crate) const IO_THREADS: usize = 16;
/// The most pieces one `preadv` takes (Linux's `IOV_MAX`).
const MAX_IOV: usize = 1024;

/// Group `ranges` (absolute `(start, end)` byte ranges, sorted by start) into runs of consecutive ranges that
/// touch (`end == next start`), each run at most `limit` bytes and [`MAX_IOV`] ranges; a range longer than
/// `limit` is a run of its own.
pub(crate) fn runs(ranges: &[(u64, u64)], limit: u64) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut run_bytes = 0u64;
    for (i, &(a, b)) in ranges.iter().enumerate() {
        let len = b - a;
        if let Some(last) = out.last_mut() {
            let touches = ranges[last.end - 1].1 == a;
            if touches && run_bytes + len <= limit && last.len() < MAX_IOV {
                last.end = i + 1;
                run_bytes += len;
                continue;
            }
        }
        out.push(i..i + 1);
        run_bytes = len;
    }
    out
}

/// Fill `bufs` (back to back in the file) from `offset` with `preadv`, again after a short count. On failure,
/// the index of the piece that could not be filled and the error (`UnexpectedEof` when the file ends first).
pub(crate) fn preadv_exact(
    file: &File,
    bufs: &mut [&mut [u8]],
    mut offset: u64,
) -> std::result::Result<(), (usize, io::Error)> {
    let mut iov: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let mut first = 0usize; // the first piece not yet filled
    loop {
        while first < iov.len() && iov[first].iov_len == 0 {
            first += 1;
        }
        if first == iov.len() {
            break;
        }
        let count = (iov.len() - first) as libc::c_int;
        // SAFETY: every iovec points into a live, exclusively borrowed slice of `bufs` (advanced within its
        // bounds below); the fd is owned by `file`.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                iov[first..].as_ptr(),
                count,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err((first, e));
        }
        if n == 0 {
            return Err((first, io::ErrorKind::UnexpectedEof.into()));
        }
        offset += n as u64;
        let mut left = n as usize;
        while left > 0 {
            let piece = &mut iov[first];
            if piece.iov_len == 0 {
                first += 1;
                continue;
            }
            let take = left.min(piece.iov_len);
            // SAFETY: advancing within the piece: `take <= iov_len`.
            piece.iov_base = unsafe { piece.iov_base.cast::<u8>().add(take) }.cast();
            piece.iov_len -= take;
            left -= take;
        }
    }
    Ok(())
}

/// Whether the pages at one to four fifths of `len` bytes of `file` at `start` are in the page cache (the first
/// pages prove nothing: opening the file read its header, and readahead brought the pages after it).
pub(crate) fn sampled_cached(file: &File, start: u64, len: u64) -> bool {
    len == 0 || (1..5).all(|k| cached(file, start + len * k / 5))
}

/// Fill `buf` with the bytes `[start, start + buf.len())` of `file` (named `path` in errors): [`BLOCK`]-sized
/// positional reads by `threads` workers (0: [`IO_THREADS`] when the range does not look cached, else min(8,
/// cores)), in file order, with readahead hints ahead of them. A range past the end of the file is
/// [`Error::Truncated`].
pub(crate) fn read_span(
    path: &Path,
    file: &File,
    start: u64,
    buf: &mut [u8],
    threads: usize,
) -> Result<()> {
    let len = buf.len() as u64;
    let threads = match threads {
        0 if !sampled_cached(file, start, len) => IO_THREADS,
        n => pool::resolve_threads(n),
    };
    let blocks: Vec<std::sync::Mutex<Option<&mut [u8]>>> = buf
        .chunks_mut(BLOCK as usize)
        .map(|b| std::sync::Mutex::new(Some(b)))
        .collect();
    let ranges: Vec<(u64, u64)> = (0..blocks.len() as u64)
        .map(|k| {
            (
                start + k * BLOCK,
                (start + (k + 1) * BLOCK).min(start + len),
            )
        })
        .collect();
    with_readahead(file, &ranges, |done| {
        pool::run::<(), _>(threads, blocks.len(), None, |_, k| {
            let block = blocks[k]
                .lock()
                .expect("block lock")
                .take()
                .expect("each block once");
            let at = ranges[k].0;
            read_exact_at(path, file, block, at, || {
                format!("bytes [{start}, {})", start + len)
            })?;
            done.fetch_add(ranges[k].1 - at, Ordering::Relaxed);
            Ok(())
        })
    })?;
    Ok(())
}

/// `read_exact_at` of `buf` at `offset` in `file` (named `path`), a short file as [`Error::Truncated`] naming
/// `what()`.
pub(crate) fn read_exact_at(
    path: &Path,
    file: &File,
    buf: &mut [u8],
    offset: u64,
    what: impl Fn() -> String,
) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Truncated {
                path: path.display().to_string(),
                what: what(),
                expected: offset + buf.len() as u64,
                actual: file.metadata().map_or(0, |m| m.len()),
            }
        } else {
            Error::io(path, format!("reading {}", what()), e)
        }
    })
}

/// `preadv_exact` of one run of pieces of `file` (named `path`), a short file as [`Error::Truncated`] naming
/// `what(piece)`.
pub(crate) fn read_run(
    path: &Path,
    file: &File,
    bufs: &mut [&mut [u8]],
    offsets: &[u64],
    what: impl Fn(usize) -> String,
) -> Result<()> {
    preadv_exact(file, bufs, offsets[0]).map_err(|(k, e)| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Truncated {
                path: path.display().to_string(),
                what: what(k),
                expected: offsets[k] + bufs[k].len() as u64,
                actual: file.metadata().map_or(0, |m| m.len()),
            }
        } else {
            Error::io(path, format!("reading {}", what(k)), e)
        }
    })
}

#[cfg(test)]
#[path = "coalesce_tests.rs"]
mod tests;
