//! O_DIRECT writes: the same bytes and checksums as the buffered path, for headers longer than a chunk, files
//! ending mid-block, strided sources, and chunk sizes that are not block multiples.

use crate::dtype::Dtype;
use crate::layout::serialize;
use crate::source::TensorSource;
use crate::writer::{write_files, FileJob, WriteOptions};

fn src<'a>(
    name: &str,
    data: &'a [u8],
    shape: &[u64],
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
fn direct_and_buffered_writes_give_the_same_bytes_and_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..=255u8).cycle().take(3 * 4096 + 77).collect();
    let long_meta = vec![("k".to_string(), "v".repeat(9000))]; // a header longer than two blocks
    let sources = vec![
        src("a", &a, &[a.len() as u64], None),
        src("t", &a[..4000], &[40, 50], Some(vec![1, 80])), // strided: a transposed view
        src("z", &a[..3], &[3], None),
    ];
    for (chunk, meta) in [
        (7u64, None),
        (4096, Some(long_meta.clone())),
        (10_000, Some(long_meta)),
    ] {
        let want = serialize(&sources, meta.as_deref(), 1).unwrap();
        let mut sums = Vec::new();
        for direct_io in [true, false] {
            let path = dir
                .path()
                .join(format!("f-{chunk}-{direct_io}.safetensors"));
            let job = FileJob {
                path: path.clone(),
                tensors: sources.clone(),
                metadata: meta.clone(),
            };
            let opts = WriteOptions {
                durable: true,
                threads: 3,
                chunk_bytes: chunk,
                direct_io,
                ..WriteOptions::default()
            };
            let stats = write_files(std::slice::from_ref(&job), &opts).unwrap();
            assert_eq!(
                std::fs::read(&path).unwrap(),
                want,
                "chunk {chunk} direct {direct_io}"
            );
            assert_eq!(stats.file_sizes, vec![want.len() as u64]);
            sums.push(stats.checksums);
        }
        assert_eq!(sums[0], sums[1], "chunk {chunk}");
    }
}

#[test]
fn chunks_cover_the_file_in_block_aligned_pieces() {
    let a = vec![1u8; 10_000];
    let sources = vec![src("a", &a, &[10_000], None)];
    let layout = crate::layout::FileLayout::plan(&sources, None, "f").unwrap();
    let chunk = super::chunk_size(5000);
    assert_eq!(chunk, 8192);
    let n = super::chunk_count(&layout, chunk);
    let mut next = 0;
    for k in 0..n {
        let (file, header, data) = super::chunk_parts(&layout, k, chunk);
        assert_eq!(file.start, next);
        assert_eq!(file.start % super::BLOCK, 0);
        assert_eq!(
            (header.len() as u64) + (data.end - data.start),
            file.end - file.start
        );
        next = file.end;
    }
    assert_eq!(next, layout.file_size());
}
