//! GPU: SwiGLU and GEGLU through candle against the plain API.
use super::*;

fn glu_case<T: El>(
    glu: Glu,
    dev: &Device,
    rng: &mut Rng,
    form: Form,
    fused: bool,
    cfg: SwigluConfig,
) {
    let stream = stream_of(dev);
    let (rows, cols) = (29, 64 + (rng.next_u64() % 4) as usize * 8 + form as usize);
    let case = format!(
        "{glu:?} {} {rows}×{cols} {form:?} fused={fused} {cfg:?}",
        T::NAME
    );
    let (a_h, b_h, dc_h): (Vec<T>, Vec<T>, Vec<T>) = (
        rng.vec(rows * cols, 0.0, 2.0),
        rng.vec(rows * cols, 0.0, 1.0),
        rng.vec(rows * cols, 0.0, 1.0),
    );
    let dc_d = upload(&stream, &dc_h);
    // The candle ops return c·dm, dm rounded to T (candle's affine), in one rounding.
    let dm = T::cast(cfg.down_multiplier as f64);
    let times_dm = |c: &CudaSlice<T>| -> Vec<f64> {
        host_buf(&stream, c)
            .iter()
            .map(|&c| T::cast(c * dm))
            .collect()
    };
    let n = rows * cols;
    let mut c_d = alloc::<T>(&stream, n);
    let s_args = SwigluArgs::new(rows, cols)
        .with_gate_multiplier(cfg.gate_multiplier)
        .with_down_multiplier(cfg.down_multiplier);
    let f_args = SwigluArgs::fused(rows, cols)
        .with_gate_multiplier(cfg.gate_multiplier)
        .with_down_multiplier(cfg.down_multiplier);
    if fused {
        let gu_h: Vec<T> = (0..rows)
            .flat_map(|i| {
                a_h[i * cols..(i + 1) * cols]
                    .iter()
                    .chain(&b_h[i * cols..(i + 1) * cols])
                    .copied()
            })
            .collect();
        let gu_d = upload(&stream, &gu_h);
        glu_call!(
            glu,
            swiglu_forward_fused / geglu_forward_fused(&stream, &f_args, &gu_d, &mut c_d)
        )
        .unwrap();
        let mut d_d = alloc::<T>(&stream, 2 * n);
        glu_call!(
            glu,
            swiglu_backward_fused / geglu_backward_fused(&stream, &f_args, &dc_d, &gu_d, &mut d_d)
        )
        .unwrap();

        let gu = form.tensor(&gu_h, rows, 2 * cols, dev, rng);
        let dc = form.tensor(&dc_h, rows, cols, dev, rng);
        let (gv, gu_var) = form.var(&gu_h, rows, 2 * cols, dev, rng);
        let c = candle_glu_fused(glu, &gu_var, &cfg).unwrap();
        assert_eq!(c.dims(), &[rows, cols]);
        assert_same(&format!("c·dm, {case}"), &host::<T>(&c), &times_dm(&c_d));
        let d = candle_glu_fused_backward(glu, &dc, &gu, &cfg).unwrap();
        assert_same(
            &format!("d_gate_up, {case}"),
            &host::<T>(&d),
            &host_buf(&stream, &d_d),
        );
        let grads = c.mul(&dc).unwrap().sum_all().unwrap().backward().unwrap();
        assert_same(
            &format!("autograd d_gate_up, {case}"),
            &host::<T>(&grad_of(&grads, &gv, form, rows)),
            &host_buf(&stream, &d_d),
        );
    } else {
        let (a_d, b_d) = (upload(&stream, &a_h), upload(&stream, &b_h));
        glu_call!(
            glu,
            swiglu_forward / geglu_forward(&stream, &s_args, &a_d, &b_d, &mut c_d)
        )
        .unwrap();
        let (mut da_d, mut db_d) = (alloc::<T>(&stream, n), alloc::<T>(&stream, n));
        glu_call!(
            glu,
            swiglu_backward
                / geglu_backward(&stream, &s_args, &dc_d, &a_d, &b_d, &mut da_d, &mut db_d)
        )
        .unwrap();

        let a = form.tensor(&a_h, rows, cols, dev, rng);
        let b = form.tensor(&b_h, rows, cols, dev, rng);
        let dc = form.tensor(&dc_h, rows, cols, dev, rng);
        let (av, a_var) = form.var(&a_h, rows, cols, dev, rng);
        let (bv, b_var) = form.var(&b_h, rows, cols, dev, rng);
        let c = candle_glu(glu, &a_var, &b_var, &cfg).unwrap();
        assert_same(&format!("c·dm, {case}"), &host::<T>(&c), &times_dm(&c_d));
        let (da, db) = candle_glu_backward(glu, &dc, &a, &b, &cfg).unwrap();
        assert_same(
            &format!("da, {case}"),
            &host::<T>(&da),
            &host_buf(&stream, &da_d),
        );
        assert_same(
            &format!("db, {case}"),
            &host::<T>(&db),
            &host_buf(&stream, &db_d),
        );
        let grads = c.mul(&dc).unwrap().sum_all().unwrap().backward().unwrap();
        assert_same(
            &format!("autograd da, {case}"),
            &host::<T>(&grad_of(&grads, &av, form, rows)),
            &host_buf(&stream, &da_d),
        );
        assert_same(
            &format!("autograd db, {case}"),
            &host::<T>(&grad_of(&grads, &bv, form, rows)),
            &host_buf(&stream, &db_d),
        );
    }
}

/// Every layout form, separate and fused, default and other multipliers, of each op in `glus`.
fn glu_sweep<T: El>(glus: &[Glu], test: &str, seed: u64) {
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let mut rng = Rng::new(seed);
    let mut n = 0;
    for (&glu, form) in glus.iter().flat_map(|g| FORMS.map(|f| (g, f))) {
        for fused in [false, true] {
            for cfg in [
                SwigluConfig::default(),
                SwigluConfig::default()
                    .with_gate_multiplier(0.75)
                    .with_down_multiplier(1.5),
            ] {
                glu_case::<T>(glu, &dev, &mut rng, form, fused, cfg);
                n += 1;
            }
        }
    }
    println!("{test}: {n} cases equal to the plain API");
}

#[test]
fn gpu_swiglu_matches_plain_api_f32() {
    glu_sweep::<f32>(&[Glu::Swiglu], "gpu_swiglu_matches_plain_api_f32", 21);
}

#[test]
fn gpu_swiglu_matches_plain_api_f16() {
    glu_sweep::<f16>(&[Glu::Swiglu], "gpu_swiglu_matches_plain_api_f16", 22);
}

#[test]
fn gpu_swiglu_matches_plain_api_bf16() {
    glu_sweep::<bf16>(&[Glu::Swiglu], "gpu_swiglu_matches_plain_api_bf16", 23);
}

#[test]
fn gpu_geglu_matches_plain_api_f32() {
    glu_sweep::<f32>(&GLUS[1..], "gpu_geglu_matches_plain_api_f32", 24);
}

#[test]
fn gpu_geglu_matches_plain_api_f16() {
    glu_sweep::<f16>(&GLUS[1..], "gpu_geglu_matches_plain_api_f16", 25);
}

#[test]
fn gpu_geglu_matches_plain_api_bf16() {
    glu_sweep::<bf16>(&GLUS[1..], "gpu_geglu_matches_plain_api_bf16", 26);
}
