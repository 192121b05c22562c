//! [candle](https://crates.io/crates/candle-core) interop (feature `candle`): RMSNorm, RoPE and
//! SwiGLU forward and backward on CUDA [`Tensor`]s, with candle's autograd.
//!
//! candle-core 0.11 is built on the same cudarc 0.19 as this crate, so a tensor's
//! `CudaStorage` holds a `cudarc` `CudaSlice` that the launchers take as it is: inputs are
//! read in place (no copy), outputs are fresh device buffers wrapped into `CudaStorage`, and
//! every launch goes on the tensor's device stream ([`CudaDevice::cuda_stream`]), so it is
//! ordered with candle's own work on that device without any synchronisation.
//!
//! **Two ways in.**
//! * Autograd: [`rms_norm`], [`rope`], [`swiglu`] and [`swiglu_fused`] are
//!   [`CustomOp1`]/[`CustomOp2`] implementations (private types behind these functions) with
//!   a backward, so `loss.backward()` runs this crate's backward kernels. An op holds what its
//!   backward needs (RMSNorm: the forward's `rstd`; RoPE: `cos`, `sin` and the position ids)
//!   for as long as the graph holds the op. On inputs that track no gradient they are plain
//!   forward calls. The op types stay private: each function checks shapes and dtypes in
//!   candle's terms first and builds a fresh op per call (an op's saved state belongs to one
//!   forward). A custom op has one output, so [`rope`] rotates q and k into one `[q | k]`
//!   buffer and returns two views of it.
//! * Explicit: [`rms_norm_forward`] (which also returns `rstd`), [`rms_norm_backward`],
//!   [`rope_backward`], [`swiglu_backward`] and [`swiglu_fused_backward`] return new tensors
//!   and build no graph, for code that keeps its own gradients.
//!
//! **Layouts.** Inputs are used in place when contiguous, with or without a start offset
//! (e.g. `narrow` on the first dim); a non-contiguous input (a transpose, a broadcast, a
//! column slice) is first copied by [`Tensor::contiguous`], which candle's autograd tracks.
//! Outputs are contiguous. The last dim is the row (`cols`) of RMSNorm and SwiGLU; all
//! leading dims are rows.
//!
//! **Dtypes**: f32, f16 and bf16; every tensor of one call has the same dtype, except `rstd`
//! (f32) and RoPE position ids (i64 or i32). Empty tensors are an error (CUDA allocates no
//! empty buffer).
//!
//! **Building**: candle-core's `cuda` feature compiles its kernels with nvcc and links cuBLAS,
//! cuRAND, cudart and the driver, so this feature needs a CUDA toolkit at build time (the
//! repository's `.ci/cuda-env.sh` installs one from PyPI) and those libraries at run time.
//!
//! **Errors.** A tensor on the CPU (or Metal) device, a wrong dtype, or a wrong shape is a
//! [`candle_core::Error`] naming the op and the tensor. An error of this crate's launchers
//! comes back as [`candle_core::Error::Cuda`] holding the [`crate::Error`] (downcast it to
//! match on it); its argument names are those of the plain API call the op maps to.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor, Var};
//! use liger_rs::candle::{RmsNormConfig, rms_norm, swiglu, SwigluConfig};
//!
//! let dev = Device::new_cuda(0)?;
//! let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 128, 4096), &dev)?.to_dtype(DType::BF16)?)?;
//! let w = Var::from_tensor(&Tensor::ones(4096, DType::BF16, &dev)?)?;
//! let y = rms_norm(x.as_tensor(), Some(w.as_tensor()), &RmsNormConfig::default())?;
//! let h = swiglu(&y, x.as_tensor(), &SwigluConfig::default())?; // gate y, up x
//! let grads = h.to_dtype(DType::F32)?.sum_all()?.backward()?;
//! let (dx, dw) = (grads.get(&x).unwrap(), grads.get(&w).unwrap());
//! # let _ = (dx, dw);
//! # Ok::<(), candle_core::Error>(())
//! ```
use crate::{CastingMode, CosSinLayout, Dtype, PositionIds, RmsNormArgs, RopeArgs, SwigluArgs};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor,
};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// Runs `$f::<T>(args)` for the element type of `$dtype` (f32, f16 or bf16), or returns
/// candle's unsupported-dtype error for `$op`.
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other, $op)),
        }
    };
}

/// An element type of both this crate's kernels and candle's CUDA storage.
trait Elem: Dtype + CudaDType {}
impl<T: Dtype + CudaDType> Elem for T {}

const RMS_NORM: &str = "liger-rs rms_norm";
const ROPE: &str = "liger-rs rope";
const SWIGLU: &str = "liger-rs swiglu";
const SWIGLU_FUSED: &str = "liger-rs swiglu_fused";

/// A launcher error as a candle error (downcastable to [`crate::Error`]).
fn launch_err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

fn not_cuda(op: &str, name: &str, device: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: `{name}` is on the {device} device; these ops run on CUDA tensors only \
         (Device::new_cuda)"
    ))
}

/// The CUDA storage of a locked tensor storage, or an error naming the tensor.
fn cuda<'a>(storage: &'a Storage, op: &str, name: &str) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(not_cuda(op, name, "CPU")),
        Storage::Metal(_) => Err(not_cuda(op, name, "Metal")),
    }
}

/// The elements a contiguous `layout` covers in `storage`, as a view (no copy).
fn view<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &'static str,
) -> Result<CudaView<'a, T>> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or(candle_core::Error::RequiresContiguous { op })?;
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// Device buffer for `len ≥ 1` elements that the kernel writes in full (CUDA allocates no
/// empty buffers, so an empty output is an error naming `op`).
fn output<T: Elem>(stream: &Arc<CudaStream>, len: usize, op: &str) -> Result<CudaSlice<T>> {
    if len == 0 {
        return Err(candle_core::Error::Msg(format!(
            "{op}: empty tensors are not supported (CUDA cannot allocate an empty output)"
        )));
    }
    // SAFETY: every caller passes the buffer to a launch that writes each of its elements
    // before anything reads it.
    unsafe { stream.alloc::<T>(len) }.map_err(|e| launch_err(e.into()))
}

fn wrap<T: Elem>(slice: CudaSlice<T>, device: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, device.clone())
}

/// A tensor over `storage` that builds no graph.
fn tensor(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// The `(rows, cols)` of a tensor whose last dim is the row: `cols` is the last dim (1 for a
/// scalar), `rows` the product of the others.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape.dims().last().copied().unwrap_or(1);
    let rows = shape.dims().iter().rev().skip(1).product();
    (rows, cols)
}

fn same_dtype(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
    if lhs.dtype() == rhs.dtype() {
        Ok(())
    } else {
        Err(candle_core::Error::DTypeMismatchBinaryOp {
            lhs: lhs.dtype(),
            rhs: rhs.dtype(),
            op,
        })
    }
}

fn same_shape(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
    if lhs.dims() == rhs.dims() {
        Ok(())
    } else {
        Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: lhs.shape().clone(),
            rhs: rhs.shape().clone(),
            op,
        })
    }
}

fn cpu_unsupported(op: &str) -> Result<(CpuStorage, Shape)> {
    Err(not_cuda(op, "input", "CPU"))
}

// ---------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------

/// RMSNorm parameters (the shape comes from the tensors): `eps`, the weight `offset` and the
/// [`CastingMode`]; see [`RmsNormArgs`] for their meaning and limits.
///
/// ```
/// use liger_rs::{CastingMode, candle::RmsNormConfig};
/// // Gemma: (1 + w) weights, f32 math throughout.
/// let gemma = RmsNormConfig { eps: 1e-6, offset: 1.0, mode: CastingMode::Gemma };
/// assert_eq!(RmsNormConfig::default().mode, CastingMode::Llama);
/// # let _ = gemma;
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormConfig {
    /// Added to the mean square before the inverse square root (finite, ≥ 0).
    pub eps: f32,
    /// Added to the weight (`1.0` for Gemma-style `(1 + w)` weights).
    pub offset: f32,
    /// Where values are rounded to the tensor dtype.
    pub mode: CastingMode,
}

impl Default for RmsNormConfig {
    /// `eps = 1e-6`, `offset = 0`, [`CastingMode::Llama`] (as [`RmsNormArgs::new`]).
    fn default() -> Self {
        RmsNormConfig {
            eps: 1e-6,
            offset: 0.0,
            mode: CastingMode::Llama,
        }
    }
}

impl RmsNormConfig {
    fn args(&self, rows: usize, cols: usize) -> RmsNormArgs {
        RmsNormArgs::new(rows, cols)
            .with_eps(self.eps)
            .with_offset(self.offset)
            .with_mode(self.mode)
    }
}

/// Checks the weight of an RMSNorm over rows of `cols`: shape `[cols]`, the dtype of `x`.
fn check_weight(x: &Tensor, weight: &Tensor) -> Result<()> {
    same_dtype(RMS_NORM, x, weight)?;
    let cols = rows_cols(x.shape()).1;
    if weight.dims() != [cols] {
        return Err(candle_core::Error::Msg(format!(
            "{RMS_NORM}: `weight` must have shape [{cols}] (the last dim of `x` {:?}), got {:?}",
            x.dims(),
            weight.dims()
        )));
    }
    Ok(())
}

/// Forward on storages: `y` (the shape of `x`) and `rstd` (`rows` f32).
fn rms_norm_fwd_storage(
    cfg: &RmsNormConfig,
    x: (&CudaStorage, &Layout),
    weight: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: Elem>(
        cfg: &RmsNormConfig,
        x: (&CudaStorage, &Layout),
        weight: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let device = &x.0.device;
        let stream = device.cuda_stream();
        let (rows, cols) = rows_cols(x.1.shape());
        let x_view = view::<T>(x.0, x.1, RMS_NORM)?;
        let w_view = weight.map(|(s, l)| view::<T>(s, l, RMS_NORM)).transpose()?;
        let mut y = output::<T>(&stream, rows * cols, RMS_NORM)?;
        let mut rstd = output::<f32>(&stream, rows, RMS_NORM)?;
        crate::rms_norm_forward(
            &stream,
            &cfg.args(rows, cols),
            &x_view,
            w_view.as_ref(),
            &mut y,
            &mut rstd,
        )
        .map_err(launch_err)?;
        Ok((wrap(y, device), wrap(rstd, device)))
    }
    by_dtype!(x.0.dtype(), RMS_NORM, run(cfg, x, weight))
}

/// RMSNorm forward with candle autograd: `y = norm(x) · (offset + weight)` over the last dim
/// of `x`.
///
/// `x`: `[..., cols]` (any rank ≥ 1, `cols ≥ 1`); `weight`: `[cols]`, the dtype of `x`
/// (without it `y` is the normalised `x`). Returns `y`, shaped like `x`. When `x` or `weight`
/// tracks gradients, the backward ([`rms_norm_backward`]'s kernels) gives `dx` and `dw`; the
/// op keeps the forward's `rstd` (`rows` f32) for it. One forward launch, as
/// [`crate::rms_norm_forward`].
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor, Var};
/// use liger_rs::candle::{RmsNormConfig, rms_norm};
/// let dev = Device::new_cuda(0)?;
/// let x = Var::randn(0f32, 1.0, (8, 4096), &dev)?;
/// let w = Tensor::ones(4096, DType::F32, &dev)?;
/// let y = rms_norm(x.as_tensor(), Some(&w), &RmsNormConfig { eps: 1e-5, ..Default::default() })?;
/// let dx = y.sum_all()?.backward()?.get(&x).cloned();
/// # let _ = dx;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(x: &Tensor, weight: Option<&Tensor>, cfg: &RmsNormConfig) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = RmsNormOp {
        cfg: *cfg,
        rstd: Mutex::new(None),
    };
    match weight {
        Some(w) => {
            check_weight(&x, w)?;
            x.apply_op2(&w.contiguous()?, op)
        }
        None => x.apply_op1(op),
    }
}

/// RMSNorm forward without autograd: returns `(y, rstd)`, `y` shaped like `x` and `rstd` the
/// f32 inverse RMS of each row, shaped like `x` without its last dim — what
/// [`rms_norm_backward`] takes. Arguments as [`rms_norm`].
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{RmsNormConfig, rms_norm_backward, rms_norm_forward};
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1.0, (8, 4096), &dev)?.to_dtype(DType::F16)?;
/// let w = Tensor::ones(4096, DType::F16, &dev)?;
/// let cfg = RmsNormConfig::default();
/// let (y, rstd) = rms_norm_forward(&x, Some(&w), &cfg)?;
/// let dy = y.ones_like()?;
/// let (dx, dw) = rms_norm_backward(&dy, &x, Some(&w), &rstd, &cfg)?;
/// # let _ = (dx, dw);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm_forward(
    x: &Tensor,
    weight: Option<&Tensor>,
    cfg: &RmsNormConfig,
) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let weight = weight
        .map(|w| check_weight(&x, w).and_then(|()| w.contiguous()))
        .transpose()?;
    let (x_storage, x_layout) = x.storage_and_layout();
    let x_cuda = cuda(&x_storage, RMS_NORM, "x")?;
    let w_guard = weight.as_ref().map(|w| w.storage_and_layout());
    let w_cuda = match &w_guard {
        Some((s, l)) => Some((cuda(s, RMS_NORM, "weight")?, *l)),
        None => None,
    };
    let (y, rstd) = rms_norm_fwd_storage(cfg, (x_cuda, x_layout), w_cuda)?;
    let rows = x.dims()[..x.rank().saturating_sub(1)].to_vec();
    Ok((tensor(y, x.shape().clone()), tensor(rstd, rows)))
}

/// RMSNorm backward without autograd: returns `(dx, dw)` from `dy` (shaped like `x`), the
/// forward's `x`, `weight` and `rstd` (f32, one per row, any shape with that many elements).
/// `dw` is `Some` exactly when `weight` is; it is reduced on the GPU deterministically (see
/// [`crate::rms_norm_backward`], which this calls: two launches and a stream-ordered f32
/// scratch with a weight, one launch without).
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::candle::{RmsNormConfig, rms_norm_backward, rms_norm_forward};
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1.0, (8, 4096), &dev)?;
/// let cfg = RmsNormConfig::default();
/// let (y, rstd) = rms_norm_forward(&x, None, &cfg)?;
/// let (dx, dw) = rms_norm_backward(&y.ones_like()?, &x, None, &rstd, &cfg)?;
/// assert!(dw.is_none());
/// # let _ = dx;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: Option<&Tensor>,
    rstd: &Tensor,
    cfg: &RmsNormConfig,
) -> Result<(Tensor, Option<Tensor>)> {
    same_shape(RMS_NORM, dy, x)?;
    same_dtype(RMS_NORM, dy, x)?;
    if let Some(w) = weight {
        check_weight(x, w)?;
    }
    let (rows, cols) = rows_cols(x.shape());
    if rstd.dtype() != DType::F32 || rstd.elem_count() != rows {
        return Err(candle_core::Error::Msg(format!(
            "{RMS_NORM}: `rstd` must be f32 with one element per row ({rows}), got {:?} {:?}",
            rstd.dtype(),
            rstd.dims()
        )));
    }
    let (dy, x, rstd) = (dy.contiguous()?, x.contiguous()?, rstd.contiguous()?);
    let weight = weight.map(Tensor::contiguous).transpose()?;

    let (dy_s, dy_l) = dy.storage_and_layout();
    let (x_s, x_l) = x.storage_and_layout();
    let (r_s, r_l) = rstd.storage_and_layout();
    let w_guard = weight.as_ref().map(|w| w.storage_and_layout());
    let w_cuda = match &w_guard {
        Some((s, l)) => Some((cuda(s, RMS_NORM, "weight")?, *l)),
        None => None,
    };
    let inputs = RmsNormGrads {
        dy: (cuda(&dy_s, RMS_NORM, "dy")?, dy_l),
        x: (cuda(&x_s, RMS_NORM, "x")?, x_l),
        weight: w_cuda,
        rstd: (cuda(&r_s, RMS_NORM, "rstd")?, r_l),
    };
    let (dx, dw) = rms_norm_bwd_storage(cfg, rows, cols, &inputs)?;
    Ok((tensor(dx, x.shape().clone()), dw.map(|dw| tensor(dw, cols))))
}

/// The inputs of the RMSNorm backward, as storages and layouts.
struct RmsNormGrads<'a> {
    dy: (&'a CudaStorage, &'a Layout),
    x: (&'a CudaStorage, &'a Layout),
    weight: Option<(&'a CudaStorage, &'a Layout)>,
    rstd: (&'a CudaStorage, &'a Layout),
}

fn rms_norm_bwd_storage(
    cfg: &RmsNormConfig,
    rows: usize,
    cols: usize,
    inputs: &RmsNormGrads<'_>,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    fn run<T: Elem>(
        cfg: &RmsNormConfig,
        rows: usize,
        cols: usize,
        inputs: &RmsNormGrads<'_>,
    ) -> Result<(CudaStorage, Option<CudaStorage>)> {
        let device = &inputs.x.0.device;
        let stream = device.cuda_stream();
        let dy = view::<T>(inputs.dy.0, inputs.dy.1, RMS_NORM)?;
        let x = view::<T>(inputs.x.0, inputs.x.1, RMS_NORM)?;
        let rstd = view::<f32>(inputs.rstd.0, inputs.rstd.1, RMS_NORM)?;
        let w = inputs
            .weight
            .map(|(s, l)| view::<T>(s, l, RMS_NORM))
            .transpose()?;
        let mut dx = output::<T>(&stream, rows * cols, RMS_NORM)?;
        let mut dw = match w {
            Some(_) => Some(output::<T>(&stream, cols, RMS_NORM)?),
            None => None,
        };
        crate::rms_norm_backward(
            &stream,
            &cfg.args(rows, cols),
            &dy,
            &x,
            w.as_ref(),
            &rstd,
            &mut dx,
            dw.as_mut().map(|d| d.as_view_mut()).as_mut(),
        )
        .map_err(launch_err)?;
        Ok((wrap(dx, device), dw.map(|dw| wrap(dw, device))))
    }
    by_dtype!(inputs.x.0.dtype(), RMS_NORM, run(cfg, rows, cols, inputs))
}

/// The autograd op of [`rms_norm`] (one input without a weight, two with), keeping the
/// forward's `rstd` for the backward.
struct RmsNormOp {
    cfg: RmsNormConfig,
    rstd: Mutex<Option<Tensor>>,
}

impl RmsNormOp {
    fn forward(
        &self,
        x: (&CudaStorage, &Layout),
        weight: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let (y, rstd) = rms_norm_fwd_storage(&self.cfg, x, weight)?;
        let rows = rows_cols(x.1.shape()).0;
        *self.rstd.lock().unwrap_or_else(|p| p.into_inner()) = Some(tensor(rstd, rows));
        Ok((y, x.1.shape().clone()))
    }

    fn backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let rstd = self
            .rstd
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("{RMS_NORM}: backward before forward"))
            })?;
        rms_norm_backward(grad, x, weight, &rstd, &self.cfg)
    }
}

impl CustomOp1 for RmsNormOp {
    fn name(&self) -> &'static str {
        RMS_NORM
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported(RMS_NORM)
    }

    fn cuda_fwd(&self, x: &CudaStorage, x_l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.forward((x, x_l), None)
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.backward(x, None, grad)?.0))
    }
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        RMS_NORM
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported(RMS_NORM)
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.forward((x, x_l), Some((w, w_l)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.backward(x, Some(w), grad)?;
        Ok((Some(dx), dw))
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------

/// What a RoPE call rotates by: `cos`, `sin` and the optional position ids, checked against
/// the shapes of q and k.
struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    position_ids: Option<Tensor>,
    args: RopeArgs,
}

impl RopeTables {
    /// Checks q `[B, S, Hq, d]`, k `[B, S, Hk, d]`, cos/sin and the ids; the rotary dim is the
    /// last dim of cos.
    fn new(
        q: &Tensor,
        k: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        position_ids: Option<&Tensor>,
    ) -> Result<Self> {
        let bad = |what: String| Err(candle_core::Error::Msg(format!("{ROPE}: {what}")));
        let (&[b, s, hq, d], &[kb, ks, hk, kd]) = (q.dims(), k.dims()) else {
            return bad(format!(
                "q and k must be [batch, seq_len, heads, head_dim], got {:?} and {:?}",
                q.dims(),
                k.dims()
            ));
        };
        if (kb, ks, kd) != (b, s, d) {
            return bad(format!(
                "k {:?} must match q {:?} in batch, seq_len and head_dim",
                k.dims(),
                q.dims()
            ));
        }
        same_dtype(ROPE, q, k)?;
        same_dtype(ROPE, q, cos)?;
        same_shape(ROPE, cos, sin)?;
        same_dtype(ROPE, cos, sin)?;
        let r = cos.dims().last().copied().unwrap_or(0);
        let rows_ok = match (cos.dims(), position_ids) {
            (&[_, _], Some(ids)) => {
                if ids.dims() != [b, s] || !matches!(ids.dtype(), DType::I64 | DType::I32) {
                    return bad(format!(
                        "position_ids must be i64 or i32 [{b}, {s}], got {:?} {:?}",
                        ids.dtype(),
                        ids.dims()
                    ));
                }
                true
            }
            (&[rows, _], None) => rows == s,
            (&[cb, cs, _], None) => (cb == b || cb == 1) && cs == s,
            _ => false,
        };
        if !rows_ok || r == 0 {
            return bad(format!(
                "cos/sin must be [seq_len, rotary_dim], [batch, seq_len, rotary_dim] or [1, \
                 seq_len, rotary_dim] (or [max_pos, rotary_dim] with position_ids) for q {:?}, \
                 got {:?}",
                q.dims(),
                cos.dims()
            ));
        }
        Ok(RopeTables {
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            position_ids: position_ids.map(Tensor::contiguous).transpose()?,
            args: RopeArgs::new(b, s, hq, hk, d).with_rotary_dim(r),
        })
    }

    /// Elements of q and of k.
    fn lens(&self) -> (usize, usize) {
        let a = &self.args;
        let tokens = a.batch * a.seq_len;
        (
            tokens * a.q_heads * a.head_dim,
            tokens * a.k_heads * a.head_dim,
        )
    }

    /// Copies q and k (contiguous storages) into one new buffer `[q | k]` and rotates both
    /// halves in place in one launch: forward by θ, or backward by −θ.
    fn rotate(
        &self,
        q: (&CudaStorage, &Layout),
        k: (&CudaStorage, &Layout),
        backward: bool,
    ) -> Result<CudaStorage> {
        fn run<T: Elem>(
            t: &RopeTables,
            q: (&CudaStorage, &Layout),
            k: (&CudaStorage, &Layout),
            backward: bool,
        ) -> Result<CudaStorage> {
            let device = &q.0.device;
            let stream = device.cuda_stream();
            let (q_len, k_len) = t.lens();
            let (q_in, k_in) = (view::<T>(q.0, q.1, ROPE)?, view::<T>(k.0, k.1, ROPE)?);
            let (cos_s, cos_l) = t.cos.storage_and_layout();
            let (sin_s, sin_l) = t.sin.storage_and_layout();
            let cos = view::<T>(cuda(&cos_s, ROPE, "cos")?, cos_l, ROPE)?;
            let sin = view::<T>(cuda(&sin_s, ROPE, "sin")?, sin_l, ROPE)?;
            let ids_guard = t.position_ids.as_ref().map(|p| p.storage_and_layout());
            let layout = match (&ids_guard, t.cos.rank()) {
                (Some((s, l)), _) => {
                    let ids = cuda(s, ROPE, "position_ids")?;
                    CosSinLayout::Gathered(match ids.dtype() {
                        DType::I32 => PositionIds::DeviceI32(view(ids, l, ROPE)?),
                        _ => PositionIds::DeviceI64(view(ids, l, ROPE)?),
                    })
                }
                (None, 3) if t.cos.dims()[0] == t.args.batch => CosSinLayout::PerBatch,
                (None, _) => CosSinLayout::PerPosition,
            };
            let mut out = output::<T>(&stream, q_len + k_len, ROPE)?;
            let (mut q_out, mut k_out) = out.split_at_mut(q_len);
            copy(&stream, &q_in, &mut q_out)?;
            copy(&stream, &k_in, &mut k_out)?;
            let rotate = if backward {
                crate::rope_backward
            } else {
                crate::rope_forward
            };
            rotate(
                &stream, &t.args, &mut q_out, &mut k_out, &cos, &sin, &layout,
            )
            .map_err(launch_err)?;
            Ok(wrap(out, device))
        }
        by_dtype!(q.0.dtype(), ROPE, run(self, q, k, backward))
    }

    /// `[q | k]` as two tensors shaped like q and k (views of `packed`, no copy).
    fn split(&self, packed: &Tensor) -> Result<(Tensor, Tensor)> {
        let a = &self.args;
        let (q_len, k_len) = self.lens();
        let q = packed.narrow(0, 0, q_len)?;
        let k = packed.narrow(0, q_len, k_len)?;
        Ok((
            q.reshape((a.batch, a.seq_len, a.q_heads, a.head_dim))?,
            k.reshape((a.batch, a.seq_len, a.k_heads, a.head_dim))?,
        ))
    }
}

/// Stream-ordered device copy of `src` into `dst` (same length).
fn copy<T: Elem>(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, T>,
    dst: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    stream
        .memcpy_dtod(src, dst)
        .map_err(|e| launch_err(e.into()))
}

/// RoPE forward with candle autograd (NeoX half-split rotation, as [`crate::rope_forward`]):
/// returns the rotated `(q, k)`.
///
/// * `q`: `[batch, seq_len, q_heads, head_dim]`, `k`: `[batch, seq_len, k_heads, head_dim]`
///   (HF's `proj(h).view(B, S, H, d)` before its `transpose(1, 2)`; a transposed
///   `[B, H, S, d]` tensor is copied to this layout first).
/// * `cos`, `sin`: rows of `rotary_dim ≤ head_dim` elements (HF's `cat(freqs, freqs)`; only
///   the first half of a row is read; dims past `rotary_dim` pass through), shaped
///   `[seq_len, rotary_dim]` or `[1, seq_len, rotary_dim]` (shared by the batch),
///   `[batch, seq_len, rotary_dim]` (per batch row, what HF's rotary embedding returns), or
///   `[max_pos, rotary_dim]` with `position_ids` `[batch, seq_len]` (i64 or i32, on the
///   device: clamped into the table by the kernel, see [`PositionIds::DeviceI64`]).
///
/// The inputs are not modified: q and k are copied into one new `[q | k]` buffer that one
/// launch rotates in place, and the results are views of it. The backward rotates the
/// gradients by −θ in one launch; `cos`, `sin` and the ids get no gradient.
///
/// ```no_run
/// use candle_core::{D, DType, Device, Tensor};
/// use liger_rs::candle::rope;
/// let dev = Device::new_cuda(0)?;
/// let (b, s, hq, hk, d) = (2, 16, 32, 8, 128);
/// let q = Tensor::randn(0f32, 1.0, (b, s, hq, d), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev)?;
/// let inv_freq: Vec<f32> = (0..d / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / d as f32)).collect();
/// let pos = Tensor::arange(0u32, s as u32, &dev)?.to_dtype(DType::F32)?;
/// let freqs = pos.unsqueeze(1)?.broadcast_mul(&Tensor::new(inv_freq, &dev)?.unsqueeze(0)?)?;
/// let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?; // [s, d]
/// let (q, k) = rope(&q, &k, &emb.cos()?, &emb.sin()?, None)?;
/// # let _ = (q, k);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let tables = Arc::new(RopeTables::new(q, k, cos, sin, position_ids)?);
    let packed = q.contiguous()?.apply_op2(
        &k.contiguous()?,
        RopeOp {
            tables: tables.clone(),
        },
    )?;
    tables.split(&packed)
}

/// RoPE backward without autograd: rotates the gradients `dq`, `dk` (shaped like the
/// forward's q and k) by −θ and returns them as new tensors; the inputs are not modified.
/// `cos`, `sin` and `position_ids` are those of the forward ([`rope`]). One launch (after a
/// device copy of `dq` and `dk`).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::rope_backward;
/// let dev = Device::new_cuda(0)?;
/// let (b, s, hq, hk, d) = (1, 16, 8, 2, 64);
/// let dq = Tensor::ones((b, s, hq, d), DType::F32, &dev)?;
/// let dk = Tensor::ones((b, s, hk, d), DType::F32, &dev)?;
/// let cos = Tensor::ones((s, d), DType::F32, &dev)?; // θ = 0: the identity
/// let sin = Tensor::zeros((s, d), DType::F32, &dev)?;
/// let (dq2, dk2) = rope_backward(&dq, &dk, &cos, &sin, None)?;
/// # let _ = (dq2, dk2);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_backward(
    dq: &Tensor,
    dk: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let tables = RopeTables::new(dq, dk, cos, sin, position_ids)?;
    let (dq, dk) = (dq.contiguous()?, dk.contiguous()?);
    let (q_s, q_l) = dq.storage_and_layout();
    let (k_s, k_l) = dk.storage_and_layout();
    let packed = tables.rotate(
        (cuda(&q_s, ROPE, "dq")?, q_l),
        (cuda(&k_s, ROPE, "dk")?, k_l),
        true,
    )?;
    let (q_len, k_len) = tables.lens();
    tables.split(&tensor(packed, q_len + k_len))
}

/// The autograd op of [`rope`]: inputs q and k, output `[q | k]` flattened.
struct RopeOp {
    tables: Arc<RopeTables>,
}

impl CustomOp2 for RopeOp {
    fn name(&self) -> &'static str {
        ROPE
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported(ROPE)
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (q_len, k_len) = self.tables.lens();
        let packed = self.tables.rotate((q, q_l), (k, k_l), false)?;
        Ok((packed, Shape::from(q_len + k_len)))
    }

    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let t = &self.tables;
        let (dq, dk) = t.split(&grad.contiguous()?)?;
        let (dq, dk) = rope_backward(&dq, &dk, &t.cos, &t.sin, t.position_ids.as_ref())?;
        Ok((Some(dq), Some(dk)))
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------------------------

/// SwiGLU multipliers: the gate is `a·gate_multiplier`, the backward uses
/// `dc·down_multiplier` (both 1 by default; see [`SwigluArgs`]).
///
/// ```
/// let cfg = liger_rs::candle::SwigluConfig { gate_multiplier: 0.5, ..Default::default() };
/// assert_eq!(cfg.down_multiplier, 1.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwigluConfig {
    /// `gm`: the gate is `z = a·gm` (finite).
    pub gate_multiplier: f32,
    /// `dm`: the backward uses `dc·dm` as the gradient of `c` (finite).
    pub down_multiplier: f32,
}

impl Default for SwigluConfig {
    /// Both multipliers 1 (plain SwiGLU).
    fn default() -> Self {
        SwigluConfig {
            gate_multiplier: 1.0,
            down_multiplier: 1.0,
        }
    }
}

impl SwigluConfig {
    fn apply(&self, args: SwigluArgs) -> SwigluArgs {
        args.with_gate_multiplier(self.gate_multiplier)
            .with_down_multiplier(self.down_multiplier)
    }
}

/// The `(rows, cols)` of the fused gate-up tensor `[..., 2·cols]`.
fn fused_rows_cols(gate_up: &Tensor) -> Result<(usize, usize)> {
    let (rows, width) = rows_cols(gate_up.shape());
    if gate_up.rank() == 0 || !width.is_multiple_of(2) {
        return Err(candle_core::Error::Msg(format!(
            "{SWIGLU_FUSED}: `gate_up` must be [..., 2·cols] (an even last dim), got {:?}",
            gate_up.dims()
        )));
    }
    Ok((rows, width / 2))
}

/// The shape of `c` for a fused gate-up tensor: its last dim halved.
fn fused_out_shape(gate_up: &Shape) -> Shape {
    let mut dims = gate_up.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

/// SwiGLU forward on storages: separate `a`, `b` (`Some(b)`) or fused `a = [gate | up]`
/// (`None`), into a new `c` of `rows × cols`.
fn swiglu_fwd_storage(
    cfg: &SwigluConfig,
    rows: usize,
    cols: usize,
    a: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        cfg: &SwigluConfig,
        rows: usize,
        cols: usize,
        a: (&CudaStorage, &Layout),
        b: Option<(&CudaStorage, &Layout)>,
    ) -> Result<CudaStorage> {
        let device = &a.0.device;
        let stream = device.cuda_stream();
        let a_view = view::<T>(a.0, a.1, SWIGLU)?;
        let mut c = output::<T>(&stream, rows * cols, SWIGLU)?;
        match b {
            Some((b, b_l)) => crate::swiglu_forward(
                &stream,
                &cfg.apply(SwigluArgs::new(rows, cols)),
                &a_view,
                &view::<T>(b, b_l, SWIGLU)?,
                &mut c,
            ),
            None => crate::swiglu_forward_fused(
                &stream,
                &cfg.apply(SwigluArgs::fused(rows, cols)),
                &a_view,
                &mut c,
            ),
        }
        .map_err(launch_err)?;
        Ok(wrap(c, device))
    }
    by_dtype!(a.0.dtype(), SWIGLU, run(cfg, rows, cols, a, b))
}

/// SwiGLU backward on storages, separate layout: `(da, db)`.
fn swiglu_bwd_storage(
    cfg: &SwigluConfig,
    rows: usize,
    cols: usize,
    [dc, a, b]: [(&CudaStorage, &Layout); 3],
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: Elem>(
        cfg: &SwigluConfig,
        rows: usize,
        cols: usize,
        [dc, a, b]: [(&CudaStorage, &Layout); 3],
    ) -> Result<(CudaStorage, CudaStorage)> {
        let device = &a.0.device;
        let stream = device.cuda_stream();
        let n = rows * cols;
        let (mut da, mut db) = (
            output::<T>(&stream, n, SWIGLU)?,
            output::<T>(&stream, n, SWIGLU)?,
        );
        crate::swiglu_backward(
            &stream,
            &cfg.apply(SwigluArgs::new(rows, cols)),
            &view::<T>(dc.0, dc.1, SWIGLU)?,
            &view::<T>(a.0, a.1, SWIGLU)?,
            &view::<T>(b.0, b.1, SWIGLU)?,
            &mut da,
            &mut db,
        )
        .map_err(launch_err)?;
        Ok((wrap(da, device), wrap(db, device)))
    }
    by_dtype!(a.0.dtype(), SWIGLU, run(cfg, rows, cols, [dc, a, b]))
}

/// SwiGLU backward on storages, fused layout: `d_gate_up`.
fn swiglu_fused_bwd_storage(
    cfg: &SwigluConfig,
    rows: usize,
    cols: usize,
    [dc, gate_up]: [(&CudaStorage, &Layout); 2],
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        cfg: &SwigluConfig,
        rows: usize,
        cols: usize,
        [dc, gate_up]: [(&CudaStorage, &Layout); 2],
    ) -> Result<CudaStorage> {
        let device = &gate_up.0.device;
        let stream = device.cuda_stream();
        let mut d = output::<T>(&stream, 2 * rows * cols, SWIGLU_FUSED)?;
        crate::swiglu_backward_fused(
            &stream,
            &cfg.apply(SwigluArgs::fused(rows, cols)),
            &view::<T>(dc.0, dc.1, SWIGLU_FUSED)?,
            &view::<T>(gate_up.0, gate_up.1, SWIGLU_FUSED)?,
            &mut d,
        )
        .map_err(launch_err)?;
        Ok(wrap(d, device))
    }
    by_dtype!(
        gate_up.0.dtype(),
        SWIGLU_FUSED,
        run(cfg, rows, cols, [dc, gate_up])
    )
}

/// SwiGLU forward with candle autograd: `c = silu(a·gm) · b` element-wise (gate `a`, up `b`,
/// same shape and dtype; rounding as [`crate::swiglu_forward`]). Returns `c`, shaped like `a`.
/// When `a` or `b` tracks gradients, the backward gives `da` and `db` in one launch
/// (recomputing silu from `a` and `b`, as Liger).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{SwigluConfig, swiglu};
/// let dev = Device::new_cuda(0)?;
/// let gate = Tensor::randn(0f32, 1.0, (8, 14336), &dev)?.to_dtype(DType::BF16)?;
/// let up = Tensor::randn(0f32, 1.0, (8, 14336), &dev)?.to_dtype(DType::BF16)?;
/// let c = swiglu(&gate, &up, &SwigluConfig::default())?;
/// # let _ = c;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu(a: &Tensor, b: &Tensor, cfg: &SwigluConfig) -> Result<Tensor> {
    same_shape(SWIGLU, a, b)?;
    same_dtype(SWIGLU, a, b)?;
    a.contiguous()?
        .apply_op2(&b.contiguous()?, SwigluOp { cfg: *cfg })
}

/// SwiGLU backward without autograd: returns `(da, db)` from `dc` and the forward's `a`, `b`
/// (all of one shape and dtype), as [`crate::swiglu_backward`].
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::candle::{SwigluConfig, swiglu_backward};
/// let dev = Device::new_cuda(0)?;
/// let a = Tensor::randn(0f32, 1.0, (8, 14336), &dev)?;
/// let b = Tensor::randn(0f32, 1.0, (8, 14336), &dev)?;
/// let (da, db) = swiglu_backward(&a.ones_like()?, &a, &b, &SwigluConfig::default())?;
/// # let _ = (da, db);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_backward(
    dc: &Tensor,
    a: &Tensor,
    b: &Tensor,
    cfg: &SwigluConfig,
) -> Result<(Tensor, Tensor)> {
    same_shape(SWIGLU, a, b)?;
    same_shape(SWIGLU, dc, a)?;
    same_dtype(SWIGLU, a, b)?;
    same_dtype(SWIGLU, dc, a)?;
    let (dc, a, b) = (dc.contiguous()?, a.contiguous()?, b.contiguous()?);
    let (rows, cols) = rows_cols(a.shape());
    let (dc_s, dc_l) = dc.storage_and_layout();
    let (a_s, a_l) = a.storage_and_layout();
    let (b_s, b_l) = b.storage_and_layout();
    let (da, db) = swiglu_bwd_storage(
        cfg,
        rows,
        cols,
        [
            (cuda(&dc_s, SWIGLU, "dc")?, dc_l),
            (cuda(&a_s, SWIGLU, "a")?, a_l),
            (cuda(&b_s, SWIGLU, "b")?, b_l),
        ],
    )?;
    Ok((tensor(da, a.shape().clone()), tensor(db, a.shape().clone())))
}

/// SwiGLU forward with candle autograd from a fused gate-up tensor `[..., 2·cols]` (gate in
/// the first half of the last dim, up in the second, as [`crate::swiglu_forward_fused`]):
/// returns `c` `[..., cols]`. The backward gives the fused gradient in one launch.
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::candle::{SwigluConfig, swiglu_fused};
/// let dev = Device::new_cuda(0)?;
/// let gate_up = Tensor::randn(0f32, 1.0, (4, 32, 2 * 11008), &dev)?;
/// let c = swiglu_fused(&gate_up, &SwigluConfig::default())?; // [4, 32, 11008]
/// # let _ = c;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_fused(gate_up: &Tensor, cfg: &SwigluConfig) -> Result<Tensor> {
    fused_rows_cols(gate_up)?;
    gate_up.contiguous()?.apply_op1(SwigluOp { cfg: *cfg })
}

/// Fused SwiGLU backward without autograd: returns `d_gate_up` (shaped like `gate_up`) from
/// `dc` `[..., cols]` and the forward's `gate_up` `[..., 2·cols]`, as
/// [`crate::swiglu_backward_fused`].
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::candle::{SwigluConfig, swiglu_fused, swiglu_fused_backward};
/// let dev = Device::new_cuda(0)?;
/// let gate_up = Tensor::randn(0f32, 1.0, (8, 2 * 11008), &dev)?;
/// let cfg = SwigluConfig::default();
/// let c = swiglu_fused(&gate_up, &cfg)?;
/// let d_gate_up = swiglu_fused_backward(&c.ones_like()?, &gate_up, &cfg)?; // [8, 22016]
/// # let _ = d_gate_up;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_fused_backward(dc: &Tensor, gate_up: &Tensor, cfg: &SwigluConfig) -> Result<Tensor> {
    let (rows, cols) = fused_rows_cols(gate_up)?;
    same_dtype(SWIGLU_FUSED, dc, gate_up)?;
    if dc.shape() != &fused_out_shape(gate_up.shape()) {
        return Err(candle_core::Error::Msg(format!(
            "{SWIGLU_FUSED}: `dc` must be {:?} for `gate_up` {:?}, got {:?}",
            fused_out_shape(gate_up.shape()).dims(),
            gate_up.dims(),
            dc.dims()
        )));
    }
    let (dc, gate_up) = (dc.contiguous()?, gate_up.contiguous()?);
    let (dc_s, dc_l) = dc.storage_and_layout();
    let (g_s, g_l) = gate_up.storage_and_layout();
    let d = swiglu_fused_bwd_storage(
        cfg,
        rows,
        cols,
        [
            (cuda(&dc_s, SWIGLU_FUSED, "dc")?, dc_l),
            (cuda(&g_s, SWIGLU_FUSED, "gate_up")?, g_l),
        ],
    )?;
    Ok(tensor(d, gate_up.shape().clone()))
}

/// The autograd op of [`swiglu`] (two inputs) and [`swiglu_fused`] (one input).
struct SwigluOp {
    cfg: SwigluConfig,
}

impl CustomOp1 for SwigluOp {
    fn name(&self) -> &'static str {
        SWIGLU_FUSED
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported(SWIGLU_FUSED)
    }

    fn cuda_fwd(&self, g: &CudaStorage, g_l: &Layout) -> Result<(CudaStorage, Shape)> {
        let shape = fused_out_shape(g_l.shape());
        let (rows, cols) = rows_cols(&shape);
        let c = swiglu_fwd_storage(&self.cfg, rows, cols, (g, g_l), None)?;
        Ok((c, shape))
    }

    fn bwd(&self, gate_up: &Tensor, _c: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(swiglu_fused_backward(grad, gate_up, &self.cfg)?))
    }
}

impl CustomOp2 for SwigluOp {
    fn name(&self) -> &'static str {
        SWIGLU
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported(SWIGLU)
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        a_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(a_l.shape());
        let c = swiglu_fwd_storage(&self.cfg, rows, cols, (a, a_l), Some((b, b_l)))?;
        Ok((c, a_l.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _c: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = swiglu_backward(grad, a, b, &self.cfg)?;
        Ok((Some(da), Some(db)))
    }
}
