//! RMSNorm forward, backward and the dW reduction (semantics: the cast points in
//! `src/reference/rms_norm.rs`; host: `src/rms_norm/`); every entry takes one [`abi::Params`]
//! block. The bodies: `scalar.rs` (any alignment), `vector.rs` (rows of 16-byte vectors in
//! registers), `dw.rs` (dW across blocks); the entry points are generated here.
//!
//! Rows are walked grid-stride (`row = blockIdx.x; row += gridDim.x`), one block per row at a
//! time, columns strided by the block. The forward writes `y` and the row's rstd; the backward
//! writes `dx` (possibly over `dy`: every element is read before the same thread writes it) and,
//! when dW is wanted, accumulates its dW contribution into one f32 partial row per block, which
//! `rms_norm_dw_reduce_*` sums over blocks in a fixed order; the `bwd_dx` kernels (a frozen
//! weight, or none) write `dx` alone. In the sm_90 build the reduction first waits in
//! `griddepcontrol.wait` (see `wait_for_prerequisite_grids`): the host launches it as a
//! programmatic dependent launch, so its blocks may start before the backward's completion is
//! processed. The f32 `_v2` backward also lets it launch at once (`allow_dependent_grids`, see
//! `backward_vec`), and the `_vs{K}` backward, launched in thread-block clusters, writes one
//! partial row per cluster (`write_cluster_partial`).
//!
//! The fused residual add (`add_fwd`, `add_bwd`, `add_bwd_dx`: the same bodies with `ADD`,
//! one kernel for each RMSNorm kernel) normalises `s = D(x + r)`, writing `s` as well (over `x`
//! or `r` allowed), and its backward writes `D(dX + ds)`, RMSNorm's dX of `s` plus the sum's
//! incoming gradient before one rounding (over `dy` or `ds` allowed). Every element of `s`
//! (of `dx`) is written by the thread that read its `x` and `r` (its `dy` and `ds`) before,
//! and by no other, which is what makes those in-place forms safe.
//!
//! `dx = r·m − r³/n·(Σ m·x)·x` is evaluated as `r·(m − mean(m·h)·h)` with `h = x·r`: every
//! factor stays near 1 whatever the row's scale (`r³` underflows f32 once the row's RMS
//! passes 2⁴², and `Σ m·x` overflows near the bf16 maximum).
//!
//! The `_v{K}` kernels are the fast path for rows of 16-byte aligned vectors (`cols` a multiple
//! of the lanes per vector, aligned pointers and strides): thread `t` owns vectors
//! `t, t + nt, …, t + (K − 1)·nt` of every row and keeps them in registers, so `x` (and `dy`) is
//! read once with 16-byte loads. The `_v{K}` forward walks a resident grid and loads its next row
//! before reducing the current one; the `_vw{K}` forward (K = 2, 4) runs one row per block over
//! a grid of every row (no next-row registers, so more blocks fit per SM; the host picks it for
//! many rows). The vector backward is persistent: each block keeps its dW partial row in registers (`_v{K}`) or shared memory
//! (`_vs{K}`, see `backward_vec`) across all its rows and writes it once at the end.
//!
//! The vector kernels form the weight product `D(x·r)·(offset + w)` as one packed 16-bit
//! product (`fma.rn.bf16x2` / `fma.rn.f16x2`: half the instructions of widening each lane and
//! fewer registers) wherever that gives the mode's bits (see `packed_weight`); 16-bit llama rows
//! with an offset other than ±0 run the `_llama_offset` twins, which multiply lane by lane.
pub mod abi;
mod dw;
mod scalar;
mod vector;

use crate::identity::{
    ElemType, Mode, NormInput, NormPass, RmsNormLayout, has_shared_dw, kernel_name,
};
use crate::{
    Elem, SUM_SLOTS, V16, Vector, allow_dependent_grids, block_dim, block_dim_y, block_idx,
    block_sum, block_sum2, elem_type, fma, grid_dim, lanes, mode, sqrt, sync_threads, thread_idx,
    thread_idx_y, unroll, wait_for_prerequisite_grids,
};
#[cfg(target_feature = "sm_90")]
use crate::{cluster_blocks, cluster_rank, cluster_sync, load_from_cluster_block};
use abi::Params;
use dw::dw_reduce;
use scalar::{backward, forward};
use vector::{backward_vec, forward_vec};

/// Scale of the second sum of squares, for rows whose f32 sum overflows: with `Σx² ≥ 2¹²⁸`
/// the scaled sum `Σ(x·2⁻⁸⁰)²` is ≥ 2⁻³² (normal f32, full precision) and, for any finite `x`
/// and up to 2³² columns, < 2¹²⁸; squares or partial sums that underflow when scaled (below
/// 2¹¹) are below the last bit of a sum that large.
const RESCALE: f32 = 1.0 / (1u128 << 80) as f32;

/// Whether the vector kernels of `elem` in `mode` form the weight product
/// `D(x·r)·(offset + w)` (none mode: `D(D(x·r)·D(D(offset) + w))`) as one packed product
/// `D(D(x·r)·w')` with `w' = D(offset + w)`, holding `w'` in registers, which gives the same
/// bits: in none mode; in llama, whose 16-bit kernels require `offset = ±0` (`offset + w`
/// exact in the type; other offsets run [`Mode::LlamaOffset`]); in gemma, which does not round
/// `x·r`, only in f32.
const fn packs(elem: ElemType, mode: Mode) -> bool {
    match mode {
        Mode::None | Mode::Llama => true,
        Mode::Gemma => matches!(elem, ElemType::F32),
        Mode::LlamaOffset => false,
    }
}

/// Whether the weight product runs packed ([`Elem::mul_rn`], [`Elem::add_rn`]; see
/// [`packs`]).
#[inline(always)]
fn packed_weight<T: Elem, const MODE: u32>() -> bool {
    const { packs(T::TYPE, mode::of(MODE)) }
}

/// Llama's cast points (`LLAMA`, or `LLAMA_OFFSET` in the vector kernels).
#[inline(always)]
fn llama<const MODE: u32>() -> bool {
    MODE == mode::LLAMA || MODE == mode::LLAMA_OFFSET
}

/// `D(offset + w)` lane-wise for each of `K` weight vectors (none mode: `D(D(offset) + w)`).
#[inline(always)]
fn offset_weight<T: Elem, const K: usize>(wv: &mut [V16; K], offset: f32) {
    let off = T::pack(&[offset; 8]);
    unroll::<K>(|k| wv[k] = T::add_rn(wv[k], off));
}

/// Per-row inverse RMS from this thread's part `part` of the row's sum of squares, with the
/// mode's cast points (block-wide: every thread of the block calls it and gets the same value).
///
/// In llama and gemma the squares are exact f32 products, as in the f64 reference, so a row
/// whose f32 sum overflows (largest |x| beyond ~2⁶⁴/√cols: f32 rows, or bf16 rows near the
/// bf16 maximum) must not give r = 0. Alongside the plain sum the block sums the parts scaled
/// by `s²` (`s` = [`RESCALE`]): `part·s·s`, or when `part` itself overflowed, `scaled(s)`, this
/// thread's `Σ(x·s)²` recomputed from its values (a thread-local branch, no barrier). When the
/// plain sum is ∞, `r = s / √(S/n)` from the scaled sum `S` (`eps·s²` is far below its last
/// bit). A row holding ±∞ keeps an infinite `S` (r = 0) and NaN stays NaN, as in the
/// reference. In none mode the squares are rounded to `T` (∞ on overflow, as in the
/// reference) and the plain sum is used.
#[inline(always)]
fn inverse_rms<T: Elem, const MODE: u32>(
    part: f32,
    scaled: impl FnOnce(f32) -> f32,
    cols: usize,
    eps: f32,
    parity: usize,
) -> f32 {
    if MODE == mode::NONE {
        let mean = T::round(block_sum(part, parity) / cols as f32);
        return T::round(1.0 / T::round(sqrt(T::round(mean + T::round(eps)))));
    }
    let part_scaled = if part == f32::INFINITY {
        scaled(RESCALE)
    } else {
        part * RESCALE * RESCALE
    };
    let (sum_sq, sum_scaled) = block_sum2(part, part_scaled, parity);
    if sum_sq == f32::INFINITY {
        return RESCALE * (1.0 / sqrt(sum_scaled / cols as f32));
    }
    1.0 / sqrt(sum_sq / cols as f32 + eps)
}

/// A forward's arguments, as its entry point receives them (sizes as `usize`). The fused
/// add's kernels (`ADD`) normalise `s = D(x + res)` and write it to `s`; the others leave `res`
/// and `s` null.
#[derive(Clone, Copy)]
struct Fwd<T> {
    x: *const T,
    x_stride: usize,
    res: *const T,
    res_stride: usize,
    s: *mut T,
    s_stride: usize,
    w: *const T,
    y: *mut T,
    y_stride: usize,
    rstd: *mut f32,
    rows: usize,
    cols: usize,
    eps: f32,
    offset: f32,
}

/// A backward's arguments, as its entry point receives them (sizes as `usize`). The fused
/// add's kernels (`ADD`) add the sum's incoming gradient `ds` to dX before rounding it; the
/// others leave `ds` null.
#[derive(Clone, Copy)]
struct Bwd<T> {
    dy: *const T,
    dy_stride: usize,
    ds: *const T,
    ds_stride: usize,
    x: *const T,
    x_stride: usize,
    w: *const T,
    rstd: *const f32,
    dx: *mut T,
    dx_stride: usize,
    dw_partial: *mut f32,
    rows: usize,
    cols: usize,
    offset: f32,
}

/// `m = dy · (w + offset)` with the mode's cast points (w = 1, offset = 0 without a weight).
#[inline(always)]
fn scaled_grad<T: Elem, const MODE: u32>(dy: f32, w: Option<f32>, offset: f32) -> f32 {
    match (w, MODE) {
        (None, _) => dy,
        (Some(wc), mode::LLAMA | mode::LLAMA_OFFSET) => T::round(dy * (wc + offset)),
        (Some(wc), mode::GEMMA) => dy * (wc + offset),
        (Some(wc), _) => T::round(dy * T::round(wc + T::round(offset))),
    }
}

/// Whether a forward `layout` runs one row per block (`ONE` of [`forward_vec`]).
const fn one_row(layout: RmsNormLayout) -> bool {
    matches!(layout, RmsNormLayout::Whole)
}

/// Whether a backward `layout` keeps dW in shared memory (`SMEM_DW` of [`backward_vec`]).
const fn shared_dw(layout: RmsNormLayout) -> bool {
    matches!(layout, RmsNormLayout::SharedDw)
}

/// Whether a backward `pass` accumulates dW partial rows (`DW` of [`backward`] and
/// [`backward_vec`]): [`NormPass::Backward`] does, the dX-only pass does not.
const fn computes_dw(pass: NormPass) -> bool {
    matches!(pass, NormPass::Backward)
}

/// Whether `input` is the fused residual add's sum (`ADD` of the forward and backward bodies).
const fn adds(input: NormInput) -> bool {
    matches!(input, NormInput::Add)
}

/// One entry point named `$name`: one [`Params`] block by value (`ld.param` loads, no local
/// copy) as `$p`, running `$call`; `$doc` is its summary, `$safety` what the caller guarantees.
macro_rules! entry {
    ($name:expr, $doc:literal, $safety:literal, |$p:ident| $call:expr) => {
        const _: () = {
            #[doc = $doc]
            ///
            /// # Safety
            #[doc = $safety]
            #[unsafe(export_name = $name)]
            // A `#[repr(C)]` struct of integers and floats: the PTX parameter is its bytes.
            #[allow(improper_gpu_kernel_arg)]
            pub unsafe extern "gpu-kernel" fn kernel($p: Params) {
                unsafe { $call }
            }
        };
    };
}

/// One forward entry point (see [`entry`]) of input `$input`: `$body` is the generic body
/// (`forward::<T, MODE, ADD>` or `forward_vec::<T, MODE, K, …>`) of element type `$ty`. The
/// fused add's forward reads `r` and writes `s`, both at `x`'s stride.
macro_rules! fwd_entry {
    ($input:ident, $name:expr, $ty:ty, $body:expr, $doc:literal, $safety:literal) => {
        entry!($name, $doc, $safety, |p| {
            let add = adds(NormInput::$input);
            $body(Fwd::<$ty> {
                x: p.x as *const $ty,
                x_stride: p.x_stride as usize,
                res: if add {
                    p.r as *const $ty
                } else {
                    core::ptr::null()
                },
                res_stride: if add { p.x_stride as usize } else { 0 },
                s: if add {
                    p.s as *mut $ty
                } else {
                    core::ptr::null_mut()
                },
                s_stride: if add { p.x_stride as usize } else { 0 },
                w: p.w as *const $ty,
                y: p.y as *mut $ty,
                y_stride: p.y_stride as usize,
                rstd: p.rstd as *mut f32,
                rows: p.rows as usize,
                cols: p.cols as usize,
                eps: p.eps,
                offset: p.offset,
            })
        });
    };
}

/// One backward entry point (see [`fwd_entry`]); the fused add's backward reads `ds` at `dy`'s
/// stride.
macro_rules! bwd_entry {
    ($input:ident, $name:expr, $ty:ty, $body:expr, $doc:literal, $safety:literal) => {
        entry!($name, $doc, $safety, |p| {
            let add = adds(NormInput::$input);
            $body(Bwd::<$ty> {
                dy: p.dy as *const $ty,
                dy_stride: p.y_stride as usize,
                ds: if add {
                    p.ds as *const $ty
                } else {
                    core::ptr::null()
                },
                ds_stride: if add { p.y_stride as usize } else { 0 },
                x: p.x as *const $ty,
                x_stride: p.x_stride as usize,
                w: p.w as *const $ty,
                rstd: p.rstd as *const f32,
                dx: p.dx as *mut $ty,
                dx_stride: p.y_stride as usize,
                dw_partial: p.dw_partial as *mut f32,
                rows: p.rows as usize,
                cols: p.cols as usize,
                offset: p.offset,
            })
        });
    };
}

/// The scalar kernels of one element type and casting mode (RMSNorm's and the fused residual
/// add's), and the element type's dW reduction.
macro_rules! rms_norm_kernels {
    (@fwd $elem:ident, $mode:ident, $input:ident, $doc:literal, $safety:literal) => {
        fwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input Forward, Scalar, $elem, $mode),
            elem_type!($elem),
            forward::<elem_type!($elem), { Mode::$mode as u32 }, { adds(NormInput::$input) }>,
            $doc,
            $safety
        );
    };
    (@bwd $elem:ident, $mode:ident, $input:ident $pass:ident, $doc:literal, $safety:literal) => {
        bwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input $pass, Scalar, $elem, $mode),
            elem_type!($elem),
            backward::<
                elem_type!($elem),
                { Mode::$mode as u32 },
                { computes_dw(NormPass::$pass) },
                { adds(NormInput::$input) },
            >,
            $doc,
            $safety
        );
    };
    ($elem:ident: $($mode:ident),*) => {
        $(
            rms_norm_kernels!(@fwd $elem, $mode, Plain,
                "RMSNorm forward for one dtype and casting mode (see the module docs).",
                "Pointers cover `rows` rows of their strides and `cols` columns; `w` may be null.");
            rms_norm_kernels!(@fwd $elem, $mode, Add,
                "Fused residual add and RMSNorm forward: `s = D(x + r)`, then RMSNorm of `s`.",
                "As the RMSNorm forward; `s` may equal `x` or `r` (same strides).");
            rms_norm_kernels!(@bwd $elem, $mode, Plain Backward,
                "RMSNorm backward for one dtype and casting mode (see the module docs).",
                "As the forward; `dx` may equal `dy`; `dw_partial` holds `gridDim.x × cols` f32 when `w` is not null.");
            rms_norm_kernels!(@bwd $elem, $mode, Plain BackwardDx,
                "RMSNorm backward of dX alone for one dtype and casting mode (see the module docs).",
                "As the forward; `dx` may equal `dy`; `dw_partial` is not used.");
            rms_norm_kernels!(@bwd $elem, $mode, Add Backward,
                "Fused residual add and RMSNorm backward: `D(dX + ds)` and dW partial rows.",
                "As the RMSNorm backward; `dx` may equal `dy` or `ds` (same strides).");
            rms_norm_kernels!(@bwd $elem, $mode, Add BackwardDx,
                "Fused residual add and RMSNorm backward of `D(dX + ds)` alone (no dW).",
                "As the RMSNorm backward; `dx` may equal `dy` or `ds`; `dw_partial` is not used.");
        )*
        entry!(
            kernel_name!(RmsNorm, DwReduce, $elem),
            "Sums the per-block dW partial rows into `dw` (see the module docs).",
            "`dw_partial` holds `parts × cols` f32; `dw` holds `cols` elements.",
            |p| {
                wait_for_prerequisite_grids();
                dw_reduce(
                    p.dw_partial as *const f32,
                    p.parts as usize,
                    p.cols as usize,
                    p.dw as *mut elem_type!($elem),
                )
            }
        );
    };
}

rms_norm_kernels!(F32: Llama, Gemma, None);
rms_norm_kernels!(F16: Llama, Gemma, None);
rms_norm_kernels!(Bf16: Llama, Gemma, None);

/// The vector kernels of one element type and mode: forward with 1, 2, 4 vectors per thread
/// (grid-stride `_v{K}`, one row per block `_vw{K}` for K = 2, 4), backward with 1 and 2 (its
/// dW accumulators need the registers), `_vs1` and where `shared` ([`has_shared_dw`]) `_vs2`,
/// and the dX-only backward `bwd_dx` with 1 and 2 (dW in neither registers nor shared memory);
/// then the same set for the fused residual add.
macro_rules! rms_norm_vec_family {
    ($elem:ident, $mode:ident, shared = $shared:tt) => {
        const _: () = assert!(has_shared_dw(ElemType::$elem, 2) == $shared);
        rms_norm_vec_family!(@inputs $elem, $mode, $shared, Plain);
        rms_norm_vec_family!(@inputs $elem, $mode, $shared, Add);
    };
    // One set of kernels: RMSNorm's, or the fused add's (the same shapes).
    (@inputs $elem:ident, $mode:ident, $shared:tt, $input:ident) => {
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Resident 1);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Resident 2);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Resident 4);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Whole 2);
        rms_norm_vec_family!(@fwd $elem, $mode, $input, Whole 4);
        rms_norm_vec_family!(@bwd $elem, $mode, $input Backward, Resident 1);
        rms_norm_vec_family!(@bwd $elem, $mode, $input Backward, Resident 2);
        rms_norm_vec_family!(@bwd $elem, $mode, $input Backward, SharedDw 1);
        rms_norm_vec_family!(@if $shared, @bwd $elem, $mode, $input Backward, SharedDw 2);
        rms_norm_vec_family!(@bwd $elem, $mode, $input BackwardDx, Resident 1);
        rms_norm_vec_family!(@bwd $elem, $mode, $input BackwardDx, Resident 2);
    };
    (@if true, $($rest:tt)*) => {
        rms_norm_vec_family!($($rest)*);
    };
    (@if false, $($rest:tt)*) => {};
    (@fwd $elem:ident, $mode:ident, $input:ident, $layout:ident $k:literal) => {
        fwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input Forward, $layout $k, $elem, $mode),
            elem_type!($elem),
            forward_vec::<
                elem_type!($elem),
                { Mode::$mode as u32 },
                $k,
                { one_row(RmsNormLayout::$layout) },
                { adds(NormInput::$input) },
            >,
            "Vectorised RMSNorm forward (`K` vectors of 16 bytes per thread, see the module docs; `_vw`: one row per block, the grid covers every row; `add_fwd`: the fused residual add).",
            "As the scalar forward, and every row of `x` and `y` and `w` start 16-byte aligned with `cols` a multiple of the lanes per vector."
        );
    };
    (@bwd $elem:ident, $mode:ident, $input:ident $pass:ident, $layout:ident $k:literal) => {
        bwd_entry!(
            $input,
            kernel_name!(RmsNorm, $input $pass, $layout $k, $elem, $mode),
            elem_type!($elem),
            backward_vec::<
                elem_type!($elem),
                { Mode::$mode as u32 },
                $k,
                { shared_dw(RmsNormLayout::$layout) },
                { computes_dw(NormPass::$pass) },
                { adds(NormInput::$input) },
            >,
            "Vectorised persistent RMSNorm backward (see `backward_vec`; `_vs`: dW in shared memory; `bwd_dx`: no dW, `dw_partial` not used; `add_`: the fused residual add's, `D(dX + ds)`).",
            "As the scalar backward, with the forward's alignment rules for `dy`, `x`, `w`, `dx`."
        );
    };
}

rms_norm_vec_family!(F32, Llama, shared = false);
rms_norm_vec_family!(F32, Gemma, shared = false);
rms_norm_vec_family!(F32, None, shared = false);
rms_norm_vec_family!(F16, Llama, shared = true);
rms_norm_vec_family!(F16, LlamaOffset, shared = true);
rms_norm_vec_family!(F16, Gemma, shared = true);
rms_norm_vec_family!(F16, None, shared = true);
rms_norm_vec_family!(Bf16, Llama, shared = true);
rms_norm_vec_family!(Bf16, LlamaOffset, shared = true);
rms_norm_vec_family!(Bf16, Gemma, shared = true);
rms_norm_vec_family!(Bf16, None, shared = true);
