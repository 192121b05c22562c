//! Element types the GPU kernels are built for.
use crate::reference::Element;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A tensor element type with device kernels: `f32`, [`half::f16`] or [`half::bf16`].
///
/// Sealed: the kernels exist for exactly these three. [`Element::NAME`] is the suffix of the
/// kernel names (`rms_norm_fwd_bf16_llama`, …).
pub trait Dtype: Element + DeviceRepr + ValidAsZeroBits + sealed::Sealed {}

impl Dtype for f32 {}
impl Dtype for half::f16 {}
impl Dtype for half::bf16 {}
