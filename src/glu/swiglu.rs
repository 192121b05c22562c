//! SwiGLU (SiLU-mul) forward and backward launchers (kernels: `kernels-gpu/src/glu/`,
//! reference: [`crate::reference::swiglu`]).
//!
//! With `z = f32(a)·gm`: forward `c = T(T(silu(z)) · b)` (silu in f32, rounded to `T`, then the
//! product of two `T` values — Liger ≥ 0.6); backward, from `g = f32(dc)·dm`,
//! `db = T(g·silu(z))`, `da = T(g·silu'(z)·gm·b)` with `silu'(z) = σ(1 + z(1 − σ))`, all in f32.
//! silu never overflows or turns NaN for finite `z`: large negative `z` gives −0, large
//! positive `z` gives `z` (and `silu'` 0 and 1). One launch per call, no allocation, no
//! synchronisation.
//!
//! The down multiplier `dm` applies in the backward only: the forward writes `c`, the
//! backward the gradients of `c·dm` (see [`SwigluArgs::down_multiplier`]).
use super::launch::{
    BACKWARD, BACKWARD_FUSED, BACKWARD_FUSED_INPLACE, BACKWARD_INPLACE, FORWARD, FORWARD_FUSED,
};
use super::{SwigluArgs, run};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::identity::Gate;
use crate::validate::{read, write};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// SwiGLU forward, separate gate and up: `c = T(T(silu(a·gm)) · b)`, element-wise over
/// `rows × cols`; `args.down_multiplier` is not applied (backward only).
///
/// `a`, `b` and `c` hold `rows` rows at `args.a_stride`, `args.b_stride`, `args.c_stride`
/// (see [`SwigluArgs`]). `c` must not overlap `a` or `b`. One launch on `stream`, no
/// allocation, no synchronisation.
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_forward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 14336);
/// let gate = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let up = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let mut c = stream.alloc_zeros::<bf16>(rows * cols)?;
/// swiglu_forward(&stream, &SwigluArgs::new(rows, cols), &gate, &up, &mut c)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `c` is overwritten (the `cols` elements of each row; elements between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize`; or `a`, `b` or `c` is shorter than its rows need. Each
///   error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `a`, `b` or `c` belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `c` overlaps `a` or `b`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    run(
        stream,
        args,
        Gate::Silu,
        &FORWARD,
        [read(a), read(b), write(c)],
    )
}

/// SwiGLU forward from a fused gate-up buffer `[rows, 2·cols]` (gate first in each row, rows
/// `args.a_stride` apart) into `c` `[rows, cols]` (rows `args.c_stride` apart); otherwise as
/// [`swiglu_forward`].
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_forward_fused};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 11008);
/// let gate_up = stream.clone_htod(&vec![0.5f32; rows * 2 * cols])?;
/// let mut c = stream.alloc_zeros::<f32>(rows * cols)?;
/// swiglu_forward_fused(&stream, &SwigluArgs::fused(rows, cols), &gate_up, &mut c)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `c` is overwritten (the `cols` elements of each row; elements between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize` (`args.a_stride` below 2 × `cols` included); or `gate_up`
///   or `c` is shorter than its rows need. Each error names the argument and, where it has one, the
///   expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `gate_up` or `c` belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `c` overlaps `gate_up`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_forward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gate_up: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    run(
        stream,
        args,
        Gate::Silu,
        &FORWARD_FUSED,
        [read(gate_up), write(c)],
    )
}

/// SwiGLU backward into separate buffers: `da` (rows at `args.a_stride`) and `db` (rows at
/// `args.b_stride`) from `dc` (rows at `args.c_stride`), recomputing silu from `a` and `b`.
///
/// With `g = dc·dm` and `z = a·gm` (f32): `db = g·silu(z)`, `da = g·silu'(z)·gm·b`, each
/// rounded once to `T`. `da` and `db` must not overlap each other or any input; use
/// [`swiglu_backward_inplace`] to write them over `a` and `b`. One launch, no allocation.
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 14336);
/// let a = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let b = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let dc = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let (mut da, mut db) = (stream.alloc_zeros::<bf16>(rows * cols)?, stream.alloc_zeros::<bf16>(rows * cols)?);
/// swiglu_backward(&stream, &SwigluArgs::new(rows, cols), &dc, &a, &b, &mut da, &mut db)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten, never accumulated into: `da` and `db` (the `cols` elements of each row; elements
/// between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize`; or `dc`, `a`, `b`, `da` or `db` is shorter than its rows
///   need. Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dc`, `a`, `b`, `da` or `db` belongs to
///   another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `da` or `db` overlaps the other, `dc`, `a` or
///   `b`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    da: &mut impl DevicePtrMut<T>,
    db: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), read(a), read(b), write(da), write(db)];
    run(stream, args, Gate::Silu, &BACKWARD, bufs)
}

/// SwiGLU backward writing `da` over `a` and `db` over `b` (the memory-saving mode of
/// Liger's seed); otherwise as [`swiglu_backward`].
///
/// `a` and `b` must not overlap each other ([`crate::Error::Aliasing`]; an interleaved
/// gate-up buffer goes through [`swiglu_backward_fused_inplace`]), nor `dc`.
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward_inplace};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 4096);
/// let mut a = stream.clone_htod(&vec![0.5f32; rows * cols])?; // becomes da
/// let mut b = stream.clone_htod(&vec![2.0f32; rows * cols])?; // becomes db
/// let dc = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let args = SwigluArgs::new(rows, cols).with_down_multiplier(0.5);
/// swiglu_backward_inplace(&stream, &args, &dc, &mut a, &mut b)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `a` and `b` are overwritten with `da` and `db` (the `cols` elements of each row; elements
/// between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize`; or `dc`, `a` or `b` is shorter than its rows need. Each
///   error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dc`, `a` or `b` belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `a` or `b` overlaps the other or `dc`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    a: &mut impl DevicePtrMut<T>,
    b: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), write(a), write(b)];
    run(stream, args, Gate::Silu, &BACKWARD_INPLACE, bufs)
}

/// SwiGLU backward from a fused gate-up buffer into a separate fused gradient buffer
/// `d_gate_up` `[rows, 2·cols]` (`da` in the first `cols` of each row, `db` in the next;
/// rows `args.a_stride` apart, like `gate_up`). `d_gate_up` must not overlap `gate_up` or
/// `dc`; otherwise as [`swiglu_backward`].
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward_fused};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 11008);
/// let gate_up = stream.clone_htod(&vec![0.5f32; rows * 2 * cols])?;
/// let dc = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let mut d_gate_up = stream.alloc_zeros::<f32>(rows * 2 * cols)?;
/// swiglu_backward_fused(&stream, &SwigluArgs::fused(rows, cols), &dc, &gate_up, &mut d_gate_up)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `d_gate_up` is overwritten, never accumulated into: `da` and `db` in the `2 × cols` elements of
/// each row (elements between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize` (`args.a_stride` below 2 × `cols` included); or `dc`,
///   `gate_up` or `d_gate_up` is shorter than its rows need. Each error names the argument and,
///   where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dc`, `gate_up` or `d_gate_up` belongs to
///   another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `d_gate_up` overlaps `dc` or `gate_up`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_backward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    gate_up: &impl DevicePtr<T>,
    d_gate_up: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), read(gate_up), write(d_gate_up)];
    run(stream, args, Gate::Silu, &BACKWARD_FUSED, bufs)
}

/// SwiGLU backward writing the fused gradient over the fused gate-up buffer (`da` over the
/// gate half, `db` over the up half of each row); `dc` must not overlap `gate_up`.
/// Otherwise as [`swiglu_backward_fused`].
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward_fused_inplace};
/// use liger_rs::half::f16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 11008);
/// let mut gate_up = stream.clone_htod(&vec![f16::ONE; rows * 2 * cols])?; // becomes d_gate_up
/// let dc = stream.clone_htod(&vec![f16::ONE; rows * cols])?;
/// swiglu_backward_fused_inplace(&stream, &SwigluArgs::fused(rows, cols), &dc, &mut gate_up)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `gate_up` is overwritten with the fused gradient: `da` and `db` in the `2 × cols` elements of
/// each row (elements between rows are not written).
///
/// # Errors
///
/// As [`swiglu_backward_fused`]'s, with `gate_up` read and written in place of `d_gate_up`:
/// `gate_up` overlapping `dc` is [`Error::Aliasing`](crate::Error::Aliasing).
pub fn swiglu_backward_fused_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    gate_up: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), write(gate_up)];
    run(stream, args, Gate::Silu, &BACKWARD_FUSED_INPLACE, bufs)
}
