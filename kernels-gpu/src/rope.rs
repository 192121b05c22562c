//! RoPE forward and backward, NeoX half-split rotation, in place on q and k in one launch
//! (semantics: DESIGN.md §3, host: `src/rope.rs`).
//!
//! q is `[tokens, q_heads, head_dim]` and k `[tokens, k_heads, head_dim]` (tokens = B·S,
//! contiguous). Only the first `rotary_dim` dims of a head rotate: with `half = rotary_dim / 2`,
//! pair `i < half` is `(x[i], x[i + half])`; dims `rotary_dim..head_dim` are never read or
//! written. cos/sin rows are `rotary_dim` long and only their first half is read (HF's tables
//! are `cat(freqs, freqs)`, so `cos[i] == cos[i + half]`).
//!
//! Mapping: the block is 2-D. `threadIdx.y` picks one of the block's `blockDim.y` tokens,
//! tokens walked grid-stride (`token = blockIdx.x·blockDim.y + threadIdx.y`, step
//! `gridDim.x·blockDim.y`). Within a token, `threadIdx.x` strides over the token's
//! `(q_heads + k_heads)·half` pairs: first every q head, then every k head — that is how q and k
//! share one launch. Consecutive threads take consecutive pairs, so loads and stores are
//! coalesced. Each pair is read and written by the same thread (in place is race-free).
//! All offsets are 64-bit; the pair index within a token is 32-bit (the host guarantees
//! `(q_heads + k_heads)·half < 2³¹`).
//!
//! The cos/sin row of a token is chosen by the kernel variant (`ROWS`, see [`rows`]); with
//! position ids the id is clamped into `[0, table_rows)`, so no id can read outside the table.
//!
//! Math in f32, one rounding to the element type per output, no FMA contraction:
//! `o1 = T(x1·c − x2·s)`, `o2 = T(x2·c + x1·s)` with each product rounded to f32. The backward
//! is the same with `s → −s` (exact), i.e. `g1 = dy1·c + dy2·s`, `g2 = dy2·c − dy1·s`.
use crate::{Bf16, Elem, block_idx, grid_dim};
use core::arch::nvptx;

/// Where a token's cos/sin row comes from (the `ROWS` const parameter; the host's kernel-name
/// suffixes `pos`, `batch`, `ids32`, `ids64` map to these in order).
pub mod rows {
    /// `[S, r]` tables shared by the batch: row = token mod seq_len.
    pub const PER_POSITION: u32 = 0;
    /// `[B, S, r]` tables: row = token.
    pub const PER_BATCH: u32 = 1;
    /// `[max_pos, r]` table gathered through i32 position ids `[B, S]` (clamped).
    pub const IDS_I32: u32 = 2;
    /// As [`IDS_I32`] with i64 ids.
    pub const IDS_I64: u32 = 3;
}

#[inline(always)]
fn tid_x() -> usize {
    unsafe { nvptx::_thread_idx_x() as usize }
}

#[inline(always)]
fn tid_y() -> usize {
    unsafe { nvptx::_thread_idx_y() as usize }
}

#[inline(always)]
fn bdim_x() -> usize {
    unsafe { nvptx::_block_dim_x() as usize }
}

#[inline(always)]
fn bdim_y() -> usize {
    unsafe { nvptx::_block_dim_y() as usize }
}

/// A position id clamped into `[0, rows)` (`rows ≥ 1`).
#[inline(always)]
fn clamp_id(id: i64, rows: usize) -> usize {
    if id <= 0 {
        0
    } else if id as u64 >= rows as u64 {
        rows - 1
    } else {
        id as usize
    }
}

/// The cos/sin table row of `token`.
#[inline(always)]
unsafe fn table_row<const ROWS: u32>(
    token: usize,
    seq_len: usize,
    ids: *const u8,
    table_rows: usize,
) -> usize {
    match ROWS {
        rows::PER_POSITION => token % seq_len,
        rows::PER_BATCH => token,
        rows::IDS_I32 => clamp_id(
            unsafe { *(ids as *const i32).add(token) } as i64,
            table_rows,
        ),
        _ => clamp_id(unsafe { *(ids as *const i64).add(token) }, table_rows),
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rotate<T: Elem, const ROWS: u32, const BWD: bool>(
    q: *mut T,
    k: *mut T,
    cos: *const T,
    sin: *const T,
    ids: *const u8,
    tokens: usize,
    seq_len: usize,
    q_heads: usize,
    k_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    table_rows: usize,
) {
    let half = rotary_dim / 2;
    let half32 = half as u32;
    let q_pairs = (q_heads * half) as u32;
    let pairs = q_pairs + (k_heads * half) as u32;
    let (tx, ty) = (bdim_x() as u32, bdim_y());
    let q_token = q_heads * head_dim;
    let k_token = k_heads * head_dim;
    let mut token = block_idx() * ty + tid_y();
    let step = grid_dim() * ty;
    while token < tokens {
        let row = unsafe { table_row::<ROWS>(token, seq_len, ids, table_rows) };
        let cos_row = unsafe { cos.add(row * rotary_dim) };
        let sin_row = unsafe { sin.add(row * rotary_dim) };
        let q_tok = unsafe { q.add(token * q_token) };
        let k_tok = unsafe { k.add(token * k_token) };
        let mut j = tid_x() as u32;
        while j < pairs {
            let (base, jj) = if j < q_pairs {
                (q_tok, j)
            } else {
                (k_tok, j - q_pairs)
            };
            let head = jj / half32;
            let i = (jj - head * half32) as usize;
            let x = unsafe { base.add(head as usize * head_dim + i) };
            let x1 = unsafe { *x }.to_f32();
            let x2 = unsafe { *x.add(half) }.to_f32();
            let c = unsafe { *cos_row.add(i) }.to_f32();
            let s = unsafe { *sin_row.add(i) }.to_f32();
            let s = if BWD { -s } else { s };
            unsafe {
                *x = T::from_f32(x1 * c - x2 * s);
                *x.add(half) = T::from_f32(x2 * c + x1 * s);
            }
            j += tx;
        }
        token += step;
    }
}

macro_rules! rope_kernel {
    ($ty:ty, $name:ident, $rows:expr, $bwd:expr) => {
        /// RoPE for one dtype, direction and cos/sin row source (see the module docs).
        ///
        /// # Safety
        /// `q` holds `tokens × q_heads × head_dim` elements, `k` `tokens × k_heads × head_dim`,
        /// disjoint; `cos`/`sin` hold every row the variant can select (`seq_len`, `tokens` or
        /// `table_rows` rows of `rotary_dim`); `ids` holds `tokens` ids of the variant's
        /// integer type (unused, may be null, for the per-position and per-batch variants).
        /// `2 ≤ rotary_dim ≤ head_dim`, `(q_heads + k_heads)·rotary_dim/2 < 2³¹`.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(
            q: *mut $ty,
            k: *mut $ty,
            cos: *const $ty,
            sin: *const $ty,
            ids: *const u8,
            tokens: u64,
            seq_len: u64,
            q_heads: u64,
            k_heads: u64,
            head_dim: u64,
            rotary_dim: u64,
            table_rows: u64,
        ) {
            unsafe {
                rotate::<$ty, { $rows }, { $bwd }>(
                    q,
                    k,
                    cos,
                    sin,
                    ids,
                    tokens as usize,
                    seq_len as usize,
                    q_heads as usize,
                    k_heads as usize,
                    head_dim as usize,
                    rotary_dim as usize,
                    table_rows as usize,
                )
            }
        }
    };
}

macro_rules! rope_kernels {
    ($ty:ty, $($name:ident: $rows:expr, $bwd:expr;)*) => {
        $(rope_kernel!($ty, $name, $rows, $bwd);)*
    };
}

rope_kernels!(f32,
    rope_fwd_f32_pos: rows::PER_POSITION, false;
    rope_fwd_f32_batch: rows::PER_BATCH, false;
    rope_fwd_f32_ids32: rows::IDS_I32, false;
    rope_fwd_f32_ids64: rows::IDS_I64, false;
    rope_bwd_f32_pos: rows::PER_POSITION, true;
    rope_bwd_f32_batch: rows::PER_BATCH, true;
    rope_bwd_f32_ids32: rows::IDS_I32, true;
    rope_bwd_f32_ids64: rows::IDS_I64, true;
);
rope_kernels!(f16,
    rope_fwd_f16_pos: rows::PER_POSITION, false;
    rope_fwd_f16_batch: rows::PER_BATCH, false;
    rope_fwd_f16_ids32: rows::IDS_I32, false;
    rope_fwd_f16_ids64: rows::IDS_I64, false;
    rope_bwd_f16_pos: rows::PER_POSITION, true;
    rope_bwd_f16_batch: rows::PER_BATCH, true;
    rope_bwd_f16_ids32: rows::IDS_I32, true;
    rope_bwd_f16_ids64: rows::IDS_I64, true;
);
rope_kernels!(Bf16,
    rope_fwd_bf16_pos: rows::PER_POSITION, false;
    rope_fwd_bf16_batch: rows::PER_BATCH, false;
    rope_fwd_bf16_ids32: rows::IDS_I32, false;
    rope_fwd_bf16_ids64: rows::IDS_I64, false;
    rope_bwd_bf16_pos: rows::PER_POSITION, true;
    rope_bwd_bf16_batch: rows::PER_BATCH, true;
    rope_bwd_bf16_ids32: rows::IDS_I32, true;
    rope_bwd_bf16_ids64: rows::IDS_I64, true;
);
