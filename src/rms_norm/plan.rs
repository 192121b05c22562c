//! Which kernels an RMSNorm call runs (RMSNorm's or the fused residual add's), on which grids
//! and launch kinds: the vector rules, the paths, the backward's dW placement (registers,
//! shared memory, clusters) and grid caps, from the arguments, the element type, the buffers'
//! alignment and the device's resident blocks.
use super::args::RmsNormArgs;
use crate::CastingMode;
use crate::dtype::Dtype;
use crate::error::{Result, invalid};
use crate::identity::{
    Kernel, Mode, NormInput, NormPass, RmsNormLayout, RmsNormShape, SUM_SLOTS, has_shared_dw,
};
use crate::launch::item_grid;
use crate::module::Kernels;
use crate::settings::{LaunchSettings, MAX_FUSED_SIZE, calculate_settings};
use cudarc::driver::CudaContext;

/// Dynamic shared memory of the row kernels' block reductions ([`SUM_SLOTS`] f32).
pub(crate) const REDUCE_SMEM_BYTES: u32 = (SUM_SLOTS * 4) as u32;

/// Rows per block below which the backward keeps dW in registers even where shared memory fits
/// more blocks: bf16 4096 columns (3 vs 2 blocks per SM) measured −12 % at 2048 rows (5 rows a
/// block) and +10 % at 16384 rows (41 a block); bf16 2048 columns in blocks of 128 threads
/// (`_vs2` 8 blocks per SM against `_v2` 4) +3.5 % at 16384 rows (15.5 a block).
pub(crate) const SMEM_DW_MIN_ROWS: usize = 8;

/// Dynamic shared memory a block may use without opting in to more (48 KiB).
pub(crate) const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// Most f32 elements of dW partial rows (256 MiB) whenever there are two or more: very wide
/// rows get fewer, longer-lived blocks in the backward instead of a larger scratch buffer. The
/// dW reduction kernel relies on it: it offsets within the partials in 32 bits.
pub(crate) const DW_PARTIAL_MAX: usize = 1 << 26;

/// Block of the dW reduction: `DW_REDUCE_COLS` columns × `DW_REDUCE_PART_LANES` parallel sums
/// over the parts.
pub(crate) const DW_REDUCE_COLS: u32 = 32;

/// See [`DW_REDUCE_COLS`].
pub(crate) const DW_REDUCE_PART_LANES: u32 = 32;

/// Block shape for rows of `cols` columns: Liger's [`calculate_settings`] up to
/// [`MAX_FUSED_SIZE`], beyond it the widest block (32 warps), whose threads stride the row.
pub(crate) fn row_settings(cols: usize) -> Result<LaunchSettings> {
    if cols == 0 {
        return Err(invalid("args.cols", "at least 1 column", cols));
    }
    if cols > MAX_FUSED_SIZE {
        return Ok(LaunchSettings {
            block_size: MAX_FUSED_SIZE,
            num_warps: 32,
        });
    }
    calculate_settings(cols)
}

/// How one pass's vector kernels are shaped: `steps` lists `(K, most threads)` by
/// increasing `K` (the `_v{K}` kernels that exist); the first `K` whose row fits in a block of
/// at most that many threads runs.
pub(crate) struct VecRule {
    pub(crate) steps: &'static [(usize, usize)],
}

impl VecRule {
    /// The vectors per thread this rule can choose.
    pub(crate) fn per_thread(&self) -> impl DoubleEndedIterator<Item = usize> {
        self.steps.iter().map(|&(k, _)| k)
    }
}

/// Forward, 16-bit types: K = 1, 2, 4, up to 128 threads. Against 256 (H200 A/B,
/// PERFORMANCE.md, "RMSNorm forward"): bf16 16384×2048 +4 % (`_vw2` at 128 threads instead of
/// `_v1` at 256), 2048×4096 +5 %, level elsewhere; bf16 16384×4096 with `_vw2` at 256 instead of
/// `_vw4` at 128 level.
pub(crate) const FWD_RULE_16: VecRule = VecRule {
    steps: &[(1, 128), (2, 128), (4, 128)],
};

/// Forward, f32: the same, but K = 2 up to 256 threads: f32 16384×2048 runs `_vw2` at 256
/// threads instead of `_vw4` at 128, 70.4–70.6 → 69.3–69.6 µs on an H200 (PERFORMANCE.md,
/// "RMSNorm forward").
pub(crate) const FWD_RULE_F32: VecRule = VecRule {
    steps: &[(1, 128), (2, 256), (4, 128)],
};

/// Backward: K = 1, 2 (the dW accumulators need the registers a fourth vector would take), up
/// to 128 threads: twice the rows in flight per SM at bf16 16384×2048 (`_vs2` at 128 threads,
/// 8 blocks per SM, against `_vs1` at 256, 5), 62.7 → 60.5 µs on an H200 (PERFORMANCE.md,
/// "RMSNorm backward"); wider rows take K = 2 at more threads either way.
pub(crate) const BWD_RULE: VecRule = VecRule {
    steps: &[(1, 128), (2, 128)],
};

/// The forward's rule for `T`.
pub(crate) fn fwd_rule<T: Dtype>() -> &'static VecRule {
    match std::mem::size_of::<T>() {
        4 => &FWD_RULE_F32,
        _ => &FWD_RULE_16,
    }
}

/// Which kernel a call runs and with how many threads per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// Scalar kernels, Liger's row-block shape (any alignment, any `cols`).
    Scalar { threads: u32 },
    /// 16-byte vector kernels `_v{per_thread}` (aligned rows, `cols` a multiple of the lanes).
    Vector { per_thread: usize, threads: u32 },
}

impl Path {
    /// The vector path when every pointer and row stride is 16-byte aligned and `cols` is a
    /// multiple of the lanes per vector: the first step of `rule` whose vectors per thread keep
    /// the block within its threads, else the most vectors per thread whose block fits;
    /// `capacity(k)` is the most threads per block the `_v{k}` kernel can launch with (its
    /// register use decides). Otherwise the scalar path.
    pub(crate) fn choose<T: Dtype>(
        settings: LaunchSettings,
        cols: usize,
        ptrs: &[u64],
        strides: &[usize],
        rule: &VecRule,
        capacity: impl Fn(usize) -> Result<usize>,
    ) -> Result<Path> {
        let scalar = Path::Scalar {
            threads: settings.threads(),
        };
        let size = std::mem::size_of::<T>();
        let lanes = 16 / size;
        let aligned = cols.is_multiple_of(lanes)
            && ptrs.iter().all(|p| p.is_multiple_of(16))
            // Wrapping: a stride only one row ever takes may be any size; 16 divides 2⁶⁴.
            && strides.iter().all(|s| s.wrapping_mul(size).is_multiple_of(16));
        if !aligned {
            return Ok(scalar);
        }
        let vecs = cols / lanes;
        let threads = |k: usize| vecs.div_ceil(k).next_multiple_of(32);
        let vector = |k: usize| Path::Vector {
            per_thread: k,
            threads: threads(k) as u32,
        };
        for &(k, most) in rule.steps {
            if threads(k) <= most.min(capacity(k)?) {
                return Ok(vector(k));
            }
        }
        for k in rule.per_thread().rev() {
            if threads(k) <= capacity(k)? {
                return Ok(vector(k));
            }
        }
        Ok(scalar)
    }

    pub(crate) fn threads(self) -> u32 {
        match self {
            Path::Scalar { threads } | Path::Vector { threads, .. } => threads,
        }
    }

    /// The kernel of `step` that runs this path (a vector path: its grid-stride one).
    pub(crate) fn kernel<T: Dtype>(self, step: Step, args: &RmsNormArgs) -> Kernel {
        let shape = match self {
            Path::Scalar { .. } => RmsNormShape::Scalar,
            Path::Vector { per_thread, .. } => RmsNormShape::Vector {
                layout: RmsNormLayout::Resident,
                per_thread,
            },
        };
        kernel::<T>(step, shape, args)
    }
}

/// The kernel of `T` for `step` and `shape`, in the mode `args` selects for that shape
/// ([`vector_mode`]).
pub(crate) fn kernel<T: Dtype>(
    (input, pass): Step,
    shape: RmsNormShape,
    args: &RmsNormArgs,
) -> Kernel {
    let mode = match shape {
        RmsNormShape::Scalar => args.mode.kernel_mode(),
        RmsNormShape::Vector { .. } => vector_mode::<T>(args),
    };
    Kernel::RmsNorm {
        input,
        pass,
        shape,
        elem: T::ELEM,
        mode,
    }
}

/// The vector kernel of `T` for `step`, `layout` and `per_thread` vectors per thread.
pub(crate) fn vector_kernel<T: Dtype>(
    step: Step,
    layout: RmsNormLayout,
    per_thread: usize,
    args: &RmsNormArgs,
) -> Kernel {
    let shape = RmsNormShape::Vector { layout, per_thread };
    kernel::<T>(step, shape, args)
}

/// The mode of the vector kernels for `args`. The `llama` vector kernels form the weight
/// product `D(x·r)·(offset + w)` as one packed product of two values of `T`, exact only when
/// `offset + w` is a value of `T`: always in f32, and in 16-bit types when `offset = ±0` (the
/// HF formula). Other offsets in 16-bit llama run the `llama_offset` kernels, which multiply
/// lane by lane in f32 (more registers, fewer blocks per SM). The scalar kernels take any offset.
pub(crate) fn vector_mode<T: Dtype>(args: &RmsNormArgs) -> Mode {
    match args.mode {
        CastingMode::Llama if T::ELEM.size() == 2 && args.offset != 0.0 => Mode::LlamaOffset,
        mode => mode.kernel_mode(),
    }
}

/// A backward kernel, its dynamic shared memory, and whether it keeps dW in shared memory
/// (`_vs{K}`).
pub(crate) struct BackwardKernel {
    pub(crate) kernel: Kernel,
    pub(crate) smem: u32,
    pub(crate) shared_dw: bool,
}

/// What a kernel computes: the row it normalises (`x`, or the fused residual add's sum) and
/// its pass.
pub(crate) type Step = (NormInput, NormPass);

/// The input of a call (`add`: the fused residual add's sum).
pub(crate) fn input(add: bool) -> NormInput {
    match add {
        false => NormInput::Plain,
        true => NormInput::Add,
    }
}

/// The backward: [`NormPass::Backward`] where `dw` is wanted, else the dX-only
/// [`NormPass::BackwardDx`] (a frozen weight, or none), whose kernels hold no dW.
pub(crate) fn backward_step(dw: bool, add: bool) -> Step {
    let pass = match dw {
        true => NormPass::Backward,
        false => NormPass::BackwardDx,
    };
    (input(add), pass)
}

/// The forward.
pub(crate) fn forward_step(add: bool) -> Step {
    (input(add), NormPass::Forward)
}

/// The `_vs{K}` twin of a vector `path`'s backward and its dynamic shared memory, where one
/// exists ([`has_shared_dw`]) and it can run: with dW wanted, and its `cols` f32 of dW within
/// the 48 KiB a block gets without opting in (the register kernels' thread limit keeps vector
/// rows below that anyway).
pub(crate) fn shared_dw_kernel<T: Dtype>(
    path: Path,
    args: &RmsNormArgs,
    dw: bool,
    add: bool,
) -> Option<(Kernel, u32)> {
    let Path::Vector { per_thread, .. } = path else {
        return None;
    };
    let smem = REDUCE_SMEM_BYTES as usize + args.cols * 4;
    if !dw || !has_shared_dw(T::ELEM, per_thread) || smem > DEFAULT_SMEM_LIMIT as usize {
        return None;
    }
    let layout = RmsNormLayout::SharedDw;
    Some((
        vector_kernel::<T>(backward_step(true, add), layout, per_thread, args),
        smem as u32,
    ))
}

/// The backward kernel for `path` (`dw`: with dW). With dW, a vector path may have two kernels
/// ([`shared_dw_kernel`]): `_v{K}` keeps each block's dW partial row in registers, `_vs{K}` in
/// shared memory. Shared memory runs when it fits more blocks per SM and every block gets at
/// least [`SMEM_DW_MIN_ROWS`] rows (its per-block set-up and per-element round trip pay off
/// only over many rows). Without dW the `bwd_dx` kernel of the path runs: it holds no dW in
/// registers, so its `_v{K}` fits as many blocks as a `_vs{K}` would, or more.
pub(crate) fn backward_kernel<T: Dtype>(
    kernels: &Kernels,
    path: Path,
    args: &RmsNormArgs,
    dw: bool,
    add: bool,
) -> Result<BackwardKernel> {
    let kernel = path.kernel::<T>(backward_step(dw, add), args);
    let in_registers = BackwardKernel {
        kernel,
        smem: REDUCE_SMEM_BYTES,
        shared_dw: false,
    };
    let Some((shared, smem)) = shared_dw_kernel::<T>(path, args, dw, add) else {
        return Ok(in_registers);
    };
    let threads = path.threads();
    let resident_registers =
        kernels.resident_blocks(&kernels.function(kernel)?, threads, REDUCE_SMEM_BYTES)?;
    let resident_shared = kernels.resident_blocks(&kernels.function(shared)?, threads, smem)?;
    if shared_dw(args.rows, resident_registers, resident_shared) {
        Ok(BackwardKernel {
            kernel: shared,
            smem,
            shared_dw: true,
        })
    } else {
        Ok(in_registers)
    }
}

/// What one backward call launches: the kernel, its block and grid, its dynamic shared memory
/// and blocks per cluster (1: no clusters); the dW reduction then sums `grid / cluster` partial
/// rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BackwardLaunch {
    pub(crate) kernel: Kernel,
    pub(crate) threads: u32,
    pub(crate) grid: usize,
    pub(crate) smem: u32,
    pub(crate) cluster: usize,
}

/// The backward launch for `path` in `ctx` (`dw`: with dW): [`backward_kernel`], a grid of the
/// blocks that fit at once (at most one per row, and at most [`DW_PARTIAL_MAX`] partial-row
/// elements with dW, or [`dx_grid_cap`] blocks without), and with the sm_90 build the
/// shared-memory dW kernels in clusters ([`cluster_grid`]).
pub(crate) fn backward_launch<T: Dtype>(
    ctx: &CudaContext,
    kernels: &Kernels,
    path: Path,
    args: &RmsNormArgs,
    dw: bool,
    add: bool,
) -> Result<BackwardLaunch> {
    let threads = path.threads();
    let bwd = backward_kernel::<T>(kernels, path, args, dw, add)?;
    let func = kernels.function(bwd.kernel)?;
    let resident = kernels.resident_blocks(&func, threads, bwd.smem)?;
    let mut grid = args.rows.min(resident).min(i32::MAX as usize);
    grid = match dw {
        true => grid.min((DW_PARTIAL_MAX / args.cols).max(1)),
        false => grid.min(dx_grid_cap(
            args.rows,
            args.cols * std::mem::size_of::<T>(),
            kernels.sm_count(),
        )),
    };
    let mut cluster = 1;
    if bwd.shared_dw && kernels.sm90 {
        let fit = kernels.resident_clusters(ctx, &func, threads, bwd.smem, DW_CLUSTER as u32)?;
        (grid, cluster) = cluster_grid(grid, fit);
    }
    Ok(BackwardLaunch {
        kernel: bwd.kernel,
        threads,
        grid,
        smem: bwd.smem,
        cluster,
    })
}

/// Bytes of rows that the frozen-weight backward's blocks hold at once, where it has many
/// rows per block ([`dx_grid_cap`]).
pub(crate) const DX_GRID_BYTES: usize = 4 << 20;

/// Rows per block from which the frozen-weight backward's grid is capped ([`dx_grid_cap`]).
pub(crate) const DX_MIN_ROWS_PER_BLOCK: usize = 32;

/// The most blocks of the frozen-weight backward (the `bwd_dx` kernels: no partial rows, no
/// reduction) over `rows` rows of `row_bytes`: [`DX_GRID_BYTES`] of rows at once, and at least
/// one block per SM, where that leaves each block [`DX_MIN_ROWS_PER_BLOCK`] rows or more; else
/// no cap (the resident grid). On an H200 the resident grid ran the 16384-row backward
/// slower than with dW at f32 4096 columns; a sweep of caps (132…1056 blocks) measured best
/// near 4 MiB of rows (f32 16384×4096: 204.1 → 195.1 µs at 264 blocks; f32 16384×2048 105.5 →
/// 100.6 µs at 528; bf16 16384×4096 104.8 → 102.9 µs at 528), level at 8192 columns, and 5 %
/// slower with 2048 rows, which keep the resident grid. This rule (256 and 512 blocks at
/// those shapes) then measured 195.2, 100.4 and 102.8 µs (PERFORMANCE.md, "RMSNorm kernels").
pub(crate) fn dx_grid_cap(rows: usize, row_bytes: usize, sms: usize) -> usize {
    let cap = (DX_GRID_BYTES / row_bytes.max(1)).max(sms);
    match rows >= DX_MIN_ROWS_PER_BLOCK * cap {
        true => cap,
        false => usize::MAX,
    }
}

/// Blocks per thread-block cluster of the shared-memory dW backward in the sm_90 build: the
/// blocks of a cluster merge their dW rows into one partial row (`write_cluster_partial` in
/// kernels-gpu), halving the rows written as the grid ends and read by the reduction. In a CUDA
/// C stand-in on an H200 (PERFORMANCE.md, "sm_90: dependent launch and dW clusters"): bf16
/// 16384×2048 −1.3 µs with 2,
/// −0.8 µs with 4 or 8 (only 124 clusters of 8 fit at once, 992 of 1056 blocks), 16 slower;
/// 16384×4096 level with 2, 1.7 µs slower with 4 or 8 (fewer resident clusters than blocks).
pub(crate) const DW_CLUSTER: usize = 2;

/// The backward's grid and blocks per cluster when its dW rows are merged in clusters of
/// [`DW_CLUSTER`] and `fit` clusters can be resident at once: the grid rounded down to whole
/// clusters, at most `fit` of them; `(grid, 1)` (no clusters) where not one cluster would run.
pub(crate) fn cluster_grid(grid: usize, fit: usize) -> (usize, usize) {
    match (grid / DW_CLUSTER).min(fit) {
        0 => (grid, 1),
        clusters => (clusters * DW_CLUSTER, DW_CLUSTER),
    }
}

/// Whether the backward keeps dW in shared memory, given the resident blocks (whole device) of
/// the register and shared-memory kernels: only when shared memory fits more blocks and every
/// one of them still gets at least [`SMEM_DW_MIN_ROWS`] rows.
pub(crate) fn shared_dw(rows: usize, in_registers: usize, in_shared: usize) -> bool {
    in_shared > in_registers && rows >= SMEM_DW_MIN_ROWS * in_shared
}

/// The forward kernel for `path` and its grid. Grid-stride row loops run as many blocks as
/// can be resident at once (SMs × blocks per SM at the path's threads), at most one per row;
/// the vector kernels prefetch a block's next row while finishing the current one. With many
/// waves of rows ([`whole_grid`]) a vector path of two or more vectors per thread runs its
/// one-row-per-block twin instead ([`forward_twin`]; f32 4096: +9 %).
pub(crate) fn forward_kernel<T: Dtype>(
    kernels: &Kernels,
    path: Path,
    args: &RmsNormArgs,
    add: bool,
) -> Result<(Kernel, u32)> {
    let kernel = path.kernel::<T>(forward_step(add), args);
    let func = kernels.function(kernel)?;
    let resident = kernels.resident_blocks(&func, path.threads(), REDUCE_SMEM_BYTES)?;
    let twin = forward_twin::<T>(path, args, add);
    let (whole, grid) = item_grid(args.rows, resident, twin.is_some());
    match twin {
        Some(twin) if whole => Ok((twin, grid)),
        _ => Ok((kernel, grid)),
    }
}

/// The one-row-per-block twin (`_vw{K}`) of a vector `path`'s forward. One vector per
/// thread is a row too short to pay for a block of its own (bf16 2048: −17 %), so `_v1` has
/// none and stays grid-stride.
pub(crate) fn forward_twin<T: Dtype>(path: Path, args: &RmsNormArgs, add: bool) -> Option<Kernel> {
    match path {
        Path::Vector { per_thread, .. } if per_thread >= 2 => Some(vector_kernel::<T>(
            forward_step(add),
            RmsNormLayout::Whole,
            per_thread,
            args,
        )),
        _ => None,
    }
}

/// Most threads per block `kernel` can launch with (fewer when it uses many registers).
pub(crate) fn capacity(kernels: &Kernels, kernel: Kernel) -> Result<usize> {
    Ok(kernels.function(kernel)?.max_threads_per_block()?.max(0) as usize)
}

#[cfg(test)]
pub(crate) mod tests;
