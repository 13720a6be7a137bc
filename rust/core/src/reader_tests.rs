//! Reading: header, mapping, read_into and its errors.

use super::*;
use crate::dtype::Dtype;
use crate::source::TensorSource;
use crate::writer::{write_file, WriteOptions};

fn written(dir: &Path) -> (PathBuf, Vec<u8>, Vec<u8>) {
    let a: Vec<u8> = (0..40_000u32).map(|i| (i % 241) as u8).collect();
    let b: Vec<u8> = (0..6u8).collect();
    let path = dir.join("r.safetensors");
    let s = vec![
        TensorSource {
            name: "a".into(),
            dtype: Dtype::F32,
            shape: vec![100, 100],
            data: &a,
            byte_offset: 0,
            byte_strides: None,
            convert_to: None,
        },
        TensorSource {
            name: "b".into(),
            dtype: Dtype::U16,
            shape: vec![3],
            data: &b,
            byte_offset: 0,
            byte_strides: None,
            convert_to: None,
        },
    ];
    write_file(
        &path,
        s,
        Some(vec![("k".into(), "v".into())]),
        &WriteOptions::default(),
    )
    .unwrap();
    (path, a, b)
}

#[test]
fn open_maps_and_reads_into() {
    let dir = tempfile::tempdir().unwrap();
    let (path, a, b) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(f.file_size(), bytes.len() as u64);
    assert_eq!(
        f.metadata(),
        Some(&[("k".to_string(), "v".to_string())][..])
    );
    assert_eq!(
        f.tensors()
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    let (ptr, len) = f.mapping();
    // SAFETY: the mapping is `len` readable bytes while `f` lives.
    let mapped = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
    assert_eq!(mapped, &bytes[..]);
    let (mut oa, mut ob) = (vec![0u8; a.len()], vec![0u8; 6]);
    f.read_into(
        vec![("a".into(), &mut oa[..]), ("b".into(), &mut ob[..])],
        3,
        1000,
    )
    .unwrap();
    assert_eq!((oa, ob), (a, b));
}

#[test]
fn unmapped_open_validates_and_reads_by_position() {
    let dir = tempfile::tempdir().unwrap();
    let (path, a, b) = written(dir.path());
    let f = SafetensorsFile::open_with(&path, &path, false).unwrap();
    assert!(!f.is_mapped());
    assert_eq!(f.mapping().1, 0);
    assert_eq!(f.tensors().len(), 2);
    let (mut oa, mut ob) = (vec![0u8; a.len()], vec![0u8; 6]);
    f.read_into(
        vec![("a".into(), &mut oa[..]), ("b".into(), &mut ob[..])],
        2,
        4096,
    )
    .unwrap();
    assert_eq!((oa, ob), (a, b));
    assert!(SafetensorsFile::open(&path).unwrap().is_mapped());
}

#[test]
fn mapping_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = written(dir.path());
    let before = std::fs::read(&path).unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    let (ptr, len) = f.mapping();
    // SAFETY: the mapping is `len` writable bytes while `f` lives; nothing else touches it here.
    unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0xEE, len) };
    drop(f);
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn read_into_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let mut small = [0u8; 5];
    let e = f
        .read_into(vec![("b".into(), &mut small[..])], 1, 8)
        .unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
    assert!(e.to_string().contains("\"b\" is 6 bytes"), "{e}");
    let e = f
        .read_into(vec![("zz".into(), &mut small[..])], 1, 8)
        .unwrap_err();
    assert_eq!(e.kind(), "KeyMismatch");
    assert!(e.tensor_named("zz"));
    // The file shrinks under an open handle: read_into reports the truncation.
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(f.data_start() + 100).unwrap();
    let mut big = vec![0u8; 40_000];
    let e = f
        .read_into(vec![("a".into(), &mut big[..])], 2, 4096)
        .unwrap_err();
    assert_eq!(e.kind(), "Truncated", "{e}");
    f.close();
    assert!(f.is_closed());
    let e = f.read_into(vec![], 1, 8).unwrap_err();
    assert_eq!(e.kind(), "InvalidArgument");
}

#[test]
fn open_errors() {
    let dir = tempfile::tempdir().unwrap();
    let e = SafetensorsFile::open(&dir.path().join("none")).unwrap_err();
    assert_eq!(e.kind(), "Io");
    let p = dir.path().join("short");
    std::fs::write(&p, [1, 2, 3]).unwrap();
    let e = SafetensorsFile::open(&p).unwrap_err();
    assert_eq!(e.kind(), "Truncated");
    assert!(e.to_string().contains("short"), "{e}");
}

#[test]
fn open_as_reads_one_path_and_names_another() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = written(dir.path());
    let shown = Path::new("/checkpoints/step_7/model.safetensors");
    let f = SafetensorsFile::open_as(&path, shown).unwrap();
    assert_eq!(f.path(), shown);
    assert_eq!(
        f.tensors().len(),
        SafetensorsFile::open(&path).unwrap().tensors().len()
    );
    let short = dir.path().join("short");
    std::fs::write(&short, [1, 2, 3]).unwrap();
    let e = SafetensorsFile::open_as(&short, shown).unwrap_err();
    assert!(
        e.to_string()
            .contains("/checkpoints/step_7/model.safetensors"),
        "{e}"
    );
    let e = SafetensorsFile::open_as(&dir.path().join("none"), shown).unwrap_err();
    assert!(e.to_string().contains("step_7"), "{e}");
}

impl Error {
    fn tensor_named(&self, name: &str) -> bool {
        self.to_string().contains(&format!("{name:?}"))
    }
}

#[test]
fn read_ranges_into_reads_parts_of_a_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (path, a, b) = written(dir.path());
    let f = SafetensorsFile::open(&path).unwrap();
    let (mut head, mut middle, mut tail) = (vec![0u8; 7], vec![0u8; 25_000], vec![0u8; 2]);
    f.read_ranges_into(
        vec![
            ("a".into(), 0, &mut head[..]),
            ("a".into(), 10_000, &mut middle[..]),
            ("b".into(), 4, &mut tail[..]),
        ],
        3,
        4096,
    )
    .unwrap();
    assert_eq!(head, a[..7]);
    assert_eq!(middle, a[10_000..35_000]);
    assert_eq!(tail, b[4..]);
    let mut past = [0u8; 3];
    let e = f
        .read_ranges_into(vec![("b".into(), 4, &mut past[..])], 1, 4096)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)));
    assert!(
        e.to_string().contains("tensor \"b\" is 6 bytes") && e.to_string().contains("[4, 4 + 3)")
    );
}
