//! Pointers and a plan → launches: the parameter block and one launch of a group.
use super::abi::{FIRST_STEP, Params, TENSORS, THREADS, Tensor};
use super::args::{AdamWArgs, SgdArgs};
use crate::error::Result;
use crate::identity::Kernel;
use crate::launch::{Launch, arg, launch_ex};
use crate::module::kernels;
use cudarc::driver::{CudaStream, LaunchConfig};

/// A parameter block without tensors or hyper-parameters; `scalars`: the device step, lr,
/// clip (its factor at index 1), grad scale and found-inf pointers, 0 where absent.
fn base(flags: u32, lr: f64, scalars: [u64; 5]) -> Params {
    let [step_ptr, lr_ptr, clip, grad_scale_ptr, found_inf_ptr] = scalars;
    Params {
        tensors: [Tensor::default(); TENSORS],
        count: 0,
        flags,
        lr,
        beta1: 0.0,
        beta2: 0.0,
        eps: 0.0,
        weight_decay: 0.0,
        momentum: 0.0,
        dampening: 0.0,
        step: 0.0,
        pad: 0,
        step_ptr,
        lr_ptr,
        grad_scale_ptr,
        found_inf_ptr,
        clip_ptr: if clip == 0 { 0 } else { clip + 4 },
        partials: 0,
        partial_base: 0,
        partial_count: 0,
        max_norm: 0.0,
        pad2: 0,
        norm: 0,
    }
}

/// An AdamW call's parameter block without tensors.
pub(crate) fn adamw_params(args: &AdamWArgs, step: f32, scalars: [u64; 5]) -> Params {
    Params {
        beta1: args.beta1,
        beta2: args.beta2,
        eps: args.eps,
        weight_decay: args.weight_decay,
        step,
        ..base(args.flags(), args.lr, scalars)
    }
}

/// An SGD call's parameter block without tensors.
pub(crate) fn sgd_params(args: &SgdArgs, first_step: bool, scalars: [u64; 5]) -> Params {
    let first = if first_step { FIRST_STEP } else { 0 };
    Params {
        weight_decay: args.weight_decay,
        momentum: args.momentum,
        dampening: args.dampening,
        ..base(args.flags() | first, args.lr, scalars)
    }
}

/// Puts a group's tensors (the first `first_blocks.len()` of `tensors`) into `p`.
pub(crate) fn fill(p: &mut Params, tensors: &[Tensor], first_blocks: &[u64]) {
    p.count = first_blocks.len() as u32;
    for (i, &fb) in first_blocks.iter().enumerate() {
        p.tensors[i] = Tensor {
            first_block: fb,
            ..tensors[i]
        };
    }
}

/// One launch of `kernel` over `blocks` blocks (none: nothing to do).
///
/// # Safety
/// `p` names buffers the call's checks validated, alive and ordered on `stream` until the
/// launch completes.
pub(crate) unsafe fn run(
    stream: &CudaStream,
    kernel: Kernel,
    blocks: u32,
    shared: u32,
    p: &Params,
) -> Result<()> {
    if blocks == 0 {
        return Ok(());
    }
    let func = kernels(stream.context())?.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    };
    // SAFETY: one parameter, a `Params` by value, as every AdamW entry takes; the caller
    // vouches for the buffers.
    unsafe { launch_ex(stream, &func, cfg, &mut [arg(p)], Launch::Plain) }
}
