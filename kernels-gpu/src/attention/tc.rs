//! The tensor-core path for 16-bit elements at head_dim `D` ∈ {64, 128}, on 16-byte aligned
//! rows (the host checks): the forward, and what both builds' backward kernels share (the
//! probabilities and dS of a score tile, the stores). The forward has one warpgroup (four
//! warps) per block, two at head_dim 128 in the sm_90a build, each warp owning 16 query rows of
//! the block's tile, so a row's softmax statistics stay within the four lanes that share it
//! (`shfl.xor` 1 and 2); its products are `mma.sync` m16n8k16 with f32
//! accumulators (operands staged by `cp.async` and read by `ldmatrix`, [`super::mma`]) or, in
//! the sm_90a build, `wgmma` (`super::wgmma`) on the same fragments. The backward is
//! `super::mma_bwd` (`mma.sync`) or, in the sm_90a build, `super::hopper` (`wgmma`).
//! As FA2, probabilities (and dS) are rounded to the element type before they meet V, dO, K
//! or Q in a product.
use super::abi::{MMA_ROWS, Params, THREADS, fwd_key_tile, fwd_stages, warpgroups};
#[cfg(not(target_feature = "sm_90a"))]
use super::mma::{Lanes, ldmatrix_x4, mma_abt, mma_pb};
use super::mma::{commit, each, shared_addr, wait_all, wait_one_pending};
use super::{Half, Score, Seq, block_y, block_z, exp2, lse_of, lse_offset, lse2_for_backward};
use super::{all_lanes, offset, safe_max, shfl_xor};
use crate::{block_idx, grid_dim, sync_threads, thread_idx};

/// Threads of a four-warp block.
const WARPS4: usize = THREADS as usize;

/// The block's row block, last first: with a causal mask the last query rows see the most keys,
/// so their blocks start first and the short ones fill the tail.
#[inline(always)]
pub(super) fn last_first() -> usize {
    grid_dim() - 1 - block_idx()
}

/// The block's dynamic shared memory as a `.shared` address.
#[inline(always)]
pub(super) fn shared_base() -> u32 {
    shared_addr(core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>())
}

/// `(g, c)`: the lane's row within an 8-row group and its column pair (see [`super::mma`]).
#[inline(always)]
pub(super) fn lane_parts() -> (usize, usize, usize) {
    let lane = thread_idx() & 31;
    (lane, lane >> 2, lane & 3)
}

/// The rows of this thread's warpgroup in a block of `wgs` warpgroups whose rows start at
/// `m0`, of `len`: the warpgroup, its first row and its last (below the first for a
/// warpgroup past the end).
#[inline(always)]
pub(super) fn warpgroup_rows(wgs: usize, m0: i64, len: i64) -> (usize, i64, i64) {
    let wg = if wgs == 1 { 0 } else { thread_idx() >> 7 };
    let w0 = m0 + (wg * MMA_ROWS as usize) as i64;
    (wg, w0, (w0 + MMA_ROWS as i64 - 1).min(len - 1))
}

/// Whether a warpgroup whose rows see `[lo, hi)` has products in the tile `[t0, t1)` (a tile
/// outside them, or a warpgroup past the end, skips its products, not the block's barriers
/// and copies); a lone warpgroup sees every tile of the block's range.
#[inline(always)]
pub(super) fn has_work(wgs: usize, (lo, hi): (i64, i64), t0: usize, t1: usize) -> bool {
    wgs == 1 || ((t0 as i64) < hi && (t1 as i64) > lo)
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

/// Stores rows `g` (`r = 0`) or `g + 8` (`r = 1`) of a warp's `D`-wide accumulator, times
/// `mul`, to the row at element `at` of `ptr`.
#[inline(always)]
pub(super) unsafe fn store_row<T: Half, const D: usize>(
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
use super::wgmma::{self, a_frags, load_tile as fwd_load_tile};

/// A score tile of `NT` n8 tiles as the `mma.sync` products take it (8 of them).
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
fn tiles8<const NT: usize>(sc: &mut [[f32; 4]; NT]) -> &mut [[f32; 4]; 8] {
    const { assert!(NT == 8) };
    // SAFETY: the same type (the assertion).
    unsafe { &mut *(sc as *mut [[f32; 4]; NT] as *mut [[f32; 4]; 8]) }
}

/// The n8 tiles of the forward's score tile at head_dim 64 and 128 (its key tile over 8).
pub(crate) const FWD_NT64: usize = fwd_key_tile(cfg!(target_feature = "sm_90a"), 64) as usize / 8;
/// See [`FWD_NT64`].
pub(crate) const FWD_NT128: usize = fwd_key_tile(cfg!(target_feature = "sm_90a"), 128) as usize / 8;
/// Threads of the forward's block at head_dim 64 and 128 (its warpgroups, [`warpgroups`]).
pub(crate) const FWD_THREADS64: usize =
    WARPS4 * warpgroups(cfg!(target_feature = "sm_90a"), 64) as usize;
/// See [`FWD_THREADS64`].
pub(crate) const FWD_THREADS128: usize =
    WARPS4 * warpgroups(cfg!(target_feature = "sm_90a"), 128) as usize;

/// The forward of a block of [`MMA_ROWS`] query rows per warpgroup (`N / 128` of them) of
/// one head, over key tiles of `8·NT` ([`fwd_key_tile`]) that every warpgroup of the block
/// reads, in [`fwd_stages`] stages. Built for sm_90a, its two products are `wgmma` (a
/// warpgroup's, [`super::wgmma`]) on tiles in that file's layout; elsewhere `mma.sync` on
/// tiles in [`super::mma`]'s. The online softmax is the same code on the same fragments.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn forward<T: Half, const D: usize, const NT: usize, const N: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const { assert!(8 * NT == fwd_key_tile(cfg!(target_feature = "sm_90a"), D as u32) as usize) };
    const ROWS: usize = MMA_ROWS as usize;
    const { assert!(N == WARPS4 * warpgroups(cfg!(target_feature = "sm_90a"), D as u32) as usize) };
    let (wgs, stages) = (
        N / WARPS4,
        fwd_stages(cfg!(target_feature = "sm_90a"), D as u32),
    );
    let bc = 8 * NT;
    let (tid, (_, g, c)) = (thread_idx(), lane_parts());
    // The warp within its warpgroup, which owns rows `w0..w0 + 64` of the block.
    let warp = (tid >> 5) & 3;
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let m0 = (last_first() * wgs * ROWS) as i64;
    if m0 >= s.sq {
        return;
    }
    let i1 = (m0 + (wgs * ROWS) as i64 - 1).min(s.sq - 1);
    let (wg, w0, w1) = warpgroup_rows(wgs, m0, s.sq);
    let hk = h / (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let base = fwd_shared_base();
    let sq = base + (wg * ROWS * D * 2) as u32;
    // Stage `st`'s K tile, then its V tile.
    let tile = (bc * D * 2) as u32;
    let sk = |st: u32| base + (wgs * ROWS * D * 2) as u32 + 2 * st * tile;
    let sv = |st: u32| sk(st) + tile;
    let k_base = p.k.ptr + 2 * offset(&p.k, b, s.k_start, hk) as u64;
    let v_base = p.v.ptr + 2 * offset(&p.v, b, s.k_start, hk) as u64;
    let (kt, vt) = (p.k.token as usize, p.v.token as usize);
    unsafe {
        let q_base = p.q.ptr + 2 * offset(&p.q, b, s.q_start + w0 as usize, h) as u64;
        fwd_load_tile::<D, WARPS4>(
            sq,
            q_base,
            p.q.token as usize,
            ROWS,
            (s.sq - w0).max(0) as usize,
            tid & (WARPS4 - 1),
        );
    }
    commit();
    let (lo, hi) = s.keys(m0, i1);
    // The keys this warpgroup's rows see.
    let seen = if w0 < s.sq { s.keys(w0, w1) } else { (0, 0) };
    let first = (lo.max(0) as usize / bc) * bc;
    let end = hi.max(0) as usize;
    let load_k = |n: usize, st: u32| unsafe {
        fwd_load_tile::<D, N>(
            sk(st),
            k_base + (2 * n * kt) as u64,
            kt,
            bc,
            s.sk as usize - n,
            tid,
        )
    };
    let load_v = |n: usize, st: u32| unsafe {
        fwd_load_tile::<D, N>(
            sv(st),
            v_base + (2 * n * vt) as u64,
            vt,
            bc,
            s.sk as usize - n,
            tid,
        )
    };
    // One stage: K now, V once the loop's first barrier has passed (its tile is free once the
    // products before it are done); two: the first tile's K and V now, the next tile's at the
    // top of each step.
    if first < end {
        load_k(first, 0);
        if stages == 2 {
            load_v(first, 0);
        }
    }
    commit();
    // Q stays in registers as the A operand of every `S = Q·Kᵀ`.
    let qf = {
        wait_one_pending();
        sync_threads();
        unsafe { a_frags::<D>(sq, warp, tid & 31) }
    };
    // Never true (the host rejects a NaN scale), unknown to ptxas.
    #[cfg(target_feature = "sm_90a")]
    let never = p.scale.is_nan() as u32;
    let (mut m, mut l) = ([f32::NEG_INFINITY; 2], [0.0f32; 2]);
    let mut o = [[0.0f32; 4]; 16];
    let (mut n0, mut st) = (first, 0u32);
    while n0 < end {
        fwd_landed();
        if stages == 1 {
            load_v(n0, 0);
        } else if n0 + bc < end {
            load_k(n0 + bc, st ^ 1);
            load_v(n0 + bc, st ^ 1);
        }
        commit();
        let (sk, sv) = (sk(st), sv(st));
        let active = has_work(wgs, seen, n0, n0 + bc);
        let mut sc = [[0.0f32; 4]; NT];
        // The two warpgroups issue their `S = Q·Kᵀ` in turn, so one's softmax overlaps the
        // other's product.
        #[cfg(target_feature = "sm_90a")]
        {
            wgmma::turn_wait(wg, wgs);
            if !active {
                wgmma::turn_done(wg, wgs);
            }
        }
        if active {
            #[cfg(target_feature = "sm_90a")]
            unsafe {
                wgmma::scores_rs::<T, D, NT>(&mut sc, &qf, sk);
                wgmma::turn_done(wg, wgs);
                wgmma::wait(&mut sc);
            }
            #[cfg(not(target_feature = "sm_90a"))]
            unsafe {
                mma_abt::<T, D>(tiles8(&mut sc), sk, tid & 31, 8, |kk| qf[kk])
            };
            let masked = !s.all_allowed(w0, w1, n0 as i64, (n0 + bc - 1) as i64);
            let row0 = w0 + (16 * warp + g) as i64;
            // One branch per tile on warpgroup-uniform conditions: the common tile (no mask,
            // no softcap, a positive scale) is straight-line code on the raw products, its
            // scale folded into the exponent's `fma` (the row maximum commutes with it).
            let raw = !masked && score.plain() && score.mul > 0.0;
            let mul = if raw { score.mul } else { 1.0 };
            if !raw {
                each::<NT>(|nt| {
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
                each::<NT>(|nt| mx = mx.max(sc[nt][2 * r]).max(sc[nt][2 * r + 1]));
                mx = mx.max(shfl_xor(mx, 1));
                mx = mx.max(shfl_xor(mx, 2));
                let m_new = m[r].max(mx * mul);
                let sub = safe_max(m_new);
                let corr = exp2(m[r] - sub);
                m[r] = m_new;
                let mut sum = 0.0f32;
                each::<NT>(|nt| {
                    each::<2>(|e| {
                        let pr = exp2(crate::fma(sc[nt][2 * r + e], mul, -sub));
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
        }
        if stages == 1 {
            fwd_landed();
            if n0 + bc < end {
                load_k(n0 + bc, 0);
            }
            commit();
        }
        if active {
            #[cfg(target_feature = "sm_90a")]
            unsafe {
                wgmma::pv::<T, D, NT>(&mut o, &sc, sv);
                wgmma::wait64(&mut o);
                wgmma::keep_alive(&qf, never, sq);
            }
            #[cfg(not(target_feature = "sm_90a"))]
            unsafe {
                mma_pb::<T, D>(&mut o, tiles8(&mut sc), sv, tid & 31, 4)
            };
        }
        n0 += bc;
        st ^= stages - 1;
    }
    wait_all();
    each::<2>(|r| {
        let mut lt = l[r] + shfl_xor(l[r], 1);
        lt += shfl_xor(lt, 2);
        let i = w0 + (16 * warp + g + 8 * r) as i64;
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

/// Query row `i` (of sequence `b`, head `h`) as the backward weighs it: its log-sum-exp in
/// log2 units and its delta; `[+∞, 0]` for a row past the sequence (probability 0).
///
/// # Safety
/// `lse` and `delta` span every row of the call.
#[inline(always)]
pub(super) unsafe fn row_stats(p: &Params, s: &Seq, b: usize, h: usize, i: i64) -> [f32; 2] {
    if i < s.sq {
        let at = lse_offset(p, b, h, s.q_start + i as usize);
        unsafe {
            [
                lse2_for_backward(*(p.lse as *const f32).add(at)),
                *(p.delta as *const f32).add(at),
            ]
        }
    } else {
        [f32::INFINITY, 0.0]
    }
}

/// The probabilities and dS of a warp's score tile, in place: `sc` holds `q·k` and becomes
/// P, `dp` holds `dO·v` and becomes dS = P ∘ (dP − delta) ∘ slope. `lse2(nt, e)` and
/// `delta(nt, e)` give the row's values of element `(nt, e)`, `allowed(nt, e)` its mask (only
/// asked for when `masked`).
#[inline(always)]
pub(super) fn probs_and_ds(
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
