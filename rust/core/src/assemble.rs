//! Assembling a safetensors file from byte ranges of other files (consolidating a sharded checkpoint): each output
//! tensor is described by the ranges of source files that fill it; the header is the official writer's (same
//! order, padding and metadata as [`crate::write_file`]); a pool of workers copies the ranges by positional reads
//! into one buffer per worker and positional writes into the preallocated temp file, so peak memory is
//! `threads * chunk_bytes` whatever the model's size; then fsync, rename over the target, fsync the folder.

use std::collections::HashSet;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::dtype::{numel, ByteSize, Dtype};
use crate::error::{Error, IoContext, Result};
use crate::header::{self, TensorInfo};
use crate::pool;
use crate::source::check_name;
use crate::sys;
use crate::temp_file::{parent_dir, TempFile};

/// `len` bytes at `src_offset` of source file `src` fill bytes `[dst_offset, dst_offset + len)` of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRange {
    /// Index into the sources.
    pub src: usize,
    /// Absolute byte offset in the source file.
    pub src_offset: u64,
    /// Byte offset within the output tensor's data.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One output tensor and the ranges that fill it (together they must cover its bytes exactly once).
#[derive(Debug, Clone)]
pub struct AssembledTensor {
    /// Its name.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape as the header stores it (F4: the unpacked last dimension).
    pub shape: Vec<u64>,
    /// The ranges, in any order.
    pub ranges: Vec<CopyRange>,
}

fn tensor_bytes(t: &AssembledTensor, file: &str) -> Result<u64> {
    let n = numel(&t.shape);
    match n.map(|n| t.dtype.bytes_for(n)) {
        Some(ByteSize::Exact(b)) => Ok(b),
        _ => Err(Error::Dtype(format!(
            "{file}: tensor {:?} of dtype {} and shape {:?} is not a whole number of bytes",
            t.name, t.dtype, t.shape
        ))),
    }
}

/// Check that `t`'s ranges cover its `nbytes` exactly once and name real sources.
fn check_cover(t: &AssembledTensor, nbytes: u64, sources: usize, file: &str) -> Result<()> {
    let mut ranges: Vec<&CopyRange> = t.ranges.iter().filter(|r| r.len > 0).collect();
    ranges.sort_by_key(|r| r.dst_offset);
    let mut at = 0u64;
    for r in ranges {
        if r.src >= sources {
            return Err(Error::InvalidArgument(format!(
                "{file}: tensor {:?}: a range names source {} of {sources}",
                t.name, r.src
            )));
        }
        if r.dst_offset != at {
            return Err(Error::InvalidArgument(format!(
                "{file}: tensor {:?}: bytes [{at}, {}) are {} (its ranges must cover its {nbytes} bytes once)",
                t.name,
                r.dst_offset.max(at),
                if r.dst_offset > at { "not covered" } else { "covered twice" }
            )));
        }
        at = at.checked_add(r.len).ok_or_else(|| {
            Error::InvalidArgument(format!("{file}: tensor {:?}: a range overflows", t.name))
        })?;
    }
    if at != nbytes {
        return Err(Error::InvalidArgument(format!(
            "{file}: tensor {:?}: its ranges cover {at} bytes, its dtype and shape need {nbytes}",
            t.name
        )));
    }
    Ok(())
}

/// One unit of work: copy `len` bytes from `sources[src]` at `src_offset` to the output at `file_offset`.
struct Copy {
    src: usize,
    src_offset: u64,
    file_offset: u64,
    len: u64,
}

/// Write the safetensors file `path` whose tensors are assembled from `sources` (see the module docs).
///
/// Returns the file size in bytes. On error the temp file is removed and `path` is untouched.
pub fn write_assembled(
    path: &Path,
    sources: &[PathBuf],
    tensors: &[AssembledTensor],
    metadata: Option<&[(String, String)]>,
    durable: bool,
    threads: usize,
    chunk_bytes: u64,
) -> Result<u64> {
    let file = path.display().to_string();
    if chunk_bytes == 0 {
        return Err(Error::InvalidArgument(
            "chunk_bytes must be at least 1".into(),
        ));
    }
    let mut seen = HashSet::with_capacity(tensors.len());
    let mut order: Vec<(usize, u64)> = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        check_name(&t.name)?;
        if !seen.insert(t.name.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "{file}: tensor name {:?} given twice",
                t.name
            )));
        }
        let nbytes = tensor_bytes(t, &file)?;
        check_cover(t, nbytes, sources.len(), &file)?;
        order.push((i, nbytes));
    }
    order.sort_by(|a, b| {
        let (x, y) = (&tensors[a.0], &tensors[b.0]);
        header::writer_order((&x.name, x.dtype), (&y.name, y.dtype))
    });
    let mut infos = Vec::with_capacity(order.len());
    let mut begins = vec![0u64; tensors.len()];
    let mut at = 0u64;
    for &(i, nbytes) in &order {
        let t = &tensors[i];
        begins[i] = at;
        infos.push(TensorInfo {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            begin: at,
            end: at + nbytes,
        });
        at += nbytes;
    }
    let head = header::encode(metadata, &infos)
        .map_err(|e| crate::layout::in_file(e, &path.display().to_string()))?;
    let data_start = head.len() as u64;
    let mut copies = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        for r in t.ranges.iter().filter(|r| r.len > 0) {
            let mut done = 0;
            while done < r.len {
                let len = (r.len - done).min(chunk_bytes);
                copies.push(Copy {
                    src: r.src,
                    src_offset: r.src_offset + done,
                    file_offset: data_start + begins[i] + r.dst_offset + done,
                    len,
                });
                done += len;
            }
        }
    }
    let inputs = sources
        .iter()
        .map(|p| File::open(p).at(p, "opening a source file"))
        .collect::<Result<Vec<_>>>()?;
    let mut temp = TempFile::create(path)?;
    sys::preallocate(&temp.file, data_start + at).at(&temp.path, "preallocating")?;
    temp.file
        .write_all_at(&head, 0)
        .at(&temp.path, "writing the header")?;
    let out = &temp.file;
    let out_path = temp.path.clone();
    pool::run::<Vec<u8>, _>(threads, copies.len(), None, |buf, k| {
        let c = &copies[k];
        buf.resize(c.len as usize, 0);
        read_exact_at(&inputs[c.src], &sources[c.src], buf, c.src_offset)?;
        out.write_all_at(buf, c.file_offset)
            .at(&out_path, "writing")
    })?;
    if durable {
        temp.file.sync_all().at(&temp.path, "fsyncing")?;
    }
    fs::rename(&temp.path, path).at(path, "renaming the finished temp file over")?;
    temp.committed = true;
    if durable {
        let dir = parent_dir(path);
        sys::fsync_dir(&dir).at(&dir, "fsyncing the folder")?;
    }
    Ok(data_start + at)
}

fn read_exact_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(Error::Truncated {
                    path: path.display().to_string(),
                    what: "a range to copy".into(),
                    expected: offset + buf.len() as u64,
                    actual: offset + done as u64,
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, "reading a range to copy", e)),
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "assemble_tests.rs"]
mod tests;
