//! GEGLU (GELU-mul) on the CPU: HF's cast points (PyTorch autograd through `gelu(a) * b` in
//! the element type, as HF's Gemma MLP and Liger's GEGLU compute it), with GELU in either of
//! its two forms, f64 in between.
//!
//! `D(·)` rounds to the element type, `F(·)` to f32 ([`Element::cast_f32`], the identity for
//! f64) where the kernels materialise an f32 value from a product of inputs:
//!
//! | value | f16, bf16                        | f32, f64 (SwiGLU's)          |
//! |-------|----------------------------------|------------------------------|
//! | gate  | `z = F(a·gm)`                    | `z = F(a·gm)`                |
//! | `c`   | `D(D(gelu(z)) · b)`              | `D(D(gelu(z)) · b)`          |
//! | `g`   | `F(dc·dm)`                       | `F(dc·dm)`                   |
//! | `db`  | `D(g · D(gelu(z)))`              | `D(g · gelu(z))`             |
//! | `da`  | `D(D(g · b) · gelu'(z) · gm)`    | `D(g · gelu'(z) · gm · b)`   |
//!
//! In 16 bits the activation is a tensor of the dtype (the forward's product and the
//! backward's `db` read it rounded) and the product's gradient `g·b` is rounded before
//! GELU's backward multiplies it, as autograd does. In f32, whose kernels compute in f32
//! throughout, the backward keeps SwiGLU's single rounding of each gradient.
//!
//! `gelu` is one of two functions, chosen by the `erf` argument (both in f64):
//!
//! - `erf = false`, the tanh approximation (PyTorch's `approximate="tanh"`, Liger's GEGLU,
//!   Gemma's `gelu_pytorch_tanh`): `gelu(z) = ½·z·(1 + tanh(y))` with
//!   `y = √(2/π)·(z + 0.044715·z³)`, computed through the identity `½·(1 + tanh(y)) = σ(2y)`
//!   as `z·σ(u)`, `u = 2y`, with the overflow-free [`sigmoid`] (no `1 + tanh(y)`
//!   cancellation for negative `z`, so the value is accurate in relative terms in the whole
//!   tail); `gelu'(z) = σ(u)·(1 + z·u'·(1 − σ(u)))`, `u' = 2·√(2/π)·(1 + 3·0.044715·z²)`.
//! - `erf = true`, the exact GELU (PyTorch's default `approximate="none"`):
//!   `gelu(z) = z·Φ(z)` and `gelu'(z) = Φ(z) + z·φ(z)`, with the standard normal CDF
//!   `Φ(z) = ½·erfc(−z/√2)` (the `libm` crate's `erfc`, accurate in relative terms in the
//!   lower tail) and density `φ(z) = e^{−z²/2}/√(2π)`.
//!
//! Both are finite for every finite `z`; an infinite `z` takes the limits gelu(−∞) = −0,
//! gelu(+∞) = +∞, gelu'(−∞) = 0, gelu'(+∞) = 1 instead of `∞·0 = NaN`, as SwiGLU's silu does
//! (the GPU kernels do the same). NaN propagates.
//!
//! Beyond HF, the multipliers `gm` and `dm` (1 in HF) scale the gate and the incoming
//! gradient. The fused gate-up layout (`[rows, 2·cols]`, gate first) is the same as SwiGLU's:
//! [`split_gate_up`] and [`join_gate_up`] convert.
//!
//! [`split_gate_up`]: super::swiglu::split_gate_up
//! [`join_gate_up`]: super::swiglu::join_gate_up
use super::Element;
use super::swiglu::{BackwardCasts, glu_backward, glu_forward, sigmoid};
use crate::SwigluArgs;
use crate::error::Result;

/// `√(2/π)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const CUBIC: f64 = 0.044715;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// Backward results: the gradients of the gate `a` and of the up projection `b`.
///
/// ```
/// use liger_rs::{SwigluArgs, reference::geglu::geglu_backward};
/// let g = geglu_backward(&SwigluArgs::new(1, 3), &[1.0f64; 3], &[0.0; 3], &[1.0; 3], true).unwrap();
/// assert_eq!((g.da.len(), g.db.len()), (3, 3));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct GegluGrads<T> {
    /// Gradient of `a` (same layout as `a`).
    pub da: Vec<T>,
    /// Gradient of `b` (same layout as `b`).
    pub db: Vec<T>,
}

/// The sigmoid argument of the tanh form, `u = 2·√(2/π)·(z + 0.044715·z³)` (±∞ once `z³`
/// overflows, which [`sigmoid`] takes to its limits).
fn tanh_u(z: f64) -> f64 {
    2.0 * SQRT_2_OVER_PI * (z + CUBIC * z * z * z)
}

/// The tanh approximation of GELU, `½·z·(1 + tanh(√(2/π)·(z + 0.044715·z³)))`, computed as
/// `z·σ(2·√(2/π)·(z + 0.044715·z³))`: accurate in relative terms for negative `z` too, −0 for
/// large negative `z` (and −∞), `z` for large positive `z`.
///
/// ```
/// use liger_rs::reference::geglu::gelu_tanh;
/// assert_eq!(gelu_tanh(0.0), 0.0);
/// assert!((gelu_tanh(1.0) - 0.841_191_990_608_276_7).abs() < 1e-15);
/// assert!((gelu_tanh(-5.0) / -2.291_796_196_629_506e-7 - 1.0).abs() < 1e-13);
/// assert_eq!(gelu_tanh(1e4), 1e4);
/// assert_eq!(gelu_tanh(-1e4), 0.0);
/// assert_eq!(gelu_tanh(f64::NEG_INFINITY), 0.0);
/// ```
pub fn gelu_tanh(z: f64) -> f64 {
    let sig = sigmoid(tanh_u(z));
    if sig == 0.0 { -0.0 } else { z * sig }
}

/// The derivative of [`gelu_tanh`]: `σ(u)·(1 + z·u'·(1 − σ(u)))` with
/// `u = 2·√(2/π)·(z + 0.044715·z³)` and `u' = 2·√(2/π)·(1 + 3·0.044715·z²)`; 0 for large
/// negative `z`, 1 for large positive.
///
/// ```
/// use liger_rs::reference::geglu::gelu_tanh_grad;
/// assert_eq!(gelu_tanh_grad(0.0), 0.5);
/// assert_eq!(gelu_tanh_grad(1e4), 1.0);
/// assert_eq!(gelu_tanh_grad(-1e4), 0.0);
/// assert_eq!(gelu_tanh_grad(f64::INFINITY), 1.0);
/// ```
pub fn gelu_tanh_grad(z: f64) -> f64 {
    let u = tanh_u(z);
    let (sig, one_minus) = (sigmoid(u), sigmoid(-u));
    if sig == 0.0 {
        return 0.0;
    }
    // 1 − σ(u) is nonzero only for u below ~745, i.e. |z| below ~25: z·u' is then finite.
    let du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * z * z);
    let tail = if one_minus == 0.0 {
        0.0
    } else {
        z * du * one_minus
    };
    sig * (1.0 + tail)
}

/// The standard normal CDF `Φ(z) = ½·erfc(−z/√2)`: relative accuracy in the lower tail
/// (no `1 + erf` cancellation), 0 at −∞, 1 at +∞.
fn normal_cdf(z: f64) -> f64 {
    0.5 * libm::erfc(-z * core::f64::consts::FRAC_1_SQRT_2)
}

/// The exact GELU `z·Φ(z)`, `Φ(z) = ½·erfc(−z/√2)` the standard normal CDF: accurate in
/// relative terms for negative `z` too, −0 for large negative `z` (and −∞), `z` for large
/// positive `z`.
///
/// ```
/// use liger_rs::reference::geglu::gelu_erf;
/// assert_eq!(gelu_erf(0.0), 0.0);
/// assert!((gelu_erf(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15); // Φ(1)
/// assert!((gelu_erf(-10.0) / -7.619_853_024_160_526e-23 - 1.0).abs() < 1e-12); // −10·Φ(−10)
/// assert_eq!(gelu_erf(1e4), 1e4);
/// assert_eq!(gelu_erf(-1e4), 0.0);
/// assert_eq!(gelu_erf(f64::NEG_INFINITY), 0.0);
/// ```
pub fn gelu_erf(z: f64) -> f64 {
    let cdf = normal_cdf(z);
    if cdf == 0.0 { -0.0 } else { z * cdf }
}

/// The derivative of [`gelu_erf`]: `Φ(z) + z·φ(z)`, `φ(z) = e^{−z²/2}/√(2π)`; 0 for large
/// negative `z`, 1 for large positive.
///
/// ```
/// use liger_rs::reference::geglu::gelu_erf_grad;
/// assert_eq!(gelu_erf_grad(0.0), 0.5);
/// // Φ(1) + φ(1)
/// assert!((gelu_erf_grad(1.0) - 1.083_315_470_587_686_3).abs() < 1e-15);
/// assert_eq!(gelu_erf_grad(1e4), 1.0);
/// assert_eq!(gelu_erf_grad(-1e4), 0.0);
/// assert_eq!(gelu_erf_grad(f64::NEG_INFINITY), 0.0);
/// ```
pub fn gelu_erf_grad(z: f64) -> f64 {
    let pdf = (-0.5 * z * z).exp() * FRAC_1_SQRT_2PI;
    // φ vanishes (underflows) before z·φ could overflow; at ±∞ it is 0 and z·φ would be NaN.
    let tail = if pdf == 0.0 { 0.0 } else { z * pdf };
    normal_cdf(z) + tail
}

/// `gelu(z)` of the form `erf` picks (module docs).
fn gelu(z: f64, erf: bool) -> f64 {
    if erf { gelu_erf(z) } else { gelu_tanh(z) }
}

/// `gelu'(z)` of the form `erf` picks (module docs).
fn gelu_grad(z: f64, erf: bool) -> f64 {
    if erf {
        gelu_erf_grad(z)
    } else {
        gelu_tanh_grad(z)
    }
}

/// The GEGLU forward `c = D(D(gelu(F(a·gm))) · b)` with `gm = args.gate_multiplier`, shaped
/// as SwiGLU's ([`super::swiglu::swiglu_forward`]: `a`, `b` and `c` are `args.rows`
/// contiguous rows of `args.cols`); `erf` picks the exact GELU ([`gelu_erf`]) over the tanh
/// approximation ([`gelu_tanh`]).
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming `args.cols` when it is 0,
/// a stride of `args` other than `cols`, `a` or `b` when it is not `rows × cols` long, or
/// `args.gate_multiplier` when it is not finite.
///
/// ```
/// use liger_rs::{SwigluArgs, reference::geglu::{geglu_forward, gelu_erf, gelu_tanh}};
/// let c = geglu_forward(&SwigluArgs::new(1, 2), &[0.0f64, 1.0], &[3.0, 2.0], false).unwrap();
/// assert_eq!(c, vec![0.0, 2.0 * gelu_tanh(1.0)]);
/// let half_gate = SwigluArgs::new(1, 1).with_gate_multiplier(0.5);
/// let c = geglu_forward(&half_gate, &[1.0f64], &[2.0], true).unwrap();
/// assert_eq!(c, vec![2.0 * gelu_erf(0.5)]);
/// ```
pub fn geglu_forward<T: Element>(args: &SwigluArgs, a: &[T], b: &[T], erf: bool) -> Result<Vec<T>> {
    glu_forward(args, a, b, |z| gelu(z, erf))
}

/// The GEGLU backward: with `z = F(a·gm)` and `g = F(dc·dm)` (`gm`, `dm` the multipliers of
/// `args`), in f16/bf16 `db = D(g·D(gelu(z)))` and `da = D(D(g·b)·gelu'(z)·gm)` (PyTorch
/// autograd's cast points), in f32/f64 `db = D(g·gelu(z))` and `da = D(g·gelu'(z)·gm·b)`;
/// `dc`, `a`, `b` shaped as in [`geglu_forward`], and `erf` picks the GELU as there.
///
/// # Errors
/// As [`geglu_forward`], and naming `dc` when it is not `rows × cols` long, or
/// `args.down_multiplier` when it is not finite.
///
/// ```
/// use liger_rs::{SwigluArgs, reference::geglu::geglu_backward};
/// // z = 0: gelu = 0, gelu' = ½ in both forms.
/// for erf in [false, true] {
///     let g = geglu_backward(&SwigluArgs::new(1, 1), &[1.0f64], &[0.0], &[4.0], erf).unwrap();
///     assert_eq!((g.da[0], g.db[0]), (2.0, 0.0));
/// }
/// ```
pub fn geglu_backward<T: Element>(
    args: &SwigluArgs,
    dc: &[T],
    a: &[T],
    b: &[T],
    erf: bool,
) -> Result<GegluGrads<T>> {
    let (act, grad) = (|z| gelu(z, erf), |z| gelu_grad(z, erf));
    let (da, db) = glu_backward(args, [dc, a, b], act, grad, BackwardCasts::Autograd)?;
    Ok(GegluGrads { da, db })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use half::bf16;

    /// The forward on `a`, `b` as one row: it is element-wise, so the values checked here
    /// need no other shape.
    fn fwd<T: Element>(a: &[T], b: &[T], gm: f32, erf: bool) -> Result<Vec<T>> {
        geglu_forward(
            &SwigluArgs::new(1, a.len()).with_gate_multiplier(gm),
            a,
            b,
            erf,
        )
    }

    /// The backward on one row, as [`fwd`].
    fn bwd<T: Element>(
        dc: &[T],
        a: &[T],
        b: &[T],
        gm: f32,
        dm: f32,
        erf: bool,
    ) -> Result<GegluGrads<T>> {
        let args = SwigluArgs::new(1, a.len())
            .with_gate_multiplier(gm)
            .with_down_multiplier(dm);
        geglu_backward(&args, dc, a, b, erf)
    }

    /// Gates from deep in the lower tail (where gelu underflows f64) to far into the linear
    /// regime, both zeros of gelu' (−0.7518 exact, −0.7525 tanh) nearby.
    fn gates() -> Vec<f64> {
        let mut z: Vec<f64> = (-400..=400).map(|i| i as f64 * 0.0625).collect();
        z.extend([
            -37.5, -30.0, -26.0, -14.0, -12.5, -11.0, -9.3, -0.7518, -0.7525, 1e-3, -1e-3, 1e-9,
            11.0, 30.0, 60.0,
        ]);
        z
    }

    #[test]
    fn tanh_form_is_half_z_one_plus_tanh() {
        for z in gates() {
            let y = SQRT_2_OVER_PI * (z + CUBIC * z * z * z);
            let textbook = 0.5 * z * (1.0 + y.tanh());
            // The textbook form loses ~|1 + tanh|⁻¹ ulps to cancellation for negative z:
            // compare in absolute terms there, relative elsewhere.
            let scale = if z < 0.0 { z.abs() } else { textbook.abs() };
            let v = gelu_tanh(z);
            assert!(
                (v - textbook).abs() <= 4.0 * f64::EPSILON * scale,
                "gelu_tanh({z}) = {v}, ½z(1 + tanh y) = {textbook}"
            );
            // The identity itself, at the sigmoid's argument 2y.
            assert_eq!(v, {
                let s = sigmoid(2.0 * SQRT_2_OVER_PI * (z + CUBIC * z * z * z));
                if s == 0.0 { -0.0 } else { z * s }
            });
        }
        // Relative accuracy in the tail, where the textbook form is 0 or noise.
        let mut prev = f64::NEG_INFINITY;
        for i in 4..=80 {
            let z = -0.25 * i as f64;
            let v = gelu_tanh(z);
            assert!(v < 0.0 && v > prev, "gelu_tanh({z}) = {v} after {prev}");
            prev = v;
        }
        let want = [
            (1.0, 0.841_191_990_608_276_7),
            (-1.0, -0.158_808_009_391_723_3),
            (3.0, 2.996_362_607_918_227),
            (-3.0, -0.003_637_392_081_773_018_8),
            (-5.0, -2.291_796_196_629_506e-7),
        ];
        for (z, w) in want {
            let v = gelu_tanh(z);
            assert!(
                (v / w - 1.0).abs() < 8.0 * f64::EPSILON * (1.0 + z * z),
                "{z}: {v}"
            );
        }
    }

    #[test]
    fn erf_form_matches_known_normal_cdf_values() {
        // Φ(z) from mpmath at 40 digits.
        let known = [
            (1.0, 0.841_344_746_068_542_9),
            (-1.0, 0.158_655_253_931_457_05),
            (0.5, 0.691_462_461_274_013_1),
            (2.0, 0.977_249_868_051_820_8),
            (-3.0, 0.001_349_898_031_630_094_5),
            (-5.0, 2.866_515_718_791_939e-7),
            (-10.0, 7.619_853_024_160_526e-24),
            (-20.0, 2.753_624_118_606_233_7e-89),
            (-37.0, 5.725_571_222_524_577e-300),
        ];
        for (z, cdf) in known {
            assert!(
                (normal_cdf(z) / cdf - 1.0).abs() < 1e-13,
                "Φ({z}) = {} vs {cdf}",
                normal_cdf(z)
            );
            let v = gelu_erf(z);
            assert!((v / (z * cdf) - 1.0).abs() < 1e-13, "gelu_erf({z}) = {v}");
        }
        assert_eq!(normal_cdf(0.0), 0.5);
        // Φ(z) + Φ(−z) = 1.
        for z in gates() {
            let s = normal_cdf(z) + normal_cdf(-z);
            assert!(
                (s - 1.0).abs() <= 2.0 * f64::EPSILON,
                "Φ({z}) + Φ(−{z}) = {s}"
            );
        }
    }

    /// Central differences of `f` at `z`: a step of 1e-6 relative to the scale on which `f`
    /// varies (1/|z| in the lower tail, where it behaves like e^{−z²/2} or e^{u}).
    fn central(f: fn(f64) -> f64, z: f64) -> f64 {
        let h = if z < -1.0 { 1e-6 / -z } else { 1e-6 };
        (f(z + h) - f(z - h)) / (2.0 * h)
    }

    #[test]
    fn gradients_match_finite_differences() {
        for z in gates() {
            // Bound the comparison by the magnitudes of gelu''s terms (cancellation near its
            // zero), plus the relative size of the tail values themselves.
            let u = tanh_u(z);
            let du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * z * z);
            let cases = [
                (
                    "tanh",
                    gelu_tanh as fn(f64) -> f64,
                    gelu_tanh_grad(z),
                    sigmoid(u) * (1.0 + (z * du).abs() * sigmoid(-u)),
                ),
                (
                    "erf",
                    gelu_erf,
                    gelu_erf_grad(z),
                    normal_cdf(z) + (z * (-0.5 * z * z).exp() * FRAC_1_SQRT_2PI).abs(),
                ),
            ];
            for (form, f, grad, terms) in cases {
                if f(z).abs() < 1e-280 && z != 0.0 {
                    continue; // deep in f64's subnormals: no digits to difference
                }
                let fd = central(f, z);
                assert!(
                    (fd - grad).abs() <= 1e-7 * terms,
                    "{form}: gelu'({z}) = {grad:e} vs finite differences {fd:e}"
                );
                assert!((-0.2..=1.2).contains(&grad), "{form} {z}");
            }
        }
        // The zeros of gelu' (the minimum of gelu): −0.751792 (exact), −0.752461 (tanh).
        assert!(gelu_erf_grad(-0.751793) < 0.0 && gelu_erf_grad(-0.751791) > 0.0);
        assert!(gelu_tanh_grad(-0.752462) < 0.0 && gelu_tanh_grad(-0.752460) > 0.0);
    }

    #[test]
    fn extremes_are_finite_with_the_right_limits() {
        for f in [gelu_tanh, gelu_erf] {
            for z in [60.0, 1e4, 65504.0, f32::MAX as f64, 1e300, f64::MAX] {
                assert_eq!(f(z), z);
                assert_eq!(f(-z), 0.0);
            }
            assert_eq!(f(f64::INFINITY), f64::INFINITY);
            assert_eq!(f(f64::NEG_INFINITY), 0.0);
            assert!(f(f64::NAN).is_nan());
        }
        for f in [gelu_tanh_grad, gelu_erf_grad] {
            for z in [60.0, 1e4, 65504.0, f32::MAX as f64, 1e300, f64::MAX] {
                assert_eq!(f(z), 1.0);
                assert_eq!(f(-z), 0.0);
            }
            assert_eq!(f(f64::INFINITY), 1.0);
            assert_eq!(f(f64::NEG_INFINITY), 0.0);
            assert!(f(f64::NAN).is_nan());
        }
        // Through the cast points: an infinite bf16 gate, and a gate that overflows f32 only
        // after the multiplier.
        for erf in [false, true] {
            let a = [bf16::INFINITY, bf16::NEG_INFINITY, bf16::MAX, bf16::MIN];
            let c = fwd(&a, &[bf16::ONE; 4], 2.0, erf).unwrap();
            let c: Vec<f64> = c.iter().map(|v| v.to_f64()).collect();
            assert_eq!(c, [f64::INFINITY, 0.0, f64::INFINITY, 0.0], "erf {erf}");
            let g = bwd(&[bf16::ONE; 4], &a, &[bf16::ONE; 4], 2.0, 1.0, erf).unwrap();
            let da: Vec<f64> = g.da.iter().map(|v| v.to_f64()).collect();
            assert_eq!(da, [2.0, 0.0, 2.0, 0.0], "erf {erf}");
        }
    }

    #[test]
    fn cast_points_are_hfs_in_16_bits_and_swiglus_in_f32() {
        // c = D(D(gelu(z))·b), z = F(a·gm), and the inner rounding matters somewhere.
        for erf in [false, true] {
            let mut differs = 0;
            for i in 0..400 {
                let a = bf16::from_f64(-6.0 + 0.03 * i as f64);
                let b = bf16::from_f64(1.0 + 0.0137 * i as f64);
                let c = fwd(&[a], &[b], 1.0, erf).unwrap()[0];
                let z = a.to_f64();
                let want = bf16::from_f64(bf16::cast(gelu(z, erf)) * b.to_f64());
                assert_eq!(c, want, "a = {a}, b = {b}, erf {erf}");
                differs += usize::from(bf16::from_f64(gelu(z, erf) * b.to_f64()) != c);
            }
            assert!(differs > 0, "the inner rounding never mattered (erf {erf})");
        }
        let (a, gm) = (1.0f32 + f32::EPSILON, 1.0f32 + 3.0 * f32::EPSILON);
        let z = (a as f64 * gm as f64) as f32 as f64;
        assert_ne!(z, a as f64 * gm as f64);
        assert_eq!(
            fwd(&[a], &[1.0f32], gm, true).unwrap()[0],
            gelu_erf(z) as f32
        );
        // Backward in bf16 (autograd's): db = D(g·D(gelu(z))), da = D(D(g·b)·gelu'(z)·gm), and
        // both inner roundings matter somewhere.
        for erf in [false, true] {
            let (mut db_differs, mut da_differs) = (0, 0);
            for i in 0..400 {
                let a = bf16::from_f64(-6.0 + 0.03 * i as f64);
                let b = bf16::from_f64(1.0 + 0.0137 * i as f64);
                let dc = bf16::from_f64(0.9 - 0.0041 * i as f64);
                let r = bwd(&[dc], &[a], &[b], 1.0, 1.0, erf).unwrap();
                let (z, g, b) = (a.to_f64(), dc.to_f64(), b.to_f64());
                let db = bf16::from_f64(g * bf16::cast(gelu(z, erf)));
                let da = bf16::from_f64(bf16::cast(g * b) * gelu_grad(z, erf));
                assert_eq!((r.da[0], r.db[0]), (da, db), "a = {a}, b = {b}, erf {erf}");
                db_differs += usize::from(bf16::from_f64(g * gelu(z, erf)) != db);
                da_differs += usize::from(bf16::from_f64(g * gelu_grad(z, erf) * b) != da);
            }
            assert!(
                db_differs > 0 && da_differs > 0,
                "erf {erf}: {db_differs} {da_differs}"
            );
        }
        // In f32: g = F(dc·dm), db = D(g·gelu(z)), da = D(g·gelu'(z)·gm·b).
        let (dc, a, b, gm, dm) = (1.3f32, -0.7f32, 2.1f32, 1.1f32, 0.9f32);
        let z = (a as f64 * gm as f64) as f32 as f64;
        let g = (dc as f64 * dm as f64) as f32 as f64;
        for erf in [false, true] {
            let r = bwd(&[dc], &[a], &[b], gm, dm, erf).unwrap();
            assert_eq!(r.db[0], (g * gelu(z, erf)) as f32);
            let da = g * gelu_grad(z, erf) * gm as f64 * b as f64;
            assert_eq!(r.da[0], da as f32);
        }
        // dm scales both gradients linearly.
        let (dc, a, b) = ([0.7f64, -1.3], [0.4f64, -2.2], [1.5f64, 0.8]);
        let g1 = bwd(&dc, &a, &b, 0.5, 1.0, true).unwrap();
        let g2 = bwd(&dc, &a, &b, 0.5, 2.0, true).unwrap();
        for i in 0..2 {
            assert_eq!((g2.da[i], g2.db[i]), (2.0 * g1.da[i], 2.0 * g1.db[i]));
        }
    }

    #[test]
    fn rejects_bad_shapes_and_multipliers() {
        let v = [1.0f64; 6];
        let bad = |r: Result<Vec<f64>>, arg: &str| match r {
            Err(Error::InvalidArgument { arg: a, .. }) if a == arg => {}
            other => panic!("expected InvalidArgument for `{arg}`, got {other:?}"),
        };
        let args = SwigluArgs::new(2, 3);
        for erf in [false, true] {
            bad(geglu_forward(&args, &v, &v[..5], erf), "b");
            bad(
                geglu_forward(&SwigluArgs::new(6, 0), &v, &v, erf),
                "args.cols",
            );
            bad(
                geglu_forward(&SwigluArgs::fused(3, 2), &v, &v, erf),
                "args.a_stride",
            );
            let nan_gm = args.with_gate_multiplier(f32::NAN);
            bad(geglu_forward(&nan_gm, &v, &v, erf), "args.gate_multiplier");
            let grads = |r: Result<GegluGrads<f64>>| r.map(|g| g.da);
            bad(grads(geglu_backward(&args, &v[..5], &v, &v, erf)), "dc");
            bad(grads(geglu_backward(&args, &v, &v, &v[..4], erf)), "b");
            let inf_gm = args.with_gate_multiplier(f32::NEG_INFINITY);
            bad(
                grads(geglu_backward(&inf_gm, &v, &v, &v, erf)),
                "args.gate_multiplier",
            );
            let inf_dm = args.with_down_multiplier(f32::INFINITY);
            bad(
                grads(geglu_backward(&inf_dm, &v, &v, &v, erf)),
                "args.down_multiplier",
            );
        }
    }
}
