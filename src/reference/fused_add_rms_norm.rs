//! Fused residual add and RMSNorm on the CPU (Liger's `fused_add_rms_norm`), in its own file as
//! every op has one: `s = D(x + r)`, then [`rms_norm_forward`] of `s`; the backward is
//! RMSNorm's of `s` with the sum's incoming gradient `ds` added to each dX element before its one
//! rounding, `dx = D(dX + ds)`, which is the gradient of both `x` and `r`.
use super::Element;
use super::rms_norm::{RmsNormGrads, backward, check_args, check_len, rms_norm_forward};
use crate::RmsNormArgs;
use crate::error::Result;

/// Forward results: the sum `s` and RMSNorm's `y` of it (rows × cols, contiguous), and each
/// row's stored rstd.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedAddRmsNormOutput<T: Element> {
    /// `D(x + r)`, the new residual stream.
    pub s: Vec<T>,
    /// Normalised (and weighted) rows of `s`.
    pub y: Vec<T>,
    /// Per-row inverse RMS of `s`, as [`super::rms_norm::RmsNormOutput::rstd`].
    pub rstd: Vec<T::Rstd>,
}

/// The fused forward as [`crate::fused_add_rms_norm_forward`] computes it: `s = D(x + r)`
/// element by element, then `y` and `rstd` as [`rms_norm_forward`] gives them for `s` (shapes
/// and `args` as there: contiguous rows; `r` like `x`).
///
/// ```
/// use liger_rs::{RmsNormArgs, reference::fused_add_rms_norm_forward};
/// let args = RmsNormArgs::new(1, 2).with_eps(0.0);
/// let out = fused_add_rms_norm_forward(&args, &[1.0f64, 3.0], &[2.0, 1.0], None).unwrap();
/// assert_eq!(out.s, vec![3.0, 4.0]);
/// assert!((out.y[1] - 4.0 / 12.5f64.sqrt()).abs() < 1e-15);
/// ```
pub fn fused_add_rms_norm_forward<T: Element>(
    args: &RmsNormArgs,
    x: &[T],
    r: &[T],
    weight: Option<&[T]>,
) -> Result<FusedAddRmsNormOutput<T>> {
    let len = check_args(args)?;
    check_len("x", x, len, "rows × cols")?;
    check_len("r", r, len, "rows × cols")?;
    let s: Vec<T> = x
        .iter()
        .zip(r)
        .map(|(x, r)| T::from_f64(x.to_f64() + r.to_f64()))
        .collect();
    let out = rms_norm_forward(args, &s, weight)?;
    Ok(FusedAddRmsNormOutput {
        s,
        y: out.y,
        rstd: out.rstd,
    })
}

/// The fused backward as [`crate::fused_add_rms_norm_backward`] computes it: `dx = D(dX + ds)`
/// with dX RMSNorm's gradient of `s` for `dy` (unrounded), and with a weight `dw` as
/// [`super::rms_norm_backward`] gives it for `s` (`dy`, `ds` and `s` shaped as `x` of
/// [`fused_add_rms_norm_forward`], `rstd` exactly `rows` long). A frozen weight's `dx` is the
/// same; ignore `dw`.
///
/// ```
/// use liger_rs::{RmsNormArgs, reference::fused_add_rms_norm_backward};
/// // s = [1, 1], r = 1, dy = [1, −1]: dX = r·dy, plus ds.
/// let args = RmsNormArgs::new(1, 2);
/// let g = fused_add_rms_norm_backward(&args, &[1.0f64, -1.0], &[0.5, 0.5], &[1.0, 1.0], None, &[1.0]).unwrap();
/// assert_eq!(g.dx, vec![1.5, -0.5]);
/// ```
pub fn fused_add_rms_norm_backward<T: Element>(
    args: &RmsNormArgs,
    dy: &[T],
    ds: &[T],
    s: &[T],
    weight: Option<&[T]>,
    rstd: &[T::Rstd],
) -> Result<RmsNormGrads<T>> {
    backward(args, dy, Some(ds), s, weight, rstd, weight.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CastingMode;

    /// `L = Σ gy·y + Σ gs·s` of the f64 forward: its gradient in `x` (and in `r`) is the
    /// backward's `dx` for `dy = gy`, `ds = gs`, and in the weight its `dw`.
    fn loss(args: &RmsNormArgs, x: &[f64], r: &[f64], w: &[f64], gy: &[f64], gs: &[f64]) -> f64 {
        let out = fused_add_rms_norm_forward(args, x, r, Some(w)).unwrap();
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f64>();
        dot(&out.y, gy) + dot(&out.s, gs)
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (rows, cols) = (3, 7);
        let n = rows * cols;
        let val = |i: usize, k: f64| (i as f64 * 0.73 + k).sin() * 1.5;
        let x: Vec<f64> = (0..n).map(|i| val(i, 0.1)).collect();
        let r: Vec<f64> = (0..n).map(|i| val(i, 1.7)).collect();
        let w: Vec<f64> = (0..cols).map(|i| 0.5 + val(i, 2.9).abs()).collect();
        let gy: Vec<f64> = (0..n).map(|i| val(i, 3.3)).collect();
        let gs: Vec<f64> = (0..n).map(|i| val(i, 4.1)).collect();
        for (mode, offset) in [
            (CastingMode::Llama, 0.0),
            (CastingMode::Gemma, 1.0),
            (CastingMode::None, 0.5),
        ] {
            let args = RmsNormArgs::new(rows, cols)
                .with_mode(mode)
                .with_offset(offset)
                .with_eps(1e-6);
            let out = fused_add_rms_norm_forward(&args, &x, &r, Some(&w)).unwrap();
            let g =
                fused_add_rms_norm_backward(&args, &gy, &gs, &out.s, Some(&w), &out.rstd).unwrap();
            let h = 1e-6;
            let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
            for i in 0..n {
                let shifted = |v: &[f64], d: f64| {
                    let mut v = v.to_vec();
                    v[i] += d;
                    v
                };
                let dx = fd(&|d| loss(&args, &shifted(&x, d), &r, &w, &gy, &gs));
                let dr = fd(&|d| loss(&args, &x, &shifted(&r, d), &w, &gy, &gs));
                assert!(
                    (dx - g.dx[i]).abs() < 1e-6,
                    "{mode:?} dx[{i}]: {dx} vs {}",
                    g.dx[i]
                );
                assert!(
                    (dr - g.dx[i]).abs() < 1e-6,
                    "{mode:?} dr[{i}]: {dr} vs {}",
                    g.dx[i]
                );
            }
            let dw = g.dw.unwrap();
            for c in 0..cols {
                let fdw = {
                    let mut wp = w.clone();
                    wp[c] += h;
                    let up = loss(&args, &x, &r, &wp, &gy, &gs);
                    wp[c] -= 2.0 * h;
                    (up - loss(&args, &x, &r, &wp, &gy, &gs)) / (2.0 * h)
                };
                assert!(
                    (fdw - dw[c]).abs() < 1e-6,
                    "{mode:?} dw[{c}]: {fdw} vs {}",
                    dw[c]
                );
            }
        }
    }

    #[test]
    fn the_sum_is_rounded_once_to_the_dtype() {
        use half::bf16;
        // 1 + 2⁻⁹ is below half a bf16 ulp of 1 (2⁻⁸): the sum rounds to 1, in bf16.
        let args = RmsNormArgs::new(1, 1);
        let one = bf16::ONE;
        let tiny = bf16::from_f64(2f64.powi(-9));
        let out = fused_add_rms_norm_forward(&args, &[one], &[tiny], None).unwrap();
        assert_eq!(out.s, vec![one]);
        let plain = rms_norm_forward(&args, &[one], None).unwrap();
        assert_eq!((out.y, out.rstd), (plain.y, plain.rstd));
    }
}
