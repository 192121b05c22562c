//! Fast math and warp exchanges shared by the kernels of several ops: `ex2`/`lg2` (the
//! special-function unit's approximations), `tanh` from one `ex2`, butterfly shuffles.

pub(crate) const LOG2_E: f32 = core::f32::consts::LOG2_E;
pub(crate) const LN_2: f32 = core::f32::consts::LN_2;

unsafe extern "C" {
    #[link_name = "llvm.nvvm.ex2.approx.ftz.f"]
    fn ex2_approx_ftz(x: f32) -> f32;
    #[link_name = "llvm.nvvm.lg2.approx.ftz.f"]
    fn lg2_approx_ftz(x: f32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly(mask: u32, value: f32, lane_mask: u32, clamp: u32) -> f32;
    #[cfg(target_feature = "sm_90")]
    #[link_name = "llvm.nvvm.shfl.sync.idx.f32"]
    fn shfl_idx(mask: u32, value: f32, lane: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.vote.all.sync"]
    fn vote_all(mask: u32, pred: bool) -> bool;
}

/// Whether `pred` holds in every lane of the (converged) warp.
#[inline(always)]
pub(crate) fn all_lanes(pred: bool) -> bool {
    // SAFETY: every lane of the warp calls it.
    unsafe { vote_all(u32::MAX, pred) }
}

/// `2^x` (`ex2.approx.ftz.f32`: 2 ulp; 0 for −∞).
#[inline(always)]
pub(crate) fn exp2(x: f32) -> f32 {
    // SAFETY: a pure register operation.
    unsafe { ex2_approx_ftz(x) }
}

/// `log2(x)` (`lg2.approx.ftz.f32`).
#[inline(always)]
pub(crate) fn log2(x: f32) -> f32 {
    // SAFETY: a pure register operation.
    unsafe { lg2_approx_ftz(x) }
}

/// `v` exchanged with the lane whose index differs in the bits of `mask`.
#[inline(always)]
pub(crate) fn shfl_xor(v: f32, mask: u32) -> f32 {
    // SAFETY: every lane of the warp calls it (the kernels keep whole warps converged here).
    unsafe { shfl_bfly(u32::MAX, v, mask, 0x1f) }
}

/// `v` of lane `lane` (below 32); only the cluster merges of the sm_90 build use it.
#[cfg(target_feature = "sm_90")]
#[inline(always)]
pub(crate) fn shfl_from(v: f32, lane: u32) -> f32 {
    // SAFETY: every lane of the warp calls it (the kernels keep whole warps converged here).
    unsafe { shfl_idx(u32::MAX, v, lane, 0x1f) }
}

/// `tanh(x)` from one `ex2`: `(1 − e)/(1 + e)` with `e = 2^(−2|x|·log2 e)`, the sign restored
/// (absolute error about 1e-7; ±1 at the ends, NaN for NaN).
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let e = exp2(-2.0 * LOG2_E * x.abs());
    let t = (1.0 - e) / (1.0 + e);
    if x < 0.0 { -t } else { t }
}

/// The maximum to subtract before `exp2`: `m`, or 0 while no key has been seen (so that
/// `2^(x − m)` is 0, not NaN, for masked scores).
#[inline(always)]
pub(crate) fn safe_max(m: f32) -> f32 {
    if m == f32::NEG_INFINITY { 0.0 } else { m }
}
