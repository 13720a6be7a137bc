//! A file's layout before it is written: the checked sources in the official writer's order, their offsets,
//! the encoded header, and the split of the data section into chunks. Also `serialize` (the same bytes in
//! memory).

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::header::{self, TensorInfo};
use crate::pool;
use crate::source::{CheckedSource, TensorSource};

/// One file, planned: header bytes and tensors in file order with their data-relative begins.
#[derive(Debug)]
pub struct FileLayout<'a> {
    /// The 8-byte length, the JSON and its padding.
    pub header: Vec<u8>,
    /// Sources in file order.
    pub tensors: Vec<CheckedSource<'a>>,
    /// `begins[i]`: where `tensors[i]` starts in the data section.
    pub begins: Vec<u64>,
    /// Length of the data section.
    pub data_len: u64,
}

/// A piece of one tensor inside a chunk: `tensors[tensor]` bytes `[start, start + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index into [`FileLayout::tensors`].
    pub tensor: usize,
    /// First byte within the tensor.
    pub start: u64,
    /// Bytes.
    pub len: usize,
}

impl<'a> FileLayout<'a> {
    /// Check every source, reject duplicate names, order as the official writer does, assign offsets and
    /// encode the header. `file` names the file in error messages.
    pub fn plan(
        sources: &[TensorSource<'a>],
        metadata: Option<&[(String, String)]>,
        file: &str,
    ) -> Result<Self> {
        let mut seen = HashSet::with_capacity(sources.len());
        let mut tensors = Vec::with_capacity(sources.len());
        for s in sources {
            if !seen.insert(s.name.as_str()) {
                return Err(Error::InvalidArgument(format!(
                    "{file}: tensor name {:?} given twice",
                    s.name
                )));
            }
            tensors.push(s.check().map_err(|e| in_file(e, file))?);
        }
        tensors.sort_by(|a, b| header::writer_order((&a.name, a.dtype), (&b.name, b.dtype)));
        let mut begins = Vec::with_capacity(tensors.len());
        let mut infos = Vec::with_capacity(tensors.len());
        let mut at = 0u64;
        for t in &tensors {
            begins.push(at);
            infos.push(TensorInfo {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                begin: at,
                end: at + t.nbytes,
            });
            at += t.nbytes;
        }
        let header = header::encode(metadata, &infos).map_err(|e| in_file(e, file))?;
        Ok(FileLayout {
            header,
            tensors,
            begins,
            data_len: at,
        })
    }

    /// Total file size in bytes.
    pub fn file_size(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }

    /// Where the data section starts in the file.
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }

    /// Number of chunks of `chunk_bytes` the data section splits into.
    pub fn chunk_count(&self, chunk_bytes: u64) -> usize {
        self.data_len.div_ceil(chunk_bytes) as usize
    }

    /// The data-section range of chunk `k`.
    pub fn chunk_range(&self, k: usize, chunk_bytes: u64) -> Range<u64> {
        let start = k as u64 * chunk_bytes;
        start..(start + chunk_bytes).min(self.data_len)
    }

    /// The tensor pieces covering the data-section range `range`, in order (empty tensors skipped).
    pub fn pieces(&self, range: Range<u64>) -> impl Iterator<Item = Piece> + '_ {
        let first = self
            .begins
            .partition_point(|&b| b <= range.start)
            .saturating_sub(1);
        (first..self.tensors.len())
            .take_while(move |&i| self.begins[i] < range.end)
            .filter_map(move |i| {
                let (b, e) = (self.begins[i], self.begins[i] + self.tensors[i].nbytes);
                let (s, t) = (b.max(range.start), e.min(range.end));
                (s < t).then_some(Piece {
                    tensor: i,
                    start: s - b,
                    len: (t - s) as usize,
                })
            })
    }

    /// Copy the data-section range `range` into `out` (`out.len() == range` length).
    pub fn fill(&self, range: Range<u64>, out: &mut [u8]) {
        let mut w = 0;
        for p in self.pieces(range) {
            self.tensors[p.tensor].gather(p.start, &mut out[w..w + p.len]);
            w += p.len;
        }
        debug_assert_eq!(w, out.len());
    }

    /// Write the whole file into `out` (`out.len() == file_size()`), data chunks copied by `threads` workers.
    pub fn serialize_into(&self, out: &mut [u8], threads: usize, chunk_bytes: u64) -> Result<()> {
        assert_eq!(
            out.len() as u64,
            self.file_size(),
            "serialize_into: wrong output size"
        );
        let (head, data) = out.split_at_mut(self.header.len());
        head.copy_from_slice(&self.header);
        let chunks: Vec<Mutex<Option<&mut [u8]>>> = data
            .chunks_mut(chunk_bytes as usize)
            .map(|c| Mutex::new(Some(c)))
            .collect();
        pool::run::<(), _>(threads, chunks.len(), None, |_, k| {
            let chunk = chunks[k]
                .lock()
                .expect("chunk lock")
                .take()
                .expect("each chunk once");
            self.fill(self.chunk_range(k, chunk_bytes), chunk);
            Ok(())
        })?;
        Ok(())
    }
}

/// The bytes `write_file` would write, in memory.
pub fn serialize(
    sources: &[TensorSource<'_>],
    metadata: Option<&[(String, String)]>,
    threads: usize,
) -> Result<Vec<u8>> {
    let layout = FileLayout::plan(sources, metadata, "<bytes>")?;
    let mut out = vec![0u8; layout.file_size() as usize];
    layout.serialize_into(&mut out, threads, crate::DEFAULT_CHUNK_BYTES)?;
    Ok(out)
}

/// Prefix a message-carrying error with the file it is about.
pub(crate) fn in_file(e: Error, file: &str) -> Error {
    match e {
        Error::Header(m) => Error::Header(format!("{file}: {m}")),
        Error::Dtype(m) => Error::Dtype(format!("{file}: {m}")),
        Error::KeyMismatch(m) => Error::KeyMismatch(format!("{file}: {m}")),
        Error::Integrity(m) => Error::Integrity(format!("{file}: {m}")),
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{file}: {m}")),
        other => other,
    }
}

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;
