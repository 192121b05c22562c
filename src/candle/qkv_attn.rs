//! Attention over one fused QKV projection, RoPE applied inside, as one autograd node.
//!
//! The same attention written as candle ops over views of the projection is three narrows and
//! reshapes, two RoPE nodes, the attention node and a reshape of its output: candle's backward
//! sums each gradient a node hands on into a zero-filled tensor of that input's size, and a
//! narrow's gradient is first padded to the whole projection. As one node the backward hands
//! the projection one gradient: the forward rotates a copy of q and k in place
//! ([`crate::rope_forward_fused`]) and attends over views of it, keeping the copy and the
//! log-sum-exp; the backward runs [`crate::attention_backward`], rotates dq and dk back
//! ([`crate::rope_backward`]) and joins dq, dk, dv in the projection's layout.
use super::flash_attn::flash_attn;
use super::nn::rotary_emb::rope_thd;
use super::{Elem, by_dtype, crate_err, output, tensor, wrap};
use crate::attention::Strides;
use crate::{AttentionArgs, CosSinLayout, RopeArgs};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, bail};
use std::sync::Mutex;

const OP: &str = "liger-rs flash_attn_qkv";

/// The node over `qkv [b, t, (hq + 2·hkv)·d]`; it keeps the rotated copy of `qkv` and the
/// log-sum-exp `[b, hq, t]`. [`super::block`] runs its forward and backward inside its own
/// node.
pub(super) struct QkvAttn {
    heads_q: usize,
    heads_kv: usize,
    scale: f32,
    causal: bool,
    /// `cos`, `sin` `[rows ≥ t, d/2]` (detached), or none.
    rope: Option<(Tensor, Tensor)>,
    saved: Mutex<Option<[Tensor; 2]>>,
}

/// `(b, t, d)` and the three heads' offsets in a token's row.
struct Dims {
    b: usize,
    t: usize,
    d: usize,
    row: usize,
    k_at: usize,
    v_at: usize,
}

impl QkvAttn {
    /// The attention of `flash_attn_qkv`'s arguments, `rope` checked against `qkv`'s `(t, d)`
    /// and `dtype` (its first `t` rows are kept).
    pub(super) fn new(
        (heads_q, heads_kv): (usize, usize),
        rope: Option<(&Tensor, &Tensor)>,
        softmax_scale: f32,
        causal: bool,
        qkv: &Tensor,
    ) -> Result<Self> {
        let (t, d) = (qkv.dim(1)?, qkv.dim(2)? / (heads_q + 2 * heads_kv));
        Ok(QkvAttn {
            heads_q,
            heads_kv,
            scale: softmax_scale,
            causal,
            rope: tables(rope, t, d, qkv)?,
            saved: Mutex::new(None),
        })
    }

    /// The forward over a contiguous CUDA `qkv` `[b, t, (hq + 2·hkv)·d]` outside any graph:
    /// `o` `[b, t, hq·d]` and what [`QkvAttn::grad`] needs (the rotated copy, the
    /// log-sum-exp).
    pub(super) fn attend(&self, qkv: &Tensor) -> Result<(Tensor, [Tensor; 2])> {
        let o = {
            let (s, l) = qkv.storage_and_layout();
            let s = super::cuda(&s, OP, "qkv")?;
            let (o, shape) = by_dtype!(qkv.dtype(), OP, forward_t(self, s, l))?;
            tensor(o, shape)
        };
        let saved = self.saved.lock().unwrap_or_else(|p| p.into_inner()).take();
        let saved = saved.ok_or_else(|| candle_core::Error::Msg(format!("{OP}: no forward")))?;
        Ok((o, saved))
    }

    /// `dqkv` `[b, t, (hq + 2·hkv)·d]` from [`QkvAttn::attend`]'s results and `o`'s
    /// gradient `d_o` (contiguous).
    pub(super) fn grad(
        &self,
        [rotated, lse]: &[Tensor; 2],
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<Tensor> {
        by_dtype!(
            rotated.dtype(),
            OP,
            backward_t(self, [rotated, o, d_o, lse])
        )
    }

    fn dims(&self, shape: &Shape) -> Result<Dims> {
        let (b, t, row) = shape.dims3()?;
        let d = row / (self.heads_q + 2 * self.heads_kv);
        Ok(Dims {
            b,
            t,
            d,
            row,
            k_at: self.heads_q * d,
            v_at: (self.heads_q + self.heads_kv) * d,
        })
    }

    /// Attention over views of one `[b, t, row]` buffer (q at 0, k at `k_at`, v at `v_at`).
    fn args(&self, d: &Dims) -> AttentionArgs {
        let s = Strides {
            batch: d.t * d.row,
            token: d.row,
            head: d.d,
        };
        AttentionArgs::new(d.b, d.t, d.t, self.heads_q, self.heads_kv, d.d)
            .with_scale(self.scale)
            .with_window(None, self.causal.then_some(0))
            .with_strides(s, s, s)
    }

    /// RoPE over `b·t` rows of `heads` heads, `stride` elements apart (half-width tables).
    fn rope_args(&self, d: &Dims, heads: (usize, usize), stride: (usize, usize)) -> RopeArgs {
        RopeArgs::new(d.d)
            .with_batch(d.b)
            .with_seq_len(d.t)
            .with_heads(heads.0, heads.1)
            .with_strides(stride.0, stride.1)
            .with_half_tables()
    }

    fn forward<T: Elem>(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dims = self.dims(l.shape())?;
        let device = &s.device;
        let stream = device.cuda_stream();
        let n = l.shape().elem_count();
        let start = l.start_offset();
        let src = s.as_cuda_slice::<T>()?.slice(start..start + n);
        let mut rotated = stream.clone_dtod(&src).map_err(|e| crate_err(e.into()))?;
        if let Some((cos, sin)) = &self.rope {
            let (cs, cl) = cos.storage_and_layout();
            let (ss, sl) = sin.storage_and_layout();
            let cos = super::view::<T>(super::cuda(&cs, OP, "cos")?, cl, OP)?;
            let sin = super::view::<T>(super::cuda(&ss, OP, "sin")?, sl, OP)?;
            let args = self.rope_args(&dims, (self.heads_q, self.heads_kv), (dims.row, dims.row));
            crate::rope_forward_fused(
                &stream,
                &args,
                &mut rotated,
                dims.k_at,
                &cos,
                &sin,
                &CosSinLayout::PerPosition,
            )
            .map_err(crate_err)?;
        }
        let args = self.args(&dims);
        let mut o = output::<T>(&stream, args.out_len(), OP)?;
        let mut lse = stream
            .alloc_zeros::<f32>(args.lse_len().max(1))
            .map_err(|e| crate_err(e.into()))?;
        crate::attention_forward(
            &stream,
            &args,
            &rotated.slice(0..),
            &rotated.slice(dims.k_at..),
            &rotated.slice(dims.v_at..),
            &mut o,
            &mut lse,
        )
        .map_err(crate_err)?;
        *self.saved.lock().unwrap_or_else(|p| p.into_inner()) = Some([
            tensor(wrap(rotated, device), l.shape().clone()),
            tensor(wrap(lse, device), args.lse_len().max(1)),
        ]);
        let shape = Shape::from((dims.b, dims.t, self.heads_q * dims.d));
        Ok((wrap(o, device), shape))
    }

    fn backward<T: Elem>(&self, [rotated, o, d_o, lse]: [&Tensor; 4]) -> Result<Tensor> {
        let dims = self.dims(rotated.shape())?;
        let args = self.args(&dims);
        let (rs, rl) = rotated.storage_and_layout();
        let (os, ol) = o.storage_and_layout();
        let (ds, dl) = d_o.storage_and_layout();
        let (ls, ll) = lse.storage_and_layout();
        let rc = super::cuda(&rs, OP, "qkv")?;
        let device = &rc.device;
        let stream = device.cuda_stream();
        let r = super::view::<T>(rc, rl, OP)?;
        let o = super::view::<T>(super::cuda(&os, OP, "o")?, ol, OP)?;
        let d_o = super::view::<T>(super::cuda(&ds, OP, "grad")?, dl, OP)?;
        let lse = super::view::<f32>(super::cuda(&ls, OP, "lse")?, ll, OP)?;
        let (q_len, kv_len) = (
            dims.b * dims.t * self.heads_q * dims.d,
            dims.b * dims.t * self.heads_kv * dims.d,
        );
        let mut dq = output::<T>(&stream, q_len, OP)?;
        let mut dk = output::<T>(&stream, kv_len, OP)?;
        let mut dv = output::<T>(&stream, kv_len, OP)?;
        crate::attention_backward(
            &stream,
            &args,
            &r.slice(0..),
            &r.slice(dims.k_at..),
            &r.slice(dims.v_at..),
            &o,
            &d_o,
            &lse,
            &mut dq,
            &mut dk,
            &mut dv,
        )
        .map_err(crate_err)?;
        if let Some((cos, sin)) = &self.rope {
            let (cs, cl) = cos.storage_and_layout();
            let (ss, sl) = sin.storage_and_layout();
            let cos = super::view::<T>(super::cuda(&cs, OP, "cos")?, cl, OP)?;
            let sin = super::view::<T>(super::cuda(&ss, OP, "sin")?, sl, OP)?;
            let heads = (self.heads_q, self.heads_kv);
            let strides = (heads.0 * dims.d, heads.1 * dims.d);
            crate::rope_backward(
                &stream,
                &self.rope_args(&dims, heads, strides),
                &mut dq,
                &mut dk,
                &cos,
                &sin,
                &CosSinLayout::PerPosition,
            )
            .map_err(crate_err)?;
        }
        let (b, t) = (dims.b, dims.t);
        let part = |s, heads: usize| tensor(wrap(s, device), (b, t, heads * dims.d));
        Tensor::cat(
            &[
                part(dq, self.heads_q),
                part(dk, self.heads_kv),
                part(dv, self.heads_kv),
            ],
            2,
        )
    }
}

impl CustomOp1 for QkvAttn {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{OP}: CPU tensors take the composed ops (flash_attn_qkv builds no node for them)")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        by_dtype!(s.dtype(), OP, forward_t(self, s, l))
    }

    fn bwd(&self, _qkv: &Tensor, o: &Tensor, d_o: &Tensor) -> Result<Option<Tensor>> {
        let Some([rotated, lse]) = self.saved.lock().unwrap_or_else(|p| p.into_inner()).clone()
        else {
            bail!("{OP}: backward before forward")
        };
        let d_o = d_o.contiguous()?;
        let g = by_dtype!(
            rotated.dtype(),
            OP,
            backward_t(self, [&rotated, o, &d_o, &lse])
        )?;
        Ok(Some(g))
    }
}

fn forward_t<T: Elem>(op: &QkvAttn, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    op.forward::<T>(s, l)
}

fn backward_t<T: Elem>(op: &QkvAttn, t: [&Tensor; 4]) -> Result<Tensor> {
    op.backward::<T>(t)
}

/// Attention over the output of one fused QKV projection, `qkv` `[batch, seq, (heads_q +
/// 2·heads_kv)·head_dim]` (per token: the query heads, the key heads, the value heads, as a
/// `qkv_proj` with the q, k and v weights stacked writes it), with NeoX RoPE on q and k when
/// `rope` is given: `(cos, sin)` `[rows ≥ seq, head_dim / 2]` in `qkv`'s dtype (candle-nn's
/// `rope` tables, as [`rope_thd`](super::nn::rotary_emb::rope_thd) takes them; position `i`
/// reads row `i`). Returns `[batch, seq, heads_q·head_dim]`, the input of the output
/// projection. Causal masks bottom-right aligned; `softmax_scale` as in
/// [`flash_attn`](super::flash_attn::flash_attn); GQA and MQA when `heads_kv` divides
/// `heads_q`.
///
/// Differentiable in `qkv`; the tables are constants (no gradient reaches them). On CUDA the
/// whole call is one autograd node (the module docs say what that saves): its values are
/// those of [`rope_thd`](super::nn::rotary_emb::rope_thd) on q and k views and
/// `flash_attn` composed, the same kernels. CPU tensors go through that composition (the
/// crate's references).
///
/// # Errors
/// `qkv` not rank 3 or its last dim not `(heads_q + 2·heads_kv)·head_dim`, heads that do
/// not divide, tables of another shape, dtype or device, named; the kernels' errors (e.g. an
/// odd head_dim with RoPE, a head_dim above 256).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::flash_attn::flash_attn_qkv;
/// let dev = Device::new_cuda(0)?;
/// let (b, t, hq, hkv, d) = (2, 1024, 16, 4, 128);
/// let qkv = Tensor::randn(0f32, 1.0, (b, t, (hq + 2 * hkv) * d), &dev)?.to_dtype(DType::BF16)?;
/// let angles = Tensor::randn(0f32, 1.0, (t, d / 2), &dev)?;
/// let (cos, sin) = (angles.cos()?.to_dtype(DType::BF16)?, angles.sin()?.to_dtype(DType::BF16)?);
/// let out = flash_attn_qkv(&qkv, hq, hkv, Some((&cos, &sin)), 1.0 / (d as f32).sqrt(), true)?;
/// assert_eq!(out.dims(), [b, t, hq * d]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn flash_attn_qkv(
    qkv: &Tensor,
    heads_q: usize,
    heads_kv: usize,
    rope: Option<(&Tensor, &Tensor)>,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let (b, t, row) = match *qkv.dims() {
        [b, t, row] => (b, t, row),
        _ => bail!(
            "{OP}: qkv must be [batch, seq, (heads_q + 2·heads_kv)·head_dim], got {:?}",
            qkv.dims()
        ),
    };
    if heads_q == 0 || heads_kv == 0 || !heads_q.is_multiple_of(heads_kv) {
        bail!("{OP}: heads_kv ({heads_kv}) must divide heads_q ({heads_q}), both ≥ 1")
    }
    let heads = heads_q + 2 * heads_kv;
    if row == 0 || !row.is_multiple_of(heads) {
        bail!(
            "{OP}: qkv's last dim ({row}) must be (heads_q + 2·heads_kv)·head_dim = {heads}·head_dim"
        )
    }
    let d = row / heads;
    let node = QkvAttn::new((heads_q, heads_kv), rope, softmax_scale, causal, qkv)?;
    if !qkv.device().is_cuda() {
        let part = |at: usize, h: usize| qkv.narrow(2, at * d, h * d)?.reshape((b, t, h, d));
        let (mut q, mut k) = (part(0, heads_q)?, part(heads_q, heads_kv)?);
        let v = part(heads_q + heads_kv, heads_kv)?;
        if let Some((cos, sin)) = &node.rope {
            (q, k) = (rope_thd(&q, cos, sin)?, rope_thd(&k, cos, sin)?);
        }
        return flash_attn(&q, &k, &v, softmax_scale, causal)?.reshape((b, t, heads_q * d));
    }
    qkv.contiguous()?.apply_op1(node)
}

/// RoPE's `(cos, sin)` checked against a `[b, t, (hq + 2·hkv)·d]` `qkv`: their first `t`
/// rows, detached and contiguous (the kernels read a table of exactly the sequence's rows).
fn tables(
    rope: Option<(&Tensor, &Tensor)>,
    t: usize,
    d: usize,
    qkv: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    let Some((cos, sin)) = rope else {
        return Ok(None);
    };
    for (name, table) in [("cos", cos), ("sin", sin)] {
        match *table.dims() {
            [rows, w] if rows >= t && 2 * w == d => {}
            _ => bail!(
                "{OP}: {name} must be [rows ≥ {t}, {}] (half of head_dim {d}), got {:?}",
                d / 2,
                table.dims()
            ),
        }
        if table.dtype() != qkv.dtype() {
            bail!(
                "{OP}: {name} is {:?}, qkv is {:?}",
                table.dtype(),
                qkv.dtype()
            )
        }
        if !table.device().same_device(qkv.device()) {
            bail!("{OP}: {name} is on another device than qkv")
        }
    }
    let rows = |x: &Tensor| x.detach().narrow(0, 0, t)?.contiguous();
    Ok(Some((rows(cos)?, rows(sin)?)))
}
