//! One tensor in candle-nn's layouts: the op behind `nn::rotary_emb`.
use super::*;

/// The layouts and pairs of candle-nn 0.11's `rotary_emb` functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NnRope {
    /// `rope`: xs `[b, h, t, d]`, NeoX pairs.
    Rope,
    /// `rope_i`: xs `[b, h, t, d]`, interleaved pairs.
    RopeI,
    /// `rope_thd`: xs `[b, t, h, d]`, NeoX pairs.
    RopeThd,
}

impl NnRope {
    fn name(self) -> &'static str {
        match self {
            NnRope::Rope => "rope",
            NnRope::RopeI => "rope_i",
            NnRope::RopeThd => "rope_thd",
        }
    }
}

/// candle-nn's rotary embedding `form` of `xs` by half-width `cos`/`sin` (`[t', d/2]` with
/// `t' ≥ t`, of which the first `t` rows are read, or `[b, t, d/2]`), with autograd for `xs`,
/// `cos` and `sin`; see [`super::nn::rotary_emb`].
pub(crate) fn nn_rope(form: NnRope, xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let name = form.name();
    let nn_bad = |what: String| Err(candle_core::Error::Msg(format!("{ROPE} ({name}): {what}")));
    let &[b, n1, n2, d] = xs.dims() else {
        return nn_bad(format!(
            "xs must have 4 dims ({}), got {:?}",
            if form == NnRope::RopeThd {
                "[b, t, h, d]"
            } else {
                "[b, h, t, d]"
            },
            xs.dims()
        ));
    };
    let (h, t) = if form == NnRope::RopeThd {
        (n2, n1)
    } else {
        (n1, n2)
    };
    same_dtype(ROPE, xs, cos)?;
    same_dtype(ROPE, cos, sin)?;
    same_shape(ROPE, cos, sin)?;
    let w = cos.dims().last().copied().unwrap_or(0);
    if w * 2 != d {
        let why = if w == d {
            " (a full-width table such as HF's cat(freqs, freqs): candle-nn's rotary_emb \
             takes one value per pair, e.g. its first half, cos.narrow(D::Minus1, 0, d / 2))"
        } else {
            ""
        };
        return nn_bad(format!(
            "cos/sin rows must be head_dim / 2 = {} long (one value per pair) for xs {:?}, got \
             {:?}{why}",
            d / 2,
            xs.dims(),
            cos.dims()
        ));
    }
    let rows = match *cos.dims() {
        [rows, _] if rows >= t => Rows::PerPosition,
        [rows, _] => {
            return nn_bad(format!(
                "cos/sin have {rows} rows, fewer than the {t} positions of xs {:?}",
                xs.dims()
            ));
        }
        [cb, ct, _] if cb == b && ct == t => Rows::PerBatch,
        [cb, ct, _] => {
            // candle-nn indexes [b, t', d/2] tables as [b, t, d/2]: with t' ≠ t it reads rows
            // of other batch entries, so there is no meaning to keep.
            return nn_bad(format!(
                "per-batch cos/sin must be [{b}, {t}, {}] (batch and positions of xs {:?}), got \
                 [{cb}, {ct}, {w}]",
                d / 2,
                xs.dims()
            ));
        }
        _ => {
            return nn_bad(format!(
                "cos/sin must be [t, d/2] or [b, t, d/2], got {:?}",
                cos.dims()
            ));
        }
    };
    on(ROPE, &[("xs", xs), ("cos", cos), ("sin", sin)])?;
    let mut args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(t)
        .with_heads(h, 0)
        .with_half_tables();
    if form != NnRope::RopeThd {
        args = args.with_head_major();
    }
    if form == NnRope::RopeI {
        args = args.with_interleaved();
    }
    let op = OneOp {
        plan: Plan { args, rows },
    };
    xs.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// The autograd op of [`nn_rope`]: inputs xs, cos, sin; output shaped like xs.
struct OneOp {
    plan: Plan,
}

impl OneOp {
    /// The gradients of the tables: with `(x1, x2)` a pair of xs, `(g1, g2)` of the
    /// gradient, `dcos = Σ g1·x1 + g2·x2` and `dsin = Σ g2·x1 − g1·x2` over the heads (and the
    /// batch for shared tables), rows past `t` zero; candle ops in f32 for 16-bit dtypes.
    fn table_grads(&self, xs: &Tensor, grad: &Tensor, cos: &Tensor) -> Result<(Tensor, Tensor)> {
        let a = &self.plan.args;
        let dtype = xs.dtype();
        let wide = match dtype {
            DType::F16 | DType::BF16 => DType::F32,
            other => other,
        };
        let half = a.head_dim / 2;
        let pairs = |t: &Tensor| -> Result<(Tensor, Tensor)> {
            let t = t.to_dtype(wide)?;
            if a.interleaved {
                let (b, n1, n2, _) = t.dims4()?;
                let t = t.reshape((b, n1, n2, half, 2))?;
                Ok((
                    t.narrow(4, 0, 1)?.squeeze(4)?,
                    t.narrow(4, 1, 1)?.squeeze(4)?,
                ))
            } else {
                Ok((
                    t.narrow(D::Minus1, 0, half)?,
                    t.narrow(D::Minus1, half, half)?,
                ))
            }
        };
        // `xs` detached: products of the tracked input would record graph nodes holding the
        // gradient, which the gradient store would keep alive to its end.
        let ((x1, x2), (g1, g2)) = (pairs(&xs.detach())?, pairs(grad)?);
        let dc = ((&g1 * &x1)? + (&g2 * &x2)?)?;
        let ds = ((&g2 * &x1)? - (&g1 * &x2)?)?;
        let heads = if a.head_major { 1 } else { 2 };
        let t_cos = cos.dims()[cos.rank() - 2];
        let to_table = |v: Tensor| -> Result<Tensor> {
            let v = v.sum(heads)?; // [b, t, d/2]
            let v = match self.plan.rows {
                Rows::PerBatch => v,
                _ => v.sum(0)?.pad_with_zeros(0, 0, t_cos - a.seq_len)?,
            };
            v.to_dtype(dtype)
        };
        Ok((to_table(dc)?, to_table(ds)?))
    }
}

impl CustomOp3 for OneOp {
    fn name(&self) -> &'static str {
        ROPE
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xs_l: &Layout,
        cos: &CpuStorage,
        cos_l: &Layout,
        sin: &CpuStorage,
        sin_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let tables = [(cos, cos_l), (sin, sin_l)];
        let call = Call::new(Pass::Forward, (xs, xs_l), None, tables, None);
        let out = self.plan.cpu(call)?;
        Ok((out, xs_l.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xs_l: &Layout,
        cos: &CudaStorage,
        cos_l: &Layout,
        sin: &CudaStorage,
        sin_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let tables = [(cos, cos_l), (sin, sin_l)];
        let call = Call::new(Pass::Forward, (xs, xs_l), None, tables, None);
        let out = self.plan.cuda(call)?;
        Ok((out, xs_l.shape().clone()))
    }

    fn bwd(
        &self,
        xs: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dxs = self
            .plan
            .tensors(Call::new(Pass::Backward, &grad, None, [cos, sin], None))?
            .reshape(xs.shape())?;
        if !(cos.track_op() || sin.track_op()) {
            return Ok((Some(dxs), None, None));
        }
        let (dcos, dsin) = self.table_grads(xs, &grad, cos)?;
        Ok((
            Some(dxs),
            cos.track_op().then_some(dcos),
            sin.track_op().then_some(dsin),
        ))
    }
}
