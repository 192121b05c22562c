//! The cross-entropy kernels' parameter block, defined once for both sides: the device crate
//! compiles this file as `kernels_gpu::cross_entropy::abi`, the host crate mounts it through
//! `#[path]` as `crate::cross_entropy::abi`. Every cross-entropy kernel takes one [`Params`]
//! by value as its only argument; the host's tests check the size of each entry's parameter
//! in the PTX against `size_of::<Params>()`.

/// Everything a cross-entropy kernel reads. A row is one token: its logits `z` (`vocab`
/// elements), its target class, its loss. Pointers are device addresses, 0 where a kernel
/// does not use the buffer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Params {
    /// Logits `[rows, vocab]`, row `i` at element `i·logits_stride`.
    pub logits: u64,
    /// Elements between consecutive rows of the logits.
    pub logits_stride: u64,
    /// The logits' gradient, shaped as the logits (0: the forward writes none); may be the
    /// logits themselves with the same stride (in place).
    pub grad: u64,
    /// Elements between consecutive rows of the gradient.
    pub grad_stride: u64,
    /// Targets, `i64 [rows]`.
    pub target: u64,
    /// Class weights, `f32 [vocab]`, or 0 for none.
    pub weight: u64,
    /// A bias added to every row of the logits as they are read, in the logits' type
    /// `[vocab]`, or 0 for none (fused linear cross-entropy's `x·Wᵀ + b`).
    pub bias: u64,
    /// Per-row loss, `f32 [rows]`: with [`NONE`] the output (cross-entropy plus z-loss),
    /// otherwise scratch holding the cross-entropy part for [`MEAN`]/[`SUM`]'s reduction.
    pub row_loss: u64,
    /// Per-row z-loss `λ·lse²`, `f32 [rows]`, or 0 (needed by the reduction when λ ≠ 0).
    pub row_z: u64,
    /// Per-row log-sum-exp of the (soft-capped) logits, `f32 [rows]`: written by the forward
    /// when not 0, read by the backward.
    pub lse: u64,
    /// The upstream gradient, `f32`: one value for [`MEAN`]/[`SUM`], one per row for
    /// [`NONE`]; 0 for 1.
    pub grad_loss: u64,
    /// `f32 [STATS]`, written by the count kernel before the row kernels read it: the mean's
    /// denominators and the weights' sum (see [`STAT_WEIGHT`], [`STAT_COUNT`],
    /// [`STAT_WEIGHT_SUM`]).
    pub stats: u64,
    /// The reduced loss, `f32 [1]` (the reduce kernel writes it).
    pub total: u64,
    /// The reduced z-loss, `f32 [1]`, or 0.
    pub total_z: u64,
    /// Rows.
    pub rows: u64,
    /// The target that marks a row to ignore (loss 0, gradient 0, not counted).
    pub ignore_index: i64,
    /// Classes per row.
    pub vocab: u32,
    /// [`NONE`], [`SUM`] or [`MEAN`].
    pub reduction: u32,
    /// Label smoothing ε in `[0, 1]`.
    pub label_smoothing: f32,
    /// The z-loss factor λ (`lse_square_scale`).
    pub lse_square_scale: f32,
    /// Soft-capping `c·tanh(z/c)` of the logits, or 0 for none.
    pub softcap: f32,
    /// Keeps the size a multiple of 8 bytes on both sides.
    pub pad: u32,
}

/// Per-row losses, no reduction.
pub const NONE: u32 = 0;
/// The sum over the counted rows.
pub const SUM: u32 = 1;
/// The cross-entropy summed over the counted rows divided by their targets' summed weight
/// (their count when unweighted), plus the z-loss summed and divided by their count.
pub const MEAN: u32 = 2;

/// f32 values of [`Params::stats`].
pub const STATS: usize = 3;
/// Index in [`Params::stats`] of `Σ w[t]` over the counted rows (their count when
/// unweighted): the mean's denominator of the cross-entropy.
pub const STAT_WEIGHT: usize = 0;
/// Index of the counted rows' number: the mean's denominator of the z-loss.
pub const STAT_COUNT: usize = 1;
/// Index of `Σ_j w[j]` over the vocabulary (the vocabulary's size when unweighted), which
/// label smoothing weighs by.
pub const STAT_WEIGHT_SUM: usize = 2;

/// Threads per block of the count and reduce kernels (one block each).
pub const STATS_THREADS: u32 = 1024;
/// Vectors (or scalars) each thread loads before it uses any of them, per step of a row.
pub const UNROLL: usize = 4;
/// The most threads per block of the row kernels.
pub const MAX_ROW_THREADS: u32 = 1024;

/// Bytes of dynamic shared memory of the row kernels: three f32 per warp and three for the
/// merged result.
pub const ROW_SHARED_BYTES: u32 = 3 * 33 * 4;

/// Byte offset in the staged forward's dynamic shared memory of its cluster's exchange slots
/// (two 16-byte slots, after [`ROW_SHARED_BYTES`]).
pub const EXCHANGE_OFFSET: u32 = 512;
/// Byte offset in the staged forward's dynamic shared memory of its slice of the row.
pub const STAGE_OFFSET: u32 = 1024;
/// The most bytes of a row one block of the staged forward holds: three such blocks fit in an
/// H100's or H200's 227 KB of shared memory per SM.
pub const STAGE_MAX_BYTES: u32 = 72 * 1024;
/// Threads per block of the staged forward: at 40 registers six such blocks fit an H100/H200
/// SM's registers, so its shared memory decides how many run (three with 72 KB slices, six
/// with the 36 KB slices the host gives split rows).
pub const STAGE_THREADS: u32 = 256;

/// Bytes of dynamic shared memory of the count and reduce kernels: three f64 per thread.
pub const fn stats_shared_bytes() -> u32 {
    3 * STATS_THREADS * 8
}
