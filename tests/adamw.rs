//! The optimizers on the GPU against the reference (`liger_rs::reference::adamw`), bit for
//! bit: the reference reproduces the kernels' arithmetic (PyTorch's fused operation order and
//! rounding points), so every θ, m, v, amsgrad maximum, momentum buffer and copy must have the
//! same bits after several steps. Tensors of odd lengths (1, 3, 4097, 100003), more than one
//! launch's worth (40 tensors) and one of 2³² + 3 elements, every gradient type and copy type,
//! amsgrad, maximize, Adam's L2 decay, SGD with and without (Nesterov) momentum, clipping by
//! the global norm, a gradient scale, found-inf skipping, the step and the learning rate on
//! the device, determinism, two host threads on two streams at once, and rejected calls
//! writing nothing.
mod common;

use common::{Failures, Rng, download, gpu, gpu_for_huge, upload};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use liger_rs::reference::adamw::{self as reference, AdamWState, SgdState};
use liger_rs::{
    AdamWArgs, AdamWTensor, Dtype, NormType, SgdArgs, SgdTensor, StepScalars, adamw_step,
    adamw_step_with_copies, sgd_step, sgd_step_with_copies,
};
use std::sync::Arc;

/// One tensor on the host and on the device.
struct State<G> {
    host: [Vec<f32>; 4],
    grad: Vec<G>,
    dev: [CudaSlice<f32>; 4],
    dgrad: CudaSlice<G>,
}

fn state<G: Dtype>(stream: &Arc<CudaStream>, rng: &mut Rng, n: usize) -> State<G> {
    let param: Vec<f32> = rng.vec(n, 0.0, 1.0);
    let grad: Vec<G> = rng.vec(n, 0.0, 0.1);
    let host = [param, vec![0.0; n], vec![0.0; n], vec![0.0; n]];
    State {
        dev: host.clone().map(|h| upload(stream, &h)),
        dgrad: upload(stream, &grad),
        host,
        grad,
    }
}

fn same_bits(what: &str, case: &str, got: &[f32], want: &[f32]) {
    if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}[{i}]: got {:e}, want {:e}; {case}", got[i], want[i]);
    }
}

/// Steps 1..=steps on every tensor, each step a fresh gradient; checks every buffer.
fn run<G: Dtype>(
    stream: &Arc<CudaStream>,
    args: &AdamWArgs,
    lens: &[usize],
    grad_scale: Option<f32>,
    seed: u64,
) {
    let case = format!(
        "{} {args:?} lens {lens:?} scale {grad_scale:?} seed {seed}",
        G::NAME
    );
    let mut rng = Rng::new(seed);
    let mut states: Vec<State<G>> = lens.iter().map(|&n| state(stream, &mut rng, n)).collect();
    let scale_dev = grad_scale.map(|s| upload(stream, &[s]));
    for step in 1..=3 {
        for s in states.iter_mut() {
            s.grad = rng.vec(s.grad.len(), 0.0, 0.1);
            s.dgrad = upload(stream, &s.grad);
        }
        let mut tensors: Vec<AdamWTensor<'_, G>> = states
            .iter_mut()
            .map(|s| {
                let [p, m, v, mx] = &mut s.dev;
                AdamWTensor {
                    param: p,
                    grad: &s.dgrad,
                    exp_avg: m,
                    exp_avg_sq: v,
                    max_exp_avg_sq: args.amsgrad.then_some(mx as &mut dyn DevicePtrMut<f32>),
                }
            })
            .collect();
        let scalars = StepScalars {
            grad_scale: scale_dev.as_ref().map(|s| s as &dyn DevicePtr<f32>),
            ..Default::default()
        };
        adamw_step(stream, args, step as f32, &scalars, &mut tensors).expect("step");
        for s in states.iter_mut() {
            let [p, m, v, mx] = &mut s.host;
            let st = AdamWState {
                param: p,
                grad: &s.grad,
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: args.amsgrad.then_some(&mut mx[..]),
            };
            reference::adamw_step(args, step as f32, None, grad_scale, st).expect("reference");
        }
    }
    for (i, s) in states.iter().enumerate() {
        for (k, what) in ["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
            .iter()
            .enumerate()
        {
            if k == 3 && !args.amsgrad {
                continue;
            }
            same_bits(
                what,
                &format!("tensor {i}, {case}"),
                &download(stream, &s.dev[k]),
                &s.host[k],
            );
        }
    }
}

fn sweep<G: Dtype>(test: &str, seed: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    let odd = [1, 3, 4097, 100_003];
    let many: Vec<usize> = (0..40).map(|i| 1 + i * 37).collect();
    let sets = [
        AdamWArgs::new(1e-3),
        AdamWArgs::new(3e-4)
            .with_betas(0.8, 0.95)
            .with_weight_decay(0.1)
            .with_amsgrad(true),
        AdamWArgs::new(1e-2).with_maximize(true).with_eps(1e-6),
        AdamWArgs::adam(1e-3).with_weight_decay(0.05),
    ];
    for (i, args) in sets.iter().enumerate() {
        failures.run(|| run::<G>(&stream, args, &odd, None, seed + i as u64));
    }
    failures.run(|| run::<G>(&stream, &sets[0], &many, None, seed + 10));
    failures.run(|| run::<G>(&stream, &sets[1], &odd, Some(1024.0), seed + 11));
    failures.finish();
}

#[test]
fn matches_the_reference_bit_for_bit_f32() {
    sweep::<f32>("matches_the_reference_bit_for_bit_f32", 1);
}

#[test]
fn matches_the_reference_bit_for_bit_f16() {
    sweep::<f16>("matches_the_reference_bit_for_bit_f16", 100);
}

#[test]
fn matches_the_reference_bit_for_bit_bf16() {
    sweep::<bf16>("matches_the_reference_bit_for_bit_bf16", 200);
}

/// The bf16 copies are the updated master weights rounded once; clipping by the global norm
/// inside the update matches clipping the gradients first; found-inf skips the step.
#[test]
fn copies_clipping_and_found_inf() {
    let Some(stream) = gpu("copies_clipping_and_found_inf") else {
        return;
    };
    let n = 5000;
    let mut rng = Rng::new(9);
    let mut s = state::<bf16>(&stream, &mut rng, n);
    let mut copy = stream.alloc_zeros::<bf16>(n).expect("alloc");
    let mut norm = stream.alloc_zeros::<f32>(3).expect("alloc");
    liger_rs::clip_grad_norm(&stream, &[&s.dgrad], 0.5, NormType::L2, &mut norm).expect("norm");
    let got_norm = download(&stream, &norm);
    let (want_norm, want_factor) = reference::clip_grad_norm(&[&s.grad[..]], 0.5, NormType::L2);
    assert!(
        (got_norm[0] as f64 - want_norm).abs() <= 1e-5 * want_norm,
        "{got_norm:?} vs {want_norm}"
    );
    assert!((got_norm[1] - want_factor).abs() <= 1e-6 * want_factor);
    let args = AdamWArgs::new(1e-3);
    {
        let [p, m, v, _] = &mut s.dev;
        let mut tensors = [AdamWTensor {
            param: p,
            grad: &s.dgrad,
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        }];
        let scalars = StepScalars {
            clip: Some(&norm),
            ..Default::default()
        };
        let mut copies: [&mut dyn DevicePtrMut<bf16>; 1] = [&mut copy];
        adamw_step_with_copies(&stream, &args, 1.0, &scalars, &mut tensors, &mut copies)
            .expect("step");
    }
    let [p, m, v, mx] = &mut s.host;
    let _ = mx;
    let st = AdamWState {
        param: p,
        grad: &s.grad,
        exp_avg: m,
        exp_avg_sq: v,
        max_exp_avg_sq: None,
    };
    reference::adamw_step(&args, 1.0, Some(got_norm[1]), None, st).expect("reference");
    let got = download(&stream, &s.dev[0]);
    same_bits("param (clipped)", "clip", &got, &s.host[0]);
    let c = download(&stream, &copy);
    assert!(
        c.iter()
            .zip(&got)
            .all(|(c, p)| c.to_bits() == bf16::from_f32(*p).to_bits())
    );
    // found-inf: nothing changes.
    let inf = upload(&stream, &[1.0f32]);
    let before = download(&stream, &s.dev[0]);
    {
        let [p, m, v, _] = &mut s.dev;
        let mut tensors = [AdamWTensor {
            param: p,
            grad: &s.dgrad,
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        }];
        let scalars = StepScalars {
            found_inf: Some(&inf),
            ..Default::default()
        };
        adamw_step(&stream, &args, 2.0, &scalars, &mut tensors).expect("skipped step");
    }
    same_bits(
        "param (found inf)",
        "found_inf",
        &download(&stream, &s.dev[0]),
        &before,
    );
}

/// A rejected call launches nothing: a moment one element short, SGD momentum without its
/// buffer.
#[test]
fn a_rejected_call_writes_nothing() {
    let Some(stream) = gpu("a_rejected_call_writes_nothing") else {
        return;
    };
    let mut p = upload(&stream, &[1.0f32; 8]);
    let g = upload(&stream, &[0.5f32; 8]);
    let mut m = upload(&stream, &[0.0f32; 8]);
    let mut v = upload(&stream, &[0.0f32; 7]);
    {
        let mut tensors = [AdamWTensor {
            param: &mut p,
            grad: &g,
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            max_exp_avg_sq: None,
        }];
        let args = AdamWArgs::new(1e-3);
        let r = adamw_step(&stream, &args, 1.0, &StepScalars::default(), &mut tensors);
        common::expect_invalid(r, "exp_avg_sq", "length 8");
    }
    {
        let mut tensors = [SgdTensor {
            param: &mut p,
            grad: &g,
            momentum_buffer: None,
        }];
        let args = SgdArgs::new(0.1).with_momentum(0.9);
        let r = sgd_step(&stream, &args, true, &StepScalars::default(), &mut tensors);
        common::expect_invalid(r, "momentum_buffer", "momentum is not 0");
    }
    assert!(download(&stream, &p).iter().all(|&x| x == 1.0));
}

/// SGD steps 1..=3 on every tensor (the first starts the buffers), checked like [`run`];
/// with `copies`, the f16 copies are the updated θ rounded once.
fn run_sgd<G: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SgdArgs,
    lens: &[usize],
    grad_scale: Option<f32>,
    seed: u64,
) {
    let case = format!(
        "{} {args:?} lens {lens:?} scale {grad_scale:?} seed {seed}",
        G::NAME
    );
    let mut rng = Rng::new(seed);
    let mut states: Vec<State<G>> = lens.iter().map(|&n| state(stream, &mut rng, n)).collect();
    let mut copies: Vec<CudaSlice<f16>> = lens
        .iter()
        .map(|&n| stream.alloc_zeros(n).expect("alloc"))
        .collect();
    let scale_dev = grad_scale.map(|s| upload(stream, &[s]));
    let momentum = args.momentum != 0.0;
    for step in 1..=3 {
        for s in states.iter_mut() {
            s.grad = rng.vec(s.grad.len(), 0.0, 0.1);
            s.dgrad = upload(stream, &s.grad);
        }
        let mut tensors: Vec<SgdTensor<'_, G>> = states
            .iter_mut()
            .map(|s| {
                let [p, b, _, _] = &mut s.dev;
                SgdTensor {
                    param: p,
                    grad: &s.dgrad,
                    momentum_buffer: momentum.then_some(b as &mut dyn DevicePtrMut<f32>),
                }
            })
            .collect();
        let scalars = StepScalars {
            grad_scale: scale_dev.as_ref().map(|s| s as &dyn DevicePtr<f32>),
            ..Default::default()
        };
        let mut c: Vec<&mut dyn DevicePtrMut<f16>> = copies.iter_mut().map(|c| c as _).collect();
        sgd_step_with_copies(stream, args, step == 1, &scalars, &mut tensors, &mut c)
            .expect("step");
        for s in states.iter_mut() {
            let [p, b, _, _] = &mut s.host;
            let st = SgdState {
                param: p,
                grad: &s.grad,
                momentum_buffer: momentum.then_some(&mut b[..]),
            };
            reference::sgd_step(args, step == 1, None, grad_scale, st).expect("reference");
        }
    }
    for (i, s) in states.iter().enumerate() {
        let case = format!("tensor {i}, {case}");
        same_bits("param", &case, &download(stream, &s.dev[0]), &s.host[0]);
        if momentum {
            same_bits(
                "momentum_buffer",
                &case,
                &download(stream, &s.dev[1]),
                &s.host[1],
            );
        }
        let c = download(stream, &copies[i]);
        let rounded: Vec<f32> = s.host[0]
            .iter()
            .map(|&p| f16::from_f32(p).to_f32())
            .collect();
        let c: Vec<f32> = c.iter().map(|c| c.to_f32()).collect();
        same_bits("copy", &case, &c, &rounded);
    }
}

fn sgd_sweep<G: Dtype>(test: &str, seed: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    let odd = [1, 3, 4097, 100_003];
    let sets = [
        SgdArgs::new(0.1),
        SgdArgs::new(0.05)
            .with_momentum(0.9)
            .with_dampening(0.1)
            .with_weight_decay(1e-4),
        SgdArgs::new(0.01)
            .with_momentum(0.95)
            .with_nesterov(true)
            .with_weight_decay(0.01),
        SgdArgs::new(0.1).with_momentum(0.5).with_maximize(true),
    ];
    for (i, args) in sets.iter().enumerate() {
        failures.run(|| run_sgd::<G>(&stream, args, &odd, None, seed + i as u64));
    }
    let many: Vec<usize> = (0..40).map(|i| 1 + i * 37).collect();
    failures.run(|| run_sgd::<G>(&stream, &sets[2], &many, None, seed + 10));
    failures.run(|| run_sgd::<G>(&stream, &sets[1], &odd, Some(512.0), seed + 11));
    failures.finish();
}

#[test]
fn sgd_matches_the_reference_bit_for_bit_f32() {
    sgd_sweep::<f32>("sgd_matches_the_reference_bit_for_bit_f32", 300);
}

#[test]
fn sgd_matches_the_reference_bit_for_bit_bf16() {
    sgd_sweep::<bf16>("sgd_matches_the_reference_bit_for_bit_bf16", 400);
}

/// The step and the learning rate read from the device give the host values' bits; the
/// global norm is the same bits twice over 40 tensors (a fixed reduction order).
#[test]
fn device_scalars_and_a_deterministic_norm() {
    let Some(stream) = gpu("device_scalars_and_a_deterministic_norm") else {
        return;
    };
    let lens: Vec<usize> = (0..40).map(|i| 1 + i * 997).collect();
    let lr = 3e-3f32;
    let args = AdamWArgs::new(lr as f64).with_weight_decay(0.1);
    let mut rng = Rng::new(21);
    let mut a: Vec<State<f32>> = lens.iter().map(|&n| state(&stream, &mut rng, n)).collect();
    let mut b: Vec<State<f32>> = a
        .iter()
        .map(|s| State {
            host: s.host.clone(),
            grad: s.grad.clone(),
            dev: s.host.clone().map(|h| upload(&stream, &h)),
            dgrad: upload(&stream, &s.grad),
        })
        .collect();
    let (step_dev, lr_dev) = (upload(&stream, &[4.0f32]), upload(&stream, &[lr]));
    fn tensors(v: &mut [State<f32>]) -> Vec<AdamWTensor<'_, f32>> {
        v.iter_mut()
            .map(|s| {
                let [p, m, v, _] = &mut s.dev;
                AdamWTensor {
                    param: p,
                    grad: &s.dgrad,
                    exp_avg: m,
                    exp_avg_sq: v,
                    max_exp_avg_sq: None,
                }
            })
            .collect()
    }
    adamw_step(
        &stream,
        &args,
        4.0,
        &StepScalars::default(),
        &mut tensors(&mut a),
    )
    .expect("host scalars");
    let scalars = StepScalars {
        step: Some(&step_dev),
        lr: Some(&lr_dev),
        ..Default::default()
    };
    let other = AdamWArgs::new(1.0).with_weight_decay(0.1);
    adamw_step(&stream, &other, 1.0, &scalars, &mut tensors(&mut b)).expect("device scalars");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        same_bits(
            "param",
            &format!("tensor {i}"),
            &download(&stream, &x.dev[0]),
            &download(&stream, &y.dev[0]),
        );
    }
    let grads: Vec<&dyn DevicePtr<f32>> = a.iter().map(|s| &s.dgrad as _).collect();
    let mut n1 = stream.alloc_zeros::<f32>(3).expect("alloc");
    let mut n2 = stream.alloc_zeros::<f32>(3).expect("alloc");
    liger_rs::clip_grad_norm(&stream, &grads, 1.0, NormType::L2, &mut n1).expect("norm");
    liger_rs::clip_grad_norm(&stream, &grads, 1.0, NormType::L2, &mut n2).expect("norm");
    same_bits(
        "norm",
        "twice",
        &download(&stream, &n1),
        &download(&stream, &n2),
    );
    let host: Vec<&[f32]> = a.iter().map(|s| &s.grad[..]).collect();
    let (want, _) = reference::clip_grad_norm(&host, 1.0, NormType::L2);
    let got = download(&stream, &n1)[0] as f64;
    assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
}

/// Two host threads, each on its own stream, step their own tensors at once; each matches
/// the reference.
#[test]
fn two_threads_on_two_streams() {
    let Some(stream) = gpu("two_threads_on_two_streams") else {
        return;
    };
    let ctx = stream.context().clone();
    std::thread::scope(|scope| {
        for t in 0..2u64 {
            let ctx = ctx.clone();
            scope.spawn(move || {
                let s = ctx.new_stream().expect("stream");
                let args = AdamWArgs::new(1e-3).with_amsgrad(t == 1);
                run::<bf16>(&s, &args, &[100_003, 4097, 5], None, 500 + t);
            });
        }
    });
}

/// One tensor of 2³² + 3 elements (bf16 gradients): the elements around 2³¹ and 2³² and at
/// the end match the reference, so no offset is truncated to 32 bits.
#[test]
fn a_tensor_over_2_32_elements() {
    let Some(stream) = gpu_for_huge("a_tensor_over_2_32_elements") else {
        return;
    };
    let n = (1usize << 32) + 3;
    let windows = [
        0..4096,
        (1 << 31) - 2048..(1 << 31) + 2048,
        (1 << 32) - 4093..n,
    ];
    let mut rng = Rng::new(77);
    let z = || stream.alloc_zeros::<f32>(n).expect("alloc");
    let (mut p, mut m, mut v) = (z(), z(), z());
    let mut g = stream.alloc_zeros::<bf16>(n).expect("alloc");
    let mut host = Vec::new();
    for w in &windows {
        let hp: Vec<f32> = rng.vec(w.len(), 0.0, 1.0);
        let hg: Vec<bf16> = rng.vec(w.len(), 0.0, 0.1);
        stream
            .memcpy_htod(&hp, &mut p.slice_mut(w.clone()))
            .expect("up");
        stream
            .memcpy_htod(&hg, &mut g.slice_mut(w.clone()))
            .expect("up");
        host.push((hp, hg));
    }
    let args = AdamWArgs::new(1e-3);
    let mut tensors = [AdamWTensor {
        param: &mut p,
        grad: &g,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
        max_exp_avg_sq: None,
    }];
    adamw_step(&stream, &args, 1.0, &StepScalars::default(), &mut tensors).expect("step");
    for (w, (mut hp, hg)) in windows.iter().zip(host) {
        let (mut hm, mut hv) = (vec![0f32; w.len()], vec![0f32; w.len()]);
        let st = AdamWState {
            param: &mut hp,
            grad: &hg,
            exp_avg: &mut hm,
            exp_avg_sq: &mut hv,
            max_exp_avg_sq: None,
        };
        reference::adamw_step(&args, 1.0, None, None, st).expect("reference");
        let got = stream.clone_dtoh(&p.slice(w.clone())).expect("down");
        same_bits("param", &format!("window {w:?}"), &got, &hp);
        let got = stream.clone_dtoh(&v.slice(w.clone())).expect("down");
        same_bits("exp_avg_sq", &format!("window {w:?}"), &got, &hv);
    }
}

/// The infinity norm over 40 f16 tensors is the largest `|g|` exactly; a NaN or an infinity
/// in one gradient sets the non-finite flag (the L2 and the infinity norm alike, the factor
/// as PyTorch's: NaN, 0), and that flag as `found_inf` skips the step.
#[test]
fn infinity_norm_and_the_non_finite_flag() {
    let Some(stream) = gpu("infinity_norm_and_the_non_finite_flag") else {
        return;
    };
    let mut rng = Rng::new(61);
    let lens: Vec<usize> = (0..40).map(|i| 3 + i * 1013).collect();
    let mut host: Vec<Vec<f16>> = lens.iter().map(|&n| rng.vec(n, 0.0, 1.0)).collect();
    host[17][500] = f16::from_f32(-9.5);
    let dev: Vec<CudaSlice<f16>> = host.iter().map(|h| upload(&stream, h)).collect();
    let grads: Vec<&dyn DevicePtr<f16>> = dev.iter().map(|d| d as _).collect();
    let mut out = stream.alloc_zeros::<f32>(3).expect("alloc");
    liger_rs::clip_grad_norm(&stream, &grads, 2.0, NormType::Inf, &mut out).expect("inf norm");
    let got = download(&stream, &out);
    let slices: Vec<&[f16]> = host.iter().map(|h| &h[..]).collect();
    let (want, factor) = reference::clip_grad_norm(&slices, 2.0, NormType::Inf);
    assert_eq!((got[0], got[1], got[2]), (want as f32, factor, 0.0));
    assert_eq!(got[0], 9.5);
    for (bad, nan_factor) in [(f16::NAN, true), (f16::INFINITY, false)] {
        let mut g = host[3].clone();
        g[1] = bad;
        let gd = upload(&stream, &g);
        for norm_type in [NormType::L2, NormType::Inf] {
            let mut list = grads.clone();
            list[3] = &gd;
            liger_rs::clip_grad_norm(&stream, &list, 1.0, norm_type, &mut out).expect("norm");
            let got = download(&stream, &out);
            assert_eq!(got[2], 1.0, "{bad:?} {norm_type:?}: {got:?}");
            assert_eq!(
                got[1].is_nan(),
                nan_factor,
                "{bad:?} {norm_type:?}: {got:?}"
            );
            if !nan_factor {
                assert_eq!(got[1], 0.0);
            }
        }
    }
    // The flag as found_inf: the step leaves θ, m and v as they were.
    let n = 1000;
    let mut s = state::<f32>(&stream, &mut rng, n);
    let before = s.host.clone();
    {
        let flag = out.slice(2..3);
        let [p, m, v, _] = &mut s.dev;
        let mut tensors = [AdamWTensor {
            param: p,
            grad: &s.dgrad,
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        }];
        let scalars = StepScalars {
            found_inf: Some(&flag),
            ..Default::default()
        };
        adamw_step(&stream, &AdamWArgs::new(1e-2), 1.0, &scalars, &mut tensors).expect("step");
    }
    for (dev, want) in s.dev.iter().zip(&before).take(3) {
        same_bits("skipped", "found_inf", &download(&stream, dev), want);
    }
}

/// bf16 moments (and amsgrad's maximum) against the reference bit for bit over three steps:
/// each computed in f32 from the widened stored value and rounded once when stored; f16
/// moments are refused.
fn bf16_moments<G: Dtype>(stream: &Arc<CudaStream>, seed: u64) {
    let mut rng = Rng::new(seed);
    let lens = [1usize, 3, 4097, 100_003];
    let args = AdamWArgs::new(1e-3)
        .with_amsgrad(true)
        .with_weight_decay(0.1);
    let mut host_p: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, 0.0, 1.0)).collect();
    let mut host_s: Vec<[Vec<bf16>; 3]> = lens
        .iter()
        .map(|&n| [0, 1, 2].map(|_| vec![bf16::ZERO; n]))
        .collect();
    let mut dev_p: Vec<CudaSlice<f32>> = host_p.iter().map(|h| upload(stream, h)).collect();
    let mut dev_s: Vec<[CudaSlice<bf16>; 3]> = host_s
        .iter()
        .map(|s| s.clone().map(|h| upload(stream, &h)))
        .collect();
    for step in 1..=3 {
        let grads: Vec<Vec<G>> = lens.iter().map(|&n| rng.vec(n, 0.0, 0.1)).collect();
        let dgrads: Vec<CudaSlice<G>> = grads.iter().map(|g| upload(stream, g)).collect();
        let mut tensors: Vec<AdamWTensor<'_, G, bf16>> = dev_p
            .iter_mut()
            .zip(dev_s.iter_mut())
            .zip(&dgrads)
            .map(|((p, [m, v, mx]), g)| AdamWTensor {
                param: p,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: Some(mx as &mut dyn DevicePtrMut<bf16>),
            })
            .collect();
        adamw_step(
            stream,
            &args,
            step as f32,
            &StepScalars::default(),
            &mut tensors,
        )
        .expect("step");
        for ((p, [m, v, mx]), g) in host_p.iter_mut().zip(host_s.iter_mut()).zip(&grads) {
            let st = AdamWState {
                param: p,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: Some(&mut mx[..]),
            };
            reference::adamw_step(&args, step as f32, None, None, st).expect("reference");
        }
    }
    let bits = |v: Vec<bf16>| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    for (i, (p, s)) in dev_p.iter().zip(&dev_s).enumerate() {
        let case = format!("{} bf16 moments, tensor {i}", G::NAME);
        same_bits("param", &case, &download(stream, p), &host_p[i]);
        for (k, what) in ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
            .iter()
            .enumerate()
        {
            let got = bits(download(stream, &s[k]));
            same_bits(what, &case, &got, &bits(host_s[i][k].clone()));
        }
    }
}

#[test]
fn bf16_moments_match_the_reference_bit_for_bit() {
    let Some(stream) = gpu("bf16_moments_match_the_reference_bit_for_bit") else {
        return;
    };
    bf16_moments::<f32>(&stream, 700);
    bf16_moments::<bf16>(&stream, 701);
    let mut p = upload(&stream, &[1.0f32; 8]);
    let g = upload(&stream, &[0.5f32; 8]);
    let (mut m, mut v) = (
        upload(&stream, &[f16::ZERO; 8]),
        upload(&stream, &[f16::ZERO; 8]),
    );
    let mut tensors = [AdamWTensor {
        param: &mut p,
        grad: &g,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
        max_exp_avg_sq: None,
    }];
    let r = adamw_step(
        &stream,
        &AdamWArgs::new(1e-3),
        1.0,
        &StepScalars::default(),
        &mut tensors,
    );
    common::expect_invalid(r, "exp_avg", "f32 or bf16 moments");
}
