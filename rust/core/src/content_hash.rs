//! Content hashes of tensors: xxh3-128 (the `xxhash-rust` crate) over fixed tensor-relative blocks, so the
//! blocks of one tensor can be hashed in parallel by whichever threads write or read them, and the result
//! depends only on the tensor's bytes, never on where it sits in a file or how a write was chunked:
//!
//! `hash = xxh3_128(h_0 || h_1 || ... || h_{k-1} || nbytes)`, `h_b = xxh3_128(bytes[b * 256 KiB ..][.. 256 KiB])`
//! (each `h_b` as 16 little-endian bytes, `nbytes` as 8). A tensor of no bytes has `xxh3_128(0u64 as 8 bytes)`.
//!
//! The writer hashes every tensor while writing it ([`crate::writer`]); [`hash_sources`] hashes tensors in memory
//! that are not written (the frozen weights of a `trainable_only` save); [`hash_files`] hashes the tensors of
//! files on disk (for `verify`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use xxhash_rust::xxh3::xxh3_128;

use crate::error::{Error, IoContext, Result};
use crate::pool;
use crate::source::{CheckedSource, TensorSource};

/// Bytes per hashed block: 256 KiB.
pub const HASH_BLOCK: u64 = 256 << 10;

/// Number of blocks of a tensor of `nbytes` bytes.
pub fn block_count(nbytes: u64) -> u64 {
    nbytes.div_ceil(HASH_BLOCK)
}

/// The hash of one block's bytes.
pub fn block_hash(bytes: &[u8]) -> u128 {
    xxh3_128(bytes)
}

/// A tensor's hash from its block hashes (in order) and its size in bytes.
pub fn combine(blocks: &[u128], nbytes: u64) -> u128 {
    let mut buf = Vec::with_capacity(blocks.len() * 16 + 8);
    for h in blocks {
        buf.extend_from_slice(&h.to_le_bytes());
    }
    buf.extend_from_slice(&nbytes.to_le_bytes());
    xxh3_128(&buf)
}

/// The hash of a whole buffer (one tensor's bytes), single-threaded.
pub fn hash_bytes(bytes: &[u8]) -> u128 {
    let blocks: Vec<u128> = bytes.chunks(HASH_BLOCK as usize).map(block_hash).collect();
    combine(&blocks, bytes.len() as u64)
}

/// The hash of block `b` of a checked source (its bytes in the file's dtype), gathered into `scratch` when the
/// source is not contiguous.
pub fn source_block(src: &CheckedSource<'_>, b: u64, scratch: &mut Vec<u8>) -> u128 {
    let start = b * HASH_BLOCK;
    let end = (start + HASH_BLOCK).min(src.nbytes);
    match src.contiguous_bytes() {
        Some(bytes) => block_hash(&bytes[start as usize..end as usize]),
        None => {
            let len = (end - start) as usize;
            if scratch.len() < len {
                scratch.resize(len, 0);
            }
            src.gather(start, &mut scratch[..len]);
            block_hash(&scratch[..len])
        }
    }
}

/// Hash tensors in memory (as they would be written: converted when `convert_to` says so), blocks of all of
/// them in parallel on `threads` workers (0 = min(8, cores)). Returns one hash per source, in order.
pub fn hash_sources(sources: &[TensorSource<'_>], threads: usize) -> Result<Vec<u128>> {
    let checked = sources
        .iter()
        .map(TensorSource::check)
        .collect::<Result<Vec<_>>>()?;
    let sizes: Vec<u64> = checked.iter().map(|c| c.nbytes).collect();
    hash_blocks(&sizes, threads, |t, b, scratch| {
        source_block(&checked[t], b, scratch)
    })
}

/// One hash per tensor of `sizes` bytes, from its [`HASH_BLOCK`] blocks: `block(t, b, scratch)` hashes block `b` of
/// tensor `t`; the blocks of all tensors run in parallel on `threads` workers (0 = min(8, cores)).
fn hash_blocks<F>(sizes: &[u64], threads: usize, block: F) -> Result<Vec<u128>>
where
    F: Fn(usize, u64, &mut Vec<u8>) -> u128 + Sync,
{
    let mut first = vec![0usize];
    for &n in sizes {
        first.push(first[first.len() - 1] + block_count(n) as usize);
    }
    let total = first[sizes.len()];
    let blocks: Vec<OnceLock<u128>> = (0..total).map(|_| OnceLock::new()).collect();
    pool::run::<Vec<u8>, _>(threads, total, None, |scratch, k| {
        let t = first.partition_point(|&c| c <= k) - 1;
        let h = block(t, (k - first[t]) as u64, scratch);
        blocks[k].set(h).expect("each block once");
        Ok(())
    })?;
    let blocks: Vec<u128> = blocks
        .into_iter()
        .map(|b| b.into_inner().unwrap_or_default())
        .collect();
    Ok((0..sizes.len())
        .map(|t| combine(&blocks[first[t]..first[t + 1]], sizes[t]))
        .collect())
}

/// The hash of each tensor whose bytes are the concatenation of its `pieces` (in order), as [`hash_bytes`] of the
/// joined bytes would give, without joining them: a block inside one piece is hashed in place, a block spanning
/// pieces is gathered. Blocks of all tensors in parallel on `threads` workers (0 = min(8, cores)). An async save
/// uses it to hash a live tensor whose first and last bytes are taken from copies made at the call.
pub fn hash_pieces(tensors: &[Vec<&[u8]>], threads: usize) -> Result<Vec<u128>> {
    let sizes: Vec<u64> = tensors
        .iter()
        .map(|p| p.iter().map(|b| b.len() as u64).sum())
        .collect();
    hash_blocks(&sizes, threads, |t, b, scratch| {
        let start = b * HASH_BLOCK;
        let end = (start + HASH_BLOCK).min(sizes[t]);
        pieces_block(&tensors[t], start, end, scratch)
    })
}

/// The hash of bytes `[start, end)` of the concatenation of `pieces`.
fn pieces_block(pieces: &[&[u8]], start: u64, end: u64, scratch: &mut Vec<u8>) -> u128 {
    let mut at = 0u64;
    scratch.clear();
    for piece in pieces {
        let (lo, hi) = (at, at + piece.len() as u64);
        at = hi;
        if hi <= start || lo >= end {
            continue;
        }
        let a = (start.max(lo) - lo) as usize;
        let b = (end.min(hi) - lo) as usize;
        if lo <= start && hi >= end {
            return block_hash(&piece[a..b]); // the whole block is in this piece
        }
        scratch.extend_from_slice(&piece[a..b]);
    }
    block_hash(scratch)
}

/// One file's tensors, hashed from disk: `(name, hash)` in offset order, or the header's error.
pub type FileHashes = std::result::Result<Vec<(String, u128)>, Error>;

/// Hash the tensors of safetensors files on disk (positional reads of one block each, all files' blocks in one
/// parallel pass). A file whose header is invalid gets its header error; an I/O error fails the call.
pub fn hash_files(paths: &[PathBuf], threads: usize) -> Result<Vec<FileHashes>> {
    struct Opened {
        file: File,
        path: PathBuf,
        tensors: Vec<(String, u64, u64)>,
    }
    let mut opened = Vec::with_capacity(paths.len());
    let mut headers = Vec::with_capacity(paths.len());
    for p in paths {
        let file = crate::file_open::open_file(p)?;
        let size = file.metadata().at(p, "reading the size of")?.len();
        match crate::checksum::read_header(&file, size, p) {
            Ok(h) => {
                let tensors = h
                    .tensors
                    .iter()
                    .map(|t| (t.name.clone(), h.data_start + t.begin, t.end - t.begin))
                    .collect();
                headers.push(Ok(()));
                opened.push(Opened {
                    file,
                    path: p.clone(),
                    tensors,
                });
            }
            Err(e) => {
                headers.push(Err(e));
                opened.push(Opened {
                    file,
                    path: p.clone(),
                    tensors: Vec::new(),
                });
            }
        }
    }
    let mut jobs: Vec<(usize, usize, u64)> = Vec::new();
    for (f, o) in opened.iter().enumerate() {
        for (t, (_, _, n)) in o.tensors.iter().enumerate() {
            jobs.extend((0..block_count(*n)).map(|b| (f, t, b)));
        }
    }
    let results: Vec<OnceLock<u128>> = (0..jobs.len()).map(|_| OnceLock::new()).collect();
    pool::run::<Vec<u8>, _>(threads, jobs.len(), None, |buf, k| {
        let (f, t, b) = jobs[k];
        let o = &opened[f];
        let (_, at, n) = &o.tensors[t];
        let start = b * HASH_BLOCK;
        let len = (HASH_BLOCK.min(n - start)) as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        o.file.read_exact_at(&mut buf[..len], at + start).at(
            &o.path,
            &format!("reading {len} bytes at offset {}", at + start),
        )?;
        results[k]
            .set(block_hash(&buf[..len]))
            .expect("each block once");
        Ok(())
    })?;
    let mut it = results
        .into_iter()
        .map(|r| r.into_inner().unwrap_or_default());
    Ok(opened
        .into_iter()
        .zip(headers)
        .map(|(o, header)| {
            header.map(|()| {
                o.tensors
                    .into_iter()
                    .map(|(name, _, n)| {
                        let blocks: Vec<u128> = it.by_ref().take(block_count(n) as usize).collect();
                        (name, combine(&blocks, n))
                    })
                    .collect()
            })
        })
        .collect())
}

#[cfg(test)]
#[path = "content_hash_tests.rs"]
mod tests;
