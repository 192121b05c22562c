//! q and k as views into one fused QKV buffer (row strides).
use super::*;

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
fn run_fused_case<T: Dtype, C: CosSinDtype<T>>(
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
         half-width tables={half} seed={seed} ({} tables)",
        T::NAME,
        C::NAME
    );
    let mut rng = Rng::new(seed);
    let t = Tables::<C>::new(stream, &args, rows, seed.is_multiple_of(2), &mut rng);
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

fn fused_sweep<T: Dtype, C: CosSinDtype<T>>(test: &str, seed_base: u64) {
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
            failures.run(|| run_fused_case::<T, C>(&stream, shape, rows, form, seed));
        }
    }
    failures.finish();
}

#[test]
fn gpu_fused_qkv_views_match_reference_f32() {
    fused_sweep::<f32, f32>("gpu_fused_qkv_views_match_reference_f32", 70_000);
}

#[test]
fn gpu_fused_qkv_views_match_reference_f16() {
    fused_sweep::<f16, f16>("gpu_fused_qkv_views_match_reference_f16", 71_000);
}

#[test]
fn gpu_fused_qkv_views_match_reference_bf16() {
    fused_sweep::<bf16, bf16>("gpu_fused_qkv_views_match_reference_bf16", 72_000);
}

#[test]
fn gpu_fused_qkv_views_with_f32_tables_match_reference_f16() {
    fused_sweep::<f16, f32>(
        "gpu_fused_qkv_views_with_f32_tables_match_reference_f16",
        73_000,
    );
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
