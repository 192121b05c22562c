//! Shapes that mean something else in candle-nn, and arguments the candle layers refuse: each
//! call either computes what candle-nn computes or returns an error that names the argument.
use super::*;

/// candle-nn's tables are `[t, d/2]`, HF's `[t, d]` (`cat(freqs, freqs)`). Each API either
/// computes what a shape means in candle-nn or says why it will not.
#[test]
fn half_width_table_trap_is_impossible() {
    let cpu = Device::Cpu;
    let mut rng = Rng::new(41);
    let (b, h, t, d) = (2, 3, 6, 8);
    let f32_ = DType::F32;
    let xs = randn(&mut rng, &[b, h, t, d], 1.0, f32_, &cpu);
    let thd = xs.transpose(1, 2).unwrap().contiguous().unwrap(); // [b, t, h, d]
    let angles = randn(&mut rng, &[t, d / 2], 2.0, f32_, &cpu);
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let full = |x: &Tensor| Tensor::cat(&[x, x], D::Minus1).unwrap(); // HF's [t, d]
    let (cos_full, sin_full) = (full(&cos), full(&sin));

    // nn: a full-width table is an error naming the fix.
    for (name, f, x) in [
        (
            "rope",
            rotary_emb::rope as fn(&Tensor, &Tensor, &Tensor) -> _,
            &xs,
        ),
        ("rope_i", rotary_emb::rope_i, &xs),
        ("rope_thd", rotary_emb::rope_thd, &thd),
    ] {
        expect_err(
            name,
            f(x, &cos_full, &sin_full),
            &[name, "one value per pair", "full-width", "[6, 8]"],
        );
        // Fewer rows than positions; per-batch tables of another length; a 4-D table.
        expect_err(
            name,
            f(
                x,
                &cos.narrow(0, 0, t - 1).unwrap(),
                &sin.narrow(0, 0, t - 1).unwrap(),
            ),
            &["5 rows", "6 positions"],
        );
        let per = randn(&mut rng, &[b, t + 1, d / 2], 1.0, f32_, &cpu);
        expect_err(
            name,
            f(x, &per, &per),
            &["per-batch", "[2, 6, 4]", "[2, 7, 4]"],
        );
        let one = randn(&mut rng, &[1, t, d / 2], 1.0, f32_, &cpu);
        expect_err(name, f(x, &one, &one), &["per-batch", "[1, 6, 4]"]);
        let four = randn(&mut rng, &[1, 1, t, d / 2], 1.0, f32_, &cpu);
        expect_err(name, f(x, &four, &four), &["[t, d/2] or [b, t, d/2]"]);
    }
    // A longer 2-D table: its first t rows, as candle-nn reads it.
    let extra = randn(&mut rng, &[3, d / 2], 1.0, f32_, &cpu);
    let long = |x: &Tensor| Tensor::cat(&[x, &extra], 0).unwrap();
    let got = rotary_emb::rope(&xs, &long(&cos), &long(&sin)).unwrap();
    let want = rotary_emb::rope(&xs, &cos, &sin).unwrap();
    assert_eq!(f64s(&got), f64s(&want), "first t rows of a longer table");

    // liger_rs::candle::rope (HF's [B, S, H, d] q and k): a [S, d/2] table would be a partial
    // rotary of d/2 with HF's full-width rows, or candle-nn's full rotation: it is an error
    // until the config says which.
    let k = thd.narrow(2, 0, 1).unwrap().contiguous().unwrap();
    expect_err(
        "rope",
        rope(&thd, &k, &cos, &sin, None),
        &["ambiguous", "half_tables", "with_rotary_dim(4)"],
    );
    // Said as candle-nn's table: candle-nn's meaning, rope_thd's result.
    let cfg = RopeConfig::default().with_half_tables();
    let (q2, k2) = rope_with(&thd, &k, &cos, &sin, None, &cfg).unwrap();
    assert_eq!(
        f64s(&q2),
        f64s(&rotary_emb::rope_thd(&thd, &cos, &sin).unwrap())
    );
    assert_eq!(
        f64s(&k2),
        f64s(&rotary_emb::rope_thd(&k, &cos, &sin).unwrap())
    );
    // Said as a partial rotary: the first d/2 dims rotate by HF's full-width rows of d/2,
    // i.e. pair i is (x[i], x[i + d/4]); the last d/2 dims stay.
    let cfg = RopeConfig::default().with_rotary_dim(d / 2);
    let (q3, _) = rope_with(&thd, &k, &cos, &sin, None, &cfg).unwrap();
    let head = thd.narrow(3, 0, d / 2).unwrap().contiguous().unwrap();
    let quarter = |x: &Tensor| x.narrow(1, 0, d / 4).unwrap();
    let want = rotary_emb::rope_thd(&head, &quarter(&cos), &quarter(&sin)).unwrap();
    assert_eq!(
        f64s(&q3.narrow(3, 0, d / 2).unwrap()),
        f64s(&want),
        "partial rotary"
    );
    assert_eq!(
        f64s(&q3.narrow(3, d / 2, d / 2).unwrap()),
        f64s(&thd.narrow(3, d / 2, d / 2).unwrap()),
        "the tail passes through"
    );
    // Rows that fit neither reading of the config are errors.
    let half = RopeConfig::default().with_half_tables();
    let (c, s) = (&cos_full, &sin_full);
    expect_err(
        "rope_with",
        rope_with(&thd, &k, c, s, None, &half),
        &["rotary_dim"],
    );
    let cfg = RopeConfig::default().with_rotary_dim(d);
    expect_err(
        "rope_with",
        rope_with(&thd, &k, &cos, &sin, None, &cfg),
        &["must be 8 long", "full-width", "rotary_dim = 8"],
    );
}

#[test]
fn linear_errors_name_the_argument() {
    let dev = Device::Cpu;
    let z = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &dev).unwrap();
    let w = z(&[3, 4], DType::F32);
    expect_err(
        "x of another width",
        linear(&z(&[2, 5], DType::F32), &w, None),
        &["x must be [..., 4]", "[3, 4]", "[2, 5]"],
    );
    expect_err(
        "a scalar x",
        linear(&z(&[], DType::F32), &w, None),
        &["x must be [..., 4]"],
    );
    expect_err(
        "a weight of rank 3",
        linear(&z(&[2, 4], DType::F32), &z(&[1, 3, 4], DType::F32), None),
        &["weight must be [out, in]"],
    );
    expect_err(
        "a bias of another length",
        linear(&z(&[2, 4], DType::F32), &w, Some(&z(&[4], DType::F32))),
        &["bias must be [3]", "[4]"],
    );
    expect_err(
        "a weight of another dtype",
        linear(&z(&[2, 4], DType::F32), &z(&[3, 4], DType::F64), None),
        &["weight is F64, x is F32"],
    );
    expect_err(
        "a bias of another dtype",
        linear(&z(&[2, 4], DType::F32), &w, Some(&z(&[3], DType::BF16))),
        &["bias is BF16, x is F32"],
    );
}

#[test]
fn mlp_errors_name_the_argument() {
    let dev = Device::Cpu;
    let z = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &dev).unwrap();
    let (x, gu, down) = (
        z(&[2, 4], DType::F32),
        z(&[6, 4], DType::F32),
        z(&[4, 3], DType::F32),
    );
    expect_err(
        "an odd gate-up height",
        swiglu_mlp(&x, &z(&[5, 4], DType::F32), &down),
        &["gate_up_weight must be [2·inter, hidden]", "[5, 4]"],
    );
    expect_err(
        "a gate-up weight of rank 1",
        swiglu_mlp(&x, &z(&[6], DType::F32), &down),
        &["gate_up_weight must be"],
    );
    expect_err(
        "a down weight of the gate-up's shape",
        swiglu_mlp(&x, &gu, &z(&[3, 4], DType::F32)),
        &["down_weight must be [4, 3]", "[3, 4]"],
    );
    expect_err(
        "x of another width",
        swiglu_mlp(&z(&[2, 5], DType::F32), &gu, &down),
        &["x must be [..., 4]", "[2, 5]"],
    );
    expect_err(
        "a scalar x",
        swiglu_mlp(&z(&[], DType::F32), &gu, &down),
        &["x must be [..., 4]"],
    );
    expect_err(
        "a down weight of another dtype",
        swiglu_mlp(&x, &gu, &z(&[4, 3], DType::BF16)),
        &["down_weight is BF16, x is F32"],
    );
}
