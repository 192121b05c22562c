//! SwiGLU (SiLU-mul) forward and backward (semantics: DESIGN.md §3, host: `src/swiglu.rs`).
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
use crate::{Bf16, Elem, block_dim, block_idx, grid_dim, thread_idx};

/// Elements per thread per tile.
const ITEMS: usize = 4;

const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// `(σ(z), 1 − σ(z))`, both accurate to a few f32 ulps (relative) for every `z`.
#[inline(always)]
fn sigmoid_pair(z: f32) -> (f32, f32) {
    // e^{−|z|} = 2^{−|z|·log2 e}; an argument of −∞ gives +0, NaN stays NaN.
    let t = core::intrinsics::exp2f32(-(z.abs()) * LOG2_E);
    let r = 1.0 / (1.0 + t);
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

macro_rules! swiglu_kernels {
    ($ty:ty, $fwd:ident, $bwd:ident) => {
        /// SwiGLU forward `c = T(T(silu(a·gm)) · b)` for one dtype (see the module docs).
        ///
        /// # Safety
        /// `a`, `b`, `c` must cover `rows` rows of their strides and `cols` columns; `c` must
        /// not overlap `a` or `b`.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $fwd(
            a: *const $ty,
            a_stride: u64,
            b: *const $ty,
            b_stride: u64,
            c: *mut $ty,
            c_stride: u64,
            rows: u64,
            cols: u64,
            gm: f32,
        ) {
            unsafe {
                forward::<$ty>(
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

        /// SwiGLU backward for one dtype (see the module docs): with `g = dc·dm`,
        /// `db = g·silu(z)`, `da = g·silu'(z)·gm·b`, `z = a·gm`.
        ///
        /// # Safety
        /// Every pointer must cover `rows` rows of its stride (`da`: `a_stride`, `db`:
        /// `b_stride`) and `cols` columns. `da` may equal `a` and `db` may equal `b`;
        /// otherwise outputs must not overlap inputs or each other.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $bwd(
            dc: *const $ty,
            dc_stride: u64,
            a: *const $ty,
            a_stride: u64,
            b: *const $ty,
            b_stride: u64,
            da: *mut $ty,
            db: *mut $ty,
            rows: u64,
            cols: u64,
            gm: f32,
            dm: f32,
        ) {
            unsafe {
                backward::<$ty>(
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
}

swiglu_kernels!(f32, swiglu_fwd_f32, swiglu_bwd_f32);
swiglu_kernels!(f16, swiglu_fwd_f16, swiglu_bwd_f16);
swiglu_kernels!(Bf16, swiglu_fwd_bf16, swiglu_bwd_bf16);
