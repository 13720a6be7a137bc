//! What must hold for *any* input bytes, shared by the fuzz targets (`rust/core/fuzz`), the replay of
//! `tests/fuzz_regressions/` and the in-tree mutation loops: the header parser and the reader either refuse the
//! input with a header-kind error naming the file, or accept it with a header that is internally consistent,
//! round-trips through the encoder, and whose every tensor reads back the same bytes through the mapping,
//! `read_into` and `checksum_files`. Any violation panics (which the fuzzer records as a crash).

#![allow(dead_code)]

use std::fs;
use std::path::Path;

use fastckpt_core::dtype::{numel, ByteSize};
use fastckpt_core::{header, parse_file, Header, SafetensorsFile};

/// The label given to the parser; every error message must contain it.
pub const LABEL: &str = "fuzz.safetensors";

/// The error kinds a malformed input may produce.
const INPUT_ERRORS: [&str; 3] = ["Header", "Truncated", "Dtype"];

/// Check the header parser on `data` (an in-memory file). Returns the header when it was accepted.
pub fn check_header(data: &[u8]) -> Option<Header> {
    match parse_file(data, LABEL) {
        Ok(h) => {
            check_consistent(&h, data);
            Some(h)
        }
        Err(e) => {
            assert!(
                INPUT_ERRORS.contains(&e.kind()),
                "unexpected error kind {}: {e}",
                e.kind()
            );
            assert!(
                e.to_string().contains(LABEL),
                "the message names the file: {e}"
            );
            None
        }
    }
}

fn check_consistent(h: &Header, data: &[u8]) {
    let n = u64::from_le_bytes(data[..8].try_into().unwrap());
    assert_eq!(h.data_start, 8 + n);
    let mut at = 0u64;
    let mut names = std::collections::HashSet::new();
    for t in &h.tensors {
        assert!(names.insert(t.name.as_str()), "duplicate name {:?}", t.name);
        assert_eq!(t.begin, at, "packed without holes or overlaps");
        let count = numel(&t.shape).expect("a shape that was accepted does not overflow");
        let ByteSize::Exact(bytes) = t.dtype.bytes_for(count) else {
            panic!(
                "{:?}: accepted a shape that is not a whole number of bytes",
                t.name
            )
        };
        assert_eq!(t.end - t.begin, bytes, "{:?}", t.name);
        at = t.end;
    }
    assert_eq!(
        h.data_start + at,
        data.len() as u64,
        "the data section is exactly the tensors"
    );
    // The encoder writes a header the parser reads back as the same header.
    let encoded =
        header::encode(h.metadata.as_deref(), &h.tensors).expect("an accepted header re-encodes");
    let mut again = encoded.clone();
    again.extend_from_slice(&data[h.data_start as usize..]);
    let back = parse_file(&again, LABEL).expect("a re-encoded header parses");
    assert_eq!(back.metadata, h.metadata);
    assert_eq!(back.tensors, h.tensors);
    assert_eq!(back.data_start, encoded.len() as u64);
}

/// Check the reader on `data` written to `dir/fuzz.safetensors`: it agrees with the parser, and every tensor
/// reads back identically through the mapping, `read_into` and `checksum_files` (with `threads` workers; the
/// fuzz target uses 1: LeakSanitizer flags the TLS destructor list of a scoped worker thread that has returned
/// but not yet exited, see docs/FUZZING.md).
pub fn check_reader(dir: &Path, data: &[u8], threads: usize) {
    let path = dir.join(LABEL);
    fs::write(&path, data).unwrap();
    let parsed = parse_file(data, LABEL);
    let opened = SafetensorsFile::open(&path);
    let (h, f) = match (parsed, opened) {
        (Ok(h), Ok(f)) => (h, f),
        (Err(a), Err(b)) => {
            assert_eq!(a.kind(), b.kind(), "parser and reader disagree: {a} / {b}");
            assert!(
                b.to_string().contains(LABEL),
                "the message names the file: {b}"
            );
            return;
        }
        (a, b) => panic!("parser and reader disagree: {:?} / {:?}", a.err(), b.err()),
    };
    assert_eq!(f.header(), &h);
    assert_eq!(f.file_size(), data.len() as u64);
    let (ptr, len) = f.mapping();
    assert_eq!(len, data.len());
    // SAFETY: the mapping is `len` readable bytes and lives as long as `f`; nothing writes to it meanwhile.
    let mapped = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
    assert_eq!(mapped, data);
    let mut bufs: Vec<Vec<u8>> = h
        .tensors
        .iter()
        .map(|t| vec![0xA5; (t.end - t.begin) as usize])
        .collect();
    let targets = h
        .tensors
        .iter()
        .zip(bufs.iter_mut())
        .map(|(t, b)| (t.name.clone(), b.as_mut_slice()))
        .collect();
    f.read_into(targets, threads, 7).unwrap();
    let sums = fastckpt_core::checksum_files(&[path], threads, 5)
        .unwrap()
        .remove(0);
    assert!(sums.header_error.is_none());
    assert_eq!(sums.checksums.file_crc32c, crc32c::crc32c(data));
    for ((t, got), (name, crc)) in h.tensors.iter().zip(&bufs).zip(&sums.checksums.tensors) {
        let want = &data[(h.data_start + t.begin) as usize..(h.data_start + t.end) as usize];
        assert_eq!(got.as_slice(), want, "read_into of {:?}", t.name);
        assert_eq!((name, *crc), (&t.name, crc32c::crc32c(want)));
    }
}
