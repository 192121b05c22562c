//! Which kernels a cross-entropy call runs, on which grids: a pure function of the arguments,
//! the element type and the buffers' alignment, unit-tested without a GPU.
use super::abi::{
    MAX_ROW_THREADS, ROW_SHARED_BYTES, STAGE_MAX_BYTES, STAGE_OFFSET, STAGE_THREADS, STATS_THREADS,
    UNROLL, stats_shared_bytes,
};
use super::args::{CrossEntropyArgs, Reduction};
use crate::identity::{CePass, CePath, ElemType, Kernel};

/// One kernel launch of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    /// The kernel.
    pub(crate) kernel: Kernel,
    /// Blocks (a row kernel's walk the rows grid-stride past 2³¹ − 1).
    pub(crate) grid: u32,
    /// Threads per block.
    pub(crate) block: u32,
    /// Dynamic shared memory per block, in bytes.
    pub(crate) shared: u32,
    /// Blocks per thread-block cluster (1: an ordinary launch).
    pub(crate) cluster: u32,
}

/// What the row kernels must handle beyond the plain loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Options {
    /// Class weights are given.
    pub(crate) weighted: bool,
    /// A bias is added to the logits.
    pub(crate) bias: bool,
}

/// The row kernels' path: vector loads when every row buffer starts 16-byte aligned and
/// every row stride is a whole number of 16-byte vectors; the full kernels when the call has
/// class weights, a bias, label smoothing or softcap (their registers cost the plain ones
/// speed).
pub(crate) fn path(
    args: &CrossEntropyArgs,
    elem: ElemType,
    opts: Options,
    ptrs: &[u64],
    strides: &[usize],
) -> CePath {
    let aligned = ptrs.iter().all(|p| p.is_multiple_of(16))
        // Wrapping: a stride only one row ever takes may be any size; 16 divides 2⁶⁴.
        && strides.iter().all(|s| s.wrapping_mul(elem.size()).is_multiple_of(16));
    let full = opts.weighted || opts.bias || args.label_smoothing != 0.0 || args.softcap.is_some();
    match (aligned, full) {
        (true, false) => CePath::Vector,
        (false, false) => CePath::Scalar,
        (true, true) => CePath::VectorFull,
        (false, true) => CePath::ScalarFull,
    }
}

/// The most blocks per cluster of the staged forward: 8 (the portable cluster size) with
/// the sm_90 build, 1 (no clusters) with the sm_80 one.
pub(crate) fn max_stage_blocks(sm90: bool) -> u32 {
    if sm90 { 8 } else { 1 }
}

/// Bytes of a row's slice per block that a split row's clusters aim for: six blocks of
/// [`STAGE_THREADS`] at 40 registers with such slices fit an SM, twice the blocks of full
/// [`STAGE_MAX_BYTES`] slices, so the SM keeps loading while blocks wait at their cluster's
/// merge. On an H100 (8192 rows of 128256 bf16 classes, in place) clusters of 8 with 32 KB
/// slices took 1.543 ms (90.1 % of a copy) against 1.642–1.645 with clusters of 4 with 64 KB;
/// a row that fits one block stays whole (32000 classes: 0.380 ms whole, 0.393 over two blocks).
pub(crate) const CLUSTER_SLICE_BYTES: usize = 36 * 1024;

/// Blocks per row of the staged forward: one where the row's 16-byte vectors fit
/// [`STAGE_MAX_BYTES`], else the fewest (a power of two up to `max_blocks`) whose slices hold
/// at most [`CLUSTER_SLICE_BYTES`], or `max_blocks` where their slices fit [`STAGE_MAX_BYTES`];
/// `None` when even those are too few or the row is not a whole number of vectors.
pub(crate) fn stage_blocks(vocab: usize, elem: ElemType, max_blocks: u32) -> Option<u32> {
    let lanes = 16 / elem.size();
    if !vocab.is_multiple_of(lanes) {
        return None;
    }
    let slice = |blocks: u32| (vocab / lanes).div_ceil(blocks as usize) * 16;
    if slice(1) <= STAGE_MAX_BYTES as usize {
        return Some(1);
    }
    let mut blocks = 2;
    while blocks < max_blocks && slice(blocks) > CLUSTER_SLICE_BYTES {
        blocks *= 2;
    }
    (blocks <= max_blocks && slice(blocks) <= STAGE_MAX_BYTES as usize).then_some(blocks)
}

/// The forward with the gradient's path: [`CePath::Staged`] in place of [`CePath::Vector`]
/// where its rows fit ([`stage_blocks`]). Each block then reads its slice of a row from DRAM
/// once; the vector kernel reads the row a second time for the gradient, partly from L2
/// (PERFORMANCE.md, "Cross-entropy").
pub(crate) fn gradient_path(path: CePath, vocab: usize, elem: ElemType, max_blocks: u32) -> CePath {
    match (path, stage_blocks(vocab, elem, max_blocks)) {
        (CePath::Vector, Some(_)) => CePath::Staged,
        _ => path,
    }
}

/// Threads per row block: enough that each thread walks about `4·UNROLL` groups (vectors or
/// elements) of the row, a power of two from 32 to 1024 (256 for the full vector kernels,
/// whose registers fit no more; the launch lowers any block to what the kernel's registers
/// allow, 768 threads for the plain vector forward). On an H200 (bf16, 8192 rows) the forward with
/// the gradient measured 0.354 ms at 32000 classes with 256 threads against 0.447 (128) and
/// 0.493 (512), and 1.453 ms at 128256 with 1024 (768 after the launch's limit) against
/// 1.626 (512): a row a block holds
/// long enough is still in L2 when the gradient pass reads it again.
pub(crate) fn row_threads(vocab: usize, elem: ElemType, path: CePath) -> u32 {
    let lanes = match path {
        CePath::Vector | CePath::VectorFull | CePath::Staged => 16 / elem.size(),
        CePath::Scalar | CePath::ScalarFull => 1,
    };
    let cap = match path {
        CePath::VectorFull => MAX_ROW_THREADS / 4,
        _ => MAX_ROW_THREADS,
    };
    let groups = vocab.div_ceil(lanes).div_ceil(4 * UNROLL);
    (groups.next_power_of_two() as u32).clamp(32, cap)
}

/// One row kernel's launch over every row of `args`; the staged forward's in clusters of
/// [`stage_blocks`] (with at most `max_blocks`) blocks per row, each block with its slice.
pub(crate) fn rows_step(
    args: &CrossEntropyArgs,
    pass: CePass,
    elem: ElemType,
    path: CePath,
    max_blocks: u32,
) -> Step {
    let kernel = Kernel::CrossEntropy { pass, path, elem };
    let rows = |per_row: usize| (args.rows.min(i32::MAX as usize / per_row) * per_row) as u32;
    match stage_blocks(args.vocab, elem, max_blocks) {
        Some(blocks) if path == CePath::Staged => {
            let vectors = args.vocab / (16 / elem.size());
            Step {
                kernel,
                grid: rows(blocks as usize),
                block: STAGE_THREADS,
                shared: STAGE_OFFSET + 16 * vectors.div_ceil(blocks as usize) as u32,
                cluster: blocks,
            }
        }
        _ => Step {
            kernel,
            grid: rows(1),
            block: row_threads(args.vocab, elem, path),
            shared: ROW_SHARED_BYTES,
            cluster: 1,
        },
    }
}

/// A one-block kernel's launch.
pub(crate) fn stats_step(pass: CePass) -> Step {
    Step {
        kernel: Kernel::CrossEntropyStats { pass },
        grid: 1,
        block: STATS_THREADS,
        shared: stats_shared_bytes(),
        cluster: 1,
    }
}

/// The forward (with or without the gradient): the count when the rows need the mean's
/// denominators or the weights' sum, the rows, the reduction unless it is `None`.
/// `max_blocks`: as [`stage_blocks`]'s, for [`CePath::Staged`].
pub(crate) fn forward(
    args: &CrossEntropyArgs,
    elem: ElemType,
    opts: Options,
    path: CePath,
    max_blocks: u32,
) -> Vec<Step> {
    let mut steps = Vec::with_capacity(3);
    if args.needs_count(opts.weighted) {
        steps.push(stats_step(CePass::Count));
    }
    steps.push(rows_step(args, CePass::Forward, elem, path, max_blocks));
    if args.reduction != Reduction::None {
        steps.push(stats_step(CePass::Reduce));
    }
    steps
}

/// The backward: the count when needed, then the rows' gradient.
pub(crate) fn backward(
    args: &CrossEntropyArgs,
    elem: ElemType,
    opts: Options,
    path: CePath,
) -> Vec<Step> {
    let mut steps = Vec::with_capacity(2);
    if args.needs_count(opts.weighted) {
        steps.push(stats_step(CePass::Count));
    }
    steps.push(rows_step(args, CePass::Backward, elem, path, 1));
    steps
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every kernel a call can plan.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let mut v = Vec::new();
        for elem in ElemType::ALL.iter().copied() {
            for path in CePath::ALL.iter().copied() {
                let args = CrossEntropyArgs::new(1, 1);
                let opts = Options {
                    weighted: true,
                    bias: false,
                };
                v.extend(forward(&args, elem, opts, path, 8).iter().map(|s| s.kernel));
                if path != CePath::Staged {
                    v.extend(backward(&args, elem, opts, path).iter().map(|s| s.kernel));
                }
            }
        }
        v.sort_by_key(|k| k.name());
        v.dedup();
        v
    }

    #[test]
    fn each_entry_takes_one_parameter_block_of_the_hosts_size() {
        crate::module::tests::assert_one_param_block(
            &launchable_kernels(),
            size_of::<super::super::abi::Params>(),
        );
    }

    #[test]
    fn vectors_need_aligned_rows_and_options_need_the_full_kernels() {
        let a = CrossEntropyArgs::new(4, 32000);
        let plain = Options::default();
        assert_eq!(
            path(&a, ElemType::Bf16, plain, &[0, 64], &[32000]),
            CePath::Vector
        );
        // 32001 bf16 per row: rows after the first start off the 16-byte grid.
        assert_eq!(
            path(&a, ElemType::Bf16, plain, &[0], &[32001]),
            CePath::Scalar
        );
        assert_eq!(
            path(&a, ElemType::F32, plain, &[4], &[32000]),
            CePath::Scalar
        );
        let w = Options {
            weighted: true,
            bias: false,
        };
        assert_eq!(
            path(&a, ElemType::Bf16, w, &[0], &[32000]),
            CePath::VectorFull
        );
        let s = a.with_softcap(Some(30.0));
        assert_eq!(
            path(&s, ElemType::F16, plain, &[2], &[32000]),
            CePath::ScalarFull
        );
        // A stride no second row uses may be any size (one row; an unused gradient stride).
        let one = CrossEntropyArgs::new(1, 32000);
        assert_eq!(
            path(&one, ElemType::Bf16, plain, &[0], &[usize::MAX, 1 << 60]),
            CePath::Scalar
        );
        assert_eq!(
            path(&one, ElemType::F32, plain, &[0], &[1 << 62]),
            CePath::Vector
        );
    }

    #[test]
    fn rows_get_blocks_sized_to_the_vocabulary() {
        assert_eq!(row_threads(32000, ElemType::Bf16, CePath::Vector), 256);
        assert_eq!(row_threads(128256, ElemType::Bf16, CePath::Vector), 1024);
        assert_eq!(row_threads(128256, ElemType::Bf16, CePath::VectorFull), 256);
        assert_eq!(row_threads(512, ElemType::Bf16, CePath::Vector), 32);
        assert_eq!(row_threads(1, ElemType::F32, CePath::Scalar), 32);
        assert_eq!(row_threads(1000, ElemType::F32, CePath::Scalar), 64);
        let a = CrossEntropyArgs::new(8192, 32000);
        let f = forward(&a, ElemType::Bf16, Options::default(), CePath::Vector, 8);
        let names: Vec<_> = f.iter().map(|s| s.kernel.name()).collect();
        assert_eq!(names, ["ce_count", "ce_fwd_v_bf16", "ce_reduce"]);
        assert_eq!(f[1].grid, 8192);
        let none = a.with_reduction(Reduction::None);
        let b = backward(&none, ElemType::F32, Options::default(), CePath::Scalar);
        let names: Vec<_> = b.iter().map(|s| s.kernel.name()).collect();
        assert_eq!(names, ["ce_bwd_f32"]);
        let huge = CrossEntropyArgs::new(1 << 32, 8);
        assert_eq!(
            rows_step(&huge, CePass::Forward, ElemType::F32, CePath::Scalar, 8).grid,
            i32::MAX as u32
        );
    }

    #[test]
    fn the_staged_forward_splits_long_rows_over_clusters_of_its_build() {
        // 72 KB a block: 36864 bf16 or 18432 f32 classes; split rows in slices of 36 KB
        // where 8 blocks suffice, else of up to 72 KB.
        assert_eq!(stage_blocks(32000, ElemType::Bf16, 1), Some(1));
        assert_eq!(stage_blocks(36864, ElemType::Bf16, 1), Some(1));
        assert_eq!(stage_blocks(36864, ElemType::Bf16, 8), Some(1));
        assert_eq!(stage_blocks(36872, ElemType::Bf16, 1), None);
        assert_eq!(stage_blocks(36872, ElemType::Bf16, 8), Some(4));
        assert_eq!(stage_blocks(36872, ElemType::Bf16, 2), Some(2));
        assert_eq!(stage_blocks(73728, ElemType::Bf16, 8), Some(4));
        assert_eq!(stage_blocks(73736, ElemType::Bf16, 8), Some(8));
        assert_eq!(stage_blocks(128256, ElemType::Bf16, 8), Some(8));
        assert_eq!(stage_blocks(262144, ElemType::Bf16, 8), Some(8));
        assert_eq!(stage_blocks(294920, ElemType::Bf16, 8), None);
        assert_eq!(stage_blocks(128256, ElemType::F32, 8), Some(8));
        assert_eq!(stage_blocks(262144, ElemType::F32, 8), None);
        // Rows of part of a vector take the vector kernels' element tail instead.
        assert_eq!(stage_blocks(32001, ElemType::F16, 8), None);
        assert_eq!(max_stage_blocks(false), 1);
        let v = CePath::Vector;
        assert_eq!(gradient_path(v, 128256, ElemType::Bf16, 8), CePath::Staged);
        assert_eq!(gradient_path(v, 128256, ElemType::Bf16, 1), v);
        assert_eq!(
            gradient_path(CePath::VectorFull, 32000, ElemType::Bf16, 8),
            CePath::VectorFull
        );
        assert_eq!(
            gradient_path(CePath::Scalar, 32000, ElemType::Bf16, 8),
            CePath::Scalar
        );
        let a = CrossEntropyArgs::new(8192, 128256);
        let s = rows_step(&a, CePass::Forward, ElemType::Bf16, CePath::Staged, 8);
        assert_eq!(s.kernel.name(), "ce_fwd_s_bf16");
        assert_eq!((s.grid, s.block, s.cluster), (8 * 8192, STAGE_THREADS, 8));
        // 16032 vectors over 8 blocks.
        assert_eq!(s.shared, STAGE_OFFSET + 2004 * 16);
        let one = rows_step(&a, CePass::Forward, ElemType::Bf16, CePath::Vector, 8);
        assert_eq!(
            (one.grid, one.cluster, one.shared),
            (8192, 1, ROW_SHARED_BYTES)
        );
        // Past 2³¹ − 1 blocks the clusters walk the rows grid-stride.
        let huge = CrossEntropyArgs::new(1 << 31, 128256);
        let h = rows_step(&huge, CePass::Forward, ElemType::Bf16, CePath::Staged, 8);
        assert_eq!(h.grid, (i32::MAX as u32 / 8) * 8);
    }
}
