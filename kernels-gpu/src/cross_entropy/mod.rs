//! Cross-entropy over rows of logits (PyTorch's `cross_entropy` with Liger's options), forward
//! and backward; host: `src/cross_entropy/`, semantics: `src/reference/cross_entropy.rs`.
//!
//! One block per row. The forward reads the row once, keeping a running maximum and sum of
//! `exp` per thread (online softmax, one `ex2` per element), merges them over the block in a
//! fixed order (deterministic), and writes the row's loss and log-sum-exp; with a gradient
//! buffer it then reads the row again (from L2: the block just read it) and writes
//! `∂loss/∂z`, which may overwrite the logits in place. The backward is that second pass
//! alone, from the saved log-sum-exp. A one-block count kernel sums the mean's denominators
//! first (the gradient needs them), a one-block reduce kernel sums the per-row losses after.
pub mod abi;
mod staged;

use crate::identity::kernel_name;
use crate::math::{LN_2, LOG2_E, exp2, log2, safe_max, shfl_xor, tanh};
use crate::{Bf16, Elem, V16, Vector, block_dim, block_idx, fma, grid_dim, lanes, sync_threads};
use crate::{thread_idx, unroll};
use abi::{MEAN, NONE, Params, STAT_COUNT, STAT_WEIGHT, STAT_WEIGHT_SUM, UNROLL};
use core::intrinsics::gpu::gpu_launch_sized_workgroup_mem;

/// A running maximum `m` and sum `s` of `2^(x − m)` (x in log2 units).
#[derive(Clone, Copy)]
struct Online {
    m: f32,
    s: f32,
}

impl Online {
    const EMPTY: Online = Online {
        m: f32::NEG_INFINITY,
        s: 0.0,
    };

    /// Adds the first `n` of `xs` (at most 8): their maximum rescales the sum once, then
    /// their `2^(x − m)` are summed, independent of each other, so that a vector costs one
    /// dependent step of the running pair instead of `n` (−∞ adds 0, NaN makes the sum NaN).
    #[inline(always)]
    fn push(&mut self, xs: &[f32; 8], n: usize) {
        let mut mv = f32::NEG_INFINITY;
        unroll::<8>(|i| {
            if i < n {
                mv = mv.max(xs[i]);
            }
        });
        let m = self.m.max(mv);
        let ms = safe_max(m);
        let mut e = [0.0f32; 8];
        unroll::<8>(|i| {
            if i < n {
                e[i] = exp2(xs[i] - ms);
            }
        });
        let t = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
        self.s = fma(self.s, exp2(self.m - ms), t);
        self.m = m;
    }

    /// Both sets of values: the same bits either way round.
    #[inline(always)]
    fn merge(self, o: Online) -> Online {
        let m = self.m.max(o.m);
        let ms = safe_max(m);
        Online {
            m,
            s: self.s * exp2(self.m - ms) + o.s * exp2(o.m - ms),
        }
    }
}

/// The warp's maximum and sum and `Σ` of `sz`, by a butterfly: the same bits in every lane.
#[inline(always)]
fn warp_merge(mut on: Online, mut sz: f32) -> (Online, f32) {
    let mut mask = 16;
    while mask > 0 {
        let o = Online {
            m: shfl_xor(on.m, mask),
            s: shfl_xor(on.s, mask),
        };
        on = on.merge(o);
        sz += shfl_xor(sz, mask);
        mask >>= 1;
    }
    (on, sz)
}

/// The row's maximum and sum and `Σ` of `sz` over the block, the same bits in every thread
/// (a butterfly in each warp, then one over the warps' values in warp 0). Two barriers; the
/// next call may follow at once: its slot writes come after a barrier every thread reaches
/// only after reading this call's result, and warp 0 reads the warps' slots before the
/// second barrier.
#[inline(always)]
fn block_merge(on: Online, sz: f32) -> (Online, f32) {
    let (on, sz) = warp_merge(on, sz);
    let smem = gpu_launch_sized_workgroup_mem::<f32>();
    let (warp, warps) = (thread_idx() >> 5, block_dim() >> 5);
    if thread_idx() & 31 == 0 {
        // SAFETY: the host gives `abi::ROW_SHARED_BYTES` of shared memory; at most 32 warps.
        unsafe {
            *smem.add(3 * warp) = on.m;
            *smem.add(3 * warp + 1) = on.s;
            *smem.add(3 * warp + 2) = sz;
        }
    }
    sync_threads();
    // Warp 0 merges the warps' values by a butterfly over its lanes (lane w holds warp w's)
    // and leaves the result after them; every thread reads it after a second barrier.
    if warp == 0 {
        let lane = thread_idx() & 31;
        // SAFETY: written above, before the barrier.
        let (mut all, mut total) = if lane < warps {
            unsafe {
                let o = Online {
                    m: *smem.add(3 * lane),
                    s: *smem.add(3 * lane + 1),
                };
                (o, *smem.add(3 * lane + 2))
            }
        } else {
            (Online::EMPTY, 0.0)
        };
        (all, total) = warp_merge(all, total);
        if lane == 0 {
            // SAFETY: the slots after the warps' (ROW_SHARED_BYTES holds 33 triples).
            unsafe {
                *smem.add(96) = all.m;
                *smem.add(97) = all.s;
                *smem.add(98) = total;
            }
        }
    }
    sync_threads();
    // SAFETY: written by warp 0 before the barrier.
    unsafe {
        (
            Online {
                m: *smem.add(96),
                s: *smem.add(97),
            },
            *smem.add(98),
        )
    }
}

/// One element's raw bits in the low lanes of a vector (for [`Elem::lane`] at 0).
#[inline(always)]
unsafe fn load_one<T: Elem>(p: *const T) -> V16 {
    // SAFETY: the caller's pointer is valid for one element.
    let a = unsafe {
        if size_of::<T>() == 2 {
            *(p as *const u16) as u32
        } else {
            *(p as *const u32)
        }
    };
    V16 {
        a,
        b: 0,
        c: 0,
        d: 0,
    }
}

/// Walks this thread's elements of a row of `vocab`: `f(j, n, v)` for each group of `n`
/// consecutive elements from `j` held raw in `v` (`n` = [`Elem::LANES`] on the vector path,
/// else 1), [`UNROLL`] groups loaded before the first is used.
///
/// # Safety
/// `row` valid for `vocab` elements; on the vector path 16-byte aligned.
#[inline(always)]
unsafe fn walk<T: Elem, const VEC: bool>(
    row: *const T,
    vocab: usize,
    mut f: impl FnMut(usize, usize, &V16),
) {
    let (tid, bd) = (thread_idx(), block_dim());
    let n = if VEC { T::LANES } else { 1 };
    let groups = vocab / n;
    // SAFETY: `k < groups`: inside the row.
    let load = |k: usize| unsafe {
        if VEC {
            V16::load((row as *const V16).add(k))
        } else {
            load_one(row.add(k))
        }
    };
    let mut k = tid;
    while k + (UNROLL - 1) * bd < groups {
        let mut buf = [V16::ZERO; UNROLL];
        unroll::<UNROLL>(|u| buf[u] = load(k + u * bd));
        unroll::<UNROLL>(|u| f((k + u * bd) * n, n, &buf[u]));
        k += UNROLL * bd;
    }
    while k < groups {
        let v = load(k);
        f(k * n, n, &v);
        k += bd;
    }
    if VEC {
        let mut j = groups * n + tid;
        while j < vocab {
            // SAFETY: `j < vocab`.
            let v = unsafe { load_one(row.add(j)) };
            f(j, 1, &v);
            j += bd;
        }
    }
}

/// Stores `n` values from `j` of a row: one packed vector when `n` is a whole vector, else
/// one element.
///
/// # Safety
/// As [`walk`]'s row, for the gradient.
#[inline(always)]
unsafe fn put<T: Elem>(row: *mut T, j: usize, n: usize, out: &[f32; 8]) {
    // SAFETY: the caller's row; a whole vector starts at a multiple of LANES.
    unsafe {
        if n == T::LANES && n > 1 {
            T::pack::<V16>(out).store((row as *mut V16).add(j / n))
        } else {
            *row.add(j) = T::from_f32(out[0])
        }
    }
}

/// Row `row`'s outputs: its loss (cross-entropy `ce`, plus the z-loss `zl` for [`NONE`]),
/// its z-loss and its log-sum-exp where the call asks for them.
///
/// # Safety
/// The host's checks: `p`'s per-row buffers span `row`.
#[inline(always)]
unsafe fn put_row(p: &Params, row: usize, ce: f32, zl: f32, lse: f32) {
    // SAFETY: the caller's.
    unsafe {
        *(p.row_loss as *mut f32).add(row) = if p.reduction == NONE { ce + zl } else { ce };
        if p.row_z != 0 {
            *(p.row_z as *mut f32).add(row) = zl;
        }
        if p.lse != 0 {
            *(p.lse as *mut f32).add(row) = lse;
        }
    }
}

/// How a row's raw logits become the values the loss sees: `+ bias`, then soft-capping.
#[derive(Clone, Copy)]
struct Logit {
    bias: u64,
    cap: f32,
}

impl Logit {
    /// Logit `j` from its raw value `v` (bias in the logits' type, widened).
    #[inline(always)]
    fn of<T: Elem>(&self, j: usize, v: f32) -> f32 {
        let z = if self.bias != 0 {
            // SAFETY: the host's checks: the bias holds `vocab` elements.
            v + unsafe { (*(self.bias as *const T).add(j)).to_f32() }
        } else {
            v
        };
        if self.cap != 0.0 {
            self.cap * tanh(z / self.cap)
        } else {
            z
        }
    }
}

/// The forward (`BWD` false: pass 1, the loss, then pass 2 when `p.grad` is set) or the
/// backward (pass 2 alone from `p.lse`) of the rows of the grid's blocks.
///
/// # Safety
/// The host's checks: every buffer of `p` the pass uses spans its rows; `abi::ROW_SHARED_BYTES`
/// of shared memory; blocks of whole warps, at most 1024 threads.
#[inline(always)]
unsafe fn rows<T: Elem, const VEC: bool, const BWD: bool, const PLAIN: bool>(p: &Params) {
    let tid = thread_idx();
    let vocab = p.vocab as usize;
    let logit = Logit {
        bias: if PLAIN { 0 } else { p.bias },
        cap: if PLAIN { 0.0 } else { p.softcap },
    };
    let weight = p.weight as *const f32;
    let eps = p.label_smoothing / vocab as f32;
    let smooth = !PLAIN && p.label_smoothing != 0.0;
    // SAFETY (every raw access below): the host's checks on `p`'s buffers.
    let stats = |i: usize| unsafe { *(p.stats as *const f32).add(i) };
    let weight_sum = if p.weight != 0 && smooth {
        stats(STAT_WEIGHT_SUM)
    } else {
        vocab as f32
    };
    let (den_w, den_n) = if p.reduction == MEAN {
        (stats(STAT_WEIGHT), stats(STAT_COUNT))
    } else {
        (1.0, 1.0)
    };
    let mut row = block_idx();
    while (row as u64) < p.rows {
        let z = unsafe { (p.logits as *const T).add(row * p.logits_stride as usize) };
        let g = unsafe { (p.grad as *mut T).add(row * p.grad_stride as usize) };
        let t = unsafe { *(p.target as *const i64).add(row) };
        if t == p.ignore_index {
            if !BWD && tid == 0 {
                unsafe { put_row(p, row, 0.0, 0.0, 0.0) };
            }
            if p.grad != 0 {
                unsafe { walk::<T, VEC>(z, vocab, |j, n, _| put(g, j, n, &[0.0; 8])) };
            }
        } else {
            let valid = t >= 0 && (t as u64) < vocab as u64;
            let w_t = match (valid, p.weight != 0) {
                (false, _) => f32::NAN,
                (true, true) => unsafe { *weight.add(t as usize) },
                (true, false) => 1.0,
            };
            let lse = if BWD {
                unsafe { *(p.lse as *const f32).add(row) }
            } else {
                // The target's logit, read before the block's barrier: the gradient may
                // overwrite it.
                let x_t = if valid && tid == 0 {
                    logit.of::<T>(t as usize, unsafe { (*z.add(t as usize)).to_f32() })
                } else {
                    f32::NAN
                };
                let (mut on, mut sz) = (Online::EMPTY, 0.0);
                unsafe {
                    walk::<T, VEC>(z, vocab, |j, n, v| {
                        let mut xs = [0.0f32; 8];
                        lanes::<T, V16>(|i| {
                            if i < n {
                                let x = logit.of::<T>(j + i, T::lane(v, i));
                                xs[i] = x * LOG2_E;
                                if smooth {
                                    sz += if p.weight != 0 {
                                        *weight.add(j + i) * x
                                    } else {
                                        x
                                    };
                                }
                            }
                        });
                        on.push(&xs, n);
                    })
                };
                let (on, sz) = block_merge(on, sz);
                let lse = if valid {
                    (on.m + log2(on.s)) * LN_2
                } else {
                    f32::NAN
                };
                if tid == 0 {
                    let mut ce = (lse - x_t) * w_t * (1.0 - p.label_smoothing);
                    if smooth {
                        ce += eps * (lse * weight_sum - sz);
                    }
                    unsafe { put_row(p, row, ce, p.lse_square_scale * lse * lse, lse) };
                }
                lse
            };
            if p.grad != 0 {
                let up = match (p.grad_loss, p.reduction) {
                    (0, _) => 1.0,
                    (gl, NONE) => unsafe { *(gl as *const f32).add(row) },
                    (gl, _) => unsafe { *(gl as *const f32) },
                };
                let a = up
                    * (((1.0 - p.label_smoothing) * w_t + eps * weight_sum) / den_w
                        + 2.0 * p.lse_square_scale * lse / den_n);
                let b = up * eps / den_w;
                let c = up * (1.0 - p.label_smoothing) * w_t / den_w;
                let lse2 = lse * LOG2_E;
                unsafe {
                    walk::<T, VEC>(z, vocab, |j, n, v| {
                        let mut out = [0.0f32; 8];
                        lanes::<T, V16>(|i| {
                            if i < n {
                                let x = logit.of::<T>(j + i, T::lane(v, i));
                                let mut d = a * exp2(x * LOG2_E - lse2);
                                if smooth {
                                    d -= if p.weight != 0 {
                                        b * *weight.add(j + i)
                                    } else {
                                        b
                                    };
                                }
                                if (j + i) as i64 == t {
                                    d -= c;
                                }
                                if logit.cap != 0.0 {
                                    let r = x / logit.cap;
                                    d *= 1.0 - r * r;
                                }
                                out[i] = d;
                            }
                        });
                        put(g, j, n, &out);
                    })
                };
            }
        }
        row += grid_dim();
    }
}

/// Sums of each thread's three values over the block by a fixed tree (deterministic), valid
/// in thread 0.
#[inline(always)]
fn tree_sum3(v: [f64; 3]) -> [f64; 3] {
    let smem = gpu_launch_sized_workgroup_mem::<f64>();
    let (tid, bd) = (thread_idx(), block_dim());
    // SAFETY: `abi::stats_shared_bytes()` of shared memory for `bd` threads.
    unsafe {
        for (k, x) in v.iter().enumerate() {
            *smem.add(k * bd + tid) = *x;
        }
        let mut half = bd / 2;
        while half > 0 {
            sync_threads();
            if tid < half {
                for k in 0..3 {
                    *smem.add(k * bd + tid) += *smem.add(k * bd + tid + half);
                }
            }
            half /= 2;
        }
        [*smem, *smem.add(bd), *smem.add(2 * bd)]
    }
}

/// The mean's denominators and the weights' sum ([`abi::STATS`] values), one block.
///
/// # Safety
/// The host's checks: targets of `p.rows`, weights of `p.vocab` when set, `stats` of 3.
#[inline(always)]
unsafe fn count(p: &Params) {
    let (tid, bd) = (thread_idx(), block_dim());
    let weight = p.weight as *const f32;
    let (mut w, mut n, mut ws) = (0.0f64, 0.0f64, 0.0f64);
    let mut i = tid;
    while (i as u64) < p.rows {
        // SAFETY: `i < rows`; a weight is read only at a target inside the vocabulary.
        let t = unsafe { *(p.target as *const i64).add(i) };
        if t != p.ignore_index {
            n += 1.0;
            w += match (p.weight != 0, t >= 0 && (t as u64) < p.vocab as u64) {
                (false, _) => 1.0,
                (true, true) => unsafe { *weight.add(t as usize) as f64 },
                (true, false) => f64::NAN,
            };
        }
        i += bd;
    }
    if p.weight != 0 {
        let mut j = tid;
        while j < p.vocab as usize {
            // SAFETY: `j < vocab`.
            ws += unsafe { *weight.add(j) as f64 };
            j += bd;
        }
    }
    let [w, n, ws] = tree_sum3([w, n, ws]);
    if tid == 0 {
        let stats = p.stats as *mut f32;
        // SAFETY: `stats` holds STATS values.
        unsafe {
            *stats.add(STAT_WEIGHT) = w as f32;
            *stats.add(STAT_COUNT) = n as f32;
            *stats.add(STAT_WEIGHT_SUM) = ws as f32;
        }
    }
}

/// The reduced loss (and z-loss) from the per-row values, one block.
///
/// # Safety
/// The host's checks: `row_loss` (and `row_z` when set) of `p.rows`, `stats` written by the
/// count kernel for [`MEAN`], `total` (and `total_z` when set) of one value.
#[inline(always)]
unsafe fn reduce(p: &Params) {
    let (tid, bd) = (thread_idx(), block_dim());
    let (mut ce, mut zl) = (0.0f64, 0.0f64);
    let mut i = tid;
    while (i as u64) < p.rows {
        // SAFETY: `i < rows`.
        unsafe {
            ce += *(p.row_loss as *const f32).add(i) as f64;
            if p.row_z != 0 {
                zl += *(p.row_z as *const f32).add(i) as f64;
            }
        }
        i += bd;
    }
    let [ce, zl, _] = tree_sum3([ce, zl, 0.0]);
    if tid == 0 {
        // SAFETY: as the function's.
        unsafe {
            let (ce, zl) = if p.reduction == MEAN {
                let stats = p.stats as *const f32;
                (
                    ce / *stats.add(STAT_WEIGHT) as f64,
                    zl / *stats.add(STAT_COUNT) as f64,
                )
            } else {
                (ce, zl)
            };
            *(p.total as *mut f32) = (ce + zl) as f32;
            if p.total_z != 0 {
                *(p.total_z as *mut f32) = zl as f32;
            }
        }
    }
}

/// Entry points: `$body(p)` exported under the kernel's identity.
macro_rules! ce_kernels {
    ($($pass:ident $($path:ident $elem:ident)? => $body:path;)*) => {
        $(
            const _: () = {
                /// # Safety
                /// The host's checks: every buffer of `p` the pass uses spans its rows; the
                /// grid, block and shared memory are the host plan's.
                #[unsafe(export_name = kernel_name!(CrossEntropy, $pass $(, $path, $elem)?))]
                // A `#[repr(C)]` struct of integers and floats: the PTX parameter is its bytes
                // (`.param .align 8 .b8 …[size]`), which the host's tests check per entry.
                #[allow(improper_gpu_kernel_arg)]
                pub unsafe extern "gpu-kernel" fn kernel(p: Params) {
                    unsafe { $body(&p) }
                }
            };
        )*
    };
}

ce_kernels! {
    Forward Scalar F32 => rows::<f32, false, false, true>;
    Forward Scalar F16 => rows::<f16, false, false, true>;
    Forward Scalar Bf16 => rows::<Bf16, false, false, true>;
    Forward Vector F32 => rows::<f32, true, false, true>;
    Forward Vector F16 => rows::<f16, true, false, true>;
    Forward Vector Bf16 => rows::<Bf16, true, false, true>;
    Forward ScalarFull F32 => rows::<f32, false, false, false>;
    Forward ScalarFull F16 => rows::<f16, false, false, false>;
    Forward ScalarFull Bf16 => rows::<Bf16, false, false, false>;
    Forward VectorFull F32 => rows::<f32, true, false, false>;
    Forward VectorFull F16 => rows::<f16, true, false, false>;
    Forward VectorFull Bf16 => rows::<Bf16, true, false, false>;
    Forward Staged F32 => staged::rows::<f32>;
    Forward Staged F16 => staged::rows::<f16>;
    Forward Staged Bf16 => staged::rows::<Bf16>;
    Backward Scalar F32 => rows::<f32, false, true, true>;
    Backward Scalar F16 => rows::<f16, false, true, true>;
    Backward Scalar Bf16 => rows::<Bf16, false, true, true>;
    Backward Vector F32 => rows::<f32, true, true, true>;
    Backward Vector F16 => rows::<f16, true, true, true>;
    Backward Vector Bf16 => rows::<Bf16, true, true, true>;
    Backward ScalarFull F32 => rows::<f32, false, true, false>;
    Backward ScalarFull F16 => rows::<f16, false, true, false>;
    Backward ScalarFull Bf16 => rows::<Bf16, false, true, false>;
    Backward VectorFull F32 => rows::<f32, true, true, false>;
    Backward VectorFull F16 => rows::<f16, true, true, false>;
    Backward VectorFull Bf16 => rows::<Bf16, true, true, false>;
    Count => count;
    Reduce => reduce;
}
