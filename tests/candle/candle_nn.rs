//! candle-nn compatibility (feature `candle`): `liger_rs::candle::nn` against candle-nn 0.11's
//! differentiable `_slow` functions run in f64 on the CPU, forward and the gradient of every
//! input, on random inputs of several shapes in every dtype: on the CPU (always run) and on
//! CUDA (GPU). Shapes that mean something else in candle-nn are errors that say why, in the
//! nn functions and in `liger_rs::candle::rope` (always run). The MLP (`SwigluMlp`, one node)
//! against candle-nn's layers composed.
use crate::common;

use candle_core::{D, DType, Device, Tensor, Var};
use common::{Rng, expect_err};
use liger_rs::Gelu;
use liger_rs::candle::nn::{Linear, Module, RmsNorm, SwigluMlp, ops, rotary_emb};
use liger_rs::candle::{RopeConfig, linear, rope, rope_with, swiglu_mlp};
use std::f64::consts::{FRAC_1_SQRT_2, PI};

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
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let n = nn_sweep(DType::F32, &dev, 11);
    println!("{test}: {n} cases");
}

#[test]
fn gpu_nn_matches_candle_nn_slow_f16() {
    let Some(dev) = common::candle_gpu("gpu_nn_matches_candle_nn_slow_f16") else {
        return;
    };
    nn_sweep(DType::F16, &dev, 12);
}

#[test]
fn gpu_nn_matches_candle_nn_slow_bf16() {
    let Some(dev) = common::candle_gpu("gpu_nn_matches_candle_nn_slow_bf16") else {
        return;
    };
    nn_sweep(DType::BF16, &dev, 13);
}

/// The GPU and the CPU path agree on the same bf16 data: RoPE bit for bit (the reference
/// rounds where the kernels do), RMSNorm and SwiGLU within the kernels' few ulps.
#[test]
fn gpu_nn_matches_the_cpu_path() {
    let test = "gpu_nn_matches_the_cpu_path";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
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
    let Some(dev) = common::candle_gpu("gpu_embedding_matches_candle_nn") else {
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

#[path = "candle_nn/adamw.rs"]
mod adamw;
#[path = "candle_nn/errors.rs"]
mod errors;
