//! `liger_rs::candle::{attention_block, swiglu_mlp_block}` (feature `candle`): Llama's decoder
//! layer halves as one node each. On the CPU (always run) the halves are the composition of
//! the separate ops, checked against candle ops written out here (RMSNorm, the projections,
//! RoPE and softmax attention, SwiGLU, the residual add) in f64; on the GPU the node's forward
//! and its own backward (the packed weight's gradient, the residual's gradient added inside
//! the RMSNorm backward) agree with the CPU path on the same inputs within the element type's
//! rounding, with frozen weights too; bad arguments are named errors.
use crate::common;

use candle_core::{DType, Device, Tensor, Var};
use common::Rng;
use liger_rs::candle::{
    AttentionBlockConfig, RmsNormConfig, attention_block, pack_attention_weights, pack_mlp_weights,
    swiglu_mlp_block,
};

fn randn(rng: &mut Rng, shape: &[usize], mean: f64, std: f64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(rng.vec::<f32>(n, mean, std), shape, &Device::Cpu).expect("tensor")
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("values")
}

/// One half's inputs: `x`, the norm weight, the packed weight, RoPE's `(cos, sin)`.
struct Inputs {
    x: Tensor,
    norm: Tensor,
    weight: Tensor,
    rope: (Tensor, Tensor),
    /// The weights of `Σ y·w`, whose gradients are compared.
    w: Tensor,
}

impl Inputs {
    fn new(rng: &mut Rng, (b, t, hidden): (usize, usize, usize), rows: usize, d: usize) -> Self {
        let angles = randn(rng, &[t + 2, d / 2], 0.0, 1.0);
        Inputs {
            x: randn(rng, &[b, t, hidden], 0.0, 1.0),
            norm: randn(rng, &[hidden], 1.0, 0.2),
            weight: randn(rng, &[rows, hidden], 0.0, (hidden as f64).powf(-0.5)),
            rope: (angles.cos().expect("cos"), angles.sin().expect("sin")),
            w: randn(rng, &[b, t, hidden], 0.0, 1.0),
        }
    }

    /// Every input in `dtype` on `dev` (rounded once, so both sides read the same values).
    fn to(&self, dtype: DType, dev: &Device) -> Self {
        let f = |t: &Tensor| {
            t.to_dtype(dtype)
                .and_then(|t| t.to_device(dev))
                .expect("to")
        };
        Inputs {
            x: f(&self.x),
            norm: f(&self.norm),
            weight: f(&self.weight),
            rope: (f(&self.rope.0), f(&self.rope.1)),
            w: f(&self.w),
        }
    }
}

/// A half as the tests call it: `x`, the norm weight, the packed weight, RoPE's tables.
type Half<'a> =
    &'a dyn Fn(&Tensor, &Tensor, &Tensor, (&Tensor, &Tensor)) -> candle_core::Result<Tensor>;

/// `y` and the gradients of `Σ y·w` with respect to `x`, the norm weight and the packed
/// weight (those that are variables: `frozen` makes the weights constants).
fn run(f: Half<'_>, inp: &Inputs, frozen: bool) -> Vec<Option<Vec<f32>>> {
    let var = |t: &Tensor| Var::from_tensor(t).expect("var");
    let (x, norm, weight) = (var(&inp.x), var(&inp.norm), var(&inp.weight));
    let (n, w) = match frozen {
        true => (inp.norm.clone(), inp.weight.clone()),
        false => (norm.as_tensor().clone(), weight.as_tensor().clone()),
    };
    let y = f(x.as_tensor(), &n, &w, (&inp.rope.0, &inp.rope.1)).expect("forward");
    let grads = (y.to_dtype(DType::F32).expect("y") * inp.w.to_dtype(DType::F32).expect("w"))
        .and_then(|s| s.sum_all())
        .and_then(|s| s.backward())
        .expect("backward");
    let g = |v: &Var| grads.get(v).map(vals);
    vec![Some(vals(&y)), g(&x), g(&norm), g(&weight)]
}

fn assert_close(what: &str, got: &[Option<Vec<f32>>], want: &[Option<Vec<f32>>], bound: f32) {
    let names = ["y", "dx", "d_norm", "d_weight"];
    for ((g, w), name) in got.iter().zip(want).zip(names) {
        match (g, w) {
            (Some(g), Some(w)) => common::assert_within(&format!("{what}: {name}"), g, w, bound),
            (None, None) => {}
            _ => panic!("{what}: {name} present on one side only"),
        }
    }
}

/// The attention half in candle ops: RMSNorm, the QKV rows, NeoX RoPE, causal softmax
/// attention with k and v repeated per group, the output rows, the residual add.
fn attention_slow(
    x: &Tensor,
    norm: &Tensor,
    weight: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    (hq, hkv): (usize, usize),
) -> candle_core::Result<Tensor> {
    let (b, t, hidden) = x.dims3()?;
    let d = weight.dim(0)? / (2 * hq + 2 * hkv);
    let n = candle_nn::ops::rms_norm_slow(x, norm, 1e-6)?;
    let qkv = n
        .reshape((b * t, hidden))?
        .matmul(&weight.narrow(0, 0, (hq + 2 * hkv) * d)?.t()?)?;
    // The block's scale is an f32, 1/√d rounded.
    let scale = (1.0 / (d as f32).sqrt()) as f64;
    let qkv = qkv.reshape((b, t, (hq + 2 * hkv) * d))?;
    let a = common::qkv_attention_slow(&qkv, (hq, hkv), Some((cos, sin)), scale, true)?;
    let a = a.reshape((b * t, hq * d))?;
    let out = a.matmul(&weight.narrow(0, (hq + 2 * hkv) * d, hq * d)?)?;
    x + out.reshape((b, t, hidden))?
}

/// The MLP half in candle ops: RMSNorm, gate and up rows, `silu(gate)·up`, the down rows'
/// transpose, the residual add.
fn mlp_slow(x: &Tensor, norm: &Tensor, weight: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, hidden) = x.dims3()?;
    let inter = weight.dim(0)? / 3;
    let n = candle_nn::ops::rms_norm_slow(x, norm, 1e-6)?.reshape((b * t, hidden))?;
    let gate = n.matmul(&weight.narrow(0, 0, inter)?.t()?)?;
    let up = n.matmul(&weight.narrow(0, inter, inter)?.t()?)?;
    let act = (candle_nn::ops::silu(&gate)? * up)?;
    let out = act.matmul(&weight.narrow(0, 2 * inter, inter)?)?;
    x + out.reshape((b, t, hidden))?
}

fn attention_cfg(hq: usize, hkv: usize, d: usize) -> AttentionBlockConfig {
    AttentionBlockConfig::llama(hq, hkv, d, 1e-6)
}

#[test]
fn cpu_halves_are_the_candle_compositions() {
    let mut rng = Rng::new(21);
    let cpu = Device::Cpu;
    for ((b, t, hidden), (hq, hkv, d)) in [((2, 7, 16), (4, 2, 8)), ((1, 9, 12), (2, 1, 6))] {
        let inp = Inputs::new(&mut rng, (b, t, hidden), (2 * hq + 2 * hkv) * d, d);
        let inp = inp.to(DType::F64, &cpu);
        let cfg = attention_cfg(hq, hkv, d);
        let ours = |x: &Tensor, n: &Tensor, w: &Tensor, r: (&Tensor, &Tensor)| {
            attention_block(x, n, w, Some(r), &cfg)
        };
        let slow = |x: &Tensor, n: &Tensor, w: &Tensor, r: (&Tensor, &Tensor)| {
            attention_slow(x, n, w, r, (hq, hkv))
        };
        let what = format!("attention {:?}", (b, t, hidden, hq, hkv, d));
        assert_close(
            &what,
            &run(&ours, &inp, false),
            &run(&slow, &inp, false),
            1e-10,
        );

        let inter = 2 * hidden + 3;
        let inp = Inputs::new(&mut rng, (b, t, hidden), 3 * inter, d).to(DType::F64, &cpu);
        let ours = |x: &Tensor, n: &Tensor, w: &Tensor, _: (&Tensor, &Tensor)| {
            swiglu_mlp_block(x, n, w, &RmsNormConfig::default())
        };
        let slow = |x: &Tensor, n: &Tensor, w: &Tensor, _: (&Tensor, &Tensor)| mlp_slow(x, n, w);
        let what = format!("mlp {:?}", (b, t, hidden, inter));
        assert_close(
            &what,
            &run(&ours, &inp, false),
            &run(&slow, &inp, false),
            1e-10,
        );
    }
}

#[test]
fn gpu_halves_agree_with_the_cpu_path() {
    let test = "gpu_halves_agree_with_the_cpu_path";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let cpu = Device::Cpu;
    let mut rng = Rng::new(22);
    for (dt, (b, t, hidden), (hq, hkv, d), frozen, bound) in [
        (DType::F32, (2, 77, 256), (4, 2, 64), false, 2e-5),
        (DType::BF16, (2, 130, 512), (8, 2, 64), false, 3e-2),
        (DType::F16, (1, 64, 256), (2, 1, 128), true, 4e-3),
        (DType::BF16, (1, 200, 256), (2, 2, 128), false, 3e-2),
    ] {
        let cfg = attention_cfg(hq, hkv, d);
        let ours = |x: &Tensor, n: &Tensor, w: &Tensor, r: (&Tensor, &Tensor)| {
            attention_block(x, n, w, Some(r), &cfg)
        };
        let inp = Inputs::new(&mut rng, (b, t, hidden), (2 * hq + 2 * hkv) * d, d).to(dt, &cpu);
        let want = run(&ours, &inp.to(DType::F64, &cpu), frozen);
        let got = run(&ours, &inp.to(dt, &dev), frozen);
        let what = format!(
            "attention {dt:?} {:?} frozen {frozen}",
            (b, t, hidden, hq, hkv, d)
        );
        assert_close(&what, &got, &want, bound);

        let inter = 3 * hidden / 2 + 8;
        let ours = |x: &Tensor, n: &Tensor, w: &Tensor, _: (&Tensor, &Tensor)| {
            swiglu_mlp_block(x, n, w, &RmsNormConfig::default())
        };
        let inp = Inputs::new(&mut rng, (b, t, hidden), 3 * inter, d).to(dt, &cpu);
        let want = run(&ours, &inp.to(DType::F64, &cpu), frozen);
        let got = run(&ours, &inp.to(dt, &dev), frozen);
        let what = format!("mlp {dt:?} {:?} frozen {frozen}", (b, t, hidden, inter));
        assert_close(&what, &got, &want, bound);
    }
}

/// On CUDA a node frees what it kept once its backward has run: a second backward through
/// the same graph is a named error, not a result from freed tensors.
#[test]
fn gpu_second_backward_is_an_error() {
    let test = "gpu_second_backward_is_an_error";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let mut rng = Rng::new(24);
    let (hq, hkv, d) = (2, 1, 64);
    let inp = Inputs::new(&mut rng, (1, 16, 128), (2 * hq + 2 * hkv) * d, d);
    let inp = inp.to(DType::BF16, &dev);
    let x = Var::from_tensor(&inp.x).expect("var");
    let cfg = attention_cfg(hq, hkv, d);
    let rope = Some((&inp.rope.0, &inp.rope.1));
    let h = attention_block(x.as_tensor(), &inp.norm, &inp.weight, rope, &cfg).expect("attn");
    let mlp_w = randn(&mut rng, &[3 * 96, 128], 0.0, 0.1)
        .to_dtype(DType::BF16)
        .and_then(|w| w.to_device(&dev))
        .expect("mlp weight");
    // The MLP half over its own variable, so that its graph holds no attention node.
    let h2 = Var::from_tensor(&h.detach()).expect("var");
    let m = swiglu_mlp_block(h2.as_tensor(), &inp.norm, &mlp_w, &RmsNormConfig::default());
    for (what, y) in [("attention", h), ("mlp", m.expect("mlp"))] {
        let loss = || y.to_dtype(DType::F32).and_then(|y| y.sum_all());
        assert!(
            loss().and_then(|l| l.backward()).is_ok(),
            "{what}: first backward"
        );
        common::expect_err(
            what,
            loss().and_then(|l| l.backward()),
            &["a second backward through the same graph"],
        );
    }
}

#[test]
fn packing_stacks_the_rows() {
    let mut rng = Rng::new(23);
    let (q, k, v, o) = (
        randn(&mut rng, &[8, 4], 0.0, 1.0),
        randn(&mut rng, &[2, 4], 0.0, 1.0),
        randn(&mut rng, &[2, 4], 0.0, 1.0),
        randn(&mut rng, &[4, 8], 0.0, 1.0),
    );
    let w = pack_attention_weights(&q, &k, &v, &o).expect("pack");
    assert_eq!(vals(&w.narrow(0, 8, 2).unwrap()), vals(&k));
    assert_eq!(vals(&w.narrow(0, 12, 8).unwrap()), vals(&o.t().unwrap()));
    let (g, u, dn) = (
        randn(&mut rng, &[6, 4], 0.0, 1.0),
        randn(&mut rng, &[6, 4], 0.0, 1.0),
        randn(&mut rng, &[4, 6], 0.0, 1.0),
    );
    let w = pack_mlp_weights(&g, &u, &dn).expect("pack");
    assert_eq!(vals(&w.narrow(0, 6, 6).unwrap()), vals(&u));
    assert_eq!(vals(&w.narrow(0, 12, 6).unwrap()), vals(&dn.t().unwrap()));
}

#[test]
fn bad_arguments_are_named() {
    let cpu = Device::Cpu;
    let z = |shape: &[usize], dt: DType| Tensor::zeros(shape, dt, &cpu).expect("zeros");
    let (x, norm) = (z(&[1, 4, 16], DType::F32), z(&[16], DType::F32));
    let cfg = attention_cfg(4, 2, 8);
    let attn = |x: &Tensor, n: &Tensor, w: &Tensor, cfg: &AttentionBlockConfig| {
        attention_block(x, n, w, None, cfg).map(|_| ())
    };
    let w = z(&[12 * 8, 16], DType::F32);
    common::expect_err(
        "x rank",
        attn(&z(&[4, 16], DType::F32), &norm, &w, &cfg),
        &["x must be [batch, seq, hidden]"],
    );
    common::expect_err(
        "heads",
        attn(&x, &norm, &w, &attention_cfg(3, 2, 8)),
        &["heads_kv (2) must divide heads_q (3)"],
    );
    common::expect_err(
        "weight rows",
        attn(&x, &norm, &z(&[50, 16], DType::F32), &cfg),
        &["weight must be [(2·4 + 2·2)·head_dim, 16]"],
    );
    common::expect_err(
        "weight cols",
        attn(&x, &norm, &z(&[96, 8], DType::F32), &cfg),
        &["weight must be"],
    );
    common::expect_err(
        "norm",
        attn(&x, &z(&[8], DType::F32), &w, &cfg),
        &["norm_weight must be [16]"],
    );
    common::expect_err(
        "dtype",
        attn(&x, &norm, &z(&[96, 16], DType::BF16), &cfg),
        &["weight is BF16, x is F32"],
    );
    let mlp = |x: &Tensor, n: &Tensor, w: &Tensor| {
        swiglu_mlp_block(x, n, w, &RmsNormConfig::default()).map(|_| ())
    };
    common::expect_err(
        "mlp rows",
        mlp(&x, &norm, &z(&[10, 16], DType::F32)),
        &["weight must be [3·inter, 16]"],
    );
    common::expect_err(
        "mlp norm",
        mlp(&x, &z(&[3], DType::F32), &z(&[9, 16], DType::F32)),
        &["norm_weight must be [16]"],
    );
}
