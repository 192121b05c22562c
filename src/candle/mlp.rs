//! A gated MLP (Llama's, Gemma's) as one autograd node: `y = glu(x·W_guᵀ)·W_downᵀ`.
//!
//! Written as candle ops, the block is a linear for the gate, one for the up projection,
//! the GLU and the down linear: candle's backward sums each gradient a node hands on into a
//! zero-filled tensor of the input's size, so the block costs a fill and an add of `x`'s size
//! per projection and three of the intermediate size (gate, up, the activation). As one node
//! it costs one of `x`'s size: the backward computes `d(act)`, the GLU backward over the fused
//! gate-up buffer and the four weight and input GEMMs itself, from the gate-up projection and
//! the activation the forward keeps (the tensors candle's graph would keep for the same
//! block).
use super::linear::matmul;
use super::swiglu::{GluOp, glu_fused_backward};
use super::{SwigluConfig, tensor};
use crate::Gelu;
use crate::identity::Gate;
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp3, D, Layout, Result, Shape, Storage, Tensor, bail,
};
use std::sync::Mutex;

/// A backend's storage as the node needs it: the GLU forward on it, and a graph-free tensor
/// over it (to keep for the backward).
trait Backend: BackendStorage {
    fn gate(op: &GluOp, gate_up: &Self, layout: &Layout) -> Result<(Self, Shape)>;
    fn into_tensor(self, shape: Shape) -> Tensor;
}

impl Backend for CpuStorage {
    fn gate(op: &GluOp, gate_up: &Self, layout: &Layout) -> Result<(Self, Shape)> {
        op.cpu_fwd(gate_up, layout)
    }
    fn into_tensor(self, shape: Shape) -> Tensor {
        Tensor::from_storage(Storage::Cpu(self), shape, BackpropOp::none(), false)
    }
}

impl Backend for CudaStorage {
    fn gate(op: &GluOp, gate_up: &Self, layout: &Layout) -> Result<(Self, Shape)> {
        op.cuda_fwd(gate_up, layout)
    }
    fn into_tensor(self, shape: Shape) -> Tensor {
        tensor(self, shape)
    }
}

/// The node: inputs `x`, `W_gu`, `W_down`; it keeps the forward's gate-up projection
/// `[rows, 2·inter]` and activation `[rows, inter]`.
struct MlpOp {
    gate: Gate,
    saved: Mutex<Option<[Tensor; 2]>>,
}

impl MlpOp {
    fn forward<S: Backend>(
        &self,
        (x, lx): (&S, &Layout),
        (w_gu, lgu): (&S, &Layout),
        (w_down, ld): (&S, &Layout),
    ) -> Result<(S, Shape)> {
        let (hidden, width) = (lgu.dims()[1], lgu.dims()[0]);
        let rows: usize = lx.dims()[..lx.dims().len() - 1].iter().product();
        let x2 = Layout::contiguous_with_offset((rows, hidden), lx.start_offset());
        let (gu, gu_shape) = matmul(x, &x2, w_gu, lgu)?;
        let op = GluOp::fused(self.gate);
        let (act, act_shape) = S::gate(&op, &gu, &Layout::contiguous(&gu_shape))?;
        let (y, _) = matmul(&act, &Layout::contiguous(&act_shape), w_down, ld)?;
        debug_assert_eq!(gu_shape.dims(), [rows, width]);
        *self.saved.lock().unwrap_or_else(|p| p.into_inner()) =
            Some([gu.into_tensor(gu_shape), act.into_tensor(act_shape)]);
        Ok((y, lx.shape().clone()))
    }
}

impl CustomOp3 for MlpOp {
    fn name(&self) -> &'static str {
        name(self.gate)
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w_gu: &CpuStorage,
        lgu: &Layout,
        w_down: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward((x, lx), (w_gu, lgu), (w_down, ld))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w_gu: &CudaStorage,
        lgu: &Layout,
        w_down: &CudaStorage,
        ld: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.forward((x, lx), (w_gu, lgu), (w_down, ld))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w_gu: &Tensor,
        w_down: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some([gu, act]) = self.saved.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            bail!("{}: backward before forward", name(self.gate))
        };
        // On detached inputs: products of tracked tensors would record graph nodes holding
        // `dy`, which the gradient store would keep alive to its end.
        let (x, w_gu, w_down) = (x.detach(), w_gu.detach(), w_down.detach());
        let hidden = w_down.dim(0)?;
        let dy = dy.reshape(((), hidden))?;
        let d_act = dy.matmul(&w_down)?;
        let d_down = dy.t()?.matmul(&act)?;
        let d_gu = glu_fused_backward(self.gate, &d_act, &gu, &SwigluConfig::default())?;
        let d_w_gu = d_gu.t()?.matmul(&x.reshape(((), hidden))?)?;
        let dx = d_gu.matmul(&w_gu)?.reshape(x.shape())?;
        Ok((Some(dx), Some(d_w_gu), Some(d_down)))
    }
}

fn name(gate: Gate) -> &'static str {
    match gate {
        Gate::Silu => "liger-rs swiglu_mlp",
        Gate::GeluTanh | Gate::GeluErf => "liger-rs geglu_mlp",
    }
}

/// Llama's MLP, `(silu(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ`, as one autograd node (the module
/// docs say what that saves candle's backward).
///
/// `x`: `[..., hidden]` (rank ≥ 1; copied first when not contiguous); `gate_up_weight`:
/// `[2·inter, hidden]`, the gate projection's rows then the up projection's
/// (`Tensor::cat(&[w_gate, w_up], 0)`); `down_weight`: `[hidden, inter]`; one dtype and
/// device. Returns `[..., hidden]`; gradients flow to all three. The projections are
/// candle's GEMMs (cuBLAS on CUDA) and the activation is [`swiglu_fused`](super::swiglu_fused)'s
/// kernel, so forward values are those of [`linear`](super::linear) and `swiglu_fused`
/// composed; the backward keeps the gate-up projection and the activation
/// (`rows · 3·inter` elements), as candle's graph of the same block does.
///
/// # Errors
/// A shape, dtype or device mismatch, named; candle's errors of the GEMMs.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[1f32, -2.0]], &dev)?;
/// let gate_up = Var::new(&[[1f32, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0]], &dev)?;
/// let down = Var::new(&[[1f32, 0.0], [0.5, 1.0]], &dev)?;
/// let y = liger_rs::candle::swiglu_mlp(x.as_tensor(), gate_up.as_tensor(), down.as_tensor())?;
/// let silu = |v: f32| v / (1.0 + (-v).exp());
/// let act = [silu(1.0) * 2.0, silu(-2.0) * -1.0];
/// let want = [act[0], 0.5 * act[0] + act[1]];
/// let got = y.to_vec2::<f32>()?;
/// assert!((got[0][0] - want[0]).abs() < 1e-6 && (got[0][1] - want[1]).abs() < 1e-6);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&gate_up).unwrap().dims(), [4, 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_mlp(x: &Tensor, gate_up_weight: &Tensor, down_weight: &Tensor) -> Result<Tensor> {
    glu_mlp(Gate::Silu, x, gate_up_weight, down_weight)
}

/// Gemma's MLP, `(gelu(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ` with GELU in the form `gelu`, as one
/// autograd node; otherwise as [`swiglu_mlp`] (the activation is
/// [`geglu_fused`](super::geglu_fused)'s kernel).
///
/// # Errors
/// As [`swiglu_mlp`].
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::Gelu;
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1.0, (8, 2048), &dev)?.to_dtype(DType::BF16)?;
/// let gate_up = Tensor::randn(0f32, 0.02, (2 * 16384, 2048), &dev)?.to_dtype(DType::BF16)?;
/// let down = Tensor::randn(0f32, 0.02, (2048, 16384), &dev)?.to_dtype(DType::BF16)?;
/// let y = liger_rs::candle::geglu_mlp(&x, &gate_up, &down, Gelu::Tanh)?; // [8, 2048]
/// # let _ = y;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu_mlp(
    x: &Tensor,
    gate_up_weight: &Tensor,
    down_weight: &Tensor,
    gelu: Gelu,
) -> Result<Tensor> {
    glu_mlp(gelu.gate(), x, gate_up_weight, down_weight)
}

fn glu_mlp(
    gate: Gate,
    x: &Tensor,
    gate_up_weight: &Tensor,
    down_weight: &Tensor,
) -> Result<Tensor> {
    let op = name(gate);
    let (width, hidden) = match *gate_up_weight.dims() {
        [w, h] if w.is_multiple_of(2) && w > 0 => (w, h),
        _ => bail!(
            "{op}: gate_up_weight must be [2·inter, hidden] (gate rows, then up rows), got {:?}",
            gate_up_weight.dims()
        ),
    };
    if down_weight.dims() != [hidden, width / 2] {
        bail!(
            "{op}: down_weight must be [{hidden}, {}] for a gate_up_weight of [{width}, \
             {hidden}], got {:?}",
            width / 2,
            down_weight.dims()
        )
    }
    if x.rank() == 0 || x.dim(D::Minus1)? != hidden {
        bail!(
            "{op}: x must be [..., {hidden}] for a gate_up_weight of [{width}, {hidden}], got {:?}",
            x.dims()
        )
    }
    for (arg, t) in [
        ("gate_up_weight", gate_up_weight),
        ("down_weight", down_weight),
    ] {
        if t.dtype() != x.dtype() {
            bail!("{op}: {arg} is {:?}, x is {:?}", t.dtype(), x.dtype())
        }
        if !t.device().same_device(x.device()) {
            bail!("{op}: {arg} is on another device than x")
        }
    }
    let node = MlpOp {
        gate,
        saved: Mutex::new(None),
    };
    x.contiguous()?.apply_op3(
        &gate_up_weight.contiguous()?,
        &down_weight.contiguous()?,
        node,
    )
}

/// A gated MLP block with one fused gate-up weight (Liger's `LigerSwiGLUMLP`, and with
/// [`SwigluMlp::geglu`] its GEGLU MLP): [`Module::forward`](candle_core::Module::forward)
/// is [`swiglu_mlp`] or [`geglu_mlp`], one autograd node.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::nn::{Module, SwigluMlp};
/// let dev = Device::Cpu;
/// let mlp = SwigluMlp::new(
///     Tensor::ones((2 * 3, 4), DType::F32, &dev)?,
///     Tensor::ones((4, 3), DType::F32, &dev)?,
/// );
/// let y = mlp.forward(&Tensor::zeros((2, 4), DType::F32, &dev)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[0.0; 4]; 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct SwigluMlp {
    gate_up: Tensor,
    down: Tensor,
    gate: Gate,
}

impl SwigluMlp {
    /// A SwiGLU MLP of `gate_up` `[2·inter, hidden]` (gate rows, then up rows) and `down`
    /// `[hidden, inter]`.
    pub fn new(gate_up: Tensor, down: Tensor) -> Self {
        SwigluMlp {
            gate_up,
            down,
            gate: Gate::Silu,
        }
    }

    /// A GEGLU MLP (Gemma's) of the same weights, GELU in the form `gelu`.
    pub fn geglu(gate_up: Tensor, down: Tensor, gelu: Gelu) -> Self {
        SwigluMlp {
            gate_up,
            down,
            gate: gelu.gate(),
        }
    }

    /// The fused gate-up weight, `[2·inter, hidden]`.
    pub fn gate_up(&self) -> &Tensor {
        &self.gate_up
    }

    /// The down projection's weight, `[hidden, inter]`.
    pub fn down(&self) -> &Tensor {
        &self.down
    }
}

impl candle_core::Module for SwigluMlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        glu_mlp(self.gate, xs, &self.gate_up, &self.down)
    }
}
