//! The CPU reference: hand-computed rows, cast points, finite differences, rejected input.
use super::*;

#[test]
fn reference_matches_hand_computed_values() {
    // x = [3, 4]: mean square 12.5, r = 1/√12.5; w = [1, 2].
    let r = 1.0 / 12.5f64.sqrt();
    let args = RmsNormArgs::new(1, 2).with_eps(0.0);
    let out = ref_forward(&args, &[3.0f64, 4.0], Some(&[1.0, 2.0])).unwrap();
    assert_eq!(out.rstd, vec![r]);
    assert_eq!(out.y, vec![3.0 * r, 8.0 * r]);
    // offset 1 (Gemma-style weights): y = x·r·(1 + w).
    let gemma = args.with_offset(1.0).with_mode(CastingMode::Gemma);
    let out = ref_forward(&gemma, &[3.0f64, 4.0], Some(&[1.0, 2.0])).unwrap();
    assert_eq!(out.y, vec![6.0 * r, 12.0 * r]);
    // eps enters under the root: x = [0, 0], eps = 0.25 → r = 2, y = 0.
    let out = ref_forward(&args.with_eps(0.25), &[0.0f64, 0.0], None).unwrap();
    assert_eq!((out.rstd, out.y), (vec![2.0], vec![0.0, 0.0]));
    // In f32 the stored rstd is the f32 rounding of 1/√12.5.
    let out = ref_forward(&args, &[3.0f32, 4.0], None).unwrap();
    assert_eq!(out.rstd, vec![r as f32]);
}

#[test]
fn reference_cast_points_differ_by_mode_as_specified() {
    // bf16, x = 1.5, one column: r = 1/1.5 (f32). x·r rounds to 1 in bf16;
    // weight 1 + 2^-7 (exact in bf16). llama: D(D(x·r)·w) = D(1·w) = w.
    // gemma: D(x·r·w) with x·r = 1.5·f32(1/1.5) ≠ 1 exactly, times w, rounded once.
    let x = [bf16::from_f32(1.5)];
    let w = [bf16::from_f32(1.0 + 1.0 / 128.0)];
    let args = |mode| RmsNormArgs::new(1, 1).with_eps(0.0).with_mode(mode);
    let llama = ref_forward(&args(CastingMode::Llama), &x, Some(&w)).unwrap();
    let gemma = ref_forward(&args(CastingMode::Gemma), &x, Some(&w)).unwrap();
    let none = ref_forward(&args(CastingMode::None), &x, Some(&w)).unwrap();
    assert_eq!(llama.y[0], w[0]);
    let r = (1.0f64 / 1.5) as f32 as f64;
    assert_eq!(gemma.y[0], bf16::from_f64(1.5 * r * w[0].to_f64()));
    // none: r itself is a bf16 value.
    assert_eq!(none.rstd[0] as f64, bf16::cast(1.0 / 1.5));
    assert_ne!(none.rstd[0], llama.rstd[0]);
}

#[test]
fn reference_rejects_bad_shapes() {
    let x = [1.0f64; 6];
    let bad = |r: liger_rs::Result<Vec<f64>>, arg: &str| match r {
        Err(Error::InvalidArgument { arg: a, .. }) if a == arg => {}
        other => panic!("expected InvalidArgument for `{arg}`, got {other:?}"),
    };
    let fwd = |args: RmsNormArgs, w: Option<&[f64]>| ref_forward(&args, &x, w).map(|o| o.y);
    bad(fwd(RmsNormArgs::new(1, 4), None), "x");
    bad(fwd(RmsNormArgs::new(3, 2), Some(&[1.0; 3])), "weight");
    bad(fwd(RmsNormArgs::new(6, 0), None), "args.cols");
    bad(
        fwd(RmsNormArgs::new(2, 3).with_strides(4, 3), None),
        "args.x_stride",
    );
    bad(
        fwd(RmsNormArgs::new(2, 3).with_strides(3, 4), None),
        "args.y_stride",
    );
    bad(fwd(RmsNormArgs::new(usize::MAX, 2), None), "args.rows");
    let (args, rstd) = (RmsNormArgs::new(2, 3), [1.0; 2]);
    let bwd = |dy: &[f64], rstd: &[f64]| ref_backward(&args, dy, &x, None, rstd).map(|g| g.dx);
    bad(bwd(&x[..3], &rstd), "dy");
    bad(bwd(&x, &rstd[..1]), "rstd");
}

/// `Σ g·y` for the f64 forward (every cast point is the identity in f64).
fn loss(args: &RmsNormArgs, x: &[f64], w: Option<&[f64]>, g: &[f64]) -> f64 {
    let y = ref_forward(args, x, w).unwrap().y;
    y.iter().zip(g).map(|(a, b)| a * b).sum()
}

#[test]
fn reference_backward_matches_finite_differences() {
    let (rows, cols, h) = (3, 5, 1e-5);
    for (seed, mode, offset, weighted) in [
        (1, CastingMode::Llama, 0.0, true),
        (2, CastingMode::Gemma, 1.0, true),
        (3, CastingMode::None, 0.5, true),
        (4, CastingMode::Llama, 0.0, false),
    ] {
        let mut rng = Rng::new(seed);
        let x: Vec<f64> = rng.vec(rows * cols, 0.0, 1.0);
        let w: Vec<f64> = rng.vec(cols, 1.0, 0.5);
        let g: Vec<f64> = rng.vec(rows * cols, 0.0, 1.0);
        let w = weighted.then_some(&w[..]);
        let args = RmsNormArgs::new(rows, cols)
            .with_eps(1e-3)
            .with_offset(offset)
            .with_mode(mode);
        let fwd = ref_forward(&args, &x, w).unwrap();
        let grads = ref_backward(&args, &g, &x, w, &fwd.rstd).unwrap();
        let case = format!("seed {seed}, {mode}, offset {offset}, weight {weighted}");
        for i in 0..x.len() {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let fd = (loss(&args, &xp, w, &g) - loss(&args, &xm, w, &g)) / (2.0 * h);
            assert!(
                (fd - grads.dx[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                "dx[{i}] {} vs fd {fd}, {case}",
                grads.dx[i]
            );
        }
        match (w, grads.dw) {
            (Some(w), Some(dw)) => {
                for j in 0..cols {
                    let (mut wp, mut wm) = (w.to_vec(), w.to_vec());
                    wp[j] += h;
                    wm[j] -= h;
                    let fd = (loss(&args, &x, Some(&wp), &g) - loss(&args, &x, Some(&wm), &g))
                        / (2.0 * h);
                    assert!(
                        (fd - dw[j]).abs() < 1e-6 * (1.0 + fd.abs()),
                        "dw[{j}] {} vs fd {fd}, {case}",
                        dw[j]
                    );
                }
            }
            (None, None) => {}
            _ => panic!("dw present without weight or missing with one, {case}"),
        }
    }
}

#[test]
fn reference_backward_of_dx_alone_is_the_backwards_dx() {
    let (rows, cols) = (3, 7);
    for (seed, mode, offset) in [
        (11, CastingMode::Llama, 0.0),
        (12, CastingMode::Gemma, 1.0),
        (13, CastingMode::None, 0.5),
    ] {
        let mut rng = Rng::new(seed);
        let x: Vec<bf16> = rng.vec(rows * cols, 0.0, 1.0);
        let w: Vec<bf16> = rng.vec(cols, 1.0, 0.5);
        let dy: Vec<bf16> = rng.vec(rows * cols, 0.0, 1.0);
        let args = RmsNormArgs::new(rows, cols)
            .with_offset(offset)
            .with_mode(mode);
        let rstd = ref_forward(&args, &x, Some(&w)).unwrap().rstd;
        for w in [Some(&w[..]), None] {
            let full = ref_backward(&args, &dy, &x, w, &rstd).unwrap();
            let dx_only = ref_backward_dx(&args, &dy, &x, w, &rstd).unwrap();
            assert_eq!((&dx_only.dx, dx_only.dw), (&full.dx, None), "{mode}");
        }
    }
}
