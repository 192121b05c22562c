//! The forward with the gradient on staged rows (plain options, 16-byte vectors): each block
//! copies its slice of a row into shared memory (`cp.async`) and reads it there twice, for the
//! log-sum-exp and for the gradient, so the logits cross DRAM once each way, as in a copy
//! (the unstaged forward reads them a second time, partly from L2). A row longer than one
//! block's [`STAGE_MAX_BYTES`] is split over a thread-block cluster (sm_90): block `r` of the
//! cluster stages slice `r`, and the blocks merge their maxima and sums through distributed
//! shared memory.
//!
//! Each thread stages exactly the vectors it later reads, so its own `cp.async` wait makes
//! them visible to it and no barrier guards the stage: the next row's copies into a thread's
//! vectors follow that thread's last reads of them.
//!
//! [`STAGE_MAX_BYTES`]: super::abi::STAGE_MAX_BYTES
use super::abi::{MEAN, NONE, Params, STAGE_OFFSET, STAT_COUNT, STAT_WEIGHT};
use super::{Online, block_merge, put_row};
use crate::cp_async::{commit, cp_async_16, shared_addr, wait_all};
use crate::math::{LN_2, LOG2_E, exp2, log2};
use crate::{Elem, V16, Vector, block_dim, block_idx, cluster_blocks, cluster_rank, grid_dim};
use crate::{cluster_sync, lanes, thread_idx};
use core::intrinsics::gpu::gpu_launch_sized_workgroup_mem;

/// The rows of the grid's clusters (a block alone is a cluster of one).
///
/// # Safety
/// The host's checks: the logits and the gradient span their rows, 16-byte aligned with
/// strides of whole vectors; `vocab` a whole number of vectors; no weights, bias, label
/// smoothing or softcap; `p.grad` set; [`STAGE_OFFSET`] plus the block's slice (a
/// `1/cluster_blocks()` share of the row's vectors, rounded up) of dynamic shared memory.
#[inline(always)]
pub(super) unsafe fn rows<T: Elem>(p: &Params) {
    let (tid, bd) = (thread_idx(), block_dim());
    let (blocks, rank) = (cluster_blocks(), cluster_rank());
    let vocab = p.vocab as usize;
    let groups = vocab / T::LANES;
    let part = groups.div_ceil(blocks);
    let first = rank * part;
    let count = part.min(groups.saturating_sub(first));
    // SAFETY: the host gives STAGE_OFFSET bytes before the slice.
    let stage =
        unsafe { gpu_launch_sized_workgroup_mem::<u8>().add(STAGE_OFFSET as usize) } as *mut V16;
    let stage_at = shared_addr(stage);
    // SAFETY (every raw access below): the host's checks on `p`'s buffers.
    let stats = |i: usize| unsafe { *(p.stats as *const f32).add(i) };
    let (den_w, den_n) = if p.reduction == MEAN {
        (stats(STAT_WEIGHT), stats(STAT_COUNT))
    } else {
        (1.0, 1.0)
    };
    let mut exchanges = 0;
    let mut row = block_idx() / blocks;
    while (row as u64) < p.rows {
        let z = unsafe { (p.logits as *const V16).add(row * p.logits_stride as usize / T::LANES) };
        let g = unsafe { (p.grad as *mut V16).add(row * p.grad_stride as usize / T::LANES) };
        let (z, g) = unsafe { (z.add(first), g.add(first)) };
        let t = unsafe { *(p.target as *const i64).add(row) };
        if t == p.ignore_index {
            if rank == 0 && tid == 0 {
                unsafe { put_row(p, row, 0.0, 0.0, 0.0) };
            }
            let mut k = tid;
            while k < count {
                unsafe { V16::ZERO.store(g.add(k)) };
                k += bd;
            }
        } else {
            let mut k = tid;
            while k < count {
                unsafe { cp_async_16(stage_at + 16 * k as u32, z.add(k) as u64, true) };
                k += bd;
            }
            commit();
            wait_all();
            let valid = t >= 0 && (t as u64) < vocab as u64;
            // The target's logit rides the block's sum: the thread that staged it adds it,
            // every other thread adds 0.
            let (mut on, mut x_t) = (Online::EMPTY, 0.0);
            let mut k = tid;
            while k < count {
                let v = unsafe { V16::load(stage.add(k)) };
                let j = (first + k) * T::LANES;
                let mut xs = [0.0f32; 8];
                lanes::<T, V16>(|i| {
                    let x = T::lane(&v, i);
                    xs[i] = x * LOG2_E;
                    if (j + i) as i64 == t {
                        x_t = x;
                    }
                });
                on.push(&xs, T::LANES);
                k += bd;
            }
            let (on, x_t) = block_merge(on, x_t);
            let on = if blocks > 1 {
                exchanges += 1;
                unsafe { cluster_merge(on, exchanges & 1) }
            } else {
                on
            };
            let lse = if valid {
                (on.m + log2(on.s)) * LN_2
            } else {
                f32::NAN
            };
            // The block that staged the target's logit writes the row's values (block 0 when
            // the target is outside the vocabulary).
            let owner = if valid {
                t as usize / T::LANES / part
            } else {
                0
            };
            if tid == 0 && rank == owner {
                let ce = if valid { lse - x_t } else { f32::NAN };
                unsafe { put_row(p, row, ce, p.lse_square_scale * lse * lse, lse) };
            }
            let up = match (p.grad_loss, p.reduction) {
                (0, _) => 1.0,
                (gl, NONE) => unsafe { *(gl as *const f32).add(row) },
                (gl, _) => unsafe { *(gl as *const f32) },
            };
            let w_t = if valid { 1.0 } else { f32::NAN };
            let a = up * (w_t / den_w + 2.0 * p.lse_square_scale * lse / den_n);
            let c = up * w_t / den_w;
            let lse2 = lse * LOG2_E;
            let mut k = tid;
            while k < count {
                let v = unsafe { V16::load(stage.add(k)) };
                let j = (first + k) * T::LANES;
                let mut out = [0.0f32; 8];
                lanes::<T, V16>(|i| {
                    let mut d = a * exp2(T::lane(&v, i) * LOG2_E - lse2);
                    if (j + i) as i64 == t {
                        d -= c;
                    }
                    out[i] = d;
                });
                unsafe { T::pack::<V16>(&out).store(g.add(k)) };
                k += bd;
            }
        }
        row += grid_dim() / blocks;
    }
    if blocks > 1 {
        // The other blocks may still read this block's last exchange slot.
        cluster_sync();
    }
}

/// The row's maximum and sum over the cluster from each block's `on`, merged in rank order:
/// the same bits in every thread of every block. Block `r`'s thread 0 posts `on` in its
/// exchange slot `slot`, and after a cluster barrier lane `r` of every warp reads block `r`'s.
/// A slot is posted again two exchanges later, after the next exchange's barrier, which every
/// block passes only once it has read this one.
///
/// # Safety
/// Every thread of every block of the cluster calls it, with the same `slot`, alternating
/// 0, 1, 0, … over the calls; [`EXCHANGE_OFFSET`] plus two slots of dynamic shared memory.
#[cfg(target_feature = "sm_90")]
#[inline(always)]
unsafe fn cluster_merge(on: Online, slot: usize) -> Online {
    use super::abi::EXCHANGE_OFFSET;
    use crate::load_from_cluster_block;
    use crate::math::shfl_from;
    // SAFETY: the host gives the slots.
    let slot = unsafe {
        (gpu_launch_sized_workgroup_mem::<u8>().add(EXCHANGE_OFFSET as usize) as *mut V16).add(slot)
    };
    if thread_idx() == 0 {
        let posted = V16 {
            a: on.m.to_bits(),
            b: on.s.to_bits(),
            c: 0,
            d: 0,
        };
        // SAFETY: this block's slot; no block reads it until the barrier below.
        unsafe { posted.store(slot) };
    }
    cluster_sync();
    let (lane, blocks) = (thread_idx() & 31, cluster_blocks());
    let theirs = if lane < blocks {
        // SAFETY: block `lane` of the cluster posted its slot before the barrier and keeps
        // running until the kernel's last cluster barrier.
        unsafe { load_from_cluster_block(slot, lane) }
    } else {
        V16::ZERO
    };
    let mut all = Online::EMPTY;
    for r in 0..blocks {
        all = all.merge(Online {
            m: shfl_from(f32::from_bits(theirs.a), r as u32),
            s: shfl_from(f32::from_bits(theirs.b), r as u32),
        });
    }
    all
}

/// Without clusters (the sm_80 build) every row fits one block and nothing is merged.
#[cfg(not(target_feature = "sm_90"))]
#[inline(always)]
unsafe fn cluster_merge(on: Online, _slot: usize) -> Online {
    on
}
