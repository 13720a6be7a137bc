//! Writing safetensors files: temp file beside the target, preallocated, tensor bytes written by a pool of
//! threads with positional (vectored) writes straight from the callers' buffers, strided tensors gathered into
//! one chunk buffer per thread; then fsync, rename over the target and fsync the folder. Each chunk's bytes
//! are summed (crc32c, per tensor piece) by the thread that writes them; see [`crate::checksum`].

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(test)]
use std::sync::Barrier;
use std::sync::{Arc, OnceLock};

use crate::checksum::{self, FileChecksums, PieceCrc};
use crate::content_hash;
use crate::direct::{self, WorkerBuffers};
use crate::error::{Error, IoContext, Result};
pub use crate::job::FileJob;
use crate::layout::FileLayout;
use crate::pool;
use crate::progress::{PieceSource, Progress};
use crate::source::TensorSource;
pub use crate::source::{ReadyFn, ReadyGate};
use crate::sys;
use crate::temp_file::{parent_dir, TempFile};

/// How to write.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// fsync each file, rename it over its target, fsync the folder. `false`: no fsync at all.
    pub durable: bool,
    /// Worker threads; 0 means min(8, cores).
    pub threads: usize,
    /// Bytes per positional write (and per gather buffer).
    pub chunk_bytes: u64,
    /// Sources that are still being filled (a pinned buffer receiving device-to-host copies): each chunk first
    /// waits here for the memory it reads. `None`: every source is ready.
    pub ready: Option<ReadyGate>,
    /// Per-tensor progress shared with the caller, who may take unwritten tensors over (see
    /// [`crate::progress`]); tensors numbered in input order across the jobs. `None`: sources are never claimed.
    pub progress: Option<Arc<Progress>>,
    /// With `durable`: write through `O_DIRECT` in block-aligned chunks (see [`crate::direct`]) where the file
    /// system allows it, bypassing the page cache; `false` always writes through the page cache.
    pub direct_io: bool,
    /// Tests: every worker waits here after taking its first chunk (size it to the worker count).
    #[cfg(test)]
    pub(crate) start_barrier: Option<Arc<Barrier>>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            durable: true,
            threads: 0,
            chunk_bytes: crate::DEFAULT_CHUNK_BYTES,
            ready: None,
            progress: None,
            direct_io: true,
            #[cfg(test)]
            start_barrier: None,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Each file's size in bytes, in job order.
    pub file_sizes: Vec<u64>,
    /// Chunks written (all files).
    pub chunks: usize,
    /// Distinct threads that wrote at least one chunk.
    pub threads_used: usize,
    /// Gather buffers allocated (at most one per thread).
    pub chunk_buffers: usize,
    /// Bytes of gather buffers allocated in all.
    pub chunk_buffer_bytes: u64,
    /// Each file's crc32c checksums (whole file, and per tensor in file order), in job order.
    pub checksums: Vec<FileChecksums>,
}

/// Write one file; see [`write_files`].
pub fn write_file(
    path: &Path,
    tensors: Vec<TensorSource<'_>>,
    metadata: Option<Vec<(String, String)>>,
    opts: &WriteOptions,
) -> Result<WriteStats> {
    let job = FileJob {
        path: path.to_path_buf(),
        tensors,
        metadata,
    };
    write_files(std::slice::from_ref(&job), opts)
}

/// Write several files in one parallel pass: all chunks of all files share one pool of workers. If anything
/// fails, every temp file is removed and no target is touched (renames happen only after all data is written).
pub fn write_files(jobs: &[FileJob<'_>], opts: &WriteOptions) -> Result<WriteStats> {
    if opts.chunk_bytes == 0 {
        return Err(Error::InvalidArgument(
            "chunk_bytes must be at least 1".into(),
        ));
    }
    let chunk = opts.chunk_bytes;
    let mut targets = std::collections::HashSet::with_capacity(jobs.len());
    if let Some(dup) = jobs.iter().find(|j| !targets.insert(j.path.as_path())) {
        return Err(Error::InvalidArgument(format!(
            "{}: the same target path is given to two files",
            dup.path.display()
        )));
    }
    let layouts = jobs
        .iter()
        .map(|j| {
            FileLayout::plan(
                &j.tensors,
                j.metadata.as_deref(),
                &j.path.display().to_string(),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let ids = crate::progress::progress_ids(jobs, &layouts, opts.progress.as_deref())?;
    let mut temps = Vec::with_capacity(jobs.len());
    let mut directs = Vec::with_capacity(jobs.len());
    for (job, layout) in jobs.iter().zip(&layouts) {
        let temp = TempFile::create(&job.path)?;
        sys::preallocate(&temp.file, layout.file_size()).at(&temp.path, "preallocating")?;
        let direct = (opts.durable && opts.direct_io)
            .then(|| direct::open_direct(&temp.path))
            .flatten();
        if direct.is_none() {
            temp.file
                .write_all_at(&layout.header, 0)
                .at(&temp.path, "writing the header")?;
        }
        temps.push(temp);
        directs.push(direct);
    }
    let dchunk = direct::chunk_size(chunk);
    // Chunk k of the whole pass belongs to the file whose range of chunk numbers holds it.
    let mut first_chunk = Vec::with_capacity(jobs.len() + 1);
    first_chunk.push(0usize);
    for (l, d) in layouts.iter().zip(&directs) {
        let n = match d {
            Some(_) => direct::chunk_count(l, dchunk),
            None => l.chunk_count(chunk),
        };
        first_chunk.push(first_chunk.last().copied().unwrap_or(0) + n);
    }
    let total_chunks = *first_chunk.last().unwrap_or(&0);
    let max_data = layouts.iter().map(|l| l.data_len).max().unwrap_or(0);
    let buffer_len = chunk.min(max_data) as usize;
    let crcs: Vec<OnceLock<Vec<PieceCrc>>> = (0..total_chunks).map(|_| OnceLock::new()).collect();
    let hashes: Vec<OnceLock<Vec<BlockHash>>> =
        (0..total_chunks).map(|_| OnceLock::new()).collect();
    let buffers = AtomicUsize::new(0);
    let buffer_bytes = AtomicU64::new(0);
    #[cfg(test)]
    let barrier = opts.start_barrier.as_deref();
    #[cfg(not(test))]
    let barrier = None;
    let report = pool::run::<WorkerBuffers, _>(opts.threads, total_chunks, barrier, |bufs, k| {
        let f = first_chunk.partition_point(|&c| c <= k) - 1;
        let (layout, temp) = (&layouts[f], &temps[f]);
        let (file_range, header_part, range) = match &directs[f] {
            Some(_) => direct::chunk_parts(layout, k - first_chunk[f], dchunk),
            None => (0..0, 0..0, layout.chunk_range(k - first_chunk[f], chunk)),
        };
        let file_offset = layout.data_start() + range.start;
        let pieces: Vec<_> = layout.pieces(range).collect();
        if let Some(gate) = &opts.ready {
            let spans: Vec<(usize, usize)> = pieces
                .iter()
                .filter_map(|p| {
                    let bytes = layout.tensors[p.tensor].contiguous_bytes()?;
                    Some((bytes[p.start as usize..].as_ptr() as usize, p.len))
                })
                .collect();
            (gate.0)(&spans)?;
        }
        let (guard, from) = match &opts.progress {
            Some(progress) => {
                let taken: Vec<(usize, u64)> = pieces
                    .iter()
                    .map(|p| (ids[f][p.tensor], p.len as u64))
                    .collect();
                let (guard, from) = progress.begin(&taken)?;
                (Some(guard), from)
            }
            None => (None, pieces.iter().map(|_| PieceSource::Live).collect()),
        };
        // A piece is read in place (live contiguous memory or the caller's copy) or gathered into `buf`.
        let direct = |i: usize| -> Option<&[u8]> {
            let p = &pieces[i];
            let start = p.start as usize;
            match &from[i] {
                PieceSource::Copy(c) => Some(&(**c).as_ref()[start..start + p.len]),
                PieceSource::Live => layout.tensors[p.tensor]
                    .contiguous_bytes()
                    .map(|b| &b[start..start + p.len]),
            }
        };
        // The whole tensor a claimed piece is read from (the caller's copy), for content-hash blocks that run past
        // the piece; `None`: the live source, read while this chunk still holds its claim (see `piece_blocks`).
        let whole = |i: usize| -> Option<&[u8]> {
            match &from[i] {
                PieceSource::Copy(c) => Some((**c).as_ref()),
                PieceSource::Live => None,
            }
        };
        let mut scratch = std::mem::take(&mut bufs.scratch);
        if let Some(dfile) = &directs[f] {
            let len = (file_range.end - file_range.start) as usize;
            let (bounce, fresh) = bufs.bounce(dchunk as usize);
            if fresh {
                buffers.fetch_add(1, Ordering::Relaxed);
                buffer_bytes.fetch_add(dchunk, Ordering::Relaxed);
            }
            let mut at = header_part.len();
            bounce[..at].copy_from_slice(&layout.header[header_part.clone()]);
            let mut sums = Vec::with_capacity(pieces.len());
            let mut blocks = Vec::new();
            for (i, p) in pieces.iter().enumerate() {
                let out = &mut bounce[at..at + p.len];
                match direct(i) {
                    Some(bytes) => out.copy_from_slice(bytes),
                    None => layout.tensors[p.tensor].gather(p.start, out),
                }
                sums.push(PieceCrc {
                    tensor: Some(p.tensor),
                    crc: checksum::crc32c_append(0, out),
                    len: p.len as u64,
                });
                blocks.extend(piece_blocks(
                    &layout.tensors[p.tensor],
                    p,
                    out,
                    whole(i),
                    &mut scratch,
                ));
                at += p.len;
            }
            hashes[k].set(blocks).expect("each chunk once");
            let padded = direct::padded(len);
            bounce[len..padded].fill(0);
            if let Some(guard) = guard {
                guard.finish(); // the bytes are in the bounce buffer: the live memory is free again
            }
            crcs[k].set(sums).expect("each chunk once");
            let written = direct::write_chunk(dfile, &bounce[..padded], file_range.start).at(
                &temp.path,
                &format!(
                    "writing {len} bytes (O_DIRECT) at offset {}",
                    file_range.start
                ),
            );
            bufs.scratch = scratch;
            return written;
        }
        let buf = &mut bufs.gather;
        let gathered: usize = (0..pieces.len())
            .filter(|&i| direct(i).is_none())
            .map(|i| pieces[i].len)
            .sum();
        if gathered > 0 && buf.is_empty() {
            *buf = vec![0u8; buffer_len];
            buffers.fetch_add(1, Ordering::Relaxed);
            buffer_bytes.fetch_add(buffer_len as u64, Ordering::Relaxed);
        }
        let mut at = 0;
        for (i, p) in pieces.iter().enumerate() {
            if direct(i).is_none() {
                layout.tensors[p.tensor].gather(p.start, &mut buf[at..at + p.len]);
                at += p.len;
            }
        }
        let mut at = 0;
        let parts: Vec<&[u8]> = (0..pieces.len())
            .map(|i| match direct(i) {
                Some(bytes) => bytes,
                None => {
                    at += pieces[i].len;
                    &buf[at - pieces[i].len..at]
                }
            })
            .collect();
        let sums = pieces.iter().zip(&parts).map(|(p, bytes)| PieceCrc {
            tensor: Some(p.tensor),
            crc: checksum::crc32c_append(0, bytes),
            len: p.len as u64,
        });
        crcs[k].set(sums.collect()).expect("each chunk once");
        let blocks = pieces
            .iter()
            .zip(&parts)
            .enumerate()
            .flat_map(|(i, (p, bytes))| {
                piece_blocks(&layout.tensors[p.tensor], p, bytes, whole(i), &mut scratch)
            })
            .collect();
        hashes[k].set(blocks).expect("each chunk once");
        bufs.scratch = scratch;
        sys::write_all_vectored_at(&temp.file, &parts, file_offset).at(
            &temp.path,
            &format!(
                "writing {} bytes at offset {file_offset}",
                range_len(&parts)
            ),
        )?;
        if let Some(guard) = guard {
            guard.finish();
        }
        if opts.durable {
            sys::start_writeback(&temp.file, file_offset, range_len(&parts) as u64);
        }
        Ok(())
    })?;
    let mut crcs = crcs.into_iter().map(|c| c.into_inner().unwrap_or_default());
    let mut hashes = hashes
        .into_iter()
        .map(|c| c.into_inner().unwrap_or_default());
    let checksums = layouts
        .iter()
        .enumerate()
        .map(|(f, layout)| {
            let header = PieceCrc {
                tensor: None,
                crc: checksum::crc32c_append(0, &layout.header),
                len: layout.header.len() as u64,
            };
            let data = crcs
                .by_ref()
                .take(first_chunk[f + 1] - first_chunk[f])
                .flatten();
            let names = layout.tensors.iter().map(|t| t.name.clone()).collect();
            let mut sums = checksum::fold(std::iter::once(header).chain(data), names);
            let mut blocks: Vec<Vec<u128>> = layout
                .tensors
                .iter()
                .map(|t| vec![0; content_hash::block_count(t.nbytes) as usize])
                .collect();
            for b in hashes
                .by_ref()
                .take(first_chunk[f + 1] - first_chunk[f])
                .flatten()
            {
                blocks[b.tensor][b.block as usize] = b.hash;
            }
            sums.tensor_hashes = layout
                .tensors
                .iter()
                .zip(&blocks)
                .map(|(t, b)| content_hash::combine(b, t.nbytes))
                .collect();
            sums
        })
        .collect();
    for ((temp, layout), d) in temps.iter().zip(&layouts).zip(&directs) {
        if d.is_some() {
            // the last direct write was padded to a whole block
            temp.file
                .set_len(layout.file_size())
                .at(&temp.path, "cutting the file to its size")?;
        }
    }
    if opts.durable {
        pool::run::<(), _>(opts.threads, temps.len(), None, |_, i| {
            temps[i].file.sync_all().at(&temps[i].path, "fsyncing")
        })?;
    }
    let mut dirs = BTreeSet::new();
    for (temp, job) in temps.iter_mut().zip(jobs) {
        fs::rename(&temp.path, &job.path).at(&job.path, "renaming the finished temp file over")?;
        temp.committed = true;
        dirs.insert(parent_dir(&job.path));
    }
    if opts.durable {
        for d in dirs {
            sys::fsync_dir(&d).at(&d, "fsyncing the folder")?;
        }
    }
    Ok(WriteStats {
        file_sizes: layouts.iter().map(FileLayout::file_size).collect(),
        chunks: total_chunks,
        threads_used: report.threads_used,
        chunk_buffers: buffers.into_inner(),
        chunk_buffer_bytes: buffer_bytes.into_inner(),
        checksums,
    })
}

/// The content hash of one block of a tensor, found by the chunk holding the block's first byte.
#[derive(Debug)]
struct BlockHash {
    tensor: usize,
    block: u64,
    hash: u128,
}

/// Hash the blocks that start inside piece `p` (whose bytes, in the file's dtype, are `bytes`); a block that runs
/// past the piece is read whole from `whole` (the caller's copy of the tensor the piece was written from) or else
/// from the source (gathered into `scratch` when not contiguous). The caller still holds its claim on the piece
/// (see [`crate::progress`]), so a live source cannot be taken over and changed meanwhile.
fn piece_blocks(
    src: &crate::source::CheckedSource<'_>,
    p: &crate::layout::Piece,
    bytes: &[u8],
    whole: Option<&[u8]>,
    scratch: &mut Vec<u8>,
) -> Vec<BlockHash> {
    let (start, end) = (p.start, p.start + p.len as u64);
    let block = content_hash::HASH_BLOCK;
    (start.div_ceil(block)..end.div_ceil(block))
        .map(|b| {
            let (b0, b1) = (b * block, ((b + 1) * block).min(src.nbytes));
            let hash = if b1 <= end {
                content_hash::block_hash(&bytes[(b0 - start) as usize..(b1 - start) as usize])
            } else if let Some(all) = whole {
                content_hash::block_hash(&all[b0 as usize..b1 as usize])
            } else {
                content_hash::source_block(src, b, scratch)
            };
            BlockHash {
                tensor: p.tensor,
                block: b,
                hash,
            }
        })
        .collect()
}

fn range_len(parts: &[&[u8]]) -> usize {
    parts.iter().map(|p| p.len()).sum()
}

#[cfg(test)]
#[path = "writer_tests.rs"]
mod tests;
