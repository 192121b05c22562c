//! RoPE: CPU reference against hand-computed rotations, finite differences, its own inverse,
//! HF's multimodal table selection and fused QKV buffers (always run); GPU kernels against the
//! reference on many shapes, dtypes and cos/sin forms, fused QKV views, multimodal tables,
//! 64-bit offsets, clamped device ids; bad input.
//!
//! With the small shapes (`LIGER_RS_TEST_SHAPES=small`, sized for compute-sanitizer) the
//! sweep's largest scalar shape runs fewer tokens and the test over 2³² elements skips.
mod common;

use common::{
    Failures, Rng, assert_close, download, download_rows, expect_invalid, gpu, gpu_for_huge,
    sampled_rows, sized, upload, upload_rows,
};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use liger_rs::reference::Element;
use liger_rs::reference::rope::{
    CosSinRows, rope_backward as ref_backward, rope_backward_fused as ref_backward_fused,
    rope_forward as ref_forward, rope_forward_fused as ref_forward_fused,
};
use liger_rs::{
    CosSinLayout, Dtype, Error, PositionIds, RopeArgs, rope_backward, rope_backward_fused,
    rope_backward_into, rope_forward, rope_forward_fused, rope_forward_into,
};
use std::sync::Arc;

// ---------------------------------------------------------------- shared helpers

/// `n` values uniform in (−2, 2) rounded to `T` (cheaper than normals for the big cases).
fn uniform<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f64(4.0 * rng.uniform() - 2.0))
        .collect()
}

/// HF-style cos/sin rows (`rotary_dim` long) for the given positions: `θ_i = p · 10000^(−2i/r)`,
/// the row is `cat(f(θ), f(θ))`. With `poison`, the second half of every row is NaN instead:
/// the kernels must read only the first half.
fn cos_sin<T: Element>(positions: &[i64], r: usize, poison: bool) -> (Vec<T>, Vec<T>) {
    let h = r / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &p in positions {
        let theta = |i: usize| p as f64 * 10000f64.powf(-2.0 * i as f64 / r as f64);
        for half in 0..2 {
            for i in 0..h {
                if half == 1 && poison {
                    cos.push(T::from_f64(f64::NAN));
                    sin.push(T::from_f64(f64::NAN));
                } else {
                    cos.push(T::from_f64(theta(i).cos()));
                    sin.push(T::from_f64(theta(i).sin()));
                }
            }
        }
    }
    (cos, sin)
}

/// Packed sequences: each batch row is cut into segments of random length whose positions
/// restart (at 0, or at a small offset as for a continued sequence).
fn packed_ids(rng: &mut Rng, batch: usize, seq: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut s = 0;
        while s < seq {
            let len = 1 + (rng.next_u64() as usize) % seq.clamp(1, 64);
            let start = if rng.next_u64().is_multiple_of(4) {
                rng.next_u64() % 5
            } else {
                0
            };
            for p in 0..len.min(seq - s) {
                ids.push((start as usize + p) as i64);
            }
            s += len;
        }
    }
    ids
}

fn bits<T: Element>(v: T) -> u64 {
    v.to_f64().to_bits()
}

// ---------------------------------------------------------------- CPU reference

#[test]
fn reference_matches_hand_computed_rotations() {
    // d = 4, a 90° rotation (c = 0, s = 1): (x1, x2, x3, x4) → (−x3, −x4, x1, x2).
    let args = RopeArgs::new(4);
    let (mut q, mut k) = (vec![1.0f64, 2.0, 3.0, 4.0], vec![5.0f64, 6.0, 7.0, 8.0]);
    let (cos, sin) = ([0.0; 4], [1.0; 4]);
    ref_forward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!(q, [-3.0, -4.0, 1.0, 2.0]);
    assert_eq!(k, [-7.0, -8.0, 5.0, 6.0]);
    // The backward rotates back by −90°.
    ref_backward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!((q, k), (vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0, 7.0, 8.0]));

    // 60° on one pair: (1, 0) → (cos 60°, sin 60°); (0, 1) → (−sin 60°, cos 60°).
    let (c, s) = (0.5f64, 3f64.sqrt() / 2.0);
    let args = RopeArgs::new(2).with_heads(2, 1);
    let (mut q, mut k) = (vec![1.0f64, 0.0, 0.0, 1.0], vec![2.0f64, 0.0]);
    ref_forward(
        &args,
        &mut q,
        &mut k,
        &[c, c],
        &[s, s],
        CosSinRows::PerPosition,
    )
    .unwrap();
    assert_eq!(q, [c, s, -s, c]);
    assert_eq!(k, [2.0 * c, 2.0 * s]);

    // Partial rotary r = 2 of d = 4, cos/sin rows of length r: dims 2, 3 stay.
    let args = RopeArgs::new(4).with_rotary_dim(2);
    let (mut q, mut k) = (vec![1.0f64, 2.0, 3.0, 4.0], vec![5.0f64, 6.0, 7.0, 8.0]);
    ref_forward(
        &args,
        &mut q,
        &mut k,
        &[0.0; 2],
        &[1.0; 2],
        CosSinRows::PerPosition,
    )
    .unwrap();
    assert_eq!(
        (q, k),
        (vec![-2.0, 1.0, 3.0, 4.0], vec![-6.0, 5.0, 7.0, 8.0])
    );
}

#[test]
fn reference_selects_rows_by_form() {
    // B = 2, S = 2, one head of d = 2, x = (1, 0) everywhere: the output is the row's (c, s).
    let args = RopeArgs::new(2).with_batch(2).with_seq_len(2);
    let rows = |n: usize| -> (Vec<f64>, Vec<f64>) {
        let c = (0..n).flat_map(|i| [i as f64, 99.0]).collect();
        let s = (0..n).flat_map(|i| [10.0 + i as f64, 99.0]).collect();
        (c, s)
    };
    let run = |cos: &[f64], sin: &[f64], form: CosSinRows<'_>| {
        let (mut q, mut k) = ([1.0, 0.0].repeat(4), [1.0, 0.0].repeat(4));
        ref_forward(&args, &mut q, &mut k, cos, sin, form).unwrap();
        assert_eq!(q, k);
        q.chunks(2).map(|p| p[0] as usize).collect::<Vec<_>>()
    };
    let (c, s) = rows(2);
    assert_eq!(run(&c, &s, CosSinRows::PerPosition), [0, 1, 0, 1]);
    let (c, s) = rows(4);
    assert_eq!(run(&c, &s, CosSinRows::PerBatch), [0, 1, 2, 3]);
    let (c, s) = rows(6);
    let ids = [5, 0, 3, 3];
    assert_eq!(run(&c, &s, CosSinRows::Gathered(&ids)), [5, 0, 3, 3]);
}

#[test]
fn reference_rounds_products_and_sums_to_f32() {
    // x1·c = (1 + 2⁻²³)² = 1 + 2⁻²² + 2⁻⁴⁶ rounds to 1 + 2⁻²² in f32; minus x2·s = 1 leaves
    // 2⁻²² in f32, while the exact difference keeps the 2⁻⁴⁶.
    let e = 2f64.powi(-23);
    let args = RopeArgs::new(2);
    let (cos, sin) = ([(1.0 + e) as f32; 2], [1.0f32; 2]);
    let (mut q, mut k) = (vec![(1.0 + e) as f32, 1.0], vec![0.0f32, 0.0]);
    ref_forward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!(q[0] as f64, 2f64.powi(-22));
    let (cos, sin) = ([1.0 + e; 2], [1.0f64; 2]);
    let (mut q, mut k) = (vec![1.0 + e, 1.0], vec![0.0f64, 0.0]);
    ref_forward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!(q[0], 2f64.powi(-22) + 2f64.powi(-46));
    // bf16: the f32 result is rounded once to bf16 (RNE).
    let (cos, sin) = ([bf16::from_f32(0.5); 2], [bf16::from_f32(0.25); 2]);
    let (mut q, mut k) = (
        vec![bf16::from_f32(3.0), bf16::from_f32(1.0)],
        vec![bf16::ZERO; 2],
    );
    ref_forward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!(q, [bf16::from_f32(1.25), bf16::from_f32(1.25)]);
}

/// Small shapes × forms for the f64 checks: (B, S, Hq, Hk, d, r).
const SMALL: [(usize, usize, usize, usize, usize, usize); 3] =
    [(2, 3, 3, 1, 6, 4), (1, 4, 1, 2, 4, 4), (2, 2, 2, 2, 8, 2)];

/// The cos/sin table (f64) and position ids for form index `f` (0 per position, 1 per batch,
/// 2 gathered): [`form_positions`]' rows.
fn f64_tables(
    rng: &mut Rng,
    b: usize,
    s: usize,
    r: usize,
    f: usize,
) -> (Vec<f64>, Vec<f64>, Vec<i64>) {
    let rows = [Form::PerPosition, Form::PerBatch, Form::Ids64][f.min(2)];
    let (positions, ids) = form_positions(rows, b, s, rng);
    let (c, sn) = cos_sin(&positions, r, false);
    (c, sn, ids)
}

fn form(f: usize, ids: &[i64]) -> CosSinRows<'_> {
    match f {
        0 => CosSinRows::PerPosition,
        1 => CosSinRows::PerBatch,
        _ => CosSinRows::Gathered(ids),
    }
}

#[test]
fn reference_backward_matches_finite_differences() {
    // L = Σ gq·q' + Σ gk·k' with (q', k') = forward(q, k); dL/dq = backward(gq), likewise k.
    // The forward is linear in q and k, so central differences are exact up to rounding.
    let h = 1e-4;
    for (n, &(b, s, hq, hk, d, r)) in SMALL.iter().enumerate() {
        for f in 0..3 {
            let seed = 100 + 3 * n as u64 + f as u64;
            let mut rng = Rng::new(seed);
            let args = RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk)
                .with_rotary_dim(r);
            let (cos, sin, ids) = f64_tables(&mut rng, b, s, r, f);
            let q: Vec<f64> = rng.vec(b * s * hq * d, 0.0, 1.0);
            let k: Vec<f64> = rng.vec(b * s * hk * d, 0.0, 1.0);
            let gq: Vec<f64> = rng.vec(q.len(), 0.0, 1.0);
            let gk: Vec<f64> = rng.vec(k.len(), 0.0, 1.0);
            let loss = |q: &[f64], k: &[f64]| {
                let (mut q, mut k) = (q.to_vec(), k.to_vec());
                ref_forward(&args, &mut q, &mut k, &cos, &sin, form(f, &ids)).unwrap();
                let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
                dot(&q, &gq) + dot(&k, &gk)
            };
            let (mut dq, mut dk) = (gq.clone(), gk.clone());
            ref_backward(&args, &mut dq, &mut dk, &cos, &sin, form(f, &ids)).unwrap();
            let case = format!("{:?} form {f} seed {seed}", (b, s, hq, hk, d, r));
            for (which, grad) in [(0, &dq), (1, &dk)] {
                for i in 0..grad.len() {
                    let (mut qp, mut kp) = (q.clone(), k.clone());
                    let (mut qm, mut km) = (q.clone(), k.clone());
                    if which == 0 {
                        qp[i] += h;
                        qm[i] -= h;
                    } else {
                        kp[i] += h;
                        km[i] -= h;
                    }
                    let fd = (loss(&qp, &kp) - loss(&qm, &km)) / (2.0 * h);
                    assert!(
                        (fd - grad[i]).abs() < 1e-8 * (1.0 + fd.abs()),
                        "{} [{i}] {} vs fd {fd}, {case}",
                        ["dq", "dk"][which],
                        grad[i]
                    );
                }
            }
        }
    }
}

#[test]
fn reference_backward_inverts_forward_in_f64() {
    // cos² + sin² = 1 up to f64 rounding, so rotating by −θ after θ is the identity.
    for (n, &(b, s, hq, hk, d, r)) in SMALL.iter().enumerate() {
        for f in 0..3 {
            let mut rng = Rng::new(200 + 3 * n as u64 + f as u64);
            let args = RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk)
                .with_rotary_dim(r);
            let (cos, sin, ids) = f64_tables(&mut rng, b, s, r, f);
            let q: Vec<f64> = rng.vec(b * s * hq * d, 0.0, 1.0);
            let k: Vec<f64> = rng.vec(b * s * hk * d, 0.0, 1.0);
            let (mut q2, mut k2) = (q.clone(), k.clone());
            ref_forward(&args, &mut q2, &mut k2, &cos, &sin, form(f, &ids)).unwrap();
            assert_ne!(q2, q, "the forward rotates");
            ref_backward(&args, &mut q2, &mut k2, &cos, &sin, form(f, &ids)).unwrap();
            for (got, want) in q2.iter().chain(&k2).zip(q.iter().chain(&k)) {
                assert!(
                    (got - want).abs() < 1e-12,
                    "{got} vs {want}, shape {n} form {f}"
                );
            }
        }
    }
}

#[test]
fn reference_partial_rotary_leaves_the_tail_bit_identical() {
    let (b, s, hq, hk, d, r) = (2, 5, 3, 2, 12, 4);
    let mut rng = Rng::new(300);
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk)
        .with_rotary_dim(r);
    let p: Vec<i64> = (0..s as i64).collect();
    let (cos, sin) = cos_sin::<bf16>(&p, r, false);
    let q: Vec<bf16> = uniform(&mut rng, b * s * hq * d);
    let k: Vec<bf16> = uniform(&mut rng, b * s * hk * d);
    for backward in [false, true] {
        let (mut q2, mut k2) = (q.clone(), k.clone());
        let f = if backward { ref_backward } else { ref_forward };
        f(&args, &mut q2, &mut k2, &cos, &sin, CosSinRows::PerPosition).unwrap();
        for (got, input) in [(&q2, &q), (&k2, &k)] {
            for (g, x) in got.chunks(d).zip(input.chunks(d)) {
                assert_eq!(g[r..], x[r..], "tail changed");
            }
            assert_ne!(got, input);
        }
    }
}

#[test]
fn reference_rejects_bad_input() {
    let a = RopeArgs::new(4)
        .with_batch(2)
        .with_seq_len(3)
        .with_heads(2, 1);
    let (q, k) = (vec![0.0f64; 48], vec![0.0f64; 24]);
    let table = vec![0.0f64; 12];
    let run = |a: RopeArgs, ql: usize, kl: usize, cos: &[f64], sin: &[f64], rows| {
        let (mut q, mut k) = (q[..ql.min(48)].to_vec(), k[..kl.min(24)].to_vec());
        ref_forward(&a, &mut q, &mut k, cos, sin, rows)
    };
    let pp = CosSinRows::PerPosition;
    assert!(run(a, 48, 24, &table, &table, pp).is_ok());
    let bad_d = RopeArgs::new(3)
        .with_batch(2)
        .with_seq_len(3)
        .with_heads(2, 1);
    expect_invalid(
        run(bad_d, 48, 24, &table, &table, pp),
        "args.head_dim",
        "even",
    );
    let bad_r = a.with_rotary_dim(6);
    expect_invalid(
        run(bad_r, 48, 24, &table, &table, pp),
        "args.rotary_dim",
        "2 ..= head_dim = 4",
    );
    expect_invalid(run(a, 47, 24, &table, &table, pp), "q", "length 48");
    expect_invalid(run(a, 48, 20, &table, &table, pp), "k", "length 24");
    expect_invalid(run(a, 48, 24, &table[..8], &table, pp), "cos", "length 12");
    expect_invalid(run(a, 48, 24, &table, &table[..8], pp), "sin", "length 12");
    expect_invalid(
        run(a, 48, 24, &table, &table, CosSinRows::PerBatch),
        "cos",
        "length 24",
    );
    let ids = [0i64, 1, 2, 3, 4, 5];
    expect_invalid(
        run(a, 48, 24, &table, &table, CosSinRows::Gathered(&ids[..5])),
        "position_ids",
        "length 6",
    );
    expect_invalid(
        run(a, 48, 24, &table, &table, CosSinRows::Gathered(&ids)),
        "position_ids",
        "position_ids[3] = 3",
    );
    let neg = [0i64, 1, -1, 0, 0, 0];
    expect_invalid(
        run(a, 48, 24, &table, &table, CosSinRows::Gathered(&neg)),
        "position_ids",
        "position_ids[2] = -1",
    );
    let (mut dq, mut dk) = (vec![0.0f64; 47], vec![0.0f64; 24]);
    expect_invalid(
        ref_backward(&a, &mut dq, &mut dk, &table, &table, pp),
        "dq",
        "length 48",
    );
}

// ---------------------------------------------------------------- GPU vs reference

/// (B, S, Hq, Hk, d, rotary_dim): the 1×1 minimum; HF-style GQA and MQA (Hk = 1), Hq < Hk;
/// head dims 2, 6, 8, 16, 64, 80, 92, 96, 128, 256, 1024; odd head counts (73, 213, 5, 3, 7);
/// partial rotary (r < d); S ≥ 8192; per-token pair counts below, at and above the
/// 256-thread block of the scalar kernels (2 → 128 tokens per block, 222, 301 → 2 uneven
/// passes, 2560 → 10).
///
/// Both kernel families (buffers from `upload` are 16-byte aligned): the 16-byte vector
/// kernels take every shape whose `head_dim` and `rotary_dim / 2` are multiples of the lanes
/// (8 for f16/bf16, 4 for f32): d = 64, 80 (5 vectors per half in bf16), 96, 128, 256, 1024,
/// partial rotary 64 of 128 and 32 of 80, and for f32 only d = 8 (1 vector per half) and
/// r = 40 of 128 (5 vectors); 320 heads need several head steps per thread. The scalar
/// kernels take the rest: d = 2, 4, 6, 16 with r = 2, 92 (odd multiples of 2), and in
/// f16/bf16 d = 8 and r = 40 of 128 (20 not a multiple of 8).
const SHAPES: [(usize, usize, usize, usize, usize, usize); 23] = [
    (1, 1, 1, 1, 2, 2),
    (3, 423, 73, 213, 92, 92),
    (2, 7, 4, 1, 64, 64),
    (1, 33, 2, 8, 80, 80),
    (4, 17, 8, 2, 96, 96),
    (2, 9, 3, 3, 92, 92),
    (1, 64, 32, 8, 128, 128),
    (1, 8, 4, 4, 256, 256),
    (2, 5, 5, 1, 128, 64),
    (3, 11, 6, 2, 80, 32),
    (1, 8192, 1, 1, 64, 64),
    (1, 8200, 2, 1, 128, 64),
    (5, 3, 1, 7, 16, 2),
    (7, 13, 73, 1, 6, 6),
    (2, 3, 1, 1, 2, 2),
    (3, 100, 2, 2, 4, 4),
    (1, 3, 40, 8, 128, 128),
    (2, 4, 300, 1, 2, 2),
    (1, 2, 1, 1, 1024, 1024),
    (2, 6, 3, 2, 128, 40),
    (2, 3, 300, 20, 128, 128),
    (3, 5, 3, 1, 8, 8),
    (4, 4096, 8, 2, 128, 128),
];

/// Shapes whose CPU reference is expensive (> 10⁷ elements) run for one dtype only.
const BIG_SHAPE_DTYPE: [(usize, &str); 1] = [(1, "bf16")];

/// The sweep's shape `i`: `SHAPES[i]`, but with the small shapes the 73 + 213-head scalar
/// shape (3.3 × 10⁷ elements) runs 3 × 7 tokens instead of 3 × 423: its kernels run one block
/// per token, so the token count only sizes their grid.
fn sweep_shape(i: usize) -> (usize, usize, usize, usize, usize, usize) {
    let (b, s, hq, hk, d, r) = SHAPES[i];
    let s = if i == 1 { sized(s, 7) } else { s };
    (b, s, hq, hk, d, r)
}

/// The cos/sin forms of the GPU sweep.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// `[S, r]`, positions 0..S.
    PerPosition,
    /// `[B, S, r]`, each batch row at its own offset.
    PerBatch,
    /// `[S + 5, r]` table, packed-sequence ids as i32 on the device.
    Ids32,
    /// As `Ids32` with i64 ids on the device.
    Ids64,
    /// As `Ids64` with the ids given as host data (checked, then uploaded).
    Host,
}

const FORMS: [Form; 5] = [
    Form::PerPosition,
    Form::PerBatch,
    Form::Ids32,
    Form::Ids64,
    Form::Host,
];

/// Rounding differences (ulps of `T`) allowed between GPU and reference. The reference
/// rounds exactly where the kernel does (each product to f32, the sum to f32, one rounding
/// to `T`; see `liger_rs::reference::rope`), and these roundings are deterministic, so the
/// GPU is expected to match bit for bit; one ulp of `T` is a margin (an indexing or cast
/// bug is off by far more: the values are O(1)). The f32 budget is not larger because no
/// f32 rounding differs between the two (no reduction order, no FMA).
const ULPS: f64 = 1.0;

/// `got` against the reference `want`: dims `r..d` of every head bit-identical to `input`
/// (partial rotary must not touch them), every element within [`ULPS`] of the reference.
/// Elements with identical bits pass `assert_close` trivially, so only the others are given
/// to it (this keeps the big cases fast).
fn check<T: Element>(
    what: &str,
    case: &str,
    got: &[T],
    want: &[T],
    input: &[T],
    d: usize,
    r: usize,
) {
    assert_eq!(got.len(), want.len(), "{what} length, {case}");
    if r < d {
        for (h, (g, x)) in got.chunks(d).zip(input.chunks(d)).enumerate() {
            for j in r..d {
                assert!(
                    bits(g[j]) == bits(x[j]),
                    "{what}: head {h} dim {j} beyond rotary_dim changed: {:?} → {:?}, {case}",
                    x[j],
                    g[j]
                );
            }
        }
    }
    let differ: Vec<usize> = (0..got.len())
        .filter(|&i| bits(got[i]) != bits(want[i]))
        .collect();
    if !differ.is_empty() {
        let pick = |v: &[T]| differ.iter().map(|&i| v[i].to_f64()).collect::<Vec<_>>();
        let case = format!(
            "{case}; {} of {} elements differ in bits (first at {})",
            differ.len(),
            got.len(),
            differ[0]
        );
        assert_close::<T>(what, &case, &pick(got), &pick(want), ULPS, &[]);
    }
}

/// One GPU case: forward on (q, k) and backward on fresh (dq, dk), both against the reference.
fn run_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    shape: (usize, usize, usize, usize, usize, usize),
    form: Form,
    poison: bool,
    seed: u64,
) {
    let (b, s, hq, hk, d, r) = shape;
    let desc = format!(
        "B={b} S={s} Hq={hq} Hk={hk} d={d} r={r} {} {form:?} poisoned-second-half={poison} seed={seed}",
        T::NAME
    );
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk)
        .with_rotary_dim(r);
    let mut rng = Rng::new(seed);
    let q: Vec<T> = uniform(&mut rng, b * s * hq * d);
    let k: Vec<T> = uniform(&mut rng, b * s * hk * d);
    let dq: Vec<T> = uniform(&mut rng, q.len());
    let dk: Vec<T> = uniform(&mut rng, k.len());
    let t = Tables::<T>::new(stream, &args, form, poison, &mut rng);
    let (cos, sin) = (&t.cos, &t.sin);
    let (rows, layout) = (t.ref_rows(), t.layout());

    let (mut q_d, mut k_d) = (upload(stream, &q), upload(stream, &k));
    rope_forward(
        stream, &args, &mut q_d, &mut k_d, &t.cos_d, &t.sin_d, &layout,
    )
    .expect(&desc);
    let (mut q_want, mut k_want) = (q.clone(), k.clone());
    ref_forward(&args, &mut q_want, &mut k_want, cos, sin, rows).expect(&desc);
    check("q", &desc, &download(stream, &q_d), &q_want, &q, d, r);
    check("k", &desc, &download(stream, &k_d), &k_want, &k, d, r);

    let (mut dq_d, mut dk_d) = (upload(stream, &dq), upload(stream, &dk));
    rope_backward(
        stream, &args, &mut dq_d, &mut dk_d, &t.cos_d, &t.sin_d, &layout,
    )
    .expect(&desc);
    let (mut dq_want, mut dk_want) = (dq.clone(), dk.clone());
    ref_backward(&args, &mut dq_want, &mut dk_want, cos, sin, rows).expect(&desc);
    check("dq", &desc, &download(stream, &dq_d), &dq_want, &dq, d, r);
    check("dk", &desc, &download(stream, &dk_d), &dk_want, &dk, d, r);
}

fn upload_ids<I: liger_rs::cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    ids: &[I],
) -> CudaSlice<I> {
    stream.clone_htod(ids).expect("upload ids")
}

/// The positions of the cos/sin rows of `rows` for `b × s` tokens, and the position ids of
/// the gathered forms (empty otherwise): per position 0..S; per batch token `t` at `3t + 1`
/// (every batch row its own rows); gathered a table of positions 0..S + 5 and packed-sequence
/// ids drawn from `rng`.
fn form_positions(rows: Form, b: usize, s: usize, rng: &mut Rng) -> (Vec<i64>, Vec<i64>) {
    match rows {
        Form::PerPosition => ((0..s as i64).collect(), vec![]),
        Form::PerBatch => ((0..(b * s) as i64).map(|t| 3 * t + 1).collect(), vec![]),
        _ => ((0..s as i64 + 5).collect(), packed_ids(rng, b, s)),
    }
}

/// The cos/sin table of a GPU case whose rows come from `rows`: on the host (for the
/// reference) and on the device, with the position ids in the form `rows` hands them over.
struct Tables<T> {
    rows: Form,
    cos: Vec<T>,
    sin: Vec<T>,
    ids: Vec<i64>,
    cos_d: CudaSlice<T>,
    sin_d: CudaSlice<T>,
    ids32_d: Option<CudaSlice<i32>>,
    ids64_d: Option<CudaSlice<i64>>,
}

impl<T: Dtype> Tables<T> {
    /// [`form_positions`]' HF-style rows for `args`' batch and sequence ([`cos_sin`]: second
    /// halves NaN with `poison`), laid out as `args`' form reads them ([`table_in_form`]).
    fn new(
        stream: &Arc<CudaStream>,
        args: &RopeArgs,
        rows: Form,
        poison: bool,
        rng: &mut Rng,
    ) -> Self {
        let (positions, ids) = form_positions(rows, args.batch, args.seq_len, rng);
        let (cos, sin) = cos_sin::<T>(&positions, args.rotary_dim, poison);
        let (cos, sin) = (table_in_form(args, &cos), table_in_form(args, &sin));
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let ids32_d =
            (matches!(rows, Form::Ids32) && !ids.is_empty()).then(|| upload_ids(stream, &ids32));
        let ids64_d =
            (matches!(rows, Form::Ids64) && !ids.is_empty()).then(|| upload_ids(stream, &ids));
        Tables {
            rows,
            cos_d: upload(stream, &cos),
            sin_d: upload(stream, &sin),
            cos,
            sin,
            ids,
            ids32_d,
            ids64_d,
        }
    }

    /// The reference's row source.
    fn ref_rows(&self) -> CosSinRows<'_> {
        match self.rows {
            Form::PerPosition => CosSinRows::PerPosition,
            Form::PerBatch => CosSinRows::PerBatch,
            _ => CosSinRows::Gathered(&self.ids),
        }
    }

    /// The launchers' layout.
    fn layout(&self) -> CosSinLayout<'_> {
        match self.rows {
            Form::PerPosition => CosSinLayout::PerPosition,
            Form::PerBatch => CosSinLayout::PerBatch,
            Form::Ids32 => CosSinLayout::Gathered(PositionIds::DeviceI32(
                self.ids32_d.as_ref().expect("device ids").as_view(),
            )),
            Form::Ids64 => CosSinLayout::Gathered(PositionIds::DeviceI64(
                self.ids64_d.as_ref().expect("device ids").as_view(),
            )),
            Form::Host => CosSinLayout::Gathered(PositionIds::Host(&self.ids)),
        }
    }
}

/// Runs every shape with a form that rotates with the shape and the dtype (so each dtype
/// sees every form on several shapes); every other case poisons the second half of the
/// cos/sin rows. All failures are collected and reported together.
fn sweep<T: Dtype>(test: &str, dtype_index: usize, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for i in 0..SHAPES.len() {
        if BIG_SHAPE_DTYPE
            .iter()
            .any(|&(j, dtype)| j == i && dtype != T::NAME)
        {
            continue;
        }
        let form = FORMS[(i + dtype_index) % FORMS.len()];
        let poison = (i + dtype_index).is_multiple_of(2);
        let seed = seed_base + i as u64;
        failures.run(|| run_case::<T>(&stream, sweep_shape(i), form, poison, seed));
    }
    failures.finish();
}

#[test]
fn gpu_matches_reference_f32() {
    sweep::<f32>("gpu_matches_reference_f32", 0, 10_000);
}

#[test]
fn gpu_matches_reference_f16() {
    sweep::<f16>("gpu_matches_reference_f16", 1, 20_000);
}

#[test]
fn gpu_matches_reference_bf16() {
    sweep::<bf16>("gpu_matches_reference_bf16", 2, 30_000);
}

#[test]
fn gpu_every_form_for_every_dtype() {
    // The sweeps rotate forms; this pins one mid-size GQA + partial-rotary shape to every
    // dtype × form × poisoning, so no combination is left to the rotation.
    let Some(stream) = gpu("gpu_every_form_for_every_dtype") else {
        return;
    };
    let shape = (3, 37, 5, 3, 92, 60);
    let mut failures = Vec::new();
    let mut cases = 0;
    for (f, &form) in FORMS.iter().enumerate() {
        for poison in [false, true] {
            let seed = 40_000 + 2 * f as u64 + poison as u64;
            let run = std::panic::AssertUnwindSafe(|| {
                run_case::<f32>(&stream, shape, form, poison, seed);
                run_case::<f16>(&stream, shape, form, poison, seed);
                run_case::<bf16>(&stream, shape, form, poison, seed);
            });
            if let Err(e) = std::panic::catch_unwind(run) {
                failures.push(e.downcast_ref::<String>().cloned().unwrap_or_default());
            }
            cases += 3;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("gpu_every_form_for_every_dtype: {cases} cases passed");
}

#[test]
fn gpu_vector_kernels_walk_many_tokens_grid_stride() {
    // Below 4 waves of token steps the vector kernels launch one resident grid and walk
    // tokens grid-stride (from 4 waves, one block per step: `whole_grid` in src/launch.rs);
    // the per-position row is advanced incrementally (wrapping at S) and gathered ids are
    // loaded one token ahead. 150 k tokens of 1 + 1 heads of d = 16 f32 (2 vectors per half,
    // 64 tokens per block: 2345 steps) are about 3 passes on an H200 (792 resident blocks,
    // ~50 k tokens at once) and under 4 on an A100 or H100 too; S = 50021 makes the stride
    // wrap S at a different place every pass. (About 2 s, mostly the CPU reference.)
    let Some(stream) = gpu("gpu_vector_kernels_walk_many_tokens_grid_stride") else {
        return;
    };
    let shape = (3, 50021, 1, 1, 16, 16);
    for (f, form) in [Form::PerPosition, Form::Ids32].into_iter().enumerate() {
        run_case::<f32>(&stream, shape, form, f == 1, 45_000 + f as u64);
    }
}

#[test]
fn gpu_misaligned_views_take_the_scalar_path() {
    // A view that starts one element into its allocation is not 16-byte aligned: the launcher
    // must fall back to the scalar kernels for d = 128 (the vector kernels would misread).
    // Each of q, k, cos, sin in turn, bf16 and f32.
    let Some(stream) = gpu("gpu_misaligned_views_take_the_scalar_path") else {
        return;
    };
    for which in 0..4 {
        misaligned::<bf16>(&stream, which);
        misaligned::<f32>(&stream, which);
    }
}

fn misaligned<T: Dtype>(stream: &Arc<CudaStream>, which: usize) {
    let (b, s, hq, hk, d) = (2, 5, 4, 2, 128);
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let mut rng = Rng::new(800 + which as u64);
    let q: Vec<T> = uniform(&mut rng, b * s * hq * d);
    let k: Vec<T> = uniform(&mut rng, b * s * hk * d);
    let (cos, sin) = cos_sin::<T>(&(0..s as i64).collect::<Vec<_>>(), d, false);
    // Buffer `i` gets one leading element when `i == which`; the call sees the view after it.
    let padded = |i: usize, v: &[T]| {
        let lead = usize::from(i == which);
        let mut data = vec![T::from_f64(0.0); lead];
        data.extend_from_slice(v);
        (upload(stream, &data), lead)
    };
    let (mut q_buf, q0) = padded(0, &q);
    let (mut k_buf, k0) = padded(1, &k);
    let (cos_buf, c0) = padded(2, &cos);
    let (sin_buf, s0) = padded(3, &sin);
    let (cos_v, sin_v) = (cos_buf.slice(c0..), sin_buf.slice(s0..));
    let pp = CosSinLayout::PerPosition;
    let case = format!("{} misaligned buffer {which}", T::NAME);
    {
        let (mut q_v, mut k_v) = (q_buf.slice_mut(q0..), k_buf.slice_mut(k0..));
        rope_forward(stream, &args, &mut q_v, &mut k_v, &cos_v, &sin_v, &pp).expect(&case);
    }
    let (mut qw, mut kw) = (q.clone(), k.clone());
    ref_forward(&args, &mut qw, &mut kw, &cos, &sin, CosSinRows::PerPosition).unwrap();
    let got_q = stream.clone_dtoh(&q_buf.slice(q0..)).unwrap();
    let got_k = stream.clone_dtoh(&k_buf.slice(k0..)).unwrap();
    check("q", &case, &got_q, &qw, &q, d, d);
    check("k", &case, &got_k, &kw, &k, d, d);
    {
        let (mut q_v, mut k_v) = (q_buf.slice_mut(q0..), k_buf.slice_mut(k0..));
        rope_backward(stream, &args, &mut q_v, &mut k_v, &cos_v, &sin_v, &pp).expect(&case);
    }
    let (q1, k1) = (qw.clone(), kw.clone());
    ref_backward(&args, &mut qw, &mut kw, &cos, &sin, CosSinRows::PerPosition).unwrap();
    let got_q = stream.clone_dtoh(&q_buf.slice(q0..)).unwrap();
    let got_k = stream.clone_dtoh(&k_buf.slice(k0..)).unwrap();
    check("dq", &case, &got_q, &qw, &q1, d, d);
    check("dk", &case, &got_k, &kw, &k1, d, d);
}

#[test]
fn gpu_device_ids_are_clamped() {
    // Device ids are not checked on the host: the kernel clamps each into [0, max_pos),
    // so the result equals the reference with clamped ids, and nothing is read out of bounds.
    let Some(stream) = gpu("gpu_device_ids_are_clamped") else {
        return;
    };
    let (b, s, hq, hk, d, max_pos) = (2, 4, 3, 1, 8, 6);
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let mut rng = Rng::new(500);
    let q: Vec<bf16> = uniform(&mut rng, b * s * hq * d);
    let k: Vec<bf16> = uniform(&mut rng, b * s * hk * d);
    // Row 0 holds position 1, not the identity rotation: a token whose (clamped) id is 0 must
    // be rotated, so skipping a negative id would fail.
    let (cos, sin) = cos_sin::<bf16>(&(1..=max_pos as i64).collect::<Vec<_>>(), d, false);
    let (cos_d, sin_d) = (upload(&stream, &cos), upload(&stream, &sin));
    let ids64: [i64; 8] = [i64::MIN, -1, 0, 5, 6, 1 << 40, i64::MAX, 3];
    let ids32: [i32; 8] = [i32::MIN, -1, 0, 5, 6, 1 << 20, i32::MAX, 3];
    let clamped: [i64; 8] = [0, 0, 0, 5, 5, 5, 5, 3];
    let (ids64_d, ids32_d) = (upload_ids(&stream, &ids64), upload_ids(&stream, &ids32));
    for layout in [
        CosSinLayout::Gathered(PositionIds::DeviceI64(ids64_d.as_view())),
        CosSinLayout::Gathered(PositionIds::DeviceI32(ids32_d.as_view())),
    ] {
        let (mut q_d, mut k_d) = (upload(&stream, &q), upload(&stream, &k));
        rope_forward(&stream, &args, &mut q_d, &mut k_d, &cos_d, &sin_d, &layout).unwrap();
        let (mut qw, mut kw) = (q.clone(), k.clone());
        let rows = CosSinRows::Gathered(&clamped);
        ref_forward(&args, &mut qw, &mut kw, &cos, &sin, rows).unwrap();
        let case = format!("{layout:?}");
        check("q", &case, &download(&stream, &q_d), &qw, &q, d, d);
        check("k", &case, &download(&stream, &k_d), &kw, &k, d, d);
    }
    // The same ids as host data are rejected, naming the first bad one.
    let (mut q_d, mut k_d) = (upload(&stream, &q), upload(&stream, &k));
    expect_invalid(
        rope_forward(
            &stream,
            &args,
            &mut q_d,
            &mut k_d,
            &cos_d,
            &sin_d,
            &CosSinLayout::Gathered(PositionIds::Host(&ids64)),
        ),
        "position_ids",
        &format!("position_ids[0] = {}", i64::MIN),
    );
}

#[test]
fn gpu_offsets_beyond_2_pow_32_elements() {
    // q: 1 × (2²⁰ + 8) tokens × 32 heads × 128 = 2³² + 32768 bf16 elements (8 GiB): any 32-bit
    // element or byte offset wraps. q and k are zero except the tokens of
    // `common::sampled_rows`, which hold random data whose cos/sin rows come from host ids:
    // 8-token windows at the start, around q elements 2³¹ and 2³² and at the end (the last
    // token), and 256 tokens spread over the rest; they must match the reference computed on
    // them alone (a wrapped read or write lands on another token and breaks it).
    let test = "gpu_offsets_beyond_2_pow_32_elements";
    let Some(stream) = gpu_for_huge(test) else {
        return;
    };
    let (hq, hk, d, win) = (32, 1, 128, 8);
    let s = (1usize << 20) + win;
    let args = RopeArgs::new(d).with_seq_len(s).with_heads(hq, hk);
    let mut q_d = stream.alloc_zeros::<bf16>(s * hq * d).expect("8 GiB for q");
    let mut k_d = stream.alloc_zeros::<bf16>(s * hk * d).expect("k");
    let max_pos = 16;
    let (cos, sin) = cos_sin::<bf16>(&(0..max_pos as i64).collect::<Vec<_>>(), d, false);
    let (cos_d, sin_d) = (upload(&stream, &cos), upload(&stream, &sin));
    let (q_row, k_row) = (hq * d, hk * d);
    // q elements 2³¹ and 2³².
    let data = sampled_rows(s, win, &[(1 << 31) / q_row, (1 << 32) / q_row]);
    let n_data: usize = data.iter().map(|r| r.len()).sum();
    let mut rng = Rng::new(600);
    let q: Vec<bf16> = uniform(&mut rng, n_data * q_row);
    let k: Vec<bf16> = uniform(&mut rng, n_data * k_row);
    let data_ids: Vec<i64> = (0..n_data)
        .map(|_| (rng.next_u64() % max_pos) as i64)
        .collect();
    upload_rows(&stream, &mut q_d, &data, q_row, &q);
    upload_rows(&stream, &mut k_d, &data, k_row, &k);
    let mut ids = vec![0i64; s];
    let data_tokens = data.iter().flat_map(|r| r.clone());
    for (t, &id) in data_tokens.zip(&data_ids) {
        ids[t] = id;
    }
    let layout = CosSinLayout::Gathered(PositionIds::Host(&ids));
    rope_forward(&stream, &args, &mut q_d, &mut k_d, &cos_d, &sin_d, &layout).unwrap();
    let got_q = download_rows(&stream, &q_d, &data, q_row);
    let got_k = download_rows(&stream, &k_d, &data, k_row);
    let data_args = RopeArgs::new(d).with_seq_len(n_data).with_heads(hq, hk);
    let (mut qw, mut kw) = (q.clone(), k.clone());
    let rows = CosSinRows::Gathered(&data_ids);
    ref_forward(&data_args, &mut qw, &mut kw, &cos, &sin, rows).unwrap();
    let case = format!("{n_data} tokens of data");
    check("q", &case, &got_q, &qw, &q, d, d);
    check("k", &case, &got_k, &kw, &k, d, d);
}

#[test]
fn gpu_nan_inf_and_overflow_propagate_as_in_the_reference() {
    // NaN stays NaN, ±Inf meets c = 1, s = 0 at position 0 (Inf·0 = NaN in the partner), and a
    // pair of 60000s overflows f16 (x2·c + x1·s ≈ 84853 > 65504) to Inf: all as the reference.
    let Some(stream) = gpu("gpu_nan_inf_and_overflow_propagate_as_in_the_reference") else {
        return;
    };
    special_values::<f32>(&stream);
    special_values::<f16>(&stream);
    special_values::<bf16>(&stream);
}

fn special_values<T: Dtype>(stream: &Arc<CudaStream>) {
    let (b, s, hq, hk, d) = (2, 3, 2, 1, 8);
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let mut rng = Rng::new(700);
    let mut q: Vec<T> = uniform(&mut rng, b * s * hq * d);
    let mut k: Vec<T> = uniform(&mut rng, b * s * hk * d);
    q[0] = T::from_f64(f64::NAN);
    q[5] = T::from_f64(f64::INFINITY);
    k[2] = T::from_f64(f64::NEG_INFINITY);
    // Token 1 (position 1): the first pair of its first q head.
    let pair = hq * d;
    q[pair] = T::from_f64(60000.0);
    q[pair + d / 2] = T::from_f64(60000.0);
    let positions: Vec<i64> = (0..s as i64).collect();
    let (cos, sin) = cos_sin::<T>(&positions, d, false);
    let (cos_d, sin_d) = (upload(stream, &cos), upload(stream, &sin));
    let pp = CosSinLayout::PerPosition;
    let case = format!("special values, {}", T::NAME);
    let (mut q_d, mut k_d) = (upload(stream, &q), upload(stream, &k));
    rope_forward(stream, &args, &mut q_d, &mut k_d, &cos_d, &sin_d, &pp).unwrap();
    let (mut qw, mut kw) = (q.clone(), k.clone());
    ref_forward(&args, &mut qw, &mut kw, &cos, &sin, CosSinRows::PerPosition).unwrap();
    let got_q = download(stream, &q_d);
    check("q", &case, &got_q, &qw, &q, d, d);
    check("k", &case, &download(stream, &k_d), &kw, &k, d, d);
    assert!(
        got_q[0].to_f64().is_nan() && got_q[5].to_f64().is_infinite(),
        "{case}"
    );
    // The backward, in place on the forward's output.
    rope_backward(stream, &args, &mut q_d, &mut k_d, &cos_d, &sin_d, &pp).unwrap();
    let (q1, k1) = (qw.clone(), kw.clone());
    ref_backward(&args, &mut qw, &mut kw, &cos, &sin, CosSinRows::PerPosition).unwrap();
    check("dq", &case, &download(stream, &q_d), &qw, &q1, d, d);
    check("dk", &case, &download(stream, &k_d), &kw, &k1, d, d);
}

// ---------------------------------------------------------------- bad input

#[test]
fn bad_input_is_rejected_before_launch() {
    let Some(stream) = gpu("bad_input_is_rejected_before_launch") else {
        return;
    };
    let (b, s, hq, hk, d) = (2, 3, 4, 2, 8);
    let a = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let zeros = |n: usize| upload(&stream, &vec![0.0f32; n]);
    let (mut q, mut k) = (zeros(b * s * hq * d), zeros(b * s * hk * d));
    let (cos, sin) = (zeros(s * d), zeros(s * d));
    let pp = CosSinLayout::PerPosition;
    let call =
        |a: &RopeArgs,
         q: &mut CudaSlice<f32>,
         k: &mut CudaSlice<f32>,
         cos: &CudaSlice<f32>,
         sin: &CudaSlice<f32>,
         layout: &CosSinLayout<'_>| { rope_forward(&stream, a, q, k, cos, sin, layout) };
    assert!(call(&a, &mut q, &mut k, &cos, &sin, &pp).is_ok());

    // The shape itself.
    let shape_errors = [
        (
            RopeArgs::new(7)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk),
            "args.head_dim",
            "even value ≥ 2",
        ),
        (
            RopeArgs::new(0)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk),
            "args.head_dim",
            "even value ≥ 2",
        ),
        (
            a.with_rotary_dim(5),
            "args.rotary_dim",
            "2 ..= head_dim = 8",
        ),
        (
            a.with_rotary_dim(0),
            "args.rotary_dim",
            "2 ..= head_dim = 8",
        ),
        (
            a.with_rotary_dim(10),
            "args.rotary_dim",
            "2 ..= head_dim = 8",
        ),
        (
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(0, hk),
            "args.q_heads",
            "at least 1",
        ),
        (
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, 0),
            "args.k_heads",
            "at least 1",
        ),
        (
            RopeArgs::new(d)
                .with_batch(usize::MAX)
                .with_seq_len(s)
                .with_heads(hq, hk),
            "args",
            "within usize",
        ),
        (
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(1 << 40, hk),
            "args",
            "< 2^31",
        ),
    ];
    for (args, arg, needle) in shape_errors {
        expect_invalid(call(&args, &mut q, &mut k, &cos, &sin, &pp), arg, needle);
    }

    // q/k lengths: a k with another batch or sequence length, a q with other heads.
    let mut k_other_seq = zeros(b * (s + 1) * hk * d);
    expect_invalid(
        call(&a, &mut q, &mut k_other_seq, &cos, &sin, &pp),
        "k",
        "length 96 (batch × seq_len × k_heads × head_dim)",
    );
    let mut q_other_heads = zeros(b * s * (hq + 1) * d);
    expect_invalid(
        call(&a, &mut q_other_heads, &mut k, &cos, &sin, &pp),
        "q",
        "length 192",
    );

    // cos/sin lengths for each form; sin unlike cos.
    let short = zeros(s * d - 2);
    expect_invalid(
        call(&a, &mut q, &mut k, &short, &sin, &pp),
        "cos",
        "length 24 (seq_len × rotary_dim)",
    );
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &short, &pp),
        "sin",
        "length 24 (the length of cos)",
    );
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &sin, &CosSinLayout::PerBatch),
        "cos",
        "length 48 (batch × seq_len × rotary_dim)",
    );
    // Partial rotary: rows are rotary_dim long, so a head_dim-wide table is rejected.
    expect_invalid(
        call(&a.with_rotary_dim(4), &mut q, &mut k, &cos, &sin, &pp),
        "cos",
        "length 12",
    );
    let ids_ok = [0i64, 1, 2, 0, 1, 2];
    let gathered = CosSinLayout::Gathered(PositionIds::Host(&ids_ok));
    let ragged = zeros(3 * d + 1);
    expect_invalid(
        call(&a, &mut q, &mut k, &ragged, &ragged, &gathered),
        "cos",
        "rows of rotary_dim = 8",
    );
    let empty = zeros(1);
    expect_invalid(
        rope_forward(
            &stream,
            &a,
            &mut q,
            &mut k,
            &empty.slice(0..0),
            &sin,
            &gathered,
        ),
        "cos",
        "max_pos ≥ 1",
    );
    assert!(call(&a, &mut q, &mut k, &cos, &sin, &gathered).is_ok());

    // Position ids: length (host and device) and host range.
    let host_short = CosSinLayout::Gathered(PositionIds::Host(&ids_ok[..5]));
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &sin, &host_short),
        "position_ids",
        "length 6 (batch × seq_len)",
    );
    let dev_long = upload_ids(&stream, &[0i32; 7]);
    let dev_long = CosSinLayout::Gathered(PositionIds::DeviceI32(dev_long.as_view()));
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &sin, &dev_long),
        "position_ids",
        "length 6",
    );
    let too_big = [0i64, 1, 2, 3, 0, 0];
    expect_invalid(
        call(
            &a,
            &mut q,
            &mut k,
            &cos,
            &sin,
            &CosSinLayout::Gathered(PositionIds::Host(&too_big)),
        ),
        "position_ids",
        "position_ids[3] = 3",
    );
    let negative = [0i64, 1, 2, 0, -2, 0];
    expect_invalid(
        call(
            &a,
            &mut q,
            &mut k,
            &cos,
            &sin,
            &CosSinLayout::Gathered(PositionIds::Host(&negative)),
        ),
        "position_ids",
        "ids in 0 ..= 2",
    );

    // The backward names its own buffers.
    let mut short_dq = zeros(b * s * hq * d - 1);
    expect_invalid(
        rope_backward(&stream, &a, &mut short_dq, &mut k, &cos, &sin, &pp),
        "dq",
        "length 192",
    );
    expect_invalid(
        rope_backward(&stream, &a, &mut q, &mut k_other_seq, &cos, &sin, &pp),
        "dk",
        "length 96",
    );
    stream.synchronize().unwrap();
}

#[test]
fn zero_tokens_launch_nothing() {
    // B = 0 or S = 0: every form is validated against its (possibly empty) length, then the
    // call returns Ok without a launch (a zero-block launch would be a driver error).
    let Some(stream) = gpu("zero_tokens_launch_nothing") else {
        return;
    };
    let (mut q_buf, mut k_buf) = (upload(&stream, &[1.0f32; 8]), upload(&stream, &[1.0f32; 8]));
    let table = upload(&stream, &[0.0f32; 40]); // 5 rows of 8
    let no_ids: [i64; 0] = [];
    for (b, s) in [(0, 5), (3, 0)] {
        let args = RopeArgs::new(8)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(2, 1);
        let (mut q, mut k) = (q_buf.slice_mut(0..0), k_buf.slice_mut(0..0));
        let per_position = table.slice(0..s * 8);
        let per_batch = table.slice(0..0);
        let forms = [
            (CosSinLayout::PerPosition, &per_position),
            (CosSinLayout::PerBatch, &per_batch),
            (
                CosSinLayout::Gathered(PositionIds::Host(&no_ids)),
                &table.as_view(),
            ),
        ];
        for (layout, cos) in &forms {
            let result = rope_forward(&stream, &args, &mut q, &mut k, *cos, *cos, layout);
            assert!(result.is_ok(), "{b}×{s} {layout:?}: {result:?}");
            let result = rope_backward(&stream, &args, &mut q, &mut k, *cos, *cos, layout);
            assert!(result.is_ok(), "{b}×{s} {layout:?}: {result:?}");
        }
        // Lengths are still checked: [S, r] with S = 5 is 40 elements, not 0.
        if s > 0 {
            let empty = table.slice(0..0);
            let pp = CosSinLayout::PerPosition;
            let result = rope_forward(&stream, &args, &mut q, &mut k, &empty, &empty, &pp);
            expect_invalid(result, "cos", "length 40");
        }
    }
    assert_eq!(download(&stream, &q_buf), vec![1.0f32; 8]);
    assert_eq!(download(&stream, &k_buf), vec![1.0f32; 8]);
}

#[test]
fn overlapping_buffers_are_rejected() {
    let Some(stream) = gpu("overlapping_buffers_are_rejected") else {
        return;
    };
    let (b, s, hq, hk, d) = (1, 2, 2, 2, 4);
    let a = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let n = b * s * hq * d; // 16, also the length of k
    let buf = upload(&stream, &vec![0.0f32; 5 * n]);
    let base = {
        let (ptr, _guard) = buf.device_ptr(&stream);
        ptr
    };
    // Safe Rust cannot hold a shared and a mutable view of the same memory, so overlaps are
    // built from raw pointers into `buf`.
    // SAFETY: every alias lies inside `buf` and is leaked (never freed) below.
    let alias = |offset: usize, len: usize| unsafe {
        stream.upgrade_device_ptr::<f32>(base + 4 * offset as u64, len)
    };
    let (mut q, mut k_over_q) = (alias(0, n), alias(n / 2, n));
    let cos = buf.slice(2 * n..2 * n + s * d);
    let sin = buf.slice(3 * n..3 * n + s * d);
    let pp = CosSinLayout::PerPosition;
    let e = rope_forward(&stream, &a, &mut q, &mut k_over_q, &cos, &sin, &pp);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "q",
            other: "k"
        })
    );
    let mut k = alias(n, n);
    // q starts where cos does and ends before k's neighbour sin: it overlaps cos alone.
    let mut q_over_cos = alias(2 * n, n);
    let e = rope_forward(&stream, &a, &mut q_over_cos, &mut k, &cos, &sin, &pp);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "q",
            other: "cos"
        })
    );
    let mut dk_over_sin = alias(3 * n + 4, n);
    let e = rope_backward(&stream, &a, &mut q, &mut dk_over_sin, &cos, &sin, &pp);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "dk",
            other: "sin"
        })
    );
    // Device position ids (2 × i64) inside k.
    // SAFETY: the ids are only compared as addresses: the call is rejected before a launch.
    let ids_in_k = unsafe { buf.slice(n..n + 4).transmute::<i64>(2) }.expect("4 f32 = 2 i64");
    let layout = CosSinLayout::Gathered(PositionIds::DeviceI64(ids_in_k));
    let e = rope_forward(&stream, &a, &mut q, &mut k, &cos, &sin, &layout);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "k",
            other: "position_ids"
        })
    );
    // Adjacent, not overlapping: accepted (cos and sin may share memory: both are inputs).
    let e = rope_forward(&stream, &a, &mut q, &mut k, &cos, &cos, &pp);
    assert!(e.is_ok(), "{e:?}");
    stream.synchronize().unwrap();
    let _ = (
        q.leak(),
        k.leak(),
        k_over_q.leak(),
        q_over_cos.leak(),
        dk_over_sin.leak(),
    );
}

// ---------------------------------------------------------------- forms and out of place

/// `(interleaved, half_tables, head_major)`: every combination, the default first.
const FORM_BITS: [(bool, bool, bool); 8] = [
    (false, false, false),
    (true, false, false),
    (false, true, false),
    (false, false, true),
    (true, true, false),
    (true, false, true),
    (false, true, true),
    (true, true, true),
];

fn in_form(args: RopeArgs, (interleaved, half, head_major): (bool, bool, bool)) -> RopeArgs {
    let args = if interleaved {
        args.with_interleaved()
    } else {
        args
    };
    let args = if half { args.with_half_tables() } else { args };
    if head_major {
        args.with_head_major()
    } else {
        args
    }
}

/// Where element `(b, s, h, j)` of a q-like tensor `[B, S, H, d]` in the default form lies in
/// `args`' form: head-major swaps S and H; interleaved moves NeoX pair `(i, i + r/2)` to
/// `(2i, 2i + 1)` (tail dims stay).
fn form_index(args: &RopeArgs, heads: usize, (b, s, h, j): (usize, usize, usize, usize)) -> usize {
    let (d, r, sl) = (args.head_dim, args.rotary_dim, args.seq_len);
    let j = match (args.interleaved, j < r / 2, j < r) {
        (true, true, _) => 2 * j,
        (true, false, true) => 2 * (j - r / 2) + 1,
        _ => j,
    };
    let head = if args.head_major {
        (b * heads + h) * sl + s
    } else {
        (b * sl + s) * heads + h
    };
    head * d + j
}

/// A q-like tensor in the default form, rearranged into `args`' form.
fn to_form<T: Copy>(args: &RopeArgs, heads: usize, x: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    for (i, &v) in x.iter().enumerate() {
        let (d, sl) = (args.head_dim, args.seq_len);
        let at = (
            i / (sl * heads * d),
            i / (heads * d) % sl,
            i / d % heads,
            i % d,
        );
        out[form_index(args, heads, at)] = v;
    }
    out
}

/// A q-like tensor in `args`' form, back in the default form.
fn from_form<T: Copy>(args: &RopeArgs, heads: usize, x: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    for (i, o) in out.iter_mut().enumerate() {
        let (d, sl) = (args.head_dim, args.seq_len);
        let at = (
            i / (sl * heads * d),
            i / (heads * d) % sl,
            i / d % heads,
            i % d,
        );
        *o = x[form_index(args, heads, at)];
    }
    out
}

/// HF's full-width rows (`cat(f, f)`, `r` long) as `args`' form reads them: their first
/// halves with half tables, `repeat_interleave(f, 2)` for interleaved full-width rows (pair
/// `i` reads entry `2i`, so entry `2i + 1` gets what the NeoX row has past its half: NaN in a
/// poisoned table).
fn table_in_form<T: Copy>(args: &RopeArgs, hf: &[T]) -> Vec<T> {
    let (r, h) = (args.rotary_dim, args.rotary_dim / 2);
    hf.chunks(r)
        .flat_map(|row| match (args.half_tables, args.interleaved) {
            (true, _) => row[..h].to_vec(),
            (false, true) => (0..h).flat_map(|i| [row[i], row[i + h]]).collect(),
            (false, false) => row.to_vec(),
        })
        .collect()
}

#[test]
fn reference_forms_are_the_default_form_rearranged() {
    // Every form computes, element for element, what the default form computes on the
    // rearranged data and tables: the same products and sums, so the same bits.
    let shapes = [(2, 3, 3, 1, 6, 4), (1, 5, 2, 3, 8, 8), (3, 2, 1, 2, 10, 2)];
    for (n, &(b, s, hq, hk, d, r)) in shapes.iter().enumerate() {
        for f in 0..3 {
            let mut rng = Rng::new(900 + 3 * n as u64 + f as u64);
            let base = RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk)
                .with_rotary_dim(r);
            let (cos, sin, ids) = f64_tables(&mut rng, b, s, r, f);
            let (cos, sin): (Vec<bf16>, Vec<bf16>) = (
                cos.iter().map(|&v| bf16::from_f64(v)).collect(),
                sin.iter().map(|&v| bf16::from_f64(v)).collect(),
            );
            let q: Vec<bf16> = uniform(&mut rng, b * s * hq * d);
            let k: Vec<bf16> = uniform(&mut rng, b * s * hk * d);
            for backward in [false, true] {
                let rotate = if backward { ref_backward } else { ref_forward };
                let (mut qw, mut kw) = (q.clone(), k.clone());
                rotate(&base, &mut qw, &mut kw, &cos, &sin, form(f, &ids)).unwrap();
                for bits in FORM_BITS {
                    let args = in_form(base, bits);
                    let (c, sn) = (table_in_form(&args, &cos), table_in_form(&args, &sin));
                    let mut qf = to_form(&args, hq, &q);
                    let mut kf = to_form(&args, hk, &k);
                    rotate(&args, &mut qf, &mut kf, &c, &sn, form(f, &ids)).unwrap();
                    let case = format!("shape {n} rows {f} {bits:?} backward={backward}");
                    assert_eq!(from_form(&args, hq, &qf), qw, "q, {case}");
                    assert_eq!(from_form(&args, hk, &kf), kw, "k, {case}");
                }
            }
        }
    }
}

#[test]
fn reference_interleaved_pairs_adjacent_dims() {
    // d = 4, interleaved, a 90° rotation of pair 0 and none of pair 1 (half-width rows
    // [cos θ0, cos θ1] = [0, 1], [sin θ0, sin θ1] = [1, 0]): (x0, x1, x2, x3) → (−x1, x0, x2, x3).
    let args = RopeArgs::new(4).with_interleaved().with_half_tables();
    let (mut q, mut k) = (vec![1.0f64, 2.0, 3.0, 4.0], vec![5.0f64, 6.0, 7.0, 8.0]);
    let (cos, sin) = ([0.0, 1.0], [1.0, 0.0]);
    ref_forward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!(
        (q, k),
        (vec![-2.0, 1.0, 3.0, 4.0], vec![-6.0, 5.0, 7.0, 8.0])
    );
    // Full-width interleaved rows hold one value per dim: pair 1 reads entry 2.
    let args = RopeArgs::new(4).with_interleaved();
    let (mut q, mut k) = (vec![1.0f64, 2.0, 3.0, 4.0], vec![0.0f64; 4]);
    let (cos, sin) = ([1.0, 9.0, 0.0, 9.0], [0.0, 9.0, 1.0, 9.0]);
    ref_forward(&args, &mut q, &mut k, &cos, &sin, CosSinRows::PerPosition).unwrap();
    assert_eq!(q, [1.0, 2.0, -4.0, 3.0]);
}

#[test]
fn reference_backward_is_the_adjoint_in_every_form() {
    // The forward is linear: the backward of `g` is its gradient exactly when
    // Σ g·forward(x) = Σ backward(g)·x for all x (finite differences of a linear map add
    // only rounding). f64, every form and row source.
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for (n, &(b, s, hq, hk, d, r)) in SMALL.iter().enumerate() {
        for f in 0..3 {
            for bits in FORM_BITS {
                let mut rng = Rng::new(1000 + 3 * n as u64 + f as u64);
                let args = in_form(
                    RopeArgs::new(d)
                        .with_batch(b)
                        .with_seq_len(s)
                        .with_heads(hq, hk)
                        .with_rotary_dim(r),
                    bits,
                );
                let (cos, sin, ids) = f64_tables(&mut rng, b, s, r, f);
                let (cos, sin) = (table_in_form(&args, &cos), table_in_form(&args, &sin));
                let x: (Vec<f64>, Vec<f64>) = (
                    rng.vec(b * s * hq * d, 0.0, 1.0),
                    rng.vec(b * s * hk * d, 0.0, 1.0),
                );
                let g: (Vec<f64>, Vec<f64>) =
                    (rng.vec(x.0.len(), 0.0, 1.0), rng.vec(x.1.len(), 0.0, 1.0));
                let (mut yq, mut yk) = x.clone();
                ref_forward(&args, &mut yq, &mut yk, &cos, &sin, form(f, &ids)).unwrap();
                let (mut gq, mut gk) = g.clone();
                ref_backward(&args, &mut gq, &mut gk, &cos, &sin, form(f, &ids)).unwrap();
                let lhs = dot(&yq, &g.0) + dot(&yk, &g.1);
                let rhs = dot(&gq, &x.0) + dot(&gk, &x.1);
                assert!(
                    (lhs - rhs).abs() < 1e-12 * (1.0 + lhs.abs()),
                    "{lhs} vs {rhs}: shape {n} rows {f} {bits:?}"
                );
            }
        }
    }
}

#[test]
fn reference_checks_half_width_rows() {
    // Half-width rows are r/2 long: a full-width table is the wrong length.
    let args = RopeArgs::new(8).with_seq_len(3).with_half_tables();
    let (mut q, mut k) = (vec![0.0f64; 24], vec![0.0f64; 24]);
    let half = vec![0.0f64; 12];
    ref_forward(&args, &mut q, &mut k, &half, &half, CosSinRows::PerPosition).unwrap();
    let full = vec![0.0f64; 24];
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &full, &full, CosSinRows::PerPosition),
        "cos",
        "length 12",
    );
}

/// Shapes of the GPU form sweep, (B, S, Hq, Hk, d, r): the 1×1 minimum, odd head counts and
/// head dims, partial rotary (whose tail the out-of-place kernels copy), more pairs per token
/// than a block's 256 threads, many heads of 2 dims.
const FORM_SHAPES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 1, 1, 1, 2, 2),
    (2, 7, 3, 5, 6, 6),
    (3, 11, 6, 2, 80, 32),
    (2, 9, 73, 3, 92, 92),
    (1, 33, 4, 1, 64, 40),
    (2, 5, 300, 1, 2, 2),
    (1, 257, 2, 2, 128, 128),
];

/// One GPU case of a form: forward and backward, in place (`rope_forward`/`rope_backward`)
/// and out of place into NaN-poisoned outputs (`*_into`, whose inputs must stay unchanged),
/// against the reference in that form.
fn run_form_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    shape: (usize, usize, usize, usize, usize, usize),
    rows: Form,
    bits: (bool, bool, bool),
    seed: u64,
) {
    let (b, s, hq, hk, d, r) = shape;
    let args = in_form(
        RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r),
        bits,
    );
    let poison = seed.is_multiple_of(2);
    let desc = format!(
        "B={b} S={s} Hq={hq} Hk={hk} d={d} r={r} {} {rows:?} (interleaved, half, head-major) = \
         {bits:?} poisoned-unread-entries={poison} seed={seed}",
        T::NAME
    );
    let mut rng = Rng::new(seed);
    let t = Tables::<T>::new(stream, &args, rows, poison, &mut rng);
    let (cos, sin) = (&t.cos, &t.sin);
    let (ref_rows, layout) = (t.ref_rows(), t.layout());
    check_directions(
        stream,
        &args,
        (cos, sin, &t.cos_d, &t.sin_d),
        (ref_rows, &layout),
        &mut rng,
        &desc,
    );
}

/// Forward and backward of one case on fresh random q and k against the reference: in place
/// (`rope_forward`/`rope_backward`) and out of place into NaN-poisoned outputs (`*_into`,
/// whose inputs must stay unchanged).
fn check_directions<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    (cos, sin, cos_d, sin_d): (&[T], &[T], &CudaSlice<T>, &CudaSlice<T>),
    (ref_rows, layout): (CosSinRows<'_>, &CosSinLayout<'_>),
    rng: &mut Rng,
    desc: &str,
) {
    let tokens = args.batch * args.seq_len;
    let (d, r) = (args.head_dim, args.rotary_dim);
    for backward in [false, true] {
        let (names, rotate, rotate_into) = if backward {
            (
                ["dq", "dk"],
                rope_backward as Rotate<T>,
                rope_backward_into as RotateInto<T>,
            )
        } else {
            (
                ["q", "k"],
                rope_forward as Rotate<T>,
                rope_forward_into as RotateInto<T>,
            )
        };
        let q: Vec<T> = uniform(rng, tokens * args.q_heads * d);
        let k: Vec<T> = uniform(rng, tokens * args.k_heads * d);
        let (mut qw, mut kw) = (q.clone(), k.clone());
        let rotate_ref = if backward { ref_backward } else { ref_forward };
        rotate_ref(args, &mut qw, &mut kw, cos, sin, ref_rows).expect(desc);

        let (mut q_d, mut k_d) = (upload(stream, &q), upload(stream, &k));
        rotate(stream, args, &mut q_d, &mut k_d, cos_d, sin_d, layout).expect(desc);
        let case = format!("in place, {desc}");
        check(names[0], &case, &download(stream, &q_d), &qw, &q, d, r);
        check(names[1], &case, &download(stream, &k_d), &kw, &k, d, r);

        let (q_d, k_d) = (upload(stream, &q), upload(stream, &k));
        let mut q_out = common::poisoned::<T>(stream, q.len());
        let mut k_out = common::poisoned::<T>(stream, k.len());
        rotate_into(
            stream, args, &q_d, &k_d, cos_d, sin_d, layout, &mut q_out, &mut k_out,
        )
        .expect(desc);
        let case = format!("out of place, {desc}");
        check(names[0], &case, &download(stream, &q_out), &qw, &q, d, r);
        check(names[1], &case, &download(stream, &k_out), &kw, &k, d, r);
        assert!(
            download(stream, &q_d) == q && download(stream, &k_d) == k,
            "inputs changed, {case}"
        );
    }
}

type Rotate<T> = fn(
    &Arc<CudaStream>,
    &RopeArgs,
    &mut CudaSlice<T>,
    &mut CudaSlice<T>,
    &CudaSlice<T>,
    &CudaSlice<T>,
    &CosSinLayout<'_>,
) -> liger_rs::Result<()>;

type RotateInto<T> = fn(
    &Arc<CudaStream>,
    &RopeArgs,
    &CudaSlice<T>,
    &CudaSlice<T>,
    &CudaSlice<T>,
    &CudaSlice<T>,
    &CosSinLayout<'_>,
    &mut CudaSlice<T>,
    &mut CudaSlice<T>,
) -> liger_rs::Result<()>;

/// Every shape in every form, the row source rotating with shape and form.
fn form_sweep<T: Dtype>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for (i, &shape) in FORM_SHAPES.iter().enumerate() {
        for (j, &bits) in FORM_BITS.iter().enumerate() {
            let rows = FORMS[(i + j) % FORMS.len()];
            let seed = seed_base + (i * FORM_BITS.len() + j) as u64;
            failures.run(|| run_form_case::<T>(&stream, shape, rows, bits, seed));
        }
    }
    failures.finish();
}

#[test]
fn gpu_forms_in_and_out_of_place_match_reference_f32() {
    form_sweep::<f32>("gpu_forms_in_and_out_of_place_match_reference_f32", 50_000);
}

#[test]
fn gpu_forms_in_and_out_of_place_match_reference_f16() {
    form_sweep::<f16>("gpu_forms_in_and_out_of_place_match_reference_f16", 51_000);
}

#[test]
fn gpu_forms_in_and_out_of_place_match_reference_bf16() {
    form_sweep::<bf16>("gpu_forms_in_and_out_of_place_match_reference_bf16", 52_000);
}

#[test]
fn out_of_place_rejects_bad_input_and_overlaps() {
    let Some(stream) = gpu("out_of_place_rejects_bad_input_and_overlaps") else {
        return;
    };
    let (b, s, hq, hk, d) = (1, 2, 2, 2, 4);
    let a = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk)
        .with_half_tables();
    let n = b * s * hq * d; // 16, also the length of k
    let buf = upload(&stream, &vec![0.0f32; 6 * n]);
    let base = {
        let (ptr, _guard) = buf.device_ptr(&stream);
        ptr
    };
    // Overlaps are built from raw pointers into `buf`, as in `overlapping_buffers_are_rejected`.
    // SAFETY: every alias lies inside `buf` and is leaked (never freed) below.
    let alias = |offset: usize, len: usize| unsafe {
        stream.upgrade_device_ptr::<f32>(base + 4 * offset as u64, len)
    };
    let (q, k) = (buf.slice(0..n), buf.slice(n..2 * n));
    let cos = buf.slice(2 * n..2 * n + s * d / 2);
    let sin = buf.slice(3 * n..3 * n + s * d / 2);
    let pp = CosSinLayout::PerPosition;
    let (mut q_out, mut k_out) = (alias(4 * n, n), alias(5 * n, n));
    let e = rope_forward_into(&stream, &a, &q, &k, &cos, &sin, &pp, &mut q_out, &mut k_out);
    assert!(e.is_ok(), "{e:?}");
    // Inputs may overlap each other (both are only read).
    let e = rope_forward_into(&stream, &a, &q, &q, &cos, &sin, &pp, &mut q_out, &mut k_out);
    assert!(e.is_ok(), "{e:?}");
    let mut over_q = alias(n / 2, n);
    let e = rope_forward_into(
        &stream,
        &a,
        &q,
        &k,
        &cos,
        &sin,
        &pp,
        &mut over_q,
        &mut k_out,
    );
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "q_out",
            other: "q"
        })
    );
    let mut over_q_out = alias(4 * n + 3, n);
    let e = rope_backward_into(
        &stream,
        &a,
        &q,
        &k,
        &cos,
        &sin,
        &pp,
        &mut q_out,
        &mut over_q_out,
    );
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "dq_out",
            other: "dk_out"
        })
    );
    // Elements 40..56: over `sin` (48..52), clear of `cos` (32..36) and `q_out` (64..80).
    let mut over_sin = alias(3 * n - n / 2, n);
    let e = rope_forward_into(
        &stream,
        &a,
        &q,
        &k,
        &cos,
        &sin,
        &pp,
        &mut q_out,
        &mut over_sin,
    );
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "k_out",
            other: "sin"
        })
    );
    // Lengths: half-width rows are d/2 long; outputs are shaped like their inputs.
    let full = buf.slice(2 * n..2 * n + s * d);
    expect_invalid(
        rope_forward_into(
            &stream, &a, &q, &k, &full, &full, &pp, &mut q_out, &mut k_out,
        ),
        "cos",
        "length 4",
    );
    let mut short = alias(4 * n, n - 1);
    expect_invalid(
        rope_backward_into(&stream, &a, &q, &k, &cos, &sin, &pp, &mut short, &mut k_out),
        "dq_out",
        "length 16",
    );
    expect_invalid(
        rope_forward_into(
            &stream,
            &a,
            &q,
            &q.slice(1..),
            &cos,
            &sin,
            &pp,
            &mut q_out,
            &mut k_out,
        ),
        "k",
        "length 16",
    );
    stream.synchronize().unwrap();
    let _ = (
        q_out.leak(),
        k_out.leak(),
        over_q.leak(),
        over_q_out.leak(),
        over_sin.leak(),
        short.leak(),
    );
}

// ---------------------------------------------------------------- fused QKV views (strides)

/// `[tokens, stride]` rows, q's `hq·d` columns at 0 and k's `hk·d` at `hq·d`, then v's `hk·d`
/// and `pad` more: the fused QKV projection output (with `pad = 0`) and a padded variant.
struct Fused {
    tokens: usize,
    q_row: usize,
    k_row: usize,
    stride: usize,
}

impl Fused {
    fn new(tokens: usize, hq: usize, hk: usize, d: usize, pad: usize) -> Self {
        Fused {
            tokens,
            q_row: hq * d,
            k_row: hk * d,
            stride: (hq + 2 * hk) * d + pad,
        }
    }

    fn len(&self) -> usize {
        self.tokens * self.stride
    }

    /// q's (`k = false`) or k's rows, gathered contiguous.
    fn gather<T: Copy>(&self, qkv: &[T], k: bool) -> Vec<T> {
        let (at, row) = if k {
            (self.q_row, self.k_row)
        } else {
            (0, self.q_row)
        };
        (0..self.tokens)
            .flat_map(|t| qkv[t * self.stride + at..][..row].iter().copied())
            .collect()
    }
}

#[test]
fn reference_fused_qkv_is_q_and_k_rotated_alone() {
    // Rotating q and k in place inside the fused buffer equals rotating contiguous copies of
    // them, element for element; v and the padding keep their bits.
    let shapes = [
        (2, 3, 3, 1, 6, 4, 0),
        (1, 5, 2, 2, 8, 8, 3),
        (3, 2, 1, 3, 10, 2, 1),
    ];
    for (n, &(b, s, hq, hk, d, r, pad)) in shapes.iter().enumerate() {
        let f = Fused::new(b * s, hq, hk, d, pad);
        let args = RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r);
        let mut rng = Rng::new(900 + n as u64);
        let qkv: Vec<f64> = uniform(&mut rng, f.len());
        let (cos, sin) = cos_sin::<f64>(&(0..s as i64).collect::<Vec<_>>(), r, false);
        for backward in [false, true] {
            let (mut q, mut k) = (f.gather(&qkv, false), f.gather(&qkv, true));
            let mut fused = qkv.clone();
            let strided = args.with_strides(f.stride, f.stride);
            let rows = CosSinRows::PerPosition;
            if backward {
                ref_backward(&args, &mut q, &mut k, &cos, &sin, rows).unwrap();
                ref_backward_fused(&strided, &mut fused, f.q_row, &cos, &sin, rows).unwrap();
            } else {
                ref_forward(&args, &mut q, &mut k, &cos, &sin, rows).unwrap();
                ref_forward_fused(&strided, &mut fused, f.q_row, &cos, &sin, rows).unwrap();
            }
            assert_eq!(f.gather(&fused, false), q, "q, shape {n}");
            assert_eq!(f.gather(&fused, true), k, "k, shape {n}");
            for t in 0..f.tokens {
                let rest = t * f.stride + f.q_row + f.k_row..(t + 1) * f.stride;
                assert_eq!(fused[rest.clone()], qkv[rest], "v and padding, shape {n}");
            }
            // Strided q and k in buffers of their own (views of a fused buffer each).
            let mut q_view = qkv.clone();
            let mut k_view = qkv[f.q_row..].to_vec();
            let rotate = if backward { ref_backward } else { ref_forward };
            rotate(&strided, &mut q_view, &mut k_view, &cos, &sin, rows).unwrap();
            assert_eq!(f.gather(&q_view, false), q, "strided q, shape {n}");
            assert_eq!(
                f.gather(&fused, true)[..],
                f.gather(&[&qkv[..f.q_row], &k_view[..]].concat(), true)[..],
                "strided k, shape {n}"
            );
        }
    }
}

#[test]
fn reference_fused_qkv_checks_spans_and_overlaps() {
    let args = RopeArgs::new(4)
        .with_batch(2)
        .with_seq_len(2)
        .with_heads(2, 1)
        .with_strides(16, 16);
    let (cos, sin) = (vec![1.0f64; 8], vec![0.0f64; 8]);
    let rows = CosSinRows::PerPosition;
    // 4 tokens of [q 8 | k 4 | v 4]: k at 8 spans 8 + 3·16 + 4 = 60 elements.
    let mut qkv = vec![0.0f64; 64];
    assert!(ref_forward_fused(&args, &mut qkv, 8, &cos, &sin, rows).is_ok());
    let mut short = vec![0.0f64; 59];
    expect_invalid(
        ref_forward_fused(&args, &mut short, 8, &cos, &sin, rows),
        "qkv",
        "length ≥ 60",
    );
    // k over q's last column, over q's first rows, over the next token's q.
    let mut roomy = vec![0.0f64; 80];
    for k_offset in [7, 0, 13] {
        let got = ref_forward_fused(&args, &mut roomy, k_offset, &cos, &sin, rows);
        assert_eq!(
            got,
            Err(Error::Aliasing {
                output: "q",
                other: "k"
            }),
            "{k_offset}"
        );
    }
    // k in v's columns (12) or past q's last row is fine.
    assert!(ref_forward_fused(&args, &mut qkv, 12, &cos, &sin, rows).is_ok());
    let mut long = vec![0.0f64; 200];
    assert!(ref_forward_fused(&args, &mut long, 56, &cos, &sin, rows).is_ok());
    let got = ref_backward_fused(&args, &mut qkv, 7, &cos, &sin, rows);
    assert_eq!(
        got,
        Err(Error::Aliasing {
            output: "dq",
            other: "dk"
        })
    );
    expect_invalid(
        ref_forward_fused(&args.with_strides(7, 16), &mut qkv, 8, &cos, &sin, rows),
        "args.q_stride",
        "≥ q_heads × head_dim = 8",
    );
    // Strided q in a buffer of its own must hold its span.
    let (mut q, mut k) = (vec![0.0f64; 55], vec![0.0f64; 52]);
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &cos, &sin, rows),
        "q",
        "length ≥ 56",
    );
}

/// The fused-QKV shapes `(B, S, Hq, Hk, d, r, pad)`: odd sizes, GQA either way, partial
/// rotary, padded token rows of `(Hq + 2·Hk)·d + pad` elements (odd strides), many tokens. The
/// vector kernels take those whose rows and halves are whole 16-byte vectors (a pad of 4:
/// f32's 4 lanes, not 16-bit types' 8), the general kernels the rest.
const FUSED_SHAPES: [(usize, usize, usize, usize, usize, usize, usize); 8] = [
    (1, 1, 1, 1, 2, 2, 0),
    (2, 7, 3, 5, 6, 6, 1),
    (3, 11, 6, 2, 80, 32, 0),
    (2, 9, 7, 3, 92, 92, 3),
    (1, 33, 4, 1, 64, 40, 0),
    (2, 300, 32, 8, 128, 128, 0),
    (1, 257, 2, 2, 128, 128, 8),
    (1, 20, 4, 2, 64, 64, 4),
];

/// One GPU case of fused QKV views: forward and backward on a NaN-free fused buffer, in place
/// (`rope_*_fused`), against the reference on the same buffer (every element: v, padding
/// and tail dims keep their bits); then q and k read as strided views of one fused buffer
/// into contiguous outputs (`rope_*_into`), against the reference on contiguous copies.
fn run_fused_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    shape: (usize, usize, usize, usize, usize, usize, usize),
    rows: Form,
    (interleaved, half): (bool, bool),
    seed: u64,
) {
    let (b, s, hq, hk, d, r, pad) = shape;
    let f = Fused::new(b * s, hq, hk, d, pad);
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk)
        .with_rotary_dim(r);
    let args = in_form(args, (interleaved, half, false));
    let strided = args.with_strides(f.stride, f.stride);
    let desc = format!(
        "B={b} S={s} Hq={hq} Hk={hk} d={d} r={r} pad={pad} {} {rows:?} interleaved={interleaved} \
         half-width tables={half} seed={seed}",
        T::NAME
    );
    let mut rng = Rng::new(seed);
    let t = Tables::<T>::new(stream, &args, rows, seed.is_multiple_of(2), &mut rng);
    let (cos, sin) = (&t.cos, &t.sin);
    let (ref_rows, layout) = (t.ref_rows(), t.layout());
    for backward in [false, true] {
        let qkv: Vec<T> = uniform(&mut rng, f.len());
        let mut want = qkv.clone();
        let mut qkv_d = upload(stream, &qkv);
        if backward {
            ref_backward_fused(&strided, &mut want, f.q_row, cos, sin, ref_rows).expect(&desc);
            rope_backward_fused(
                stream, &strided, &mut qkv_d, f.q_row, &t.cos_d, &t.sin_d, &layout,
            )
        } else {
            ref_forward_fused(&strided, &mut want, f.q_row, cos, sin, ref_rows).expect(&desc);
            rope_forward_fused(
                stream, &strided, &mut qkv_d, f.q_row, &t.cos_d, &t.sin_d, &layout,
            )
        }
        .expect(&desc);
        let case = format!("fused in place, backward={backward}, {desc}");
        // Every element: the rotated q and k columns within ULPS, the rest bit for bit.
        let got = download(stream, &qkv_d);
        check("qkv", &case, &got, &want, &qkv, 1, 1);
        for (i, (g, x)) in got.iter().zip(&qkv).enumerate() {
            let (t, c) = (i / f.stride, i % f.stride);
            let head_dim_of = |col: usize| col % d;
            let rotated = c < f.q_row + f.k_row && head_dim_of(c) < r;
            assert!(
                rotated || bits(*g) == bits(*x),
                "token {t} column {c} outside q's and k's rotary dims changed, {case}"
            );
        }

        // Strided views of one fused buffer, read only, into contiguous outputs.
        let (mut q, mut k) = (f.gather(&qkv, false), f.gather(&qkv, true));
        let input = (q.clone(), k.clone());
        let rotate = if backward { ref_backward } else { ref_forward };
        rotate(&args, &mut q, &mut k, cos, sin, ref_rows).expect(&desc);
        let qkv_d = upload(stream, &qkv);
        let (q_view, k_view) = (qkv_d.slice(..), qkv_d.slice(f.q_row..));
        let mut q_out = common::poisoned::<T>(stream, q.len());
        let mut k_out = common::poisoned::<T>(stream, k.len());
        let into = if backward {
            rope_backward_into
        } else {
            rope_forward_into
        };
        into(
            stream, &strided, &q_view, &k_view, &t.cos_d, &t.sin_d, &layout, &mut q_out, &mut k_out,
        )
        .expect(&desc);
        let case = format!("strided views out of place, backward={backward}, {desc}");
        check(
            "q_out",
            &case,
            &download(stream, &q_out),
            &q,
            &input.0,
            d,
            r,
        );
        check(
            "k_out",
            &case,
            &download(stream, &k_out),
            &k,
            &input.1,
            d,
            r,
        );
        assert!(download(stream, &qkv_d) == qkv, "input changed, {case}");
    }
}

fn fused_sweep<T: Dtype>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for (i, &(b, s, hq, hk, d, r, pad)) in FUSED_SHAPES.iter().enumerate() {
        // Sanitizer-sized: at most 9 positions.
        let shape = (b, sized(s, s.min(9)), hq, hk, d, r, pad);
        // Both pair layouts, with full-width tables and, alternating with the shape, half-width.
        for interleaved in [false, true] {
            let form = (interleaved, (i + interleaved as usize) % 2 == 1);
            let rows = FORMS[(2 * i + interleaved as usize) % FORMS.len()];
            let seed = seed_base + 2 * i as u64 + interleaved as u64;
            failures.run(|| run_fused_case::<T>(&stream, shape, rows, form, seed));
        }
    }
    failures.finish();
}

#[test]
fn gpu_fused_qkv_views_match_reference_f32() {
    fused_sweep::<f32>("gpu_fused_qkv_views_match_reference_f32", 70_000);
}

#[test]
fn gpu_fused_qkv_views_match_reference_f16() {
    fused_sweep::<f16>("gpu_fused_qkv_views_match_reference_f16", 71_000);
}

#[test]
fn gpu_fused_qkv_views_match_reference_bf16() {
    fused_sweep::<bf16>("gpu_fused_qkv_views_match_reference_bf16", 72_000);
}

#[test]
fn fused_qkv_rejects_bad_input_and_overlaps() {
    let test = "fused_qkv_rejects_bad_input_and_overlaps";
    let Some(stream) = gpu(test) else { return };
    // 4 tokens of [q 8 | k 4 | v 4]; k at 8 spans 8 + 3·16 + 4 = 60 elements.
    let args = RopeArgs::new(4)
        .with_batch(2)
        .with_seq_len(2)
        .with_heads(2, 1)
        .with_strides(16, 16);
    let (cos, sin) = (upload(&stream, &[1.0f32; 8]), upload(&stream, &[0.0f32; 8]));
    let pos = CosSinLayout::PerPosition;
    let mut qkv = upload(&stream, &[0.5f32; 64]);
    rope_forward_fused(&stream, &args, &mut qkv, 8, &cos, &sin, &pos).expect("valid");
    let mut short = upload(&stream, &[0.5f32; 59]);
    expect_invalid(
        rope_forward_fused(&stream, &args, &mut short, 8, &cos, &sin, &pos),
        "qkv",
        "length ≥ 60",
    );
    expect_invalid(
        rope_backward_fused(&stream, &args, &mut short, 8, &cos, &sin, &pos),
        "dqkv",
        "length ≥ 60",
    );
    // k over q's first rows, over q's last column, over the next token's q.
    let mut roomy = upload(&stream, &[0.5f32; 80]);
    for k_offset in [0, 7, 13] {
        let got = rope_forward_fused(&stream, &args, &mut roomy, k_offset, &cos, &sin, &pos);
        assert_eq!(
            got,
            Err(Error::Aliasing {
                output: "q",
                other: "k"
            }),
            "{k_offset}"
        );
    }
    let got = rope_backward_fused(&stream, &args, &mut qkv, 7, &cos, &sin, &pos);
    assert_eq!(
        got,
        Err(Error::Aliasing {
            output: "dq",
            other: "dk"
        })
    );
    expect_invalid(
        rope_forward_fused(
            &stream,
            &args.with_strides(16, 3),
            &mut qkv,
            8,
            &cos,
            &sin,
            &pos,
        ),
        "args.k_stride",
        "≥ k_heads × head_dim = 4",
    );
    expect_invalid(
        rope_forward_fused(
            &stream,
            &args.with_head_major(),
            &mut qkv,
            8,
            &cos,
            &sin,
            &pos,
        ),
        "args.q_stride",
        "None with head-major",
    );
    // The rejected calls wrote nothing; the valid one rotated by 0 (cos 1, sin 0).
    assert_eq!(download(&stream, &qkv), vec![0.5f32; 64]);
    // Strided q of its own must hold its span (56), k its own (52).
    let (mut q, mut k) = (
        upload(&stream, &[0.5f32; 55]),
        upload(&stream, &[0.5f32; 52]),
    );
    expect_invalid(
        rope_forward(&stream, &args, &mut q, &mut k, &cos, &sin, &pos),
        "q",
        "length ≥ 56 ((batch × seq_len − 1) × q_stride + q_heads × head_dim)",
    );
}

// ---------------------------------------------------------------- multimodal (Qwen2-VL)

/// HF's `apply_multimodal_rotary_pos_emb` table selection, written as HF writes it: split
/// each `[3, tokens, r]` table's rows into chunks of `mrope_section * 2` and take chunk `j`
/// from table `j mod 3`; the result is a `[tokens, r]` per-batch table.
fn hf_multimodal_table<T: Copy>(
    three: &[T],
    tokens: usize,
    r: usize,
    sections: [usize; 3],
) -> Vec<T> {
    let chunks: Vec<usize> = sections.iter().chain(&sections).copied().collect();
    let mut out = Vec::with_capacity(tokens * r);
    for t in 0..tokens {
        let mut start = 0;
        for (j, &len) in chunks.iter().enumerate() {
            let table = &three[(j % 3) * tokens * r..][..tokens * r];
            out.extend_from_slice(&table[t * r + start..][..len]);
            start += len;
        }
    }
    out
}

/// Three `[tokens, r]` HF-style tables (t, h, w) from 3-row position ids, as Qwen2-VL's rotary
/// embedding computes them.
fn multimodal_tables<T: Element>(rng: &mut Rng, tokens: usize, r: usize) -> (Vec<T>, Vec<T>) {
    let ids: Vec<i64> = (0..3 * tokens)
        .map(|_| (rng.next_u64() % 50) as i64)
        .collect();
    cos_sin::<T>(&ids, r, false)
}

#[test]
fn reference_multimodal_is_hf_apply_multimodal_rotary_pos_emb() {
    // Rotating with the per-batch table HF assembles equals the multimodal layout, bit for bit.
    let cases = [
        (2, 3, 3, 1, 8, 8, [1, 2, 1]),
        (1, 5, 2, 3, 12, 12, [0, 3, 3]),
        (2, 4, 1, 2, 16, 12, [6, 0, 0]),
        (1, 7, 2, 2, 128, 128, [16, 24, 24]),
    ];
    for (n, &(b, s, hq, hk, d, r, sections)) in cases.iter().enumerate() {
        let tokens = b * s;
        let mut rng = Rng::new(1200 + n as u64);
        let (cos3, sin3) = multimodal_tables::<f64>(&mut rng, tokens, r);
        let cos = hf_multimodal_table(&cos3, tokens, r, sections);
        let sin = hf_multimodal_table(&sin3, tokens, r, sections);
        let args = RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r);
        let q: Vec<f64> = uniform(&mut rng, tokens * hq * d);
        let k: Vec<f64> = uniform(&mut rng, tokens * hk * d);
        for backward in [false, true] {
            let rotate = if backward { ref_backward } else { ref_forward };
            let (mut q_hf, mut k_hf) = (q.clone(), k.clone());
            rotate(
                &args,
                &mut q_hf,
                &mut k_hf,
                &cos,
                &sin,
                CosSinRows::PerBatch,
            )
            .unwrap();
            let (mut q_m, mut k_m) = (q.clone(), k.clone());
            let rows = CosSinRows::Multimodal { sections };
            rotate(&args, &mut q_m, &mut k_m, &cos3, &sin3, rows).unwrap();
            assert_eq!((q_m, k_m), (q_hf, k_hf), "case {n}, backward={backward}");
        }
    }
    // The sections must split rotary_dim / 2, and the tables hold 3 × tokens rows.
    let args = RopeArgs::new(8).with_seq_len(2);
    let (mut q, mut k) = (vec![0.0f64; 16], vec![0.0f64; 16]);
    let table = vec![0.0f64; 3 * 2 * 8];
    let bad = CosSinRows::Multimodal {
        sections: [1, 1, 1],
    };
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &table, &table, bad),
        "layout.sections",
        "summing to rotary_dim / 2 = 4",
    );
    let ok = CosSinRows::Multimodal {
        sections: [1, 2, 1],
    };
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &table[..32], &table[..32], ok),
        "cos",
        "length 48 (3 × batch × seq_len × rotary_dim)",
    );
}

#[test]
fn reference_multimodal_gathered_is_multimodal_on_the_gathered_rows() {
    // Rows read through [3, B, S] ids from one table equal the [3, B, S, r] tables of those
    // rows, bit for bit, in every form.
    let (b, s, hq, hk, d, r, sections) = (2, 5, 3, 2, 12, 10, [2, 1, 2]);
    let tokens = b * s;
    let max_pos = 40;
    for (n, &bits) in FORM_BITS.iter().enumerate() {
        let mut rng = Rng::new(1300 + n as u64);
        let args = in_form(
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk)
                .with_rotary_dim(r),
            bits,
        );
        let ids: Vec<i64> = (0..3 * tokens)
            .map(|_| (rng.next_u64() % max_pos) as i64)
            .collect();
        let (cos, sin) = cos_sin::<f64>(&(0..max_pos as i64).collect::<Vec<_>>(), r, false);
        let (cos3, sin3) = cos_sin::<f64>(&ids, r, false);
        let (cos, sin) = (table_in_form(&args, &cos), table_in_form(&args, &sin));
        let (cos3, sin3) = (table_in_form(&args, &cos3), table_in_form(&args, &sin3));
        let q: Vec<f64> = uniform(&mut rng, tokens * hq * d);
        let k: Vec<f64> = uniform(&mut rng, tokens * hk * d);
        for backward in [false, true] {
            let rotate = if backward { ref_backward } else { ref_forward };
            let (mut q3, mut k3) = (q.clone(), k.clone());
            let rows = CosSinRows::Multimodal { sections };
            rotate(&args, &mut q3, &mut k3, &cos3, &sin3, rows).unwrap();
            let (mut qg, mut kg) = (q.clone(), k.clone());
            let rows = CosSinRows::MultimodalGathered {
                sections,
                ids: &ids,
            };
            rotate(&args, &mut qg, &mut kg, &cos, &sin, rows).unwrap();
            assert_eq!((qg, kg), (q3, k3), "form {bits:?}, backward={backward}");
        }
    }
    // The ids are [3, B, S] and each names a row of the table.
    let args = RopeArgs::new(4).with_seq_len(2);
    let (mut q, mut k) = (vec![0.0f64; 8], vec![0.0f64; 8]);
    let table = vec![0.0f64; 5 * 4];
    let ok = |ids| CosSinRows::MultimodalGathered {
        sections: [1, 0, 1],
        ids,
    };
    assert!(
        ref_forward(
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            ok(&[0, 1, 2, 3, 4, 0])
        )
        .is_ok()
    );
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &table, &table, ok(&[0, 1, 2, 3])),
        "position_ids",
        "length 6 (3 × batch × seq_len)",
    );
    expect_invalid(
        ref_forward(
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            ok(&[0, 1, 2, 3, 5, 0]),
        ),
        "position_ids",
        "position_ids[4] = 5",
    );
}

/// A multimodal shape: `(B, S, Hq, Hk, d, r, sections)`.
type MultimodalShape = (usize, usize, usize, usize, usize, usize, [usize; 3]);

/// In place in the default form, the vector kernels take the shapes whose halves and section
/// starts are whole 16-byte vectors (`[16, 24, 24]` and `[8, 8, 16]` for every type,
/// `[20, 20, 0]` for f32 alone), the general kernels the rest and every other form; shape `i`
/// gathers through `[i32, i64, host][i % 3]` ids.
const MULTIMODAL_SHAPES: [MultimodalShape; 7] = [
    (1, 1, 1, 1, 2, 2, [1, 0, 0]),
    (2, 7, 3, 5, 6, 6, [1, 1, 1]),
    (3, 11, 6, 2, 80, 32, [4, 6, 6]),
    (2, 9, 7, 3, 92, 92, [0, 23, 23]),
    (2, 64, 28, 4, 128, 128, [16, 24, 24]),
    (1, 257, 2, 2, 128, 80, [20, 20, 0]),
    (2, 33, 4, 2, 64, 64, [8, 8, 16]),
];

/// One GPU case of multimodal tables, in a form of `FORM_BITS`: forward and backward, in
/// place and out of place, against the reference.
fn run_multimodal_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    shape: MultimodalShape,
    bits: (bool, bool, bool),
    ids_form: Option<Form>,
    seed: u64,
) {
    let (b, s, hq, hk, d, r, sections) = shape;
    let args = in_form(
        RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r),
        bits,
    );
    let desc = format!(
        "B={b} S={s} Hq={hq} Hk={hk} d={d} r={r} sections={sections:?} {} (interleaved, half, \
         head-major) = {bits:?} ids={ids_form:?} seed={seed}",
        T::NAME
    );
    let mut rng = Rng::new(seed);
    // Three [B, S, r] tables, or one [max_pos, r] table and [3, B, S] ids into it.
    let max_pos = 50;
    let ids: Vec<i64> = (0..3 * b * s)
        .map(|_| (rng.next_u64() % max_pos) as i64)
        .collect();
    let (cos, sin) = match ids_form {
        None => multimodal_tables::<T>(&mut rng, b * s, r),
        Some(_) => cos_sin::<T>(&(0..max_pos as i64).collect::<Vec<_>>(), r, true),
    };
    let (cos, sin) = (table_in_form(&args, &cos), table_in_form(&args, &sin));
    let (cos_d, sin_d) = (upload(stream, &cos), upload(stream, &sin));
    let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let (ids32_d, ids64_d) = (upload_ids(stream, &ids32), upload_ids(stream, &ids));
    let position_ids = match ids_form {
        Some(Form::Ids32) => PositionIds::DeviceI32(ids32_d.as_view()),
        Some(Form::Host) => PositionIds::Host(&ids),
        _ => PositionIds::DeviceI64(ids64_d.as_view()),
    };
    let layout = match ids_form {
        None => CosSinLayout::Multimodal { sections },
        Some(_) => CosSinLayout::MultimodalGathered {
            sections,
            position_ids,
        },
    };
    let ref_rows = match ids_form {
        None => CosSinRows::Multimodal { sections },
        Some(_) => CosSinRows::MultimodalGathered {
            sections,
            ids: &ids,
        },
    };
    check_directions(
        stream,
        &args,
        (&cos, &sin, &cos_d, &sin_d),
        (ref_rows, &layout),
        &mut rng,
        &desc,
    );
}

fn multimodal_sweep<T: Dtype>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for (i, &(b, s, hq, hk, d, r, sections)) in MULTIMODAL_SHAPES.iter().enumerate() {
        // Sanitizer-sized: at most 9 positions.
        let shape = (b, sized(s, s.min(9)), hq, hk, d, r, sections);
        // The default form on every shape, and the other forms rotating with the shape; the
        // three tables, and one table through i32, i64 and host ids.
        let gathered = [Form::Ids32, Form::Ids64, Form::Host][i % 3];
        for (j, bits) in [FORM_BITS[0], FORM_BITS[1 + i % (FORM_BITS.len() - 1)]]
            .into_iter()
            .enumerate()
        {
            for ids_form in [None, Some(gathered)] {
                let seed = seed_base + 8 * i as u64 + 2 * j as u64 + ids_form.is_some() as u64;
                failures.run(|| run_multimodal_case::<T>(&stream, shape, bits, ids_form, seed));
            }
        }
    }
    failures.finish();
}

#[test]
fn gpu_multimodal_matches_reference_f32() {
    multimodal_sweep::<f32>("gpu_multimodal_matches_reference_f32", 80_000);
}

#[test]
fn gpu_multimodal_matches_reference_f16() {
    multimodal_sweep::<f16>("gpu_multimodal_matches_reference_f16", 81_000);
}

#[test]
fn gpu_multimodal_matches_reference_bf16() {
    multimodal_sweep::<bf16>("gpu_multimodal_matches_reference_bf16", 82_000);
}

#[test]
fn multimodal_rejects_bad_sections_and_tables() {
    let test = "multimodal_rejects_bad_sections_and_tables";
    let Some(stream) = gpu(test) else { return };
    let args = RopeArgs::new(8).with_seq_len(2);
    let (mut q, mut k) = (
        upload(&stream, &[0.5f32; 16]),
        upload(&stream, &[0.5f32; 16]),
    );
    let table = upload(&stream, &[1.0f32; 48]);
    let short = upload(&stream, &[1.0f32; 32]);
    let bad = CosSinLayout::Multimodal {
        sections: [2, 2, 1],
    };
    expect_invalid(
        rope_forward(&stream, &args, &mut q, &mut k, &table, &table, &bad),
        "layout.sections",
        "summing to rotary_dim / 2 = 4",
    );
    let ok = CosSinLayout::Multimodal {
        sections: [2, 2, 0],
    };
    expect_invalid(
        rope_backward(&stream, &args, &mut q, &mut k, &short, &short, &ok),
        "cos",
        "length 48 (3 × batch × seq_len × rotary_dim)",
    );
    rope_forward(&stream, &args, &mut q, &mut k, &table, &short, &ok)
        .map(|()| panic!("a short sin was accepted"))
        .unwrap_or_else(|e| assert!(e.to_string().contains("`sin`"), "{e}"));
    // [3, B, S] ids into one table: 6 of them, each a row of the 6-row table.
    let ids = upload_ids(&stream, &[0i64, 1, 2, 3, 4]);
    let gathered = |position_ids| CosSinLayout::MultimodalGathered {
        sections: [2, 1, 1],
        position_ids,
    };
    expect_invalid(
        rope_forward(
            &stream,
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            &gathered(PositionIds::DeviceI64(ids.as_view())),
        ),
        "position_ids",
        "length 6 (3 × batch × seq_len)",
    );
    let host = [0i64, 1, 2, 3, 4, 6];
    expect_invalid(
        rope_forward(
            &stream,
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            &gathered(PositionIds::Host(&host)),
        ),
        "position_ids",
        "position_ids[5] = 6",
    );
    assert_eq!(download(&stream, &q), vec![0.5f32; 16]);
}
