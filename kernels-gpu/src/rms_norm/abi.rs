//! The RMSNorm kernels' parameter block (the fused residual add's and the dW reduction's
//! too), defined once for both sides: the device crate compiles this file as
//! `kernels_gpu::rms_norm::abi`, the host crate mounts it through `#[path]` as
//! `crate::rms_norm::abi`.

/// Everything an RMSNorm kernel reads. Pointers are device addresses (0 where the kernel has
/// no such buffer: a weight left out, the fused add's buffers in RMSNorm's kernels, the
/// backward's in the forward's); strides count elements between consecutive rows.
///
/// The forward reads `x` (and the fused add's `r`), writes `y`, `rstd` (and the sum `s`).
/// The backward reads `dy` (and the fused add's `ds`), `x`, `w`, `rstd`, writes `dx` and, with
/// dW, one f32 partial row per block or cluster into `dw_partial`; the dW reduction sums
/// `parts` partial rows of `dw_partial` into `dw`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Params {
    /// The input rows.
    pub x: u64,
    /// The fused add's residual rows (the forward).
    pub r: u64,
    /// The fused add's sum `x + r`, written by the forward (may be `x` or `r`).
    pub s: u64,
    /// The weight, `cols` elements, or 0.
    pub w: u64,
    /// The forward's output rows.
    pub y: u64,
    /// One f32 per row: written by the forward, read by the backward.
    pub rstd: u64,
    /// The backward's incoming gradient rows.
    pub dy: u64,
    /// The fused add's incoming gradient of the sum (the backward).
    pub ds: u64,
    /// The backward's output rows (may be `dy`, or the fused add's `ds`).
    pub dx: u64,
    /// The dW partial rows, f32.
    pub dw_partial: u64,
    /// dW, `cols` elements (the reduction).
    pub dw: u64,
    /// Row stride of `x`, and of the fused add's `r` and `s`.
    pub x_stride: u64,
    /// Row stride of `y`; in the backward of `dy`, `ds` and `dx`.
    pub y_stride: u64,
    /// Rows.
    pub rows: u64,
    /// Elements per row.
    pub cols: u64,
    /// Partial rows of `dw_partial` (the reduction).
    pub parts: u64,
    /// ε inside the root.
    pub eps: f32,
    /// The weight offset (`offset + w`).
    pub offset: f32,
}
