//! Grid shapes and kernel launches shared by every op's launcher.
use crate::error::Result;
use crate::module::cluster_attribute;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, result, sys};
use std::ffi::c_void;

/// Waves of resident blocks from which a grid-stride kernel with a one-item-per-block twin runs
/// the twin over a grid of every item instead (PERFORMANCE.md, "Whole grids: one item per block"): the hardware's
/// block scheduler then balances the last wave, the twin holds no next-item registers (more
/// blocks fit per SM), and a resident grid's last round (up to one item per block more than
/// the average) goes away. Below it, the resident grid's fewer launches of blocks win.
pub(crate) const WHOLE_GRID_MIN_WAVES: u64 = 4;

/// Whether `items` (tiles, rows or token steps) run one per block over a grid of all of them
/// rather than grid-stride over `resident` blocks (see [`WHOLE_GRID_MIN_WAVES`]).
pub(crate) fn whole_grid(items: u64, resident: usize) -> bool {
    items >= WHOLE_GRID_MIN_WAVES.saturating_mul(resident as u64)
}

/// The grid for `items` rows or token steps of a grid-stride kernel with `resident` blocks
/// resident at once, and whether its one-item-per-block twin runs instead: with `twin` (one
/// exists, or the kernel itself keeps no next-item state, as RoPE's) and [`whole_grid`], one
/// block per item; otherwise at most `resident` blocks and at
/// most one per item. Grids stay below 2³¹ blocks.
pub(crate) fn item_grid(items: usize, resident: usize, twin: bool) -> (bool, u32) {
    const MAX_GRID: usize = i32::MAX as usize;
    if twin && whole_grid(items as u64, resident) && items <= MAX_GRID {
        (true, items as u32)
    } else {
        (false, items.min(resident).min(MAX_GRID) as u32)
    }
}

/// How [`launch_ex`] launches a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Launch {
    /// An ordinary launch (`cuLaunchKernel`).
    Plain,
    /// A programmatic dependent launch (sm_90 and later): the driver processes the launch while
    /// the grid queued before it runs, and its blocks may start as that grid's blocks exit,
    /// before its completion is processed and its writes flushed. So the kernel must run
    /// `griddepcontrol.wait` before it reads anything that grid writes (the sm_90 build's
    /// `wait_for_prerequisite_grids`).
    Dependent,
    /// Thread-block clusters of this many consecutive blocks along x (sm_90 and later), which
    /// run at once on one GPC and can read each other's shared memory; the grid's x dimension
    /// must be a multiple of it.
    Cluster(u32),
}

/// Launches `func` on `stream`: `cuLaunchKernel`, or `cuLaunchKernelEx` with the one launch
/// attribute that `how` names.
///
/// # Safety
/// As cudarc's `LaunchArgs::launch`: `args` point to one value per kernel parameter, of its
/// type, and every buffer the kernel touches is valid for the launch; the stream orders the
/// buffers (plain device pointers carry no events of their own).
pub(crate) unsafe fn launch_ex(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &mut [*mut c_void],
    how: Launch,
) -> Result<()> {
    stream.context().bind_to_thread()?;
    let mut attr = match how {
        Launch::Plain => {
            // SAFETY: the caller vouches for `args`.
            return Ok(unsafe {
                result::launch_kernel(
                    func.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    stream.cu_stream(),
                    args,
                )
            }?);
        }
        Launch::Dependent => {
            // SAFETY: a zeroed attribute is valid (the union's pad covers every member); the
            // id and its member are set next.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            attr
        }
        Launch::Cluster(blocks) => cluster_attribute(blocks),
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `config` and `attr` outlive the call; the caller vouches for `args`.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()?;
    Ok(())
}

/// A kernel argument as `cuLaunchKernelEx` takes it: a pointer to the value.
pub(crate) fn arg<T>(value: &T) -> *mut c_void {
    value as *const T as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_grids_start_at_four_waves() {
        assert!(!whole_grid(3, 1) && whole_grid(4, 1));
        assert!(!whole_grid(4 * 528 - 1, 528));
        assert!(whole_grid(4 * 528, 528));
        assert!(whole_grid(u64::MAX, usize::MAX));
    }

    #[test]
    fn item_grids_take_a_block_per_item_only_with_a_twin_and_many_waves() {
        // 16384 rows over 528 resident blocks: 31 waves.
        assert_eq!(item_grid(16384, 528, true), (true, 16384));
        assert_eq!(item_grid(16384, 528, false), (false, 528));
        // Under 4 waves: grid-stride, at most one block per item.
        assert_eq!(item_grid(2111, 528, true), (false, 528));
        assert_eq!(item_grid(300, 528, true), (false, 300));
        // Beyond a grid's 2³¹ − 1 blocks: grid-stride over the resident blocks.
        assert_eq!(item_grid(1 << 31, 528, true), (false, 528));
        assert_eq!(
            item_grid(usize::MAX, usize::MAX, false),
            (false, i32::MAX as u32)
        );
    }
}
