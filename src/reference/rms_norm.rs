//! RMSNorm on the CPU: HuggingFace's cast points (see `rms_norm_forward`, `CastingMode`) with f64 in between.
//!
//! `x` is widened exactly, `D(·)` rounds to the element type, `F(·)` rounds to f32
//! ([`Element::cast_f32`]) where HuggingFace materialises an f32 tensor (`h = x·r`, the weight
//! sum, their product), and `r` is the row's inverse RMS. Sums are f64.
//!
//! | mode  | `r`                                  | `y` (with weight `w`)                   |
//! |-------|--------------------------------------|-----------------------------------------|
//! | llama | `F(1/√(Σx²/n + eps))`                 | `D(F(D(F(x·r)) · F(offset + w)))`       |
//! | gemma | `F(1/√(Σx²/n + eps))`                 | `D(F(F(x·r) · F(offset + w)))`          |
//! | none  | `D(1/D(√D(D(ΣD(x²)/n) + D(eps))))`   | `D(D(x·r) · D(D(offset) + w))`          |
//!
//! Without a weight `y = D(F(x·r))`. Backward, with `wp = F(w + offset)` (`D(w + D(offset))`
//! in none; 1 without a weight): `m = D(F(dy·wp))` (llama), `F(dy·wp)` (gemma), `D(dy·wp)`
//! (none); `dx = D(r·m − r³/n·(Σ m·x)·x)`; `dw = D(Σ_rows dy·D(F(x·r)))` (llama) or
//! `D(Σ_rows dy·x·r)` (gemma, none).
use super::Element;
use crate::CastingMode;
use crate::error::{Result, invalid};

/// Forward results: `y` (rows × cols, contiguous) and each row's stored rstd.
///
/// ```
/// use liger_rs::{CastingMode, reference::rms_norm_forward};
/// let out = rms_norm_forward(&[3.0f64, 4.0], None, 2, 0.0, 0.0, CastingMode::Llama).unwrap();
/// assert_eq!((out.y.len(), out.rstd.len()), (2, 1));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNormOutput<T> {
    /// Normalised (and weighted) rows.
    pub y: Vec<T>,
    /// Per-row inverse RMS as the kernels store it (an f32 value, or a `D` value in none).
    pub rstd: Vec<f64>,
}

/// Backward results.
///
/// ```
/// use liger_rs::{CastingMode, reference::rms_norm_backward};
/// let g = rms_norm_backward(&[1.0f64, 1.0], &[3.0, 4.0], Some(&[1.0, 1.0]), &[0.25], 2, 0.0, CastingMode::Gemma).unwrap();
/// assert_eq!((g.dx.len(), g.dw.map(|d| d.len())), (2, Some(2)));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNormGrads<T> {
    /// Gradient of the input (rows × cols).
    pub dx: Vec<T>,
    /// Gradient of the weight (cols), when there is a weight.
    pub dw: Option<Vec<T>>,
}

fn check_shape<T>(name: &'static str, data: &[T], cols: usize) -> Result<usize> {
    if cols == 0 {
        return Err(invalid("cols", "at least 1", 0));
    }
    if !data.len().is_multiple_of(cols) {
        return Err(invalid(
            name,
            format!("a multiple of cols = {cols} elements"),
            data.len(),
        ));
    }
    Ok(data.len() / cols)
}

fn check_weight<T>(weight: Option<&[T]>, cols: usize) -> Result<()> {
    match weight {
        Some(w) if w.len() != cols => {
            Err(invalid("weight", format!("length {cols} (cols)"), w.len()))
        }
        _ => Ok(()),
    }
}

/// The RMSNorm forward of contiguous `rows × cols` data (`rows = x.len() / cols`).
///
/// ```
/// use liger_rs::{CastingMode, reference::rms_norm_forward};
/// let out = rms_norm_forward(&[3.0f64, 4.0], None, 2, 0.0, 0.0, CastingMode::Llama).unwrap();
/// let r = 1.0 / 12.5f64.sqrt();
/// assert!((out.y[1] - 4.0 * r).abs() < 1e-15);
/// ```
pub fn rms_norm_forward<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f32,
    offset: f32,
    mode: CastingMode,
) -> Result<RmsNormOutput<T>> {
    let rows = check_shape("x", x, cols)?;
    check_weight(weight, cols)?;
    let (eps, offset) = (eps as f64, offset as f64);
    let mut y = Vec::with_capacity(x.len());
    let mut rstd = Vec::with_capacity(rows);
    for row in x.chunks(cols) {
        let n = cols as f64;
        let r = if mode == CastingMode::None {
            let s: f64 = row.iter().map(|v| T::cast(v.to_f64() * v.to_f64())).sum();
            let mean = T::cast(s / n);
            T::cast(1.0 / T::cast(T::cast(mean + T::cast(eps)).sqrt()))
        } else {
            let s: f64 = row.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            T::cast_f32(1.0 / (s / n + eps).sqrt())
        };
        rstd.push(r);
        for (c, v) in row.iter().enumerate() {
            let v = v.to_f64();
            let f = T::cast_f32;
            let out = match weight.map(|w| w[c].to_f64()) {
                None if mode == CastingMode::None => v * r,
                None => f(v * r),
                Some(w) => match mode {
                    CastingMode::Llama => f(T::cast(f(v * r)) * f(offset + w)),
                    CastingMode::Gemma => f(f(v * r) * f(offset + w)),
                    CastingMode::None => T::cast(v * r) * T::cast(T::cast(offset) + w),
                },
            };
            y.push(T::from_f64(out));
        }
    }
    Ok(RmsNormOutput { y, rstd })
}

/// The RMSNorm backward: `dx` and, with a weight, `dw`, from `dy`, `x` and the forward's rstd.
///
/// ```
/// use liger_rs::{CastingMode, reference::rms_norm_backward};
/// // x = [1, 1], r = 1, dy = [1, −1]: the dot product Σ dy·x is 0, so dx = r·dy.
/// let g = rms_norm_backward(&[1.0f64, -1.0], &[1.0, 1.0], None, &[1.0], 2, 0.0, CastingMode::Llama).unwrap();
/// assert_eq!(g.dx, vec![1.0, -1.0]);
/// assert!(g.dw.is_none());
/// ```
pub fn rms_norm_backward<T: Element>(
    dy: &[T],
    x: &[T],
    weight: Option<&[T]>,
    rstd: &[f64],
    cols: usize,
    offset: f32,
    mode: CastingMode,
) -> Result<RmsNormGrads<T>> {
    let rows = check_shape("x", x, cols)?;
    check_weight(weight, cols)?;
    if dy.len() != x.len() {
        return Err(invalid(
            "dy",
            format!("length {} (like x)", x.len()),
            dy.len(),
        ));
    }
    if rstd.len() != rows {
        return Err(invalid("rstd", format!("length {rows} (rows)"), rstd.len()));
    }
    let offset = offset as f64;
    let wp: Option<Vec<f64>> = weight.map(|w| {
        w.iter()
            .map(|w| match mode {
                CastingMode::None => T::cast(w.to_f64() + T::cast(offset)),
                _ => T::cast_f32(w.to_f64() + offset),
            })
            .collect()
    });
    let grad = |g: f64, c: usize| match (&wp, mode) {
        (None, _) => g,
        (Some(wp), CastingMode::Llama) => T::cast(T::cast_f32(g * wp[c])),
        (Some(wp), CastingMode::Gemma) => T::cast_f32(g * wp[c]),
        (Some(wp), CastingMode::None) => T::cast(g * wp[c]),
    };
    let mut dx = Vec::with_capacity(x.len());
    let mut dw_acc = vec![0.0f64; cols];
    for ((dyr, xr), &r) in dy.chunks(cols).zip(x.chunks(cols)).zip(rstd) {
        let dot: f64 = (0..cols)
            .map(|c| grad(dyr[c].to_f64(), c) * xr[c].to_f64())
            .sum();
        let coef = r * r * r * dot / cols as f64;
        for c in 0..cols {
            let (g, v) = (dyr[c].to_f64(), xr[c].to_f64());
            dx.push(T::from_f64(r * grad(g, c) - coef * v));
            let normed = if mode == CastingMode::Llama {
                T::cast(T::cast_f32(v * r))
            } else {
                v * r
            };
            dw_acc[c] += g * normed;
        }
    }
    let dw = weight.map(|_| dw_acc.into_iter().map(T::from_f64).collect());
    Ok(RmsNormGrads { dx, dw })
}
