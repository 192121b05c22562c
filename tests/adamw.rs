//! AdamW on the GPU against the reference (`liger_rs::reference::adamw`), bit for bit: the
//! reference reproduces the kernels' arithmetic (PyTorch's fused operation order, f64 where
//! its C++ promotes), so every θ, m, v, amsgrad maximum and copy must have
//! the same bits after several steps. Tensors of odd lengths (1, 3, 4097, 100003) and more
//! than one launch's worth (40 tensors), every gradient type and copy type, amsgrad, maximize,
//! Adam's L2 decay, clipping by the global norm, a gradient scale, found-inf skipping, the
//! step and the learning rate on the device, determinism, and rejected calls writing nothing.
mod common;

use common::{Failures, Rng, download, gpu, upload};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use liger_rs::reference::adamw::{self as reference, AdamWState};
use liger_rs::{AdamWArgs, AdamWTensor, Dtype, StepScalars, adamw_step, adamw_step_with_copies};
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
    let mut norm = stream.alloc_zeros::<f32>(2).expect("alloc");
    liger_rs::clip_grad_norm(&stream, &[&s.dgrad], 0.5, &mut norm).expect("norm");
    let got_norm = download(&stream, &norm);
    let (want_norm, want_factor) = reference::clip_grad_norm(&[&s.grad[..]], 0.5);
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

/// A rejected call launches nothing: a moment one element short.
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
    assert!(download(&stream, &p).iter().all(|&x| x == 1.0));
}
