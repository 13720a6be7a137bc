//! Conversions: exact round trips of every f16 / bf16 value, round-to-nearest-even ties, overflow, subnormals;
//! converted writes (chunked, strided, partial elements at chunk edges) equal a conversion of the whole tensor,
//! and the content hash computed while writing equals the one of the bytes on disk and of `hash_sources`.

use super::*;
use crate::content_hash::{hash_bytes, hash_files, hash_sources};
use crate::source::TensorSource;
use crate::writer::{write_file, WriteOptions};

#[test]
fn every_f16_and_bf16_value_round_trips_through_f32() {
    for h in 0..=u16::MAX {
        let nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
        let back = f32_to_f16(f16_to_f32(h));
        if nan {
            assert_eq!(back & 0x7e00, 0x7e00, "{h:#06x} stays a quiet NaN");
            assert_eq!(back & 0x8000, h & 0x8000, "{h:#06x} keeps its sign");
        } else {
            assert_eq!(back, h, "f16 {h:#06x}");
            assert!(!f32::from_bits(f16_to_f32(h)).is_nan());
        }
        let bnan = (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
        let bback = f32_to_bf16(bf16_to_f32(h));
        if bnan {
            assert!(f32::from_bits(bf16_to_f32(h)).is_nan());
            assert_eq!(bback | 0x0040, h | 0x0040);
        } else {
            assert_eq!(bback, h, "bf16 {h:#06x}");
        }
    }
}

#[test]
fn ties_round_to_even_and_overflow_goes_to_infinity() {
    assert_eq!(f32_to_bf16(0x3f80_8000), 0x3f80); // tie, even below
    assert_eq!(f32_to_bf16(0x3f81_8000), 0x3f82); // tie, even above
    assert_eq!(f32_to_bf16(0x3f80_8001), 0x3f81);
    assert_eq!(f32_to_bf16(0x7f7f_ffff), 0x7f80); // rounds up to infinity
    assert_eq!(f32_to_f16(65520f32.to_bits()), 0x7c00); // half-way above f16 max
    assert_eq!(f32_to_f16(65519f32.to_bits()), 0x7bff);
    assert_eq!(f32_to_f16((2f32.powi(-25)).to_bits()), 0x0000); // tie with 0: even
    assert_eq!(f32_to_f16((2f32.powi(-25) * 1.5).to_bits()), 0x0001);
    assert_eq!(f32_to_f16((2f32.powi(-24) * 1.5).to_bits()), 0x0002); // tie 1|2: even
    assert_eq!(f32_to_f16((-0f32).to_bits()), 0x8000);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24).to_bits());
}

fn f32_source<'a>(
    data: &'a [u8],
    shape: &[u64],
    strides: Option<Vec<u64>>,
    to: Dtype,
) -> TensorSource<'a> {
    TensorSource {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        data,
        byte_offset: 0,
        byte_strides: strides,
        convert_to: Some(to),
    }
}

#[test]
fn converted_writes_match_a_whole_conversion_for_any_chunking() {
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<u8> = (0..3001u32)
        .flat_map(|i| (i as f32 * 1.000_123 - 777.7).to_le_bytes())
        .collect();
    for to in [Dtype::BF16, Dtype::F16, Dtype::F64] {
        let item = (to.bits() / 8) as usize;
        let mut want = vec![0u8; 3001 * item];
        convert(Dtype::F32, to, &values, &mut want);
        for chunk in [1u64, 3, 7, 4096, 1 << 20] {
            let path = dir.path().join(format!("c{chunk}.safetensors"));
            let opts = WriteOptions {
                durable: false,
                threads: 3,
                chunk_bytes: chunk,
                ..WriteOptions::default()
            };
            let stats = write_file(
                &path,
                vec![f32_source(&values, &[3001], None, to)],
                None,
                &opts,
            )
            .unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(
                &bytes[bytes.len() - want.len()..],
                &want[..],
                "{to} chunk {chunk}"
            );
            let on_disk = hash_files(std::slice::from_ref(&path), 2).unwrap();
            let on_disk = on_disk[0].as_ref().unwrap()[0].1;
            assert_eq!(stats.checksums[0].tensor_hashes, vec![hash_bytes(&want)]);
            assert_eq!(on_disk, hash_bytes(&want));
            let mem = hash_sources(&[f32_source(&values, &[3001], None, to)], 2).unwrap();
            assert_eq!(mem, vec![hash_bytes(&want)]);
        }
    }
}

#[test]
fn strided_sources_convert_in_logical_order() {
    // a (3, 5) f32 matrix stored transposed: element (i, j) at (j * 3 + i) * 4
    let data: Vec<u8> = (0..15u32)
        .flat_map(|k| (k as f32 + 0.5).to_le_bytes())
        .collect();
    let src = f32_source(&data, &[3, 5], Some(vec![4, 12]), Dtype::BF16);
    let checked = src.check().unwrap();
    let mut out = vec![0u8; 30];
    checked.gather(0, &mut out);
    for i in 0..3u32 {
        for j in 0..5u32 {
            let k = (i * 5 + j) as usize;
            let want = f32_to_bf16((((j * 3 + i) as f32) + 0.5).to_bits());
            assert_eq!(u16::from_le_bytes([out[2 * k], out[2 * k + 1]]), want);
        }
    }
    let mut part = vec![0u8; 7];
    checked.gather(3, &mut part);
    assert_eq!(&part[..], &out[3..10]);
}

#[test]
fn integer_dtypes_are_refused() {
    let data = [0u8; 8];
    let src = TensorSource {
        name: "ids".into(),
        dtype: Dtype::I64,
        shape: vec![1],
        data: &data,
        byte_offset: 0,
        byte_strides: None,
        convert_to: Some(Dtype::BF16),
    };
    assert!(matches!(src.check(), Err(crate::error::Error::Dtype(_))));
}
