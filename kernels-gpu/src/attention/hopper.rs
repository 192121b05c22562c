//! The sm_90a build's tensor-core backward on Hopper's warpgroup `wgmma` ([`super::wgmma`]):
//! dQ over blocks of query rows and dK/dV over blocks of key rows, 64 per warpgroup, two
//! warpgroups per block at head_dim 128 sharing the tiles they stream (K and V for dQ, Q and
//! dO for dK/dV), in that file's swizzled layout and three `cp.async` stages: the next tile's
//! copy overlaps the current tile's products, and a step's last product (the accumulating
//! one) runs on under the next step's barrier, waited for by its first wait. dQ is the
//! forward's shape with one more product: `S = Q·Kᵀ` and `dP = dO·Vᵀ` from shared memory, then
//! `dQ += dS·K` with dS from registers and K as an MN-major operand. Every product is a 64-row
//! one whose accumulator fragments are `mma.sync`'s, so dS and the stores are
//! [`super::tc`]'s code.
use super::abi::{
    DKDV_STAGES_SM90, DQ_STAGES_SM90, MMA_KEYS, MMA_ROWS, Params, THREADS, dkdv_stage_bytes_sm90,
    dkdv_threads, dq_threads,
};
use super::mma::each;
use super::mma::{commit, wait_all};
use super::tc::{has_work, probs_and_ds, row_stats, store_row, warpgroup_rows};
use super::wgmma::{self, load_tile, pv, scores, wait32, wait64};
use super::{Half, Score, Seq, block_y, block_z, exp2, offset};
use crate::{block_idx, grid_dim, sync_threads, thread_idx};

const THREADS4: usize = THREADS as usize;
/// Rows of every tile: a warpgroup's product.
const ROWS: usize = 64;
const _: () = assert!(MMA_ROWS as usize == ROWS && MMA_KEYS as usize == ROWS);

/// The block's dynamic shared memory, 1024-byte aligned for `wgmma`'s swizzle (the plan adds
/// the slack).
#[inline(always)]
fn base() -> (u32, *mut u8) {
    let p = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>();
    let raw = super::mma::shared_addr(p);
    let aligned = (raw + 1023) & !1023;
    // SAFETY: within the block's dynamic shared memory (the slack covers the shift).
    (aligned, unsafe { p.add((aligned - raw) as usize) })
}

/// Waits for this thread's copies and makes the block's visible to `wgmma`; the barrier also
/// ends every warp's previous products (each warp's share of a `wgmma` reads the whole B
/// tile), so the stage they read is free for the next copy.
#[inline(always)]
fn landed() {
    wait_all();
    wgmma::proxy_fence();
    sync_threads();
}

/// Threads of the dQ kernel at head_dim 64 and 128 (its warpgroups,
/// [`super::abi::warpgroups`]).
pub(crate) const DQ_THREADS64: usize = dq_threads(true, 64) as usize;
/// See [`DQ_THREADS64`].
pub(crate) const DQ_THREADS128: usize = dq_threads(true, 128) as usize;

/// dQ of a block of 64 query rows per warpgroup (`N / 128` of them) of one head, over key
/// tiles of 64 that every warpgroup of the block reads, in [`DQ_STAGES_SM90`] stages. A step
/// computes `S = Q·Kᵀ` and `dP = dO·Vᵀ` together, then dS, then `dQ += dS·K`, which the next
/// step's first wait waits for.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dq<T: Half, const D: usize, const N: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const { assert!(N == dq_threads(true, D as u32) as usize) };
    const STAGES: u32 = DQ_STAGES_SM90;
    let wgs = N / THREADS4;
    let tid = thread_idx();
    let (warp, g, c) = ((tid >> 5) & 3, (tid & 31) >> 2, tid & 3);
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let m0 = ((grid_dim() - 1 - block_idx()) * wgs * ROWS) as i64;
    if m0 >= s.sq {
        return;
    }
    let i1 = (m0 + (wgs * ROWS) as i64 - 1).min(s.sq - 1);
    let (wg, w0, w1) = warpgroup_rows(wgs, m0, s.sq);
    let hk = h / (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let (base, _) = base();
    let tile = (ROWS * D * 2) as u32;
    let (sq, sdo, stages) = (
        base + 2 * wg as u32 * tile,
        base + (2 * wg as u32 + 1) * tile,
        base + 2 * wgs as u32 * tile,
    );
    unsafe {
        let rows_left = (s.sq - w0).max(0) as usize;
        let tok0 = s.q_start + w0 as usize;
        let t = tid & (THREADS4 - 1);
        let q = p.q.ptr + 2 * offset(&p.q, b, tok0, h) as u64;
        load_tile::<D, THREADS4>(sq, q, p.q.token as usize, ROWS, rows_left, t);
        let d_o = p.d_o.ptr + 2 * offset(&p.d_o, b, tok0, h) as u64;
        load_tile::<D, THREADS4>(sdo, d_o, p.d_o.token as usize, ROWS, rows_left, t);
    }
    commit();
    let stats: [_; 2] = core::array::from_fn(|r| {
        let [lse2, delta] = unsafe { row_stats(p, &s, b, h, w0 + (16 * warp + g + 8 * r) as i64) };
        (lse2, delta)
    });
    let k_base = p.k.ptr + 2 * offset(&p.k, b, s.k_start, hk) as u64;
    let v_base = p.v.ptr + 2 * offset(&p.v, b, s.k_start, hk) as u64;
    let (kt, vt) = (p.k.token as usize, p.v.token as usize);
    let load = |n0: usize, stage: u32| unsafe {
        let at = stages + stage * 2 * tile;
        let valid = s.sk as usize - n0;
        load_tile::<D, N>(at, k_base + (2 * n0 * kt) as u64, kt, ROWS, valid, tid);
        load_tile::<D, N>(
            at + tile,
            v_base + (2 * n0 * vt) as u64,
            vt,
            ROWS,
            valid,
            tid,
        );
    };
    let (lo, hi) = s.keys(m0, i1);
    // The keys this warpgroup's rows see.
    let seen = if w0 < s.sq { s.keys(w0, w1) } else { (0, 0) };
    let first = (lo.max(0) as usize / ROWS) * ROWS;
    let end = hi.max(0) as usize;
    if first < end {
        load(first, 0);
    }
    commit();
    let mut acc = [[0.0f32; 4]; 16];
    // Written by each step's first products, which do not accumulate into their old values.
    let (mut sc, mut dp) = ([[0.0f32; 4]; 8], [[0.0f32; 4]; 8]);
    let row0 = w0 + (16 * warp + g) as i64;
    if first < end {
        let (mut n0, mut stage) = (first, 0u32);
        while n0 < end {
            // Also ends every warp's products of the step before last (the last one's `dQ` was
            // waited for by this one's first wait), so the stage they read is free to overwrite.
            landed();
            let next = if stage + 1 == STAGES { 0 } else { stage + 1 };
            if n0 + ROWS < end {
                load(n0 + ROWS, next);
            }
            commit();
            let (sk, sv) = (stages + stage * 2 * tile, stages + stage * 2 * tile + tile);
            if !has_work(wgs, seen, n0, n0 + ROWS) {
                wait64(&mut acc);
            } else {
                unsafe {
                    scores::<T, D, 8>(&mut sc, sq, sk);
                    scores::<T, D, 8>(&mut dp, sdo, sv);
                }
                wait32(&mut sc);
                wait32(&mut dp);
                let masked = !s.all_allowed(w0, w1, n0 as i64, (n0 + ROWS - 1) as i64);
                probs_and_ds(
                    &mut sc,
                    &mut dp,
                    8,
                    &score,
                    masked,
                    |_, e| stats[e >> 1],
                    |nt, e| {
                        let j = (n0 + 8 * nt + 2 * c + (e & 1)) as i64;
                        s.allows(row0 + 8 * (e >> 1) as i64, j)
                    },
                );
                unsafe { pv::<T, D, 8>(&mut acc, &dp, sk) };
            }
            n0 += ROWS;
            stage = next;
        }
        wait64(&mut acc);
    }
    wait_all();
    each::<2>(|r| {
        let i = w0 + (16 * warp + g + 8 * r) as i64;
        if i < s.sq {
            let at = offset(&p.dq, b, s.q_start + i as usize, h);
            unsafe { store_row::<T, D>(&acc, r, p.scale, p.dq.ptr, at, c) };
        }
    });
}

/// The f32 pair packed by [`crate::f16x2`] (`lo` in the low half).
#[inline(always)]
fn unpack_f16x2(w: u32) -> (f32, f32) {
    (
        f16::from_bits(w as u16) as f32,
        f16::from_bits((w >> 16) as u16) as f32,
    )
}

/// Threads of the dK/dV kernel at head_dim 64 and 128 (its warpgroups,
/// [`super::abi::warpgroups`]).
pub(crate) const DKDV_THREADS64: usize = dkdv_threads(true, 64) as usize;
/// See [`DKDV_THREADS64`].
pub(crate) const DKDV_THREADS128: usize = dkdv_threads(true, 128) as usize;

/// dK and dV of a block of 64 key rows per warpgroup (`N / 128` of them) of one key/value
/// head, over every query head of its group and every tile of 64 queries that sees them,
/// summed in registers in that order: each warp's 16 key rows hold their transposed products,
/// and every warpgroup of the block reads the step's Q and dO tiles, which arrive in
/// [`DKDV_STAGES_SM90`] stages. A step computes `Sᵀ = K·Qᵀ` and Pᵀ, adds `dV += Pᵀ·dO` (Pᵀ
/// the register A operand), then `dPᵀ = V·dOᵀ`, `dSᵀ = Pᵀ ∘ slope ∘ (dPᵀ − delta)` and
/// `dK += dSᵀ·Q`, which the next step's first wait waits for. Between the two halves Pᵀ ∘ slope
/// waits in registers as f16 pairs (relative error 2⁻¹¹, below the 16-bit rounding of dS that
/// follows; P lies in [0, 1]), so a thread holds the two 64 × D accumulators, one 64 × 64
/// product and 16 words at a time (f32 Pᵀ beside dPᵀ spilled at head_dim 128).
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dkdv<T: Half, const D: usize, const N: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const { assert!(N == dkdv_threads(true, D as u32) as usize) };
    const STAGES: u32 = DKDV_STAGES_SM90;
    let wgs = N / THREADS4;
    let tid = thread_idx();
    let (warp, g, c) = ((tid >> 5) & 3, (tid & 31) >> 2, tid & 3);
    let (b, hk) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let n0 = (block_idx() * wgs * ROWS) as i64;
    if n0 >= s.sk {
        return;
    }
    let n1 = (n0 + (wgs * ROWS) as i64 - 1).min(s.sk - 1);
    let (wg, w0, w1) = warpgroup_rows(wgs, n0, s.sk);
    let group = (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let (base, smem) = base();
    let tile = (ROWS * D * 2) as u32;
    let (sk, sv, stages) = (
        base + 2 * wg as u32 * tile,
        base + (2 * wg as u32 + 1) * tile,
        base + 2 * wgs as u32 * tile,
    );
    let stage_bytes = dkdv_stage_bytes_sm90(D as u32);
    unsafe {
        let at = s.k_start + w0 as usize;
        let valid = (s.sk - w0).max(0) as usize;
        let t = tid & (THREADS4 - 1);
        let k = p.k.ptr + 2 * offset(&p.k, b, at, hk) as u64;
        load_tile::<D, THREADS4>(sk, k, p.k.token as usize, ROWS, valid, t);
        let v = p.v.ptr + 2 * offset(&p.v, b, at, hk) as u64;
        load_tile::<D, THREADS4>(sv, v, p.v.token as usize, ROWS, valid, t);
    }
    let (lo, hi) = s.queries(n0, n1);
    // The queries this warpgroup's keys see.
    let seen = if w0 < s.sk { s.queries(w0, w1) } else { (0, 0) };
    let first = (lo.max(0) as usize / ROWS) * ROWS;
    let end = hi.max(0) as usize;
    let tiles = if first < end {
        (end - first).div_ceil(ROWS)
    } else {
        0
    };
    let steps = tiles * group;
    let (qtok, dtok) = (p.q.token as usize, p.d_o.token as usize);
    // Each stage: the Q tile, the dO tile, then the tile's log-sum-exp (log2 units) and delta.
    let stats_of = |stage: u32| unsafe {
        smem.add((stages - base + stage * stage_bytes + 2 * tile) as usize) as *mut [f32; 2]
    };
    let load = |step: usize, stage: u32| unsafe {
        let h = hk * group + step / tiles;
        let i0 = first + (step % tiles) * ROWS;
        let at = stages + stage * stage_bytes;
        let tok = s.q_start + i0;
        let valid = s.sq as usize - i0;
        let q = p.q.ptr + 2 * offset(&p.q, b, tok, h) as u64;
        let d_o = p.d_o.ptr + 2 * offset(&p.d_o, b, tok, h) as u64;
        load_tile::<D, N>(at, q, qtok, ROWS, valid, tid);
        load_tile::<D, N>(at + tile, d_o, dtok, ROWS, valid, tid);
        // The tile's statistics, by plain stores: read after the barrier that the tile's
        // copies wait for.
        if tid < ROWS {
            *stats_of(stage).add(tid) = row_stats(p, &s, b, h, (i0 + tid) as i64);
        }
    };
    if steps > 0 {
        load(0, 0);
    }
    commit();
    let (mut dk, mut dv) = ([[0.0f32; 4]; 16], [[0.0f32; 4]; 16]);
    let key0 = w0 + (16 * warp + g) as i64;
    let (mut step, mut stage) = (0, 0u32);
    while step < steps {
        // Also ends every warp's products of the step before last (the last one's `dK` was
        // waited for by this one's first wait), so the stage they read is free to overwrite.
        landed();
        let next = if stage + 1 == STAGES { 0 } else { stage + 1 };
        if step + 1 < steps {
            load(step + 1, next);
        }
        commit();
        let i0 = first + (step % tiles) * ROWS;
        if !has_work(wgs, seen, i0, i0 + ROWS) {
            wait64(&mut dk);
        } else {
            let (sq, sdo) = (
                stages + stage * stage_bytes,
                stages + stage * stage_bytes + tile,
            );
            let stats = stats_of(stage) as *const [f32; 2];
            // Each thread's columns: queries i0 + 8·nt + 2c + {0, 1}.
            let col = |nt: usize, e: usize| 8 * nt + 2 * c + (e & 1);
            let mut x = [[0.0f32; 4]; 8];
            unsafe { scores::<T, D, 8>(&mut x, sk, sq) };
            wait32(&mut x);
            // Key rows past the sequence (zeros) need no mask: their dK and dV are not stored.
            let masked = !s.all_allowed(i0 as i64, (i0 + ROWS - 1) as i64, w0, w1);
            let lse2 = |nt: usize, e: usize| unsafe { (*stats.add(col(nt, e)))[0] };
            // Pᵀ ∘ slope as f16 pairs: word `2·nt + r` holds row `g + 8r`'s two columns of tile `nt`.
            let mut ps = [0u32; 16];
            // One branch per tile, the common tile straight-line code (as the forward).
            if !masked && score.plain() {
                each::<8>(|nt| {
                    each::<4>(|e| x[nt][e] = exp2(crate::fma(x[nt][e], score.mul, -lse2(nt, e))));
                    each::<2>(|r| ps[2 * nt + r] = crate::f16x2(x[nt][2 * r], x[nt][2 * r + 1]));
                });
            } else {
                each::<8>(|nt| {
                    let mut sl = [0.0f32; 4];
                    each::<4>(|e| {
                        let (sc, slope) = score.with_slope(x[nt][e]);
                        let i = (i0 + col(nt, e)) as i64;
                        let seen = !masked || (i < s.sq && s.allows(i, key0 + 8 * (e >> 1) as i64));
                        x[nt][e] = if seen { exp2(sc - lse2(nt, e)) } else { 0.0 };
                        sl[e] = x[nt][e] * slope;
                    });
                    each::<2>(|r| ps[2 * nt + r] = crate::f16x2(sl[2 * r], sl[2 * r + 1]));
                });
            }
            unsafe { pv::<T, D, 8>(&mut dv, &x, sdo) };
            wait64(&mut dv);
            unsafe { scores::<T, D, 8>(&mut x, sv, sdo) };
            wait32(&mut x);
            each::<8>(|nt| {
                each::<2>(|r| {
                    let (lo, hi) = unpack_f16x2(ps[2 * nt + r]);
                    let delta = |e: usize| unsafe { (*stats.add(col(nt, e)))[1] };
                    x[nt][2 * r] = lo * (x[nt][2 * r] - delta(2 * r));
                    x[nt][2 * r + 1] = hi * (x[nt][2 * r + 1] - delta(2 * r + 1));
                });
            });
            unsafe { pv::<T, D, 8>(&mut dk, &x, sq) };
        }
        step += 1;
        stage = next;
    }
    wait_all();
    wait64(&mut dk);
    each::<2>(|r| {
        let j = key0 + 8 * r as i64;
        if j < s.sk {
            let t = s.k_start + j as usize;
            unsafe {
                store_row::<T, D>(&dk, r, p.scale, p.dk.ptr, offset(&p.dk, b, t, hk), c);
                store_row::<T, D>(&dv, r, 1.0, p.dv.ptr, offset(&p.dv, b, t, hk), c);
            }
        }
    });
}
