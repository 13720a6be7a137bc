//! verify: the recorded crc32c values against the bytes read, per tensor and for the whole file.

use std::path::{Path, PathBuf};

use super::*;
use crate::dtype::Dtype;
use crate::source::TensorSource;
use crate::writer::{write_file, WriteOptions};

/// A file of two tensors; returns its path and (file crc, crc of "a", crc of "b").
fn written(dir: &Path) -> (PathBuf, (u32, u32, u32)) {
    let a: Vec<u8> = (0..40_000u32).map(|i| (i % 241) as u8).collect();
    let b: Vec<u8> = (0..6u8).collect();
    let path = dir.join("v.safetensors");
    let src = |name: &str, dtype, shape: Vec<u64>, data| TensorSource {
        name: name.into(),
        dtype,
        shape,
        data,
        byte_offset: 0,
        byte_strides: None,
        convert_to: None,
    };
    let sources = vec![
        src("a", Dtype::F32, vec![100, 100], &a[..]),
        src("b", Dtype::U16, vec![3], &b[..]),
    ];
    write_file(&path, sources, None, &WriteOptions::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (
        path,
        (
            crc32c::crc32c(&bytes),
            crc32c::crc32c(&a),
            crc32c::crc32c(&b),
        ),
    )
}

fn expected(file: Option<u32>, tensors: &[(&str, u32)]) -> Expected {
    Expected {
        file_crc32c: file,
        tensors: tensors.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
        recorded_in: "fastckpt.json".into(),
        summed: Vec::new(),
    }
}

fn flip(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn matching_checksums_pass_in_any_chunking() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (file, a, b)) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    for chunk in [1, 777, 8 << 20] {
        let all = f
            .verify(&expected(Some(file), &[("a", a), ("b", b)]), 3, chunk)
            .unwrap();
        assert_eq!(
            all,
            Verified {
                bytes: f.file_size(),
                tensors: 2
            }
        );
        let one = f.verify(&expected(None, &[("b", b)]), 2, chunk).unwrap();
        assert_eq!(
            one,
            Verified {
                bytes: 6,
                tensors: 1
            }
        );
    }
}

#[test]
fn a_flipped_tensor_byte_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (file, a, b)) = written(dir.path());
    let start = SafetensorsFile::open(&path).unwrap().data_start();
    flip(&path, start + 12_345);
    let f = SafetensorsFile::open(&path).unwrap();
    let e = f
        .verify(&expected(Some(file), &[("a", a), ("b", b)]), 2, 4096)
        .unwrap_err();
    assert_eq!(e.kind(), "Integrity");
    let msg = e.to_string();
    assert!(msg.contains("v.safetensors: tensor \"a\": crc32c"), "{msg}");
    assert!(
        msg.contains(&format!("{a:08x} recorded in fastckpt.json")),
        "{msg}"
    );
    assert!(!msg.contains("\"b\""), "{msg}");
    // a check of "b" alone reads only "b", which is intact
    f.verify(&expected(None, &[("b", b)]), 2, 4096).unwrap();
}

#[test]
fn a_whole_file_difference_outside_the_tensors_names_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (file, a, b)) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let e = f
        .verify(&expected(Some(file ^ 1), &[("a", a), ("b", b)]), 1, 1 << 20)
        .unwrap_err();
    assert_eq!(e.kind(), "Integrity");
    assert!(e.to_string().contains("the header or its padding"), "{e}");
}

#[test]
fn a_recorded_tensor_the_file_lacks_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (_, a, _)) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let e = f
        .verify(&expected(None, &[("a", a), ("gone", 7)]), 1, 1 << 20)
        .unwrap_err();
    assert_eq!(e.kind(), "Integrity");
    assert!(
        e.to_string()
            .contains("tensor \"gone\" is recorded in fastckpt.json but absent"),
        "{e}"
    );
}

#[test]
fn a_closed_file_is_an_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (_, a, _)) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    f.close();
    let e = f
        .verify(&expected(None, &[("a", a)]), 1, 1 << 20)
        .unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
}

#[test]
fn reads_sum_each_target_as_it_lands_in_any_chunking() {
    let dir = tempfile::tempdir().unwrap();
    // over 2 x PIECE, not a multiple of it: the sums run over several pieces per job and a short last one
    let big: Vec<u8> = (0..(2 * PIECE + 4_100) as u32)
        .map(|i| (i % 251) as u8)
        .collect();
    let path = dir.path().join("big.safetensors");
    let sources = vec![TensorSource {
        name: "big".into(),
        dtype: Dtype::U8,
        shape: vec![big.len() as u64],
        data: &big[..],
        byte_offset: 0,
        byte_strides: None,
        convert_to: None,
    }];
    write_file(&path, sources, None, &WriteOptions::default()).unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    for chunk in [777, PIECE as u64 + 1, 8 << 20] {
        let mut out = vec![0u8; big.len()];
        let got = f
            .read_into_summed(vec![("big".into(), &mut out[..])], 2, chunk)
            .unwrap();
        assert_eq!(got, vec![crc32c::crc32c(&big)]);
        assert_eq!(out, big);
    }
    let (path, (_, a, b)) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let (mut ba, mut bb) = (vec![0u8; 40_000], vec![0u8; 6]);
    let got = f
        .read_into_summed(
            vec![("b".into(), &mut bb[..]), ("a".into(), &mut ba[..])],
            3,
            1000,
        )
        .unwrap();
    assert_eq!(got, vec![b, a]);
}

#[test]
fn a_checked_read_names_the_damaged_tensor_and_skips_none() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (_, a, b)) = written(dir.path());
    let data_start = SafetensorsFile::open(&path).unwrap().data_start();
    flip(&path, data_start + 1234); // inside "a"
    let f = SafetensorsFile::open(&path).unwrap();
    let (mut ba, mut bb) = (vec![0u8; 40_000], vec![0u8; 6]);
    let err = f
        .read_into_checked(
            vec![("a".into(), &mut ba[..]), ("b".into(), &mut bb[..])],
            &[Some(a), Some(b)],
            "fastckpt.json",
            2,
            4096,
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Integrity(_)), "{msg}");
    assert!(msg.contains("tensor \"a\": crc32c "), "{msg}");
    assert!(
        msg.contains(&format!("{a:08x} recorded in fastckpt.json")),
        "{msg}"
    );
    assert!(!msg.contains("tensor \"b\""), "{msg}");
    // not compared: reads as it is
    f.read_into_checked(vec![("a".into(), &mut ba[..])], &[None], "x", 2, 4096)
        .unwrap();
    let err = f
        .read_into_checked(vec![("b".into(), &mut bb[..])], &[], "x", 2, 4096)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)));
}

#[test]
fn tensors_summed_as_read_are_not_read_again_and_still_enter_the_file_crc() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (file, a, b)) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let mut e = expected(Some(file), &[("b", b)]);
    e.summed = vec![("a".into(), a)];
    let done = f.verify(&e, 2, 4096).unwrap();
    assert_eq!(
        done,
        Verified {
            bytes: f.file_size() - 40_000,
            tensors: 1
        }
    );
    e.summed = vec![("a".into(), a ^ 1)]; // a wrong value handed in: the whole-file crc32c no longer adds up
    let err = f.verify(&e, 2, 4096).unwrap_err();
    assert!(err.to_string().contains("outside every tensor"), "{err}");
}

/// A file of one `u8` tensor "big" of `len` bytes (a pattern); returns its path and (file crc, tensor crc).
fn written_big(dir: &Path, len: usize) -> (PathBuf, (u32, u32)) {
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let path = dir.join("big.safetensors");
    let sources = vec![TensorSource {
        name: "big".into(),
        dtype: Dtype::U8,
        shape: vec![len as u64],
        data: &data[..],
        byte_offset: 0,
        byte_strides: None,
        convert_to: None,
    }];
    write_file(&path, sources, None, &WriteOptions::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, (crc32c::crc32c(&bytes), crc32c::crc32c(&data)))
}

#[test]
fn a_damaged_byte_past_the_first_piece_or_at_the_end_of_the_file_is_named() {
    // 3 PIECEs + 5 bytes: a job of several pieces, the last one short, the tensor ending the file
    let len = 3 * PIECE + 5;
    for at in [2 * PIECE as u64 + 1, len as u64 - 1] {
        let dir = tempfile::tempdir().unwrap();
        let (path, (file, crc)) = written_big(dir.path(), len);
        let f = SafetensorsFile::open(&path).unwrap();
        let got = f
            .verify(&expected(Some(file), &[("big", crc)]), 2, 8 << 20)
            .unwrap();
        assert_eq!(got.bytes, f.file_size());
        assert_eq!(f.data_start() + len as u64, f.file_size());
        flip(&path, f.data_start() + at);
        let f = SafetensorsFile::open(&path).unwrap();
        for chunk in [4096, PIECE as u64 + 3, 8 << 20] {
            let e = f
                .verify(&expected(Some(file), &[("big", crc)]), 2, chunk)
                .unwrap_err();
            assert_eq!(e.kind(), "Integrity");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!(
                    "big.safetensors: tensor \"big\": crc32c {:08x} read, {crc:08x} recorded in fastckpt.json \
                     (the file is damaged)",
                    {
                        let mut data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
                        data[at as usize] ^= 1;
                        crc32c::crc32c(&data)
                    }
                )),
                "{msg}"
            );
        }
    }
}

#[test]
fn a_file_that_shrank_after_open_is_truncated_naming_the_tensor_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let (path, (file, crc)) = written_big(dir.path(), 2 * PIECE + 7);
    let f = SafetensorsFile::open(&path).unwrap();
    // truncated in place under the open (and mapped) file: the sum reads by pread, so this is an error, not a
    // SIGBUS
    let cut = f.data_start() + PIECE as u64 + 100;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    for chunk in [4096, 8 << 20] {
        let e = f
            .verify(&expected(Some(file), &[("big", crc)]), 2, chunk)
            .unwrap_err();
        assert_eq!(e.kind(), "Truncated");
        let msg = e.to_string();
        assert!(
            msg.contains("big.safetensors: truncated safetensors file: tensor \"big\" needs"),
            "{msg}"
        );
        assert!(msg.ends_with(&format!("found {cut}")), "{msg}");
    }
}

#[test]
fn a_file_of_no_tensors_and_a_one_byte_tensor_are_summed_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.safetensors");
    write_file(&path, Vec::new(), None, &WriteOptions::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    let got = f
        .verify(&expected(Some(crc32c::crc32c(&bytes)), &[]), 2, 1)
        .unwrap();
    assert_eq!(
        got,
        Verified {
            bytes: bytes.len() as u64,
            tensors: 0
        }
    );
    let e = f
        .verify(&expected(Some(crc32c::crc32c(&bytes) ^ 1), &[]), 2, 1)
        .unwrap_err();
    assert!(e.to_string().contains("the header or its padding"), "{e}");

    let (path, (file, crc)) = written_big(dir.path(), 1);
    let f = SafetensorsFile::open(&path).unwrap();
    let got = f
        .verify(&expected(Some(file), &[("big", crc)]), 2, 1)
        .unwrap();
    assert_eq!((got.bytes, got.tensors), (f.file_size(), 1));
    flip(&path, f.file_size() - 1);
    let f = SafetensorsFile::open(&path).unwrap();
    let e = f
        .verify(&expected(Some(file), &[("big", crc)]), 2, 1)
        .unwrap_err();
    assert!(e.to_string().contains("tensor \"big\": crc32c"), "{e}");
}

/// A file of `n` small tensors back to back ("t0", "t1", ...); returns its path and each tensor's crc32c.
fn written_many(dir: &Path, n: usize) -> (PathBuf, Vec<u32>) {
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            (0..(4 * (i + 1) * 97))
                .map(|j| ((i * 31 + j) % 251) as u8)
                .collect()
        })
        .collect();
    let path = dir.join("many.safetensors");
    let sources = data
        .iter()
        .enumerate()
        .map(|(i, d)| TensorSource {
            name: format!("t{i}"),
            dtype: Dtype::F32,
            shape: vec![(d.len() / 4) as u64],
            data: &d[..],
            byte_offset: 0,
            byte_strides: None,
            convert_to: None,
        })
        .collect();
    write_file(&path, sources, None, &WriteOptions::default()).unwrap();
    (path, data.iter().map(|d| crc32c::crc32c(d)).collect())
}

#[test]
fn coalesced_reads_of_many_small_tensors_name_the_damaged_and_the_truncated_one() {
    let dir = tempfile::tempdir().unwrap();
    let (path, crcs) = written_many(dir.path(), 40);
    let want: Vec<(String, u32)> = crcs
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("t{i}"), *c))
        .collect();
    let refs: Vec<(&str, u32)> = want.iter().map(|(n, c)| (n.as_str(), *c)).collect();
    let whole = crc32c::crc32c(&std::fs::read(&path).unwrap());
    let f = SafetensorsFile::open(&path).unwrap();
    for chunk in [1, 4096, 8 << 20] {
        f.verify(&expected(Some(whole), &refs), 2, chunk).unwrap();
    }
    let t17 = f.tensor("t17").unwrap().clone();
    let (start, end) = (f.data_start() + t17.begin, f.data_start() + t17.end);
    drop(f);
    flip(&path, start + 5);
    let f = SafetensorsFile::open(&path).unwrap();
    for chunk in [1, 4096, 8 << 20] {
        let msg = f
            .verify(&expected(None, &refs), 2, chunk)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("tensor \"t17\""), "{msg}");
        assert_eq!(
            msg.matches("tensor \"t").count(),
            1,
            "only t17 is damaged: {msg}"
        );
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(end - 3)
        .unwrap();
    for chunk in [4096, 8 << 20] {
        let e = f.verify(&expected(None, &refs), 2, chunk).unwrap_err();
        assert_eq!(e.kind(), "Truncated");
        assert!(e.to_string().contains("tensor \"t17\" needs"), "{e}");
    }
}
