//! The attention kernels' parameter block, defined once for both sides: the device crate
//! compiles this file as `kernels_gpu::attention::abi`, the host crate mounts it through
//! `#[path]` as `crate::attention::abi`. Every attention kernel takes one [`Params`] by value
//! as its only argument, so the host and the device cannot disagree on the order or the type
//! of a field; the host's tests check the size of each entry's parameter in the PTX against
//! `size_of::<Params>()`.

/// One tensor of `[tokens, heads, head_dim]` rows in device memory: its address and its
/// strides in elements. Element `(b, t, h, e)` (batch, token of the sequence, head, element
/// of the head) lies at `ptr + b·batch + (start_b + t)·token + h·head + e`, where `start_b` is
/// the sequence's first token (`cu_seqlens[b]` in a packed batch, else 0).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tensor {
    /// Device address of element 0 (0 where the kernel does not use the tensor).
    pub ptr: u64,
    /// Elements between batches (0 in a packed batch, whose sequences `cu_seqlens` places).
    pub batch: u64,
    /// Elements between consecutive tokens.
    pub token: u64,
    /// Elements between consecutive heads of a token.
    pub head: u64,
}

/// Everything an attention kernel reads: one block for the forward, the backward's
/// preprocessing, its dQ and its dK/dV kernels (each reads the fields it needs).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Params {
    /// Queries `[B, Sq, Hq, d]` (or packed `[total_q, Hq, d]`).
    pub q: Tensor,
    /// Keys `[B, Sk, Hkv, d]`.
    pub k: Tensor,
    /// Values, shaped as the keys.
    pub v: Tensor,
    /// The output, shaped as the queries (the forward writes it, the backward reads it).
    pub o: Tensor,
    /// The output's gradient, shaped as the queries (backward).
    pub d_o: Tensor,
    /// The queries' gradient (backward).
    pub dq: Tensor,
    /// The keys' gradient (backward).
    pub dk: Tensor,
    /// The values' gradient (backward).
    pub dv: Tensor,
    /// f32 log-sum-exp of each query row's scores (natural log): row `(b, h, t)` at
    /// `b·lse_batch + h·lse_head + start_b + t`. Written by the forward, read by the backward.
    pub lse: u64,
    /// f32 `Σ_e dO·O` of each query row (the backward's preprocessing writes it), laid out as
    /// `lse`.
    pub delta: u64,
    /// Elements between batches of `lse` and `delta` (0 in a packed batch).
    pub lse_batch: u64,
    /// Elements between heads of `lse` and `delta`.
    pub lse_head: u64,
    /// i32 `[B + 1]` first query token of each sequence of a packed batch, 0 otherwise.
    pub cu_seqlens_q: u64,
    /// i32 `[B + 1]` first key token of each sequence of a packed batch, 0 otherwise.
    pub cu_seqlens_k: u64,
    /// Sequences.
    pub batch: u32,
    /// Query heads.
    pub heads_q: u32,
    /// Key/value heads (divides `heads_q`: query head `h` reads key/value head
    /// `h / (heads_q / heads_kv)`).
    pub heads_kv: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Query tokens per sequence (the longest, in a packed batch).
    pub seqlen_q: u32,
    /// Key tokens per sequence (the longest, in a packed batch).
    pub seqlen_k: u32,
    /// Query tokens of a packed batch (`cu_seqlens_q` is clamped to it), else 0.
    pub total_q: u32,
    /// Key tokens of a packed batch (`cu_seqlens_k` is clamped to it), else 0.
    pub total_k: u32,
    /// Keys left of the diagonal a query sees, or −1 for all of them.
    pub window_left: i32,
    /// Keys right of the diagonal a query sees, or −1 for all of them (0 when causal).
    pub window_right: i32,
    /// The factor on `q·k` (usually `1/√d`).
    pub scale: f32,
    /// Soft-capping of the scores, `c·tanh(s/c)`, or 0 for none.
    pub softcap: f32,
}

/// Query rows per warpgroup of the tensor-core forward and dQ kernels (16 per warp); a block
/// has one warpgroup, or two in the sm_90a build at head_dim 128 ([`fwd_rows`], [`dq_rows`]).
pub const MMA_ROWS: u32 = 64;
/// Threads per block of every attention kernel but the tensor-core dK/dV kernel.
pub const THREADS: u32 = 128;
/// Query rows per block of the SIMT kernels and of the backward's preprocessing (one warp
/// each); key rows per block of the SIMT dK/dV kernel.
pub const SIMT_ROWS: u32 = THREADS / 32;
/// The largest head_dim of the SIMT kernels (eight elements per lane).
pub const SIMT_MAX_HEAD_DIM: u32 = 256;

/// Key rows per block of the sm_80 build's tensor-core dK/dV kernel, per warpgroup of the
/// sm_90a build's ([`dkdv_keys`]).
pub const MMA_KEYS: u32 = 64;

/// Threads per block of the sm_80 build's tensor-core dK/dV kernel (eight warps: its dK and dV
/// accumulators split over twice the warps of the other kernels, so each holds a quarter of
/// the head).
pub const DKDV_THREADS: u32 = 256;

/// Queries per step of the tensor-core dK/dV kernel: 128 (64 measured 7–11 % slower over the
/// backward at head_dim 128).
pub const DKDV_QUERY_TILE: u32 = 128;

/// Keys per step of the tensor-core forward (the tile of K and V in shared memory): 128 at
/// head_dim 128 in the sm_90a build (`wgmma` m64n128 scores, half the barriers per key), 64
/// elsewhere (at 64 the longer tile measured up to 7 % slower, at three blocks per SM instead
/// of two).
pub const fn fwd_key_tile(sm90: bool, head_dim: u32) -> u32 {
    if sm90 && head_dim > 64 { 128 } else { 64 }
}

/// Keys per step of the tensor-core dQ kernel (its Q and dO tiles stay in shared memory, read
/// by `ldmatrix` at each step, so the registers hold only dQ, S and dP): 32 at head_dim 128
/// (64 spills), 64 at 64.
pub const fn dq_key_tile(head_dim: u32) -> u32 {
    if head_dim > 64 { 32 } else { 64 }
}

/// Bytes of dynamic shared memory of the tensor-core forward at `head_dim` (16-bit elements)
/// in the sm_80 build: the block's Q tile, one K tile and one V tile, and 1 KiB of slack to
/// start them 1024-byte aligned (the period of `wgmma`'s 128-byte swizzle). (Two stages of K and
/// V, one barrier pair per tile, measured 2–3 % slower at head_dim 128 and 17 % at 64 with
/// `mma.sync`, where their registers leave two blocks per SM instead of three.)
pub const fn fwd_shared_bytes(head_dim: u32) -> u32 {
    (MMA_ROWS + 2 * fwd_key_tile(false, head_dim)) * head_dim * 2 + 1024
}

/// Warpgroups (of four warps, 64 rows each) per block of the tensor-core forward, dQ and, in
/// the sm_90a build, dK/dV kernels: two at head_dim 128 in the sm_90a build, sharing each tile
/// they stream (K and V for the forward and dQ, Q and dO for dK/dV), so a tile's bytes cross
/// from L2 once per 128 rows instead of per 64 (the forward with one stage 1–6 % faster on the
/// head_dim 128 rows); one elsewhere (two measured 27–34 % slower on the forward at head_dim
/// 64, whose 64-key tiles are cheap to load).
pub const fn warpgroups(sm90: bool, head_dim: u32) -> u32 {
    if sm90 && head_dim > 64 { 2 } else { 1 }
}

/// Query rows per block of the tensor-core forward.
pub const fn fwd_rows(sm90: bool, head_dim: u32) -> u32 {
    MMA_ROWS * warpgroups(sm90, head_dim)
}

/// Stages of K and V tiles of the tensor-core forward: two where a block has two warpgroups
/// (their registers leave one block per SM, so shared memory is free), the next tile's copies
/// then overlapping the whole current tile under one barrier per tile (3–6 % faster than one
/// stage); one elsewhere.
pub const fn fwd_stages(sm90: bool, head_dim: u32) -> u32 {
    warpgroups(sm90, head_dim)
}

/// As [`fwd_shared_bytes`], in the sm_90a build: each warpgroup's Q tile and each stage's K
/// and V tiles.
pub const fn fwd_shared_bytes_sm90(head_dim: u32) -> u32 {
    (fwd_rows(true, head_dim) + 2 * fwd_stages(true, head_dim) * fwd_key_tile(true, head_dim))
        * head_dim
        * 2
        + 1024
}

/// Bytes of dynamic shared memory of the tensor-core dQ kernel: the block's Q and dO tiles,
/// then two stages of a K and a V tile.
pub const fn dq_shared_bytes(head_dim: u32) -> u32 {
    (2 * MMA_ROWS + 4 * dq_key_tile(head_dim)) * head_dim * 2
}

/// Bytes of one stage of the tensor-core dK/dV kernel: a Q and a dO tile, then the tile's
/// log-sum-exp (log2 units) and delta values (f32).
pub const fn dkdv_stage_bytes(head_dim: u32) -> u32 {
    DKDV_QUERY_TILE * (2 * head_dim * 2 + 2 * 4)
}

/// Bytes of dynamic shared memory of the tensor-core dK/dV kernel: the block's K and V tiles,
/// the step's P and dS tiles (keys × queries, 16-bit) and two stages ([`dkdv_stage_bytes`]).
pub const fn dkdv_shared_bytes(head_dim: u32) -> u32 {
    2 * MMA_KEYS * head_dim * 2
        + 2 * MMA_KEYS * DKDV_QUERY_TILE * 2
        + 2 * dkdv_stage_bytes(head_dim)
}

/// Query rows per block of the tensor-core dQ kernel.
pub const fn dq_rows(sm90: bool, head_dim: u32) -> u32 {
    MMA_ROWS * warpgroups(sm90, head_dim)
}

/// Threads per block of the tensor-core dQ kernel.
pub const fn dq_threads(sm90: bool, head_dim: u32) -> u32 {
    THREADS * warpgroups(sm90, head_dim)
}

/// Stages of K and V tiles of the sm_90a build's dQ kernel: three, so a step's last product
/// (`dQ += dS·K`, reading the step's K tile) can run on under the next step's barrier and
/// first products; the copy after that barrier overwrites the stage of the step before last.
pub const DQ_STAGES_SM90: u32 = 3;

/// Bytes of dynamic shared memory of the sm_90a build's dQ kernel (`wgmma`, 64 keys per
/// step): each warpgroup's Q and dO tiles, [`DQ_STAGES_SM90`] stages of a K and a V tile, and
/// 1 KiB of slack to start them 1024-byte aligned.
pub const fn dq_shared_bytes_sm90(head_dim: u32) -> u32 {
    (2 * dq_rows(true, head_dim) + 2 * DQ_STAGES_SM90 * MMA_ROWS) * head_dim * 2 + 1024
}

/// Bytes of one stage of the sm_90a build's dK/dV kernel: a Q and a dO tile of [`MMA_ROWS`]
/// queries, then their log-sum-exp (log2 units) and delta values (f32), padded to keep the
/// next stage 1024-byte aligned.
pub const fn dkdv_stage_bytes_sm90(head_dim: u32) -> u32 {
    2 * MMA_ROWS * head_dim * 2 + 1024
}

/// Key rows per block of the tensor-core dK/dV kernel.
pub const fn dkdv_keys(sm90: bool, head_dim: u32) -> u32 {
    MMA_KEYS * warpgroups(sm90, head_dim)
}

/// Threads per block of the tensor-core dK/dV kernel.
pub const fn dkdv_threads(sm90: bool, head_dim: u32) -> u32 {
    if sm90 {
        THREADS * warpgroups(true, head_dim)
    } else {
        DKDV_THREADS
    }
}

/// Stages of Q and dO tiles of the sm_90a build's dK/dV kernel: three, so a step's last
/// product (`dK += dSᵀ·Q`, reading the step's Q tile) can run on under the next step's
/// barrier and first product; the copy after that barrier overwrites the stage of the step
/// before last.
pub const DKDV_STAGES_SM90: u32 = 3;

/// Bytes of dynamic shared memory of the sm_90a build's dK/dV kernel (`wgmma`, 64-query
/// steps): each warpgroup's K and V tiles, [`DKDV_STAGES_SM90`] stages
/// ([`dkdv_stage_bytes_sm90`]) and 1 KiB of alignment slack.
pub const fn dkdv_shared_bytes_sm90(head_dim: u32) -> u32 {
    2 * dkdv_keys(true, head_dim) * head_dim * 2
        + DKDV_STAGES_SM90 * dkdv_stage_bytes_sm90(head_dim)
        + 1024
}
