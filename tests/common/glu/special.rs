//! The GLU suite's special values: extreme gates, NaN and ±∞, offsets past 32 bits.
use super::*;

/// One row of `a`, `b`, `dc` (`args` for `rows = 1`) through the forward and the backward
/// into buffers poisoned with `poison`: `c`, `da`, `db`, each checked against the reference
/// within the sweep's tolerance, widened.
fn one_row<T: Dtype>(
    stream: &Stream,
    op: Op,
    args: &SwigluArgs,
    [a, b, dc]: [&[T]; 3],
    poison: Poison,
    desc: &str,
) -> [Vec<f64>; 3] {
    let n = a.len();
    let (a_d, b_d, dc_d) = (upload(stream, a), upload(stream, b), upload(stream, dc));
    let [mut c_d, mut da_d, mut db_d] = [(); 3].map(|_| poisoned_with::<T>(stream, n, poison));
    glu_call!(
        op,
        swiglu_forward / geglu_forward(stream, args, &a_d, &b_d, &mut c_d)
    )
    .expect(desc);
    glu_call!(
        op,
        swiglu_backward / geglu_backward(stream, args, &dc_d, &a_d, &b_d, &mut da_d, &mut db_d)
    )
    .expect(desc);
    let got = [c_d, da_d, db_d].map(|d| widen(&download(stream, &d)));
    let want_c = op.ref_forward(args, a, b).unwrap();
    let grads = op.ref_backward(args, dc, a, b).unwrap();
    let (gm, dm) = (args.gate_multiplier, args.down_multiplier);
    let [sc, sda, sdb] = slacks(op, a, b, dc, gm, dm);
    assert_close::<T>("c", desc, &got[0], &widen(&want_c), ULPS, &sc);
    assert_close::<T>("da", desc, &got[1], &widen(&grads.da), ULPS, &sda);
    assert_close::<T>("db", desc, &got[2], &widen(&grads.db), ULPS, &sdb);
    got
}

/// Pins the numerics at extreme gates: every listed `a` (f32: ±1e4, the tails where σ is
/// 0/1/subnormal, a sweep of [−120, 120], up to ±f32::MAX; f16/bf16: every finite value).
/// Pass 1 (b = dc = 1, gm = dm = 1): c, da, db finite; for |a| ≥ 200 exactly the limits
/// (c = a or 0, da = 1 or 0, db = a or 0); all within the sweep's tolerance of the reference.
/// Pass 2 (random b, dc; gm = 1.25 so a·gm overflows f32 for the largest bf16/f32 values;
/// dm = 0.5): matches the reference (infinite c only where the true value overflows).
fn extremes<T: Dtype>(stream: &Stream, op: Op, a: Vec<T>) {
    let n = a.len();
    let desc = format!("{op:?} extremes {} n = {n}", T::NAME);
    let mut rng = Rng::new(77);
    for (pass, gm, dm) in [(1, 1.0f32, 1.0f32), (2, 1.25, 0.5)] {
        let (b, dc): (Vec<T>, Vec<T>) = if pass == 1 {
            (vec![T::from_f64(1.0); n], vec![T::from_f64(1.0); n])
        } else {
            (rng.vec(n, 0.0, 1.0), rng.vec(n, 0.0, 1.0))
        };
        let args = SwigluArgs::new(1, n)
            .with_gate_multiplier(gm)
            .with_down_multiplier(dm);
        let case = format!("{desc}, pass {pass}");
        let [c, da, db] = one_row(stream, op, &args, [&a, &b, &dc], Poison::Nan, &case);
        if pass == 1 {
            for i in 0..n {
                let x = a[i].to_f64();
                assert!(
                    c[i].is_finite() && da[i].is_finite() && db[i].is_finite(),
                    "a = {x}: c {} da {} db {}, {case}",
                    c[i],
                    da[i],
                    db[i]
                );
                if x.abs() >= 200.0 {
                    let want = if x > 0.0 {
                        (x, 1.0, x)
                    } else {
                        (0.0, 0.0, 0.0)
                    };
                    assert_eq!((c[i], da[i], db[i]), want, "limits at a = {x}, {case}");
                }
            }
        }
    }
}

/// [`extremes`] for each dtype.
pub fn extreme_gates(op: Op, test: &str) {
    let Some(stream) = gpu(test) else {
        return;
    };
    let mut f32s = vec![0.0f32, -0.0, 1e-30, -1e-30, 1e-45, -1e-45];
    for v in [
        1e4f32,
        1e3,
        200.0,
        150.0,
        104.0,
        100.0,
        90.0,
        88.0,
        87.0,
        50.0,
        20.0,
        1e30,
        1e38,
        f32::MAX,
    ] {
        f32s.extend([v, -v]);
    }
    f32s.extend((0..=2400).map(|i| -120.0 + 0.1 * i as f32));
    let f16s: Vec<f16> = (0..=u16::MAX)
        .map(f16::from_bits)
        .filter(|v| v.is_finite())
        .collect();
    let bf16s: Vec<bf16> = (0..=u16::MAX)
        .map(bf16::from_bits)
        .filter(|v| v.is_finite())
        .collect();
    collect(test, 3, |i| match i {
        0 => extremes(&stream, op, f32s.clone()),
        1 => extremes(&stream, op, f16s.clone()),
        _ => extremes(&stream, op, bf16s.clone()),
    });
}

/// NaN and ±∞ inputs give what the reference gives: NaN propagates, an infinite
/// gate takes the silu limits, an infinite `b` or `dc` multiplies through. Where the
/// reference is NaN a NaN poison would pass unwritten, so the row runs into each poison and
/// the outputs must agree bit for bit ([`assert_written`]).
fn non_finite<T: Dtype>(stream: &Stream, op: Op) {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let rows: [(f64, f64, f64); 8] = [
        (nan, 1.0, 1.0),
        (inf, 1.0, 1.0),
        (-inf, 1.0, 1.0),
        (1.0, nan, 1.0),
        (2.0, inf, 1.0),
        (1.0, 1.0, nan),
        (-3.0, 1.0, inf),
        (0.5, -inf, 0.25),
    ];
    let pick = |f: fn(&(f64, f64, f64)) -> f64| -> Vec<T> {
        rows.iter().map(|r| T::from_f64(f(r))).collect()
    };
    let (a, b, dc) = (pick(|r| r.0), pick(|r| r.1), pick(|r| r.2));
    let n = a.len();
    let args = SwigluArgs::new(1, n);
    let desc = format!("{op:?} non-finite inputs {}", T::NAME);
    let [nan_run, finite_run] =
        [Poison::Nan, Poison::Finite].map(|p| one_row(stream, op, &args, [&a, &b, &dc], p, &desc));
    for (i, what) in ["c", "da", "db"].into_iter().enumerate() {
        assert_written(what, &desc, &nan_run[i], &finite_run[i]);
    }
}

/// [`non_finite`] for each dtype.
pub fn nan_and_inf(op: Op, test: &str) {
    let Some(stream) = gpu(test) else {
        return;
    };
    collect(test, 3, |i| match i {
        0 => non_finite::<f32>(&stream, op),
        1 => non_finite::<f16>(&stream, op),
        _ => non_finite::<bf16>(&stream, op),
    });
}

/// Offsets past 32 bits, fused in place (bf16).
pub fn offsets_beyond_2_pow_32_elements(op: Op, test: &str) {
    // A fused gate-up buffer of 2³² / (2·cols) + 64 rows: over 2³² bf16 elements (8 GiB), c
    // and dc over 2³¹ (4 GiB), so any 32-bit element or byte offset wraps; 14336 columns take
    // the vector kernels, 14337 the scalar ones. All rows are zero except those of
    // `common::sampled_rows`, which hold random data and must match the reference, forward and
    // backward (in place over gate-up): 8-row windows at the start, around gate-up element 2³¹,
    // around c element 2³¹ (gate-up element 2³²) and at the end (the last row), and 256 rows
    // spread over the rest.
    let Some(stream) = gpu_for_huge(test) else {
        return;
    };
    for cols in [14336, 14337] {
        huge_case(&stream, op, cols);
    }
}

fn huge_case(stream: &Stream, op: Op, cols: usize) {
    let (win, width) = (8, 2 * cols);
    let rows = (1usize << 32) / width + 64;
    // Gate-up elements 2³¹ and 2³² (c and dc element 2³¹).
    let data = sampled_rows(rows, win, &[(1 << 31) / width, (1 << 32) / width]);
    let n_data: usize = data.iter().map(|r| r.len()).sum();
    let desc = format!("{op:?} {rows}×{cols} fused bf16, {n_data} rows of data");
    let mut rng = Rng::new(1000 + cols as u64);
    let mut gate_up_d = stream
        .alloc_zeros::<bf16>(rows * width)
        .expect("8 GiB gate-up");
    let mut dc_d = stream.alloc_zeros::<bf16>(rows * cols).expect("4 GiB dc");
    let a: Vec<bf16> = (0..n_data * cols).map(|_| gate_value(&mut rng)).collect();
    let b: Vec<bf16> = rng.vec(n_data * cols, 0.0, 1.0);
    let dc: Vec<bf16> = rng.vec(n_data * cols, 0.0, 1.0);
    let joined = join_gate_up(&a, &b, cols).unwrap();
    upload_rows(stream, &mut gate_up_d, &data, width, &joined);
    upload_rows(stream, &mut dc_d, &data, cols, &dc);
    let data_of = |buf: &CudaSlice<bf16>, w: usize| download_rows(stream, buf, &data, w);
    let args = SwigluArgs::fused(rows, cols);
    let [slack_c, slack_da, slack_db] = slacks(op, &a, &b, &dc, 1.0, 1.0);

    let mut c_d = poisoned_on_device::<bf16>(stream, rows * cols);
    glu_call!(
        op,
        swiglu_forward_fused / geglu_forward_fused(stream, &args, &gate_up_d, &mut c_d)
    )
    .expect(&desc);
    let ref_args = SwigluArgs::new(a.len() / cols, cols);
    let want_c = widen(&op.ref_forward(&ref_args, &a, &b).unwrap());
    let got_c = widen(&data_of(&c_d, cols));
    assert_close::<bf16>("c", &desc, &got_c, &want_c, ULPS, &slack_c);

    glu_call!(
        op,
        swiglu_backward_fused_inplace
            / geglu_backward_fused_inplace(stream, &args, &dc_d, &mut gate_up_d)
    )
    .expect(&desc);
    let (da, db) = split_gate_up(&data_of(&gate_up_d, width), cols).unwrap();
    let grads = op.ref_backward(&ref_args, &dc, &a, &b).unwrap();
    assert_close::<bf16>("da", &desc, &widen(&da), &widen(&grads.da), ULPS, &slack_da);
    assert_close::<bf16>("db", &desc, &widen(&db), &widen(&grads.db), ULPS, &slack_db);
}
