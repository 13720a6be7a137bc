//! Writing: bytes equal to `serialize`, several threads really write, bounded buffer memory, atomicity, modes.

use super::*;
use crate::dtype::Dtype;
use crate::layout::serialize;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Barrier};

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

fn opts(threads: usize, chunk_bytes: u64) -> WriteOptions {
    WriteOptions {
        durable: false,
        threads,
        chunk_bytes,
        ..WriteOptions::default()
    }
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn file_bytes_equal_serialize() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..=255).cycle().take(10_000).collect();
    let s = vec![
        src("a", Dtype::F32, &[50, 50], &a, None),
        src("t", Dtype::F32, &[50, 50], &a, Some(vec![200, 4])),
        src("x", Dtype::U8, &[7], &a, None),
    ];
    let want = serialize(&s, Some(&[]), 1).unwrap();
    for (threads, chunk, durable) in [(1, 1 << 20, true), (4, 100, false), (3, 7, true)] {
        let path = dir.path().join("f.safetensors");
        let o = WriteOptions {
            durable,
            ..opts(threads, chunk)
        };
        let st = write_file(&path, s.clone(), Some(vec![]), &o).unwrap();
        assert_eq!(fs::read(&path).unwrap(), want);
        assert_eq!(st.file_sizes, [want.len() as u64]);
    }
    assert_eq!(listing(dir.path()), ["f.safetensors"]);
}

#[test]
fn several_threads_write_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let data = vec![5u8; 1 << 20];
    let mut o = opts(4, 16 << 10);
    o.start_barrier = Some(Arc::new(Barrier::new(4)));
    let st = write_file(
        &dir.path().join("p"),
        vec![src("d", Dtype::U8, &[1 << 20], &data, None)],
        None,
        &o,
    )
    .unwrap();
    assert_eq!(st.chunks, 64);
    assert_eq!(
        st.threads_used, 4,
        "every worker took a chunk before any finished"
    );
}

#[test]
fn gather_buffers_are_bounded_by_threads_times_chunk() {
    let dir = tempfile::tempdir().unwrap();
    // A 4 MiB F32 matrix written transposed: every byte goes through a gather buffer.
    let n = 1024u64;
    let data: Vec<u8> = (0..n * n * 4).map(|i| (i % 253) as u8).collect();
    let chunk = 64 << 10;
    for threads in [1usize, 3] {
        let s = vec![src("t", Dtype::F32, &[n, n], &data, Some(vec![4, n * 4]))];
        let st = write_file(&dir.path().join("t"), s, None, &opts(threads, chunk)).unwrap();
        assert_eq!(st.chunks, 64);
        assert!(
            st.chunk_buffers >= 1 && st.chunk_buffers <= threads,
            "{st:?}"
        );
        assert!(st.chunk_buffer_bytes <= threads as u64 * chunk, "{st:?}");
    }
    // Contiguous sources are written straight from their buffers: no gather buffer at all.
    let s = vec![src("c", Dtype::F32, &[n, n], &data, None)];
    let st = write_file(&dir.path().join("c"), s, None, &opts(3, chunk)).unwrap();
    assert_eq!((st.chunk_buffers, st.chunk_buffer_bytes), (0, 0));
}

#[test]
fn failure_leaves_target_and_folder_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    fs::write(&good, "old").unwrap();
    let d = [0u8; 4];
    let jobs = vec![
        FileJob {
            path: good.clone(),
            tensors: vec![src("a", Dtype::U8, &[4], &d, None)],
            metadata: None,
        },
        FileJob {
            path: dir.path().join("missing/bad"),
            tensors: vec![src("a", Dtype::U8, &[4], &d, None)],
            metadata: None,
        },
    ];
    let e = write_files(&jobs, &opts(2, 2)).unwrap_err();
    match &e {
        Error::Io { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::ENOENT)),
        other => panic!("{other:?}"),
    }
    assert_eq!(fs::read_to_string(&good).unwrap(), "old");
    assert_eq!(listing(dir.path()), ["good"]);
    let e = write_file(
        &good,
        vec![src("a", Dtype::U8, &[5], &d, None)],
        None,
        &opts(1, 2),
    )
    .unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
    assert_eq!(listing(dir.path()), ["good"]);
}

#[test]
fn existing_mode_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m");
    fs::write(&p, "old").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
    write_file(&p, vec![], None, &WriteOptions::default()).unwrap();
    assert_eq!(
        fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
        0o640
    );
    assert_eq!(fs::read(&p).unwrap(), b"\x08\0\0\0\0\0\0\0{}      ");
}

#[test]
fn zero_chunk_bytes_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let e = write_file(&dir.path().join("z"), vec![], None, &opts(1, 0)).unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
}

#[test]
fn the_same_target_twice_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let job = FileJob {
        path: dir.path().join("x"),
        tensors: vec![],
        metadata: None,
    };
    let e = write_files(&[job.clone(), job], &opts(1, 8)).unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
    assert_eq!(listing(dir.path()), Vec::<String>::new());
}

#[test]
fn ready_gate_sees_every_contiguous_chunk_and_can_stop_the_write() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..=255).cycle().take(10_000).collect();
    let base = a.as_ptr() as usize;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let gated = WriteOptions {
        ready: Some(ReadyGate(Arc::new(move |spans: &[(usize, usize)]| {
            log.lock().unwrap().extend_from_slice(spans);
            Ok(())
        }))),
        ..opts(3, 1024)
    };
    let s = vec![
        src("a", Dtype::F32, &[50, 50], &a, None),
        src("t", Dtype::F32, &[50, 50], &a, Some(vec![4, 200])),
    ];
    let path = dir.path().join("g.safetensors");
    write_file(&path, s.clone(), None, &gated).unwrap();
    assert_eq!(fs::read(&path).unwrap(), serialize(&s, None, 1).unwrap());
    // Only the contiguous tensor is gated (the strided one is gathered from memory that is ready), every byte
    // of it exactly once, in pieces of at most one chunk.
    let mut spans = seen.lock().unwrap().clone();
    spans.sort();
    assert_eq!(spans.iter().map(|s| s.1).sum::<usize>(), a.len());
    assert!(spans
        .iter()
        .all(|&(at, len)| at >= base && at + len <= base + a.len() && len <= 1024));

    let failing = WriteOptions {
        ready: Some(ReadyGate(Arc::new(|_: &[(usize, usize)]| {
            Err(Error::InvalidArgument("not ready".into()))
        }))),
        ..opts(2, 1024)
    };
    let target = dir.path().join("f.safetensors");
    let e = write_file(&target, s, None, &failing).unwrap_err();
    assert_eq!(e.to_string(), "not ready");
    assert!(!target.exists());
    assert_eq!(listing(dir.path()), ["g.safetensors"]);
}
