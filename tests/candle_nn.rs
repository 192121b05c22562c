//! candle-nn compatibility (feature `candle`): `liger_rs::candle::nn` against candle-nn 0.11's
//! differentiable `_slow` functions run in f64 on the CPU, forward and the gradient of every
//! input, on random inputs of several shapes in every dtype: on the CPU (always run) and on
//! CUDA (GPU). Shapes that mean something else in candle-nn are errors that say why, in the
//! nn functions and in `liger_rs::candle::rope` (always run). The MLP (`SwigluMlp`, one node)
//! against candle-nn's layers composed.
#![cfg(feature = "candle")]
mod common;

use candle_core::{D, DType, Device, Tensor, Var};
use common::Rng;
use liger_rs::Gelu;
use liger_rs::candle::nn::{Linear, Module, RmsNorm, SwigluMlp, ops, rotary_emb};
use liger_rs::candle::{RopeConfig, linear, rope, rope_with, swiglu_mlp};
use std::f64::consts::{FRAC_1_SQRT_2, PI};

/// CUDA device 0 as candle opens it, or `None` after the skip line of [`common::gpu`].
fn candle_gpu(test: &str) -> Option<Device> {
    common::gpu(test)?;
    Some(Device::new_cuda(0).expect("candle opens the GPU that liger-rs found"))
}

/// Normal values with standard deviation `scale` (seeded), rounded to `dtype`, on `dev`.
fn randn(rng: &mut Rng, dims: &[usize], scale: f64, dtype: DType, dev: &Device) -> Tensor {
    let v: Vec<f64> = rng.vec(dims.iter().product(), 0.0, scale);
    Tensor::from_vec(v, dims, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .expect("random tensor")
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("download")
}

/// Relative error a value computed in `dtype` may carry against f64: a few roundings.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 2e-5,
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        other => panic!("no tolerance for {other:?}"),
    }
}

/// `|got − want| ≤ tol·(|want| + rms(want))` element by element: a few roundings of the
/// value or of the terms it sums (cancellation), far below what a wrong formula gives.
fn assert_near(what: &str, got: &Tensor, want: &Tensor, dtype: DType) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (f64s(got), f64s(want));
    let rms = (w.iter().map(|v| v * v).sum::<f64>() / w.len().max(1) as f64).sqrt();
    let tol = tolerance(dtype);
    let bad: Vec<String> = g
        .iter()
        .zip(&w)
        .enumerate()
        .filter(|(_, (g, w))| (*g - *w).abs() > tol * (w.abs() + rms)) // NaN fails too
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] got {g:e} want {w:e}"))
        .collect();
    let nan = g.iter().any(|v| v.is_nan());
    assert!(
        bad.is_empty() && !nan,
        "{what} ({dtype:?}, rms {rms:e}): {bad:?}"
    );
}

type Op = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>>;

/// One comparison: `ours` on `inputs` rounded to `dtype` on `dev`, against `slow` on the same
/// values in f64 on the CPU: the output, then the gradient of every input under the loss
/// `Σ y·R` for a random `R`.
fn compare(what: &str, dtype: DType, dev: &Device, inputs: &[Tensor], ours: Op, slow: Op) {
    let rounded: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(dtype).expect("round"))
        .collect();
    let vars: Vec<Var> = rounded
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(dev).expect("upload")).expect("var"))
        .collect();
    let exact: Vec<Var> = rounded
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F64).expect("widen")).expect("var"))
        .collect();
    let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = ours(&args).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(y.dtype(), dtype, "{what}: output dtype");
    let exact_args: Vec<Tensor> = exact.iter().map(|v| v.as_tensor().clone()).collect();
    let y_want = slow(&exact_args).unwrap_or_else(|e| panic!("{what} (slow): {e}"));
    assert_near(&format!("{what}: y"), &y, &y_want, dtype);

    let mut rng = Rng::new(y.elem_count() as u64);
    let r = randn(&mut rng, y.dims(), 1.0, DType::F64, &Device::Cpu);
    let loss = |y: &Tensor| {
        let y = y.to_dtype(DType::F64)?.to_device(&Device::Cpu)?;
        (y * &r)?.sum_all()
    };
    let grads = loss(&y).and_then(|l| l.backward()).expect("backward");
    let grads_want = loss(&y_want).and_then(|l| l.backward()).expect("backward");
    for (i, (v, w)) in vars.iter().zip(&exact).enumerate() {
        let g = grads
            .get(v)
            .unwrap_or_else(|| panic!("{what}: no gradient for input {i}"));
        let gw = grads_want.get(w).expect("slow gradient");
        assert_eq!(g.dtype(), dtype, "{what}: gradient {i} dtype");
        assert_near(&format!("{what}: d input {i}"), g, gw, dtype);
    }
}

/// rope_slow (or rope_i_slow) for `[b, t, d/2]` tables: each batch entry with its own table.
fn per_batch(
    slow: fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    x: &[Tensor],
) -> candle_core::Result<Tensor> {
    let b = x[0].dim(0)?;
    let parts = (0..b)
        .map(|i| {
            let table = |t: &Tensor| t.narrow(0, i, 1)?.squeeze(0);
            slow(&x[0].narrow(0, i, 1)?, &table(&x[1])?, &table(&x[2])?)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

/// candle-nn's `rope_slow` on `[b, t, h, d]`: through its `[b, h, t, d]` layout.
fn rope_thd_slow(x: &[Tensor]) -> candle_core::Result<Tensor> {
    let xs = x[0].transpose(1, 2)?;
    candle_nn::rotary_emb::rope_slow(&xs, &x[1], &x[2])?.transpose(1, 2)
}

/// candle-nn's `Linear` on `x`, a row of one for a vector (which candle-nn does not take).
fn candle_nn_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let layer = candle_nn::Linear::new(w.clone(), b.cloned());
    match x.rank() {
        1 => layer.forward(&x.unsqueeze(0)?)?.squeeze(0),
        _ => layer.forward(x),
    }
}

/// Every nn function on several shapes in `dtype` on `dev`.
fn nn_sweep(dtype: DType, dev: &Device, seed: u64) -> usize {
    let mut rng = Rng::new(seed);
    let cpu = Device::Cpu;
    let f64_ = DType::F64;
    let mut n = 0;
    let mut run = |what: String, inputs: Vec<Tensor>, ours: Op, slow: Op| {
        compare(&what, dtype, dev, &inputs, ours, slow);
        n += 1;
    };

    for dims in [vec![5, 64], vec![2, 3, 17], vec![1, 1, 1, 8], vec![3, 200]] {
        let hidden = *dims.last().unwrap();
        let x = randn(&mut rng, &dims, 1.0, f64_, &cpu);
        let w = randn(&mut rng, &[hidden], 0.5, f64_, &cpu)
            .affine(1.0, 1.0)
            .unwrap();
        for eps in [1e-6f32, 0.25] {
            run(
                format!("ops::rms_norm {dims:?} eps {eps}"),
                vec![x.clone(), w.clone()],
                Box::new(move |t| ops::rms_norm(&t[0], &t[1], eps)),
                Box::new(move |t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], eps)),
            );
        }
        run(
            format!("RmsNorm::forward {dims:?}"),
            vec![x.clone(), w.clone()],
            Box::new(|t| RmsNorm::new(t[1].clone(), 1e-5).forward(&t[0])),
            Box::new(|t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5)),
        );
    }

    // (b, h, t, d, rows of a 2-D table).
    for (b, h, t, d, rows) in [
        (2, 3, 5, 8, 5),
        (1, 2, 7, 16, 10),
        (3, 1, 1, 4, 1),
        (2, 4, 9, 6, 12),
    ] {
        let xs = randn(&mut rng, &[b, h, t, d], 1.0, f64_, &cpu);
        let thd = randn(&mut rng, &[b, t, h, d], 1.0, f64_, &cpu);
        let angles = randn(&mut rng, &[rows, d / 2], 2.0, f64_, &cpu);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let per = randn(&mut rng, &[b, t, d / 2], 2.0, f64_, &cpu);
        let (cos_b, sin_b) = (per.cos().unwrap(), per.sin().unwrap());
        let shape = format!("b={b} h={h} t={t} d={d}");
        run(
            format!("rotary_emb::rope {shape} [{rows}, d/2]"),
            vec![xs.clone(), cos.clone(), sin.clone()],
            Box::new(|t| rotary_emb::rope(&t[0], &t[1], &t[2])),
            Box::new(|t| candle_nn::rotary_emb::rope_slow(&t[0], &t[1], &t[2])),
        );
        run(
            format!("rotary_emb::rope {shape} [b, t, d/2]"),
            vec![xs.clone(), cos_b.clone(), sin_b.clone()],
            Box::new(|t| rotary_emb::rope(&t[0], &t[1], &t[2])),
            Box::new(|t| per_batch(candle_nn::rotary_emb::rope_slow, t)),
        );
        run(
            format!("rotary_emb::rope_i {shape} [{rows}, d/2]"),
            vec![xs.clone(), cos.clone(), sin.clone()],
            Box::new(|t| rotary_emb::rope_i(&t[0], &t[1], &t[2])),
            Box::new(|t| candle_nn::rotary_emb::rope_i_slow(&t[0], &t[1], &t[2])),
        );
        run(
            format!("rotary_emb::rope_i {shape} [b, t, d/2]"),
            vec![xs.clone(), cos_b.clone(), sin_b.clone()],
            Box::new(|t| rotary_emb::rope_i(&t[0], &t[1], &t[2])),
            Box::new(|t| per_batch(candle_nn::rotary_emb::rope_i_slow, t)),
        );
        run(
            format!("rotary_emb::rope_thd {shape} [{rows}, d/2]"),
            vec![thd.clone(), cos.clone(), sin.clone()],
            Box::new(|t| rotary_emb::rope_thd(&t[0], &t[1], &t[2])),
            Box::new(rope_thd_slow),
        );
        run(
            format!("rotary_emb::rope_thd {shape} [b, t, d/2]"),
            vec![thd, cos_b, sin_b],
            Box::new(|t| rotary_emb::rope_thd(&t[0], &t[1], &t[2])),
            Box::new(|t| {
                let xs = t[0].transpose(1, 2)?;
                let bhtd = [xs, t[1].clone(), t[2].clone()];
                per_batch(candle_nn::rotary_emb::rope_slow, &bhtd)?.transpose(1, 2)
            }),
        );
    }

    for dims in [vec![3, 14], vec![2, 4, 32], vec![1, 2], vec![7, 1, 130]] {
        let xs = randn(&mut rng, &dims, 2.0, f64_, &cpu);
        run(
            format!("ops::swiglu {dims:?}"),
            vec![xs],
            Box::new(|t| ops::swiglu(&t[0])),
            Box::new(|t| candle_nn::ops::swiglu(&t[0])),
        );
        let half: Vec<usize> = dims[..dims.len() - 1]
            .iter()
            .copied()
            .chain([dims[dims.len() - 1] / 2])
            .collect();
        let (a, b) = (
            randn(&mut rng, &half, 2.0, f64_, &cpu),
            randn(&mut rng, &half, 1.0, f64_, &cpu),
        );
        run(
            format!("ops::silu_mul {half:?}"),
            vec![a, b],
            Box::new(|t| ops::silu_mul(&t[0], &t[1])),
            Box::new(|t| t[0].silu()? * &t[1]),
        );
    }

    // (x dims, out features): rank 1 to 4, one row, one feature.
    for (dims, out) in [
        (vec![7], 5),
        (vec![6, 16], 9),
        (vec![2, 3, 33], 1),
        (vec![2, 1, 3, 8], 12),
    ] {
        let k = *dims.last().unwrap();
        let x = randn(&mut rng, &dims, 1.0, f64_, &cpu);
        let w = randn(&mut rng, &[out, k], 0.5, f64_, &cpu);
        let bias = randn(&mut rng, &[out], 1.0, f64_, &cpu);
        run(
            format!("Linear::forward {dims:?} → {out}"),
            vec![x.clone(), w.clone()],
            Box::new(|t| Linear::new(t[1].clone(), None).forward(&t[0])),
            Box::new(|t| candle_nn_linear(&t[0], &t[1], None)),
        );
        run(
            format!("Linear::forward {dims:?} → {out} with bias"),
            vec![x.clone(), w.clone(), bias],
            Box::new(|t| Linear::new(t[1].clone(), Some(t[2].clone())).forward(&t[0])),
            Box::new(|t| candle_nn_linear(&t[0], &t[1], Some(&t[2]))),
        );
        if dims.len() < 2 {
            continue;
        }
        // A transposed (non-contiguous) input. candle-nn's Linear sends it through a matmul
        // with the broadcast weight, which candle 0.11.1's CPU backend gets wrong for a
        // transposed left operand, so the ground truth is the contiguous copy's.
        run(
            format!("linear of a transposed {dims:?}"),
            vec![x.t().unwrap(), w],
            Box::new(|t| linear(&t[0].t()?, &t[1], None)),
            Box::new(|t| candle_nn_linear(&t[0].t()?.contiguous()?, &t[1], None)),
        );
    }

    // (x dims, inter): rank 1 to 3, an intermediate of one, one wider than the hidden size.
    for (dims, inter) in [
        (vec![5], 3),
        (vec![6, 16], 24),
        (vec![2, 3, 33], 1),
        (vec![4, 40], 9),
    ] {
        let hidden = *dims.last().unwrap();
        let x = randn(&mut rng, &dims, 1.0, f64_, &cpu);
        let gate_up = randn(&mut rng, &[2 * inter, hidden], 0.5, f64_, &cpu);
        let down = randn(&mut rng, &[hidden, inter], 0.5, f64_, &cpu);
        for (form, act) in [
            ("swiglu", None),
            ("geglu tanh", Some(Gelu::Tanh)),
            ("geglu erf", Some(Gelu::Erf)),
        ] {
            run(
                format!("SwigluMlp::forward ({form}) {dims:?}, inter {inter}"),
                vec![x.clone(), gate_up.clone(), down.clone()],
                Box::new(move |t| {
                    let (g, d) = (t[1].clone(), t[2].clone());
                    match act {
                        None => SwigluMlp::new(g, d),
                        Some(gelu) => SwigluMlp::geglu(g, d, gelu),
                    }
                    .forward(&t[0])
                }),
                Box::new(move |t| mlp_slow(&t[0], &t[1], &t[2], act)),
            );
        }
    }
    n
}

/// Llama's (or with `gelu`, Gemma's) MLP as candle-nn's layers compose it.
fn mlp_slow(
    x: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    gelu: Option<Gelu>,
) -> candle_core::Result<Tensor> {
    let inter = down.dim(1)?;
    let gate = candle_nn_linear(x, &gate_up.narrow(0, 0, inter)?, None)?;
    let up = candle_nn_linear(x, &gate_up.narrow(0, inter, inter)?, None)?;
    // GELU from elementary ops: the backward of candle's `gelu` uses six-digit constants.
    let half_x = (&gate * 0.5)?;
    let gate = match gelu {
        None => gate.silu()?,
        Some(Gelu::Tanh) => {
            let inner = ((&gate + (gate.powf(3.0)? * 0.044715)?)? * (2.0 / PI).sqrt())?;
            (&half_x * (inner.tanh()? + 1.0)?)?
        }
        Some(Gelu::Erf) => (&half_x * ((&gate * FRAC_1_SQRT_2)?.erf()? + 1.0)?)?,
        Some(other) => panic!("no candle form of {other:?}"),
    };
    candle_nn_linear(&(gate * up)?, down, None)
}

#[test]
fn cpu_nn_matches_candle_nn_slow_f32() {
    let n = nn_sweep(DType::F32, &Device::Cpu, 1);
    println!("cpu_nn_matches_candle_nn_slow_f32: {n} cases");
}

#[test]
fn cpu_nn_matches_candle_nn_slow_f16() {
    nn_sweep(DType::F16, &Device::Cpu, 2);
}

#[test]
fn cpu_nn_matches_candle_nn_slow_bf16() {
    nn_sweep(DType::BF16, &Device::Cpu, 3);
}

#[test]
fn cpu_nn_matches_candle_nn_slow_f64() {
    nn_sweep(DType::F64, &Device::Cpu, 4);
}

#[test]
fn gpu_nn_matches_candle_nn_slow_f32() {
    let test = "gpu_nn_matches_candle_nn_slow_f32";
    let Some(dev) = candle_gpu(test) else { return };
    let n = nn_sweep(DType::F32, &dev, 11);
    println!("{test}: {n} cases");
}

#[test]
fn gpu_nn_matches_candle_nn_slow_f16() {
    let Some(dev) = candle_gpu("gpu_nn_matches_candle_nn_slow_f16") else {
        return;
    };
    nn_sweep(DType::F16, &dev, 12);
}

#[test]
fn gpu_nn_matches_candle_nn_slow_bf16() {
    let Some(dev) = candle_gpu("gpu_nn_matches_candle_nn_slow_bf16") else {
        return;
    };
    nn_sweep(DType::BF16, &dev, 13);
}

/// The GPU and the CPU path agree on the same bf16 data: RoPE bit for bit (the reference
/// rounds where the kernels do), RMSNorm and SwiGLU within the kernels' few ulps.
#[test]
fn gpu_nn_matches_the_cpu_path() {
    let test = "gpu_nn_matches_the_cpu_path";
    let Some(dev) = candle_gpu(test) else { return };
    let mut rng = Rng::new(21);
    let dtype = DType::BF16;
    let cpu = Device::Cpu;
    let (b, h, t, d) = (2, 5, 33, 64);
    let xs = randn(&mut rng, &[b, h, t, d], 1.0, dtype, &cpu);
    let angles = randn(&mut rng, &[t + 4, d / 2], 2.0, DType::F32, &cpu);
    let cos = angles.cos().unwrap().to_dtype(dtype).unwrap();
    let sin = angles.sin().unwrap().to_dtype(dtype).unwrap();
    let on_gpu = |x: &Tensor| x.to_device(&dev).unwrap();
    for f in [rotary_emb::rope, rotary_emb::rope_i] {
        let want = f(&xs, &cos, &sin).unwrap();
        let got = f(&on_gpu(&xs), &on_gpu(&cos), &on_gpu(&sin)).unwrap();
        assert_eq!(f64s(&got), f64s(&want), "rope on GPU vs CPU");
    }
    let thd = xs.transpose(1, 2).unwrap().contiguous().unwrap();
    let want = rotary_emb::rope_thd(&thd, &cos, &sin).unwrap();
    let got = rotary_emb::rope_thd(&on_gpu(&thd), &on_gpu(&cos), &on_gpu(&sin)).unwrap();
    assert_eq!(f64s(&got), f64s(&want), "rope_thd on GPU vs CPU");

    let w = randn(&mut rng, &[d], 0.5, dtype, &cpu);
    let want = ops::rms_norm(&xs, &w, 1e-5).unwrap();
    let got = ops::rms_norm(&on_gpu(&xs), &on_gpu(&w), 1e-5).unwrap();
    assert_near("rms_norm on GPU vs CPU", &got, &want, dtype);
    let want = ops::swiglu(&xs).unwrap();
    let got = ops::swiglu(&on_gpu(&xs)).unwrap();
    assert_near("swiglu on GPU vs CPU", &got, &want, dtype);
}

#[test]
fn rms_norm_from_a_var_builder_trains_its_weight() {
    // candle-nn's constructor: the weight comes from the VarBuilder (a VarMap here, so it is
    // a trainable variable) and gets a gradient, equal to that of candle-nn's LayerNorm chain.
    let vars = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let norm = liger_rs::candle::nn::rms_norm(24, 1e-6, vb.pp("norm")).unwrap();
    let weight = vars.all_vars().pop().expect("one variable");
    let mut rng = Rng::new(31);
    let x = randn(&mut rng, &[4, 24], 1.0, DType::F32, &Device::Cpu);
    let y = norm.forward(&x).unwrap();
    let want = norm.clone().into_inner().forward(&x).unwrap();
    assert_near("forward", &y, &want, DType::F32);
    let r = randn(&mut rng, &[4, 24], 1.0, DType::F32, &Device::Cpu);
    let grad = |y: Tensor| {
        let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        g.get(&weight).cloned().expect("a gradient for the weight")
    };
    assert_near("d weight", &grad(y), &grad(want), DType::F32);
}

// ---------------------------------------------------------------- shapes with another meaning

fn expect_err<V: std::fmt::Debug>(what: &str, r: candle_core::Result<V>, needles: &[&str]) {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "{what}: message {msg:?} lacks {n:?}");
            }
        }
    }
}

/// candle-nn's tables are `[t, d/2]`, HF's `[t, d]` (`cat(freqs, freqs)`). Each API either
/// computes what a shape means in candle-nn or says why it will not.
#[test]
fn half_width_table_trap_is_impossible() {
    let cpu = Device::Cpu;
    let mut rng = Rng::new(41);
    let (b, h, t, d) = (2, 3, 6, 8);
    let f32_ = DType::F32;
    let xs = randn(&mut rng, &[b, h, t, d], 1.0, f32_, &cpu);
    let thd = xs.transpose(1, 2).unwrap().contiguous().unwrap(); // [b, t, h, d]
    let angles = randn(&mut rng, &[t, d / 2], 2.0, f32_, &cpu);
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let full = |x: &Tensor| Tensor::cat(&[x, x], D::Minus1).unwrap(); // HF's [t, d]
    let (cos_full, sin_full) = (full(&cos), full(&sin));

    // nn: a full-width table is an error naming the fix.
    for (name, f, x) in [
        (
            "rope",
            rotary_emb::rope as fn(&Tensor, &Tensor, &Tensor) -> _,
            &xs,
        ),
        ("rope_i", rotary_emb::rope_i, &xs),
        ("rope_thd", rotary_emb::rope_thd, &thd),
    ] {
        expect_err(
            name,
            f(x, &cos_full, &sin_full),
            &[name, "one value per pair", "full-width", "[6, 8]"],
        );
        // Fewer rows than positions; per-batch tables of another length; a 4-D table.
        expect_err(
            name,
            f(
                x,
                &cos.narrow(0, 0, t - 1).unwrap(),
                &sin.narrow(0, 0, t - 1).unwrap(),
            ),
            &["5 rows", "6 positions"],
        );
        let per = randn(&mut rng, &[b, t + 1, d / 2], 1.0, f32_, &cpu);
        expect_err(
            name,
            f(x, &per, &per),
            &["per-batch", "[2, 6, 4]", "[2, 7, 4]"],
        );
        let one = randn(&mut rng, &[1, t, d / 2], 1.0, f32_, &cpu);
        expect_err(name, f(x, &one, &one), &["per-batch", "[1, 6, 4]"]);
        let four = randn(&mut rng, &[1, 1, t, d / 2], 1.0, f32_, &cpu);
        expect_err(name, f(x, &four, &four), &["[t, d/2] or [b, t, d/2]"]);
    }
    // A longer 2-D table: its first t rows, as candle-nn reads it.
    let extra = randn(&mut rng, &[3, d / 2], 1.0, f32_, &cpu);
    let long = |x: &Tensor| Tensor::cat(&[x, &extra], 0).unwrap();
    let got = rotary_emb::rope(&xs, &long(&cos), &long(&sin)).unwrap();
    let want = rotary_emb::rope(&xs, &cos, &sin).unwrap();
    assert_eq!(f64s(&got), f64s(&want), "first t rows of a longer table");

    // liger_rs::candle::rope (HF's [B, S, H, d] q and k): a [S, d/2] table would be a partial
    // rotary of d/2 with HF's full-width rows, or candle-nn's full rotation: it is an error
    // until the config says which.
    let k = thd.narrow(2, 0, 1).unwrap().contiguous().unwrap();
    expect_err(
        "rope",
        rope(&thd, &k, &cos, &sin, None),
        &["ambiguous", "half_tables", "with_rotary_dim(4)"],
    );
    // Said as candle-nn's table: candle-nn's meaning, rope_thd's result.
    let cfg = RopeConfig::default().with_half_tables();
    let (q2, k2) = rope_with(&thd, &k, &cos, &sin, None, &cfg).unwrap();
    assert_eq!(
        f64s(&q2),
        f64s(&rotary_emb::rope_thd(&thd, &cos, &sin).unwrap())
    );
    assert_eq!(
        f64s(&k2),
        f64s(&rotary_emb::rope_thd(&k, &cos, &sin).unwrap())
    );
    // Said as a partial rotary: the first d/2 dims rotate by HF's full-width rows of d/2,
    // i.e. pair i is (x[i], x[i + d/4]); the last d/2 dims stay.
    let cfg = RopeConfig::default().with_rotary_dim(d / 2);
    let (q3, _) = rope_with(&thd, &k, &cos, &sin, None, &cfg).unwrap();
    let head = thd.narrow(3, 0, d / 2).unwrap().contiguous().unwrap();
    let quarter = |x: &Tensor| x.narrow(1, 0, d / 4).unwrap();
    let want = rotary_emb::rope_thd(&head, &quarter(&cos), &quarter(&sin)).unwrap();
    assert_eq!(
        f64s(&q3.narrow(3, 0, d / 2).unwrap()),
        f64s(&want),
        "partial rotary"
    );
    assert_eq!(
        f64s(&q3.narrow(3, d / 2, d / 2).unwrap()),
        f64s(&thd.narrow(3, d / 2, d / 2).unwrap()),
        "the tail passes through"
    );
    // Rows that fit neither reading of the config are errors.
    let half = RopeConfig::default().with_half_tables();
    let (c, s) = (&cos_full, &sin_full);
    expect_err(
        "rope_with",
        rope_with(&thd, &k, c, s, None, &half),
        &["rotary_dim"],
    );
    let cfg = RopeConfig::default().with_rotary_dim(d);
    expect_err(
        "rope_with",
        rope_with(&thd, &k, &cos, &sin, None, &cfg),
        &["must be 8 long", "full-width", "rotary_dim = 8"],
    );
}

/// Steps of `liger_rs::candle::nn::AdamW` on CUDA `Var`s (40 of odd lengths: two launches)
/// against the reference on the host, bit for bit: f32 variables, and bf16 copies of f32
/// masters (each copy the updated master rounded once), with clipping by the global norm on
/// the second step. The gradient of `Σ w·c` is `c`, so the host knows every gradient.
#[test]
fn gpu_adamw_matches_the_reference_bit_for_bit() {
    use liger_rs::NormType;
    use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    use liger_rs::reference::adamw::{AdamWState, adamw_step, clip_grad_norm};
    let Some(dev) = candle_gpu("gpu_adamw_matches_the_reference_bit_for_bit") else {
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
    let Some(dev) = candle_gpu("gpu_adamw_follows_candle_nn") else {
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

#[test]
fn linear_errors_name_the_argument() {
    let dev = Device::Cpu;
    let z = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &dev).unwrap();
    let w = z(&[3, 4], DType::F32);
    expect_err(
        "x of another width",
        linear(&z(&[2, 5], DType::F32), &w, None),
        &["x must be [..., 4]", "[3, 4]", "[2, 5]"],
    );
    expect_err(
        "a scalar x",
        linear(&z(&[], DType::F32), &w, None),
        &["x must be [..., 4]"],
    );
    expect_err(
        "a weight of rank 3",
        linear(&z(&[2, 4], DType::F32), &z(&[1, 3, 4], DType::F32), None),
        &["weight must be [out, in]"],
    );
    expect_err(
        "a bias of another length",
        linear(&z(&[2, 4], DType::F32), &w, Some(&z(&[4], DType::F32))),
        &["bias must be [3]", "[4]"],
    );
    expect_err(
        "a weight of another dtype",
        linear(&z(&[2, 4], DType::F32), &z(&[3, 4], DType::F64), None),
        &["weight is F64, x is F32"],
    );
    expect_err(
        "a bias of another dtype",
        linear(&z(&[2, 4], DType::F32), &w, Some(&z(&[3], DType::BF16))),
        &["bias is BF16, x is F32"],
    );
}

#[test]
fn mlp_errors_name_the_argument() {
    let dev = Device::Cpu;
    let z = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &dev).unwrap();
    let (x, gu, down) = (
        z(&[2, 4], DType::F32),
        z(&[6, 4], DType::F32),
        z(&[4, 3], DType::F32),
    );
    expect_err(
        "an odd gate-up height",
        swiglu_mlp(&x, &z(&[5, 4], DType::F32), &down),
        &["gate_up_weight must be [2·inter, hidden]", "[5, 4]"],
    );
    expect_err(
        "a gate-up weight of rank 1",
        swiglu_mlp(&x, &z(&[6], DType::F32), &down),
        &["gate_up_weight must be"],
    );
    expect_err(
        "a down weight of the gate-up's shape",
        swiglu_mlp(&x, &gu, &z(&[3, 4], DType::F32)),
        &["down_weight must be [4, 3]", "[3, 4]"],
    );
    expect_err(
        "x of another width",
        swiglu_mlp(&z(&[2, 5], DType::F32), &gu, &down),
        &["x must be [..., 4]", "[2, 5]"],
    );
    expect_err(
        "a scalar x",
        swiglu_mlp(&z(&[], DType::F32), &gu, &down),
        &["x must be [..., 4]"],
    );
    expect_err(
        "a down weight of another dtype",
        swiglu_mlp(&x, &gu, &z(&[4, 3], DType::BF16)),
        &["down_weight is BF16, x is F32"],
    );
}

/// `Embedding` against candle-nn's on the same table and ids: the rows exactly, the table's
/// gradient (under `Σ y·R`) within the dtype's rounding of candle-nn's in f64 on the CPU;
/// ids of every type candle-nn takes, one id repeated.
fn embedding_sweep(dtype: DType, dev: &Device) {
    let mut rng = Rng::new(31);
    let cpu = Device::Cpu;
    let (vocab, hidden) = (23, 40);
    let table = randn(&mut rng, &[vocab, hidden], 1.0, DType::F64, &cpu)
        .to_dtype(dtype)
        .unwrap();
    let ids: Vec<u32> = (0..30)
        .map(|i| if i % 4 == 0 { 7 } else { (i * 5 % 23) as u32 })
        .collect();
    let ids = Tensor::from_vec(ids, (3, 10), &cpu).unwrap();
    for id_type in [DType::U32, DType::I64, DType::U8] {
        let what = format!("Embedding {dtype:?}, {id_type:?} ids");
        let ids = ids.to_dtype(id_type).unwrap();
        let ours_table = Var::from_tensor(&table.to_device(dev).unwrap()).unwrap();
        let y = liger_rs::candle::nn::Embedding::new(ours_table.as_tensor().clone(), hidden)
            .forward(&ids.to_device(dev).unwrap())
            .unwrap();
        let exact_table = Var::from_tensor(&table.to_dtype(DType::F64).unwrap()).unwrap();
        let y_want = candle_nn::Embedding::new(exact_table.as_tensor().clone(), hidden)
            .forward(&ids)
            .unwrap();
        assert_eq!(y.dims(), [3, 10, hidden], "{what}: shape");
        assert_eq!(f64s(&y), f64s(&y_want), "{what}: rows");
        let r = randn(&mut rng, y.dims(), 1.0, DType::F64, &cpu);
        let loss = |y: &Tensor| (y.to_dtype(DType::F64)?.to_device(&cpu)? * &r)?.sum_all();
        let g = loss(&y).unwrap().backward().unwrap();
        let g_want = loss(&y_want).unwrap().backward().unwrap();
        let dw = g.get(&ours_table).expect("a gradient for the table");
        assert_eq!(dw.dtype(), dtype, "{what}: gradient dtype");
        assert_near(
            &format!("{what}: d table"),
            dw,
            g_want.get(&exact_table).unwrap(),
            dtype,
        );
    }
    expect_err(
        "a 3-D table",
        liger_rs::candle::embedding(&table.reshape((1, vocab, hidden)).unwrap(), &ids),
        &["table must be [vocab, hidden]"],
    );
    expect_err(
        "f32 ids",
        liger_rs::candle::embedding(&table, &ids.to_dtype(DType::F32).unwrap()),
        &["ids must be u8, u32 or i64"],
    );
}

#[test]
fn cpu_embedding_matches_candle_nn() {
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        embedding_sweep(dtype, &Device::Cpu);
    }
}

#[test]
fn gpu_embedding_matches_candle_nn() {
    let Some(dev) = candle_gpu("gpu_embedding_matches_candle_nn") else {
        return;
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        embedding_sweep(dtype, &dev);
    }
}

/// The gradients a backward hands out record no graph of their own: a graph would keep the
/// incoming gradient alive for as long as the gradient store (the optimizer step).
#[test]
fn gradients_of_linear_mlp_and_rope_tables_hold_no_graph() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(41);
    let x = Var::from_tensor(&randn(&mut rng, &[2, 3, 8], 1.0, DType::F32, &dev)).unwrap();
    let w = Var::from_tensor(&randn(&mut rng, &[5, 8], 1.0, DType::F32, &dev)).unwrap();
    let y = linear(x.as_tensor(), w.as_tensor(), None).unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v, other) in [("dW", &w, &x), ("dx", &x, &w)] {
        let g = grads.get(v).unwrap();
        let again = g.sum_all().unwrap().backward().unwrap();
        assert!(again.get(other).is_none(), "{name} records a graph");
    }
    let xs = Var::from_tensor(&randn(&mut rng, &[1, 4, 2, 8], 1.0, DType::F32, &dev)).unwrap();
    let angles = randn(&mut rng, &[4, 4], 1.0, DType::F32, &dev);
    let cos = Var::from_tensor(&angles.cos().unwrap()).unwrap();
    let sin = Var::from_tensor(&angles.sin().unwrap()).unwrap();
    let y = rotary_emb::rope_thd(xs.as_tensor(), cos.as_tensor(), sin.as_tensor()).unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let again = grads
        .get(&cos)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(again.get(&xs).is_none(), "dcos records a graph");

    let x = Var::from_tensor(&randn(&mut rng, &[3, 8], 1.0, DType::F32, &dev)).unwrap();
    let gu = Var::from_tensor(&randn(&mut rng, &[10, 8], 1.0, DType::F32, &dev)).unwrap();
    let down = Var::from_tensor(&randn(&mut rng, &[8, 5], 1.0, DType::F32, &dev)).unwrap();
    let y = swiglu_mlp(x.as_tensor(), gu.as_tensor(), down.as_tensor()).unwrap();
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v) in [("MLP dx", &x), ("MLP dW_gu", &gu), ("MLP dW_down", &down)] {
        let again = grads.get(v).unwrap().sum_all().unwrap().backward().unwrap();
        for other in [&x, &gu, &down] {
            assert!(again.get(other).is_none(), "{name} records a graph");
        }
    }
}
