//! Attention on the GPU against the f64 reference (`liger_rs::reference::attention_*`), on
//! fresh random data per case (outputs poisoned with NaN before each launch, so an unwritten
//! element fails): both paths (tensor cores for f16/bf16 at head_dim 64 and 128, CUDA cores
//! otherwise), GQA and MQA, causal and windowed masks aligned bottom-right (Sq ≠ Sk, rows that
//! see no key), soft-capping, sequences that are no multiple of a tile, packed batches with
//! empty sequences, views of one fused QKV buffer, bitwise determinism, per-thread streams
//! from several host threads, tensors of more than 2³² elements (64-bit offsets), and a
//! rejected call writing nothing.
//!
//! Tolerances: errors are measured against the largest magnitude of each output tensor
//! (`max |want|`), in units of the element type's rounding unit `u` (2⁻²⁴ f32, 2⁻¹¹ f16,
//! 2⁻⁸ bf16). The tensor-core path rounds probabilities (and dS) to the element type before
//! each product, as flash-attention 2 does, so 16-bit results carry a few `u` of the largest
//! term; f32 runs the exact math in f32 with `ex2.approx` (2 ulp), whose error grows with the
//! number of keys summed. A mask or index error moves an output by a whole term, far beyond
//! these bounds in the peaked cases (scale 1, where a few keys carry each row).
mod common;

use common::{Failures, Rng, download, gpu, poisoned, sized, upload};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream};
use liger_rs::half::{bf16, f16};
use liger_rs::reference::{self, Element};
use liger_rs::{AttentionArgs, Dtype, Strides};
use std::io::Write;
use std::sync::Arc;

/// One case: the arguments, and for a packed batch its sequence lengths.
#[derive(Debug, Clone)]
struct Case {
    args: AttentionArgs,
    lens: Option<(Vec<usize>, Vec<usize>)>,
    /// A fused QKV buffer `[B, S, (Hq + 2·Hkv)·d]` (Sq = Sk) holds q, k and v.
    fused: bool,
}

fn case(args: AttentionArgs) -> Case {
    Case {
        args,
        lens: None,
        fused: false,
    }
}

/// The element type's rounding unit.
fn unit<T: Element>() -> f64 {
    2f64.powi(-(T::MANTISSA_DIGITS as i32))
}

/// How many rounding units of the largest magnitude an output may be off by.
fn allowed<T: Element>(what: &str, keys: usize) -> f64 {
    match (T::NAME, what) {
        ("f32", _) => 64.0 + 4.0 * (keys as f64).sqrt(),
        (_, "o") => 6.0,
        _ => 24.0,
    }
}

/// The largest error seen per output and element type, in units of its bound, printed by
/// [`sweep`] so that a run shows how close each output comes to its tolerance.
static WORST: std::sync::Mutex<Vec<(String, f64)>> = std::sync::Mutex::new(Vec::new());

fn note_worst(key: String, ratio: f64) {
    let mut w = WORST.lock().unwrap_or_else(|e| e.into_inner());
    match w.iter_mut().find(|(k, _)| *k == key) {
        Some((_, r)) => *r = r.max(ratio),
        None => w.push((key, ratio)),
    }
}

/// Checks one output against the reference: every element finite where the reference is, and
/// `max |got − want| ≤ allowed · u · max |want|`.
fn check<T: Element>(what: &str, desc: &str, got: &[T], want: &[T], keys: usize) {
    assert_eq!(got.len(), want.len(), "{what} length, {desc}");
    let scale = want
        .iter()
        .map(|w| w.to_f64().abs())
        .fold(0.0, f64::max)
        .max(1e-30);
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f64(), w.to_f64());
        let err = if g.is_finite() {
            (g - w).abs()
        } else {
            f64::INFINITY
        };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let ratio = worst.0 / (unit::<T>() * scale);
    let limit = allowed::<T>(what, keys);
    note_worst(format!("{} {what}", T::NAME), ratio / limit);
    assert!(
        ratio <= limit,
        "{what}: error {:.1} u of max |want| = {scale:e} at [{}] (got {:?}, want {:?}); {limit:.0} allowed; {desc}",
        ratio,
        worst.1,
        got[worst.1],
        want[worst.1],
    );
}

/// The buffers of a case on the device, and their host copies.
struct Inputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    d_o: Vec<T>,
    /// The fused buffer, or q, k, v.
    dev: Vec<CudaSlice<T>>,
    cu: Option<Offsets>,
}

/// A packed batch's offsets on the host and on the device: q's, then k's.
type Offsets = (Vec<i32>, Vec<i32>, CudaSlice<i32>, CudaSlice<i32>);

fn offsets(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for l in lens {
        cu.push(cu.last().unwrap() + *l as i32);
    }
    cu
}

fn inputs<T: Dtype>(stream: &Arc<CudaStream>, c: &Case, rng: &mut Rng) -> Inputs<T> {
    let a = &c.args;
    let (q_tokens, k_tokens) = (
        a.total_q.unwrap_or(a.batch * a.seqlen_q),
        a.total_k.unwrap_or(a.batch * a.seqlen_k),
    );
    let d_o = rng.vec::<T>(a.out_len(), 0.0, 1.0);
    let cu = c.lens.as_ref().map(|(lq, lk)| {
        let (cq, ck) = (offsets(lq), offsets(lk));
        let up = |v: &[i32]| stream.clone_htod(v).expect("upload offsets");
        let (dq, dk) = (up(&cq), up(&ck));
        (cq, ck, dq, dk)
    });
    if c.fused {
        let n = q_tokens * (a.heads_q + 2 * a.heads_kv) * a.head_dim;
        let all = rng.vec::<T>(n, 0.0, 1.0);
        Inputs {
            dev: vec![upload(stream, &all)],
            q: all.clone(),
            k: all[a.heads_q * a.head_dim..].to_vec(),
            v: all[(a.heads_q + a.heads_kv) * a.head_dim..].to_vec(),
            d_o,
            cu,
        }
    } else {
        let q = rng.vec::<T>(q_tokens * a.heads_q * a.head_dim, 0.0, 1.0);
        let k = rng.vec::<T>(k_tokens * a.heads_kv * a.head_dim, 0.0, 1.0);
        let v = rng.vec::<T>(k_tokens * a.heads_kv * a.head_dim, 0.0, 1.0);
        Inputs {
            dev: vec![upload(stream, &q), upload(stream, &k), upload(stream, &v)],
            q,
            k,
            v,
            d_o,
            cu,
        }
    }
}

/// The outputs of one forward and one backward run.
struct Run<T> {
    o: Vec<T>,
    lse: Vec<f32>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
}

fn run<T: Dtype>(stream: &Arc<CudaStream>, c: &Case, x: &Inputs<T>) -> Run<T> {
    let a = &c.args;
    let (eq, ek) = (
        a.total_q.unwrap_or(a.batch * a.seqlen_q),
        a.total_k.unwrap_or(a.batch * a.seqlen_k),
    );
    let (qv, kv, vv) = if c.fused {
        let (hq, hkv) = (a.heads_q * a.head_dim, a.heads_kv * a.head_dim);
        (
            x.dev[0].slice(..),
            x.dev[0].slice(hq..),
            x.dev[0].slice(hq + hkv..),
        )
    } else {
        (x.dev[0].slice(..), x.dev[1].slice(..), x.dev[2].slice(..))
    };
    let mut o = poisoned::<T>(stream, a.out_len());
    let mut lse = poisoned::<f32>(stream, a.lse_len());
    let mut dq = poisoned::<T>(stream, eq * a.heads_q * a.head_dim);
    let mut dk = poisoned::<T>(stream, ek * a.heads_kv * a.head_dim);
    let mut dv = poisoned::<T>(stream, ek * a.heads_kv * a.head_dim);
    let d_o = upload(stream, &x.d_o);
    match &x.cu {
        None => {
            liger_rs::attention_forward(stream, a, &qv, &kv, &vv, &mut o, &mut lse)
                .expect("forward");
            liger_rs::attention_backward(
                stream, a, &qv, &kv, &vv, &o, &d_o, &lse, &mut dq, &mut dk, &mut dv,
            )
            .expect("backward");
        }
        Some((_, _, cq, ck)) => {
            liger_rs::attention_forward_varlen(stream, a, &qv, &kv, &vv, cq, ck, &mut o, &mut lse)
                .expect("forward");
            liger_rs::attention_backward_varlen(
                stream, a, &qv, &kv, &vv, &o, &d_o, &lse, cq, ck, &mut dq, &mut dk, &mut dv,
            )
            .expect("backward");
        }
    }
    Run {
        o: download(stream, &o),
        lse: download(stream, &lse),
        dq: download(stream, &dq),
        dk: download(stream, &dk),
        dv: download(stream, &dv),
    }
}

/// Runs a case on the GPU and checks every output against the reference.
fn check_case<T: Dtype>(stream: &Arc<CudaStream>, c: &Case, seed: u64) {
    let mut rng = Rng::new(seed);
    let x = inputs::<T>(stream, c, &mut rng);
    let got = run(stream, c, &x);
    let a = &c.args;
    let cu =
        x.cu.as_ref()
            .map(|(q, k, _, _)| (q.as_slice(), k.as_slice()));
    let want = reference::attention_forward(a, &x.q, &x.k, &x.v, cu).expect("reference forward");
    let grads =
        reference::attention_backward(a, &x.q, &x.k, &x.v, &x.d_o, cu).expect("reference backward");
    let desc = format!("{} seed {seed}: {c:?}", T::NAME);
    let keys = a.seqlen_k;
    check("o", &desc, &got.o, &want.o, keys);
    for (i, (g, w)) in got.lse.iter().zip(&want.lse).enumerate() {
        let ok = if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= 1e-4 * (1.0 + w.abs())
        };
        assert!(ok, "lse[{i}]: got {g}, want {w}; {desc}");
    }
    check("dq", &desc, &got.dq, &grads.dq[..got.dq.len()], keys);
    check("dk", &desc, &got.dk, &grads.dk[..got.dk.len()], keys);
    check("dv", &desc, &got.dv, &grads.dv[..got.dv.len()], keys);
}

/// The cases every element type runs at `d`.
fn cases(d: usize) -> Vec<Case> {
    let s = sized(200, 70);
    let mut v = vec![
        case(AttentionArgs::new(2, s, s, 4, 2, d)),
        case(AttentionArgs::new(2, s, s, 4, 2, d).with_causal(true)),
        // Peaked softmax: a few keys carry each row, so a mask error is a large one.
        case(
            AttentionArgs::new(1, s, s, 2, 1, d)
                .with_causal(true)
                .with_scale(1.0),
        ),
        // One query; more queries than keys (rows that see no key); more keys than queries.
        case(AttentionArgs::new(3, 1, s, 2, 2, d).with_causal(true)),
        case(AttentionArgs::new(1, s, 37, 4, 1, d).with_causal(true)),
        case(
            AttentionArgs::new(1, 37, s + 9, 2, 2, d)
                .with_causal(true)
                .with_scale(1.0),
        ),
        // Sliding windows (Mistral) and a two-sided window; soft-capping (Gemma 2).
        case(
            AttentionArgs::new(1, s, s, 2, 2, d)
                .with_window(Some(24), Some(0))
                .with_scale(1.0),
        ),
        case(AttentionArgs::new(1, s, s - 5, 2, 1, d).with_window(Some(17), Some(40))),
        case(
            AttentionArgs::new(2, s, s, 2, 1, d)
                .with_causal(true)
                .with_softcap(5.0)
                .with_scale(1.0),
        ),
    ];
    // A packed batch with an empty sequence and one of a single token.
    let lq = vec![s / 2, 0, 1, s];
    let lk = vec![s / 2 + 3, 5, 1, s];
    let (tq, tk) = (lq.iter().sum(), lk.iter().sum());
    v.push(Case {
        args: AttentionArgs::varlen(4, tq, tk, s, s, 4, 2, d).with_causal(true),
        lens: Some((lq.clone(), lk.clone())),
        fused: false,
    });
    v.push(Case {
        args: AttentionArgs::varlen(4, tq, tk, s, s, 2, 2, d),
        lens: Some((lq, lk)),
        fused: false,
    });
    // q, k, v as views of one fused QKV projection.
    let (hq, hkv) = (4, 2);
    let row = (hq + 2 * hkv) * d;
    let strides = |h: usize| Strides {
        batch: s * row,
        token: row,
        head: h,
    };
    let args = AttentionArgs::new(2, s, s, hq, hkv, d)
        .with_causal(true)
        .with_strides(strides(d), strides(d), strides(d));
    v.push(Case {
        args,
        lens: None,
        fused: true,
    });
    v
}

fn sweep<T: Dtype>(test: &str, dims: &[usize]) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for &d in dims {
        for (i, c) in cases(d).into_iter().enumerate() {
            let seed = 1000 * d as u64 + i as u64;
            failures.run(|| check_case::<T>(&stream, &c, seed));
        }
    }
    for (k, r) in WORST.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        if k.starts_with(T::NAME) {
            // Straight to stderr: libtest captures the output of passing tests.
            let line = format!("{test}: {k} at most {:.0} % of its bound", 100.0 * r);
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    }
    failures.finish();
}

#[test]
fn bf16_matches_the_reference_on_tensor_cores_and_cuda_cores() {
    sweep::<bf16>(
        "bf16_matches_the_reference_on_tensor_cores_and_cuda_cores",
        &[64, 128, 40, 256],
    );
}

#[test]
fn f16_matches_the_reference_on_tensor_cores_and_cuda_cores() {
    sweep::<f16>(
        "f16_matches_the_reference_on_tensor_cores_and_cuda_cores",
        &[64, 128, 3],
    );
}

#[test]
fn f32_matches_the_reference() {
    sweep::<f32>("f32_matches_the_reference", &[64, 128, 2, 80]);
}

#[test]
fn the_backward_is_bitwise_deterministic() {
    let test = "the_backward_is_bitwise_deterministic";
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for d in [128, 64, 48] {
        failures.run(|| {
            let s = sized(700, 150);
            let c = case(AttentionArgs::new(2, s, s, 8, 2, d).with_causal(true));
            let x = inputs::<bf16>(&stream, &c, &mut Rng::new(7));
            let (a, b) = (run(&stream, &c, &x), run(&stream, &c, &x));
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.o), bits(&b.o), "o, d {d}");
            assert_eq!(bits(&a.dq), bits(&b.dq), "dq, d {d}");
            assert_eq!(bits(&a.dk), bits(&b.dk), "dk, d {d}");
            assert_eq!(bits(&a.dv), bits(&b.dv), "dv, d {d}");
        });
    }
    failures.finish();
}

#[test]
fn per_thread_streams_of_several_threads_compute_their_own_calls() {
    let test = "per_thread_streams_of_several_threads_compute_their_own_calls";
    let Some(stream) = gpu(test) else { return };
    let ctx = stream.context().clone();
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                let stream = ctx.per_thread_stream();
                for i in 0..3 {
                    let c = case(AttentionArgs::new(1, 96, 96, 4, 2, 128).with_causal(t % 2 == 0));
                    check_case::<bf16>(&stream, &c, 100 * t + i);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a thread's calls match the reference");
    }
}

#[test]
fn a_rejected_call_writes_nothing() {
    let test = "a_rejected_call_writes_nothing";
    let Some(stream) = gpu(test) else { return };
    let args = AttentionArgs::new(2, 70, 70, 4, 2, 64).with_causal(true);
    let mut rng = Rng::new(5);
    let q = upload(&stream, &rng.vec::<bf16>(2 * 70 * 4 * 64, 0.0, 1.0));
    let kv = upload(&stream, &rng.vec::<bf16>(2 * 70 * 2 * 64, 0.0, 1.0));
    let bits = |v: Vec<bf16>| v.into_iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut o = poisoned::<bf16>(&stream, args.out_len());
    let mut short_lse = poisoned::<f32>(&stream, args.lse_len() - 1);
    let before = bits(download(&stream, &o));
    let r = liger_rs::attention_forward(&stream, &args, &q, &kv, &kv, &mut o, &mut short_lse);
    common::expect_invalid(r, "lse", "length ≥");
    assert_eq!(
        bits(download(&stream, &o)),
        before,
        "o after a rejected call"
    );
    // k and o as disjoint halves of one buffer: accepted (overlaps are rejected before any
    // launch; `src/attention/args.rs` tests which layouts overlap).
    let mut lse = poisoned::<f32>(&stream, args.lse_len());
    let mut fused = poisoned::<bf16>(&stream, args.out_len() + kv.len());
    let (head, mut tail) = fused.split_at_mut(kv.len());
    let r = liger_rs::attention_forward(&stream, &args, &q, &head, &kv, &mut tail, &mut lse);
    assert!(r.is_ok(), "disjoint halves of one buffer: {r:?}");
}

#[test]
fn more_than_2_pow_32_elements_take_64_bit_offsets() {
    let test = "more_than_2_pow_32_elements_take_64_bit_offsets";
    let Some(stream) = common::gpu_for_huge(test) else {
        return;
    };
    // 65535 sequences (the grid's z limit) of 65 tokens, 8 query heads of 128: q, o, dO and dq
    // hold 4.3·10⁹ elements each, past 2³² (8.6 GB in bf16).
    let (b, s, hq, hkv, d) = (65535, 65, 8, 1, 128);
    let args = AttentionArgs::new(b, s, s, hq, hkv, d).with_causal(true);
    let (per_q, per_k) = (s * hq * d, s * hkv * d);
    let (nq, nk) = (b * per_q, b * per_k);
    assert!(nq > 1 << 32);
    let zeros = |n: usize| stream.alloc_zeros::<bf16>(n).expect("allocate");
    let (mut q, mut k, mut v, mut d_o) = (zeros(nq), zeros(nk), zeros(nk), zeros(nq));
    // Random data in the first sequence, those whose q elements cross 2³¹ and 2³², and the
    // last; every other sequence is zeros, whose outputs are known exactly.
    let seqs = [0, (1usize << 31) / per_q, (1usize << 32) / per_q, b - 1];
    let mut rng = Rng::new(11);
    let mut host = Vec::new();
    for &i in &seqs {
        let x = [
            rng.vec::<bf16>(per_q, 0.0, 1.0),
            rng.vec::<bf16>(per_k, 0.0, 1.0),
            rng.vec::<bf16>(per_k, 0.0, 1.0),
            rng.vec::<bf16>(per_q, 0.0, 1.0),
        ];
        let put = |buf: &mut CudaSlice<bf16>, at: usize, data: &[bf16]| {
            let mut view = buf.slice_mut(at..at + data.len());
            stream.memcpy_htod(data, &mut view).expect("upload");
        };
        put(&mut q, i * per_q, &x[0]);
        put(&mut k, i * per_k, &x[1]);
        put(&mut v, i * per_k, &x[2]);
        put(&mut d_o, i * per_q, &x[3]);
        host.push((i, x));
    }
    let mut o = common::poisoned_on_device::<bf16>(&stream, nq);
    let mut lse = common::poisoned_on_device::<f32>(&stream, args.lse_len());
    let (mut dq, mut dk, mut dv) = (
        common::poisoned_on_device::<bf16>(&stream, nq),
        common::poisoned_on_device::<bf16>(&stream, nk),
        common::poisoned_on_device::<bf16>(&stream, nk),
    );
    liger_rs::attention_forward(&stream, &args, &q, &k, &v, &mut o, &mut lse).expect("forward");
    liger_rs::attention_backward(
        &stream, &args, &q, &k, &v, &o, &d_o, &lse, &mut dq, &mut dk, &mut dv,
    )
    .expect("backward");
    let get = |buf: &CudaSlice<bf16>, at: usize, n: usize| {
        stream.clone_dtoh(&buf.slice(at..at + n)).expect("download")
    };
    let one = AttentionArgs::new(1, s, s, hq, hkv, d).with_causal(true);
    for (i, [qh, kh, vh, dh]) in &host {
        let i = *i;
        let desc = format!("sequence {i} of {b}");
        let want = reference::attention_forward(&one, qh, kh, vh, None).expect("reference");
        let g = reference::attention_backward(&one, qh, kh, vh, dh, None).expect("reference");
        check("o", &desc, &get(&o, i * per_q, per_q), &want.o, s);
        check("dq", &desc, &get(&dq, i * per_q, per_q), &g.dq, s);
        check("dk", &desc, &get(&dk, i * per_k, per_k), &g.dk, s);
        check("dv", &desc, &get(&dv, i * per_k, per_k), &g.dv, s);
        let l = stream
            .clone_dtoh(&lse.slice(i * hq * s..(i + 1) * hq * s))
            .expect("download");
        for (got, want) in l.iter().zip(&want.lse) {
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "lse {got} vs {want}, {desc}"
            );
        }
    }
    // A zero sequence next to the last sampled one: written, and exactly zero.
    let z = b - 2;
    for (what, got) in [
        ("o", get(&o, z * per_q, per_q)),
        ("dq", get(&dq, z * per_q, per_q)),
        ("dv", get(&dv, z * per_k, per_k)),
    ] {
        assert!(
            got.iter().all(|x| x.to_f32() == 0.0),
            "{what} of zero sequence {z}"
        );
    }
}
