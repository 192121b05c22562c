//! GPU kernels against the reference: the shape sweep, every form and dtype, grid-stride
//! walks, misaligned views, clamped device ids, offsets beyond 2³² elements, special values.
use super::*;

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
pub(super) enum Form {
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

pub(super) const FORMS: [Form; 5] = [
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
pub(super) fn check<T: Element>(
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
fn run_case<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    shape: (usize, usize, usize, usize, usize, usize),
    form: Form,
    poison: bool,
    seed: u64,
) {
    let (b, s, hq, hk, d, r) = shape;
    let desc = format!(
        "B={b} S={s} Hq={hq} Hk={hk} d={d} r={r} {} ({} tables) {form:?} \
         poisoned-second-half={poison} seed={seed}",
        T::NAME,
        C::NAME
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
    let t = Tables::<C>::new(stream, &args, form, poison, &mut rng);
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

pub(super) fn upload_ids<I: liger_rs::cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    ids: &[I],
) -> CudaSlice<I> {
    stream.clone_htod(ids).expect("upload ids")
}

/// The positions of the cos/sin rows of `rows` for `b × s` tokens, and the position ids of
/// the gathered forms (empty otherwise): per position 0..S; per batch token `t` at `3t + 1`
/// (every batch row its own rows); gathered a table of positions 0..S + 5 and packed-sequence
/// ids drawn from `rng`.
pub(super) fn form_positions(
    rows: Form,
    b: usize,
    s: usize,
    rng: &mut Rng,
) -> (Vec<i64>, Vec<i64>) {
    match rows {
        Form::PerPosition => ((0..s as i64).collect(), vec![]),
        Form::PerBatch => ((0..(b * s) as i64).map(|t| 3 * t + 1).collect(), vec![]),
        _ => ((0..s as i64 + 5).collect(), packed_ids(rng, b, s)),
    }
}

/// Runs every shape with a form that rotates with the shape and the dtype (so each dtype
/// sees every form on several shapes); every other case poisons the second half of the
/// cos/sin rows. All failures are collected and reported together.
fn sweep<T: Dtype, C: CosSinDtype<T>>(test: &str, dtype_index: usize, seed_base: u64) {
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
        failures.run(|| run_case::<T, C>(&stream, sweep_shape(i), form, poison, seed));
    }
    failures.finish();
}

#[test]
fn gpu_matches_reference_f32() {
    sweep::<f32, f32>("gpu_matches_reference_f32", 0, 10_000);
}

#[test]
fn gpu_matches_reference_f16() {
    sweep::<f16, f16>("gpu_matches_reference_f16", 1, 20_000);
}

#[test]
fn gpu_matches_reference_bf16() {
    sweep::<bf16, bf16>("gpu_matches_reference_bf16", 2, 30_000);
}

#[test]
fn gpu_f32_tables_match_reference_f16() {
    sweep::<f16, f32>("gpu_f32_tables_match_reference_f16", 1, 60_000);
}

#[test]
fn gpu_f32_tables_match_reference_bf16() {
    sweep::<bf16, f32>("gpu_f32_tables_match_reference_bf16", 2, 61_000);
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
                run_case::<f32, f32>(&stream, shape, form, poison, seed);
                run_case::<f16, f16>(&stream, shape, form, poison, seed);
                run_case::<bf16, bf16>(&stream, shape, form, poison, seed);
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
        run_case::<f32, f32>(&stream, shape, form, f == 1, 45_000 + f as u64);
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
