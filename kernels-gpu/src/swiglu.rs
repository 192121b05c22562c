//! SwiGLU (SiLU-mul) forward and backward (semantics: the cast points in `src/reference/swiglu.rs`, host: `src/swiglu.rs`).
//!
//! Element-wise over `rows × cols`: `a` (gate) and `b` (up) are read through row strides, so
//! the fused gate-up layout (`[rows, 2·cols]`, gate first) is the same kernel with
//! `b = a + cols` and one shared stride; in-place backward passes `da = a`, `db = b`.
//!
//! Mapping: the grid walks *tiles* grid-stride (`tile = blockIdx.x; tile += gridDim.x`); a tile
//! is `ITEMS · blockDim.x` consecutive columns of one row (`row = tile / tiles_per_row`, one
//! 64-bit division per tile, none per element). Thread `t` handles columns
//! `t, t + blockDim.x, …` of its tile, so each warp load/store is contiguous (coalesced). All
//! loads of a tile are issued before any store, and every element is read and then written
//! by the same thread, which makes the in-place modes race-free.
//!
//! Numerics (f32 throughout, one rounding to `T` at each store): with `t = e^{−|z|} ∈ [0, 1]`
//! (from `ex2.approx`) and `r = 1/(1 + t) ∈ [½, 1]`, `σ(z)` and `1 − σ(z)` are `r` and `t·r`
//! (z ≥ 0) or `t·r` and `r` (z < 0): no overflow, no cancellation, exact 0/1 limits. For any
//! finite `z` the products `z·σ`, `z·(1 − σ)` are then finite; infinite `z` (an infinite gate,
//! or `a·gm` overflowing f32) takes the limits silu(−∞) = −0, silu(+∞) = +∞,
//! silu'(−∞) = 0, silu'(+∞) = 1 instead of `∞·0 = NaN`. NaN propagates.
//!
//! The vector kernels are the fast path when every pointer and row stride is 16-byte aligned,
//! `cols` is a multiple of the lanes per 16-byte vector (`T::LANES`) and `rows`, `cols`,
//! strides and `gridDim.x · K · blockDim.x` are below 2³¹ (the host checks): the
//! `rows × cols/lanes` vectors form one flat range (a vector never crosses a row) walked
//! grid-stride in tiles of `K · blockDim.x` vectors. Thread `t` of a tile takes vectors
//! `t, t + blockDim.x, …` (coalesced vector loads and stores). The `_v` kernels take `K`
//! ([`FWD_VECS`], [`BWD_VECS`]) 16-byte vectors ([`V16`]) per thread and load their next tile
//! before computing the current one, so all `K` vectors of every operand are in flight at
//! once. Their `_vt` twins, which the host picks for many waves of tiles, run one tile per
//! block over a grid of every tile, with no next tile: the forward's take [`FWD_VECS_TILE`]
//! 16-byte vectors per thread, the backward's one 8-byte vector ([`V8`]) of each operand,
//! which on an H200 gives the five-stream pattern its highest DRAM throughput of every width,
//! vector count and block size measured (PERFORMANCE.md, "SwiGLU tile shapes"; the forward
//! measured lower with it, its index arithmetic then a larger share). Each
//! thread tracks the (row, column) of its vectors incrementally in 32 bits (three divisions
//! per thread at start, none per vector), so row strides and the fused layout cost one wide
//! multiply-add per pointer per vector. The f32 math per element is the scalar kernels' (same
//! functions, same order), so every path gives the same bits.
use crate::identity::swiglu::{
    BWD_TILE_VECTOR_BYTES, BWD_VECS, BWD_VECS_TILE, FWD_VECS, FWD_VECS_TILE, ITEMS,
};
use crate::identity::{ElemType, kernel_name};
use crate::{
    Elem, V8, V16, Vector, block_dim, block_idx, elem_type, grid_dim, lanes, lanes_per, thread_idx,
    unroll,
};

const LOG2_E: f32 = core::f32::consts::LOG2_E;

unsafe extern "C" {
    #[link_name = "llvm.nvvm.rcp.approx.ftz.f"]
    fn rcp_approx_ftz(x: f32) -> f32;
}

/// `1/x` correctly rounded for `x ∈ [1, 2]` (and NaN for NaN): the fast path of the
/// `rcp.rn.f32` expansion (`MUFU.RCP`, then one Newton step with two FMAs), the same operations
/// and so the same bits as `1.0 / x`, without its range check, branch and slow-path call
/// (never needed here: no subnormal, huge or infinite `x`).
#[inline(always)]
pub(crate) fn recip_1_2(x: f32) -> f32 {
    // SAFETY: a pure register operation.
    let r0 = unsafe { rcp_approx_ftz(x) };
    let e = core::intrinsics::fmaf32(x, r0, -1.0);
    core::intrinsics::fmaf32(r0, -e, r0)
}

/// `(σ(z), 1 − σ(z))`, both accurate to a few f32 ulps (relative) for every `z`.
#[inline(always)]
fn sigmoid_pair(z: f32) -> (f32, f32) {
    // e^{−|z|} = 2^{−|z|·log2 e}; an argument of −∞ gives +0, NaN stays NaN.
    let t = core::intrinsics::exp2f32(-(z.abs()) * LOG2_E);
    // 1 + t ∈ [1, 2] (or NaN).
    let r = recip_1_2(1.0 + t);
    let tr = t * r;
    if z >= 0.0 { (r, tr) } else { (tr, r) }
}

/// `silu(z) = z·σ(z)`, with silu(−∞) = −0.
#[inline(always)]
fn silu_of(z: f32, sig: f32) -> f32 {
    if sig == 0.0 { -0.0 } else { z * sig }
}

/// `silu'(z) = σ·(1 + z·(1 − σ))`, with the limits 0 at −∞ and 1 at +∞.
#[inline(always)]
fn silu_grad_of(z: f32, sig: f32, one_minus: f32) -> f32 {
    let z_one_minus = if one_minus == 0.0 { 0.0 } else { z * one_minus };
    if sig == 0.0 {
        0.0
    } else {
        sig * (1.0 + z_one_minus)
    }
}

/// Tiles per row and columns per tile for this launch's block size.
#[inline(always)]
fn tiling(cols: usize) -> (usize, usize) {
    let tile = ITEMS * block_dim();
    // At least one tile per row (the host never launches cols = 0): keeps the division by
    // `per_row` free of its divide-by-zero trap.
    (cols.div_ceil(tile).max(1), tile)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn forward<T: Elem>(
    a: *const T,
    a_stride: usize,
    b: *const T,
    b_stride: usize,
    c: *mut T,
    c_stride: usize,
    rows: usize,
    cols: usize,
    gm: f32,
) {
    let (tid, nt) = (thread_idx(), block_dim());
    let (per_row, tile) = tiling(cols);
    let tiles = rows * per_row;
    let mut t = block_idx();
    while t < tiles {
        let row = t / per_row;
        let col0 = (t - row * per_row) * tile + tid;
        let ar = unsafe { a.add(row * a_stride) };
        let br = unsafe { b.add(row * b_stride) };
        let cr = unsafe { c.add(row * c_stride) };
        let mut av = [0.0f32; ITEMS];
        let mut bv = [0.0f32; ITEMS];
        let mut k = 0;
        while k < ITEMS {
            let col = col0 + k * nt;
            if col < cols {
                av[k] = unsafe { *ar.add(col) }.to_f32();
                bv[k] = unsafe { *br.add(col) }.to_f32();
            }
            k += 1;
        }
        let mut k = 0;
        while k < ITEMS {
            let col = col0 + k * nt;
            if col < cols {
                let z = av[k] * gm;
                let (sig, _) = sigmoid_pair(z);
                // Liger ≥ 0.6: silu in f32, rounded to T, then the product of two T values.
                let s = T::round(silu_of(z, sig));
                unsafe { *cr.add(col) = T::from_f32(s * bv[k]) };
            }
            k += 1;
        }
        t += grid_dim();
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward<T: Elem>(
    dc: *const T,
    dc_stride: usize,
    a: *const T,
    a_stride: usize,
    b: *const T,
    b_stride: usize,
    da: *mut T,
    db: *mut T,
    rows: usize,
    cols: usize,
    gm: f32,
    dm: f32,
) {
    let (tid, nt) = (thread_idx(), block_dim());
    let (per_row, tile) = tiling(cols);
    let tiles = rows * per_row;
    let mut t = block_idx();
    while t < tiles {
        let row = t / per_row;
        let col0 = (t - row * per_row) * tile + tid;
        let dcr = unsafe { dc.add(row * dc_stride) };
        let ar = unsafe { a.add(row * a_stride) };
        let br = unsafe { b.add(row * b_stride) };
        let dar = unsafe { da.add(row * a_stride) };
        let dbr = unsafe { db.add(row * b_stride) };
        let mut gv = [0.0f32; ITEMS];
        let mut av = [0.0f32; ITEMS];
        let mut bv = [0.0f32; ITEMS];
        let mut k = 0;
        while k < ITEMS {
            let col = col0 + k * nt;
            if col < cols {
                gv[k] = unsafe { *dcr.add(col) }.to_f32();
                av[k] = unsafe { *ar.add(col) }.to_f32();
                bv[k] = unsafe { *br.add(col) }.to_f32();
            }
            k += 1;
        }
        let mut k = 0;
        while k < ITEMS {
            let col = col0 + k * nt;
            if col < cols {
                let g = gv[k] * dm;
                let z = av[k] * gm;
                let (sig, one_minus) = sigmoid_pair(z);
                let db_v = g * silu_of(z, sig);
                // silu' (|silu'| ≤ 1.1) multiplies in before b: where it vanishes (z → −∞)
                // da is 0, not ∞·0, even when g·b alone would overflow f32.
                let da_v = g * (silu_grad_of(z, sig, one_minus) * gm) * bv[k];
                unsafe { *dar.add(col) = T::from_f32(da_v) };
                unsafe { *dbr.add(col) = T::from_f32(db_v) };
            }
            k += 1;
        }
        t += grid_dim();
    }
}

/// A vector's place in the `rows × per_row` grid of vectors (32-bit: the host takes this
/// path only for `rows`, `cols` and strides below 2³¹).
#[derive(Clone, Copy)]
struct Pos {
    row: u32,
    col: u32,
}

impl Pos {
    /// Offset (in vectors) of this vector in an operand whose rows are `stride` vectors apart
    /// (one wide multiply-add).
    #[inline(always)]
    fn at(self, stride: u32) -> usize {
        (self.row as u64 * stride as u64 + self.col as u64) as usize
    }
}

/// A fixed distance in the flattened vector range, as whole rows plus columns (< `per_row`).
#[derive(Clone, Copy)]
struct Step {
    rows: u32,
    cols: u32,
}

/// This thread's walk through the flattened `rows × per_row` vectors: `K` vectors
/// `block_dim` apart per tile, tiles `grid_dim · K · block_dim` apart.
struct Walk<const K: usize> {
    rows: u32,
    per_row: u32,
    /// From one of a thread's vectors to its next in the same tile (`block_dim` vectors).
    in_tile: Step,
    /// From a thread's first vector of a tile to its first of the next tile.
    to_next: Step,
}

impl<const K: usize> Walk<K> {
    #[inline(always)]
    fn new(rows: u32, per_row: u32) -> Self {
        // The host never launches with fewer columns than a vector holds; `max(1)` keeps the
        // divisions trap-free.
        let per_row = per_row.max(1);
        let nt = block_dim() as u32;
        let step = |n: u32| Step {
            rows: n / per_row,
            cols: n % per_row,
        };
        Walk {
            rows,
            per_row,
            in_tile: step(nt),
            to_next: step(grid_dim() as u32 * K as u32 * nt),
        }
    }

    /// This thread's first vector.
    #[inline(always)]
    fn first(&self) -> Pos {
        let j = (block_idx() * K * block_dim() + thread_idx()) as u32;
        Pos {
            row: j / self.per_row,
            col: j % self.per_row,
        }
    }

    /// Whether `p` is inside the range (positions only grow, so once one is past the end,
    /// all later ones are).
    #[inline(always)]
    fn inside(&self, p: Pos) -> bool {
        p.row < self.rows
    }

    #[inline(always)]
    fn advance(&self, p: Pos, s: Step) -> Pos {
        let mut row = p.row + s.rows;
        let mut col = p.col + s.cols;
        if col >= self.per_row {
            col -= self.per_row;
            row += 1;
        }
        Pos { row, col }
    }

    /// This thread's `K` vectors of the tile that starts at `p` (inside the range). Those past
    /// the end are replaced by `p`: their loads read `p`'s vectors again and their stores
    /// write `p`'s results again (the same values, after every load of the tile, so in place
    /// too), which keeps the tile straight-line code with every load issued up front (a load
    /// used only under a condition gets sunk into it, one load in flight at a time).
    #[inline(always)]
    fn tile(&self, p: Pos) -> [Pos; K] {
        let mut pos = [p; K];
        let mut q = p;
        unroll::<K>(|k| {
            if k > 0 {
                q = self.advance(q, self.in_tile);
                if self.inside(q) {
                    pos[k] = q;
                }
            }
        });
        pos
    }

    /// This thread's first vector of the next tile.
    #[inline(always)]
    fn next(&self, p: Pos) -> Pos {
        self.advance(p, self.to_next)
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn forward_vec<T: Elem, V: Vector, const K: usize, const ONE: bool>(
    a: *const T,
    a_stride: usize,
    b: *const T,
    b_stride: usize,
    c: *mut T,
    c_stride: usize,
    rows: usize,
    cols: usize,
    gm: f32,
) {
    let (a, b, c) = (a as *const V, b as *const V, c as *mut V);
    let lanes_per = lanes_per::<T, V>();
    let (sa, sb, sc) = (
        (a_stride / lanes_per) as u32,
        (b_stride / lanes_per) as u32,
        (c_stride / lanes_per) as u32,
    );
    let walk = Walk::<K>::new(rows as u32, (cols / lanes_per) as u32);
    let load = |pos: &[Pos; K]| {
        let (mut av, mut bv) = ([V::ZERO; K], [V::ZERO; K]);
        unroll::<K>(|k| {
            av[k] = unsafe { V::load(a.add(pos[k].at(sa))) };
            bv[k] = unsafe { V::load(b.add(pos[k].at(sb))) };
        });
        (av, bv)
    };
    let mut p = walk.first();
    if !walk.inside(p) {
        return;
    }
    let mut pos = walk.tile(p);
    let (mut av, mut bv) = load(&pos);
    loop {
        // The next tile's loads are issued before this tile's math (double buffering): their
        // uses are past the back edge, so ptxas keeps them together (loads in the same block
        // as their uses get sunk next to each use, one round trip per vector). Without a next
        // tile they re-read this one (L1 hits), keeping the code straight-line.
        let pn = walk.next(p);
        let more = !ONE && walk.inside(pn);
        let pos_n = if more { walk.tile(pn) } else { pos };
        let (an, bn) = if ONE { (av, bv) } else { load(&pos_n) };
        unroll::<K>(|k| {
            let mut s = [0.0f32; 8];
            lanes::<T, V>(|i| {
                let z = T::lane(&av[k], i) * gm;
                let (sig, _) = sigmoid_pair(z);
                s[i] = silu_of(z, sig);
            });
            // T(silu) per lane (the packing conversion rounds each lane like `T::round`),
            // then the product of two T values, rounded once more: one packed product.
            let out = T::mul_rn(T::pack(&s), bv[k]);
            unsafe { out.store(c.add(pos[k].at(sc))) };
        });
        if !more {
            return;
        }
        (p, pos, av, bv) = (pn, pos_n, an, bn);
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward_vec<T: Elem, V: Vector, const K: usize, const ONE: bool>(
    dc: *const T,
    dc_stride: usize,
    a: *const T,
    a_stride: usize,
    b: *const T,
    b_stride: usize,
    da: *mut T,
    db: *mut T,
    rows: usize,
    cols: usize,
    gm: f32,
    dm: f32,
) {
    let (dc, a, b) = (dc as *const V, a as *const V, b as *const V);
    let (da, db) = (da as *mut V, db as *mut V);
    let lanes_per = lanes_per::<T, V>();
    let (sc, sa, sb) = (
        (dc_stride / lanes_per) as u32,
        (a_stride / lanes_per) as u32,
        (b_stride / lanes_per) as u32,
    );
    let walk = Walk::<K>::new(rows as u32, (cols / lanes_per) as u32);
    let load = |pos: &[Pos; K]| {
        let (mut gv, mut av, mut bv) = ([V::ZERO; K], [V::ZERO; K], [V::ZERO; K]);
        unroll::<K>(|k| {
            gv[k] = unsafe { V::load(dc.add(pos[k].at(sc))) };
            av[k] = unsafe { V::load(a.add(pos[k].at(sa))) };
            bv[k] = unsafe { V::load(b.add(pos[k].at(sb))) };
        });
        (gv, av, bv)
    };
    let mut p = walk.first();
    if !walk.inside(p) {
        return;
    }
    let mut pos = walk.tile(p);
    let (mut gv, mut av, mut bv) = load(&pos);
    loop {
        // Double buffered as in the forward. In place, the next tile's loads come before this
        // tile's stores, and the tiles are disjoint (or the same tile, re-read before its stores).
        let pn = walk.next(p);
        let more = !ONE && walk.inside(pn);
        let pos_n = if more { walk.tile(pn) } else { pos };
        let (gn, an, bn) = if ONE { (gv, av, bv) } else { load(&pos_n) };
        unroll::<K>(|k| {
            let mut da_v = [0.0f32; 8];
            let mut db_v = [0.0f32; 8];
            lanes::<T, V>(|i| {
                let g = T::lane(&gv[k], i) * dm;
                let z = T::lane(&av[k], i) * gm;
                let (sig, one_minus) = sigmoid_pair(z);
                db_v[i] = g * silu_of(z, sig);
                da_v[i] = g * (silu_grad_of(z, sig, one_minus) * gm) * T::lane(&bv[k], i);
            });
            // In place (da = a, db = b) each vector is loaded above, by this thread,
            // before these stores.
            unsafe { T::pack::<V>(&da_v).store(da.add(pos[k].at(sa))) };
            unsafe { T::pack::<V>(&db_v).store(db.add(pos[k].at(sb))) };
        });
        if !more {
            return;
        }
        (p, pos, gv, av, bv) = (pn, pos_n, gn, an, bn);
    }
}

macro_rules! swiglu_fwd_kernel {
    ($elem:ident, $path:ident, $body:ident $(:: $v:ident, $k:expr, $one:literal)?, $doc:literal) => {
        const _: () = {
            /// SwiGLU forward `c = T(T(silu(a·gm)) · b)` for one dtype (see the module docs).
            #[doc = $doc]
            ///
            /// # Safety
            /// `a`, `b`, `c` must cover `rows` rows of their strides and `cols` columns; `c`
            /// must not overlap `a` or `b`.
            #[unsafe(export_name = kernel_name!(Swiglu, Forward, $path, $elem))]
            pub unsafe extern "gpu-kernel" fn kernel(
                a: *const elem_type!($elem),
                a_stride: u64,
                b: *const elem_type!($elem),
                b_stride: u64,
                c: *mut elem_type!($elem),
                c_stride: u64,
                rows: u64,
                cols: u64,
                gm: f32,
            ) {
                unsafe {
                    $body::<elem_type!($elem) $(, $v, { $k }, $one)?>(
                        a,
                        a_stride as usize,
                        b,
                        b_stride as usize,
                        c,
                        c_stride as usize,
                        rows as usize,
                        cols as usize,
                        gm,
                    )
                }
            }
        };
    };
}

macro_rules! swiglu_bwd_kernel {
    ($elem:ident, $path:ident, $body:ident $(:: $v:ident, $k:expr, $one:literal)?, $doc:literal) => {
        const _: () = {
            /// SwiGLU backward for one dtype (see the module docs): with `g = dc·dm`,
            /// `db = g·silu(z)`, `da = g·silu'(z)·gm·b`, `z = a·gm`.
            #[doc = $doc]
            ///
            /// # Safety
            /// Every pointer must cover `rows` rows of its stride (`da`: `a_stride`, `db`:
            /// `b_stride`) and `cols` columns. `da` may equal `a` and `db` may equal `b`;
            /// otherwise outputs must not overlap inputs or each other.
            #[unsafe(export_name = kernel_name!(Swiglu, Backward, $path, $elem))]
            pub unsafe extern "gpu-kernel" fn kernel(
                dc: *const elem_type!($elem),
                dc_stride: u64,
                a: *const elem_type!($elem),
                a_stride: u64,
                b: *const elem_type!($elem),
                b_stride: u64,
                da: *mut elem_type!($elem),
                db: *mut elem_type!($elem),
                rows: u64,
                cols: u64,
                gm: f32,
                dm: f32,
            ) {
                unsafe {
                    $body::<elem_type!($elem) $(, $v, { $k }, $one)?>(
                        dc,
                        dc_stride as usize,
                        a,
                        a_stride as usize,
                        b,
                        b_stride as usize,
                        da,
                        db,
                        rows as usize,
                        cols as usize,
                        gm,
                        dm,
                    )
                }
            }
        };
    };
}

// The backward `_vt` kernels load `V8`s, the vectors the host sizes their tiles in.
const _: () = assert!(size_of::<V8>() == BWD_TILE_VECTOR_BYTES);

/// Every SwiGLU kernel of one element type: scalar, `_v` and `_vt`, each direction.
macro_rules! swiglu_kernels {
    ($elem:ident) => {
        swiglu_fwd_kernel!($elem, Scalar, forward, "Scalar kernel: any alignment, any `cols`.");
        swiglu_bwd_kernel!($elem, Scalar, backward, "Scalar kernel: any alignment, any `cols`.");
        swiglu_fwd_kernel!($elem, Vector, forward_vec::V16, FWD_VECS, false, "16-byte vector kernel, grid-stride over tiles: pointers and row strides 16-byte aligned, `cols` a multiple of the lanes per 16-byte vector.");
        swiglu_bwd_kernel!($elem, Vector, backward_vec::V16, BWD_VECS, false, "16-byte vector kernel, grid-stride over tiles: pointers and row strides 16-byte aligned, `cols` a multiple of the lanes per 16-byte vector.");
        swiglu_fwd_kernel!($elem, Tile, forward_vec::V16, FWD_VECS_TILE, true, "16-byte vector kernel, one tile per block (the grid covers every tile): the `_v` kernel's rules.");
        swiglu_bwd_kernel!($elem, Tile, backward_vec::V8, BWD_VECS_TILE, true, "8-byte vector kernel, one tile per block (the grid covers every tile): the `_v` kernel's rules; the host counts its tiles in 8-byte vectors.");
    };
}

swiglu_kernels!(F32);
swiglu_kernels!(F16);
swiglu_kernels!(Bf16);
