//! Assembling: a tensor split over two files comes back byte-identical to writing it whole; bad covers refused.

use super::*;
use crate::layout::serialize;
use crate::source::TensorSource;

fn whole(
    name: &str,
    dtype: Dtype,
    shape: &[u64],
    data: &[u8],
    meta: Option<&[(String, String)]>,
) -> Vec<u8> {
    let s = TensorSource {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
        byte_offset: 0,
        byte_strides: None,
        convert_to: None,
    };
    serialize(&[s], meta, 1).unwrap()
}

fn range(src: usize, src_offset: u64, dst_offset: u64, len: u64) -> CopyRange {
    CopyRange {
        src,
        src_offset,
        dst_offset,
        len,
    }
}

#[test]
fn rows_from_two_files_equal_the_whole_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..=255u8).cycle().take(4 * 6 * 4).collect();
    // a [4, 6] F32 matrix column-split into two [4, 3] chunks, each stored contiguously after a 16-byte prefix
    let (mut left, mut right) = (vec![7u8; 16], vec![9u8; 16]);
    for row in 0..4 {
        left.extend_from_slice(&data[row * 24..row * 24 + 12]);
        right.extend_from_slice(&data[row * 24 + 12..row * 24 + 24]);
    }
    let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
    fs::write(&a, &left).unwrap();
    fs::write(&b, &right).unwrap();
    let mut ranges = Vec::new();
    for row in 0..4u64 {
        ranges.push(range(0, 16 + row * 12, row * 24, 12));
        ranges.push(range(1, 16 + row * 12, row * 24 + 12, 12));
    }
    let small = AssembledTensor {
        name: "b".into(),
        dtype: Dtype::U8,
        shape: vec![0],
        ranges: vec![],
    };
    let t = AssembledTensor {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: vec![4, 6],
        ranges,
    };
    let meta = vec![("format".to_string(), "pt".to_string())];
    let out = dir.path().join("model.safetensors");
    let size = write_assembled(&out, &[a, b], &[small, t], Some(&meta), true, 3, 5).unwrap();
    let got = fs::read(&out).unwrap();
    assert_eq!(size as usize, got.len());
    let parsed = header::parse_file(&got, "model.safetensors").unwrap();
    assert_eq!(
        parsed
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["w", "b"]
    );
    let want = whole("w", Dtype::F32, &[4, 6], &data, Some(&meta));
    let start = parsed.data_start as usize;
    assert_eq!(&got[start..start + 96], &want[want.len() - 96..]);
    assert_eq!(got.len() % 8, want.len() % 8);
}

#[test]
fn ranges_must_cover_the_tensor_once() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("s.bin");
    fs::write(&src, [0u8; 64]).unwrap();
    let out = dir.path().join("o.safetensors");
    let cases = [
        (vec![range(0, 0, 0, 8)], "cover 8 bytes"),
        (vec![range(0, 0, 0, 8), range(0, 0, 4, 12)], "covered twice"),
        (vec![range(0, 0, 0, 8), range(0, 0, 10, 6)], "not covered"),
        (vec![range(3, 0, 0, 16)], "names source 3"),
    ];
    for (ranges, msg) in cases {
        let t = AssembledTensor {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![4],
            ranges,
        };
        let err =
            write_assembled(&out, std::slice::from_ref(&src), &[t], None, false, 1, 8).unwrap_err();
        assert!(err.to_string().contains(msg), "{err}");
    }
    assert!(!out.exists());
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_short_source_is_truncated_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("s.bin");
    fs::write(&src, [0u8; 10]).unwrap();
    let out = dir.path().join("o.safetensors");
    let t = AssembledTensor {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: vec![4],
        ranges: vec![range(0, 0, 0, 16)],
    };
    let err = write_assembled(&out, &[src], &[t], None, false, 1, 8).unwrap_err();
    assert_eq!(err.kind(), "Truncated");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}
