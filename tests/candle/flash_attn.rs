//! `liger_rs::candle::flash_attn` (feature `candle`): candle-flash-attn's functions with a
//! backward. On the CPU (always run) the forward and candle's autograd gradients equal the
//! reference's bit for bit (the CPU path is the reference), for fixed and packed batches, a
//! strided view of a fused QKV tensor and candle-nn's `[b, h, t, d]` layout; on the GPU the
//! same calls agree with the CPU path on the same inputs within the element type's rounding
//! (tests/attention.rs bounds the kernels themselves); bad arguments are candle errors.
//! `flash_attn_qkv` (one fused projection, RoPE inside) against candle-nn's `rope_slow` and a
//! softmax attention in candle ops in f64 on the CPU, and on the GPU against its CPU path.
use crate::common;

use candle_core::{DType, Device, Tensor, Var};
use common::Rng;
use liger_rs::AttentionArgs;
use liger_rs::candle::flash_attn::{
    flash_attn, flash_attn_alibi_windowed_softcap, flash_attn_bhtd, flash_attn_qkv,
    flash_attn_varlen, flash_attn_varlen_windowed, flash_attn_windowed,
};

fn randn(rng: &mut Rng, shape: &[usize], dev: &Device) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(rng.vec::<f32>(n, 0.0, 1.0), shape, dev).expect("tensor")
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("values")
}

/// The forward and the gradients of `Σ o·w` with respect to q, k and v.
fn run(
    f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    [q, k, v]: [&Tensor; 3],
    w: &Tensor,
) -> [Vec<f32>; 4] {
    let (qv, kv, vv) = (
        Var::from_tensor(q).expect("var"),
        Var::from_tensor(k).expect("var"),
        Var::from_tensor(v).expect("var"),
    );
    let o = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor()).expect("forward");
    let grads = (o.to_dtype(DType::F32).expect("cast") * w.to_dtype(DType::F32).expect("cast"))
        .and_then(|x| x.sum_all())
        .and_then(|x| x.backward())
        .expect("backward");
    let g = |x: &Var| vals(grads.get(x).expect("a gradient"));
    [vals(&o), g(&qv), g(&kv), g(&vv)]
}

#[test]
fn cpu_forward_and_gradients_are_the_references() {
    let mut rng = Rng::new(1);
    let cpu = Device::Cpu;
    let (b, s, hq, hkv, d) = (2, 9, 4, 2, 8);
    let q = randn(&mut rng, &[b, s, hq, d], &cpu);
    let k = randn(&mut rng, &[b, s, hkv, d], &cpu);
    let v = randn(&mut rng, &[b, s, hkv, d], &cpu);
    let w = randn(&mut rng, &[b, s, hq, d], &cpu);
    let scale = 0.3;
    let args = AttentionArgs::new(b, s, s, hq, hkv, d)
        .with_scale(scale)
        .with_window(Some(3), Some(0));
    let got = run(
        &|q, k, v| flash_attn_windowed(q, k, v, scale, Some(3), Some(0)),
        [&q, &k, &v],
        &w,
    );
    let (qh, kh, vh, wh) = (vals(&q), vals(&k), vals(&v), vals(&w));
    let o = liger_rs::reference::attention_forward(&args, &qh, &kh, &vh, None).expect("reference");
    let g = liger_rs::reference::attention_backward(&args, &qh, &kh, &vh, &wh, None)
        .expect("reference");
    assert_eq!(got, [o.o, g.dq, g.dk, g.dv]);
}

#[test]
fn cpu_packed_batches_are_the_reference() {
    let mut rng = Rng::new(2);
    let cpu = Device::Cpu;
    let (tq, tk, hq, hkv, d) = (7, 9, 2, 1, 4);
    let (cq, ck) = ([0u32, 3, 3, 7], [0u32, 4, 5, 9]);
    let q = randn(&mut rng, &[tq, hq, d], &cpu);
    let k = randn(&mut rng, &[tk, hkv, d], &cpu);
    let v = randn(&mut rng, &[tk, hkv, d], &cpu);
    let w = randn(&mut rng, &[tq, hq, d], &cpu);
    let sq = Tensor::new(&cq, &cpu).expect("offsets");
    let sk = Tensor::new(&ck, &cpu).expect("offsets");
    let got = run(
        &|q, k, v| flash_attn_varlen(q, k, v, &sq, &sk, 4, 4, 0.5, true),
        [&q, &k, &v],
        &w,
    );
    let args = AttentionArgs::varlen(3, tq, tk, 4, 4, hq, hkv, d)
        .with_scale(0.5)
        .with_causal(true);
    let (iq, ik) = (cq.map(|x| x as i32), ck.map(|x| x as i32));
    let cu = Some((&iq[..], &ik[..]));
    let (qh, kh, vh, wh) = (vals(&q), vals(&k), vals(&v), vals(&w));
    let o = liger_rs::reference::attention_forward(&args, &qh, &kh, &vh, cu).expect("reference");
    let g =
        liger_rs::reference::attention_backward(&args, &qh, &kh, &vh, &wh, cu).expect("reference");
    assert_eq!(got, [o.o, g.dq, g.dk, g.dv]);
    // A window that covers everything is the unmasked call.
    let wide = run(
        &|q, k, v| flash_attn_varlen_windowed(q, k, v, &sq, &sk, 4, 4, 0.5, Some(99), Some(0)),
        [&q, &k, &v],
        &w,
    );
    assert_eq!(wide, got);
}

#[test]
fn cpu_views_and_the_bhtd_layout_read_the_same_values() {
    let mut rng = Rng::new(3);
    let cpu = Device::Cpu;
    let (b, s, hq, hkv, d) = (1, 6, 2, 1, 4);
    // q, k, v as column views of one fused projection `[b, s, (hq + 2·hkv)·d]`.
    let qkv = randn(&mut rng, &[b, s, (hq + 2 * hkv) * d], &cpu);
    let view = |at: usize, h: usize| {
        qkv.narrow(2, at * d, h * d)
            .and_then(|x| x.reshape((b, s, h, d)))
    };
    let (q, k, v) = (
        view(0, hq).expect("q"),
        view(hq, hkv).expect("k"),
        view(hq + hkv, hkv).expect("v"),
    );
    let w = randn(&mut rng, &[b, s, hq, d], &cpu);
    let views = run(&|q, k, v| flash_attn(q, k, v, 0.5, true), [&q, &k, &v], &w);
    let copies = [q.contiguous(), k.contiguous(), v.contiguous()].map(|t| t.expect("copy"));
    let dense = run(
        &|q, k, v| flash_attn(q, k, v, 0.5, true),
        [&copies[0], &copies[1], &copies[2]],
        &w,
    );
    assert_eq!(views, dense);
    // candle-nn's layout: the same attention, transposed in and out.
    let t = |x: &Tensor| {
        x.transpose(1, 2)
            .and_then(|x| x.contiguous())
            .expect("transpose")
    };
    let bhtd = run(
        &|q, k, v| flash_attn_bhtd(q, k, v, 0.5, true),
        [&t(&copies[0]), &t(&copies[1]), &t(&copies[2])],
        &t(&w),
    );
    let o = flash_attn(&copies[0], &copies[1], &copies[2], 0.5, true).expect("forward");
    assert_eq!(bhtd[0], vals(&t(&o)));
}

#[test]
fn bad_arguments_are_candle_errors() {
    let cpu = Device::Cpu;
    let z = |shape: &[usize], dt: DType| Tensor::zeros(shape, dt, &cpu).expect("zeros");
    let (q, k) = (z(&[1, 4, 2, 8], DType::F32), z(&[1, 4, 1, 8], DType::F32));
    let err = |r: candle_core::Result<Tensor>, needle: &str| {
        let e = r.expect_err("an error").to_string();
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    };
    err(
        flash_attn(&q, &k, &z(&[1, 4, 1, 8], DType::F16), 1.0, true),
        "`v` is F16",
    );
    err(
        flash_attn(&q, &k, &z(&[1, 5, 1, 8], DType::F32), 1.0, true),
        "shape mismatch",
    );
    err(
        flash_attn(
            &q,
            &z(&[1, 4, 3, 8], DType::F32),
            &z(&[1, 4, 3, 8], DType::F32),
            1.0,
            true,
        ),
        "heads_kv",
    );
    let slopes = z(&[2], DType::F32);
    err(
        flash_attn_alibi_windowed_softcap(&q, &k, &k, Some(&slopes), 1.0, None, Some(0), 0.0),
        "ALiBi",
    );
    let bad = Tensor::new(&[0f32, 4.0], &cpu).expect("offsets");
    let (qp, kp) = (z(&[4, 2, 8], DType::F32), z(&[4, 1, 8], DType::F32));
    err(
        flash_attn_varlen(&qp, &kp, &kp, &bad, &bad, 4, 4, 1.0, true),
        "must be u32",
    );
}

#[test]
fn gpu_calls_agree_with_the_cpu_path() {
    let test = "gpu_calls_agree_with_the_cpu_path";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let mut rng = Rng::new(4);
    let (b, s, hq, hkv) = (2, 77, 4, 2);
    for (dt, d, bound) in [
        (DType::F32, 64, 2e-5),
        (DType::BF16, 128, 3e-2),
        (DType::F16, 64, 4e-3),
    ] {
        let host = |shape: &[usize], rng: &mut Rng| {
            randn(rng, shape, &Device::Cpu).to_dtype(dt).expect("cast")
        };
        let (q, k, v) = (
            host(&[b, s, hq, d], &mut rng),
            host(&[b, s, hkv, d], &mut rng),
            host(&[b, s, hkv, d], &mut rng),
        );
        let w = host(&[b, s, hq, d], &mut rng);
        let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
            flash_attn_alibi_windowed_softcap(q, k, v, None, 0.2, Some(40), Some(0), 20.0)
        };
        let on = |t: &Tensor| t.to_device(&dev).expect("upload");
        let want = run(
            &f,
            [
                &q.to_dtype(DType::F64).unwrap(),
                &k.to_dtype(DType::F64).unwrap(),
                &v.to_dtype(DType::F64).unwrap(),
            ],
            &w,
        );
        let got = run(&f, [&on(&q), &on(&k), &on(&v)], &on(&w));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= bound * scale,
                "{dt:?} output {i}: error {err} of max {scale}"
            );
        }
    }
}

/// `flash_attn_qkv`'s call: heads, tables, scale, causal.
struct QkvCall {
    hq: usize,
    hkv: usize,
    rope: Option<(Tensor, Tensor)>,
    scale: f32,
    causal: bool,
}

impl QkvCall {
    fn ours(&self, qkv: &Tensor) -> candle_core::Result<Tensor> {
        let dev = qkv.device();
        let tables = match &self.rope {
            Some((c, s)) => Some((
                c.to_dtype(qkv.dtype())?.to_device(dev)?,
                s.to_dtype(qkv.dtype())?.to_device(dev)?,
            )),
            None => None,
        };
        let rope = tables.as_ref().map(|(c, s)| (c, s));
        flash_attn_qkv(qkv, self.hq, self.hkv, rope, self.scale, self.causal)
    }

    /// candle-nn's `rope_slow` on `[b, h, t, d]` heads and softmax attention over repeated
    /// key/value heads, in candle ops.
    fn slow(&self, qkv: &Tensor) -> candle_core::Result<Tensor> {
        let rope = self.rope.as_ref().map(|(c, s)| (c, s));
        let (heads, scale) = ((self.hq, self.hkv), self.scale as f64);
        common::qkv_attention_slow(qkv, heads, rope, scale, self.causal)
    }
}

/// The output and the gradient of `Σ o·w` with respect to `qkv`.
fn qkv_run(
    f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    qkv: &Tensor,
    w: &Tensor,
) -> [Vec<f32>; 2] {
    let x = Var::from_tensor(qkv).expect("var");
    let o = f(x.as_tensor()).expect("forward");
    let w = w.to_dtype(o.dtype()).and_then(|w| w.to_device(o.device()));
    let grads = (&o * w.expect("weights"))
        .and_then(|x| x.to_dtype(DType::F64))
        .and_then(|x| x.sum_all())
        .and_then(|x| x.backward())
        .expect("backward");
    [vals(&o), vals(grads.get(&x).expect("a gradient"))]
}

fn qkv_inputs(
    rng: &mut Rng,
    (b, t, hq, hkv, d): (usize, usize, usize, usize, usize),
) -> (Tensor, Tensor, Option<(Tensor, Tensor)>) {
    let cpu = Device::Cpu;
    let qkv = randn(rng, &[b, t, (hq + 2 * hkv) * d], &cpu);
    let w = randn(rng, &[b, t, hq * d], &cpu);
    // More rows than tokens: the first `t` are read.
    let angles = randn(rng, &[t + 3, d / 2], &cpu);
    let rope = Some((angles.cos().unwrap(), angles.sin().unwrap()));
    (qkv, w, rope)
}

fn assert_close(what: &str, got: &[Vec<f32>; 2], want: &[Vec<f32>; 2], bound: f32) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        common::assert_within(&format!("{what}: output {i}"), g, w, bound);
    }
}

#[test]
fn cpu_qkv_attention_is_rope_slow_and_softmax_attention() {
    let mut rng = Rng::new(9);
    for (shape, causal, with_rope) in [
        ((2, 9, 4, 2, 8), true, true),
        ((1, 7, 3, 1, 6), false, true),
        ((2, 5, 2, 2, 4), true, false),
    ] {
        let (qkv, w, rope) = qkv_inputs(&mut rng, shape);
        let f64_ = |t: Tensor| t.to_dtype(DType::F64).unwrap();
        let call = QkvCall {
            hq: shape.2,
            hkv: shape.3,
            rope: rope.filter(|_| with_rope).map(|(c, s)| (f64_(c), f64_(s))),
            scale: 0.4,
            causal,
        };
        let qkv = f64_(qkv);
        let got = qkv_run(&|x| call.ours(x), &qkv, &w);
        let want = qkv_run(&|x| call.slow(x), &qkv, &w);
        assert_close(&format!("{shape:?} causal {causal}"), &got, &want, 1e-12);
    }
}

#[test]
fn qkv_attention_bad_arguments_are_named() {
    let cpu = Device::Cpu;
    let z = |shape: &[usize], dt: DType| Tensor::zeros(shape, dt, &cpu).expect("zeros");
    let qkv = z(&[1, 4, 6 * 8], DType::F32);
    let table = z(&[4, 4], DType::F32);
    let err = |r: candle_core::Result<Tensor>, needle: &str| {
        let e = r.expect_err("an error").to_string();
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    };
    err(
        flash_attn_qkv(&z(&[4, 48], DType::F32), 4, 1, None, 1.0, true),
        "qkv must be [batch, seq, (heads_q + 2·heads_kv)·head_dim]",
    );
    err(
        flash_attn_qkv(&qkv, 3, 2, None, 1.0, true),
        "heads_kv (2) must divide heads_q (3)",
    );
    err(flash_attn_qkv(&qkv, 4, 0, None, 1.0, true), "heads_kv (0)");
    err(
        flash_attn_qkv(&qkv, 3, 1, None, 1.0, true),
        "must be (heads_q + 2·heads_kv)·head_dim = 5·head_dim",
    );
    err(
        flash_attn_qkv(
            &qkv,
            4,
            1,
            Some((&z(&[3, 4], DType::F32), &table)),
            1.0,
            true,
        ),
        "cos must be [rows ≥ 4, 4]",
    );
    err(
        flash_attn_qkv(
            &qkv,
            4,
            1,
            Some((&table, &z(&[4, 8], DType::F32))),
            1.0,
            true,
        ),
        "sin must be [rows ≥ 4, 4]",
    );
    err(
        flash_attn_qkv(
            &qkv,
            4,
            1,
            Some((&table, &z(&[4, 4], DType::BF16))),
            1.0,
            true,
        ),
        "sin is BF16, qkv is F32",
    );
}

#[test]
fn gpu_qkv_attention_agrees_with_the_cpu_path() {
    let test = "gpu_qkv_attention_agrees_with_the_cpu_path";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let mut rng = Rng::new(11);
    for (dt, shape, causal, with_rope, bound) in [
        (DType::F32, (2, 77, 4, 2, 64), true, true, 2e-5),
        (DType::BF16, (2, 130, 8, 2, 128), true, true, 3e-2),
        (DType::F16, (1, 64, 4, 1, 64), false, true, 4e-3),
        (DType::BF16, (2, 33, 4, 4, 64), true, false, 3e-2),
    ] {
        let (qkv, w, rope) = qkv_inputs(&mut rng, shape);
        let rope = rope.filter(|_| with_rope);
        let qkv = qkv.to_dtype(dt).unwrap();
        // The tables rounded to the dtype once, for both sides.
        let rope = rope.map(|(c, s)| (c.to_dtype(dt).unwrap(), s.to_dtype(dt).unwrap()));
        let call = |rope: Option<(Tensor, Tensor)>| QkvCall {
            hq: shape.2,
            hkv: shape.3,
            rope,
            scale: 1.0 / (shape.4 as f32).sqrt(),
            causal,
        };
        let f64_ = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let exact = call(rope.as_ref().map(|(c, s)| (f64_(c), f64_(s))));
        let want = qkv_run(&|x| exact.ours(x), &f64_(&qkv), &w);
        let on_gpu = call(rope);
        let got = qkv_run(&|x| on_gpu.ours(x), &qkv.to_device(&dev).unwrap(), &w);
        assert_close(
            &format!("{dt:?} {shape:?} causal {causal}"),
            &got,
            &want,
            bound,
        );
    }
}
