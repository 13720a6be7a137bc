use super::*;

#[test]
fn runs_join_touching_ranges_up_to_the_limit() {
    let r = [(0, 4), (4, 8), (8, 20), (30, 31), (31, 32), (32, 100)];
    assert_eq!(runs(&r, 10), vec![0..2, 2..3, 3..5, 5..6]);
    assert_eq!(runs(&r, 1000), vec![0..3, 3..6]);
    assert_eq!(runs(&[], 10), Vec::<Range<usize>>::new());
}

#[test]
fn runs_stop_at_iov_max() {
    let r: Vec<(u64, u64)> = (0..(MAX_IOV as u64 + 5)).map(|i| (i, i + 1)).collect();
    assert_eq!(runs(&r, u64::MAX), vec![0..MAX_IOV, MAX_IOV..MAX_IOV + 5]);
}

#[test]
fn preadv_fills_pieces_and_names_the_one_past_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let data: Vec<u8> = (0..100u8).collect();
    std::fs::write(&path, &data).unwrap();
    let f = File::open(&path).unwrap();
    let (mut a, mut z, mut b, mut c) = (vec![0u8; 10], vec![0u8; 0], vec![0u8; 30], vec![0u8; 5]);
    {
        let mut bufs: Vec<&mut [u8]> = vec![&mut a, &mut z, &mut b, &mut c];
        preadv_exact(&f, &mut bufs, 3).unwrap();
    }
    assert_eq!(a, &data[3..13]);
    assert_eq!(b, &data[13..43]);
    assert_eq!(c, &data[43..48]);
    let (mut a, mut b) = (vec![0u8; 50], vec![0u8; 50]);
    let mut bufs: Vec<&mut [u8]> = vec![&mut a, &mut b];
    let (k, e) = preadv_exact(&f, &mut bufs, 20).unwrap_err();
    assert_eq!((k, e.kind()), (1, io::ErrorKind::UnexpectedEof));
}
