//! RMSNorm on candle tensors: the autograd op, the explicit forward and backward.
use super::{
    Elem, HostElem, On, by_dtype, by_host_dtype, crate_err, cuda, grad_outputs, host, host_slice,
    host_tensor, on, output, rows_cols, same_dtype, same_shape, tensor, view, wrap,
};
use crate::error::invalid;
use crate::reference::Element;
use crate::{CastingMode, RmsNormArgs};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor,
};
use std::sync::Mutex;

const RMS_NORM: &str = "liger-rs rms_norm";

/// RMSNorm parameters (the shape comes from the tensors): `eps`, the weight `offset` and the
/// [`CastingMode`]; see [`RmsNormArgs`] for their meaning and limits.
///
/// ```
/// use liger_rs::{CastingMode, candle::RmsNormConfig};
/// // Gemma: (1 + w) weights, f32 math throughout.
/// let gemma = RmsNormConfig::default().with_offset(1.0).with_mode(CastingMode::Gemma);
/// assert_eq!((gemma.eps, gemma.offset), (1e-6, 1.0));
/// assert_eq!(RmsNormConfig::default().mode, CastingMode::Llama);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
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
    /// Sets `eps`.
    ///
    /// ```
    /// assert_eq!(liger_rs::candle::RmsNormConfig::default().with_eps(1e-5).eps, 1e-5);
    /// ```
    pub fn with_eps(self, eps: f32) -> Self {
        RmsNormConfig { eps, ..self }
    }

    /// Sets the weight offset.
    ///
    /// ```
    /// assert_eq!(liger_rs::candle::RmsNormConfig::default().with_offset(1.0).offset, 1.0);
    /// ```
    pub fn with_offset(self, offset: f32) -> Self {
        RmsNormConfig { offset, ..self }
    }

    /// Sets the casting mode.
    ///
    /// ```
    /// use liger_rs::{CastingMode, candle::RmsNormConfig};
    /// let cfg = RmsNormConfig::default().with_mode(CastingMode::None);
    /// assert_eq!(cfg.mode, CastingMode::None);
    /// ```
    pub fn with_mode(self, mode: CastingMode) -> Self {
        RmsNormConfig { mode, ..self }
    }

    pub(super) fn args(&self, rows: usize, cols: usize) -> RmsNormArgs {
        RmsNormArgs::new(rows, cols)
            .with_eps(self.eps)
            .with_offset(self.offset)
            .with_mode(self.mode)
    }

    /// The checks of the launchers' `args.eps` and `args.offset`, for the CPU path (the
    /// reference takes any value).
    pub(super) fn check(&self) -> Result<()> {
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(crate_err(invalid(
                "args.eps",
                "a finite value ≥ 0",
                self.eps,
            )));
        }
        if !self.offset.is_finite() {
            return Err(crate_err(invalid(
                "args.offset",
                "a finite value",
                self.offset,
            )));
        }
        Ok(())
    }
}

/// Checks the weight of an RMSNorm over rows of `cols`: shape `[cols]`, the dtype of `x`.
pub(super) fn check_weight(x: &Tensor, weight: &Tensor) -> Result<()> {
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

/// The dtype of `rstd` for tensors of `dtype`: f32, f64 for f64 tensors (CPU only).
fn rstd_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Forward on CUDA storages: `y` (the shape of `x`) and `rstd` (`rows` f32).
fn fwd_cuda(
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
            w_view.as_ref().map(|w| w as _),
            &mut y,
            &mut rstd,
        )
        .map_err(crate_err)?;
        Ok((wrap(y, device), wrap(rstd, device)))
    }
    by_dtype!(x.0.dtype(), RMS_NORM, run(cfg, x, weight))
}

/// Forward on host data: `y` and `rstd` (as the kernels store it).
fn fwd_host<T: HostElem>(
    cfg: &RmsNormConfig,
    x: &[T],
    weight: Option<&[T]>,
    (rows, cols): (usize, usize),
) -> Result<(Vec<T>, Vec<f64>)> {
    cfg.check()?;
    let args = cfg.args(rows, cols);
    let out = crate::reference::rms_norm_forward(&args, x, weight).map_err(crate_err)?;
    Ok((out.y, out.rstd.into_iter().map(Element::to_f64).collect()))
}

/// Forward on CPU storages: `y` and `rstd` (f32, f64 for f64 tensors).
fn fwd_cpu(
    cfg: &RmsNormConfig,
    x: (&CpuStorage, &Layout),
    weight: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Tensor)> {
    fn run<T: HostElem>(
        cfg: &RmsNormConfig,
        x: (&CpuStorage, &Layout),
        weight: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Tensor)> {
        let (rows, cols) = rows_cols(x.1.shape());
        let xs = host_slice::<T>(x.0, x.1, RMS_NORM)?;
        let w = weight
            .map(|(s, l)| host_slice::<T>(s, l, RMS_NORM))
            .transpose()?;
        let (y, rstd) = fwd_host(cfg, xs, w, (rows, cols))?;
        Ok((T::to_cpu_storage_owned(y), rstd_tensor::<T>(rstd, rows)?))
    }
    by_host_dtype!(x.0.dtype(), RMS_NORM, run(cfg, x, weight))
}

/// `rstd` as stored, a host tensor of shape `rows`: f32 values (exact: the reference rounds
/// them so), or f64 for f64 tensors; shared by every CPU forward that keeps it.
pub(super) fn rstd_tensor<T: HostElem>(rstd: Vec<f64>, rows: impl Into<Shape>) -> Result<Tensor> {
    match T::DTYPE {
        DType::F64 => host_tensor(rstd, rows),
        _ => host_tensor(rstd.into_iter().map(|r| r as f32).collect::<Vec<_>>(), rows),
    }
}

/// RMSNorm forward with candle autograd: `y = norm(x) · (offset + weight)` over the last dim
/// of `x`.
///
/// `x`: `[..., cols]` (any rank ≥ 1, `cols ≥ 1`); `weight`: `[cols]`, the dtype of `x`
/// (without it `y` is the normalised `x`). Returns `y`, shaped like `x`. When `x` or `weight`
/// tracks gradients, the backward ([`rms_norm_backward`]'s kernels) gives `dx`, and `dw` when
/// the weight tracks gradients ([`Tensor::track_op`]: a `Var` or computed from one); a frozen
/// weight (a plain tensor, or detached, as in LoRA/PEFT) gets none: its backward computes `dx`
/// alone, one launch without dW work (see [`crate::rms_norm_backward`] with `dw = None`). The
/// op keeps the forward's `rstd` (`rows` f32) for it. One forward launch on CUDA, as
/// [`crate::rms_norm_forward`]; the reference on the CPU.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor, Var};
/// use liger_rs::candle::{RmsNormConfig, rms_norm};
/// let dev = Device::new_cuda(0)?;
/// let x = Var::randn(0f32, 1.0, (8, 4096), &dev)?;
/// let w = Tensor::ones(4096, DType::F32, &dev)?;
/// let y = rms_norm(x.as_tensor(), Some(&w), &RmsNormConfig::default().with_eps(1e-5))?;
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
            on(RMS_NORM, &[("x", &x), ("weight", w)])?;
            x.apply_op2(&w.contiguous()?, op)
        }
        None => x.apply_op1(op),
    }
}

/// RMSNorm forward without autograd: returns `(y, rstd)`, `y` shaped like `x` and `rstd` the
/// f32 inverse RMS of each row (f64 for f64 tensors), shaped like `x` without its last dim —
/// what [`rms_norm_backward`] takes. Arguments as [`rms_norm`].
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
    let mut named = vec![("x", &x)];
    named.extend(weight.as_ref().map(|w| ("weight", w)));
    let rows = x.dims()[..x.rank().saturating_sub(1)].to_vec();
    if on(RMS_NORM, &named)? == On::Cpu {
        fn run<T: HostElem>(
            cfg: &RmsNormConfig,
            x: &Tensor,
            weight: Option<&Tensor>,
            rows: Vec<usize>,
        ) -> Result<(Tensor, Tensor)> {
            let w = weight.map(host::<T>).transpose()?;
            let (y, rstd) = fwd_host(cfg, &host::<T>(x)?, w.as_deref(), rows_cols(x.shape()))?;
            let rstd = rstd_tensor::<T>(rstd, rows)?;
            Ok((host_tensor(y, x.shape().clone())?, rstd))
        }
        return by_host_dtype!(x.dtype(), RMS_NORM, run(cfg, &x, weight.as_ref(), rows));
    }
    let (x_storage, x_layout) = x.storage_and_layout();
    let x_cuda = cuda(&x_storage, RMS_NORM, "x")?;
    let w_guard = weight.as_ref().map(|w| w.storage_and_layout());
    let w_cuda = match &w_guard {
        Some((s, l)) => Some((cuda(s, RMS_NORM, "weight")?, *l)),
        None => None,
    };
    let (y, rstd) = fwd_cuda(cfg, (x_cuda, x_layout), w_cuda)?;
    Ok((tensor(y, x.shape().clone()), tensor(rstd, rows)))
}

/// RMSNorm backward without autograd: returns `(dx, dw)` from `dy` (shaped like `x`), the
/// forward's `x`, `weight` and `rstd` (f32, f64 for f64 tensors, one per row, any shape with
/// that many elements). `dw` is `Some` exactly when `weight` is; on CUDA it is reduced on the
/// GPU deterministically (see [`crate::rms_norm_backward`], which this calls: two launches
/// and the kept f32 scratch with a weight, one launch without).
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
    backward(dy, x, weight, rstd, cfg, weight.is_some())
}

/// [`rms_norm_backward`], with `dw` (`with_dw`, and a weight given) or for a frozen weight
/// without.
fn backward(
    dy: &Tensor,
    x: &Tensor,
    weight: Option<&Tensor>,
    rstd: &Tensor,
    cfg: &RmsNormConfig,
    with_dw: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    same_shape(RMS_NORM, dy, x)?;
    same_dtype(RMS_NORM, dy, x)?;
    if let Some(w) = weight {
        check_weight(x, w)?;
    }
    let (rows, cols) = rows_cols(x.shape());
    let want = rstd_dtype(x.dtype());
    if rstd.dtype() != want || rstd.elem_count() != rows {
        return Err(candle_core::Error::Msg(format!(
            "{RMS_NORM}: `rstd` must be {} with one element per row ({rows}), got {:?} {:?}",
            want.as_str(),
            rstd.dtype(),
            rstd.dims()
        )));
    }
    let (dy, x, rstd) = (dy.contiguous()?, x.contiguous()?, rstd.contiguous()?);
    let weight = weight.map(Tensor::contiguous).transpose()?;
    let mut named = vec![("dy", &dy), ("x", &x), ("rstd", &rstd)];
    named.extend(weight.as_ref().map(|w| ("weight", w)));
    if on(RMS_NORM, &named)? == On::Cpu {
        fn run<T: HostElem>(
            cfg: &RmsNormConfig,
            [dy, x, rstd]: [&Tensor; 3],
            weight: Option<&Tensor>,
            with_dw: bool,
        ) -> Result<(Tensor, Option<Tensor>)> {
            cfg.check()?;
            let (rows, cols) = rows_cols(x.shape());
            let w = weight.map(host::<T>).transpose()?;
            let rstd = host::<f64>(&rstd.to_dtype(DType::F64)?)?;
            // Exact: the values are f32 (or f64 for f64 tensors), as the forward stored them.
            let rstd: Vec<T::Rstd> = rstd.into_iter().map(T::Rstd::from_f64).collect();
            let backward = match with_dw {
                true => crate::reference::rms_norm_backward,
                false => crate::reference::rms_norm_backward_dx,
            };
            let g = backward(
                &cfg.args(rows, cols),
                &host::<T>(dy)?,
                &host::<T>(x)?,
                w.as_deref(),
                &rstd,
            )
            .map_err(crate_err)?;
            let dw = g.dw.map(|dw| host_tensor(dw, cols)).transpose()?;
            Ok((host_tensor(g.dx, x.shape().clone())?, dw))
        }
        return by_host_dtype!(
            x.dtype(),
            RMS_NORM,
            run(cfg, [&dy, &x, &rstd], weight.as_ref(), with_dw)
        );
    }

    let (dy_s, dy_l) = dy.storage_and_layout();
    let (x_s, x_l) = x.storage_and_layout();
    let (r_s, r_l) = rstd.storage_and_layout();
    let w_guard = weight.as_ref().map(|w| w.storage_and_layout());
    let w_cuda = match &w_guard {
        Some((s, l)) => Some((cuda(s, RMS_NORM, "weight")?, *l)),
        None => None,
    };
    let inputs = Grads {
        dy: (cuda(&dy_s, RMS_NORM, "dy")?, dy_l),
        x: (cuda(&x_s, RMS_NORM, "x")?, x_l),
        weight: w_cuda,
        rstd: (cuda(&r_s, RMS_NORM, "rstd")?, r_l),
    };
    let (dx, dw) = bwd_cuda(cfg, rows, cols, &inputs, with_dw)?;
    Ok((tensor(dx, x.shape().clone()), dw.map(|dw| tensor(dw, cols))))
}

/// The inputs of the RMSNorm backward, as storages and layouts.
struct Grads<'a> {
    dy: (&'a CudaStorage, &'a Layout),
    x: (&'a CudaStorage, &'a Layout),
    weight: Option<(&'a CudaStorage, &'a Layout)>,
    rstd: (&'a CudaStorage, &'a Layout),
}

fn bwd_cuda(
    cfg: &RmsNormConfig,
    rows: usize,
    cols: usize,
    inputs: &Grads<'_>,
    with_dw: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    fn run<T: Elem>(
        cfg: &RmsNormConfig,
        rows: usize,
        cols: usize,
        inputs: &Grads<'_>,
        with_dw: bool,
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
        let with_dw = w.is_some() && with_dw;
        let (mut dx, mut dw) = grad_outputs::<T>(&stream, (rows, cols), with_dw, RMS_NORM)?;
        crate::rms_norm_backward(
            &stream,
            &cfg.args(rows, cols),
            &dy,
            &x,
            w.as_ref().map(|w| w as _),
            &rstd,
            &mut dx,
            dw.as_mut().map(|d| d as _),
        )
        .map_err(crate_err)?;
        Ok((wrap(dx, device), dw.map(|dw| wrap(dw, device))))
    }
    by_dtype!(
        inputs.x.0.dtype(),
        RMS_NORM,
        run(cfg, rows, cols, inputs, with_dw)
    )
}

/// The autograd op of [`rms_norm`] (one input without a weight, two with), keeping the
/// forward's `rstd` for the backward.
struct RmsNormOp {
    cfg: RmsNormConfig,
    rstd: Mutex<Option<Tensor>>,
}

impl RmsNormOp {
    /// Keeps the forward's `rstd` (`rows` elements) for the backward.
    fn keep(&self, rstd: Tensor) {
        *self.rstd.lock().unwrap_or_else(|p| p.into_inner()) = Some(rstd);
    }

    fn cuda(
        &self,
        x: (&CudaStorage, &Layout),
        weight: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let (y, rstd) = fwd_cuda(&self.cfg, x, weight)?;
        self.keep(tensor(rstd, rows_cols(x.1.shape()).0));
        Ok((y, x.1.shape().clone()))
    }

    fn cpu(
        &self,
        x: (&CpuStorage, &Layout),
        weight: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, rstd) = fwd_cpu(&self.cfg, x, weight)?;
        self.keep(rstd);
        Ok((y, x.1.shape().clone()))
    }

    /// The backward; `dw` only where the weight tracks gradients (a frozen weight gets `dx`
    /// alone).
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
        let with_dw = weight.is_some_and(Tensor::track_op);
        backward(grad, x, weight, &rstd, &self.cfg, with_dw)
    }
}

impl CustomOp1 for RmsNormOp {
    fn name(&self) -> &'static str {
        RMS_NORM
    }

    fn cpu_fwd(&self, x: &CpuStorage, x_l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu((x, x_l), None)
    }

    fn cuda_fwd(&self, x: &CudaStorage, x_l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.cuda((x, x_l), None)
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
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x, x_l), Some((w, w_l)))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda((x, x_l), Some((w, w_l)))
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
