//! crc32c (Castagnoli) checksums, per tensor and per file, from the `crc-fast` crate (carry-less multiplication:
//! VPCLMULQDQ / AVX-512, PCLMULQDQ + SSE 4.2 or ARM PMULL, chosen at run time; pure Rust, no C). Every chunk of a
//! file is summed on its own, by whichever thread writes or reads it, split at tensor boundaries into pieces; the
//! pieces are then folded in file order with [`crc32c_combine`], so parallel chunks never need each other's state.
//! The writer sums the bytes it writes (no second pass); [`checksum_files`] sums files already on disk (for
//! `verify`), with parallel positional reads, never through a mapping (a file shrunk under us is an error, not a
//! SIGBUS).

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crc_fast::{CrcAlgorithm, Digest};

use crate::error::{Error, IoContext, Result};
use crate::header::{self, TensorInfo};
use crate::pool;

/// The largest positional read of a sum: small enough to stay in the CPU cache for the crc32c that follows.
pub(crate) const PIECE: usize = 1 << 20;

/// The crc32c of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The crc32c of `data` appended to a running `crc` (0 to start): `crc32c_append(crc32c(a), b)` is the crc32c of
/// `a` followed by `b`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if crc == 0 {
        return crc32c(data);
    }
    // The register before the final xor is the complement of the crc32c so far.
    let mut digest = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

/// The crc32c of two runs of bytes back to back, from their crc32c values and the second run's length in bytes.
///
/// Computed as `crc1 * x^(8 len2) + crc2` modulo the polynomial, the power taken from a table of `x^(2^k)`: about
/// 64 bit steps per set bit of the length (under a microsecond), where the zlib-style matrix squaring of the
/// `crc32c` and `crc-fast` crates takes 40-50 us (measured here), which a load of many tensors pays per piece.
pub fn crc32c_combine(crc1: u32, crc2: u32, len2: u64) -> u32 {
    if len2 == 0 {
        return crc1;
    }
    mul_mod(x_pow_8n(len2), crc1) ^ crc2
}

/// The crc32c polynomial, bit-reflected (x^0 is the highest bit).
const POLY: u32 = 0x82F6_3B78;

/// `a * b` modulo the polynomial (both reflected).
const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                return p;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
}

/// `X2N[k]` = x^(2^k) modulo the polynomial, for every power a 64-bit length in bits needs.
const X2N: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = 1 << 30; // x^1
    let mut k = 1;
    while k < 67 {
        t[k] = mul_mod(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// x^(8 n) modulo the polynomial: the operator that appends `n` zero bytes.
fn x_pow_8n(mut n: u64) -> u32 {
    let mut p = 1u32 << 31; // x^0
    let mut k = 3; // 8 n = n * 2^3
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod(X2N[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// A file's checksums: the whole file (header and data) and each tensor's bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileChecksums {
    /// The file size in bytes.
    pub file_size: u64,
    /// crc32c of every byte of the file.
    pub file_crc32c: u32,
    /// `(name, crc32c of its data bytes)` in file (offset) order; an empty tensor's crc is 0.
    pub tensors: Vec<(String, u32)>,
    /// Each tensor's content hash ([`crate::content_hash`]), in the order of `tensors`; empty when not
    /// computed.
    pub tensor_hashes: Vec<u128>,
}

/// The crc32c of one run of bytes of a file: `tensor` indexes the file's tensors (offset order); `None` for
/// bytes of no tensor (the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceCrc {
    /// The tensor the bytes belong to, if any.
    pub tensor: Option<usize>,
    /// Their crc32c.
    pub crc: u32,
    /// How many bytes.
    pub len: u64,
}

/// Fold `pieces`, given in file order and covering the file from byte 0 without gaps, into the file's
/// checksums. `names` are the tensors' names in offset order.
pub fn fold(pieces: impl IntoIterator<Item = PieceCrc>, names: Vec<String>) -> FileChecksums {
    let mut file = 0u32;
    let mut size = 0u64;
    let mut tensors = vec![0u32; names.len()];
    for p in pieces {
        file = crc32c_combine(file, p.crc, p.len);
        size += p.len;
        if let Some(t) = p.tensor {
            tensors[t] = crc32c_combine(tensors[t], p.crc, p.len);
        }
    }
    FileChecksums {
        file_size: size,
        file_crc32c: file,
        tensors: names.into_iter().zip(tensors).collect(),
        tensor_hashes: Vec::new(),
    }
}

/// A file on disk, summed: its checksums, and why its header could not be used when it could not (its
/// tensors are then unknown, only the whole-file crc32c is computed).
#[derive(Debug)]
pub struct FileCheck {
    /// The path summed.
    pub path: PathBuf,
    /// Size, whole-file crc32c, and per-tensor crc32c (empty when `header_error` is set).
    pub checksums: FileChecksums,
    /// The header's validation error (HeaderError, TruncatedFileError, DtypeError), if any.
    pub header_error: Option<Error>,
}

/// The regions of a file: `(tensor, absolute byte range)`, header first, then each non-empty tensor.
fn regions(size: u64, header: Option<&header::Header>) -> Vec<(Option<usize>, Range<u64>)> {
    let Some(h) = header else {
        return vec![(None, 0..size)];
    };
    let mut out = vec![(None, 0..h.data_start)];
    for (i, t) in h.tensors.iter().enumerate() {
        if t.end > t.begin {
            out.push((Some(i), h.data_start + t.begin..h.data_start + t.end));
        }
    }
    out
}

/// The pieces of `regions` (sorted, adjacent) that `range` covers, as `(tensor, absolute range)`.
fn split(
    regions: &[(Option<usize>, Range<u64>)],
    range: Range<u64>,
) -> Vec<(Option<usize>, Range<u64>)> {
    let first = regions.partition_point(|(_, r)| r.end <= range.start);
    regions[first..]
        .iter()
        .take_while(|(_, r)| r.start < range.end)
        .map(|(t, r)| (*t, r.start.max(range.start)..r.end.min(range.end)))
        .filter(|(_, r)| r.start < r.end)
        .collect()
}

/// One file being summed.
struct Summing {
    path: PathBuf,
    file: File,
    size: u64,
    header: std::result::Result<header::Header, Error>,
    regions: Vec<(Option<usize>, Range<u64>)>,
}

fn open_for_summing(path: &Path) -> Result<Summing> {
    let file = crate::file_open::open_file(path)?;
    let size = file.metadata().at(path, "reading the size of")?.len();
    let header = read_header(&file, size, path);
    let regions = regions(size, header.as_ref().ok());
    Ok(Summing {
        path: path.to_path_buf(),
        file,
        size,
        header,
        regions,
    })
}

/// Read and validate the header of an open file (I/O errors are reported as errors of the header).
pub(crate) fn read_header(file: &File, size: u64, path: &Path) -> Result<header::Header> {
    let label = path.display().to_string();
    let mut prefix = [0u8; 8];
    let got = (size as usize).min(8);
    file.read_exact_at(&mut prefix[..got], 0)
        .at(path, "reading the header length of")?;
    let n = header::header_len(&prefix[..got], size, &label)?;
    let mut json = vec![0u8; n as usize];
    file.read_exact_at(&mut json, 8)
        .at(path, "reading the header of")?;
    header::parse(&json, size, &label)
}

/// Sum every file of `paths` (safetensors files; others get only a whole-file crc32c and a header error) in
/// one parallel pass of `chunk_bytes` positional reads by `threads` workers (0 = min(8, cores)).
///
/// Errors: a file that cannot be opened or read ([`Error::Io`]), or one that shrinks while it is read
/// ([`Error::Truncated`]). A malformed header is not an error of the call: see [`FileCheck::header_error`].
pub fn checksum_files(
    paths: &[PathBuf],
    threads: usize,
    chunk_bytes: u64,
) -> Result<Vec<FileCheck>> {
    if chunk_bytes == 0 {
        return Err(Error::InvalidArgument(
            "chunk_bytes must be at least 1".into(),
        ));
    }
    let files = paths
        .iter()
        .map(|p| open_for_summing(p))
        .collect::<Result<Vec<_>>>()?;
    let mut first_chunk = vec![0usize];
    for f in &files {
        first_chunk
            .push(first_chunk[first_chunk.len() - 1] + f.size.div_ceil(chunk_bytes) as usize);
    }
    let total = first_chunk[files.len()];
    let results: Vec<OnceLock<Vec<PieceCrc>>> = (0..total).map(|_| OnceLock::new()).collect();
    pool::run::<Vec<u8>, _>(threads, total, None, |buf, k| {
        let f = first_chunk.partition_point(|&c| c <= k) - 1;
        let s = &files[f];
        let start = (k - first_chunk[f]) as u64 * chunk_bytes;
        let range = start..(start + chunk_bytes).min(s.size);
        let len = (range.end - range.start) as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        s.file
            .read_exact_at(&mut buf[..len], range.start)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => Error::Truncated {
                    path: s.path.display().to_string(),
                    what: "the file (it shrank while it was read)".into(),
                    expected: range.end,
                    actual: s.file.metadata().map_or(0, |m| m.len()),
                },
                _ => Error::io(
                    &s.path,
                    format!("reading {len} bytes at offset {}", range.start),
                    e,
                ),
            })?;
        let pieces = split(&s.regions, range.clone())
            .into_iter()
            .map(|(tensor, r)| {
                let at = (r.start - range.start) as usize..(r.end - range.start) as usize;
                PieceCrc {
                    tensor,
                    crc: crc32c(&buf[at]),
                    len: r.end - r.start,
                }
            })
            .collect();
        results[k].set(pieces).expect("each chunk once");
        Ok(())
    })?;
    let mut results = results
        .into_iter()
        .map(|r| r.into_inner().unwrap_or_default());
    let mut out = Vec::with_capacity(files.len());
    for (f, s) in files.into_iter().enumerate() {
        let chunks = first_chunk[f + 1] - first_chunk[f];
        let pieces: Vec<PieceCrc> = results.by_ref().take(chunks).flatten().collect();
        let (names, header_error) = match s.header {
            Ok(h) => (
                h.tensors.into_iter().map(|t: TensorInfo| t.name).collect(),
                None,
            ),
            Err(e) => (Vec::new(), Some(e)),
        };
        out.push(FileCheck {
            path: s.path,
            checksums: fold(pieces, names),
            header_error,
        });
    }
    Ok(out)
}

#[cfg(test)]
#[path = "checksum_tests.rs"]
mod tests;
