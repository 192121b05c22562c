//! The GLU ops, SwiGLU ([`swiglu`]) and GEGLU ([`geglu`]): one family of kernels, launchers and
//! arguments, the op the gate of the kernels (SiLU, or GELU in one of its forms).
//!
//! The anatomy of every op family: [`args`] ([`SwigluArgs`] and what each buffer must hold) →
//! [`plan`] (the kernel and its grid) → [`launch`] (the one `#[repr(C)]` parameter block of
//! [`abi`], which the device crate compiles too). Every public launcher of either op is one
//! [`run`] of a [`launch::Launcher`]: its buffers' table, then its pass's plan and launch.
pub(crate) mod args;
mod geglu;
pub(crate) mod launch;
pub(crate) mod plan;
mod swiglu;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/glu/abi.rs"]
pub(crate) mod abi;

pub use args::SwigluArgs;
pub use geglu::{
    Gelu, geglu_backward, geglu_backward_fused, geglu_backward_fused_inplace,
    geglu_backward_inplace, geglu_forward, geglu_forward_fused,
};
pub use swiglu::{
    swiglu_backward, swiglu_backward_fused, swiglu_backward_fused_inplace, swiglu_backward_inplace,
    swiglu_forward, swiglu_forward_fused,
};

use crate::dtype::Dtype;
use crate::error::Result;
use crate::identity::Gate;
use crate::module::kernels;
use crate::validate::{Buf, validate};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Validates `bufs` against `launcher`'s table, then launches `gate`'s kernel of the
/// launcher's pass on their pointers (nothing without rows).
pub(crate) fn run<'b, T: Dtype, const N: usize>(
    stream: &'b Arc<CudaStream>,
    args: &SwigluArgs,
    gate: Gate,
    launcher: &launch::Launcher<N>,
    bufs: [Option<Buf<'b, T>>; N],
) -> Result<()> {
    let table = args.table(&launcher.buffers)?;
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let p = (launcher.params)(args, call.ptrs, size_of::<T>() as u64);
    let kernels = kernels(stream.context())?;
    let plan = plan::plan(launcher.pass, gate, T::ELEM, &p, |kernel, threads| {
        kernels.resident_blocks(&kernels.function(kernel)?, threads, 0)
    })?;
    let func = kernels.function(plan.kernel)?;
    // SAFETY: `validate` checked every buffer of the table for `args` (lengths, context,
    // overlaps); `call` holds their guards until the launch is queued; the plan is `p`'s.
    unsafe { launch::run(stream, &func, &plan, &p) }
}
