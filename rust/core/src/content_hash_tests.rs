//! `hash_pieces` equals `hash_bytes` of the joined bytes for any split (blocks inside a piece, blocks spanning
//! pieces, empty pieces, tensors of no bytes) and any thread count.

use super::*;

#[test]
fn pieces_hash_as_the_joined_bytes_for_any_split() {
    let n = 3 * HASH_BLOCK as usize + 12_345;
    let data: Vec<u8> = (0..n as u32).map(|i| (i * 31 % 253) as u8).collect();
    let whole = hash_bytes(&data);
    let cuts = [
        vec![],
        vec![4000, n - 3000],
        vec![0, 0, 7, HASH_BLOCK as usize, HASH_BLOCK as usize + 1],
        vec![1, n - 1, n],
    ];
    for threads in [1, 3] {
        let mut tensors = Vec::new();
        for cut in &cuts {
            let mut pieces = Vec::new();
            let mut at = 0;
            for &c in cut {
                pieces.push(&data[at..c]);
                at = c;
            }
            pieces.push(&data[at..]);
            tensors.push(pieces);
        }
        tensors.push(vec![]);
        tensors.push(vec![&data[..0], &data[..0]]);
        let got = hash_pieces(&tensors, threads).unwrap();
        for h in &got[..cuts.len()] {
            assert_eq!(*h, whole);
        }
        assert_eq!(got[cuts.len()], hash_bytes(&[]));
        assert_eq!(got[cuts.len() + 1], hash_bytes(&[]));
    }
}
