//! `liger_rs::candle::nn::AdamW` on CUDA against the reference bit for bit and against
//! candle-nn's optimizer.
use super::*;

/// Steps of `liger_rs::candle::nn::AdamW` on CUDA `Var`s (40 of odd lengths: two launches)
/// against the reference on the host, bit for bit: f32 variables, and bf16 copies of f32
/// masters (each copy the updated master rounded once), with clipping by the global norm on
/// the second step. The gradient of `Σ w·c` is `c`, so the host knows every gradient.
#[test]
fn gpu_adamw_matches_the_reference_bit_for_bit() {
    use liger_rs::NormType;
    use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    use liger_rs::reference::adamw::{AdamWState, adamw_step, clip_grad_norm};
    let Some(dev) = common::candle_gpu("gpu_adamw_matches_the_reference_bit_for_bit") else {
        return;
    };
    let lens: Vec<usize> = (0..40).map(|i| [1, 3, 4097, 977][i % 4] + i).collect();
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    for mixed in [false, true] {
        let mut rng = Rng::new(31 + mixed as u64);
        let init: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, 0.0, 1.0)).collect();
        let masters: Vec<Var> = init
            .iter()
            .map(|h| Var::from_vec(h.clone(), h.len(), &dev).expect("var"))
            .collect();
        let (mut opt, used) = match mixed {
            false => (
                AdamW::new(masters.clone(), params.clone()).expect("opt"),
                masters.clone(),
            ),
            true => AdamW::new_mixed(masters.clone(), params.clone(), DType::BF16).expect("opt"),
        };
        let mut host = init.clone();
        let mut moments: Vec<(Vec<f32>, Vec<f32>)> =
            lens.iter().map(|&n| (vec![0.0; n], vec![0.0; n])).collect();
        let args = liger_rs::AdamWArgs::new(params.lr).with_weight_decay(params.weight_decay);
        for step in 1..=3 {
            let cs: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, 0.0, 0.1)).collect();
            let mut loss = Tensor::zeros((), DType::F32, &dev).expect("zero");
            for (u, c) in used.iter().zip(&cs) {
                let c = Tensor::from_vec(c.clone(), c.len(), &dev).expect("c");
                let w = u.as_tensor().to_dtype(DType::F32).expect("cast");
                loss = (loss + (w * c).expect("mul").sum_all().expect("sum")).expect("add");
            }
            let grads = loss.backward().expect("backward");
            // The gradients the step sees: c, rounded to bf16 through the copies' cast.
            let g: Vec<Vec<f32>> = cs
                .iter()
                .map(|c| match mixed {
                    true => c
                        .iter()
                        .map(|x| half::bf16::from_f32(*x).to_f32())
                        .collect(),
                    false => c.clone(),
                })
                .collect();
            let clip = if step == 2 {
                let norm = opt.clip_grad_norm(&grads, 0.05).expect("norm");
                let norm = norm.to_scalar::<f32>().expect("norm to host");
                let slices: Vec<&[f32]> = g.iter().map(|v| &v[..]).collect();
                let (want, _) = clip_grad_norm(&slices, 0.05, NormType::L2);
                assert!(
                    (norm as f64 - want).abs() <= 1e-5 * want,
                    "{norm} vs {want}"
                );
                Some((0.05f32 / (norm + 1e-6)).min(1.0))
            } else {
                None
            };
            opt.step(&grads).expect("step");
            for ((p, (m, v)), g) in host.iter_mut().zip(moments.iter_mut()).zip(&g) {
                // The clipped gradient rounds to the gradient's type: bf16 for the copies'.
                let g16: Vec<half::bf16> = g.iter().map(|x| half::bf16::from_f32(*x)).collect();
                let r = match mixed {
                    true => adamw_step(
                        &args,
                        step as f32,
                        clip,
                        None,
                        AdamWState {
                            param: p,
                            grad: &g16,
                            exp_avg: m,
                            exp_avg_sq: v,
                            max_exp_avg_sq: None,
                        },
                    ),
                    false => adamw_step(
                        &args,
                        step as f32,
                        clip,
                        None,
                        AdamWState {
                            param: p,
                            grad: g,
                            exp_avg: m,
                            exp_avg_sq: v,
                            max_exp_avg_sq: None,
                        },
                    ),
                };
                r.expect("reference");
            }
        }
        for (i, (m, want)) in masters.iter().zip(&host).enumerate() {
            let got = m.as_tensor().to_vec1::<f32>().expect("download");
            let bad = got
                .iter()
                .zip(want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(bad.is_none(), "mixed {mixed}, tensor {i}, element {bad:?}");
            if mixed {
                let c = used[i].as_tensor().to_vec1::<half::bf16>().expect("copy");
                assert!(
                    c.iter()
                        .zip(&got)
                        .all(|(c, p)| *c == half::bf16::from_f32(*p))
                );
            }
        }
    }
}

/// The fused AdamW follows candle-nn's `AdamW` on the same `ParamsAdamW` within f32
/// rounding over ten steps (the same rule, another operation order).
#[test]
fn gpu_adamw_follows_candle_nn() {
    use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    let Some(dev) = common::candle_gpu("gpu_adamw_follows_candle_nn") else {
        return;
    };
    let mut rng = Rng::new(5);
    let init: Vec<f32> = rng.vec(10_000, 0.0, 1.0);
    let c = Tensor::from_vec(rng.vec::<f32>(10_000, 0.0, 1.0), 10_000, &dev).expect("c");
    let (a, b) = (
        Var::from_vec(init.clone(), 10_000, &dev).expect("var"),
        Var::from_vec(init, 10_000, &dev).expect("var"),
    );
    let params = ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let mut ours = AdamW::new(vec![a.clone()], params.clone()).expect("opt");
    let mut theirs = candle_nn::AdamW::new(vec![b.clone()], params).expect("opt");
    for _ in 0..10 {
        let la = (a.as_tensor().sqr().expect("sqr") * &c)
            .expect("mul")
            .sum_all()
            .expect("sum");
        ours.backward_step(&la).expect("ours");
        let lb = (b.as_tensor().sqr().expect("sqr") * &c)
            .expect("mul")
            .sum_all()
            .expect("sum");
        theirs.backward_step(&lb).expect("theirs");
    }
    assert_near(
        "θ after ten steps",
        a.as_tensor(),
        b.as_tensor(),
        DType::F32,
    );
}
