//! The sm_80 build's tensor-core backward on `mma.sync` m16n8k16: dQ with four warps per
//! block of 64 query rows, dK/dV with eight warps per block of 64 key rows, which trade P and
//! dS through shared memory ([`dkdv`]). The sm_90a build's is `hopper`.
use super::abi::{
    DKDV_QUERY_TILE, DKDV_THREADS, MMA_KEYS, MMA_ROWS, Params, THREADS, dkdv_stage_bytes,
    dkdv_threads, dq_key_tile, dq_threads,
};
use super::mma::each;
use super::mma::{
    Lanes, commit, ldmatrix_x4, ldmatrix_x4_trans, load_tile, mma, mma_abt, mma_pb, swizzled,
    wait_all, wait_one_pending,
};
use super::tc::{lane_parts, last_first, probs_and_ds, row_stats, shared_base, store_row};
use super::{Half, Score, Seq, block_y, block_z, offset};
use crate::{block_idx, sync_threads, thread_idx};

/// Threads of a four-warp block (dQ) and of an eight-warp block (dK/dV).
const WARPS4: usize = THREADS as usize;
const WARPS8: usize = DKDV_THREADS as usize;

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

/// Threads of the dQ kernel at head_dim 64 and 128 (four warps at both).
pub(crate) const DQ_THREADS64: usize = dq_threads(false, 64) as usize;
/// See [`DQ_THREADS64`].
pub(crate) const DQ_THREADS128: usize = dq_threads(false, 128) as usize;

/// dQ of a block of [`MMA_ROWS`] query rows of one head.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dq<T: Half, const D: usize, const N: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const { assert!(N == THREADS as usize) };
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
    let stats: [_; 2] = core::array::from_fn(|r| {
        let [lse2, delta] = unsafe { row_stats(p, &s, b, h, m0 + (16 * warp + g + 8 * r) as i64) };
        (lse2, delta)
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

/// Threads of the dK/dV kernel at head_dim 64 and 128 (eight warps at both).
pub(crate) const DKDV_THREADS64: usize = dkdv_threads(false, 64) as usize;
/// See [`DKDV_THREADS64`].
pub(crate) const DKDV_THREADS128: usize = dkdv_threads(false, 128) as usize;

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
pub(crate) unsafe fn dkdv<T: Half, const D: usize, const N: usize>(p: &Params) {
    const { assert!(D == 64 || D == 128) };
    const { assert!(N == WARPS8) };
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
            *stats.add(tid) = row_stats(p, &s, b, h, (i0 + tid) as i64);
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
