//! Reading safetensors files: open, validate the whole header, map the file privately and writably
//! (copy-on-write, so views of it are writable without touching the file), and `read_into` caller buffers
//! with parallel positional reads.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

use memmap2::{MmapMut, MmapOptions};

use crate::checksum::{crc32c_append, crc32c_combine, PIECE};
use crate::coalesce::{read_run, runs, sampled_cached};
use crate::error::{Error, IoContext, Result};
use crate::file_open::open_file_as;
use crate::header::{self, Header, TensorInfo};
use crate::pool;
use crate::readahead::{willneed, with_readahead};

/// One positional read: (file offset, destination, index of the tensor's name).
type ReadJob<'a> = (u64, &'a mut [u8], usize);

/// An opened, validated safetensors file with a private writable mapping of the whole file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    file: Mutex<Option<Arc<File>>>,
    map: Option<(MmapMut, MapPtr)>,
    file_size: u64,
    header: Header,
    index: HashMap<String, usize>,
}

/// The mapping's first byte, taken once from `MmapMut::as_mut_ptr` so that writes through it (by Python
/// views) never go through a shared reference.
#[derive(Debug)]
struct MapPtr(NonNull<u8>);

// SAFETY: the pointer is into a private mapping owned by the same `SafetensorsFile`; the core itself never
// reads or writes through it, it only hands it out, so moving or sharing it between threads adds no race.
unsafe impl Send for MapPtr {}
// SAFETY: as above; `&MapPtr` only gives out the address.
unsafe impl Sync for MapPtr {}

impl SafetensorsFile {
    /// Open `path`, validate its header fully (see CORE_API.md) and map it.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, path, true)
    }

    /// Open the file at `source` but name it `path` (in errors and [`SafetensorsFile::path`]): `source` can be a
    /// handle-relative path such as `/proc/self/fd/N/model.safetensors` that pins the folder a reader opened.
    pub fn open_as(source: &Path, path: &Path) -> Result<Self> {
        Self::open_with(source, path, true)
    }

    /// Open the file at `source` (named `path`, as [`open_as`](Self::open_as)) and validate its header fully;
    /// map it only when `mapped` (unmapped, tensor bytes are served by positional reads alone: memory stays
    /// bounded by what the caller reads, and [`mapping`](Self::mapping) is empty).
    pub fn open_with(source: &Path, path: &Path, mapped: bool) -> Result<Self> {
        let label = path.display().to_string();
        let file = open_file_as(source, path)?;
        let file_size = file.metadata().at(path, "reading the size of")?.len();
        let mut prefix = [0u8; 8];
        let got = (file_size as usize).min(8);
        file.read_exact_at(&mut prefix[..got], 0)
            .at(path, "reading the header length of")?;
        let n = header::header_len(&prefix[..got], file_size, &label)?;
        let mut json = vec![0u8; n as usize];
        file.read_exact_at(&mut json, 8)
            .at(path, "reading the header of")?;
        let header = header::parse(&json, file_size, &label)?;
        let map = if mapped {
            // SAFETY: a private (copy-on-write) mapping: writes through it never reach the file. The file can
            // still be changed by others under the mapping (as with any mmap); fastckpt writes files through a
            // temp file + rename, so its own files are never modified in place.
            let mut map = unsafe { MmapOptions::new().map_copy(&file) }.at(path, "mapping")?;
            let map_ptr = MapPtr(NonNull::new(map.as_mut_ptr()).expect("a mapping is never null"));
            Some((map, map_ptr))
        } else {
            None
        };
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file: Mutex::new(Some(Arc::new(file))),
            map,
            file_size,
            header,
            index,
        })
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its size in bytes.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// 8 + the header length: where the data section starts.
    pub fn data_start(&self) -> u64 {
        self.header.data_start
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// `__metadata__` in file order, `None` when absent.
    pub fn metadata(&self) -> Option<&[(String, String)]> {
        self.header.metadata.as_deref()
    }

    /// The tensors in file (offset) order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// A tensor by name, or [`Error::KeyMismatch`].
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.index
            .get(name)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| {
                Error::KeyMismatch(format!(
                    "{}: no tensor named {name:?} (the file has {} tensors)",
                    self.path.display(),
                    self.header.tensors.len()
                ))
            })
    }

    /// The index (file order) of the tensor named `name`, if the file has one.
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The whole private mapping: its first byte and its length. The memory stays valid, readable and
    /// writable as long as `self` lives. An unmapped file (see [`open_with`](Self::open_with)) gives a
    /// dangling pointer and length 0.
    pub fn mapping(&self) -> (NonNull<u8>, usize) {
        match &self.map {
            Some((map, ptr)) => (ptr.0, map.len()),
            None => (NonNull::dangling(), 0),
        }
    }

    /// Whether the file is mapped (false for [`open_with`](Self::open_with)`(source, path, false)`).
    pub fn is_mapped(&self) -> bool {
        self.map.is_some()
    }

    /// Hint the kernel to read the data section (at most `max_bytes` of it) into the page cache without waiting,
    /// unless it looks cached already (pages at 1/5..4/5 of it are; the first pages prove nothing, the header's
    /// readahead brought them). Linux reads at most the device's readahead size (`read_ahead_kb`) per hint, so
    /// this starts the first window; a mapped load (`load_file`) gets the rest from fault readahead as it touches
    /// the pages. A closed file is not hinted.
    pub fn prefetch(&self, max_bytes: u64) {
        let Ok(file) = self.handle("prefetch") else {
            return;
        };
        let start = self.header.data_start;
        let len = self.file_size.saturating_sub(start).min(max_bytes);
        if len > 0 && !sampled_cached(&file, start, len) {
            willneed(&file, start, len);
        }
    }

    /// Drop the file handle (the mapping stays). `read_into` fails afterwards.
    pub fn close(&self) {
        self.file.lock().expect("file lock").take();
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.file.lock().expect("file lock").is_none()
    }

    /// The open file handle, or [`Error::InvalidArgument`] naming `what` when [`close`](Self::close) was called.
    pub(crate) fn handle(&self, what: &str) -> Result<Arc<File>> {
        self.file.lock().expect("file lock").clone().ok_or_else(|| {
            Error::InvalidArgument(format!("{}: {what} on a closed file", self.path.display()))
        })
    }

    /// Fill each target with its tensor's bytes, read from the file (not the map) in `chunk_bytes` pieces by
    /// `threads` workers. Unknown names are [`Error::KeyMismatch`]; a target of the wrong length is
    /// [`Error::InvalidArgument`]. Targets must not overlap each other.
    pub fn read_into(
        &self,
        targets: Vec<(String, &mut [u8])>,
        threads: usize,
        chunk_bytes: u64,
    ) -> Result<()> {
        let ranges = self.whole_targets(targets)?;
        self.read_ranges_into(ranges, threads, chunk_bytes)
    }

    /// `(name, 0, target)` of each whole-tensor target, its length checked against the tensor's.
    fn whole_targets<'a>(
        &self,
        targets: Vec<(String, &'a mut [u8])>,
    ) -> Result<Vec<(String, u64, &'a mut [u8])>> {
        let mut ranges = Vec::with_capacity(targets.len());
        for (name, buf) in targets {
            let info = self.tensor(&name)?;
            let want = info.end - info.begin;
            if buf.len() as u64 != want {
                return Err(Error::InvalidArgument(format!(
                    "{}: tensor {name:?} is {want} bytes ({} {:?}) but its target buffer is {} bytes",
                    self.path.display(),
                    info.dtype,
                    info.shape,
                    buf.len()
                )));
            }
            ranges.push((name, 0, buf));
        }
        Ok(ranges)
    }

    /// Fill each `(name, offset, target)` with bytes `[offset, offset + target.len())` of that tensor's data (a
    /// part of a tensor: the pinned bounce buffers of a load to a GPU take a large tensor piece by piece), read
    /// from the file in `chunk_bytes` pieces by `threads` workers. Unknown names are [`Error::KeyMismatch`]; a
    /// range past the tensor's end is [`Error::InvalidArgument`]. Targets must not overlap each other.
    pub fn read_ranges_into(
        &self,
        targets: Vec<(String, u64, &mut [u8])>,
        threads: usize,
        chunk_bytes: u64,
    ) -> Result<()> {
        self.read_ranges(targets, threads, chunk_bytes, false)
            .map(|_| ())
    }

    /// [`read_into`](Self::read_into) that also returns the crc32c of each target's bytes (in target order),
    /// summed as they are read: each positional read of at most [`PIECE`] bytes is summed right after it lands,
    /// while it is still in the CPU cache, so the bytes cross memory once.
    pub fn read_into_summed(
        &self,
        targets: Vec<(String, &mut [u8])>,
        threads: usize,
        chunk_bytes: u64,
    ) -> Result<Vec<u32>> {
        let ranges = self.whole_targets(targets)?;
        self.read_ranges(ranges, threads, chunk_bytes, true)
    }

    /// The jobs of [`read_ranges_into`](Self::read_ranges_into), run; with `sum`, the crc32c of each target.
    fn read_ranges(
        &self,
        targets: Vec<(String, u64, &mut [u8])>,
        threads: usize,
        chunk_bytes: u64,
        sum: bool,
    ) -> Result<Vec<u32>> {
        if chunk_bytes == 0 {
            return Err(Error::InvalidArgument(
                "chunk_bytes must be at least 1".into(),
            ));
        }
        let file = self.handle("read_into")?;
        let mut flat: Vec<ReadJob<'_>> = Vec::new();
        let mut names = Vec::with_capacity(targets.len());
        for (name, offset, buf) in targets {
            let info = self.tensor(&name)?;
            let size = info.end - info.begin;
            if offset
                .checked_add(buf.len() as u64)
                .is_none_or(|end| end > size)
            {
                return Err(Error::InvalidArgument(format!(
                    "{}: tensor {name:?} is {size} bytes ({} {:?}); bytes [{offset}, {offset} + {}) are past its end",
                    self.path.display(),
                    info.dtype,
                    info.shape,
                    buf.len()
                )));
            }
            let start = self.header.data_start + info.begin + offset;
            // Summed pieces stay small enough to be summed while still in the CPU cache.
            let step = if sum {
                chunk_bytes.min(PIECE as u64)
            } else {
                chunk_bytes
            };
            for (k, piece) in buf.chunks_mut(step as usize).enumerate() {
                flat.push((start + k as u64 * step, piece, names.len()));
            }
            names.push(name);
        }
        // In file order, so the device sees one sweep (and the readahead hints run ahead of it); the pieces of
        // one target stay in order, as the crc32c combine below needs. Touching pieces (adjacent tensors) are
        // read by one preadv of up to `chunk_bytes` (PIECE when summing): see coalesce.rs.
        flat.sort_by_key(|(offset, _, _)| *offset);
        let spans: Vec<(usize, usize)> = flat.iter().map(|(_, p, t)| (*t, p.len())).collect();
        let ranges: Vec<(u64, u64)> = flat
            .iter()
            .map(|(o, p, _)| (*o, *o + p.len() as u64))
            .collect();
        let limit = if sum { PIECE as u64 } else { chunk_bytes };
        let runs = runs(&ranges, limit);
        let mut pieces: Vec<Option<&mut [u8]>> =
            flat.into_iter().map(|(_, p, _)| Some(p)).collect();
        let mut jobs: Vec<Mutex<Vec<&mut [u8]>>> = Vec::with_capacity(runs.len());
        for run in &runs {
            let bufs = run
                .clone()
                .map(|j| pieces[j].take().expect("each piece once"));
            jobs.push(Mutex::new(bufs.collect()));
        }
        let sums: Vec<OnceLock<u32>> = (0..spans.len()).map(|_| OnceLock::new()).collect();
        with_readahead(&file, &ranges, |done| {
            pool::run::<(), _>(threads, jobs.len(), None, |_, r| {
                let mut bufs = std::mem::take(&mut *jobs[r].lock().expect("job lock"));
                let run = runs[r].clone();
                let offsets: Vec<u64> = ranges[run.clone()].iter().map(|(a, _)| *a).collect();
                let what = |k: usize| format!("tensor {:?}", names[spans[run.start + k].0]);
                read_run(&self.path, &file, &mut bufs, &offsets, what)?;
                if sum {
                    for (k, piece) in bufs.iter().enumerate() {
                        sums[run.start + k]
                            .set(crc32c_append(0, piece))
                            .expect("each piece once");
                    }
                }
                let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                done.fetch_add(len, Ordering::Relaxed);
                Ok(())
            })
        })?;
        let mut out = vec![0u32; if sum { names.len() } else { 0 }];
        if sum {
            for ((t, len), crc) in spans.into_iter().zip(sums) {
                let crc = crc.into_inner().expect("every job ran");
                out[t] = crc32c_combine(out[t], crc, len as u64);
            }
        }
        Ok(out)
    }

    /// Whether the data section looks like it is in the page cache: pages at a fifth, two, three and four
    /// fifths of it are (its first pages prove nothing: reading the header pulls them in by readahead). An empty
    /// data section or a closed file counts as cached: there is nothing to read ahead.
    pub fn data_looks_cached(&self) -> bool {
        let Ok(file) = self.handle("data_looks_cached") else {
            return true;
        };
        let start = self.data_start();
        sampled_cached(&file, start, self.file_size().saturating_sub(start))
    }
}

#[cfg(test)]
#[path = "reader_tests.rs"]
mod tests;
