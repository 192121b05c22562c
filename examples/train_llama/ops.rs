//! The two runs' fused ops: candle-nn's differentiable ones and liger-rs's.
use super::*;
use liger_rs::candle::{AttentionBlockConfig, BlockSlots, RmsNormConfig};

/// `xs · Wᵀ` for the parameter `name` (`[out, in]`): candle-nn's `Linear` without a bias.
fn linear(model: &Model, name: &str, xs: &Tensor) -> Result<Tensor> {
    Linear::new(model.weight(name)?, None).forward(xs)
}

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
    fn step(opt: &mut Self::Opt, model: &Model, loss: &Tensor) -> Result<()> {
        let vars = &model.vars;
        let mut grads = loss.backward()?;
        model.average(&mut grads)?;
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
        let h = Self::rms_norm(xs, &model.weight(&format!("{l}.mlp_norm"))?, EPS)?;
        let gate = linear(model, &format!("{l}.gate"), &h)?;
        let up = linear(model, &format!("{l}.up"), &h)?;
        xs + linear(model, &format!("{l}.down"), &(gate.silu()? * up)?)?
    }
    fn embedding(model: &Model, ids: &Tensor) -> Result<Tensor> {
        let w = model.weight("embed")?;
        Embedding::new(w.clone(), w.dim(1)?).forward(ids)
    }
    fn attention(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let (cfg, cos, sin) = (model.cfg, &model.cos, &model.sin);
        let h = Self::rms_norm(xs, &model.weight(&format!("{l}.attn_norm"))?, EPS)?;
        let proj = |p: &str| linear(model, &format!("{l}.{p}"), &h);
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
        xs + linear(model, &format!("{l}.o"), &out)?
    }
    fn head_loss(model: &Model, xs: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = Linear::new(model.weight("head")?, None)
            .forward(xs)?
            .to_dtype(DType::F32)?;
        candle_nn::loss::cross_entropy(&logits, targets)
    }
}

/// `values` `[rows, cols]` row-major, transposed.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows)
        .map(|i| values[(i % rows) * cols + i / rows])
        .collect()
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
    /// The nodes put the weights' gradients into the model's slots; they join candle's
    /// before the optimizer reads them.
    fn step(opt: &mut Self::Opt, model: &Model, loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        for (i, slot) in model.slots.iter().enumerate() {
            slot.drain_into(&mut grads, &model.weight_at(i)?)?;
        }
        model.average(&mut grads)?;
        opt.clip_grad_norm(&grads, CLIP)?;
        opt.step(&grads)
    }
    fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
        liger_rs::candle::nn::ops::rms_norm(xs, alpha, eps)
    }
    /// Each block half's projections as one packed weight (`liger_rs::candle::pack_*`'s
    /// layouts): `{l}.attn` the q, k, v rows and the output projection's transpose,
    /// `{l}.mlp` the gate and up rows and the down projection's transpose.
    fn parameters(init: &[Param]) -> Vec<Param> {
        // (a part, the packed weight it goes into, whether it is stored transposed)
        const PACKS: [(&str, &str, bool); 7] = [
            ("q", "attn", false),
            ("k", "attn", false),
            ("v", "attn", false),
            ("o", "attn", true),
            ("gate", "mlp", false),
            ("up", "mlp", false),
            ("down", "mlp", true),
        ];
        let mut out: Vec<Param> = Vec::with_capacity(init.len());
        for (name, shape, values) in init {
            let pack = name.rsplit_once('.').and_then(|(l, part)| {
                let (_, into, t) = PACKS.iter().find(|p| p.0 == part)?;
                Some((format!("{l}.{into}"), *t))
            });
            let Some((into, transposed)) = pack else {
                out.push((name.clone(), shape.clone(), values.clone()));
                continue;
            };
            let (rows, values) = match transposed {
                false => (shape[0], values.clone()),
                true => (shape[1], transpose(values, shape[0], shape[1])),
            };
            match out.last_mut() {
                Some(last) if last.0 == into => {
                    last.1[0] += rows;
                    last.2.extend_from_slice(&values);
                }
                _ => out.push((into, vec![rows, shape[0] * shape[1] / rows], values)),
            }
        }
        out
    }
    /// One autograd node (`swiglu_mlp_block`): the norm, the gate-up projection, SwiGLU, the
    /// down projection and the residual add hand candle's backward one gradient of `xs`'s
    /// size instead of four (each a zero fill and an add).
    fn mlp(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let (norm, w) = (format!("{l}.mlp_norm"), format!("{l}.mlp"));
        let slots = block_slots(model, &norm, &w);
        let cfg = RmsNormConfig::default().with_eps(EPS);
        let (norm, w) = (model.weight(&norm)?, model.weight(&w)?);
        liger_rs::candle::swiglu_mlp_block_with_slots(xs, &norm, &w, &cfg, &slots)
    }
    /// One node with a deterministic backward kernel (candle's `index_add` has one thread
    /// per column walk every id).
    fn embedding(model: &Model, ids: &Tensor) -> Result<Tensor> {
        let slot = &model.slots[model.at("embed")];
        liger_rs::candle::embedding_with_slot(&model.weight("embed")?, ids, slot)
    }
    /// One autograd node (`attention_block`): the norm, the QKV projection, RoPE, the
    /// attention, the output projection and the residual add; candle's graph of them would
    /// hand its backward five gradients of `xs`'s size and one of the QKV projection's.
    fn attention(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor> {
        let c = model.cfg;
        let (norm, w) = (format!("{l}.attn_norm"), format!("{l}.attn"));
        let slots = block_slots(model, &norm, &w);
        let (norm, w) = (model.weight(&norm)?, model.weight(&w)?);
        let cfg = AttentionBlockConfig::llama(c.heads, c.kv_heads, c.head_dim(), EPS);
        let rope = Some((&model.cos, &model.sin));
        liger_rs::candle::attention_block_with_slots(xs, &norm, &w, rope, &cfg, &slots)
    }
    fn head_loss(model: &Model, xs: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let cfg = liger_rs::candle::CrossEntropyConfig::default();
        let (w, slot) = (model.weight("head")?, &model.slots[model.at("head")]);
        liger_rs::candle::fused_linear_cross_entropy_with_slot(xs, &w, None, targets, &cfg, slot)?
            .to_dtype(DType::F32)
    }
}

/// The slots of a block half's norm weight and packed weight (clones sharing the model's).
fn block_slots(model: &Model, norm: &str, weight: &str) -> BlockSlots {
    BlockSlots {
        norm: model.slots[model.at(norm)].clone(),
        weight: model.slots[model.at(weight)].clone(),
    }
}
