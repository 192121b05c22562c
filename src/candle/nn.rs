//! candle-nn 0.11's fused ops with their names, arguments, shapes and dtypes, differentiable.
//!
//! candle-nn's fast `ops::rms_norm` (behind `RmsNorm`'s `Module::forward` on contiguous
//! input), `rotary_emb::{rope, rope_i, rope_thd}` are `apply_op*_no_bwd`: a training loop gets
//! no gradient through them, silently. Here each has a backward (this crate's kernels on
//! CUDA, its reference on the CPU), so the port is the `use` line:
//!
//! ```
//! // use candle_nn::{ops, rotary_emb, rms_norm, Module, RmsNorm};
//! use liger_rs::candle::nn::{ops, rotary_emb, rms_norm, Module, RmsNorm};
//! use candle_core::{DType, Device, Tensor, Var};
//!
//! let dev = Device::Cpu; // or Device::new_cuda(0)?
//! let x = Var::randn(0f32, 1.0, (2, 4, 8, 16), &dev)?; // [b, h, t, d]
//! let norm = RmsNorm::new(Tensor::ones(16, DType::F32, &dev)?, 1e-5);
//! let y = norm.forward(x.as_tensor())?;
//! let (cos, sin) = (Tensor::ones((8, 8), DType::F32, &dev)?, Tensor::zeros((8, 8), DType::F32, &dev)?);
//! let y = rotary_emb::rope(&y, &cos, &sin)?; // [t, d/2] tables
//! let y = ops::swiglu(&y)?; // silu of the first half of the last dim times the second
//! let grad = y.sum_all()?.backward()?.get(&x).cloned();
//! assert!(grad.is_some());
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! [`Linear`] (and its constructors [`linear()`], [`linear_no_bias`], [`linear_b`]) computes
//! candle-nn's layer as one autograd node instead of four, which saves candle's backward a
//! zero fill and an add of each of those nodes' gradients ([`crate::candle::linear`]);
//! [`Embedding`] (and [`embedding()`]) is one node whose backward is a deterministic kernel
//! ([`crate::candle::embedding`]; candle's `index_add` is serial over the ids);
//! [`SwigluMlp`] is Llama's (or Gemma's) MLP over one fused gate-up weight as one node
//! ([`crate::candle::swiglu_mlp`]: candle-nn's layers would be four).
//! Everything else of candle-nn is re-exported unchanged (`VarBuilder`, `ops::softmax`,
//! `rotary_emb::rope_slow`, …), so a `use` line that names those too keeps working. What
//! differs from candle-nn:
//!
//! * **Gradients** for every input: `xs` and `alpha`/the weight; `xs`, `cos` and `sin` of the
//!   rotary embeddings (the tables' only when they track a gradient: candle ops reducing over
//!   batch and heads); both halves of `swiglu`.
//! * **Numbers**: RMSNorm is HF's Llama cast points ([`CastingMode::Llama`]: statistics in
//!   f32, the normalised row rounded to the dtype, then times the weight), as candle-nn's
//!   `rms_norm_slow`; rotary products and sums are f32 with one rounding to the dtype;
//!   `swiglu` rounds silu to the dtype before the product. All within the dtype's rounding of
//!   candle-nn's `_slow` functions, which are the tests' ground truth.
//! * **Shapes with another meaning are errors** that say why: a full-width `[t, d]` table
//!   given to the rotary embeddings (candle-nn's tables are `[t, d/2]`, one value per pair),
//!   per-batch `[b, t', d/2]` tables with `t' ≠ t` (candle-nn reads them as `[b, t, d/2]`),
//!   an odd last dim for `swiglu` (candle-nn panics or fails with a shape mismatch).
//! * **Layouts**: a non-contiguous input is copied first (candle-nn's fast ops reject it).
//! * **Devices and dtypes**: f32, f16 and bf16 on CUDA; those and f64 on the CPU; no Metal.
//!
//! [`CastingMode::Llama`]: crate::CastingMode::Llama
use super::rope::{NnRope, nn_rope};
use super::{RmsNormConfig, SwigluConfig};
use candle_core::{Result, Tensor};

pub use super::embedding::Embedding;
pub use super::linear::Linear;
pub use super::mlp::SwigluMlp;
pub use super::optim::AdamW;
pub use candle_nn::*;

/// candle-nn's `embedding`: an [`Embedding`] of `in_size` rows of `out_size`, from `vb`
/// (candle-nn's initialisation).
///
/// # Errors
/// `vb`'s errors.
pub fn embedding(in_size: usize, out_size: usize, vb: VarBuilder) -> Result<Embedding> {
    candle_nn::embedding(in_size, out_size, vb).map(Embedding::from)
}

/// candle-nn's `linear`: a [`Linear`] with a bias, from `vb` (candle-nn's initialisation).
///
/// # Errors
/// `vb`'s errors.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear(in_dim, out_dim, vb).map(Linear::from)
}

/// candle-nn's `linear_no_bias`: a [`Linear`] without a bias, from `vb`.
///
/// # Errors
/// `vb`'s errors.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_no_bias(in_dim, out_dim, vb).map(Linear::from)
}

/// candle-nn's `linear_b`: a [`Linear`] with a bias when `bias`, from `vb`.
///
/// # Errors
/// `vb`'s errors.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_b(in_dim, out_dim, bias, vb).map(Linear::from)
}

/// candle-nn's `loss` with [`cross_entropy`](loss::cross_entropy) fused (one pass forward,
/// one backward) and its gradient this crate's.
pub mod loss {
    pub use super::super::cross_entropy::cross_entropy;
    pub use candle_nn::loss::*;
}

/// candle-nn's `ops` with a differentiable [`rms_norm`](ops::rms_norm) and
/// [`swiglu`](ops::swiglu), and [`silu_mul`](ops::silu_mul).
pub mod ops {
    use super::*;
    pub use candle_nn::ops::*;

    /// RMSNorm over the last dim with candle autograd: `xs / √(mean(xs²) + eps) · alpha`,
    /// candle-nn's `ops::rms_norm(xs, alpha, eps)` (arguments, shapes, dtypes), with HF's
    /// Llama cast points as its `rms_norm_slow`.
    ///
    /// `xs`: `[..., n]`; `alpha`: `[n]`, the dtype of `xs`. Gradients flow to both
    /// ([`crate::candle::rms_norm`] with `eps`, offset 0, [`crate::CastingMode::Llama`]).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let xs = Tensor::new(&[[3f32, 4.0]], &Device::Cpu)?;
    /// let y = liger_rs::candle::nn::ops::rms_norm(&xs, &Tensor::ones(2, DType::F32, &Device::Cpu)?, 0.0)?;
    /// let r = 1.0 / 12.5f32.sqrt();
    /// assert_eq!(y.to_vec2::<f32>()?, [[3.0 * r, 4.0 * r]]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
        let hidden = xs.dims().last().copied();
        if alpha.rank() != 1 || hidden != Some(alpha.dims()[0]) {
            return Err(candle_core::Error::Msg(format!(
                "shape mismatch in rms-norm {:?} {:?}: alpha must be [n] for xs [..., n]",
                xs.shape(),
                alpha.shape()
            )));
        }
        let cfg = RmsNormConfig::default().with_eps(eps);
        crate::candle::rms_norm(xs, Some(alpha), &cfg)
    }

    /// SwiGLU with candle autograd on a fused tensor, candle-nn's `ops::swiglu(xs)`: the last
    /// dim is cut in two halves, `silu(first) · second` (this crate's kernels, one launch;
    /// [`crate::candle::swiglu_fused`]). Returns `[..., n/2]` for `xs` `[..., n]`; an odd
    /// `n` is an error.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// let xs = Tensor::new(&[[0f32, 1.0, 5.0, 2.0]], &Device::Cpu)?;
    /// let y = liger_rs::candle::nn::ops::swiglu(&xs)?; // [silu(0)·5, silu(1)·2]
    /// let s1 = 1.0 / (1.0 + (-1f32).exp());
    /// assert_eq!(y.to_vec2::<f32>()?, [[0.0, 2.0 * s1]]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn swiglu(xs: &Tensor) -> Result<Tensor> {
        crate::candle::swiglu_fused(xs, &SwigluConfig::default())
    }

    /// `silu(a) · b` with candle autograd on separate tensors of one shape and dtype (this
    /// crate's kernels, one launch; [`crate::candle::swiglu`]): [`swiglu`] without the
    /// concatenation.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// let a = Tensor::new(&[0f32, 1.0], &Device::Cpu)?;
    /// let b = Tensor::new(&[5f32, 2.0], &Device::Cpu)?;
    /// let y = liger_rs::candle::nn::ops::silu_mul(&a, &b)?;
    /// assert_eq!(y.to_vec1::<f32>()?, [0.0, 2.0 / (1.0 + (-1f32).exp())]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn silu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
        crate::candle::swiglu(a, b, &SwigluConfig::default())
    }
}

/// candle-nn's `rotary_emb` with differentiable [`rope`](rotary_emb::rope),
/// [`rope_i`](rotary_emb::rope_i) and [`rope_thd`](rotary_emb::rope_thd).
///
/// Each takes `cos`, `sin` of `[t', d/2]` (one value per pair; `t' ≥ t`, the first `t` rows
/// are read) or `[b, t, d/2]` (per batch entry), of the dtype of `xs`, and returns a new
/// tensor shaped like `xs`, written in one launch from `xs` where it is. On CUDA that is this
/// crate's general RoPE kernels; on the CPU its reference. The backward rotates the gradient
/// by −θ (one launch) and, when `cos` or `sin` track a gradient, reduces theirs with candle
/// ops.
pub mod rotary_emb {
    use super::*;
    pub use candle_nn::rotary_emb::*;

    /// NeoX rotary embedding, candle-nn's `rotary_emb::rope`: `xs` `[b, h, t, d]`, pair `i`
    /// is `(x[i], x[i + d/2])` rotated by `(cos[t, i], sin[t, i])`.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// // A 90° rotation: (x1, x2) → (−x2, x1).
    /// let xs = Tensor::new(&[[[[1f32, 2.0]]]], &Device::Cpu)?; // [1, 1, 1, 2]
    /// let (cos, sin) = (Tensor::new(&[[0f32]], &Device::Cpu)?, Tensor::new(&[[1f32]], &Device::Cpu)?);
    /// let y = liger_rs::candle::nn::rotary_emb::rope(&xs, &cos, &sin)?;
    /// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [-2.0, 1.0]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        nn_rope(NnRope::Rope, xs, cos, sin)
    }

    /// Interleaved rotary embedding, candle-nn's `rotary_emb::rope_i`: `xs` `[b, h, t, d]`,
    /// pair `i` is `(x[2i], x[2i + 1])`.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// let xs = Tensor::new(&[[[[1f32, 2.0, 3.0, 4.0]]]], &Device::Cpu)?; // [1, 1, 1, 4]
    /// // Pair 0 by 90°, pair 1 by 0°.
    /// let cos = Tensor::new(&[[0f32, 1.0]], &Device::Cpu)?;
    /// let sin = Tensor::new(&[[1f32, 0.0]], &Device::Cpu)?;
    /// let y = liger_rs::candle::nn::rotary_emb::rope_i(&xs, &cos, &sin)?;
    /// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [-2.0, 1.0, 3.0, 4.0]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        nn_rope(NnRope::RopeI, xs, cos, sin)
    }

    /// NeoX rotary embedding on `xs` `[b, t, h, d]`, candle-nn's `rotary_emb::rope_thd`.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// let xs = Tensor::new(&[[[[1f32, 2.0]], [[1.0, 2.0]]]], &Device::Cpu)?; // [1, 2, 1, 2]
    /// // Position 0 by 0°, position 1 by 90°.
    /// let cos = Tensor::new(&[[1f32], [0.0]], &Device::Cpu)?;
    /// let sin = Tensor::new(&[[0f32], [1.0]], &Device::Cpu)?;
    /// let y = liger_rs::candle::nn::rotary_emb::rope_thd(&xs, &cos, &sin)?;
    /// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [1.0, 2.0, -2.0, 1.0]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        nn_rope(NnRope::RopeThd, xs, cos, sin)
    }
}

/// RMSNorm module, candle-nn's `RmsNorm`: [`Module::forward`] is [`ops::rms_norm`] with the
/// weight and `eps`, differentiable for any input layout.
///
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use liger_rs::candle::nn::RmsNorm;
/// let norm = RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
/// let y = norm.forward(&Tensor::ones((2, 4), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [2, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// A norm with `weight` `[n]` and `eps` (as candle-nn: `eps` is used as f32).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = liger_rs::candle::nn::RmsNorm::new(Tensor::ones(8, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert_eq!(norm.eps(), 1e-5);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm { weight, eps }
    }

    /// The same norm as candle-nn's `LayerNorm` (its chain of candle ops, differentiable).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = liger_rs::candle::nn::RmsNorm::new(Tensor::ones(8, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert_eq!(norm.into_inner().eps(), 1e-5);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn into_inner(self) -> candle_nn::LayerNorm {
        candle_nn::LayerNorm::rms_norm(self.weight, self.eps)
    }

    /// The weight `[n]`.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = liger_rs::candle::nn::RmsNorm::new(Tensor::ones(8, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert_eq!(norm.weight().dims(), [8]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `eps`.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = liger_rs::candle::nn::RmsNorm::new(Tensor::ones(8, DType::F32, &Device::Cpu)?, 0.5);
    /// assert_eq!(norm.eps(), 0.5);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// candle-nn's name for its differentiable forward; here the same as
    /// [`Module::forward`], which is differentiable too.
    ///
    /// ```
    /// use candle_core::{DType, Device, Module, Tensor};
    /// let norm = liger_rs::candle::nn::RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
    /// assert_eq!(norm.forward_diff(&x)?.to_vec2::<f32>()?, norm.forward(&x)?.to_vec2::<f32>()?);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn forward_diff(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward(xs)
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        ops::rms_norm(xs, &self.weight, self.eps as f32)
    }
}

/// candle-nn's `rms_norm(size, eps, vb)`: the weight `[size]` from `vb` (named `weight`, or
/// `gamma`, initialised to ones where `vb` creates it, exactly as candle-nn looks it up).
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// let vars = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
/// let norm = liger_rs::candle::nn::rms_norm(16, 1e-6, vb.pp("input_layernorm"))?;
/// assert_eq!(norm.weight().dims(), [16]);
/// assert_eq!(vars.all_vars().len(), 1); // trainable
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder<'_>) -> Result<RmsNorm> {
    let inner = candle_nn::rms_norm(size, eps, vb)?;
    Ok(RmsNorm::new(inner.weight().clone(), eps))
}
