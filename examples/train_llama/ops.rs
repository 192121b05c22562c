//! The two runs' fused ops: candle-nn's differentiable ones and liger-rs's.
use super::*;

/// candle-nn's differentiable ops: its fast `ops::rms_norm` and `rotary_emb::rope` have no
/// backward, so a training loop uses the `_slow` forms.
pub(super) struct CandleNn;

impl FusedOps for CandleNn {
    const NAME: &'static str = "candle-nn";
    type Opt = AdamW;
    fn optimizer(
        masters: Vec<Var>,
        params: ParamsAdamW,
        _: DType,
    ) -> Result<(Self::Opt, Option<Vec<Var>>)> {
        Ok((AdamW::new(masters, params)?, None))
    }
    /// `clip_grad_norm_` in candle ops: the norm of the gradients' norms, each gradient
    /// scaled by `min(1, CLIP / (norm + 1e-6))`.
    fn step(opt: &mut Self::Opt, vars: &[Var], loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        let mut sq = Vec::with_capacity(vars.len());
        for v in vars {
            if let Some(g) = grads.get(v) {
                sq.push(g.to_dtype(DType::F32)?.sqr()?.sum_all()?);
            }
        }
        let norm = Tensor::stack(&sq, 0)?.sum_all()?.sqrt()?;
        let factor = (norm + 1e-6)?
            .recip()?
            .affine(CLIP, 0.0)?
            .clamp(0f32, 1f32)?;
        for v in vars {
            if let Some(g) = grads.remove(v) {
                let scaled = g.broadcast_mul(&factor.to_dtype(g.dtype())?)?;
                grads.insert(v, scaled);
            }
        }
        opt.step(&grads)
    }
    fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
        candle_nn::ops::rms_norm_slow(xs, alpha, eps)
    }
    fn mlp(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let gate = model.linear::<Self>(&format!("{l}.gate"), xs)?;
        let up = model.linear::<Self>(&format!("{l}.up"), xs)?;
        model.linear::<Self>(&format!("{l}.down"), &(gate.silu()? * up)?)
    }
    fn linear(w: &Tensor, xs: &Tensor) -> Result<Tensor> {
        Linear::new(w.clone(), None).forward(xs)
    }
    fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
        Embedding::new(w.clone(), w.dim(1)?).forward(ids)
    }
    fn attention(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let (cfg, cos, sin) = (model.cfg, &model.cos, &model.sin);
        let proj = |p: &str| model.linear::<Self>(&format!("{l}.{p}"), xs);
        let (q, k, v) = (proj("q")?, proj("k")?, proj("v")?);
        let (b, t, d) = (cfg.batch, cfg.seq, cfg.head_dim());
        let heads = |x: Tensor, n: usize| x.reshape((b, t, n, d))?.transpose(1, 2)?.contiguous();
        let rope = candle_nn::rotary_emb::rope_slow;
        let q = rope(&heads(q, cfg.heads)?, cos, sin)?;
        let k = rope(&heads(k, cfg.kv_heads)?, cos, sin)?;
        let v = heads(v, cfg.kv_heads)?;
        // Grouped query attention: each key-value head serves `heads / kv_heads` query heads.
        let repeat = |x: Tensor| -> Result<Tensor> {
            let n = cfg.heads / cfg.kv_heads;
            Tensor::cat(&vec![&x; n], 2)?.reshape((b, cfg.heads, t, d))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?
            .to_dtype(DType::F32)?
            .broadcast_add(&model.mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(cfg.dtype)?;
        let out = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, cfg.hidden))?;
        model.linear::<Self>(&format!("{l}.o"), &out)
    }
    fn head_loss(xs: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = Linear::new(w.clone(), None)
            .forward(xs)?
            .to_dtype(DType::F32)?;
        candle_nn::loss::cross_entropy(&logits, targets)
    }
}

/// liger-rs's fused kernels through its candle-nn-compatible module.
pub(super) struct LigerRs;

impl FusedOps for LigerRs {
    const NAME: &'static str = "liger-rs";
    type Opt = liger_rs::candle::nn::AdamW;
    /// In f16/bf16 the optimizer keeps the compute-dtype copies the forward uses, rewritten by
    /// each step's launch: no cast of the weights in the forward, none of their gradients.
    fn optimizer(
        masters: Vec<Var>,
        params: ParamsAdamW,
        dtype: DType,
    ) -> Result<(Self::Opt, Option<Vec<Var>>)> {
        if dtype == DType::F32 {
            return Ok((Self::Opt::new(masters, params)?, None));
        }
        let (opt, copies) = Self::Opt::new_mixed(masters, params, dtype)?;
        Ok((opt, Some(copies)))
    }
    fn step(opt: &mut Self::Opt, _: &[Var], loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        opt.clip_grad_norm(&grads, CLIP)?;
        opt.step(&grads)
    }
    fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
        liger_rs::candle::nn::ops::rms_norm(xs, alpha, eps)
    }
    /// The q, k and v projections as one `qkv` weight, the gate and up projections as one
    /// `gate_up` (rows stacked in that order).
    fn parameters(init: &[Param]) -> Vec<Param> {
        // (a part, the joined weight it goes into, the part that starts it)
        const JOINS: [(&str, &str, &str); 5] = [
            ("q", "qkv", "q"),
            ("k", "qkv", "q"),
            ("v", "qkv", "q"),
            ("gate", "gate_up", "gate"),
            ("up", "gate_up", "gate"),
        ];
        let mut out: Vec<Param> = Vec::with_capacity(init.len());
        for (name, shape, values) in init {
            let join = name.rsplit_once('.').and_then(|(l, part)| {
                let (_, into, first) = JOINS.iter().find(|j| j.0 == part)?;
                Some((format!("{l}.{into}"), part == *first))
            });
            match join {
                Some((into, true)) => out.push((into, shape.clone(), values.clone())),
                Some((into, false)) => {
                    let last = out.last_mut().expect("a joined weight's first part");
                    assert_eq!(last.0, into, "initial_weights' order");
                    last.1[0] += shape[0];
                    last.2.extend_from_slice(values);
                }
                None => out.push((name.clone(), shape.clone(), values.clone())),
            }
        }
        out
    }
    /// One autograd node (`nn::SwigluMlp`): candle-nn's four layers cost the backward a zero
    /// fill and an add per input of each (three of the intermediate size).
    fn mlp(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let gate_up = model.weight(&format!("{l}.gate_up"))?;
        let down = model.weight(&format!("{l}.down"))?;
        liger_rs::candle::nn::SwigluMlp::new(gate_up, down).forward(xs)
    }
    /// One autograd node (candle-nn's `Linear` is four, each costing the backward a zero
    /// fill and an add of its gradient).
    fn linear(w: &Tensor, xs: &Tensor) -> Result<Tensor> {
        liger_rs::candle::nn::Linear::new(w.clone(), None).forward(xs)
    }
    /// One node with a deterministic backward kernel (candle's `index_add` has one thread
    /// per column walk every id).
    fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
        liger_rs::candle::nn::Embedding::new(w.clone(), w.dim(1)?).forward(ids)
    }
    /// One fused QKV projection and `flash_attn_qkv`, which applies RoPE to q and k itself:
    /// two linears and one attention node in candle's graph.
    fn attention(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let cfg = model.cfg;
        let qkv = model.linear::<Self>(&format!("{l}.qkv"), xs)?;
        let rope = Some((&model.cos, &model.sin));
        let scale = 1.0 / (cfg.head_dim() as f32).sqrt();
        let out = liger_rs::candle::flash_attn::flash_attn_qkv(
            &qkv,
            cfg.heads,
            cfg.kv_heads,
            rope,
            scale,
            true,
        )?;
        model.linear::<Self>(&format!("{l}.o"), &out)
    }
    fn head_loss(xs: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let cfg = liger_rs::candle::CrossEntropyConfig::default();
        liger_rs::candle::fused_linear_cross_entropy(xs, w, None, targets, &cfg)?
            .to_dtype(DType::F32)
    }
}
