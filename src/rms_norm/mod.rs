//! RMSNorm forward and backward launchers, and the fused residual add's ([`fused_add`])
//! (kernels: `kernels-gpu/src/rms_norm/`, reference: [`crate::reference::rms_norm`],
//! semantics: [`CastingMode`](crate::CastingMode)).
//!
//! The anatomy of every op family: [`args`] ([`RmsNormArgs`] and what each buffer must hold) →
//! [`plan`] (the kernels, grids and launch kinds) → [`launch`] (the one `#[repr(C)]` parameter
//! block of [`abi`], which the device crate compiles too).
pub(crate) mod args;
pub(crate) mod fused_add;
pub(crate) mod launch;
pub(crate) mod plan;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/rms_norm/abi.rs"]
pub(crate) mod abi;

pub use args::RmsNormArgs;
pub use fused_add::{
    fused_add_rms_norm_backward, fused_add_rms_norm_backward_inplace, fused_add_rms_norm_forward,
    fused_add_rms_norm_forward_inplace,
};

use crate::dtype::Dtype;
use crate::error::Result;
use crate::validate::{Access, Buf, read, validate, write};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use launch::{BwdPtrs, FwdPtrs, launch_backward, launch_forward};
use std::sync::Arc;

/// RMSNorm forward: `y = norm(x) · (offset + weight)` row by row, and each row's inverse RMS
/// into `rstd` (needed by the backward).
///
/// `x` and `y` hold `rows` rows at their strides (see [`RmsNormArgs`]); `weight`, if given,
/// holds `cols` elements (without it `y` is the normalised `x`); `rstd` holds at least `rows`
/// f32 (in [`CastingMode::None`](crate::CastingMode::None) each is a value of `T` widened to f32). One launch on
/// `stream`, no allocation, no synchronisation. `y` and `rstd` must not overlap the inputs.
///
/// ```no_run
/// use liger_rs::{RmsNormArgs, half::bf16, rms_norm_forward};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 4096);
/// let x = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let w = stream.clone_htod(&vec![bf16::ONE; cols])?;
/// let mut y = stream.alloc_zeros::<bf16>(rows * cols)?;
/// let mut rstd = stream.alloc_zeros::<f32>(rows)?;
/// rms_norm_forward(&stream, &RmsNormArgs::new(rows, cols), &x, Some(&w), &mut y, &mut rstd)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten, never accumulated into: `y` (the `cols` elements of each row; elements between
/// rows, where `y_stride > cols`, are not written) and the first `rows` elements of `rstd`.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0, `args.eps` is
///   negative or not finite, `args.offset` is not finite, a stride is below `cols` or its rows span
///   past `usize`; `x`, `y` or `rstd` is shorter than its rows need, or `weight` is not `cols`
///   long. Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `x`, `weight`, `y` or `rstd` belongs to
///   another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `y` or `rstd` overlaps `x`, `weight` or the
///   other.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn rms_norm_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    x: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    y: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let (settings, table) = args.forward_table()?;
    let bufs = [
        read(x),
        weight.and_then(|w| read(w)),
        write(y),
        Some(Buf::F32(Access::Write(rstd))),
    ];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [x, w, y, rstd] = call.ptrs;
    let ptrs = FwdPtrs {
        x,
        add: None,
        w,
        y,
        rstd,
    };
    launch_forward::<T>(stream, args, settings, ptrs)
}

/// RMSNorm backward into a separate `dx` buffer: `dx` (rows at `y_stride`) and, when `dw` is
/// given (`cols` elements; only with a weight), the weight's gradient.
///
/// `dy` is read at `y_stride`, `x` at `x_stride`; `rstd` is the forward's output. A weight
/// with `dw = None` is frozen (LoRA/PEFT training): `dx` uses it, and no dW is computed: one
/// launch of the `bwd_dx` kernels, which hold no dW partial rows, need no scratch and fit more
/// blocks per SM, and no reduction (as without a weight). With `dw`, dW is
/// reduced on the GPU in f32 without a rows × cols temporary: each block accumulates its rows
/// into one partial row (in registers or, where that fits more blocks on an SM, in shared
/// memory), then a second launch sums the partial rows in a fixed order (deterministic). That
/// scratch (`blocks × cols` f32, blocks ≤ SMs × resident blocks per SM and ≤ max(1, 2²⁶ /
/// cols), so at most 256 MiB for rows of up to 2²⁶ columns) is allocated stream-ordered on
/// `stream` by the first call that needs that much and kept for the next calls on the same
/// stream (up to eight buffers per context, least recently used freed first;
/// [`release_scratch`](crate::release_scratch) frees them), which saves a stream-ordered
/// allocation and free per call; see the crate's *Threads and streams* for why this is safe
/// on every kind of stream and thread. A call on a stream being captured into a CUDA graph
/// allocates and frees its own scratch inside the graph (memory nodes), so such a graph can
/// have one executable instance at a time (a CUDA rule for graphs with memory nodes).
/// Outputs must not overlap inputs; use [`rms_norm_backward_inplace`] to write `dx` over `dy`.
///
/// ```no_run
/// use liger_rs::{RmsNormArgs, rms_norm_backward, rms_norm_forward};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (rows, cols) = (8, 4096);
/// let x = stream.clone_htod(&vec![0.5f32; rows * cols])?;
/// let w = stream.clone_htod(&vec![1.0f32; cols])?;
/// let (mut y, mut rstd) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(rows)?);
/// let args = RmsNormArgs::new(rows, cols);
/// rms_norm_forward(&stream, &args, &x, Some(&w), &mut y, &mut rstd)?;
/// let dy = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let (mut dx, mut dw) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(cols)?);
/// rms_norm_backward(&stream, &args, &dy, &x, Some(&w), &rstd, &mut dx, Some(&mut dw))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten, never accumulated into: `dx` (the `cols` elements of each row) and, if given,
/// `dw`, which receives this call's dW alone (zeros when `rows` is 0). Training code that
/// accumulates weight gradients over micro-batches adds `dw` into its own accumulator after
/// each call. A frozen weight (`dw = None`) gives the `dx` of a call with `dw`, the same bits
/// where both run blocks of the same size (the `bwd_dx` kernels' fewer registers can let very
/// wide rows run vector kernels where the dW kernels fall back to the scalar ones).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0, `args.eps` is
///   negative or not finite, `args.offset` is not finite, a stride is below `cols` or its rows span
///   past `usize`; `dy`, `x`, `dx` or `rstd` is shorter than its rows need; `weight` or `dw` is not
///   `cols` long; or `dw` is given without a weight (a weight without `dw` is frozen, not an
///   error). Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dy`, `x`, `weight`, `rstd`, `dx` or `dw`
///   belongs to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `dx` or `dw` overlaps `dy`, `x`, `weight`, `rstd`
///   or the other.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into
///   the stream's context (at its first launch there), the stream-ordered allocation of the dW scratch
///   (with `dw`: the first call on a stream that needs more than it keeps, and every call during
///   a graph capture), or a launch, which also fails once an earlier kernel has faulted in the
///   context. With `dw` the backward and then the dW reduction are launched: where the second
///   fails, `dx` is written and `dw` is not.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    dy: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    rstd: &impl DevicePtr<f32>,
    dx: &mut impl DevicePtrMut<T>,
    dw: Option<&mut dyn DevicePtrMut<T>>,
) -> Result<()> {
    let (dy, dx) = (read(dy), write(dx));
    backward(stream, args, [dy, dx], x, weight, rstd, dw)
}

/// RMSNorm backward writing `dx` over `dy` (Liger's memory-saving default); otherwise as
/// [`rms_norm_backward`].
///
/// ```no_run
/// use liger_rs::{RmsNormArgs, rms_norm_backward_inplace, rms_norm_forward};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (rows, cols) = (8, 4096);
/// let args = RmsNormArgs::new(rows, cols);
/// let x = stream.clone_htod(&vec![0.5f32; rows * cols])?;
/// let w = stream.clone_htod(&vec![1.0f32; cols])?;
/// let (mut y, mut rstd) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(rows)?);
/// rms_norm_forward(&stream, &args, &x, Some(&w), &mut y, &mut rstd)?;
/// let mut dy = stream.clone_htod(&vec![1.0f32; rows * cols])?; // becomes dx
/// let mut dw = stream.alloc_zeros::<f32>(cols)?;
/// rms_norm_backward_inplace(&stream, &args, &mut dy, &x, Some(&w), &rstd, Some(&mut dw))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten, never accumulated into: `dy_dx` (dX written over dY: the `cols` elements of each
/// row) and, if given, `dw`, which receives this call's dW alone (zeros when `rows` is 0).
/// Training code that accumulates weight gradients over micro-batches adds `dw` into its own
/// accumulator after each call. A weight with `dw = None` is frozen: dX alone, one launch, no
/// scratch (see [`rms_norm_backward`]).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0, `args.eps` is
///   negative or not finite, `args.offset` is not finite, a stride is below `cols` or its rows span
///   past `usize`; `dy_dx`, `x` or `rstd` is shorter than its rows need; `weight` or `dw` is not
///   `cols` long; or `dw` is given without a weight (a weight without `dw` is frozen, not an
///   error). Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dy_dx`, `x`, `weight`, `rstd` or `dw`
///   belongs to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `dy_dx` or `dw` overlaps `x`, `weight`, `rstd` or
///   the other.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into
///   the stream's context (at its first launch there), the stream-ordered allocation of the dW scratch
///   (with `dw`: the first call on a stream that needs more than it keeps, and every call during
///   a graph capture), or a launch, which also fails once an earlier kernel has faulted in the
///   context. With `dw` the backward and then the dW reduction are launched: where the second
///   fails, `dy_dx` is written and `dw` is not.
pub fn rms_norm_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    dy_dx: &mut impl DevicePtrMut<T>,
    x: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    rstd: &impl DevicePtr<f32>,
    dw: Option<&mut dyn DevicePtrMut<T>>,
) -> Result<()> {
    backward(stream, args, [write(dy_dx), None], x, weight, rstd, dw)
}

/// Shared backward: `[dy, dx]` are the first and fifth buffers of
/// [`RmsNormArgs::backward_table`] (in place, `dy_dx` and `None`).
fn backward<'b, T: Dtype>(
    stream: &'b Arc<CudaStream>,
    args: &RmsNormArgs,
    [dy, dx]: [Option<Buf<'b, T>>; 2],
    x: &'b impl DevicePtr<T>,
    weight: Option<&'b dyn DevicePtr<T>>,
    rstd: &'b impl DevicePtr<f32>,
    dw: Option<&'b mut (dyn DevicePtrMut<T> + '_)>,
) -> Result<()> {
    let in_place = dx.is_none();
    let (settings, table) = args.backward_table(in_place, weight.is_some(), dw.is_some())?;
    let bufs = [
        dy,
        read(x),
        weight.and_then(|w| read(w)),
        Some(Buf::F32(Access::Read(rstd))),
        dx,
        dw.and_then(|d| write(d)),
    ];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [dy, x, w, rstd, dx, dw] = call.ptrs;
    let dx = if in_place { dy } else { dx };
    let ptrs = BwdPtrs {
        dy,
        ds: None,
        x,
        w,
        rstd,
        dx,
        dw,
    };
    launch_backward::<T>(stream, args, settings, ptrs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::kernels;
    use crate::test_skip::Need;
    use cudarc::driver::CudaContext;
    use cudarc::driver::result::memset_d8_async;
    use half::{bf16, f16};

    /// One backward of `rows × cols` (llama, with a weight) on `stream`: dW's bits.
    fn dw_bits<T: Dtype>(stream: &Arc<CudaStream>, rows: usize, cols: usize) -> Vec<u64> {
        // Small exact values (multiples of 1/64 in [-2, 2)): a fixed input per shape.
        let value =
            |i: usize| T::from_f64((i.wrapping_mul(2_654_435_761) % 256) as f64 / 64.0 - 2.0);
        let x: Vec<T> = (0..rows * cols).map(value).collect();
        let w: Vec<T> = (0..cols).map(|i| value(i + 7)).collect();
        let dy: Vec<T> = (0..rows * cols).map(|i| value(i + 3)).collect();
        let (x, w, mut dy) = (
            stream.clone_htod(&x).unwrap(),
            stream.clone_htod(&w).unwrap(),
            stream.clone_htod(&dy).unwrap(),
        );
        let args = RmsNormArgs::new(rows, cols);
        let mut y = stream.alloc_zeros::<T>(rows * cols).unwrap();
        let mut rstd = stream.alloc_zeros::<f32>(rows).unwrap();
        rms_norm_forward(stream, &args, &x, Some(&w), &mut y, &mut rstd).unwrap();
        let mut dw = stream.alloc_zeros::<T>(cols).unwrap();
        rms_norm_backward_inplace(stream, &args, &mut dy, &x, Some(&w), &rstd, Some(&mut dw))
            .unwrap();
        let dw = stream.clone_dtoh(&dw).unwrap();
        dw.iter().map(|v| v.to_f64().to_bits()).collect()
    }

    /// Whatever the last call left in a stream's kept dW scratch must not reach the next
    /// call's dW: its backward writes every partial element the reduction reads. Between two
    /// calls on one stream the kept buffer is filled with NaN; dW must keep its bits. Shapes:
    /// the clustered shared-memory dW kernel (bf16 9600 × 2048 on an H200), dW in registers
    /// (bf16 2048 × 4096, f32 3000 × 2048), the scalar kernel (4095 columns), one row.
    #[test]
    fn gpu_a_poisoned_kept_scratch_does_not_reach_dw() {
        let ctx = match crate::cuda_context(0) {
            Ok(ctx) => ctx,
            Err(e) => {
                let test = "rms_norm::tests::gpu_a_poisoned_kept_scratch_does_not_reach_dw";
                crate::test_skip::skip(test, &format!("no GPU ({e})"), Need::Gpus(1));
                return;
            }
        };
        fn check<T: Dtype>(ctx: &Arc<CudaContext>, rows: usize, cols: usize) {
            let stream = ctx.new_stream().unwrap();
            let first = dw_bits::<T>(&stream, rows, cols);
            assert!(first.iter().all(|&b| f64::from_bits(b).is_finite()));
            let kernels = kernels(ctx).unwrap();
            let id = crate::scratch::stream_id(&stream).unwrap();
            // No other test in this binary runs a backward on the shared pool, and these
            // five streams are fewer than it keeps: this stream's buffer is there.
            let kept = kernels.scratch.kept();
            let &(_, len) = kept.iter().find(|(i, _)| *i == id).expect("kept scratch");
            kernels
                .scratch
                .with(&stream, len, |ptr| {
                    // SAFETY: `ptr` holds `len` f32, used on `stream` only.
                    unsafe { memset_d8_async(ptr, 0xFF, len * 4, stream.cu_stream()) }?;
                    Ok(())
                })
                .unwrap();
            let what = format!("{} {rows} x {cols}", T::NAME);
            assert_eq!(dw_bits::<T>(&stream, rows, cols), first, "{what}");
        }
        check::<bf16>(&ctx, 9600, 2048);
        check::<bf16>(&ctx, 2048, 4096);
        check::<f32>(&ctx, 3000, 2048);
        check::<f16>(&ctx, 700, 4095);
        check::<bf16>(&ctx, 1, 4096);
    }
}
