//! A linear layer as one autograd node: `y = x·Wᵀ (+ b)`.
//!
//! candle-nn's `Linear` is a reshape, a matmul with the view `W.t()` and a reshape back: four
//! nodes of candle's graph. candle's backward sums every gradient a node hands on into a
//! zero-filled tensor of that input's size, so each of those nodes costs a fill and an add:
//! of the input's and the output's size for the reshapes, of the weight's size twice for the
//! transposed view (the second add reading it strided). Here the layer is one node whose
//! backward returns `dx` and `dW` directly, from the same GEMMs (cuBLAS through candle on
//! CUDA, candle's CPU GEMM on the CPU).
use candle_core::backend::BackendStorage;
use candle_core::op::Add;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, D, Layout, Result, Shape, Tensor, bail,
};

/// The node: the forward GEMM on storage, the backward's GEMMs on tensors.
struct LinearOp;

/// `x [..., k]` (contiguous) times `Wᵀ` for `W [n, k]`: `[..., n]`.
pub(super) fn matmul<S: BackendStorage>(
    x: &S,
    lx: &Layout,
    w: &S,
    lw: &Layout,
) -> Result<(S, Shape)> {
    if !lx.is_contiguous() {
        bail!("liger-rs linear: x must be contiguous (the wrapper makes it so)")
    }
    let dims = lx.dims();
    let k = dims[dims.len() - 1];
    let m: usize = dims[..dims.len() - 1].iter().product();
    let (n, _) = lw.shape().dims2()?;
    let x2 = Layout::contiguous_with_offset((m, k), lx.start_offset());
    let y = x.matmul(w, (1, m, n, k), &x2, &lw.transpose(0, 1)?)?;
    let mut out = dims[..dims.len() - 1].to_vec();
    out.push(n);
    Ok((y, Shape::from(out)))
}

/// [`matmul`] plus the bias `[n]` broadcast over the rows.
fn matmul_bias<S: BackendStorage>(
    (x, lx): (&S, &Layout),
    (w, lw): (&S, &Layout),
    (b, lb): (&S, &Layout),
) -> Result<(S, Shape)> {
    let (y, shape) = matmul(x, lx, w, lw)?;
    let y = y.binary_impl::<Add>(b, &Layout::contiguous(&shape), &lb.broadcast_as(&shape)?)?;
    Ok((y, shape))
}

/// `(dx, dW)` of `y = x·Wᵀ` for the output gradient `dy`.
fn grads(x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    // On detached inputs (the same storage): the products of tracked `x` and `w` would record
    // graph nodes holding `dy`, which the gradient store would keep alive to its end.
    let (x, w) = (x.detach(), w.detach());
    let (n, k) = w.dims2()?;
    let dy = dy.reshape(((), n))?;
    let dx = dy.matmul(&w)?.reshape(x.shape())?;
    let dw = dy.t()?.matmul(&x.reshape(((), k))?)?;
    Ok((dx, dw))
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "liger-rs linear"
    }
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        matmul(x, lx, w, lw)
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        matmul(x, lx, w, lw)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = grads(x, w, dy)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "liger-rs linear"
    }
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        matmul_bias((x, lx), (w, lw), (b, lb))
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        matmul_bias((x, lx), (w, lw), (b, lb))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = grads(x, w, dy)?;
        let db = dy.reshape(((), w.dim(0)?))?.sum(0)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `y = x·Wᵀ + b` over the last dim as one autograd node (candle-nn's `Linear::forward`,
/// whose backward costs candle's graph four nodes' gradient sums: the module docs).
///
/// `x`: `[..., k]` (rank ≥ 1; copied first when not contiguous); `weight`: `[n, k]`;
/// `bias`: `[n]`; all of one dtype and device. Returns `[..., n]`. Gradients flow to all
/// three. The forward is the GEMM candle-nn runs for a contiguous `x`, so its values are
/// candle-nn's; the weight's gradient is the GEMM `dyᵀ·x` written `[n, k]` (candle-nn
/// computes `xᵀ·dy` and transposes it), equal up to the GEMM's summation order.
///
/// # Errors
/// A shape, dtype or device mismatch, named; candle's errors of the GEMM.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let x = Var::new(&[[1f32, 2.0]], &Device::Cpu)?;
/// let w = Var::new(&[[1f32, 0.0], [3.0, -1.0], [0.5, 0.5]], &Device::Cpu)?;
/// let y = liger_rs::candle::linear(x.as_tensor(), w.as_tensor(), None)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1.0, 1.0, 1.5]]);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&x).unwrap().to_vec2::<f32>()?, [[4.5, -0.5]]);
/// assert_eq!(grads.get(&w).unwrap().to_vec2::<f32>()?, [[1.0, 2.0]; 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (n, k) = match *weight.dims() {
        [n, k] => (n, k),
        _ => bail!(
            "liger-rs linear: weight must be [out, in], got {:?}",
            weight.dims()
        ),
    };
    if x.rank() == 0 || x.dim(D::Minus1)? != k {
        bail!(
            "liger-rs linear: x must be [..., {k}] for a weight of [{n}, {k}], got {:?}",
            x.dims()
        )
    }
    let mut named = vec![("weight", weight)];
    named.extend(bias.map(|b| ("bias", b)));
    for (name, t) in named {
        if t.dtype() != x.dtype() {
            bail!(
                "liger-rs linear: {name} is {:?}, x is {:?}",
                t.dtype(),
                x.dtype()
            )
        }
        if !t.device().same_device(x.device()) {
            bail!("liger-rs linear: {name} is on another device than x")
        }
    }
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    match bias {
        None => x.apply_op2(&weight, LinearOp),
        Some(b) => {
            if b.dims() != [n] {
                bail!("liger-rs linear: bias must be [{n}], got {:?}", b.dims())
            }
            x.apply_op3(&weight, b, LinearOp)
        }
    }
}

/// candle-nn's `Linear` (same constructor, accessors and `Module::forward`), its forward
/// [`linear`]: one autograd node.
///
/// ```
/// use liger_rs::candle::nn::{Linear, Module};
/// use candle_core::{Device, Tensor};
/// let layer = Linear::new(Tensor::ones((3, 2), candle_core::DType::F32, &Device::Cpu)?, None);
/// let y = layer.forward(&Tensor::new(&[[1f32, 2.0]], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[3.0; 3]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// A layer of `weight` `[out, in]` and an optional `bias` `[out]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias }
    }

    /// The weight, `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl From<candle_nn::Linear> for Linear {
    /// The same weight and bias.
    fn from(l: candle_nn::Linear) -> Self {
        Linear::new(l.weight().clone(), l.bias().cloned())
    }
}

impl candle_core::Module for Linear {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        linear(xs, &self.weight, self.bias.as_ref())
    }
}
