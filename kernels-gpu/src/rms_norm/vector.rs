//! The vector kernels' bodies (`_v{K}`, `_vw{K}`, `_vs{K}`): rows of 16-byte vectors held in
//! registers.
use super::*;
#[cfg(target_feature = "sm_90")]
use dw::write_cluster_partial;

/// Loads this thread's `K` vectors of a row (vectors past `vecs` read as zeros).
#[inline(always)]
pub(super) unsafe fn load_row<const K: usize>(row: *const V16, vecs: usize) -> [V16; K] {
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
pub(super) unsafe fn store_row<const K: usize>(
    row: *mut V16,
    vecs: usize,
    out: impl Fn(usize) -> V16,
) {
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
pub(super) unsafe fn forward_vec<
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
pub(super) unsafe fn backward_vec<
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
