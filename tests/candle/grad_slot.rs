//! `liger_rs::candle::GradSlot` and the nodes that take one (feature `candle`): a small model
//! (an embedding, two attention and two MLP block halves sharing their weights, the fused
//! linear cross-entropy) trained once with candle's `GradStore` alone and once with every
//! parameter's gradient put into a slot and drained into the store. The stores agree bitwise
//! (the same kernels, reductions and sums in the same order: a slot's first gradient is what
//! candle would add to its zero fill, the shared weights' second one is added as candle adds
//! it), on the CPU (always run) and the GPU in f32 and bf16; slots that are not emptied sum
//! the next backward's gradients; a frozen weight's slot gets nothing.
use crate::common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::Rng;
use liger_rs::candle::{
    AttentionBlockConfig, BlockSlots, CrossEntropyConfig, GradSlot, RmsNormConfig, attention_block,
    attention_block_with_slots, embedding, embedding_with_slot, fused_linear_cross_entropy,
    fused_linear_cross_entropy_with_slot, swiglu_mlp_block, swiglu_mlp_block_with_slots,
};

const VOCAB: usize = 40;
const HIDDEN: usize = 64;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 16;
const INTER: usize = 96;

/// The parameters (embedding, attention norm and packed weight, MLP norm and packed weight,
/// head) as variables of `dtype` on `dev`, from one seed.
fn params(dtype: DType, dev: &Device) -> Vec<Var> {
    let mut rng = Rng::new(31);
    let mut var = |shape: &[usize], mean: f64, std: f64| {
        let n = shape.iter().product();
        let t = Tensor::from_vec(rng.vec::<f32>(n, mean, std), shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(dev))
            .expect("tensor");
        Var::from_tensor(&t).expect("var")
    };
    let std = (HIDDEN as f64).powf(-0.5);
    vec![
        var(&[VOCAB, HIDDEN], 0.0, 1.0),
        var(&[HIDDEN], 1.0, 0.1),
        var(&[(2 * HQ + 2 * HKV) * D, HIDDEN], 0.0, std),
        var(&[HIDDEN], 1.0, 0.1),
        var(&[3 * INTER, HIDDEN], 0.0, std),
        var(&[VOCAB, HIDDEN], 0.0, std),
    ]
}

/// The model's loss and its gradients in the store, the slots (one per parameter) drained
/// into it where given and `drain`; `frozen` parameters are passed as constants.
fn step(
    p: &[Var],
    slots: Option<&[GradSlot]>,
    frozen: &[usize],
    drain: bool,
    dev: &Device,
) -> GradStore {
    let (b, t) = (2, 9);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % VOCAB) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), dev).expect("ids");
    let target = Tensor::from_vec(
        (0..b * t)
            .map(|i| (i * 5 % VOCAB) as u32)
            .collect::<Vec<_>>(),
        b * t,
        dev,
    )
    .expect("target");
    let w: Vec<Tensor> = (p.iter().enumerate())
        .map(|(i, v)| match frozen.contains(&i) {
            true => v.as_tensor().detach(),
            false => v.as_tensor().clone(),
        })
        .collect();
    let half = |i: usize| {
        slots.map(|s| BlockSlots {
            norm: s[i].clone(),
            weight: s[i + 1].clone(),
        })
    };
    let (attn_slots, mlp_slots) = (half(1), half(3));
    let cfg = AttentionBlockConfig::llama(HQ, HKV, D, 1e-6);
    let angles = Tensor::arange(0f32, (t * D / 2) as f32, dev)
        .and_then(|a| a.reshape((t, D / 2)))
        .and_then(|a| a * 0.05)
        .expect("angles");
    let (cos, sin) = (
        angles.cos().and_then(|c| c.to_dtype(w[0].dtype())).unwrap(),
        angles.sin().and_then(|s| s.to_dtype(w[0].dtype())).unwrap(),
    );
    let norm = RmsNormConfig::default().with_eps(1e-6);
    let forward = || -> candle_core::Result<Tensor> {
        let mut x = match slots {
            Some(s) => embedding_with_slot(&w[0], &ids, &s[0])?,
            None => embedding(&w[0], &ids)?,
        };
        for _ in 0..2 {
            let rope = Some((&cos, &sin));
            x = match &attn_slots {
                Some(s) => attention_block_with_slots(&x, &w[1], &w[2], rope, &cfg, s)?,
                None => attention_block(&x, &w[1], &w[2], rope, &cfg)?,
            };
            x = match &mlp_slots {
                Some(s) => swiglu_mlp_block_with_slots(&x, &w[3], &w[4], &norm, s)?,
                None => swiglu_mlp_block(&x, &w[3], &w[4], &norm)?,
            };
        }
        let x = x.reshape((b * t, HIDDEN))?;
        let ce = CrossEntropyConfig::default();
        match slots {
            Some(s) => fused_linear_cross_entropy_with_slot(&x, &w[5], None, &target, &ce, &s[5]),
            None => fused_linear_cross_entropy(&x, &w[5], None, &target, &ce),
        }
    };
    let mut grads = forward().and_then(|l| l.backward()).expect("backward");
    if let Some(s) = slots.filter(|_| drain) {
        for (i, (slot, v)) in s.iter().zip(p).enumerate() {
            // Slotted weights' gradients bypass the store.
            assert!(grads.get(v).is_none(), "param {i}: gradient in the store");
            slot.drain_into(&mut grads, v.as_tensor()).expect("drain");
        }
    }
    grads
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("values")
}

fn bits(t: &Tensor) -> Vec<u32> {
    vals(t).iter().map(|x| x.to_bits()).collect()
}

/// With and without slots, the same gradients bit for bit, every parameter's present.
fn slots_match_the_store(dtype: DType, dev: &Device) {
    let p = params(dtype, dev);
    let want = step(&p, None, &[], true, dev);
    let slots: Vec<GradSlot> = p.iter().map(|_| GradSlot::new()).collect();
    let got = step(&p, Some(&slots), &[], true, dev);
    for (i, v) in p.iter().enumerate() {
        let (g, w) = (got.get(v), want.get(v));
        let (g, w) = (g.expect("slot gradient"), w.expect("store gradient"));
        assert_eq!(g.dims(), w.dims(), "{dtype:?} param {i}");
        assert!(bits(g) == bits(w), "{dtype:?} param {i}: gradients differ");
        assert!(slots[i].take().is_none(), "param {i}: slot not emptied");
    }
}

/// A slot that is not emptied sums the next backward's gradients into what it holds (the
/// same gradients again: twice them); a frozen parameter's slot gets nothing.
fn slots_accumulate_and_skip_frozen(dtype: DType, dev: &Device) {
    let p = params(dtype, dev);
    let slots: Vec<GradSlot> = p.iter().map(|_| GradSlot::new()).collect();
    step(&p, Some(&slots), &[], false, dev);
    let once: Vec<Tensor> = (slots.iter())
        .map(|s| s.take().expect("first gradient"))
        .collect();
    step(&p, Some(&slots), &[], false, dev);
    let frozen = [1, 2, 5];
    step(&p, Some(&slots), &frozen, false, dev);
    let bound = match dtype {
        DType::BF16 => 1e-2,
        _ => 1e-6,
    };
    for (i, (slot, g)) in slots.iter().zip(&once).enumerate() {
        let held = slot.take().expect("held gradient");
        if frozen.contains(&i) {
            assert!(
                bits(&held) == bits(g),
                "{dtype:?} param {i}: frozen, but added to"
            );
            continue;
        }
        // Each use's gradient is added on its own, so a shared weight's two steps are summed
        // in another order than twice one step's sum.
        let want = (g + g).expect("2g");
        common::assert_within(
            &format!("{dtype:?} param {i}"),
            &vals(&held),
            &vals(&want),
            bound,
        );
    }
}

#[test]
fn cpu_slots_match_the_store() {
    slots_match_the_store(DType::F32, &Device::Cpu);
    slots_match_the_store(DType::F64, &Device::Cpu);
    slots_accumulate_and_skip_frozen(DType::F32, &Device::Cpu);
}

#[test]
fn gpu_slots_match_the_store() {
    let test = "gpu_slots_match_the_store";
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    slots_match_the_store(DType::F32, &dev);
    slots_match_the_store(DType::BF16, &dev);
    slots_accumulate_and_skip_frozen(DType::BF16, &dev);
}
