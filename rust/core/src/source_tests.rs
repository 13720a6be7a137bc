//! Source checks (every rejection, with the variant) and strided gather against a naive reference.

use super::*;

fn src<'a>(
    dtype: Dtype,
    shape: &[u64],
    data: &'a [u8],
    off: u64,
    strides: Option<&[u64]>,
) -> TensorSource<'a> {
    TensorSource {
        name: "t".into(),
        dtype,
        shape: shape.to_vec(),
        data,
        byte_offset: off,
        byte_strides: strides.map(<[u64]>::to_vec),
        convert_to: None,
    }
}

/// The logical bytes of a strided tensor, one element at a time.
fn naive(base: &[u8], off: u64, shape: &[u64], strides: &[u64], item: usize) -> Vec<u8> {
    let n = numel(shape).unwrap();
    let mut out = Vec::new();
    for flat in 0..n {
        let mut rem = flat;
        let mut at = off;
        for (&size, &stride) in shape.iter().zip(strides).rev() {
            at += (rem % size) * stride;
            rem /= size;
        }
        out.extend_from_slice(&base[at as usize..at as usize + item]);
    }
    out
}

struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
}

fn check_all_ranges(s: &TensorSource<'_>, want: &[u8]) {
    let c = s.check().unwrap();
    assert_eq!(c.nbytes as usize, want.len());
    let mut whole = vec![0u8; want.len()];
    c.gather(0, &mut whole);
    assert_eq!(
        whole, want,
        "whole tensor, shape {:?} strides {:?}",
        s.shape, s.byte_strides
    );
    let n = want.len();
    let step = (n / 23).max(1);
    for start in (0..n).step_by(step) {
        for len in [0, 1, 3, 5, 7, 8, 13, n - start] {
            let len = len.min(n - start);
            let mut out = vec![0u8; len];
            c.gather(start as u64, &mut out);
            assert_eq!(out, &want[start..start + len], "range {start}+{len}");
        }
    }
}

#[test]
fn strided_gather_matches_naive_for_random_layouts() {
    let base: Vec<u8> = (0..4096u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for dtype in [Dtype::U8, Dtype::BF16, Dtype::F32, Dtype::C64] {
        let item = dtype.item_bytes().unwrap();
        for _ in 0..60 {
            let ndim = 1 + rng.next(4) as usize;
            let shape: Vec<u64> = (0..ndim).map(|_| 1 + rng.next(5)).collect();
            let strides: Vec<u64> = (0..ndim).map(|_| rng.next(6) * item).collect();
            let off = rng.next(16) * item;
            let reach: u64 = off
                + item
                + shape
                    .iter()
                    .zip(&strides)
                    .map(|(s, t)| (s - 1) * t)
                    .sum::<u64>();
            assert!(reach <= base.len() as u64);
            let want = naive(&base, off, &shape, &strides, item as usize);
            check_all_ranges(&src(dtype, &shape, &base, off, Some(&strides)), &want);
        }
    }
}

#[test]
fn transposed_channels_last_and_expanded() {
    let base: Vec<u8> = (0..=255u8).collect();
    // A [4, 6] F32 matrix's transpose: shape [6, 4], strides [4, 24] bytes.
    let t = src(Dtype::F32, &[6, 4], &base[..96], 0, Some(&[4, 24]));
    check_all_ranges(&t, &naive(&base, 0, &[6, 4], &[4, 24], 4));
    // NCHW [2, 3, 2, 2] BF16 stored as NHWC: strides (H*W*C, 1, W*C, C) elements.
    let s = [24, 2, 12, 6];
    let cl = src(Dtype::BF16, &[2, 3, 2, 2], &base[..48], 0, Some(&s));
    check_all_ranges(&cl, &naive(&base, 0, &[2, 3, 2, 2], &s, 2));
    // Expanded: a [3] I64 row broadcast to [5, 3] (stride 0).
    let ex = src(Dtype::I64, &[5, 3], &base[..24], 0, Some(&[0, 8]));
    let want = naive(&base, 0, &[5, 3], &[0, 8], 8);
    assert_eq!(&want[..24], &want[24..48]);
    check_all_ranges(&ex, &want);
}

#[test]
fn contiguous_strides_are_written_straight_from_the_buffer() {
    let base = [0u8; 64];
    for (shape, strides) in [
        (vec![2u64, 3], vec![12u64, 4]),
        (vec![2, 1, 3], vec![12, 999, 4]),
        (vec![1, 1], vec![0, 0]),
        (vec![0, 3], vec![4, 4]),
    ] {
        let c = src(Dtype::F32, &shape, &base, 4, Some(&strides))
            .check()
            .unwrap();
        assert!(c.contiguous_bytes().is_some(), "{shape:?} {strides:?}");
    }
    let c = src(Dtype::F32, &[2, 3], &base, 0, Some(&[4, 8]))
        .check()
        .unwrap();
    assert!(c.contiguous_bytes().is_none());
}

#[test]
fn every_rejection_has_its_variant() {
    let base = [0u8; 16];
    let cases: Vec<(TensorSource<'_>, &str, &str)> = vec![
        (
            TensorSource {
                name: "__metadata__".into(),
                ..src(Dtype::U8, &[1], &base, 0, None)
            },
            "InvalidArgument",
            "__metadata__",
        ),
        (
            TensorSource {
                name: "a\u{7}".into(),
                ..src(Dtype::U8, &[1], &base, 0, None)
            },
            "InvalidArgument",
            "U+0007",
        ),
        (
            src(Dtype::F32, &[u64::MAX, 2], &base, 0, None),
            "InvalidArgument",
            "overflows",
        ),
        (
            src(Dtype::F32, &[5], &base, 0, None),
            "InvalidArgument",
            "20 bytes at byte_offset 0 do not fit in its 16-byte buffer",
        ),
        (
            src(Dtype::U8, &[1], &base, 17, None),
            "InvalidArgument",
            "byte_offset 17",
        ),
        (
            src(Dtype::F32, &[3], &base, 0, Some(&[8])),
            "InvalidArgument",
            "reads 20 bytes",
        ),
        (
            src(Dtype::F32, &[2], &base, 0, Some(&[u64::MAX])),
            "InvalidArgument",
            "overflow",
        ),
        (
            src(Dtype::F32, &[2, 2], &base, 0, Some(&[4])),
            "InvalidArgument",
            "dims",
        ),
        (
            src(Dtype::F4, &[4], &base, 0, Some(&[1])),
            "Dtype",
            "sub-byte",
        ),
        (
            src(Dtype::F4, &[3], &base, 0, None),
            "Dtype",
            "whole number of bytes",
        ),
    ];
    for (s, kind, needle) in cases {
        let e = s.check().unwrap_err();
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
    }
}

#[test]
fn sub_byte_contiguous_is_fine() {
    let base = [0xABu8; 3];
    let c = src(Dtype::F6_E2M3, &[4], &base, 0, None).check().unwrap();
    assert_eq!(c.nbytes, 3);
    let mut out = [0u8; 3];
    c.gather(0, &mut out);
    assert_eq!(out, base);
}
