//! SwiGLU and GEGLU on candle tensors: the autograd ops (separate and fused gate-up), the
//! explicit backwards. GEGLU takes every path of SwiGLU's (the kernels' [`Gate`] picks the
//! kernels and the reference).
use super::{
    Elem, HostElem, On, by_dtype, by_host_dtype, crate_err, cuda, host, host_slice, host_tensor,
    on, output, rows_cols, same_dtype, same_shape, scaled, tensor, view, wrap,
};
use crate::error::invalid;
use crate::glu::launch::{BACKWARD, BACKWARD_FUSED, FORWARD, FORWARD_FUSED};
use crate::glu::run;
use crate::identity::Gate;
use crate::reference::swiglu::{join_gate_up, split_gate_up};
use crate::reference::{Element, geglu as ref_geglu, swiglu as ref_swiglu};
use crate::validate::{read, write};
use crate::{Gelu, SwigluArgs};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor,
};
use half::{bf16, f16};

/// The op's name in errors: separate and fused.
fn names(gate: Gate) -> (&'static str, &'static str) {
    match gate {
        Gate::Silu => ("liger-rs swiglu", "liger-rs swiglu_fused"),
        Gate::GeluTanh | Gate::GeluErf => ("liger-rs geglu", "liger-rs geglu_fused"),
    }
}

/// The reference forward of `gate` (contiguous separate rows).
fn ref_forward<T: Element>(gate: Gate, args: &SwigluArgs, a: &[T], b: &[T]) -> Result<Vec<T>> {
    match gate {
        Gate::Silu => ref_swiglu::swiglu_forward(args, a, b),
        gelu => ref_geglu::geglu_forward(args, a, b, gelu == Gate::GeluErf),
    }
    .map_err(crate_err)
}

/// The reference backward of `gate`: `(da, db)`.
fn ref_backward<T: Element>(
    gate: Gate,
    args: &SwigluArgs,
    [dc, a, b]: [&[T]; 3],
) -> Result<(Vec<T>, Vec<T>)> {
    match gate {
        Gate::Silu => ref_swiglu::swiglu_backward(args, dc, a, b).map(|g| (g.da, g.db)),
        gelu => {
            ref_geglu::geglu_backward(args, dc, a, b, gelu == Gate::GeluErf).map(|g| (g.da, g.db))
        }
    }
    .map_err(crate_err)
}

/// SwiGLU multipliers (both 1 by default; see [`SwigluArgs`]): the gate is `a·gm`, and the
/// ops return `c·dm` (`c = silu(a·gm)·b`), whose gradient their backward is.
///
/// `dm` is rounded to the tensors' dtype first (candle's `affine`, which scales `c` on
/// either device, multiplies in the dtype), and the backward uses that same value, so the
/// backward stays the gradient of what the forward returned.
///
/// ```
/// let cfg = liger_rs::candle::SwigluConfig::default().with_gate_multiplier(0.5);
/// assert_eq!((cfg.gate_multiplier, cfg.down_multiplier), (0.5, 1.0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SwigluConfig {
    /// `gm`: the gate is `z = a·gm` (finite).
    pub gate_multiplier: f32,
    /// `dm`: the ops return `c·dm` (finite).
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
    /// Sets the gate multiplier `gm`.
    ///
    /// ```
    /// let cfg = liger_rs::candle::SwigluConfig::default().with_gate_multiplier(0.5);
    /// assert_eq!(cfg.gate_multiplier, 0.5);
    /// ```
    pub fn with_gate_multiplier(self, gate_multiplier: f32) -> Self {
        SwigluConfig {
            gate_multiplier,
            ..self
        }
    }

    /// Sets the down multiplier `dm`.
    ///
    /// ```
    /// let cfg = liger_rs::candle::SwigluConfig::default().with_down_multiplier(2.0);
    /// assert_eq!(cfg.down_multiplier, 2.0);
    /// ```
    pub fn with_down_multiplier(self, down_multiplier: f32) -> Self {
        SwigluConfig {
            down_multiplier,
            ..self
        }
    }

    /// This config for tensors of `dtype`: `dm` rounded to it.
    fn for_dtype(&self, dtype: DType) -> SwigluConfig {
        let dm = self.down_multiplier;
        let down_multiplier = match dtype {
            DType::F16 => f16::from_f32(dm).to_f32(),
            DType::BF16 => bf16::from_f32(dm).to_f32(),
            _ => dm,
        };
        SwigluConfig {
            down_multiplier,
            ..*self
        }
    }

    fn apply(&self, args: SwigluArgs) -> SwigluArgs {
        args.with_gate_multiplier(self.gate_multiplier)
            .with_down_multiplier(self.down_multiplier)
    }

    /// The launchers' checks of the multipliers, for the CPU path.
    fn check(&self) -> Result<()> {
        for (arg, m) in [
            ("args.gate_multiplier", self.gate_multiplier),
            ("args.down_multiplier", self.down_multiplier),
        ] {
            if !m.is_finite() {
                return Err(crate_err(invalid(arg, "a finite value", m)));
            }
        }
        Ok(())
    }
}

/// The `(rows, cols)` of the fused gate-up tensor `[..., 2·cols]`.
pub(super) fn fused_rows_cols(gate_up: &Tensor, name: &str) -> Result<(usize, usize)> {
    let (rows, width) = rows_cols(gate_up.shape());
    if gate_up.rank() == 0 || !width.is_multiple_of(2) || width == 0 {
        return Err(candle_core::Error::Msg(format!(
            "{name}: `gate_up` must be [..., 2·cols] (an even last dim ≥ 2: gate, then \
             up), got {:?}",
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

/// Forward on CUDA storages: separate `a`, `b` (`Some(b)`) or fused `a = [gate | up]`
/// (`None`), into a new `c` of `rows × cols` (without `dm`).
fn fwd_cuda<T: Elem>(
    gate: Gate,
    cfg: &SwigluConfig,
    (rows, cols): (usize, usize),
    a: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let name = names(gate).0;
    let device = &a.0.device;
    let stream = device.cuda_stream();
    let a_view = view::<T>(a.0, a.1, name)?;
    let mut c = output::<T>(&stream, rows * cols, name)?;
    match b {
        Some((b, b_l)) => {
            let args = cfg.apply(SwigluArgs::new(rows, cols));
            let b_view = view::<T>(b, b_l, name)?;
            let bufs = [read(&a_view), read(&b_view), write(&mut c)];
            run(&stream, &args, gate, &FORWARD, bufs)
        }
        None => {
            let args = cfg.apply(SwigluArgs::fused(rows, cols));
            let bufs = [read(&a_view), write(&mut c)];
            run(&stream, &args, gate, &FORWARD_FUSED, bufs)
        }
    }
    .map_err(crate_err)?;
    Ok(wrap(c, device))
}

/// Forward on CPU storages (as [`fwd_cuda`]), by the reference.
fn fwd_cpu<T: HostElem>(
    gate: Gate,
    cfg: &SwigluConfig,
    cols: usize,
    a: (&CpuStorage, &Layout),
    b: Option<(&CpuStorage, &Layout)>,
) -> Result<CpuStorage> {
    cfg.check()?;
    let name = names(gate).0;
    let a_shape = a.1.shape();
    let a = host_slice::<T>(a.0, a.1, name)?;
    let (a, b) = match b {
        Some((b, b_l)) => (a.to_vec(), host_slice::<T>(b, b_l, name)?.to_vec()),
        None => split_gate_up(a, cols).map_err(crate_err)?,
    };
    let args = cfg.apply(SwigluArgs::new(rows_cols(a_shape).0, cols));
    let c = ref_forward(gate, &args, &a, &b)?;
    Ok(T::to_cpu_storage_owned(c))
}

/// SwiGLU with candle autograd: returns `c·dm` with `c = silu(a·gm)·b` element-wise (gate
/// `a`, up `b`, same shape and dtype; rounding as [`crate::swiglu_forward`], then `dm`
/// applied by candle's `affine` when it is not 1, see [`SwigluConfig`]), shaped like `a`.
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
    glu_op(Gate::Silu, a, b, cfg)
}

/// GEGLU with candle autograd: returns `c·dm` with `c = gelu(a·gm)·b` element-wise, GELU in
/// the form `gelu`; otherwise as [`swiglu`] (rounding as [`crate::geglu_forward`]).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::Gelu;
/// use liger_rs::candle::{SwigluConfig, geglu};
/// let dev = Device::new_cuda(0)?;
/// let gate = Tensor::randn(0f32, 1.0, (8, 16384), &dev)?.to_dtype(DType::BF16)?;
/// let up = Tensor::randn(0f32, 1.0, (8, 16384), &dev)?.to_dtype(DType::BF16)?;
/// let c = geglu(&gate, &up, Gelu::Tanh, &SwigluConfig::default())?;
/// # let _ = c;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu(a: &Tensor, b: &Tensor, gelu: Gelu, cfg: &SwigluConfig) -> Result<Tensor> {
    glu_op(gelu.gate(), a, b, cfg)
}

/// [`swiglu`] or [`geglu`].
fn glu_op(gate: Gate, a: &Tensor, b: &Tensor, cfg: &SwigluConfig) -> Result<Tensor> {
    let name = names(gate).0;
    same_shape(name, a, b)?;
    same_dtype(name, a, b)?;
    on(name, &[("a", a), ("b", b)])?;
    let cfg = cfg.for_dtype(a.dtype());
    a.contiguous()?
        .apply_op2(&b.contiguous()?, GluOp { gate, cfg })
}

/// SwiGLU backward without autograd: returns `(da, db)`, the gradients of `c·dm` (what
/// [`swiglu`] returns) from `dc`, the gradient with respect to it, and the forward's `a`, `b`
/// (all of one shape and dtype; `dm` rounded to the dtype as there), as
/// [`crate::swiglu_backward`] computes them.
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
    glu_backward(Gate::Silu, [dc, a, b], cfg)
}

/// GEGLU backward without autograd: `(da, db)`, the gradients of what [`geglu`] returns, as
/// [`crate::geglu_backward`] computes them; otherwise as [`swiglu_backward`].
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::Gelu;
/// use liger_rs::candle::{SwigluConfig, geglu_backward};
/// let dev = Device::new_cuda(0)?;
/// let a = Tensor::randn(0f32, 1.0, (8, 16384), &dev)?;
/// let b = Tensor::randn(0f32, 1.0, (8, 16384), &dev)?;
/// let (da, db) = geglu_backward(&a.ones_like()?, &a, &b, Gelu::Erf, &SwigluConfig::default())?;
/// # let _ = (da, db);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu_backward(
    dc: &Tensor,
    a: &Tensor,
    b: &Tensor,
    gelu: Gelu,
    cfg: &SwigluConfig,
) -> Result<(Tensor, Tensor)> {
    glu_backward(gelu.gate(), [dc, a, b], cfg)
}

/// [`swiglu_backward`] or [`geglu_backward`].
fn glu_backward(
    gate: Gate,
    [dc, a, b]: [&Tensor; 3],
    cfg: &SwigluConfig,
) -> Result<(Tensor, Tensor)> {
    let name = names(gate).0;
    same_shape(name, a, b)?;
    same_shape(name, dc, a)?;
    same_dtype(name, a, b)?;
    same_dtype(name, dc, a)?;
    let cfg = cfg.for_dtype(a.dtype());
    let (dc, a, b) = (dc.contiguous()?, a.contiguous()?, b.contiguous()?);
    let (rows, cols) = rows_cols(a.shape());
    if on(name, &[("dc", &dc), ("a", &a), ("b", &b)])? == On::Cpu {
        fn run<T: HostElem>(
            gate: Gate,
            cfg: &SwigluConfig,
            (rows, cols): (usize, usize),
            [dc, a, b]: [&Tensor; 3],
        ) -> Result<(Tensor, Tensor)> {
            cfg.check()?;
            let args = cfg.apply(SwigluArgs::new(rows, cols));
            let data = [host::<T>(dc)?, host::<T>(a)?, host::<T>(b)?];
            let [dc_h, a_h, b_h] = &data;
            let (da, db) = ref_backward(gate, &args, [dc_h, a_h, b_h])?;
            Ok((
                host_tensor(da, a.shape().clone())?,
                host_tensor(db, a.shape().clone())?,
            ))
        }
        return by_host_dtype!(
            a.dtype(),
            name,
            run(gate, &cfg, (rows, cols), [&dc, &a, &b])
        );
    }
    let (dc_s, dc_l) = dc.storage_and_layout();
    let (a_s, a_l) = a.storage_and_layout();
    let (b_s, b_l) = b.storage_and_layout();
    let storages = [
        (cuda(&dc_s, name, "dc")?, dc_l),
        (cuda(&a_s, name, "a")?, a_l),
        (cuda(&b_s, name, "b")?, b_l),
    ];
    let rc = (rows, cols);
    let (da, db) = by_dtype!(a.dtype(), name, bwd_cuda(gate, &cfg, rc, storages))?;
    Ok((tensor(da, a.shape().clone()), tensor(db, a.shape().clone())))
}

/// Backward on CUDA storages, separate layout: `(da, db)`.
fn bwd_cuda<T: Elem>(
    gate: Gate,
    cfg: &SwigluConfig,
    (rows, cols): (usize, usize),
    [dc, a, b]: [(&CudaStorage, &Layout); 3],
) -> Result<(CudaStorage, CudaStorage)> {
    let name = names(gate).0;
    let device = &a.0.device;
    let stream = device.cuda_stream();
    let n = rows * cols;
    let (mut da, mut db) = (
        output::<T>(&stream, n, name)?,
        output::<T>(&stream, n, name)?,
    );
    let args = cfg.apply(SwigluArgs::new(rows, cols));
    let [dc, a, b] = [dc, a, b].map(|(s, l)| view::<T>(s, l, name));
    let (dc, a, b) = (dc?, a?, b?);
    let bufs = [
        read(&dc),
        read(&a),
        read(&b),
        write(&mut da),
        write(&mut db),
    ];
    run(&stream, &args, gate, &BACKWARD, bufs).map_err(crate_err)?;
    Ok((wrap(da, device), wrap(db, device)))
}

/// SwiGLU with candle autograd from a fused gate-up tensor `[..., 2·cols]` (gate in the first
/// half of the last dim, up in the second, as [`crate::swiglu_forward_fused`]): returns
/// `c·dm` `[..., cols]` as [`swiglu`]. The backward gives the fused gradient in one launch.
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
    glu_fused(Gate::Silu, gate_up, cfg)
}

/// GEGLU with candle autograd from a fused gate-up tensor `[..., 2·cols]`, GELU in the form
/// `gelu`; otherwise as [`swiglu_fused`].
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::Gelu;
/// use liger_rs::candle::{SwigluConfig, geglu_fused};
/// let dev = Device::new_cuda(0)?;
/// let gate_up = Tensor::randn(0f32, 1.0, (4, 32, 2 * 16384), &dev)?;
/// let c = geglu_fused(&gate_up, Gelu::Tanh, &SwigluConfig::default())?; // [4, 32, 16384]
/// # let _ = c;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu_fused(gate_up: &Tensor, gelu: Gelu, cfg: &SwigluConfig) -> Result<Tensor> {
    glu_fused(gelu.gate(), gate_up, cfg)
}

/// [`swiglu_fused`] or [`geglu_fused`].
pub(super) fn glu_fused(gate: Gate, gate_up: &Tensor, cfg: &SwigluConfig) -> Result<Tensor> {
    let name = names(gate).1;
    fused_rows_cols(gate_up, name)?;
    on(name, &[("gate_up", gate_up)])?;
    let cfg = cfg.for_dtype(gate_up.dtype());
    gate_up.contiguous()?.apply_op1(GluOp { gate, cfg })
}

/// Fused SwiGLU backward without autograd: returns `d_gate_up` (shaped like `gate_up`), the
/// gradient of `c·dm` (what [`swiglu_fused`] returns) from `dc` `[..., cols]`, the gradient
/// with respect to it, and the forward's `gate_up` `[..., 2·cols]`, as
/// [`crate::swiglu_backward_fused`] computes it.
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
    glu_fused_backward(Gate::Silu, dc, gate_up, cfg)
}

/// Fused GEGLU backward without autograd: `d_gate_up`, the gradient of what [`geglu_fused`]
/// returns, as [`crate::geglu_backward_fused`] computes it; otherwise as
/// [`swiglu_fused_backward`].
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use liger_rs::Gelu;
/// use liger_rs::candle::{SwigluConfig, geglu_fused, geglu_fused_backward};
/// let dev = Device::new_cuda(0)?;
/// let gate_up = Tensor::randn(0f32, 1.0, (8, 2 * 16384), &dev)?;
/// let cfg = SwigluConfig::default();
/// let c = geglu_fused(&gate_up, Gelu::Erf, &cfg)?;
/// let d_gate_up = geglu_fused_backward(&c.ones_like()?, &gate_up, Gelu::Erf, &cfg)?;
/// # let _ = d_gate_up;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu_fused_backward(
    dc: &Tensor,
    gate_up: &Tensor,
    gelu: Gelu,
    cfg: &SwigluConfig,
) -> Result<Tensor> {
    glu_fused_backward(gelu.gate(), dc, gate_up, cfg)
}

/// [`swiglu_fused_backward`] or [`geglu_fused_backward`].
pub(super) fn glu_fused_backward(
    gate: Gate,
    dc: &Tensor,
    gate_up: &Tensor,
    cfg: &SwigluConfig,
) -> Result<Tensor> {
    let name = names(gate).1;
    let (rows, cols) = fused_rows_cols(gate_up, name)?;
    same_dtype(name, dc, gate_up)?;
    if dc.shape() != &fused_out_shape(gate_up.shape()) {
        return Err(candle_core::Error::Msg(format!(
            "{name}: `dc` must be {:?} for `gate_up` {:?}, got {:?}",
            fused_out_shape(gate_up.shape()).dims(),
            gate_up.dims(),
            dc.dims()
        )));
    }
    let cfg = cfg.for_dtype(gate_up.dtype());
    let (dc, gate_up) = (dc.contiguous()?, gate_up.contiguous()?);
    if on(name, &[("dc", &dc), ("gate_up", &gate_up)])? == On::Cpu {
        fn run<T: HostElem>(
            gate: Gate,
            cfg: &SwigluConfig,
            cols: usize,
            dc: &Tensor,
            gate_up: &Tensor,
        ) -> Result<Tensor> {
            cfg.check()?;
            let (a, b) = split_gate_up(&host::<T>(gate_up)?, cols).map_err(crate_err)?;
            let args = cfg.apply(SwigluArgs::new(a.len() / cols, cols));
            let (da, db) = ref_backward(gate, &args, [&host::<T>(dc)?, &a, &b])?;
            let d = join_gate_up(&da, &db, cols).map_err(crate_err)?;
            host_tensor(d, gate_up.shape().clone())
        }
        return by_host_dtype!(gate_up.dtype(), name, run(gate, &cfg, cols, &dc, &gate_up));
    }
    let (dc_s, dc_l) = dc.storage_and_layout();
    let (g_s, g_l) = gate_up.storage_and_layout();
    let storages = [
        (cuda(&dc_s, name, "dc")?, dc_l),
        (cuda(&g_s, name, "gate_up")?, g_l),
    ];
    let rc = (rows, cols);
    let d = by_dtype!(
        gate_up.dtype(),
        name,
        fused_bwd_cuda(gate, &cfg, rc, storages)
    )?;
    Ok(tensor(d, gate_up.shape().clone()))
}

/// Backward on CUDA storages, fused layout: `d_gate_up`.
fn fused_bwd_cuda<T: Elem>(
    gate: Gate,
    cfg: &SwigluConfig,
    (rows, cols): (usize, usize),
    [dc, gate_up]: [(&CudaStorage, &Layout); 2],
) -> Result<CudaStorage> {
    let name = names(gate).1;
    let device = &gate_up.0.device;
    let stream = device.cuda_stream();
    let mut d = output::<T>(&stream, 2 * rows * cols, name)?;
    let args = cfg.apply(SwigluArgs::fused(rows, cols));
    let (dc, gate_up) = (
        view::<T>(dc.0, dc.1, name)?,
        view::<T>(gate_up.0, gate_up.1, name)?,
    );
    let bufs = [read(&dc), read(&gate_up), write(&mut d)];
    run(&stream, &args, gate, &BACKWARD_FUSED, bufs).map_err(crate_err)?;
    Ok(wrap(d, device))
}

/// The autograd op of [`swiglu`]/[`geglu`] (two inputs) and [`swiglu_fused`]/[`geglu_fused`]
/// (one input); `cfg`'s `dm` is already rounded to the tensors' dtype.
pub(super) struct GluOp {
    gate: Gate,
    cfg: SwigluConfig,
}

impl GluOp {
    /// The fused-layout op of `gate` with the default multipliers.
    pub(super) fn fused(gate: Gate) -> Self {
        GluOp {
            gate,
            cfg: SwigluConfig::default(),
        }
    }
}

impl CustomOp1 for GluOp {
    fn name(&self) -> &'static str {
        names(self.gate).1
    }

    fn cpu_fwd(&self, g: &CpuStorage, g_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = fused_out_shape(g_l.shape());
        let (gate, cfg, cols) = (self.gate, &self.cfg, rows_cols(&shape).1);
        let c = by_host_dtype!(
            g.dtype(),
            names(self.gate).1,
            fwd_cpu(gate, cfg, cols, (g, g_l), None)
        )?;
        Ok((scaled(c, &shape, self.cfg.down_multiplier)?, shape))
    }

    fn cuda_fwd(&self, g: &CudaStorage, g_l: &Layout) -> Result<(CudaStorage, Shape)> {
        let shape = fused_out_shape(g_l.shape());
        let (gate, cfg, rc) = (self.gate, &self.cfg, rows_cols(&shape));
        let c = by_dtype!(
            g.dtype(),
            names(self.gate).1,
            fwd_cuda(gate, cfg, rc, (g, g_l), None)
        )?;
        Ok((scaled(c, &shape, self.cfg.down_multiplier)?, shape))
    }

    fn bwd(&self, gate_up: &Tensor, _c: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let d = glu_fused_backward(self.gate, grad, gate_up, &self.cfg)?;
        Ok(Some(d))
    }
}

impl CustomOp2 for GluOp {
    fn name(&self) -> &'static str {
        names(self.gate).0
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_l: &Layout,
        b: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = a_l.shape().clone();
        let cols = rows_cols(&shape).1;
        let (gate, cfg, b) = (self.gate, &self.cfg, Some((b, b_l)));
        let c = by_host_dtype!(
            a.dtype(),
            names(self.gate).0,
            fwd_cpu(gate, cfg, cols, (a, a_l), b)
        )?;
        Ok((scaled(c, &shape, self.cfg.down_multiplier)?, shape))
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        a_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let shape = a_l.shape().clone();
        let (gate, cfg, rc, b) = (self.gate, &self.cfg, rows_cols(&shape), Some((b, b_l)));
        let c = by_dtype!(
            a.dtype(),
            names(self.gate).0,
            fwd_cuda(gate, cfg, rc, (a, a_l), b)
        )?;
        Ok((scaled(c, &shape, self.cfg.down_multiplier)?, shape))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _c: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = glu_backward(self.gate, [grad, a, b], &self.cfg)?;
        Ok((Some(da), Some(db)))
    }
}
