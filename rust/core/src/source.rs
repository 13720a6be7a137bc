//! Tensor sources on the write side: a tensor's bytes inside a caller's buffer, contiguous or strided. Every
//! access is bounds-checked once, up front; strided tensors are gathered in logical row-major order on demand.

use crate::dtype::{numel, ByteSize, Dtype};
use crate::error::{Error, Result};
use crate::header::METADATA_KEY;

/// One tensor to write, as the caller describes it.
#[derive(Debug, Clone)]
pub struct TensorSource<'a> {
    /// The name (fqn) to store it under.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its logical shape (for F4, the packed shape).
    pub shape: Vec<u64>,
    /// The memory holding it (e.g. the tensor's whole storage).
    pub data: &'a [u8],
    /// Where its first element is in `data`, in bytes.
    pub byte_offset: u64,
    /// Strides in bytes; `None` means C-contiguous. Sub-byte dtypes must be contiguous.
    pub byte_strides: Option<Vec<u64>>,
    /// Store it as this dtype instead, converted while it is written (floating dtypes only, see
    /// [`crate::convert`]); `None` stores `dtype` as is.
    pub convert_to: Option<Dtype>,
}

/// How a checked source's bytes are laid out in its buffer.
#[derive(Debug, Clone)]
enum Layout<'a> {
    /// Exactly the tensor's bytes, in order.
    Contiguous(&'a [u8]),
    /// `base` starts at the first element; `dims` are (size, byte stride), outermost first, size-1 dims
    /// dropped and mergeable neighbours merged; never empty.
    Strided {
        base: &'a [u8],
        item: u64,
        dims: Vec<(u64, u64)>,
    },
}

/// A source that passed every check: its byte size is exact and every byte it reads is inside its buffer.
#[derive(Debug, Clone)]
pub struct CheckedSource<'a> {
    /// The name to store it under.
    pub name: String,
    /// Its dtype in the file (the converted dtype when it is converted).
    pub dtype: Dtype,
    /// Its logical shape.
    pub shape: Vec<u64>,
    /// Its size in the file, in bytes.
    pub nbytes: u64,
    /// The dtype of its memory when it is converted while written; `None` when it is written as is.
    pub converted_from: Option<Dtype>,
    layout: Layout<'a>,
}

/// Reject names the header cannot hold: `__metadata__`, control characters.
pub fn check_name(name: &str) -> Result<()> {
    if name == METADATA_KEY {
        return Err(Error::InvalidArgument(format!(
            "a tensor cannot be named {METADATA_KEY:?} (the header's metadata key)"
        )));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(Error::InvalidArgument(format!(
            "tensor name {name:?} contains the control character U+{:04X}",
            c as u32
        )));
    }
    Ok(())
}

impl<'a> TensorSource<'a> {
    /// Check the name, the byte size and every access against the buffer.
    pub fn check(&self) -> Result<CheckedSource<'a>> {
        check_name(&self.name)?;
        let name = &self.name;
        let invalid = |msg: String| Error::InvalidArgument(format!("tensor {name:?}: {msg}"));
        let n = numel(&self.shape)
            .ok_or_else(|| invalid(format!("shape {:?} overflows", self.shape)))?;
        let nbytes = match self.dtype.bytes_for(n) {
            ByteSize::Exact(b) => b,
            ByteSize::NotWhole => {
                return Err(Error::Dtype(format!(
                "tensor {name:?}: shape {:?} of {} is {n} x {} bits, not a whole number of bytes",
                self.shape,
                self.dtype,
                self.dtype.bits()
            )))
            }
            ByteSize::Overflow => return Err(invalid(format!("shape {:?} overflows", self.shape))),
        };
        let len = self.data.len() as u64;
        if self.byte_offset > len {
            return Err(invalid(format!(
                "byte_offset {} is past the end of its {len}-byte buffer",
                self.byte_offset
            )));
        }
        let base = &self.data[self.byte_offset as usize..];
        let dims = match (&self.byte_strides, self.dtype.item_bytes()) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(Error::Dtype(format!(
                    "tensor {name:?}: {} is a sub-byte dtype and must be contiguous (byte_strides=None)",
                    self.dtype
                )))
            }
            (Some(strides), Some(item)) => {
                if strides.len() != self.shape.len() {
                    return Err(invalid(format!(
                        "{} byte_strides {strides:?} for the {} dims of shape {:?}",
                        strides.len(),
                        self.shape.len(),
                        self.shape
                    )));
                }
                simplify(&self.shape, strides, item).map(|d| (item, d))
            }
        };
        let layout = match dims {
            None => {
                if nbytes > base.len() as u64 {
                    return Err(invalid(format!(
                        "{nbytes} bytes at byte_offset {} do not fit in its {len}-byte buffer",
                        self.byte_offset
                    )));
                }
                Layout::Contiguous(&base[..nbytes as usize])
            }
            Some((item, dims)) => {
                let reach = if n == 0 {
                    0
                } else {
                    dims.iter()
                        .try_fold(item, |acc, &(size, stride)| {
                            (size - 1).checked_mul(stride)?.checked_add(acc)
                        })
                        .ok_or_else(|| invalid("byte_strides overflow".to_string()))?
                };
                if reach > base.len() as u64 {
                    return Err(invalid(format!(
                        "shape {:?} with byte_strides {:?} reads {reach} bytes from byte_offset {}, \
                         past the end of its {len}-byte buffer",
                        self.shape,
                        self.byte_strides.as_deref().unwrap_or_default(),
                        self.byte_offset
                    )));
                }
                if n == 0 {
                    Layout::Contiguous(&[])
                } else {
                    Layout::Strided { base, item, dims }
                }
            }
        };
        let (dtype, nbytes, converted_from) = match self.convert_to {
            Some(to) if to != self.dtype => {
                crate::convert::check(self.dtype, to, name)?;
                (to, n * (to.bits() / 8), Some(self.dtype))
            }
            _ => (self.dtype, nbytes, None),
        };
        Ok(CheckedSource {
            name: self.name.clone(),
            dtype,
            shape: self.shape.clone(),
            nbytes,
            converted_from,
            layout,
        })
    }
}

/// Drop size-1 dims and merge neighbours that are contiguous with each other; `None` when the result is
/// plain C-contiguous (or has no elements to stride over).
fn simplify(shape: &[u64], strides: &[u64], item: u64) -> Option<Vec<(u64, u64)>> {
    if shape.contains(&0) {
        return None;
    }
    let mut dims: Vec<(u64, u64)> = Vec::with_capacity(shape.len());
    for (&size, &stride) in shape.iter().zip(strides).filter(|(&s, _)| s != 1) {
        match dims.last_mut() {
            Some(last) if last.1 == stride.saturating_mul(size) => {
                *last = (last.0 * size, stride);
            }
            _ => dims.push((size, stride)),
        }
    }
    match dims.as_slice() {
        [] => None,
        [(_, stride)] if *stride == item => None,
        _ => Some(dims),
    }
}

impl CheckedSource<'_> {
    /// Whether the bytes can be written straight from the buffer (no gather, no conversion).
    pub fn contiguous_bytes(&self) -> Option<&[u8]> {
        match &self.layout {
            Layout::Contiguous(bytes) if self.converted_from.is_none() => Some(bytes),
            _ => None,
        }
    }

    /// Copy the tensor's logical bytes `[start, start + out.len())` (row-major order, in the file's dtype)
    /// into `out`, converting them when the tensor is converted. Panics if the range is outside `0..nbytes`
    /// (callers plan ranges from `nbytes`).
    pub fn gather(&self, start: u64, out: &mut [u8]) {
        assert!(
            start + out.len() as u64 <= self.nbytes,
            "gather past the tensor's end"
        );
        match self.converted_from {
            Some(from) => self.gather_converted(from, start, out),
            None => self.gather_raw(start, out),
        }
    }

    /// Elements `[first, first + count)` converted to the file's dtype into `out` (`count` file elements).
    fn convert_elements(&self, from: Dtype, first: u64, out: &mut [u8]) {
        let (s, o) = (from.bits() / 8, self.dtype.bits() / 8);
        let count = out.len() as u64 / o;
        match &self.layout {
            Layout::Contiguous(bytes) => {
                let src = &bytes[(first * s) as usize..((first + count) * s) as usize];
                crate::convert::convert(from, self.dtype, src, out);
            }
            Layout::Strided { .. } => {
                let mut scratch = [0u8; CONVERT_BLOCK * 8];
                let src = &mut scratch[..(count * s) as usize];
                self.gather_raw(first * s, src);
                crate::convert::convert(from, self.dtype, src, out);
            }
        }
    }

    /// Converted bytes `[start, start + out.len())`, in blocks of [`CONVERT_BLOCK`] elements; a partial
    /// element at either end is converted whole into a small buffer and the needed bytes copied.
    fn gather_converted(&self, from: Dtype, start: u64, out: &mut [u8]) {
        let o = self.dtype.bits() / 8;
        let end = start + out.len() as u64;
        let mut e = start / o;
        while e * o < end {
            let block_end = (e + CONVERT_BLOCK as u64).min(end.div_ceil(o));
            let (b0, b1) = (e * o, block_end * o);
            if b0 >= start && b1 <= end {
                let at = (b0 - start) as usize;
                self.convert_elements(from, e, &mut out[at..at + (b1 - b0) as usize]);
            } else {
                let mut tmp = [0u8; CONVERT_BLOCK * 8];
                let tmp = &mut tmp[..(b1 - b0) as usize];
                self.convert_elements(from, e, tmp);
                let (lo, hi) = (b0.max(start), b1.min(end));
                out[(lo - start) as usize..(hi - start) as usize]
                    .copy_from_slice(&tmp[(lo - b0) as usize..(hi - b0) as usize]);
            }
            e = block_end;
        }
    }

    /// The source memory's logical bytes `[start, start + out.len())` (in the source dtype).
    fn gather_raw(&self, start: u64, out: &mut [u8]) {
        match &self.layout {
            Layout::Contiguous(bytes) => {
                out.copy_from_slice(&bytes[start as usize..start as usize + out.len()]);
            }
            Layout::Strided { base, item, dims } => gather_strided(base, *item, dims, start, out),
        }
    }
}

/// Elements converted per block (the block buffers live on the stack: at most 8 bytes an element).
const CONVERT_BLOCK: usize = 4096;

/// Gather logical bytes `[start, start + out.len())` of a strided tensor, one innermost row at a time.
fn gather_strided(base: &[u8], item: u64, dims: &[(u64, u64)], start: u64, out: &mut [u8]) {
    let (inner_size, inner_stride) = *dims.last().expect("strided layouts have a dim");
    let outer = &dims[..dims.len() - 1];
    let (item, inner_stride) = (item as usize, inner_stride as usize);
    let row_bytes = inner_size * item as u64;
    let end = start + out.len() as u64;
    let (mut pos, mut w) = (start, 0usize);
    while pos < end {
        let (row, in_row) = (pos / row_bytes, (pos % row_bytes) as usize);
        let mut row_at = 0u64;
        let mut r = row;
        for &(size, stride) in outer.iter().rev() {
            row_at += (r % size) * stride;
            r /= size;
        }
        let row_at = row_at as usize;
        let take = (row_bytes - in_row as u64).min(end - pos) as usize;
        let dst = &mut out[w..w + take];
        if inner_stride == item {
            dst.copy_from_slice(&base[row_at + in_row..row_at + in_row + take]);
        } else {
            gather_row(base, row_at, inner_stride, item, in_row, dst);
        }
        pos += take as u64;
        w += take;
    }
}

/// Fill `dst` with the row's logical bytes from `in_row` on, where element `e` of the row is at
/// `row_at + e * stride` in `base`. Partial elements at either end are copied byte-exactly.
fn gather_row(
    base: &[u8],
    row_at: usize,
    stride: usize,
    item: usize,
    in_row: usize,
    dst: &mut [u8],
) {
    let mut p = in_row;
    let mut w = 0;
    let stop = in_row + dst.len();
    // A leading partial element.
    if !p.is_multiple_of(item) {
        let (e, b) = (p / item, p % item);
        let n = (item - b).min(stop - p);
        let src = row_at + e * stride + b;
        dst[..n].copy_from_slice(&base[src..src + n]);
        p += n;
        w += n;
    }
    let whole = (stop - p) / item;
    let first = row_at + (p / item) * stride;
    let body = &mut dst[w..w + whole * item];
    match item {
        1 => copy_elems::<1>(base, first, stride, body),
        2 => copy_elems::<2>(base, first, stride, body),
        4 => copy_elems::<4>(base, first, stride, body),
        8 => copy_elems::<8>(base, first, stride, body),
        _ => {
            for (k, d) in body.chunks_exact_mut(item).enumerate() {
                let src = first + k * stride;
                d.copy_from_slice(&base[src..src + item]);
            }
        }
    }
    p += whole * item;
    w += whole * item;
    // A trailing partial element.
    if p < stop {
        let src = row_at + (p / item) * stride;
        let n = stop - p;
        dst[w..].copy_from_slice(&base[src..src + n]);
    }
}

/// Copy `dst.len() / N` elements of `N` bytes, the k-th from `base[first + k * stride..]`.
#[inline]
fn copy_elems<const N: usize>(base: &[u8], first: usize, stride: usize, dst: &mut [u8]) {
    for (k, d) in dst.chunks_exact_mut(N).enumerate() {
        let src = first + k * stride;
        let e: [u8; N] = base[src..src + N].try_into().expect("N bytes");
        d.copy_from_slice(&e);
    }
}

/// Called by a worker before it writes a chunk, with the `(address, length)` of the source memory of each of the
/// chunk's contiguous pieces; returns once those bytes hold their final values (or an error, which fails the
/// write). Lets chunk k be written while the copy of chunk k+1 into its source buffer is still running.
#[derive(Clone)]
pub struct ReadyGate(pub std::sync::Arc<ReadyFn>);

/// The function a [`ReadyGate`] wraps.
pub type ReadyFn = dyn Fn(&[(usize, usize)]) -> Result<()> + Send + Sync;

impl std::fmt::Debug for ReadyGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReadyGate(..)")
    }
}

#[cfg(test)]
#[path = "source_tests.rs"]
mod tests;
