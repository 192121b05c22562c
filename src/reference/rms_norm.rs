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
use crate::error::{Result, invalid};
use crate::{CastingMode, RmsNormArgs};

/// Forward results: `y` (rows × cols, contiguous) and each row's stored rstd.
///
/// ```
/// use liger_rs::{RmsNormArgs, reference::rms_norm_forward};
/// let out = rms_norm_forward(&RmsNormArgs::new(1, 2).with_eps(0.0), &[3.0f64, 4.0], None).unwrap();
/// assert_eq!((out.y.len(), out.rstd.len()), (2, 1));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNormOutput<T: Element> {
    /// Normalised (and weighted) rows.
    pub y: Vec<T>,
    /// Per-row inverse RMS as the kernels store it (an f32 value, or a `D` value in none), in
    /// [`Element::Rstd`]: f32 as the GPU gives it, f64 for `f64` data.
    pub rstd: Vec<T::Rstd>,
}

/// Backward results.
///
/// ```
/// use liger_rs::{CastingMode, RmsNormArgs, reference::rms_norm_backward};
/// let args = RmsNormArgs::new(1, 2).with_mode(CastingMode::Gemma);
/// let g = rms_norm_backward(&args, &[1.0f64, 1.0], &[3.0, 4.0], Some(&[1.0, 1.0]), &[0.25]).unwrap();
/// assert_eq!((g.dx.len(), g.dw.map(|d| d.len())), (2, Some(2)));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNormGrads<T> {
    /// Gradient of the input (rows × cols).
    pub dx: Vec<T>,
    /// Gradient of the weight (cols), when there is a weight.
    pub dw: Option<Vec<T>>,
}

/// Checks the shape of `args` for the reference, which takes contiguous rows: `cols ≥ 1`
/// and both strides equal to `cols`. Returns `rows × cols`.
pub(crate) fn check_args(args: &RmsNormArgs) -> Result<usize> {
    let cols = args.cols;
    if cols == 0 {
        return Err(invalid("args.cols", "at least 1 column", cols));
    }
    for (arg, stride) in [
        ("args.x_stride", args.x_stride),
        ("args.y_stride", args.y_stride),
    ] {
        if stride != cols {
            let expected = format!("cols = {cols} (the reference takes contiguous rows)");
            return Err(invalid(arg, expected, stride));
        }
    }
    args.rows.checked_mul(cols).ok_or_else(|| {
        invalid(
            "args.rows",
            "rows × cols within usize",
            format!("{} × {cols}", args.rows),
        )
    })
}

/// Checks that `data` holds exactly `len` elements (`what` says what the count is).
pub(crate) fn check_len<T>(arg: &'static str, data: &[T], len: usize, what: &str) -> Result<()> {
    if data.len() != len {
        return Err(invalid(arg, format!("length {len} ({what})"), data.len()));
    }
    Ok(())
}

fn check_weight<T>(weight: Option<&[T]>, cols: usize) -> Result<()> {
    match weight {
        Some(w) => check_len("weight", w, cols, "cols"),
        None => Ok(()),
    }
}

/// The RMSNorm forward of `args.rows` contiguous rows of `args.cols` elements, with
/// `args.eps`, `args.offset` and `args.mode` (any values: the launchers' checks of eps and
/// offset are not repeated), as [`crate::rms_norm_forward`] computes it: `x` holds exactly
/// `rows × cols` elements, `weight` (if given) `cols`; strides other than `cols` are an
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
///
/// ```
/// use liger_rs::{RmsNormArgs, reference::rms_norm_forward};
/// let out = rms_norm_forward(&RmsNormArgs::new(1, 2).with_eps(0.0), &[3.0f64, 4.0], None).unwrap();
/// let r = 1.0 / 12.5f64.sqrt();
/// assert!((out.y[1] - 4.0 * r).abs() < 1e-15);
/// assert_eq!(out.rstd, vec![r]); // f64 data: rstd in f64
/// ```
pub fn rms_norm_forward<T: Element>(
    args: &RmsNormArgs,
    x: &[T],
    weight: Option<&[T]>,
) -> Result<RmsNormOutput<T>> {
    let len = check_args(args)?;
    check_len("x", x, len, "rows × cols")?;
    let (rows, cols, mode) = (args.rows, args.cols, args.mode);
    check_weight(weight, cols)?;
    let (eps, offset) = (args.eps as f64, args.offset as f64);
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
        rstd.push(T::Rstd::from_f64(r));
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

/// The RMSNorm backward: `dx` and, with a weight, `dw`, from `dy`, `x` and the forward's
/// rstd, as [`crate::rms_norm_backward`] computes them (shapes as [`rms_norm_forward`];
/// `dy` like `x`, `rstd` exactly `rows` long, as the GPU's rstd or [`RmsNormOutput::rstd`];
/// `args.eps` is not used).
///
/// ```
/// use liger_rs::{RmsNormArgs, reference::rms_norm_backward};
/// // x = [1, 1], r = 1, dy = [1, −1]: the dot product Σ dy·x is 0, so dx = r·dy.
/// let g = rms_norm_backward(&RmsNormArgs::new(1, 2), &[1.0f64, -1.0], &[1.0, 1.0], None, &[1.0]).unwrap();
/// assert_eq!(g.dx, vec![1.0, -1.0]);
/// assert!(g.dw.is_none());
/// ```
pub fn rms_norm_backward<T: Element>(
    args: &RmsNormArgs,
    dy: &[T],
    x: &[T],
    weight: Option<&[T]>,
    rstd: &[T::Rstd],
) -> Result<RmsNormGrads<T>> {
    backward(args, dy, None, x, weight, rstd, weight.is_some())
}

/// The RMSNorm backward of `dx` alone, for a frozen weight (or none): `dw` is `None` and not
/// computed, as [`crate::rms_norm_backward`] with a weight and `dw = None`; `dx` as
/// [`rms_norm_backward`] gives it. Arguments as [`rms_norm_backward`].
///
/// ```
/// use liger_rs::{RmsNormArgs, reference::{rms_norm_backward, rms_norm_backward_dx}};
/// let (args, w) = (RmsNormArgs::new(1, 2), [2.0f64, 0.5]);
/// let g = rms_norm_backward_dx(&args, &[1.0f64, -1.0], &[1.0, 1.0], Some(&w), &[1.0]).unwrap();
/// let full = rms_norm_backward(&args, &[1.0f64, -1.0], &[1.0, 1.0], Some(&w), &[1.0]).unwrap();
/// assert_eq!((g.dx, g.dw), (full.dx, None));
/// ```
pub fn rms_norm_backward_dx<T: Element>(
    args: &RmsNormArgs,
    dy: &[T],
    x: &[T],
    weight: Option<&[T]>,
    rstd: &[T::Rstd],
) -> Result<RmsNormGrads<T>> {
    backward(args, dy, None, x, weight, rstd, false)
}

/// The backward of [`rms_norm_backward`], with `dw` (a weight is given) or without; `ds`
/// (the fused residual add's incoming gradient of the sum, shaped as `dy`) is added to each
/// unrounded dX element before its one rounding.
pub(crate) fn backward<T: Element>(
    args: &RmsNormArgs,
    dy: &[T],
    ds: Option<&[T]>,
    x: &[T],
    weight: Option<&[T]>,
    rstd: &[T::Rstd],
    with_dw: bool,
) -> Result<RmsNormGrads<T>> {
    let len = check_args(args)?;
    check_len("dy", dy, len, "rows × cols")?;
    check_len("x", x, len, "rows × cols")?;
    if let Some(ds) = ds {
        check_len("ds", ds, len, "rows × cols")?;
    }
    let (rows, cols, mode) = (args.rows, args.cols, args.mode);
    check_weight(weight, cols)?;
    check_len("rstd", rstd, rows, "rows")?;
    let offset = args.offset as f64;
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
    let mut dw_acc = vec![0.0f64; if with_dw { cols } else { 0 }];
    for ((dyr, xr), r) in dy.chunks(cols).zip(x.chunks(cols)).zip(rstd) {
        let r = r.to_f64();
        let dot: f64 = (0..cols)
            .map(|c| grad(dyr[c].to_f64(), c) * xr[c].to_f64())
            .sum();
        let coef = r * r * r * dot / cols as f64;
        for c in 0..cols {
            let (g, v) = (dyr[c].to_f64(), xr[c].to_f64());
            let d = r * grad(g, c) - coef * v;
            // Without `ds` nothing is added (`+ 0.0` would turn a −0 into +0).
            let d = ds.map_or(d, |ds| d + ds[dx.len()].to_f64());
            dx.push(T::from_f64(d));
            if with_dw {
                let normed = if mode == CastingMode::Llama {
                    T::cast(T::cast_f32(v * r))
                } else {
                    v * r
                };
                dw_acc[c] += g * normed;
            }
        }
    }
    let dw = with_dw.then(|| dw_acc.into_iter().map(T::from_f64).collect());
    Ok(RmsNormGrads { dx, dw })
}
