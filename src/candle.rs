//! [candle](https://crates.io/crates/candle-core) interop (feature `candle`): RMSNorm, RoPE and
//! SwiGLU forward and backward on candle [`Tensor`]s, with candle's autograd, on CUDA (this
//! crate's kernels) and on the CPU (this crate's [`reference`](crate::reference)).
//!
//! **Porting from candle-nn**: [`nn`] has candle-nn 0.11's `ops::rms_norm`, `RmsNorm`,
//! `rms_norm`, `rotary_emb::{rope, rope_i, rope_thd}` and `ops::swiglu` with its names,
//! arguments, shapes and dtypes, all differentiable (candle-nn's are not); changing the `use`
//! line is the whole port. The rest of this module is this crate's own API (Liger's casting
//! modes, weight offsets, multipliers, HF's `[B, S, H, d]` RoPE with q and k in one launch).
//!
//! candle-core 0.11 is built on the same cudarc 0.19 as this crate, so a CUDA tensor's
//! `CudaStorage` holds a `cudarc` `CudaSlice` that the launchers take as it is: inputs are
//! read in place (no copy), outputs are fresh device buffers wrapped into `CudaStorage`, and
//! every launch goes on the tensor's device stream ([`CudaDevice::cuda_stream`]), so it is
//! ordered with candle's own work on that device without any synchronisation.
//!
//! **Two ways in.**
//! * Autograd: [`rms_norm`], [`fused_add_rms_norm`], [`rope`] ([`rope_with`]), [`swiglu`],
//!   [`swiglu_fused`], [`geglu`] and [`geglu_fused`] are [`CustomOp1`](candle_core::CustomOp1),
//!   [`CustomOp2`](candle_core::CustomOp2) or [`CustomOp3`](candle_core::CustomOp3)
//!   implementations (private types behind these functions) with a backward, so
//!   `loss.backward()` runs this crate's backward. Each op's backward is the gradient of the
//!   value its forward returns. An op holds what its backward needs (RMSNorm: the forward's
//!   `rstd`; RoPE: `cos`, `sin` and the position ids) for as long as the graph holds the op.
//!   On inputs that track no gradient they are plain forward calls. The op types stay
//!   private: each function checks shapes and dtypes in candle's terms first and builds a
//!   fresh op per call (an op's saved state belongs to one forward). A custom op has one
//!   output, so [`rope`] writes q and k rotated into one `[q | k]` buffer (reading q and k
//!   where they are) and returns two views of it, as [`fused_add_rms_norm`] does `[y | s]`.
//! * Explicit: [`rms_norm_forward`] (which also returns `rstd`), [`rms_norm_backward`],
//!   [`rope_backward`] ([`rope_backward_with`]), [`swiglu_backward`],
//!   [`swiglu_fused_backward`], [`geglu_backward`] and [`geglu_fused_backward`] return new tensors and build no graph, for code that keeps its
//!   own gradients.
//!
//! **Devices.** CUDA tensors run this crate's kernels. CPU tensors run the f64 reference with
//! the kernels' cast points (so a model runs, and its tests pass, on `Device::Cpu` too; it is
//! a ground truth, not fast), and take f64 as well. Every tensor of a call is on one device;
//! Metal tensors are an error.
//!
//! **Layouts.** Inputs are used in place when contiguous, with or without a start offset
//! (e.g. `narrow` on the first dim); a non-contiguous input (a transpose, a broadcast, a
//! column slice) is first copied by [`Tensor::contiguous`], which candle's autograd tracks.
//! Outputs are contiguous. The last dim is the row (`cols`) of RMSNorm and SwiGLU; all
//! leading dims are rows.
//!
//! **Dtypes**: f32, f16 and bf16 (and f64 on the CPU); every tensor of one call has the same
//! dtype, except `rstd` (f32, f64 for f64 tensors) and RoPE position ids (i64 or i32). Empty
//! CUDA tensors are an error (CUDA allocates no empty buffer).
//!
//! **Building**: candle-core's `cuda` feature compiles its kernels with nvcc and links cuBLAS,
//! cuRAND, cudart and the driver, so this feature needs a CUDA toolkit at build time (the
//! repository's `.ci/cuda-env.sh` installs one from PyPI) and those libraries at run time.
//!
//! **Errors.** A tensor on the Metal device, tensors on different devices, a wrong dtype, or
//! a wrong shape is a [`candle_core::Error`] naming the op and the tensor. An error of this
//! crate (a launcher's on CUDA, the reference's on the CPU) comes back as
//! [`candle_core::Error::Cuda`], candle's variant that carries a `std::error::Error`, holding
//! the [`crate::Error`] (downcast it to match on it); its argument names are those of the
//! plain API call the op maps to.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor, Var};
//! use liger_rs::candle::{RmsNormConfig, rms_norm, swiglu, SwigluConfig};
//!
//! let dev = Device::new_cuda(0)?;
//! let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 128, 4096), &dev)?.to_dtype(DType::BF16)?)?;
//! let w = Var::from_tensor(&Tensor::ones(4096, DType::BF16, &dev)?)?;
//! let y = rms_norm(x.as_tensor(), Some(w.as_tensor()), &RmsNormConfig::default())?;
//! let h = swiglu(&y, x.as_tensor(), &SwigluConfig::default())?; // gate y, up x
//! let grads = h.to_dtype(DType::F32)?.sum_all()?.backward()?;
//! let (dx, dw) = (grads.get(&x).unwrap(), grads.get(&w).unwrap());
//! # let _ = (dx, dw);
//! # Ok::<(), candle_core::Error>(())
//! ```
use crate::Dtype;
use crate::reference::Element;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use std::sync::Arc;

mod block;
mod cross_entropy;
pub mod ddp;
mod embedding;
pub mod flash_attn;
mod fused_add_rms_norm;
mod grad_slot;
mod linear;
mod mlp;
pub mod nn;
mod optim;
mod qkv_attn;
mod rms_norm;
mod rope;
mod swiglu;

pub use block::{
    AttentionBlockConfig, BlockSlots, attention_block, attention_block_with_slots,
    pack_attention_weights, pack_mlp_weights, swiglu_mlp_block, swiglu_mlp_block_with_slots,
};
pub use cross_entropy::{
    CrossEntropyConfig, cross_entropy, cross_entropy_with, fused_linear_cross_entropy,
    fused_linear_cross_entropy_with_slot,
};
pub use embedding::{embedding, embedding_with_slot};
pub use fused_add_rms_norm::fused_add_rms_norm;
pub use grad_slot::GradSlot;
pub use linear::linear;
pub use mlp::{geglu_mlp, swiglu_mlp};
pub use rms_norm::{RmsNormConfig, rms_norm, rms_norm_backward, rms_norm_forward};
pub use rope::{RopeConfig, rope, rope_backward, rope_backward_with, rope_with};
pub use swiglu::{
    SwigluConfig, geglu, geglu_backward, geglu_fused, geglu_fused_backward, swiglu,
    swiglu_backward, swiglu_fused, swiglu_fused_backward,
};

/// Runs `$f::<T>(args)` for the element type of `$dtype` (f32, f16 or bf16), or returns
/// candle's unsupported-dtype error for `$op`.
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other, $op)),
        }
    };
}
pub(crate) use by_dtype;

/// [`by_dtype`] for the CPU path, which takes f64 too.
macro_rules! by_host_dtype {
    ($dtype:expr, $op:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other, $op)),
        }
    };
}
pub(crate) use by_host_dtype;

/// An element type of both this crate's kernels and candle's CUDA storage.
trait Elem: Dtype + CudaDType {}
impl<T: Dtype + CudaDType> Elem for T {}

/// An element type of both this crate's reference and candle's CPU storage.
trait HostElem: Element + WithDType {}
impl<T: Element + WithDType> HostElem for T {}

/// An error of this crate as a candle error (downcastable to [`crate::Error`]).
fn crate_err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// Where a call's tensors are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum On {
    Cpu,
    Cuda,
}

fn device_name(device: &Device) -> &'static str {
    match device {
        Device::Cpu => "CPU",
        Device::Cuda(_) => "CUDA",
        Device::Metal(_) => "Metal",
    }
}

/// The device of a call's tensors (named for errors): all on the CPU or all on one CUDA
/// device.
fn on(op: &str, tensors: &[(&str, &Tensor)]) -> Result<On> {
    let Some(&(first, t0)) = tensors.first() else {
        return Ok(On::Cpu);
    };
    let where_ = match t0.device() {
        Device::Cpu => On::Cpu,
        Device::Cuda(_) => On::Cuda,
        Device::Metal(_) => return Err(not_here(op, first, "Metal")),
    };
    for &(name, t) in &tensors[1..] {
        if !t.device().same_device(t0.device()) {
            return Err(candle_core::Error::Msg(format!(
                "{op}: `{name}` is on the {} device but `{first}` on the {} device",
                device_name(t.device()),
                device_name(t0.device())
            )));
        }
    }
    Ok(where_)
}

fn not_here(op: &str, name: &str, device: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: `{name}` is on the {device} device; these ops run on CUDA and CPU tensors"
    ))
}

/// The CUDA storage of a locked tensor storage, or an error naming the tensor.
fn cuda<'a>(storage: &'a Storage, op: &str, name: &str) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(not_here(op, name, "CPU")),
        Storage::Metal(_) => Err(not_here(op, name, "Metal")),
    }
}

/// The elements a contiguous `layout` covers in `storage`, as a view (no copy).
fn view<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &'static str,
) -> Result<CudaView<'a, T>> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or(candle_core::Error::RequiresContiguous { op })?;
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// The elements a contiguous `layout` covers in a CPU storage.
fn host_slice<'a, T: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> Result<&'a [T]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or(candle_core::Error::RequiresContiguous { op })?;
    Ok(&storage.as_slice::<T>()?[start..end])
}

/// Device buffer for `len ≥ 1` elements that the kernel writes in full (CUDA allocates no
/// empty buffers, so an empty output is an error naming `op`).
fn output<T: Elem>(stream: &Arc<CudaStream>, len: usize, op: &str) -> Result<CudaSlice<T>> {
    if len == 0 {
        return Err(candle_core::Error::Msg(format!(
            "{op}: empty tensors are not supported on CUDA (CUDA cannot allocate an empty \
             output)"
        )));
    }
    // SAFETY: every caller passes the buffer to a launch that writes each of its elements
    // before anything reads it.
    unsafe { stream.alloc::<T>(len) }.map_err(|e| crate_err(e.into()))
}

/// The gradient buffers of a norm's backward: `dx` of `rows × cols` elements, and `dw` of
/// `cols` where the weight's gradient is wanted (a frozen or absent weight gets none).
fn grad_outputs<T: Elem>(
    stream: &Arc<CudaStream>,
    (rows, cols): (usize, usize),
    with_dw: bool,
    op: &str,
) -> Result<(CudaSlice<T>, Option<CudaSlice<T>>)> {
    let dx = output::<T>(stream, rows * cols, op)?;
    let dw = match with_dw {
        true => Some(output::<T>(stream, cols, op)?),
        false => None,
    };
    Ok((dx, dw))
}

fn wrap<T: Elem>(slice: CudaSlice<T>, device: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, device.clone())
}

/// A tensor over `storage` that builds no graph.
fn tensor(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// A tensor's elements in row-major order, on the host.
fn host<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

/// A CPU tensor of `data` that builds no graph.
fn host_tensor<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// The `(rows, cols)` of a tensor whose last dim is the row: `cols` is the last dim (1 for a
/// scalar), `rows` the product of the others.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape.dims().last().copied().unwrap_or(1);
    let rows = shape.dims().iter().rev().skip(1).product();
    (rows, cols)
}

fn same_dtype(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
    if lhs.dtype() == rhs.dtype() {
        Ok(())
    } else {
        Err(candle_core::Error::DTypeMismatchBinaryOp {
            lhs: lhs.dtype(),
            rhs: rhs.dtype(),
            op,
        })
    }
}

fn same_shape(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
    if lhs.dims() == rhs.dims() {
        Ok(())
    } else {
        Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: lhs.shape().clone(),
            rhs: rhs.shape().clone(),
            op,
        })
    }
}

/// `storage` scaled by `m` (rounded to its dtype, as candle's `affine` does), through
/// candle's own elementwise kernel; `storage` itself when `m = 1`.
fn scaled<S: BackendStorage>(storage: S, shape: &Shape, m: f32) -> Result<S> {
    if m == 1.0 {
        Ok(storage)
    } else {
        storage.affine(&Layout::contiguous(shape), m as f64, 0.0)
    }
}
