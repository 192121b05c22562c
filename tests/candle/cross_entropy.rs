//! `liger_rs::candle::{cross_entropy, cross_entropy_with, fused_linear_cross_entropy}` against
//! candle-nn's `loss::cross_entropy` (and `matmul` before it) on the same tensors, values and
//! gradients, on the CPU (the reference) and on CUDA (the kernels and cuBLAS): f32 within f32
//! rounding of candle-nn's f32 chain, bf16 within a few bf16 units (candle-nn computes the bf16
//! chain in bf16, liger-rs in f32, so candle-nn's f32 result on the widened logits is the
//! ground truth there).
use crate::common;

use candle_core::{DType, Device, Tensor, Var};
use liger_rs::Reduction;
use liger_rs::candle::{
    CrossEntropyConfig, cross_entropy, cross_entropy_with, fused_linear_cross_entropy,
};

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn max_abs(a: &Tensor) -> f32 {
    a.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The loss and the logits' gradient of liger-rs's and candle-nn's cross-entropy on the same
/// logits (candle-nn's in f32 on the widened logits).
fn compare(dev: &Device, dtype: DType, rows: usize, vocab: usize) {
    let z = Tensor::randn(0f32, 3.0, (rows, vocab), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let t: Vec<u32> = (0..rows).map(|i| (i * 7919 % vocab) as u32).collect();
    let t = Tensor::new(t.as_slice(), dev).unwrap();
    let ours_z = Var::from_tensor(&z).unwrap();
    let loss = cross_entropy(ours_z.as_tensor(), &t).unwrap();
    assert_eq!(loss.dtype(), dtype);
    assert_eq!(loss.dims(), &[] as &[usize]);
    let g = loss.backward().unwrap();
    let dz = g.get(&ours_z).unwrap();
    let theirs_z = Var::from_tensor(&z.to_dtype(DType::F32).unwrap()).unwrap();
    let want = candle_nn::loss::cross_entropy(theirs_z.as_tensor(), &t).unwrap();
    let gw = want.backward().unwrap();
    let dz_want = gw.get(&theirs_z).unwrap();
    let (l, w) = (
        loss.to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        want.to_scalar::<f32>().unwrap(),
    );
    let (loss_tol, grad_tol) = match dtype {
        DType::F32 => (2e-6, 1e-5),
        _ => (8e-3, 8e-3),
    };
    assert!(
        (l - w).abs() <= loss_tol * w.abs().max(1.0),
        "{dtype:?} {rows}×{vocab}: loss {l} vs {w}"
    );
    // Relative to its largest element, or to the terms it is a difference of (1/rows each:
    // one class cancels to 0).
    let d = max_diff(dz, dz_want) / max_abs(dz_want).max(1.0 / rows as f32);
    assert!(
        d <= grad_tol,
        "{dtype:?} {rows}×{vocab}: gradient off by {d} of its largest"
    );
}

#[test]
fn matches_candle_nn_on_the_cpu() {
    for (rows, vocab) in [(1, 1), (5, 17), (33, 1000)] {
        compare(&Device::Cpu, DType::F32, rows, vocab);
        compare(&Device::Cpu, DType::F64, rows, vocab);
    }
}

/// Logits broadcast over rows (row stride 0) are read as candle-nn reads them (copied first);
/// a bias that is not `[vocab]` is an error before the forward (one of `[1, vocab]` would pass
/// the forward and then break candle's backward, which adds a `[vocab]` gradient to it).
#[test]
fn broadcast_logits_and_a_misshapen_bias_on_the_cpu() {
    let dev = Device::Cpu;
    let z = Tensor::new(&[1f32, 2.0, 3.0], &dev)
        .and_then(|r| r.broadcast_as((4, 3)))
        .unwrap();
    let t = Tensor::new(&[0u32, 1, 2, 1], &dev).unwrap();
    let got = cross_entropy(&z, &t).unwrap().to_scalar::<f32>().unwrap();
    let want = candle_nn::loss::cross_entropy(&z.contiguous().unwrap(), &t)
        .and_then(|l| l.to_scalar::<f32>())
        .unwrap();
    assert!((got - want).abs() <= 1e-6 * want.abs(), "{got} vs {want}");
    let x = Tensor::randn(0f32, 1.0, (4, 8), &dev).unwrap();
    let w = Tensor::randn(0f32, 1.0, (3, 8), &dev).unwrap();
    for dims in [(1, 3), (3, 1)] {
        let b = Tensor::zeros(dims, DType::F32, &dev).unwrap();
        let r = fused_linear_cross_entropy(&x, &w, Some(&b), &t, &CrossEntropyConfig::default());
        let e = r.expect_err("a bias of [1, 3] or [3, 1]").to_string();
        assert!(e.contains("`bias` must be [3]"), "{e}");
    }
}

#[test]
fn matches_candle_nn_on_cuda() {
    let test = "matches_candle_nn_on_cuda";
    let Some(_) = common::gpu(test) else { return };
    let dev = Device::new_cuda(0).expect("cuda device");
    for (rows, vocab) in [(1, 1), (5, 17), (257, 32000), (8, 70001)] {
        compare(&dev, DType::F32, rows, vocab);
        compare(&dev, DType::BF16, rows, vocab);
        compare(&dev, DType::F16, rows, vocab);
    }
}

/// Options through candle: the per-row losses of `Reduction::None` with ignored rows, and a
/// weighted, smoothed mean, against the CPU reference path on the same values.
#[test]
fn options_agree_between_cuda_and_the_cpu() {
    let test = "options_agree_between_cuda_and_the_cpu";
    let Some(_) = common::gpu(test) else { return };
    let dev = Device::new_cuda(0).expect("cuda device");
    let (rows, vocab) = (64, 3000);
    let z = Tensor::randn(0f32, 2.0, (rows, vocab), &Device::Cpu).unwrap();
    let t: Vec<i64> = (0..rows as i64)
        .map(|i| if i % 9 == 4 { -100 } else { i * 31 % 3000 })
        .collect();
    let t = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
    let w = Tensor::rand(0.5f32, 1.5, vocab, &Device::Cpu).unwrap();
    let cfgs = [
        CrossEntropyConfig {
            reduction: Reduction::None,
            ..Default::default()
        },
        CrossEntropyConfig {
            label_smoothing: 0.1,
            lse_square_scale: 1e-3,
            softcap: Some(10.0),
            weight: Some(w.clone()),
            ..Default::default()
        },
    ];
    for cfg in cfgs {
        let on = |d: &Device| {
            let zv = Var::from_tensor(&z.to_device(d).unwrap()).unwrap();
            let cfg = CrossEntropyConfig {
                weight: cfg.weight.as_ref().map(|w| w.to_device(d).unwrap()),
                ..cfg.clone()
            };
            let loss = cross_entropy_with(zv.as_tensor(), &t.to_device(d).unwrap(), &cfg).unwrap();
            let g = loss.sum_all().unwrap().backward().unwrap();
            let dz = g.get(&zv).unwrap().to_device(&Device::Cpu).unwrap();
            (loss.to_device(&Device::Cpu).unwrap(), dz)
        };
        let ((lc, gc), (lg, gg)) = (on(&Device::Cpu), on(&dev));
        assert!(
            max_diff(&lc, &lg) <= 1e-5 * max_abs(&lc).max(1.0),
            "{cfg:?}: loss"
        );
        assert!(
            max_diff(&gc, &gg) <= 1e-5 * max_abs(&gc),
            "{cfg:?}: gradient"
        );
    }
}

/// The fused linear form against `matmul` + candle-nn's cross-entropy: loss and the
/// gradients of x, w and the bias (f32 on CUDA and the CPU; bf16 on CUDA against the f32
/// chain on the widened tensors); a second backward through its graph is an error.
#[test]
fn fused_linear_matches_matmul_and_candle_nn() {
    let cuda = common::gpu("fused_linear_matches_matmul_and_candle_nn")
        .map(|_| Device::new_cuda(0).expect("cuda device"));
    let mut devices = vec![(Device::Cpu, DType::F32)];
    if let Some(d) = cuda {
        devices.push((d.clone(), DType::F32));
        devices.push((d, DType::BF16));
    }
    for (dev, dtype) in devices {
        let (tokens, hidden, vocab) = if dev.is_cpu() {
            (9, 8, 30)
        } else {
            (1500, 256, 5000)
        };
        let x = Tensor::randn(0f32, 1.0, (tokens, hidden), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let w = (Tensor::randn(0f32, 1.0, (vocab, hidden), &dev).unwrap() / (hidden as f64).sqrt())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let b = Tensor::randn(0f32, 0.5, vocab, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let t: Vec<u32> = (0..tokens).map(|i| (i * 13 % vocab) as u32).collect();
        let t = Tensor::new(t.as_slice(), &dev).unwrap();
        let (xv, wv, bv) = (
            Var::from_tensor(&x).unwrap(),
            Var::from_tensor(&w).unwrap(),
            Var::from_tensor(&b).unwrap(),
        );
        let loss = fused_linear_cross_entropy(
            xv.as_tensor(),
            wv.as_tensor(),
            Some(bv.as_tensor()),
            &t,
            &CrossEntropyConfig::default(),
        )
        .unwrap();
        let g = (loss.clone() * 2.0).unwrap().backward().unwrap();
        // The backward freed the kept gradients: a second one through this graph is an error.
        common::expect_err(
            "second backward",
            (loss.clone() * 2.0).unwrap().backward(),
            &["a second backward through the same graph"],
        );
        let f32v = |v: &Tensor| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap();
        let (xf, wf, bf) = (f32v(&x), f32v(&w), f32v(&b));
        let logits = xf
            .as_tensor()
            .matmul(&wf.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(bf.as_tensor())
            .unwrap();
        let want = candle_nn::loss::cross_entropy(&logits, &t).unwrap();
        let gw = (want.clone() * 2.0).unwrap().backward().unwrap();
        let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
        let (l, wl) = (
            loss.to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            want.to_scalar::<f32>().unwrap(),
        );
        assert!(
            (l - wl).abs() <= tol * wl.abs(),
            "{dev:?} {dtype:?}: loss {l} vs {wl}"
        );
        for (name, ours, theirs) in [
            ("dx", g.get(&xv).unwrap(), gw.get(&xf).unwrap()),
            ("dw", g.get(&wv).unwrap(), gw.get(&wf).unwrap()),
            ("db", g.get(&bv).unwrap(), gw.get(&bf).unwrap()),
        ] {
            assert_eq!(ours.dtype(), dtype, "{name}");
            let d = max_diff(ours, theirs) / max_abs(theirs);
            assert!(
                d <= tol,
                "{dev:?} {dtype:?}: {name} off by {d} of its largest"
            );
        }
    }
}

/// The fused linear form's gradients under an upstream gradient of 3 (computed on the
/// device, where the backward reads it) are those under 1 times 3, rounded once to the dtype:
/// bit for bit, in every dtype.
#[test]
fn fused_linear_gradients_scale_by_the_upstream_gradient() {
    let Some(dev) = common::gpu("fused_linear_gradients_scale_by_the_upstream_gradient")
        .map(|_| Device::new_cuda(0).expect("cuda device"))
    else {
        return;
    };
    let (tokens, hidden, vocab) = (700, 96, 3000);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let randn = |shape: (usize, usize), std: f32| {
            Tensor::randn(0f32, std, shape, &dev)
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| Var::from_tensor(&t))
                .unwrap()
        };
        let (x, w) = (randn((tokens, hidden), 1.0), randn((vocab, hidden), 0.1));
        let t: Vec<u32> = (0..tokens).map(|i| (i * 7 % vocab) as u32).collect();
        let t = Tensor::new(t.as_slice(), &dev).unwrap();
        let grads = |factor: f64| {
            let loss = fused_linear_cross_entropy(
                x.as_tensor(),
                w.as_tensor(),
                None,
                &t,
                &CrossEntropyConfig::default(),
            )
            .unwrap();
            let g = (loss * factor).unwrap().backward().unwrap();
            [g.get(&x).unwrap().clone(), g.get(&w).unwrap().clone()]
        };
        let (once, thrice) = (grads(1.0), grads(3.0));
        for (name, one, three) in [("dx", &once[0], &thrice[0]), ("dw", &once[1], &thrice[1])] {
            let want = (one.to_dtype(DType::F64).unwrap() * 3.0)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            let bits = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .unwrap()
            };
            assert!(max_abs(one) > 0.0, "{dtype:?} {name}: all zeros");
            assert_eq!(bits(three), bits(&want), "{dtype:?} {name}");
        }
    }
}
