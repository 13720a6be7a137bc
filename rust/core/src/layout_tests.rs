//! Planning: order, offsets, chunk pieces, fill and in-memory serialize.

use super::*;
use crate::dtype::Dtype;

fn src<'a>(name: &str, dtype: Dtype, shape: &[u64], data: &'a [u8]) -> TensorSource<'a> {
    TensorSource {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
        byte_offset: 0,
        byte_strides: None,
        convert_to: None,
    }
}

#[test]
fn plan_orders_like_the_official_writer() {
    let (a, b, c) = ([1u8; 4], [2u8; 8], [3u8; 3]);
    let s = [
        src("z", Dtype::U8, &[3], &c),
        src("b", Dtype::F32, &[1], &a),
        src("a", Dtype::F64, &[1], &b),
        src("e", Dtype::F32, &[0], &[]),
    ];
    let l = FileLayout::plan(&s, None, "f").unwrap();
    let names: Vec<_> = l.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "e", "z"]);
    assert_eq!(l.begins, [0, 8, 12, 12]);
    assert_eq!(l.data_len, 15);
    assert_eq!(l.file_size(), l.header.len() as u64 + 15);
    let h = crate::header::parse_file(&serialize(&s, None, 2).unwrap(), "f").unwrap();
    assert_eq!(h.tensors.len(), 4);
}

#[test]
fn pieces_split_at_chunk_edges_and_skip_empty_tensors() {
    let d = [7u8; 10];
    let s = [
        src("a", Dtype::U8, &[4], &d),
        src("b", Dtype::U8, &[0], &d),
        src("c", Dtype::U8, &[6], &d),
    ];
    let l = FileLayout::plan(&s, None, "f").unwrap();
    assert_eq!(l.chunk_count(3), 4);
    let p: Vec<_> = l.pieces(l.chunk_range(1, 3)).collect();
    assert_eq!(
        p,
        [
            Piece {
                tensor: 0,
                start: 3,
                len: 1
            },
            Piece {
                tensor: 2,
                start: 0,
                len: 2
            }
        ]
    );
    let p: Vec<_> = l.pieces(l.chunk_range(3, 3)).collect();
    assert_eq!(
        p,
        [Piece {
            tensor: 2,
            start: 5,
            len: 1
        }]
    );
}

#[test]
fn serialize_is_header_then_data_for_any_chunking() {
    let a: Vec<u8> = (0..100).collect();
    let b: Vec<u8> = (100..164).collect();
    let s = [
        src("a", Dtype::U8, &[100], &a),
        src("b", Dtype::I16, &[32], &b),
    ];
    let l = FileLayout::plan(&s, Some(&[("k".into(), "v".into())]), "f").unwrap();
    let mut want = l.header.clone();
    want.extend_from_slice(&b);
    want.extend_from_slice(&a);
    for (threads, chunk) in [(1, 1 << 20), (3, 1), (2, 7)] {
        let mut out = vec![0u8; l.file_size() as usize];
        l.serialize_into(&mut out, threads, chunk).unwrap();
        assert_eq!(out, want, "threads {threads}, chunk {chunk}");
    }
}

#[test]
fn duplicate_names_and_bad_sources_name_the_file() {
    let d = [0u8; 4];
    let e = FileLayout::plan(
        &[src("x", Dtype::U8, &[1], &d), src("x", Dtype::U8, &[1], &d)],
        None,
        "f.st",
    )
    .unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
    assert!(e.to_string().starts_with("f.st: "), "{e}");
    let e = FileLayout::plan(&[src("x", Dtype::U8, &[9], &d)], None, "f.st").unwrap_err();
    assert!(e.to_string().starts_with("f.st: tensor \"x\""), "{e}");
}
