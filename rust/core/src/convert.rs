//! Floating-point dtype conversion while writing (`save_state(..., dtype=torch.bfloat16)`): element blocks are
//! converted from the source memory straight into the writer's chunk buffer, so no converted copy of a tensor
//! is ever held in memory.
//!
//! Every conversion goes through f32, as torch's `.to()` does (`c10::BFloat16` and `c10::Half` are built from a
//! float; a double is first rounded to float): f16 / bf16 -> f32 and f32 -> f64 are exact; f64 -> f32 is the
//! hardware's round to nearest even; f32 -> bf16 and f32 -> f16 round to nearest even in software, with
//! subnormals, signed zeros, infinities and overflow to infinity handled as IEEE 754 says. Every non-NaN value
//! is therefore bit-identical to torch's result. A NaN stays a quiet NaN with its sign and the top bits of its
//! payload (the hardware rule; torch's own NaN bit patterns differ between its scalar and vectorized loops).

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// Whether `from -> to` is a conversion this module does (both among F16, BF16, F32, F64).
pub fn is_convertible(from: Dtype, to: Dtype) -> bool {
    let float = |d| matches!(d, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64);
    float(from) && float(to)
}

/// Check `from -> to` for tensor `name`, or a [`Error::Dtype`] naming it.
pub fn check(from: Dtype, to: Dtype, name: &str) -> Result<()> {
    if is_convertible(from, to) {
        Ok(())
    } else {
        Err(Error::Dtype(format!(
            "tensor {name:?}: cannot convert {from} to {to} while writing (only F16, BF16, F32 and F64 convert)"
        )))
    }
}

/// f16 bits -> f32 bits, exact.
#[inline]
pub fn f16_to_f32(h: u16) -> u32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    match exp {
        0x1f if man == 0 => sign | 0x7f80_0000,
        0x1f => sign | 0x7fc0_0000 | (man << 13),
        0 => sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    }
}

/// bf16 bits -> f32 bits, exact (a signalling NaN is quieted).
#[inline]
pub fn bf16_to_f32(b: u16) -> u32 {
    let x = (b as u32) << 16;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        x | 0x0040_0000
    } else {
        x
    }
}

/// f32 bits -> bf16 bits, round to nearest even.
#[inline]
pub fn f32_to_bf16(x: u32) -> u16 {
    if x & 0x7fff_ffff > 0x7f80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    let bias = 0x7fff + ((x >> 16) & 1);
    (x.wrapping_add(bias) >> 16) as u16
}

/// f32 bits -> f16 bits, round to nearest even (subnormals, overflow to infinity).
#[inline]
pub fn f32_to_f16(x: u32) -> u16 {
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let man = x & 0x007f_ffff;
    if exp == 0xff {
        return if man == 0 {
            sign | 0x7c00
        } else {
            sign | 0x7e00 | (man >> 13) as u16
        };
    }
    let half_exp = exp - 127 + 15;
    if half_exp >= 0x1f {
        return sign | 0x7c00;
    }
    if half_exp <= 0 {
        let shift = (14 - half_exp) as u32;
        if shift > 24 || exp == 0 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let kept = m >> shift;
        let half = 1u32 << (shift - 1);
        let rest = m & ((half << 1) - 1);
        let round = rest > half || (rest == half && kept & 1 == 1);
        return sign | (kept + round as u32) as u16;
    }
    let kept = ((half_exp as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    let round = rest > 0x1000 || (rest == 0x1000 && kept & 1 == 1);
    sign | (kept + round as u32) as u16
}

#[inline]
fn load(from: Dtype, src: &[u8], i: usize) -> u32 {
    match from {
        Dtype::F16 => f16_to_f32(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])),
        Dtype::BF16 => bf16_to_f32(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])),
        Dtype::F32 => u32::from_le_bytes(src[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        _ => (f64::from_le_bytes(src[8 * i..8 * i + 8].try_into().expect("8 bytes")) as f32)
            .to_bits(),
    }
}

fn convert_via_f32(from: Dtype, to: Dtype, src: &[u8], dst: &mut [u8]) {
    let n = dst.len() / (to.bits() / 8) as usize;
    match to {
        Dtype::BF16 => {
            for (i, d) in dst.chunks_exact_mut(2).enumerate() {
                d.copy_from_slice(&f32_to_bf16(load(from, src, i)).to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (i, d) in dst.chunks_exact_mut(2).enumerate() {
                d.copy_from_slice(&f32_to_f16(load(from, src, i)).to_le_bytes());
            }
        }
        Dtype::F32 => {
            for (i, d) in dst.chunks_exact_mut(4).enumerate() {
                d.copy_from_slice(&load(from, src, i).to_le_bytes());
            }
        }
        _ => {
            for (i, d) in dst.chunks_exact_mut(8).enumerate().take(n) {
                let v = f32::from_bits(load(from, src, i)) as f64;
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Convert whole elements: `src` holds `k` elements of `from`, `dst` receives `k` elements of `to`.
/// Panics when the lengths disagree (callers size both from the element count).
pub fn convert(from: Dtype, to: Dtype, src: &[u8], dst: &mut [u8]) {
    let (s, d) = ((from.bits() / 8) as usize, (to.bits() / 8) as usize);
    assert_eq!(
        src.len() / s,
        dst.len() / d,
        "convert: element counts differ"
    );
    assert!(
        src.len().is_multiple_of(s) && dst.len().is_multiple_of(d),
        "convert: partial elements"
    );
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    if from == Dtype::F32 && to == Dtype::BF16 {
        // The hot path (an f32 model exported in bf16): a plain loop the compiler vectorizes.
        for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
            let x = u32::from_le_bytes(s.try_into().expect("4 bytes"));
            d.copy_from_slice(&f32_to_bf16(x).to_le_bytes());
        }
        return;
    }
    if from == Dtype::F64 && to == Dtype::F64 {
        dst.copy_from_slice(src);
        return;
    }
    convert_via_f32(from, to, src, dst);
}

#[cfg(test)]
#[path = "convert_tests.rs"]
mod tests;
