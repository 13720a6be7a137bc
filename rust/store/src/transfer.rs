//! Moving bytes: parallel multipart uploads from a mapped file or straight from tensor memory (a planned
//! [`FileLayout`]), ranged parallel reads into a preallocated file. Every request holds one permit of a semaphore of `concurrency`, over every object of a call, so the bytes
//! in flight stay near `concurrency * part_size`. crc32c is summed per part by the task that sends or receives it,
//! and the parts are folded in order with the core's [`fastckpt_core::checksum::fold`].

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;
use fastckpt_core::checksum::{crc32c_append, fold, FileChecksums, PieceCrc};
use fastckpt_core::FileLayout;
use futures::future::try_join_all;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use tokio::sync::Semaphore;

use crate::error::{Result, StoreError};
use crate::Store;

/// Suffix of the small object that records a multipart upload's id while it runs (`{key}.fastckpt-upload`),
/// so a later save can abort the uploads of a save that was killed.
pub const UPLOAD_MARKER: &str = ".fastckpt-upload";

/// What an upload wrote: the object's size and crc32c.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upload {
    /// Bytes.
    pub size: u64,
    /// crc32c of every byte, summed as they went out.
    pub crc32c: u32,
}

/// What a download read: the crc32c of every byte written to the local file.
pub type Download = u32;

/// A byte range of a mapped file, owned (so a request body can hold it without a copy).
struct MappedSlice {
    map: Arc<memmap2::Mmap>,
    start: usize,
    end: usize,
}

impl AsRef<[u8]> for MappedSlice {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.start..self.end]
    }
}

fn io_error(path: &std::path::Path, source: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn crc_of(pieces: Vec<PieceCrc>) -> u32 {
    fold(pieces, Vec::new()).file_crc32c
}

/// The parts an object of `size` bytes is uploaded in: one (a single PUT) up to `part + part / 8` bytes, so an
/// object of one part's worth of tensors plus its header is not a multipart upload with a tiny last part; else
/// `part` sized pieces.
fn upload_ranges(size: u64, part: u64) -> Vec<Range<u64>> {
    if size <= part + part / 8 {
        return std::iter::once(0..size).collect();
    }
    ranges(size, part)
}

/// Byte ranges of `size` bytes in `part` sized pieces (one empty range for an empty object).
fn ranges(size: u64, part: u64) -> Vec<Range<u64>> {
    if size == 0 {
        return std::iter::once(0..0).collect();
    }
    (0..size.div_ceil(part))
        .map(|i| i * part..((i + 1) * part).min(size))
        .collect()
}

/// One part of an object, built once a request permit is held: its body and the crc32c of its pieces.
type Part = (PutPayload, Vec<PieceCrc>);

/// The bytes `range` of the file `layout` plans (header and data section), copied into one owned buffer (the
/// request body), with the crc32c of each piece: header bytes, then each tensor's bytes (`tensor` set).
fn layout_part(layout: &FileLayout<'_>, range: &Range<u64>) -> Part {
    let mut buf = vec![0u8; (range.end - range.start) as usize];
    let mut sums = Vec::new();
    let head = layout.data_start();
    let mut at = 0usize;
    if range.start < head {
        let end = range.end.min(head);
        let bytes = &layout.header[range.start as usize..end as usize];
        buf[..bytes.len()].copy_from_slice(bytes);
        sums.push(PieceCrc {
            tensor: None,
            crc: crc32c_append(0, bytes),
            len: bytes.len() as u64,
        });
        at = bytes.len();
    }
    let data = range.start.max(head) - head..range.end.max(head) - head;
    if data.start < data.end {
        for piece in layout.pieces(data) {
            let out = &mut buf[at..at + piece.len];
            match layout.tensors[piece.tensor].contiguous_bytes() {
                Some(bytes) => {
                    let start = piece.start as usize;
                    out.copy_from_slice(&bytes[start..start + piece.len]);
                }
                None => layout.tensors[piece.tensor].gather(piece.start, out),
            }
            sums.push(PieceCrc {
                tensor: Some(piece.tensor),
                crc: crc32c_append(0, out),
                len: piece.len as u64,
            });
            at += piece.len;
        }
    }
    debug_assert_eq!(at, buf.len());
    (PutPayload::from(buf), sums)
}

impl Store {
    /// Upload each `(local file, key)`; files larger than one part go as multipart uploads whose parts are sent
    /// in parallel. Returns each object's size and crc32c, in the order of `jobs`.
    ///
    /// A failed multipart upload is aborted; one whose process dies leaves `{key}.fastckpt-upload` naming it.
    pub fn upload_files(&self, jobs: &[(std::path::PathBuf, String)]) -> Result<Vec<Upload>> {
        let permits = Arc::new(Semaphore::new(self.transfer.concurrency));
        self.runtime.block_on(try_join_all(
            jobs.iter()
                .map(|(local, key)| self.upload_file(local, key, &permits)),
        ))
    }

    /// Upload each `(key, layout)`: the safetensors file the layout plans, straight from the tensors' memory (no
    /// local file), as [`Store::upload_files`] does (multipart above one part, parts in parallel). Each part is
    /// copied from the tensors into its own request body only once it holds a request permit, so at most
    /// `concurrency` part buffers exist at a time (about `concurrency * part_size` bytes). Returns each object's
    /// checksums (size, crc32c of the whole object and of each tensor), summed as the parts were built.
    ///
    /// The tensors must not change until this returns.
    pub fn upload_layouts(&self, jobs: &[(String, &FileLayout<'_>)]) -> Result<Vec<FileChecksums>> {
        let permits = Arc::new(Semaphore::new(self.transfer.concurrency));
        self.runtime
            .block_on(try_join_all(jobs.iter().map(|(key, layout)| {
                let permits = &permits;
                async move {
                    let pieces = self
                        .upload_object(key, layout.file_size(), permits, |range| {
                            layout_part(layout, range)
                        })
                        .await?;
                    let names = layout.tensors.iter().map(|t| t.name.clone()).collect();
                    Ok::<_, StoreError>(fold(pieces, names))
                }
            })))
    }

    async fn upload_file(
        &self,
        local: &std::path::Path,
        key: &str,
        permits: &Semaphore,
    ) -> Result<Upload> {
        let file = File::open(local).map_err(|e| io_error(local, e))?;
        let size = file.metadata().map_err(|e| io_error(local, e))?.len();
        let map = if size == 0 {
            None
        } else {
            // SAFETY: the file is one this process wrote into its own staging folder (mode 0700) and nothing
            // truncates or rewrites it while it is uploaded; the mapping is read only.
            Some(Arc::new(
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_error(local, e))?,
            ))
        };
        let body = |range: &Range<u64>| -> Part {
            let Some(map) = &map else {
                return (PutPayload::new(), Vec::new());
            };
            let slice = MappedSlice {
                map: map.clone(),
                start: range.start as usize,
                end: range.end as usize,
            };
            let piece = PieceCrc {
                tensor: None,
                crc: crc32c_append(0, slice.as_ref()),
                len: range.end - range.start,
            };
            (PutPayload::from(Bytes::from_owner(slice)), vec![piece])
        };
        let pieces = self.upload_object(key, size, permits, body).await?;
        Ok(Upload {
            size,
            crc32c: crc_of(pieces),
        })
    }

    /// Upload the object `key` of `size` bytes whose byte range `r` is `part(&r)` (called once per part, with a
    /// permit held until the part is sent): one PUT when it fits one part, else a multipart upload recorded by
    /// its marker while it runs and aborted when it fails. Returns every part's pieces, in object order.
    async fn upload_object(
        &self,
        key: &str,
        size: u64,
        permits: &Semaphore,
        part: impl Fn(&Range<u64>) -> Part,
    ) -> Result<Vec<PieceCrc>> {
        let path = Path::from(key);
        let parts = upload_ranges(size, self.transfer.part_size);
        if parts.len() == 1 {
            let _permit = permits.acquire().await.expect("semaphore open");
            let (payload, pieces) = part(&parts[0]);
            self.s3
                .put(&path, payload)
                .await
                .map_err(|e| self.fail(key, e))?;
            return Ok(pieces);
        }
        let id = self
            .s3
            .create_multipart(&path)
            .await
            .map_err(|e| self.fail(key, e))?;
        let marker = Path::from(format!("{key}{UPLOAD_MARKER}"));
        let sent = async {
            self.s3
                .put(&marker, PutPayload::from(id.clone().into_bytes()))
                .await
                .map_err(|e| self.fail(key, e))?;
            let sent: Vec<(PartId, Vec<PieceCrc>)> =
                try_join_all(parts.iter().enumerate().map(|(i, range)| {
                    let (path, id, part) = (&path, &id, &part);
                    async move {
                        let _permit = permits.acquire().await.expect("semaphore open");
                        let (payload, pieces) = part(range);
                        let done = self
                            .s3
                            .put_part(path, id, i, payload)
                            .await
                            .map_err(|e| self.fail(key, e))?;
                        Ok::<_, StoreError>((done, pieces))
                    }
                }))
                .await?;
            let (ids, pieces): (Vec<PartId>, Vec<Vec<PieceCrc>>) = sent.into_iter().unzip();
            self.s3
                .complete_multipart(&path, &id, ids)
                .await
                .map_err(|e| self.fail(key, e))?;
            Ok::<_, StoreError>(pieces.into_iter().flatten().collect())
        }
        .await;
        match sent {
            Ok(pieces) => {
                self.s3
                    .delete(&marker)
                    .await
                    .map_err(|e| self.fail(key, e))?;
                Ok(pieces)
            }
            Err(error) => {
                // best effort: the next save aborts what is left (the marker names it) if this fails too
                if self.s3.abort_multipart(&path, &id).await.is_ok() {
                    let _ = self.s3.delete(&marker).await;
                }
                Err(error)
            }
        }
    }

    /// Download each `(key, local file, size)` into a new local file of that size by ranged reads in parallel.
    /// Returns each file's crc32c, in the order of `jobs`.
    ///
    /// Raises [`StoreError::Integrity`] when the store returns another number of bytes than `size` for a range
    /// (the object is shorter or longer than recorded).
    pub fn download_files(
        &self,
        jobs: &[(String, std::path::PathBuf, u64)],
    ) -> Result<Vec<Download>> {
        let permits = Arc::new(Semaphore::new(self.transfer.concurrency));
        self.runtime
            .block_on(try_join_all(jobs.iter().map(|(key, local, size)| {
                self.download_one(key, local, *size, &permits)
            })))
    }

    async fn download_one(
        &self,
        key: &str,
        local: &std::path::Path,
        size: u64,
        permits: &Semaphore,
    ) -> Result<u32> {
        let file = File::create(local).map_err(|e| io_error(local, e))?;
        file.set_len(size).map_err(|e| io_error(local, e))?;
        let path = Path::from(key);
        if size == 0 {
            let meta = self.s3.head(&path).await.map_err(|e| self.fail(key, e))?;
            if meta.size != 0 {
                return Err(StoreError::Integrity {
                    url: self.url(key),
                    what: format!("{} bytes stored, 0 recorded in the manifest", meta.size),
                });
            }
            return Ok(0);
        }
        let (file, path) = (&file, &path);
        let pieces = try_join_all(ranges(size, self.transfer.part_size).into_iter().map(
            |range| async move {
                let _permit = permits.acquire().await.expect("semaphore open");
                let bytes = self
                    .s3
                    .get_range(path, range.clone())
                    .await
                    .map_err(|e| self.fail(key, e))?;
                let want = range.end - range.start;
                if bytes.len() as u64 != want {
                    return Err(StoreError::Integrity {
                        url: self.url(key),
                        what: format!(
                            "bytes {}..{}: {} bytes read, {want} expected",
                            range.start,
                            range.end,
                            bytes.len()
                        ),
                    });
                }
                file.write_all_at(&bytes, range.start)
                    .map_err(|e| io_error(local, e))?;
                Ok(PieceCrc {
                    tensor: None,
                    crc: crc32c_append(0, &bytes),
                    len: want,
                })
            },
        ))
        .await?;
        Ok(crc_of(pieces))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastckpt_core::{Dtype, TensorSource};

    #[test]
    fn ranges_cover_the_object_once_in_part_sized_pieces() {
        assert_eq!(ranges(0, 5), std::iter::once(0..0).collect::<Vec<_>>());
        assert_eq!(ranges(5, 5), std::iter::once(0..5).collect::<Vec<_>>());
        assert_eq!(ranges(11, 5), vec![0..5, 5..10, 10..11]);
    }

    #[test]
    fn objects_up_to_an_eighth_over_one_part_go_in_one_put() {
        assert_eq!(
            upload_ranges(0, 8),
            std::iter::once(0..0).collect::<Vec<_>>()
        );
        assert_eq!(
            upload_ranges(9, 8),
            std::iter::once(0..9).collect::<Vec<_>>()
        );
        assert_eq!(upload_ranges(10, 8), vec![0..8, 8..10]);
    }

    #[test]
    fn folded_part_crcs_equal_the_whole_objects_crc() {
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 2_654_435_761) as u8).collect();
        let pieces = ranges(data.len() as u64, 4096)
            .into_iter()
            .map(|r| PieceCrc {
                tensor: None,
                crc: crc32c_append(0, &data[r.start as usize..r.end as usize]),
                len: r.end - r.start,
            })
            .collect();
        assert_eq!(crc_of(pieces), crc32c_append(0, &data));
    }

    fn src<'a>(
        name: &str,
        shape: &[u64],
        data: &'a [u8],
        strides: Option<Vec<u64>>,
    ) -> TensorSource<'a> {
        TensorSource {
            name: name.into(),
            dtype: Dtype::U8,
            shape: shape.to_vec(),
            data,
            byte_offset: 0,
            byte_strides: strides,
            convert_to: None,
        }
    }

    #[test]
    fn layout_parts_are_the_serialized_file_and_their_crcs_fold_to_its_checksums() {
        let a: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let b: Vec<u8> = (0..600u32).map(|i| (i * 13 + 1) as u8).collect();
        // "t" is the transpose of a 20 x 30 matrix: strided, gathered into the part buffers
        let sources = [
            src("a", &[1000], &a, None),
            src("t", &[30, 20], &b, Some(vec![1, 30])),
            src("empty", &[0], &[], None),
        ];
        let layout =
            FileLayout::plan(&sources, Some(&[("format".into(), "pt".into())]), "f").unwrap();
        let whole =
            fastckpt_core::serialize(&sources, Some(&[("format".into(), "pt".into())]), 1).unwrap();
        for part in [7u64, 64, 333, 5000] {
            let mut bytes = Vec::new();
            let mut pieces = Vec::new();
            for range in ranges(layout.file_size(), part) {
                let (payload, sums) = layout_part(&layout, &range);
                assert_eq!(payload.content_length() as u64, range.end - range.start);
                payload.iter().for_each(|b| bytes.extend_from_slice(b));
                pieces.extend(sums);
            }
            assert_eq!(bytes, whole, "part size {part}");
            let names = layout.tensors.iter().map(|t| t.name.clone()).collect();
            let sums = fold(pieces, names);
            assert_eq!(sums.file_size, whole.len() as u64);
            assert_eq!(sums.file_crc32c, crc32c_append(0, &whole));
            let header = fastckpt_core::header::parse_file(&whole, "f").unwrap();
            for (t, (name, crc)) in header.tensors.iter().zip(&sums.tensors) {
                assert_eq!(&t.name, name);
                let at =
                    (header.data_start + t.begin) as usize..(header.data_start + t.end) as usize;
                assert_eq!(
                    *crc,
                    crc32c_append(0, &whole[at]),
                    "tensor {name}, part size {part}"
                );
            }
        }
    }
}
