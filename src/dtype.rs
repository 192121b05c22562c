//! Element types: [`Element`], every host type the CPU reference computes in, and [`Dtype`],
//! the ones the GPU kernels are built for.
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use std::fmt::Debug;

mod sealed {
    use crate::identity::ElemType;
    use crate::validate::{Access, Buf};
    use cudarc::driver::DevicePtr;

    /// Keeps [`Dtype`](super::Dtype) to the element types of the kernels, and names each.
    pub trait Sealed: Sized {
        /// The element type in the kernels' identities.
        const ELEM: ElemType;
        /// A buffer of this type read by a call whose own element type is `U`.
        fn read<U>(buf: &dyn DevicePtr<Self>) -> Option<Buf<'_, U>>;
    }
    impl Sealed for f32 {
        const ELEM: ElemType = ElemType::F32;
        fn read<U>(buf: &dyn DevicePtr<Self>) -> Option<Buf<'_, U>> {
            Some(Buf::F32(Access::Read(buf)))
        }
    }
    impl Sealed for half::f16 {
        const ELEM: ElemType = ElemType::F16;
        fn read<U>(buf: &dyn DevicePtr<Self>) -> Option<Buf<'_, U>> {
            Some(Buf::F16(Access::Read(buf)))
        }
    }
    impl Sealed for half::bf16 {
        const ELEM: ElemType = ElemType::Bf16;
        fn read<U>(buf: &dyn DevicePtr<Self>) -> Option<Buf<'_, U>> {
            Some(Buf::Bf16(Access::Read(buf)))
        }
    }
}

/// A tensor element type with device kernels: `f32`, [`half::f16`] or [`half::bf16`].
///
/// Sealed: the kernels exist for exactly these three. [`Element::NAME`] is the suffix of the
/// kernel names (`rms_norm_fwd_bf16_llama`, …), and [`Element::Rstd`] is `f32`, the type of
/// the launchers' `rstd`, so the GPU's rstd goes to [`crate::reference::rms_norm_backward`]
/// as it is. Write code generic over the dtype with it:
///
/// ```no_run
/// use liger_rs::{Dtype, RmsNormArgs, rms_norm_forward};
/// use liger_rs::cudarc::driver::{CudaSlice, CudaStream};
/// use std::sync::Arc;
///
/// fn normalise<T: Dtype>(stream: &Arc<CudaStream>, x: &CudaSlice<T>, rows: usize) -> liger_rs::Result<CudaSlice<T>> {
///     let cols = x.len() / rows;
///     let mut y = stream.alloc_zeros::<T>(x.len())?;
///     let mut rstd = stream.alloc_zeros::<f32>(rows)?;
///     rms_norm_forward(stream, &RmsNormArgs::new(rows, cols), x, None, &mut y, &mut rstd)?;
///     Ok(y)
/// }
/// ```
pub trait Dtype: Element<Rstd = f32> + DeviceRepr + ValidAsZeroBits + sealed::Sealed {}

impl Dtype for f32 {}
impl Dtype for half::f16 {}
impl Dtype for half::bf16 {}

/// The element type of RoPE's cos/sin tables with q and k of `T`: `T` itself, or `f32` with
/// `f16` or `bf16` q and k (as HF's Llama 4 and Liger-Kernel keep their tables). The math is
/// the same (f32, one rounding to `T` per output), so f32 tables give the products of the
/// unrounded angles.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward};
/// use liger_rs::half::bf16;
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (s, d) = (16, 128);
/// let mut q = stream.clone_htod(&vec![bf16::ONE; s * 8 * d])?;
/// let mut k = stream.clone_htod(&vec![bf16::ONE; s * 2 * d])?;
/// // f32 tables with bf16 q and k.
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let args = RopeArgs::new(d).with_seq_len(s).with_heads(8, 2);
/// rope_forward(&stream, &args, &mut q, &mut k, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait CosSinDtype<T: Dtype>: Dtype {}

impl<T: Dtype> CosSinDtype<T> for T {}
impl CosSinDtype<f16> for f32 {}
impl CosSinDtype<bf16> for f32 {}

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
