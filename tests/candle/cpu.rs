//! On the CPU (always run): every candle op against the reference, gradients, argument errors.
use super::*;

/// A CPU tensor's values, widened.
pub(super) fn cpu_vals<T: Element + WithDType>(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<T>())
        .expect("values")
        .into_iter()
        .map(Element::to_f64)
        .collect()
}

fn wide<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// The gradients of `Σ y·dy`: with `dy` the incoming gradient, each input's gradient.
fn weighted_sum_grads(y: Tensor, dy: &Tensor) -> candle_core::backprop::GradStore {
    (y * dy).unwrap().sum_all().unwrap().backward().unwrap()
}

/// On the CPU every op runs `liger_rs::reference`: each explicit call's result and each
/// autograd value and gradient is the reference's, exactly (f32, f16, bf16 and f64).
fn cpu_case<T: Element + WithDType>(seed: u64) {
    let cpu = Device::Cpu;
    let mut rng = Rng::new(seed);
    let t = |data: &[T], shape: &[usize]| Tensor::from_slice(data, shape, &cpu).unwrap();
    let var = |data: &[T], shape: &[usize]| Var::from_tensor(&t(data, shape)).unwrap();
    let name = T::NAME;

    let (rows, cols) = (5, 24);
    let x: Vec<T> = rng.vec(rows * cols, 0.0, 1.0);
    let w: Vec<T> = rng.vec(cols, 1.0, 0.5);
    let dy: Vec<T> = rng.vec(rows * cols, 0.0, 1.0);
    let rc = [rows, cols];
    for (mode, offset) in [
        (CastingMode::Llama, 0.0),
        (CastingMode::Gemma, 1.0),
        (CastingMode::None, 0.5),
    ] {
        let case = format!("{name} {mode} offset {offset}");
        let cfg = RmsNormConfig::default()
            .with_eps(1e-5)
            .with_offset(offset)
            .with_mode(mode);
        let args = RmsNormArgs::new(rows, cols)
            .with_eps(1e-5)
            .with_offset(offset)
            .with_mode(mode);
        let want = liger_rs::reference::rms_norm_forward(&args, &x, Some(&w)).unwrap();
        let grads =
            liger_rs::reference::rms_norm_backward(&args, &dy, &x, Some(&w), &want.rstd).unwrap();
        let (y, rstd) = rms_norm_forward(&t(&x, &rc), Some(&t(&w, &[cols])), &cfg).unwrap();
        assert_eq!(cpu_vals::<T>(&y), wide(&want.y), "y, {case}");
        let rstd_vals = rstd.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(rstd_vals, wide(&want.rstd), "rstd, {case}");
        let (dx, dw) = rms_norm_backward(
            &t(&dy, &rc),
            &t(&x, &rc),
            Some(&t(&w, &[cols])),
            &rstd,
            &cfg,
        )
        .unwrap();
        assert_eq!(cpu_vals::<T>(&dx), wide(&grads.dx), "dx, {case}");
        let want_dw = wide(grads.dw.as_ref().unwrap());
        assert_eq!(cpu_vals::<T>(&dw.unwrap()), want_dw, "dw, {case}");
        // The gradients of Σ y·dy.
        let grads_of = |y: Tensor| (y * t(&dy, &rc)).unwrap().sum_all().unwrap().backward();
        let (xv, wv) = (var(&x, &rc), var(&w, &[cols]));
        let y = rms_norm(xv.as_tensor(), Some(wv.as_tensor()), &cfg).unwrap();
        assert_eq!(cpu_vals::<T>(&y), wide(&want.y), "autograd y, {case}");
        let g = grads_of(y).unwrap();
        assert_eq!(
            cpu_vals::<T>(g.get(&xv).unwrap()),
            wide(&grads.dx),
            "autograd dx, {case}"
        );
        assert_eq!(
            cpu_vals::<T>(g.get(&wv).unwrap()),
            want_dw,
            "autograd dw, {case}"
        );
        // A frozen weight (a plain tensor): dx alone, no gradient for it.
        let (xv, w_frozen) = (var(&x, &rc), t(&w, &[cols]));
        let y = rms_norm(xv.as_tensor(), Some(&w_frozen), &cfg).unwrap();
        let g = grads_of(y).unwrap();
        let dx = cpu_vals::<T>(g.get(&xv).unwrap());
        assert_eq!(dx, wide(&grads.dx), "frozen-weight autograd dx, {case}");
        assert!(g.get(&w_frozen).is_none(), "frozen weight's dw, {case}");
    }

    for glu in GLUS {
        cpu_glu_case::<T>(glu, &mut rng);
    }

    let (bs, s, hq, hk, d) = (2, 5, 3, 1, 8);
    let q: Vec<T> = rng.vec(bs * s * hq * d, 0.0, 1.0);
    let k: Vec<T> = rng.vec(bs * s * hk * d, 0.0, 1.0);
    let dq: Vec<T> = rng.vec(q.len(), 0.0, 1.0);
    let dk: Vec<T> = rng.vec(k.len(), 0.0, 1.0);
    let angles: Vec<f64> = rng.vec(7 * d, 0.0, 2.0);
    let (cos, sin): (Vec<T>, Vec<T>) = (
        angles.iter().map(|a| Element::from_f64(a.cos())).collect(),
        angles.iter().map(|a| Element::from_f64(a.sin())).collect(),
    );
    let ids = [0i64, 3, 1, 6, 2, 2, 5, 0, 4, 1];
    let ids_t = Tensor::new(&ids[..], &cpu)
        .unwrap()
        .reshape((bs, s))
        .unwrap();
    let (qs, ks) = ([bs, s, hq, d], [bs, s, hk, d]);
    let configs = [
        (RopeConfig::default(), d),
        (
            RopeConfig::default().with_rotary_dim(6).with_interleaved(),
            6,
        ),
        (RopeConfig::default().with_half_tables(), d / 2),
    ];
    for (cfg, w) in configs {
        for gathered in [false, true] {
            let case = format!("{name} {cfg:?} gathered={gathered}");
            let r = cfg.rotary_dim.unwrap_or(d);
            let mut args = RopeArgs::new(d)
                .with_batch(bs)
                .with_seq_len(s)
                .with_heads(hq, hk)
                .with_rotary_dim(r);
            if cfg.interleaved {
                args = args.with_interleaved();
            }
            if cfg.half_tables {
                args = args.with_half_tables();
            }
            let (rows, form) = if gathered {
                (7, CosSinRows::Gathered(&ids))
            } else {
                (s, CosSinRows::PerPosition)
            };
            let (c, sn) = (&cos[..rows * w], &sin[..rows * w]);
            let (ct, st) = (t(c, &[rows, w]), t(sn, &[rows, w]));
            let ids_arg = gathered.then_some(&ids_t);
            let (mut qw, mut kw) = (q.clone(), k.clone());
            liger_rs::reference::rope_forward(&args, &mut qw, &mut kw, c, sn, form).unwrap();
            let (mut dqw, mut dkw) = (dq.clone(), dk.clone());
            liger_rs::reference::rope_backward(&args, &mut dqw, &mut dkw, c, sn, form).unwrap();
            let (qv, kv) = (var(&q, &qs), var(&k, &ks));
            let (qr, kr) =
                rope_with(qv.as_tensor(), kv.as_tensor(), &ct, &st, ids_arg, &cfg).unwrap();
            assert_eq!(
                (cpu_vals::<T>(&qr), cpu_vals::<T>(&kr)),
                (wide(&qw), wide(&kw)),
                "forward, {case}"
            );
            let (gq, gk) =
                rope_backward_with(&t(&dq, &qs), &t(&dk, &ks), &ct, &st, ids_arg, &cfg).unwrap();
            assert_eq!(
                (cpu_vals::<T>(&gq), cpu_vals::<T>(&gk)),
                (wide(&dqw), wide(&dkw)),
                "explicit backward, {case}"
            );
            let loss = ((qr * t(&dq, &qs)).unwrap().sum_all().unwrap()
                + (kr * t(&dk, &ks)).unwrap().sum_all().unwrap())
            .unwrap();
            let grads = loss.backward().unwrap();
            assert_eq!(
                cpu_vals::<T>(grads.get(&qv).unwrap()),
                wide(&dqw),
                "autograd dq, {case}"
            );
            assert_eq!(
                cpu_vals::<T>(grads.get(&kv).unwrap()),
                wide(&dkw),
                "autograd dk, {case}"
            );
        }
    }
}

/// The GLU ops: SwiGLU and GEGLU in both forms.
pub(super) const GLUS: [Glu; 3] = [Glu::Swiglu, Glu::Geglu(Gelu::Tanh), Glu::Geglu(Gelu::Erf)];

/// candle's autograd op for `glu`, separate gate and up.
pub(super) fn candle_glu(
    glu: Glu,
    a: &Tensor,
    b: &Tensor,
    cfg: &SwigluConfig,
) -> candle_core::Result<Tensor> {
    match glu {
        Glu::Swiglu => swiglu(a, b, cfg),
        Glu::Geglu(gelu) => geglu(a, b, gelu, cfg),
    }
}

/// candle's explicit backward for `glu`, separate.
pub(super) fn candle_glu_backward(
    glu: Glu,
    dc: &Tensor,
    a: &Tensor,
    b: &Tensor,
    cfg: &SwigluConfig,
) -> candle_core::Result<(Tensor, Tensor)> {
    match glu {
        Glu::Swiglu => swiglu_backward(dc, a, b, cfg),
        Glu::Geglu(gelu) => geglu_backward(dc, a, b, gelu, cfg),
    }
}

/// candle's autograd op for `glu`, fused gate-up.
pub(super) fn candle_glu_fused(
    glu: Glu,
    gate_up: &Tensor,
    cfg: &SwigluConfig,
) -> candle_core::Result<Tensor> {
    match glu {
        Glu::Swiglu => swiglu_fused(gate_up, cfg),
        Glu::Geglu(gelu) => geglu_fused(gate_up, gelu, cfg),
    }
}

/// candle's explicit backward for `glu`, fused.
pub(super) fn candle_glu_fused_backward(
    glu: Glu,
    dc: &Tensor,
    gate_up: &Tensor,
    cfg: &SwigluConfig,
) -> candle_core::Result<Tensor> {
    match glu {
        Glu::Swiglu => swiglu_fused_backward(dc, gate_up, cfg),
        Glu::Geglu(gelu) => geglu_fused_backward(dc, gate_up, gelu, cfg),
    }
}

/// [`cpu_case`]'s GLU part: the explicit calls and autograd of `glu`, separate and fused, with
/// multipliers, equal to the reference.
fn cpu_glu_case<T: Element + WithDType>(glu: Glu, rng: &mut Rng) {
    let cpu = Device::Cpu;
    let t = |data: &[T], shape: &[usize]| Tensor::from_slice(data, shape, &cpu).unwrap();
    let var = |data: &[T], shape: &[usize]| Var::from_tensor(&t(data, shape)).unwrap();
    let name = T::NAME;
    let (rows, cols) = (7, 10);
    let a: Vec<T> = rng.vec(rows * cols, 0.0, 2.0);
    let b: Vec<T> = rng.vec(rows * cols, 0.0, 1.0);
    let dc: Vec<T> = rng.vec(rows * cols, 0.0, 1.0);
    let rc = [rows, cols];
    for cfg in [
        SwigluConfig::default(),
        SwigluConfig::default()
            .with_gate_multiplier(0.75)
            .with_down_multiplier(1.5),
        SwigluConfig::default()
            .with_gate_multiplier(-1.25)
            .with_down_multiplier(0.3),
    ] {
        let case = format!("{name} {glu:?} {cfg:?}");
        let (gm, dm) = (cfg.gate_multiplier, T::cast(cfg.down_multiplier as f64));
        // The ops return c·dm with dm rounded to the dtype; the backward is its gradient.
        let args = SwigluArgs::new(rows, cols)
            .with_gate_multiplier(gm)
            .with_down_multiplier(dm as f32);
        let c: Vec<f64> = glu
            .ref_forward(&args, &a, &b)
            .unwrap()
            .iter()
            .map(|&c| T::cast(Element::to_f64(c) * dm))
            .collect();
        let g = glu.ref_backward(&args, &dc, &a, &b).unwrap();
        let (da, db) =
            candle_glu_backward(glu, &t(&dc, &rc), &t(&a, &rc), &t(&b, &rc), &cfg).unwrap();
        assert_eq!(
            (cpu_vals::<T>(&da), cpu_vals::<T>(&db)),
            (wide(&g.da), wide(&g.db)),
            "explicit, {case}"
        );
        let (av, bv) = (var(&a, &rc), var(&b, &rc));
        let y = candle_glu(glu, av.as_tensor(), bv.as_tensor(), &cfg).unwrap();
        assert_eq!(cpu_vals::<T>(&y), c, "c·dm, {case}");
        let grads = weighted_sum_grads(y, &t(&dc, &rc));
        assert_eq!(
            cpu_vals::<T>(grads.get(&av).unwrap()),
            wide(&g.da),
            "autograd da, {case}"
        );
        assert_eq!(
            cpu_vals::<T>(grads.get(&bv).unwrap()),
            wide(&g.db),
            "autograd db, {case}"
        );

        let join =
            |p: &[T], q: &[T]| liger_rs::reference::swiglu::join_gate_up(p, q, cols).unwrap();
        let (gu, dgu) = (join(&a, &b), join(&g.da, &g.db));
        let fused = [rows, 2 * cols];
        let d = candle_glu_fused_backward(glu, &t(&dc, &rc), &t(&gu, &fused), &cfg).unwrap();
        assert_eq!(cpu_vals::<T>(&d), wide(&dgu), "explicit fused, {case}");
        let gv = var(&gu, &fused);
        let y = candle_glu_fused(glu, gv.as_tensor(), &cfg).unwrap();
        assert_eq!(cpu_vals::<T>(&y), c, "fused c·dm, {case}");
        let grads = weighted_sum_grads(y, &t(&dc, &rc));
        assert_eq!(
            cpu_vals::<T>(grads.get(&gv).unwrap()),
            wide(&dgu),
            "autograd fused, {case}"
        );
    }
}

#[test]
fn cpu_paths_are_the_reference() {
    cpu_case::<f32>(51);
    cpu_case::<f16>(52);
    cpu_case::<bf16>(53);
    cpu_case::<f64>(54);
}

#[test]
fn cpu_ids_outside_the_table_are_an_error() {
    // The kernels clamp device ids; the reference, which runs on the CPU, rejects them.
    let cpu = Device::Cpu;
    let q = Tensor::ones((1, 2, 1, 4), DType::F32, &cpu).unwrap();
    let cos = Tensor::ones((3, 4), DType::F32, &cpu).unwrap();
    let ids = Tensor::new(&[[0i64, 3]], &cpu).unwrap();
    expect_err(
        "rope",
        rope(&q, &q, &cos, &cos, Some(&ids)),
        &["position_ids", "position_ids[1] = 3"],
    );
}

/// A last dim of 0: `linear` gives candle-nn's zeros of the right shape (an input width of 0
/// left it with no elements before), RMSNorm and the MLP block an error, not a panic.
#[test]
fn zero_width_rows() {
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    let y = liger_rs::candle::linear(&z(&[2, 0]), &z(&[3, 0]), None).expect("linear");
    assert_eq!(y.to_vec2::<f32>().expect("read"), vec![vec![0.0; 3]; 2]);
    let cfg = RmsNormConfig::default();
    let columns = ["at least 1 column"];
    expect_err("rms_norm", rms_norm(&z(&[2, 0]), None, &cfg), &columns);
    let block = liger_rs::candle::swiglu_mlp_block(&z(&[2, 0]), &z(&[0]), &z(&[3, 0]), &cfg);
    expect_err("swiglu_mlp_block", block, &columns);
}

/// `nn::Embedding` keeps candle-nn's contract: rows of `hidden_size`, else an error.
#[test]
fn embedding_module_rows_are_hidden_size_wide() {
    use candle_core::Module;
    let table = Tensor::zeros((5, 4), DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[0u32, 4], [2, 1]], &Device::Cpu).unwrap();
    let y = nn::Embedding::new(table.clone(), 4)
        .forward(&ids)
        .expect("lookup");
    assert_eq!(y.dims(), [2, 2, 4]);
    let wrong = nn::Embedding::new(table, 3).forward(&ids);
    expect_err("hidden_size 3 for rows of 4", wrong, &["Shape mismatch"]);
}

#[test]
fn bad_shapes_and_dtypes_are_errors_naming_the_tensor() {
    let cpu = Device::Cpu;
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &cpu).unwrap();
    let f32 = DType::F32;
    let cfg = RmsNormConfig::default();
    let x = t(&[3, 16], f32);
    expect_err(
        "weight shape",
        rms_norm(&x, Some(&t(&[15], f32)), &cfg),
        &["`weight` must have shape [16]", "[15]"],
    );
    expect_err(
        "weight dtype",
        rms_norm_forward(&x, Some(&t(&[16], DType::F16)), &cfg),
        &["F32", "F16"],
    );
    expect_err(
        "rstd length",
        rms_norm_backward(&x, &x, None, &t(&[2], f32), &cfg),
        &["`rstd`", "(3)"],
    );
    expect_err(
        "rstd dtype",
        rms_norm_backward(&x, &x, None, &t(&[3], DType::F16), &cfg),
        &["`rstd` must be f32"],
    );

    let q = t(&[2, 5, 4, 8], f32);
    let k = t(&[2, 5, 2, 8], f32);
    let cos = t(&[5, 8], f32);
    expect_err(
        "q rank",
        rope(&t(&[10, 4, 8], f32), &k, &cos, &cos, None),
        &["[batch, seq_len, heads, head_dim]"],
    );
    expect_err(
        "k seq",
        rope(&q, &t(&[2, 4, 2, 8], f32), &cos, &cos, None),
        &["must match q"],
    );
    expect_err(
        "cos rows",
        rope(&q, &k, &t(&[4, 8], f32), &t(&[4, 8], f32), None),
        &["cos/sin must be", "[4, 8]"],
    );
    expect_err(
        "cos batch",
        rope(&q, &k, &t(&[3, 5, 8], f32), &t(&[3, 5, 8], f32), None),
        &["cos/sin must be"],
    );
    expect_err(
        "sin shape",
        rope(&q, &k, &cos, &t(&[5, 6], f32), None),
        &["[5, 8]", "[5, 6]"],
    );
    expect_err(
        "ids dtype",
        rope(&q, &k, &cos, &cos, Some(&t(&[2, 5], DType::U32))),
        &["position_ids must be i64 or i32 [2, 5]"],
    );
    expect_err(
        "ids shape",
        rope(&q, &k, &cos, &cos, Some(&t(&[5], DType::I64))),
        &["position_ids"],
    );

    let s = SwigluConfig::default();
    expect_err(
        "swiglu shapes",
        swiglu(&x, &t(&[3, 15], f32), &s),
        &["swiglu", "[3, 15]"],
    );
    expect_err(
        "swiglu dtypes",
        swiglu(&x, &t(&[3, 16], DType::BF16), &s),
        &["BF16"],
    );
    expect_err(
        "fused odd width",
        swiglu_fused(&t(&[3, 15], f32), &s),
        &["even last dim", "[3, 15]"],
    );
    expect_err(
        "fused dc shape",
        swiglu_fused_backward(&t(&[3, 16], f32), &x, &s),
        &["`dc` must be [3, 8]"],
    );
}
