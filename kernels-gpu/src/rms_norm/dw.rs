//! dW across blocks: the cluster's partial row (sm_90) and the fixed-order reduction.
use super::*;

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
pub(super) unsafe fn write_cluster_partial(dw_s: *const f32, dw_partial: *mut f32, cols: usize) {
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
pub(super) const DW_UNROLL: usize = 8;

/// `dw[c] = D(Σ_b partial[b][c])` in a fixed order (deterministic).
///
/// Block `(nx, ny)`: `threadIdx.x` picks one of `nx` consecutive columns (coalesced runs of the
/// partial rows), `threadIdx.y` sums parts `y, y + ny, …` of it — `ny` independent streams per
/// column instead of one serial walk over hundreds of parts, each issuing [`DW_UNROLL`] loads
/// before adding them in part order — and the `ny` sums are added in `y` order through shared
/// memory (`nx·ny` f32). The partials are L2-resident (just written), so the reduction is bound
/// by load latency, not bandwidth.
#[inline(always)]
pub(super) unsafe fn dw_reduce<T: Elem>(
    partial: *const f32,
    parts: usize,
    cols: usize,
    dw: *mut T,
) {
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
