//! Fused attention (flash-attention 2 semantics), forward and backward, on tensor cores for
//! 16-bit elements at head_dim 64 and 128 and on CUDA cores otherwise.
//!
//! The anatomy of every op family: [`args`] (the public arguments and their checks, shared
//! with the CPU reference and the candle CPU path) → [`plan`] (a pure function of the
//! arguments, element type and alignment: kernels, grids, shared memory) → [`launch`] (the
//! one `#[repr(C)]` parameter block of [`abi`], which the device crate compiles too, and the
//! launches).
pub(crate) mod args;
mod launch;
pub(crate) mod plan;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/attention/abi.rs"]
pub(crate) mod abi;

pub use args::{AttentionArgs, Strides};

use crate::dtype::Dtype;
use crate::error::{Result, invalid};
use crate::validate::{Access, Buf, read, validate, write};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use launch::Ptrs;
use std::sync::Arc;

fn packed(args: &AttentionArgs, varlen: bool) -> Result<()> {
    if args.is_varlen() != varlen {
        let (expected, got) = if varlen {
            (
                "a packed batch (AttentionArgs::varlen)",
                "fixed-length arguments",
            )
        } else {
            (
                "fixed-length arguments (AttentionArgs::new)",
                "a packed batch",
            )
        };
        return Err(invalid("args", expected, got));
    }
    Ok(())
}

/// The path's stride inputs: every stride of the call's layouts, the gradients' included in
/// the forward too, so that a forward and its backward with the same arguments take the same
/// path.
fn strides(args: &AttentionArgs) -> Vec<usize> {
    let out = args.out_strides();
    let mut s = Vec::with_capacity(18);
    for l in [
        args.q,
        args.k,
        args.v,
        out,
        args.grads[0],
        args.grads[1],
        args.grads[2],
    ] {
        s.extend([l.token, l.head]);
        if !args.is_varlen() {
            s.push(l.batch);
        }
    }
    s
}

/// The forward of both call forms: `cu` holds the packed batch's offsets.
fn forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AttentionArgs,
    [q, k, v]: [&dyn DevicePtr<T>; 3],
    cu: Option<[&dyn DevicePtr<i32>; 2]>,
    o: &mut dyn DevicePtrMut<T>,
    lse: &mut dyn DevicePtrMut<f32>,
) -> Result<()> {
    let table = args.forward_table()?;
    let cu_buf = |i: usize| cu.map(|c| Buf::I32(Access::Read(c[i])));
    let bufs = [
        read(q),
        read(k),
        read(v),
        write(o),
        Some(Buf::F32(Access::Write(lse))),
        cu_buf(0),
        cu_buf(1),
    ];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [q, k, v, o, lse, cq, ck] = call.ptrs;
    let ptrs = Ptrs {
        q,
        k,
        v,
        o,
        lse,
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
        ..Ptrs::default()
    };
    let path = plan::path(args, T::ELEM, &[q, k, v, o], &strides(args));
    let kernels = crate::module::kernels(stream.context())?;
    let step = plan::forward_within(args, T::ELEM, path, kernels.sm90, kernels.max_shared);
    // SAFETY: `validate` checked every buffer the forward touches against the arguments;
    // `call` keeps them recorded on the stream until the launch is queued.
    unsafe { launch::run(stream, &kernels, &[step], &launch::params(args, &ptrs)) }
}

/// The backward of both call forms.
#[allow(clippy::too_many_arguments)]
fn backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AttentionArgs,
    [q, k, v, o, d_o]: [&dyn DevicePtr<T>; 5],
    lse: &dyn DevicePtr<f32>,
    cu: Option<[&dyn DevicePtr<i32>; 2]>,
    [dq, dk, dv]: [&mut dyn DevicePtrMut<T>; 3],
) -> Result<()> {
    let table = args.backward_table()?;
    let cu_buf = |i: usize| cu.map(|c| Buf::I32(Access::Read(c[i])));
    let bufs = [
        read(q),
        read(k),
        read(v),
        read(o),
        read(d_o),
        Some(Buf::F32(Access::Read(lse))),
        write(dq),
        write(dk),
        write(dv),
        cu_buf(0),
        cu_buf(1),
    ];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [q, k, v, o, d_o, lse, dq, dk, dv, cq, ck] = call.ptrs;
    let path = plan::path(
        args,
        T::ELEM,
        &[q, k, v, o, d_o, dq, dk, dv],
        &strides(args),
    );
    let kernels = crate::module::kernels(stream.context())?;
    let steps = plan::backward_within(args, T::ELEM, path, kernels.sm90, kernels.max_shared);
    // Σ dO·O per query row: stream-ordered scratch, freed behind the launches.
    let delta = stream.alloc_zeros::<f32>(args.lse_len().max(1))?;
    let (delta_ptr, _delta_use) = delta.device_ptr(stream);
    let ptrs = Ptrs {
        q,
        k,
        v,
        o,
        d_o,
        dq,
        dk,
        dv,
        lse,
        delta: delta_ptr,
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
    };
    // SAFETY: as in `forward`; `delta` spans every query row and lives until the launches
    // are queued (its free is ordered behind them on the stream).
    unsafe { launch::run(stream, &kernels, &steps, &launch::params(args, &ptrs)) }
}

/// Attention forward: `o = softmax(mask(softcap(scale · q·kᵀ))) · v` for every query head
/// (over key/value head `h / (heads_q / heads_kv)`), and each query row's log-sum-exp of its
/// scores (natural log, f32), which the backward takes.
///
/// q `[B, Sq, Hq, d]`, k and v `[B, Sk, Hkv, d]` in the layouts of `args` (any strides: views
/// of a fused QKV projection work in place), o contiguous `[B, Sq, Hq, d]`, lse
/// `[B, Hq, Sq]`. f16 and bf16 at head_dim 64 and 128 run on tensor cores (16-byte aligned
/// buffers and strides; probabilities rounded to the element type before they weight v, as
/// flash-attention 2 does, f32 accumulation); every other case on CUDA cores in f32.
/// Scores never leave registers: no scratch, no allocation, one launch.
///
/// ```no_run
/// use liger_rs::{AttentionArgs, attention_forward, half::bf16};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let args = AttentionArgs::new(2, 1024, 1024, 16, 4, 128).with_causal(true);
/// let q = stream.alloc_zeros::<bf16>(2 * 1024 * 16 * 128)?;
/// let kv = stream.alloc_zeros::<bf16>(2 * 1024 * 4 * 128)?;
/// let mut o = stream.alloc_zeros::<bf16>(args.out_len())?;
/// let mut lse = stream.alloc_zeros::<f32>(args.lse_len())?;
/// attention_forward(&stream, &args, &q, &kv, &kv, &mut o, &mut lse)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad shape, option or
/// layout (head_dim outside 1 ..= 256, `heads_kv` not dividing `heads_q`, a written layout
/// that names an element twice, a packed batch's arguments), a buffer shorter than its layout
/// spans; [`Error::WrongContext`](crate::Error::WrongContext),
/// [`Error::Aliasing`](crate::Error::Aliasing) when o or lse overlaps another buffer; a
/// driver error. A rejected call launches nothing.
pub fn attention_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AttentionArgs,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    o: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    packed(args, false)?;
    forward(stream, args, [q, k, v], None, o, lse)
}

/// [`attention_forward`] on a packed batch ([`AttentionArgs::varlen`]): q `[total_q, Hq, d]`,
/// k and v `[total_k, Hkv, d]`, sequence `b` at tokens `cu_seqlens_q[b]..cu_seqlens_q[b + 1]`
/// (i32, `batch + 1` offsets from 0; `cu_seqlens_k` for keys), o `[total_q, Hq, d]`, lse
/// `[Hq, total_q]`. Empty sequences are allowed.
///
/// # Errors
/// As [`attention_forward`]; also when `args` is not a packed batch or an offsets buffer does
/// not hold `batch + 1` values.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_varlen<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AttentionArgs,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    cu_seqlens_q: &impl DevicePtr<i32>,
    cu_seqlens_k: &impl DevicePtr<i32>,
    o: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    packed(args, true)?;
    forward(
        stream,
        args,
        [q, k, v],
        Some([cu_seqlens_q, cu_seqlens_k]),
        o,
        lse,
    )
}

/// Attention backward from the output's gradient `d_o`, recomputing the probabilities from
/// q, k and the forward's `lse`: `dv = Σ pᵀ·dO`, `dp = dO·vᵀ`, `ds = p ∘ (dp − Σ dO·O)`
/// (times the softcap's `1 − tanh²`), `dq = scale · ds·k`, `dk = scale · dsᵀ·q`; dk and dv
/// are summed over the query heads of each key/value head's group.
///
/// Deterministic: every gradient element is summed by one thread in a fixed order (dK/dV
/// blocks walk every query head of their group; no atomics), so runs give the same bits.
/// Three launches; the per-row `Σ dO·O` (f32, one value per query row and head) is scratch
/// allocated on `stream` for the call and freed behind it, stream-ordered (graph capture
/// records it as an allocation node). dq, dk and dv take the layouts `args.grads` names
/// (contiguous by default) and must not overlap any input or each other.
///
/// # Errors
/// As [`attention_forward`], for every buffer of the backward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AttentionArgs,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    o: &impl DevicePtr<T>,
    d_o: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    packed(args, false)?;
    backward(stream, args, [q, k, v, o, d_o], lse, None, [dq, dk, dv])
}

/// [`attention_backward`] on a packed batch (see [`attention_forward_varlen`]).
///
/// # Errors
/// As [`attention_forward_varlen`], for every buffer of the backward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_varlen<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AttentionArgs,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    o: &impl DevicePtr<T>,
    d_o: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    cu_seqlens_q: &impl DevicePtr<i32>,
    cu_seqlens_k: &impl DevicePtr<i32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    packed(args, true)?;
    let cu: [&dyn DevicePtr<i32>; 2] = [cu_seqlens_q, cu_seqlens_k];
    backward(stream, args, [q, k, v, o, d_o], lse, Some(cu), [dq, dk, dv])
}
