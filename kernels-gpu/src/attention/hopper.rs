//! The sm_90a build's tensor-core dQ kernel on Hopper's warpgroup `wgmma` ([`super::wgmma`]):
//! one warpgroup (four warps) per block of 64 query rows, K and V tiles of 64 keys in that
//! file's swizzled layout, in two `cp.async` stages (the next tile's copy overlapping the
//! current tile's products). `S = Q·Kᵀ` and `dP = dO·Vᵀ` come from shared memory, then
//! `dQ += dS·K` takes dS from registers and K as an MN-major operand: the forward's shape with
//! one more product. Every product is a 64-row one whose accumulator fragments are
//! `mma.sync`'s, so dS and the stores are [`super::tc`]'s code; each is waited for before its
//! registers are read. (The dK/dV kernel is [`super::mma_bwd`]'s in both builds.)
use super::abi::{MMA_ROWS, Params, THREADS};
use super::mma::{commit, wait_all};
use super::tc::{each, probs_and_ds, row_stats, store_row};
use super::wgmma::{self, load_tile, pv, scores, wait32, wait64};
use super::{Half, Score, Seq, block_y, block_z, offset};
use crate::{block_idx, grid_dim, sync_threads, thread_idx};

const THREADS4: usize = THREADS as usize;
/// Rows of every tile: a warpgroup's product.
const ROWS: usize = 64;
const _: () = assert!(MMA_ROWS as usize == ROWS);

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
