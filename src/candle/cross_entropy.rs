//! Cross-entropy and fused linear cross-entropy on candle tensors, differentiable: CUDA
//! tensors run this crate's kernels (and cuBLAS for the linear form), CPU tensors its f64
//! reference.
//!
//! [`cross_entropy`] is candle-nn's `loss::cross_entropy` (also as
//! [`nn::loss::cross_entropy`](super::nn::loss::cross_entropy)): `inp [batch, classes]`,
//! `target [batch]` (u8, u32 or i64), the mean loss as a scalar of `inp`'s dtype, computed in
//! one fused pass (candle-nn's is `log_softmax` + `nll`, several kernels over `[batch,
//! classes]` tensors in `inp`'s dtype). The loss and the upstream gradient pass through f32
//! (the kernels' precision): an f64 tensor on the CPU gets the reference's f64 result rounded
//! to f32.
//! [`cross_entropy_with`] takes the options ([`CrossEntropyConfig`]: PyTorch's and
//! Liger-Kernel's). [`fused_linear_cross_entropy`] is Liger's FLCE: the loss of `x·Wᵀ + b`
//! without the `[tokens, vocab]` logits ever held whole, differentiable in x, W and b.
use super::grad_slot::GradSlot;
use super::{HostElem, On, by_dtype, by_host_dtype, crate_err, cuda, host_tensor, on, tensor};
use crate::cross_entropy::{CrossEntropyArgs, Reduction};
use crate::{LinearCrossEntropyArgs, LinearCrossEntropyGrads};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::sync::Mutex;

const OP: &str = "cross-entropy";
const FLCE: &str = "fused-linear-cross-entropy";

fn msg(op: &str, text: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {text}"))
}

/// The options of [`cross_entropy_with`] and [`fused_linear_cross_entropy`]: PyTorch's
/// `cross_entropy` arguments and Liger-Kernel's (see [`CrossEntropyArgs`] for the formula).
///
/// ```
/// use liger_rs::candle::CrossEntropyConfig;
/// let cfg = CrossEntropyConfig { label_smoothing: 0.1, ..Default::default() };
/// assert_eq!(cfg.ignore_index, -100);
/// ```
#[derive(Debug, Clone)]
pub struct CrossEntropyConfig {
    /// The target of rows to ignore (−100).
    pub ignore_index: i64,
    /// Label smoothing ε in `[0, 1]` (0).
    pub label_smoothing: f32,
    /// The z-loss factor λ (`lse_square_scale`, 0).
    pub lse_square_scale: f32,
    /// Soft-capping of the logits (none).
    pub softcap: Option<f32>,
    /// The reduction (mean).
    pub reduction: Reduction,
    /// Class weights `f32 [classes]` on the logits' device (none).
    pub weight: Option<Tensor>,
}

impl Default for CrossEntropyConfig {
    fn default() -> Self {
        CrossEntropyConfig {
            ignore_index: -100,
            label_smoothing: 0.0,
            lse_square_scale: 0.0,
            softcap: None,
            reduction: Reduction::Mean,
            weight: None,
        }
    }
}

impl CrossEntropyConfig {
    fn args(&self, rows: usize, vocab: usize) -> CrossEntropyArgs {
        CrossEntropyArgs::new(rows, vocab)
            .with_ignore_index(self.ignore_index)
            .with_label_smoothing(self.label_smoothing)
            .with_lse_square_scale(self.lse_square_scale)
            .with_softcap(self.softcap)
            .with_reduction(self.reduction)
    }
}

/// The loss's shape: a scalar, or one value per row.
fn loss_shape(args: &CrossEntropyArgs) -> Shape {
    match args.reduction {
        Reduction::None => Shape::from(args.rows),
        _ => Shape::from(()),
    }
}

/// The targets as i64 on the logits' device, and the weights as f32 there.
fn prepare(
    op: &str,
    inp: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut named = vec![("input", inp), ("target", target)];
    if let Some(w) = weight {
        named.push(("weight", w));
    }
    on(op, &named)?;
    let target = match target.dtype() {
        DType::I64 => target.contiguous()?,
        DType::U8 | DType::U32 => target.to_dtype(DType::I64)?.contiguous()?,
        other => {
            return Err(msg(
                op,
                format!("`target` must be u8, u32 or i64, got {other:?}"),
            ));
        }
    };
    let weight = weight
        .map(|w| w.to_dtype(DType::F32)?.contiguous())
        .transpose()?;
    Ok((target.detach(), weight.map(|w| w.detach())))
}

/// A tensor's contiguous f32 or i64 elements on CUDA, as a view.
fn cuda_view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a Storage,
    l: &Layout,
    op: &'static str,
    name: &str,
) -> Result<cudarc::driver::CudaView<'a, T>> {
    super::view::<T>(cuda(s, op, name)?, l, op)
}

/// The autograd op of [`cross_entropy_with`]: the forward keeps each row's log-sum-exp for
/// the backward.
struct CrossEntropy {
    cfg: CrossEntropyConfig,
    weight: Option<Tensor>,
    lse: Mutex<Option<Tensor>>,
}

impl CrossEntropy {
    /// The arguments for logits of this layout: rows with a contiguous last dim.
    fn args(&self, l: &Layout) -> Result<CrossEntropyArgs> {
        let (rows, vocab) = l.shape().dims2()?;
        let stride = l.stride();
        if stride[1] != 1 && vocab > 1 {
            return Err(candle_core::Error::RequiresContiguous { op: OP });
        }
        Ok(self
            .cfg
            .args(rows, vocab)
            .with_logits_stride(if rows > 1 { stride[0] } else { vocab }))
    }

    fn host_weight(&self) -> Result<Option<Vec<f32>>> {
        self.weight.as_ref().map(super::host::<f32>).transpose()
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        z: &CpuStorage,
        zl: &Layout,
        t: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: HostElem>(
            op: &CrossEntropy,
            (z, zl): (&CpuStorage, &Layout),
            t: &[i64],
        ) -> Result<(CpuStorage, Shape)> {
            let args = op.args(zl)?;
            let z = &z.as_slice::<T>()?[zl.start_offset()..];
            let w = op.host_weight()?;
            let out = crate::reference::cross_entropy_forward(&args, z, t, w.as_deref())
                .map_err(crate_err)?;
            let loss: Vec<f32> = out.loss.iter().map(|&l| l as f32).collect();
            Ok((CpuStorage::F32(loss), loss_shape(&args)))
        }
        use candle_core::backend::BackendStorage;
        let t = super::host_slice::<i64>(t, tl, OP)?;
        by_host_dtype!(z.dtype(), OP, run(self, (z, zl), t))
    }

    fn cuda_fwd(
        &self,
        z: &CudaStorage,
        zl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: super::Elem>(
            op: &CrossEntropy,
            (z, zl): (&CudaStorage, &Layout),
            (t, tl): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let args = op.args(zl)?;
            let device = &z.device;
            let stream = device.cuda_stream();
            let zv = z.as_cuda_slice::<T>()?.slice(zl.start_offset()..);
            let tv = super::view::<i64>(t, tl, OP)?;
            let alloc = |n: usize| {
                stream
                    .alloc_zeros::<f32>(n.max(1))
                    .map_err(|e| crate_err(e.into()))
            };
            let (mut loss, mut lse) = (alloc(args.loss_len())?, alloc(args.rows)?);
            let (wg, wl);
            let wv = match &op.weight {
                Some(w) => {
                    (wg, wl) = w.storage_and_layout();
                    Some(cuda_view::<f32>(&wg, wl, OP, "weight")?)
                }
                None => None,
            };
            let w_dyn = wv.as_ref().map(|w| w as &dyn DevicePtr<f32>);
            crate::cross_entropy_forward(
                &stream, &args, &zv, &tv, w_dyn, &mut loss, None, &mut lse,
            )
            .map_err(crate_err)?;
            *op.lse.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(tensor(super::wrap(lse, device), args.rows.max(1)));
            Ok((super::wrap(loss, device), loss_shape(&args)))
        }
        use candle_core::backend::BackendStorage;
        by_dtype!(z.dtype(), OP, run(self, (z, zl), (t, tl)))
    }

    fn bwd(
        &self,
        z: &Tensor,
        t: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad_res.to_dtype(DType::F32)?.contiguous()?;
        let dz = match on(OP, &[("input", z), ("grad", &g)])? {
            On::Cpu => {
                fn run<T: HostElem>(
                    op: &CrossEntropy,
                    z: &Tensor,
                    t: &Tensor,
                    g: &Tensor,
                ) -> Result<Tensor> {
                    let (zs, zl) = z.storage_and_layout();
                    let args = op.args(zl)?;
                    let Storage::Cpu(zc) = &*zs else {
                        return Err(msg(OP, "tensors on different devices".into()));
                    };
                    let zh = &zc.as_slice::<T>()?[zl.start_offset()..];
                    let gl: Vec<f64> = super::host::<f32>(g)?.into_iter().map(f64::from).collect();
                    let th = super::host::<i64>(t)?;
                    let w = op.host_weight()?;
                    let dz =
                        crate::reference::cross_entropy_backward(&args, zh, &th, w.as_deref(), &gl)
                            .map_err(crate_err)?;
                    host_tensor(dz, (args.rows, args.vocab))
                }
                by_host_dtype!(z.dtype(), OP, run(self, z, t, &g))?
            }
            On::Cuda => {
                fn run<T: super::Elem>(
                    op: &CrossEntropy,
                    z: &Tensor,
                    t: &Tensor,
                    g: &Tensor,
                ) -> Result<Tensor> {
                    let lse = op
                        .lse
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone()
                        .ok_or_else(|| msg(OP, "backward before forward".into()))?;
                    let (zs, zl) = z.storage_and_layout();
                    let args = op.args(zl)?;
                    let zc = cuda(&zs, OP, "input")?;
                    let device = &zc.device;
                    let stream = device.cuda_stream();
                    let zv = zc.as_cuda_slice::<T>()?.slice(zl.start_offset()..);
                    let (ts, tl) = t.storage_and_layout();
                    let (ls, ll) = lse.storage_and_layout();
                    let (gs, gl) = g.storage_and_layout();
                    let tv = cuda_view::<i64>(&ts, tl, OP, "target")?;
                    let lv = cuda_view::<f32>(&ls, ll, OP, "lse")?;
                    let gv = cuda_view::<f32>(&gs, gl, OP, "grad")?;
                    let (wg, wl);
                    let wv = match &op.weight {
                        Some(w) => {
                            (wg, wl) = w.storage_and_layout();
                            Some(cuda_view::<f32>(&wg, wl, OP, "weight")?)
                        }
                        None => None,
                    };
                    let w_dyn = wv.as_ref().map(|w| w as &dyn DevicePtr<f32>);
                    let mut dz = super::output::<T>(&stream, args.rows * args.vocab, OP)?;
                    let args = args.with_grad_stride(args.vocab);
                    crate::cross_entropy_backward(
                        &stream, &args, &zv, &tv, w_dyn, &lv, &gv, &mut dz,
                    )
                    .map_err(crate_err)?;
                    Ok(tensor(super::wrap(dz, device), (args.rows, args.vocab)))
                }
                by_dtype!(z.dtype(), OP, run(self, z, t, &g))?
            }
        };
        Ok((Some(dz), None))
    }
}

/// candle-nn's `loss::cross_entropy`: the mean cross-entropy of `inp [batch, classes]`
/// (logits) against `target [batch]` (u8, u32 or i64 class indices), a scalar of `inp`'s
/// dtype, differentiable in `inp`. One fused pass forward, one backward; the loss is
/// computed in f32 (candle-nn's in `inp`'s dtype: bf16 logits give a bf16 log-softmax).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let inp = Var::new(&[[1f32, 2.0, 0.5], [-1.0, 0.0, 3.0]], &Device::Cpu)?;
/// let target = Tensor::new(&[1u32, 2], &Device::Cpu)?;
/// let loss = liger_rs::candle::cross_entropy(inp.as_tensor(), &target)?;
/// let want = candle_nn::loss::cross_entropy(inp.as_tensor(), &target)?;
/// assert!((loss.to_scalar::<f32>()? - want.to_scalar::<f32>()?).abs() < 1e-6);
/// let grad = loss.backward()?.get(&inp).cloned();
/// assert_eq!(grad.unwrap().dims(), &[2, 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
/// As [`cross_entropy_with`].
pub fn cross_entropy(inp: &Tensor, target: &Tensor) -> Result<Tensor> {
    cross_entropy_with(inp, target, &CrossEntropyConfig::default())
}

/// [`cross_entropy`] with PyTorch's and Liger-Kernel's options: the loss (z-loss included)
/// in `inp`'s dtype, a scalar, or `[batch]` with [`Reduction::None`].
///
/// # Errors
/// A candle error for `inp` not of rank 2, a target of another dtype or length, tensors on
/// different devices or on Metal; this crate's error (wrapped, see [`super`]) for a bad
/// option or, on the CPU, a target outside the classes that is not `ignore_index` (on CUDA
/// such a row's loss is NaN).
pub fn cross_entropy_with(
    inp: &Tensor,
    target: &Tensor,
    cfg: &CrossEntropyConfig,
) -> Result<Tensor> {
    if inp.rank() != 2 {
        return Err(msg(
            OP,
            format!("`input` must be [batch, classes], got {:?}", inp.dims()),
        ));
    }
    if target.dims() != [inp.dims()[0]] {
        return Err(msg(
            OP,
            format!(
                "`target` must be [{}], got {:?}",
                inp.dims()[0],
                target.dims()
            ),
        ));
    }
    let (target, weight) = prepare(OP, inp, target, cfg.weight.as_ref())?;
    // Rows with a contiguous last dim that do not overlap are read in place; any other layout
    // (a transpose, a broadcast over rows) is copied first.
    let (rows, vocab) = inp.dims2()?;
    let inp = match inp.stride() {
        [_, 1] if rows <= 1 => inp.clone(),
        [row, 1] if *row >= vocab => inp.clone(),
        _ => inp.contiguous()?,
    };
    let op = CrossEntropy {
        cfg: cfg.clone(),
        weight,
        lse: Mutex::new(None),
    };
    inp.apply_op2(&target, op)?.to_dtype(inp.dtype())
}

/// The autograd op of [`fused_linear_cross_entropy`]: the forward computes the gradients for
/// an upstream gradient of 1 and keeps them; the backward takes and scales them, and puts
/// `w`'s into `slot` where one is given.
struct LinearCe {
    cfg: CrossEntropyConfig,
    target: Tensor,
    weight: Option<Tensor>,
    grads: Mutex<Option<Vec<Tensor>>>,
    slot: Option<GradSlot>,
}

impl LinearCe {
    fn args(&self, x: &Layout, w: &Layout) -> Result<LinearCrossEntropyArgs> {
        let (tokens, hidden) = x.shape().dims2()?;
        let (vocab, wh) = w.shape().dims2()?;
        if wh != hidden {
            return Err(msg(
                FLCE,
                format!("`w` is [{vocab}, {wh}] but `x` has {hidden} columns"),
            ));
        }
        for (name, l) in [("x", x), ("w", w)] {
            if !l.is_contiguous() {
                return Err(msg(FLCE, format!("`{name}` must be contiguous")));
            }
        }
        Ok(LinearCrossEntropyArgs::with_ce(
            hidden,
            self.cfg.args(tokens, vocab),
        ))
    }

    fn keep(&self, grads: Vec<Tensor>) {
        *self.grads.lock().unwrap_or_else(|p| p.into_inner()) = Some(grads);
    }

    fn cpu<T: HostElem>(
        &self,
        (x, xl): (&CpuStorage, &Layout),
        (w, wl): (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let args = self.args(xl, wl)?;
        let slice = |s: &CpuStorage, l: &Layout| -> Result<Vec<T>> {
            Ok(super::host_slice::<T>(s, l, FLCE)?.to_vec())
        };
        let bias = b.map(|(s, l)| slice(s, l)).transpose()?;
        let t = super::host::<i64>(&self.target)?;
        let cw = self.weight.as_ref().map(super::host::<f32>).transpose()?;
        let out = crate::reference::fused_linear_cross_entropy(
            &args,
            &slice(x, xl)?,
            &slice(w, wl)?,
            bias.as_deref(),
            &t,
            cw.as_deref(),
        )
        .map_err(crate_err)?;
        let (h, v) = (args.hidden, args.ce.vocab);
        let cast = |g: Vec<f32>| -> Vec<T> {
            g.into_iter()
                .map(|x| <T as crate::reference::Element>::from_f64(x as f64))
                .collect()
        };
        let mut grads = vec![
            host_tensor(out.dx, (args.ce.rows, h))?,
            host_tensor(cast(out.dweight), (v, h))?,
        ];
        if let Some(db) = out.dbias {
            grads.push(host_tensor(cast(db), v)?);
        }
        self.keep(grads);
        let loss: Vec<f32> = out.loss.iter().map(|&l| l as f32).collect();
        Ok((CpuStorage::F32(loss), loss_shape(&args.ce)))
    }

    fn cuda<T: super::Elem>(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        b: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let args = self.args(xl, wl)?;
        let device = &x.device;
        let stream = device.cuda_stream();
        let (t, h, v) = (args.ce.rows, args.hidden, args.ce.vocab);
        let xv = super::view::<T>(x, xl, FLCE)?;
        let wv = super::view::<T>(w, wl, FLCE)?;
        let bv = b.map(|(s, l)| super::view::<T>(s, l, FLCE)).transpose()?;
        let (ts, tl) = self.target.storage_and_layout();
        let tv = cuda_view::<i64>(&ts, tl, FLCE, "target")?;
        let (wg, wgl);
        let cw = match &self.weight {
            Some(c) => {
                (wg, wgl) = c.storage_and_layout();
                Some(cuda_view::<f32>(&wg, wgl, FLCE, "weight")?)
            }
            None => None,
        };
        let zeros = |n: usize| {
            stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(|e| crate_err(e.into()))
        };
        let mut loss = zeros(args.ce.loss_len())?;
        let mut dx = super::output::<T>(&stream, t * h, FLCE)?;
        let mut dw = zeros(v * h)?;
        let mut db = bv.as_ref().map(|_| zeros(v)).transpose()?;
        crate::fused_linear_cross_entropy(
            &stream,
            &args,
            &xv,
            &wv,
            bv.as_ref().map(|b| b as &dyn DevicePtr<T>),
            &tv,
            cw.as_ref().map(|c| c as &dyn DevicePtr<f32>),
            &mut loss,
            None,
            LinearCrossEntropyGrads {
                dx: &mut dx,
                dweight: &mut dw,
                dbias: db
                    .as_mut()
                    .map(|d| d as &mut dyn cudarc::driver::DevicePtrMut<f32>),
            },
        )
        .map_err(crate_err)?;
        let dtype = w.dtype();
        let mut grads = vec![
            tensor(super::wrap(dx, device), (t, h)),
            tensor(super::wrap(dw, device), (v, h)).to_dtype(dtype)?,
        ];
        if let Some(db) = db {
            grads.push(tensor(super::wrap(db, device), v).to_dtype(dtype)?);
        }
        self.keep(grads);
        Ok((super::wrap(loss, device), loss_shape(&args.ce)))
    }

    /// The scaled gradients of x, w and the bias (w's none where it goes to the slot, which
    /// it does if `w` tracks a gradient).
    fn backward(&self, grad_res: &Tensor, w: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let mut g = self.scaled_grads(grad_res)?.into_iter();
        let (dx, dw, db) = (g.next(), g.next(), g.next());
        let dw = GradSlot::hand_on(self.slot.as_ref(), w, dw)?;
        Ok([dx, dw, db])
    }

    fn scaled_grads(&self, grad_res: &Tensor) -> Result<Vec<Tensor>> {
        let grads = self
            .grads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                msg(
                    FLCE,
                    "a second backward through the same graph (the first freed the kept \
                     gradients)"
                        .into(),
                )
            })?;
        // Each kept gradient is dropped once its scaled copy exists.
        if !grad_res.device().is_cuda() || grad_res.elem_count() != 1 {
            return grads
                .into_iter()
                .map(|g| g.broadcast_mul(&grad_res.to_dtype(g.dtype())?))
                .collect();
        }
        let grad_res = grad_res.to_dtype(DType::F32)?.contiguous()?;
        grads
            .into_iter()
            .map(|g| by_dtype!(g.dtype(), FLCE, scaled(&g, &grad_res)))
            .collect()
    }
}

/// `g · s` for a one-element f32 `s` on the device: a copy of `g` scaled in place by cuBLAS,
/// which reads `s` where it lies (candle's broadcast multiply takes its strided path, at
/// about a tenth of the copy bandwidth).
fn scaled<T: super::Elem>(g: &Tensor, s: &Tensor) -> Result<Tensor> {
    let (gs, gl) = g.storage_and_layout();
    let gc = cuda(&gs, FLCE, "gradient")?;
    let device = &gc.device;
    let stream = device.cuda_stream();
    let view = super::view::<T>(gc, gl, FLCE)?;
    let mut out = stream.clone_dtod(&view).map_err(|e| crate_err(e.into()))?;
    let (ss, sl) = s.storage_and_layout();
    let sv = super::view::<f32>(cuda(&ss, FLCE, "grad")?, sl, FLCE)?;
    let blas = crate::blas::Blas::on(&stream).map_err(crate_err)?;
    {
        let (alpha, _a) = sv.device_ptr(&stream);
        let (x, _x) = out.device_ptr_mut(&stream);
        // SAFETY: `out` holds `g`'s elements and `sv` one f32, both of this context and
        // ordered on `stream`, where the scale is queued.
        unsafe { blas.scale::<T>(g.elem_count(), alpha, x) }.map_err(crate_err)?;
    }
    Ok(tensor(super::wrap(out, device), g.shape().clone()))
}

use candle_core::backend::BackendStorage;

impl CustomOp2 for LinearCe {
    fn name(&self) -> &'static str {
        FLCE
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_host_dtype!(x.dtype(), FLCE, cpu_t(self, (x, xl), (w, wl), None))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(x.dtype(), FLCE, cuda_t(self, (x, xl), (w, wl), None))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, _] = self.backward(grad_res, w)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for LinearCe {
    fn name(&self) -> &'static str {
        FLCE
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_host_dtype!(
            x.dtype(),
            FLCE,
            cpu_t(self, (x, xl), (w, wl), Some((b, bl)))
        )
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(
            x.dtype(),
            FLCE,
            cuda_t(self, (x, xl), (w, wl), Some((b, bl)))
        )
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, db] = self.backward(grad_res, w)?;
        Ok((dx, dw, db))
    }
}

type CpuArg<'a> = (&'a CpuStorage, &'a Layout);
type CudaArg<'a> = (&'a CudaStorage, &'a Layout);

fn cpu_t<T: HostElem>(
    op: &LinearCe,
    x: CpuArg<'_>,
    w: CpuArg<'_>,
    b: Option<CpuArg<'_>>,
) -> Result<(CpuStorage, Shape)> {
    op.cpu::<T>(x, w, b)
}

fn cuda_t<T: super::Elem>(
    op: &LinearCe,
    x: CudaArg<'_>,
    w: CudaArg<'_>,
    b: Option<CudaArg<'_>>,
) -> Result<(CudaStorage, Shape)> {
    op.cuda::<T>(x, w, b)
}

/// Liger-Kernel's fused linear cross-entropy on candle tensors: the loss of
/// `cross_entropy(x·wᵀ + bias, target)` with `cfg`'s options, in `x`'s dtype, differentiable
/// in `x [tokens, hidden]`, `w [vocab, hidden]` and `bias [vocab]` (see
/// [`crate::fused_linear_cross_entropy`]: chunks of tokens, the logits never whole). The
/// forward computes the gradients too and keeps them (dx `[tokens, hidden]`, dW and db in
/// w's dtype) until the backward, which scales them by the loss's gradient and frees them: a
/// second backward through the same graph is an error, as in PyTorch without `retain_graph`.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use liger_rs::candle::{CrossEntropyConfig, fused_linear_cross_entropy};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (6, 4), &dev)?;
/// let w = Var::randn(0f32, 1.0, (10, 4), &dev)?;
/// let target = Tensor::new(&[1u32, 2, 3, 4, 5, 9], &dev)?;
/// let cfg = CrossEntropyConfig::default();
/// let loss = fused_linear_cross_entropy(x.as_tensor(), w.as_tensor(), None, &target, &cfg)?;
/// let logits = x.as_tensor().matmul(&w.as_tensor().t()?)?;
/// let want = candle_nn::loss::cross_entropy(&logits, &target)?;
/// assert!((loss.to_scalar::<f32>()? - want.to_scalar::<f32>()?).abs() < 1e-5);
/// let grads = loss.backward()?;
/// assert!(grads.get(&x).is_some() && grads.get(&w).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
/// As [`cross_entropy_with`]; [`Reduction::None`] (the gradients are computed for an upstream
/// gradient of one value); x and w not contiguous matrices with one hidden size; a bias not
/// `[vocab]`; tensors of different dtypes.
pub fn fused_linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    target: &Tensor,
    cfg: &CrossEntropyConfig,
) -> Result<Tensor> {
    linear_ce(x, w, bias, target, cfg, None)
}

/// [`fused_linear_cross_entropy`] whose backward puts `w`'s gradient into `slot` (summed with
/// what it holds) instead of handing it to candle's backward (see [`GradSlot`]); x's and the
/// bias's go to candle's backward.
///
/// # Errors
/// As [`fused_linear_cross_entropy`].
pub fn fused_linear_cross_entropy_with_slot(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    target: &Tensor,
    cfg: &CrossEntropyConfig,
    slot: &GradSlot,
) -> Result<Tensor> {
    linear_ce(x, w, bias, target, cfg, Some(slot))
}

fn linear_ce(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    target: &Tensor,
    cfg: &CrossEntropyConfig,
    slot: Option<&GradSlot>,
) -> Result<Tensor> {
    if cfg.reduction == Reduction::None {
        return Err(msg(
            FLCE,
            "Reduction::None is not supported: the gradients need one upstream value".into(),
        ));
    }
    for (name, t) in [("w", Some(w)), ("bias", bias)] {
        if let Some(t) = t
            && t.dtype() != x.dtype()
        {
            return Err(msg(
                FLCE,
                format!("`{name}` is {:?} but `x` is {:?}", t.dtype(), x.dtype()),
            ));
        }
    }
    let (tokens, _) = x.dims2()?;
    if target.dims() != [tokens] {
        return Err(msg(
            FLCE,
            format!("`target` must be [{tokens}], got {:?}", target.dims()),
        ));
    }
    let (vocab, _) = w.dims2()?;
    if let Some(b) = bias
        && b.dims() != [vocab]
    {
        return Err(msg(
            FLCE,
            format!("`bias` must be [{vocab}], got {:?}", b.dims()),
        ));
    }
    let (target, weight) = prepare(FLCE, x, target, cfg.weight.as_ref())?;
    let op = LinearCe {
        cfg: cfg.clone(),
        target,
        weight,
        grads: Mutex::new(None),
        slot: slot.cloned(),
    };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let loss = match bias {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op)?,
        None => x.apply_op2(&w, op)?,
    };
    loss.to_dtype(x.dtype())
}
