//! liger-rs device kernels.
//!
//! Compiled only for `nvptx64-nvidia-cuda` by the pinned nightly (see `rust-toolchain.toml`)
//! with `-Zbuild-std=core --emit=asm`; the host crate's `build.rs` embeds the resulting PTX.
//! Every entry point is an `extern "gpu-kernel"` function whose `export_name` is built where
//! it is instantiated from its identity in [`identity`], the file that the host launchers in
//! `src/<op>/` include to name the kernels they launch.
//!
//! Shared building blocks live here: element types ([`Elem`]), thread/block indices and the
//! block-wide reduction. One file per op holds that op's kernels.
#![no_std]
#![feature(
    abi_gpu_kernel,
    f16,
    link_llvm_intrinsics,
    core_intrinsics,
    gpu_intrinsics
)]
#![feature(gpu_launch_sized_workgroup_mem, stdarch_nvptx, asm_experimental_arch)]
#![feature(stmt_expr_attributes)]
#![allow(internal_features)]
// The host build shows this crate's warnings only when it fails: code unused in either build
// (sm_80, sm_90a) fails it instead.
#![deny(dead_code, unused_imports)]

pub mod adamw;
pub mod attention;
mod cp_async;
pub mod cross_entropy;
pub mod embedding;
pub mod glu;
pub mod identity;
mod math;
pub mod rms_norm;
pub mod rope;

use core::arch::{asm, nvptx};
use identity::ElemType;

/// The casting modes of [`identity::Mode`] as const-generic parameters of the RMSNorm kernels.
pub mod mode {
    use crate::identity::Mode;
    /// [`Mode::Llama`].
    pub const LLAMA: u32 = Mode::Llama as u32;
    /// [`Mode::Gemma`].
    pub const GEMMA: u32 = Mode::Gemma as u32;
    /// [`Mode::None`].
    pub const NONE: u32 = Mode::None as u32;
    /// [`Mode::LlamaOffset`].
    pub const LLAMA_OFFSET: u32 = Mode::LlamaOffset as u32;

    /// The mode whose const-generic parameter is `id`.
    pub const fn of(id: u32) -> Mode {
        match id {
            LLAMA => Mode::Llama,
            GEMMA => Mode::Gemma,
            NONE => Mode::None,
            _ => Mode::LlamaOffset,
        }
    }
}

/// The Rust type of an [`ElemType`] value (`elem_type!(Bf16)`), for the kernels' signatures.
macro_rules! elem_type {
    (F32) => {
        f32
    };
    (F16) => {
        f16
    };
    (Bf16) => {
        $crate::Bf16
    };
}
pub(crate) use elem_type;

/// A unit of vectorised loads and stores: [`V16`] or [`V8`], whole 32-bit words, aligned to
/// its size.
pub trait Vector: Copy {
    /// 32-bit words per vector.
    const WORDS: usize;
    /// All bits zero (0.0 in every lane of every element type).
    const ZERO: Self;
    /// Loads a vector from an address aligned to its size.
    ///
    /// # Safety
    /// `p` must be valid for a vector's bytes and aligned to its size.
    unsafe fn load(p: *const Self) -> Self;
    /// Stores a vector to an address aligned to its size.
    ///
    /// # Safety
    /// `p` must be valid for a vector's bytes and aligned to its size.
    unsafe fn store(self, p: *mut Self);
    /// Word `i` (< `WORDS`), the lowest-addressed first.
    fn word(&self, i: usize) -> u32;
    /// The vector whose word `i` is `f(i)`.
    fn from_words(f: impl FnMut(usize) -> u32) -> Self;
}

/// 16 bytes, 16-byte aligned (`ld/st.global.v4.b32`).
#[derive(Clone, Copy)]
#[repr(C, align(16))]
pub struct V16 {
    /// Bytes 0..4.
    pub a: u32,
    /// Bytes 4..8.
    pub b: u32,
    /// Bytes 8..12.
    pub c: u32,
    /// Bytes 12..16.
    pub d: u32,
}

impl Vector for V16 {
    const WORDS: usize = 4;
    const ZERO: V16 = V16 {
        a: 0,
        b: 0,
        c: 0,
        d: 0,
    };

    #[inline(always)]
    unsafe fn load(p: *const V16) -> V16 {
        let r = unsafe { &*p };
        V16 {
            a: r.a,
            b: r.b,
            c: r.c,
            d: r.d,
        }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut V16) {
        unsafe {
            *p = V16 {
                a: self.a,
                b: self.b,
                c: self.c,
                d: self.d,
            }
        }
    }

    #[inline(always)]
    fn word(&self, i: usize) -> u32 {
        match i & 3 {
            0 => self.a,
            1 => self.b,
            2 => self.c,
            _ => self.d,
        }
    }

    #[inline(always)]
    fn from_words(mut f: impl FnMut(usize) -> u32) -> V16 {
        V16 {
            a: f(0),
            b: f(1),
            c: f(2),
            d: f(3),
        }
    }
}

/// 8 bytes, 8-byte aligned (`ld/st.global.v2.b32`).
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub struct V8 {
    /// Bytes 0..4.
    pub a: u32,
    /// Bytes 4..8.
    pub b: u32,
}

impl Vector for V8 {
    const WORDS: usize = 2;
    const ZERO: V8 = V8 { a: 0, b: 0 };

    #[inline(always)]
    unsafe fn load(p: *const V8) -> V8 {
        let r = unsafe { &*p };
        V8 { a: r.a, b: r.b }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut V8) {
        unsafe {
            *p = V8 {
                a: self.a,
                b: self.b,
            }
        }
    }

    #[inline(always)]
    fn word(&self, i: usize) -> u32 {
        match i & 1 {
            0 => self.a,
            _ => self.b,
        }
    }

    #[inline(always)]
    fn from_words(mut f: impl FnMut(usize) -> u32) -> V8 {
        V8 { a: f(0), b: f(1) }
    }
}

/// A storage element: widened to f32 for arithmetic, narrowed with round-to-nearest-even.
pub trait Elem: Copy {
    /// Its identity in entry names and in the rules of [`identity`].
    const TYPE: ElemType;
    /// Elements per 32-bit word (1 or 2).
    const PER_WORD: usize;
    /// Elements per [`V16`].
    const LANES: usize = 4 * Self::PER_WORD;
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
    /// Round-to-nearest-even narrowing from f32 (NaN stays NaN).
    fn from_f32(v: f32) -> Self;
    /// Lane `i` (< `V::WORDS · PER_WORD`) of a vector, widened.
    fn lane<V: Vector>(v: &V, i: usize) -> f32;
    /// Packs `V::WORDS · PER_WORD` values (rounded to this type) into a vector.
    fn pack<V: Vector>(v: &[f32; 8]) -> V;
    /// `v` rounded to this type and widened back: the value an op "in D" produces.
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
    /// Lane-wise `D(a·b)` of two vectors of this type: the exact product rounded once, as
    /// `from_f32(a · b)` on widened lanes gives (the f32 product of two 16-bit values is exact).
    /// 16-bit types: one packed instruction per two lanes.
    fn mul_rn<V: Vector>(a: V, b: V) -> V;
    /// Lane-wise `D(a + b)`, like [`Elem::mul_rn`].
    fn add_rn<V: Vector>(a: V, b: V) -> V;
}

/// `f(a, b)` on each pair of 32-bit words of two vectors.
#[inline(always)]
fn words<V: Vector>(a: V, b: V, f: impl Fn(u32, u32) -> u32) -> V {
    V::from_words(|i| f(a.word(i), b.word(i)))
}

impl Elem for f32 {
    const TYPE: ElemType = ElemType::F32;
    const PER_WORD: usize = 1;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn lane<V: Vector>(v: &V, i: usize) -> f32 {
        f32::from_bits(v.word(i))
    }
    #[inline(always)]
    fn pack<V: Vector>(v: &[f32; 8]) -> V {
        V::from_words(|i| v[i].to_bits())
    }
    #[inline(always)]
    fn mul_rn<V: Vector>(a: V, b: V) -> V {
        words(a, b, |a, b| {
            (f32::from_bits(a) * f32::from_bits(b)).to_bits()
        })
    }
    #[inline(always)]
    fn add_rn<V: Vector>(a: V, b: V) -> V {
        words(a, b, |a, b| {
            (f32::from_bits(a) + f32::from_bits(b)).to_bits()
        })
    }
}

/// `D(a·b + c)` on two packed 16-bit lanes, `D` the type of `op` (`fma.rn.f16x2` or
/// `fma.rn.bf16x2`, PTX ≥ 7.0, sm_80: one rounding, subnormals kept).
macro_rules! fma_x2 {
    ($op:literal, $a:expr, $b:expr, $c:expr) => {{
        let d: u32;
        // SAFETY: a pure register operation.
        unsafe {
            asm!(concat!($op, " {d}, {a}, {b}, {c};"), d = out(reg32) d, a = in(reg32) $a,
                 b = in(reg32) $b, c = in(reg32) $c, options(pure, nomem, nostack))
        };
        d
    }};
}

/// Two negative zeros: `a·b + (−0)` is `a·b` rounded once, zeros keeping the product's sign.
const NEG_ZERO_X2: u32 = 0x8000_8000;

/// [`Elem::mul_rn`] and [`Elem::add_rn`] of a 16-bit type through its packed `fma` (`$fma`;
/// `$one_x2` is 1.0 in both halves): `a·b + (−0)` and `a·1 + b`, each rounded once.
macro_rules! packed_arith {
    ($fma:literal, $one_x2:expr) => {
        #[inline(always)]
        fn mul_rn<V: Vector>(a: V, b: V) -> V {
            words(a, b, |a, b| fma_x2!($fma, a, b, NEG_ZERO_X2))
        }
        #[inline(always)]
        fn add_rn<V: Vector>(a: V, b: V) -> V {
            words(a, b, |a, b| fma_x2!($fma, a, $one_x2, b))
        }
    };
}

/// `lo` and `hi` rounded to f16 (RNE) and packed, `lo` in the low half (`cvt.rn.f16x2.f32`).
#[inline(always)]
fn f16x2(lo: f32, hi: f32) -> u32 {
    let d: u32;
    // SAFETY: a pure register conversion (PTX ≥ 7.0, sm_80).
    unsafe {
        asm!("cvt.rn.f16x2.f32 {d}, {hi}, {lo};", d = out(reg32) d, hi = in(reg32) hi, lo = in(reg32) lo,
             options(pure, nomem, nostack))
    };
    d
}

/// `lo` and `hi` rounded to bf16 (RNE) and packed, `lo` in the low half (`cvt.rn.bf16x2.f32`).
#[inline(always)]
fn bf16x2(lo: f32, hi: f32) -> u32 {
    let d: u32;
    // SAFETY: a pure register conversion (PTX ≥ 7.0, sm_80).
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {d}, {hi}, {lo};", d = out(reg32) d, hi = in(reg32) hi, lo = in(reg32) lo,
             options(pure, nomem, nostack))
    };
    d
}

#[inline(always)]
fn half_word<V: Vector>(v: &V, i: usize) -> u16 {
    (v.word(i >> 1) >> ((i & 1) * 16)) as u16
}

impl Elem for f16 {
    const TYPE: ElemType = ElemType::F16;
    const PER_WORD: usize = 2;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as f16
    }
    #[inline(always)]
    fn lane<V: Vector>(v: &V, i: usize) -> f32 {
        f16::from_bits(half_word(v, i)) as f32
    }
    #[inline(always)]
    fn pack<V: Vector>(v: &[f32; 8]) -> V {
        V::from_words(|i| f16x2(v[2 * i], v[2 * i + 1]))
    }
    packed_arith!("fma.rn.f16x2", 0x3c00_3c00);
}

/// bfloat16 carried as its bit pattern (core has no bf16 type).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Elem for Bf16 {
    const TYPE: ElemType = ElemType::Bf16;
    const PER_WORD: usize = 2;
    #[inline(always)]
    fn lane<V: Vector>(v: &V, i: usize) -> f32 {
        Bf16(half_word(v, i)).to_f32()
    }
    #[inline(always)]
    fn pack<V: Vector>(v: &[f32; 8]) -> V {
        V::from_words(|i| bf16x2(v[2 * i], v[2 * i + 1]))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    /// `cvt.rn.bf16.f32` (one instruction; NaN becomes the canonical quiet NaN).
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Bf16(bf16x2(v, 0.0) as u16)
    }
    packed_arith!("fma.rn.bf16x2", 0x3f80_3f80);
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

/// This thread's y index in its block.
#[inline(always)]
pub fn thread_idx_y() -> usize {
    unsafe { nvptx::_thread_idx_y() as usize }
}

/// Threads per block along y.
#[inline(always)]
pub fn block_dim_y() -> usize {
    unsafe { nvptx::_block_dim_y() as usize }
}

/// This thread's z index in its block.
#[inline(always)]
pub fn thread_idx_z() -> usize {
    unsafe { nvptx::_thread_idx_z() as usize }
}

/// Threads per block along z.
#[inline(always)]
pub fn block_dim_z() -> usize {
    unsafe { nvptx::_block_dim_z() as usize }
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

/// Waits until the grid queued before this one in the stream has completed and its writes are
/// visible. The host launches the RMSNorm dW reduction as a programmatic dependent launch
/// (sm_90 and later): its blocks may start once the backward's blocks have exited, before the
/// backward's completion is processed, so the reduction calls this before it reads the
/// backward's partial rows. Returns at once after an ordinary launch; a no-op in the sm_80
/// build.
#[inline(always)]
pub fn wait_for_prerequisite_grids() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack))
    }
}

/// Lets the grid queued after this one in the stream, when it is a programmatic dependent
/// launch, start before this grid's blocks exit (once every block of this grid has called this
/// or exited); that grid still waits in [`wait_for_prerequisite_grids`] for this grid's
/// completion and writes. A no-op in the sm_80 build and for an ordinary launch.
#[inline(always)]
pub fn allow_dependent_grids() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack))
    }
}

/// Blocks in this block's thread-block cluster: 1 unless the host launched the grid in
/// clusters (sm_90 and later); always 1 in the sm_80 build, which has no clusters.
#[inline(always)]
pub fn cluster_blocks() -> usize {
    #[cfg(target_feature = "sm_90")]
    {
        let n: u32;
        // SAFETY: reads a special register.
        unsafe {
            asm!("mov.u32 {n}, %cluster_nctarank;", n = out(reg32) n,
                 options(pure, nomem, nostack))
        };
        n as usize
    }
    #[cfg(not(target_feature = "sm_90"))]
    1
}

/// This block's rank in its cluster (`0..cluster_blocks()`); 0 without a cluster.
#[inline(always)]
pub fn cluster_rank() -> usize {
    #[cfg(target_feature = "sm_90")]
    {
        let r: u32;
        // SAFETY: reads a special register.
        unsafe {
            asm!("mov.u32 {r}, %cluster_ctarank;", r = out(reg32) r,
                 options(pure, nomem, nostack))
        };
        r as usize
    }
    #[cfg(not(target_feature = "sm_90"))]
    0
}

/// Barrier over every thread of every block in the cluster, with release / acquire semantics
/// at cluster scope (the defaults of `barrier.cluster.arrive` / `.wait`; PTX 7.8 cannot spell
/// them out): shared-memory writes before it are visible to the cluster's blocks after
/// it ([`load_from_cluster_block`]), and a block that passes it knows that every block of the
/// cluster has arrived. Every thread of the block must call it (`.aligned`). A no-op in the
/// sm_80 build.
#[inline(always)]
pub fn cluster_sync() {
    #[cfg(target_feature = "sm_90")]
    // SAFETY: a barrier; the asm's implied memory clobber keeps shared-memory accesses on
    // their side of it.
    unsafe {
        asm!(
            "barrier.cluster.arrive.aligned;",
            "barrier.cluster.wait.aligned;",
            options(nostack)
        )
    }
}

/// The 16 bytes at `p`, an address in this block's shared memory, read from the same address
/// in the shared memory of block `rank` of the cluster (`mapa` then `ld.shared::cluster`).
///
/// # Safety
/// `p` must point into this block's dynamic shared memory, 16-byte aligned; `rank` must be
/// below [`cluster_blocks`]; that block must still be running, and the bytes written before a
/// [`cluster_sync`] that both blocks have passed. Only in the sm_90 build.
#[cfg(target_feature = "sm_90")]
#[inline(always)]
pub unsafe fn load_from_cluster_block(p: *const V16, rank: usize) -> V16 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller vouches for the address, the rank and the ordering.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 %shared64;",
            ".reg .u32 %shared, %remote;",
            "cvta.to.shared.u64 %shared64, {p};",
            "cvt.u32.u64 %shared, %shared64;",
            "mapa.shared::cluster.u32 %remote, %shared, {rank};",
            "ld.shared::cluster.v4.b32 {{{a}, {b}, {c}, {d}}}, [%remote];",
            "}}",
            p = in(reg64) p,
            rank = in(reg32) rank as u32,
            a = out(reg32) a,
            b = out(reg32) b,
            c = out(reg32) c,
            d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    V16 { a, b, c, d }
}

/// Sum over the 32 lanes of a (full) warp by butterfly exchange; every lane gets the same bits
/// (a + b = b + a).
#[inline(always)]
fn warp_sum(mut v: f32) -> f32 {
    let mut lane_mask = 16;
    while lane_mask > 0 {
        v += unsafe { shfl_bfly_f32(u32::MAX, v, lane_mask, 0x1f) };
        lane_mask >>= 1;
    }
    v
}

/// f32 slots of dynamic shared memory that [`block_sum2`] and [`block_sum`] use (from offset 0):
/// two sets, each one value per warp for each of the two sums.
pub use identity::SUM_SLOTS;

/// Sums of `a` and of `b` over the whole block, returned to every thread, in a fixed order
/// (deterministic).
///
/// Needs the block size to be a multiple of 32 and [`SUM_SLOTS`] f32 of dynamic shared memory.
/// One barrier per call: the warps' sums go to slot set `parity`, so consecutive calls must
/// alternate `parity` (0, 1, 0, …). A set is written again only two calls later, after the
/// next call's barrier, which every thread reaches only once it has read this call's slots.
#[inline(always)]
pub fn block_sum2(a: f32, b: f32, parity: usize) -> (f32, f32) {
    let smem = unsafe {
        core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>().add(parity * SUM_SLOTS / 2)
    };
    let (wa, wb) = (warp_sum(a), warp_sum(b));
    let lane = thread_idx() & 31;
    let warp = thread_idx() >> 5;
    let warps = block_dim() >> 5;
    if lane == 0 {
        unsafe {
            *smem.add(warp) = wa;
            *smem.add(32 + warp) = wb;
        }
    }
    sync_threads();
    let (pa, pb) = if lane < warps {
        unsafe { (*smem.add(lane), *smem.add(32 + lane)) }
    } else {
        (0.0, 0.0)
    };
    (warp_sum(pa), warp_sum(pb))
}

/// Sum of `v` over the whole block (see [`block_sum2`]: one barrier, alternate `parity`).
#[inline(always)]
pub fn block_sum(v: f32, parity: usize) -> f32 {
    let smem = unsafe {
        core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>().add(parity * SUM_SLOTS / 2)
    };
    let warp_total = warp_sum(v);
    let lane = thread_idx() & 31;
    let warp = thread_idx() >> 5;
    let warps = block_dim() >> 5;
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

/// Calls `f(0), f(1), …, f(N − 1)` as straight-line code (`N ≤ 8`, checked at compile time),
/// so that arrays indexed by the argument get constant indices and stay in registers (a `for`
/// loop over a small array is not always unrolled, and a dynamically indexed array lives in
/// local memory).
#[inline(always)]
pub fn unroll<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 8, "unroll takes at most 8 steps") };
    macro_rules! step {
        ($($i:literal)*) => { $( if N > $i { f($i); } )* };
    }
    step!(0 1 2 3 4 5 6 7);
}

/// Elements of `T` per vector `V`.
#[inline(always)]
pub fn lanes_per<T: Elem, V: Vector>() -> usize {
    V::WORDS * T::PER_WORD
}

/// Calls `f(i)` for each lane `i < lanes_per::<T, V>()` of a vector as straight-line code.
#[inline(always)]
pub fn lanes<T: Elem, V: Vector>(mut f: impl FnMut(usize)) {
    unroll::<8>(|i| {
        if i < lanes_per::<T, V>() {
            f(i)
        }
    });
}

/// Correctly rounded square root (`sqrt.rn.f32`).
#[inline(always)]
pub fn sqrt(v: f32) -> f32 {
    core::intrinsics::sqrtf32(v)
}

/// `a·b + c` with one rounding (`fma.rn.f32`): one instruction where `a * b + c` takes two.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}
