//! # liger-rs
//!
//! Fused LLM training kernels — RMSNorm ([`rms_norm_forward`]), the fused residual add and
//! RMSNorm ([`fused_add_rms_norm_forward`]), RoPE ([`rope_forward`]), SwiGLU
//! ([`swiglu_forward`]), GEGLU ([`geglu_forward`], tanh or exact erf GELU), fused attention
//! ([`attention_forward`], flash-attention 2 semantics), cross-entropy
//! ([`cross_entropy_forward`], PyTorch's with Liger's options) and fused linear
//! cross-entropy ([`fused_linear_cross_entropy`], on cuBLAS), forward and backward, and the
//! fused multi-tensor optimizer steps ([`adamw_step`], [`sgd_step`], with [`clip_grad_norm`];
//! PyTorch's fused AdamW/SGD arithmetic) — written in Rust, compiled to PTX, and launched on
//! your own [`cudarc`] device buffers.
//!
//! * **Device code** lives in the `kernels-gpu` crate (`#![no_std]`, shipped inside this
//!   package), compiled for `nvptx64-nvidia-cuda` by the nightly its `rust-toolchain.toml`
//!   pins, with `-Zbuild-std=core --emit=asm`. `build.rs` runs that build for sm_80 and for
//!   sm_90a and embeds both ([`PTX`], [`PTX_SM90`]); it needs rustup, and installs the nightly
//!   and `rust-src` when they are missing (set `LIGER_RS_NO_TOOLCHAIN_INSTALL` to get an error
//!   naming the `rustup` command instead).
//!   The host crate itself builds on stable Rust (its `rust-version` or newer).
//! * **Host code** uses cudarc 0.19 with the driver loaded at run time: the crate builds and
//!   its CPU tests run on machines without a CUDA toolkit or GPU. Each kernel is loaded into a
//!   CUDA context at its first use there, as a PTX module of its own (so the driver JIT-compiles
//!   only the kernels a process launches), and cached. Calls are stream-ordered: no hidden
//!   synchronisation.
//! * **Semantics** follow HuggingFace's modules with Liger-Kernel's cast points
//!   ([`CastingMode`]); [`mod@reference`] holds the CPU ground truth (f64 between cast points).
//! * **Errors**: every bad shape, length, stride, mode or aliasing is an [`Error`] naming the
//!   argument and the expected value; a missing driver or GPU is an `Err`, never a panic.
//!
//! ```no_run
//! use liger_rs::{RmsNormArgs, half::bf16, rms_norm_backward_inplace, rms_norm_forward};
//!
//! let ctx = liger_rs::cuda_context(0)?;
//! let stream = ctx.default_stream();
//! let (rows, cols) = (4, 4096);
//! let x = stream.clone_htod(&vec![bf16::from_f32(0.5); rows * cols])?;
//! let w = stream.clone_htod(&vec![bf16::ONE; cols])?;
//! let (mut y, mut rstd) = (stream.alloc_zeros::<bf16>(rows * cols)?, stream.alloc_zeros::<f32>(rows)?);
//! let args = RmsNormArgs::new(rows, cols).with_eps(1e-5);
//! rms_norm_forward(&stream, &args, &x, Some(&w), &mut y, &mut rstd)?;
//! let mut dy = stream.clone_htod(&vec![bf16::ONE; rows * cols])?; // becomes dx
//! let mut dw = stream.alloc_zeros::<bf16>(cols)?;
//! rms_norm_backward_inplace(&stream, &args, &mut dy, &x, Some(&w), &rstd, Some(&mut dw))?;
//! let dx: Vec<bf16> = stream.clone_dtoh(&dy)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Conventions
//!
//! * **Buffers** are anything cudarc can give a device pointer for (`CudaSlice`, `CudaView`,
//!   `CudaViewMut`) and must belong to the stream's context: `&impl DevicePtr<T>` for a buffer
//!   read, `&mut impl DevicePtrMut<T>` for one written, and for an optional one (RMSNorm's
//!   `weight` and `dw`) `Option<&dyn DevicePtr<T>>` / `Option<&mut dyn DevicePtrMut<T>>`, so
//!   that `Some(&w)` takes any of them and `None` needs no type (a weight without `dw` is
//!   frozen: its backward computes dX alone). Lengths are checked against
//!   the shape before anything is launched; rows may be strided (`with_strides` on the
//!   argument types) so a row-slice of a larger buffer works.
//! * **Arguments**: each op's shape and parameters are one struct ([`RmsNormArgs`],
//!   [`RopeArgs`], [`SwigluArgs`]) built with `new` and named `with_*` setters; its fields
//!   are public to read. The structs and the public enums are `#[non_exhaustive]`, so that a
//!   field or variant can be added without breaking callers.
//! * **Errors** come in one order for every launcher: the argument struct (and which optional
//!   buffers are given), then every buffer's context, then every buffer's length (each in
//!   signature order), then, unless the call has no rows or tokens, overlaps: every buffer
//!   written must share no byte with any other ([`Error::Aliasing`] names the written one;
//!   two buffers of token rows with the same stride, such as RoPE's strided q and k, are
//!   compared row by row, so disjoint columns of the same rows pass).
//!   A call without rows or tokens returns after the lengths, touching no buffer, except the
//!   RMSNorm backward with `dw`, which zeroes it (checked for overlaps first). RoPE's
//!   host position ids are range-checked last.
//! * **In place**: RoPE rotates q and k in place (forward) and dq, dk in place (backward), as
//!   Liger does ([`rope_forward_into`] and [`rope_backward_into`] write to their own buffers
//!   instead; [`rope_forward_fused`] and [`rope_backward_fused`] rotate q and k in place
//!   inside one fused QKV buffer). RMSNorm and SwiGLU backward come in two forms: `*_backward` writes gradients
//!   to their own buffers (which must not overlap any input), `*_backward_inplace` writes them
//!   over `dy` (RMSNorm) or over `a` and `b` (SwiGLU), the memory-saving default of Liger.
//! * **Scratch**: the RMSNorm backward with `dw` needs device scratch (one f32
//!   partial row per resident block), so that dW is reduced on the GPU deterministically. It
//!   is kept for the next call on the same stream (up to eight buffers per context;
//!   [`release_scratch`] frees them); during a graph capture each call allocates its own, which
//!   the graph owns. The attention backward allocates one f32 per query row and head for the
//!   call on its stream (stream-ordered, freed behind its launches), as do a reduced
//!   cross-entropy (its per-row losses) and the fused linear cross-entropy (a chunk of logits
//!   and a cuBLAS workspace; its cuBLAS handle is kept per host thread and context).
//!   Everything else launches on buffers you own.
//! * **Threads and streams**: every function may be called from any number of host threads
//!   at once, on any streams: created ones, the legacy default stream, per-thread streams
//!   (`CudaContext::per_thread_stream`, one handle that names a different stream in each
//!   thread; candle's choice), streams wrapped from other libraries, and streams being
//!   captured into a graph. What the library keeps between calls (loaded kernels, the dW
//!   scratch) is never used by two launches that can run at once, and never freed while
//!   queued work may still use it: a scratch buffer is reused only on the stream that the
//!   driver's stream id says used it last, taken by one call at a time, and freed only after
//!   an event recorded behind its last use. Ordering *your* buffers across streams is yours
//!   to do (or cudarc's event tracking, which follows the `CudaContext` handle a buffer was
//!   allocated through: a buffer from a second handle on the same device is accepted, since
//!   it is the same CUDA context, but is ordered only if that handle tracks events). While
//!   cudarc manages several streams (tracking on and a stream created on that handle), every
//!   buffer use waits on its last use's event, and CUDA refuses a capture that waits on work
//!   recorded before it (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, returned as an [`Error`]):
//!   capture on a handle with tracking off, or on one that created no stream (candle's case).
//! * **Precision**: arithmetic is f32; values are rounded to the tensor dtype exactly where
//!   HuggingFace's modules round them ([`CastingMode`] for RMSNorm). The CPU functions in
//!   [`mod@reference`] implement the same cast points in f64, and the test suite holds the
//!   kernels to within a few units in the last place of the dtype against them.
//! * **Launch shape**: [`calculate_settings`] is Liger's row-block rule; the launchers use
//!   16-byte vector kernels when pointers, strides and widths allow and fall back to scalar
//!   kernels otherwise, so any shape and alignment works.
#![warn(missing_docs)]

mod adamw;
mod attention;
#[cfg(test)]
mod bad_input;
mod blas;
#[cfg(feature = "candle")]
pub mod candle;
mod cross_entropy;
mod dtype;
mod embedding;
mod error;
mod glu;
// The device crate's file, as the package ships it (`packaging/kernels-gpu/` links to
// `kernels-gpu/` in a checkout): the kernels' identities and shared constants, defined once.
#[path = "../packaging/kernels-gpu/src/identity.rs"]
mod identity;
mod launch;
mod mode;
mod module;
mod ptx;
pub mod reference;
mod rms_norm;
mod rope;
mod scratch;
mod settings;
#[cfg(test)]
#[path = "../tests/common/skip.rs"]
#[allow(dead_code)] // the unit tests skip for want of a GPU or an H200, never for their shapes
mod test_skip;
mod validate;
// The shared bad-input tables name the crate as a user does.
#[cfg(test)]
extern crate self as liger_rs;

pub use adamw::{
    AdamWArgs, AdamWTensor, NormType, SgdArgs, SgdTensor, StepScalars, adamw_step,
    adamw_step_with_copies, clip_grad_norm, sgd_step, sgd_step_with_copies,
};
pub use attention::{
    AttentionArgs, Strides, attention_backward, attention_backward_varlen, attention_forward,
    attention_forward_varlen,
};
#[cfg(feature = "candle")]
pub use candle_core;
pub use cross_entropy::linear::{
    LinearCrossEntropyArgs, LinearCrossEntropyGrads, fused_linear_cross_entropy,
};
pub use cross_entropy::{
    CrossEntropyArgs, Reduction, cross_entropy_backward, cross_entropy_backward_inplace,
    cross_entropy_forward, cross_entropy_forward_backward, cross_entropy_forward_backward_inplace,
};
pub use cudarc;
pub use dtype::{CosSinDtype, Dtype};
pub use embedding::{EmbeddingArgs, TokenId, embedding_backward, embedding_forward};
pub use error::{Error, Result};
pub use glu::{
    Gelu, geglu_backward, geglu_backward_fused, geglu_backward_fused_inplace,
    geglu_backward_inplace, geglu_forward, geglu_forward_fused,
};
pub use glu::{
    SwigluArgs, swiglu_backward, swiglu_backward_fused, swiglu_backward_fused_inplace,
    swiglu_backward_inplace, swiglu_forward, swiglu_forward_fused,
};
pub use half;
pub use mode::CastingMode;
pub use module::{BASELINE_PTX_ENV, PTX, PTX_SM90, cuda_context, release_scratch};
pub use rms_norm::{RmsNormArgs, rms_norm_backward, rms_norm_backward_inplace, rms_norm_forward};
pub use rms_norm::{
    fused_add_rms_norm_backward, fused_add_rms_norm_backward_inplace, fused_add_rms_norm_forward,
    fused_add_rms_norm_forward_inplace,
};
pub use rope::{
    CosSinLayout, PositionIds, RopeArgs, rope_backward, rope_backward_fused, rope_backward_into,
    rope_forward, rope_forward_fused, rope_forward_into,
};
pub use settings::{LaunchSettings, MAX_FUSED_SIZE, calculate_settings};

/// The README's Rust snippets, compiled as doc tests with the `candle` feature that its candle
/// snippets need (`cargo test --features candle`, which CI runs).
#[cfg(all(doctest, feature = "candle"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
