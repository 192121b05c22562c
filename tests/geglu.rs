//! GEGLU: the GPU kernels against the CPU reference (`liger_rs::reference::geglu`, itself
//! checked against known values in its unit tests and against finite differences here), in both forms of
//! GELU, through SwiGLU's suite (`common::glu`): every dtype × layout (separate, fused gate-up)
//! × mode (out of place, in place) on many shapes with both multipliers, poisoned outputs and
//! untouched gaps; extreme gates (±large, every finite f16/bf16, overflow of `a·gm`), NaN and
//! ±∞; offsets past 32 bits. Bad input: `tests/bad_input.rs` (GEGLU's launchers validate as
//! SwiGLU's).
mod common;

use common::glu::{self, Op};
use half::{bf16, f16};
use liger_rs::Gelu;

const TANH: Op = Op::Geglu(Gelu::Tanh);
const ERF: Op = Op::Geglu(Gelu::Erf);

#[test]
fn reference_backward_matches_finite_differences() {
    glu::reference_backward_matches_finite_differences(TANH);
    glu::reference_backward_matches_finite_differences(ERF);
}

#[test]
fn gpu_tanh_matches_reference_f32() {
    glu::sweep::<f32>(TANH, "gpu_tanh_matches_reference_f32", 140_000);
}

#[test]
fn gpu_tanh_matches_reference_f16() {
    glu::sweep::<f16>(TANH, "gpu_tanh_matches_reference_f16", 150_000);
}

#[test]
fn gpu_tanh_matches_reference_bf16() {
    glu::sweep::<bf16>(TANH, "gpu_tanh_matches_reference_bf16", 160_000);
}

#[test]
fn gpu_erf_matches_reference_f32() {
    glu::sweep::<f32>(ERF, "gpu_erf_matches_reference_f32", 240_000);
}

#[test]
fn gpu_erf_matches_reference_f16() {
    glu::sweep::<f16>(ERF, "gpu_erf_matches_reference_f16", 250_000);
}

#[test]
fn gpu_erf_matches_reference_bf16() {
    glu::sweep::<bf16>(ERF, "gpu_erf_matches_reference_bf16", 260_000);
}

#[test]
fn gpu_tanh_extreme_gates_are_finite_with_the_right_limits() {
    let test = "gpu_tanh_extreme_gates_are_finite_with_the_right_limits";
    glu::extreme_gates(TANH, test);
}

#[test]
fn gpu_erf_extreme_gates_are_finite_with_the_right_limits() {
    let test = "gpu_erf_extreme_gates_are_finite_with_the_right_limits";
    glu::extreme_gates(ERF, test);
}

#[test]
fn gpu_tanh_nan_and_inf_propagate_as_in_the_reference() {
    let test = "gpu_tanh_nan_and_inf_propagate_as_in_the_reference";
    glu::nan_and_inf(TANH, test);
}

#[test]
fn gpu_erf_nan_and_inf_propagate_as_in_the_reference() {
    let test = "gpu_erf_nan_and_inf_propagate_as_in_the_reference";
    glu::nan_and_inf(ERF, test);
}

#[test]
fn gpu_tanh_offsets_beyond_2_pow_32_elements() {
    let test = "gpu_tanh_offsets_beyond_2_pow_32_elements";
    glu::offsets_beyond_2_pow_32_elements(TANH, test);
}

#[test]
fn gpu_erf_offsets_beyond_2_pow_32_elements() {
    let test = "gpu_erf_offsets_beyond_2_pow_32_elements";
    glu::offsets_beyond_2_pow_32_elements(ERF, test);
}
