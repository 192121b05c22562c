//! Pointers → a parameter block → one launch: the launchers of both ops (their buffers in
//! signature order, and the block their validated pointers make), and the launch of a plan.
use super::abi::Params;
use super::args::{Buffers, Of, SwigluArgs};
use super::plan::Plan;
use crate::error::Result;
use crate::identity::Pass;
use crate::launch::{Launch, arg, launch_ex};
use crate::validate::Role::{InPlace, Read, Written};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};

/// A launcher of both ops (`swiglu_*` and `geglu_*` of one layout and mode): its buffers in
/// signature order, its pass, and the parameter block of its validated pointers (with the
/// element size in bytes, which places a fused row's up half).
pub(crate) struct Launcher<const N: usize> {
    pub(crate) buffers: Buffers<N>,
    pub(crate) pass: Pass,
    pub(crate) params: fn(&SwigluArgs, [u64; N], u64) -> Params,
}

/// The block of a call without pointers.
fn base(args: &SwigluArgs) -> Params {
    Params {
        a_stride: args.a_stride as u64,
        b_stride: args.b_stride as u64,
        c_stride: args.c_stride as u64,
        rows: args.rows as u64,
        cols: args.cols as u64,
        gate_multiplier: args.gate_multiplier,
        down_multiplier: args.down_multiplier,
        ..Params::default()
    }
}

/// The fused layout's block: the gate and up halves of each row of `gate_up` (and of its
/// gradient `d_gate_up`, 0 in the forward), rows `a_stride` apart.
fn fused(args: &SwigluArgs, gate_up: u64, c: u64, d_gate_up: u64, size: u64) -> Params {
    let up = args.cols as u64 * size;
    let grad = |ptr: u64| if ptr == 0 { 0 } else { ptr + up };
    Params {
        a: gate_up,
        b: gate_up + up,
        c,
        da: d_gate_up,
        db: grad(d_gate_up),
        b_stride: args.a_stride as u64,
        ..base(args)
    }
}

/// [`crate::swiglu_forward`], [`crate::geglu_forward`].
pub(crate) const FORWARD: Launcher<3> = Launcher {
    buffers: [
        ("a", Read, Of::A),
        ("b", Read, Of::B),
        ("c", Written, Of::C),
    ],
    pass: Pass::Forward,
    params: |args, [a, b, c], _| Params {
        a,
        b,
        c,
        ..base(args)
    },
};
/// [`crate::swiglu_forward_fused`], [`crate::geglu_forward_fused`].
pub(crate) const FORWARD_FUSED: Launcher<2> = Launcher {
    buffers: [("gate_up", Read, Of::Fused), ("c", Written, Of::C)],
    pass: Pass::Forward,
    params: |args, [gate_up, c], size| fused(args, gate_up, c, 0, size),
};
/// [`crate::swiglu_backward`], [`crate::geglu_backward`].
pub(crate) const BACKWARD: Launcher<5> = Launcher {
    buffers: [
        ("dc", Read, Of::C),
        ("a", Read, Of::A),
        ("b", Read, Of::B),
        ("da", Written, Of::A),
        ("db", Written, Of::B),
    ],
    pass: Pass::Backward,
    params: |args, [c, a, b, da, db], _| Params {
        a,
        b,
        c,
        da,
        db,
        ..base(args)
    },
};
/// [`crate::swiglu_backward_inplace`], [`crate::geglu_backward_inplace`].
pub(crate) const BACKWARD_INPLACE: Launcher<3> = Launcher {
    buffers: [
        ("dc", Read, Of::C),
        ("a", InPlace, Of::A),
        ("b", InPlace, Of::B),
    ],
    pass: Pass::Backward,
    params: |args, [c, a, b], _| Params {
        a,
        b,
        c,
        da: a,
        db: b,
        ..base(args)
    },
};
/// [`crate::swiglu_backward_fused`], [`crate::geglu_backward_fused`].
pub(crate) const BACKWARD_FUSED: Launcher<3> = Launcher {
    buffers: [
        ("dc", Read, Of::C),
        ("gate_up", Read, Of::Fused),
        ("d_gate_up", Written, Of::Fused),
    ],
    pass: Pass::Backward,
    params: |args, [dc, gate_up, d_gate_up], size| fused(args, gate_up, dc, d_gate_up, size),
};
/// [`crate::swiglu_backward_fused_inplace`], [`crate::geglu_backward_fused_inplace`].
pub(crate) const BACKWARD_FUSED_INPLACE: Launcher<2> = Launcher {
    buffers: [("dc", Read, Of::C), ("gate_up", InPlace, Of::Fused)],
    pass: Pass::Backward,
    params: |args, [dc, gate_up], size| fused(args, gate_up, dc, gate_up, size),
};

/// One launch of `func` (the plan's kernel) with `p` on `stream`.
///
/// # Safety
/// `p` names buffers that the call's checks validated for its pass (each pointer covers `rows`
/// rows of its stride and `cols` columns; outputs overlap no input, or are their inputs
/// exactly in place, where each element is read, then written, by the same thread), alive
/// and ordered on `stream` until the launch completes; `plan` is [`super::plan::plan`]'s for
/// `p`, so a vector kernel only where every pointer and stride is aligned and the shape within
/// 32 bits.
pub(crate) unsafe fn run(
    stream: &CudaStream,
    func: &CudaFunction,
    plan: &Plan,
    p: &Params,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (plan.grid, 1, 1),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the entry takes one `Params` by value (the plan tests tie every entry's parameter
    // to its size); the caller vouches for the buffers.
    unsafe { launch_ex(stream, func, cfg, &mut [arg(p)], Launch::Plain) }
}
