//! RoPE forward and backward launchers (kernels: `kernels-gpu/src/rope/`, reference:
//! [`crate::reference::rope`], semantics in its docs).
//!
//! The anatomy of every op family: [`args`] ([`RopeArgs`], the cos/sin layouts and what each
//! buffer must hold) → [`plan`] (the kernel, its block and grid) → [`launch`] (the one
//! `#[repr(C)]` parameter block of [`abi`], which the device crate compiles too).
pub(crate) mod args;
pub(crate) mod launch;
pub(crate) mod layout;
pub(crate) mod plan;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/rope/abi.rs"]
pub(crate) mod abi;

pub(crate) use crate::identity::Pass;
pub use args::RopeArgs;
pub(crate) use args::{
    check_fused_disjoint, check_host_ids, check_sections, fused_k_end, fused_spec,
};
pub use layout::{CosSinLayout, PositionIds};

use crate::dtype::{CosSinDtype, Dtype};
use crate::error::Result;
use crate::module::kernels;
use crate::validate::{Buf, read, validate, write};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use launch::Io;
use std::sync::Arc;

/// RoPE forward (rotation by θ), in place on `q` and `k`, in one launch.
///
/// For every head of q and k and every pair `i < r/2` (`r = args.rotary_dim`), with
/// `(x1, x2)` the pair's two dims (`x[i]`, `x[i + r/2]`, or `x[2i]`, `x[2i + 1]` interleaved)
/// and `c`, `s` its entries of the token's cos/sin rows ([`RopeArgs`]): `x1 ← x1·c − x2·s`,
/// `x2 ← x2·c + x1·s`, computed in f32 (each product rounded to f32, no FMA) and rounded once
/// to `T`. Dims `r..head_dim` are not written.
///
/// `q` must hold exactly `batch × seq_len × q_heads × head_dim` elements and `k`
/// `batch × seq_len × k_heads × head_dim` (layouts: [`RopeArgs`]), or with token strides
/// ([`RopeArgs::with_strides`]) at least their span, `(batch × seq_len − 1) × stride + row`;
/// `cos`/`sin` are laid out as `layout` says (their lengths must match it exactly; `sin` like
/// `cos`), in `T` or, with f16/bf16 q and k, in f32 ([`CosSinDtype`]: the tables HF's Llama 4
/// and Liger-Kernel keep; the kernels then read their entries unrounded). `q` and `k` must not overlap each other (strided rows of the same stride: compared
/// row by row), `cos`, `sin` or device position ids. One launch on `stream`, no
/// synchronisation, no allocation (except for [`PositionIds::Host`]). Token-major calls take
/// 16-byte vector kernels (either pair layout, any table width, token strides and row source;
/// multimodal tables with contiguous NeoX halves and full-width rows) where pointers, head and
/// rotary widths, strides and multimodal sections are whole vectors; head-major and the other
/// calls take the general kernels (one element pair per thread, every form).
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (b, s, hq, hk, d) = (2, 16, 8, 2, 128);
/// // cos/sin [s, d] for positions 0..s, as HF builds them: cat(freqs, freqs).
/// let (mut cos, mut sin) = (Vec::new(), Vec::new());
/// for p in 0..s {
///     for i in 0..d {
///         let theta = p as f64 * 10000f64.powf(-2.0 * (i % (d / 2)) as f64 / d as f64);
///         cos.push(bf16::from_f64(theta.cos()));
///         sin.push(bf16::from_f64(theta.sin()));
///     }
/// }
/// let (cos, sin) = (stream.clone_htod(&cos)?, stream.clone_htod(&sin)?);
/// let mut q = stream.clone_htod(&vec![bf16::ONE; b * s * hq * d])?;
/// let mut k = stream.clone_htod(&vec![bf16::ONE; b * s * hk * d])?;
/// let args = RopeArgs::new(d).with_batch(b).with_seq_len(s).with_heads(hq, hk);
/// rope_forward(&stream, &args, &mut q, &mut k, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `q` and `k` are overwritten in place: dims `0..rotary_dim` of every head; dims past `rotary_dim`
/// are not written.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.head_dim` is 0 or odd,
///   `args.rotary_dim` is 0, odd or above `head_dim`, `args.q_heads` or `args.k_heads` is 0,
///   (q_heads + k_heads) × rotary_dim / 2 reaches 2³¹ or a length overflows `usize`;
///   `args.q_stride` or `args.k_stride` is below its row or set with `head_major`; `q` or `k` is
///   not exactly its shape's length (strided: shorter than its span); multimodal `sections` do
///   not sum to `rotary_dim / 2`; `cos` does not have the length `layout` needs (`sin` must
///   match it), device position ids are not `batch × seq_len` long, or a host position id lies
///   outside the table. Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `q`, `k`, `cos`, `sin` or device position
///   ids belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `q` or `k` overlaps the other, `cos`, `sin` or
///   device position ids.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there), uploading host position ids (a stream-ordered
///   allocation and a copy), or the launch, which also fails once an earlier kernel has faulted in
///   the context.
pub fn rope_forward<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    q: &mut impl DevicePtrMut<T>,
    k: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(q), write(k), None, None];
    rope_call(stream, args, Pass::Forward, io, cos, sin, layout)
}

/// RoPE backward (rotation by −θ), in place on the gradients `dq` and `dk`, in one launch.
///
/// With `(dy1, dy2)` a pair of the gradient: `dy1 ← dy1·c + dy2·s`, `dy2 ← dy2·c − dy1·s`,
/// f32 math and one rounding to `T`. `dq`/`dk` have the
/// shapes of `q`/`k`; `cos`, `sin` and `layout` are those of the forward. Otherwise as
/// [`rope_forward`].
///
/// ```no_run
/// use liger_rs::{CosSinLayout, PositionIds, RopeArgs, rope_backward};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (b, s, hq, hk, d, max_pos) = (1, 4, 4, 1, 64, 4096);
/// // Partial rotary: the first 32 dims rotate; cos/sin rows are 32 long.
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_rotary_dim(32);
/// let cos = stream.clone_htod(&vec![1.0f32; max_pos * 32])?;
/// let sin = stream.alloc_zeros::<f32>(max_pos * 32)?;
/// let ids = stream.clone_htod(&[0i32, 1, 0, 1])?; // device ids: clamped by the kernel
/// let layout = CosSinLayout::Gathered(PositionIds::DeviceI32(ids.as_view()));
/// let mut dq = stream.clone_htod(&vec![1.0f32; b * s * hq * d])?;
/// let mut dk = stream.clone_htod(&vec![1.0f32; b * s * hk * d])?;
/// rope_backward(&stream, &args, &mut dq, &mut dk, &cos, &sin, &layout)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `dq` and `dk` are overwritten in place: dims `0..rotary_dim` of every head; dims past
/// `rotary_dim` are not written.
///
/// # Errors
///
/// As [`rope_forward`]'s, with `dq` and `dk` in place of `q` and `k` (the names the errors
/// give).
pub fn rope_backward<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(dq), write(dk), None, None];
    rope_call(stream, args, Pass::Backward, io, cos, sin, layout)
}

/// RoPE forward in place on q and k that lie in one buffer `qkv`: q's token rows start at
/// element 0, `args.q_token_stride()` elements apart, and k's at element `k_offset`,
/// `args.k_token_stride()` apart ([`RopeArgs::with_strides`]), e.g. the fused QKV projection
/// output `[batch, seq_len, (q_heads + 2·k_heads)·head_dim]` with both strides
/// `(q_heads + 2·k_heads)·head_dim` and `k_offset = q_heads·head_dim`: q and k rotate in
/// place, v and every other element of `qkv` are neither read nor written. The rotation,
/// `cos`, `sin` and `layout` are those of [`rope_forward`], and so are the kernels: vector
/// kernels where both strides, `k_offset` and the widths are whole 16-byte vectors (as for a
/// fused QKV buffer of bf16 heads of 128 and a 16-byte aligned start).
///
/// `qkv` must hold q's span from its start and k's from `k_offset`; q's and k's rows must
/// share no element. With equal strides this is checked row by row (disjoint column ranges
/// of the same token rows, as in a fused QKV buffer, pass); with different strides the two
/// spans must not overlap.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward_fused};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (b, s, hq, hk, d) = (2, 16, 8, 2, 64);
/// let fused = (hq + 2 * hk) * d;
/// // The QKV projection output [b, s, (hq + 2·hk)·d]: per token q's heads, k's, v's.
/// let mut qkv = stream.clone_htod(&vec![1.0f32; b * s * fused])?;
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_strides(fused, fused);
/// rope_forward_fused(&stream, &args, &mut qkv, hq * d, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// The rows of q and k in `qkv` are overwritten in place: dims `0..rotary_dim` of every head;
/// nothing else in `qkv` is written.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): as [`rope_forward`]'s for
///   `args`, `cos`, `sin` and the position ids; `args.q_stride` or `args.k_stride` below its
///   row (`heads × head_dim`) or set with `head_major`; `qkv` shorter than q's span or than
///   `k_offset` plus k's span (named `qkv`); `k_offset` plus k's span overflows `usize`.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `qkv`, `cos`, `sin` or device
///   position ids belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `qkv`'s span overlaps `cos`, `sin` or
///   device position ids (output `qkv`), or q's rows overlap k's (output `q`, other `k`).
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): as [`rope_forward`].
pub fn rope_forward_fused<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    qkv: &mut impl DevicePtrMut<T>,
    k_offset: usize,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(qkv), None, None, None];
    let fused = Some(k_offset);
    rope_call_in(stream, args, Pass::Forward, io, fused, cos, sin, layout)
}

/// RoPE backward (rotation by −θ) in place on dq and dk that lie in one buffer `dqkv`, as
/// [`rope_forward_fused`] lays out q and k (the gradient of the fused QKV projection output:
/// dv's columns are neither read nor written). The rotation is [`rope_backward`]'s; errors
/// as [`rope_forward_fused`], with `dqkv`, `dq` and `dk` for `qkv`, `q` and `k`.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_backward_fused};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (s, hq, hk, d) = (16, 4, 4, 64);
/// let fused = (hq + 2 * hk) * d;
/// let mut dqkv = stream.clone_htod(&vec![1.0f32; s * fused])?;
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let args = RopeArgs::new(d).with_seq_len(s).with_heads(hq, hk).with_strides(fused, fused);
/// rope_backward_fused(&stream, &args, &mut dqkv, hq * d, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_backward_fused<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dqkv: &mut impl DevicePtrMut<T>,
    k_offset: usize,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(dqkv), None, None, None];
    let fused = Some(k_offset);
    rope_call_in(stream, args, Pass::Backward, io, fused, cos, sin, layout)
}

/// RoPE forward out of place: the rotation of [`rope_forward`] read from `q` and `k` and
/// written to `q_out` and `k_out` (shaped like them, dims past `rotary_dim` copied), in one
/// launch; `q` and `k` are not modified.
///
/// Arguments as [`rope_forward`]; `q_out` and `k_out` must not overlap each other or any input
/// (`q` and `k` may overlap each other: they are only read). Out of place always takes the
/// general kernels, so a caller that would otherwise copy q and k first reads and writes each
/// element once instead of twice; in place, [`rope_forward`] may take the vector kernels.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward_into};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (b, s, hq, hk, d) = (1, 16, 8, 2, 64);
/// // candle-nn's tables: [s, d/2], one value per pair; q and k head-major [b, h, s, d].
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_half_tables()
///     .with_head_major();
/// let cos = stream.clone_htod(&vec![1.0f32; s * d / 2])?;
/// let sin = stream.alloc_zeros::<f32>(s * d / 2)?;
/// let q = stream.clone_htod(&vec![1.0f32; b * hq * s * d])?;
/// let k = stream.clone_htod(&vec![1.0f32; b * hk * s * d])?;
/// let (mut q_rot, mut k_rot) = (stream.alloc_zeros::<f32>(q.len())?, stream.alloc_zeros::<f32>(k.len())?);
/// rope_forward_into(&stream, &args, &q, &k, &cos, &sin, &CosSinLayout::PerPosition, &mut q_rot, &mut k_rot)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `q_out` and `k_out` are overwritten whole: the rotated dims, and dims past `rotary_dim` copied
/// from `q` and `k`, which are only read.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.head_dim` is 0 or odd,
///   `args.rotary_dim` is 0, odd or above `head_dim`, `args.q_heads` or `args.k_heads` is 0,
///   (q_heads + k_heads) × rotary_dim / 2 or (q_heads + k_heads) × head_dim reaches 2³¹, or a
///   length overflows `usize`; `q` or `k` is not exactly its shape's length (with token
///   strides, [`RopeArgs::with_strides`]: shorter than its span), or `q_out` or `k_out` not
///   exactly its shape's length (outputs are contiguous);
///   `cos` does not have the length `layout` needs (`sin` must match it), device position ids are
///   not `batch × seq_len` long, or a host position id lies outside the table. Each error names the
///   argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `q`, `k`, `cos`, `sin`, device position
///   ids, `q_out` or `k_out` belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `q_out` or `k_out` overlaps the other, `q`, `k`,
///   `cos`, `sin` or device position ids.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there), uploading host position ids (a stream-ordered
///   allocation and a copy), or the launch, which also fails once an earlier kernel has faulted in
///   the context.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward_into<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
    q_out: &mut impl DevicePtrMut<T>,
    k_out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let io = (q, q_out, Some((k, k_out)));
    rope_into(stream, args, Pass::Forward, io, cos, sin, layout)
}

/// RoPE backward out of place: the rotation by −θ of [`rope_backward`] read from `dq` and
/// `dk` and written to `dq_out` and `dk_out`; otherwise as [`rope_forward_into`].
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_backward_into};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (b, s, hq, hk, d) = (1, 16, 8, 2, 64);
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_interleaved();
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let dq = stream.clone_htod(&vec![1.0f32; b * s * hq * d])?;
/// let dk = stream.clone_htod(&vec![1.0f32; b * s * hk * d])?;
/// let (mut gq, mut gk) = (stream.alloc_zeros::<f32>(dq.len())?, stream.alloc_zeros::<f32>(dk.len())?);
/// rope_backward_into(&stream, &args, &dq, &dk, &cos, &sin, &CosSinLayout::PerPosition, &mut gq, &mut gk)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `dq_out` and `dk_out` are overwritten whole: the rotated dims, and dims past `rotary_dim` copied
/// from `dq` and `dk`, which are only read.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.head_dim` is 0 or odd,
///   `args.rotary_dim` is 0, odd or above `head_dim`, `args.q_heads` or `args.k_heads` is 0,
///   (q_heads + k_heads) × rotary_dim / 2 or (q_heads + k_heads) × head_dim reaches 2³¹, or a
///   length overflows `usize`; `dq` or `dk` is not exactly its shape's length (with token
///   strides, [`RopeArgs::with_strides`]: shorter than its span), or `dq_out` or `dk_out` not
///   exactly its shape's length (outputs are contiguous);
///   `cos` does not have the length `layout` needs (`sin` must match it), device position ids are
///   not `batch × seq_len` long, or a host position id lies outside the table. Each error names the
///   argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dq`, `dk`, `cos`, `sin`, device position
///   ids, `dq_out` or `dk_out` belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `dq_out` or `dk_out` overlaps the other, `dq`,
///   `dk`, `cos`, `sin` or device position ids.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there), uploading host position ids (a stream-ordered
///   allocation and a copy), or the launch, which also fails once an earlier kernel has faulted in
///   the context.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward_into<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dq: &impl DevicePtr<T>,
    dk: &impl DevicePtr<T>,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
    dq_out: &mut impl DevicePtrMut<T>,
    dk_out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let io = (dq, dq_out, Some((dk, dk_out)));
    rope_into(stream, args, Pass::Backward, io, cos, sin, layout)
}

/// The q input and output of an out-of-place call, and k's (`None`: q alone, with
/// `args.k_heads = 0`).
pub(crate) type OutOfPlace<'a, Q, QO, K, KO> = (&'a Q, &'a mut QO, Option<(&'a K, &'a mut KO)>);

/// RoPE out of place on the general kernels, with or without k (see [`rope_forward_into`]).
pub(crate) fn rope_into<T, C, Q, QO, K, KO>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    pass: Pass,
    (q, q_out, k): OutOfPlace<'_, Q, QO, K, KO>,
    cos: &impl DevicePtr<C>,
    sin: &impl DevicePtr<C>,
    layout: &CosSinLayout<'_>,
) -> Result<()>
where
    T: Dtype,
    C: CosSinDtype<T>,
    Q: DevicePtr<T>,
    QO: DevicePtrMut<T>,
    K: DevicePtr<T>,
    KO: DevicePtrMut<T>,
{
    let (k, k_out) = match k {
        Some((k, k_out)) => (read(k), write(k_out)),
        None => (None, None),
    };
    let io = [read(q), k, write(q_out), k_out];
    rope_call(stream, args, pass, io, cos, sin, layout)
}

/// Validates and launches a call: `[q, k, q_out, k_out]` as in [`RopeArgs::table`] (in place,
/// the outputs `None`; without k, k and k_out `None`).
#[allow(clippy::too_many_arguments)]
fn rope_call<'b, T: Dtype, C: CosSinDtype<T>>(
    stream: &'b Arc<CudaStream>,
    args: &RopeArgs,
    pass: Pass,
    [q, k, q_out, k_out]: [Option<Buf<'b, T>>; 4],
    cos: &'b impl DevicePtr<C>,
    sin: &'b impl DevicePtr<C>,
    layout: &'b CosSinLayout<'_>,
) -> Result<()> {
    rope_call_in(
        stream,
        args,
        pass,
        [q, k, q_out, k_out],
        None,
        cos,
        sin,
        layout,
    )
}

/// [`rope_call`], or with `fused = Some(k_offset)` the in-place call on q and k of one buffer
/// (`q`: [`rope_forward_fused`]'s `qkv`, `k` None): k starts `k_offset` elements into it.
#[allow(clippy::too_many_arguments)]
fn rope_call_in<'b, T: Dtype, C: CosSinDtype<T>>(
    stream: &'b Arc<CudaStream>,
    args: &RopeArgs,
    pass: Pass,
    [q, k, q_out, k_out]: [Option<Buf<'b, T>>; 4],
    fused: Option<usize>,
    cos: &'b impl DevicePtr<C>,
    sin: &'b impl DevicePtr<C>,
    layout: &'b CosSinLayout<'_>,
) -> Result<()> {
    let out_of_place = q_out.is_some();
    let with_k = k.is_some() || fused.is_some();
    let (sizes, mut table) = args.table(pass, layout.rows(), out_of_place, with_k)?;
    if let Some(k_offset) = fused {
        table.specs[0] = fused_spec(&sizes, k_offset, pass)?;
    }
    let bufs = [q, k, C::read(cos), C::read(sin), layout.ids(), q_out, k_out];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [q, mut k, cos_ptr, sin_ptr, ids_ptr, q_out, k_out] = call.ptrs;
    if let Some(k_offset) = fused {
        check_fused_disjoint(&sizes, k_offset, pass)?;
        k = q + (k_offset * size_of::<T>()) as u64;
    }
    let rows = args.table_rows(layout.rows(), &sizes, cos.len());
    // Host ids go up only now that every check has passed; a fresh allocation is disjoint
    // from every argument by construction.
    let uploaded: Option<CudaSlice<i64>> = match layout.position_ids() {
        Some(PositionIds::Host(h)) => {
            check_host_ids(h, rows)?;
            Some(stream.clone_htod(*h)?)
        }
        _ => None,
    };
    let (ids_ptr, _uploaded) = match uploaded.as_ref() {
        Some(u) => {
            let (p, g) = u.device_ptr(stream);
            (p, Some(g))
        }
        None => (ids_ptr, None),
    };
    let io = Io {
        q,
        k,
        out: out_of_place.then_some((q_out, k_out)),
        cos: cos_ptr,
        sin: sin_ptr,
        ids: ids_ptr,
    };
    let p = launch::params(args, &sizes, &io, (rows, layout.rows()));
    let kernels = kernels(stream.context())?;
    let source = (layout.rows(), layout.source());
    let plan = plan::plan(
        args,
        pass,
        (T::ELEM, C::ELEM),
        &sizes,
        source,
        out_of_place,
        &p,
        |k, t| kernels.resident_blocks(&kernels.function(k)?, t, 0),
    )?;
    let func = kernels.function(plan.kernel)?;
    // SAFETY: `validate` checked every buffer of the table for `args` (lengths, context,
    // overlaps; the fused buffer's q and k rows by `check_fused_disjoint`), `call` and
    // `_uploaded` hold their guards until the launch is queued, and the plan is `p`'s.
    unsafe { launch::run(stream, &func, &plan, &p) }
}
