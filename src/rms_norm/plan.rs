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
            && strides.iter().all(|s| (s * size).is_multiple_of(16));
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
pub(crate) mod tests {
    use super::super::abi;
    use super::*;
    use crate::identity::ElemType;
    use crate::identity::RmsNormLayout::Resident;
    use half::{bf16, f16};

    fn path<T: Dtype>(cols: usize, ptrs: &[u64], strides: &[usize], cap: usize) -> Path {
        let settings = row_settings(cols).unwrap();
        Path::choose::<T>(settings, cols, ptrs, strides, fwd_rule::<T>(), |_| Ok(cap)).unwrap()
    }

    #[test]
    fn vector_path_needs_alignment_and_whole_vectors() {
        let vector = |per_thread, threads| Path::Vector {
            per_thread,
            threads,
        };
        assert_eq!(
            path::<bf16>(4096, &[256, 512], &[4096], 1024),
            vector(4, 128)
        );
        assert_eq!(path::<bf16>(2048, &[256], &[2048], 1024), vector(2, 128));
        assert_eq!(path::<bf16>(1024, &[256], &[1024], 1024), vector(1, 128));
        // f32: K = 2 up to 256 threads.
        assert_eq!(path::<f32>(1024, &[256], &[1024], 1024), vector(2, 128));
        assert_eq!(path::<f32>(2048, &[256], &[2048], 1024), vector(2, 256));
        // No K keeps its step's threads: the most vectors per thread.
        assert_eq!(path::<f32>(4096, &[256], &[4096], 1024), vector(4, 256));
        assert_eq!(path::<bf16>(16384, &[256], &[16384], 1024), vector(4, 512));
        assert_eq!(path::<f32>(100, &[256], &[100], 1024), vector(1, 32));
        // A kernel whose registers allow only 256 threads caps the choice.
        assert_eq!(path::<bf16>(11008, &[256], &[11008], 1024), vector(4, 352));
        // Misaligned pointer, odd stride, partial vector, too wide: the scalar kernels.
        let scalar = |cols| Path::Scalar {
            threads: row_settings(cols).unwrap().threads(),
        };
        assert_eq!(path::<bf16>(11008, &[256], &[11008], 256), scalar(11008));
        assert_eq!(path::<bf16>(4096, &[256, 2], &[4096], 1024), scalar(4096));
        assert_eq!(path::<bf16>(4096, &[256], &[4100], 1024), scalar(4096));
        assert_eq!(path::<bf16>(4097, &[256], &[4097], 1024), scalar(4097));
        assert_eq!(path::<bf16>(65536, &[256], &[65536], 1024), scalar(65536));
        // Wider than one pass: the scalar kernels with the widest block.
        assert_eq!(path::<f32>(65540, &[256], &[65540], 1024), scalar(65540));
        assert_eq!(scalar(1 << 20), Path::Scalar { threads: 1024 });
    }

    #[test]
    fn cols_must_be_positive_and_may_exceed_one_pass() {
        let err = RmsNormArgs::new(1, 0).check().unwrap_err();
        assert!(err.to_string().contains("args.cols"), "{err}");
        assert_eq!(RmsNormArgs::new(1, 65536).check().unwrap().threads(), 1024);
        assert_eq!(
            RmsNormArgs::new(1, 1 << 24).check().unwrap().threads(),
            1024
        );
    }

    /// Every kernel the launchers can ask for: each path of each rule at every block size,
    /// its twins, in every mode, with and without a weight offset, the dX-only backward, and
    /// the dW reductions.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        fn of<T: Dtype>() -> Vec<Kernel> {
            let mut out = Vec::new();
            for mode in CastingMode::ALL {
                for offset in [0.0, 1.0] {
                    let args = RmsNormArgs::new(1, 8).with_mode(mode).with_offset(offset);
                    for (step, rule) in [
                        (forward_step(false), fwd_rule::<T>()),
                        (forward_step(true), fwd_rule::<T>()),
                        (backward_step(true, false), &BWD_RULE),
                        (backward_step(false, false), &BWD_RULE),
                        (backward_step(true, true), &BWD_RULE),
                        (backward_step(false, true), &BWD_RULE),
                    ] {
                        let add = step.0 == NormInput::Add;
                        let scalar = Path::Scalar { threads: 32 };
                        out.push(scalar.kernel::<T>(step, &args));
                        for (per_thread, threads) in rule
                            .per_thread()
                            .flat_map(|k| (5..=10).map(move |t| (k, 1 << t)))
                        {
                            let path = Path::Vector {
                                per_thread,
                                threads,
                            };
                            out.push(path.kernel::<T>(step, &args));
                            match step.1 {
                                NormPass::Forward => {
                                    out.extend(forward_twin::<T>(path, &args, add))
                                }
                                pass => {
                                    let dw = pass == NormPass::Backward;
                                    let twin = shared_dw_kernel::<T>(path, &args, dw, add);
                                    out.extend(twin.map(|k| k.0))
                                }
                            }
                        }
                    }
                }
            }
            out.push(Kernel::RmsNormDwReduce { elem: T::ELEM });
            out
        }
        [of::<f32>(), of::<f16>(), of::<bf16>()].concat()
    }

    #[test]
    fn each_entry_takes_one_parameter_block_of_the_hosts_size() {
        crate::module::tests::assert_one_param_block(
            &launchable_kernels(),
            size_of::<abi::Params>(),
        );
    }

    #[test]
    pub(crate) fn kernel_names_are_their_parts() {
        let v = Path::Vector {
            per_thread: 2,
            threads: 256,
        };
        let gemma = RmsNormArgs::new(1, 8).with_mode(CastingMode::Gemma);
        let name = |k: Kernel| k.name();
        assert_eq!(
            name(v.kernel::<bf16>(forward_step(false), &gemma)),
            "rms_norm_fwd_v2_bf16_gemma"
        );
        let llama = RmsNormArgs::new(1, 8);
        assert_eq!(
            name(vector_kernel::<f16>(
                forward_step(false),
                RmsNormLayout::Whole,
                4,
                &llama
            )),
            "rms_norm_fwd_vw4_f16_llama"
        );
        let s = Path::Scalar { threads: 128 };
        let none = RmsNormArgs::new(1, 8).with_mode(CastingMode::None);
        assert_eq!(
            name(s.kernel::<f32>(backward_step(true, false), &none)),
            "rms_norm_bwd_f32_none"
        );
        assert_eq!(
            name(s.kernel::<f32>(backward_step(false, false), &none)),
            "rms_norm_bwd_dx_f32_none"
        );
        assert_eq!(
            name(v.kernel::<bf16>(backward_step(false, false), &gemma)),
            "rms_norm_bwd_dx_v2_bf16_gemma"
        );
        // The fused residual add's twins.
        assert_eq!(
            name(v.kernel::<bf16>(forward_step(true), &gemma)),
            "rms_norm_add_fwd_v2_bf16_gemma"
        );
        assert_eq!(
            name(s.kernel::<f32>(backward_step(true, true), &none)),
            "rms_norm_add_bwd_f32_none"
        );
        assert_eq!(
            name(v.kernel::<bf16>(backward_step(false, true), &gemma)),
            "rms_norm_add_bwd_dx_v2_bf16_gemma"
        );
        assert_eq!(
            name(Kernel::RmsNormDwReduce {
                elem: ElemType::Bf16
            }),
            "rms_norm_dw_reduce_bf16"
        );
        // 16-bit rows with a 1 + w weight: the lane-by-lane twins.
        let offset = llama.with_offset(1.0);
        assert_eq!(
            name(shared_dw_kernel::<bf16>(v, &offset, true, false).unwrap().0),
            "rms_norm_bwd_vs2_bf16_llama_offset"
        );
        assert_eq!(
            name(shared_dw_kernel::<bf16>(v, &offset, true, true).unwrap().0),
            "rms_norm_add_bwd_vs2_bf16_llama_offset"
        );
        // f32 rows of two vectors keep dW in registers: no `_vs2`.
        assert_eq!(shared_dw_kernel::<f32>(v, &offset, true, false), None);
        assert_eq!(shared_dw_kernel::<bf16>(v, &offset, false, false), None);
    }

    #[test]
    fn cluster_grids_hold_whole_clusters_that_fit_at_once() {
        assert_eq!(DW_CLUSTER, 2);
        // H200, bf16 16384×2048 (`_vs2`, sm_90 build): 1188 blocks fit at once (9 per SM),
        // but only 528 clusters of two (a cluster's blocks share a GPC).
        assert_eq!(cluster_grid(1188, 528), (1056, 2));
        // An odd grid loses its last block where the clusters fit.
        assert_eq!(cluster_grid(1187, 594), (1186, 2));
        assert_eq!(cluster_grid(528, 264), (528, 2));
        // No whole cluster: the plain grid.
        assert_eq!(cluster_grid(1, 594), (1, 1));
        assert_eq!(cluster_grid(1188, 0), (1188, 1));
    }

    #[test]
    fn frozen_weight_grid_holds_4_mib_of_rows_when_each_block_gets_32_rows() {
        let sms = 132;
        // 16384 rows: f32 4096 and 8192 columns, f32 2048 (and 16-bit 4096).
        assert_eq!(dx_grid_cap(16384, 16384, sms), 256);
        assert_eq!(dx_grid_cap(16384, 32768, sms), sms);
        assert_eq!(dx_grid_cap(16384, 8192, sms), 512);
        // Too few rows for 32 per block: no cap.
        assert_eq!(dx_grid_cap(16384, 4096, sms), usize::MAX);
        assert_eq!(dx_grid_cap(2048, 16384, sms), usize::MAX);
        assert_eq!(dx_grid_cap(32 * 256 - 1, 16384, sms), usize::MAX);
        assert_eq!(dx_grid_cap(32 * 256, 16384, sms), 256);
    }

    #[test]
    fn dw_goes_to_shared_memory_only_for_more_blocks_and_many_rows() {
        // bf16 4096 on an H200: 4 blocks per SM with dW in shared memory, 2 in registers.
        let (regs, shared) = (2 * 132, 4 * 132);
        assert!(shared_dw(16384, regs, shared));
        assert!(shared_dw(SMEM_DW_MIN_ROWS * shared, regs, shared));
        assert!(!shared_dw(SMEM_DW_MIN_ROWS * shared - 1, regs, shared));
        // Shared memory fits no more blocks than registers do: registers.
        assert!(!shared_dw(1 << 20, shared, shared));
        assert!(!shared_dw(1 << 20, shared, regs));
    }

    #[test]
    fn llama_offsets_other_than_zero_take_the_lane_by_lane_kernels_in_16_bit_types() {
        let llama = RmsNormArgs::new(1, 8);
        let v = Path::Vector {
            per_thread: 1,
            threads: 32,
        };
        for offset in [0.0, -0.0] {
            let args = llama.with_offset(offset);
            assert_eq!(vector_mode::<bf16>(&args), Mode::Llama);
            assert_eq!(vector_mode::<f16>(&args), Mode::Llama);
        }
        for offset in [1.0, -2.5e-3] {
            let args = llama.with_offset(offset);
            assert_eq!(vector_mode::<bf16>(&args), Mode::LlamaOffset);
            assert_eq!(
                v.kernel::<f16>(backward_step(true, false), &args).name(),
                "rms_norm_bwd_v1_f16_llama_offset"
            );
            // In f32 the rounding D is the identity: the packed product is the same expression.
            assert_eq!(vector_mode::<f32>(&args), Mode::Llama);
            // The scalar kernels take any offset.
            let s = Path::Scalar { threads: 128 };
            assert_eq!(
                s.kernel::<bf16>(forward_step(false), &args).name(),
                "rms_norm_fwd_bf16_llama"
            );
            for mode in [CastingMode::Gemma, CastingMode::None] {
                assert_eq!(
                    vector_mode::<bf16>(&args.with_mode(mode)),
                    mode.kernel_mode()
                );
            }
        }
    }

    /// 16-byte aligned stand-ins for device pointers: the paths look only at alignment.
    const ALIGNED: u64 = 1 << 20;

    fn gpu_args(rows: usize, cols: usize, mode: CastingMode, offset: f32) -> RmsNormArgs {
        RmsNormArgs::new(rows, cols)
            .with_mode(mode)
            .with_offset(offset)
    }

    /// The forward's kernel, grid and threads for contiguous, aligned buffers with a weight.
    fn forward_choice<T: Dtype>(kernels: &Kernels, args: &RmsNormArgs) -> (String, u32, u32) {
        let settings = args.check().unwrap();
        let capacity = |k| {
            capacity(
                kernels,
                vector_kernel::<T>(forward_step(false), Resident, k, args),
            )
        };
        let (cols, rule) = (args.cols, fwd_rule::<T>());
        let path = Path::choose::<T>(settings, cols, &[ALIGNED; 3], &[cols; 2], rule, capacity);
        let path = path.unwrap();
        let (kernel, grid) = forward_kernel::<T>(kernels, path, args, false).unwrap();
        (kernel.name(), grid, path.threads())
    }

    /// A [`BackwardLaunch`] with its kernel's name.
    #[derive(Debug, PartialEq)]
    struct Launched {
        kernel: String,
        threads: u32,
        grid: usize,
        smem: u32,
        cluster: usize,
    }

    /// The backward launch for contiguous, aligned buffers, with or without dW.
    fn backward_choice<T: Dtype>(
        ctx: &CudaContext,
        kernels: &Kernels,
        args: &RmsNormArgs,
        dw: bool,
    ) -> Launched {
        let settings = args.check().unwrap();
        let capacity = |k| {
            capacity(
                kernels,
                vector_kernel::<T>(backward_step(dw, false), Resident, k, args),
            )
        };
        let cols = args.cols;
        let path = Path::choose::<T>(
            settings,
            cols,
            &[ALIGNED; 4],
            &[cols; 2],
            &BWD_RULE,
            capacity,
        );
        let launch = backward_launch::<T>(ctx, kernels, path.unwrap(), args, dw, false).unwrap();
        Launched {
            kernel: launch.kernel.name(),
            threads: launch.threads,
            grid: launch.grid,
            smem: launch.smem,
            cluster: launch.cluster,
        }
    }

    #[test]
    fn gpu_h200_suite_shapes_take_their_documented_kernels() {
        // The kernels, grids and clusters that tests/rms_norm/device.rs's comments (and
        // PERFORMANCE.md) say its shapes run on an H200: if a kernel's registers or a host rule
        // change, the suites would still pass on whatever kernel ran; this says which did.
        let Some((ctx, k)) = crate::module::h200_kernels(
            "rms_norm::plan::tests::gpu_h200_suite_shapes_take_their_documented_kernels",
        ) else {
            return;
        };
        let llama = |rows, cols| gpu_args(rows, cols, CastingMode::Llama, 0.0);
        use ElemType::{Bf16, F16, F32};
        let forward = |elem, args: &RmsNormArgs| match elem {
            Bf16 => forward_choice::<bf16>(&k, args),
            F16 => forward_choice::<f16>(&k, args),
            F32 => forward_choice::<f32>(&k, args),
        };
        let gemma = gpu_args(2200, 8192, CastingMode::Gemma, 1.0);
        // `gpu_forward_rows_walk_grid_stride_or_take_a_block_each`: one row per block from
        // four waves of resident blocks, grid-stride below.
        for (elem, args, kernel, grid, threads) in [
            (Bf16, llama(7000, 2048), "vw2_bf16_llama", 7000, 128),
            (F32, llama(4000, 2048), "vw2_f32_llama", 4000, 256),
            (F16, llama(2200, 8192), "vw4_f16_llama", 2200, 256),
            (F16, gemma, "vw4_f16_gemma", 2200, 256),
            (F32, llama(2200, 4096), "vw4_f32_llama", 2200, 256),
            (Bf16, llama(9600, 4096), "vw4_bf16_llama", 9600, 128),
            (Bf16, llama(2000, 2048), "v2_bf16_llama", 1188, 128),
            (F32, llama(1500, 2048), "v2_f32_llama", 660, 256),
            (Bf16, llama(1500, 4096), "v4_bf16_llama", 660, 128),
            (F32, llama(1000, 4096), "v4_f32_llama", 528, 256),
        ] {
            let want = (format!("rms_norm_fwd_{kernel}"), grid, threads);
            assert_eq!(forward(elem, &args), want);
        }
        // `gpu_many_rows_take_the_shared_memory_dw_kernels`: dW in shared memory, in clusters
        // of two, for every mode (at 2048 columns 9 blocks per SM fit, 1188, but only 528
        // clusters of two); for f32 rows of two vectors dW stays in registers and no cluster
        // runs (the bench's 16384×2048 f32 and 2048×4096 bf16 too). Without dW (a frozen
        // weight, or none) the `bwd_dx` kernels run, no cluster: bf16 `_v2` at 55 registers
        // (ptxas 12.9 and 13.0, sm_90) fits 9 blocks of 128 threads per SM (1188; at up to 64
        // registers 8), against the dW `_v2`'s 4 (528).
        let bwd = |kernel: &str, threads, grid, smem, cluster| Launched {
            kernel: kernel.to_string(),
            threads,
            grid,
            smem,
            cluster,
        };
        let shared = |cols: usize| REDUCE_SMEM_BYTES + 4 * cols as u32;
        assert_eq!(
            backward_choice::<bf16>(&ctx, &k, &llama(9600, 2048), true),
            bwd("rms_norm_bwd_vs2_bf16_llama", 128, 1056, shared(2048), 2)
        );
        assert_eq!(
            backward_choice::<bf16>(&ctx, &k, &llama(9600, 4096), true),
            bwd("rms_norm_bwd_vs2_bf16_llama", 256, 528, shared(4096), 2)
        );
        assert_eq!(
            backward_choice::<bf16>(&ctx, &k, &llama(16384, 2048), true),
            bwd("rms_norm_bwd_vs2_bf16_llama", 128, 1056, shared(2048), 2)
        );
        for (mode, offset) in [
            (CastingMode::Llama, 1.0),
            (CastingMode::Gemma, 1.0),
            (CastingMode::None, 0.25),
        ] {
            for cols in [2048, 4096] {
                let args = gpu_args(9600, cols, mode, offset);
                for got in [
                    backward_choice::<bf16>(&ctx, &k, &args, true),
                    backward_choice::<f16>(&ctx, &k, &args, true),
                ] {
                    assert!(got.kernel.starts_with("rms_norm_bwd_vs2_"), "{got:?}");
                    assert_eq!((got.cluster, got.grid % 2), (2, 0), "{got:?}");
                }
            }
        }
        let no_dw = backward_choice::<bf16>(&ctx, &k, &llama(9600, 2048), false);
        assert_eq!(
            bwd(
                "rms_norm_bwd_dx_v2_bf16_llama",
                128,
                no_dw.grid,
                REDUCE_SMEM_BYTES,
                1
            ),
            no_dw
        );
        assert!(no_dw.grid >= 8 * 132, "{no_dw:?}");
        let f32_2048 = backward_choice::<f32>(&ctx, &k, &llama(16384, 2048), true);
        assert_eq!(
            (f32_2048.kernel.as_str(), f32_2048.cluster),
            ("rms_norm_bwd_v2_f32_llama", 1)
        );
        let small = backward_choice::<bf16>(&ctx, &k, &llama(2048, 4096), true);
        assert_eq!(
            (small.kernel.as_str(), small.cluster),
            ("rms_norm_bwd_v2_bf16_llama", 1)
        );
    }
}
