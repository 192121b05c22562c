//! `liger_rs::candle::nn::AdamW` on CUDA against the reference bit for bit and against
//! candle-nn's optimizer.
use super::*;

/// Steps of `liger_rs::candle::nn::AdamW` on `dev`'s `Var`s (40 of odd lengths: two launches
/// on CUDA) against the reference on the host, bit for bit: f32 variables, and bf16 copies of
/// f32 masters (each copy the updated master rounded once), with clipping by the global norm
/// on the second step (the clipped gradient rounded to bf16 for the copies' on the CPU path
/// too). The gradient of `Σ w·c` is `c`, so the host knows every gradient.
fn adamw_matches_the_reference_bit_for_bit(dev: &Device) {
    use liger_rs::NormType;
    use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    use liger_rs::reference::adamw::{AdamWState, adamw_step, clip_grad_norm};
    let dev = dev.clone();
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

#[test]
fn adamw_matches_the_reference_bit_for_bit_on_the_cpu() {
    adamw_matches_the_reference_bit_for_bit(&Device::Cpu);
}

#[test]
fn gpu_adamw_matches_the_reference_bit_for_bit() {
    if let Some(dev) = common::candle_gpu("gpu_adamw_matches_the_reference_bit_for_bit") {
        adamw_matches_the_reference_bit_for_bit(&dev);
    }
}

/// Each variable's bias correction counts its own updates, as PyTorch's per-parameter `step`:
/// `b`, without a gradient in the first two steps, moves at its first update exactly as
/// under a fresh optimizer's first step, and `a` exactly as under an optimizer of its own.
fn each_variable_counts_its_own_steps(dev: &Device) {
    use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    let var = |x: f32| Var::new(&[x, -x, 0.5 * x], dev).expect("var");
    let (a, b, a_alone, b_alone) = (var(1.0), var(2.0), var(1.0), var(2.0));
    let params = ParamsAdamW {
        lr: 0.1,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = AdamW::new(vec![a.clone(), b.clone()], params.clone()).expect("opt");
    let mut only_a = AdamW::new(vec![a_alone.clone()], params.clone()).expect("opt");
    let mut only_b = AdamW::new(vec![b_alone.clone()], params).expect("opt");
    let c = Tensor::new(&[0.3f32, -0.7, 1.1], dev).expect("c");
    let loss = |v: &Var| {
        (v.as_tensor() * &c)
            .and_then(|t| t.sum_all())
            .expect("loss")
    };
    for step in 1..=3 {
        let both = match step {
            3 => (loss(&a) + loss(&b)).expect("add"),
            _ => loss(&a),
        };
        opt.backward_step(&both).expect("step");
        only_a.backward_step(&loss(&a_alone)).expect("step");
    }
    only_b.backward_step(&loss(&b_alone)).expect("step");
    let bits = |v: &Var| {
        let h = v.as_tensor().to_vec1::<f32>().expect("read");
        h.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(bits(&a), bits(&a_alone), "a after three updates");
    assert_eq!(bits(&b), bits(&b_alone), "b after its first update");
}

#[test]
fn each_variable_counts_its_own_steps_on_the_cpu() {
    each_variable_counts_its_own_steps(&Device::Cpu);
}

#[test]
fn gpu_each_variable_counts_its_own_steps() {
    if let Some(dev) = common::candle_gpu("gpu_each_variable_counts_its_own_steps") {
        each_variable_counts_its_own_steps(&dev);
    }
}

/// candle-nn's inherent constructors and accessors, and a variable given twice refused before
/// any update on the CPU as on CUDA (candle's in-place locks would deadlock there).
#[test]
fn candle_nn_accessors_and_a_repeated_variable() {
    use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    let w = Var::new(&[1f32, 2.0], &Device::Cpu).expect("var");
    let mut opt = AdamW::new_lr(vec![w.clone()], 0.25).expect("opt");
    assert_eq!(opt.params().lr, 0.25);
    assert_eq!(opt.params().beta1, ParamsAdamW::default().beta1);
    opt.set_params(ParamsAdamW {
        lr: 0.5,
        ..Default::default()
    });
    assert_eq!(opt.learning_rate(), 0.5);
    let mut twice = AdamW::new(vec![w.clone(), w.clone()], ParamsAdamW::default()).expect("opt");
    let loss = w.as_tensor().sum_all().expect("loss");
    let r = twice.backward_step(&loss);
    common::expect_err("a repeated variable", r, &["shares its storage"]);
    assert_eq!(w.as_tensor().to_vec1::<f32>().expect("read"), [1.0, 2.0]);
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
