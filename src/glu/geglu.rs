//! GEGLU (GELU-mul) forward and backward launchers (kernels: `kernels-gpu/src/glu/`,
//! reference: [`crate::reference::geglu`]): SwiGLU's launchers, layouts, arguments
//! ([`SwigluArgs`]: shape, row strides, multipliers) and kernel paths, with GELU in place of
//! SiLU as the gate, in the form [`Gelu`] picks.
//!
//! With `z = f32(a)·gm` and `T` the element type, in f16 and bf16 the cast points of PyTorch
//! autograd through `gelu(a) * b` in that dtype (HF's Gemma MLP, Liger's GEGLU), in f32
//! SwiGLU's:
//!
//! | value | f16, bf16                      | f32                          |
//! |-------|--------------------------------|------------------------------|
//! | `c`   | `T(T(gelu(z)) · b)`            | `T(T(gelu(z)) · b)`          |
//! | `g`   | `f32(dc)·dm`                   | `f32(dc)·dm`                 |
//! | `db`  | `T(g · T(gelu(z)))`            | `T(g · gelu(z))`             |
//! | `da`  | `T(T(g · b) · gelu'(z) · gm)`  | `T(g · gelu'(z) · gm · b)`   |
//!
//! all in f32 between the casts. [`Gelu::Tanh`]: `gelu(z) = ½·z·(1 + tanh(√(2/π)·(z +
//! 0.044715·z³)))`, evaluated as `z·σ(u)`, `u = 2·√(2/π)·(z + 0.044715·z³)`, and
//! `gelu'(z) = σ(u)·(1 + z·u'·(1 − σ(u)))`, `u' = 2·√(2/π)·(1 + 3·0.044715·z²)`.
//! [`Gelu::Erf`]: `gelu(z) = z·Φ(z)`, `gelu'(z) = Φ(z) + z·φ(z)` with `Φ` the standard normal
//! CDF (`½·erfc(−z/√2)`) and `φ` its density. Both stay finite for every finite `z`, in
//! relative accuracy down the negative tail (no `1 + tanh` or `1 + erf` cancellation): large
//! negative `z` gives −0 (and `gelu'` 0), large positive `z` gives `z` (and 1); infinite `z`
//! the same limits; NaN propagates. The f32 GELU is within 6 ulps of the exact function of the
//! f32 `z` (`gelu'` within 7 ulps of its larger term; `ex2.approx` adds up to 2), before the
//! rounding to `T`.
//!
//! The down multiplier `dm` applies in the backward only, as for SwiGLU (see
//! [`SwigluArgs::down_multiplier`]). One launch per call, no allocation, no synchronisation.
//!
//! Liger-Kernel's GEGLU has the tanh form only; its cast points are the f16/bf16 column.
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

/// The form of GELU a GEGLU call uses (module docs: the formulas).
///
/// ```
/// use liger_rs::Gelu;
/// assert_ne!(Gelu::Tanh, Gelu::Erf);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Gelu {
    /// The tanh approximation: PyTorch's `gelu(approximate="tanh")`, HF's
    /// `gelu_pytorch_tanh` (Gemma), Liger-Kernel's GEGLU.
    Tanh,
    /// The exact GELU through the normal CDF: PyTorch's default `gelu(approximate="none")`,
    /// HF's `gelu`.
    Erf,
}

impl Gelu {
    /// The kernels' gate.
    pub(crate) fn gate(self) -> Gate {
        match self {
            Gelu::Tanh => Gate::GeluTanh,
            Gelu::Erf => Gate::GeluErf,
        }
    }
}

/// GEGLU forward, separate gate and up: `c = T(T(gelu(a·gm)) · b)`, element-wise over
/// `rows × cols`, GELU in the form `gelu`; `args.down_multiplier` is not applied (backward
/// only).
///
/// `a`, `b` and `c` hold `rows` rows at `args.a_stride`, `args.b_stride`, `args.c_stride`
/// (see [`SwigluArgs`]). `c` must not overlap `a` or `b`.
///
/// ```no_run
/// use liger_rs::{Gelu, SwigluArgs, geglu_forward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 16384);
/// let gate = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let up = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let mut c = stream.alloc_zeros::<bf16>(rows * cols)?;
/// geglu_forward(&stream, &SwigluArgs::new(rows, cols), Gelu::Tanh, &gate, &up, &mut c)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `c` is overwritten (the `cols` elements of each row; elements between rows are not written).
///
/// # Errors
///
/// Those of [`crate::swiglu_forward`] for the same `args` and buffers (the form is never an
/// error), checked before anything is launched, leaving every buffer untouched:
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for `args` or a buffer shorter
/// than its rows need, [`Error::WrongContext`](crate::Error::WrongContext) for a buffer of
/// another context, [`Error::Aliasing`](crate::Error::Aliasing) when `c` overlaps `a` or `b`;
/// then [`Error::Driver`](crate::Error::Driver) from loading the kernel (at its first launch in
/// the context) or the launch.
pub fn geglu_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gelu: Gelu,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    run(
        stream,
        args,
        gelu.gate(),
        &FORWARD,
        [read(a), read(b), write(c)],
    )
}

/// GEGLU forward from a fused gate-up buffer `[rows, 2·cols]` (gate first in each row, rows
/// `args.a_stride` apart) into `c` `[rows, cols]` (rows `args.c_stride` apart); otherwise as
/// [`geglu_forward`].
///
/// ```no_run
/// use liger_rs::{Gelu, SwigluArgs, geglu_forward_fused};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 16384);
/// let gate_up = stream.clone_htod(&vec![0.5f32; rows * 2 * cols])?;
/// let mut c = stream.alloc_zeros::<f32>(rows * cols)?;
/// geglu_forward_fused(&stream, &SwigluArgs::fused(rows, cols), Gelu::Erf, &gate_up, &mut c)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `c` is overwritten (the `cols` elements of each row; elements between rows are not written).
///
/// # Errors
///
/// Those of [`crate::swiglu_forward_fused`] for the same `args` and buffers, checked before
/// anything is launched: [`Error::InvalidArgument`](crate::Error::InvalidArgument) (also
/// `args.a_stride` below 2 × `cols`), [`Error::WrongContext`](crate::Error::WrongContext),
/// [`Error::Aliasing`](crate::Error::Aliasing) when `c` overlaps `gate_up`; then
/// [`Error::Driver`](crate::Error::Driver).
pub fn geglu_forward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gelu: Gelu,
    gate_up: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(gate_up), write(c)];
    run(stream, args, gelu.gate(), &FORWARD_FUSED, bufs)
}

/// GEGLU backward into separate buffers: `da` (rows at `args.a_stride`) and `db` (rows at
/// `args.b_stride`) from `dc` (rows at `args.c_stride`), recomputing GELU from `a` and `b`.
///
/// With `g = dc·dm` and `z = a·gm` (f32), in f32 `db = g·gelu(z)` and `da = g·gelu'(z)·gm·b`,
/// each rounded once; in f16/bf16 autograd's `db = T(g·T(gelu(z)))` and
/// `da = T(T(g·b)·gelu'(z)·gm)` (the module's table). `da` and `db` must not overlap each
/// other or any input; use
/// [`geglu_backward_inplace`] to write them over `a` and `b`.
///
/// ```no_run
/// use liger_rs::{Gelu, SwigluArgs, geglu_backward};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 16384);
/// let a = stream.clone_htod(&vec![0.5f32; rows * cols])?;
/// let b = stream.clone_htod(&vec![2.0f32; rows * cols])?;
/// let dc = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let (mut da, mut db) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(rows * cols)?);
/// let args = SwigluArgs::new(rows, cols);
/// geglu_backward(&stream, &args, Gelu::Tanh, &dc, &a, &b, &mut da, &mut db)?;
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
/// Those of [`crate::swiglu_backward`] for the same `args` and buffers, checked before anything
/// is launched: [`Error::InvalidArgument`](crate::Error::InvalidArgument),
/// [`Error::WrongContext`](crate::Error::WrongContext),
/// [`Error::Aliasing`](crate::Error::Aliasing) when `da` or `db` overlaps the other, `dc`, `a`
/// or `b`; then [`Error::Driver`](crate::Error::Driver).
#[allow(clippy::too_many_arguments)]
pub fn geglu_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gelu: Gelu,
    dc: &impl DevicePtr<T>,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    da: &mut impl DevicePtrMut<T>,
    db: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), read(a), read(b), write(da), write(db)];
    run(stream, args, gelu.gate(), &BACKWARD, bufs)
}

/// GEGLU backward writing `da` over `a` and `db` over `b`; otherwise as [`geglu_backward`].
/// `a` and `b` must not overlap each other (an interleaved gate-up buffer goes through
/// [`geglu_backward_fused_inplace`]), nor `dc`.
///
/// ```no_run
/// use liger_rs::{Gelu, SwigluArgs, geglu_backward_inplace};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 4096);
/// let mut a = stream.clone_htod(&vec![0.5f32; rows * cols])?; // becomes da
/// let mut b = stream.clone_htod(&vec![2.0f32; rows * cols])?; // becomes db
/// let dc = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let args = SwigluArgs::new(rows, cols).with_down_multiplier(0.5);
/// geglu_backward_inplace(&stream, &args, Gelu::Erf, &dc, &mut a, &mut b)?;
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
/// Those of [`crate::swiglu_backward_inplace`] for the same `args` and buffers, checked before
/// anything is launched: [`Error::InvalidArgument`](crate::Error::InvalidArgument),
/// [`Error::WrongContext`](crate::Error::WrongContext),
/// [`Error::Aliasing`](crate::Error::Aliasing) when `a` or `b` overlaps the other or `dc`;
/// then [`Error::Driver`](crate::Error::Driver).
pub fn geglu_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gelu: Gelu,
    dc: &impl DevicePtr<T>,
    a: &mut impl DevicePtrMut<T>,
    b: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), write(a), write(b)];
    run(stream, args, gelu.gate(), &BACKWARD_INPLACE, bufs)
}

/// GEGLU backward from a fused gate-up buffer into a separate fused gradient buffer
/// `d_gate_up` `[rows, 2·cols]` (`da` in the first `cols` of each row, `db` in the next; rows
/// `args.a_stride` apart, like `gate_up`). `d_gate_up` must not overlap `gate_up` or `dc`;
/// otherwise as [`geglu_backward`].
///
/// ```no_run
/// use liger_rs::{Gelu, SwigluArgs, geglu_backward_fused};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 16384);
/// let gate_up = stream.clone_htod(&vec![bf16::ONE; rows * 2 * cols])?;
/// let dc = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let mut d_gate_up = stream.alloc_zeros::<bf16>(rows * 2 * cols)?;
/// let args = SwigluArgs::fused(rows, cols);
/// geglu_backward_fused(&stream, &args, Gelu::Tanh, &dc, &gate_up, &mut d_gate_up)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `d_gate_up` is overwritten, never accumulated into: `da` and `db` in the `2 × cols` elements
/// of each row (elements between rows are not written).
///
/// # Errors
///
/// Those of [`crate::swiglu_backward_fused`] for the same `args` and buffers, checked before
/// anything is launched: [`Error::InvalidArgument`](crate::Error::InvalidArgument) (also
/// `args.a_stride` below 2 × `cols`), [`Error::WrongContext`](crate::Error::WrongContext),
/// [`Error::Aliasing`](crate::Error::Aliasing) when `d_gate_up` overlaps `dc` or `gate_up`;
/// then [`Error::Driver`](crate::Error::Driver).
pub fn geglu_backward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gelu: Gelu,
    dc: &impl DevicePtr<T>,
    gate_up: &impl DevicePtr<T>,
    d_gate_up: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), read(gate_up), write(d_gate_up)];
    run(stream, args, gelu.gate(), &BACKWARD_FUSED, bufs)
}

/// GEGLU backward writing the fused gradient over the fused gate-up buffer (`da` over the
/// gate half, `db` over the up half of each row); `dc` must not overlap `gate_up`. Otherwise
/// as [`geglu_backward_fused`].
///
/// ```no_run
/// use liger_rs::{Gelu, SwigluArgs, geglu_backward_fused_inplace};
/// use liger_rs::half::f16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 16384);
/// let mut gate_up = stream.clone_htod(&vec![f16::ONE; rows * 2 * cols])?; // becomes d_gate_up
/// let dc = stream.clone_htod(&vec![f16::ONE; rows * cols])?;
/// let args = SwigluArgs::fused(rows, cols);
/// geglu_backward_fused_inplace(&stream, &args, Gelu::Erf, &dc, &mut gate_up)?;
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
/// Those of [`crate::swiglu_backward_fused_inplace`] for the same `args` and buffers, checked
/// before anything is launched: [`Error::InvalidArgument`](crate::Error::InvalidArgument)
/// (also `args.a_stride` below 2 × `cols`), [`Error::WrongContext`](crate::Error::WrongContext),
/// [`Error::Aliasing`](crate::Error::Aliasing) when `gate_up` overlaps `dc`; then
/// [`Error::Driver`](crate::Error::Driver).
pub fn geglu_backward_fused_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gelu: Gelu,
    dc: &impl DevicePtr<T>,
    gate_up: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), write(gate_up)];
    run(stream, args, gelu.gate(), &BACKWARD_FUSED_INPLACE, bufs)
}
