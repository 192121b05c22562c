//! The RoPE kernels' parameter block and constants, defined once for both sides: the device
//! crate compiles this file as `kernels_gpu::rope::abi`, the host crate mounts it through
//! `#[path]` as `crate::rope::abi`.

/// Everything a RoPE kernel reads. Pointers are device addresses of the element type (`ids`:
/// of the id type, 0 where the row source has none; `k` and `k_out`: 0 without k heads);
/// strides count elements between consecutive token rows.
///
/// The scalar and vector kernels rotate `q` and `k` in place (they ignore the outputs and their
/// strides; the scalar kernels also the strides, sections and form); the general kernels read
/// `q`, `k` and write `q_out`, `k_out`, which are `q` and `k` in place.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Params {
    /// q (or dq), `[tokens, q_heads, head_dim]` token-major or `[B, q_heads, S, head_dim]`.
    pub q: u64,
    /// k (or dk), as q with `k_heads`.
    pub k: u64,
    /// The general kernels' output of q.
    pub q_out: u64,
    /// The general kernels' output of k.
    pub k_out: u64,
    /// The cos table.
    pub cos: u64,
    /// The sin table.
    pub sin: u64,
    /// Position ids, i32 or i64 by the row source.
    pub ids: u64,
    /// Tokens, `B·S`.
    pub tokens: u64,
    /// Positions per sequence.
    pub seq_len: u64,
    /// Heads of q.
    pub q_heads: u64,
    /// Heads of k (0: q alone).
    pub k_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// The rotated dims of a head (even, ≤ `head_dim`).
    pub rotary_dim: u64,
    /// Rows of a gathered table (`ids` index it, clamped).
    pub table_rows: u64,
    /// Elements between token rows of q.
    pub q_stride: u64,
    /// Elements between token rows of k.
    pub k_stride: u64,
    /// Elements between token rows of `q_out`.
    pub q_out_stride: u64,
    /// Elements between token rows of `k_out`.
    pub k_out_stride: u64,
    /// Multimodal tables: the first pair of table 1 and of table 2.
    pub sections: [u32; 2],
    /// Bits of [`form`].
    pub form: u32,
    /// Keeps the block a whole number of 8-byte words.
    pub pad: u32,
}

/// Bits of [`Params::form`].
pub mod form {
    /// Pair `i < rotary_dim/2` is `(x[2i], x[2i + 1])` (GPT-J, candle-nn's `rope_i`)
    /// instead of the NeoX halves `(x[i], x[i + rotary_dim/2])`.
    pub const INTERLEAVED: u32 = 1;
    /// q is `[B, q_heads, S, head_dim]` and k `[B, k_heads, S, head_dim]` (heads before
    /// positions) instead of `[B, S, heads, head_dim]`.
    pub const HEAD_MAJOR: u32 = 2;
    /// cos/sin rows hold `rotary_dim/2` values, one per pair, instead of `rotary_dim`, one
    /// per rotary dim (where pair `i` reads the entry of its first dim: `i`, or `2i`
    /// interleaved).
    pub const HALF_TABLES: u32 = 4;
    /// The output is not the input and `rotary_dim < head_dim`: dims
    /// `rotary_dim..head_dim` are copied from input to output.
    pub const COPY_TAIL: u32 = 8;
}

/// Heads one thread of the vector kernels rotates per step, for elements of `lanes` per
/// 16-byte vector: their `2·vec_heads` loads are all issued before the first result is
/// stored, and the host sizes `blockDim.y = ⌈heads / vec_heads⌉` so that one step usually
/// covers every head of the token. On an H200 (llama shape, 40 heads of 128): 16-bit types
/// 2 (64 registers, 6 blocks of 160 threads per SM) measured +0.5 % over 4 (96 registers,
/// 4 blocks of 160), f32 4 measured +1 % over 2 (whose 16 vectors per half leave 2.5 heads
/// per thread).
pub const fn vec_heads(lanes: usize) -> usize {
    match lanes {
        8 => 2,
        _ => 4,
    }
}
