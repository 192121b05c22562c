//! Cross-entropy and fused linear cross-entropy on the GPU against the f64 reference
//! (`liger_rs::reference::cross_entropy_*`, `fused_linear_cross_entropy`), on fresh random
//! data per case, outputs poisoned with NaN before each launch (an unwritten element fails):
//! every entry point (forward, forward with the gradient, in place or not, backward, in place
//! or not), every option and their combinations (reductions, ignored rows, all rows ignored,
//! class weights, label smoothing, z-loss, softcap), every load path (aligned 16-byte vectors,
//! rows off the vector grid, and the forward with the gradient on rows staged in shared memory,
//! split over clusters of 4 and 8 blocks on sm_90), vocabularies from 1 to beyond 2¹⁶, row
//! strides, targets out
//! of range (NaN rows), bitwise determinism, a rejected call writing nothing, more than 2³²
//! logits, and the fused linear form over several chunks from several host threads at once.
//!
//! Tolerances. Losses and log-sum-exps are f32 (`ex2`/`lg2.approx`, 2 ulp, over sums of up to
//! 2¹⁸ terms): `|got − want| ≤ 3e-6·(1 + |want|)` per row. Gradients are computed in f32 and
//! rounded once to the element type: 1 ulp of it for f16/bf16 plus `1e-6·max|want|` of f32
//! arithmetic, 64 ulp for f32. A wrong target, mask or normalisation moves a value by far more.
mod common;

use common::{Failures, Rng, assert_close, download, gpu, poisoned, sized, upload, widen};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use liger_rs::half::{bf16, f16};
use liger_rs::reference::{self, Element};
use liger_rs::{
    CrossEntropyArgs, Dtype, LinearCrossEntropyArgs, LinearCrossEntropyGrads, Reduction,
};
use std::sync::Arc;

fn targets(stream: &Arc<CudaStream>, t: &[i64]) -> CudaSlice<i64> {
    stream.clone_htod(t).expect("upload targets")
}

/// One case's data on the host.
struct Data<T> {
    /// Logits, `rows × stride`.
    z: Vec<T>,
    target: Vec<i64>,
    weight: Option<Vec<f32>>,
}

fn data<T: Element>(args: &CrossEntropyArgs, seed: u64, weighted: bool, ignore: f64) -> Data<T> {
    let mut rng = Rng::new(seed);
    let n = if args.rows == 0 {
        0
    } else {
        (args.rows - 1) * args.logits_stride + args.vocab
    };
    let z = rng.vec::<T>(n, 0.0, 3.0);
    let target = (0..args.rows)
        .map(|_| {
            if rng.uniform() < ignore {
                args.ignore_index
            } else {
                (rng.next_u64() % args.vocab as u64) as i64
            }
        })
        .collect();
    let weight = weighted.then(|| {
        (0..args.vocab)
            .map(|_| (0.25 + rng.uniform()) as f32)
            .collect()
    });
    Data { z, target, weight }
}

/// Loss-like f32 values against the f64 reference.
fn check_f32(what: &str, case: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what} length, {case}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        let ok = if w.is_nan() {
            g.is_nan()
        } else {
            (g - w).abs() <= 3e-6 * (1.0 + w.abs())
        };
        assert!(ok, "{what}[{i}]: got {g:e}, want {w:e}; {case}");
    }
}

/// A gradient (contiguous rows of `vocab`) against the reference's. `terms` bounds the
/// magnitude of the terms each element is a difference of (`A·p` and `C`: the upstream
/// gradient times the target's weight over the mean's denominator, times `1 + 2λ·lse`):
/// where they cancel (a vocabulary of one) the f32 error is theirs, not the result's.
fn check_grad<T: Element>(case: &str, got: &[T], want: &[T], terms: f64) {
    let want = widen(want);
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let ulps = if T::NAME == "f32" { 64.0 } else { 1.0 };
    let slack = vec![1e-6 * scale + 4e-6 * terms; want.len()];
    assert_close::<T>("grad", case, &widen(got), &want, ulps, &slack);
}

/// Rows of `stride` compacted to rows of `vocab`.
fn compact<T: Copy>(buf: &[T], rows: usize, vocab: usize, stride: usize) -> Vec<T> {
    (0..rows)
        .flat_map(|i| buf[i * stride..i * stride + vocab].iter().copied())
        .collect()
}

/// Runs every entry point on one case of random data and checks each against the reference.
fn run_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    weighted: bool,
    seed: u64,
) {
    let case = format!("{} {args:?} weighted {weighted} seed {seed}", T::NAME);
    check_case(
        stream,
        args,
        &data::<T>(args, seed, weighted, 0.2),
        &case,
        seed,
    );
}

/// Runs every entry point on `d` and checks each against the reference (`seed` draws the
/// upstream gradients).
fn check_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &CrossEntropyArgs,
    d: &Data<T>,
    case: &str,
    seed: u64,
) {
    let want = reference::cross_entropy_forward(args, &d.z, &d.target, d.weight.as_deref())
        .expect("reference forward");
    let mut rng = Rng::new(seed ^ 0x5eed);
    let grad_loss: Vec<f64> = (0..args.loss_len()).map(|_| 0.5 + rng.uniform()).collect();
    let ones = vec![1.0; args.loss_len()];
    let g1 = reference::cross_entropy_backward(args, &d.z, &d.target, d.weight.as_deref(), &ones)
        .expect("reference backward");
    let gg =
        reference::cross_entropy_backward(args, &d.z, &d.target, d.weight.as_deref(), &grad_loss)
            .expect("reference backward");
    let (rows, vocab) = (args.rows, args.vocab);
    let terms = |g: f64| {
        let w_max = d
            .weight
            .as_ref()
            .map_or(1.0, |w| w.iter().fold(0.0f64, |m, &x| m.max(x as f64)));
        let den = match args.reduction {
            Reduction::Mean => {
                let w = |t: i64| d.weight.as_ref().map_or(1.0, |w| w[t as usize] as f64);
                let counted = d.target.iter().filter(|&&t| t != args.ignore_index);
                let (den_w, den_n) = (
                    counted.clone().map(|&t| w(t)).sum::<f64>(),
                    counted.count() as f64,
                );
                den_w.min(den_n).max(1e-30)
            }
            _ => 1.0,
        };
        let lse = want.lse.iter().fold(0.0f64, |m, l| m.max(l.abs()));
        g * w_max * (1.0 + 2.0 * args.lse_square_scale as f64 * lse) / den
    };
    let g_max = grad_loss.iter().fold(0.0f64, |m, g| m.max(*g));
    let z = upload(stream, &d.z);
    let target = targets(stream, &d.target);
    let weight = d.weight.as_ref().map(|w| upload(stream, w));
    let w_dyn = weight.as_ref().map(|w| w as &dyn DevicePtr<f32>);
    let mut loss = poisoned::<f32>(stream, args.loss_len());
    let mut z_loss = poisoned::<f32>(stream, args.loss_len());
    let mut lse = poisoned::<f32>(stream, rows);
    liger_rs::cross_entropy_forward(
        stream,
        args,
        &z,
        &target,
        w_dyn,
        &mut loss,
        Some(&mut z_loss),
        &mut lse,
    )
    .expect("forward");
    check_f32("loss", case, &download(stream, &loss), &want.loss);
    check_f32("z_loss", case, &download(stream, &z_loss), &want.z_loss);
    check_f32("lse", case, &download(stream, &lse), &want.lse);

    // The gradient in its own buffer (row stride `grad_stride`), then in place.
    let grad_rows = |stride: usize| {
        if rows == 0 {
            0
        } else {
            (rows - 1) * stride + vocab
        }
    };
    let mut grad = poisoned::<T>(stream, grad_rows(args.grad_stride));
    let mut loss2 = poisoned::<f32>(stream, args.loss_len());
    liger_rs::cross_entropy_forward_backward(
        stream, args, &z, &target, w_dyn, &mut loss2, None, &mut grad,
    )
    .expect("forward_backward");
    check_f32(
        "loss (with grad)",
        case,
        &download(stream, &loss2),
        &want.loss,
    );
    let got = compact(&download(stream, &grad), rows, vocab, args.grad_stride);
    check_grad(&format!("forward_backward, {case}"), &got, &g1, terms(1.0));
    let mut zi = upload(stream, &d.z);
    liger_rs::cross_entropy_forward_backward_inplace(
        stream, args, &mut zi, &target, w_dyn, &mut loss2, None,
    )
    .expect("forward_backward_inplace");
    let got = compact(&download(stream, &zi), rows, vocab, args.logits_stride);
    check_grad(
        &format!("forward_backward_inplace, {case}"),
        &got,
        &g1,
        terms(1.0),
    );

    let gl32: Vec<f32> = grad_loss.iter().map(|&g| g as f32).collect();
    let gl = upload(stream, &gl32);
    let mut grad = poisoned::<T>(stream, grad_rows(args.grad_stride));
    liger_rs::cross_entropy_backward(stream, args, &z, &target, w_dyn, &lse, &gl, &mut grad)
        .expect("backward");
    let got = compact(&download(stream, &grad), rows, vocab, args.grad_stride);
    check_grad(&format!("backward, {case}"), &got, &gg, terms(g_max));
    let mut zi = upload(stream, &d.z);
    liger_rs::cross_entropy_backward_inplace(stream, args, &mut zi, &target, w_dyn, &lse, &gl)
        .expect("backward_inplace");
    let got = compact(&download(stream, &zi), rows, vocab, args.logits_stride);
    check_grad(
        &format!("backward_inplace, {case}"),
        &got,
        &gg,
        terms(g_max),
    );
}

/// The option sets every shape runs: plain; PyTorch's sum and per-row losses; Liger's options
/// one by one and all together.
fn option_sets(rows: usize, vocab: usize) -> Vec<(CrossEntropyArgs, bool)> {
    let a = CrossEntropyArgs::new(rows, vocab);
    vec![
        (a, false),
        (a.with_reduction(Reduction::Sum), false),
        (
            a.with_reduction(Reduction::None).with_ignore_index(-1),
            false,
        ),
        (a.with_label_smoothing(0.1), false),
        (a.with_lse_square_scale(1e-4), false),
        (a.with_softcap(Some(30.0)), false),
        (a, true),
        (
            a.with_label_smoothing(0.2)
                .with_lse_square_scale(1e-3)
                .with_softcap(Some(5.0)),
            true,
        ),
        (
            a.with_reduction(Reduction::None).with_label_smoothing(0.05),
            true,
        ),
    ]
}

fn sweep<T: Dtype>(test: &str, seed: u64) {
    let Some(stream) = gpu(test) else { return };
    let shapes: Vec<(usize, usize)> = sized(
        vec![
            (1, 1),
            (3, 7),
            (17, 4097),
            (64, 32000),
            (9, 40000),
            (5, 70001),
            (3, 128256),
            (2, 262144),
        ],
        vec![(1, 1), (3, 7), (5, 4097), (3, 40000), (2, 70001)],
    );
    let mut failures = Failures::new(test);
    for (i, &(rows, vocab)) in shapes.iter().enumerate() {
        for (j, (args, weighted)) in option_sets(rows, vocab).into_iter().enumerate() {
            let seed = seed + 100 * i as u64 + j as u64;
            failures.run(|| run_case::<T>(&stream, &args, weighted, seed));
        }
        // Row strides: padded rows (vectors when the padding keeps 16-byte rows), rows off
        // the vector grid, and a gradient stride of its own.
        let lanes = 16 / size_of::<T>();
        for stride in [vocab + lanes, vocab + 1] {
            let args = CrossEntropyArgs::new(rows, vocab)
                .with_logits_stride(stride)
                .with_grad_stride(vocab + 2 * lanes);
            failures.run(|| run_case::<T>(&stream, &args, false, seed + 7 * i as u64));
        }
    }
    failures.finish();
}

#[test]
fn matches_the_reference_f32() {
    sweep::<f32>("matches_the_reference_f32", 1);
}

#[test]
fn matches_the_reference_f16() {
    sweep::<f16>("matches_the_reference_f16", 2000);
}

#[test]
fn matches_the_reference_bf16() {
    sweep::<bf16>("matches_the_reference_bf16", 4000);
}

/// Targets on both sides of every boundary between the slices of rows split over a cluster
/// (eighths of the row here), and the first and last classes: the block that staged the
/// target's logit writes the row's loss and the target's gradient element, so a target on a
/// slice's edge must be found by the block that holds it. Mean and per-row losses.
#[test]
fn targets_on_the_edges_of_cluster_slices() {
    let test = "targets_on_the_edges_of_cluster_slices";
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for (i, vocab) in sized(vec![32000, 40000, 128256, 262144], vec![40000])
        .into_iter()
        .enumerate()
    {
        let mut target: Vec<i64> = (0..=8)
            .flat_map(|k| {
                let edge = (vocab * k / 8) as i64;
                [edge - 1, edge, edge + 1]
            })
            .filter(|&t| (0..vocab as i64).contains(&t))
            .collect();
        target.dedup();
        let a = CrossEntropyArgs::new(target.len(), vocab);
        for (j, args) in [a, a.with_reduction(Reduction::None)]
            .into_iter()
            .enumerate()
        {
            let seed = 9000 + 10 * i as u64 + j as u64;
            let case = |dtype: &str| format!("{dtype} {args:?} targets {target:?}");
            failures.run(|| {
                let d = Data::<bf16> {
                    target: target.clone(),
                    ..data(&args, seed, false, 0.0)
                };
                check_case(&stream, &args, &d, &case("bf16"), seed)
            });
            failures.run(|| {
                let d = Data::<f32> {
                    target: target.clone(),
                    ..data(&args, seed, false, 0.0)
                };
                check_case(&stream, &args, &d, &case("f32"), seed)
            });
        }
    }
    failures.finish();
}

/// Every row ignored: the mean is NaN (PyTorch's 0/0), the sum 0, every gradient 0; a target
/// outside the vocabulary makes its row's loss and gradient NaN and leaves the others right.
#[test]
fn ignored_and_invalid_targets() {
    let Some(stream) = gpu("ignored_and_invalid_targets") else {
        return;
    };
    let (rows, vocab) = (4, 300);
    let z = upload(&stream, &Rng::new(9).vec::<f32>(rows * vocab, 0.0, 2.0));
    for (reduction, want) in [(Reduction::Mean, f32::NAN), (Reduction::Sum, 0.0)] {
        let args = CrossEntropyArgs::new(rows, vocab).with_reduction(reduction);
        let target = targets(&stream, &[-100; 4]);
        let (mut loss, mut grad) = (
            poisoned::<f32>(&stream, 1),
            poisoned::<f32>(&stream, rows * vocab),
        );
        liger_rs::cross_entropy_forward_backward(
            &stream, &args, &z, &target, None, &mut loss, None, &mut grad,
        )
        .expect("all ignored");
        let l = download(&stream, &loss)[0];
        assert!(
            l.to_bits() == want.to_bits() || (l.is_nan() && want.is_nan()),
            "{reduction:?}: {l}"
        );
        assert!(download(&stream, &grad).iter().all(|&g| g == 0.0));
    }
    let args = CrossEntropyArgs::new(rows, vocab).with_reduction(Reduction::None);
    let host_z = download(&stream, &z);
    let target = targets(&stream, &[5, 300, -7, 299]);
    let (mut loss, mut grad) = (
        poisoned::<f32>(&stream, rows),
        poisoned::<f32>(&stream, rows * vocab),
    );
    liger_rs::cross_entropy_forward_backward(
        &stream, &args, &z, &target, None, &mut loss, None, &mut grad,
    )
    .expect("invalid targets");
    let (loss, grad) = (download(&stream, &loss), download(&stream, &grad));
    assert!(loss[1].is_nan() && loss[2].is_nan(), "{loss:?}");
    assert!(grad[vocab..3 * vocab].iter().all(|g| g.is_nan()));
    let good = CrossEntropyArgs::new(1, vocab).with_reduction(Reduction::None);
    for (row, t) in [(0, 5), (3, 299)] {
        let want =
            reference::cross_entropy_forward(&good, &host_z[row * vocab..][..vocab], &[t], None)
                .expect("reference");
        check_f32(
            "loss",
            "a valid row beside invalid ones",
            &loss[row..row + 1],
            &want.loss,
        );
    }
}

/// Two runs give the same bits (one block per row, fixed-order merges, the reduction in one
/// block in a fixed order).
#[test]
fn runs_are_bitwise_deterministic() {
    let Some(stream) = gpu("runs_are_bitwise_deterministic") else {
        return;
    };
    let args = CrossEntropyArgs::new(sized(512, 16), 32000).with_lse_square_scale(1e-4);
    let d = data::<bf16>(&args, 77, false, 0.1);
    let (z, target) = (upload(&stream, &d.z), targets(&stream, &d.target));
    let run = || {
        let (mut loss, mut grad) = (
            poisoned::<f32>(&stream, 1),
            poisoned::<bf16>(&stream, d.z.len()),
        );
        liger_rs::cross_entropy_forward_backward(
            &stream, &args, &z, &target, None, &mut loss, None, &mut grad,
        )
        .expect("run");
        (download(&stream, &loss), download(&stream, &grad))
    };
    let (a, b) = (run(), run());
    assert_eq!(a.0[0].to_bits(), b.0[0].to_bits());
    assert!(
        a.1.iter()
            .zip(&b.1)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );
}

/// A call the checks reject launches nothing: its outputs keep their poison.
#[test]
fn a_rejected_call_writes_nothing() {
    let Some(stream) = gpu("a_rejected_call_writes_nothing") else {
        return;
    };
    let args = CrossEntropyArgs::new(4, 100);
    let z = upload(&stream, &vec![0.5f32; 400]);
    let target = targets(&stream, &[1, 2, 3, 4]);
    let short_weight = upload(&stream, &vec![1.0f32; 99]);
    let (mut loss, mut grad) = (poisoned::<f32>(&stream, 1), poisoned::<f32>(&stream, 400));
    let r = liger_rs::cross_entropy_forward_backward(
        &stream,
        &args,
        &z,
        &target,
        Some(&short_weight),
        &mut loss,
        None,
        &mut grad,
    );
    common::expect_invalid(r, "weight", "length 100");
    let r = liger_rs::cross_entropy_forward_backward(
        &stream,
        &args.with_label_smoothing(1.5),
        &z,
        &target,
        None,
        &mut loss,
        None,
        &mut grad,
    );
    common::expect_invalid(r, "args.label_smoothing", "[0, 1]");
    assert!(download(&stream, &loss)[0].is_nan());
    assert!(download(&stream, &grad).iter().all(|g| g.is_nan()));
}

/// More than 2³² logits (bf16, 33 000 rows of 131 072): the rows around element 2³¹ and 2³²
/// and the last rows hold random data and match the reference; the others, zeros, have the
/// known loss `ln V` and gradient `1/V − [j = t]`.
#[test]
fn more_than_2_pow_32_logits() {
    let test = "more_than_2_pow_32_logits";
    if common::skip_when_small(test, "it needs 8.6 GB of logits") {
        return;
    }
    let Some(stream) = common::gpu_for_huge(test) else {
        return;
    };
    let (rows, vocab) = (33_000usize, 131_072usize);
    let args = CrossEntropyArgs::new(rows, vocab).with_reduction(Reduction::None);
    let mut z = stream
        .alloc_zeros::<bf16>(rows * vocab)
        .expect("alloc logits");
    let marks = [(1usize << 31) / vocab, (1usize << 32) / vocab, rows - 1];
    let runs = common::sampled_rows(rows, 2, &marks);
    let n: usize = runs.iter().map(|r| r.len()).sum();
    let host: Vec<bf16> = Rng::new(5).vec(n * vocab, 0.0, 3.0);
    common::upload_rows(&stream, &mut z, &runs, vocab, &host);
    let want_t: Vec<i64> = (0..rows).map(|i| (i * 7919 % vocab) as i64).collect();
    let target = targets(&stream, &want_t);
    let mut loss = poisoned::<f32>(&stream, rows);
    liger_rs::cross_entropy_forward_backward_inplace(
        &stream, &args, &mut z, &target, None, &mut loss, None,
    )
    .expect("huge");
    let loss = download(&stream, &loss);
    let grad = common::download_rows(&stream, &z, &runs, vocab);
    let mut at = 0;
    for r in &runs {
        for i in r.clone() {
            let one = CrossEntropyArgs::new(1, vocab).with_reduction(Reduction::None);
            let row = &host[at * vocab..][..vocab];
            let want = reference::cross_entropy_forward(&one, row, &want_t[i..=i], None).unwrap();
            check_f32("loss", &format!("row {i}"), &loss[i..=i], &want.loss);
            let g =
                reference::cross_entropy_backward(&one, row, &want_t[i..=i], None, &[1.0]).unwrap();
            check_grad(&format!("row {i}"), &grad[at * vocab..][..vocab], &g, 1.0);
            at += 1;
        }
    }
    let ln_v = (vocab as f64).ln();
    let zero_rows = (0..rows).filter(|i| !runs.iter().any(|r| r.contains(i)));
    for i in zero_rows.step_by(997) {
        check_f32("loss", &format!("zero row {i}"), &loss[i..=i], &[ln_v]);
    }
}

/// Fused linear cross-entropy against the reference over several chunks (the last one short),
/// with and without a bias, class weights and the options, in each element type.
fn linear_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &LinearCrossEntropyArgs,
    bias: bool,
    weighted: bool,
    seed: u64,
) {
    let case = format!(
        "{} {args:?} bias {bias} weighted {weighted} seed {seed}",
        T::NAME
    );
    let (t, h, v) = (args.ce.rows, args.hidden, args.ce.vocab);
    let mut rng = Rng::new(seed);
    let x: Vec<T> = rng.vec(t * h, 0.0, 1.0);
    let w: Vec<T> = rng.vec(v * h, 0.0, 1.0 / (h as f64).sqrt());
    let b: Option<Vec<T>> = bias.then(|| rng.vec(v, 0.0, 0.5));
    let target: Vec<i64> = (0..t)
        .map(|i| {
            if i % 5 == 3 {
                -100
            } else {
                (rng.next_u64() % v as u64) as i64
            }
        })
        .collect();
    let cw: Option<Vec<f32>> =
        weighted.then(|| (0..v).map(|_| (0.5 + rng.uniform()) as f32).collect());
    let want =
        reference::fused_linear_cross_entropy(args, &x, &w, b.as_deref(), &target, cw.as_deref())
            .expect("reference");
    let (xd, wd, td) = (
        upload(stream, &x),
        upload(stream, &w),
        targets(stream, &target),
    );
    let bd = b.as_ref().map(|b| upload(stream, b));
    let cwd = cw.as_ref().map(|c| upload(stream, c));
    let mut loss = poisoned::<f32>(stream, args.ce.loss_len());
    let mut z_loss = poisoned::<f32>(stream, args.ce.loss_len());
    let mut dx = poisoned::<T>(stream, t * h);
    let mut dw = poisoned::<f32>(stream, v * h);
    let mut db = bias.then(|| poisoned::<f32>(stream, v));
    liger_rs::fused_linear_cross_entropy(
        stream,
        args,
        &xd,
        &wd,
        bd.as_ref().map(|b| b as &dyn DevicePtr<T>),
        &td,
        cwd.as_ref().map(|c| c as &dyn DevicePtr<f32>),
        &mut loss,
        Some(&mut z_loss),
        LinearCrossEntropyGrads {
            dx: &mut dx,
            dweight: &mut dw,
            dbias: db
                .as_mut()
                .map(|d| d as &mut dyn liger_rs::cudarc::driver::DevicePtrMut<f32>),
        },
    )
    .expect("fused linear cross-entropy");
    // cuBLAS's f32 sums differ from the reference's exact ones by about one f32 rounding per
    // term, which can move a logit across a rounding boundary of T: a few units of T's last
    // place in the loss and gradients (relative to the largest).
    let tol = match T::NAME {
        "f32" => 1e-5,
        "f16" => 4e-3,
        _ => 3e-2,
    };
    let near = |what: &str, got: &[f64], want: &[f64]| {
        let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * scale,
                "{what}[{i}]: got {g:e}, want {w:e} (max {scale:e}); {case}"
            );
        }
    };
    let f = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    near("loss", &f(download(stream, &loss)), &want.loss);
    near("z_loss", &f(download(stream, &z_loss)), &want.z_loss);
    near("dx", &widen(&download(stream, &dx)), &widen(&want.dx));
    near(
        "dweight",
        &f(download(stream, &dw)),
        &f(want.dweight.clone()),
    );
    if let (Some(db), Some(want)) = (&db, &want.dbias) {
        near("dbias", &f(download(stream, db)), &f(want.clone()));
    }
}

fn linear_sweep<T: Dtype>(test: &str) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    let (t, h, v) = sized((37, 64, 1000), (21, 32, 300));
    let base = LinearCrossEntropyArgs::new(t, h, v).with_chunk(8);
    let sets = [
        (base, false, false),
        (base, true, false),
        (
            LinearCrossEntropyArgs::with_ce(
                h,
                CrossEntropyArgs::new(t, v)
                    .with_label_smoothing(0.1)
                    .with_lse_square_scale(1e-3)
                    .with_softcap(Some(20.0)),
            )
            .with_chunk(16),
            true,
            true,
        ),
        (
            LinearCrossEntropyArgs::with_ce(
                h,
                CrossEntropyArgs::new(t, v).with_reduction(Reduction::Sum),
            ),
            false,
            true,
        ),
    ];
    for (i, (args, bias, weighted)) in sets.into_iter().enumerate() {
        failures.run(|| linear_case::<T>(&stream, &args, bias, weighted, 50 + i as u64));
    }
    failures.finish();
}

#[test]
fn fused_linear_matches_the_reference_f32() {
    linear_sweep::<f32>("fused_linear_matches_the_reference_f32");
}

#[test]
fn fused_linear_matches_the_reference_f16() {
    linear_sweep::<f16>("fused_linear_matches_the_reference_f16");
}

#[test]
fn fused_linear_matches_the_reference_bf16() {
    linear_sweep::<bf16>("fused_linear_matches_the_reference_bf16");
}

/// Four host threads, each on a stream of its own (per-thread cuBLAS handles, per-call
/// workspaces), run the fused linear cross-entropy at once and get the single thread's bits.
#[test]
fn fused_linear_from_several_threads_at_once() {
    let Some(stream) = gpu("fused_linear_from_several_threads_at_once") else {
        return;
    };
    let ctx = stream.context().clone();
    let (t, h, v) = sized((512, 256, 4096), (64, 64, 512));
    let args = LinearCrossEntropyArgs::new(t, h, v).with_chunk(64);
    let mut rng = Rng::new(11);
    let x: Vec<bf16> = rng.vec(t * h, 0.0, 1.0);
    let w: Vec<bf16> = rng.vec(v * h, 0.0, 0.1);
    let target: Vec<i64> = (0..t).map(|_| (rng.next_u64() % v as u64) as i64).collect();
    let run = |stream: &Arc<CudaStream>| -> (Vec<f32>, Vec<bf16>, Vec<f32>) {
        let (xd, wd, td) = (
            upload(stream, &x),
            upload(stream, &w),
            targets(stream, &target),
        );
        let mut loss = poisoned::<f32>(stream, 1);
        let mut dx: CudaSlice<bf16> = poisoned(stream, t * h);
        let mut dw: CudaSlice<f32> = poisoned(stream, v * h);
        for _ in 0..3 {
            liger_rs::fused_linear_cross_entropy(
                stream,
                &args,
                &xd,
                &wd,
                None,
                &td,
                None,
                &mut loss,
                None,
                LinearCrossEntropyGrads {
                    dx: &mut dx,
                    dweight: &mut dw,
                    dbias: None,
                },
            )
            .expect("fused linear cross-entropy");
        }
        (
            download(stream, &loss),
            download(stream, &dx),
            download(stream, &dw),
        )
    };
    let want = run(&stream);
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let ctx = ctx.clone();
                s.spawn(move || run(&ctx.new_stream().expect("stream")))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    for g in got {
        assert_eq!(g.0[0].to_bits(), want.0[0].to_bits());
        assert!(
            g.1.iter()
                .zip(&want.1)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        assert!(
            g.2.iter()
                .zip(&want.2)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
