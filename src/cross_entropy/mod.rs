//! Cross-entropy over rows of logits (PyTorch's `cross_entropy`, Liger-Kernel's
//! `LigerCrossEntropyFunction` options), forward and backward, and the fused linear
//! cross-entropy ([`linear`]) on top of it.
//!
//! The anatomy of every op family: [`args`] (the public arguments and their checks, shared
//! with the CPU reference and the candle CPU path) → [`plan`] (a pure function of the
//! arguments, element type and alignment: kernels, grids, blocks) → [`launch`] (the one
//! `#[repr(C)]` parameter block of [`abi`], which the device crate compiles too, and the
//! launches).
pub(crate) mod args;
mod launch;
pub(crate) mod linear;
pub(crate) mod plan;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/cross_entropy/abi.rs"]
// The statistics' indices are the device's; the host only sizes the block.
#[allow(dead_code)]
pub(crate) mod abi;

pub use args::{CrossEntropyArgs, Reduction};

use crate::dtype::Dtype;
use crate::error::Result;
use crate::validate::{Access, Buf, read, validate, write};
use args::Call;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use launch::Ptrs;
use plan::Options;
use std::sync::Arc;

/// The buffers of one call, as its public function received them.
pub(crate) struct Bufs<'b, T> {
    pub(crate) logits: Buf<'b, T>,
    pub(crate) target: &'b dyn DevicePtr<i64>,
    pub(crate) weight: Option<&'b dyn DevicePtr<f32>>,
    pub(crate) bias: Option<&'b dyn DevicePtr<T>>,
    pub(crate) grad: Option<&'b mut dyn DevicePtrMut<T>>,
    pub(crate) loss: Option<&'b mut dyn DevicePtrMut<f32>>,
    pub(crate) z_loss: Option<&'b mut dyn DevicePtrMut<f32>>,
    pub(crate) lse: Option<Access<'b, f32>>,
    pub(crate) grad_loss: Option<&'b dyn DevicePtr<f32>>,
}

/// Every cross-entropy call: checks, scratch, plan, launches.
pub(crate) fn call<'b, T: Dtype>(
    stream: &'b Arc<CudaStream>,
    args: &CrossEntropyArgs,
    call: Call,
    b: Bufs<'b, T>,
) -> Result<()> {
    let table = args.table(call)?;
    let backward = call.lse_read;
    let opts = Options {
        weighted: b.weight.is_some(),
        bias: b.bias.is_some(),
    };
    let bufs = [
        Some(b.logits),
        Some(Buf::I64(Access::Read(b.target))),
        b.weight.map(|w| Buf::F32(Access::Read(w))),
        b.bias.and_then(|x| read(x)),
        b.loss.map(|l| Buf::F32(Access::Write(l))),
        b.z_loss.map(|l| Buf::F32(Access::Write(l))),
        b.lse.map(Buf::F32),
        b.grad_loss.map(|g| Buf::F32(Access::Read(g))),
        b.grad.and_then(|g| write(g)),
    ];
    let Some(taken) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [
        logits,
        target,
        weight,
        bias,
        loss,
        z_loss,
        lse,
        grad_loss,
        grad,
    ] = taken.ptrs;
    let grad = if call.in_place { logits } else { grad };
    let reduced = args.reduction != Reduction::None;
    let z_rows = reduced && (args.lse_square_scale != 0.0 || z_loss != 0);
    // Per-row losses and z-losses of a reduced call, and the count kernel's statistics:
    // stream-ordered scratch, freed behind the launches.
    let rows_scratch = if reduced && !backward { args.rows } else { 0 };
    let z_scratch = if z_rows && !backward { args.rows } else { 0 };
    let scratch: CudaSlice<f32> = stream.alloc_zeros(rows_scratch + z_scratch + abi::STATS)?;
    let (base, _scratch_use) = scratch.device_ptr(stream);
    let at = |i: usize| base + 4 * i as u64;
    let ptrs = Ptrs {
        logits,
        grad,
        target,
        weight,
        bias,
        row_loss: if reduced { at(0) } else { loss },
        row_z: match (reduced, z_rows) {
            (true, true) => at(rows_scratch),
            (true, false) => 0,
            (false, _) => z_loss,
        },
        lse,
        grad_loss,
        stats: at(rows_scratch + z_scratch),
        total: if reduced { loss } else { 0 },
        total_z: if reduced { z_loss } else { 0 },
    };
    let strides = [args.logits_stride, args.grad_stride];
    let grad_stride = if call.in_place {
        args.logits_stride
    } else {
        args.grad_stride
    };
    let path = plan::path(args, T::ELEM, opts, &[logits, grad, bias], &strides);
    let max_blocks = plan::max_stage_blocks(crate::module::kernels(stream.context())?.sm90);
    let steps = if backward {
        plan::backward(args, T::ELEM, opts, path)
    } else {
        // Only the forward with the gradient reads its rows twice, which staging saves.
        let path = if grad != 0 {
            plan::gradient_path(path, args.vocab, T::ELEM, max_blocks)
        } else {
            path
        };
        plan::forward(args, T::ELEM, opts, path, max_blocks)
    };
    // SAFETY: `validate` checked every buffer the call touches against the arguments; the
    // scratch spans what `ptrs` names in it and is freed behind the launches.
    unsafe { launch::run(stream, &steps, &launch::params(args, &ptrs, grad_stride)) }
}

/// Cross-entropy forward: the loss of each row of `logits` against its target (see
/// [`CrossEntropyArgs`] for the formula and the options), reduced as `args.reduction` says,
/// and each row's log-sum-exp for [`cross_entropy_backward`].
///
/// logits `[rows, vocab]` (row stride `args.logits_stride`), target `i64 [rows]`, weight
/// (class weights) `f32 [vocab]`, loss and z_loss (`λ·lse²`, reduced like the loss, and
/// included in it) `f32 [args.loss_len()]`, lse `f32 [rows]`. f32 arithmetic throughout,
/// whatever the logits' type; the reduction sums the rows in f64 in a fixed order
/// (deterministic). The logits are read once.
///
/// ```no_run
/// use liger_rs::{CrossEntropyArgs, cross_entropy_forward, half::bf16};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let args = CrossEntropyArgs::new(8192, 32000);
/// let logits = stream.alloc_zeros::<bf16>(8192 * 32000)?;
/// let target = stream.clone_htod(&vec![7i64; 8192])?;
/// let mut loss = stream.alloc_zeros::<f32>(1)?;
/// let mut lse = stream.alloc_zeros::<f32>(8192)?;
/// cross_entropy_forward(&stream, &args, &logits, &target, None, &mut loss, None, &mut lse)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Launches: a one-block count of the mean's denominators (when the mean or weighted label
/// smoothing needs it), one block per row, a one-block reduction (unless `None`); a reduced
/// call allocates its per-row losses (`4·rows` bytes, twice with a z-loss) on `stream`,
/// freed behind it.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad option (vocab 0,
/// label smoothing outside `[0, 1]`, a negative or non-finite λ, a softcap ≤ 0) or a buffer
/// of the wrong length; [`Error::WrongContext`](crate::Error::WrongContext);
/// [`Error::Aliasing`](crate::Error::Aliasing) when an output overlaps another buffer; a
/// driver error. A rejected call launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    logits: &impl DevicePtr<T>,
    target: &impl DevicePtr<i64>,
    weight: Option<&dyn DevicePtr<f32>>,
    loss: &mut impl DevicePtrMut<f32>,
    z_loss: Option<&mut dyn DevicePtrMut<f32>>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let call_kind = Call {
        grad: false,
        in_place: false,
        lse_read: false,
    };
    let bufs = Bufs {
        logits: Buf::T(Access::Read(logits)),
        target,
        weight,
        bias: None,
        grad: None,
        loss: Some(loss),
        z_loss: z_loss.map(|z| z as &mut dyn DevicePtrMut<f32>),
        lse: Some(Access::Write(lse)),
        grad_loss: None,
    };
    call(stream, args, call_kind, bufs)
}

/// The forward and, in the same pass over the logits, their gradient for an upstream
/// gradient of 1 (Liger-Kernel's forward): `grad` `[rows, vocab]` (row stride
/// `args.grad_stride`, in the logits' type) gets `∂loss/∂logits`, 0 on ignored rows. Each row
/// is read from device memory once and written once where it fits in shared memory (16-byte
/// aligned rows of whole vectors, no class weights, label smoothing or softcap, and up to
/// 36864 bf16/f16 or 18432 f32 classes, or 8 times that on Hopper, whose thread-block
/// clusters split a row); otherwise it is read twice, the second time partly from L2.
///
/// # Errors
/// As [`cross_entropy_forward`].
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    logits: &impl DevicePtr<T>,
    target: &impl DevicePtr<i64>,
    weight: Option<&dyn DevicePtr<f32>>,
    loss: &mut impl DevicePtrMut<f32>,
    z_loss: Option<&mut dyn DevicePtrMut<f32>>,
    grad: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let call_kind = Call {
        grad: true,
        in_place: false,
        lse_read: false,
    };
    let bufs = Bufs {
        logits: Buf::T(Access::Read(logits)),
        target,
        weight,
        bias: None,
        grad: Some(grad),
        loss: Some(loss),
        z_loss: z_loss.map(|z| z as &mut dyn DevicePtrMut<f32>),
        lse: None,
        grad_loss: None,
    };
    call(stream, args, call_kind, bufs)
}

/// [`cross_entropy_forward_backward`] with the gradient written over the logits (no second
/// `[rows, vocab]` buffer), as Liger-Kernel does.
///
/// # Errors
/// As [`cross_entropy_forward`].
pub fn cross_entropy_forward_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    logits: &mut impl DevicePtrMut<T>,
    target: &impl DevicePtr<i64>,
    weight: Option<&dyn DevicePtr<f32>>,
    loss: &mut impl DevicePtrMut<f32>,
    z_loss: Option<&mut dyn DevicePtrMut<f32>>,
) -> Result<()> {
    let call_kind = Call {
        grad: true,
        in_place: true,
        lse_read: false,
    };
    let bufs = Bufs {
        logits: Buf::T(Access::Write(logits)),
        target,
        weight,
        bias: None,
        grad: None,
        loss: Some(loss),
        z_loss: z_loss.map(|z| z as &mut dyn DevicePtrMut<f32>),
        lse: None,
        grad_loss: None,
    };
    call(stream, args, call_kind, bufs)
}

/// Cross-entropy backward: `grad = grad_loss · ∂loss/∂logits` from the forward's `lse`
/// (each row read once and written once). `grad_loss` is the upstream gradient, `f32
/// [args.loss_len()]` (one value for a reduced loss, one per row for `None`); it weighs the
/// z-loss inside the loss too. Same arguments as the forward otherwise.
///
/// # Errors
/// As [`cross_entropy_forward`].
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    logits: &impl DevicePtr<T>,
    target: &impl DevicePtr<i64>,
    weight: Option<&dyn DevicePtr<f32>>,
    lse: &impl DevicePtr<f32>,
    grad_loss: &impl DevicePtr<f32>,
    grad: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let call_kind = Call {
        grad: true,
        in_place: false,
        lse_read: true,
    };
    let bufs = Bufs {
        logits: Buf::T(Access::Read(logits)),
        target,
        weight,
        bias: None,
        grad: Some(grad),
        loss: None,
        z_loss: None,
        lse: Some(Access::Read(lse)),
        grad_loss: Some(grad_loss),
    };
    call(stream, args, call_kind, bufs)
}

/// [`cross_entropy_backward`] with the gradient written over the logits.
///
/// # Errors
/// As [`cross_entropy_forward`].
pub fn cross_entropy_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    logits: &mut impl DevicePtrMut<T>,
    target: &impl DevicePtr<i64>,
    weight: Option<&dyn DevicePtr<f32>>,
    lse: &impl DevicePtr<f32>,
    grad_loss: &impl DevicePtr<f32>,
) -> Result<()> {
    let call_kind = Call {
        grad: true,
        in_place: true,
        lse_read: true,
    };
    let bufs = Bufs {
        logits: Buf::T(Access::Write(logits)),
        target,
        weight,
        bias: None,
        grad: None,
        loss: None,
        z_loss: None,
        lse: Some(Access::Read(lse)),
        grad_loss: Some(grad_loss),
    };
    call(stream, args, call_kind, bufs)
}
