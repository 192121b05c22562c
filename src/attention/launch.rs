//! Pointers and a plan → launches: the parameter block and the kernel launches of a call.
use super::abi::{Params, Tensor};
use super::args::{AttentionArgs, Strides};
use super::plan::Step;
use crate::error::Result;
use crate::launch::{Launch, arg, launch_ex};
use crate::module::Kernels;
use cudarc::driver::{CudaStream, LaunchConfig, sys};

/// The device pointers of a call, 0 where the pass has none.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ptrs {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) o: u64,
    pub(crate) d_o: u64,
    pub(crate) dq: u64,
    pub(crate) dk: u64,
    pub(crate) dv: u64,
    pub(crate) lse: u64,
    pub(crate) delta: u64,
    pub(crate) cu_seqlens_q: u64,
    pub(crate) cu_seqlens_k: u64,
}

fn tensor(ptr: u64, s: &Strides, packed: bool) -> Tensor {
    Tensor {
        ptr,
        batch: if packed { 0 } else { s.batch as u64 },
        token: s.token as u64,
        head: s.head as u64,
    }
}

/// The parameter block of a call.
pub(crate) fn params(args: &AttentionArgs, p: &Ptrs) -> Params {
    let packed = args.is_varlen();
    let out = args.out_strides();
    let (wl, wr) = args.window();
    let (lse_batch, lse_head) = match args.total_q {
        Some(t) => (0, t as u64),
        None => ((args.heads_q * args.seqlen_q) as u64, args.seqlen_q as u64),
    };
    Params {
        q: tensor(p.q, &args.q, packed),
        k: tensor(p.k, &args.k, packed),
        v: tensor(p.v, &args.v, packed),
        o: tensor(p.o, &out, packed),
        d_o: tensor(p.d_o, &out, packed),
        dq: tensor(p.dq, &args.grads[0], packed),
        dk: tensor(p.dk, &args.grads[1], packed),
        dv: tensor(p.dv, &args.grads[2], packed),
        lse: p.lse,
        delta: p.delta,
        lse_batch,
        lse_head,
        cu_seqlens_q: p.cu_seqlens_q,
        cu_seqlens_k: p.cu_seqlens_k,
        batch: args.batch as u32,
        heads_q: args.heads_q as u32,
        heads_kv: args.heads_kv as u32,
        head_dim: args.head_dim as u32,
        seqlen_q: args.seqlen_q as u32,
        seqlen_k: args.seqlen_k as u32,
        total_q: args.total_q.unwrap_or(0) as u32,
        total_k: args.total_k.unwrap_or(0) as u32,
        window_left: wl,
        window_right: wr,
        scale: args.scale,
        softcap: args.softcap,
    }
}

/// Launches the steps in order on `stream`, each with `params` (a step without blocks is
/// skipped); `k` is the stream's context's kernels, whose build the plan chose the steps for.
///
/// # Safety
/// `params` names buffers that the call's checks validated for every step's pass, alive and
/// ordered on `stream` until the launches complete.
pub(crate) unsafe fn run(
    stream: &CudaStream,
    k: &Kernels,
    steps: &[Step],
    params: &Params,
) -> Result<()> {
    for step in steps {
        if step.grid.0 == 0 || step.grid.1 == 0 || step.grid.2 == 0 {
            continue;
        }
        let func = k.function(step.kernel)?;
        if step.shared > 48 * 1024 {
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                step.shared as i32,
            )?;
        }
        let cfg = LaunchConfig {
            grid_dim: step.grid,
            block_dim: (step.threads, 1, 1),
            shared_mem_bytes: step.shared,
        };
        // SAFETY: one parameter, a `Params` by value, as every attention entry takes; the
        // caller vouches for the buffers it names.
        unsafe { launch_ex(stream, &func, cfg, &mut [arg(params)], Launch::Plain)? };
    }
    Ok(())
}
