//! The GLU kernels, forward and backward: SwiGLU (SiLU as the gate, [`silu`]) and GEGLU (GELU
//! in its tanh or exact form, [`gelu`]) on the same code ([`glu_bodies!`]), one [`abi::Params`]
//! block per launch (semantics: the cast points in `src/reference/swiglu.rs` and
//! `src/reference/geglu.rs`; host: `src/glu/`). The numerics below are SiLU's; GELU's are in
//! `gelu.rs`.
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
//! (`FWD_VECS`, `BWD_VECS`) 16-byte vectors (`V16`) per thread and load their next tile
//! before computing the current one, so all `K` vectors of every operand are in flight at
//! once. Their `_vw` twins, which the host picks for many waves of tiles, run one tile per
//! block over a grid of every tile, with no next tile: the forward's take `FWD_VECS_TILE`
//! 16-byte vectors per thread, the backward's one 8-byte vector ([`V8`]) of each operand,
//! which on an H200 gives the five-stream pattern its highest DRAM throughput of every width,
//! vector count and block size measured (PERFORMANCE.md, "SwiGLU tile shapes"; the forward
//! measured lower with it, its index arithmetic then a larger share). Each
//! thread tracks the (row, column) of its vectors incrementally in 32 bits (three divisions
//! per thread at start, none per vector), so row strides and the fused layout cost one wide
//! multiply-add per pointer per vector. The f32 math per element is the scalar kernels' (same
//! functions, same order), so every path gives the same bits.
pub mod abi;

use crate::{
    Elem, V8, Vector, block_dim, block_idx, grid_dim, lanes, lanes_per, thread_idx, unroll,
};
use abi::{BWD_TILE_VECTOR_BYTES, ITEMS, Params};

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
pub(crate) fn sigmoid_pair(z: f32) -> (f32, f32) {
    // e^{−|z|} = 2^{−|z|·log2 e}; an argument of −∞ gives +0, NaN stays NaN.
    let t = core::intrinsics::exp2f32(-(z.abs()) * LOG2_E);
    // 1 + t ∈ [1, 2] (or NaN).
    let r = recip_1_2(1.0 + t);
    let tr = t * r;
    if z >= 0.0 { (r, tr) } else { (tr, r) }
}

/// `each_item!(k => { … })` runs the block for `k = 0, …, ITEMS − 1` in a loop, which LLVM
/// unrolls for SiLU's small body (the loop SwiGLU's scalar kernels were measured with).
/// GELU's body is past its unroll threshold, so GEGLU's scalar kernels take
/// [`unroll_items!`]: a loop left rolled indexes their arrays dynamically, which puts them in
/// local memory.
macro_rules! each_item {
    ($k:ident => $body:block) => {
        let mut $k = 0;
        while $k < ITEMS {
            $body
            $k += 1;
        }
    };
}

/// `unroll_items!(k => { … })`: the block for `k = 0, …, ITEMS − 1` as straight-line code.
macro_rules! unroll_items {
    ($k:ident => $body:block) => {
        unroll::<ITEMS>(|$k| $body)
    };
}

/// Tiles per row and columns per tile for this launch's block size.
#[inline(always)]
fn tiling(cols: usize) -> (usize, usize) {
    let tile = ITEMS * block_dim();
    // At least one tile per row (the host never launches cols = 0): keeps the division by
    // `per_row` free of its divide-by-zero trap.
    (cols.div_ceil(tile).max(1), tile)
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

/// A forward kernel's arguments, as the bodies take them (strides and sizes as `usize`).
#[derive(Clone, Copy)]
pub(crate) struct Fwd<T> {
    pub(crate) a: *const T,
    pub(crate) a_stride: usize,
    pub(crate) b: *const T,
    pub(crate) b_stride: usize,
    pub(crate) c: *mut T,
    pub(crate) c_stride: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) gm: f32,
}

impl<T> Fwd<T> {
    /// The forward's view of a parameter block.
    #[inline(always)]
    pub(crate) fn of(p: &Params) -> Self {
        Fwd {
            a: p.a as *const T,
            a_stride: p.a_stride as usize,
            b: p.b as *const T,
            b_stride: p.b_stride as usize,
            c: p.c as *mut T,
            c_stride: p.c_stride as usize,
            rows: p.rows as usize,
            cols: p.cols as usize,
            gm: p.gate_multiplier,
        }
    }
}

/// A backward kernel's arguments, as [`Fwd`]'s (`da` in rows of `a_stride`, `db` of
/// `b_stride`).
#[derive(Clone, Copy)]
pub(crate) struct Bwd<T> {
    pub(crate) dc: *const T,
    pub(crate) dc_stride: usize,
    pub(crate) a: *const T,
    pub(crate) a_stride: usize,
    pub(crate) b: *const T,
    pub(crate) b_stride: usize,
    pub(crate) da: *mut T,
    pub(crate) db: *mut T,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) gm: f32,
    pub(crate) dm: f32,
}

impl<T> Bwd<T> {
    /// The backward's view of a parameter block (`c` is `dc`).
    #[inline(always)]
    pub(crate) fn of(p: &Params) -> Self {
        Bwd {
            dc: p.c as *const T,
            dc_stride: p.c_stride as usize,
            a: p.a as *const T,
            a_stride: p.a_stride as usize,
            b: p.b as *const T,
            b_stride: p.b_stride as usize,
            da: p.da as *mut T,
            db: p.db as *mut T,
            rows: p.rows as usize,
            cols: p.cols as usize,
            gm: p.gate_multiplier,
            dm: p.down_multiplier,
        }
    }
}

/// `each_tile!(rows, cols, nt, row, col0 => { … })`: the scalar kernels' grid-stride walk over
/// tiles, the block run once per tile of this block with `row` its row, `col0` this thread's
/// first column in it and `nt` the threads per block (the thread's columns are `col0 + k·nt`).
macro_rules! each_tile {
    ($rows:ident, $cols:ident, $nt:ident, $row:ident, $col0:ident => $body:block) => {
        let (tid, $nt) = (thread_idx(), block_dim());
        let (per_row, tile) = tiling($cols);
        let tiles = $rows * per_row;
        let mut t = block_idx();
        while t < tiles {
            let $row = t / per_row;
            let $col0 = (t - $row * per_row) * tile + tid;
            $body
            t += grid_dim();
        }
    };
}

/// `each_col!(items, k, col0, nt, col < cols => { … })`: inside [`each_tile!`], the block for
/// each of this thread's columns `col = col0 + k·nt` of the tile that lies before `cols`,
/// through the item loop `items!` ([`each_item!`] or [`unroll_items!`]).
macro_rules! each_col {
    ($items:tt, $k:ident, $col0:ident, $nt:ident, $col:ident < $cols:ident => { $($body:tt)* }) => {
        $items!($k => {
            let $col = $col0 + $k * $nt;
            if $col < $cols {
                $($body)*
            }
        })
    };
}

/// `each_vec_tile!(walk, load, pos, (x, …), (x_next, …) => { … })`: the vector kernels' walk,
/// the block run once per tile of this thread with `pos` its vectors' places and `x, …` the
/// operands `load(&pos)` gave.
///
/// The next tile's loads are issued before this tile's math (double buffering): their uses
/// are past the back edge, so ptxas keeps them together (loads in the same block as their uses
/// get sunk next to each use, one round trip per vector). Without a next tile (`ONE`, or past
/// the end) they re-read this one (L1 hits), keeping the code straight-line.
macro_rules! each_vec_tile {
    ($walk:ident, $load:ident, $pos:ident, ($($v:ident),+), ($($n:ident),+) => $body:block) => {
        let mut p = $walk.first();
        if !$walk.inside(p) {
            return;
        }
        let mut $pos = $walk.tile(p);
        let ($(mut $v),+) = $load(&$pos);
        loop {
            let pn = $walk.next(p);
            let more = !ONE && $walk.inside(pn);
            let pos_n = if more { $walk.tile(pn) } else { $pos };
            let ($($n),+) = if ONE { ($($v),+) } else { $load(&pos_n) };
            $body
            if !more {
                return;
            }
            (p, $pos, $($v),+) = (pn, pos_n, $($n),+);
        }
    };
}

/// The kernel bodies of a GLU whose gate activation `act` is given by three functions, each
/// called once per element: `$parts(z)`, the two values `act(z)` and `act'(z)` are formed from
/// (SiLU: `σ(z)`, `1 − σ(z)`); `$act(z, first)`; `$grad(z, first, second)` (the forward's
/// unused part compiles away). The scalar kernels compute their `ITEMS` elements through
/// `$items!`: [`each_item!`] or [`unroll_items!`]. `$autograd`: in 16-bit types the backward
/// rounds where PyTorch autograd through `act(a) * b` in that dtype does (GEGLU, as HF's MLP
/// and Liger's GEGLU): `db = D(g·D(act))`, `da = D(D(g·b)·act'·gm)`; otherwise (SwiGLU, as
/// Liger's, and every f32 kernel) each gradient is rounded once. `#[$vector]` is put on the
/// vector backward's per-vector closure (GEGLU's `#[inline(always)]`: its erf body in 16 bits
/// was otherwise compiled as a call per vector). A macro rather than a trait
/// or a const generic: the gate stays plain function calls, which rustc inlines in SwiGLU's
/// measured instruction order (either generic form gave SwiGLU's forward another one).
macro_rules! glu_bodies {
    ($parts:path, $act:path, $grad:path, $items:ident, $autograd:expr $(, #[$vector:meta])?) => {
        /// The activation as the backward's `db = g·act` reads it: rounded to `T` where
        /// `$autograd` says (see [`glu_bodies!`]).
        #[inline(always)]
        fn stored_act<T: Elem>(act: f32) -> f32 {
            if $autograd && core::mem::size_of::<T>() == 2 {
                T::round(act)
            } else {
                act
            }
        }

        /// `da` from `g`, `grad = act'·gm` and `b`, rounded where `$autograd` says. Otherwise
        /// act' (|silu'| ≤ 1.1, |gelu'| ≤ 1.13) multiplies in before b: where it vanishes
        /// (z → −∞) da is 0, not ∞·0, even when g·b alone would overflow f32.
        #[inline(always)]
        fn da_of<T: Elem>(g: f32, grad: f32, b: f32) -> f32 {
            if $autograd && core::mem::size_of::<T>() == 2 {
                T::round(g * b) * grad
            } else {
                g * grad * b
            }
        }

        #[inline(always)]
        pub(crate) unsafe fn forward<T: Elem>(args: Fwd<T>) {
            let Fwd { a, a_stride, b, b_stride, c, c_stride, rows, cols, gm } = args;
            each_tile!(rows, cols, nt, row, col0 => {
                let ar = unsafe { a.add(row * a_stride) };
                let br = unsafe { b.add(row * b_stride) };
                let cr = unsafe { c.add(row * c_stride) };
                let mut av = [0.0f32; ITEMS];
                let mut bv = [0.0f32; ITEMS];
                each_col!(each_item, k, col0, nt, col < cols => {
                    av[k] = unsafe { *ar.add(col) }.to_f32();
                    bv[k] = unsafe { *br.add(col) }.to_f32();
                });
                each_col!($items, k, col0, nt, col < cols => {
                    let z = av[k] * gm;
                    // Liger ≥ 0.6: silu in f32, rounded to T, then the product of two T values.
                    let (first, _) = $parts(z);
                    let s = T::round($act(z, first));
                    unsafe { *cr.add(col) = T::from_f32(s * bv[k]) };
                });
            });
        }

        #[inline(always)]
        pub(crate) unsafe fn backward<T: Elem>(args: Bwd<T>) {
            let Bwd { dc, dc_stride, a, a_stride, b, b_stride, da, db, rows, cols, gm, dm } = args;
            each_tile!(rows, cols, nt, row, col0 => {
                let dcr = unsafe { dc.add(row * dc_stride) };
                let ar = unsafe { a.add(row * a_stride) };
                let br = unsafe { b.add(row * b_stride) };
                let dar = unsafe { da.add(row * a_stride) };
                let dbr = unsafe { db.add(row * b_stride) };
                let mut gv = [0.0f32; ITEMS];
                let mut av = [0.0f32; ITEMS];
                let mut bv = [0.0f32; ITEMS];
                each_col!(each_item, k, col0, nt, col < cols => {
                    gv[k] = unsafe { *dcr.add(col) }.to_f32();
                    av[k] = unsafe { *ar.add(col) }.to_f32();
                    bv[k] = unsafe { *br.add(col) }.to_f32();
                });
                each_col!($items, k, col0, nt, col < cols => {
                    let g = gv[k] * dm;
                    let z = av[k] * gm;
                    let (first, second) = $parts(z);
                    let db_v = g * stored_act::<T>($act(z, first));
                    let da_v = da_of::<T>(g, $grad(z, first, second) * gm, bv[k]);
                    unsafe { *dar.add(col) = T::from_f32(da_v) };
                    unsafe { *dbr.add(col) = T::from_f32(db_v) };
                });
            });
        }

        #[inline(always)]
        pub(crate) unsafe fn forward_vec<T: Elem, V: Vector, const K: usize, const ONE: bool>(
            args: Fwd<T>,
        ) {
            let Fwd { a, a_stride, b, b_stride, c, c_stride, rows, cols, gm } = args;
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
            each_vec_tile!(walk, load, pos, (av, bv), (an, bn) => {
                unroll::<K>(|k| {
                    let mut s = [0.0f32; 8];
                    lanes::<T, V>(|i| {
                        let z = T::lane(&av[k], i) * gm;
                        let (first, _) = $parts(z);
                        s[i] = $act(z, first);
                    });
                    // T(act) per lane (the packing conversion rounds each lane like `T::round`),
                    // then the product of two T values, rounded once more: one packed product.
                    let out = T::mul_rn(T::pack(&s), bv[k]);
                    unsafe { out.store(c.add(pos[k].at(sc))) };
                });
            });
        }

        #[inline(always)]
        pub(crate) unsafe fn backward_vec<T: Elem, V: Vector, const K: usize, const ONE: bool>(
            args: Bwd<T>,
        ) {
            let Bwd { dc, dc_stride, a, a_stride, b, b_stride, da, db, rows, cols, gm, dm } = args;
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
            // In place, the next tile's loads come before this tile's stores, and the tiles are
            // disjoint (or the same tile, re-read before its stores).
            each_vec_tile!(walk, load, pos, (gv, av, bv), (gn, an, bn) => {
                unroll::<K>($(#[$vector])? |k| {
                    let mut da_v = [0.0f32; 8];
                    let mut db_v = [0.0f32; 8];
                    lanes::<T, V>(|i| {
                        let g = T::lane(&gv[k], i) * dm;
                        let z = T::lane(&av[k], i) * gm;
                        let (first, second) = $parts(z);
                        db_v[i] = g * stored_act::<T>($act(z, first));
                        let grad = $grad(z, first, second) * gm;
                        da_v[i] = da_of::<T>(g, grad, T::lane(&bv[k], i));
                    });
                    // In place (da = a, db = b) each vector is loaded above, by this thread,
                    // before these stores.
                    unsafe { T::pack::<V>(&da_v).store(da.add(pos[k].at(sa))) };
                    unsafe { T::pack::<V>(&db_v).store(db.add(pos[k].at(sb))) };
                });
            });
        }
    };
}

/// One kernel: bodies `$bodies` (a module of [`glu_bodies!`] under this one), gate `$gate` (its
/// entry name, `kernel_name!(Glu, $gate, $pass, $path, $elem)`), body `$body` with its vector
/// type, count (a constant of [`abi`]) and one-tile flag. The entry takes one [`Params`] block
/// by value (`ld.param` loads, no local copy); the pass picks the bodies' view of it.
macro_rules! glu_kernel {
    ($($bodies:ident)::+, $gate:ident, $elem:ident, $pass:ident, $path:ident,
     $body:ident $(:: $v:ident, $k:ident, $one:literal)?, $doc:literal) => {
        const _: () = {
            #[doc = $crate::glu::glu_kernel!(@what $pass)]
            #[doc = ""]
            #[doc = $doc]
            #[doc = ""]
            #[doc = "# Safety"]
            #[doc = $crate::glu::glu_kernel!(@safety $pass)]
            #[unsafe(export_name = $crate::identity::kernel_name!(Glu, $gate, $pass, $path, $elem))]
            // A `#[repr(C)]` struct of integers and floats: the PTX parameter is its bytes.
            #[allow(improper_gpu_kernel_arg)]
            pub unsafe extern "gpu-kernel" fn kernel(p: $crate::glu::abi::Params) {
                unsafe {
                    $crate::glu::$($bodies)::+::$body::<$crate::elem_type!($elem) $(, $crate::$v, { $crate::glu::abi::$k }, $one)?>(
                        $crate::glu::glu_kernel!(@view $pass, p)
                    )
                }
            }
        };
    };
    (@view Forward, $p:ident) => { $crate::glu::Fwd::of(&$p) };
    (@view Backward, $p:ident) => { $crate::glu::Bwd::of(&$p) };
    (@what Forward) => {
        "GLU forward `c = T(T(act(a·gm)) · b)` for one dtype, `act` the op's gate \
         (`kernels-gpu/src/glu/`'s module docs)."
    };
    (@what Backward) => {
        "GLU backward for one dtype, `act` the op's gate (`kernels-gpu/src/glu/`'s module \
         docs): with `g = dc·dm`, `db = g·act(z)`, `da = g·act'(z)·gm·b`, `z = a·gm`."
    };
    (@safety Forward) => {
        "`p.a`, `p.b`, `p.c` must cover `rows` rows of their strides and `cols` columns; `c` \
         must not overlap `a` or `b`."
    };
    (@safety Backward) => {
        "Every pointer of `p` must cover `rows` rows of its stride (`dc`: `c_stride`, `da`: \
         `a_stride`, `db`: `b_stride`) and `cols` columns. `da` may equal `a` and `db` may equal \
         `b`; otherwise outputs must not overlap inputs or each other."
    };
}
pub(crate) use glu_kernel;

// The backward `_vw` kernels load `V8`s, the vectors the host sizes their tiles in.
const _: () = assert!(size_of::<V8>() == BWD_TILE_VECTOR_BYTES);

/// Every kernel of one gate and element type: scalar, `_v` and `_vw`, each pass, with the
/// bodies of module `$bodies` ([`glu_bodies!`]), named by `$gate`.
macro_rules! glu_kernels {
    ($($bodies:ident)::+, $gate:ident, $elem:ident) => {
        $crate::glu::glu_kernel!($($bodies)::+, $gate, $elem, Forward, Scalar, forward, "Scalar kernel: any alignment, any `cols`.");
        $crate::glu::glu_kernel!($($bodies)::+, $gate, $elem, Backward, Scalar, backward, "Scalar kernel: any alignment, any `cols`.");
        $crate::glu::glu_kernel!($($bodies)::+, $gate, $elem, Forward, Vector, forward_vec::V16, FWD_VECS, false, "16-byte vector kernel, grid-stride over tiles: pointers and row strides 16-byte aligned, `cols` a multiple of the lanes per 16-byte vector.");
        $crate::glu::glu_kernel!($($bodies)::+, $gate, $elem, Backward, Vector, backward_vec::V16, BWD_VECS, false, "16-byte vector kernel, grid-stride over tiles: pointers and row strides 16-byte aligned, `cols` a multiple of the lanes per 16-byte vector.");
        $crate::glu::glu_kernel!($($bodies)::+, $gate, $elem, Forward, Whole, forward_vec::V16, FWD_VECS_TILE, true, "16-byte vector kernel, one tile per block (the grid covers every tile): the `_v` kernel's rules.");
        $crate::glu::glu_kernel!($($bodies)::+, $gate, $elem, Backward, Whole, backward_vec::V8, BWD_VECS_TILE, true, "8-byte vector kernel, one tile per block (the grid covers every tile): the `_v` kernel's rules; the host counts its tiles in 8-byte vectors.");
    };
}

// After the macros, which the gates' files expand (textual scope).
mod gelu;
mod silu;
