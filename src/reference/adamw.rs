//! The optimizers on the host, operation for operation as PyTorch's fused kernels compute them
//! (see [`crate::adamw_step`], [`crate::sgd_step`]), so that the kernels' results are checked
//! bit for bit: each operation is exact and then rounded where PyTorch's kernel rounds.
//! Both round their hyper-parameters to f32 and compute in f32, with the `fma`s of PyTorch's
//! kernels (its `std::fma` calls and the products nvcc contracts into sums). The bias
//! corrections' `β^t` is the exact power rounded to f32 (by squaring in f64), which is what
//! the f32 `pow` of PyTorch's kernel returns for these arguments.
use super::Element;
use crate::adamw::args::{AdamWArgs, NormType, SgdArgs, check_step};
use crate::error::{Result, invalid};

/// `β^t` rounded to f32.
fn powf(beta: f32, t: f32) -> f32 {
    let mut n = t as u64;
    let (mut base, mut acc) = (beta as f64, 1.0f64);
    while n > 0 {
        if n & 1 == 1 {
            acc *= base;
        }
        base *= base;
        n >>= 1;
    }
    acc as f32
}

/// The gradient as both rules take it: times the clip factor in its own type.
fn gradient<G: Element>(g: G, clip: Option<f32>) -> f32 {
    let g = g.to_f64() as f32;
    match clip {
        Some(c) => G::cast((g * c) as f64).to_f64() as f32,
        None => g,
    }
}

/// Every buffer's length against the gradient's.
fn check_lens(n: usize, lens: &[(&'static str, usize)]) -> Result<()> {
    for &(name, len) in lens {
        if len != n {
            return Err(invalid(name, format!("length {n} (the gradient's)"), len));
        }
    }
    Ok(())
}

/// One tensor's buffers for [`adamw_step`].
pub struct AdamWState<'a, G, S = f32> {
    /// θ.
    pub param: &'a mut [f32],
    /// The gradient.
    pub grad: &'a [G],
    /// m (f32, or bf16: computed in f32, rounded when stored).
    pub exp_avg: &'a mut [S],
    /// v.
    pub exp_avg_sq: &'a mut [S],
    /// amsgrad's maximum of v.
    pub max_exp_avg_sq: Option<&'a mut [S]>,
}

/// One step on one tensor: `clip` the clip factor, `grad_scale` PyTorch's gradient scale.
///
/// # Errors
/// As [`crate::adamw_step`] for the arguments and lengths.
pub fn adamw_step<G: Element, S: Element>(
    args: &AdamWArgs,
    step: f32,
    clip: Option<f32>,
    grad_scale: Option<f32>,
    s: AdamWState<'_, G, S>,
) -> Result<()> {
    args.check()?;
    check_step(step)?;
    let n = s.grad.len();
    check_lens(
        n,
        &[
            ("param", s.param.len()),
            ("exp_avg", s.exp_avg.len()),
            ("exp_avg_sq", s.exp_avg_sq.len()),
        ],
    )?;
    if s.max_exp_avg_sq.is_some() != args.amsgrad {
        return Err(invalid(
            "max_exp_avg_sq",
            "a buffer exactly with amsgrad",
            "the opposite",
        ));
    }
    let (lr, b1, b2) = (args.lr as f32, args.beta1 as f32, args.beta2 as f32);
    let (wd, eps) = (args.weight_decay as f32, args.eps as f32);
    let bc1 = 1.0 - powf(b1, step);
    let bc2_sqrt = (1.0 - powf(b2, step)).sqrt();
    let step_size = lr / bc1;
    let mut vmax = s.max_exp_avg_sq;
    for j in 0..n {
        let mut g = gradient(s.grad[j], clip);
        if let Some(scale) = grad_scale {
            g /= scale;
        }
        if args.maximize {
            g = -g;
        }
        let mut th = s.param[j];
        if wd != 0.0 {
            if args.decoupled {
                th = (-(lr * wd)).mul_add(th, th);
            } else {
                g = th.mul_add(wd, g);
            }
        }
        let wide = |x: S| x.to_f64() as f32;
        let m = b1.mul_add(wide(s.exp_avg[j]), (-b1).mul_add(g, g));
        let g2 = g * g;
        let v = b2.mul_add(wide(s.exp_avg_sq[j]), (-b2).mul_add(g2, g2));
        let second = match vmax.as_mut() {
            Some(mx) => {
                let x = wide(mx[j]).max(v);
                mx[j] = S::from_f64(x as f64);
                x
            }
            None => v,
        };
        let denom = second.sqrt() / bc2_sqrt + eps;
        th -= step_size * m / denom;
        s.exp_avg[j] = S::from_f64(m as f64);
        s.exp_avg_sq[j] = S::from_f64(v as f64);
        s.param[j] = th;
    }
    Ok(())
}

/// One tensor's buffers for [`sgd_step`].
pub struct SgdState<'a, G> {
    /// θ.
    pub param: &'a mut [f32],
    /// The gradient.
    pub grad: &'a [G],
    /// The momentum buffer (exactly with momentum).
    pub momentum_buffer: Option<&'a mut [f32]>,
}

/// One SGD step on one tensor: `clip` the clip factor, `grad_scale` PyTorch's gradient scale.
///
/// # Errors
/// As [`crate::sgd_step`] for the arguments and lengths.
pub fn sgd_step<G: Element>(
    args: &SgdArgs,
    first_step: bool,
    clip: Option<f32>,
    grad_scale: Option<f32>,
    s: SgdState<'_, G>,
) -> Result<()> {
    args.check()?;
    let n = s.grad.len();
    check_lens(n, &[("param", s.param.len())])?;
    if let Some(b) = &s.momentum_buffer {
        check_lens(n, &[("momentum_buffer", b.len())])?;
    }
    if s.momentum_buffer.is_some() != (args.momentum != 0.0) {
        return Err(invalid(
            "momentum_buffer",
            "a buffer exactly with momentum",
            "the opposite",
        ));
    }
    let (lr, wd, mom) = (
        args.lr as f32,
        args.weight_decay as f32,
        args.momentum as f32,
    );
    let undamped = 1.0 - args.dampening as f32;
    let mut buf = s.momentum_buffer;
    for j in 0..n {
        let mut g = gradient(s.grad[j], clip);
        if let Some(scale) = grad_scale {
            g /= scale;
        }
        if args.maximize {
            g = -g;
        }
        let th = s.param[j];
        if wd != 0.0 {
            g = wd.mul_add(th, g);
        }
        if let Some(b) = buf.as_mut() {
            let bj = if first_step {
                g
            } else {
                undamped.mul_add(g, mom * b[j])
            };
            b[j] = bj;
            g = if args.nesterov {
                mom.mul_add(bj, g)
            } else {
                bj
            };
        }
        s.param[j] = (-lr).mul_add(g, th);
    }
    Ok(())
}

/// The global norm of `grads` (in f64) and the clip factor `max_norm / (norm + 1e-6)`
/// clamped to 1 in f32 (NaN staying NaN), as [`crate::clip_grad_norm`] computes them (its L2
/// norm is the f64 norm rounded to f32, up to the f32 rounding of its per-block sums; its
/// infinity norm is exact).
pub fn clip_grad_norm<G: Element>(
    grads: &[&[G]],
    max_norm: f32,
    norm_type: NormType,
) -> (f64, f32) {
    let all = grads.iter().flat_map(|g| g.iter()).map(|x| x.to_f64());
    let norm = match norm_type {
        NormType::L2 => all.map(|x| x * x).sum::<f64>().sqrt(),
        NormType::Inf => all.fold(0.0, |m: f64, x| {
            if x.is_nan() || x.abs() > m {
                x.abs()
            } else {
                m
            }
        }),
    };
    let f = max_norm / (norm as f32 + 1e-6);
    (norm, if f > 1.0 { 1.0 } else { f })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// θ = 1, g = 0.5, first step, PyTorch's defaults: θ' = (1 − 1e-5) − 0.01·0.05 / (0.5 + 1e-8).
    #[test]
    fn one_step_of_pytorch_s_defaults() {
        let args = AdamWArgs::new(1e-3);
        let (mut p, g, mut m, mut v) = ([1.0f32], [0.5f32], [0.0f32], [0.0f32]);
        let s = AdamWState {
            param: &mut p,
            grad: &g,
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            max_exp_avg_sq: None,
        };
        adamw_step(&args, 1.0, None, None, s).unwrap();
        let want = (1.0 - 1e-5) - 0.01 * 0.05 / (0.5 + 1e-8);
        assert!((p[0] as f64 - want).abs() < 2e-7, "{} vs {want}", p[0]);
        // m = g − β1·g and v = g² − β2·g² with β1, β2 rounded to f32, each in one rounding.
        let (b1, b2) = (0.9f32 as f64, 0.999f32 as f64);
        assert_eq!(m[0], (0.5 - b1 * 0.5) as f32);
        assert_eq!(v[0], (0.25 - b2 * 0.25) as f32);
        assert_ne!(m[0], 0.05f32, "β1 rounds to f32 before 1 − β1");
    }

    /// SGD with Nesterov momentum over three steps against the rule in f64 (PyTorch rounds
    /// θ, g and the buffer to f32 at each step; the f64 rule here is within that rounding).
    #[test]
    fn sgd_with_nesterov_momentum_tracks_the_rule() {
        let args = SgdArgs::new(0.1)
            .with_momentum(0.9)
            .with_nesterov(true)
            .with_weight_decay(0.01);
        let (mut p, mut b) = ([1.0f32, -2.0], [0f32; 2]);
        let (mut pe, mut be) = ([1.0f64, -2.0], [0f64; 2]);
        for t in 0..3 {
            let g = [0.5f32 - t as f32, 0.25];
            let s = SgdState {
                param: &mut p,
                grad: &g,
                momentum_buffer: Some(&mut b),
            };
            sgd_step(&args, t == 0, None, None, s).unwrap();
            for j in 0..2 {
                let gj = g[j] as f64 + 0.01 * pe[j];
                be[j] = if t == 0 { gj } else { 0.9 * be[j] + gj };
                pe[j] -= 0.1 * (gj + 0.9 * be[j]);
            }
        }
        for j in 0..2 {
            assert!((p[j] as f64 - pe[j]).abs() < 1e-6, "{} vs {}", p[j], pe[j]);
            assert!((b[j] as f64 - be[j]).abs() < 1e-6, "{} vs {}", b[j], be[j]);
        }
        let bad = SgdState {
            param: &mut p,
            grad: &[0.0f32; 2],
            momentum_buffer: None,
        };
        assert!(sgd_step(&args, false, None, None, bad).is_err());
    }

    /// Many steps of the f32 emulation stay within f32 rounding of the same rule in f64.
    #[test]
    fn the_emulation_tracks_the_exact_rule() {
        let args = AdamWArgs::new(1e-2)
            .with_weight_decay(0.1)
            .with_amsgrad(true);
        let n = 64;
        let (mut p, mut m, mut v, mut mx) =
            (vec![0.5f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let (mut pe, mut me, mut ve, mut mxe) =
            (vec![0.5f64; n], vec![0f64; n], vec![0f64; n], vec![0f64; n]);
        for t in 1..=50 {
            let g: Vec<f32> = (0..n)
                .map(|j| ((j * 7 + t * 3) % 11) as f32 / 11.0 - 0.5)
                .collect();
            let ge = g.clone();
            let s = AdamWState {
                param: &mut p,
                grad: &g,
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
                max_exp_avg_sq: Some(&mut mx),
            };
            adamw_step(&args, t as f32, None, None, s).unwrap();
            let (b1, b2) = (args.beta1, args.beta2);
            for j in 0..n {
                let gj = ge[j] as f64;
                pe[j] -= args.lr * args.weight_decay * pe[j];
                me[j] = b1 * me[j] + (1.0 - b1) * gj;
                ve[j] = b2 * ve[j] + (1.0 - b2) * gj * gj;
                mxe[j] = mxe[j].max(ve[j]);
                let denom = mxe[j].sqrt() / (1.0 - b2.powi(t as i32)).sqrt() + args.eps;
                pe[j] -= args.lr / (1.0 - b1.powi(t as i32)) * me[j] / denom;
            }
        }
        for j in 0..n {
            assert!(
                (p[j] as f64 - pe[j]).abs() < 1e-5,
                "{j}: {} vs {}",
                p[j],
                pe[j]
            );
        }
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let l2 = NormType::L2;
        let (norm, factor) = clip_grad_norm(&[&[3.0f32][..], &[4.0f32][..]], 1.0, l2);
        assert_eq!(norm, 5.0);
        assert!((factor - 1.0 / (5.0 + 1e-6)).abs() < 1e-7);
        assert_eq!(clip_grad_norm(&[&[0.3f32][..]], 1.0, l2).1, 1.0);
        let inf = NormType::Inf;
        assert_eq!(
            clip_grad_norm(&[&[3.0f32, -7.0][..], &[4.0f32][..]], 1.0, inf).0,
            7.0
        );
        assert_eq!(clip_grad_norm(&[&[f32::INFINITY][..]], 1.0, l2).1, 0.0);
        assert!(clip_grad_norm(&[&[1.0, f32::NAN][..]], 1.0, inf).1.is_nan());
    }
}
