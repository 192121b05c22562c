//! liger-rs device kernels.
//!
//! Compiled only for `nvptx64-nvidia-cuda` by the pinned nightly (see `rust-toolchain.toml`)
//! with `-Zbuild-std=core --emit=asm`; the host crate's `build.rs` embeds the resulting PTX.
//! Every entry point is `#[unsafe(no_mangle)] extern "gpu-kernel"` and named
//! `<op>_<direction>_<dtype>[_<mode>]`; the host launchers in `src/<op>.rs` build the same names.
//!
//! Shared building blocks live here: element types ([`Elem`]), thread/block indices and the
//! block-wide reduction. One file per op holds that op's kernels.
#![no_std]
#![feature(abi_gpu_kernel, f16, link_llvm_intrinsics, core_intrinsics, gpu_intrinsics)]
#![feature(gpu_launch_sized_workgroup_mem, stdarch_nvptx)]
#![allow(internal_features)]

pub mod rms_norm;
pub mod rope;
pub mod swiglu;

use core::arch::nvptx;

/// Casting modes, as const-generic parameters of the kernels (must match the host's order).
pub mod mode {
    /// HF LlamaRMSNorm: f32 statistics, `D(x·r)` then the weight product.
    pub const LLAMA: u32 = 0;
    /// HF GemmaRMSNorm: everything in f32, one cast at the end.
    pub const GEMMA: u32 = 1;
    /// Everything in the tensor dtype.
    pub const NONE: u32 = 2;
}

/// A storage element: widened to f32 for arithmetic, narrowed with round-to-nearest-even.
pub trait Elem: Copy {
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
    /// Round-to-nearest-even narrowing from f32 (NaN stays NaN).
    fn from_f32(v: f32) -> Self;
    /// `v` rounded to this type and widened back: the value an op "in D" produces.
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as f16
    }
}

/// bfloat16 carried as its bit pattern (core has no bf16 type).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Elem for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        let u = v.to_bits();
        if v != v {
            // Quiet NaN with the sign kept.
            return Bf16(((u >> 16) | 0x0040) as u16);
        }
        let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1));
        Bf16((rounded >> 16) as u16)
    }
}

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly_f32(mask: u32, value: f32, lane_mask: u32, clamp: u32) -> f32;
}

/// This thread's index in its block.
#[inline(always)]
pub fn thread_idx() -> usize {
    unsafe { nvptx::_thread_idx_x() as usize }
}

/// Threads per block.
#[inline(always)]
pub fn block_dim() -> usize {
    unsafe { nvptx::_block_dim_x() as usize }
}

/// This block's index in the grid.
#[inline(always)]
pub fn block_idx() -> usize {
    unsafe { nvptx::_block_idx_x() as usize }
}

/// Blocks in the grid.
#[inline(always)]
pub fn grid_dim() -> usize {
    unsafe { nvptx::_grid_dim_x() as usize }
}

/// Block-wide barrier.
#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// Sum over the 32 lanes of a (full) warp; every lane gets the same bits (a + b = b + a).
#[inline(always)]
pub fn warp_sum(mut v: f32) -> f32 {
    let mut lane_mask = 16;
    while lane_mask > 0 {
        v += unsafe { shfl_bfly_f32(u32::MAX, v, lane_mask, 0x1f) };
        lane_mask >>= 1;
    }
    v
}

/// Sum of `v` over the whole block, returned to every thread, in a fixed order (deterministic).
///
/// Needs the block size to be a multiple of 32 and 32 f32 of dynamic shared memory.
/// Starts with a barrier so back-to-back calls may reuse the shared slots.
#[inline(always)]
pub fn block_sum(v: f32) -> f32 {
    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>();
    let warp_total = warp_sum(v);
    let lane = thread_idx() & 31;
    let warp = thread_idx() >> 5;
    let warps = block_dim() >> 5;
    sync_threads();
    if lane == 0 {
        unsafe { *smem.add(warp) = warp_total };
    }
    sync_threads();
    let partial = if lane < warps {
        unsafe { *smem.add(lane) }
    } else {
        0.0
    };
    warp_sum(partial)
}

/// Correctly rounded square root (`sqrt.rn.f32`).
#[inline(always)]
pub fn sqrt(v: f32) -> f32 {
    core::intrinsics::sqrtf32(v)
}
