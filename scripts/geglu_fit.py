#!/usr/bin/env python3
"""Where the constants of kernels-gpu/src/glu/gelu.rs come from, and how its accuracy was measured.

    pip install numpy scipy mpmath
    python3 scripts/geglu_fit.py          # constants, then the error sweep (every f32 in ±[2⁻⁸, 16])
    python3 scripts/geglu_fit.py 13       # the sweep on every 13th f32 there (quick)

Fit: relative least squares at 3000 Chebyshev nodes (near-minimax), then the coefficients
rounded to f32 one at a time from the constant term up, the higher ones refitted after each
rounding. Truth: scipy's f64 erf/erfcx/ndtr (≲ 1e-15 relative, far below f32's 6e-8).

Emulation: the device functions step by step in numpy float32 (every operation rounded to
f32), fma as one rounding (exact product and sum in f64 rounded to odd, then to f32), ex2 correctly
rounded (the device's ex2.approx.f32 adds up to 2 ulp to that one value), divisions correctly
rounded (div.rn.f32, and recip_1_2 gives the same bits).

The full sweep (about 6 minutes) gave the table in kernels-gpu/src/glu/gelu.rs: value 3.59 ulp
(tanh) and 5.13 ulp (erf); gelu' 5.08 and 4.43 ulp of its larger term. The 16-bit types' erf
form (plain f32 exponent, shorter polynomials) is swept last: value 118 ulp (7.7e-6 relative,
at z = −12.9), gelu' 114 ulp of its larger term (the sweep on every 257th f32; a dense random
sample gives 1.03e-5), within (8z² + 72)·2⁻²⁴ relative everywhere (the exponent's rounding
grows like z², the near-0 polynomial's fit error is ~4e-6).
"""
import sys
import mpmath as mp
import numpy as np
from scipy.special import erf, erfcx, ndtr

F = np.float32
SQ2PI = np.sqrt(2 * np.pi)
K, C = 0.7978845608028654, 0.044715  # √(2/π) and the cubic coefficient, as the f64 reference
XA, XB, DEG_A, DEG_B = 1.0, 16.0, 5, 11  # |z| < XA: Φ = ½ + z·S(z²); XA ≤ |z| ≤ XB: Q = e^{−x²/2}·R(t)


def cheb(lo, hi, n):
    k = np.arange(n)
    return 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(np.pi * (k + 0.5) / n)


def fit_f32(f, lo, hi, deg, n=3000):
    t = cheb(lo, hi, n)
    y = f(t)
    V = np.vander(t, deg + 1, increasing=True)
    fixed = []
    for i in range(deg + 1):
        r = y - (V[:, :i] @ np.array(fixed) if i else 0)
        c, *_ = np.linalg.lstsq(V[:, i:] / y[:, None], r / y, rcond=None)
        fixed.append(F(c[0]))
    return fixed


def S(s):  # (Φ(√s) − ½)/√s
    x = np.sqrt(s)
    safe = np.where(x > 0, x, 1.0)
    return np.where(x > 0, 0.5 * erf(safe / np.sqrt(2)) / safe, 1 / SQ2PI)


def R_of_t(t):  # R = Φ(−x)·e^{x²/2} at x = 2(1/t − 1), i.e. t = 1/(1 + x/2)
    return 0.5 * erfcx(2 * (1 / t - 1) / np.sqrt(2))


def split(v):  # v ≈ hi + lo, both f32
    hi = F(float(v))
    return hi, F(float(v - mp.mpf(float(hi))))


mp.mp.dps = 40
LOG2E = 1 / mp.log(2)
Bh, Bl = split(2 * mp.mpf(K) * LOG2E)  # u·log2 e = z·B + z³·A
Ah, Al = split(2 * mp.mpf(K) * mp.mpf(C) * LOG2E)
Lh, Ll = split(LOG2E / 2)  # x²/2·log2 e = x²·L
BN, AN3 = F(2 * K), F(6 * K * C)  # u' = BN + AN3·z²
LN2, ISQ2PI = F(float(mp.log(2))), F(float(1 / mp.sqrt(2 * mp.pi)))
cA = fit_f32(S, 0.0, XA * XA, DEG_A)
cB = fit_f32(R_of_t, 1 / (1 + 0.5 * XB), 1 / (1 + 0.5 * XA), DEG_B)
# The 16-bit types' exact form (gelu_erf_and_grad_short): degrees 3 and 6.
cAs = fit_f32(S, 0.0, XA * XA, 3)
cBs = fit_f32(R_of_t, 1 / (1 + 0.5 * XB), 1 / (1 + 0.5 * XA), 6)
TWOM24 = F(2.0**-24)


def fma(a, b, c):  # one rounding: exact f64 product, TwoSum, f64 rounded to odd, then to f32
    a, b, c = (np.asarray(v, F).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    ok = np.isfinite(s) & np.isfinite(err) & (err != 0)
    bits = s.view(np.uint64)
    bits = np.where(ok & (np.signbit(err) != np.signbit(s)), bits - np.uint64(1), bits)
    bits = np.where(ok, bits | np.uint64(1), bits)
    return bits.view(np.float64).astype(F)


def ex2(x):
    return np.exp2(x.astype(np.float64)).astype(F)


def horner(c, x):
    acc = np.full_like(x, c[-1])
    for ci in reversed(c[:-1]):
        acc = fma(acc, x, ci)
    return acc


def clamp(x, m):  # magnitude at most m, NaN kept
    return np.where(np.abs(x) > m, np.copysign(F(m), x), x).astype(F)


def gelu_tanh_both(z):
    zc = clamp(z, 16.0)
    z2 = zc * zc
    z2l = fma(zc, zc, -z2)
    z3 = z2 * zc
    z3l = fma(z2l, zc, fma(z2, zc, -z3))
    p1 = Bh * zc
    e1 = fma(Bl, zc, fma(Bh, zc, -p1))
    p2 = Ah * z3
    e2 = fma(Ah, z3l, fma(Al, z3, fma(Ah, z3, -p2)))
    s = p1 + p2
    bb = s - p1
    wl = ((p1 - (s - bb)) + (p2 - bb)) + (e1 + e2)
    sa = np.abs(s)
    big = (sa > F(64)) & (s < 0)
    t = ex2(np.where(big, F(24) - sa, -sa).astype(F))
    t = fma(t, np.where(s >= 0, -wl, wl).astype(F) * LN2, t)
    tu = np.where(big, F(0), t).astype(F)
    hi = F(1) + tu
    lo = tu - (hi - F(1))
    r0 = F(1) / hi
    r = fma(r0, fma(-hi, r0, F(1)) - lo * r0, r0)
    tr = t * r
    neg = ~(z >= 0)
    sig = np.where(neg, tr, r).astype(F)
    one_minus = np.where(neg, r, tr).astype(F)
    scale = np.where(big, TWOM24, F(1)).astype(F)
    gelu = np.where(sig == 0, F(-0.0), (z * sig) * scale).astype(F)
    q = zc * fma(AN3, z2, BN)
    grad = np.where(sig == 0, F(0), (sig * fma(q, one_minus, F(1))) * scale).astype(F)
    return gelu, grad


def gelu_erf_both(z):
    x = np.abs(z)
    xc = clamp(x, 16.0)
    zc = np.copysign(xc, z).astype(F)
    h = xc * xc
    hl = fma(xc, xc, -h)
    p = h * Lh
    pl = fma(hl, Lh, fma(h, Ll, fma(h, Lh, -p)))
    big = p > F(64)
    e = ex2(np.where(big, F(24) - p, -p).astype(F))
    e = fma(e, -pl * LN2, e)
    scale = np.where(big, TWOM24, F(1)).astype(F)
    cdf_a = fma(z, horner(cA, h), F(0.5))
    gelu_a = z * cdf_a
    grad_a = fma(z, e * ISQ2PI, cdf_a)
    d = fma(xc, F(0.5), F(1))
    dl = xc * F(0.5) - (d - F(1))
    t0 = F(1) / d
    t = fma(t0, fma(-d, t0, F(1)) - dl * t0, t0)
    R = horner(cB, t)
    q = e * R
    gelu_n = np.where(q == 0, F(-0.0), (z * q) * scale).astype(F)
    grad_n = (e * fma(zc, ISQ2PI, R)) * scale
    cdf_p = F(1) - q * scale
    gelu_p = z * cdf_p
    grad_p = fma(zc, (e * scale) * ISQ2PI, cdf_p)
    small, neg = x < F(XA), z < 0
    gelu = np.where(small, gelu_a, np.where(neg, gelu_n, gelu_p)).astype(F)
    grad = np.where(small, grad_a, np.where(neg, grad_n, grad_p)).astype(F)
    return gelu, grad


def gelu_erf_short(z):  # plain f32 exponent, rcp.approx taken as correctly rounded, no scaling
    x = np.abs(z)
    xc = clamp(x, 16.0)
    zc = np.copysign(xc, z).astype(F)
    h = xc * xc
    e = ex2((-(h * Lh)).astype(F))
    cdf_a = fma(z, horner(cAs, h), F(0.5))
    gelu_a, grad_a = z * cdf_a, fma(z, e * ISQ2PI, cdf_a)
    t = F(1) / fma(xc, F(0.5), F(1))
    R = horner(cBs, t)
    q = e * R
    gelu_n = np.where(q == 0, F(-0.0), z * q).astype(F)
    grad_n = e * fma(zc, ISQ2PI, R)
    cdf_p = F(1) - q
    gelu_p, grad_p = z * cdf_p, fma(zc, e * ISQ2PI, cdf_p)
    small, neg = x < F(XA), z < 0
    gelu = np.where(small, gelu_a, np.where(neg, gelu_n, gelu_p)).astype(F)
    grad = np.where(small, grad_a, np.where(neg, grad_n, grad_p)).astype(F)
    return gelu, grad


def truth_tanh(z):  # value, derivative, the derivative's larger term (f64)
    z = z.astype(np.float64)
    u = 2 * K * (z + C * z**3)
    t = np.exp(-np.abs(u))
    r = 1 / (1 + t)
    s, om = np.where(u >= 0, r, t * r), np.where(u >= 0, t * r, r)
    zdu = z * 2 * K * (1 + 3 * C * z * z)
    return z * s, s * (1 + zdu * om), np.maximum(s, np.abs(zdu * om * s))


def truth_erf(z):
    z = z.astype(np.float64)
    P = ndtr(z)
    zphi = z * np.exp(-0.5 * z * z) / SQ2PI
    return z * P, P + zphi, np.maximum(P, np.abs(zphi))


def ulp(v):
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126))) - 23)


def sweep(name, fn, truth, step):
    ranges = [(2.0**-8, 16.0, step), (2.0**-126, 2.0**-8, 997), (16.0, 3.4e38, 9973)]
    worst = {"value": (0.0, 0.0), "derivative (ulps of its larger term)": (0.0, 0.0),
             "derivative where |gelu'| ≥ ½ its larger term": (0.0, 0.0)}
    n = 0
    for lo, hi, st in ranges:
        b = np.arange(F(lo).view(np.uint32), F(hi).view(np.uint32), st, dtype=np.uint32)
        for sign in (F(1), F(-1)):
            for i in range(0, len(b), 1 << 22):
                z = b[i:i + (1 << 22)].view(F) * sign
                g, d = fn(z)
                tv, td, terms = truth(z)
                n += len(z)
                normal_d = np.abs(td) >= 2.0**-126
                for key, err, mask in [
                    ("value", np.abs(g - tv) / ulp(tv), np.abs(tv) >= 2.0**-126),
                    ("derivative (ulps of its larger term)", np.abs(d - td) / ulp(terms), normal_d),
                    ("derivative where |gelu'| ≥ ½ its larger term", np.abs(d - td) / ulp(td),
                     normal_d & (np.abs(td) >= terms / 2)),
                ]:
                    e = np.where(mask, err, 0)
                    j = int(np.argmax(e))
                    if e[j] > worst[key][0]:
                        worst[key] = (float(e[j]), float(z[j]))
    print(f"{name}: {n} inputs")
    for key, (e, z) in worst.items():
        print(f"  {key}: {e:.2f} ulp (at z = {z!r})")


def lit(v):  # the shortest decimal that reads back as this f32
    return np.format_float_scientific(F(v), unique=True, trim="-").replace("e+00", "").replace("e-00", "e-").replace("e+", "e").replace("e-0", "e-")


def rust(name, v):
    return f"const {name}: f32 = {lit(v)};"


if __name__ == "__main__":
    np.seterr(all="ignore")
    for nm, v in [("TANH_B_HI", Bh), ("TANH_B_LO", Bl), ("TANH_A_HI", Ah), ("TANH_A_LO", Al),
                  ("TANH_DU0", BN), ("TANH_DU2", AN3), ("HALF_LOG2_E_HI", Lh),
                  ("HALF_LOG2_E_LO", Ll), ("LN_2", LN2), ("FRAC_1_SQRT_2PI", ISQ2PI)]:
        print(rust(nm, v))
    print("const CDF_NEAR_0: [f32; %d] = [%s];" % (len(cA), ", ".join(lit(c) for c in cA)))
    print("const MILLS: [f32; %d] = [%s];" % (len(cB), ", ".join(lit(c) for c in cB)))
    print("const CDF_NEAR_0_SHORT: [f32; %d] = [%s];" % (len(cAs), ", ".join(lit(c) for c in cAs)))
    print("const MILLS_SHORT: [f32; %d] = [%s];" % (len(cBs), ", ".join(lit(c) for c in cBs)))
    step = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    sweep("gelu_tanh", gelu_tanh_both, truth_tanh, step)
    sweep("gelu_erf", gelu_erf_both, truth_erf, step)
    sweep("gelu_erf_short (16-bit types)", gelu_erf_short, truth_erf, step)
