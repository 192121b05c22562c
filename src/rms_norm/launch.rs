//! Validated pointers → a parameter block → the launches of a plan (the backward's dW
//! reduction after it, over the kept dW scratch).
use super::abi;
use super::args::RmsNormArgs;
use super::plan::*;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::identity::{Kernel, RmsNormLayout::Resident};
use crate::launch::{Launch, arg, launch_ex};
use crate::module::kernels;
use crate::settings::LaunchSettings;
use cudarc::driver::{CudaStream, LaunchConfig};
use std::sync::Arc;

/// The device pointers of a validated forward (0 for a weight left out); `add`: the fused
/// residual add's `r` and `s`, which take `x`'s stride.
pub(crate) struct FwdPtrs {
    pub(crate) x: u64,
    pub(crate) add: Option<(u64, u64)>,
    pub(crate) w: u64,
    pub(crate) y: u64,
    pub(crate) rstd: u64,
}

/// Launches the forward (RMSNorm's, or with `p.add` the fused residual add's) over buffers
/// that the caller validated and whose guards it holds until this returns.
pub(crate) fn launch_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    settings: LaunchSettings,
    p: FwdPtrs,
) -> Result<()> {
    let add = p.add.is_some();
    let (r_ptr, s_ptr) = p.add.unwrap_or((0, 0));
    let kernels = kernels(stream.context())?;
    let mut ptrs = vec![p.x, p.w, p.y];
    if add {
        ptrs.extend([r_ptr, s_ptr]);
    }
    let path = Path::choose::<T>(
        settings,
        args.cols,
        &ptrs,
        &[args.x_stride, args.y_stride],
        fwd_rule::<T>(),
        |k| {
            capacity(
                &kernels,
                vector_kernel::<T>(forward_step(add), Resident, k, args),
            )
        },
    )?;
    let (kernel, grid) = forward_kernel::<T>(&kernels, path, args, add)?;
    let func = kernels.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (path.threads(), 1, 1),
        shared_mem_bytes: REDUCE_SMEM_BYTES,
    };
    let params = abi::Params {
        x: p.x,
        r: r_ptr,
        s: s_ptr,
        w: p.w,
        y: p.y,
        rstd: p.rstd,
        ..base(args)
    };
    // SAFETY: every forward entry takes one `Params` by value (the test
    // `each_entry_takes_one_parameter_block_of_the_hosts_size`); every pointer was checked by
    // the caller to cover `rows` rows of its stride (`rstd`: `rows` f32, `r` and `s` at
    // `x_stride`), and `s` may be `x` or `r` only at their stride.
    unsafe { launch_ex(stream, &func, cfg, &mut [arg(&params)], Launch::Plain) }
}

/// A call's parameter block without pointers.
fn base(args: &RmsNormArgs) -> abi::Params {
    abi::Params {
        x_stride: args.x_stride as u64,
        y_stride: args.y_stride as u64,
        rows: args.rows as u64,
        cols: args.cols as u64,
        eps: args.eps,
        offset: args.offset,
        ..abi::Params::default()
    }
}

/// The device pointers of a validated backward (0 for a weight or `dw` left out; `dx` is `dy`
/// in place); `ds`: the fused residual add's incoming gradient of the sum, at `dy`'s stride.
pub(crate) struct BwdPtrs {
    pub(crate) dy: u64,
    pub(crate) ds: Option<u64>,
    pub(crate) x: u64,
    pub(crate) w: u64,
    pub(crate) rstd: u64,
    pub(crate) dx: u64,
    pub(crate) dw: u64,
}

/// Launches the backward (RMSNorm's, or with `p.ds` the fused residual add's) and, with `dw`,
/// the dW reduction, over buffers that the caller validated and whose guards it holds until
/// this returns.
pub(crate) fn launch_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RmsNormArgs,
    settings: LaunchSettings,
    p: BwdPtrs,
) -> Result<()> {
    let BwdPtrs {
        dy: dy_ptr,
        ds,
        x: x_ptr,
        w: w_ptr,
        rstd: r_ptr,
        dx: dx_ptr,
        dw: dw_ptr,
    } = p;
    let add = ds.is_some();
    let ds_ptr = ds.unwrap_or(0);
    let with_dw = dw_ptr != 0;
    if args.rows == 0 {
        // Only with dW (else the call is empty): dW of no rows is zero.
        let bytes = args.cols * size_of::<T>();
        stream.context().bind_to_thread()?;
        // SAFETY: `dw` was checked to hold `cols` elements and to overlap no other buffer;
        // its guard lives until the end of this function.
        unsafe { cudarc::driver::result::memset_d8_async(dw_ptr, 0, bytes, stream.cu_stream()) }?;
        return Ok(());
    }

    let kernels = kernels(stream.context())?;
    let mut ptrs = vec![dy_ptr, x_ptr, w_ptr, dx_ptr];
    if add {
        ptrs.push(ds_ptr);
    }
    let path = Path::choose::<T>(
        settings,
        args.cols,
        &ptrs,
        &[args.x_stride, args.y_stride],
        &BWD_RULE,
        |k| {
            let kernel = vector_kernel::<T>(backward_step(with_dw, add), Resident, k, args);
            capacity(&kernels, kernel)
        },
    )?;
    let launch = backward_launch::<T>(stream.context(), &kernels, path, args, with_dw, add)?;
    let (grid, cluster) = (launch.grid, launch.cluster);
    let parts = grid / cluster;
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (launch.threads, 1, 1),
        shared_mem_bytes: launch.smem,
    };
    let how = match cluster {
        1 => Launch::Plain,
        c => Launch::Cluster(c as u32),
    };
    let func = kernels.function(launch.kernel)?;
    // Loaded before the backward is queued: a failed first load must leave no dX without dW.
    let reduce = match with_dw {
        true => Some(kernels.function(Kernel::RmsNormDwReduce { elem: T::ELEM })?),
        false => None,
    };
    // The backward, then (with dW) the dW reduction over `partial`, the scratch of
    // `parts × cols` f32 (0 without dW: the `bwd_dx` kernels do not use it).
    let run = |partial: u64| -> Result<()> {
        let params = abi::Params {
            dy: dy_ptr,
            ds: ds_ptr,
            x: x_ptr,
            w: w_ptr,
            rstd: r_ptr,
            dx: dx_ptr,
            dw_partial: partial,
            dw: dw_ptr,
            parts: parts as u64,
            ..base(args)
        };
        // SAFETY: every backward entry takes one `Params` by value; buffers were checked by the
        // caller (`ds` and `dx` at `y_stride`), the partial buffer holds `parts × cols` f32 (one
        // row per block, or per cluster), every element written by its block (the scalar kernel
        // at its first row, the vector kernel at its end) or its cluster
        // (`write_cluster_partial`).
        unsafe { launch_ex(stream, &func, cfg, &mut [arg(&params)], how) }?;
        let Some(reduce) = &reduce else {
            return Ok(());
        };
        let cfg = LaunchConfig {
            grid_dim: (args.cols.div_ceil(DW_REDUCE_COLS as usize) as u32, 1, 1),
            block_dim: (DW_REDUCE_COLS, DW_REDUCE_PART_LANES, 1),
            shared_mem_bytes: DW_REDUCE_COLS * DW_REDUCE_PART_LANES * 4,
        };
        let how = match kernels.sm90 {
            true => Launch::Dependent,
            false => Launch::Plain,
        };
        // SAFETY: the dW reduction takes the same `Params`; its sm_90 build waits for the
        // backward before reading `dw_partial`, which holds `parts × cols` f32, every element
        // written by the backward just queued; `dw` holds `cols`.
        unsafe { launch_ex(stream, reduce, cfg, &mut [arg(&params)], how) }
    };
    match with_dw {
        false => run(0),
        true => kernels.scratch.with(stream, parts * args.cols, run),
    }
}
