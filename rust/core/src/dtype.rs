//! Safetensors dtypes: names, sizes in bits, and the official writer's sort rank.

use std::fmt;

use crate::error::{Error, Result};

/// A safetensors element type. Declared in the official writer's ascending rank: the writer orders tensors by
/// descending rank (widest first), then by name.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// Boolean, one byte each.
    BOOL,
    /// MX FP4 (E2M1), 4 bits.
    F4,
    /// MX FP6 (E2M3), 6 bits.
    F6_E2M3,
    /// MX FP6 (E3M2), 6 bits.
    F6_E3M2,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// FP8 E5M2.
    F8_E5M2,
    /// FP8 E4M3 (fn).
    F8_E4M3,
    /// FP8 E8M0 (MX scale).
    F8_E8M0,
    /// FP8 E4M3 (fnuz).
    F8_E4M3FNUZ,
    /// FP8 E5M2 (fnuz).
    F8_E5M2FNUZ,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two f32.
    C64,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

/// Every dtype, in ascending rank.
pub const ALL_DTYPES: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

impl Dtype {
    /// The name written in headers (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Parse a header dtype name; `None` when unknown.
    pub fn from_name(name: &str) -> Option<Dtype> {
        ALL_DTYPES.iter().copied().find(|d| d.name() == name)
    }

    /// Parse a dtype name for tensor `tensor`, or a [`Error::Dtype`] naming it.
    pub fn parse_for(name: &str, tensor: &str, file: &str) -> Result<Dtype> {
        Dtype::from_name(name).ok_or_else(|| {
            Error::Dtype(format!(
                "{file}: tensor {tensor:?}: unknown dtype {name:?} (known: {})",
                ALL_DTYPES.map(Dtype::name).join(" ")
            ))
        })
    }

    /// Size of one element in bits (4 for F4, 6 for F6_*, 8 for BOOL).
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// Whether an element is smaller than a byte (F4, F6_*): such tensors can only be stored contiguously.
    pub fn is_sub_byte(self) -> bool {
        self.bits() < 8
    }

    /// Size of one element in bytes, `None` for sub-byte dtypes.
    pub fn item_bytes(self) -> Option<u64> {
        (!self.is_sub_byte()).then(|| self.bits() / 8)
    }

    /// The official writer's sort rank: larger ranks come first in a file.
    pub fn rank(self) -> u8 {
        self as u8
    }

    /// Bytes of `numel` elements of this dtype.
    pub fn bytes_for(self, numel: u64) -> ByteSize {
        match numel.checked_mul(self.bits()) {
            None => ByteSize::Overflow,
            Some(bits) if bits % 8 != 0 => ByteSize::NotWhole,
            Some(bits) => ByteSize::Exact(bits / 8),
        }
    }
}

/// The byte size of a number of elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteSize {
    /// A whole number of bytes.
    Exact(u64),
    /// `numel * bits` is not a multiple of 8 (sub-byte dtypes only).
    NotWhole,
    /// `numel * bits` overflows u64.
    Overflow,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Number of elements of `shape`, `None` on overflow.
pub fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in ALL_DTYPES {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            assert_eq!(d.to_string(), d.name());
        }
        assert_eq!(Dtype::from_name("F128"), None);
        assert_eq!(Dtype::from_name("bf16"), None);
    }

    #[test]
    fn ranks_follow_official_order() {
        // Descending rank, as the official writer orders a file.
        let mut sorted = ALL_DTYPES.to_vec();
        sorted.sort_by_key(|d| std::cmp::Reverse(d.rank()));
        let names: Vec<_> = sorted.iter().map(|d| d.name()).collect();
        assert_eq!(
            names.join(" "),
            "U64 I64 F64 C64 F32 U32 I32 BF16 F16 U16 I16 F8_E5M2FNUZ F8_E4M3FNUZ F8_E8M0 F8_E4M3 \
             F8_E5M2 I8 U8 F6_E3M2 F6_E2M3 F4 BOOL"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(Dtype::BF16.bits(), 16);
        assert_eq!(Dtype::C64.item_bytes(), Some(8));
        assert_eq!(Dtype::BOOL.item_bytes(), Some(1));
        assert_eq!(Dtype::F4.item_bytes(), None);
        assert_eq!(Dtype::F4.bytes_for(4), ByteSize::Exact(2));
        assert_eq!(Dtype::F4.bytes_for(3), ByteSize::NotWhole);
        assert_eq!(Dtype::F6_E2M3.bytes_for(4), ByteSize::Exact(3));
        assert_eq!(Dtype::F6_E3M2.bytes_for(2), ByteSize::NotWhole);
        assert_eq!(Dtype::F64.bytes_for(u64::MAX), ByteSize::Overflow);
        assert_eq!(numel(&[2, 3, 4]), Some(24));
        assert_eq!(numel(&[]), Some(1));
        assert_eq!(numel(&[u64::MAX, 2]), None);
    }

    #[test]
    fn parse_for_names_tensor() {
        let e = Dtype::parse_for("F128", "w", "a.safetensors").unwrap_err();
        assert_eq!(e.kind(), "Dtype");
        assert!(e.to_string().contains("\"w\""));
        assert!(e.to_string().contains("F128"));
    }
}
