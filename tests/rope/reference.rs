//! The CPU reference: hand-computed rotations, form selection, rounding, finite differences,
//! its own inverse, partial rotary, rejected input.
use super::*;

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
pub(super) const SMALL: [(usize, usize, usize, usize, usize, usize); 3] =
    [(2, 3, 3, 1, 6, 4), (1, 4, 1, 2, 4, 4), (2, 2, 2, 2, 8, 2)];

/// The cos/sin table (f64) and position ids for form index `f` (0 per position, 1 per batch,
/// 2 gathered): [`form_positions`]' rows.
pub(super) fn f64_tables(
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

pub(super) fn form(f: usize, ids: &[i64]) -> CosSinRows<'_> {
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

#[test]
fn the_gpu_check_fails_tables_rounded_to_the_element_type() {
    // The GPU tests' f32-table cases would catch a kernel that rounds f32 tables to bf16
    // first: `check`'s ulps are relative to each result, and `x1·c − x2·s` cancels.
    let (s, h, d) = (64, 4, 64);
    let args = RopeArgs::new(d).with_seq_len(s).with_heads(h, h);
    let mut rng = Rng::new(77);
    let q: Vec<bf16> = uniform(&mut rng, s * h * d);
    let k: Vec<bf16> = uniform(&mut rng, s * h * d);
    let (cos, sin) = cos_sin::<f32>(&(0..s as i64).collect::<Vec<_>>(), d, false);
    let rotate = |c: &[f32], sn: &[f32]| {
        let (mut qr, mut kr) = (q.clone(), k.clone());
        ref_forward(&args, &mut qr, &mut kr, c, sn, CosSinRows::PerPosition).unwrap();
        qr
    };
    let round = |t: &[f32]| -> Vec<f32> { t.iter().map(|&v| bf16::from_f32(v).to_f32()).collect() };
    let want = rotate(&cos, &sin);
    let rounded = rotate(&round(&cos), &round(&sin));
    check("q", "f32 tables", &want, &want, &q, d, d);
    let caught = std::panic::catch_unwind(|| check("q", "rounded", &rounded, &want, &q, d, d));
    assert!(
        caught.is_err(),
        "check passed the result of bf16-rounded tables"
    );
}
