//! Element types the GPU kernels are built for.
use crate::reference::Element;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

mod sealed {
    use crate::identity::ElemType;

    /// Keeps [`Dtype`](super::Dtype) to the element types of the kernels, and names each.
    pub trait Sealed {
        /// The element type in the kernels' identities.
        const ELEM: ElemType;
    }
    impl Sealed for f32 {
        const ELEM: ElemType = ElemType::F32;
    }
    impl Sealed for half::f16 {
        const ELEM: ElemType = ElemType::F16;
    }
    impl Sealed for half::bf16 {
        const ELEM: ElemType = ElemType::Bf16;
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
