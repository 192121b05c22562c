//! Every cos/sin form (interleaved pairs, half-width tables, head-major) in and out of place.
use super::*;

/// `(interleaved, half_tables, head_major)`: every combination, the default first.
pub(super) const FORM_BITS: [(bool, bool, bool); 8] = [
    (false, false, false),
    (true, false, false),
    (false, true, false),
    (false, false, true),
    (true, true, false),
    (true, false, true),
    (false, true, true),
    (true, true, true),
];

pub(super) fn in_form(
    args: RopeArgs,
    (interleaved, half, head_major): (bool, bool, bool),
) -> RopeArgs {
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
pub(super) fn table_in_form<T: Copy>(args: &RopeArgs, hf: &[T]) -> Vec<T> {
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
fn run_form_case<T: Dtype, C: CosSinDtype<T>>(
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
         {bits:?} poisoned-unread-entries={poison} seed={seed} ({} tables)",
        T::NAME,
        C::NAME
    );
    let mut rng = Rng::new(seed);
    let t = Tables::<C>::new(stream, &args, rows, poison, &mut rng);
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
pub(super) fn check_directions<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    (cos, sin, cos_d, sin_d): (&[C], &[C], &CudaSlice<C>, &CudaSlice<C>),
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
                rope_backward as Rotate<T, C>,
                rope_backward_into as RotateInto<T, C>,
            )
        } else {
            (
                ["q", "k"],
                rope_forward as Rotate<T, C>,
                rope_forward_into as RotateInto<T, C>,
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

type Rotate<T, C> = fn(
    &Arc<CudaStream>,
    &RopeArgs,
    &mut CudaSlice<T>,
    &mut CudaSlice<T>,
    &CudaSlice<C>,
    &CudaSlice<C>,
    &CosSinLayout<'_>,
) -> liger_rs::Result<()>;

type RotateInto<T, C> = fn(
    &Arc<CudaStream>,
    &RopeArgs,
    &CudaSlice<T>,
    &CudaSlice<T>,
    &CudaSlice<C>,
    &CudaSlice<C>,
    &CosSinLayout<'_>,
    &mut CudaSlice<T>,
    &mut CudaSlice<T>,
) -> liger_rs::Result<()>;

/// Every shape in every form, the row source rotating with shape and form.
fn form_sweep<T: Dtype, C: CosSinDtype<T>>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for (i, &shape) in FORM_SHAPES.iter().enumerate() {
        for (j, &bits) in FORM_BITS.iter().enumerate() {
            let rows = FORMS[(i + j) % FORMS.len()];
            let seed = seed_base + (i * FORM_BITS.len() + j) as u64;
            failures.run(|| run_form_case::<T, C>(&stream, shape, rows, bits, seed));
        }
    }
    failures.finish();
}

#[test]
fn gpu_forms_in_and_out_of_place_match_reference_f32() {
    form_sweep::<f32, f32>("gpu_forms_in_and_out_of_place_match_reference_f32", 50_000);
}

#[test]
fn gpu_forms_in_and_out_of_place_match_reference_f16() {
    form_sweep::<f16, f16>("gpu_forms_in_and_out_of_place_match_reference_f16", 51_000);
}

#[test]
fn gpu_forms_in_and_out_of_place_match_reference_bf16() {
    form_sweep::<bf16, bf16>("gpu_forms_in_and_out_of_place_match_reference_bf16", 52_000);
}

#[test]
fn gpu_forms_with_f32_tables_match_reference_f16() {
    form_sweep::<f16, f32>("gpu_forms_with_f32_tables_match_reference_f16", 53_000);
}

#[test]
fn gpu_forms_with_f32_tables_match_reference_bf16() {
    form_sweep::<bf16, f32>("gpu_forms_with_f32_tables_match_reference_bf16", 54_000);
}
