//! GPU: RMSNorm through candle against the plain API on the same data and stream.
use super::*;

fn rms_norm_case<T: El>(
    dev: &Device,
    rng: &mut Rng,
    form: Form,
    weighted: bool,
    cfg: RmsNormConfig,
) {
    let stream = stream_of(dev);
    let (rows, cols) = (
        37,
        96 + (rng.next_u64() % 4) as usize * 8 + 3 * (form as usize),
    );
    let case = format!(
        "{} {rows}×{cols} {form:?} weight={weighted} {cfg:?}",
        T::NAME
    );
    let x_h: Vec<T> = rng.vec(rows * cols, 0.0, 1.0);
    let w_h: Vec<T> = rng.vec(cols, 1.0, 0.5);
    let dy_h: Vec<T> = rng.vec(rows * cols, 0.0, 1.0);

    // Plain API on the same stream.
    let args = RmsNormArgs::new(rows, cols)
        .with_eps(cfg.eps)
        .with_offset(cfg.offset)
        .with_mode(cfg.mode);
    let (x_d, w_d, dy_d) = (
        upload(&stream, &x_h),
        upload(&stream, &w_h),
        upload(&stream, &dy_h),
    );
    let w_arg: Option<&dyn DevicePtr<T>> = weighted.then_some(&w_d);
    let (mut y_d, mut r_d) = (
        alloc::<T>(&stream, rows * cols),
        alloc::<f32>(&stream, rows),
    );
    liger_rs::rms_norm_forward(&stream, &args, &x_d, w_arg, &mut y_d, &mut r_d).unwrap();
    let (mut dx_d, mut dw_d) = (alloc::<T>(&stream, rows * cols), alloc::<T>(&stream, cols));
    liger_rs::rms_norm_backward(
        &stream,
        &args,
        &dy_d,
        &x_d,
        w_arg,
        &r_d,
        &mut dx_d,
        weighted.then_some(&mut dw_d),
    )
    .unwrap();
    let want_dw = weighted.then(|| host_buf(&stream, &dw_d));

    // candle, explicit.
    let x = form.tensor(&x_h, rows, cols, dev, rng);
    let w = tensor(&w_h, &[cols], dev);
    let weight = weighted.then_some(&w);
    let (y, rstd) = rms_norm_forward(&x, weight, &cfg).unwrap();
    assert_eq!(
        (y.dims(), rstd.dims(), rstd.dtype()),
        (&[rows, cols][..], &[rows][..], DType::F32)
    );
    assert_same(
        &format!("y, {case}"),
        &host::<T>(&y),
        &host_buf(&stream, &y_d),
    );
    assert_same(
        &format!("rstd, {case}"),
        &host::<f32>(&rstd),
        &host_buf(&stream, &r_d),
    );
    let dy = form.tensor(&dy_h, rows, cols, dev, rng);
    let (dx, dw) = rms_norm_backward(&dy, &x, weight, &rstd, &cfg).unwrap();
    assert_same(
        &format!("dx, {case}"),
        &host::<T>(&dx),
        &host_buf(&stream, &dx_d),
    );
    assert_eq!(dw.is_some(), weighted, "dw presence, {case}");
    if let (Some(dw), Some(want)) = (&dw, &want_dw) {
        assert_same(&format!("dw, {case}"), &host::<T>(dw), want);
    }

    // candle, autograd: the gradient reaching y is exactly dy.
    let (xv, x) = form.var(&x_h, rows, cols, dev, rng);
    let wv = Var::from_tensor(&w).unwrap();
    let y = rms_norm(&x, weighted.then_some(wv.as_tensor()), &cfg).unwrap();
    assert_same(
        &format!("autograd y, {case}"),
        &host::<T>(&y),
        &host_buf(&stream, &y_d),
    );
    let loss = y
        .mul(&tensor(&dy_h, &[rows, cols], dev))
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    assert_same(
        &format!("autograd dx, {case}"),
        &host::<T>(&grad_of(&grads, &xv, form, rows)),
        &host_buf(&stream, &dx_d),
    );
    match (grads.get(&wv), &want_dw) {
        (Some(gw), Some(want)) => {
            assert_same(&format!("autograd dw, {case}"), &host::<T>(gw), want)
        }
        (None, None) => {}
        (got, _) => panic!("autograd dw presence {:?}, {case}", got.is_some()),
    }

    // A frozen weight (a plain tensor): the dX-only backward, the same dx bits, no dW.
    if weighted {
        let (xv, x) = form.var(&x_h, rows, cols, dev, rng);
        let y = rms_norm(&x, Some(&w), &cfg).unwrap();
        let dy = tensor(&dy_h, &[rows, cols], dev);
        let grads = y.mul(&dy).unwrap().sum_all().unwrap().backward().unwrap();
        assert_same(
            &format!("frozen-weight autograd dx, {case}"),
            &host::<T>(&grad_of(&grads, &xv, form, rows)),
            &host_buf(&stream, &dx_d),
        );
        assert!(
            grads.get(&w).is_none(),
            "frozen weight has a gradient, {case}"
        );
    }
}

fn rms_norm_sweep<T: El>(test: &str, seed: u64) {
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let mut rng = Rng::new(seed);
    let mut n = 0;
    for mode in CastingMode::ALL {
        for form in FORMS {
            for weighted in [true, false] {
                let offset = if mode == CastingMode::Gemma { 1.0 } else { 0.0 };
                let cfg = RmsNormConfig::default()
                    .with_eps(1e-5)
                    .with_offset(offset)
                    .with_mode(mode);
                rms_norm_case::<T>(&dev, &mut rng, form, weighted, cfg);
                n += 1;
            }
        }
    }
    println!("{test}: {n} cases equal to the plain API");
}

#[test]
fn gpu_rms_norm_matches_plain_api_f32() {
    rms_norm_sweep::<f32>("gpu_rms_norm_matches_plain_api_f32", 1);
}

#[test]
fn gpu_rms_norm_matches_plain_api_f16() {
    rms_norm_sweep::<f16>("gpu_rms_norm_matches_plain_api_f16", 2);
}

#[test]
fn gpu_rms_norm_matches_plain_api_bf16() {
    rms_norm_sweep::<bf16>("gpu_rms_norm_matches_plain_api_bf16", 3);
}
