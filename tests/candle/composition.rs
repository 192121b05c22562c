//! GPU: ops composed in one graph, several streams and threads, errors.
use super::*;

/// A Llama-shaped block (RMSNorm → RoPE on q/k projections → SwiGLU) through one candle
/// autograd graph with candle's own ops between ours: the RMSNorm forward matches the CPU
/// reference, and every variable gets a finite, non-zero gradient of its shape.
#[test]
fn gpu_ops_compose_in_one_autograd_graph() {
    let test = "gpu_ops_compose_in_one_autograd_graph";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let (b, s, h, hk, d) = (2, 8, 4, 2, 32);
    let hidden = h * d;
    let x = Var::randn(0f32, 1.0, (b, s, hidden), &dev).unwrap();
    let w = Var::from_tensor(&Tensor::ones(hidden, DType::F32, &dev).unwrap()).unwrap();
    let wq = Var::randn(0f32, 0.1, (hidden, hidden), &dev).unwrap();
    let wk = Var::randn(0f32, 0.1, (hidden, hk * d), &dev).unwrap();
    let wg = Var::randn(0f32, 0.1, (hidden, 2 * hidden), &dev).unwrap();

    let cfg = RmsNormConfig::default().with_eps(1e-5);
    let y = rms_norm(x.as_tensor(), Some(w.as_tensor()), &cfg).unwrap();
    let x_h = x
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let args = RmsNormArgs::new(b * s, hidden).with_eps(1e-5);
    let want = liger_rs::reference::rms_norm_forward(&args, &x_h, None)
        .unwrap()
        .y;
    let got = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-5, "rms_norm vs reference: worst {worst}");

    let y2 = y.reshape((b * s, hidden)).unwrap();
    let q = y2
        .matmul(wq.as_tensor())
        .unwrap()
        .reshape((b, s, h, d))
        .unwrap();
    let k = y2
        .matmul(wk.as_tensor())
        .unwrap()
        .reshape((b, s, hk, d))
        .unwrap();
    let pos = Tensor::arange(0u32, s as u32, &dev)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / d as f32))
        .collect();
    let freqs = pos
        .unsqueeze(1)
        .unwrap()
        .broadcast_mul(&Tensor::new(inv, &dev).unwrap().unsqueeze(0).unwrap())
        .unwrap();
    let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1).unwrap();
    let (q, k) = rope(&q, &k, &emb.cos().unwrap(), &emb.sin().unwrap(), None).unwrap();
    let gate_up = y2.matmul(wg.as_tensor()).unwrap();
    let c = swiglu_fused(&gate_up, &SwigluConfig::default()).unwrap();
    let loss = (q.sqr().unwrap().sum_all().unwrap() + k.sum_all().unwrap() + c.sum_all().unwrap())
        .unwrap();
    let grads = loss.backward().unwrap();
    for (name, v) in [("x", &x), ("w", &w), ("wq", &wq), ("wk", &wk), ("wg", &wg)] {
        let g = grads
            .get(v)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(g.dims(), v.dims(), "gradient shape of {name}");
        let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            g.iter().all(|v| v.is_finite()),
            "gradient of {name} not finite"
        );
        assert!(g.iter().any(|&v| v != 0.0), "gradient of {name} all zero");
    }
}

#[test]
fn gpu_errors_are_candle_errors() {
    let test = "gpu_errors_are_candle_errors";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    // An unsupported dtype.
    let x = Tensor::ones((2, 8), DType::F64, &dev).unwrap();
    expect_err(
        "f64",
        rms_norm(&x, None, &RmsNormConfig::default()),
        &["F64", "rms_norm"],
    );
    // A launcher error keeps this crate's error inside candle's.
    let x = Tensor::ones((2, 8), DType::F32, &dev).unwrap();
    let cfg = RmsNormConfig::default().with_eps(-1.0);
    let e = rms_norm(&x, None, &cfg).unwrap_err();
    match &e {
        candle_core::Error::Cuda(inner) => match inner.downcast_ref::<liger_rs::Error>() {
            Some(liger_rs::Error::InvalidArgument { arg, .. }) => assert_eq!(*arg, "args.eps"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        },
        other => panic!("expected candle_core::Error::Cuda, got {other:?}"),
    }
    // An empty tensor (a zero-row view) is a clear error.
    let x = Tensor::ones((4, 8), DType::F32, &dev)
        .unwrap()
        .narrow(0, 0, 0)
        .unwrap();
    expect_err(
        "empty",
        rms_norm(&x, None, &RmsNormConfig::default()),
        &["empty tensors"],
    );
}

/// Candle's case of the per-thread-stream race: one candle device (whose stream is the
/// per-thread stream, a different stream in each thread) used by four threads, each training
/// its own RMSNorm weight through autograd. Each thread's dW (bits) alone, under a lock, must
/// come back from every one of its concurrent steps.
#[test]
fn gpu_rms_norm_from_several_threads_on_one_device() {
    let Some(dev) = common::candle_gpu("gpu_rms_norm_from_several_threads_on_one_device") else {
        return;
    };
    let (threads, steps, rows, cols) = (4, common::sized(50, 10), common::sized(4096, 700), 2048);
    let alone = Mutex::new(());
    let start = std::sync::Barrier::new(threads);
    let dw_bits = |x: &Var, w: &Var, dy: &Tensor| -> Vec<u16> {
        let y = rms_norm(
            x.as_tensor(),
            Some(w.as_tensor()),
            &RmsNormConfig::default(),
        )
        .unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * dy)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let dw = grads.get(w).expect("dW").to_vec1::<bf16>().unwrap();
        dw.iter().map(|v| v.to_bits()).collect()
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (dev, alone, start, dw_bits) = (&dev, &alone, &start, &dw_bits);
                scope.spawn(move || {
                    let mut rng = Rng::new(40 + t as u64);
                    let x = Var::from_tensor(&tensor(
                        &rng.vec::<bf16>(rows * cols, 0.0, 1.0),
                        &[rows, cols],
                        dev,
                    ))
                    .unwrap();
                    let w =
                        Var::from_tensor(&tensor(&rng.vec::<bf16>(cols, 1.0, 0.3), &[cols], dev))
                            .unwrap();
                    let dy = tensor(&rng.vec::<f32>(rows * cols, 0.0, 1.0), &[rows, cols], dev);
                    let want = {
                        let _alone = alone.lock().unwrap();
                        dw_bits(&x, &w, &dy)
                    };
                    start.wait();
                    let differing = (0..steps).filter(|_| dw_bits(&x, &w, &dy) != want).count();
                    assert_eq!(
                        differing, 0,
                        "thread {t}: {differing} of {steps} steps gave another dW"
                    );
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
    });
}
