//! Fused multi-tensor AdamW, Adam and SGD (PyTorch's fused arithmetic), with low-precision
//! copies of the weights written in the same pass, f32 or bf16 moments, and the global
//! gradient norm (L2 or infinity) for clipping applied inside the update.
//!
//! The anatomy of every op family: [`args`] → [`plan`] (launch groups, a pure function of the
//! lengths) → [`launch`] (the one `#[repr(C)]` parameter block of [`abi`], which the device
//! crate compiles too).
pub(crate) mod args;
mod launch;
pub(crate) mod plan;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/adamw/abi.rs"]
pub(crate) mod abi;

pub use args::{AdamWArgs, NormType, SgdArgs};

use crate::dtype::Dtype;
use crate::error::{Error, Result, invalid};
use crate::identity::{AdamWPass, ElemType};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::sync::Arc;

/// One parameter tensor's buffers for a step: the f32 weights, the gradient, the moments
/// (updated in place) and amsgrad's running maximum of v, in `S`: f32, or bf16 to halve
/// their memory (each computed in f32 and rounded once when stored).
pub struct AdamWTensor<'a, G, S = f32> {
    /// θ, f32 `[n]`.
    pub param: &'a mut dyn DevicePtrMut<f32>,
    /// The gradient `[n]`, only read.
    pub grad: &'a dyn DevicePtr<G>,
    /// m `[n]`.
    pub exp_avg: &'a mut dyn DevicePtrMut<S>,
    /// v `[n]`.
    pub exp_avg_sq: &'a mut dyn DevicePtrMut<S>,
    /// amsgrad's maximum of v `[n]` (required with amsgrad, refused without).
    pub max_exp_avg_sq: Option<&'a mut dyn DevicePtrMut<S>>,
}

/// One parameter tensor's buffers for an SGD step: the f32 weights, the gradient and, with
/// momentum, the f32 momentum buffer (updated in place).
pub struct SgdTensor<'a, G> {
    /// θ, f32 `[n]`.
    pub param: &'a mut dyn DevicePtrMut<f32>,
    /// The gradient `[n]`, only read.
    pub grad: &'a dyn DevicePtr<G>,
    /// The momentum buffer, f32 `[n]` (required with momentum, refused without).
    pub momentum_buffer: Option<&'a mut dyn DevicePtrMut<f32>>,
}

/// A step's scalars that may live on the device (so that a step can be captured in a CUDA
/// graph and replayed): each a single f32.
#[derive(Default, Clone, Copy)]
pub struct StepScalars<'a> {
    /// The step count t ≥ 1 on the device (else the call's `step`).
    pub step: Option<&'a dyn DevicePtr<f32>>,
    /// The learning rate on the device (else `args.lr`).
    pub lr: Option<&'a dyn DevicePtr<f32>>,
    /// [`clip_grad_norm`]'s output (`[norm, factor, non-finite]`): the gradients are scaled
    /// by the factor, in their type, before the update.
    pub clip: Option<&'a dyn DevicePtr<f32>>,
    /// PyTorch's `grad_scale`: each gradient is divided by it before the update (PyTorch's
    /// fused kernel also writes the unscaled gradient back; this one leaves it).
    pub grad_scale: Option<&'a dyn DevicePtr<f32>>,
    /// PyTorch's `found_inf`: where it holds anything but 0 the step changes nothing.
    /// [`clip_grad_norm`]'s third value (`out.slice(2..3)`) is such a flag: 1 where the norm
    /// is not finite (see there).
    pub found_inf: Option<&'a dyn DevicePtr<f32>>,
}

/// A buffer of a call as the checks see it, and its pointer's guard once taken.
struct Item<'b> {
    name: &'static str,
    bytes: u64,
    written: bool,
    ptr: u64,
    _guard: Option<SyncOnDrop<'b>>,
}

/// Checks a buffer's context and length (`need` elements of `E`) and takes its pointer.
fn take<'b, E>(
    stream: &'b CudaStream,
    name: &'static str,
    tensor: usize,
    need: usize,
    buf: Access<'b, E>,
) -> Result<Item<'b>> {
    let ctx = stream.context().cu_ctx() as usize;
    let (len, other) = match &buf {
        Access::Read(b) => (b.len(), b.stream().context().cu_ctx() as usize),
        Access::Write(b) => (b.len(), b.stream().context().cu_ctx() as usize),
    };
    if other != ctx {
        return Err(Error::WrongContext { arg: name });
    }
    if len != need {
        let expected = format!("length {need} (tensor {tensor}'s gradient)");
        return Err(invalid(name, expected, len));
    }
    let written = matches!(buf, Access::Write(_));
    let (ptr, guard) = match buf {
        Access::Read(b) => b.device_ptr(stream),
        Access::Write(b) => b.device_ptr_mut(stream),
    };
    Ok(Item {
        name,
        bytes: (need * size_of::<E>()) as u64,
        written,
        ptr,
        _guard: Some(guard),
    })
}

enum Access<'b, E> {
    Read(&'b dyn DevicePtr<E>),
    Write(&'b mut dyn DevicePtrMut<E>),
}

/// Every written buffer disjoint from every other buffer of the call: one sweep over the
/// buffers in address order (a step has hundreds), keeping the furthest end reached by any
/// buffer and by a written one.
fn check_disjoint(items: &[Item<'_>]) -> Result<()> {
    let mut order: Vec<&Item<'_>> = items.iter().filter(|i| i.bytes > 0).collect();
    order.sort_by_key(|i| i.ptr);
    let (mut any, mut written): (Option<&Item<'_>>, Option<&Item<'_>>) = (None, None);
    let end = |i: &Item<'_>| i.ptr + i.bytes;
    for &x in &order {
        let hit = match (written, any) {
            (Some(w), _) if x.ptr < end(w) => Some(w),
            (_, Some(a)) if x.written && x.ptr < end(a) => Some(a),
            _ => None,
        };
        if let Some(o) = hit {
            let (output, other) = if x.written { (x, o) } else { (o, x) };
            return Err(Error::Aliasing {
                output: output.name,
                other: other.name,
            });
        }
        if any.is_none_or(|a| end(x) > end(a)) {
            any = Some(x);
        }
        if x.written && written.is_none_or(|w| end(x) > end(w)) {
            written = Some(x);
        }
    }
    Ok(())
}

/// The scalars' pointers (0 where absent), checked to hold one f32 of the stream's context.
fn scalars<'b>(stream: &'b CudaStream, s: &StepScalars<'b>) -> Result<(Vec<Item<'b>>, [u64; 5])> {
    let mut items = Vec::new();
    let mut ptrs = [0u64; 5];
    let all = [
        ("scalars.step", s.step, 1),
        ("scalars.lr", s.lr, 1),
        ("scalars.clip", s.clip, abi::NORM_OUT),
        ("scalars.grad_scale", s.grad_scale, 1),
        ("scalars.found_inf", s.found_inf, 1),
    ];
    for (k, (name, buf, need)) in all.into_iter().enumerate() {
        if let Some(b) = buf {
            let item = take(stream, name, 0, need, Access::Read(b))?;
            ptrs[k] = item.ptr;
            items.push(item);
        }
    }
    Ok((items, ptrs))
}

/// One tensor's buffers as the shared body takes them: the gradient, θ, and the rule's f32
/// states in the parameter block's order (m or the momentum buffer, v, amsgrad's maximum).
struct Slots<'s, G, S> {
    grad: &'s dyn DevicePtr<G>,
    param: &'s mut dyn DevicePtrMut<f32>,
    states: [Option<(&'static str, &'s mut dyn DevicePtrMut<S>)>; 3],
}

/// What a launch computes: the kernel pass and its parameter block without tensors.
struct Rule {
    pass: AdamWPass,
    params: abi::Params,
}

/// The shared body of every step: checks the copies and every buffer, then launches `rule`'s
/// kernel over groups of tensors.
fn step_impl<G: Dtype, C: Dtype, S: Dtype>(
    stream: &Arc<CudaStream>,
    rule: impl FnOnce([u64; 5]) -> Rule,
    scalars_in: &StepScalars<'_>,
    tensors: Vec<Slots<'_, G, S>>,
    copies: Option<&mut [&mut dyn DevicePtrMut<C>]>,
) -> Result<()> {
    let copy_type = match (&copies, C::ELEM) {
        (None, _) => None,
        (Some(_), ElemType::F32) => {
            return Err(invalid(
                "copies",
                "f16 or bf16 copies (the weights are f32)",
                "f32",
            ));
        }
        (Some(c), e) => {
            if c.len() != tensors.len() {
                let expected = format!("{} copies (one per tensor)", tensors.len());
                return Err(invalid("copies", expected, c.len()));
            }
            Some(e)
        }
    };
    let (mut items, sp) = scalars(stream, scalars_in)?;
    let lens: Vec<usize> = tensors.iter().map(|t| t.grad.len()).collect();
    let groups = plan::groups(&lens)?;
    let mut ptrs: Vec<abi::Tensor> = Vec::with_capacity(tensors.len());
    let mut copies = copies.map(|c| c.iter_mut());
    for (i, t) in tensors.into_iter().enumerate() {
        let n = lens[i];
        let grad = take(stream, "grad", i, n, Access::Read(t.grad))?;
        let param = take(stream, "param", i, n, Access::Write(t.param))?;
        let mut state = [0u64; 3];
        for (k, slot) in t.states.into_iter().enumerate() {
            if let Some((name, buf)) = slot {
                let item = take(stream, name, i, n, Access::Write(buf))?;
                state[k] = item.ptr;
                items.push(item);
            }
        }
        let copy = match copies.as_mut().and_then(|c| c.next()) {
            Some(c) => Some(take(stream, "copies", i, n, Access::Write(&mut **c))?),
            None => None,
        };
        ptrs.push(abi::Tensor {
            param: param.ptr,
            grad: grad.ptr,
            exp_avg: state[0],
            exp_avg_sq: state[1],
            max_exp_avg_sq: state[2],
            copy: copy.as_ref().map_or(0, |x| x.ptr),
            len: n as u64,
            first_block: 0,
        });
        items.extend([grad, param]);
        items.extend(copy);
    }
    check_disjoint(&items)?;
    let Rule { pass, mut params } = rule(sp);
    let kernel = plan::update(pass, G::ELEM, copy_type);
    for g in &groups {
        launch::fill(&mut params, &ptrs[g.start..], &g.first_blocks);
        // SAFETY: every buffer of the group's tensors was checked to hold its tensor's length
        // in the stream's context, written buffers disjoint from all others; the items keep
        // them recorded on the stream until the launch is queued.
        unsafe { launch::run(stream, kernel, g.blocks, 0, &params)? };
    }
    Ok(())
}

/// The AdamW body: its checks, its slots, its parameter block.
fn adamw_impl<G: Dtype, C: Dtype, S: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AdamWArgs,
    step: f32,
    scalars: &StepScalars<'_>,
    tensors: &mut [AdamWTensor<'_, G, S>],
    copies: Option<&mut [&mut dyn DevicePtrMut<C>]>,
) -> Result<()> {
    args.check()?;
    let pass = match S::ELEM {
        ElemType::F32 => AdamWPass::Update,
        ElemType::Bf16 => AdamWPass::UpdateBf16States,
        ElemType::F16 => {
            return Err(invalid("exp_avg", "f32 or bf16 moments", "f16"));
        }
    };
    if scalars.step.is_none() {
        args::check_step(step)?;
    }
    let mut slots = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter_mut().enumerate() {
        if t.max_exp_avg_sq.is_some() != args.amsgrad {
            let expected = match args.amsgrad {
                true => format!("a max_exp_avg_sq buffer for tensor {i} (amsgrad)"),
                false => format!("no max_exp_avg_sq for tensor {i} (amsgrad is off)"),
            };
            return Err(invalid("max_exp_avg_sq", expected, "the opposite"));
        }
        slots.push(Slots {
            grad: t.grad,
            param: &mut *t.param,
            states: [
                Some(("exp_avg", &mut *t.exp_avg as &mut dyn DevicePtrMut<S>)),
                Some(("exp_avg_sq", &mut *t.exp_avg_sq)),
                t.max_exp_avg_sq
                    .as_mut()
                    .map(|b| ("max_exp_avg_sq", &mut **b as &mut dyn DevicePtrMut<S>)),
            ],
        });
    }
    let rule = |sp| Rule {
        pass,
        params: launch::adamw_params(args, step, sp),
    };
    step_impl(stream, rule, scalars, slots, copies)
}

/// The SGD body: its checks, its slots, its parameter block.
fn sgd_impl<G: Dtype, C: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SgdArgs,
    first_step: bool,
    scalars: &StepScalars<'_>,
    tensors: &mut [SgdTensor<'_, G>],
    copies: Option<&mut [&mut dyn DevicePtrMut<C>]>,
) -> Result<()> {
    args.check()?;
    if scalars.step.is_some() {
        return Err(invalid(
            "scalars.step",
            "no step count (SGD takes first_step)",
            "a buffer",
        ));
    }
    let mut slots = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter_mut().enumerate() {
        if t.momentum_buffer.is_some() != (args.momentum != 0.0) {
            let expected = match args.momentum != 0.0 {
                true => format!("a momentum_buffer for tensor {i} (momentum is not 0)"),
                false => format!("no momentum_buffer for tensor {i} (momentum is 0)"),
            };
            return Err(invalid("momentum_buffer", expected, "the opposite"));
        }
        slots.push(Slots {
            grad: t.grad,
            param: &mut *t.param,
            states: [
                t.momentum_buffer
                    .as_mut()
                    .map(|b| ("momentum_buffer", &mut **b as &mut dyn DevicePtrMut<f32>)),
                None,
                None,
            ],
        });
    }
    let rule = |sp| Rule {
        pass: AdamWPass::Sgd,
        params: launch::sgd_params(args, first_step, sp),
    };
    step_impl(stream, rule, scalars, slots, copies)
}

/// One AdamW (or Adam, [`AdamWArgs::adam`]) step over many tensors, PyTorch's
/// `torch.optim.AdamW(fused=True)` operation for operation: for each element, with `g` the
/// gradient (scaled by the clip factor, divided by the gradient scale, negated by maximize)
/// and `t` the step,
/// `θ ← θ − lr·λ·θ` (decoupled; Adam adds `λ·θ` to g instead), `m ← β1·m + (1 − β1)·g`,
/// `v ← β2·v + (1 − β2)·g²`, `θ ← θ − (lr / (1 − β1ᵗ))·m / (√v / √(1 − β2ᵗ) + ε)` (amsgrad:
/// √ of the running maximum of v), in f32 with PyTorch 2.11's operation order and fused
/// multiply-adds, the hyper-parameters rounded to f32. θ in f32; m and v in f32, or bf16
/// (`S`; PyTorch has no such form); gradients f32, f16 or bf16. Up to 32 tensors per launch, their addresses in the launch's parameter block (no
/// upload, no allocation), so a step with its scalars on the device ([`StepScalars`]) can be
/// captured in a graph.
///
/// Against PyTorch's fused AdamW on the same inputs the results are the same bits, except
/// after the steps where CUDA's f32 `pow` misrounds `β^t` (this kernel takes the exact power
/// rounded to f32): for β2 = 0.999, 5826 of the first 10⁶ steps, the first at t = 102. From
/// such a step on, θ differs in some elements' last bits (after 30 steps of 100003 elements:
/// 71 elements with β2 = 0.95, 2468 with β2 = 0.99); m and v stay the same bits.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a hyper-parameter out of
/// range, a step that is not a whole number ≥ 1, a buffer whose length is not its tensor's
/// gradient's, amsgrad's buffer missing or given without it, a scalar buffer that is not one
/// f32 (three for `clip`), f16 moments; [`Error::WrongContext`](crate::Error::WrongContext);
/// [`Error::Aliasing`](crate::Error::Aliasing) when a written buffer overlaps any other. A
/// rejected call launches nothing.
pub fn adamw_step<G: Dtype, S: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AdamWArgs,
    step: f32,
    scalars: &StepScalars<'_>,
    tensors: &mut [AdamWTensor<'_, G, S>],
) -> Result<()> {
    adamw_impl::<G, half::bf16, S>(stream, args, step, scalars, tensors, None)
}

/// [`adamw_step`], also writing each tensor's updated θ rounded to `C` (f16 or bf16) into
/// `copies[i]`, in the same pass: the weights a mixed-precision forward uses.
///
/// # Errors
/// As [`adamw_step`]; also for f32 copies or a copy count other than the tensors'.
pub fn adamw_step_with_copies<G: Dtype, C: Dtype, S: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AdamWArgs,
    step: f32,
    scalars: &StepScalars<'_>,
    tensors: &mut [AdamWTensor<'_, G, S>],
    copies: &mut [&mut dyn DevicePtrMut<C>],
) -> Result<()> {
    adamw_impl::<G, C, S>(stream, args, step, scalars, tensors, Some(copies))
}

/// One SGD step over many tensors, PyTorch's `torch.optim.SGD(fused=True)` operation for
/// operation: for each element, with `g` the gradient (scaled by the clip factor, divided by
/// the gradient scale, negated by maximize), `g ← g + λ·θ`; with momentum μ, `b ← g` on the
/// first step, else `b ← μ·b + (1 − dampening)·g`, and `g ← g + μ·b` (Nesterov) or `g ← b`;
/// then `θ ← θ − lr·g`, in f32 with PyTorch's fused multiply-adds. θ and the buffer
/// in f32; gradients f32, f16 or bf16. The launches and scalars are [`adamw_step`]'s, but
/// SGD takes no step count: `first_step` starts the buffers.
///
/// # Errors
/// As [`adamw_step`]; also for a momentum buffer missing with momentum or given without it,
/// Nesterov without momentum or with dampening, and a device step count.
pub fn sgd_step<G: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SgdArgs,
    first_step: bool,
    scalars: &StepScalars<'_>,
    tensors: &mut [SgdTensor<'_, G>],
) -> Result<()> {
    sgd_impl::<G, half::bf16>(stream, args, first_step, scalars, tensors, None)
}

/// [`sgd_step`], also writing each tensor's updated θ rounded to `C` (f16 or bf16) into
/// `copies[i]` in the same pass.
///
/// # Errors
/// As [`sgd_step`]; also for f32 copies or a copy count other than the tensors'.
pub fn sgd_step_with_copies<G: Dtype, C: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SgdArgs,
    first_step: bool,
    scalars: &StepScalars<'_>,
    tensors: &mut [SgdTensor<'_, G>],
    copies: &mut [&mut dyn DevicePtrMut<C>],
) -> Result<()> {
    sgd_impl::<G, C>(stream, args, first_step, scalars, tensors, Some(copies))
}

/// The global norm of all `grads` (L2, or the infinity norm: the largest `|g|`), the clip
/// factor `max_norm / (norm + 1e-6)` clamped to 1 (PyTorch's `clip_grad_norm_`: 0 for an
/// infinite norm, NaN for a NaN one) and a non-finite flag (1 where the norm is infinite or
/// NaN, else 0: some gradient is, or, with the L2 norm, the f32 sum of a block's squares
/// overflowed, which takes gradients near 10¹⁹), written to `out` (f32 `[norm, factor,
/// non-finite]`) on the device. Pass
/// `out` as [`StepScalars::clip`] to clip inside the update, its third value as
/// [`StepScalars::found_inf`] to skip a step with a non-finite gradient (loss scaling), and
/// read it back to log the norm. L2: squares summed in f32 per block of 4096, the blocks in
/// f64 in a fixed order (bitwise deterministic). Allocates the per-block partials on `stream`
/// for the call. `max_norm = ∞` computes the norm and the flag without clipping.
///
/// # Errors
/// As [`adamw_step`] for the buffers; `max_norm` not > 0; `out` not three f32.
pub fn clip_grad_norm<G: Dtype>(
    stream: &Arc<CudaStream>,
    grads: &[&dyn DevicePtr<G>],
    max_norm: f32,
    norm_type: NormType,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(invalid("max_norm", "a value > 0", max_norm));
    }
    let lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
    let groups = plan::groups(&lens)?;
    let mut items = Vec::with_capacity(grads.len() + 1);
    let mut ptrs = Vec::with_capacity(grads.len());
    for (i, g) in grads.iter().enumerate() {
        let item = take(stream, "grads", i, lens[i], Access::Read(*g))?;
        ptrs.push(abi::Tensor {
            grad: item.ptr,
            len: lens[i] as u64,
            ..abi::Tensor::default()
        });
        items.push(item);
    }
    let out_item = take(stream, "out", 0, abi::NORM_OUT, Access::Write(out))?;
    let out_ptr = out_item.ptr;
    items.push(out_item);
    check_disjoint(&items)?;
    let total: u64 = groups.iter().map(|g| g.blocks as u64).sum();
    let partials = stream.alloc_zeros::<f32>(total.max(1) as usize)?;
    let (partials_ptr, _partials_use) = partials.device_ptr(stream);
    let mut params = launch::adamw_params(&AdamWArgs::new(0.0), 1.0, [0; 5]);
    params.flags = match norm_type {
        NormType::L2 => 0,
        NormType::Inf => abi::NORM_INF,
    };
    params.partials = partials_ptr;
    let kernel = plan::sum_squares(G::ELEM);
    let mut base = 0u64;
    for g in &groups {
        launch::fill(&mut params, &ptrs[g.start..], &g.first_blocks);
        params.partial_base = base;
        // SAFETY: the gradients were checked against their lengths; the partials hold every
        // group's blocks from its base.
        unsafe {
            launch::run(
                stream,
                kernel,
                g.blocks,
                crate::identity::SUM_SLOTS as u32 * 4,
                &params,
            )?
        };
        base += g.blocks as u64;
    }
    params.partial_count = total;
    params.max_norm = max_norm;
    params.norm = out_ptr;
    // SAFETY: `total` partial sums, `out` two f32.
    unsafe { launch::run(stream, plan::NORM, 1, abi::THREADS * 8, &params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(name: &'static str, ptr: u64, bytes: u64, written: bool) -> Item<'static> {
        Item {
            name,
            bytes,
            written,
            ptr,
            _guard: None,
        }
    }

    fn aliasing(items: &[Item<'_>]) -> Option<(&'static str, &'static str)> {
        match check_disjoint(items) {
            Ok(()) => None,
            Err(Error::Aliasing { output, other }) => Some((output, other)),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn written_buffers_overlap_nothing_and_reads_may_share() {
        let ok = [
            item("grad", 0, 100, false),
            item("grad", 50, 100, false),
            item("param", 150, 10, true),
            item("exp_avg", 160, 10, true),
            item("empty", 155, 0, true),
        ];
        assert_eq!(aliasing(&ok), None);
        let inside_a_read = [item("grad", 0, 1000, false), item("param", 500, 4, true)];
        assert_eq!(aliasing(&inside_a_read), Some(("param", "grad")));
        let read_after_long_write = [
            item("param", 0, 1000, true),
            item("exp_avg", 1000, 8, true),
            item("grad", 990, 4, false),
        ];
        assert_eq!(aliasing(&read_after_long_write), Some(("param", "grad")));
        let two_writes = [item("exp_avg", 8, 8, true), item("param", 0, 12, true)];
        assert_eq!(aliasing(&two_writes), Some(("exp_avg", "param")));
    }
}
