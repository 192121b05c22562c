//! GEGLU's gate (GELU-mul forward and backward): the GLU kernels (`glu/mod.rs`: every path,
//! layout, multiplier and in-place mode) with GELU as the gate, in its tanh or exact (erf)
//! form, and that GELU's f32 math (semantics: the cast points in `src/reference/geglu.rs`;
//! host: `src/glu/`).
//!
//! The kernels' bodies are `glu_bodies!`'s: where SwiGLU's evaluate
//! `sigmoid_pair`/`silu_of`/`silu_grad_of`, these evaluate [`gelu_and_grad`], in the same order
//! of operations: forward `c = T(T::round(gelu(z))·b)` with `z = a·gm`; backward `g = dc·dm`
//! and, in f32, `db = g·gelu(z)`, `da = g·(gelu'(z)·gm)·b` (gelu' multiplies in before `b`, so
//! where it vanishes `da` is 0, not `∞·0`), in f16/bf16 autograd's `db = g·T::round(gelu(z))`,
//! `da = T::round(g·b)·(gelu'(z)·gm)`. The forward's unused gelu' compiles away.
//!
//! # Functions
//!
//! - tanh form (`ERF = false`): `gelu(z) = ½·z·(1 + tanh(y)) = z·σ(u)`, `y = √(2/π)·(z +
//!   0.044715·z³)`, `u = 2y`; `gelu'(z) = σ(u)·(1 + z·u'·(1 − σ(u)))`,
//!   `u' = 2·√(2/π)·(1 + 3·0.044715·z²)`.
//! - exact form (`ERF = true`): `gelu(z) = z·Φ(z)`, `gelu'(z) = Φ(z) + z·φ(z)`, with
//!   `Φ(z) = ½·erfc(−z/√2)` and `φ(z) = e^{−z²/2}/√(2π)`.
//!
//! Every finite `z` gives finite values; `z = ±∞` gives the limits gelu(−∞) = −0,
//! gelu(+∞) = +∞, gelu'(−∞) = 0, gelu'(+∞) = 1 (as SwiGLU's silu); NaN propagates. Inside the
//! exponentials `|z|` is clamped to 16, where both forms have saturated in f32 (σ(u), Φ(z)
//! are exactly 0 or 1, and below −16 gelu and gelu' are 0), which keeps `z²` and `z³` finite.
//!
//! # Numerics
//!
//! The lower tails decay like `e^{u}` (`|u|` reaches 104 at z ≈ −10.6, where gelu underflows)
//! and `e^{−z²/2}`, so an f32 rounding of the exponent moves the result by `|exponent|` ulps;
//! both forms therefore carry their exponent as an unevaluated f32 pair `hi + lo`:
//!
//! - tanh form: `u·log2 e = z·B + z³·A` with `B = 2·√(2/π)·log2 e`, `A = 0.044715·B`, each
//!   constant split in two f32, `z²` an exact pair and `z³` a near-exact one (FMA), the
//!   products' errors by FMA and the sum by TwoSum. Then `t = e^{−|u|}` is
//!   `ex2(−|hi|)·(1 ∓ lo·ln 2)` and, with `1 + t` kept as an exact pair, `r = 1/(1 + t)` is
//!   within a hair of correct rounding ([`recip_1_2`] and one correction); `σ`, `1 − σ` are
//!   `r`, `t·r` (z ≥ 0) or `t·r`, `r` (z < 0), as in SwiGLU's `sigmoid_pair` (which takes a
//!   plain f32 argument: fine for `|z|`-sized exponents, not for this cubic one).
//! - exact form: `e^{−x²/2} = ex2(−x²·log2 e/2)` with `x² = h + l` exact and `log2 e/2` split,
//!   corrected as above. For `|z| < 1`, `Φ(z) = ½ + z·S(z²)`, `S` a degree-5 polynomial; for
//!   `x = |z| ≥ 1`, `Φ(−x) = e^{−x²/2}·R(t)`, `t = 1/(1 + x/2)` (an exact pair `1 + x/2`,
//!   one correction: `t` within ½ ulp), `R` a degree-11 polynomial (the scaled Mills ratio
//!   `e^{x²/2}·Φ(−x)`), and `Φ(x) = 1 − Φ(−x)` (no cancellation: `Φ(−x) ≤ 0.16`). The lower
//!   tail needs no `1 + erf` cancellation, so `Φ` keeps its relative accuracy down to the
//!   subnormals; `gelu'(−x) = e^{−x²/2}·(R − x/√(2π))`.
//! - Where the exponent is below −64 the exponential is taken 2²⁴ larger and the final product
//!   scaled back (exactly, unless the result is subnormal), so that values that are normal do
//!   not lose bits to a subnormal `σ`, `e^{−x²/2}` or `Φ` on the way (`|z|·σ` is normal with
//!   `σ` subnormal for z ≈ −10).
//!
//! The coefficients of `S` and `R` (and the split constants) are this project's own fit:
//! `scripts/geglu_fit.py` (relative least squares at Chebyshev nodes, coefficients rounded to
//! f32 one at a time with the rest refitted) prints them, and replays these functions in f32
//! arithmetic with numpy (every operation rounded to f32, FMA rounded once, `ex2` and the
//! divisions correctly rounded) against f64 truth; with `ex2` and the reciprocals replaced that
//! way, this file compiled for the host gives the emulation's bits on 9.4·10⁶ inputs (all of
//! the sweep's binades, ±0, ±∞, NaN, subnormals). Fit error: `S` 2.8·10⁻⁸ relative (the f32
//! rounding of `S(0) = 1/√(2π)`), `R` 2.5·10⁻¹⁰. For sm_80 the value and derivative together
//! take about 70 PTX instructions per element in either form (the exact form's value alone
//! about 60), with no calls: one `ex2.approx.f32`, and `rcp.approx.ftz` (through
//! [`recip_1_2`]) or one `rcp.rn.f32`.
//!
//! # 16-bit types
//!
//! In f16 and bf16 the tanh form is [`gelu_tanh_and_grad_short`]: `u` in plain f32
//! (`z·(u₀ + u₂·z²)`, within 2 ulps) and SwiGLU's `sigmoid_pair(u)`, so `e^{−|u|}` carries
//! about `3.3·|u|` ulps (`|u|` < 104 wherever gelu is normal in f32), against the pair
//! arithmetic's few: at most `(4|u| + 24)·2⁻²⁴` relative (the tests' bound; an f32 replay with
//! an exact `ex2` reaches 1.3·10⁻⁵ at z = −8.9, where the bound is 1.7·10⁻⁵), 300 times below
//! a bf16 ulp, while the value is rounded to the 16-bit type before it is
//! used (`c`) or stored (`db`, `da`). It takes about 25 instructions per element for value and
//! derivative instead of 70, which bounded the 16-bit rows by compute (bf16 16384×14336
//! backward 771 µs, behind Liger's 701; PERFORMANCE.md, "GEGLU"). The exact form is
//! [`gelu_erf_and_grad_short`]: the long form's branches with the exponent `x²·log2 e/2` in
//! plain f32 (its rounding moves `e^{−x²/2}` by about `z²/2` units of 2⁻²⁴: 5·10⁻⁶ at z = −13,
//! where gelu is last normal in f32), `t`
//! from `rcp.approx`, `S` of degree 3 and `R` of degree 6 (`CDF_NEAR_0_SHORT`, `MILLS_SHORT`,
//! from `scripts/geglu_fit.py`), no scaling: within `(8z² + 72)·2⁻²⁴` relative (the replay's
//! worst: value 7.7·10⁻⁶, gelu' 1.03·10⁻⁵ of its larger term), plus `ex2.approx`'s 2 ulps;
//! the PTX of the bf16 `_vw` forward is 39 % shorter. A value that is normal in the 16-bit type
//! keeps at least 16 bits through a subnormal intermediate. f32 keeps the pair forms, whose
//! error the f32 outputs would show.
//!
//! # Accuracy
//!
//! Against the exact function of the f32 input `z` (the reference's `gelu(F(a·gm))`), every
//! f32 `z` with `2⁻⁸ ≤ |z| < 16` (2·10⁸ inputs), every 997th below and every 9973rd above,
//! where the exact value is normal (subnormal results: a few subnormal ulps):
//!
//! | form  | value                 | gelu', ulps of its larger term | gelu' where ≥ ½ of it  |
//! |-------|-----------------------|--------------------------------|------------------------|
//! | tanh  | 3.59 ulp (z = −3.728) | 5.08 ulp (z = −3.583)          | 6.89 ulp (z = −1.199)  |
//! | erf   | 5.13 ulp (z = −1.847) | 4.43 ulp (z = −0.964)          | 4.91 ulp (z = −1.266)  |
//!
//! gelu' is a difference of two terms that cancel at its zero (z ≈ −0.7525 tanh, −0.7518
//! exact), so its error is bounded relative to the larger term, `max(σ, |z·u'·σ·(1 − σ)|)` or
//! `max(Φ, |z·φ|)`; the last column is the relative error where the cancellation is at most
//! 2×. On the device `ex2.approx.f32` (≤ 2 ulp where the emulation rounds correctly) adds up
//! to 2 ulp to the exponential, so to what is proportional to it: the tanh form's `σ` for
//! z < 0, the exact form's `Φ(−|z|)` for `|z| ≥ 1` and its `φ`. None of these
//! bounds grows with `|z|`, unlike SwiGLU's (there the f32 exponent `−|z|·log2 e` costs
//! ≈ `|z|` ulps).
use super::{recip_1_2, sigmoid_pair};
use crate::{Elem, fma};
use core::intrinsics::exp2f32;

/// `2·√(2/π)·log2 e` as `hi + lo`: the tanh form's `u·log2 e = z·B + z³·A`.
const TANH_B_HI: f32 = 2.3022082;
const TANH_B_LO: f32 = 1.2948402e-8;
/// `0.044715·2·√(2/π)·log2 e` as `hi + lo`.
const TANH_A_HI: f32 = 1.0294324e-1;
const TANH_A_LO: f32 = -2.0161985e-9;
/// `u' = TANH_DU0 + TANH_DU2·z²`: `2·√(2/π)` and `3·0.044715·2·√(2/π)`.
const TANH_DU0: f32 = 1.5957692;
const TANH_DU2: f32 = 2.1406445e-1;
/// `0.044715·2·√(2/π)`: `u = z·(TANH_DU0 + TANH_U2·z²)` in plain f32 (16-bit types).
const TANH_U2: f32 = 7.1354814e-2;
/// `log2 e / 2` as `hi + lo`: `e^{−x²/2} = 2^{−x²·(hi + lo)}`.
const HALF_LOG2_E_HI: f32 = 7.213475e-1;
const HALF_LOG2_E_LO: f32 = 9.629815e-9;
const LN_2: f32 = 6.931472e-1;
const FRAC_1_SQRT_2PI: f32 = 3.989423e-1;
/// `S(s)`, `Φ(z) = ½ + z·S(z²)` for `|z| < 1` (coefficients of `s⁰ … s⁵`).
const CDF_NEAR_0: [f32; 6] = [
    3.989423e-1,
    -6.649059e-2,
    9.974603e-3,
    -1.1892292e-3,
    1.1636525e-4,
    -8.6949485e-6,
];
/// `R(t) ≈ e^{x²/2}·Φ(−x)`, `t = 1/(1 + x/2)`, for `1 ≤ x ≤ 16` (coefficients of `t⁰ … t¹¹`).
const MILLS: [f32; 12] = [
    3.9228603e-8,
    1.9946888e-1,
    1.9952819e-1,
    1.4876729e-1,
    5.779144e-2,
    -1.13437146e-1,
    1.1681221e-1,
    -7.4498063e-1,
    1.6077683,
    -1.6442188,
    8.6061734e-1,
    -1.883083e-1,
];

/// The 16-bit types' `S` (degree 3) and `R` (degree 6): [`gelu_erf_and_grad_short`].
const CDF_NEAR_0_SHORT: [f32; 4] = [3.9894146e-1, -6.6464886e-2, 9.846467e-3, -9.789584e-4];
const MILLS_SHORT: [f32; 7] = [
    1.0267443e-5,
    1.9914679e-1,
    2.0366132e-1,
    1.209534e-1,
    1.6121647e-1,
    -3.021296e-1,
    1.1835765e-1,
];

/// `|z|` beyond which both forms have saturated in f32 (σ(u), Φ(z) ∈ {0, 1}, gelu and gelu'
/// 0 below −16): the exponentials see `z` clamped to ±16.
const CLAMP: f32 = 16.0;
/// Base-2 exponents below `−SCALE_FROM` are raised by `SCALE_UP` (exactly: `SCALE_UP − p` is
/// exact for `p ≥ 12`) and the result multiplied by `SCALE_DOWN = 2^{−SCALE_UP}`.
const SCALE_FROM: f32 = 64.0;
const SCALE_UP: f32 = 24.0;
const SCALE_DOWN: f32 = 5.9604645e-8;

/// `z` with its magnitude clamped to [`CLAMP`]; NaN stays NaN.
#[inline(always)]
fn clamp(z: f32) -> f32 {
    if z.abs() > CLAMP {
        CLAMP.copysign(z)
    } else {
        z
    }
}

/// `c[0] + c[1]·x + … + c[N−1]·x^{N−1}` by Horner with FMAs.
#[inline(always)]
fn horner<const N: usize>(c: &[f32; N], x: f32) -> f32 {
    let mut acc = c[N - 1];
    let mut i = N - 1;
    while i > 0 {
        i -= 1;
        acc = fma(acc, x, c[i]);
    }
    acc
}

/// The tanh form's sigmoid at `u = 2·√(2/π)·(z + 0.044715·z³)`.
struct TanhSigmoid {
    /// `σ(u)/scale`.
    sig: f32,
    /// `1 − σ(u)` (unscaled; only added to 1).
    one_minus: f32,
    /// 1, or 2⁻²⁴ where `σ` was taken 2²⁴ larger (z < 0, `u·log2 e < −64`).
    scale: f32,
    /// `z·u'` at the clamped `z` (finite).
    zdu: f32,
}

#[inline(always)]
fn tanh_sigmoid(z: f32) -> TanhSigmoid {
    let zc = clamp(z);
    // z² as an exact pair, z³ as a pair within a few ulps of its low part.
    let z2 = zc * zc;
    let z2l = fma(zc, zc, -z2);
    let z3 = z2 * zc;
    let z3l = fma(z2l, zc, fma(z2, zc, -z3));
    // w = u·log2 e = z·B + z³·A as s + wl: each product with its error, then TwoSum.
    let p1 = TANH_B_HI * zc;
    let e1 = fma(TANH_B_LO, zc, fma(TANH_B_HI, zc, -p1));
    let p2 = TANH_A_HI * z3;
    let e2 = fma(TANH_A_HI, z3l, fma(TANH_A_LO, z3, fma(TANH_A_HI, z3, -p2)));
    let s = p1 + p2;
    let bb = s - p1;
    let wl = ((p1 - (s - bb)) + (p2 - bb)) + (e1 + e2);
    // t = e^{−|u|} = 2^{−|s ± wl|} (2²⁴ larger when scaled).
    let sa = s.abs();
    let scaled = sa > SCALE_FROM && s < 0.0;
    let t = exp2f32(if scaled { SCALE_UP - sa } else { -sa });
    let t = fma(t, (if s >= 0.0 { -wl } else { wl }) * LN_2, t);
    // r = 1/(1 + t) with 1 + t = hi + lo exact (scaled: t < 2⁻⁶⁴ and r = 1).
    let tu = if scaled { 0.0 } else { t };
    let hi = 1.0 + tu;
    let lo = tu - (hi - 1.0);
    let r0 = recip_1_2(hi);
    let r = fma(r0, fma(-hi, r0, 1.0) - lo * r0, r0);
    let tr = t * r;
    let (sig, one_minus) = if z >= 0.0 { (r, tr) } else { (tr, r) };
    TanhSigmoid {
        sig,
        one_minus,
        scale: if scaled { SCALE_DOWN } else { 1.0 },
        zdu: zc * fma(TANH_DU2, z2, TANH_DU0),
    }
}

/// The tanh form: `(gelu(z), gelu'(z))` (module docs).
#[inline(always)]
pub(crate) fn gelu_tanh_and_grad(z: f32) -> (f32, f32) {
    let TanhSigmoid {
        sig,
        one_minus,
        scale,
        zdu,
    } = tanh_sigmoid(z);
    if sig == 0.0 {
        // z → −∞ (or below −16): −0 and 0, not ∞·0.
        return (-0.0, 0.0);
    }
    (z * sig * scale, sig * fma(zdu, one_minus, 1.0) * scale)
}

/// The exact form: `(gelu(z), gelu'(z)) = (z·Φ(z), Φ(z) + z·φ(z))` (module docs).
#[inline(always)]
pub(crate) fn gelu_erf_and_grad(z: f32) -> (f32, f32) {
    let x = z.abs();
    let xc = clamp(x);
    let zc = xc.copysign(z);
    // e = e^{−x²/2} = 2^{−p − pl} (2²⁴ larger when scaled), x² = h + hl exact.
    let h = xc * xc;
    let hl = fma(xc, xc, -h);
    let p = h * HALF_LOG2_E_HI;
    let pl = fma(
        hl,
        HALF_LOG2_E_HI,
        fma(h, HALF_LOG2_E_LO, fma(h, HALF_LOG2_E_HI, -p)),
    );
    let scaled = p > SCALE_FROM;
    let e = exp2f32(if scaled { SCALE_UP - p } else { -p });
    let e = fma(e, -pl * LN_2, e);
    let scale = if scaled { SCALE_DOWN } else { 1.0 };
    if x < 1.0 {
        // Φ(z) = ½ + z·S(z²) (h = z² here).
        let cdf = fma(z, horner(&CDF_NEAR_0, h), 0.5);
        return (z * cdf, fma(z, e * FRAC_1_SQRT_2PI, cdf));
    }
    // Φ(−x) = e·R(t), t = 1/(1 + x/2) from the exact pair d + dl = 1 + x/2.
    let d = fma(xc, 0.5, 1.0);
    let dl = xc * 0.5 - (d - 1.0);
    let t0 = 1.0 / d;
    let t = fma(t0, fma(-d, t0, 1.0) - dl * t0, t0);
    let r = horner(&MILLS, t);
    let q = e * r;
    if z < 0.0 {
        // gelu = −x·Φ(−x), gelu' = e^{−x²/2}·(R − x/√(2π)); −0 at −∞, not ∞·0.
        let gelu = if q == 0.0 { -0.0 } else { z * q * scale };
        (gelu, e * fma(zc, FRAC_1_SQRT_2PI, r) * scale)
    } else {
        // Φ(x) = 1 − Φ(−x) (NaN lands here and stays NaN).
        let cdf = 1.0 - q * scale;
        (z * cdf, fma(zc, e * scale * FRAC_1_SQRT_2PI, cdf))
    }
}

/// The exact form for 16-bit types: [`gelu_erf_and_grad`]'s branches with the exponent
/// `x²·log2 e/2` in plain f32, `t = 1/(1 + x/2)` from `rcp.approx`, the shorter [`CDF_NEAR_0_SHORT`]
/// and [`MILLS_SHORT`], and no scaling (module docs, "16-bit types").
#[inline(always)]
pub(crate) fn gelu_erf_and_grad_short(z: f32) -> (f32, f32) {
    let x = z.abs();
    let xc = clamp(x);
    let zc = xc.copysign(z);
    let h = xc * xc;
    let e = exp2f32(-(h * HALF_LOG2_E_HI));
    if x < 1.0 {
        let cdf = fma(z, horner(&CDF_NEAR_0_SHORT, h), 0.5);
        return (z * cdf, fma(z, e * FRAC_1_SQRT_2PI, cdf));
    }
    // SAFETY: a pure register operation (1 + x/2 lies in [1.5, 9], or is NaN).
    let t = unsafe { super::rcp_approx_ftz(fma(xc, 0.5, 1.0)) };
    let r = horner(&MILLS_SHORT, t);
    let q = e * r;
    if z < 0.0 {
        let gelu = if q == 0.0 { -0.0 } else { z * q };
        (gelu, e * fma(zc, FRAC_1_SQRT_2PI, r))
    } else {
        let cdf = 1.0 - q;
        (z * cdf, fma(zc, e * FRAC_1_SQRT_2PI, cdf))
    }
}

/// The tanh form for 16-bit types: `u` in plain f32 and SwiGLU's `sigmoid_pair` of it, no
/// exponent pair and no scaling (module docs, "16-bit types").
#[inline(always)]
pub(crate) fn gelu_tanh_and_grad_short(z: f32) -> (f32, f32) {
    let zc = clamp(z);
    let z2 = zc * zc;
    let (sig, one_minus) = sigmoid_pair(zc * fma(TANH_U2, z2, TANH_DU0));
    if sig == 0.0 {
        // z → −∞ (or below −16): −0 and 0, not ∞·0.
        return (-0.0, 0.0);
    }
    let zdu = zc * fma(TANH_DU2, z2, TANH_DU0);
    (z * sig, sig * fma(zdu, one_minus, 1.0))
}

/// `(gelu(z), gelu'(z))` in the form `ERF` picks, for elements of type `T`: the tanh form of
/// the 16-bit types is [`gelu_tanh_and_grad_short`].
#[inline(always)]
pub(crate) fn gelu_and_grad<T: Elem, const ERF: bool>(z: f32) -> (f32, f32) {
    if ERF && T::PER_WORD == 2 {
        gelu_erf_and_grad_short(z)
    } else if ERF {
        gelu_erf_and_grad(z)
    } else if T::PER_WORD == 2 {
        gelu_tanh_and_grad_short(z)
    } else {
        gelu_tanh_and_grad(z)
    }
}

/// `gelu(z)` from [`gelu_and_grad`]'s first value: the kernels' `act`.
#[inline(always)]
pub(crate) fn gelu_of(_: f32, gelu: f32) -> f32 {
    gelu
}

/// `gelu'(z)` from [`gelu_and_grad`]'s second value: the kernels' `act'`.
#[inline(always)]
pub(crate) fn gelu_grad_of(_: f32, _: f32, grad: f32) -> f32 {
    grad
}

/// GEGLU's kernel bodies, GELU's tanh form.
pub(crate) mod tanh {
    use super::super::*;
    use super::{gelu_and_grad, gelu_grad_of, gelu_of};
    glu_bodies!(
        gelu_and_grad::<T, false>,
        gelu_of,
        gelu_grad_of,
        unroll_items,
        true,
        #[inline(always)]
    );
}

/// GEGLU's kernel bodies, GELU's exact form.
pub(crate) mod erf {
    use super::super::*;
    use super::{gelu_and_grad, gelu_grad_of, gelu_of};
    glu_bodies!(
        gelu_and_grad::<T, true>,
        gelu_of,
        gelu_grad_of,
        unroll_items,
        true,
        #[inline(always)]
    );
}

glu_kernels!(gelu::tanh, GeluTanh, F32);
glu_kernels!(gelu::tanh, GeluTanh, F16);
glu_kernels!(gelu::tanh, GeluTanh, Bf16);
glu_kernels!(gelu::erf, GeluErf, F32);
glu_kernels!(gelu::erf, GeluErf, F16);
glu_kernels!(gelu::erf, GeluErf, Bf16);
