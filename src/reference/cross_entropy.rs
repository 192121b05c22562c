//! Cross-entropy and fused linear cross-entropy in f64 (see [`CrossEntropyArgs`] for the
//! formula): the logits are widened exactly, everything after is f64, and only the gradient
//! is rounded, once, to the logits' type `D`, where the kernels round it. Fused linear
//! cross-entropy rounds its logits to `D` as cuBLAS does (`D(x·Wᵀ)`, the bias added after, in
//! f64), holds their gradient in `D` as the kernels do, and returns `dx` rounded to `D` and
//! `dW`, `db` rounded to f32.
use super::Element;
use crate::cross_entropy::args::{CrossEntropyArgs, Reduction};
use crate::cross_entropy::linear::LinearCrossEntropyArgs;
use crate::error::{Result, invalid};

/// The forward's results, exact (f64).
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEntropyOut {
    /// The loss: one value, or one per row with [`Reduction::None`] (z-loss included).
    pub loss: Vec<f64>,
    /// The z-loss `λ·lse²`, reduced like the loss.
    pub z_loss: Vec<f64>,
    /// Each row's log-sum-exp of its (soft-capped) logits (0 on ignored rows).
    pub lse: Vec<f64>,
}

/// The statistics of one counted row.
struct Row {
    lse: f64,
    /// Its logits after bias and softcap.
    x: Vec<f64>,
}

fn check<T>(
    args: &CrossEntropyArgs,
    logits: &[T],
    target: &[i64],
    weight: Option<&[f32]>,
) -> Result<()> {
    args.check()?;
    let need = crate::validate::span("logits", args.rows, args.vocab, args.logits_stride)?;
    if logits.len() < need {
        return Err(invalid("logits", format!("length ≥ {need}"), logits.len()));
    }
    if target.len() != args.rows {
        return Err(invalid(
            "target",
            format!("length {}", args.rows),
            target.len(),
        ));
    }
    if let Some(w) = weight
        && w.len() != args.vocab
    {
        return Err(invalid("weight", format!("length {}", args.vocab), w.len()));
    }
    for &t in target {
        if t != args.ignore_index && !(0..args.vocab as i64).contains(&t) {
            let expected = format!("targets in 0..{} or {}", args.vocab, args.ignore_index);
            return Err(invalid("target", expected, t));
        }
    }
    Ok(())
}

/// Row `i`'s logits after the bias and the softcap, and their log-sum-exp.
fn row<T: Element>(args: &CrossEntropyArgs, logits: &[T], bias: Option<&[T]>, i: usize) -> Row {
    let z = &logits[i * args.logits_stride..][..args.vocab];
    let x: Vec<f64> = z
        .iter()
        .enumerate()
        .map(|(j, v)| {
            let v = v.to_f64() + bias.map_or(0.0, |b| b[j].to_f64());
            match args.softcap {
                Some(c) => c as f64 * (v / c as f64).tanh(),
                None => v,
            }
        })
        .collect();
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    Row { lse, x }
}

/// `(Σ w_t, count)` over the counted rows and `Σ_j w_j`: the mean's denominators.
fn denominators(
    args: &CrossEntropyArgs,
    target: &[i64],
    weight: Option<&[f32]>,
) -> (f64, f64, f64) {
    let w = |j: usize| weight.map_or(1.0, |w| w[j] as f64);
    let counted = target.iter().filter(|&&t| t != args.ignore_index);
    let den_w = counted.clone().map(|&t| w(t as usize)).sum();
    let den_n = counted.count() as f64;
    (den_w, den_n, (0..args.vocab).map(w).sum())
}

fn forward<T: Element>(
    args: &CrossEntropyArgs,
    logits: &[T],
    bias: Option<&[T]>,
    target: &[i64],
    weight: Option<&[f32]>,
) -> CrossEntropyOut {
    let (v, eps) = (args.vocab, args.label_smoothing as f64);
    let lambda = args.lse_square_scale as f64;
    let w = |j: usize| weight.map_or(1.0, |w| w[j] as f64);
    let (den_w, den_n, weight_sum) = denominators(args, target, weight);
    let (mut ce, mut zl, mut lse) = (
        vec![0.0; args.rows],
        vec![0.0; args.rows],
        vec![0.0; args.rows],
    );
    for (i, &t) in target.iter().enumerate() {
        if t == args.ignore_index {
            continue;
        }
        let r = row(args, logits, bias, i);
        let t = t as usize;
        let smooth: f64 = (0..v).map(|j| w(j) * r.x[j]).sum();
        ce[i] =
            (1.0 - eps) * w(t) * (r.lse - r.x[t]) + eps / v as f64 * (r.lse * weight_sum - smooth);
        zl[i] = lambda * r.lse * r.lse;
        lse[i] = r.lse;
    }
    let (loss, z_loss) = match args.reduction {
        Reduction::None => (ce.iter().zip(&zl).map(|(c, z)| c + z).collect(), zl),
        Reduction::Sum => {
            let (c, z) = (ce.iter().sum::<f64>(), zl.iter().sum::<f64>());
            (vec![c + z], vec![z])
        }
        Reduction::Mean => {
            let (c, z) = (
                ce.iter().sum::<f64>() / den_w,
                zl.iter().sum::<f64>() / den_n,
            );
            (vec![c + z], vec![z])
        }
    };
    CrossEntropyOut { loss, z_loss, lse }
}

/// `grad_loss · ∂loss/∂logits` in f64, rows of `vocab` (contiguous).
fn gradient<T: Element>(
    args: &CrossEntropyArgs,
    logits: &[T],
    bias: Option<&[T]>,
    target: &[i64],
    weight: Option<&[f32]>,
    grad_loss: &[f64],
) -> Vec<f64> {
    let (v, eps) = (args.vocab, args.label_smoothing as f64);
    let lambda = args.lse_square_scale as f64;
    let w = |j: usize| weight.map_or(1.0, |w| w[j] as f64);
    let (den_w, den_n, weight_sum) = denominators(args, target, weight);
    let (den_w, den_n) = match args.reduction {
        Reduction::Mean => (den_w, den_n),
        _ => (1.0, 1.0),
    };
    let mut grad = vec![0.0; args.rows * v];
    for (i, &t) in target.iter().enumerate() {
        if t == args.ignore_index {
            continue;
        }
        let g = match args.reduction {
            Reduction::None => grad_loss[i],
            _ => grad_loss[0],
        };
        let r = row(args, logits, bias, i);
        let t = t as usize;
        for j in 0..v {
            let p = (r.x[j] - r.lse).exp();
            let mut d = (1.0 - eps) * w(t) * (p - f64::from(u8::from(j == t))) / den_w
                + eps / v as f64 * (weight_sum * p - w(j)) / den_w
                + 2.0 * lambda * r.lse * p / den_n;
            if let Some(c) = args.softcap {
                let q = r.x[j] / c as f64;
                d *= 1.0 - q * q;
            }
            grad[i * v + j] = g * d;
        }
    }
    grad
}

/// Cross-entropy forward (see [`crate::cross_entropy_forward`]).
///
/// # Errors
/// As the launcher for the options and lengths, and for a target outside `0..vocab` that is
/// not `ignore_index`.
pub fn cross_entropy_forward<T: Element>(
    args: &CrossEntropyArgs,
    logits: &[T],
    target: &[i64],
    weight: Option<&[f32]>,
) -> Result<CrossEntropyOut> {
    check(args, logits, target, weight)?;
    Ok(forward(args, logits, None, target, weight))
}

/// Cross-entropy backward (see [`crate::cross_entropy_backward`]): `grad_loss ·
/// ∂loss/∂logits`, contiguous rows of `vocab`, rounded to `T`.
///
/// # Errors
/// As [`cross_entropy_forward`], and for a `grad_loss` of the wrong length.
pub fn cross_entropy_backward<T: Element>(
    args: &CrossEntropyArgs,
    logits: &[T],
    target: &[i64],
    weight: Option<&[f32]>,
    grad_loss: &[f64],
) -> Result<Vec<T>> {
    check(args, logits, target, weight)?;
    if grad_loss.len() != args.loss_len() {
        let expected = format!("length {}", args.loss_len());
        return Err(invalid("grad_loss", expected, grad_loss.len()));
    }
    let g = gradient(args, logits, None, target, weight, grad_loss);
    Ok(g.into_iter().map(T::from_f64).collect())
}

/// Fused linear cross-entropy's results.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearCrossEntropyOut<T> {
    /// The loss and z-loss (as [`CrossEntropyOut`]).
    pub loss: Vec<f64>,
    /// The z-loss.
    pub z_loss: Vec<f64>,
    /// `∂loss/∂x`, rounded to `T`.
    pub dx: Vec<T>,
    /// `∂loss/∂W`, rounded to f32.
    pub dweight: Vec<f32>,
    /// `∂loss/∂b` with a bias, rounded to f32.
    pub dbias: Option<Vec<f32>>,
}

/// Fused linear cross-entropy (see [`crate::fused_linear_cross_entropy`]), for an upstream
/// gradient of 1.
///
/// # Errors
/// As [`cross_entropy_forward`], and for x, weight or bias of the wrong length.
pub fn fused_linear_cross_entropy<T: Element>(
    args: &LinearCrossEntropyArgs,
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    target: &[i64],
    ce_weight: Option<&[f32]>,
) -> Result<LinearCrossEntropyOut<T>> {
    let (t, h, v) = (args.ce.rows, args.hidden, args.ce.vocab);
    let ce = CrossEntropyArgs {
        logits_stride: v,
        grad_stride: v,
        ..args.ce
    };
    for (name, len, need) in [("x", x.len(), t * h), ("weight", weight.len(), v * h)] {
        if len != need {
            return Err(invalid(name, format!("length {need}"), len));
        }
    }
    if let Some(b) = bias
        && b.len() != v
    {
        return Err(invalid("bias", format!("length {v}"), b.len()));
    }
    let logits: Vec<T> = (0..t * v)
        .map(|e| {
            let (i, j) = (e / v, e % v);
            let dot: f64 = (0..h)
                .map(|k| x[i * h + k].to_f64() * weight[j * h + k].to_f64())
                .sum();
            T::from_f64(dot)
        })
        .collect();
    check(&ce, &logits, target, ce_weight)?;
    let out = forward(&ce, &logits, bias, target, ce_weight);
    let ones = vec![1.0; ce.loss_len()];
    let dz: Vec<f64> = gradient(&ce, &logits, bias, target, ce_weight, &ones)
        .into_iter()
        .map(T::cast)
        .collect();
    let dx = (0..t * h)
        .map(|e| {
            let (i, k) = (e / h, e % h);
            T::from_f64(
                (0..v)
                    .map(|j| dz[i * v + j] * weight[j * h + k].to_f64())
                    .sum(),
            )
        })
        .collect();
    let dweight = (0..v * h)
        .map(|e| {
            let (j, k) = (e / h, e % h);
            (0..t)
                .map(|i| dz[i * v + j] * x[i * h + k].to_f64())
                .sum::<f64>() as f32
        })
        .collect();
    let dbias = bias.map(|_| {
        (0..v)
            .map(|j| (0..t).map(|i| dz[i * v + j]).sum::<f64>() as f32)
            .collect()
    });
    Ok(LinearCrossEntropyOut {
        loss: out.loss,
        z_loss: out.z_loss,
        dx,
        dweight,
        dbias,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64, n: usize, scale: f64) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Every option at once against central differences of the f64 forward.
    #[test]
    fn the_gradient_is_the_forward_s_derivative() {
        let (rows, vocab) = (5, 7);
        let z = lcg(1, rows * vocab, 3.0);
        let target = [3, -100, 0, 6, 2];
        let weight: Vec<f32> = lcg(2, vocab, 0.5)
            .iter()
            .map(|w| (1.0 + w) as f32)
            .collect();
        for reduction in [Reduction::None, Reduction::Sum, Reduction::Mean] {
            for (eps, lambda, cap) in [(0.0, 0.0, None), (0.1, 1e-2, Some(4.0)), (0.3, 0.0, None)] {
                let args = CrossEntropyArgs::new(rows, vocab)
                    .with_reduction(reduction)
                    .with_label_smoothing(eps)
                    .with_lse_square_scale(lambda)
                    .with_softcap(cap);
                for w in [None, Some(&weight[..])] {
                    let gl: Vec<f64> = lcg(3, args.loss_len(), 1.0);
                    let g = cross_entropy_backward(&args, &z, &target, w, &gl).unwrap();
                    let f = |z: &[f64]| -> f64 {
                        let out = cross_entropy_forward(&args, z, &target, w).unwrap();
                        out.loss.iter().zip(&gl).map(|(l, g)| l * g).sum()
                    };
                    for e in 0..rows * vocab {
                        let h = 1e-6;
                        let (mut up, mut down) = (z.clone(), z.clone());
                        up[e] += h;
                        down[e] -= h;
                        let fd = (f(&up) - f(&down)) / (2.0 * h);
                        assert!(
                            (fd - g[e]).abs() < 1e-7 * (1.0 + fd.abs()),
                            "{args:?} weighted {}: element {e}: {fd} vs {}",
                            w.is_some(),
                            g[e]
                        );
                    }
                }
            }
        }
    }

    /// PyTorch's values: `F.cross_entropy(z, t)` of a 2 × 3 batch, and with
    /// `label_smoothing=0.2`, `weight=[1, 2, 0.5]` (float64).
    #[test]
    fn matches_pytorch_on_a_small_batch() {
        let z = [1.0, 2.0, 0.5, -1.0, 0.0, 3.0];
        let t = [1, 2];
        let args = CrossEntropyArgs::new(2, 3);
        let out = cross_entropy_forward(&args, &z, &t, None).unwrap();
        // −log softmax([1, 2, .5])[1] and −log softmax([−1, 0, 3])[2].
        let expect = (0.464_368_784_107_945 + 0.065_883_903_757_429) / 2.0;
        assert!((out.loss[0] - expect).abs() < 1e-14, "{}", out.loss[0]);
        let w = [1.0f32, 2.0, 0.5];
        let args = args.with_label_smoothing(0.2);
        let out = cross_entropy_forward(&args, &z, &t, Some(&w)).unwrap();
        // loss_i = 0.8·w_t·nll_i + 0.2/3·Σ_j w_j·nll_ij, mean over Σ w_t = 2.5.
        let nll = |r: &[f64], j: usize| {
            let m = r.iter().copied().fold(f64::MIN, f64::max);
            m + r.iter().map(|v| (v - m).exp()).sum::<f64>().ln() - r[j]
        };
        let eps = 0.2f32 as f64;
        let per = |r: &[f64], t: usize| {
            (1.0 - eps) * w[t] as f64 * nll(r, t)
                + eps / 3.0 * (0..3).map(|j| w[j] as f64 * nll(r, j)).sum::<f64>()
        };
        let expect = (per(&z[..3], 1) + per(&z[3..], 2)) / 2.5;
        assert!(
            (out.loss[0] - expect).abs() < 1e-12,
            "{} vs {expect}",
            out.loss[0]
        );
    }

    #[test]
    fn every_row_ignored_is_nan_for_the_mean_and_zero_gradients() {
        let args = CrossEntropyArgs::new(2, 3);
        let z = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let out = cross_entropy_forward(&args, &z, &[-100, -100], None).unwrap();
        assert!(out.loss[0].is_nan());
        let g = cross_entropy_backward(&args, &z, &[-100, -100], None, &[1.0]).unwrap();
        assert!(g.iter().all(|&v| v == 0.0));
        let sum = args.with_reduction(Reduction::Sum);
        assert_eq!(
            cross_entropy_forward(&sum, &z, &[-100, -100], None)
                .unwrap()
                .loss,
            [0.0]
        );
    }

    #[test]
    fn out_of_range_targets_are_errors() {
        let args = CrossEntropyArgs::new(1, 3);
        for t in [3, -1] {
            let e = cross_entropy_forward(&args, &[0.0; 3], &[t], None).unwrap_err();
            assert!(matches!(
                e,
                crate::Error::InvalidArgument { arg: "target", .. }
            ));
        }
    }

    /// The fused form's gradients against central differences of its own loss (f64: the
    /// logits' cast point is the identity).
    #[test]
    fn the_fused_linear_gradients_are_the_loss_s_derivatives() {
        let (t, h, v) = (4, 3, 5);
        let x = lcg(4, t * h, 1.0);
        let w = lcg(5, v * h, 1.0);
        let b = lcg(6, v, 0.5);
        let target = [1, 4, -100, 0];
        let args = LinearCrossEntropyArgs::with_ce(
            h,
            CrossEntropyArgs::new(t, v)
                .with_label_smoothing(0.1)
                .with_lse_square_scale(1e-2),
        );
        let out = fused_linear_cross_entropy(&args, &x, &w, Some(&b), &target, None).unwrap();
        let loss = |x: &[f64], w: &[f64], b: &[f64]| {
            fused_linear_cross_entropy(&args, x, w, Some(b), &target, None)
                .unwrap()
                .loss[0]
        };
        let fd = |f: &dyn Fn(f64) -> f64| (f(1e-6) - f(-1e-6)) / 2e-6;
        for e in 0..x.len() {
            let d = fd(&|s| {
                let mut x = x.clone();
                x[e] += s;
                loss(&x, &w, &b)
            });
            assert!((d - out.dx[e]).abs() < 1e-7, "dx {e}: {d} vs {}", out.dx[e]);
        }
        for e in 0..w.len() {
            let d = fd(&|s| {
                let mut w = w.clone();
                w[e] += s;
                loss(&x, &w, &b)
            });
            assert!((d - out.dweight[e] as f64).abs() < 1e-6, "dW {e}");
        }
        let db = out.dbias.unwrap();
        for e in 0..b.len() {
            let d = fd(&|s| {
                let mut b = b.clone();
                b[e] += s;
                loss(&x, &w, &b)
            });
            assert!((d - db[e] as f64).abs() < 1e-6, "db {e}");
        }
    }
}
