//! AdamW, Adam and SGD over many tensors per launch, PyTorch's fused optimizers operation for
//! operation; the global gradient norm for clipping. Host: `src/adamw/`, semantics:
//! `src/reference/adamw.rs`.
//!
//! The update kernels: blocks of [`abi::BLOCK_ELEMS`] elements over the launch's tensors in
//! order (a block finds its tensor in the parameter block), four elements per thread per step
//! on aligned tensors (`sweep`). Each element is read and written once: θ in f32, m, v (and
//! amsgrad's maximum) in f32 or bf16, the gradient in its own type, the low-precision copy of θ
//! written in the same pass. The norm: a sum-of-squares (or max-abs) kernel writes one f32
//! partial per block, a one-block kernel reduces them in f64 in a fixed order (deterministic)
//! and writes the norm, the clip factor (which the update multiplies the gradient by) and the
//! non-finite flag.
pub mod abi;

use crate::identity::kernel_name;
use crate::math::shfl_xor;
use crate::{
    Bf16, Elem, V8, V16, Vector, block_dim, block_idx, block_sum, fma, sqrt, sync_threads,
    thread_idx,
};
use abi::{
    AMSGRAD, BLOCK_ELEMS, DECOUPLED, FIRST_STEP, MAXIMIZE, NESTEROV, NORM_INF, Params, Tensor,
};
use core::intrinsics::gpu::gpu_launch_sized_workgroup_mem;

/// A copy type of the weights: none, or a 16-bit element type.
pub(crate) trait Copy16 {
    /// The alignment four copy elements need (1 without a copy).
    const BYTES4: u64;
    /// Stores `v` rounded to this type at element `j` of `ptr` (nothing without a copy).
    ///
    /// # Safety
    /// `ptr` valid for element `j`.
    unsafe fn store(ptr: u64, j: usize, v: f32);
    /// Stores four values at elements `4q..4q + 4` of `ptr` (nothing without a copy).
    ///
    /// # Safety
    /// `ptr` aligned to [`Copy16::BYTES4`] and valid for those elements.
    unsafe fn store4(ptr: u64, q: usize, v: [f32; 4]);
}

/// No copy.
pub(crate) struct NoCopy;

impl Copy16 for NoCopy {
    const BYTES4: u64 = 1;
    #[inline(always)]
    unsafe fn store(_: u64, _: usize, _: f32) {}
    #[inline(always)]
    unsafe fn store4(_: u64, _: usize, _: [f32; 4]) {}
}

impl<T: Elem> Copy16 for T {
    const BYTES4: u64 = 4 * size_of::<T>() as u64;
    #[inline(always)]
    unsafe fn store(ptr: u64, j: usize, v: f32) {
        // SAFETY: the caller's.
        unsafe { *(ptr as *mut T).add(j) = T::from_f32(v) }
    }
    #[inline(always)]
    unsafe fn store4(ptr: u64, q: usize, v: [f32; 4]) {
        // SAFETY: the caller's.
        unsafe { store4::<T>(ptr, q, v) }
    }
}

/// `β^t` for a whole number of steps t: the exact power (by squaring in f64) rounded to f32,
/// which is what PyTorch's f32 `pow` returns for these arguments.
#[inline(always)]
fn powf(beta: f32, t: f32) -> f32 {
    let mut n = t as u64;
    let (mut base, mut acc) = (beta as f64, 1.0f64);
    while n > 0 {
        if n & 1 == 1 {
            acc *= base;
        }
        base *= base;
        n >>= 1;
    }
    acc as f32
}

/// Tensor `i` of the parameter block, by constant indices only: a dynamic index into the
/// by-value block would copy all of it (2 KiB) to local memory in every thread.
macro_rules! pick {
    ($p:expr, $i:expr; $($k:literal)*) => {
        match $i { $($k => $p.tensors[$k],)* _ => $p.tensors[0] }
    };
}

/// The launch's tensor of block `b` and the block's first element in it.
#[inline(always)]
fn tensor_of(p: &Params, b: u64) -> (Tensor, u64) {
    let mut i = 0u32;
    macro_rules! find {
        ($($k:literal)*) => { $( if $k < p.count && p.tensors[$k].first_block <= b { i = $k; } )* };
    }
    find!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    let t = pick!(p, i; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
        27 28 29 30 31);
    (t, (b - t.first_block) * BLOCK_ELEMS)
}

/// A device f32 scalar, or `none` without one.
///
/// # Safety
/// `ptr` is 0 or a valid f32.
#[inline(always)]
unsafe fn scalar(ptr: u64, none: f32) -> f32 {
    if ptr == 0 {
        none
    } else {
        // SAFETY: the caller's.
        unsafe { *(ptr as *const f32) }
    }
}

/// Four consecutive elements of `T` at `ptr + 4·q`, widened (one 8- or 16-byte load).
///
/// # Safety
/// `ptr` aligned to four elements and valid for elements `4q..4q + 4`.
#[inline(always)]
unsafe fn load4<T: Elem>(ptr: u64, q: usize) -> [f32; 4] {
    // SAFETY: the caller's.
    unsafe {
        if T::PER_WORD == 1 {
            let v = V16::load((ptr as *const V16).add(q));
            [0, 1, 2, 3].map(|i| T::lane(&v, i))
        } else {
            let v = V8::load((ptr as *const V8).add(q));
            [0, 1, 2, 3].map(|i| T::lane(&v, i))
        }
    }
}

/// Stores four values rounded to `T` at `ptr + 4·q` (one 8- or 16-byte store).
///
/// # Safety
/// As [`load4`].
#[inline(always)]
unsafe fn store4<T: Elem>(ptr: u64, q: usize, v: [f32; 4]) {
    let w = [v[0], v[1], v[2], v[3], 0.0, 0.0, 0.0, 0.0];
    // SAFETY: the caller's.
    unsafe {
        if T::PER_WORD == 1 {
            T::pack::<V16>(&w).store((ptr as *mut V16).add(q));
        } else {
            T::pack::<V8>(&w).store((ptr as *mut V8).add(q));
        }
    }
}

/// Whether every buffer of `t` is aligned to four of its elements (0, an absent buffer, is).
#[inline(always)]
fn aligned<G: Elem, C: Copy16, S: Elem>(t: &Tensor) -> bool {
    let states = t.exp_avg | t.exp_avg_sq | t.max_exp_avg_sq;
    let (g, s) = (4 * size_of::<G>() as u64, 4 * size_of::<S>() as u64);
    t.param % 16 == 0 && states % s == 0 && t.grad % g == 0 && t.copy % C::BYTES4 == 0
}

/// Runs the element rule `f(g, [θ, s1, s2, s3]) → [θ, s1, s2, s3]` over the block's elements
/// of `t`: the gradient (times the clip factor, rounded to its type, as `clip_grad_norm_`
/// scales gradients in place) read, θ (f32) and the states (of `S`, widened to f32 and
/// rounded back when stored) whose pointers are not 0 read and written, the copy of θ
/// written. Aligned tensors go four elements per thread per step (16-
/// and 8-byte accesses), the rest (and a tensor's last few elements) one.
///
/// # Safety
/// The host's checks: every buffer of `t` holds `t.len` elements; the scalars' pointers are 0
/// or valid.
#[inline(always)]
unsafe fn sweep<G: Elem, C: Copy16, S: Elem>(
    p: &Params,
    t: &Tensor,
    start: u64,
    f: impl Fn(f32, [f32; 4]) -> [f32; 4],
) {
    let end = (start + BLOCK_ELEMS).min(t.len);
    let clip = p.clip_ptr;
    let arrays = [t.param, t.exp_avg, t.exp_avg_sq, t.max_exp_avg_sq];
    // SAFETY (every access): elements below `end ≤ len`; the caller's pointers.
    unsafe {
        let clip = scalar(clip, 1.0);
        let grad = |g: f32| match p.clip_ptr {
            0 => g,
            _ => G::round(g * clip),
        };
        let (tid, bd) = (thread_idx() as u64, block_dim() as u64);
        let mut j = start;
        if aligned::<G, C, S>(t) {
            let quads = (end - start) / 4;
            let mut q = start / 4 + tid;
            while q < start / 4 + quads {
                let gs = load4::<G>(t.grad, q as usize);
                let mut vals = [[0.0f32; 4]; 4];
                for (k, &a) in arrays.iter().enumerate() {
                    if a != 0 {
                        vals[k] = match k {
                            0 => load4::<f32>(a, q as usize),
                            _ => load4::<S>(a, q as usize),
                        };
                    }
                }
                let mut th = [0.0f32; 4];
                for l in 0..4 {
                    let out = f(
                        grad(gs[l]),
                        [vals[0][l], vals[1][l], vals[2][l], vals[3][l]],
                    );
                    for k in 0..4 {
                        vals[k][l] = out[k];
                    }
                    th[l] = out[0];
                }
                for (k, &a) in arrays.iter().enumerate() {
                    if a != 0 {
                        match k {
                            0 => store4::<f32>(a, q as usize, vals[k]),
                            _ => store4::<S>(a, q as usize, vals[k]),
                        }
                    }
                }
                C::store4(t.copy, q as usize, th);
                q += bd;
            }
            j = start + 4 * quads;
        }
        let mut j = j + tid;
        while j < end {
            let i = j as usize;
            let g = grad((*(t.grad as *const G).add(i)).to_f32());
            let mut vals = [0.0f32; 4];
            for (k, &a) in arrays.iter().enumerate() {
                if a != 0 {
                    vals[k] = match k {
                        0 => *(a as *const f32).add(i),
                        _ => (*(a as *const S).add(i)).to_f32(),
                    };
                }
            }
            let out = f(g, vals);
            for (k, &a) in arrays.iter().enumerate() {
                if a != 0 {
                    match k {
                        0 => *(a as *mut f32).add(i) = out[k],
                        _ => *(a as *mut S).add(i) = S::from_f32(out[k]),
                    }
                }
            }
            C::store(t.copy, i, out[0]);
            j += bd;
        }
    }
}

/// The AdamW/Adam update of the block's elements, PyTorch 2.11's `adam_math` operation for
/// operation: the hyper-parameters rounded to f32, f32 arithmetic, its `fma`s where it calls
/// `std::fma` or nvcc contracts a product into a sum. The moments are of `S`: f32, or bf16
/// (rounded once when stored; the step uses the f32 values it computed).
///
/// # Safety
/// The host's checks: every tensor's buffers hold `len` elements, the grid is the launch's
/// blocks, the scalars' pointers are 0 or valid.
#[inline(always)]
unsafe fn update<G: Elem, C: Copy16, S: Elem>(p: &Params) {
    // SAFETY (every access): the host's checks.
    unsafe {
        if scalar(p.found_inf_ptr, 0.0) != 0.0 {
            return;
        }
        let (t, start) = tensor_of(p, block_idx() as u64);
        let step = scalar(p.step_ptr, p.step);
        let lr = scalar(p.lr_ptr, p.lr as f32);
        let scale = scalar(p.grad_scale_ptr, 1.0);
        let (b1, b2, wd, eps) = (
            p.beta1 as f32,
            p.beta2 as f32,
            p.weight_decay as f32,
            p.eps as f32,
        );
        let bc1 = 1.0 - powf(b1, step);
        let bc2_sqrt = sqrt(1.0 - powf(b2, step));
        let step_size = lr / bc1;
        let (amsgrad, maximize, decoupled) = (
            p.flags & AMSGRAD != 0,
            p.flags & MAXIMIZE != 0,
            p.flags & DECOUPLED != 0,
        );
        let scaled = p.grad_scale_ptr != 0;
        sweep::<G, C, S>(p, &t, start, |g, [th, m, v, mx]| {
            let mut g = if scaled { g / scale } else { g };
            if maximize {
                g = -g;
            }
            let mut th = th;
            if wd != 0.0 {
                if decoupled {
                    th = fma(-(lr * wd), th, th);
                } else {
                    g = fma(th, wd, g);
                }
            }
            let m1 = fma(b1, m, fma(-b1, g, g));
            let g2 = g * g;
            let v1 = fma(b2, v, fma(-b2, g2, g2));
            let mx1 = if amsgrad { mx.max(v1) } else { v1 };
            let denom = sqrt(mx1) / bc2_sqrt + eps;
            [th - step_size * m1 / denom, m1, v1, mx1]
        });
    }
}

/// The SGD update of the block's elements, PyTorch 2.11's `sgd_math` operation for
/// operation: the hyper-parameters rounded to f32, f32 arithmetic with the `fma`s nvcc
/// contracts its products and sums into.
///
/// # Safety
/// As [`update`]; `exp_avg` holds the momentum buffer where `momentum` is not 0.
#[inline(always)]
unsafe fn sgd<G: Elem, C: Copy16>(p: &Params) {
    // SAFETY (every access): the host's checks.
    unsafe {
        if scalar(p.found_inf_ptr, 0.0) != 0.0 {
            return;
        }
        let (t, start) = tensor_of(p, block_idx() as u64);
        let lr = scalar(p.lr_ptr, p.lr as f32);
        let scale = scalar(p.grad_scale_ptr, 1.0);
        let (wd, mom) = (p.weight_decay as f32, p.momentum as f32);
        let undamped = 1.0 - p.dampening as f32;
        let (nesterov, first) = (p.flags & NESTEROV != 0, p.flags & FIRST_STEP != 0);
        let maximize = p.flags & MAXIMIZE != 0;
        let scaled = p.grad_scale_ptr != 0;
        sweep::<G, C, f32>(p, &t, start, |g, [th, b, _, _]| {
            let mut g = if scaled { g / scale } else { g };
            if maximize {
                g = -g;
            }
            if wd != 0.0 {
                g = fma(wd, th, g);
            }
            let mut b1 = b;
            if mom != 0.0 {
                // nvcc fuses the second product: `μ·b` rounds, `(1 − dampening)·g` does not.
                b1 = if first { g } else { fma(undamped, g, mom * b) };
                g = if nesterov { fma(mom, b1, g) } else { b1 };
            }
            [fma(-lr, g, th), b1, 0.0, 0.0]
        });
    }
}

/// `a` or `b`, the larger, NaN where either is NaN (as `torch.max`): a NaN gradient must reach
/// the infinity norm.
#[inline(always)]
fn max_nan(a: f32, b: f32) -> f32 {
    if b.is_nan() || b > a { b } else { a }
}

/// The largest of `v ≥ 0` over the block (NaN if any is), to every thread; `SUM_SLOTS` f32 of
/// shared memory, one barrier.
#[inline(always)]
fn block_max(v: f32) -> f32 {
    let smem = gpu_launch_sized_workgroup_mem::<f32>();
    let warp_max = |mut w: f32| {
        let mut mask = 16;
        while mask > 0 {
            w = max_nan(w, shfl_xor(w, mask));
            mask >>= 1;
        }
        w
    };
    let w = warp_max(v);
    let (lane, warp, warps) = (thread_idx() & 31, thread_idx() >> 5, block_dim() >> 5);
    if lane == 0 {
        // SAFETY: one slot per warp, `SUM_SLOTS ≥ 32`.
        unsafe { *smem.add(warp) = w };
    }
    sync_threads();
    // SAFETY: the warps' slots, written before the barrier.
    warp_max(if lane < warps {
        unsafe { *smem.add(lane) }
    } else {
        0.0
    })
}

/// Each block's sum of the squared gradient elements (f32; with [`NORM_INF`], the largest
/// `|g|`) into `partials[partial_base + b]`.
///
/// # Safety
/// As [`update`]; `partials` holds the launch's blocks from `partial_base`; `SUM_SLOTS` f32 of
/// shared memory.
#[inline(always)]
unsafe fn sum_squares<G: Elem>(p: &Params) {
    let b = block_idx() as u64;
    let (t, start) = tensor_of(p, b);
    let end = (start + BLOCK_ELEMS).min(t.len);
    let inf = p.flags & NORM_INF != 0;
    let add = |acc: f32, g: f32| {
        if inf {
            max_nan(acc, g.abs())
        } else {
            fma(g, g, acc)
        }
    };
    let (tid, bd) = (thread_idx() as u64, block_dim() as u64);
    let mut acc = 0.0f32;
    let mut j = start;
    if t.grad % (4 * size_of::<G>() as u64) == 0 {
        let quads = (end - start) / 4;
        let mut q = start / 4 + tid;
        while q < start / 4 + quads {
            // SAFETY: elements `4q..4q + 4 ≤ end`, aligned.
            let g = unsafe { load4::<G>(t.grad, q as usize) };
            acc = add(add(add(add(acc, g[0]), g[1]), g[2]), g[3]);
            q += bd;
        }
        j = start + 4 * quads;
    }
    let mut j = j + tid;
    while j < end {
        // SAFETY: `j < len`.
        acc = add(acc, unsafe {
            (*(t.grad as *const G).add(j as usize)).to_f32()
        });
        j += bd;
    }
    let total = if inf {
        block_max(acc)
    } else {
        block_sum(acc, 0)
    };
    if thread_idx() == 0 {
        // SAFETY: the host sized the partials.
        unsafe { *(p.partials as *mut f32).add((p.partial_base + b) as usize) = total };
    }
}

/// The global norm from the partials (L2: their sum in f64 in a fixed order, then the root;
/// [`NORM_INF`]: their maximum), the clip factor `max_norm / (norm + 1e-6)` clamped to 1 (f32,
/// NaN staying NaN, as PyTorch's `clip_grad_norm_`), and the non-finite flag; one block.
///
/// # Safety
/// `partials` holds `partial_count` values, `norm` [`NORM_OUT`] f32; `THREADS` f64 of shared
/// memory.
#[inline(always)]
unsafe fn norm(p: &Params) {
    let smem = gpu_launch_sized_workgroup_mem::<f64>();
    let (tid, bd) = (thread_idx(), block_dim());
    let inf = p.flags & NORM_INF != 0;
    let combine = |a: f64, b: f64| {
        if !inf {
            a + b
        } else if b.is_nan() || b > a {
            b
        } else {
            a
        }
    };
    let mut acc = 0.0f64;
    let mut i = tid as u64;
    while i < p.partial_count {
        // SAFETY: `i < partial_count`.
        acc = combine(acc, unsafe { *(p.partials as *const f32).add(i as usize) }
            as f64);
        i += bd as u64;
    }
    // SAFETY: `bd` f64 of shared memory; a fixed tree.
    unsafe {
        *smem.add(tid) = acc;
        let mut half = bd / 2;
        while half > 0 {
            sync_threads();
            if tid < half {
                *smem.add(tid) = combine(*smem.add(tid), *smem.add(tid + half));
            }
            half /= 2;
        }
        if tid == 0 {
            let total = *smem;
            let n = if inf {
                total as f32
            } else {
                core::intrinsics::sqrtf64(total) as f32
            };
            let f = p.max_norm / (n + 1e-6);
            let out = p.norm as *mut f32;
            *out = n;
            *out.add(1) = if f > 1.0 { 1.0 } else { f };
            *out.add(2) = if n.is_finite() { 0.0 } else { 1.0 };
        }
    }
}

/// Entry points: `$body(p)` exported under the kernel's identity.
macro_rules! adamw_kernels {
    ($($pass:ident $($grad:ident $($copy:ident)?)? => $body:path;)*) => {
        $(
            const _: () = {
                /// # Safety
                /// The host's checks: every tensor of `p` holds its length; the grid, block
                /// and shared memory are the host plan's.
                #[unsafe(export_name = kernel_name!(AdamW, $pass $(, $grad $(, $copy)?)?))]
                // A `#[repr(C)]` struct of integers and floats: the PTX parameter is its bytes.
                #[allow(improper_gpu_kernel_arg)]
                pub unsafe extern "gpu-kernel" fn kernel(p: Params) {
                    unsafe { $body(&p) }
                }
            };
        )*
    };
}

adamw_kernels! {
    Update F32 None => update::<f32, NoCopy, f32>;
    Update F32 F16 => update::<f32, f16, f32>;
    Update F32 Bf16 => update::<f32, Bf16, f32>;
    Update F16 None => update::<f16, NoCopy, f32>;
    Update F16 F16 => update::<f16, f16, f32>;
    Update F16 Bf16 => update::<f16, Bf16, f32>;
    Update Bf16 None => update::<Bf16, NoCopy, f32>;
    Update Bf16 F16 => update::<Bf16, f16, f32>;
    Update Bf16 Bf16 => update::<Bf16, Bf16, f32>;
    UpdateBf16States F32 None => update::<f32, NoCopy, Bf16>;
    UpdateBf16States F32 F16 => update::<f32, f16, Bf16>;
    UpdateBf16States F32 Bf16 => update::<f32, Bf16, Bf16>;
    UpdateBf16States F16 None => update::<f16, NoCopy, Bf16>;
    UpdateBf16States F16 F16 => update::<f16, f16, Bf16>;
    UpdateBf16States F16 Bf16 => update::<f16, Bf16, Bf16>;
    UpdateBf16States Bf16 None => update::<Bf16, NoCopy, Bf16>;
    UpdateBf16States Bf16 F16 => update::<Bf16, f16, Bf16>;
    UpdateBf16States Bf16 Bf16 => update::<Bf16, Bf16, Bf16>;
    Sgd F32 None => sgd::<f32, NoCopy>;
    Sgd F32 F16 => sgd::<f32, f16>;
    Sgd F32 Bf16 => sgd::<f32, Bf16>;
    Sgd F16 None => sgd::<f16, NoCopy>;
    Sgd F16 F16 => sgd::<f16, f16>;
    Sgd F16 Bf16 => sgd::<f16, Bf16>;
    Sgd Bf16 None => sgd::<Bf16, NoCopy>;
    Sgd Bf16 F16 => sgd::<Bf16, f16>;
    Sgd Bf16 Bf16 => sgd::<Bf16, Bf16>;
    SumSquares F32 => sum_squares::<f32>;
    SumSquares F16 => sum_squares::<f16>;
    SumSquares Bf16 => sum_squares::<Bf16>;
    Norm => norm;
}
