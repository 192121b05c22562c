//! SwiGLU: CPU reference against hand-computed values, finite differences and extreme inputs
//! (always run); GPU kernels against the reference for every dtype × layout (separate, fused
//! gate-up) × mode (out of place, in place) on many shapes; GPU numerics at extreme inputs;
//! bad input.
//!
//! With the small shapes (`LIGER_RS_TEST_SHAPES=small`, sized for compute-sanitizer) every
//! case keeps its shape, hence its kernel and grid: cases over 2²⁰ elements hold data in a few
//! windows of rows only (`common::DataRows`), and the test over 2³² elements skips.
mod common;

use common::{
    DataRows, Failures, Rng, assert_close, download, expect_invalid, gpu, poisoned,
    poisoned_on_device, skip_when_small, ulp, upload, widen,
};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use liger_rs::reference::Element;
use liger_rs::reference::swiglu::{
    SwigluGrads as Grads, join_gate_up, sigmoid, silu, silu_grad, split_gate_up,
    swiglu_backward as ref_backward, swiglu_forward as ref_forward,
};
use liger_rs::{
    Dtype, Error, SwigluArgs, swiglu_backward, swiglu_backward_fused,
    swiglu_backward_fused_inplace, swiglu_backward_inplace, swiglu_forward, swiglu_forward_fused,
};
use std::mem::ManuallyDrop;
use std::sync::Arc;

type Stream = Arc<CudaStream>;

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

/// `Σ w·c` for the f64 forward (every cast point is the identity in f64).
fn loss(a: &[f64], b: &[f64], w: &[f64], gm: f32) -> f64 {
    let c = fwd(a, b, gm).unwrap();
    c.iter().zip(w).map(|(c, w)| c * w).sum()
}

#[test]
fn reference_backward_matches_finite_differences() {
    // With dc = w the backward returns dm·∂(Σ w·c)/∂(a, b); central differences in f64
    // (h = 1e-6: truncation ~h²·|c'''| ≈ 1e-12, cancellation ~1e-16·|loss|/h ≈ 1e-9).
    let h = 1e-6;
    for (seed, gm, dm) in [
        (1, 1.0f32, 1.0f32),
        (2, 1.7, 0.6),
        (3, -0.8, 2.5),
        (4, 0.3, 1.0),
    ] {
        let mut rng = Rng::new(seed);
        let n = 24;
        let mut a: Vec<f64> = rng.vec(n, 0.0, 2.5);
        a[0] = 9.0; // far into the linear tail
        a[1] = -9.0; // far into the vanishing tail
        a[2] = -1.2785; // near the zero of silu'
        let b: Vec<f64> = rng.vec(n, 0.0, 1.0);
        let w: Vec<f64> = rng.vec(n, 0.0, 1.0);
        let grads = bwd(&w, &a, &b, gm, dm).unwrap();
        let case = format!("seed {seed}, gm {gm}, dm {dm}");
        let dm = dm as f64;
        for i in 0..n {
            let (mut ap, mut am) = (a.clone(), a.clone());
            ap[i] += h;
            am[i] -= h;
            let fd = dm * (loss(&ap, &b, &w, gm) - loss(&am, &b, &w, gm)) / (2.0 * h);
            assert!(
                (fd - grads.da[i]).abs() < 1e-7 * (1.0 + fd.abs()),
                "da[{i}] {} vs fd {fd}, {case}",
                grads.da[i]
            );
            let (mut bp, mut bm) = (b.clone(), b.clone());
            bp[i] += h;
            bm[i] -= h;
            let fd = dm * (loss(&a, &bp, &w, gm) - loss(&a, &bm, &w, gm)) / (2.0 * h);
            assert!(
                (fd - grads.db[i]).abs() < 1e-7 * (1.0 + fd.abs()),
                "db[{i}] {} vs fd {fd}, {case}",
                grads.db[i]
            );
        }
    }
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

// ---------------------------------------------------------------- tolerances

/// Allowed ulps of `T` (at the reference value) on top of the slack below: the GPU and the
/// reference each round once to `T` (½ ulp each), but when the GPU's value before rounding
/// lies in the next binade up its ulp is twice the reference's: ½ + 1 = 1.5.
const ULPS: f64 = 1.5;

/// f32 unit roundoff and smallest subnormal.
const U: f64 = 1.0 / (1u64 << 24) as f64;
const TINY: f64 = 1.401298464324817e-45;

/// Bound on |f32 silu of the kernel − exact silu(z)| (before any rounding to `T`).
///
/// The kernel forms `t = e^{−|z|}` with `ex2.approx.f32` (≤ 2 ulp) of the f32 argument
/// `−|z|·log2 e`, whose rounding (and that of the log2 e constant) moves `t` by up to
/// ≈ 1.5·|z| f32 ulps relative; σ or 1 − σ is `t·r`, so one of them carries that error, the
/// rest is a handful of f32 roundings. Hence `(2|z| + 20)·2⁻²⁴` relative, plus an absolute
/// term for the f32 subnormal range (σ below 2⁻¹²⁶ when z < −87, where `t` keeps fewer
/// bits): a few subnormal ulps of σ, multiplied by |z|. Exact 0/1 limits: no error for
/// infinite `z`.
fn silu_err(z: f64) -> f64 {
    if !z.is_finite() {
        return 0.0;
    }
    (2.0 * z.abs() + 20.0) * U * silu(z).abs() + (z.abs() + 2.0) * 8.0 * TINY
}

/// Per-element slack for `c`, `da`, `db` on top of 1 ulp of `T` (the final rounding to `T`
/// of a value that may sit on the other side of a rounding boundary than the exact one):
/// - `c = T(T(s)·b)`: `T(s)` may differ by one ulp of `T` at `s` (plus the f32 error of `s`
///   when that exceeds it, i.e. for f32), which the product scales by `|b|`; the product of
///   two `T` values is then rounded identically.
/// - `db = T(g·s)`: `|g|` times the silu error, plus the f32 product's rounding.
/// - `da = T(g·silu'·gm·b)`: silu' = σ(1 + z(1 − σ)) cancels near z ≈ −1.28, so its error is
///   relative to the magnitudes of its terms, σ(1 + |z|(1 − σ)), times |g·gm·b|, with
///   (2|z| + 24) f32 roundings (as for silu, plus the products), plus subnormal slack.
fn slacks<T: Element>(a: &[T], b: &[T], dc: &[T], gm: f32, dm: f32) -> [Vec<f64>; 3] {
    let (gm, dm) = (gm as f64, dm as f64);
    let mut out = [Vec::new(), Vec::new(), Vec::new()];
    for i in 0..a.len() {
        let z = (a[i].to_f64() * gm) as f32 as f64;
        let (s, e, bv) = (silu(z), silu_err(z), b[i].to_f64().abs());
        let st = T::cast(s);
        let ulp_s = if st.is_finite() { ulp::<T>(st) } else { 0.0 };
        out[0].push(bv * (ulp_s + e));
        let g = (dc[i].to_f64() * dm) as f32 as f64;
        out[2].push(g.abs() * e + (g * s).abs() * 2.0 * U + TINY);
        let scale = (g * gm * bv).abs();
        let da = if z.is_finite() {
            let terms = scale * sigmoid(z) * (1.0 + z.abs() * sigmoid(-z));
            terms * (2.0 * z.abs() + 24.0) * U + (scale + 1.0) * (z.abs() + 2.0) * 16.0 * TINY
        } else {
            scale * silu_grad(z) * 4.0 * U
        };
        out[1].push(da);
    }
    out
}

// ---------------------------------------------------------------- GPU vs reference

/// (rows, cols, pad): 1×1, 1 column, odd and prime widths, Llama widths (11008, 14336) and
/// one past, n > 65536, many short rows (rows far beyond the grid: grid-stride), and padded
/// row strides (pad > 0: every buffer gets its own stride, gaps must stay untouched).
///
/// Both launch paths: the 16-byte vector kernels take the shapes whose `cols` is a multiple
/// of the lanes per vector (4 for f32, 8 for f16/bf16) and whose strides stay whole vectors
/// (pad a multiple of 8): 3×11008, 2×14336, 1000×64 contiguous; 9×2048 pad 8 (every buffer
/// strided, and the fused up half 16-byte aligned); 24000×56 pad 8 (7 or 14 vectors per
/// row, so tiles span many rows and the f32 walk sweeps the grid more than once); 5×20 pad
/// 4 takes the vector path for f32 only (20 is not a multiple of 8); 1300×8192 and
/// 200001×56 pad 8 have over four waves of tiles on an H200, so they run the
/// one-tile-per-block `_vt` kernels (8-byte vectors), the latter with strided rows, many rows
/// per tile and a last tile cut short; the library's unit test
/// `swiglu::tests::gpu_h200_suite_shapes_take_their_documented_kernels` checks that choice.
/// The rest (odd widths, 14337, pad 13/7/1) take the scalar kernels.
const SHAPES: [(usize, usize, usize); 20] = [
    (1, 1, 0),
    (1, 3, 0),
    (3, 1, 0),
    (7, 41, 0),
    (5, 123, 0),
    (3, 11008, 0),
    (2, 14336, 0),
    (2, 14337, 0),
    (1, 70001, 0),
    (1000, 64, 0),
    (70000, 3, 0),
    (33, 4097, 0),
    (37, 1000, 13),
    (5, 129, 7),
    (2, 1025, 1),
    (9, 2048, 8),
    (24000, 56, 8),
    (5, 20, 4),
    (1300, 8192, 0),
    (200001, 56, 8),
];

/// Gate values mixed into the data (~2 %): the tails where σ is 0/1 or subnormal in f32, and
/// the largest magnitudes (those not finite in `T` are skipped). With gm > 1 the largest
/// overflow f32 in `a·gm`, which exercises the infinite-gate limits.
const HUGE: [f64; 12] = [
    1e4, -1e4, 95.0, -95.0, 30.0, -30.0, 60000.0, -60000.0, 3.0e38, -3.0e38, 200.0, -200.0,
];

struct Case {
    rows: usize,
    cols: usize,
    pad: usize,
    fused: bool,
    inplace: bool,
    gm: f32,
    dm: f32,
    seed: u64,
}

impl Case {
    /// Row strides (a or fused gate-up, b, c).
    fn strides(&self) -> (usize, usize, usize) {
        let p = self.pad;
        if self.fused {
            (2 * self.cols + p, 2 * self.cols + p, self.cols + 2 * p)
        } else {
            (self.cols + p, self.cols + 2 * p, self.cols + 3 * p)
        }
    }

    fn args(&self) -> SwigluArgs {
        let (sa, sb, sc) = self.strides();
        let base = if self.fused {
            SwigluArgs::fused(self.rows, self.cols)
        } else {
            SwigluArgs::new(self.rows, self.cols)
        };
        base.with_strides(sa, sb, sc)
            .with_gate_multiplier(self.gm)
            .with_down_multiplier(self.dm)
    }
}

fn span(rows: usize, width: usize, stride: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + width
    }
}

/// Elements outside the first `width` of each row must be NaN (poisoned, untouched) or, with
/// `orig`, equal to it.
fn check_gaps<T: Element>(
    what: &str,
    case: &str,
    buf: &[T],
    width: usize,
    stride: usize,
    orig: Option<&[T]>,
) {
    for (i, v) in buf.iter().enumerate() {
        if i % stride < width {
            continue;
        }
        let ok = match orig {
            None => v.to_f64().is_nan(),
            Some(o) => v.to_f64().to_bits() == o[i].to_f64().to_bits(),
        };
        assert!(ok, "{what}: gap element {i} was written ({v:?}), {case}");
    }
}

fn gate_value<T: Element>(rng: &mut Rng) -> T {
    if rng.uniform() < 0.02 {
        let v = HUGE[(rng.next_u64() % HUGE.len() as u64) as usize];
        if T::cast(v).is_finite() {
            return T::from_f64(v);
        }
    }
    T::from_f64(3.0 * rng.normal())
}

/// A strided buffer whose columns `< gate_cols` of each row are gate values and the rest
/// (the up half when fused, and the gaps) standard normal, in the rows of `rows`; zero in the
/// others.
fn data<T: Element>(
    rng: &mut Rng,
    rows: &DataRows,
    len: usize,
    stride: usize,
    gate_cols: usize,
) -> Vec<T> {
    (0..len)
        .map(|i| {
            if !rows.holds(i / stride) {
                T::from_f64(0.0)
            } else if i % stride < gate_cols {
                gate_value(rng)
            } else {
                T::from_f64(rng.normal())
            }
        })
        .collect()
}

fn run_case<T: Dtype>(stream: &Stream, c: &Case) {
    let desc = format!(
        "{}×{} pad {} {} fused={} inplace={} gm={} dm={} seed={}",
        c.rows,
        c.cols,
        c.pad,
        T::NAME,
        c.fused,
        c.inplace,
        c.gm,
        c.dm,
        c.seed
    );
    let (rows, cols) = (c.rows, c.cols);
    let (sa, sb, sc) = c.strides();
    let args = c.args();
    let mut rng = Rng::new(c.seed);
    // With the small shapes, a big case's other rows are zero, and so are their outputs.
    let data_rows = DataRows::of(rows, cols);
    let compact = |buf: &[T], stride, offset| data_rows.compact(buf, cols, stride, offset);
    let zero_rows = |what, buf: &[T], width, stride| {
        data_rows.assert_zero_rows(what, &desc, buf, width, stride, 0);
    };
    let dc_h: Vec<T> = data(&mut rng, &data_rows, span(rows, cols, sc), sc, 0);
    let dc_d = upload(stream, &dc_h);
    let dc = compact(&dc_h, sc, 0);
    let c_span = span(rows, cols, sc);

    // Inputs (host copies kept to check that nothing but the outputs changes).
    let (a_h, b_h): (Vec<T>, Vec<T>) = if c.fused {
        (
            data(&mut rng, &data_rows, span(rows, 2 * cols, sa), sa, cols),
            Vec::new(),
        )
    } else {
        (
            data(&mut rng, &data_rows, span(rows, cols, sa), sa, cols),
            data(&mut rng, &data_rows, span(rows, cols, sb), sb, 0),
        )
    };
    let a = compact(&a_h, sa, 0);
    let b = if c.fused {
        compact(&a_h, sa, cols)
    } else {
        compact(&b_h, sb, 0)
    };
    let mut a_d = upload(stream, &a_h);
    // The fused layout has no separate b (and an empty device buffer cannot be allocated).
    let mut b_d = upload(stream, if c.fused { &dc_h[..1] } else { &b_h });

    // The reference takes the data rows, contiguous and separate.
    let ref_args = SwigluArgs::new(a.len() / cols, cols)
        .with_gate_multiplier(c.gm)
        .with_down_multiplier(c.dm);
    let want_c = ref_forward(&ref_args, &a, &b).unwrap();
    let grads = ref_backward(&ref_args, &dc, &a, &b).unwrap();
    let [slack_c, slack_da, slack_db] = slacks(&a, &b, &dc, c.gm, c.dm);

    // Forward into a NaN-poisoned c.
    let mut c_d = poisoned::<T>(stream, c_span);
    if c.fused {
        swiglu_forward_fused(stream, &args, &a_d, &mut c_d).expect(&desc);
    } else {
        swiglu_forward(stream, &args, &a_d, &b_d, &mut c_d).expect(&desc);
    }
    let c_got = download(stream, &c_d);
    check_gaps("c", &desc, &c_got, cols, sc, None);
    let got = widen(&compact(&c_got, sc, 0));
    zero_rows("c", &c_got, cols, sc);
    assert_close::<T>("c", &desc, &got, &widen(&want_c), ULPS, &slack_c);
    assert!(
        download(stream, &a_d) == a_h,
        "forward changed its input, {desc}"
    );
    if !c.fused {
        assert!(download(stream, &b_d) == b_h, "forward changed b, {desc}");
    }

    // Backward: into poisoned buffers or over the inputs.
    let (da, db) = match (c.fused, c.inplace) {
        (false, false) => {
            let mut da_d = poisoned::<T>(stream, a_h.len());
            let mut db_d = poisoned::<T>(stream, b_h.len());
            swiglu_backward(stream, &args, &dc_d, &a_d, &b_d, &mut da_d, &mut db_d).expect(&desc);
            let (da_h, db_h) = (download(stream, &da_d), download(stream, &db_d));
            check_gaps("da", &desc, &da_h, cols, sa, None);
            check_gaps("db", &desc, &db_h, cols, sb, None);
            zero_rows("da", &da_h, cols, sa);
            zero_rows("db", &db_h, cols, sb);
            assert!(download(stream, &a_d) == a_h, "backward changed a, {desc}");
            assert!(download(stream, &b_d) == b_h, "backward changed b, {desc}");
            (compact(&da_h, sa, 0), compact(&db_h, sb, 0))
        }
        (false, true) => {
            swiglu_backward_inplace(stream, &args, &dc_d, &mut a_d, &mut b_d).expect(&desc);
            let (da_h, db_h) = (download(stream, &a_d), download(stream, &b_d));
            check_gaps("da", &desc, &da_h, cols, sa, Some(&a_h));
            check_gaps("db", &desc, &db_h, cols, sb, Some(&b_h));
            zero_rows("da", &da_h, cols, sa);
            zero_rows("db", &db_h, cols, sb);
            (compact(&da_h, sa, 0), compact(&db_h, sb, 0))
        }
        (true, false) => {
            let mut g_d = poisoned::<T>(stream, a_h.len());
            swiglu_backward_fused(stream, &args, &dc_d, &a_d, &mut g_d).expect(&desc);
            let g_h = download(stream, &g_d);
            check_gaps("d_gate_up", &desc, &g_h, 2 * cols, sa, None);
            zero_rows("d_gate_up", &g_h, 2 * cols, sa);
            assert!(
                download(stream, &a_d) == a_h,
                "backward changed gate_up, {desc}"
            );
            (compact(&g_h, sa, 0), compact(&g_h, sa, cols))
        }
        (true, true) => {
            swiglu_backward_fused_inplace(stream, &args, &dc_d, &mut a_d).expect(&desc);
            let g_h = download(stream, &a_d);
            check_gaps("d_gate_up", &desc, &g_h, 2 * cols, sa, Some(&a_h));
            zero_rows("d_gate_up", &g_h, 2 * cols, sa);
            (compact(&g_h, sa, 0), compact(&g_h, sa, cols))
        }
    };
    assert!(
        download(stream, &dc_d) == dc_h,
        "backward changed dc, {desc}"
    );
    assert_close::<T>("da", &desc, &widen(&da), &widen(&grads.da), ULPS, &slack_da);
    assert_close::<T>("db", &desc, &widen(&db), &widen(&grads.db), ULPS, &slack_db);
}

/// Runs one closure per case, collecting every failure instead of stopping at the first.
fn collect(test: &str, cases: usize, mut run: impl FnMut(usize)) {
    let mut failures = Failures::new(test);
    for i in 0..cases {
        failures.run(|| run(i));
    }
    failures.finish();
}

/// Every shape × {separate, fused} × {out of place, in place}, with the multipliers cycling
/// through 1 and other values so each layout and mode sees gm ≠ 1 and dm ≠ 1.
fn sweep<T: Dtype>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let gms = [1.0f32, 0.75, 1.5];
    let dms = [1.0f32, 2.0, 0.3, 1.0];
    collect(test, SHAPES.len() * 4, |i| {
        let (rows, cols, pad) = SHAPES[i / 4];
        let case = Case {
            rows,
            cols,
            pad,
            fused: i % 4 >= 2,
            inplace: i % 2 == 1,
            gm: gms[i % 3],
            dm: dms[(i / 3) % 4],
            seed: seed_base + i as u64,
        };
        run_case::<T>(&stream, &case);
    });
}

#[test]
fn gpu_matches_reference_f32() {
    sweep::<f32>("gpu_matches_reference_f32", 40_000);
}

#[test]
fn gpu_matches_reference_f16() {
    sweep::<f16>("gpu_matches_reference_f16", 50_000);
}

#[test]
fn gpu_matches_reference_bf16() {
    sweep::<bf16>("gpu_matches_reference_bf16", 60_000);
}

/// Pins the numerics at extreme gates: every listed `a` (f32: ±1e4, the tails where σ is
/// 0/1/subnormal, a sweep of [−120, 120], up to ±f32::MAX; f16/bf16: every finite value).
/// Pass 1 (b = dc = 1, gm = dm = 1): c, da, db finite; for |a| ≥ 200 exactly the limits
/// (c = a or 0, da = 1 or 0, db = a or 0); all within the sweep's tolerance of the reference.
/// Pass 2 (random b, dc; gm = 1.25 so a·gm overflows f32 for the largest bf16/f32 values;
/// dm = 0.5): matches the reference (infinite c only where the true value overflows).
fn extremes<T: Dtype>(stream: &Stream, a: Vec<T>) {
    let n = a.len();
    let desc = format!("extremes {} n = {n}", T::NAME);
    let mut rng = Rng::new(77);
    for (pass, gm, dm) in [(1, 1.0f32, 1.0f32), (2, 1.25, 0.5)] {
        let (b, dc): (Vec<T>, Vec<T>) = if pass == 1 {
            (vec![T::from_f64(1.0); n], vec![T::from_f64(1.0); n])
        } else {
            (rng.vec(n, 0.0, 1.0), rng.vec(n, 0.0, 1.0))
        };
        let args = SwigluArgs::new(1, n)
            .with_gate_multiplier(gm)
            .with_down_multiplier(dm);
        let (a_d, b_d, dc_d) = (upload(stream, &a), upload(stream, &b), upload(stream, &dc));
        let mut c_d = poisoned::<T>(stream, n);
        let (mut da_d, mut db_d) = (poisoned::<T>(stream, n), poisoned::<T>(stream, n));
        swiglu_forward(stream, &args, &a_d, &b_d, &mut c_d).expect(&desc);
        swiglu_backward(stream, &args, &dc_d, &a_d, &b_d, &mut da_d, &mut db_d).expect(&desc);
        let (c, da, db) = (
            widen(&download(stream, &c_d)),
            widen(&download(stream, &da_d)),
            widen(&download(stream, &db_d)),
        );
        let case = format!("{desc}, pass {pass}");
        if pass == 1 {
            for i in 0..n {
                let x = a[i].to_f64();
                assert!(
                    c[i].is_finite() && da[i].is_finite() && db[i].is_finite(),
                    "a = {x}: c {} da {} db {}, {case}",
                    c[i],
                    da[i],
                    db[i]
                );
                if x.abs() >= 200.0 {
                    let want = if x > 0.0 {
                        (x, 1.0, x)
                    } else {
                        (0.0, 0.0, 0.0)
                    };
                    assert_eq!((c[i], da[i], db[i]), want, "limits at a = {x}, {case}");
                }
            }
        }
        let want_c = ref_forward(&args, &a, &b).unwrap();
        let grads = ref_backward(&args, &dc, &a, &b).unwrap();
        let [sc, sda, sdb] = slacks(&a, &b, &dc, gm, dm);
        assert_close::<T>("c", &case, &c, &widen(&want_c), ULPS, &sc);
        assert_close::<T>("da", &case, &da, &widen(&grads.da), ULPS, &sda);
        assert_close::<T>("db", &case, &db, &widen(&grads.db), ULPS, &sdb);
    }
}

#[test]
fn gpu_extreme_gates_are_finite_with_the_right_limits() {
    let Some(stream) = gpu("gpu_extreme_gates_are_finite_with_the_right_limits") else {
        return;
    };
    let mut f32s = vec![0.0f32, -0.0, 1e-30, -1e-30, 1e-45, -1e-45];
    for v in [
        1e4f32,
        1e3,
        200.0,
        150.0,
        104.0,
        100.0,
        90.0,
        88.0,
        87.0,
        50.0,
        20.0,
        1e30,
        1e38,
        f32::MAX,
    ] {
        f32s.extend([v, -v]);
    }
    f32s.extend((0..=2400).map(|i| -120.0 + 0.1 * i as f32));
    let f16s: Vec<f16> = (0..=u16::MAX)
        .map(f16::from_bits)
        .filter(|v| v.is_finite())
        .collect();
    let bf16s: Vec<bf16> = (0..=u16::MAX)
        .map(bf16::from_bits)
        .filter(|v| v.is_finite())
        .collect();
    collect(
        "gpu_extreme_gates_are_finite_with_the_right_limits",
        3,
        |i| match i {
            0 => extremes(&stream, f32s.clone()),
            1 => extremes(&stream, f16s.clone()),
            _ => extremes(&stream, bf16s.clone()),
        },
    );
}

/// NaN and ±∞ inputs give what the reference gives: NaN propagates, an infinite
/// gate takes the silu limits, an infinite `b` or `dc` multiplies through.
fn non_finite<T: Dtype>(stream: &Stream) {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let rows: [(f64, f64, f64); 8] = [
        (nan, 1.0, 1.0),
        (inf, 1.0, 1.0),
        (-inf, 1.0, 1.0),
        (1.0, nan, 1.0),
        (2.0, inf, 1.0),
        (1.0, 1.0, nan),
        (-3.0, 1.0, inf),
        (0.5, -inf, 0.25),
    ];
    let pick = |f: fn(&(f64, f64, f64)) -> f64| -> Vec<T> {
        rows.iter().map(|r| T::from_f64(f(r))).collect()
    };
    let (a, b, dc) = (pick(|r| r.0), pick(|r| r.1), pick(|r| r.2));
    let n = a.len();
    let args = SwigluArgs::new(1, n);
    let desc = format!("non-finite inputs {}", T::NAME);
    let (a_d, b_d, dc_d) = (upload(stream, &a), upload(stream, &b), upload(stream, &dc));
    let mut c_d = poisoned::<T>(stream, n);
    let (mut da_d, mut db_d) = (poisoned::<T>(stream, n), poisoned::<T>(stream, n));
    swiglu_forward(stream, &args, &a_d, &b_d, &mut c_d).expect(&desc);
    swiglu_backward(stream, &args, &dc_d, &a_d, &b_d, &mut da_d, &mut db_d).expect(&desc);
    let want_c = ref_forward(&args, &a, &b).unwrap();
    let grads = ref_backward(&args, &dc, &a, &b).unwrap();
    let [sc, sda, sdb] = slacks(&a, &b, &dc, 1.0, 1.0);
    let got = |d: &CudaSlice<T>| widen(&download(stream, d));
    assert_close::<T>("c", &desc, &got(&c_d), &widen(&want_c), ULPS, &sc);
    assert_close::<T>("da", &desc, &got(&da_d), &widen(&grads.da), ULPS, &sda);
    assert_close::<T>("db", &desc, &got(&db_d), &widen(&grads.db), ULPS, &sdb);
}

#[test]
fn gpu_nan_and_inf_propagate_as_in_the_reference() {
    let Some(stream) = gpu("gpu_nan_and_inf_propagate_as_in_the_reference") else {
        return;
    };
    collect(
        "gpu_nan_and_inf_propagate_as_in_the_reference",
        3,
        |i| match i {
            0 => non_finite::<f32>(&stream),
            1 => non_finite::<f16>(&stream),
            _ => non_finite::<bf16>(&stream),
        },
    );
}

#[test]
fn gpu_offsets_beyond_2_pow_32_elements() {
    // A fused gate-up buffer of 2³² / (2·cols) + 64 rows: over 2³² bf16 elements (8 GiB), c
    // and dc over 2³¹ (4 GiB), so any 32-bit element or byte offset wraps; 14336 columns take
    // the vector kernels, 14337 the scalar ones. All rows are zero except 8-row windows of
    // random data at the start, around gate-up element 2³¹, around c element 2³¹ (gate-up
    // element 2³²) and at the end: each must match the reference on its own, forward and
    // backward (in place over gate-up).
    let test = "gpu_offsets_beyond_2_pow_32_elements";
    let Some(stream) = gpu(test) else {
        return;
    };
    if skip_when_small(
        test,
        "64-bit offsets need buffers of over 2³² elements (8 GiB)",
    ) {
        return;
    }
    for cols in [14336, 14337] {
        huge_case(&stream, cols);
    }
}

fn huge_case(stream: &Stream, cols: usize) {
    let (win, width) = (8, 2 * cols);
    let rows = (1usize << 32) / width + 64;
    let starts = [
        0,
        (1usize << 31) / width - win / 2,
        (1usize << 31) / cols - win / 2,
        rows - win,
    ];
    let desc = format!("{rows}×{cols} fused bf16, windows at rows {starts:?}");
    let mut rng = Rng::new(1000 + cols as u64);
    let mut gate_up_d = stream
        .alloc_zeros::<bf16>(rows * width)
        .expect("8 GiB gate-up");
    let mut dc_d = stream.alloc_zeros::<bf16>(rows * cols).expect("4 GiB dc");
    let (mut a, mut b, mut dc) = (Vec::new(), Vec::new(), Vec::new());
    for &r0 in &starts {
        let aw: Vec<bf16> = (0..win * cols).map(|_| gate_value(&mut rng)).collect();
        let bw: Vec<bf16> = rng.vec(win * cols, 0.0, 1.0);
        let dcw: Vec<bf16> = rng.vec(win * cols, 0.0, 1.0);
        let joined = join_gate_up(&aw, &bw, cols).unwrap();
        let mut g = gate_up_d.slice_mut(r0 * width..(r0 + win) * width);
        stream.memcpy_htod(&joined, &mut g).unwrap();
        let mut d = dc_d.slice_mut(r0 * cols..(r0 + win) * cols);
        stream.memcpy_htod(&dcw, &mut d).unwrap();
        a.extend(aw);
        b.extend(bw);
        dc.extend(dcw);
    }
    let windows = |buf: &CudaSlice<bf16>, w: usize| -> Vec<bf16> {
        let rows = starts.iter().map(|&r0| buf.slice(r0 * w..(r0 + win) * w));
        rows.flat_map(|v| stream.clone_dtoh(&v).unwrap()).collect()
    };
    let args = SwigluArgs::fused(rows, cols);
    let [slack_c, slack_da, slack_db] = slacks(&a, &b, &dc, 1.0, 1.0);

    let mut c_d = poisoned_on_device::<bf16>(stream, rows * cols);
    swiglu_forward_fused(stream, &args, &gate_up_d, &mut c_d).expect(&desc);
    let ref_args = SwigluArgs::new(a.len() / cols, cols);
    let want_c = widen(&ref_forward(&ref_args, &a, &b).unwrap());
    let got_c = widen(&windows(&c_d, cols));
    assert_close::<bf16>("c", &desc, &got_c, &want_c, ULPS, &slack_c);

    swiglu_backward_fused_inplace(stream, &args, &dc_d, &mut gate_up_d).expect(&desc);
    let (da, db) = split_gate_up(&windows(&gate_up_d, width), cols).unwrap();
    let grads = ref_backward(&ref_args, &dc, &a, &b).unwrap();
    assert_close::<bf16>("da", &desc, &widen(&da), &widen(&grads.da), ULPS, &slack_da);
    assert_close::<bf16>("db", &desc, &widen(&db), &widen(&grads.db), ULPS, &slack_db);
}

// ---------------------------------------------------------------- bad input

#[test]
fn bad_input_is_rejected_before_launch() {
    let Some(stream) = gpu("bad_input_is_rejected_before_launch") else {
        return;
    };
    let (rows, cols) = (4, 8);
    let n = rows * cols;
    let one = |len: usize| upload(&stream, &vec![1.0f32; len]);
    let (a, b, dc) = (one(n), one(n), one(n));
    let (short, fused_in) = (one(n - 1), one(2 * n));
    let mut c = poisoned::<f32>(&stream, n);
    let mut short_out = poisoned::<f32>(&stream, n - 1);
    let args = SwigluArgs::new(rows, cols);
    let fused = SwigluArgs::fused(rows, cols);

    // Arguments.
    let zero = SwigluArgs::new(rows, 0);
    expect_invalid(
        swiglu_forward(&stream, &zero, &a, &b, &mut c),
        "args.cols",
        "at least 1",
    );
    expect_invalid(
        swiglu_forward_fused(&stream, &SwigluArgs::fused(rows, 0), &fused_in, &mut c),
        "args.cols",
        "at least 1",
    );
    let nan_gm = args.with_gate_multiplier(f32::NAN);
    expect_invalid(
        swiglu_forward(&stream, &nan_gm, &a, &b, &mut c),
        "args.gate_multiplier",
        "finite",
    );
    let inf_dm = args.with_down_multiplier(f32::INFINITY);
    let (mut da, mut db) = (poisoned::<f32>(&stream, n), poisoned::<f32>(&stream, n));
    expect_invalid(
        swiglu_backward(&stream, &inf_dm, &dc, &a, &b, &mut da, &mut db),
        "args.down_multiplier",
        "finite",
    );
    for (strides, arg) in [
        ((cols - 1, cols, cols), "args.a_stride"),
        ((cols, cols - 1, cols), "args.b_stride"),
        ((cols, cols, cols - 1), "args.c_stride"),
    ] {
        let s = args.with_strides(strides.0, strides.1, strides.2);
        expect_invalid(
            swiglu_forward(&stream, &s, &a, &b, &mut c),
            arg,
            "row stride ≥ cols = 8",
        );
    }
    let narrow = fused.with_strides(2 * cols - 1, 2 * cols, cols);
    expect_invalid(
        swiglu_forward_fused(&stream, &narrow, &fused_in, &mut c),
        "args.a_stride",
        "2 × cols = 16",
    );

    // Lengths, separate layout.
    expect_invalid(
        swiglu_forward(&stream, &args, &short, &b, &mut c),
        "a",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_forward(&stream, &args, &a, &short, &mut c),
        "b",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_forward(&stream, &args, &a, &b, &mut short_out),
        "c",
        "length ≥ 32",
    );
    let wide = args.with_strides(cols + 1, cols, cols);
    expect_invalid(
        swiglu_forward(&stream, &wide, &a, &b, &mut c),
        "a",
        "length ≥ 35",
    );
    expect_invalid(
        swiglu_backward(&stream, &args, &short, &a, &b, &mut da, &mut db),
        "dc",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_backward(&stream, &args, &dc, &a, &b, &mut short_out, &mut db),
        "da",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_backward(&stream, &args, &dc, &a, &b, &mut da, &mut short_out),
        "db",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_backward(&stream, &args, &dc, &a, &short, &mut da, &mut db),
        "b",
        "length ≥ 32",
    );
    let mut short_b = one(n - 1);
    expect_invalid(
        swiglu_backward_inplace(&stream, &args, &dc, &mut da, &mut short_b),
        "b",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_backward_inplace(&stream, &args, &short, &mut da, &mut db),
        "dc",
        "length ≥ 32",
    );

    // Lengths, fused layout.
    let short_fused = one(2 * n - 1);
    expect_invalid(
        swiglu_forward_fused(&stream, &fused, &short_fused, &mut c),
        "gate_up",
        "length ≥ 64",
    );
    expect_invalid(
        swiglu_forward_fused(&stream, &fused, &fused_in, &mut short_out),
        "c",
        "length ≥ 32",
    );
    let mut d_fused = poisoned::<f32>(&stream, 2 * n);
    let mut short_d_fused = poisoned::<f32>(&stream, 2 * n - 1);
    expect_invalid(
        swiglu_backward_fused(&stream, &fused, &dc, &fused_in, &mut short_d_fused),
        "d_gate_up",
        "length ≥ 64",
    );
    expect_invalid(
        swiglu_backward_fused(&stream, &fused, &short, &fused_in, &mut d_fused),
        "dc",
        "length ≥ 32",
    );
    expect_invalid(
        swiglu_backward_fused_inplace(&stream, &fused, &dc, &mut short_d_fused),
        "gate_up",
        "length ≥ 64",
    );

    // rows = 0: nothing to check against, nothing launched, outputs untouched.
    let none = SwigluArgs::new(0, cols);
    let tiny = one(1);
    swiglu_forward(&stream, &none, &tiny, &tiny, &mut c).unwrap();
    swiglu_backward_fused_inplace(&stream, &SwigluArgs::fused(0, cols), &tiny, &mut d_fused)
        .unwrap();
    assert!(download(&stream, &c).iter().all(|v| v.is_nan()));
    assert!(download(&stream, &d_fused).iter().all(|v| v.is_nan()));
    stream.synchronize().unwrap();
}

/// A second handle on `len` f32 starting `offset` elements into `buf`: safe Rust cannot hold
/// overlapping mutable views, so overlaps are built from raw pointers. Never dropped (not
/// even when an assertion unwinds): freeing it would free part of `buf`.
fn alias(
    stream: &Stream,
    buf: &CudaSlice<f32>,
    offset: usize,
    len: usize,
) -> ManuallyDrop<CudaSlice<f32>> {
    let base = {
        let (ptr, _guard) = buf.device_ptr(stream);
        ptr
    };
    // SAFETY: the alias lies inside `buf`, which outlives its uses, and is never freed.
    ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<f32>(base + 4 * offset as u64, len) })
}

#[test]
fn overlapping_buffers_are_rejected() {
    let Some(stream) = gpu("overlapping_buffers_are_rejected") else {
        return;
    };
    let (rows, cols) = (4, 8);
    let n = rows * cols;
    let args = SwigluArgs::new(rows, cols);
    let fused = SwigluArgs::fused(rows, cols);
    let buf = upload(&stream, &vec![1.0f32; 4 * n]);
    let (first, second) = (buf.slice(..n), buf.slice(n..2 * n));
    let mut half_in = alias(&stream, &buf, n / 2, n); // overlaps first and second
    let mut half_in2 = alias(&stream, &buf, n / 2 + 1, n);
    let mut at0 = alias(&stream, &buf, 0, 2 * n);
    let other = upload(&stream, &vec![1.0f32; n]);
    let aliasing = |output, other| Err(Error::Aliasing { output, other });

    // Forward: c over a, c over b.
    let e = swiglu_forward(&stream, &args, &first, &other, &mut *half_in);
    assert_eq!(e, aliasing("c", "a"));
    let e = swiglu_forward(&stream, &args, &other, &second, &mut *half_in);
    assert_eq!(e, aliasing("c", "b"));
    // Fused forward: c inside gate_up.
    let gu = buf.slice(..2 * n);
    let e = swiglu_forward_fused(&stream, &fused, &gu, &mut *half_in);
    assert_eq!(e, aliasing("c", "gate_up"));

    // Out-of-place backward: da over dc / a, db over b, da and db over each other.
    let mut out = poisoned::<f32>(&stream, n);
    let e = swiglu_backward(
        &stream,
        &args,
        &first,
        &other,
        &other,
        &mut *half_in,
        &mut out,
    );
    assert_eq!(e, aliasing("da", "dc"));
    let e = swiglu_backward(
        &stream,
        &args,
        &other,
        &second,
        &other,
        &mut *half_in,
        &mut out,
    );
    assert_eq!(e, aliasing("da", "a"));
    let e = swiglu_backward(
        &stream,
        &args,
        &other,
        &other,
        &first,
        &mut out,
        &mut *half_in,
    );
    assert_eq!(e, aliasing("db", "b"));
    let mut far = alias(&stream, &buf, 3 * n, n);
    let mut far2 = alias(&stream, &buf, 3 * n - 1, n);
    let e = swiglu_backward(
        &stream, &args, &other, &other, &other, &mut *far, &mut *far2,
    );
    assert_eq!(e, aliasing("da", "db"));

    // In place: a and b must not overlap each other; dc must not overlap either.
    let e = swiglu_backward_inplace(&stream, &args, &other, &mut *half_in, &mut *half_in2);
    assert_eq!(e, aliasing("a", "b"));
    let e = swiglu_backward_inplace(&stream, &args, &second, &mut *far, &mut *half_in);
    assert_eq!(e, aliasing("b", "dc"));

    // Fused: the gradient over the input, dc over the buffer written in place.
    let mut d_gu = alias(&stream, &buf, n, 2 * n);
    let e = swiglu_backward_fused(&stream, &fused, &other, &gu, &mut *d_gu);
    assert_eq!(e, aliasing("d_gate_up", "gate_up"));
    let e = swiglu_backward_fused_inplace(&stream, &fused, &second, &mut *at0);
    assert_eq!(e, aliasing("gate_up", "dc"));

    // Adjacent, not overlapping: accepted (and computed).
    let mut adjacent = alias(&stream, &buf, 2 * n, n);
    swiglu_forward(&stream, &args, &first, &second, &mut *adjacent).unwrap();
    let mut pair = poisoned::<f32>(&stream, 2 * n);
    let (mut lo, mut hi) = pair.split_at_mut(n);
    swiglu_backward_inplace(&stream, &args, &other, &mut lo, &mut hi).unwrap();
    stream.synchronize().unwrap();
}
