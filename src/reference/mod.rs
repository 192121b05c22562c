//! CPU reference implementations of every op, in f64 between the cast points each op's module documents.
//!
//! Public so that users can test their own integration against the same ground truth the
//! library's tests use. Every function is generic over [`Element`]: the tensor dtype `D`
//! (`f32`, `f16`, `bf16`) decides where values are rounded; with `f64` every cast point is the
//! identity, which gives the exact math (used for finite-difference gradient checks).
//!
//! The RMSNorm, fused add + RMSNorm, RoPE and SwiGLU functions mirror their launchers (and GEGLU's take SwiGLU's
//! arguments): the same argument struct first, then the buffers in the launcher's order (host
//! slices, contiguous rows), results returned (RoPE rotates in place, as its launcher does),
//! and RMSNorm's rstd in the type the GPU stores ([`Element::Rstd`]), so a launcher's inputs
//! and outputs go to the reference as they are:
//!
//! ```
//! use liger_rs::{RmsNormArgs, reference};
//! let args = RmsNormArgs::new(2, 4).with_eps(1e-5);
//! let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0];
//! let out = reference::rms_norm_forward(&args, &x, None)?;
//! let rstd: &[f32] = &out.rstd; // what `liger_rs::rms_norm_forward` writes to `rstd`
//! let grads = reference::rms_norm_backward(&args, &[1.0; 8], &x, None, rstd)?;
//! assert_eq!((out.y.len(), grads.dx.len()), (8, 8));
//! # Ok::<(), liger_rs::Error>(())
//! ```
pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod embedding;
pub mod fused_add_rms_norm;
pub mod geglu;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;

pub use attention::{AttentionGrads, AttentionOut, attention_backward, attention_forward};
pub use cross_entropy::{
    CrossEntropyOut, LinearCrossEntropyOut, cross_entropy_backward, cross_entropy_forward,
    fused_linear_cross_entropy,
};
pub use embedding::{embedding_backward, embedding_forward};
pub use fused_add_rms_norm::{fused_add_rms_norm_backward, fused_add_rms_norm_forward};
pub use geglu::{geglu_backward, geglu_forward};
pub use rms_norm::{rms_norm_backward, rms_norm_backward_dx, rms_norm_forward};
pub use rope::{rope_backward, rope_forward};
pub use swiglu::{swiglu_backward, swiglu_forward};

use half::{bf16, f16};
use std::fmt::Debug;

/// A host element type: how values are widened to f64 and rounded back.
///
/// ```
/// use liger_rs::reference::Element;
/// use liger_rs::half::bf16;
/// // 1 + 2⁻⁸ is half-way between two bf16 values: ties go to even.
/// assert_eq!(bf16::cast(1.0 + 2f64.powi(-8)), 1.0);
/// assert_eq!(bf16::cast_f32(1.0 + 2f64.powi(-30)), 1.0); // the f32 cast point
/// assert_eq!(f64::cast_f32(1.0 + 2f64.powi(-30)), 1.0 + 2f64.powi(-30)); // exact in f64
/// ```
pub trait Element: Copy + Debug + Default + PartialEq + Send + Sync + 'static {
    /// Short name: `f64`, `f32`, `f16`, `bf16`.
    const NAME: &'static str;
    /// Bits of precision (significand, including the implicit bit).
    const MANTISSA_DIGITS: u32;
    /// What RMSNorm's rstd is returned as: `f32` for the tensor dtypes (`f32`, `f16`, `bf16`),
    /// as the kernels store it, so the GPU's rstd goes straight into the reference backward;
    /// `f64` for `f64`, whose rstd must stay exact for finite-difference checks. Every value
    /// the reference stores is exact in it (an f32 value, or a value of the dtype).
    type Rstd: Element;
    /// Exact widening.
    fn to_f64(self) -> f64;
    /// Round-to-nearest-even from f64, correctly rounded (no double rounding).
    fn from_f64(v: f64) -> Self;
    /// `D(v)`: `v` rounded to this type, as f64.
    fn cast(v: f64) -> f64 {
        Self::from_f64(v).to_f64()
    }
    /// `f32(v)` for the "computed in f32" cast points; the identity for `f64`.
    fn cast_f32(v: f64) -> f64 {
        v as f32 as f64
    }
}

impl Element for f64 {
    const NAME: &'static str = "f64";
    type Rstd = f64;
    const MANTISSA_DIGITS: u32 = f64::MANTISSA_DIGITS;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn cast_f32(v: f64) -> f64 {
        v
    }
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    type Rstd = f32;
    const MANTISSA_DIGITS: u32 = f32::MANTISSA_DIGITS;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Element for f16 {
    const NAME: &'static str = "f16";
    type Rstd = f32;
    const MANTISSA_DIGITS: u32 = 11;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f32(to_f32_round_to_odd(v))
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bf16";
    type Rstd = f32;
    const MANTISSA_DIGITS: u32 = 8;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_bits(bf16_bits_rne(to_f32_round_to_odd(v)))
    }
}

/// f64 → f32 rounding to odd: exact values stay, inexact ones are truncated toward zero with
/// the last bit set. A second RNE rounding to a format with ≤ 22 significand bits (f16, bf16)
/// then equals one correct rounding of the f64.
fn to_f32_round_to_odd(v: f64) -> f32 {
    let f = v as f32;
    if !v.is_finite() || f.is_infinite() || f as f64 == v {
        return f;
    }
    let truncated = if (f as f64).abs() > v.abs() {
        f32::from_bits(f.to_bits() - 1)
    } else {
        f
    };
    f32::from_bits(truncated.to_bits() | 1)
}

/// f32 → bf16 bits, round to nearest even, NaN kept quiet (the device kernels use the same).
fn bf16_bits_rne(v: f32) -> u16 {
    let u = v.to_bits();
    if v.is_nan() {
        return ((u >> 16) | 0x0040) as u16;
    }
    (u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_correct_from_f64() {
        // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: even → 1. A hair above rounds up,
        // which a rounding that drops the low f64 bits first would get wrong.
        assert_eq!(bf16::cast(1.0 + 2f64.powi(-8)), 1.0);
        assert_eq!(
            bf16::cast(1.0 + 2f64.powi(-8) + 2f64.powi(-40)),
            1.0 + 2f64.powi(-7)
        );
        assert_eq!(
            bf16::cast(1.0 + 3.0 * 2f64.powi(-8)),
            1.0 + 2.0 * 2f64.powi(-7)
        );
        assert_eq!(bf16::cast(-3.0e38 * 2.0), f64::NEG_INFINITY);
        assert!(bf16::cast(f64::NAN).is_nan());
    }

    #[test]
    fn f16_rounding_is_correct_from_f64() {
        assert_eq!(f16::cast(1.0 + 2f64.powi(-11)), 1.0);
        assert_eq!(
            f16::cast(1.0 + 2f64.powi(-11) + 2f64.powi(-45)),
            1.0 + 2f64.powi(-10)
        );
        assert_eq!(f16::cast(65520.0), f64::INFINITY);
        assert_eq!(f16::cast(65519.0), 65504.0);
    }

    #[test]
    fn f64_is_exact_and_f32_rounds() {
        let v = 1.0 + 2f64.powi(-40);
        assert_eq!(f64::cast(v), v);
        assert_eq!(f64::cast_f32(v), v);
        assert_eq!(f32::cast(v), 1.0);
        assert_eq!(bf16::cast_f32(v), 1.0);
    }
}
