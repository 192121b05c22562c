//! The tensor-core backward of the sm_90a build: dQ and dK/dV with Hopper's warpgroup `wgmma`
//! ([`super::wgmma`]), one warpgroup (four warps) per block and tiles of 64 rows in that
//! file's swizzled layout. Every product is a 64-row one whose accumulator fragments are
//! `mma.sync`'s, so the probabilities, dS and the stores are [`super::tc`]'s code:
//! - dQ (64 query rows): `S = Q·Kᵀ` and `dP = dO·Vᵀ` from shared memory, then
//!   `dQ += dS·K` with dS from registers and K as an MN-major operand: the forward's shape
//!   with one more product.
//! - dK/dV (64 key rows): the transposed products `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, then
//!   `dV += Pᵀ·dO` and `dK += dSᵀ·Q` with Pᵀ and dSᵀ from registers: each warp's 16 key rows
//!   hold their probabilities and dS as the A operand straight away, so nothing goes through
//!   shared memory but the operand tiles.
//!
//! Each product is waited for before its registers are read. K/V (dQ) and Q/dO (dK/dV) come in
//! two `cp.async` stages, the next tile's copy overlapping the current tile's products.
use super::abi::{DKDV_THREADS, MMA_KEYS, MMA_ROWS, Params, THREADS, dkdv_stage_bytes_sm90};
use super::mma::{commit, red_add, wait_all};
use super::tc::{each, probs_and_ds, row_stats, store_row};
use super::wgmma::{self, load_tile, mn_product, pv, scores, wait32, wait64};
use super::{Half, Score, Seq, block_y, block_z, exp2, lse_offset, offset};
use crate::{block_idx, grid_dim, sync_threads, thread_idx};
use core::arch::asm;

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

/// dQ of a block of 64 query rows of one head, over key tiles of 64.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dq<T: Half, const D: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    let tid = thread_idx();
    let (warp, g, c) = (tid >> 5, (tid & 31) >> 2, tid & 3);
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let m0 = ((grid_dim() - 1 - block_idx()) * ROWS) as i64;
    if m0 >= s.sq {
        return;
    }
    let i1 = (m0 + ROWS as i64 - 1).min(s.sq - 1);
    let hk = h / (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let (base, _) = base();
    let tile = (ROWS * D * 2) as u32;
    let (sq, sdo, stages) = (base, base + tile, base + 2 * tile);
    let rows_left = (s.sq - m0) as usize;
    let tok0 = s.q_start + m0 as usize;
    unsafe {
        let q = p.q.ptr + 2 * offset(&p.q, b, tok0, h) as u64;
        load_tile::<D, THREADS4>(sq, q, p.q.token as usize, ROWS, rows_left, tid);
        let d_o = p.d_o.ptr + 2 * offset(&p.d_o, b, tok0, h) as u64;
        load_tile::<D, THREADS4>(sdo, d_o, p.d_o.token as usize, ROWS, rows_left, tid);
    }
    commit();
    let stats: [_; 2] = core::array::from_fn(|r| {
        let [lse2, delta] = unsafe { row_stats(p, &s, b, h, m0 + (16 * warp + g + 8 * r) as i64) };
        (lse2, delta)
    });
    let k_base = p.k.ptr + 2 * offset(&p.k, b, s.k_start, hk) as u64;
    let v_base = p.v.ptr + 2 * offset(&p.v, b, s.k_start, hk) as u64;
    let (kt, vt) = (p.k.token as usize, p.v.token as usize);
    let load = |n0: usize, stage: u32| unsafe {
        let at = stages + stage * 2 * tile;
        let valid = s.sk as usize - n0;
        load_tile::<D, THREADS4>(at, k_base + (2 * n0 * kt) as u64, kt, ROWS, valid, tid);
        load_tile::<D, THREADS4>(
            at + tile,
            v_base + (2 * n0 * vt) as u64,
            vt,
            ROWS,
            valid,
            tid,
        );
    };
    let (lo, hi) = s.keys(m0, i1);
    let first = (lo.max(0) as usize / ROWS) * ROWS;
    let end = hi.max(0) as usize;
    if first < end {
        load(first, 0);
    }
    commit();
    let mut acc = [[0.0f32; 4]; 16];
    let row0 = m0 + (16 * warp + g) as i64;
    let (mut n0, mut stage) = (first, 0u32);
    while n0 < end {
        landed();
        if n0 + ROWS < end {
            load(n0 + ROWS, stage ^ 1);
        }
        commit();
        let (sk, sv) = (stages + stage * 2 * tile, stages + stage * 2 * tile + tile);
        let (mut sc, mut dp) = ([[0.0f32; 4]; 8], [[0.0f32; 4]; 8]);
        unsafe {
            scores::<T, D>(&mut sc, sq, sk);
            scores::<T, D>(&mut dp, sdo, sv);
        }
        wait32(&mut sc);
        wait32(&mut dp);
        let masked = !s.all_allowed(m0, i1, n0 as i64, (n0 + ROWS - 1) as i64);
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
        unsafe { pv::<T, D>(&mut acc, &dp, sk) };
        wait64(&mut acc);
        n0 += ROWS;
        stage ^= 1;
    }
    wait_all();
    each::<2>(|r| {
        let i = m0 + (16 * warp + g + 8 * r) as i64;
        if i < s.sq {
            let at = offset(&p.dq, b, s.q_start + i as usize, h);
            unsafe { store_row::<T, D>(&acc, r, p.scale, p.dq.ptr, at, c) };
        }
    });
}

/// Threads of the dK/dV kernel: two warpgroups.
const THREADS8: usize = DKDV_THREADS as usize;

/// Named barrier 1 over both warpgroups: the first arrives once its probabilities are in
/// shared memory, the second waits for them (`bar.arrive` / `bar.sync`; barrier 0 is
/// `__syncthreads`'s).
#[inline(always)]
fn probs_arrive() {
    // SAFETY: a barrier all 256 threads of the block take once per step, by warpgroup role.
    unsafe { asm!("bar.arrive 1, 256;", options(nostack)) }
}

/// See [`probs_arrive`].
#[inline(always)]
fn probs_wait() {
    // SAFETY: as `probs_arrive`; the implied memory clobber keeps the reads after it.
    unsafe { asm!("bar.sync 1, 256;", options(nostack)) }
}

/// Named barrier 2, as [`probs_arrive`] the other way: the second warpgroup arrives once its
/// dSᵀ tile is in shared memory, the first (which computes `dQ = dS·K`) waits for it.
#[inline(always)]
fn ds_arrive() {
    // SAFETY: as `probs_arrive`.
    unsafe { asm!("bar.arrive 2, 256;", options(nostack)) }
}

/// See [`ds_arrive`].
#[inline(always)]
fn ds_wait() {
    // SAFETY: as `probs_wait`.
    unsafe { asm!("bar.sync 2, 256;", options(nostack)) }
}

/// dK and dV of a block of 64 key rows of one key/value head, over every query head of its
/// group and every tile of 64 queries that sees them, summed in registers in that order. Two
/// warpgroups share each step's tiles and split its four products: the first computes
/// `Sᵀ = K·Qᵀ`, the probabilities Pᵀ and `dV += Pᵀ·dO`; the second `dPᵀ = V·dOᵀ` and, once the
/// first has left `Pᵀ ∘ slope` in shared memory (f32, each thread's fragment for the thread
/// of the same place in the other warpgroup), `dSᵀ = Pᵀ ∘ slope ∘ (dPᵀ − delta)` and
/// `dK += dSᵀ·Q`. Each thread then holds one 64 × D accumulator and one 64 × 64 product, where
/// one warpgroup doing all four would hold two of each and spill at head_dim 128.
///
/// With `DQ` (the nondeterministic backward) the step also takes dQ's share of its keys: the
/// second warpgroup leaves dSᵀ (16-bit, the tile layout) in shared memory and the first,
/// while `dV += Pᵀ·dO` runs, computes `dS·K` 64 columns at a time (both operands MN-major)
/// and adds it into `dq_accum` by atomics.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dkdv<T: Half, const D: usize, const DQ: bool>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    let tid = thread_idx();
    let (wg, t) = (tid >> 7, tid & 127);
    let (warp, g, c) = (t >> 5, (t & 31) >> 2, t & 3);
    let (b, hk) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    let n0 = (block_idx() * ROWS) as i64;
    if n0 >= s.sk {
        return;
    }
    let n1 = (n0 + ROWS as i64 - 1).min(s.sk - 1);
    let group = (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let (base, smem) = base();
    let tile = (ROWS * D * 2) as u32;
    let (sk, sv, stages) = (base, base + tile, base + 2 * tile);
    let stage_bytes = dkdv_stage_bytes_sm90(D as u32);
    // After the two stages: the exchange of Pᵀ ∘ slope, word `i` of thread `t` at `i·128 + t`.
    let xchg_at = 2 * tile + 2 * stage_bytes;
    let xchg = unsafe { smem.add(xchg_at as usize) as *mut f32 };
    // After the exchange: the step's dSᵀ tile (64 keys × 64 queries), with `DQ`.
    let sds = base + xchg_at + (ROWS * 64 * 4) as u32;
    unsafe {
        let at = s.k_start + n0 as usize;
        let valid = (s.sk - n0) as usize;
        let k = p.k.ptr + 2 * offset(&p.k, b, at, hk) as u64;
        load_tile::<D, THREADS8>(sk, k, p.k.token as usize, ROWS, valid, tid);
        let v = p.v.ptr + 2 * offset(&p.v, b, at, hk) as u64;
        load_tile::<D, THREADS8>(sv, v, p.v.token as usize, ROWS, valid, tid);
    }
    let (lo, hi) = s.queries(n0, n1);
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
        smem.add((4 * tile + stage * stage_bytes) as usize) as *mut [f32; 2]
    };
    let load = |step: usize, stage: u32| unsafe {
        let h = hk * group + step / tiles;
        let i0 = first + (step % tiles) * ROWS;
        let at = stages + stage * stage_bytes;
        let tok = s.q_start + i0;
        let valid = s.sq as usize - i0;
        let q = p.q.ptr + 2 * offset(&p.q, b, tok, h) as u64;
        let d_o = p.d_o.ptr + 2 * offset(&p.d_o, b, tok, h) as u64;
        load_tile::<D, THREADS8>(at, q, qtok, ROWS, valid, tid);
        load_tile::<D, THREADS8>(at + tile, d_o, dtok, ROWS, valid, tid);
        // The tile's statistics, by plain stores: read after the barrier that the tile's
        // copies wait for. Rows past the sequence get probability 0.
        if tid < ROWS {
            *stats_of(stage).add(tid) = row_stats(p, &s, b, h, (i0 + tid) as i64);
        }
    };
    if steps > 0 {
        load(0, 0);
    }
    commit();
    // dV in the first warpgroup, dK in the second.
    let mut acc = [[0.0f32; 4]; 16];
    let key0 = n0 + (16 * warp + g) as i64;
    let (mut step, mut stage) = (0, 0u32);
    while step < steps {
        // Also ends the previous step: its products and the exchange's reads.
        landed();
        if step + 1 < steps {
            load(step + 1, stage ^ 1);
        }
        commit();
        let i0 = first + (step % tiles) * ROWS;
        let (sq, sdo) = (
            stages + stage * stage_bytes,
            stages + stage * stage_bytes + tile,
        );
        let stats = stats_of(stage) as *const [f32; 2];
        // Each thread's columns: queries i0 + 8·nt + 2c + {0, 1}.
        let col = |nt: usize, e: usize| 8 * nt + 2 * c + (e & 1);
        let mut x = [[0.0f32; 4]; 8];
        if wg == 0 {
            unsafe { scores::<T, D>(&mut x, sk, sq) };
            wait32(&mut x);
            // Key rows past the sequence (zeros) need no mask: their dK and dV are not stored.
            let masked = !s.all_allowed(i0 as i64, (i0 + ROWS - 1) as i64, n0, n1);
            let lse2 = |nt: usize, e: usize| unsafe { (*stats.add(col(nt, e)))[0] };
            // One branch per tile, the common tile straight-line code (as the forward).
            if !masked && score.plain() {
                each::<8>(|nt| {
                    each::<4>(|e| {
                        let pr = exp2(crate::fma(x[nt][e], score.mul, -lse2(nt, e)));
                        x[nt][e] = pr;
                        unsafe { *xchg.add((4 * nt + e) * 128 + t) = pr };
                    });
                });
            } else {
                each::<8>(|nt| {
                    each::<4>(|e| {
                        let (sc, slope) = score.with_slope(x[nt][e]);
                        let i = (i0 + col(nt, e)) as i64;
                        let allowed =
                            !masked || (i < s.sq && s.allows(i, key0 + 8 * (e >> 1) as i64));
                        let pr = if allowed { exp2(sc - lse2(nt, e)) } else { 0.0 };
                        x[nt][e] = pr;
                        unsafe { *xchg.add((4 * nt + e) * 128 + t) = pr * slope };
                    });
                });
            }
            probs_arrive();
            unsafe { pv::<T, D>(&mut acc, &x, sdo) };
            if DQ {
                // Rows of one head and sequence are consecutive rows of the sum.
                let h = hk * group + step / tiles;
                let rows = lse_offset(p, b, h, s.q_start + i0) * D;
                let rows = unsafe { (p.dq_accum as *mut f32).add(rows) };
                ds_wait();
                each::<2>(|half| {
                    if half < D / 64 {
                        let mut q = [[0.0f32; 4]; 8];
                        unsafe { mn_product::<T>(&mut q, sds, sk + half as u32 * tile / 2) };
                        wait32(&mut q);
                        let valid = s.sq as usize - i0;
                        unsafe { add_dq::<D>(rows, &q, valid, half, (warp, g, c)) };
                    }
                });
            }
        } else {
            unsafe { scores::<T, D>(&mut x, sv, sdo) };
            wait32(&mut x);
            probs_wait();
            each::<8>(|nt| {
                each::<4>(|e| {
                    let delta = unsafe { (*stats.add(col(nt, e)))[1] };
                    let ps = unsafe { *xchg.add((4 * nt + e) * 128 + t) };
                    x[nt][e] = ps * (x[nt][e] - delta);
                });
            });
            if DQ {
                each::<8>(|nt| {
                    each::<2>(|r| {
                        let (key, col) = (16 * warp + g + 8 * r, 8 * nt + 2 * c);
                        let at = wgmma::swizzled(ROWS, key, col / 8) as usize + 2 * (col % 8);
                        let w = T::pack2(x[nt][2 * r], x[nt][2 * r + 1]);
                        // SAFETY: inside the dSᵀ tile; 4-byte aligned.
                        unsafe { *(smem.add((sds - base) as usize + at) as *mut u32) = w };
                    });
                });
                wgmma::proxy_fence();
                ds_arrive();
            }
            unsafe { pv::<T, D>(&mut acc, &x, sq) };
        }
        wait64(&mut acc);
        step += 1;
        stage ^= 1;
    }
    wait_all();
    each::<2>(|r| {
        let j = key0 + 8 * r as i64;
        if j < s.sk {
            let tok = s.k_start + j as usize;
            let (out, mul) = if wg == 0 {
                (&p.dv, 1.0)
            } else {
                (&p.dk, p.scale)
            };
            unsafe { store_row::<T, D>(&acc, r, mul, out.ptr, offset(out, b, tok, hk), c) };
        }
    });
}

/// Adds a warpgroup's 64 × 64 block `half` of `dS·K` (rows `16·warp + g + 8r` of the step's
/// queries, head columns `64·half + 8·nt + 2c`, `+1`) into the f32 rows of `D` at `rows`,
/// skipping rows from `valid` on (past the sequence).
///
/// # Safety
/// `rows` has `valid` rows of `D` f32.
#[inline(always)]
unsafe fn add_dq<const D: usize>(
    rows: *mut f32,
    q: &[[f32; 4]; 8],
    valid: usize,
    half: usize,
    (warp, g, c): (usize, usize, usize),
) {
    each::<2>(|r| {
        let i = 16 * warp + g + 8 * r;
        if i < valid {
            let row = unsafe { rows.add(i * D + 64 * half + 2 * c) };
            each::<8>(|nt| unsafe {
                red_add(row.add(8 * nt), q[nt][2 * r]);
                red_add(row.add(8 * nt + 1), q[nt][2 * r + 1]);
            });
        }
    });
}
