//! SwiGLU: CPU reference against hand-computed values, finite differences and extreme inputs
//! (always run); GPU kernels against the reference for every dtype × layout (separate, fused
//! gate-up) × mode (out of place, in place) on many shapes, GPU numerics at extreme inputs and
//! offsets past 32 bits (the suite `common::glu` shares with GEGLU); empty calls (argument checks
//! and overlaps: `tests/bad_input.rs`).
mod common;

use common::glu::{self, Op};
use common::{download, gpu, poisoned, upload};
use half::{bf16, f16};
use liger_rs::reference::Element;
use liger_rs::reference::swiglu::{
    SwigluGrads as Grads, join_gate_up, sigmoid, silu, silu_grad, split_gate_up,
    swiglu_backward as ref_backward, swiglu_forward as ref_forward,
};
use liger_rs::{Error, SwigluArgs, swiglu_backward_fused_inplace, swiglu_forward};

// ---------------------------------------------------------------- CPU reference

/// The reference forward on `a`, `b` as one row: it is element-wise, so the values checked
/// below need no other shape.
fn fwd<T: Element>(a: &[T], b: &[T], gm: f32) -> liger_rs::Result<Vec<T>> {
    ref_forward(&SwigluArgs::new(1, a.len()).with_gate_multiplier(gm), a, b)
}

/// The reference backward on one row, as [`fwd`].
fn bwd<T: Element>(dc: &[T], a: &[T], b: &[T], gm: f32, dm: f32) -> liger_rs::Result<Grads<T>> {
    let args = SwigluArgs::new(1, a.len())
        .with_gate_multiplier(gm)
        .with_down_multiplier(dm);
    ref_backward(&args, dc, a, b)
}

#[test]
fn reference_matches_hand_computed_values() {
    let s1 = 1.0 / (1.0 + (-1.0f64).exp());
    assert_eq!(silu(0.0), 0.0);
    assert_eq!(sigmoid(0.0), 0.5);
    assert!((sigmoid(1.0) - s1).abs() < 1e-16);
    assert!((silu(1.0) - s1).abs() < 1e-16);
    assert!((silu(-1.0) + (1.0 - s1)).abs() < 1e-16);
    for z in [0.3, 2.0, 17.0, 40.0] {
        assert!(
            (sigmoid(z) + sigmoid(-z) - 1.0).abs() <= 2.0 * f64::EPSILON,
            "σ({z}) + σ(−{z})"
        );
    }
    // c = silu(a·gm)·b, gm = 1 and gm = 2.
    let c = fwd(&[0.0f64, 1.0, -1.0], &[5.0, 3.0, 4.0], 1.0).unwrap();
    assert_eq!(c, vec![0.0, 3.0 * silu(1.0), 4.0 * silu(-1.0)]);
    let c = fwd(&[1.0f64], &[3.0], 2.0).unwrap();
    let s2 = 1.0 / (1.0 + (-2.0f64).exp());
    assert!((c[0] - 3.0 * 2.0 * s2).abs() < 1e-15);
    // Backward at z = 0: σ = ½, silu = 0, silu' = ½. gm = 2, dm = 3, dc = 1, b = 4:
    // g = 3, da = g·silu'·gm·b = 3·½·2·4 = 12, db = g·silu = 0.
    let g = bwd(&[1.0f64], &[0.0], &[4.0], 2.0, 3.0).unwrap();
    assert_eq!((g.da, g.db), (vec![12.0], vec![0.0]));
    // At a = 1, gm = dm = 1: db = dc·σ(1), da = dc·b·σ(1)·(1 + (1 − σ(1))).
    let g = bwd(&[2.0f64], &[1.0], &[5.0], 1.0, 1.0).unwrap();
    assert!((g.db[0] - 2.0 * s1).abs() < 1e-15);
    assert!((g.da[0] - 2.0 * 5.0 * s1 * (2.0 - s1)).abs() < 1e-15);
    assert!((silu_grad(1.0) - s1 * (2.0 - s1)).abs() < 1e-16);
    // dm scales both gradients linearly; gm scales the gate.
    let (dc, a, b) = ([0.7f64, -1.3], [0.4f64, -2.2], [1.5f64, 0.8]);
    let g1 = bwd(&dc, &a, &b, 0.5, 1.0).unwrap();
    let g2 = bwd(&dc, &a, &b, 0.5, 2.0).unwrap();
    for i in 0..2 {
        assert_eq!(g2.da[i], 2.0 * g1.da[i]);
        assert_eq!(g2.db[i], 2.0 * g1.db[i]);
        let z = a[i] * 0.5;
        assert!((g1.db[i] - dc[i] * silu(z)).abs() < 1e-15);
        assert!((g1.da[i] - dc[i] * silu_grad(z) * 0.5 * b[i]).abs() < 1e-15);
    }
}

#[test]
fn reference_rounds_silu_to_the_dtype_before_the_product() {
    // Liger ≥ 0.6: c = D(D(silu(z))·b). Check the formula on a grid and that the inner
    // rounding matters somewhere (a single rounding D(silu(z)·b) differs).
    let mut differs = 0;
    for i in 0..400 {
        let a = bf16::from_f64(-6.0 + 0.03 * i as f64);
        let b = bf16::from_f64(1.0 + 0.0137 * i as f64);
        let c = fwd(&[a], &[b], 1.0).unwrap()[0];
        let z = a.to_f64();
        let want = bf16::from_f64(bf16::cast(silu(z)) * b.to_f64());
        assert_eq!(c, want, "a = {a}, b = {b}");
        differs += usize::from(bf16::from_f64(silu(z) * b.to_f64()) != c);
    }
    assert!(differs > 0, "the inner rounding never mattered on the grid");
    // z = F(a·gm): the gate product is rounded to f32 for f32/f16/bf16 (the kernels' f32 math).
    let (a, gm) = (1.0f32 + f32::EPSILON, 1.0f32 + 3.0 * f32::EPSILON);
    let z = (a as f64 * gm as f64) as f32 as f64;
    assert_ne!(z, a as f64 * gm as f64);
    let c = fwd(&[a], &[1.0f32], gm).unwrap()[0];
    assert_eq!(c, silu(z) as f32);
}

#[test]
fn reference_rejects_bad_shapes() {
    let v = [1.0f64; 6];
    let bad = |r: liger_rs::Result<Vec<f64>>, arg: &str| match r {
        Err(Error::InvalidArgument { arg: a, .. }) if a == arg => {}
        other => panic!("expected InvalidArgument for `{arg}`, got {other:?}"),
    };
    let args = SwigluArgs::new(2, 3);
    bad(ref_forward(&args, &v, &v[..5]), "b");
    bad(ref_forward(&SwigluArgs::new(1, 5), &v, &v), "a");
    bad(ref_forward(&SwigluArgs::new(6, 0), &v, &v), "args.cols");
    bad(
        ref_forward(&SwigluArgs::fused(3, 2), &v, &v),
        "args.a_stride",
    );
    bad(
        ref_forward(&args.with_strides(3, 4, 3), &v, &v),
        "args.b_stride",
    );
    bad(
        ref_forward(&args.with_strides(3, 3, 4), &v, &v),
        "args.c_stride",
    );
    bad(
        ref_forward(&SwigluArgs::new(usize::MAX, 2), &v, &v),
        "args.rows",
    );
    let nan_gm = args.with_gate_multiplier(f32::NAN);
    bad(ref_forward(&nan_gm, &v, &v), "args.gate_multiplier");
    let grads = |r: liger_rs::Result<Grads<f64>>| r.map(|g| g.da);
    bad(grads(ref_backward(&args, &v[..5], &v, &v)), "dc");
    bad(grads(ref_backward(&args, &v, &v, &v[..4])), "b");
    let inf_dm = args.with_down_multiplier(f32::INFINITY);
    bad(
        grads(ref_backward(&inf_dm, &v, &v, &v)),
        "args.down_multiplier",
    );
    bad(split_gate_up(&v, 0).map(|p| p.0), "cols");
    bad(split_gate_up(&v, 2).map(|p| p.0), "gate_up");
    bad(join_gate_up(&v, &v[..3], 3), "b");
    bad(join_gate_up(&v[..5], &v[..5], 3), "a");
    // Round trip.
    let ab: Vec<f64> = (0..12).map(f64::from).collect();
    let (a, b) = split_gate_up(&ab, 3).unwrap();
    assert_eq!(a, vec![0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
    assert_eq!(join_gate_up(&a, &b, 3).unwrap(), ab);
}

#[test]
fn reference_backward_matches_finite_differences() {
    glu::reference_backward_matches_finite_differences(Op::Swiglu);
}

/// bf16's largest finite value.
const BF16_MAX: f64 = 3.3895313892515355e38;

#[test]
fn reference_silu_is_finite_with_the_right_limits_at_extremes() {
    for z in [
        1e4,
        800.0,
        65504.0,
        BF16_MAX,
        f32::MAX as f64,
        1e300,
        f64::MAX,
    ] {
        assert_eq!(silu(z), z, "silu({z})");
        assert_eq!(silu(-z), 0.0, "silu(−{z})");
        assert_eq!(silu_grad(z), 1.0, "silu'({z})");
        assert_eq!(silu_grad(-z), 0.0, "silu'(−{z})");
        assert_eq!((sigmoid(z), sigmoid(-z)), (1.0, 0.0));
    }
    assert_eq!(silu(f64::INFINITY), f64::INFINITY);
    assert_eq!(silu(f64::NEG_INFINITY), 0.0);
    assert_eq!(silu_grad(f64::INFINITY), 1.0);
    assert_eq!(silu_grad(f64::NEG_INFINITY), 0.0);
    assert!(silu(f64::NAN).is_nan() && silu_grad(f64::NAN).is_nan() && sigmoid(f64::NAN).is_nan());
    // Through the typed ops, b = dc = 1: c = a or 0, da = 1 or 0, db = a or 0, all finite.
    fn limits<T: Element>(values: &[f64]) {
        let mut a: Vec<T> = Vec::new();
        for &v in values {
            a.push(T::from_f64(v));
            a.push(T::from_f64(-v));
        }
        let one = vec![T::from_f64(1.0); a.len()];
        let c = fwd(&a, &one, 1.0).unwrap();
        let g = bwd(&one, &a, &one, 1.0, 1.0).unwrap();
        for i in 0..a.len() {
            let x = a[i].to_f64();
            let (c, da, db) = (c[i].to_f64(), g.da[i].to_f64(), g.db[i].to_f64());
            assert!(x.is_finite() && c.is_finite() && da.is_finite() && db.is_finite());
            let want = if x > 0.0 {
                (x, 1.0, x)
            } else {
                (0.0, 0.0, 0.0)
            };
            assert_eq!((c, da, db), want, "{} a = {x}", T::NAME);
        }
    }
    limits::<f32>(&[1e4, 1e30, f32::MAX as f64]);
    limits::<f16>(&[1e4, 65504.0]);
    limits::<bf16>(&[1e4, 1e30, BF16_MAX]);
    // a·gm overflowing f32 takes the limits instead of ∞·0 = NaN.
    let a = [bf16::MAX, bf16::MIN];
    let c = fwd(&a, &[bf16::ONE; 2], 2.0).unwrap();
    assert_eq!((c[0].to_f64(), c[1].to_f64()), (f64::INFINITY, 0.0));
    let g = bwd(&[bf16::ONE; 2], &a, &[bf16::ONE; 2], 2.0, 1.0).unwrap();
    assert_eq!((g.da[0].to_f64(), g.da[1].to_f64()), (2.0, 0.0));
}

// ---------------------------------------------------------------- GPU vs reference

#[test]
fn gpu_matches_reference_f32() {
    glu::sweep::<f32>(Op::Swiglu, "gpu_matches_reference_f32", 40_000);
}

#[test]
fn gpu_matches_reference_f16() {
    glu::sweep::<f16>(Op::Swiglu, "gpu_matches_reference_f16", 50_000);
}

#[test]
fn gpu_matches_reference_bf16() {
    glu::sweep::<bf16>(Op::Swiglu, "gpu_matches_reference_bf16", 60_000);
}

#[test]
fn gpu_extreme_gates_are_finite_with_the_right_limits() {
    let test = "gpu_extreme_gates_are_finite_with_the_right_limits";
    glu::extreme_gates(Op::Swiglu, test);
}

#[test]
fn gpu_nan_and_inf_propagate_as_in_the_reference() {
    glu::nan_and_inf(Op::Swiglu, "gpu_nan_and_inf_propagate_as_in_the_reference");
}

#[test]
fn gpu_offsets_beyond_2_pow_32_elements() {
    let test = "gpu_offsets_beyond_2_pow_32_elements";
    glu::offsets_beyond_2_pow_32_elements(Op::Swiglu, test);
}

// ---------------------------------------------------------------- empty calls
// (every argument check is a row of tests/bad_input.rs's table walk)

#[test]
fn calls_without_rows_launch_nothing() {
    let Some(stream) = gpu("calls_without_rows_launch_nothing") else {
        return;
    };
    let cols = 8;
    let tiny = upload(&stream, &[1.0f32]);
    let mut c = poisoned::<f32>(&stream, 4 * cols);
    let mut d_fused = poisoned::<f32>(&stream, 8 * cols);
    // rows = 0: nothing to check against, nothing launched, outputs untouched.
    let none = SwigluArgs::new(0, cols);
    swiglu_forward(&stream, &none, &tiny, &tiny, &mut c).unwrap();
    swiglu_backward_fused_inplace(&stream, &SwigluArgs::fused(0, cols), &tiny, &mut d_fused)
        .unwrap();
    assert!(download(&stream, &c).iter().all(|v| v.is_nan()));
    assert!(download(&stream, &d_fused).iter().all(|v| v.is_nan()));
    stream.synchronize().unwrap();
}
