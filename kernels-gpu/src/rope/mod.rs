//! RoPE forward and backward on q and k in one launch: the NeoX half-split rotation in place
//! (scalar and vector kernels), and the general kernels' other forms (host: `src/rope/`; every entry takes one [`abi::Params`] block).
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
//! Vector paths (see [`rotate_vec`]): in place, 16-byte loads and stores when every head half,
//! table row and multimodal section is whole vectors. `rope_{fwd,bwd}_v_*`: contiguous NeoX
//! halves, full-width tables; `_va_` (NeoX) and `_vi_` (interleaved pairs): token rows any
//! stride apart (fused QKV views), half-width tables and every row source, multimodal
//! included. Same math, bit for bit.
//!
//! General path (`rope_{fwd,bwd}_g_*`, see [`rotate_any`]): the scalar mapping with separate
//! inputs and outputs (in place when they are the same buffers), and the forms that [`flags`]
//! select: interleaved pairs, head-major q and k, half-width cos/sin rows; token rows any
//! stride apart (q and k as views into a fused QKV buffer), and Qwen2-VL's multimodal rows
//! ([`multimodal_rows`]). Same math.
//!
//! Math in f32, one rounding to the element type per output, no FMA contraction:
//! `o1 = T(x1·c − x2·s)`, `o2 = T(x2·c + x1·s)` with each product rounded to f32. The backward
//! is the same with `s → −s` (exact), i.e. `g1 = dy1·c + dy2·s`, `g2 = dy2·c − dy1·s`.
pub mod abi;

use crate::identity::{Pass, Rows, kernel_name};
use crate::{
    Elem, V16, Vector, block_dim, block_dim_y, block_dim_z, block_idx, elem_type, grid_dim, lanes,
    thread_idx, thread_idx_y, thread_idx_z, unroll,
};
use abi::{Params, form as flags};

/// The cos/sin row sources of [`Rows`] as the `ROWS` const parameter.
pub mod rows {
    use crate::identity::Rows;
    /// [`Rows::PerPosition`].
    pub const PER_POSITION: u32 = Rows::PerPosition as u32;
    /// [`Rows::PerBatch`].
    pub const PER_BATCH: u32 = Rows::PerBatch as u32;
    /// [`Rows::IdsI32`].
    pub const IDS_I32: u32 = Rows::IdsI32 as u32;
    /// [`Rows::IdsI64`].
    pub const IDS_I64: u32 = Rows::IdsI64 as u32;
    /// [`Rows::Multimodal`].
    pub const MULTIMODAL: u32 = Rows::Multimodal as u32;
    /// [`Rows::MultimodalIdsI32`].
    pub const MULTIMODAL_IDS_I32: u32 = Rows::MultimodalIdsI32 as u32;
    /// [`Rows::MultimodalIdsI64`].
    pub const MULTIMODAL_IDS_I64: u32 = Rows::MultimodalIdsI64 as u32;

    /// Whether `rows` picks a row per pair by its frequency section (Qwen2-VL).
    pub const fn multimodal(rows: u32) -> bool {
        matches!(rows, MULTIMODAL | MULTIMODAL_IDS_I32 | MULTIMODAL_IDS_I64)
    }
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

/// What every RoPE kernel takes besides its q and k buffers of `T` (and the general kernels'
/// outputs and form): the cos/sin tables of `C` (`T`, or f32 with 16-bit q and k), the
/// position ids and the sizes, as one value so that the scalar, vector and general bodies share
/// their entry points' conversions.
#[derive(Clone, Copy)]
struct Args<C> {
    cos: *const C,
    sin: *const C,
    ids: *const u8,
    tokens: usize,
    seq_len: usize,
    q_heads: usize,
    k_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    table_rows: usize,
}

impl<C> Args<C> {
    /// The tables, ids and sizes of a parameter block.
    #[inline(always)]
    fn of(p: &Params) -> Self {
        Args {
            cos: p.cos as *const C,
            sin: p.sin as *const C,
            ids: p.ids as *const u8,
            tokens: p.tokens as usize,
            seq_len: p.seq_len as usize,
            q_heads: p.q_heads as usize,
            k_heads: p.k_heads as usize,
            head_dim: p.head_dim as usize,
            rotary_dim: p.rotary_dim as usize,
            table_rows: p.table_rows as usize,
        }
    }
}

/// The t, h and w cos/sin table rows of `token` for the multimodal variants of the general
/// kernels: rows `token`, `tokens + token` and `2·tokens + token` of the three stacked tables,
/// or the rows that the three id rows `[3, tokens]` name, clamped into `[0, table_rows)`.
#[inline(always)]
unsafe fn multimodal_rows<C, const ROWS: u32>(token: usize, a: &Args<C>) -> [usize; 3] {
    let id = |k: usize| match ROWS {
        rows::MULTIMODAL_IDS_I32 => {
            let id = unsafe { *(a.ids as *const i32).add(k * a.tokens + token) };
            clamp_id(id as i64, a.table_rows)
        }
        rows::MULTIMODAL_IDS_I64 => {
            let id = unsafe { *(a.ids as *const i64).add(k * a.tokens + token) };
            clamp_id(id, a.table_rows)
        }
        _ => k * a.tokens + token,
    };
    [id(0), id(1), id(2)]
}

/// The cos/sin table row of `token`.
#[inline(always)]
unsafe fn table_row<C, const ROWS: u32>(token: usize, a: &Args<C>) -> usize {
    match ROWS {
        rows::PER_POSITION => token % a.seq_len,
        rows::PER_BATCH => token,
        rows::IDS_I32 => clamp_id(
            unsafe { *(a.ids as *const i32).add(token) } as i64,
            a.table_rows,
        ),
        _ => clamp_id(unsafe { *(a.ids as *const i64).add(token) }, a.table_rows),
    }
}

#[inline(always)]
unsafe fn rotate<T: Elem, C: Elem, const ROWS: u32, const BWD: bool>(
    q: *mut T,
    k: *mut T,
    a: Args<C>,
) {
    let half = a.rotary_dim / 2;
    let half32 = half as u32;
    let q_pairs = (a.q_heads * half) as u32;
    let pairs = q_pairs + (a.k_heads * half) as u32;
    let (tx, ty) = (block_dim() as u32, block_dim_y());
    let q_token = a.q_heads * a.head_dim;
    let k_token = a.k_heads * a.head_dim;
    let mut token = block_idx() * ty + thread_idx_y();
    let step = grid_dim() * ty;
    while token < a.tokens {
        let row = unsafe { table_row::<C, ROWS>(token, &a) };
        let cos_row = unsafe { a.cos.add(row * a.rotary_dim) };
        let sin_row = unsafe { a.sin.add(row * a.rotary_dim) };
        let q_tok = unsafe { q.add(token * q_token) };
        let k_tok = unsafe { k.add(token * k_token) };
        let mut j = thread_idx() as u32;
        while j < pairs {
            let (base, jj) = if j < q_pairs {
                (q_tok, j)
            } else {
                (k_tok, j - q_pairs)
            };
            let head = jj / half32;
            let i = (jj - head * half32) as usize;
            let x = unsafe { base.add(head as usize * a.head_dim + i) };
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

/// Elements between consecutive tokens' rows of q, k, q_out and k_out on the general path
/// (token-major layouts only: head-major q and k ignore them).
#[derive(Clone, Copy)]
struct Strides {
    q: usize,
    k: usize,
    q_out: usize,
    k_out: usize,
}

/// The general path: the scalar mapping of [`rotate`] (a 2-D block, `threadIdx.y` a token,
/// `threadIdx.x` striding over the token's work items, q heads first, then k heads), reading
/// from `q`, `k` and writing to `q_out`, `k_out` (the same pointers and strides for in place:
/// each element is read and written by one thread). A head has `rotary_dim/2` pairs, then,
/// with [`flags::COPY_TAIL`], its `head_dim − rotary_dim` tail dims as items that copy one
/// element. Token `t`'s row of q starts at `t·strides.q` (and so on for each buffer), so q and
/// k may be views into a fused QKV buffer. With the multimodal rows ([`multimodal_rows`]) pair
/// `i` takes the token's t, h or w row for `i < sections[0]`, `i < sections[1]`, else.
/// `k_heads = 0` rotates q alone (`k`, `k_out` unused). The host guarantees
/// `(q_heads + k_heads)·head_dim < 2³¹` (32-bit item indices); offsets are 64-bit.
#[inline(always)]
unsafe fn rotate_any<T: Elem, C: Elem, const ROWS: u32, const BWD: bool>(
    q: *const T,
    k: *const T,
    q_out: *mut T,
    k_out: *mut T,
    a: Args<C>,
    strides: Strides,
    sections: [u32; 2],
    form: u32,
) {
    let Args {
        cos,
        sin,
        tokens,
        seq_len,
        q_heads,
        k_heads,
        head_dim,
        rotary_dim,
        ..
    } = a;
    let half = rotary_dim / 2;
    let interleaved = form & flags::INTERLEAVED != 0;
    let head_major = form & flags::HEAD_MAJOR != 0;
    // Row length and the table entry of pair `i` (`i·cs_step`).
    let (row_len, cs_step) = if form & flags::HALF_TABLES != 0 {
        (half, 1)
    } else if interleaved {
        (rotary_dim, 2)
    } else {
        (rotary_dim, 1)
    };
    let tail = if form & flags::COPY_TAIL != 0 {
        head_dim - rotary_dim
    } else {
        0
    };
    let per_head = (half + tail) as u32;
    let q_items = q_heads as u32 * per_head;
    let items = q_items + k_heads as u32 * per_head;
    let (tx, ty) = (block_dim() as u32, block_dim_y());
    let mut token = block_idx() * ty + thread_idx_y();
    let step = grid_dim() * ty;
    while token < tokens {
        // The token's row, or its t, h and w rows (the first of them for `cos_row`).
        let [r_t, r_h, r_w] = if rows::multimodal(ROWS) {
            unsafe { multimodal_rows::<C, ROWS>(token, &a) }
        } else {
            let row = unsafe { table_row::<C, ROWS>(token, &a) };
            [row, row, row]
        };
        let cos_row = unsafe { cos.add(r_t * row_len) };
        let sin_row = unsafe { sin.add(r_t * row_len) };
        // Offsets of head 0 of this token in q, k, q_out and k_out, and the distance between
        // heads.
        let (q_tok, k_tok, q_out_tok, k_out_tok, head_stride) = if head_major {
            let b = token / seq_len;
            let s = token - b * seq_len;
            let q_tok = (b * q_heads * seq_len + s) * head_dim;
            let k_tok = (b * k_heads * seq_len + s) * head_dim;
            (q_tok, k_tok, q_tok, k_tok, seq_len * head_dim)
        } else {
            (
                token * strides.q,
                token * strides.k,
                token * strides.q_out,
                token * strides.k_out,
                head_dim,
            )
        };
        let mut j = thread_idx() as u32;
        while j < items {
            let (src, dst, jj, tok, out_tok) = if j < q_items {
                (q, q_out, j, q_tok, q_out_tok)
            } else {
                (k, k_out, j - q_items, k_tok, k_out_tok)
            };
            let head = jj / per_head;
            let e = (jj - head * per_head) as usize;
            let at = head as usize * head_stride;
            let (x, y) = unsafe { (src.add(tok + at), dst.add(out_tok + at)) };
            if e < half {
                let (o1, o2) = if interleaved {
                    (2 * e, 2 * e + 1)
                } else {
                    (e, e + half)
                };
                // A multimodal pair reads the row its frequency's section names (selected,
                // not indexed: an indexed local array would live in local memory).
                let (cos_row, sin_row) = if rows::multimodal(ROWS) {
                    let row = if e as u32 >= sections[1] {
                        r_w
                    } else if e as u32 >= sections[0] {
                        r_h
                    } else {
                        r_t
                    };
                    unsafe { (cos.add(row * row_len), sin.add(row * row_len)) }
                } else {
                    (cos_row, sin_row)
                };
                let x1 = unsafe { *x.add(o1) }.to_f32();
                let x2 = unsafe { *x.add(o2) }.to_f32();
                let c = unsafe { *cos_row.add(e * cs_step) }.to_f32();
                let s = unsafe { *sin_row.add(e * cs_step) }.to_f32();
                let s = if BWD { -s } else { s };
                unsafe {
                    *y.add(o1) = T::from_f32(x1 * c - x2 * s);
                    *y.add(o2) = T::from_f32(x2 * c + x1 * s);
                }
            } else {
                let o = rotary_dim + (e - half);
                unsafe { *y.add(o) = *x.add(o) };
            }
            j += tx;
        }
        token += step;
    }
}

/// Heads one thread of the vector path rotates per step (see [`abi::vec_heads`]).
pub use abi::vec_heads;

/// The most heads per step of any type (the length of the per-step arrays).
const MAX_VEC_HEADS: usize = 4;

/// `v`, hidden from the optimiser: a value it cannot reason about.
#[inline(always)]
fn opaque(v: u32) -> u32 {
    let o: u32;
    // SAFETY: a register move.
    unsafe {
        core::arch::asm!("mov.b32 {o}, {v};", o = out(reg32) o, v = in(reg32) v,
             options(pure, nomem, nostack))
    };
    o
}

/// [`opaque`] on each word.
#[inline(always)]
fn opaque_v(v: V16) -> V16 {
    V16 {
        a: opaque(v.a),
        b: opaque(v.b),
        c: opaque(v.c),
        d: opaque(v.d),
    }
}

/// Position id of `token` in id row `table` (0, or t/h/w of the multimodal ids) for the
/// gathered variants (0 past the end and for the others).
#[inline(always)]
unsafe fn raw_id<const ROWS: u32>(
    ids: *const u8,
    token: usize,
    tokens: usize,
    table: usize,
) -> i64 {
    let at = table * tokens + token;
    match ROWS {
        _ if token >= tokens => 0,
        rows::IDS_I32 | rows::MULTIMODAL_IDS_I32 => {
            (unsafe { *(ids as *const i32).add(at) }) as i64
        }
        rows::IDS_I64 | rows::MULTIMODAL_IDS_I64 => unsafe { *(ids as *const i64).add(at) },
        _ => 0,
    }
}

/// The even lanes of `lo`, then those of `hi`, bit for bit: the entries pairs read from two
/// consecutive vectors of a full-width interleaved table row (pair `i` reads `cos[2i]`).
#[inline(always)]
fn even_lanes<T: Elem>(lo: V16, hi: V16) -> V16 {
    if T::PER_WORD == 1 {
        V16 {
            a: lo.a,
            b: lo.c,
            c: hi.a,
            d: hi.c,
        }
    } else {
        let two = |x: u32, y: u32| (x & 0xffff) | (y << 16);
        V16 {
            a: two(lo.a, lo.b),
            b: two(lo.c, lo.d),
            c: two(hi.a, hi.b),
            d: two(hi.c, hi.d),
        }
    }
}

/// The vector path, in place on token-major q and k: NeoX halves, or interleaved pairs with
/// `INTERLEAVED`; with `ANY`, token rows `strides` elements apart (views into a fused QKV
/// buffer), full-width or half-width ([`flags::HALF_TABLES`]) cos/sin rows and every row
/// source, multimodal included; without, contiguous rows, full-width tables and no multimodal
/// rows (`strides` and `form` unused). Without `ANY` the offsets take fewer registers: bf16
/// NeoX 64 against 70, 6 resident blocks of the llama shape per SM against 5, which measured
/// 87.7 against 90.4 µs (PERFORMANCE.md, "RoPE"). Requires (host-checked) 16-byte aligned `q`, `k`, `cos`, `sin`;
/// `head_dim`, `half = rotary_dim / 2`, both strides and, multimodal, both section starts
/// multiples of `T::LANES`, so every half of every head, every cos/sin row and every section is
/// made of whole aligned [`V16`]s; `half / T::LANES ≤ blockDim.x` (one vector per thread, no
/// loop); each token's rows within 2³¹ elements (32-bit in-token offsets; token offsets are
/// 64-bit).
///
/// Mapping: a 3-D block. `threadIdx.z` picks one of the block's `blockDim.z` tokens, tokens
/// walked grid-stride (`token = blockIdx.x·blockDim.z + threadIdx.z`). `threadIdx.x` = `v` owns
/// pairs `v·LANES .. (v+1)·LANES` of every head: NeoX, vector `v` of each half; interleaved,
/// vectors `2v` and `2v + 1` of the head. It loads their cos/sin once per token (the row of
/// their section, multimodal) and reuses them for every head it rotates. `threadIdx.y` picks
/// heads `y, y + blockDim.y, …` of the token's `q_heads + k_heads` (q heads first, then k
/// heads: q and k share the launch), [`vec_heads`] per step with all their loads in flight
/// before the first store. Consecutive threads (x fastest, then y) touch consecutive 16-byte
/// vectors of a head, so a warp's accesses cover whole contiguous segments. No division in
/// the loops (the per-position row follows the token incrementally).
#[inline(always)]
unsafe fn rotate_vec<
    T: Elem,
    C: Elem,
    const ROWS: u32,
    const BWD: bool,
    const INTERLEAVED: bool,
    const ANY: bool,
>(
    q: *mut T,
    k: *mut T,
    a: Args<C>,
    strides: [usize; 2],
    sections: [u32; 2],
    form: u32,
) {
    // Everything below counts 16-byte vectors; in-token offsets are u32 (host-checked).
    let vph = (a.rotary_dim / 2 / T::LANES) as u32;
    let vh = vec_heads(T::LANES);
    let head_vecs = (a.head_dim / T::LANES) as u32;
    let (q_heads32, heads) = (a.q_heads as u32, (a.q_heads + a.k_heads) as u32);
    let v = thread_idx() as u32;
    if v >= vph {
        return;
    }
    // The thread's first vector of a head, and the distance to its second.
    let (first, second) = if INTERLEAVED {
        (2 * v as usize, 1)
    } else {
        (v as usize, vph as usize)
    };
    // cos/sin: vectors per row, and the thread's vector in the row: vector `v` of a row of
    // one entry per pair (the first half of a NeoX row, or a half-width row); the even lanes
    // of vectors `2v` and `2v + 1` of a full-width interleaved row.
    let half_tables = ANY && form & flags::HALF_TABLES != 0;
    let wide = INTERLEAVED && !half_tables;
    let row_vecs = if half_tables {
        vph as usize
    } else {
        2 * vph as usize
    };
    let table_vec = if wide { 2 * v } else { v } as usize;
    // Table vectors per q/k vector: 1, or 2 for f32 tables with 16-bit q and k (row and
    // vector indices above count q/k-sized vectors; `w·` turns them into table vectors).
    let w = T::LANES / C::LANES;
    // The multimodal table (t, h or w) of the thread's pairs: their section's.
    let table = match rows::multimodal(ROWS) {
        true if v * T::LANES as u32 >= sections[1] => 2,
        true if v * T::LANES as u32 >= sections[0] => 1,
        _ => 0,
    };
    let by = block_dim_y() as u32;
    let (q, k) = (q as *mut V16, k as *mut V16);
    let (q_stride, k_stride) = match ANY {
        true => (strides[0] / T::LANES, strides[1] / T::LANES),
        false => (
            a.q_heads * head_vecs as usize,
            a.k_heads * head_vecs as usize,
        ),
    };
    let (cos, sin) = (a.cos as *const V16, a.sin as *const V16);
    let bz = block_dim_z();
    let mut token = block_idx() * bz + thread_idx_z();
    let step = grid_dim() * bz;
    // Per-position row (token mod seq_len), advanced without a division per token.
    let (mut pos, pos_step) = if ROWS == rows::PER_POSITION {
        (token % a.seq_len, step % a.seq_len)
    } else {
        (0, 0)
    };
    // Gathered rows: the next token's id is loaded one iteration ahead (and clamped only when
    // used), so the cos/sin loads never wait for it.
    let mut id = unsafe { raw_id::<ROWS>(a.ids, token, a.tokens, table) };
    while token < a.tokens {
        let row = match ROWS {
            rows::PER_POSITION => pos,
            rows::PER_BATCH => token,
            rows::MULTIMODAL => table * a.tokens + token,
            _ => clamp_id(id, a.table_rows),
        };
        id = unsafe { raw_id::<ROWS>(a.ids, token + step, a.tokens, table) };
        let at = w * (row * row_vecs + table_vec);
        // The thread's pairs' entries: lane `i` of the pairs is lane `i mod C::LANES` of
        // table vector `i / C::LANES`.
        let (mut c, mut s) = ([V16::ZERO; 2], [V16::ZERO; 2]);
        unroll::<2>(|j| {
            if j >= w {
                return;
            }
            unsafe {
                if wide {
                    let at = at + 2 * j;
                    c[j] = even_lanes::<C>(V16::load(cos.add(at)), V16::load(cos.add(at + 1)));
                    s[j] = even_lanes::<C>(V16::load(sin.add(at)), V16::load(sin.add(at + 1)));
                } else {
                    c[j] = V16::load(cos.add(at + j));
                    s[j] = V16::load(sin.add(at + j));
                }
            }
        });
        // Head h of the token starts at `base + h·head_vecs`, base = q_tok for q heads and
        // k_tok − q_heads·head_vecs for k heads (so the k base needs no subtraction per head).
        let q_tok = unsafe { q.add(token * q_stride + first) };
        let k_tok =
            unsafe { k.add(token * k_stride + first) }.wrapping_sub(a.q_heads * head_vecs as usize);
        let mut h0 = thread_idx_y() as u32;
        while h0 < heads {
            // All `2·vh` loads are issued before any math, so their latencies overlap:
            // - every load is unconditional: a head past the last one re-reads this thread's
            //   own head `h0` (live, written only later by this same thread: no race) and is
            //   not stored. Predicated loads into zeroed registers let ptxas schedule the
            //   first head's math between the loads;
            // - `live` is computed from an opaque copy of `heads`, so head 0's math (otherwise
            //   known live) stays in its own block after the loads; in the same block ptxas
            //   interleaves it with the other heads' loads, which then wait for head 0's.
            let mut live = [false; MAX_VEC_HEADS];
            let mut at = [core::ptr::null_mut::<V16>(); MAX_VEC_HEADS];
            let mut x1 = [V16::ZERO; MAX_VEC_HEADS];
            let mut x2 = [V16::ZERO; MAX_VEC_HEADS];
            unroll::<MAX_VEC_HEADS>(|j| {
                if j >= vh {
                    return;
                }
                let h = h0 + j as u32 * by;
                live[j] = h < opaque(heads);
                let h = if h < heads { h } else { h0 };
                let base = if h < q_heads32 { q_tok } else { k_tok };
                at[j] = base.wrapping_add((h * head_vecs) as usize);
                x1[j] = unsafe { V16::load(at[j]) };
                x2[j] = unsafe { V16::load(at[j].add(second)) };
            });
            unroll::<MAX_VEC_HEADS>(|j| {
                // cos/sin stay packed across heads and are widened per head (one shift or
                // mask per lane): hoisted, their widened lanes took 16 registers for the
                // whole loop (bf16 106 → 96 registers: 4 blocks per SM instead of 3, +2 %).
                let (mut cw, mut sw) = (c, s);
                unroll::<2>(|j| {
                    if j < w {
                        (cw[j], sw[j]) = (opaque_v(c[j]), opaque_v(s[j]));
                    }
                });
                if live[j] {
                    // Lane `e` of the head's two vectors (x1 then x2), and the outputs.
                    let x = |e: usize| match e < T::LANES {
                        true => T::lane(&x1[j], e),
                        false => T::lane(&x2[j], e - T::LANES),
                    };
                    let (mut o1, mut o2) = ([0.0f32; 8], [0.0f32; 8]);
                    lanes::<T, V16>(|i| {
                        // Pair i: lanes i of both vectors (NeoX), or lanes 2i and 2i + 1.
                        let (e1, e2) = if INTERLEAVED {
                            (2 * i, 2 * i + 1)
                        } else {
                            (i, i + T::LANES)
                        };
                        let (p, r) = (x(e1), x(e2));
                        let cc = C::lane(&cw[i / C::LANES], i % C::LANES);
                        let ss = C::lane(&sw[i / C::LANES], i % C::LANES);
                        let ss = if BWD { -ss } else { ss };
                        let (y1, y2) = (p * cc - r * ss, r * cc + p * ss);
                        if e1 < T::LANES {
                            o1[e1] = y1;
                        } else {
                            o2[e1 - T::LANES] = y1;
                        }
                        if e2 < T::LANES {
                            o1[e2] = y2;
                        } else {
                            o2[e2 - T::LANES] = y2;
                        }
                    });
                    unsafe {
                        T::pack::<V16>(&o1).store(at[j]);
                        T::pack::<V16>(&o2).store(at[j].add(second));
                    }
                }
            });
            h0 += vh as u32 * by;
        }
        token += step;
        if ROWS == rows::PER_POSITION {
            pos += pos_step;
            if pos >= a.seq_len {
                pos -= a.seq_len;
            }
        }
    }
}

/// The cos/sin element type of an entry: q's (`$elem` alone), or `F32`'s.
macro_rules! table_type {
    ($elem:ident) => {
        elem_type!($elem)
    };
    ($elem:ident / F32) => {
        f32
    };
}

/// One RoPE entry point: one [`Params`] block by value (`ld.param` loads, no local copy),
/// handed to `$body` (its const generics after the element and table types, row source and
/// direction: `$generic`) as the path's pointers, [`Args`] and `$pass` (made of `p`). `$elem /
/// F32` is the entry of f32 cos/sin tables with q and k of `$elem`.
macro_rules! rope_entry {
    (
        $(#[$doc:meta])*
        $body:ident [$($generic:expr),*], $path:ident, $elem:ident $(/ $table:ident)?,
        $rows:ident, $dir:ident, |$p:ident| ($($pass:expr),*)
    ) => {
        const _: () = {
            $(#[$doc])*
            #[unsafe(export_name = kernel_name!(Rope, $dir, $path, $elem, $rows $(, $table)?))]
            // A `#[repr(C)]` struct of integers: the PTX parameter is its bytes.
            #[allow(improper_gpu_kernel_arg)]
            pub unsafe extern "gpu-kernel" fn kernel($p: Params) {
                unsafe {
                    $body::<
                        elem_type!($elem),
                        table_type!($elem $(/ $table)?),
                        { Rows::$rows as u32 },
                        { matches!(Pass::$dir, Pass::Backward) }
                        $(, $generic)*
                    >($($pass),*)
                }
            }
        };
    };
}

/// The scalar kernels ([`rotate`]): in-place NeoX halves, contiguous, of one element type,
/// cos/sin row source and direction.
macro_rules! rope_kernel {
    ($elem:ident, $rows:ident, $dir:ident) => {
        rope_entry!(
            /// RoPE for one dtype, direction and cos/sin row source (see the module docs).
            ///
            /// # Safety
            /// `p.q` holds `tokens × q_heads × head_dim` elements, `p.k` `tokens × k_heads ×
            /// head_dim`, disjoint; `cos`/`sin` hold every row the variant can select
            /// (`seq_len`, `tokens` or `table_rows` rows of `rotary_dim`); `ids` holds `tokens`
            /// ids of the variant's integer type (unused, may be 0, for the per-position and
            /// per-batch variants). `2 ≤ rotary_dim ≤ head_dim`,
            /// `(q_heads + k_heads)·rotary_dim/2 < 2³¹`.
            rotate [], Scalar, $elem, $rows, $dir,
            |p| (p.q as *mut _, p.k as *mut _, Args::of(&p))
        );
    };
}

/// The vector kernels ([`rotate_vec`]) of one pair layout and generality (`$interleaved`,
/// `$any`), element type, cos/sin row source and direction.
macro_rules! rope_vector_kernel {
    (
        $elem:ident $(/ $table:ident)?, $path:ident, $interleaved:expr, $any:expr, $rows:ident,
        $dir:ident
    ) => {
        rope_entry!(
            /// RoPE for one dtype, direction, pair layout and cos/sin row source on the vector
            /// path ([`rotate_vec`]): in place, token-major rows `q_stride` and `k_stride`
            /// elements apart, cos/sin rows as `form` says ([`flags::HALF_TABLES`]; its other
            /// bits are ignored); the `_v_` kernels take contiguous rows (the strides equal to
            /// them) and full-width tables alone.
            ///
            /// # Safety
            /// `p.q` holds `tokens` rows of `q_heads × head_dim` elements `q_stride` apart, `p.k`
            /// `tokens` rows of `k_heads × head_dim` `k_stride` apart, no element in both;
            /// `cos`/`sin` hold every row the variant can select (`seq_len`, `tokens`,
            /// `table_rows` or, multimodal, `3·tokens` rows, of `rotary_dim` or, half-width,
            /// `rotary_dim/2`); `ids` holds `tokens` ids of the variant's integer type
            /// (`3·tokens` multimodal; unused, may be 0, for the others); multimodal
            /// `sections` holds the first pair of table 1 and of table 2. `2 ≤ rotary_dim ≤
            /// head_dim`, `seq_len ≥ 1`, and the alignment and divisibility listed at
            /// [`rotate_vec`].
            rotate_vec [$interleaved, $any], $path, $elem $(/ $table)?, $rows, $dir,
            |p| (
                p.q as *mut _,
                p.k as *mut _,
                Args::of(&p),
                [p.q_stride as usize, p.k_stride as usize],
                p.sections,
                p.form
            )
        );
    };
}

/// The general kernel ([`rotate_any`]) of one element type, cos/sin row source and direction.
macro_rules! rope_general_kernel {
    ($elem:ident $(/ $table:ident)?, $rows:ident, $dir:ident) => {
        rope_entry!(
            /// RoPE for one dtype, direction and cos/sin row source on the general path
            /// ([`rotate_any`]): out of place or in place, in the forms `form` selects
            /// ([`flags`]), token rows `*_stride` elements apart (token-major layouts).
            ///
            /// # Safety
            /// `q`/`q_out` hold `tokens` rows of `q_heads × head_dim` elements and `k`/`k_out`
            /// `tokens` rows of `k_heads × head_dim` (none and unused when `k_heads = 0`) in
            /// the layout `form` names, token-major rows `q_stride`, `k_stride`, `q_out_stride`,
            /// `k_out_stride` elements apart (each ≥ its row); the rows each thread writes are
            /// read by no other thread (each output is its input with the same stride, or
            /// disjoint from every buffer; the outputs are disjoint). `cos`/`sin` hold every
            /// row the variant can select (`seq_len`, `tokens`, `table_rows` or, multimodal,
            /// `3·tokens` rows of `rotary_dim`, or `rotary_dim/2` with [`flags::HALF_TABLES`]);
            /// `ids` as for the other kernels (`3·tokens` ids for the multimodal ones);
            /// multimodal `sections` holds the first pair of table 1 and of table 2. `2 ≤
            /// rotary_dim ≤ head_dim`, both even, `seq_len ≥ 1`, `(q_heads + k_heads)·head_dim
            /// < 2³¹`; [`flags::COPY_TAIL`] only out of place.
            rotate_any [], General, $elem $(/ $table)?, $rows, $dir,
            |p| (
                p.q as *const _,
                p.k as *const _,
                p.q_out as *mut _,
                p.k_out as *mut _,
                Args::of(&p),
                Strides {
                    q: p.q_stride as usize,
                    k: p.k_stride as usize,
                    q_out: p.q_out_stride as usize,
                    k_out: p.k_out_stride as usize,
                },
                p.sections,
                p.form
            )
        );
    };
}

/// Every RoPE kernel of one element type: each direction and cos/sin row source on every
/// path, but multimodal rows only on the NeoX vector path of any strides (`_va_`, which the
/// host gives them with contiguous full-width NeoX calls) and the general path. `$elem / F32`:
/// the kernels of f32 tables with 16-bit q and k, on every path but the scalar one (the host
/// gives its calls to the general path).
macro_rules! rope_kernels {
    ($elem:ident $(/ $table:ident)?) => {
        rope_kernels!(@rows $elem $(/ $table)?, Forward);
        rope_kernels!(@rows $elem $(/ $table)?, Backward);
    };
    (@rows $elem:ident $(/ $table:ident)?, $dir:ident) => {
        rope_kernels!(@paths $elem $(/ $table)?, $dir, PerPosition);
        rope_kernels!(@paths $elem $(/ $table)?, $dir, PerBatch);
        rope_kernels!(@paths $elem $(/ $table)?, $dir, IdsI32);
        rope_kernels!(@paths $elem $(/ $table)?, $dir, IdsI64);
        rope_kernels!(@multimodal $elem $(/ $table)?, $dir, Multimodal);
        rope_kernels!(@multimodal $elem $(/ $table)?, $dir, MultimodalIdsI32);
        rope_kernels!(@multimodal $elem $(/ $table)?, $dir, MultimodalIdsI64);
    };
    (@paths $elem:ident $(/ $table:ident)?, $dir:ident, $rows:ident) => {
        rope_kernels!(@scalar $elem $(/ $table)?, $dir, $rows);
        rope_vector_kernel!($elem $(/ $table)?, Vector, false, false, $rows, $dir);
        rope_vector_kernel!($elem $(/ $table)?, VectorInterleaved, true, true, $rows, $dir);
        rope_kernels!(@multimodal $elem $(/ $table)?, $dir, $rows);
    };
    (@scalar $elem:ident, $dir:ident, $rows:ident) => {
        rope_kernel!($elem, $rows, $dir);
    };
    (@scalar $elem:ident / F32, $dir:ident, $rows:ident) => {};
    (@multimodal $elem:ident $(/ $table:ident)?, $dir:ident, $rows:ident) => {
        rope_vector_kernel!($elem $(/ $table)?, VectorAny, false, true, $rows, $dir);
        rope_general_kernel!($elem $(/ $table)?, $rows, $dir);
    };
}

rope_kernels!(F32);
rope_kernels!(F16);
rope_kernels!(Bf16);
rope_kernels!(F16 / F32);
rope_kernels!(Bf16 / F32);
