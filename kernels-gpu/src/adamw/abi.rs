//! The optimizer kernels' parameter block, defined once for both sides: the device crate compiles
//! this file as `kernels_gpu::adamw::abi`, the host crate mounts it through `#[path]` as
//! `crate::adamw::abi`. Each launch updates up to [`TENSORS`] parameter tensors (PyTorch's
//! multi-tensor apply): their addresses travel in the parameter block, by value, so a step
//! needs no upload and can be captured in a graph.

/// One parameter tensor of a launch: f32 master weights, optimizer states (f32, or bf16 for
/// the AdamW update with bf16 states), the gradient in the launch's gradient type, an optional
/// low-precision copy of the weights. SGD keeps its
/// momentum buffer in `exp_avg` (0 without momentum).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tensor {
    /// The weights θ, f32, updated in place.
    pub param: u64,
    /// The gradient, read.
    pub grad: u64,
    /// The first moment m.
    pub exp_avg: u64,
    /// The second moment v.
    pub exp_avg_sq: u64,
    /// amsgrad's running maximum of v, or 0.
    pub max_exp_avg_sq: u64,
    /// The weights rounded to the copy type after the update, or 0.
    pub copy: u64,
    /// Elements.
    pub len: u64,
    /// The launch's first block on this tensor (blocks of [`BLOCK_ELEMS`] elements, tensors in
    /// order).
    pub first_block: u64,
}

/// Tensors per launch.
pub const TENSORS: usize = 32;
/// Elements per block.
pub const BLOCK_ELEMS: u64 = 4096;
/// Threads per block of the update and the sum-of-squares kernels.
pub const THREADS: u32 = 256;

/// Everything an optimizer kernel reads. The hyper-parameters are f64, as PyTorch's fused
/// kernels take them; the kernels round them to f32 first, as PyTorch's do.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// The launch's tensors; the first `count` are used.
    pub tensors: [Tensor; TENSORS],
    /// Tensors of this launch.
    pub count: u32,
    /// Bits of [`AMSGRAD`], [`MAXIMIZE`], [`DECOUPLED`].
    pub flags: u32,
    /// Learning rate.
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε, added outside the square root.
    pub eps: f64,
    /// Weight decay λ.
    pub weight_decay: f64,
    /// SGD's momentum μ (0: no buffer).
    pub momentum: f64,
    /// SGD's dampening.
    pub dampening: f64,
    /// The step t ≥ 1 (f32, as PyTorch keeps it), unless `step_ptr` is set.
    pub step: f32,
    /// Keeps the layout free of implicit padding on both sides.
    pub pad: u32,
    /// A device f32 holding the step, or 0.
    pub step_ptr: u64,
    /// A device f32 holding the learning rate, or 0.
    pub lr_ptr: u64,
    /// A device f32 the gradient is divided by (PyTorch's `grad_scale`), or 0.
    pub grad_scale_ptr: u64,
    /// A device f32: the step is skipped where it is not 0 (PyTorch's `found_inf`), or 0.
    pub found_inf_ptr: u64,
    /// A device f32 the gradient is multiplied by first (gradient clipping's factor), or 0.
    pub clip_ptr: u64,
    /// The sum-of-squares kernel's per-block partial sums, f32 `[blocks]`.
    pub partials: u64,
    /// The sum-of-squares kernel's first block for this launch's tensors.
    pub partial_base: u64,
    /// The norm kernel: partial sums to reduce.
    pub partial_count: u64,
    /// The norm kernel: clip to this norm (f32; ∞ for no clipping).
    pub max_norm: f32,
    /// Keeps the layout free of implicit padding.
    pub pad2: u32,
    /// The norm kernel's outputs, f32 `[NORM_OUT]`: the global norm, the clip factor, and 1
    /// where the norm is not finite (some gradient is infinite or NaN), else 0.
    pub norm: u64,
}

/// amsgrad: the denominator uses the running maximum of v.
pub const AMSGRAD: u32 = 1;
/// Ascend the gradient.
pub const MAXIMIZE: u32 = 2;
/// AdamW's decoupled weight decay (`θ ← θ − lr·λ·θ`), else Adam's L2 (`g ← g + λ·θ`).
pub const DECOUPLED: u32 = 4;
/// SGD's Nesterov momentum.
pub const NESTEROV: u32 = 8;
/// SGD's first step: the momentum buffer starts as the gradient.
pub const FIRST_STEP: u32 = 16;
/// The norm kernels: the infinity norm (the largest `|g|`), else the L2 norm.
pub const NORM_INF: u32 = 32;
/// f32 values the norm kernel writes.
pub const NORM_OUT: usize = 3;
