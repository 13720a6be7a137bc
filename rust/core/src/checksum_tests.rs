//! Checksums: folding pieces equals summing the whole, the writer's sums equal the bytes on disk for any
//! thread count and chunk size, `checksum_files` finds the same values and names what was damaged.

use super::*;
use crate::dtype::Dtype;
use crate::source::TensorSource;
use crate::writer::{write_file, WriteOptions};
use std::fs;

fn src<'a>(
    name: &str,
    dtype: Dtype,
    shape: &[u64],
    data: &'a [u8],
    strides: Option<Vec<u64>>,
) -> TensorSource<'a> {
    TensorSource {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
        byte_offset: 0,
        byte_strides: strides,
        convert_to: None,
    }
}

/// The crc32c of `bytes`, the slow obvious way (one call over everything).
fn whole(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

#[test]
fn known_value_and_fold_equals_whole() {
    assert_eq!(whole(b"Hello world!"), 0x7B98_E751);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    for cuts in [
        vec![0, 10_000],
        vec![0, 1, 2, 9_999, 10_000],
        vec![0, 4096, 4097, 8000, 10_000],
    ] {
        let pieces = cuts.windows(2).map(|w| PieceCrc {
            tensor: Some(usize::from(w[0] >= 4096)),
            crc: whole(&data[w[0]..w[1]]),
            len: (w[1] - w[0]) as u64,
        });
        let sums = fold(pieces, vec!["a".into(), "b".into()]);
        assert_eq!(sums.file_crc32c, whole(&data));
        assert_eq!(sums.file_size, 10_000);
        // Pieces starting before 4096 belong to "a": it ends at the first cut at or past 4096.
        let a_end = cuts.iter().copied().find(|&c| c >= 4096).unwrap();
        assert_eq!(sums.tensors[0], ("a".to_string(), whole(&data[..a_end])));
        assert_eq!(sums.tensors[1], ("b".to_string(), whole(&data[a_end..])));
    }
}

fn tensor_bytes(file: &[u8], name: &str) -> Vec<u8> {
    let h = crate::header::parse_file(file, "t").unwrap();
    let t = h.tensors.iter().find(|t| t.name == name).unwrap();
    file[(h.data_start + t.begin) as usize..(h.data_start + t.end) as usize].to_vec()
}

#[test]
fn writer_sums_equal_the_bytes_on_disk_for_any_threads_and_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..=255).cycle().take(40_000).collect();
    let s = vec![
        src("big", Dtype::F32, &[100, 100], &a, None),
        src("strided", Dtype::F32, &[50, 50], &a, Some(vec![200, 4])),
        src("empty", Dtype::F16, &[0, 3], &[], None),
        src("tiny", Dtype::U8, &[3], &a, None),
    ];
    let path = dir.path().join("c.safetensors");
    let mut seen = None;
    for (threads, chunk) in [(1, 1 << 20), (4, 100), (3, 7), (2, 4096)] {
        let o = WriteOptions {
            durable: false,
            threads,
            chunk_bytes: chunk,
            ..WriteOptions::default()
        };
        let st = write_file(&path, s.clone(), None, &o).unwrap();
        let bytes = fs::read(&path).unwrap();
        let sums = &st.checksums[0];
        assert_eq!(sums.file_size, bytes.len() as u64);
        assert_eq!(sums.file_crc32c, whole(&bytes));
        let names: Vec<&str> = sums.tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["big", "strided", "empty", "tiny"],
            "file (offset) order"
        );
        for (name, crc) in &sums.tensors {
            assert_eq!(*crc, whole(&tensor_bytes(&bytes, name)), "{name}");
        }
        assert_eq!(sums.tensors[2].1, 0, "an empty tensor sums to 0");
        // The same values whatever the split.
        assert_eq!(*seen.get_or_insert(sums.clone()), *sums);
        let check = checksum_files(std::slice::from_ref(&path), threads, chunk).unwrap();
        let hashes = crate::content_hash::hash_files(std::slice::from_ref(&path), threads).unwrap();
        let on_disk: Vec<u128> = hashes[0]
            .as_ref()
            .unwrap()
            .iter()
            .map(|(_, h)| *h)
            .collect();
        assert_eq!(
            on_disk, sums.tensor_hashes,
            "content hashes: written == on disk"
        );
        let mut without_hashes = sums.clone();
        without_hashes.tensor_hashes.clear();
        assert_eq!(check[0].checksums, without_hashes);
        assert!(check[0].header_error.is_none());
    }
}

#[test]
fn damage_changes_only_the_damaged_tensor_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let a = vec![1u8; 4000];
    let b = vec![2u8; 4000];
    let path = dir.path().join("d.safetensors");
    let st = write_file(
        &path,
        vec![
            src("a", Dtype::U8, &[4000], &a, None),
            src("b", Dtype::U8, &[4000], &b, None),
        ],
        None,
        &WriteOptions::default(),
    )
    .unwrap();
    let good = st.checksums[0].clone();
    let mut bytes = fs::read(&path).unwrap();
    let h = crate::header::parse_file(&bytes, "d").unwrap();
    let b_at = (h.data_start + h.tensors[1].begin + 1234) as usize;
    bytes[b_at] ^= 0x10;
    fs::write(&path, &bytes).unwrap();
    let got = &checksum_files(std::slice::from_ref(&path), 2, 512).unwrap()[0].checksums;
    assert_ne!(got.file_crc32c, good.file_crc32c);
    assert_eq!(got.tensors[0], good.tensors[0]);
    assert_ne!(got.tensors[1].1, good.tensors[1].1);

    // A damaged header: the whole-file sum is still computed, the tensors are unknown.
    bytes[8] = b'[';
    fs::write(&path, &bytes).unwrap();
    let check = checksum_files(std::slice::from_ref(&path), 2, 512)
        .unwrap()
        .remove(0);
    assert_eq!(check.checksums.file_crc32c, whole(&bytes));
    assert_eq!(check.checksums.file_size, bytes.len() as u64);
    assert!(check.checksums.tensors.is_empty());
    assert_eq!(check.header_error.unwrap().kind(), "Header");

    // A truncated file: the header error says so, with the numbers.
    fs::write(&path, &bytes[..5]).unwrap();
    let check = checksum_files(std::slice::from_ref(&path), 1, 512)
        .unwrap()
        .remove(0);
    assert_eq!(check.checksums.file_crc32c, whole(&bytes[..5]));
    assert_eq!(check.header_error.unwrap().kind(), "Truncated");
}

#[test]
fn missing_files_folders_and_fifos_are_errors_that_never_hang() {
    let dir = tempfile::tempdir().unwrap();
    let e = checksum_files(&[dir.path().join("nope")], 1, 64).unwrap_err();
    assert!(
        matches!(&e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOENT)),
        "{e:?}"
    );
    let e = checksum_files(&[dir.path().to_path_buf()], 1, 64).unwrap_err();
    assert!(
        matches!(&e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::EISDIR)),
        "{e:?}"
    );
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only reads it.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = checksum_files(std::slice::from_ref(&fifo), 1, 64).unwrap_err();
    assert_eq!(e.kind(), "Header", "{e}");
    assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
    let e = crate::reader::SafetensorsFile::open(&fifo).unwrap_err();
    assert_eq!(e.kind(), "Header", "{e}");
    assert_eq!(checksum_files(&[], 1, 64).unwrap().len(), 0);
    assert_eq!(
        checksum_files(&[], 1, 0).unwrap_err().kind(),
        "InvalidArgument"
    );
}

/// A deterministic byte stream (xorshift), so a failure is reproducible.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

#[test]
fn crc32c_equals_the_crc32c_crate_at_every_length_offset_and_split() {
    let data = noise(7, (1 << 20) + 4099);
    let mut lengths: Vec<usize> = (0..300).collect();
    lengths.extend([
        511,
        512,
        513,
        4095,
        4096,
        4097,
        65_536,
        65_537,
        1 << 20,
        (1 << 20) + 4099,
    ]);
    let mut x = 12_345u64;
    for &len in &lengths {
        // several start offsets (alignments) of the same length
        for start in [0usize, 1, 3, 7, 8, 15, 63, 64, 4095] {
            if start + len > data.len() {
                continue;
            }
            let bytes = &data[start..start + len];
            let want = crc32c::crc32c(bytes);
            assert_eq!(crc32c(bytes), want, "len {len} at {start}");
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let cut = if len == 0 {
                0
            } else {
                (x >> 33) as usize % (len + 1)
            };
            let (a, b) = bytes.split_at(cut);
            assert_eq!(
                crc32c_append(crc32c(a), b),
                want,
                "append at {cut} of {len}"
            );
            assert_eq!(
                crc32c_combine(crc32c(a), crc32c(b), b.len() as u64),
                want,
                "combine at {cut} of {len}"
            );
            assert_eq!(
                crc32c_append(crc32c(a), b),
                crc32c::crc32c_append(crc32c::crc32c(a), b)
            );
        }
    }
}

#[test]
fn combine_equals_the_crc32c_crate_for_any_length() {
    let mut x = 99u64;
    for _ in 0..2_000 {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let (a, b) = ((x >> 32) as u32, x as u32);
        // lengths of every magnitude, up to 2^40 bytes (the crate takes usize)
        let len = (x >> 11) & ((1u64 << ((x >> 3) % 41)) - 1);
        assert_eq!(
            crc32c_combine(a, b, len),
            crc32c::crc32c_combine(a, b, len as usize),
            "len {len}"
        );
    }
    assert_eq!(crc32c_combine(0x1234_5678, 0, 0), 0x1234_5678);
}
