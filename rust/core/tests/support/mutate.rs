//! A small structure-aware mutator for safetensors files (no external fuzzing engine): valid seed files built
//! by the writer, then 1-4 mutations each, aimed at the header's JSON (numbers, dtypes, keys, brackets), its
//! 8-byte length, and the data section's size. Deterministic for a given seed (xorshift64*).

#![allow(dead_code)]

use fastckpt_core::dtype::ALL_DTYPES;
use fastckpt_core::{serialize, Dtype, TensorSource};

/// xorshift64*: enough randomness for mutations, reproducible from its seed.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// `__metadata__` pairs, or none.
type Metadata = Option<Vec<(String, String)>>;

/// Valid files to mutate: several dtypes (sub-byte ones too), empty tensors, metadata or none, many tensors.
pub fn seeds() -> Vec<Vec<u8>> {
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    let src = |name: &str, dtype: Dtype, shape: &[u64]| TensorSource {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data: &data,
        byte_offset: 0,
        byte_strides: None,
        convert_to: None,
    };
    let meta = |pairs: &[(&str, &str)]| {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    let files: Vec<(Vec<TensorSource<'_>>, Metadata)> = vec![
        (vec![], None),
        (vec![], meta(&[("format", "pt")])),
        (
            vec![src("w", Dtype::F32, &[2, 3]), src("b", Dtype::BF16, &[3])],
            meta(&[("format", "pt")]),
        ),
        (
            vec![
                src("e", Dtype::F16, &[0, 4]),
                src("x", Dtype::U8, &[5]),
                src("s", Dtype::I64, &[]),
            ],
            None,
        ),
        (
            vec![
                src("f4", Dtype::F4, &[2, 8]),
                src("f6", Dtype::F6_E2M3, &[4]),
                src("c", Dtype::C64, &[2]),
            ],
            None,
        ),
        (
            (0..12)
                .map(|i| {
                    src(
                        ["a", "bb", "ccc", "é", "名", "x.y.z"][i % 6],
                        ALL_DTYPES[i + 4],
                        &[i as u64, 2],
                    )
                })
                .take(6)
                .collect(),
            meta(&[("k", "v"), ("json", "{\"a\": [1, 2]}")]),
        ),
        (
            (0..40)
                .map(|i| src(&format!("layer.{i}.weight"), Dtype::F32, &[4, 4]))
                .collect(),
            None,
        ),
    ];
    files
        .into_iter()
        .map(|(t, m)| serialize(&t, m.as_deref(), 1).unwrap())
        .collect()
}

const NUMBERS: [&str; 14] = [
    "0",
    "1",
    "-1",
    "7",
    "8",
    "255",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "1e3",
    "1.5",
    "-0",
];
const TOKENS: [&str; 22] = [
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "null",
    "true",
    "[]",
    "{}",
    "\"\"",
    "\"dtype\"",
    "\"shape\"",
    "\"data_offsets\"",
    "\"__metadata__\"",
    "[0,0]",
    "[1,1]",
    "\\u0000",
    "\\ud800",
    "\u{FFFD}",
    "\u{0}",
];
const DTYPE_NAMES: [&str; 6] = ["F128", "", "f32", "BOOL ", "F8_E4M3FN", "U1"];

/// Split a file into (length prefix, JSON, data); files too short or with a bad length give the whole as data.
fn split(file: &[u8]) -> (u64, Vec<u8>, Vec<u8>) {
    if file.len() >= 8 {
        let n = u64::from_le_bytes(file[..8].try_into().unwrap());
        if n <= (file.len() - 8) as u64 {
            let n = n as usize;
            return (n as u64, file[8..8 + n].to_vec(), file[8 + n..].to_vec());
        }
    }
    (0, Vec::new(), file.to_vec())
}

fn replace_run(rng: &mut Rng, json: &mut Vec<u8>, is_part: fn(u8) -> bool, with: &str) {
    let starts: Vec<usize> = (0..json.len())
        .filter(|&i| is_part(json[i]) && (i == 0 || !is_part(json[i - 1])))
        .collect();
    if starts.is_empty() {
        return;
    }
    let s = *rng.pick(&starts);
    let e = (s..json.len())
        .find(|&i| !is_part(json[i]))
        .unwrap_or(json.len());
    json.splice(s..e, with.bytes());
}

fn mutate_json(rng: &mut Rng, json: &mut Vec<u8>) {
    match rng.below(9) {
        0 => {
            let number = *rng.pick(&NUMBERS);
            replace_run(rng, json, |b| b.is_ascii_digit(), number)
        }
        1 => {
            let names: Vec<&str> = ALL_DTYPES
                .iter()
                .map(|d| d.name())
                .chain(DTYPE_NAMES)
                .collect();
            let name = *rng.pick(&names);
            replace_run(
                rng,
                json,
                |b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_',
                name,
            )
        }
        2 | 3 if !json.is_empty() => {
            let at = rng.below(json.len() + 1);
            let token = *rng.pick(&TOKENS);
            json.splice(at..at, token.bytes());
        }
        4 if !json.is_empty() => {
            let at = rng.below(json.len());
            let len = 1 + rng.below(16.min(json.len() - at));
            json.drain(at..at + len);
        }
        5 if !json.is_empty() => {
            let at = rng.below(json.len());
            json[at] = rng.next() as u8;
        }
        6 if json.len() > 2 => {
            // Copy a slice of the header elsewhere: duplicates keys and entries.
            let (a, b) = (rng.below(json.len()), rng.below(json.len()));
            let (s, e) = (a.min(b), a.max(b).min(a.min(b) + 64));
            let piece = json[s..e].to_vec();
            let at = rng.below(json.len());
            json.splice(at..at, piece);
        }
        7 => {
            let key = *rng.pick(&["dtype", "shape", "data_offsets", "x", "__metadata__"]);
            replace_run(rng, json, |b| b.is_ascii_lowercase() || b == b'_', key)
        }
        _ => {
            let at = rng.below(json.len() + 1);
            let number = *rng.pick(&NUMBERS);
            json.splice(at..at, number.bytes());
        }
    }
}

/// One mutant of `file`.
pub fn mutate(rng: &mut Rng, file: &[u8]) -> Vec<u8> {
    let (mut n, mut json, mut data) = split(file);
    let mut fix_length = rng.below(4) != 0;
    for _ in 0..1 + rng.below(4) {
        match rng.below(10) {
            0..=5 => mutate_json(rng, &mut json),
            6 => data.truncate(rng.below(data.len() + 1)),
            7 => data.extend((0..1 + rng.below(9)).map(|_| rng.next() as u8)),
            8 => {
                fix_length = false;
                n = *rng.pick(&[
                    0,
                    1,
                    7,
                    n.wrapping_sub(1),
                    n.wrapping_add(1),
                    n.wrapping_add(8),
                    100_000_000,
                    100_000_001,
                    u64::MAX,
                    1 << 40,
                ]);
            }
            _ => {
                let cut = rng.below(json.len() + data.len() + 9);
                let mut whole = Vec::new();
                whole.extend_from_slice(&n.to_le_bytes());
                whole.extend_from_slice(&json);
                whole.extend_from_slice(&data);
                whole.truncate(cut);
                return whole;
            }
        }
    }
    if fix_length {
        n = json.len() as u64;
    }
    let mut out = n.to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&data);
    out
}
