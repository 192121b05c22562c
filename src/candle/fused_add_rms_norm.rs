//! Fused residual add + RMSNorm on candle tensors, with autograd.
use super::rms_norm::{RmsNormConfig, check_weight, rstd_tensor};
use super::{
    Elem, HostElem, On, by_dtype, by_host_dtype, crate_err, cuda, grad_outputs, host, host_slice,
    host_tensor, on, output, rows_cols, same_dtype, same_shape, tensor, view, wrap,
};
use crate::reference::Element;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use std::sync::Mutex;

const FUSED_ADD: &str = "liger-rs fused_add_rms_norm";

/// Fused residual add and RMSNorm with candle autograd (Liger's
/// `LigerFusedAddRMSNormFunction`): returns `(y, s)` with `s = x + r` (rounded once to the
/// dtype) and `y = norm(s) · (offset + weight)` over the last dim, both shaped like `x`.
///
/// `x`, `r`: the same shape `[..., cols]` and dtype; `weight`: `[cols]` (without it `y` is the
/// normalised `s`). One forward launch on CUDA ([`crate::fused_add_rms_norm_forward`]); the
/// reference on the CPU. The backward takes the gradients of both outputs (`dy`, and `ds` from
/// the residual stream; candle gives zeros for an output the loss does not use) and gives `x`
/// and `r` the same gradient `D(dX + ds)` ([`crate::fused_add_rms_norm_backward`]), and the
/// weight its `dw` when it tracks gradients (a frozen weight gets none: dX alone, one launch).
/// `y` and `s` are two views of one `[y | s]` buffer (a custom op has one output), so the
/// backward reads `s` where the forward wrote it.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor, Var};
/// use liger_rs::candle::{RmsNormConfig, fused_add_rms_norm};
/// let dev = Device::new_cuda(0)?;
/// let h = Var::randn(0f32, 1.0, (8, 4096), &dev)?; // a block's output
/// let residual = Var::randn(0f32, 1.0, (8, 4096), &dev)?;
/// let w = Var::from_tensor(&Tensor::ones(4096, DType::F32, &dev)?)?;
/// let cfg = RmsNormConfig::default();
/// let (y, s) = fused_add_rms_norm(h.as_tensor(), residual.as_tensor(), Some(w.as_tensor()), &cfg)?;
/// let grads = (y.sum_all()? + s.sum_all()?)?.backward()?;
/// # let _ = grads;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn fused_add_rms_norm(
    x: &Tensor,
    r: &Tensor,
    weight: Option<&Tensor>,
    cfg: &RmsNormConfig,
) -> Result<(Tensor, Tensor)> {
    same_shape(FUSED_ADD, x, r)?;
    same_dtype(FUSED_ADD, x, r)?;
    let (x, r) = (x.contiguous()?, r.contiguous()?);
    let op = FusedAddOp {
        cfg: *cfg,
        rstd: Mutex::new(None),
    };
    let packed = match weight {
        Some(w) => {
            check_weight(&x, w)?;
            on(FUSED_ADD, &[("x", &x), ("r", &r), ("weight", w)])?;
            x.apply_op3(&r, &w.contiguous()?, op)?
        }
        None => {
            on(FUSED_ADD, &[("x", &x), ("r", &r)])?;
            x.apply_op2(&r, op)?
        }
    };
    let n = x.elem_count();
    let y = packed.narrow(0, 0, n)?.reshape(x.shape())?;
    let s = packed.narrow(0, n, n)?.reshape(x.shape())?;
    Ok((y, s))
}

/// The autograd op of [`fused_add_rms_norm`] (`x`, `r` and, with a weight, `weight`): its
/// output is the flat `[y | s]`; it keeps the forward's `rstd` for the backward.
struct FusedAddOp {
    cfg: RmsNormConfig,
    rstd: Mutex<Option<Tensor>>,
}

impl FusedAddOp {
    fn keep(&self, rstd: Tensor) {
        *self.rstd.lock().unwrap_or_else(|p| p.into_inner()) = Some(rstd);
    }

    fn cuda(
        &self,
        x: (&CudaStorage, &Layout),
        r: (&CudaStorage, &Layout),
        weight: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: Elem>(
            cfg: &RmsNormConfig,
            x: (&CudaStorage, &Layout),
            r: (&CudaStorage, &Layout),
            weight: Option<(&CudaStorage, &Layout)>,
        ) -> Result<(CudaStorage, CudaStorage)> {
            let device = &x.0.device;
            let stream = device.cuda_stream();
            let (rows, cols) = rows_cols(x.1.shape());
            let n = rows * cols;
            let x_view = view::<T>(x.0, x.1, FUSED_ADD)?;
            let r_view = view::<T>(r.0, r.1, FUSED_ADD)?;
            let w_view = weight
                .map(|(s, l)| view::<T>(s, l, FUSED_ADD))
                .transpose()?;
            let mut packed = output::<T>(&stream, 2 * n, FUSED_ADD)?;
            let mut rstd = output::<f32>(&stream, rows, FUSED_ADD)?;
            {
                let (mut y, mut s) = packed.split_at_mut(n);
                crate::fused_add_rms_norm_forward(
                    &stream,
                    &cfg.args(rows, cols),
                    &x_view,
                    &r_view,
                    w_view.as_ref().map(|w| w as _),
                    &mut s,
                    &mut y,
                    &mut rstd,
                )
                .map_err(crate_err)?;
            }
            Ok((wrap(packed, device), wrap(rstd, device)))
        }
        let (packed, rstd) = by_dtype!(x.0.dtype(), FUSED_ADD, run(&self.cfg, x, r, weight))?;
        let rows = rows_cols(x.1.shape()).0;
        self.keep(tensor(rstd, rows));
        Ok((packed, Shape::from(2 * x.1.shape().elem_count())))
    }

    fn cpu(
        &self,
        x: (&CpuStorage, &Layout),
        r: (&CpuStorage, &Layout),
        weight: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: HostElem>(
            cfg: &RmsNormConfig,
            x: (&CpuStorage, &Layout),
            r: (&CpuStorage, &Layout),
            weight: Option<(&CpuStorage, &Layout)>,
        ) -> Result<(CpuStorage, Tensor)> {
            cfg.check()?;
            let (rows, cols) = rows_cols(x.1.shape());
            let xs = host_slice::<T>(x.0, x.1, FUSED_ADD)?;
            let rs = host_slice::<T>(r.0, r.1, FUSED_ADD)?;
            let w = weight
                .map(|(s, l)| host_slice::<T>(s, l, FUSED_ADD))
                .transpose()?;
            let out =
                crate::reference::fused_add_rms_norm_forward(&cfg.args(rows, cols), xs, rs, w)
                    .map_err(crate_err)?;
            let mut packed = out.y;
            packed.extend(out.s);
            let rstd = out.rstd.into_iter().map(Element::to_f64).collect();
            let rstd = rstd_tensor::<T>(rstd, rows)?;
            Ok((T::to_cpu_storage_owned(packed), rstd))
        }
        let (packed, rstd) = by_host_dtype!(x.0.dtype(), FUSED_ADD, run(&self.cfg, x, r, weight))?;
        self.keep(rstd);
        Ok((packed, Shape::from(2 * x.1.shape().elem_count())))
    }

    /// The backward from the gradient of `[y | s]`: `(dx, dw)`, `dw` only where the weight
    /// tracks gradients.
    fn backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let rstd = self
            .rstd
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("{FUSED_ADD}: backward before forward"))
            })?;
        let n = x.elem_count();
        let grad = grad.contiguous()?;
        let (dy, ds) = (grad.narrow(0, 0, n)?, grad.narrow(0, n, n)?);
        let s = packed.detach().narrow(0, n, n)?;
        let with_dw = weight.is_some_and(Tensor::track_op);
        let (dx, dw) = backward(&dy, &ds, &s, weight, &rstd, &self.cfg, with_dw, x.dims())?;
        Ok((dx.reshape(x.shape())?, dw))
    }
}

/// `(dx, dw)` of the fused backward from flat `dy`, `ds`, `s` (`dims`: the shape of `x`).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    dy: &Tensor,
    ds: &Tensor,
    s: &Tensor,
    weight: Option<&Tensor>,
    rstd: &Tensor,
    cfg: &RmsNormConfig,
    with_dw: bool,
    dims: &[usize],
) -> Result<(Tensor, Option<Tensor>)> {
    let (rows, cols) = rows_cols(&Shape::from(dims));
    let mut named = vec![("dy", dy), ("ds", ds), ("s", s), ("rstd", rstd)];
    named.extend(weight.map(|w| ("weight", w)));
    if on(FUSED_ADD, &named)? == On::Cpu {
        fn run<T: HostElem>(
            cfg: &RmsNormConfig,
            [dy, ds, s, rstd]: [&Tensor; 4],
            weight: Option<&Tensor>,
            with_dw: bool,
            (rows, cols): (usize, usize),
        ) -> Result<(Tensor, Option<Tensor>)> {
            cfg.check()?;
            let w = weight.map(host::<T>).transpose()?;
            let rstd = host::<f64>(&rstd.to_dtype(DType::F64)?)?;
            // Exact: the values are f32 (or f64 for f64 tensors), as the forward stored them.
            let rstd: Vec<T::Rstd> = rstd.into_iter().map(T::Rstd::from_f64).collect();
            let args = cfg.args(rows, cols);
            let (dy, ds, s) = (host::<T>(dy)?, host::<T>(ds)?, host::<T>(s)?);
            let g = crate::reference::fused_add_rms_norm_backward(
                &args,
                &dy,
                &ds,
                &s,
                w.as_deref(),
                &rstd,
            )
            .map_err(crate_err)?;
            let dw = match with_dw {
                true => g.dw.map(|dw| host_tensor(dw, cols)).transpose()?,
                false => None,
            };
            Ok((host_tensor(g.dx, rows * cols)?, dw))
        }
        return by_host_dtype!(
            s.dtype(),
            FUSED_ADD,
            run(cfg, [dy, ds, s, rstd], weight, with_dw, (rows, cols))
        );
    }
    fn run<T: Elem>(
        cfg: &RmsNormConfig,
        [dy, ds, s, rstd]: [&Tensor; 4],
        weight: Option<&Tensor>,
        with_dw: bool,
        (rows, cols): (usize, usize),
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (dy_s, dy_l) = dy.storage_and_layout();
        let (ds_s, ds_l) = ds.storage_and_layout();
        let (s_s, s_l) = s.storage_and_layout();
        let (r_s, r_l) = rstd.storage_and_layout();
        let w_guard = weight.map(|w| w.storage_and_layout());
        let w_view = match &w_guard {
            Some((st, l)) => Some(view::<T>(cuda(st, FUSED_ADD, "weight")?, l, FUSED_ADD)?),
            None => None,
        };
        let s_cuda = cuda(&s_s, FUSED_ADD, "s")?;
        let device = &s_cuda.device;
        let stream = device.cuda_stream();
        let dy_v = view::<T>(cuda(&dy_s, FUSED_ADD, "dy")?, dy_l, FUSED_ADD)?;
        let ds_v = view::<T>(cuda(&ds_s, FUSED_ADD, "ds")?, ds_l, FUSED_ADD)?;
        let s_v = view::<T>(s_cuda, s_l, FUSED_ADD)?;
        let r_v = view::<f32>(cuda(&r_s, FUSED_ADD, "rstd")?, r_l, FUSED_ADD)?;
        let with_dw = w_view.is_some() && with_dw;
        let (mut dx, mut dw) = grad_outputs::<T>(&stream, (rows, cols), with_dw, FUSED_ADD)?;
        crate::fused_add_rms_norm_backward(
            &stream,
            &cfg.args(rows, cols),
            &dy_v,
            &ds_v,
            &s_v,
            w_view.as_ref().map(|w| w as _),
            &r_v,
            &mut dx,
            dw.as_mut().map(|d| d as _),
        )
        .map_err(crate_err)?;
        let dw = dw.map(|dw| tensor(wrap(dw, device), cols));
        Ok((tensor(wrap(dx, device), rows * cols), dw))
    }
    by_dtype!(
        s.dtype(),
        FUSED_ADD,
        run(cfg, [dy, ds, s, rstd], weight, with_dw, (rows, cols))
    )
}

impl CustomOp2 for FusedAddOp {
    fn name(&self) -> &'static str {
        FUSED_ADD
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        r: &CpuStorage,
        r_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x, x_l), (r, r_l), None)
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        r: &CudaStorage,
        r_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda((x, x_l), (r, r_l), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        _r: &Tensor,
        packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, _) = self.backward(x, None, packed, grad)?;
        Ok((Some(dx.clone()), Some(dx)))
    }
}

impl CustomOp3 for FusedAddOp {
    fn name(&self) -> &'static str {
        FUSED_ADD
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        r: &CpuStorage,
        r_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x, x_l), (r, r_l), Some((w, w_l)))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        r: &CudaStorage,
        r_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda((x, x_l), (r, r_l), Some((w, w_l)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _r: &Tensor,
        w: &Tensor,
        packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.backward(x, Some(w), packed, grad)?;
        Ok((Some(dx.clone()), Some(dx), dw))
    }
}
