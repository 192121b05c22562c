//! AdamW and Adam on the host, PyTorch's `AdamW(fused=True)` arithmetic operation for
//! operation (see [`crate::adamw_step`]): f32 values, promoted to f64 exactly where PyTorch's
//! C++ promotes them (its scalars are doubles), so the kernels' results are checked bit for
//! bit. The bias corrections take `β^t` by repeated squaring in f64, as the kernels do; PyTorch
//! calls `pow`, which can differ in the last f64 bit, and so, rarely, in the f32 bias
//! correction.
use super::Element;
use crate::adamw::args::{AdamWArgs, check_step};
use crate::error::{Result, invalid};

/// `β^t` by squaring.
fn powi(beta: f64, t: f32) -> f64 {
    let mut n = t as u64;
    let (mut base, mut acc) = (beta, 1.0f64);
    while n > 0 {
        if n & 1 == 1 {
            acc *= base;
        }
        base *= base;
        n >>= 1;
    }
    acc
}

/// One tensor's buffers for [`adamw_step`].
pub struct AdamWState<'a, G> {
    /// θ.
    pub param: &'a mut [f32],
    /// The gradient.
    pub grad: &'a [G],
    /// m.
    pub exp_avg: &'a mut [f32],
    /// v.
    pub exp_avg_sq: &'a mut [f32],
    /// amsgrad's maximum of v.
    pub max_exp_avg_sq: Option<&'a mut [f32]>,
}

/// One step on one tensor: `clip` the clip factor, `grad_scale` PyTorch's gradient scale.
///
/// # Errors
/// As [`crate::adamw_step`] for the arguments and lengths.
pub fn adamw_step<G: Element>(
    args: &AdamWArgs,
    step: f32,
    clip: Option<f32>,
    grad_scale: Option<f32>,
    s: AdamWState<'_, G>,
) -> Result<()> {
    args.check()?;
    check_step(step)?;
    let n = s.grad.len();
    for (name, len) in [
        ("param", s.param.len()),
        ("exp_avg", s.exp_avg.len()),
        ("exp_avg_sq", s.exp_avg_sq.len()),
    ] {
        if len != n {
            return Err(invalid(name, format!("length {n} (the gradient's)"), len));
        }
    }
    if s.max_exp_avg_sq.is_some() != args.amsgrad {
        return Err(invalid(
            "max_exp_avg_sq",
            "a buffer exactly with amsgrad",
            "the opposite",
        ));
    }
    let bc1 = (1.0 - powi(args.beta1, step)) as f32;
    let bc2_sqrt = (1.0 - powi(args.beta2, step)).sqrt() as f32;
    let step_size = (args.lr / bc1 as f64) as f32;
    let mut vmax = s.max_exp_avg_sq;
    for j in 0..n {
        let mut g = s.grad[j].to_f64() as f32;
        if let Some(c) = clip {
            g = G::cast((g * c) as f64) as f32;
        }
        if let Some(scale) = grad_scale {
            g = (g as f64 / scale as f64) as f32;
        }
        if args.maximize {
            g = -g;
        }
        let mut th = s.param[j];
        if args.weight_decay != 0.0 {
            if args.decoupled {
                th = (th as f64 - args.lr * args.weight_decay * th as f64) as f32;
            } else {
                g = (g as f64 + th as f64 * args.weight_decay) as f32;
            }
        }
        let m = (args.beta1 * s.exp_avg[j] as f64 + (1.0 - args.beta1) * g as f64) as f32;
        let v =
            (args.beta2 * s.exp_avg_sq[j] as f64 + (1.0 - args.beta2) * g as f64 * g as f64) as f32;
        let second = match vmax.as_mut() {
            Some(mx) => {
                mx[j] = mx[j].max(v);
                mx[j]
            }
            None => v,
        };
        let denom = ((second.sqrt() / bc2_sqrt) as f64 + args.eps) as f32;
        th -= step_size * m / denom;
        s.exp_avg[j] = m;
        s.exp_avg_sq[j] = v;
        s.param[j] = th;
    }
    Ok(())
}

/// The global L2 norm of `grads` (in f64) and the clip factor `min(1, max_norm / (norm +
/// 1e-6))` in f32, as [`crate::clip_grad_norm`] computes them (its norm is the f64 norm
/// rounded to f32, up to the f32 rounding of its per-block sums).
pub fn clip_grad_norm<G: Element>(grads: &[&[G]], max_norm: f32) -> (f64, f32) {
    let sum: f64 = grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|x| x.to_f64() * x.to_f64())
        .sum();
    let norm = sum.sqrt();
    (norm, (max_norm / (norm as f32 + 1e-6)).min(1.0))
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
        assert_eq!((m[0], v[0]), (0.05f32, (0.001f64 * 0.25) as f32));
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
        let (norm, factor) = clip_grad_norm(&[&[3.0f32][..], &[4.0f32][..]], 1.0);
        assert_eq!(norm, 5.0);
        assert!((factor - 1.0 / (5.0 + 1e-6)).abs() < 1e-7);
        assert_eq!(clip_grad_norm(&[&[0.3f32][..]], 1.0).1, 1.0);
    }
}
