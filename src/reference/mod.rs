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

pub use crate::dtype::Element;
