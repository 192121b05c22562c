//! q and k in HF's layout: [`rope`], [`rope_with`], their explicit backwards and the
//! differentiable op behind them.
use super::*;

/// A q-and-k call's plan and what it rotates by: `cos`, `sin` (contiguous) and the ids.
pub(super) struct Pair {
    plan: Plan,
    cos: Tensor,
    sin: Tensor,
    position_ids: Option<Tensor>,
}

impl Pair {
    /// Checks q `[B, S, Hq, d]`, k `[B, S, Hk, d]`, the tables, the ids and `cfg`.
    fn new(
        [q, k]: [&Tensor; 2],
        [cos, sin]: [&Tensor; 2],
        position_ids: Option<&Tensor>,
        cfg: &RopeConfig,
    ) -> Result<Self> {
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
        table_dtype(q, cos)?;
        same_shape(ROPE, cos, sin)?;
        same_dtype(ROPE, cos, sin)?;
        let w = cos.dims().last().copied().unwrap_or(0);
        let r = match (cfg.rotary_dim, cfg.half_tables) {
            (Some(r), half) => {
                let want = if half { r / 2 } else { r };
                if w != want {
                    let form = if half { "half" } else { "full" };
                    return bad(format!(
                        "cos/sin rows must be {want} long ({form}-width rows of rotary_dim = \
                         {r}), got {:?}",
                        cos.dims()
                    ));
                }
                r
            }
            (None, true) => 2 * w,
            (None, false) if 2 * w == d => {
                return bad(format!(
                    "cos/sin rows of {w} = head_dim / 2 are ambiguous: candle-nn's half-width \
                     table of a full rotation (liger_rs::candle::nn::rotary_emb::rope_thd takes \
                     q in this layout, or RopeConfig::default().with_half_tables()), or HF's \
                     full-width table of a partial rotary of rotary_dim = {w} \
                     (RopeConfig::default().with_rotary_dim({w})); say which with rope_with"
                ));
            }
            (None, false) => w,
        };
        let rows = match (cos.dims(), position_ids) {
            (&[_, _], Some(ids)) => {
                if ids.dims() != [b, s] || !matches!(ids.dtype(), DType::I64 | DType::I32) {
                    return bad(format!(
                        "position_ids must be i64 or i32 [{b}, {s}], got {:?} {:?}",
                        ids.dtype(),
                        ids.dims()
                    ));
                }
                Some(Rows::Gathered)
            }
            // A longer table without ids: its first rows, as candle-nn reads one.
            (&[rows, _], None) if rows >= s => Some(Rows::PerPosition),
            (&[1, cs, _], None) if cs == s => Some(Rows::PerPosition),
            (&[cb, cs, _], None) if cb == b && cs == s => Some(Rows::PerBatch),
            _ => None,
        };
        let Some(rows) = rows.filter(|_| w > 0) else {
            return bad(format!(
                "cos/sin must be [rows ≥ seq_len, w], [batch, seq_len, w] or [1, seq_len, w] \
                 (or [max_pos, w] with position_ids) for q {:?}, got {:?}",
                q.dims(),
                cos.dims()
            ));
        };
        let mut args = RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r);
        if cfg.half_tables {
            args = args.with_half_tables();
        }
        if cfg.interleaved {
            args = args.with_interleaved();
        }
        Ok(Pair {
            plan: Plan { args, rows },
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            position_ids: position_ids.map(Tensor::contiguous).transpose()?,
        })
    }

    /// Rotates contiguous q and k (or their gradients) into a new flat `[q | k]`.
    fn rotate(&self, dir: Pass, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let tables = [&self.cos, &self.sin];
        let ids = self.position_ids.as_ref();
        self.plan.tensors(Call::new(dir, q, Some(k), tables, ids))
    }

    /// `[q | k]` as two tensors shaped like q and k (views of `packed`, no copy).
    fn split(&self, packed: &Tensor) -> Result<(Tensor, Tensor)> {
        let a = &self.plan.args;
        let (q_len, k_len) = self.plan.lens();
        let q = packed.narrow(0, 0, q_len)?;
        let k = packed.narrow(0, q_len, k_len)?;
        Ok((
            q.reshape((a.batch, a.seq_len, a.q_heads, a.head_dim))?,
            k.reshape((a.batch, a.seq_len, a.k_heads, a.head_dim))?,
        ))
    }
}

/// RoPE forward with candle autograd (NeoX half-split rotation, as [`crate::rope_forward`])
/// on HF's tables: [`rope_with`] with the default [`RopeConfig`] (the rotary dim is the rows'
/// length; rows of `head_dim / 2` are an error, see there).
///
/// * `q`: `[batch, seq_len, q_heads, head_dim]`, `k`: `[batch, seq_len, k_heads, head_dim]`
///   (HF's `proj(h).view(B, S, H, d)` before its `transpose(1, 2)`; a transposed
///   `[B, H, S, d]` tensor is copied to this layout first).
/// * `cos`, `sin`: rows of `rotary_dim ≤ head_dim` elements (HF's `cat(freqs, freqs)`; only
///   the first half of a row is read; dims past `rotary_dim` pass through), shaped
///   `[rows ≥ seq_len, rotary_dim]` (the first `seq_len` rows, shared by the batch) or
///   `[1, seq_len, rotary_dim]`, `[batch, seq_len, rotary_dim]` (per batch row, what HF's
///   rotary embedding returns), or `[max_pos, rotary_dim]` with `position_ids`
///   `[batch, seq_len]` (i64 or i32; clamped into the table on CUDA, see
///   [`PositionIds::DeviceI64`]; on the CPU an id outside it is an error); in q's dtype, or
///   f32 with f16/bf16 q and k ([`crate::CosSinDtype`]), whose entries are then used unrounded.
///
/// The inputs are not modified: one launch reads q and k where they are and writes both
/// rotated into one new `[q | k]` buffer; the results are views of it. The backward rotates
/// the gradients by −θ in one launch; `cos`, `sin` and the ids get no gradient.
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
    rope_with(q, k, cos, sin, position_ids, &RopeConfig::default())
}

/// [`rope`] with the table form, rotary dim and pairing of `cfg`: half-width rows (one value
/// per pair) with `cfg.half_tables`, interleaved pairs with `cfg.interleaved` (full-width
/// rows then hold one value per dim, `repeat_interleave(freqs, 2)`), a partial rotary whose
/// `rotary_dim` is explicit. Rows whose length does not fit `cfg` are an error.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{RopeConfig, rope_with};
/// let dev = Device::new_cuda(0)?;
/// let (b, s, hq, hk, d) = (1, 16, 8, 8, 64);
/// let q = Tensor::randn(0f32, 1.0, (b, s, hq, d), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev)?;
/// let cos = Tensor::ones((s, d / 2), DType::F32, &dev)?; // one value per pair
/// let sin = Tensor::zeros((s, d / 2), DType::F32, &dev)?;
/// let cfg = RopeConfig::default().with_half_tables().with_interleaved();
/// let (q, k) = rope_with(&q, &k, &cos, &sin, None, &cfg)?;
/// # let _ = (q, k);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_with(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
    cfg: &RopeConfig,
) -> Result<(Tensor, Tensor)> {
    let pair = Arc::new(Pair::new([q, k], [cos, sin], position_ids, cfg)?);
    on(ROPE, &[("q", q), ("k", k), ("cos", cos), ("sin", sin)])?;
    let op = PairOp { pair: pair.clone() };
    let packed = token_rows(q)?.apply_op2(&token_rows(k)?, op)?;
    pair.split(&packed)
}

/// RoPE backward without autograd: rotates the gradients `dq`, `dk` (shaped like the
/// forward's q and k) by −θ and returns them as new tensors; the inputs are not modified.
/// `cos`, `sin` and `position_ids` are those of the forward ([`rope`]). One launch.
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
    rope_backward_with(dq, dk, cos, sin, position_ids, &RopeConfig::default())
}

/// [`rope_backward`] with the forms of `cfg` (those of the forward, [`rope_with`]).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{RopeConfig, rope_backward_with};
/// let dev = Device::new_cuda(0)?;
/// let (b, s, h, d) = (1, 16, 4, 64);
/// let dq = Tensor::ones((b, s, h, d), DType::F32, &dev)?;
/// let cos = Tensor::ones((s, d / 2), DType::F32, &dev)?;
/// let sin = Tensor::zeros((s, d / 2), DType::F32, &dev)?;
/// let cfg = RopeConfig::default().with_half_tables();
/// let (dq2, dk2) = rope_backward_with(&dq, &dq, &cos, &sin, None, &cfg)?;
/// # let _ = (dq2, dk2);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_backward_with(
    dq: &Tensor,
    dk: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
    cfg: &RopeConfig,
) -> Result<(Tensor, Tensor)> {
    let pair = Pair::new([dq, dk], [cos, sin], position_ids, cfg)?;
    let packed = pair.rotate(Pass::Backward, &token_rows(dq)?, &token_rows(dk)?)?;
    pair.split(&packed)
}

/// The autograd op of [`rope_with`]: inputs q and k, output `[q | k]` flattened.
pub(super) struct PairOp {
    pair: Arc<Pair>,
}

impl CustomOp2 for PairOp {
    fn name(&self) -> &'static str {
        ROPE
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = &self.pair;
        let ids = p.position_ids.as_ref().map(host_ids).transpose()?;
        let (c_s, c_l) = p.cos.storage_and_layout();
        let (s_s, s_l) = p.sin.storage_and_layout();
        let tables = [(cpu(&c_s, "cos")?, c_l), (cpu(&s_s, "sin")?, s_l)];
        let call = Call::new(
            Pass::Forward,
            (q, q_l),
            Some((k, k_l)),
            tables,
            ids.as_deref(),
        );
        let out = p.plan.cpu(call)?;
        let (q_len, k_len) = p.plan.lens();
        Ok((out, Shape::from(q_len + k_len)))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let p = &self.pair;
        let (c_s, c_l) = p.cos.storage_and_layout();
        let (s_s, s_l) = p.sin.storage_and_layout();
        let ids_guard = p.position_ids.as_ref().map(|i| i.storage_and_layout());
        let ids = match &ids_guard {
            Some((s, l)) => Some((cuda(s, ROPE, "position_ids")?, *l)),
            None => None,
        };
        let tables = [
            (cuda(&c_s, ROPE, "cos")?, c_l),
            (cuda(&s_s, ROPE, "sin")?, s_l),
        ];
        let call = Call::new(Pass::Forward, (q, q_l), Some((k, k_l)), tables, ids);
        let out = p.plan.cuda(call)?;
        let (q_len, k_len) = p.plan.lens();
        Ok((out, Shape::from(q_len + k_len)))
    }

    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let p = &self.pair;
        let (q_len, k_len) = p.plan.lens();
        let grad = grad.contiguous()?;
        let (gq, gk) = (grad.narrow(0, 0, q_len)?, grad.narrow(0, q_len, k_len)?);
        let packed = p.rotate(Pass::Backward, &gq, &gk)?;
        let (dq, dk) = p.split(&packed)?;
        Ok((Some(dq), Some(dk)))
    }
}
