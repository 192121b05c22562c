//! Pointers and a plan → launches: the parameter block and the kernel launches of a call.
use super::abi::{Params, STAGE_MAX_BYTES, STAGE_OFFSET};
use super::args::CrossEntropyArgs;
use super::plan::Step;
use crate::error::Result;
use crate::identity::Kernel;
use crate::launch::{Launch, arg, launch_ex};
use crate::module::kernels;
use cudarc::driver::{CudaStream, LaunchConfig, sys};

/// The device pointers of a call, 0 where it has none.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ptrs {
    pub(crate) logits: u64,
    pub(crate) grad: u64,
    pub(crate) target: u64,
    pub(crate) weight: u64,
    pub(crate) bias: u64,
    pub(crate) row_loss: u64,
    pub(crate) row_z: u64,
    pub(crate) lse: u64,
    pub(crate) grad_loss: u64,
    pub(crate) stats: u64,
    pub(crate) total: u64,
    pub(crate) total_z: u64,
}

/// The parameter block of a call; `grad_stride` is the logits' in place.
pub(crate) fn params(args: &CrossEntropyArgs, p: &Ptrs, grad_stride: usize) -> Params {
    Params {
        logits: p.logits,
        logits_stride: args.logits_stride as u64,
        grad: p.grad,
        grad_stride: grad_stride as u64,
        target: p.target,
        weight: p.weight,
        bias: p.bias,
        row_loss: p.row_loss,
        row_z: p.row_z,
        lse: p.lse,
        grad_loss: p.grad_loss,
        stats: p.stats,
        total: p.total,
        total_z: p.total_z,
        rows: args.rows as u64,
        ignore_index: args.ignore_index,
        vocab: args.vocab as u32,
        reduction: args.reduction.id(),
        label_smoothing: args.label_smoothing,
        lse_square_scale: args.lse_square_scale,
        softcap: args.softcap.unwrap_or(0.0),
        pad: 0,
    }
}

/// Launches the steps in order on `stream`, each with `params` (a step without blocks is
/// skipped). A row block larger than the kernel's register budget allows is shrunk to the
/// largest whole number of warps that fits (the row kernels take any number of warps), a
/// one-block kernel's to the largest power of two (its sums halve the block).
///
/// # Safety
/// `params` names buffers that the call's checks validated for every step, alive and
/// ordered on `stream` until the launches complete.
pub(crate) unsafe fn run(stream: &CudaStream, steps: &[Step], params: &Params) -> Result<()> {
    let k = kernels(stream.context())?;
    for step in steps {
        if step.grid == 0 {
            continue;
        }
        let func = k.function(step.kernel)?;
        let most = func
            .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?
            as u32;
        let fits = match step.kernel {
            Kernel::CrossEntropyStats { .. } => 1 << most.max(1).ilog2(),
            _ => most / 32 * 32,
        };
        let block = step.block.min(fits);
        if step.shared > 48 * 1024 {
            // The staged forward's most, whatever this call's slice: concurrent calls with
            // other vocabularies then never lower the limit under each other's launches.
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (STAGE_OFFSET + STAGE_MAX_BYTES) as i32,
            )?;
        }
        let cfg = LaunchConfig {
            grid_dim: (step.grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: step.shared,
        };
        let how = match step.cluster {
            1 => Launch::Plain,
            blocks => Launch::Cluster(blocks),
        };
        // SAFETY: one parameter, a `Params` by value, as every cross-entropy entry takes;
        // the caller vouches for the buffers it names.
        unsafe { launch_ex(stream, &func, cfg, &mut [arg(params)], how)? };
    }
    Ok(())
}
