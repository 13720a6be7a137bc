//! Progress: a claim waits for live reads, a claimed tensor is written from the caller's copy, aborts stop the
//! write, and a write with progress produces the same bytes as without.

use super::*;
use crate::dtype::Dtype;
use crate::layout::serialize;
use crate::source::TensorSource;
use crate::writer::{write_file, WriteOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

fn src<'a>(name: &str, data: &'a [u8], strides: Option<Vec<u64>>) -> TensorSource<'a> {
    TensorSource {
        name: name.into(),
        dtype: Dtype::U8,
        shape: vec![data.len() as u64 / if strides.is_some() { 2 } else { 1 }],
        data,
        byte_offset: 0,
        byte_strides: strides,
        convert_to: None,
    }
}

fn opts(progress: &Arc<Progress>, chunk_bytes: u64) -> WriteOptions {
    WriteOptions {
        durable: false,
        threads: 2,
        chunk_bytes,
        progress: Some(progress.clone()),
        ..WriteOptions::default()
    }
}

#[test]
fn claim_waits_for_live_reads_and_skips_written_tensors() {
    let p = Progress::new(&[10, 10, 0]);
    assert!(p.is_written(2).unwrap());
    let (guard, from) = p.begin(&[(0, 10)]).unwrap();
    assert!(matches!(from[0], PieceSource::Live));
    let finished = AtomicBool::new(false);
    thread::scope(|s| {
        let claimer = s.spawn(|| {
            let taken = p.claim(&[0, 1, 2]).unwrap();
            assert!(
                finished.load(Ordering::SeqCst),
                "the claim returned while a live read ran"
            );
            taken
        });
        thread::sleep(Duration::from_millis(50));
        finished.store(true, Ordering::SeqCst);
        guard.finish();
        // tensor 0 was written before the claim could take it; 2 is empty
        assert_eq!(claimer.join().unwrap(), vec![1]);
    });
    assert!(p.is_written(0).unwrap());
    assert!(!p.is_written(1).unwrap());
}

#[test]
fn a_failed_chunk_ends_its_reads_without_counting_bytes() {
    let p = Progress::new(&[10]);
    drop(p.begin(&[(0, 4)]).unwrap());
    assert!(!p.is_written(0).unwrap());
    assert_eq!(p.claim(&[0]).unwrap(), vec![0]); // no reader left: returns at once
}

#[test]
fn provide_checks_claim_and_size() {
    let p = Progress::new(&[4]);
    let copy: CopyBytes = Arc::new(vec![1u8; 4]);
    assert!(p.provide(0, copy.clone()).is_err()); // not claimed
    p.claim(&[0]).unwrap();
    assert!(p.provide(0, Arc::new(vec![1u8; 3])).is_err());
    p.provide(0, copy).unwrap();
    assert!(p.claim(&[7]).is_err());
}

#[test]
fn claimed_tensors_are_written_from_the_copy() {
    let dir = tempfile::tempdir().unwrap();
    let live: Vec<u8> = (0..200u8).collect();
    let strided: Vec<u8> = (0..200u8).rev().collect();
    let sources = vec![src("a", &live, None), src("b", &strided, Some(vec![2]))];
    let p = Arc::new(Progress::new(&[200, 100]));
    assert_eq!(p.claim(&[0, 1]).unwrap(), vec![0, 1]);
    let copy_a: Vec<u8> = live.iter().map(|b| b.wrapping_add(1)).collect();
    let copy_b: Vec<u8> = strided.iter().step_by(2).map(|b| b ^ 0xff).collect();
    p.provide(0, Arc::new(copy_a.clone())).unwrap();
    p.provide(1, Arc::new(copy_b.clone())).unwrap();
    let path = dir.path().join("f.safetensors");
    write_file(&path, sources, None, &opts(&p, 16)).unwrap();
    let want = serialize(&[src("a", &copy_a, None), src("b", &copy_b, None)], None, 1).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), want);
    assert!(p.is_written(0).unwrap() && p.is_written(1).unwrap());
}

#[test]
fn unclaimed_write_equals_serialize_and_marks_all_written() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..=255).cycle().take(1000).collect();
    let sources = vec![src("z", &a, None), src("b", &a[..500], None)];
    let p = Arc::new(Progress::new(&[1000, 500]));
    let path = dir.path().join("f.safetensors");
    write_file(&path, sources.clone(), None, &opts(&p, 64)).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        serialize(&sources, None, 1).unwrap()
    );
    p.wait_written(&[0, 1]).unwrap();
}

#[test]
fn wrong_sizes_and_aborts_fail_the_write() {
    let dir = tempfile::tempdir().unwrap();
    let a = vec![3u8; 100];
    let path = dir.path().join("f.safetensors");
    let p = Arc::new(Progress::new(&[99]));
    assert!(write_file(&path, vec![src("a", &a, None)], None, &opts(&p, 10)).is_err());
    let p = Arc::new(Progress::new(&[100]));
    p.claim(&[0]).unwrap();
    p.abort("the copy failed");
    let err = write_file(&path, vec![src("a", &a, None)], None, &opts(&p, 10)).unwrap_err();
    assert!(err.to_string().contains("the copy failed"), "{err}");
    assert!(!path.exists());
}
