//! Header bytes for known inputs, and every validation rule rejected with the right variant.

use super::*;
use crate::dtype::ByteSize;

fn info(name: &str, dtype: Dtype, shape: &[u64], begin: u64) -> TensorInfo {
    let ByteSize::Exact(bytes) = dtype.bytes_for(numel(shape).unwrap()) else {
        panic!("whole bytes")
    };
    TensorInfo {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        begin,
        end: begin + bytes,
    }
}

fn json_of(encoded: &[u8]) -> &str {
    let n = u64::from_le_bytes(encoded[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0, "padded to 8");
    assert_eq!(encoded.len(), 8 + n);
    std::str::from_utf8(&encoded[8..]).unwrap()
}

#[test]
fn encodes_known_header_bytes() {
    let t = [info("a", Dtype::F32, &[2], 0)];
    let e = encode(None, &t).unwrap();
    assert_eq!(
        json_of(&e),
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#.to_string() + "  "
    );
    let e = encode(Some(&[]), &t).unwrap();
    assert_eq!(
        json_of(&e).trim_end(),
        r#"{"__metadata__":{},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#
    );
    let e = encode(None, &[]).unwrap();
    assert_eq!(&e[..], b"\x08\0\0\0\0\0\0\0{}      ");
}

#[test]
fn metadata_first_in_given_order_with_serde_json_escapes() {
    let meta = vec![
        ("z".to_string(), "tab\there".to_string()),
        ("a\"q".to_string(), "ctl\u{1}é\\".to_string()),
    ];
    let t = [info("w", Dtype::BF16, &[], 0)];
    let e = encode(Some(&meta), &t).unwrap();
    assert_eq!(
        json_of(&e).trim_end(),
        r#"{"__metadata__":{"z":"tab\there","a\"q":"ctl\u0001é\\"},"w":{"dtype":"BF16","shape":[],"data_offsets":[0,2]}}"#
    );
}

#[test]
fn duplicate_metadata_key_is_invalid_argument() {
    let meta = vec![("k".into(), "1".into()), ("k".into(), "2".into())];
    assert_eq!(
        encode(Some(&meta), &[]).unwrap_err().kind(),
        "InvalidArgument"
    );
}

#[test]
fn writer_order_is_rank_then_name() {
    let mut v = vec![
        ("b", Dtype::F16),
        ("a", Dtype::BOOL),
        ("c", Dtype::F64),
        ("a", Dtype::F16),
    ];
    v.sort_by(|x, y| writer_order(*x, *y));
    assert_eq!(
        v,
        vec![
            ("c", Dtype::F64),
            ("a", Dtype::F16),
            ("b", Dtype::F16),
            ("a", Dtype::BOOL)
        ]
    );
}

#[test]
fn parse_round_trips_and_sorts_by_offset() {
    let t = vec![
        info("b", Dtype::I64, &[2], 0),
        info("a", Dtype::U8, &[3], 16),
    ];
    let meta = vec![("x".to_string(), "y".to_string())];
    let mut file = encode(Some(&meta), &t).unwrap();
    file.extend_from_slice(&[0u8; 19]);
    let h = parse_file(&file, "f").unwrap();
    assert_eq!(h.metadata, Some(meta));
    assert_eq!(h.tensors, t);
    assert_eq!(h.data_start, file.len() as u64 - 19);
    assert_eq!(h.data_len(), 19);
}

/// A whole file: 8-byte length, `json` unpadded, `data_len` zero bytes.
fn file(json: &str, data_len: usize) -> Vec<u8> {
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json.as_bytes());
    v.resize(v.len() + data_len, 0);
    v
}

fn kind_of(data: &[u8]) -> (&'static str, String) {
    let e = parse_file(data, "t.safetensors").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("t.safetensors"),
        "message names the file: {msg}"
    );
    (e.kind(), msg)
}

const W: &str = r#""w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;

#[test]
fn every_rule_rejected_with_its_variant() {
    let mut big = 100_000_001u64.to_le_bytes().to_vec();
    big.extend_from_slice(b"{}");
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        ("short", vec![1, 2, 3], "Truncated", "found 3"),
        ("too large", big, "Header", "over the limit"),
        (
            "past end",
            {
                let mut v = 64u64.to_le_bytes().to_vec();
                v.extend_from_slice(b"{}");
                v
            },
            "Truncated",
            "the header needs 72 bytes, found 10",
        ),
        (
            "utf8",
            {
                let mut v = 4u64.to_le_bytes().to_vec();
                v.extend_from_slice(b"{\xff}\n");
                v
            },
            "Header",
            "UTF-8",
        ),
        ("not json", file(r#"{"w":"#, 0), "Header", "not a valid"),
        ("array", file("[]", 0), "Header", "start with"),
        ("space first", file(" {}", 0), "Header", "start with"),
        (
            "metadata int",
            file(r#"{"__metadata__":{"a":1}}"#, 0),
            "Header",
            "__metadata__ key \"a\"",
        ),
        (
            "metadata null",
            file(r#"{"__metadata__":null}"#, 0),
            "Header",
            "__metadata__",
        ),
        (
            "metadata dup",
            file(r#"{"__metadata__":{"a":"1","a":"2"}}"#, 0),
            "Header",
            "duplicate key \"a\"",
        ),
        (
            "entry not object",
            file(r#"{"w":[1]}"#, 0),
            "Header",
            "tensor \"w\"",
        ),
        (
            "extra field",
            file(
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}}"#,
                8,
            ),
            "Header",
            "unknown field",
        ),
        (
            "missing field",
            file(r#"{"w":{"dtype":"F32","shape":[2]}}"#, 8),
            "Header",
            "missing field",
        ),
        (
            "dup field",
            file(
                r#"{"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
            "Header",
            "duplicate field",
        ),
        (
            "negative shape",
            file(
                r#"{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#,
                8,
            ),
            "Header",
            "tensor \"w\"",
        ),
        (
            "offsets 3",
            file(
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}}"#,
                8,
            ),
            "Header",
            "tensor \"w\"",
        ),
        (
            "offsets 1",
            file(r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}}"#, 8),
            "Header",
            "tensor \"w\"",
        ),
        (
            "dtype int",
            file(r#"{"w":{"dtype":3,"shape":[2],"data_offsets":[0,8]}}"#, 8),
            "Header",
            "tensor \"w\"",
        ),
        (
            "duplicate name",
            file(&format!("{{{W},{W}}}"), 8),
            "Header",
            "duplicate key \"w\"",
        ),
        (
            "unknown dtype",
            file(
                r#"{"w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
            "Dtype",
            "F128",
        ),
        (
            "overflow",
            file(
                r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#,
                8,
            ),
            "Header",
            "overflows",
        ),
        (
            "bits overflow",
            file(
                r#"{"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}}"#,
                8,
            ),
            "Header",
            "overflows",
        ),
        (
            "f6 partial",
            file(
                r#"{"w":{"dtype":"F6_E3M2","shape":[3],"data_offsets":[0,2]}}"#,
                2,
            ),
            "Header",
            "whole number of bytes",
        ),
        (
            "size mismatch",
            file(
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,12]}}"#,
                12,
            ),
            "Header",
            "span 12 bytes",
        ),
        (
            "begin > end",
            file(
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
                8,
            ),
            "Header",
            "begin after end",
        ),
        (
            "hole",
            file(
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
            ),
            "Header",
            "hole",
        ),
        (
            "overlap",
            file(
                &format!(r#"{{{W},"v":{{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}}}"#),
                12,
            ),
            "Header",
            "overlap",
        ),
        (
            "data short",
            file(&format!("{{{W}}}"), 7),
            "Truncated",
            "data section needs",
        ),
        (
            "data long",
            file(&format!("{{{W}}}"), 9),
            "Header",
            "1 extra bytes",
        ),
    ];
    for (what, data, kind, needle) in cases {
        let (k, msg) = kind_of(&data);
        assert_eq!(k, kind, "{what}: {msg}");
        assert!(msg.contains(needle), "{what}: {msg:?} lacks {needle:?}");
    }
}

#[test]
fn json_order_is_free_and_empty_tensors_pack() {
    let json = r#"{"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    let h = parse_file(&file(json, 4), "f").unwrap();
    let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "e", "b"]);
    assert_eq!(h.metadata, None);
}

#[test]
fn header_len_checks() {
    assert_eq!(header_len(&16u64.to_le_bytes(), 24, "f").unwrap(), 16);
    assert_eq!(
        header_len(&17u64.to_le_bytes(), 24, "f")
            .unwrap_err()
            .kind(),
        "Truncated"
    );
}

#[test]
fn encode_refuses_a_header_the_reader_would_refuse() {
    // One metadata value of the limit's size: the JSON around it takes the header over the limit.
    let big = vec![("k".to_string(), "x".repeat(MAX_HEADER_BYTES as usize))];
    let err = encode(Some(&big), &[]).unwrap_err();
    assert_eq!(err.kind(), "InvalidArgument");
    let msg = err.to_string();
    assert!(msg.contains(&MAX_HEADER_BYTES.to_string()), "{msg}");
    assert!(msg.contains("nothing was written"), "{msg}");
    // Just under the limit it encodes, and the reader takes its length.
    let fits = vec![("k".to_string(), "x".repeat(MAX_HEADER_BYTES as usize - 64))];
    let out = encode(Some(&fits), &[]).unwrap();
    let n = header_len(&out, out.len() as u64, "f").unwrap();
    assert!(n <= MAX_HEADER_BYTES);
    parse(&out[8..], out.len() as u64, "f").unwrap();
}
