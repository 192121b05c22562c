//! Attention (flash-attention 2 semantics) forward and backward; host: `src/attention/`,
//! semantics: `src/reference/attention.rs`.
//!
//! Every kernel takes one [`abi::Params`] and runs on a grid of (row blocks, heads, sequences):
//! the forward and dQ kernels over blocks of query rows of one query head, the dK/dV kernels
//! over blocks of key rows of one key/value head, each walking every query head of that head's
//! group, so dK and dV are summed in registers in a fixed order (deterministic, no atomics).
//! Scores live only in registers: the forward keeps a running maximum and sum per row (online
//! softmax) and saves the output and each row's log-sum-exp; the backward recomputes the
//! probabilities from the log-sum-exp, tile by tile.
//!
//! Two paths: [`simt`] (one warp per row, f32 in CUDA cores: any element type, head_dim up to
//! 256, any alignment) and the tensor cores on 16-bit elements at head_dim 64 and 128
//! (operands staged in shared memory by `cp.async`): [`tc`] (the forward) and the backward,
//! `mma_bwd` (`mma.sync` m16n8k16 and `ldmatrix`) in the sm_80 build and `hopper`
//! (warpgroup `wgmma`) in the sm_90a one. All apply the same masks through [`Seq`].
pub mod abi;
mod mma;
mod simt;
mod tc;
#[cfg(target_feature = "sm_90a")]
mod wgmma;
// The tensor-core backward: `mma.sync` in the sm_80 build, `wgmma` in the sm_90a one (same
// entry points; the host plans blocks and shared memory by the build).
#[cfg(target_feature = "sm_90a")]
mod hopper;
#[cfg(not(target_feature = "sm_90a"))]
mod mma_bwd;
#[cfg(target_feature = "sm_90a")]
use hopper as tc_bwd;
#[cfg(not(target_feature = "sm_90a"))]
use mma_bwd as tc_bwd;

use crate::{Bf16, Elem};
use abi::{Params, Tensor};
use core::arch::nvptx;

pub(crate) use crate::math::{LN_2, LOG2_E, all_lanes, exp2, log2, safe_max, shfl_xor, tanh};

/// Block index along y (the head).
#[inline(always)]
pub(crate) fn block_y() -> usize {
    // SAFETY: reads a special register.
    unsafe { nvptx::_block_idx_y() as usize }
}

/// Block index along z (the sequence).
#[inline(always)]
pub(crate) fn block_z() -> usize {
    // SAFETY: reads a special register.
    unsafe { nvptx::_block_idx_z() as usize }
}

/// How a kernel turns `q·k` into a score in log2 units (`s·log2 e`, so that `2^x` is `e^s`).
#[derive(Clone, Copy)]
pub(crate) struct Score {
    /// `scale·log2 e` without softcap, `scale / c` with it.
    pub(crate) mul: f32,
    /// `c·log2 e`, or 0 without softcap.
    cap: f32,
}

impl Score {
    #[inline(always)]
    pub(crate) fn new(p: &Params) -> Self {
        if p.softcap > 0.0 {
            Score {
                mul: p.scale / p.softcap,
                cap: p.softcap * LOG2_E,
            }
        } else {
            Score {
                mul: p.scale * LOG2_E,
                cap: 0.0,
            }
        }
    }

    /// Without softcap: the score is `q·k · mul`.
    #[inline(always)]
    pub(crate) fn plain(&self) -> bool {
        self.cap == 0.0
    }

    /// The score of a raw `q·k` in log2 units.
    #[inline(always)]
    pub(crate) fn of(&self, qk: f32) -> f32 {
        if self.cap != 0.0 {
            self.cap * tanh(qk * self.mul)
        } else {
            qk * self.mul
        }
    }

    /// The score in log2 units and `∂s/∂s_scaled`: `1 − tanh²` with softcap, 1 without.
    #[inline(always)]
    pub(crate) fn with_slope(&self, qk: f32) -> (f32, f32) {
        if self.cap != 0.0 {
            let t = tanh(qk * self.mul);
            (self.cap * t, 1.0 - t * t)
        } else {
            (qk * self.mul, 1.0)
        }
    }
}

/// One sequence of the batch: where its tokens start and which keys each query sees.
#[derive(Clone, Copy)]
pub(crate) struct Seq {
    /// Its first query token (in a packed batch; else 0).
    pub(crate) q_start: usize,
    /// Its first key token.
    pub(crate) k_start: usize,
    /// Query tokens.
    pub(crate) sq: i64,
    /// Key tokens.
    pub(crate) sk: i64,
    /// `sk − sq`: the masks align to the bottom-right corner.
    off: i64,
    wl: i64,
    wr: i64,
}

impl Seq {
    /// Sequence `b` of the call. In a packed batch each offset is clamped to the batch's
    /// tokens and each length to the longest sequence the grid covers (the host cannot read
    /// device offsets without a synchronisation), so that bad offsets never address outside
    /// the tensors.
    ///
    /// # Safety
    /// In a packed batch `cu_seqlens_q/k` hold `batch + 1` values and `b < batch`.
    #[inline(always)]
    pub(crate) unsafe fn of(p: &Params, b: usize) -> Self {
        let (q_start, k_start, sq, sk) = if p.cu_seqlens_q != 0 {
            let (cq, ck) = (p.cu_seqlens_q as *const i32, p.cu_seqlens_k as *const i32);
            // SAFETY: the caller vouches for the offsets.
            let (q0, q1, k0, k1) =
                unsafe { (*cq.add(b), *cq.add(b + 1), *ck.add(b), *ck.add(b + 1)) };
            let (tq, tk) = (p.total_q as i64, p.total_k as i64);
            let q0 = (q0 as i64).clamp(0, tq);
            let k0 = (k0 as i64).clamp(0, tk);
            let sq = ((q1 as i64).clamp(q0, tq) - q0).min(p.seqlen_q as i64);
            let sk = ((k1 as i64).clamp(k0, tk) - k0).min(p.seqlen_k as i64);
            (q0 as usize, k0 as usize, sq, sk)
        } else {
            (0, 0, p.seqlen_q as i64, p.seqlen_k as i64)
        };
        Seq {
            q_start,
            k_start,
            sq,
            sk,
            off: sk - sq,
            wl: p.window_left as i64,
            wr: p.window_right as i64,
        }
    }

    /// Whether query `i` sees key `j` (both of this sequence; `i < sq`).
    #[inline(always)]
    pub(crate) fn allows(&self, i: i64, j: i64) -> bool {
        j >= 0
            && j < self.sk
            && (self.wr < 0 || j <= i + self.off + self.wr)
            && (self.wl < 0 || j >= i + self.off - self.wl)
    }

    /// The keys `[lo, hi)` that some query of `[i0, i1]` sees (empty when `hi ≤ lo`).
    #[inline(always)]
    pub(crate) fn keys(&self, i0: i64, i1: i64) -> (i64, i64) {
        let lo = if self.wl >= 0 {
            (i0 + self.off - self.wl).max(0)
        } else {
            0
        };
        let hi = if self.wr >= 0 {
            (i1 + self.off + self.wr + 1).min(self.sk)
        } else {
            self.sk
        };
        (lo, hi)
    }

    /// The queries `[lo, hi)` that see some key of `[j0, j1]`.
    #[inline(always)]
    pub(crate) fn queries(&self, j0: i64, j1: i64) -> (i64, i64) {
        let lo = if self.wr >= 0 {
            (j0 - self.off - self.wr).max(0)
        } else {
            0
        };
        let hi = if self.wl >= 0 {
            (j1 - self.off + self.wl + 1).min(self.sq)
        } else {
            self.sq
        };
        (lo, hi)
    }

    /// Whether every query of `[i0, i1]` (all `< sq`) sees every key of `[j0, j1]` (all ≥ 0).
    #[inline(always)]
    pub(crate) fn all_allowed(&self, i0: i64, i1: i64, j0: i64, j1: i64) -> bool {
        i1 < self.sq
            && j1 < self.sk
            && (self.wr < 0 || j1 <= i0 + self.off + self.wr)
            && (self.wl < 0 || j0 >= i1 + self.off - self.wl)
    }
}

/// Element offset of head `h` of token `tok` (counted from the sequence's start, which the
/// caller adds) of sequence `b` in `t`.
#[inline(always)]
pub(crate) fn offset(t: &Tensor, b: usize, tok: usize, h: usize) -> usize {
    b * t.batch as usize + tok * t.token as usize + h * t.head as usize
}

/// Offset of row `(b, h, tok)` in `lse` and `delta` (`tok` with the sequence's start).
#[inline(always)]
pub(crate) fn lse_offset(p: &Params, b: usize, h: usize, tok: usize) -> usize {
    b * p.lse_batch as usize + h * p.lse_head as usize + tok
}

/// The log-sum-exp of a row in natural log from its maximum `m` and sum `l` in log2 units;
/// −∞ for a row without keys.
#[inline(always)]
pub(crate) fn lse_of(m: f32, l: f32) -> f32 {
    if l > 0.0 {
        (m + log2(l)) * LN_2
    } else {
        f32::NEG_INFINITY
    }
}

/// The log-sum-exp in log2 units as the backward subtracts it: +∞ for a row without keys, so
/// that its probabilities are 0.
#[inline(always)]
pub(crate) fn lse2_for_backward(lse: f32) -> f32 {
    if lse == f32::NEG_INFINITY {
        f32::INFINITY
    } else {
        lse * LOG2_E
    }
}

/// Entry points: `$body::<T>(p)` exported under the kernel's identity.
macro_rules! attn_kernels {
    ($($pass:ident $path:ident $elem:ident => $body:path;)*) => {
        $(
            const _: () = {
                /// # Safety
                /// The host's checks: every tensor of `p` the pass reads or writes spans its
                /// shape and strides, the grid and block are the host plan's.
                #[unsafe(export_name = crate::identity::kernel_name!(Attention, $pass, $path, $elem))]
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

attn_kernels! {
    Forward Simt F32 => simt::forward::<f32>;
    Forward Simt F16 => simt::forward::<f16>;
    Forward Simt Bf16 => simt::forward::<Bf16>;
    Prep Simt F32 => simt::prep::<f32>;
    Prep Simt F16 => simt::prep::<f16>;
    Prep Simt Bf16 => simt::prep::<Bf16>;
    Dq Simt F32 => simt::dq::<f32>;
    Dq Simt F16 => simt::dq::<f16>;
    Dq Simt Bf16 => simt::dq::<Bf16>;
    DkDv Simt F32 => simt::dkdv::<f32>;
    DkDv Simt F16 => simt::dkdv::<f16>;
    DkDv Simt Bf16 => simt::dkdv::<Bf16>;
    Forward Mma64 F16 => tc::forward::<f16, 64, { tc::FWD_NT64 }, { tc::FWD_THREADS64 }>;
    Forward Mma64 Bf16 => tc::forward::<Bf16, 64, { tc::FWD_NT64 }, { tc::FWD_THREADS64 }>;
    Forward Mma128 F16 => tc::forward::<f16, 128, { tc::FWD_NT128 }, { tc::FWD_THREADS128 }>;
    Forward Mma128 Bf16 => tc::forward::<Bf16, 128, { tc::FWD_NT128 }, { tc::FWD_THREADS128 }>;
    Dq Mma64 F16 => tc_bwd::dq::<f16, 64, { tc_bwd::DQ_THREADS64 }>;
    Dq Mma64 Bf16 => tc_bwd::dq::<Bf16, 64, { tc_bwd::DQ_THREADS64 }>;
    Dq Mma128 F16 => tc_bwd::dq::<f16, 128, { tc_bwd::DQ_THREADS128 }>;
    Dq Mma128 Bf16 => tc_bwd::dq::<Bf16, 128, { tc_bwd::DQ_THREADS128 }>;
    DkDv Mma64 F16 => tc_bwd::dkdv::<f16, 64, { tc_bwd::DKDV_THREADS64 }>;
    DkDv Mma64 Bf16 => tc_bwd::dkdv::<Bf16, 64, { tc_bwd::DKDV_THREADS64 }>;
    DkDv Mma128 F16 => tc_bwd::dkdv::<f16, 128, { tc_bwd::DKDV_THREADS128 }>;
    DkDv Mma128 Bf16 => tc_bwd::dkdv::<Bf16, 128, { tc_bwd::DKDV_THREADS128 }>;
}

/// A 16-bit element type of the tensor-core kernels.
pub(crate) trait Half: Elem {
    /// bf16 (else f16): picks the type of `mma.sync`.
    const IS_BF16: bool;
    /// `lo` and `hi` rounded to this type, packed (`lo` in the low half).
    fn pack2(lo: f32, hi: f32) -> u32;
}

impl Half for f16 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        crate::f16x2(lo, hi)
    }
}

impl Half for Bf16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        crate::bf16x2(lo, hi)
    }
}
