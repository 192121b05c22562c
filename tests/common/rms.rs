//! The error bounds of RMSNorm's GPU tests against the f64 reference, shared by plain RMSNorm
//! (`tests/rms_norm.rs`) and fused add + RMSNorm (`tests/fused_add_rms_norm.rs`), whose
//! kernels normalise and differentiate the same way.
use liger_rs::CastingMode;
use liger_rs::reference::Element;

/// Unit roundoff of f32 arithmetic.
const F32_EPS: f64 = 1.0 / (1u64 << 24) as f64;

/// Allowed rounding differences (ulps of `T`) in `y`, `rstd` and `dx`/`dw`, against the f64
/// reference with the same cast points. GPU and reference differ only where f32 arithmetic
/// (sum order, f32 instead of f64 products) moves an intermediate across a rounding boundary
/// of `T`; each crossing costs one ulp of `T`. `y` has two rounding points (three in none
/// mode, whose rstd is itself a `T` value); an f32 rstd may differ by a few f32 ulps (the sum
/// of up to 10⁵ squares runs in another order: ≤ 98 per thread, then a tree).
/// For f32 tensors the allowance is ~1e-5 relative (84 ulps).
pub fn ulps<T: Element>(mode: CastingMode) -> [f64; 3] {
    if T::NAME == "f32" {
        return [84.0; 3];
    }
    let f32_ulps_in_t = 2f64.powi(T::MANTISSA_DIGITS as i32 - 24);
    match mode {
        // none: the mean is rounded to T from an f32 sum; when that sum sits next to a
        // rounding boundary of T the mean may round the other way than the f64 one (1 ulp),
        // which √ and 1/x carry into rstd as up to 2 ulps of T (seen: f16, 1000×64), and y
        // (x·r rounded, times the weight, rounded) one more on top of its 3 roundings (seen:
        // 4 ulps in f16, 6400×4096).
        CastingMode::None => [4.0, 2.0, 2.0],
        _ => [2.0, 8.0 * f32_ulps_in_t, 2.0],
    }
}

/// Per-element slack for `dx = D(r·m − c·x + ds)` (`ds`: the fused add's gradient of the sum,
/// `None` for plain RMSNorm) and `dw = D(Σ_rows dy·n)`, whose f32 terms can be far larger
/// than the result (a single column cancels almost completely). `dx`: 8 f32 roundings of
/// `|r·m| + |c·x|` (the reference rounds `m` at the kernel's cast points, so `m` itself
/// agrees) and 2 of `|ds|`. `dw`: f32 accumulation over the rows, `(8 + 2√rows)` roundings
/// of `Σ|dy·x·r|`. `x` is the normalised input (the fused add's sum).
pub fn grad_slack<T: Element>(
    dy: &[T],
    ds: Option<&[T]>,
    x: &[T],
    w: Option<&[T]>,
    rstd: &[f64],
    cols: usize,
    offset: f32,
) -> (Vec<f64>, Vec<f64>) {
    let rows = rstd.len();
    let mut dx_slack = Vec::with_capacity(x.len());
    let mut abs_terms = vec![0.0; cols];
    for (row, &r) in rstd.iter().enumerate() {
        let at = |c: usize| (dy[row * cols + c].to_f64(), x[row * cols + c].to_f64());
        let wp = |c: usize| w.map_or(1.0, |w| w[c].to_f64() + offset as f64);
        let dot: f64 = (0..cols).map(|c| (at(c).0 * wp(c) * at(c).1).abs()).sum();
        let coef = r * r * r * dot / cols as f64;
        for (c, term) in abs_terms.iter_mut().enumerate() {
            let (g, v) = at(c);
            let rm = (r * g * wp(c)).abs();
            let d = ds.map_or(0.0, |ds| ds[row * cols + c].to_f64().abs());
            dx_slack.push(8.0 * F32_EPS * (rm + coef * v.abs()) + 2.0 * F32_EPS * d);
            *term += (g * v * r).abs();
        }
    }
    let k = (8.0 + 2.0 * (rows as f64).sqrt()) * F32_EPS;
    (dx_slack, abs_terms.into_iter().map(|t| k * t).collect())
}
