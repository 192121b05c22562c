//! Gradients of every op against finite differences of its value.
use super::*;

type Op = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>>;

/// One of candle-nn's rotary embeddings: `(xs, cos, sin)`.
type Rotary = fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// The autograd gradient of `f` at `inputs` (CPU, in `dtype`) against central differences
/// of the value `f` returns, for every element of every input: `L = Σ f(x)·R` for a fixed
/// random `R`, step `h·max(1, |x|)`, agreement within `tol·(|g| + rms(g))`.
fn fd_check(what: &str, dtype: DType, inputs: &[Tensor], f: Op, h: f64, tol: f64) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap())
        .collect();
    let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&args).unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut rng = Rng::new(y.elem_count() as u64);
    let r: Vec<f64> = rng.vec(y.elem_count(), 0.0, 1.0);
    let r = Tensor::from_vec(r, y.shape(), &Device::Cpu).unwrap();
    let loss = |y: &Tensor| {
        (y.to_dtype(DType::F64).unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let grads = loss(&y).backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let g = grads
            .get(v)
            .unwrap_or_else(|| panic!("{what}: no gradient for input {i}"))
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let x = args[i]
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let rms = (g.iter().map(|v| v * v).sum::<f64>() / g.len() as f64).sqrt();
        for j in 0..x.len() {
            let at = |delta: f64| {
                let mut moved = x.clone();
                moved[j] += delta;
                let t = Tensor::from_vec(moved, args[i].shape(), &Device::Cpu).unwrap();
                // The step actually taken in the dtype.
                let t = t.to_dtype(dtype).unwrap();
                let xj = t
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .get(j)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                let mut a = args.clone();
                a[i] = t;
                (xj, loss(&f(&a).unwrap()).to_scalar::<f64>().unwrap())
            };
            let step = h * x[j].abs().max(1.0);
            let ((xp, lp), (xm, lm)) = (at(step), at(-step));
            let fd = (lp - lm) / (xp - xm);
            assert!(
                (fd - g[j]).abs() <= tol * (g[j].abs() + rms),
                "{what} ({dtype:?}): d input {i} [{j}] autograd {} vs finite differences {fd}",
                g[j]
            );
        }
    }
}

fn randn_cpu(rng: &mut Rng, dims: &[usize], mean: f64, scale: f64) -> Tensor {
    let v: Vec<f64> = rng.vec(dims.iter().product(), mean, scale);
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// Every candle op with its multipliers, offsets, modes and RoPE forms: the backward is the
/// gradient of the value the forward returns.
fn fd_sweep(dtype: DType, h: f64, tol: f64) {
    let mut rng = Rng::new(61);
    let check =
        |what: String, inputs: Vec<Tensor>, f: Op| fd_check(&what, dtype, &inputs, f, h, tol);

    let (x, w) = (
        randn_cpu(&mut rng, &[3, 7], 0.0, 1.0),
        randn_cpu(&mut rng, &[7], 1.0, 0.5),
    );
    for mode in CastingMode::ALL {
        for offset in [0.0, 1.0, -0.25] {
            let cfg = RmsNormConfig::default()
                .with_eps(0.1)
                .with_offset(offset)
                .with_mode(mode);
            check(
                format!("rms_norm {cfg:?}"),
                vec![x.clone(), w.clone()],
                Box::new(move |t| rms_norm(&t[0], Some(&t[1]), &cfg)),
            );
        }
        let cfg = RmsNormConfig::default()
            .with_eps(1e-6)
            .with_offset(0.0)
            .with_mode(mode);
        check(
            format!("rms_norm {cfg:?} without a weight"),
            vec![x.clone()],
            Box::new(move |t| rms_norm(&t[0], None, &cfg)),
        );
    }

    let (a, b) = (
        randn_cpu(&mut rng, &[4, 5], 0.0, 2.0),
        randn_cpu(&mut rng, &[4, 5], 0.0, 1.0),
    );
    let gu = randn_cpu(&mut rng, &[4, 10], 0.0, 2.0);
    for (gm, dm) in [(1.0, 1.0), (0.75, 1.5), (-1.25, 0.3), (2.0, -4.0)] {
        let cfg = SwigluConfig::default()
            .with_gate_multiplier(gm)
            .with_down_multiplier(dm);
        for glu in GLUS {
            check(
                format!("{glu:?} {cfg:?}"),
                vec![a.clone(), b.clone()],
                Box::new(move |t| candle_glu(glu, &t[0], &t[1], &cfg)),
            );
            check(
                format!("{glu:?} fused {cfg:?}"),
                vec![gu.clone()],
                Box::new(move |t| candle_glu_fused(glu, &t[0], &cfg)),
            );
        }
    }

    let (bs, s, hq, hk, d) = (2, 3, 2, 1, 8);
    let (q, k) = (
        randn_cpu(&mut rng, &[bs, s, hq, d], 0.0, 1.0),
        randn_cpu(&mut rng, &[bs, s, hk, d], 0.0, 1.0),
    );
    let angles = randn_cpu(&mut rng, &[5, d], 0.0, 2.0);
    let ids = Tensor::new(&[[4i64, 0, 2], [1, 1, 3]], &Device::Cpu).unwrap();
    for (cfg, w, gathered) in [
        (RopeConfig::default(), d, false),
        (RopeConfig::default(), d, true),
        (RopeConfig::default().with_rotary_dim(6), 6, false),
        (RopeConfig::default().with_interleaved(), d, true),
        (
            RopeConfig::default()
                .with_half_tables()
                .with_interleaved()
                .with_rotary_dim(6),
            3,
            false,
        ),
    ] {
        let rows = if gathered { 5 } else { s };
        let a = angles.narrow(0, 0, rows).unwrap().narrow(1, 0, w).unwrap();
        let (cos, sin) = (
            a.cos().unwrap().to_dtype(dtype).unwrap(),
            a.sin().unwrap().to_dtype(dtype).unwrap(),
        );
        let ids = gathered.then(|| ids.clone());
        check(
            format!("rope_with {cfg:?} gathered={gathered}"),
            vec![q.clone(), k.clone()],
            Box::new(move |t| {
                let (q, k) = rope_with(&t[0], &t[1], &cos, &sin, ids.as_ref(), &cfg)?;
                Tensor::cat(&[q.flatten_all()?, k.flatten_all()?], 0)
            }),
        );
    }

    // candle-nn's functions, the tables differentiated too (a 2-D table longer than t, and
    // per-batch tables).
    let (b2, h2, t2, d2) = (2, 2, 3, 6);
    let xs = randn_cpu(&mut rng, &[b2, h2, t2, d2], 0.0, 1.0);
    let thd = randn_cpu(&mut rng, &[b2, t2, h2, d2], 0.0, 1.0);
    for dims in [vec![t2 + 2, d2 / 2], vec![b2, t2, d2 / 2]] {
        let a = randn_cpu(&mut rng, &dims, 0.0, 2.0);
        let (cos, sin) = (a.cos().unwrap(), a.sin().unwrap());
        let nn_fns: [(&str, Rotary, &Tensor); 3] = [
            ("rope", nn::rotary_emb::rope, &xs),
            ("rope_i", nn::rotary_emb::rope_i, &xs),
            ("rope_thd", nn::rotary_emb::rope_thd, &thd),
        ];
        for (name, f, x) in nn_fns {
            check(
                format!("nn::rotary_emb::{name} tables {dims:?}"),
                vec![x.clone(), cos.clone(), sin.clone()],
                Box::new(move |t| f(&t[0], &t[1], &t[2])),
            );
        }
    }
    check(
        "nn::ops::rms_norm".into(),
        vec![x.clone(), w.clone()],
        Box::new(|t| nn::ops::rms_norm(&t[0], &t[1], 0.1)),
    );
    check(
        "nn::ops::swiglu".into(),
        vec![gu],
        Box::new(|t| nn::ops::swiglu(&t[0])),
    );
    check(
        "nn::ops::silu_mul".into(),
        vec![a, b],
        Box::new(|t| nn::ops::silu_mul(&t[0], &t[1])),
    );
}

#[test]
fn every_op_gradient_matches_finite_differences_f64() {
    fd_sweep(DType::F64, 1e-5, 1e-6);
}

#[test]
fn every_op_gradient_matches_finite_differences_f32() {
    // The cast points (f32 roundings) leave the differences noisy: a larger step and bound.
    fd_sweep(DType::F32, 1e-2, 2e-2);
}

/// q and k as views of one fused QKV projection output `[B, S, (Hq + 2·Hk)·d]` reshaped to
/// heads and narrowed (tokens apart, no copy): `rope` equals `rope` on contiguous copies,
/// forward, explicit backward and autograd, whose gradient of the fused tensor is dq and dk
/// in their columns and 0 in v's.
fn fused_views_case<T: El>(dev: &Device, rng: &mut Rng) {
    let (b, s, hq, hk, d) = (2, 5, 6, 2, 16);
    let heads = hq + 2 * hk;
    let data: Vec<T> = rng.vec(b * s * heads * d, 0.0, 1.0);
    let positions: Vec<i64> = (0..s as i64).collect();
    let (cos_h, sin_h) = cos_sin::<T>(&positions, d);
    let (cos, sin) = (tensor(&cos_h, &[s, d], dev), tensor(&sin_h, &[s, d], dev));
    let fused = Var::from_tensor(&tensor(&data, &[b, s, heads * d], dev)).unwrap();
    let by_head = fused.as_tensor().reshape((b, s, heads, d)).unwrap();
    let (q, k) = (
        by_head.narrow(2, 0, hq).unwrap(),
        by_head.narrow(2, hq, hk).unwrap(),
    );
    assert!(!q.is_contiguous() && !k.is_contiguous());
    let (qc, kc) = (q.contiguous().unwrap(), k.contiguous().unwrap());
    let (qr, kr) = rope(&q, &k, &cos, &sin, None).unwrap();
    let (qw, kw) = rope(&qc, &kc, &cos, &sin, None).unwrap();
    let case = format!("fused views {} on {dev:?}", T::NAME);
    assert_same(&format!("q, {case}"), &host::<T>(&qr), &host::<T>(&qw));
    assert_same(&format!("k, {case}"), &host::<T>(&kr), &host::<T>(&kw));
    let (gq, gk) = rope_backward(&q, &k, &cos, &sin, None).unwrap();
    let (gqw, gkw) = rope_backward(&qc, &kc, &cos, &sin, None).unwrap();
    assert_same(&format!("dq, {case}"), &host::<T>(&gq), &host::<T>(&gqw));
    assert_same(&format!("dk, {case}"), &host::<T>(&gk), &host::<T>(&gkw));
    // Autograd: d(Σ qr·u + Σ kr·w)/d fused = [rope_backward(u) | rope_backward(w) | 0].
    let u = tensor(&rng.vec::<T>(qr.elem_count(), 0.0, 1.0), qr.dims(), dev);
    let w = tensor(&rng.vec::<T>(kr.elem_count(), 0.0, 1.0), kr.dims(), dev);
    let loss =
        (qr.mul(&u).unwrap().sum_all().unwrap() + kr.mul(&w).unwrap().sum_all().unwrap()).unwrap();
    let grad = loss.backward().unwrap();
    let grad = grad.get(&fused).expect("grad of the fused tensor");
    let grad = grad.reshape((b, s, heads, d)).unwrap();
    let (gu, gw) = rope_backward(&u, &w, &cos, &sin, None).unwrap();
    let zeros = vec![0.0; b * s * hk * d];
    assert_same(
        &format!("autograd dq, {case}"),
        &host::<T>(&grad.narrow(2, 0, hq).unwrap()),
        &host::<T>(&gu),
    );
    assert_same(
        &format!("autograd dk, {case}"),
        &host::<T>(&grad.narrow(2, hq, hk).unwrap()),
        &host::<T>(&gw),
    );
    assert_same(
        &format!("autograd dv, {case}"),
        &host::<T>(&grad.narrow(2, hq + hk, hk).unwrap()),
        &zeros,
    );
}

#[test]
fn rope_reads_fused_qkv_views_on_the_cpu() {
    let mut rng = Rng::new(31);
    fused_views_case::<f32>(&Device::Cpu, &mut rng);
    fused_views_case::<bf16>(&Device::Cpu, &mut rng);
}

#[test]
fn gpu_rope_reads_fused_qkv_views() {
    let Some(dev) = common::candle_gpu("gpu_rope_reads_fused_qkv_views") else {
        return;
    };
    let mut rng = Rng::new(32);
    fused_views_case::<f32>(&dev, &mut rng);
    fused_views_case::<f16>(&dev, &mut rng);
    fused_views_case::<bf16>(&dev, &mut rng);
}
