//! RMSNorm forward, backward and the dW reduction (semantics: the cast points in `src/reference/rms_norm.rs`, host: `src/rms_norm.rs`); every
//! entry takes one [`abi::Params`] block.
//!
//! Rows are walked grid-stride (`row = blockIdx.x; row += gridDim.x`), one block per row at a
//! time, columns strided by the block. The forward writes `y` and the row's rstd; the backward
//! writes `dx` (possibly over `dy`: every element is read before the same thread writes it) and,
//! when dW is wanted, accumulates its dW contribution into one f32 partial row per block, which
//! `rms_norm_dw_reduce_*` sums over blocks in a fixed order; the `bwd_dx` kernels (a frozen
//! weight, or none) write `dx` alone. In the sm_90 build the reduction first waits in
//! `griddepcontrol.wait` (see `wait_for_prerequisite_grids`): the host launches it as a
//! programmatic dependent launch, so its blocks may start before the backward's completion is
//! processed. The f32 `_v2` backward also lets it launch at once (`allow_dependent_grids`, see
//! `backward_vec`), and the `_vs{K}` backward, launched in thread-block clusters, writes one
//! partial row per cluster (`write_cluster_partial`).
//!
//! The fused residual add (`add_fwd`, `add_bwd`, `add_bwd_dx`: the same bodies with `ADD`,
//! one kernel for each RMSNorm kernel) normalises `s = D(x + r)`, writing `s` as well (over `x`
//! or `r` allowed), and its backward writes `D(dX + ds)`, RMSNorm's dX of `s` plus the sum's
//! incoming gradient before one rounding (over `dy` or `ds` allowed). Every element of `s`
//! (of `dx`) is written by the thread that read its `x` and `r` (its `dy` and `ds`) before,
//! and by no other, which is what makes those in-place forms safe.
//!
//! `dx = r·m − r³/n·(Σ m·x)·x` is evaluated as `r·(m − mean(m·h)·h)` with `h = x·r`: every
//! factor stays near 1 whatever the row's scale (`r³` underflows f32 once the row's RMS
//! passes 2⁴², and `Σ m·x` overflows near the bf16 maximum).
//!
//! The `_v{K}` kernels are the fast path for rows of 16-byte aligned vectors (`cols` a multiple
//! of the lanes per vector, aligned pointers and strides): thread `t` owns vectors
//! `t, t + nt, …, t + (K − 1)·nt` of every row and keeps them in registers, so `x` (and `dy`) is
//! read once with 16-byte loads. The `_v{K}` forward walks a resident grid and loads its next row
//! before reducing the current one; the `_vw{K}` forward (K = 2, 4) runs one row per block over
//! a grid of every row (no next-row registers, so more blocks fit per SM; the host picks it for
//! many rows). The vector backward is persistent: each block keeps its dW partial row in registers (`_v{K}`) or shared memory
//! (`_vs{K}`, see `backward_vec`) across all its rows and writes it once at the end.
//!
//! The vector kernels form the weight product `D(x·r)·(offset + w)` as one packed 16-bit
//! product (`fma.rn.bf16x2` / `fma.rn.f16x2`: half the instructions of widening each lane and
//! fewer registers) wherever that gives the mode's bits (see `packed_weight`); 16-bit llama rows
//! with an offset other than ±0 run the `_llama_offset` twins, which multiply lane by lane.
pub mod abi;

use crate::identity::{
    ElemType, Mode, NormInput, NormPass, RmsNormLayout, has_shared_dw, kernel_name,
};
use crate::{
    Elem, SUM_SLOTS, V16, Vector, allow_dependent_grids, block_dim, block_dim_y, block_idx,
    block_sum, block_sum2, elem_type, fma, grid_dim, lanes, mode, sqrt, sync_threads, thread_idx,
    thread_idx_y, unroll, wait_for_prerequisite_grids,
};
#[cfg(target_feature = "sm_90")]
use crate::{cluster_blocks, cluster_rank, cluster_sync, load_from_cluster_block};
use abi::Params;

/// Scale of the second sum of squares, for rows whose f32 sum overflows: with `Σx² ≥ 2¹²⁸`
/// the scaled sum `Σ(x·2⁻⁸⁰)²` is ≥ 2⁻³² (normal f32, full precision) and, for any finite `x`
/// and up to 2³² columns, < 2¹²⁸; squares or partial sums that underflow when scaled (below
/// 2¹¹) are below the last bit of a sum that large.
const RESCALE: f32 = 1.0 / (1u128 << 80) as f32;

/// Whether the vector kernels of `elem` in `mode` form the weight product
/// `D(x·r)·(offset + w)` (none mode: `D(D(x·r)·D(D(offset) + w))`) as one packed product
/// `D(D(x·r)·w')` with `w' = D(offset + w)`, holding `w'` in registers, which gives the same
/// bits: in none mode; in llama, whose 16-bit kernels require `offset = ±0` (`offset + w`
/// exact in the type; other offsets run [`Mode::LlamaOffset`]); in gemma, which does not round
/// `x·r`, only in f32.
const fn packs(elem: ElemType, mode: Mode) -> bool {
    match mode {
        Mode::None | Mode::Llama => true,
        Mode::Gemma => matches!(elem, ElemType::F32),
        Mode::LlamaOffset => false,
    }
}

/// Whether the weight product runs packed ([`Elem::mul_rn`], [`Elem::add_rn`]; see
/// [`packs`]).
#[inline(always)]
fn packed_weight<T: Elem, const MODE: u32>() -> bool {
    const { packs(T::TYPE, mode::of(MODE)) }
}

/// Llama's cast points (`LLAMA`, or `LLAMA_OFFSET` in the vector kernels).
#[inline(always)]
fn llama<const MODE: u32>() -> bool {
    MODE == mode::LLAMA || MODE == mode::LLAMA_OFFSET
}

/// `D(offset + w)` lane-wise for each of `K` weight vectors (none mode: `D(D(offset) + w)`).
#[inline(always)]
fn offset_weight<T: Elem, const K: usize>(wv: &mut [V16; K], offset: f32) {
    let off = T::pack(&[offset; 8]);
    unroll::<K>(|k| wv[k] = T::add_rn(wv[k], off));
}

/// Per-row inverse RMS from this thread's part `part` of the row's sum of squares, with the
/// mode's cast points (block-wide: every thread of the block calls it and gets the same value).
///
/// In llama and gemma the squares are exact f32 products, as in the f64 reference, so a row
/// whose f32 sum overflows (largest |x| beyond ~2⁶⁴/√cols: f32 rows, or bf16 rows near the
/// bf16 maximum) must not give r = 0. Alongside the plain sum the block sums the parts scaled
/// by `s²` (`s` = [`RESCALE`]): `part·s·s`, or when `part` itself overflowed, `scaled(s)`, this
/// thread's `Σ(x·s)²` recomputed from its values (a thread-local branch, no barrier). When the
/// plain sum is ∞, `r = s / √(S/n)` from the scaled sum `S` (`eps·s²` is far below its last
/// bit). A row holding ±∞ keeps an infinite `S` (r = 0) and NaN stays NaN, as in the
/// reference. In none mode the squares are rounded to `T` (∞ on overflow, as in the
/// reference) and the plain sum is used.
#[inline(always)]
fn inverse_rms<T: Elem, const MODE: u32>(
    part: f32,
    scaled: impl FnOnce(f32) -> f32,
    cols: usize,
    eps: f32,
    parity: usize,
) -> f32 {
    if MODE == mode::NONE {
        let mean = T::round(block_sum(part, parity) / cols as f32);
        return T::round(1.0 / T::round(sqrt(T::round(mean + T::round(eps)))));
    }
    let part_scaled = if part == f32::INFINITY {
        scaled(RESCALE)
    } else {
        part * RESCALE * RESCALE
    };
    let (sum_sq, sum_scaled) = block_sum2(part, part_scaled, parity);
    if sum_sq == f32::INFINITY {
        return RESCALE * (1.0 / sqrt(sum_scaled / cols as f32));
    }
    1.0 / sqrt(sum_sq / cols as f32 + eps)
}

/// A forward's arguments, as its entry point receives them (sizes as `usize`). The fused
/// add's kernels (`ADD`) normalise `s = D(x + res)` and write it to `s`; the others leave `res`
/// and `s` null.
#[derive(Clone, Copy)]
struct Fwd<T> {
    x: *const T,
    x_stride: usize,
    res: *const T,
    res_stride: usize,
    s: *mut T,
    s_stride: usize,
    w: *const T,
    y: *mut T,
    y_stride: usize,
    rstd: *mut f32,
    rows: usize,
    cols: usize,
    eps: f32,
    offset: f32,
}

/// A backward's arguments, as its entry point receives them (sizes as `usize`). The fused
/// add's kernels (`ADD`) add the sum's incoming gradient `ds` to dX before rounding it; the
/// others leave `ds` null.
#[derive(Clone, Copy)]
struct Bwd<T> {
    dy: *const T,
    dy_stride: usize,
    ds: *const T,
    ds_stride: usize,
    x: *const T,
    x_stride: usize,
    w: *const T,
    rstd: *const f32,
    dx: *mut T,
    dx_stride: usize,
    dw_partial: *mut f32,
    rows: usize,
    cols: usize,
    offset: f32,
}

/// The scalar forward; `ADD` first writes the row's sum `s = D(x + res)` to `s`, then
/// normalises `s` as RMSNorm normalises `x` (the same code, so RMSNorm's compiles as it did
/// before the fused add). Each thread reads back only the elements of `s` it wrote, so `s`
/// may be `x` or `res`.
#[inline(always)]
unsafe fn forward<T: Elem, const MODE: u32, const ADD: bool>(a: Fwd<T>) {
    // One line for the struct, not one per field (rustfmt's layout of a struct pattern).
    #[rustfmt::skip]
    let Fwd { x, x_stride, res, res_stride, s, s_stride, w, y, y_stride, rstd, rows, cols, eps, offset } = a;
    // `ADD`: the row normalised is the sum.
    let (add_x, add_x_stride) = (x, x_stride);
    let (x, x_stride) = match ADD {
        true => (s.cast_const(), s_stride),
        false => (x, x_stride),
    };
    let (tid, nt) = (thread_idx(), block_dim());
    let mut row = block_idx();
    let mut parity = 0;
    while row < rows {
        if ADD {
            let xa = unsafe { add_x.add(row * add_x_stride) };
            let ra = unsafe { res.add(row * res_stride) };
            let sr = unsafe { s.add(row * s_stride) };
            let mut c = tid;
            while c < cols {
                let sum = unsafe { (*xa.add(c)).to_f32() + (*ra.add(c)).to_f32() };
                unsafe { *sr.add(c) = T::from_f32(sum) };
                c += nt;
            }
        }
        let xr = unsafe { x.add(row * x_stride) };
        let yr = unsafe { y.add(row * y_stride) };
        let mut acc = 0.0f32;
        let mut c = tid;
        while c < cols {
            let v = unsafe { *xr.add(c) }.to_f32();
            acc += if MODE == mode::NONE {
                T::round(v * v)
            } else {
                v * v
            };
            c += nt;
        }
        let scaled = |s: f32| {
            let (mut sum, mut c) = (0.0f32, tid);
            while c < cols {
                let v = unsafe { *xr.add(c) }.to_f32() * s;
                sum += v * v;
                c += nt;
            }
            sum
        };
        let r = inverse_rms::<T, MODE>(acc, scaled, cols, eps, parity);
        parity ^= 1;
        if tid == 0 {
            unsafe { *rstd.add(row) = r };
        }
        let mut c = tid;
        while c < cols {
            let v = unsafe { *xr.add(c) }.to_f32();
            let out = if w.is_null() {
                v * r
            } else {
                let wc = unsafe { *w.add(c) }.to_f32();
                match MODE {
                    mode::LLAMA => T::round(v * r) * (offset + wc),
                    mode::GEMMA => v * r * (offset + wc),
                    _ => T::round(v * r) * T::round(T::round(offset) + wc),
                }
            };
            unsafe { *yr.add(c) = T::from_f32(out) };
            c += nt;
        }
        row += grid_dim();
    }
}

/// `m = dy · (w + offset)` with the mode's cast points (w = 1, offset = 0 without a weight).
#[inline(always)]
fn scaled_grad<T: Elem, const MODE: u32>(dy: f32, w: Option<f32>, offset: f32) -> f32 {
    match (w, MODE) {
        (None, _) => dy,
        (Some(wc), mode::LLAMA | mode::LLAMA_OFFSET) => T::round(dy * (wc + offset)),
        (Some(wc), mode::GEMMA) => dy * (wc + offset),
        (Some(wc), _) => T::round(dy * T::round(wc + T::round(offset))),
    }
}

/// The scalar backward; `DW` accumulates the weight's dW partial row (see [`computes_dw`]),
/// `ADD` adds `ds` to each dX element before rounding it (read by the thread that then writes
/// that element, so `dx` may be `ds`).
#[inline(always)]
unsafe fn backward<T: Elem, const MODE: u32, const DW: bool, const ADD: bool>(a: Bwd<T>) {
    // One line for the fields, not one per field (rustfmt's layout of a struct pattern).
    #[rustfmt::skip]
    let Bwd {
        dy, dy_stride, ds, ds_stride, x, x_stride, w, rstd, dx, dx_stride, dw_partial, rows,
        cols, offset,
    } = a;
    let (tid, nt) = (thread_idx(), block_dim());
    // `wrapping_add`: `dw_partial` is null without dW, and `add` off null is undefined.
    let part = dw_partial.wrapping_add(block_idx() * cols);
    let load_w = |c: usize| {
        if w.is_null() {
            None
        } else {
            Some(unsafe { *w.add(c) }.to_f32())
        }
    };
    let mut first = true;
    let mut row = block_idx();
    let mut parity = 0;
    while row < rows {
        let dyr = unsafe { dy.add(row * dy_stride) };
        let xr = unsafe { x.add(row * x_stride) };
        let dxr = unsafe { dx.add(row * dx_stride) };
        let r = unsafe { *rstd.add(row) };
        let mut acc = 0.0f32;
        let mut c = tid;
        while c < cols {
            let g = unsafe { *dyr.add(c) }.to_f32();
            let v = unsafe { *xr.add(c) }.to_f32();
            acc += scaled_grad::<T, MODE>(g, load_w(c), offset) * (v * r);
            c += nt;
        }
        let mean = block_sum(acc, parity) / cols as f32;
        parity ^= 1;
        let mut c = tid;
        while c < cols {
            let g = unsafe { *dyr.add(c) }.to_f32();
            let v = unsafe { *xr.add(c) }.to_f32();
            let wc = load_w(c);
            let m = scaled_grad::<T, MODE>(g, wc, offset);
            let mut out = r * (m - mean * (v * r));
            if ADD {
                out += unsafe { *ds.add(row * ds_stride + c) }.to_f32();
            }
            unsafe { *dxr.add(c) = T::from_f32(out) };
            if DW && wc.is_some() {
                let normed = if MODE == mode::LLAMA {
                    T::round(v * r)
                } else {
                    v * r
                };
                let contrib = g * normed;
                let slot = unsafe { part.add(c) };
                unsafe { *slot = if first { contrib } else { *slot + contrib } };
            }
            c += nt;
        }
        first = false;
        row += grid_dim();
    }
}

/// Loads this thread's `K` vectors of a row (vectors past `vecs` read as zeros).
#[inline(always)]
unsafe fn load_row<const K: usize>(row: *const V16, vecs: usize) -> [V16; K] {
    let (tid, nt) = (thread_idx(), block_dim());
    let mut v = [V16::ZERO; K];
    unroll::<K>(|k| {
        let j = tid + k * nt;
        if j < vecs {
            v[k] = unsafe { V16::load(row.add(j)) };
        }
    });
    v
}

/// Stores `out(k)` as this thread's `k`-th vector of a row (vectors past `vecs` skipped).
#[inline(always)]
unsafe fn store_row<const K: usize>(row: *mut V16, vecs: usize, out: impl Fn(usize) -> V16) {
    let (tid, nt) = (thread_idx(), block_dim());
    unroll::<K>(|k| {
        let j = tid + k * nt;
        if j < vecs {
            unsafe { out(k).store(row.add(j)) };
        }
    });
}

/// The vector forward: `ONE` runs one row per block (`_vw{K}`), else a resident grid walks the
/// rows (`_v{K}`). `ADD` loads `x` and `res`, normalises their packed sum `s = D(x + res)` from
/// registers and stores it to `s` (the same thread loaded those elements of `x` and `res`
/// first, and no other thread touches them, so `s` may be `x` or `res`; a prefetched next row
/// is another row).
#[inline(always)]
unsafe fn forward_vec<
    T: Elem,
    const MODE: u32,
    const K: usize,
    const ONE: bool,
    const ADD: bool,
>(
    a: Fwd<T>,
) {
    // One line for the struct, not one per field (rustfmt's layout of a struct pattern).
    #[rustfmt::skip]
    let Fwd { x, x_stride, res, res_stride, s, s_stride, w, y, y_stride, rstd, rows, cols, eps, offset } = a;
    let tid = thread_idx();
    let vecs = cols / T::LANES;
    let has_w = !w.is_null();
    // The packed product holds `w'` in registers; the per-lane one re-reads w each row (an L1
    // hit), so the grid-stride kernels do not hold its widened lanes across rows.
    let packed = has_w && packed_weight::<T, MODE>();
    let mut wv = [V16::ZERO; K];
    if packed {
        wv = unsafe { load_row::<K>(w as *const V16, vecs) };
        offset_weight::<T, K>(&mut wv, offset);
    }
    let load_x = |row: usize| match row < rows {
        true => unsafe { load_row::<K>(x.add(row * x_stride) as *const V16, vecs) },
        false => [V16::ZERO; K],
    };
    // The residual `res` (`ADD`), loaded alongside `x`.
    let load_r = |row: usize| match ADD && row < rows {
        true => unsafe { load_row::<K>(res.add(row * res_stride) as *const V16, vecs) },
        false => [V16::ZERO; K],
    };
    let mut row = block_idx();
    let mut parity = 0;
    let mut next = load_x(row);
    let mut next_r = load_r(row);
    while row < rows {
        // The next row's loads are issued before this row's reduction, so they are in flight
        // while this block waits at its barrier and stores (`ONE`: no next row).
        let mut xv = next;
        if ADD {
            unroll::<K>(|k| xv[k] = T::add_rn(xv[k], next_r[k]));
            let sr = unsafe { s.add(row * s_stride) } as *mut V16;
            unsafe { store_row::<K>(sr, vecs, |k| xv[k]) };
        }
        if !ONE {
            next = load_x(row + grid_dim());
            next_r = load_r(row + grid_dim());
        }
        let mut acc = 0.0f32;
        unroll::<K>(|k| {
            lanes::<T, V16>(|i| {
                let e = T::lane(&xv[k], i);
                acc = if MODE == mode::NONE {
                    acc + T::round(e * e)
                } else {
                    fma(e, e, acc)
                };
            })
        });
        let scaled = |s: f32| {
            let mut sum = 0.0f32;
            unroll::<K>(|k| {
                lanes::<T, V16>(|i| {
                    let v = T::lane(&xv[k], i) * s;
                    sum = fma(v, v, sum);
                })
            });
            sum
        };
        let r = inverse_rms::<T, MODE>(acc, scaled, cols, eps, parity);
        parity ^= 1;
        if tid == 0 {
            unsafe { *rstd.add(row) = r };
        }
        let yr = unsafe { y.add(row * y_stride) } as *mut V16;
        // `D(x·r)` of vector `k`, packed.
        let normed = |k: usize| {
            let mut h = [0.0f32; 8];
            lanes::<T, V16>(|i| h[i] = T::lane(&xv[k], i) * r);
            T::pack(&h)
        };
        // One uniform branch per row, each arm straight-line code.
        match (has_w, packed) {
            (false, _) => unsafe { store_row::<K>(yr, vecs, normed) },
            (true, true) => unsafe { store_row::<K>(yr, vecs, |k| T::mul_rn(normed(k), wv[k])) },
            (true, false) => unsafe {
                let wv = load_row::<K>(w as *const V16, vecs);
                store_row::<K>(yr, vecs, |k| {
                    let mut out = [0.0f32; 8];
                    lanes::<T, V16>(|i| {
                        let v = T::lane(&xv[k], i);
                        let wc = T::lane(&wv[k], i);
                        out[i] = match llama::<MODE>() {
                            true => T::round(v * r) * (offset + wc),
                            false => v * r * (offset + wc),
                        };
                    });
                    T::pack(&out)
                })
            },
        }
        if ONE {
            return;
        }
        row += grid_dim();
    }
}

/// The vector backward. Its dW partial row lives in registers (`SMEM_DW = false`: `K × 8`
/// f32 per thread) or in shared memory after the [`SUM_SLOTS`] reduction slots (`SMEM_DW =
/// true`: `cols` f32 per block; each thread owns the columns of its vectors, so no barrier
/// guards them).
/// Shared memory frees those registers, which raises the resident blocks of some shapes (bf16
/// 4096: 2 → 4 per SM, 8192: 1 → 2) and costs a shared-memory round trip per element; the host
/// runs it only where it fits more blocks per SM and every block gets many rows (`shared_dw`
/// in src/rms_norm/plan.rs). Without `DW` (the `bwd_dx` kernels, [`computes_dw`]) the dW sums are
/// never stored, so the compiler drops them and their registers (bf16 `_v2`: 55 registers
/// against 83–104 with dW).
#[inline(always)]
unsafe fn backward_vec<
    T: Elem,
    const MODE: u32,
    const K: usize,
    const SMEM_DW: bool,
    const DW: bool,
    const ADD: bool,
>(
    a: Bwd<T>,
) {
    // One line for the fields, not one per field (rustfmt's layout of a struct pattern).
    #[rustfmt::skip]
    let Bwd {
        dy, dy_stride, x, x_stride, w, rstd, dx, dx_stride, dw_partial, rows, cols, offset, ds,
        ds_stride,
    } = a;
    // f32 with dW in registers (`_v2`, the f32 rows above 512 columns): the dW reduction may
    // be launched at once, its launch hidden behind this grid (16384×2048 on an H200: −2.6 µs;
    // the 16-bit kernels lost up to 0.7 µs with it: PERFORMANCE.md, "sm_90: dependent launch and
    // dW clusters"). `& DW`: no reduction follows the `bwd_dx` kernels, and `&` adds no branch
    // (the `DW` kernels' code stays that of a condition without it).
    if T::LANES == 4 && K == 2 && !SMEM_DW & DW {
        allow_dependent_grids();
    }
    let (tid, nt) = (thread_idx(), block_dim());
    let vecs = cols / T::LANES;
    let has_w = !w.is_null();
    // Without a weight, w = 1 and offset = 0 give m = dy exactly in every mode, with no
    // per-element test (the host runs the `DW = false` kernels then).
    let ones = T::pack(&[1.0; 8]);
    let offset = if has_w { offset } else { 0.0 };
    // m = D(dy·D(offset + w)) as one packed product where that is the mode's m (llama with
    // `offset + w` exact in T, none); gemma keeps m in f32.
    let packed = MODE != mode::GEMMA && packed_weight::<T, MODE>();
    let off = T::pack(&[offset; 8]);
    let mut dw_acc = [[0.0f32; 8]; K];
    let dw_s =
        unsafe { core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>().add(SUM_SLOTS) };
    // This thread's slots (8 f32: two vectors of 4) for its `k`-th vector's columns.
    let own = |k: usize| unsafe { dw_s.add((tid + k * nt) * T::LANES) } as *mut V16;
    if SMEM_DW && has_w {
        unroll::<K>(|k| {
            if tid + k * nt < vecs {
                unsafe { V16::ZERO.store(own(k)) };
                if T::LANES == 8 {
                    unsafe { V16::ZERO.store(own(k).add(1)) };
                }
            }
        });
    }
    let mut row = block_idx();
    let mut parity = 0;
    while row < rows {
        let gv = unsafe { load_row::<K>(dy.add(row * dy_stride) as *const V16, vecs) };
        let xv = unsafe { load_row::<K>(x.add(row * x_stride) as *const V16, vecs) };
        // w is re-read every row (an L1 hit) rather than held in registers.
        let wv = if has_w {
            unsafe { load_row::<K>(w as *const V16, vecs) }
        } else {
            [ones; K]
        };
        let wc = |k: usize, i: usize| Some(T::lane(&wv[k], i));
        let r = unsafe { *rstd.add(row) };
        // Before the barrier: the dot product, this row's dW contribution, and m. m is a value
        // of T (exact when packed) except in gemma mode, so it crosses the barrier packed in
        // place of dy and is not recomputed; in gemma it is recomputed from dy.
        let packed_m = MODE != mode::GEMMA;
        let mut mv = [V16::ZERO; K];
        if packed {
            unroll::<K>(|k| mv[k] = T::mul_rn(gv[k], T::add_rn(wv[k], off)));
        }
        let mut acc = 0.0f32;
        unroll::<K>(|k| {
            let mut m = [0.0f32; 8];
            let in_smem = SMEM_DW && has_w && tid + k * nt < vecs;
            let (lo, hi) = match in_smem {
                true => unsafe {
                    let hi = if T::LANES == 8 {
                        V16::load(own(k).add(1))
                    } else {
                        V16::ZERO
                    };
                    (V16::load(own(k)), hi)
                },
                false => (V16::ZERO, V16::ZERO),
            };
            lanes::<T, V16>(|i| {
                let (g, h) = (T::lane(&gv[k], i), T::lane(&xv[k], i) * r);
                m[i] = match packed {
                    true => T::lane(&mv[k], i),
                    false => scaled_grad::<T, MODE>(g, wc(k, i), offset),
                };
                acc = fma(m[i], h, acc);
                let normed = if llama::<MODE>() { T::round(h) } else { h };
                let old = match (SMEM_DW, i < 4) {
                    (false, _) => dw_acc[k][i],
                    (true, true) => f32::lane(&lo, i),
                    (true, false) => f32::lane(&hi, i - 4),
                };
                dw_acc[k][i] = fma(g, normed, old);
            });
            if in_smem {
                let d = &dw_acc[k];
                unsafe { f32::pack::<V16>(d).store(own(k)) };
                if T::LANES == 8 {
                    let d_hi = [d[4], d[5], d[6], d[7], 0.0, 0.0, 0.0, 0.0];
                    unsafe { f32::pack::<V16>(&d_hi).store(own(k).add(1)) };
                }
            }
            if packed_m && !packed {
                mv[k] = T::pack(&m);
            }
        });
        let mean = block_sum(acc, parity) / cols as f32;
        parity ^= 1;
        let dxr = unsafe { dx.add(row * dx_stride) } as *mut V16;
        if ADD {
            // dX plus the sum's gradient, rounded once. A loop of its own, so that RMSNorm's
            // (below) compiles as it did before the fused add existed. Each thread reads its
            // elements of `ds` before writing the same elements of `dx`, so `dx` may be `ds`.
            let dsr = unsafe { ds.add(row * ds_stride) } as *const V16;
            unroll::<K>(|k| {
                let j = tid + k * nt;
                if j < vecs {
                    let d = unsafe { V16::load(dsr.add(j)) };
                    let mut out = [0.0f32; 8];
                    lanes::<T, V16>(|i| {
                        let m = if packed_m {
                            T::lane(&mv[k], i)
                        } else {
                            scaled_grad::<T, MODE>(T::lane(&gv[k], i), wc(k, i), offset)
                        };
                        out[i] = r * fma(-mean, T::lane(&xv[k], i) * r, m) + T::lane(&d, i);
                    });
                    unsafe { T::pack::<V16>(&out).store(dxr.add(j)) };
                }
            });
            row += grid_dim();
            continue;
        }
        unroll::<K>(|k| {
            let j = tid + k * nt;
            if j < vecs {
                let mut out = [0.0f32; 8];
                lanes::<T, V16>(|i| {
                    let m = if packed_m {
                        T::lane(&mv[k], i)
                    } else {
                        scaled_grad::<T, MODE>(T::lane(&gv[k], i), wc(k, i), offset)
                    };
                    out[i] = r * fma(-mean, T::lane(&xv[k], i) * r, m);
                });
                unsafe { T::pack::<V16>(&out).store(dxr.add(j)) };
            }
        });
        row += grid_dim();
    }
    // `&`, not `&&`: no branch of its own, so the `DW` kernels' code is that of `if has_w`.
    if has_w & DW {
        #[cfg(target_feature = "sm_90")]
        if SMEM_DW && cluster_blocks() > 1 {
            unsafe { write_cluster_partial(dw_s, dw_partial, cols) };
            return;
        }
        let part = unsafe { dw_partial.add(block_idx() * cols) };
        unroll::<K>(|k| {
            let j = tid + k * nt;
            if j < vecs {
                let p = unsafe { part.add(j * T::LANES) } as *mut V16;
                let (lo, hi) = if SMEM_DW {
                    let hi = if T::LANES == 8 {
                        unsafe { V16::load(own(k).add(1)) }
                    } else {
                        V16::ZERO
                    };
                    (unsafe { V16::load(own(k)) }, hi)
                } else {
                    let a = &dw_acc[k];
                    (
                        f32::pack(&[a[0], a[1], a[2], a[3], 0.0, 0.0, 0.0, 0.0]),
                        f32::pack(&[a[4], a[5], a[6], a[7], 0.0, 0.0, 0.0, 0.0]),
                    )
                };
                unsafe { lo.store(p) };
                if T::LANES == 8 {
                    unsafe { hi.store(p.add(1)) };
                }
            }
        });
    }
}

/// The dW partial row of this block's cluster (row `block_idx() / cluster_blocks()` of
/// `dw_partial`) from its blocks' rows in shared memory (`dw_s`, `cols` f32 each): block `r`
/// of the cluster sums column slice `r` over the blocks in rank order, so the row's bits depend
/// only on the grid and the cluster size. Half the partial rows with clusters of two: they are
/// written in one burst as the persistent grid ends, and the reduction reads every one (bf16
/// 16384×2048: −1.3 µs per backward in a CUDA C stand-in, PERFORMANCE.md, "sm_90: dependent
/// launch and dW clusters").
/// Every thread of the block calls it.
#[cfg(target_feature = "sm_90")]
#[inline(always)]
unsafe fn write_cluster_partial(dw_s: *const f32, dw_partial: *mut f32, cols: usize) {
    let (blocks, rank) = (cluster_blocks(), cluster_rank());
    let (tid, nt) = (thread_idx(), block_dim());
    // Every block's row is complete here, and stays readable until the second barrier.
    cluster_sync();
    let vecs = cols / f32::LANES;
    let per = vecs.div_ceil(blocks);
    let end = ((rank + 1) * per).min(vecs);
    let part = unsafe { dw_partial.add(block_idx() / blocks * cols) } as *mut V16;
    let mut v = rank * per + tid;
    while v < end {
        let own = unsafe { dw_s.add(v * f32::LANES) } as *const V16;
        let mut sum = [0.0f32; 8];
        let mut q = 0;
        while q < blocks {
            let w = unsafe { load_from_cluster_block(own, q) };
            lanes::<f32, V16>(|i| sum[i] += f32::lane(&w, i));
            q += 1;
        }
        unsafe { f32::pack::<V16>(&sum).store(part.add(v)) };
        v += nt;
    }
    cluster_sync();
}

/// Loads of partial rows each thread of the dW reduction has in flight.
const DW_UNROLL: usize = 8;

/// `dw[c] = D(Σ_b partial[b][c])` in a fixed order (deterministic).
///
/// Block `(nx, ny)`: `threadIdx.x` picks one of `nx` consecutive columns (coalesced runs of the
/// partial rows), `threadIdx.y` sums parts `y, y + ny, …` of it — `ny` independent streams per
/// column instead of one serial walk over hundreds of parts, each issuing [`DW_UNROLL`] loads
/// before adding them in part order — and the `ny` sums are added in `y` order through shared
/// memory (`nx·ny` f32). The partials are L2-resident (just written), so the reduction is bound
/// by load latency, not bandwidth.
#[inline(always)]
unsafe fn dw_reduce<T: Elem>(partial: *const f32, parts: usize, cols: usize, dw: *mut T) {
    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>();
    let (x, nx, y, ny) = (thread_idx(), block_dim(), thread_idx_y(), block_dim_y());
    let c = block_idx() * nx + x;
    let mut acc = 0.0f32;
    if c < cols {
        // Offsets from the column's first part, in wrapping 32-bit arithmetic: a loaded part's
        // offset is `< parts × cols ≤ 2²⁶` (the host's cap whenever there are two or more
        // parts) or 0, so it is exact even where an unused one wraps.
        let col = unsafe { partial.add(c) };
        let step = (ny as u32).wrapping_mul(cols as u32);
        let mut p = y;
        while p < parts {
            let mut v = [0.0f32; DW_UNROLL];
            let at = (p as u32).wrapping_mul(cols as u32);
            unroll::<DW_UNROLL>(|i| {
                if p + i * ny < parts {
                    let off = at.wrapping_add((i as u32).wrapping_mul(step));
                    v[i] = unsafe { *col.add(off as usize) };
                }
            });
            unroll::<DW_UNROLL>(|i| {
                if p + i * ny < parts {
                    acc += v[i];
                }
            });
            p += DW_UNROLL * ny;
        }
    }
    unsafe { *smem.add(y * nx + x) = acc };
    sync_threads();
    if y == 0 && c < cols {
        let mut total = 0.0f32;
        let mut i = 0;
        while i < ny {
            let mut v = [0.0f32; DW_UNROLL];
            unroll::<DW_UNROLL>(|j| {
                if i + j < ny {
                    v[j] = unsafe { *smem.add((i + j) * nx + x) };
                }
            });
            unroll::<DW_UNROLL>(|j| {
                if i + j < ny {
                    total += v[j];
                }
            });
            i += DW_UNROLL;
        }
        unsafe { *dw.add(c) = T::from_f32(total) };
    }
}

/// Whether a forward `layout` runs one row per block (`ONE` of [`forward_vec`]).
const fn one_row(layout: RmsNormLayout) -> bool {
    matches!(layout, RmsNormLayout::Whole)
}

/// Whether a backward `layout` keeps dW in shared memory (`SMEM_DW` of [`backward_vec`]).
const fn shared_dw(layout: RmsNormLayout) -> bool {
    matches!(layout, RmsNormLayout::SharedDw)
}

/// Whether a backward `pass` accumulates dW partial rows (`DW` of [`backward`] and
/// [`backward_vec`]): [`NormPass::Backward`] does, the dX-only pass does not.
const fn computes_dw(pass: NormPass) -> bool {
    matches!(pass, NormPass::Backward)
}

/// Whether `input` is the fused residual add's sum (`ADD` of the forward and backward bodies).
const fn adds(input: NormInput) -> bool {
    matches!(input, NormInput::Add)
}

/// One entry point named `$name`: one [`Params`] block by value (`ld.param` loads, no local
/// copy) as `$p`, running `$call`; `$doc` is its summary, `$safety` what the caller guarantees.
macro_rules! entry {
    ($name:expr, $doc:literal, $safety:literal, |$p:ident| $call:expr) => {
        const _: () = {
            #[doc = $doc]
            ///
            /// # Safety
            #[doc = $safety]
            #[unsafe(export_name = $name)]
            // A `#[repr(C)]` struct of integers and floats: the PTX parameter is its bytes.
            #[allow(improper_gpu_kernel_arg)]
            pub unsafe extern "gpu-kernel" fn kernel($p: Params) {
                unsafe { $call }
            }
        };
    };
}

/// One forward entry point (see [`entry`]) of input `$input`: `$body` is the generic body
/// (`forward::<T, MODE, ADD>` or `forward_vec::<T, MODE, K, …>`) of element type `$ty`. The
/// fused add's forward reads `r` and writes `s`, both at `x`'s stride.
macro_rules! fwd_entry {
    ($input:ident, $name:expr, $ty:ty, $body:expr, $doc:literal, $safety:literal) => {
        entry!($name, $doc, $safety, |p| {
            let add = adds(NormInput::$input);
            $body(Fwd::<$ty> {
                x: p.x as *const $ty,
                x_stride: p.x_stride as usize,
                res: if add {
                    p.r as *const $ty
                } else {
                    core::ptr::null()
                },
                res_stride: if add { p.x_stride as usize } else { 0 },
                s: if add {
                    p.s as *mut $ty
                } else {
                    core::ptr::null_mut()
                },
                s_stride: if add { p.x_stride as usize } else { 0 },
                w: p.w as *const $ty,
                y: p.y as *mut $ty,
                y_stride: p.y_stride as usize,
                rstd: p.rstd as *mut f32,
                rows: p.rows as usize,
                cols: p.cols as usize,
                eps: p.eps,
                offset: p.offset,
            })
        });
    };
}

/// One backward entry point (see [`fwd_entry`]); the fused add's backward reads `ds` at `dy`'s
/// stride.
macro_rules! bwd_entry {
    ($input:ident, $name:expr, $ty:ty, $body:expr, $doc:literal, $safety:literal) => {
        entry!($name, $doc, $safety, |p| {
            let add = adds(NormInput::$input);
            $body(Bwd::<$ty> {
                dy: p.dy as *const $ty,
                dy_stride: p.y_stride as usize,
                ds: if add {
                    p.ds as *const $ty
                } else {
                    core::ptr::null()
                },
                ds_stride: if add { p.y_stride as usize } else { 0 },
                x: p.x as *const $ty,
                x_stride: p.x_stride as usize,
                w: p.w as *const $ty,
                rstd: p.rstd as *const f32,
                dx: p.dx as *mut $ty,
                dx_stride: p.y_stride as usize,
                dw_partial: p.dw_partial as *mut f32,
                rows: p.rows as usize,
                cols: p.cols as usize,
                offset: p.offset,
            })
        });
    };
}

/// The scalar kernels of one element type and casting mode (RMSNorm's and the fused residual
/// add's), and the element type's dW reduction.
macro_rules! rms_norm_kernels {
    (@fwd $elem:ident, $mode:ident, $input:ident, $doc:literal, $safety:literal) => {
        fwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input Forward, Scalar, $elem, $mode),
            elem_type!($elem),
            forward::<elem_type!($elem), { Mode::$mode as u32 }, { adds(NormInput::$input) }>,
            $doc,
            $safety
        );
    };
    (@bwd $elem:ident, $mode:ident, $input:ident $pass:ident, $doc:literal, $safety:literal) => {
        bwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input $pass, Scalar, $elem, $mode),
            elem_type!($elem),
            backward::<
                elem_type!($elem),
                { Mode::$mode as u32 },
                { computes_dw(NormPass::$pass) },
                { adds(NormInput::$input) },
            >,
            $doc,
            $safety
        );
    };
    ($elem:ident: $($mode:ident),*) => {
        $(
            rms_norm_kernels!(@fwd $elem, $mode, Plain,
                "RMSNorm forward for one dtype and casting mode (see the module docs).",
                "Pointers cover `rows` rows of their strides and `cols` columns; `w` may be null.");
            rms_norm_kernels!(@fwd $elem, $mode, Add,
                "Fused residual add and RMSNorm forward: `s = D(x + r)`, then RMSNorm of `s`.",
                "As the RMSNorm forward; `s` may equal `x` or `r` (same strides).");
            rms_norm_kernels!(@bwd $elem, $mode, Plain Backward,
                "RMSNorm backward for one dtype and casting mode (see the module docs).",
                "As the forward; `dx` may equal `dy`; `dw_partial` holds `gridDim.x × cols` f32 when `w` is not null.");
            rms_norm_kernels!(@bwd $elem, $mode, Plain BackwardDx,
                "RMSNorm backward of dX alone for one dtype and casting mode (see the module docs).",
                "As the forward; `dx` may equal `dy`; `dw_partial` is not used.");
            rms_norm_kernels!(@bwd $elem, $mode, Add Backward,
                "Fused residual add and RMSNorm backward: `D(dX + ds)` and dW partial rows.",
                "As the RMSNorm backward; `dx` may equal `dy` or `ds` (same strides).");
            rms_norm_kernels!(@bwd $elem, $mode, Add BackwardDx,
                "Fused residual add and RMSNorm backward of `D(dX + ds)` alone (no dW).",
                "As the RMSNorm backward; `dx` may equal `dy` or `ds`; `dw_partial` is not used.");
        )*
        entry!(
            kernel_name!(RmsNorm, DwReduce, $elem),
            "Sums the per-block dW partial rows into `dw` (see the module docs).",
            "`dw_partial` holds `parts × cols` f32; `dw` holds `cols` elements.",
            |p| {
                wait_for_prerequisite_grids();
                dw_reduce(
                    p.dw_partial as *const f32,
                    p.parts as usize,
                    p.cols as usize,
                    p.dw as *mut elem_type!($elem),
                )
            }
        );
    };
}

rms_norm_kernels!(F32: Llama, Gemma, None);
rms_norm_kernels!(F16: Llama, Gemma, None);
rms_norm_kernels!(Bf16: Llama, Gemma, None);

/// The vector kernels of one element type and mode: forward with 1, 2, 4 vectors per thread
/// (grid-stride `_v{K}`, one row per block `_vw{K}` for K = 2, 4), backward with 1 and 2 (its
/// dW accumulators need the registers), `_vs1` and where `shared` ([`has_shared_dw`]) `_vs2`,
/// and the dX-only backward `bwd_dx` with 1 and 2 (dW in neither registers nor shared memory);
/// then the same set for the fused residual add.
macro_rules! rms_norm_vec_family {
    ($elem:ident, $mode:ident, shared = $shared:tt) => {
        const _: () = assert!(has_shared_dw(ElemType::$elem, 2) == $shared);
        rms_norm_vec_family!(@inputs $elem, $mode, $shared, Plain);
        rms_norm_vec_family!(@inputs $elem, $mode, $shared, Add);
    };
    // One set of kernels: RMSNorm's, or the fused add's (the same shapes).
    (@inputs $elem:ident, $mode:ident, $shared:tt, $input:ident) => {
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Resident 1);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Resident 2);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Resident 4);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Whole 2);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Whole 4);
        rms_norm_vec_family!(@bwd $elem, $mode, $input Backward, Resident 1);
        rms_norm_vec_family!(@bwd $elem, $mode, $input Backward, Resident 2);
        rms_norm_vec_family!(@bwd $elem, $mode, $input Backward, SharedDw 1);
        rms_norm_vec_family!(@if $shared, @bwd $elem, $mode, $input Backward, SharedDw 2);
        rms_norm_vec_family!(@bwd $elem, $mode, $input BackwardDx, Resident 1);
        rms_norm_vec_family!(@bwd $elem, $mode, $input BackwardDx, Resident 2);
    };
    (@if true, $($rest:tt)*) => {
        rms_norm_vec_family!($($rest)*);
    };
    (@if false, $($rest:tt)*) => {};
    (@fwd $elem:ident, $mode:ident, $input:ident, $layout:ident $k:literal) => {
        fwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input Forward, $layout $k, $elem, $mode),
            elem_type!($elem),
            forward_vec::<
                elem_type!($elem),
                { Mode::$mode as u32 },
                $k,
                { one_row(RmsNormLayout::$layout) },
                { adds(NormInput::$input) },
            >,
            "Vectorised RMSNorm forward (`K` vectors of 16 bytes per thread, see the module docs; `_vw`: one row per block, the grid covers every row; `add_fwd`: the fused residual add).",
            "As the scalar forward, and every row of `x` and `y` and `w` start 16-byte aligned with `cols` a multiple of the lanes per vector."
        );
    };
    (@bwd $elem:ident, $mode:ident, $input:ident $pass:ident, $layout:ident $k:literal) => {
        bwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input $pass, $layout $k, $elem, $mode),
            elem_type!($elem),
            backward_vec::<
                elem_type!($elem),
                { Mode::$mode as u32 },
                $k,
                { shared_dw(RmsNormLayout::$layout) },
                { computes_dw(NormPass::$pass) },
                { adds(NormInput::$input) },
            >,
            "Vectorised persistent RMSNorm backward (see `backward_vec`; `_vs`: dW in shared memory; `bwd_dx`: no dW, `dw_partial` not used; `add_`: the fused residual add's, `D(dX + ds)`).",
            "As the scalar backward, with the forward's alignment rules for `dy`, `x`, `w`, `dx`."
        );
    };
}

rms_norm_vec_family!(F32, Llama, shared = false);
rms_norm_vec_family!(F32, Gemma, shared = false);
rms_norm_vec_family!(F32, None, shared = false);
rms_norm_vec_family!(F16, Llama, shared = true);
rms_norm_vec_family!(F16, LlamaOffset, shared = true);
rms_norm_vec_family!(F16, Gemma, shared = true);
rms_norm_vec_family!(F16, None, shared = true);
rms_norm_vec_family!(Bf16, Llama, shared = true);
rms_norm_vec_family!(Bf16, LlamaOffset, shared = true);
rms_norm_vec_family!(Bf16, Gemma, shared = true);
rms_norm_vec_family!(Bf16, None, shared = true);
