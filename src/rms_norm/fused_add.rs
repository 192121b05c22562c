//! Fused residual add and RMSNorm (Liger's `fused_add_rms_norm`): the launchers and their
//! validation tables. The kernels are RMSNorm's with the add compiled in (`add_fwd`,
//! `add_bwd`, `add_bwd_dx` in `kernels-gpu/src/rms_norm/`), launched by the same plan and
//! grid choice as RMSNorm ([`crate::rms_norm`]); reference:
//! [`crate::reference::fused_add_rms_norm`].
use super::args::RmsNormArgs;
use super::launch::{BwdPtrs, FwdPtrs, launch_backward, launch_forward};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::settings::LaunchSettings;
use crate::validate::{Access, Buf, Spec, Table, read, validate, write};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

impl RmsNormArgs {
    /// The buffers of [`fused_add_rms_norm_forward`] (`in_place`: of
    /// [`fused_add_rms_norm_forward_inplace`], whose `x_s` stands first, read and written, and
    /// `s` is left out), and the block shape.
    pub(crate) fn fused_add_forward_table(
        &self,
        in_place: bool,
    ) -> Result<(LaunchSettings, Table<6>)> {
        // RMSNorm's table with the residual `r` after `x` and the sum `s` before `y`.
        let (settings, table) = self.forward_table()?;
        let [x, weight, y, rstd] = table.specs;
        let specs = [
            match in_place {
                false => x,
                true => Spec::in_place("x_s", x.need),
            },
            Spec::read("r", x.need),
            weight,
            Spec::written("s", x.need),
            y,
            rstd,
        ];
        let empty = table.empty;
        Ok((settings, Table { specs, empty }))
    }

    /// The buffers of [`fused_add_rms_norm_backward`] (`in_place`: of
    /// [`fused_add_rms_norm_backward_inplace`], whose `ds_dx` stands second, read and written,
    /// and `dx` is left out), and the block shape. As RMSNorm's: `dw` needs a weight, and
    /// without rows a given `dw` is still zeroed.
    pub(crate) fn fused_add_backward_table(
        &self,
        in_place: bool,
        weight: bool,
        dw: bool,
    ) -> Result<(LaunchSettings, Table<7>)> {
        // RMSNorm's table with the sum's gradient `ds` after `dy` and `s` in place of `x`.
        let (settings, table) = self.backward_table(false, weight, dw)?;
        let [dy, x, weight, rstd, dx, dw] = table.specs;
        let specs = [
            dy,
            match in_place {
                false => Spec::read("ds", dy.need),
                true => Spec::in_place("ds_dx", dy.need),
            },
            Spec { name: "s", ..x },
            weight,
            rstd,
            dx,
            dw,
        ];
        let empty = table.empty;
        Ok((settings, Table { specs, empty }))
    }
}

/// Fused residual add and RMSNorm forward (Liger's `LigerFusedAddRMSNormFunction`): the sum
/// `s = x + r` into `s`, and `y = norm(s) · (offset + weight)` with each row's inverse RMS into
/// `rstd`, in one pass over the rows.
///
/// `s[i] = D(x[i] + r[i])`, the sum rounded once to `T` (PyTorch's `x + r` in `T`); `y` and
/// `rstd` are then exactly those of [`rms_norm_forward`](crate::rms_norm_forward) on `s`, with
/// the same `args` (casting mode, offset, eps; the same bits). `x`, `r` and `s` hold `rows`
/// rows at `args.x_stride`, `y` at `args.y_stride`; `weight`, if given, `cols` elements;
/// `rstd` at least `rows` f32. One launch on `stream`, no allocation, no synchronisation. The
/// backward ([`fused_add_rms_norm_backward`]) takes `s` in place of RMSNorm's `x`. To write
/// `s` over `x` or over `r`, use [`fused_add_rms_norm_forward_inplace`].
///
/// It reads `x`, `r` and the weight and writes `s` and `y`: 4 row-sets of traffic where an add
/// then RMSNorm moves 5 (the add's 3, RMSNorm's 2).
///
/// ```no_run
/// use liger_rs::{RmsNormArgs, fused_add_rms_norm_forward};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (rows, cols) = (8, 4096);
/// let x = stream.clone_htod(&vec![0.5f32; rows * cols])?; // a block's output
/// let r = stream.clone_htod(&vec![0.25f32; rows * cols])?; // the residual stream
/// let w = stream.clone_htod(&vec![1.0f32; cols])?;
/// let mut s = stream.alloc_zeros::<f32>(rows * cols)?; // the new residual stream
/// let (mut y, mut rstd) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(rows)?);
/// let args = RmsNormArgs::new(rows, cols);
/// fused_add_rms_norm_forward(&stream, &args, &x, &r, Some(&w), &mut s, &mut y, &mut rstd)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten: `s` and `y` (the `cols` elements of each row) and `rstd[..rows]` (in
/// [`CastingMode::None`](crate::CastingMode::None) each a value of `T` widened to f32).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0, `args.eps` is
///   negative or not finite, `args.offset` is not finite, a stride is below `cols` or its rows
///   span past `usize`; `x`, `r`, `s`, `y` or `rstd` is shorter than its rows need; `weight` is
///   not `cols` long. Each error names the argument and the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): a buffer belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `s`, `y` or `rstd` overlaps `x`, `r`,
///   `weight` or another output.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into
///   the stream's context (at its first launch there) or the launch, which also fails once an
///   earlier kernel has faulted in the context.
#[allow(clippy::too_many_arguments)]
pub fn fused_add_rms_norm_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    x: &impl DevicePtr<T>,
    r: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    s: &mut impl DevicePtrMut<T>,
    y: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward(stream, args, [read(x), write(s)], r, weight, y, rstd)
}

/// Fused residual add and RMSNorm forward writing the sum over `x_s`: `x_s ← D(x_s + r)`;
/// otherwise as [`fused_add_rms_norm_forward`]. The sum is symmetric, so to write it over the
/// residual instead, pass the residual as `x_s` and the other operand as `r`.
///
/// ```no_run
/// use liger_rs::{RmsNormArgs, fused_add_rms_norm_forward_inplace};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (rows, cols) = (8, 4096);
/// let h = stream.clone_htod(&vec![0.5f32; rows * cols])?; // a block's output
/// let mut residual = stream.clone_htod(&vec![0.25f32; rows * cols])?; // becomes h + residual
/// let (mut y, mut rstd) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(rows)?);
/// let args = RmsNormArgs::new(rows, cols);
/// fused_add_rms_norm_forward_inplace(&stream, &args, &mut residual, &h, None, &mut y, &mut rstd)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten: `x_s` (the sum, the `cols` elements of each row), `y` and `rstd[..rows]`.
///
/// # Errors
///
/// As [`fused_add_rms_norm_forward`], with `x_s` in place of `x` and `s`: `y` or `rstd`
/// overlapping `x_s`, `r`, `weight` or the other, or `x_s` overlapping `r`, is
/// [`Error::Aliasing`](crate::Error::Aliasing).
pub fn fused_add_rms_norm_forward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    x_s: &mut impl DevicePtrMut<T>,
    r: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    y: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward(stream, args, [write(x_s), None], r, weight, y, rstd)
}

/// Shared forward: `[x, s]` are the first and fourth buffers of
/// [`RmsNormArgs::fused_add_forward_table`] (in place, `x_s` and `None`).
fn forward<'b, T: Dtype>(
    stream: &'b Arc<CudaStream>,
    args: &RmsNormArgs,
    [x, s]: [Option<Buf<'b, T>>; 2],
    r: &'b impl DevicePtr<T>,
    weight: Option<&'b dyn DevicePtr<T>>,
    y: &'b mut impl DevicePtrMut<T>,
    rstd: &'b mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let in_place = s.is_none();
    let (settings, table) = args.fused_add_forward_table(in_place)?;
    let bufs = [
        x,
        read(r),
        weight.and_then(|w| read(w)),
        s,
        write(y),
        Some(Buf::F32(Access::Write(rstd))),
    ];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [x, r, w, s, y, rstd] = call.ptrs;
    let s = if in_place { x } else { s };
    let ptrs = FwdPtrs {
        x,
        add: Some((r, s)),
        w,
        y,
        rstd,
    };
    launch_forward::<T>(stream, args, settings, ptrs)
}

/// Fused residual add and RMSNorm backward into a separate `dx` buffer: the gradient of `x` and
/// of `r` (the same tensor), and with `dw` the weight's.
///
/// `dx[i] = D(dX[i] + ds[i])`: `dX` is RMSNorm's dX of `s` for `dy` (as
/// [`rms_norm_backward`](crate::rms_norm_backward) with `x = s`, before its rounding to `T`),
/// `ds` the sum's incoming gradient (the residual stream's, from the layers after), added in
/// f32 and rounded once (Liger's order). `dy`, `ds` and `dx` hold `rows` rows at
/// `args.y_stride`, `s` (the forward's sum) at `args.x_stride`; `rstd` is the forward's. dW,
/// the scratch it uses and a frozen weight (`dw = None`: dX alone, one launch) are as in
/// [`rms_norm_backward`](crate::rms_norm_backward). Outputs must not overlap inputs; use
/// [`fused_add_rms_norm_backward_inplace`] to write `dx` over `ds`.
///
/// ```no_run
/// use liger_rs::{RmsNormArgs, fused_add_rms_norm_backward};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (rows, cols) = (8, 4096);
/// let args = RmsNormArgs::new(rows, cols);
/// # let s = stream.clone_htod(&vec![0.75f32; rows * cols])?;
/// # let rstd = stream.clone_htod(&vec![1.0f32; rows])?;
/// let w = stream.clone_htod(&vec![1.0f32; cols])?;
/// // `s` and `rstd` from `fused_add_rms_norm_forward`.
/// let dy = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let ds = stream.clone_htod(&vec![0.5f32; rows * cols])?;
/// let (mut dx, mut dw) = (stream.alloc_zeros::<f32>(rows * cols)?, stream.alloc_zeros::<f32>(cols)?);
/// fused_add_rms_norm_backward(&stream, &args, &dy, &ds, &s, Some(&w), &rstd, &mut dx, Some(&mut dw))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten, never accumulated into: `dx` (the `cols` elements of each row) and, if given,
/// `dw`, which receives this call's dW alone (zeros when `rows` is 0).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0, `args.eps` is
///   negative or not finite, `args.offset` is not finite, a stride is below `cols` or its rows
///   span past `usize`; `dy`, `ds`, `s`, `dx` or `rstd` is shorter than its rows need; `weight`
///   or `dw` is not `cols` long; or `dw` is given without a weight. Each error names the
///   argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): a buffer belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `dx` or `dw` overlaps `dy`, `ds`, `s`,
///   `weight`, `rstd` or the other.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): as [`rms_norm_backward`](crate::rms_norm_backward)
///   (with `dw`, where the dW reduction's launch fails, `dx` is written and `dw` is not).
#[allow(clippy::too_many_arguments)]
pub fn fused_add_rms_norm_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    dy: &impl DevicePtr<T>,
    ds: &impl DevicePtr<T>,
    s: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    rstd: &impl DevicePtr<f32>,
    dx: &mut impl DevicePtrMut<T>,
    dw: Option<&mut dyn DevicePtrMut<T>>,
) -> Result<()> {
    backward(stream, args, dy, [read(ds), write(dx)], s, weight, rstd, dw)
}

/// Fused residual add and RMSNorm backward writing the gradient over the sum's incoming
/// gradient: `ds_dx ← D(dX + ds_dx)` (the residual stream's gradient, updated in place);
/// otherwise as [`fused_add_rms_norm_backward`].
///
/// # Outputs
///
/// Overwritten, never accumulated into: `ds_dx` (the `cols` elements of each row) and, if
/// given, `dw` (this call's dW alone; zeros when `rows` is 0).
///
/// # Errors
///
/// As [`fused_add_rms_norm_backward`], with `ds_dx` in place of `ds` and `dx`: `ds_dx` or `dw`
/// overlapping `dy`, `s`, `weight`, `rstd` or the other is
/// [`Error::Aliasing`](crate::Error::Aliasing).
#[allow(clippy::too_many_arguments)]
pub fn fused_add_rms_norm_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    dy: &impl DevicePtr<T>,
    ds_dx: &mut impl DevicePtrMut<T>,
    s: &impl DevicePtr<T>,
    weight: Option<&dyn DevicePtr<T>>,
    rstd: &impl DevicePtr<f32>,
    dw: Option<&mut dyn DevicePtrMut<T>>,
) -> Result<()> {
    backward(stream, args, dy, [write(ds_dx), None], s, weight, rstd, dw)
}

/// Shared backward: `[ds, dx]` are the second and sixth buffers of
/// [`RmsNormArgs::fused_add_backward_table`] (in place, `ds_dx` and `None`).
#[allow(clippy::too_many_arguments)]
fn backward<'b, T: Dtype>(
    stream: &'b Arc<CudaStream>,
    args: &RmsNormArgs,
    dy: &'b impl DevicePtr<T>,
    [ds, dx]: [Option<Buf<'b, T>>; 2],
    s: &'b impl DevicePtr<T>,
    weight: Option<&'b dyn DevicePtr<T>>,
    rstd: &'b impl DevicePtr<f32>,
    dw: Option<&'b mut (dyn DevicePtrMut<T> + '_)>,
) -> Result<()> {
    let in_place = dx.is_none();
    let (settings, table) =
        args.fused_add_backward_table(in_place, weight.is_some(), dw.is_some())?;
    let bufs = [
        read(dy),
        ds,
        read(s),
        weight.and_then(|w| read(w)),
        Some(Buf::F32(Access::Read(rstd))),
        dx,
        dw.and_then(|d| write(d)),
    ];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [dy, ds, x, w, rstd, dx, dw] = call.ptrs;
    let dx = if in_place { ds } else { dx };
    let ptrs = BwdPtrs {
        dy,
        ds: Some(ds),
        x,
        w,
        rstd,
        dx,
        dw,
    };
    launch_backward::<T>(stream, args, settings, ptrs)
}
