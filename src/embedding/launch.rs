//! Pointers and a plan → one launch.
use super::abi::Params;
use super::args::EmbeddingArgs;
use super::plan::Step;
use crate::error::Result;
use crate::launch::{Launch, arg, launch_ex};
use crate::module::kernels;
use cudarc::driver::{CudaStream, LaunchConfig};

/// The parameter block of a call over `table`, `ids` and `rows` (device pointers).
pub(crate) fn params(args: &EmbeddingArgs, [table, ids, rows]: [u64; 3]) -> Params {
    Params {
        ids,
        table,
        rows,
        tokens: args.tokens as u64,
        vocab: args.vocab as u64,
        hidden: args.hidden as u64,
        table_stride: args.table_stride as u64,
        rows_stride: args.rows_stride as u64,
    }
}

/// Launches `step` with `p` on `stream` (nothing for an empty grid).
///
/// # Safety
/// `p` names buffers the call's checks validated, alive and ordered on `stream` until the
/// launch completes.
pub(crate) unsafe fn run(stream: &CudaStream, step: &Step, p: &Params) -> Result<()> {
    if step.grid == 0 {
        return Ok(());
    }
    let func = kernels(stream.context())?.function(step.kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (step.grid, 1, 1),
        block_dim: (step.block, 1, 1),
        shared_mem_bytes: step.shared,
    };
    // SAFETY: one parameter, a `Params` by value, as every embedding entry takes; the caller
    // vouches for the buffers.
    unsafe { launch_ex(stream, &func, cfg, &mut [arg(p)], Launch::Plain) }
}
