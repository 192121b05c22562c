//! The fused residual add + RMSNorm through candle.
use super::*;

/// `Σ y·gy + Σ s·gs` of the fused op, or of `x + r` then [`rms_norm`] (`fused = false`), and
/// its gradients in `x`, `r` and, when it is a `Var`, the weight.
fn fused_add_grads(
    fused: bool,
    [x, r]: [&Var; 2],
    w: &Tensor,
    [gy, gs]: [&Tensor; 2],
    cfg: &RmsNormConfig,
) -> (Vec<Vec<f64>>, candle_core::backprop::GradStore) {
    let (y, s) = if fused {
        liger_rs::candle::fused_add_rms_norm(x.as_tensor(), r.as_tensor(), Some(w), cfg).unwrap()
    } else {
        let s = (x.as_tensor() + r.as_tensor()).unwrap();
        (rms_norm(&s, Some(w), cfg).unwrap(), s)
    };
    let loss =
        ((&y * gy).unwrap().sum_all().unwrap() + (&s * gs).unwrap().sum_all().unwrap()).unwrap();
    let vals = [&y, &s].map(cpu_vals::<f64>);
    (vals.to_vec(), loss.backward().unwrap())
}

#[test]
fn cpu_fused_add_rms_norm_is_add_then_rms_norm() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(77);
    let (rows, cols) = (5, 24);
    for (mode, offset, trained) in [
        (CastingMode::Llama, 0.0, true),
        (CastingMode::Gemma, 1.0, true),
        (CastingMode::None, 0.0, false),
    ] {
        let cfg = RmsNormConfig::default().with_mode(mode).with_offset(offset);
        let data = |rng: &mut Rng, n: usize, mean: f64| -> Vec<f64> { rng.vec(n, mean, 1.0) };
        let x = Var::from_slice(&data(&mut rng, rows * cols, 0.0), (rows, cols), &dev).unwrap();
        let r = Var::from_slice(&data(&mut rng, rows * cols, 0.0), (rows, cols), &dev).unwrap();
        let w_var = Var::from_slice(&data(&mut rng, cols, 1.0), cols, &dev).unwrap();
        let frozen = w_var.as_tensor().detach();
        let w = if trained { w_var.as_tensor() } else { &frozen };
        let gy = Tensor::from_slice(&data(&mut rng, rows * cols, 0.0), (rows, cols), &dev).unwrap();
        let gs = Tensor::from_slice(&data(&mut rng, rows * cols, 0.0), (rows, cols), &dev).unwrap();
        let (fused_vals, fused) = fused_add_grads(true, [&x, &r], w, [&gy, &gs], &cfg);
        let (plain_vals, plain) = fused_add_grads(false, [&x, &r], w, [&gy, &gs], &cfg);
        let case = format!("{mode} offset {offset} trained {trained}");
        for (what, got, want) in [
            ("y", &fused_vals[0], &plain_vals[0]),
            ("s", &fused_vals[1], &plain_vals[1]),
        ] {
            for (g, w) in got.iter().zip(want.iter()) {
                assert!(
                    (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                    "{what}: {g} vs {w}, {case}"
                );
            }
        }
        let close = |what: &str, got: &Tensor, want: &Tensor| {
            let (got, want) = (cpu_vals::<f64>(got), cpu_vals::<f64>(want));
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-10 * (1.0 + w.abs()),
                    "{what}: {g} vs {w}, {case}"
                );
            }
        };
        for v in [&x, &r] {
            close("dx", fused.get(v).unwrap(), plain.get(v).unwrap());
        }
        match trained {
            true => close("dw", fused.get(&w_var).unwrap(), plain.get(&w_var).unwrap()),
            false => assert!(fused.get(&w_var).is_none(), "a frozen weight gets no dw"),
        }
    }
}

/// The fused op on CUDA against the plain API on the same data and stream: the same kernels,
/// so the same bits (`y`, `s`; `dx` of x and r, `dw` through autograd).
fn fused_add_gpu_case<T: El>(dev: &Device, rng: &mut Rng, cfg: RmsNormConfig) {
    let stream = stream_of(dev);
    let (rows, cols) = (29, 256);
    let n = rows * cols;
    let [x_h, r_h, dy_h, ds_h]: [Vec<T>; 4] = std::array::from_fn(|_| rng.vec(n, 0.0, 1.0));
    let w_h: Vec<T> = rng.vec(cols, 1.0, 0.5);
    let args = RmsNormArgs::new(rows, cols)
        .with_eps(cfg.eps)
        .with_offset(cfg.offset)
        .with_mode(cfg.mode);
    let [x_d, r_d, dy_d, ds_d] = [&x_h, &r_h, &dy_h, &ds_h].map(|h| upload(&stream, h));
    let w_d = upload(&stream, &w_h);
    let (mut s_d, mut y_d, mut rstd_d) = (
        alloc::<T>(&stream, n),
        alloc::<T>(&stream, n),
        alloc::<f32>(&stream, rows),
    );
    liger_rs::fused_add_rms_norm_forward(
        &stream,
        &args,
        &x_d,
        &r_d,
        Some(&w_d),
        &mut s_d,
        &mut y_d,
        &mut rstd_d,
    )
    .unwrap();
    let (mut dx_d, mut dw_d) = (alloc::<T>(&stream, n), alloc::<T>(&stream, cols));
    liger_rs::fused_add_rms_norm_backward(
        &stream,
        &args,
        &dy_d,
        &ds_d,
        &s_d,
        Some(&w_d),
        &rstd_d,
        &mut dx_d,
        Some(&mut dw_d),
    )
    .unwrap();

    let var = |h: &[T], shape: &[usize]| Var::from_tensor(&tensor(h, shape, dev)).unwrap();
    let (x, r, w) = (
        var(&x_h, &[rows, cols]),
        var(&r_h, &[rows, cols]),
        var(&w_h, &[cols]),
    );
    let (y, s) = liger_rs::candle::fused_add_rms_norm(
        x.as_tensor(),
        r.as_tensor(),
        Some(w.as_tensor()),
        &cfg,
    )
    .unwrap();
    assert_same("y", &host::<T>(&y), &host_buf(&stream, &y_d));
    assert_same("s", &host::<T>(&s), &host_buf(&stream, &s_d));
    let (gy, gs) = (
        tensor(&dy_h, &[rows, cols], dev),
        tensor(&ds_h, &[rows, cols], dev),
    );
    let loss = ((&y * &gy)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        + (&s * &gs)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    let dx = host_buf(&stream, &dx_d);
    assert_same("dx of x", &host::<T>(grads.get(&x).unwrap()), &dx);
    assert_same("dx of r", &host::<T>(grads.get(&r).unwrap()), &dx);
    assert_same(
        "dw",
        &host::<T>(grads.get(&w).unwrap()),
        &host_buf(&stream, &dw_d),
    );
}

#[test]
fn gpu_fused_add_rms_norm_matches_plain_api() {
    let Some(dev) = common::candle_gpu("gpu_fused_add_rms_norm_matches_plain_api") else {
        return;
    };
    let mut rng = Rng::new(78);
    for cfg in [
        RmsNormConfig::default(),
        RmsNormConfig::default()
            .with_mode(CastingMode::Gemma)
            .with_offset(1.0),
    ] {
        fused_add_gpu_case::<f32>(&dev, &mut rng, cfg);
        fused_add_gpu_case::<bf16>(&dev, &mut rng, cfg);
    }
}
