//! candle interop (feature `candle`): the candle path against the plain API on the same data
//! and stream (same kernels, so the same numbers), for every op, dtype and layout form, forward,
//! explicit backward and candle's autograd (GPU); on the CPU (always run) the same calls against
//! the reference, every op's gradient against finite differences of its value, argument
//! errors.
#![cfg(feature = "candle")]
mod common;

use candle_core::{D, DType, Device, Tensor, Var, WithDType};
use common::Rng;
use common::glu::{Op as Glu, glu_call};
use half::{bf16, f16};
use liger_rs::candle::{
    RmsNormConfig, RopeConfig, SwigluConfig, geglu, geglu_backward, geglu_fused,
    geglu_fused_backward, nn, rms_norm, rms_norm_backward, rms_norm_forward, rope, rope_backward,
    rope_backward_with, rope_with, swiglu, swiglu_backward, swiglu_fused, swiglu_fused_backward,
};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use liger_rs::reference::Element;
use liger_rs::reference::rope::CosSinRows;
use liger_rs::{
    CastingMode, CosSinLayout, Dtype, Gelu, PositionIds, RmsNormArgs, RopeArgs, SwigluArgs,
};
use std::sync::{Arc, Mutex};

type Stream = Arc<CudaStream>;

/// CUDA device 0 as candle opens it, or `None` after skipping `test` (see `common::skip`).
fn candle_gpu(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            let first = e.to_string().lines().next().unwrap_or_default().to_string();
            common::skip(test, &format!("no GPU ({first})"), common::Need::Gpus(1));
            None
        }
    }
}

/// The stream candle launches on for `dev`: the plain API runs there too.
fn stream_of(dev: &Device) -> Stream {
    match dev {
        Device::Cuda(d) => d.cuda_stream(),
        other => panic!("not a CUDA device: {other:?}"),
    }
}

/// An element type of this crate's kernels and of candle tensors.
trait El: Dtype + WithDType {}
impl<T: Dtype + WithDType> El for T {}

fn host<T: El>(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<T>())
        .expect("download tensor")
        .into_iter()
        .map(Element::to_f64)
        .collect()
}

fn host_buf<T: El>(stream: &Stream, buf: &CudaSlice<T>) -> Vec<f64> {
    stream
        .clone_dtoh(buf)
        .expect("download buffer")
        .into_iter()
        .map(Element::to_f64)
        .collect()
}

/// Equal values (−0 equals +0: candle's gradient accumulation adds to zeros), no NaN.
fn assert_same(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] candle {g:e} plain {w:e}"))
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: candle path differs from the plain API: {bad:?}"
    );
}

fn upload<T: DeviceRepr>(stream: &Stream, data: &[T]) -> CudaSlice<T> {
    stream.clone_htod(data).expect("upload")
}

fn alloc<T: El>(stream: &Stream, n: usize) -> CudaSlice<T> {
    stream.alloc_zeros::<T>(n).expect("alloc")
}

fn tensor<T: El>(data: &[T], shape: &[usize], dev: &Device) -> Tensor {
    Tensor::from_slice(data, shape, dev).expect("tensor")
}

/// How a `[rows, cols]` input reaches an op.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// A contiguous tensor.
    Contiguous,
    /// A contiguous view with a start offset: rows `1..=rows` of a `[rows + 2, cols]` tensor.
    Offset,
    /// A non-contiguous view: the transpose of a contiguous `[cols, rows]` tensor.
    Transposed,
}

const FORMS: [Form; 3] = [Form::Contiguous, Form::Offset, Form::Transposed];

impl Form {
    /// The contiguous tensor that [`Form::view`] turns into `data` `[rows, cols]`.
    fn base<T: El>(
        self,
        data: &[T],
        rows: usize,
        cols: usize,
        dev: &Device,
        rng: &mut Rng,
    ) -> Tensor {
        match self {
            Form::Contiguous => tensor(data, &[rows, cols], dev),
            Form::Offset => {
                let mut big = rng.vec::<T>(cols, 0.0, 1.0);
                big.extend_from_slice(data);
                big.extend(rng.vec::<T>(cols, 0.0, 1.0));
                tensor(&big, &[rows + 2, cols], dev)
            }
            Form::Transposed => {
                let t: Vec<T> = (0..cols * rows)
                    .map(|i| data[(i % rows) * cols + i / rows])
                    .collect();
                tensor(&t, &[cols, rows], dev)
            }
        }
    }

    /// The `[rows, cols]` view of a [`Form::base`] tensor (or of its gradient).
    fn view(self, base: &Tensor, rows: usize) -> Tensor {
        let t = match self {
            Form::Contiguous => base.clone(),
            Form::Offset => base.narrow(0, 1, rows).expect("narrow"),
            Form::Transposed => base.t().expect("transpose"),
        };
        match self {
            Form::Contiguous => assert!(t.is_contiguous() && t.layout().start_offset() == 0),
            Form::Offset => assert!(t.is_contiguous() && t.layout().start_offset() > 0),
            Form::Transposed => assert!(!t.is_contiguous()),
        }
        t
    }

    /// `data` `[rows, cols]` as a tensor of this form.
    fn tensor<T: El>(
        self,
        data: &[T],
        rows: usize,
        cols: usize,
        dev: &Device,
        rng: &mut Rng,
    ) -> Tensor {
        self.view(&self.base(data, rows, cols, dev, rng), rows)
    }

    /// `data` `[rows, cols]` as a tensor of this form computed from a variable, and that
    /// variable (its gradient goes through [`Form::view`] too).
    fn var<T: El>(
        self,
        data: &[T],
        rows: usize,
        cols: usize,
        dev: &Device,
        rng: &mut Rng,
    ) -> (Var, Tensor) {
        let v = Var::from_tensor(&self.base(data, rows, cols, dev, rng)).expect("var");
        let t = self.view(v.as_tensor(), rows);
        (v, t)
    }
}

/// The gradient of `v` seen through `form` (`[rows, cols]`).
fn grad_of(grads: &candle_core::backprop::GradStore, v: &Var, form: Form, rows: usize) -> Tensor {
    form.view(grads.get(v).expect("gradient of a variable"), rows)
}

// ---------------------------------------------------------------- CPU (always run)

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

/// A CPU tensor's values, widened.
fn cpu_vals<T: Element + WithDType>(t: &Tensor) -> Vec<f64> {
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
const GLUS: [Glu; 3] = [Glu::Swiglu, Glu::Geglu(Gelu::Tanh), Glu::Geglu(Gelu::Erf)];

/// candle's autograd op for `glu`, separate gate and up.
fn candle_glu(glu: Glu, a: &Tensor, b: &Tensor, cfg: &SwigluConfig) -> candle_core::Result<Tensor> {
    match glu {
        Glu::Swiglu => swiglu(a, b, cfg),
        Glu::Geglu(gelu) => geglu(a, b, gelu, cfg),
    }
}

/// candle's explicit backward for `glu`, separate.
fn candle_glu_backward(
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
fn candle_glu_fused(glu: Glu, gate_up: &Tensor, cfg: &SwigluConfig) -> candle_core::Result<Tensor> {
    match glu {
        Glu::Swiglu => swiglu_fused(gate_up, cfg),
        Glu::Geglu(gelu) => geglu_fused(gate_up, gelu, cfg),
    }
}

/// candle's explicit backward for `glu`, fused.
fn candle_glu_fused_backward(
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

// ---------------------------------------------------------------- GPU: RMSNorm

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
    let Some(dev) = candle_gpu(test) else { return };
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

// ---------------------------------------------------------------- GPU: RoPE

/// How a RoPE case passes cos/sin.
#[derive(Clone, Copy, Debug)]
enum Tables {
    /// `[S, r]`.
    PerPosition,
    /// `[1, S, r]`.
    Shared,
    /// `[B, S, r]`.
    PerBatch,
    /// `[max_pos, r]` with i64 ids.
    IdsI64,
    /// `[max_pos, r]` with i32 ids.
    IdsI32,
}

fn cos_sin<T: El>(positions: &[i64], r: usize) -> (Vec<T>, Vec<T>) {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &p in positions {
        for j in 0..r {
            let theta = p as f64 * 10000f64.powf(-2.0 * (j % (r / 2)) as f64 / r as f64);
            cos.push(Element::from_f64(theta.cos()));
            sin.push(Element::from_f64(theta.sin()));
        }
    }
    (cos, sin)
}

fn rope_case<T: El>(dev: &Device, rng: &mut Rng, tables: Tables, transposed_q: bool) {
    let stream = stream_of(dev);
    let (b, s, hq, hk, d) = (2, 7, 6, 2, 40);
    let r = if matches!(tables, Tables::PerBatch) {
        24
    } else {
        d
    };
    let case = format!("{} {tables:?} transposed_q={transposed_q} r={r}", T::NAME);
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk)
        .with_rotary_dim(r);
    let (q_h, k_h): (Vec<T>, Vec<T>) = (
        rng.vec(b * s * hq * d, 0.0, 1.0),
        rng.vec(b * s * hk * d, 0.0, 1.0),
    );
    let (dq_h, dk_h): (Vec<T>, Vec<T>) =
        (rng.vec(q_h.len(), 0.0, 1.0), rng.vec(k_h.len(), 0.0, 1.0));
    let max_pos = 50;
    let ids: Vec<i64> = (0..b * s)
        .map(|_| (rng.next_u64() % max_pos) as i64)
        .collect();
    let positions: Vec<i64> = match tables {
        Tables::PerPosition | Tables::Shared => (0..s as i64).collect(),
        Tables::PerBatch => (0..(b * s) as i64).map(|i| 3 * i + 1).collect(),
        Tables::IdsI64 | Tables::IdsI32 => (0..max_pos as i64).collect(),
    };
    let (cos_h, sin_h) = cos_sin::<T>(&positions, r);
    let cs_dims: Vec<usize> = match tables {
        Tables::PerPosition => vec![s, r],
        Tables::Shared => vec![1, s, r],
        Tables::PerBatch => vec![b, s, r],
        Tables::IdsI64 | Tables::IdsI32 => vec![max_pos as usize, r],
    };

    // Plain API on the same stream.
    let (cos_d, sin_d) = (upload(&stream, &cos_h), upload(&stream, &sin_h));
    let ids64_d = upload(&stream, &ids);
    let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let ids32_d = upload(&stream, &ids32);
    let layout = match tables {
        Tables::PerPosition | Tables::Shared => CosSinLayout::PerPosition,
        Tables::PerBatch => CosSinLayout::PerBatch,
        Tables::IdsI64 => CosSinLayout::Gathered(PositionIds::DeviceI64(ids64_d.as_view())),
        Tables::IdsI32 => CosSinLayout::Gathered(PositionIds::DeviceI32(ids32_d.as_view())),
    };
    let (mut q_d, mut k_d) = (upload(&stream, &q_h), upload(&stream, &k_h));
    liger_rs::rope_forward(&stream, &args, &mut q_d, &mut k_d, &cos_d, &sin_d, &layout).unwrap();
    let (mut dq_d, mut dk_d) = (upload(&stream, &dq_h), upload(&stream, &dk_h));
    liger_rs::rope_backward(
        &stream, &args, &mut dq_d, &mut dk_d, &cos_d, &sin_d, &layout,
    )
    .unwrap();

    // candle. With `transposed_q`, q-shaped tensors are [B, H, S, d] contiguous, transposed to
    // [B, S, H, d] (HF's layout after its transpose): non-contiguous.
    let q_base = |data: &[T]| {
        if transposed_q {
            let mut bhsd = data.to_vec();
            for (i, &v) in data.iter().enumerate() {
                let (bi, si, hi, di) = (i / (s * hq * d), i / (hq * d) % s, i / d % hq, i % d);
                bhsd[((bi * hq + hi) * s + si) * d + di] = v;
            }
            tensor(&bhsd, &[b, hq, s, d], dev)
        } else {
            tensor(data, &[b, s, hq, d], dev)
        }
    };
    let q_view = |t: &Tensor| {
        let v = if transposed_q {
            t.transpose(1, 2).unwrap()
        } else {
            t.clone()
        };
        assert_eq!(v.is_contiguous(), !transposed_q);
        v
    };
    let qv = Var::from_tensor(&q_base(&q_h)).unwrap();
    let q = q_view(qv.as_tensor());
    let k = tensor(&k_h, &[b, s, hk, d], dev);
    let (cos, sin) = (tensor(&cos_h, &cs_dims, dev), tensor(&sin_h, &cs_dims, dev));
    let ids_t = match tables {
        Tables::IdsI64 => Some(Tensor::from_slice(&ids, (b, s), dev).unwrap()),
        Tables::IdsI32 => Some(Tensor::from_slice(&ids32, (b, s), dev).unwrap()),
        _ => None,
    };
    let kv = Var::from_tensor(&k).unwrap();
    let (qr, kr) = rope(&q, kv.as_tensor(), &cos, &sin, ids_t.as_ref()).unwrap();
    assert_eq!(
        (qr.dims(), kr.dims()),
        (&[b, s, hq, d][..], &[b, s, hk, d][..])
    );
    assert_same(
        &format!("q, {case}"),
        &host::<T>(&qr),
        &host_buf(&stream, &q_d),
    );
    assert_same(
        &format!("k, {case}"),
        &host::<T>(&kr),
        &host_buf(&stream, &k_d),
    );
    // The inputs are unchanged.
    assert_same(
        &format!("q input, {case}"),
        &host::<T>(&q),
        &q_h.iter().map(|&v| Element::to_f64(v)).collect::<Vec<_>>(),
    );

    let (dq, dk) = (q_view(&q_base(&dq_h)), tensor(&dk_h, &[b, s, hk, d], dev));
    let (gq, gk) = rope_backward(&dq, &dk, &cos, &sin, ids_t.as_ref()).unwrap();
    assert_same(
        &format!("dq, {case}"),
        &host::<T>(&gq),
        &host_buf(&stream, &dq_d),
    );
    assert_same(
        &format!("dk, {case}"),
        &host::<T>(&gk),
        &host_buf(&stream, &dk_d),
    );

    let loss = qr
        .mul(&dq)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&kr.mul(&dk).unwrap().sum_all().unwrap())
        .unwrap();
    let grads = loss.backward().unwrap();
    assert_same(
        &format!("autograd dq, {case}"),
        &host::<T>(&q_view(grads.get(&qv).expect("grad q"))),
        &host_buf(&stream, &dq_d),
    );
    assert_same(
        &format!("autograd dk, {case}"),
        &host::<T>(grads.get(&kv).expect("grad k")),
        &host_buf(&stream, &dk_d),
    );
}

fn rope_sweep<T: El>(test: &str, seed: u64) {
    let Some(dev) = candle_gpu(test) else { return };
    let mut rng = Rng::new(seed);
    let mut n = 0;
    for tables in [
        Tables::PerPosition,
        Tables::Shared,
        Tables::PerBatch,
        Tables::IdsI64,
        Tables::IdsI32,
    ] {
        for transposed_q in [false, true] {
            rope_case::<T>(&dev, &mut rng, tables, transposed_q);
            n += 1;
        }
    }
    println!("{test}: {n} cases equal to the plain API");
}

#[test]
fn gpu_rope_matches_plain_api_f32() {
    rope_sweep::<f32>("gpu_rope_matches_plain_api_f32", 11);
}

#[test]
fn gpu_rope_matches_plain_api_f16() {
    rope_sweep::<f16>("gpu_rope_matches_plain_api_f16", 12);
}

#[test]
fn gpu_rope_matches_plain_api_bf16() {
    rope_sweep::<bf16>("gpu_rope_matches_plain_api_bf16", 13);
}

// ---------------------------------------------------------------- GPU: SwiGLU

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
    let Some(dev) = candle_gpu(test) else { return };
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

// ---------------------------------------------------------------- GPU: composition, errors

/// A Llama-shaped block (RMSNorm → RoPE on q/k projections → SwiGLU) through one candle
/// autograd graph with candle's own ops between ours: the RMSNorm forward matches the CPU
/// reference, and every variable gets a finite, non-zero gradient of its shape.
#[test]
fn gpu_ops_compose_in_one_autograd_graph() {
    let test = "gpu_ops_compose_in_one_autograd_graph";
    let Some(dev) = candle_gpu(test) else { return };
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
    let Some(dev) = candle_gpu(test) else { return };
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
    let Some(dev) = candle_gpu("gpu_rms_norm_from_several_threads_on_one_device") else {
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

// ---------------------------------------------------------------- gradients: finite differences

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
    let Some(dev) = candle_gpu("gpu_rope_reads_fused_qkv_views") else {
        return;
    };
    let mut rng = Rng::new(32);
    fused_views_case::<f32>(&dev, &mut rng);
    fused_views_case::<f16>(&dev, &mut rng);
    fused_views_case::<bf16>(&dev, &mut rng);
}

// ---------------------------------------------------------------- fused add + RMSNorm

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
    let Some(dev) = candle_gpu("gpu_fused_add_rms_norm_matches_plain_api") else {
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
