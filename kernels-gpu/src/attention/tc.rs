//! The tensor-core path (`mma.sync` m16n8k16, f32 accumulators) for 16-bit elements at
//! head_dim `D` ∈ {64, 128}, on 16-byte aligned rows (the host checks). The forward and dQ
//! kernels have four warps per block, each owning 16 query rows of the block's tile, so a row's
//! softmax statistics stay within the four lanes that share it (`shfl.xor` 1 and 2); the dK/dV
//! kernel has eight, which trade P and dS through shared memory ([`dkdv`]). Operand tiles go global → shared by `cp.async` (overlapping the
//! previous tile's math) and shared → registers by `ldmatrix` ([`super::mma`] has the
//! fragment and swizzle layouts). As FA2, probabilities (and dS) are rounded to the element
//! type before they meet V, dO, K or Q in a product.
use super::abi::fwd_key_tile;
use super::abi::{
    DKDV_QUERY_TILE, DKDV_THREADS, MMA_KEYS, MMA_ROWS, Params, THREADS, dkdv_stage_bytes,
    dq_key_tile,
};
use super::mma::{
    Lanes, commit, ldmatrix_x4, ldmatrix_x4_trans, load_tile, mma, shared_addr, swizzled, wait_all,
    wait_one_pending,
};

/// Threads of a four-warp block (the forward and dQ kernels) and of an eight-warp block (dK/dV).
const WARPS4: usize = THREADS as usize;
const WARPS8: usize = DKDV_THREADS as usize;
use super::{Half, Score, Seq, block_y, block_z, exp2, lse_of, lse_offset, lse2_for_backward};
use super::{all_lanes, offset, safe_max, shfl_xor};
use crate::{block_idx, grid_dim, sync_threads, thread_idx};

/// Calls `f(0), …, f(N − 1)` as straight-line code (`N ≤ 16`), so that register arrays indexed
/// by the argument keep constant indices.
#[inline(always)]
pub(super) fn each<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 16) };
    macro_rules! step {
        ($($i:literal)*) => { $( if N > $i { f($i); } )* };
    }
    step!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
}

/// The block's row block, last first: with a causal mask the last query rows see the most keys,
/// so their blocks start first and the short ones fill the tail.
#[inline(always)]
fn last_first() -> usize {
    grid_dim() - 1 - block_idx()
}

/// The block's dynamic shared memory as a `.shared` address.
#[inline(always)]
fn shared_base() -> u32 {
    shared_addr(core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>())
}

/// `(g, c)`: the lane's row within an 8-row group and its column pair (see [`super::mma`]).
#[inline(always)]
fn lane_parts() -> (usize, usize, usize) {
    let lane = thread_idx() & 31;
    (lane, lane >> 2, lane & 3)
}

/// A fragments of the warp's 16 rows (from `16·warp`) of a `D`-wide tile: k-step `kk` in
/// `frags[kk]` (D/16 of them; at most 8).
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
unsafe fn a_frags<const D: usize>(tile: u32, warp: usize, lane: usize) -> [[u32; 4]; 8] {
    let mut f = [[0u32; 4]; 8];
    let l = Lanes::a::<D>(lane, warp);
    each::<8>(|kk| {
        if kk < D / 16 {
            f[kk] = unsafe { ldmatrix_x4(l.at::<D>(tile, 0, kk)) };
        }
    });
    f
}

/// `acc[n] += A · Bᵀ` for the `n8` n-tiles (8 rows each) of a `D`-wide tile of B rows, A given
/// by `a(kk)` per k-step: B rows are the n dimension, their elements the k dimension
/// (`ldmatrix` without transposition: K for scores, V for dP, Q or dO for the dK/dV kernel's
/// transposed scores).
#[inline(always)]
unsafe fn mma_abt<T: Half, const D: usize>(
    acc: &mut [[f32; 4]; 8],
    tile: u32,
    lane: usize,
    n8: usize,
    mut a: impl FnMut(usize) -> [u32; 4],
) {
    let l = Lanes::b::<D>(lane);
    each::<8>(|kk| {
        if kk < D / 16 {
            let af = a(kk);
            each::<4>(|np| {
                if np < n8 / 2 {
                    let b = unsafe { ldmatrix_x4(l.at::<D>(tile, np, kk)) };
                    mma::<T>(&mut acc[2 * np], &af, b[0], b[1]);
                    mma::<T>(&mut acc[2 * np + 1], &af, b[2], b[3]);
                }
            });
        }
    });
}

/// `acc[n] += P · B` over `k16` k-steps of 16 rows of a `D`-wide tile of B rows (the k
/// dimension; their elements the n dimension: `ldmatrix.trans`), with P's accumulator tiles
/// `p` (two per k-step) packed to 16 bits as the A operand.
#[inline(always)]
unsafe fn mma_pb<T: Half, const D: usize>(
    acc: &mut [[f32; 4]; 16],
    p: &[[f32; 4]; 8],
    tile: u32,
    lane: usize,
    k16: usize,
) {
    let l = Lanes::bt::<D>(lane);
    each::<4>(|kk| {
        if kk < k16 {
            let (lo, hi) = (&p[2 * kk], &p[2 * kk + 1]);
            let a = [
                T::pack2(lo[0], lo[1]),
                T::pack2(lo[2], lo[3]),
                T::pack2(hi[0], hi[1]),
                T::pack2(hi[2], hi[3]),
            ];
            each::<8>(|dp| {
                if dp < D / 16 {
                    let b = unsafe { ldmatrix_x4_trans(l.at::<D>(tile, kk, dp)) };
                    mma::<T>(&mut acc[2 * dp], &a, b[0], b[1]);
                    mma::<T>(&mut acc[2 * dp + 1], &a, b[2], b[3]);
                }
            });
        }
    });
}

/// Stores rows `g` (`r = 0`) or `g + 8` (`r = 1`) of a warp's `D`-wide accumulator, times
/// `mul`, to the row at element `at` of `ptr`.
#[inline(always)]
unsafe fn store_row<T: Half, const D: usize>(
    acc: &[[f32; 4]; 16],
    r: usize,
    mul: f32,
    ptr: u64,
    at: usize,
    c: usize,
) {
    let p = ptr as *mut u32;
    each::<16>(|dt| {
        if dt < D / 8 {
            let w = T::pack2(acc[dt][2 * r] * mul, acc[dt][2 * r + 1] * mul);
            // SAFETY: the host checked the tensor's extent and its 16-byte alignment.
            unsafe { *p.add((at + 8 * dt + 2 * c) / 2) = w };
        }
    });
}

/// The forward's tiles: 1024-byte aligned for `wgmma`'s swizzle (the plan adds the slack).
#[inline(always)]
fn fwd_shared_base() -> u32 {
    (shared_base() + 1023) & !1023
}

/// Waits for this thread's copies, then (a barrier) for the block's: the tiles are readable
/// by the next products (through the async proxy for `wgmma`), and the products before are
/// done with the tile the next copy overwrites.
#[inline(always)]
fn fwd_landed() {
    wait_all();
    #[cfg(target_feature = "sm_90a")]
    wgmma::proxy_fence();
    sync_threads();
}

#[cfg(not(target_feature = "sm_90a"))]
use super::mma::load_tile as fwd_load_tile;
#[cfg(target_feature = "sm_90a")]
use super::wgmma::{self, load_tile as fwd_load_tile};

/// The forward of a block of [`MMA_ROWS`] query rows of one head. Built for sm_90a, its two
/// products are `wgmma` (a warpgroup's, [`super::wgmma`]) on tiles in that file's layout;
/// elsewhere `mma.sync` on tiles in [`super::mma`]'s. The online softmax is the same code on
/// the same fragments.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn forward<T: Half, const D: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const BC: usize = 64;
    const { assert!(fwd_key_tile(D as u32) as usize == BC) };
    let (tid, (_, g, c)) = (thread_idx(), lane_parts());
    let warp = tid >> 5;
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let m0 = (last_first() * MMA_ROWS as usize) as i64;
    if m0 >= s.sq {
        return;
    }
    let i1 = (m0 + MMA_ROWS as i64 - 1).min(s.sq - 1);
    let hk = h / (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let base = fwd_shared_base();
    let (sq, sk, sv) = (
        base,
        base + (64 * D * 2) as u32,
        base + ((64 + BC) * D * 2) as u32,
    );
    let k_base = p.k.ptr + 2 * offset(&p.k, b, s.k_start, hk) as u64;
    let v_base = p.v.ptr + 2 * offset(&p.v, b, s.k_start, hk) as u64;
    let (kt, vt) = (p.k.token as usize, p.v.token as usize);
    unsafe {
        let q_base = p.q.ptr + 2 * offset(&p.q, b, s.q_start + m0 as usize, h) as u64;
        fwd_load_tile::<D, WARPS4>(
            sq,
            q_base,
            p.q.token as usize,
            64,
            (s.sq - m0) as usize,
            tid,
        );
    }
    commit();
    let (lo, hi) = s.keys(m0, i1);
    let first = (lo.max(0) as usize / BC) * BC;
    let end = hi.max(0) as usize;
    if first < end {
        unsafe {
            fwd_load_tile::<D, WARPS4>(
                sk,
                k_base + (2 * first * kt) as u64,
                kt,
                BC,
                s.sk as usize - first,
                tid,
            )
        };
    }
    commit();
    #[cfg(not(target_feature = "sm_90a"))]
    let qf = {
        wait_one_pending();
        sync_threads();
        unsafe { a_frags::<D>(sq, warp, tid & 31) }
    };
    let (mut m, mut l) = ([f32::NEG_INFINITY; 2], [0.0f32; 2]);
    let mut o = [[0.0f32; 4]; 16];
    let mut n0 = first;
    while n0 < end {
        fwd_landed();
        unsafe {
            fwd_load_tile::<D, WARPS4>(
                sv,
                v_base + (2 * n0 * vt) as u64,
                vt,
                BC,
                s.sk as usize - n0,
                tid,
            )
        };
        commit();
        let mut sc = [[0.0f32; 4]; 8];
        #[cfg(target_feature = "sm_90a")]
        unsafe {
            wgmma::scores::<T, D>(&mut sc, sq, sk);
            wgmma::wait32(&mut sc);
        }
        #[cfg(not(target_feature = "sm_90a"))]
        unsafe {
            mma_abt::<T, D>(&mut sc, sk, tid & 31, 8, |kk| qf[kk])
        };
        let masked = !s.all_allowed(m0, i1, n0 as i64, (n0 + BC - 1) as i64);
        let row0 = m0 + (16 * warp + g) as i64;
        // One branch per tile on block-uniform conditions: the common tile (no mask, no
        // softcap) is straight-line code.
        if !masked && score.plain() {
            each::<8>(|nt| each::<4>(|e| sc[nt][e] *= score.mul));
        } else {
            each::<8>(|nt| {
                each::<4>(|e| {
                    let x = score.of(sc[nt][e]);
                    let j = (n0 + 8 * nt + 2 * c + (e & 1)) as i64;
                    let i = row0 + 8 * (e >> 1) as i64;
                    sc[nt][e] = if masked && !s.allows(i, j) {
                        f32::NEG_INFINITY
                    } else {
                        x
                    };
                });
            });
        }
        each::<2>(|r| {
            let mut mx = f32::NEG_INFINITY;
            each::<8>(|nt| mx = mx.max(sc[nt][2 * r]).max(sc[nt][2 * r + 1]));
            mx = mx.max(shfl_xor(mx, 1));
            mx = mx.max(shfl_xor(mx, 2));
            let m_new = m[r].max(mx);
            let sub = safe_max(m_new);
            let corr = exp2(m[r] - sub);
            m[r] = m_new;
            let mut sum = 0.0f32;
            each::<8>(|nt| {
                each::<2>(|e| {
                    let pr = exp2(sc[nt][2 * r + e] - sub);
                    sc[nt][2 * r + e] = pr;
                    sum += pr;
                });
            });
            l[r] = l[r] * corr + sum;
            // Once the maximum settles it rarely moves: skip the rescale when no row of the
            // warp's moved.
            if !all_lanes(corr == 1.0) {
                each::<16>(|dt| {
                    o[dt][2 * r] *= corr;
                    o[dt][2 * r + 1] *= corr;
                });
            }
        });
        fwd_landed();
        if n0 + BC < end {
            let next = n0 + BC;
            unsafe {
                fwd_load_tile::<D, WARPS4>(
                    sk,
                    k_base + (2 * next * kt) as u64,
                    kt,
                    BC,
                    s.sk as usize - next,
                    tid,
                )
            };
        }
        commit();
        #[cfg(target_feature = "sm_90a")]
        unsafe {
            wgmma::pv::<T, D>(&mut o, &sc, sv);
            wgmma::wait64(&mut o);
        }
        #[cfg(not(target_feature = "sm_90a"))]
        unsafe {
            mma_pb::<T, D>(&mut o, &sc, sv, tid & 31, 4)
        };
        n0 += BC;
    }
    wait_all();
    each::<2>(|r| {
        let mut lt = l[r] + shfl_xor(l[r], 1);
        lt += shfl_xor(lt, 2);
        let i = m0 + (16 * warp + g + 8 * r) as i64;
        if i < s.sq {
            let tok = s.q_start + i as usize;
            let inv = if lt > 0.0 { 1.0 / lt } else { 0.0 };
            unsafe {
                store_row::<T, D>(&o, r, inv, p.o.ptr, offset(&p.o, b, tok, h), c);
                if c == 0 {
                    *(p.lse as *mut f32).add(lse_offset(p, b, h, tok)) = lse_of(m[r], lt);
                }
            }
        }
    });
}

/// The probabilities and dS of a warp's score tile, in place: `sc` holds `q·k` and becomes
/// P, `dp` holds `dO·v` and becomes dS = P ∘ (dP − delta) ∘ slope. `lse2(nt, e)` and
/// `delta(nt, e)` give the row's values of element `(nt, e)`, `allowed(nt, e)` its mask (only
/// asked for when `masked`).
#[inline(always)]
fn probs_and_ds(
    sc: &mut [[f32; 4]; 8],
    dp: &mut [[f32; 4]; 8],
    n8: usize,
    score: &Score,
    masked: bool,
    mut stats: impl FnMut(usize, usize) -> (f32, f32),
    mut allowed: impl FnMut(usize, usize) -> bool,
) {
    // As in the forward: one branch per tile, the common tile straight-line code.
    if !masked && score.plain() {
        each::<8>(|nt| {
            if nt < n8 {
                each::<4>(|e| {
                    let (lse2, delta) = stats(nt, e);
                    let pr = exp2(crate::fma(sc[nt][e], score.mul, -lse2));
                    sc[nt][e] = pr;
                    dp[nt][e] = pr * (dp[nt][e] - delta);
                });
            }
        });
        return;
    }
    each::<8>(|nt| {
        if nt < n8 {
            each::<4>(|e| {
                let (lse2, delta) = stats(nt, e);
                let (x, slope) = score.with_slope(sc[nt][e]);
                let pr = if masked && !allowed(nt, e) {
                    0.0
                } else {
                    exp2(x - lse2)
                };
                sc[nt][e] = pr;
                dp[nt][e] = pr * (dp[nt][e] - delta) * slope;
            });
        }
    });
}

/// Stores a warp's `n8` accumulator tiles (rows `row0 + g`, `+ 8`; columns `col0 + 8·nt +
/// 2c`, `+1`) rounded to 16 bits into the swizzled tile of `W`-element rows at byte `at` of
/// shared memory.
#[inline(always)]
unsafe fn store_tile<T: Half, const W: usize>(
    smem: *mut u8,
    at: usize,
    acc: &[[f32; 4]; 8],
    n8: usize,
    (row0, col0): (usize, usize),
    (g, c): (usize, usize),
) {
    each::<8>(|nt| {
        if nt < n8 {
            each::<2>(|r| {
                let (row, col) = (row0 + g + 8 * r, col0 + 8 * nt + 2 * c);
                let off = swizzled::<W>(row, col / 8) as usize + 2 * (col % 8);
                let w = T::pack2(acc[nt][2 * r], acc[nt][2 * r + 1]);
                // SAFETY: inside the tile (the caller's); 4-byte aligned.
                unsafe { *(smem.add(at + off) as *mut u32) = w };
            });
        }
    });
}

/// `acc[i][mt][n] += A_i · B_i` for each of `N` products: a warp's 32 rows (`32·half`) of the
/// 16-bit tile `a[i]` (`W`-element rows, the k dimension) and the `4·pairs` columns from
/// `16·pair0` of the `D`-wide tile `b[i]` (its rows the k dimension: `ldmatrix.trans`). The
/// products share each k-step's loop, so their loads can interleave.
#[inline(always)]
unsafe fn mma_rows32<T: Half, const W: usize, const D: usize, const N: usize>(
    mut acc: [&mut [[[f32; 4]; 4]; 2]; N],
    a: [u32; N],
    b: [u32; N],
    (half, pair0, pairs): (usize, usize, usize),
    lane: usize,
) {
    let la = Lanes::a::<W>(lane, 0);
    let lb = Lanes::bt_from::<D>(lane, pair0);
    each::<8>(|kk| {
        if kk < W / 16 {
            let af = a
                .map(|t| [0, 1].map(|mt| unsafe { ldmatrix_x4(la.at::<W>(t, 2 * half + mt, kk)) }));
            each::<2>(|dp| {
                if dp < pairs {
                    let bf = b.map(|t| unsafe { ldmatrix_x4_trans(lb.at::<D>(t, kk, dp)) });
                    each::<2>(|mt| {
                        each::<N>(|i| {
                            mma::<T>(&mut acc[i][mt][2 * dp], &af[i][mt], bf[i][0], bf[i][1]);
                            mma::<T>(&mut acc[i][mt][2 * dp + 1], &af[i][mt], bf[i][2], bf[i][3]);
                        });
                    });
                }
            });
        }
    });
}

/// Stores each of `N` warp 32-row accumulators of [`mma_rows32`] times `mul[i]`: row
/// `32·half + 16·mt + g + 8r` at element `at(row)[i]` of `ptr[i]` (skipped where `at` gives
/// `None`), columns from `col0`.
#[inline(always)]
unsafe fn store_rows32<T: Half, const N: usize>(
    acc: [&[[[f32; 4]; 4]; 2]; N],
    n8: usize,
    mul: [f32; N],
    ptr: [u64; N],
    (half, col0): (usize, usize),
    (g, c): (usize, usize),
    at: impl Fn(usize) -> Option<[usize; N]>,
) {
    each::<2>(|mt| {
        each::<2>(|r| {
            if let Some(o) = at(32 * half + 16 * mt + g + 8 * r) {
                each::<4>(|nt| {
                    if nt < n8 {
                        let col = col0 + 8 * nt + 2 * c;
                        each::<N>(|i| {
                            let (x, m) = (&acc[i][mt][nt], mul[i]);
                            // SAFETY: the host checked the tensor's extent and 16-byte
                            // alignment.
                            unsafe {
                                *(ptr[i] as *mut u32).add((o[i] + col) / 2) =
                                    T::pack2(x[2 * r] * m, x[2 * r + 1] * m)
                            };
                        });
                    }
                });
            }
        });
    });
}

/// dQ of a block of [`MMA_ROWS`] query rows of one head.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dq<T: Half, const D: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    let bc = dq_key_tile(D as u32) as usize;
    let (tid, (lane, g, c)) = (thread_idx(), lane_parts());
    let warp = tid >> 5;
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let m0 = (last_first() * MMA_ROWS as usize) as i64;
    if m0 >= s.sq {
        return;
    }
    let i1 = (m0 + MMA_ROWS as i64 - 1).min(s.sq - 1);
    let hk = h / (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let base = shared_base();
    let rows_left = (s.sq - m0) as usize;
    let tok0 = s.q_start + m0 as usize;
    unsafe {
        load_tile::<D, WARPS4>(
            base,
            p.q.ptr + 2 * offset(&p.q, b, tok0, h) as u64,
            p.q.token as usize,
            64,
            rows_left,
            tid,
        );
        let d_o = p.d_o.ptr + 2 * offset(&p.d_o, b, tok0, h) as u64;
        load_tile::<D, WARPS4>(
            base + (64 * D * 2) as u32,
            d_o,
            p.d_o.token as usize,
            64,
            rows_left,
            tid,
        );
    }
    commit();
    let (sq, sdo) = (base, base + (64 * D * 2) as u32);
    let mut stats = [(f32::INFINITY, 0.0f32); 2];
    each::<2>(|r| {
        let i = m0 + (16 * warp + g + 8 * r) as i64;
        if i < s.sq {
            let at = lse_offset(p, b, h, s.q_start + i as usize);
            // SAFETY: the row exists; lse and delta span every row.
            stats[r] = unsafe {
                (
                    lse2_for_backward(*(p.lse as *const f32).add(at)),
                    *(p.delta as *const f32).add(at),
                )
            };
        }
    });
    let stages = base + (2 * 64 * D * 2) as u32;
    let k_base = p.k.ptr + 2 * offset(&p.k, b, s.k_start, hk) as u64;
    let v_base = p.v.ptr + 2 * offset(&p.v, b, s.k_start, hk) as u64;
    let (kt, vt) = (p.k.token as usize, p.v.token as usize);
    let stage_bytes = (2 * bc * D * 2) as u32;
    let load = |n0: usize, stage: u32| unsafe {
        let tile = stages + stage * stage_bytes;
        let valid = s.sk as usize - n0;
        load_tile::<D, WARPS4>(tile, k_base + (2 * n0 * kt) as u64, kt, bc, valid, tid);
        load_tile::<D, WARPS4>(
            tile + (bc * D * 2) as u32,
            v_base + (2 * n0 * vt) as u64,
            vt,
            bc,
            valid,
            tid,
        );
    };
    let (lo, hi) = s.keys(m0, i1);
    let first = (lo.max(0) as usize / bc) * bc;
    let end = hi.max(0) as usize;
    if first < end {
        load(first, 0);
    }
    commit();
    let mut acc = [[0.0f32; 4]; 16];
    let row0 = m0 + (16 * warp + g) as i64;
    let (mut n0, mut stage) = (first, 0u32);
    while n0 < end {
        if n0 + bc < end {
            load(n0 + bc, stage ^ 1);
            commit();
            wait_one_pending();
        } else {
            wait_all();
        }
        sync_threads();
        let (sk, sv) = (
            stages + stage * stage_bytes,
            stages + stage * stage_bytes + (bc * D * 2) as u32,
        );
        let (mut sc, mut dp) = ([[0.0f32; 4]; 8], [[0.0f32; 4]; 8]);
        let masked = !s.all_allowed(m0, i1, n0 as i64, (n0 + bc - 1) as i64);
        unsafe {
            let l = Lanes::a::<D>(lane, warp);
            mma_abt::<T, D>(&mut sc, sk, lane, bc / 8, |kk| {
                ldmatrix_x4(l.at::<D>(sq, 0, kk))
            });
            mma_abt::<T, D>(&mut dp, sv, lane, bc / 8, |kk| {
                ldmatrix_x4(l.at::<D>(sdo, 0, kk))
            });
        }
        probs_and_ds(
            &mut sc,
            &mut dp,
            bc / 8,
            &score,
            masked,
            |_, e| stats[e >> 1],
            |nt, e| {
                let j = (n0 + 8 * nt + 2 * c + (e & 1)) as i64;
                s.allows(row0 + 8 * (e >> 1) as i64, j)
            },
        );
        unsafe {
            mma_pb::<T, D>(&mut acc, &dp, sk, lane, bc / 16);
        }
        sync_threads();
        n0 += bc;
        stage ^= 1;
    }
    each::<2>(|r| {
        let i = m0 + (16 * warp + g + 8 * r) as i64;
        if i < s.sq {
            let at = offset(&p.dq, b, s.q_start + i as usize, h);
            unsafe { store_row::<T, D>(&acc, r, p.scale, p.dq.ptr, at, c) };
        }
    });
}

/// dK and dV of a block of [`MMA_KEYS`] key rows of one key/value head, over every query head
/// of its group and every query tile that sees them, with eight warps. Each step takes a tile
/// of [`DKDV_QUERY_TILE`] queries in two phases: warp `w` computes Sᵀ and dPᵀ for 16 keys
/// (`16·(w % 4)`) and 64 queries (`64·(w / 4)`, 32 at a time) and leaves P and dS (16-bit) in
/// shared memory;
/// then it adds `Pᵀ·dO` and `dSᵀ·Q` into dV and dK for 32 keys (`32·(w % 2)`) and a quarter of
/// the head (`D/4·(w / 2)`). The split keeps a quarter of each accumulator per warp, so the
/// query step can take 128 queries (a four-warp block holding whole dK and dV rows took 16 at
/// head_dim 128), and gives the dV and dK products 32 × 32 (head_dim 128) or 32 × 16 warp
/// tiles with A from shared memory instead of 16 × 128 ones that re-read K and V at every
/// 16-query step.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dkdv<T: Half, const D: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const QT: usize = DKDV_QUERY_TILE as usize;
    const KEYS: usize = MMA_KEYS as usize;
    // 16-column groups of the head per warp in the second phase.
    let pairs = D / 64;
    let (tid, (lane, g, c)) = (thread_idx(), lane_parts());
    let warp = tid >> 5;
    let (wk, wq) = (warp & 3, warp >> 2);
    let (kh, quarter) = (warp & 1, warp >> 1);
    let (b, hk) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let n0 = (block_idx() * KEYS) as i64;
    if n0 >= s.sk {
        return;
    }
    let n1 = (n0 + KEYS as i64 - 1).min(s.sk - 1);
    let group = (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let base = shared_base();
    let (sk, sv) = (base, base + (KEYS * D * 2) as u32);
    let sp_off = 2 * KEYS * D * 2;
    let sds_off = sp_off + KEYS * QT * 2;
    let stages_off = sds_off + KEYS * QT * 2;
    let (sp, sds) = (base + sp_off as u32, base + sds_off as u32);
    let stages = base + stages_off as u32;
    let stage_bytes = dkdv_stage_bytes(D as u32);
    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>();
    unsafe {
        let at = s.k_start + n0 as usize;
        let valid = (s.sk - n0) as usize;
        load_tile::<D, WARPS8>(
            sk,
            p.k.ptr + 2 * offset(&p.k, b, at, hk) as u64,
            p.k.token as usize,
            KEYS,
            valid,
            tid,
        );
        load_tile::<D, WARPS8>(
            sv,
            p.v.ptr + 2 * offset(&p.v, b, at, hk) as u64,
            p.v.token as usize,
            KEYS,
            valid,
            tid,
        );
    }
    let (lo, hi) = s.queries(n0, n1);
    let first = (lo.max(0) as usize / QT) * QT;
    let end = hi.max(0) as usize;
    let tiles = if first < end {
        (end - first).div_ceil(QT)
    } else {
        0
    };
    let steps = tiles * group;
    let (qtok, dtok) = (p.q.token as usize, p.d_o.token as usize);
    let stats_at = |stage: u32| stages_off + (stage * stage_bytes) as usize + QT * D * 4;
    let load = |step: usize, stage: u32| unsafe {
        let h = hk * group + step / tiles;
        let i0 = first + (step % tiles) * QT;
        let tile = stages + stage * stage_bytes;
        let tok = s.q_start + i0;
        let valid = s.sq as usize - i0;
        let (q, d_o) = (
            p.q.ptr + 2 * offset(&p.q, b, tok, h) as u64,
            p.d_o.ptr + 2 * offset(&p.d_o, b, tok, h) as u64,
        );
        load_tile::<D, WARPS8>(tile, q, qtok, QT, valid, tid);
        load_tile::<D, WARPS8>(tile + (QT * D * 2) as u32, d_o, dtok, QT, valid, tid);
        // The tile's statistics, by plain stores: read after the barrier that the tile's
        // copies wait for. Rows past the sequence get probability 0.
        if tid < QT {
            let stats = smem.add(stats_at(stage)) as *mut [f32; 2];
            let i = i0 + tid;
            *stats.add(tid) = if (i as i64) < s.sq {
                let at = lse_offset(p, b, h, s.q_start + i);
                [
                    lse2_for_backward(*(p.lse as *const f32).add(at)),
                    *(p.delta as *const f32).add(at),
                ]
            } else {
                [f32::INFINITY, 0.0]
            };
        }
    };
    if steps > 0 {
        load(0, 0);
    }
    commit();
    let (mut dk, mut dv) = ([[[0.0f32; 4]; 4]; 2], [[[0.0f32; 4]; 4]; 2]);
    let key0 = n0 + (16 * wk + g) as i64;
    let mut stage = 0u32;
    let mut step = 0;
    while step < steps {
        wait_all();
        // The barrier makes this step's tile visible and ends every warp's previous step, so
        // the other stage and the P and dS tiles are free to overwrite.
        sync_threads();
        if step + 1 < steps {
            load(step + 1, stage ^ 1);
        }
        commit();
        let i0 = first + (step % tiles) * QT;
        let tile = stages + stage * stage_bytes;
        let (sq, sdo) = (tile, tile + (QT * D * 2) as u32);
        // Key rows past the sequence (zeros) need no mask: their dK and dV are not stored.
        let masked = !s.all_allowed(i0 as i64, (i0 + QT - 1) as i64, n0, n1);
        let stats = unsafe { smem.add(stats_at(stage)) as *const [f32; 2] };
        // The warp's queries in parts of 32 (a 16 × 32 score tile at a time, which leaves
        // registers for 128-query steps).
        for part in 0..QT / 64 {
            let q0 = QT / 2 * wq + 32 * part;
            let (mut sc, mut dp) = ([[0.0f32; 4]; 8], [[0.0f32; 4]; 8]);
            unsafe {
                let l = Lanes::a::<D>(lane, wk);
                let rows = (q0 * D * 2) as u32;
                mma_abt::<T, D>(&mut sc, sq + rows, lane, 4, |kk| {
                    ldmatrix_x4(l.at::<D>(sk, 0, kk))
                });
                mma_abt::<T, D>(&mut dp, sdo + rows, lane, 4, |kk| {
                    ldmatrix_x4(l.at::<D>(sv, 0, kk))
                });
            }
            // Each thread's columns: queries i0 + q0 + 8·nt + 2c + {0, 1}.
            let col = |nt: usize, e: usize| q0 + 8 * nt + 2 * c + (e & 1);
            probs_and_ds(
                &mut sc,
                &mut dp,
                4,
                &score,
                masked,
                |nt, e| {
                    let [lse2, delta] = unsafe { *stats.add(col(nt, e)) };
                    (lse2, delta)
                },
                |nt, e| {
                    let i = (i0 + col(nt, e)) as i64;
                    i < s.sq && s.allows(i, key0 + 8 * (e >> 1) as i64)
                },
            );
            unsafe {
                let at = (16 * wk, q0);
                store_tile::<T, QT>(smem, sp_off, &sc, 4, at, (g, c));
                store_tile::<T, QT>(smem, sds_off, &dp, 4, at, (g, c));
            }
        }
        sync_threads();
        unsafe {
            let tile = (kh, pairs * quarter, pairs);
            mma_rows32::<T, QT, D, 2>([&mut dv, &mut dk], [sp, sds], [sdo, sq], tile, lane);
        }
        step += 1;
        stage ^= 1;
    }
    wait_all();
    let cols = (kh, D / 4 * quarter);
    unsafe {
        store_rows32::<T, 2>(
            [&dk, &dv],
            2 * pairs,
            [p.scale, 1.0],
            [p.dk.ptr, p.dv.ptr],
            cols,
            (g, c),
            |row| {
                let j = n0 + row as i64;
                let t = s.k_start + j as usize;
                (j < s.sk).then(|| [offset(&p.dk, b, t, hk), offset(&p.dv, b, t, hk)])
            },
        );
    }
}
