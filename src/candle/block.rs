//! Llama's decoder layer as two autograd nodes: `h = x + attention(rms_norm(x))` and
//! `y = h + mlp(rms_norm(h))`, each half one node over its input, its norm's weight and one
//! packed weight.
//!
//! candle's backward sums every gradient a node hands on into a zero-filled tensor of that
//! input's size (a fill and an add, one per edge of the graph). Written as separate nodes
//! (norm, projection, attention, projection, residual add), a layer hands on nine gradients of
//! the hidden size and one of the QKV projection's; as these two nodes, two. The node's
//! forward is the output projection with the residual add (one GEMM into a copy of the input,
//! `β = 1`); the norm, the first projection and the attention or the GLU run before it on
//! graph-free tensors, and the node keeps what its backward needs (the tensors candle's graph
//! of the same layer keeps, less what is cheap to recompute: the normalised input and, in the
//! MLP, the activation), and only until its backward has run: candle holds the whole graph
//! until the backward is done, and a node that frees its tensors as it goes lowers the
//! backward's peak by every layer's kept tensors. The backward recomputes what was not kept
//! (an RMSNorm forward, a GLU forward), runs the same kernels and GEMMs in reverse, writes
//! both weight gradients into one packed gradient, and adds the residual's gradient inside
//! the RMSNorm backward ([`crate::fused_add_rms_norm_backward`]). The `_with_slots` forms put the two parameters'
//! gradients into [`GradSlot`]s instead of handing them to candle's backward.
//!
//! CPU tensors go through the composition of this crate's separate ops (the reference), so
//! the same model code runs there.
use super::flash_attn::flash_attn_qkv;
use super::grad_slot::GradSlot;
use super::linear::linear;
use super::qkv_attn::QkvAttn;
use super::rms_norm::{RmsNormConfig, rms_norm, rms_norm_forward};
use super::swiglu::{glu_fused, glu_fused_backward};
use super::{Elem, SwigluConfig, by_dtype, crate_err, cuda, output, tensor, view, wrap};
use crate::blas::{Blas, Gemm};
use crate::identity::Gate;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::sync::{Arc, Mutex};

const ATTN: &str = "liger-rs attention_block";
const MLP: &str = "liger-rs swiglu_mlp_block";

/// The attention half of a Llama decoder layer, for [`attention_block`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionBlockConfig {
    /// Query heads.
    pub heads_q: usize,
    /// Key and value heads (divides `heads_q`).
    pub heads_kv: usize,
    /// The scale of `q·kᵀ` (Llama: `1/√head_dim`).
    pub softmax_scale: f32,
    /// Causal mask (bottom-right aligned, as [`flash_attn_qkv`]'s).
    pub causal: bool,
    /// The input RMSNorm.
    pub norm: RmsNormConfig,
}

impl AttentionBlockConfig {
    /// Causal attention of `heads_q` / `heads_kv` heads of `head_dim`, scale `1/√head_dim`,
    /// RMSNorm with `eps` ([`CastingMode::Llama`](crate::CastingMode::Llama)).
    ///
    /// ```
    /// let cfg = liger_rs::candle::AttentionBlockConfig::llama(16, 4, 64, 1e-5);
    /// assert_eq!(cfg.softmax_scale, 0.125);
    /// ```
    pub fn llama(heads_q: usize, heads_kv: usize, head_dim: usize, eps: f32) -> Self {
        AttentionBlockConfig {
            heads_q,
            heads_kv,
            softmax_scale: 1.0 / (head_dim as f32).sqrt(),
            causal: true,
            norm: RmsNormConfig::default().with_eps(eps),
        }
    }
}

/// Where a block half's parameter gradients go ([`attention_block_with_slots`],
/// [`swiglu_mlp_block_with_slots`]): the norm weight's and the packed weight's. Clones share
/// the slots.
#[derive(Debug, Clone, Default)]
pub struct BlockSlots {
    /// The norm weight's gradient, `[hidden]`.
    pub norm: GradSlot,
    /// The packed weight's gradient, the weight's shape.
    pub weight: GradSlot,
}

/// The attention weights packed for [`attention_block`]: `[q; k; v; oᵀ]`, rows stacked, from
/// HF's `q_proj` `[hq·d, hidden]`, `k_proj` and `v_proj` `[hkv·d, hidden]` and `o_proj`
/// `[hidden, hq·d]` (transposed here: every part then has `hidden` columns).
///
/// # Errors
/// Parts whose shapes do not stack, named by candle.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let dev = Device::Cpu;
/// let (q, kv, o) = ((8, 4), (2, 4), (4, 8));
/// let w = liger_rs::candle::pack_attention_weights(
///     &Tensor::zeros(q, DType::F32, &dev)?,
///     &Tensor::zeros(kv, DType::F32, &dev)?,
///     &Tensor::zeros(kv, DType::F32, &dev)?,
///     &Tensor::zeros(o, DType::F32, &dev)?,
/// )?;
/// assert_eq!(w.dims(), [8 + 2 + 2 + 8, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn pack_attention_weights(q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor) -> Result<Tensor> {
    Tensor::cat(&[q, k, v, &o.t()?], 0)
}

/// The MLP weights packed for [`swiglu_mlp_block`]: `[gate; up; downᵀ]`, rows stacked, from
/// HF's `gate_proj` and `up_proj` `[inter, hidden]` and `down_proj` `[hidden, inter]`.
///
/// # Errors
/// Parts whose shapes do not stack, named by candle.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let dev = Device::Cpu;
/// let w = liger_rs::candle::pack_mlp_weights(
///     &Tensor::zeros((6, 4), DType::F32, &dev)?,
///     &Tensor::zeros((6, 4), DType::F32, &dev)?,
///     &Tensor::zeros((4, 6), DType::F32, &dev)?,
/// )?;
/// assert_eq!(w.dims(), [18, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn pack_mlp_weights(gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    Tensor::cat(&[gate, up, &down.t()?], 0)
}

/// `x + attention(rms_norm(x))`, the attention half of a Llama decoder layer, as one autograd
/// node (the module docs say what that saves candle's backward).
///
/// `x` `[batch, seq, hidden]`; `norm_weight` `[hidden]`; `weight` `[(2·hq + 2·hkv)·d,
/// hidden]`, [`pack_attention_weights`]'s layout (the rows of a fused QKV projection, then
/// the output projection's transpose); `rope`: `(cos, sin)` `[rows ≥ seq, d/2]` in `x`'s
/// dtype, NeoX RoPE on q and k, or none. One dtype and device. The value is that of the
/// composition [`rms_norm`] → [`linear`] (the QKV rows) → [`flash_attn_qkv`] → the output
/// projection → the residual add, with the same kernels and GEMMs (CPU tensors take that
/// composition). Gradients flow to `x`, `norm_weight` and `weight`; the tables are constants.
/// The node keeps the rotated QKV projection, the attention output and the log-sum-exp until
/// its backward, which recomputes the normalised input (one RMSNorm forward) and frees them:
/// a second backward through the same graph is an error, as in PyTorch without
/// `retain_graph`.
///
/// # Errors
/// Shapes that do not fit (named), another dtype or device, heads that do not divide; the
/// kernels' and cuBLAS's errors.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{AttentionBlockConfig, attention_block};
/// let dev = Device::new_cuda(0)?;
/// let (b, t, hidden, hq, hkv, d) = (2, 1024, 2048, 16, 4, 128);
/// let x = Tensor::randn(0f32, 1.0, (b, t, hidden), &dev)?.to_dtype(DType::BF16)?;
/// let norm = Tensor::ones(hidden, DType::BF16, &dev)?;
/// let w = Tensor::randn(0f32, 0.02, ((2 * hq + 2 * hkv) * d, hidden), &dev)?.to_dtype(DType::BF16)?;
/// let angles = Tensor::randn(0f32, 1.0, (t, d / 2), &dev)?;
/// let (cos, sin) = (angles.cos()?.to_dtype(DType::BF16)?, angles.sin()?.to_dtype(DType::BF16)?);
/// let cfg = AttentionBlockConfig::llama(hq, hkv, d, 1e-5);
/// let h = attention_block(&x, &norm, &w, Some((&cos, &sin)), &cfg)?; // [b, t, hidden]
/// # let _ = h;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_block(
    x: &Tensor,
    norm_weight: &Tensor,
    weight: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    cfg: &AttentionBlockConfig,
) -> Result<Tensor> {
    attention(x, norm_weight, weight, rope, cfg, None)
}

/// [`attention_block`] whose backward puts the gradients of `norm_weight` and `weight` into
/// `slots` (summed with what they hold) and hands candle's backward only `x`'s: no zero fill
/// and add of the packed weight's size per step. On the CPU, the composition's gradients go
/// to the slots the same way.
///
/// # Errors
/// As [`attention_block`].
///
/// ```
/// use candle_core::{Device, Var};
/// use liger_rs::candle::{AttentionBlockConfig, BlockSlots, attention_block_with_slots};
/// let dev = Device::Cpu;
/// let (hidden, hq, hkv, d) = (8, 2, 1, 4);
/// let x = Var::randn(0f32, 1.0, (1, 3, hidden), &dev)?;
/// let norm = Var::ones(hidden, candle_core::DType::F32, &dev)?;
/// let w = Var::randn(0f32, 0.1, ((2 * hq + 2 * hkv) * d, hidden), &dev)?;
/// let slots = BlockSlots::default();
/// let cfg = AttentionBlockConfig::llama(hq, hkv, d, 1e-5);
/// let h = attention_block_with_slots(x.as_tensor(), norm.as_tensor(), w.as_tensor(), None, &cfg, &slots)?;
/// let mut grads = h.sum_all()?.backward()?;
/// assert!(grads.get(&w).is_none() && grads.get(&x).is_some());
/// slots.weight.drain_into(&mut grads, w.as_tensor())?;
/// assert_eq!(grads.get(&w).unwrap().dims(), w.dims());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_block_with_slots(
    x: &Tensor,
    norm_weight: &Tensor,
    weight: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    cfg: &AttentionBlockConfig,
    slots: &BlockSlots,
) -> Result<Tensor> {
    attention(x, norm_weight, weight, rope, cfg, Some(slots))
}

fn attention(
    x: &Tensor,
    norm_weight: &Tensor,
    weight: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    cfg: &AttentionBlockConfig,
    slots: Option<&BlockSlots>,
) -> Result<Tensor> {
    let (hq, hkv) = (cfg.heads_q, cfg.heads_kv);
    let (b, t, hidden) = match *x.dims() {
        [b, t, hidden] => (b, t, hidden),
        _ => bail!("{ATTN}: x must be [batch, seq, hidden], got {:?}", x.dims()),
    };
    if hq == 0 || hkv == 0 || !hq.is_multiple_of(hkv) {
        bail!("{ATTN}: heads_kv ({hkv}) must divide heads_q ({hq}), both ≥ 1")
    }
    let heads = 2 * hq + 2 * hkv;
    let d = match *weight.dims() {
        [rows, h] if h == hidden && rows > 0 && rows.is_multiple_of(heads) => rows / heads,
        _ => bail!(
            "{ATTN}: weight must be [(2·{hq} + 2·{hkv})·head_dim, {hidden}] (q, k, v, oᵀ rows), \
             got {:?}",
            weight.dims()
        ),
    };
    check_params(ATTN, x, norm_weight, weight)?;
    let (qkv_rows, o_rows) = ((hq + 2 * hkv) * d, hq * d);
    if !x.device().is_cuda() {
        let (norm_weight, weight) = routed(norm_weight, weight, slots)?;
        let n = rms_norm(x, Some(&norm_weight), &cfg.norm)?;
        let qkv = linear(&n, &weight.narrow(0, 0, qkv_rows)?, None)?;
        let a = flash_attn_qkv(&qkv, hq, hkv, rope, cfg.softmax_scale, cfg.causal)?;
        let out = a.reshape((b * t, o_rows))?;
        let out = out.matmul(&weight.narrow(0, qkv_rows, o_rows)?)?;
        return x + out.reshape((b, t, hidden))?;
    }
    let (x, norm_weight, weight) = (
        x.contiguous()?,
        norm_weight.contiguous()?,
        weight.contiguous()?,
    );
    let (xd, wp) = (x.detach(), weight.detach());
    let (n, _) = rms_norm_forward(&xd, Some(&norm_weight.detach()), &cfg.norm)?;
    let qkv = n
        .reshape((b * t, hidden))?
        .matmul(&wp.narrow(0, 0, qkv_rows)?.t()?)?
        .reshape((b, t, qkv_rows))?;
    let attn = QkvAttn::new((hq, hkv), rope, cfg.softmax_scale, cfg.causal, &qkv)?;
    let (a, kept) = attn.attend(&qkv)?;
    let node = BlockOp {
        name: ATTN,
        norm: cfg.norm,
        split: qkv_rows,
        kept: Mutex::new(Some(Inner::Attention {
            attn,
            kept,
            out: a.reshape((b * t, o_rows))?,
        })),
        slots: slots.cloned(),
    };
    x.apply_op3(&norm_weight, &weight, node)
}

/// `x + swiglu_mlp(rms_norm(x))`, the MLP half of a Llama decoder layer, as one autograd
/// node (the module docs say what that saves candle's backward).
///
/// `x` `[..., hidden]`; `norm_weight` `[hidden]`; `weight` `[3·inter, hidden]`,
/// [`pack_mlp_weights`]'s layout (the gate rows, the up rows, then the down projection's
/// transpose). One dtype and device. The value is that of [`rms_norm`] →
/// [`swiglu_mlp`](super::swiglu_mlp) → the residual add, with the same kernels and GEMMs (CPU
/// tensors take that composition). Gradients flow to all three. The node keeps the gate-up
/// projection until its backward, which recomputes the normalised input and the activation
/// (an RMSNorm and a GLU forward) and frees it (a second backward through the same graph is
/// an error).
///
/// # Errors
/// Shapes that do not fit (named), another dtype or device; the kernels' and cuBLAS's errors.
///
/// ```
/// use candle_core::{Device, Var};
/// use liger_rs::candle::{RmsNormConfig, swiglu_mlp_block};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[1f32, -2.0]], &dev)?;
/// let norm = Var::new(&[1f32, 1.0], &dev)?;
/// // inter = 1: the gate row, the up row, the down projection's transpose.
/// let w = Var::new(&[[1f32, 0.0], [0.0, 1.0], [1.0, 1.0]], &dev)?;
/// let y = swiglu_mlp_block(&x, &norm, &w, &RmsNormConfig::default().with_eps(0.0))?;
/// let n = [1.0 / 2.5f32.sqrt(), -2.0 / 2.5f32.sqrt()]; // x / rms(x)
/// let act = n[0] / (1.0 + (-n[0]).exp()) * n[1]; // silu(gate) · up
/// let got = y.to_vec2::<f32>()?;
/// assert!((got[0][0] - (1.0 + act)).abs() < 1e-6 && (got[0][1] - (-2.0 + act)).abs() < 1e-6);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&w).unwrap().dims(), [3, 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_mlp_block(
    x: &Tensor,
    norm_weight: &Tensor,
    weight: &Tensor,
    norm: &RmsNormConfig,
) -> Result<Tensor> {
    mlp(x, norm_weight, weight, norm, None)
}

/// [`swiglu_mlp_block`] whose backward puts the gradients of `norm_weight` and `weight` into
/// `slots`, as [`attention_block_with_slots`].
///
/// # Errors
/// As [`swiglu_mlp_block`].
pub fn swiglu_mlp_block_with_slots(
    x: &Tensor,
    norm_weight: &Tensor,
    weight: &Tensor,
    norm: &RmsNormConfig,
    slots: &BlockSlots,
) -> Result<Tensor> {
    mlp(x, norm_weight, weight, norm, Some(slots))
}

fn mlp(
    x: &Tensor,
    norm_weight: &Tensor,
    weight: &Tensor,
    norm: &RmsNormConfig,
    slots: Option<&BlockSlots>,
) -> Result<Tensor> {
    let hidden = match x.dims().last() {
        Some(&h) => h,
        None => bail!("{MLP}: x must be [..., hidden], got a scalar"),
    };
    let inter = match *weight.dims() {
        [rows, h] if h == hidden && rows > 0 && rows.is_multiple_of(3) => rows / 3,
        _ => bail!(
            "{MLP}: weight must be [3·inter, {hidden}] (gate, up, downᵀ rows), got {:?}",
            weight.dims()
        ),
    };
    check_params(MLP, x, norm_weight, weight)?;
    let m: usize = x.dims()[..x.rank() - 1].iter().product();
    if !x.device().is_cuda() {
        let (norm_weight, weight) = routed(norm_weight, weight, slots)?;
        let n = rms_norm(x, Some(&norm_weight), norm)?;
        let gu = linear(&n, &weight.narrow(0, 0, 2 * inter)?, None)?;
        let act = glu_fused(Gate::Silu, &gu, &SwigluConfig::default())?;
        let out = act
            .reshape((m, inter))?
            .matmul(&weight.narrow(0, 2 * inter, inter)?)?;
        return x + out.reshape(x.shape())?;
    }
    let (x, norm_weight, weight) = (
        x.contiguous()?,
        norm_weight.contiguous()?,
        weight.contiguous()?,
    );
    let (xd, wp) = (x.detach(), weight.detach());
    let (n, _) = rms_norm_forward(&xd, Some(&norm_weight.detach()), norm)?;
    let gu = n
        .reshape((m, hidden))?
        .matmul(&wp.narrow(0, 0, 2 * inter)?.t()?)?;
    let act = glu_fused(Gate::Silu, &gu, &SwigluConfig::default())?;
    let node = BlockOp {
        name: MLP,
        norm: *norm,
        split: 2 * inter,
        kept: Mutex::new(Some(Inner::Mlp {
            gate: Gate::Silu,
            gate_up: gu,
            act: Some(act),
        })),
        slots: slots.cloned(),
    };
    x.apply_op3(&norm_weight, &weight, node)
}

/// The CPU composition's parameters, through `slots` where given.
fn routed(
    norm_weight: &Tensor,
    weight: &Tensor,
    slots: Option<&BlockSlots>,
) -> Result<(Tensor, Tensor)> {
    match slots {
        Some(s) => Ok((s.norm.route(norm_weight)?, s.weight.route(weight)?)),
        None => Ok((norm_weight.clone(), weight.clone())),
    }
}

/// `x`'s norm weight and packed weight: `[hidden]`, one dtype and device.
fn check_params(op: &str, x: &Tensor, norm_weight: &Tensor, weight: &Tensor) -> Result<()> {
    let hidden = x.dims().last().copied().unwrap_or(0);
    if norm_weight.dims() != [hidden] {
        bail!(
            "{op}: norm_weight must be [{hidden}], got {:?}",
            norm_weight.dims()
        )
    }
    for (arg, p) in [("norm_weight", norm_weight), ("weight", weight)] {
        if p.dtype() != x.dtype() {
            bail!("{op}: {arg} is {:?}, x is {:?}", p.dtype(), x.dtype())
        }
        if !p.device().same_device(x.device()) {
            bail!("{op}: {arg} is on another device than x")
        }
    }
    Ok(())
}

/// What a half runs between its first projection and its last (computed before the node is
/// built: the node's forward is only the last projection), and what its backward keeps of it.
enum Inner {
    /// RoPE and attention over the QKV projection; the rotated QKV and the log-sum-exp, and
    /// the attention output `[rows, hq·d]`.
    Attention {
        attn: QkvAttn,
        kept: [Tensor; 2],
        out: Tensor,
    },
    /// The GLU over the gate-up projection, which is kept; the activation until the forward
    /// has used it (the backward recomputes it).
    Mlp {
        gate: Gate,
        gate_up: Tensor,
        act: Option<Tensor>,
    },
}

/// The node over `x`, the norm weight and the packed weight, whose rows `split..` are the last
/// projection's transpose.
struct BlockOp {
    name: &'static str,
    norm: RmsNormConfig,
    split: usize,
    /// Until the backward takes it (freeing it as soon as the backward of this half is
    /// done, not when the graph is dropped).
    kept: Mutex<Option<Inner>>,
    slots: Option<BlockSlots>,
}

impl BlockOp {
    /// The last projection's input: the attention output, or the activation (once).
    fn mid(&self) -> Result<Tensor> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let mid = match kept.as_mut() {
            Some(Inner::Attention { out, .. }) => Some(out.clone()),
            Some(Inner::Mlp { act, .. }) => act.take(),
            None => None,
        };
        mid.ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }

    /// `x + mid·W[split..]`: `x` copied, then one GEMM with `β = 1`.
    fn residual<T: Elem>(
        &self,
        (x, lx): (&CudaStorage, &Layout),
        (w, lw): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let mid = &self.mid()?;
        let (ms, ml) = mid.storage_and_layout();
        let mid_v = view::<T>(cuda(&ms, self.name, "mid")?, ml, self.name)?;
        let x_v = view::<T>(x, lx, self.name)?;
        let w_v = view::<T>(w, lw, self.name)?;
        let (rows, k) = mid.dims2()?;
        let hidden = lw.dims()[1];
        let stream = x.device.cuda_stream();
        let mut out = stream.clone_dtod(&x_v).map_err(|e| crate_err(e.into()))?;
        let proj = w_v.slice(self.split * hidden..);
        let blas = Blas::on(&stream).map_err(crate_err)?;
        gemm::<T>(
            &blas,
            &stream,
            (rows, hidden, k),
            (&mid_v, false),
            (&proj, false),
            &mut out,
            1.0,
        )?;
        Ok((wrap(out, &x.device), lx.shape().clone()))
    }

    fn backward<T: Elem>(
        &self,
        [x, norm_weight, weight, dy]: [&Tensor; 4],
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let (norm_weight_d, w) = (norm_weight.detach(), weight.detach());
        let (rows_w, hidden) = w.dims2()?;
        let x_d = x.detach();
        let (n, rstd) = rms_norm_forward(&x_d, Some(&norm_weight_d), &self.norm)?;
        let rows = n.elem_count() / hidden;
        let n = n.reshape((rows, hidden))?;
        let dy = dy.contiguous()?.reshape((rows, hidden))?;
        let first = w.narrow(0, 0, self.split)?;
        let d_mid = dy.matmul(&w.narrow(0, self.split, rows_w - self.split)?.t()?)?;
        let inner = self.kept.lock().unwrap_or_else(|p| p.into_inner()).take();
        let inner = inner.ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{}: a second backward through the same graph (the first freed what the node \
                 kept)",
                self.name
            ))
        })?;
        let (d_first, mid) = match &inner {
            Inner::Attention { attn, kept, out } => {
                let (b, t, _) = kept[0].dims3()?;
                let k = out.dim(1)?;
                let (o, d_o) = (out.reshape((b, t, k))?, d_mid.reshape((b, t, k))?);
                let d_qkv = attn.grad(kept, &o, &d_o)?.reshape((rows, self.split))?;
                (d_qkv, out.clone())
            }
            Inner::Mlp { gate, gate_up, .. } => {
                let cfg = SwigluConfig::default();
                let d_gate_up = glu_fused_backward(*gate, &d_mid, gate_up, &cfg)?;
                (d_gate_up, glu_fused(*gate, gate_up, &cfg)?)
            }
        };
        let k = mid.dim(1)?;
        let dn = d_first.matmul(&first)?;
        let slots = self.slots.as_ref();
        let dw = match weight.track_op() {
            false => None,
            true => {
                Some(self.weight_grad::<T>([&d_first, &n, &mid, &dy], (rows_w, hidden, rows, k))?)
            }
        };
        // Freed before the norm's backward allocates its outputs.
        drop((n, mid, d_first, inner));
        let with_dw = norm_weight.track_op();
        let (dx, d_norm) = super::fused_add_rms_norm::backward(
            &dn.flatten_all()?,
            &dy.flatten_all()?,
            &x.detach().flatten_all()?,
            Some(&norm_weight_d),
            &rstd,
            &self.norm,
            with_dw,
            x.dims(),
        )?;
        let (norm_slot, weight_slot) = match slots {
            Some(s) => (Some(&s.norm), Some(&s.weight)),
            None => (None, None),
        };
        Ok((
            dx.reshape(x.shape())?,
            GradSlot::hand_on(norm_slot, norm_weight, d_norm)?,
            GradSlot::hand_on(weight_slot, weight, dw)?,
        ))
    }

    /// The packed weight's gradient: `d_firstᵀ·n` in rows `..split`, `midᵀ·dy` after.
    fn weight_grad<T: Elem>(
        &self,
        [d_first, n, mid, dy]: [&Tensor; 4],
        (rows_w, hidden, rows, k): (usize, usize, usize, usize),
    ) -> Result<Tensor> {
        let guards = [d_first, n, mid, dy].map(|t| t.storage_and_layout());
        let names = ["d_first", "n", "mid", "dy"];
        let mut views = Vec::with_capacity(4);
        for ((s, l), name) in guards.iter().zip(names) {
            views.push(view::<T>(cuda(s, self.name, name)?, l, self.name)?);
        }
        let device = cuda(&guards[0].0, self.name, "d_first")?.device.clone();
        let stream = device.cuda_stream();
        let mut dw = output::<T>(&stream, rows_w * hidden, self.name)?;
        let blas = Blas::on(&stream).map_err(crate_err)?;
        let split = self.split * hidden;
        {
            let (mut head, mut tail) = dw.split_at_mut(split);
            let (n_rows, v) = ((self.split, hidden, rows), &views);
            gemm::<T>(
                &blas,
                &stream,
                n_rows,
                (&v[0], true),
                (&v[1], false),
                &mut head,
                0.0,
            )?;
            let tail_dims = (k, hidden, rows);
            gemm::<T>(
                &blas,
                &stream,
                tail_dims,
                (&v[2], true),
                (&v[3], false),
                &mut tail,
                0.0,
            )?;
        }
        Ok(tensor(wrap(dw, &device), (rows_w, hidden)))
    }
}

/// Row-major `c [m, n] ← op(a)·op(b) + β·c` with `op(a)` `[m, k]` (`a` stored `[k, m]` when
/// transposed) and `op(b)` `[k, n]` (`b` stored `[n, k]` when transposed), f32 accumulation.
fn gemm<T: Elem>(
    blas: &Blas<'_>,
    stream: &Arc<CudaStream>,
    (m, n, k): (usize, usize, usize),
    (a, ta): (&impl DevicePtr<T>, bool),
    (b, tb): (&impl DevicePtr<T>, bool),
    c: &mut impl DevicePtrMut<T>,
    beta: f32,
) -> Result<()> {
    if a.len() < m * k || b.len() < k * n || c.len() < m * n {
        bail!(
            "liger-rs block GEMM: operands of {} / {} / {} elements for [{m}, {k}]·[{k}, {n}]",
            a.len(),
            b.len(),
            c.len()
        )
    }
    let (pa, _a_use) = a.device_ptr(stream);
    let (pb, _b_use) = b.device_ptr(stream);
    let (pc, _c_use) = c.device_ptr_mut(stream);
    // Column-major, the product is cᵀ = op(b)ᵀ·op(a)ᵀ: b's storage is op(b)ᵀ read as
    // [n, k] column-major (ld n) unless transposed, a's likewise.
    let g = Gemm {
        trans_a: tb,
        trans_b: ta,
        m: n,
        n: m,
        k,
        a: pb,
        lda: if tb { k } else { n },
        b: pa,
        ldb: if ta { m } else { k },
        c: pc,
        ldc: n,
        c_type: T::ELEM,
        beta,
    };
    // SAFETY: the three buffers hold their operands (lengths checked above), all of this
    // context and ordered on `stream`; `c` is a fresh or exclusively borrowed buffer that
    // overlaps neither input.
    unsafe { blas.gemm::<T>(&g) }.map_err(crate_err)
}

impl CustomOp3 for BlockOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!(
            "{}: CPU tensors take the composed ops (no node is built for them)",
            self.name
        )
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        _: &CudaStorage,
        _: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        by_dtype!(x.dtype(), self.name, residual_t(self, (x, lx), (w, lw)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        norm_weight: &Tensor,
        weight: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dn, dw) = by_dtype!(
            x.dtype(),
            self.name,
            backward_t(self, [x, norm_weight, weight, dy])
        )?;
        Ok((Some(dx), dn, dw))
    }
}

fn residual_t<T: Elem>(
    op: &BlockOp,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    op.residual::<T>(x, w)
}

#[allow(clippy::type_complexity)]
fn backward_t<T: Elem>(
    op: &BlockOp,
    t: [&Tensor; 4],
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    op.backward::<T>(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The CPU path is the composition, so its gradients are the separate ops'.
    #[test]
    fn mlp_block_on_the_cpu_is_the_composition() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (2, 3, 8), &dev)?;
        let nw = Var::randn(1f32, 0.1, 8, &dev)?;
        let w = Var::randn(0f32, 0.3, (3 * 5, 8), &dev)?;
        let y = swiglu_mlp_block(&x, &nw, &w, &RmsNormConfig::default())?;
        let n = rms_norm(&x, Some(&nw), &RmsNormConfig::default())?;
        let mlp = super::super::swiglu_mlp(&n, &w.narrow(0, 0, 10)?, &w.narrow(0, 10, 5)?.t()?)?;
        let want = (x.as_tensor() + mlp)?;
        let gap = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(gap < 1e-5, "{gap}");
        Ok(())
    }
}
