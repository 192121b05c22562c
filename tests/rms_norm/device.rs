//! GPU kernels against the reference: every path, dtype, mode and shape class the host picks, determinism, in place, streams.
use super::*;

/// (rows, cols): 1×1, odd and prime widths, just above powers of two, the 65536 widest
/// one-pass row and wider rows (chunked), Llama widths and 16384, and row counts that are
/// multiples of nothing in particular.
const SHAPES: [(usize, usize); 25] = [
    (1, 1),
    (3, 1),
    (1, 3),
    (2, 41),
    (7, 123),
    (257, 33),
    (64, 96),
    (31, 100),
    (9, 257),
    (5, 1025),
    (13, 2047),
    (1, 2048),
    (33, 4096),
    (3, 4097),
    (6, 5120),
    (17, 8193),
    (5, 11008),
    (4, 16385),
    (3, 16384),
    (2, 32769),
    (2, 65536),
    (1, 65537),
    (3, 100_003),
    (1000, 64),
    (129, 2048),
];

struct Case {
    rows: usize,
    cols: usize,
    mode: CastingMode,
    weighted: bool,
    /// Whether `dw` is given (with a weight; without it the weight is frozen).
    dw: bool,
    inplace: bool,
    offset: f32,
    seed: u64,
}

/// Case `c` on random data: in every row, or with the small shapes, for a case of more than
/// 2²⁰ elements, in a few windows of rows ([`DataRows`]: the row count, which picks the kernel
/// and grid, stays).
fn run_case<T: Dtype>(stream: &std::sync::Arc<liger_rs::cudarc::driver::CudaStream>, c: &Case) {
    let desc = format!(
        "{}×{} {} {} weight={} dw={} inplace={} offset={} seed={}",
        c.rows,
        c.cols,
        T::NAME,
        c.mode,
        c.weighted,
        c.dw,
        c.inplace,
        c.offset,
        c.seed
    );
    let data = DataRows::of(c.rows, c.cols);
    let mut rng = Rng::new(c.seed);
    let x: Vec<T> = data.vec(&mut rng, c.cols, 0.0, 2.0);
    let w: Vec<T> = rng.vec(c.cols, if c.offset == 0.0 { 1.0 } else { 0.0 }, 0.5);
    let dy: Vec<T> = data.vec(&mut rng, c.cols, 0.0, 1.0);
    check_case(stream, c, &data, &x, &w, &dy, 1e-6, &desc);
}

/// Runs the forward and backward of case `c` (its shape, mode, weight, dW or a frozen weight,
/// offset, in place or not) on the given data with `eps` and checks every output against the
/// reference: the rows of `data` against the reference on those rows, the other (zero) rows
/// exactly (y and dx zero, rstd the reference's for a zero row; in place, where dy's zero rows
/// hold ones, dx against the reference of such a row); zero rows add nothing to dW.
/// Where the reference holds NaN the case runs again into finite poison (see
/// [`assert_written`]).
#[allow(clippy::too_many_arguments)]
fn check_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    c: &Case,
    data: &DataRows,
    x: &[T],
    w: &[T],
    dy: &[T],
    eps: f32,
    desc: &str,
) {
    let cols = c.cols;
    let args = RmsNormArgs::new(c.rows, c.cols)
        .with_mode(c.mode)
        .with_offset(c.offset)
        .with_eps(eps);
    let [ulps_y, ulps_r, ulps_g] = ulps::<T>(c.mode);
    // In place, dy's zero rows hold ones (x's stay zero, so they add nothing to dW): a row the
    // backward leaves untouched keeps its ones instead of passing for the zero dx of a zero dy.
    let ones_in_place = c.inplace && !data.are_all();
    let dy_ones;
    let dy_in = if ones_in_place {
        let mut v = dy.to_vec();
        data.fill_zero_rows(&mut v, cols, cols, T::from_f64(1.0));
        dy_ones = v;
        &dy_ones[..]
    } else {
        dy
    };
    let got = launch_case(stream, c, &args, [x, w, dy_in], Poison::Nan, desc);

    let (x_c, dy_c) = (
        data.compact(x, cols, cols, 0),
        data.compact(dy, cols, cols, 0),
    );
    let weight_host = c.weighted.then_some(w);
    // The reference runs on the data rows only.
    let mut data_args = args;
    data_args.rows = x_c.len() / cols;
    let want = ref_forward(&data_args, &x_c, weight_host).unwrap();
    let rstd_c = data.compact(&got.rstd, 1, 1, 0);
    let rstd_gpu = widen(&rstd_c);
    let y_got = widen(&data.compact(&got.y, cols, cols, 0));
    assert_close::<T>("y", desc, &y_got, &widen(&want.y), ulps_y, &[]);
    assert_close::<T>("rstd", desc, &rstd_gpu, &widen(&want.rstd), ulps_r, &[]);
    if !data.are_all() {
        data.assert_zero_rows("y", desc, &got.y, cols, cols, 0);
        let zero_row = vec![T::from_f64(0.0); cols];
        let mut one_row = args;
        one_row.rows = 1;
        let zero = ref_forward(&one_row, &zero_row, weight_host).unwrap();
        let got: Vec<f64> = data.zero_rows().map(|r| got.rstd[r] as f64).collect();
        let want = vec![zero.rstd[0] as f64; got.len()];
        assert_close::<T>("rstd of zero rows", desc, &got, &want, ulps_r, &[]);
    }

    let backward = if got.dw.is_some() {
        ref_backward
    } else {
        ref_backward_dx
    };
    let grads = backward(&data_args, &dy_c, &x_c, weight_host, &rstd_c).unwrap();
    assert_eq!(grads.dw.is_some(), got.dw.is_some(), "{desc}");
    let (dx_slack, dw_slack) =
        grad_slack(&dy_c, None, &x_c, weight_host, &rstd_gpu, cols, c.offset);
    let dx_got = widen(&data.compact(&got.dx, cols, cols, 0));
    assert_close::<T>("dx", desc, &dx_got, &widen(&grads.dx), ulps_g, &dx_slack);
    if ones_in_place {
        check_ones_rows(c, &args, data, weight_host, &got, desc);
    } else {
        data.assert_zero_rows("dx", desc, &got.dx, cols, cols, 0);
    }
    if let (Some(got_dw), Some(want_dw)) = (&got.dw, &grads.dw) {
        let (got_dw, want_dw) = (widen(got_dw), widen(want_dw));
        assert_close::<T>("dw", desc, &got_dw, &want_dw, ulps_g, &dw_slack);
    }

    let nan = |v: &[T]| v.iter().any(|e| e.to_f64().is_nan());
    let nan_wanted = nan(&want.y)
        || want.rstd.iter().any(|r| r.is_nan())
        || nan(&grads.dx)
        || grads.dw.as_deref().is_some_and(nan);
    if nan_wanted {
        let again = launch_case(stream, c, &args, [x, w, dy_in], Poison::Finite, desc);
        assert_written("y", desc, &got.y, &again.y);
        assert_written("rstd", desc, &got.rstd, &again.rstd);
        assert_written("dx", desc, &got.dx, &again.dx);
        if let (Some(dw), Some(dw_again)) = (&got.dw, &again.dw) {
            assert_written("dw", desc, dw, dw_again);
        }
    }
}

/// Checks the in-place dx of the zero rows of case `c`, whose dy holds ones there, against
/// the reference for one row of x = 0 and dy = 1 at that row's rstd; a row with the bits and
/// rstd of the row checked last had the same inputs, so it is not compared again.
fn check_ones_rows<T: Dtype>(
    c: &Case,
    args: &RmsNormArgs,
    data: &DataRows,
    w: Option<&[T]>,
    got: &Outputs<T>,
    desc: &str,
) {
    let cols = c.cols;
    let mut one_row = *args;
    one_row.rows = 1;
    let (x0, ones) = (vec![T::from_f64(0.0); cols], vec![T::from_f64(1.0); cols]);
    let ulps_g = ulps::<T>(c.mode)[2];
    let row = |r: usize| &got.dx[r * cols..(r + 1) * cols];
    let same = |a: &[T], b: &[T]| {
        a.iter()
            .zip(b)
            .all(|(u, v)| u.to_f64().to_bits() == v.to_f64().to_bits())
    };
    let mut last: Option<usize> = None;
    for r in data.zero_rows() {
        let rstd = got.rstd[r];
        if let Some(l) = last
            && got.rstd[l].to_bits() == rstd.to_bits()
            && same(row(l), row(r))
        {
            continue;
        }
        let want = ref_backward_dx(&one_row, &ones, &x0, w, &[rstd]).unwrap();
        let (slack, _) = grad_slack(&ones, None, &x0, w, &[rstd as f64], cols, c.offset);
        let what = format!("dx of zero row {r} (dy ones, in place)");
        assert_close::<T>(
            &what,
            desc,
            &widen(row(r)),
            &widen(&want.dx),
            ulps_g,
            &slack,
        );
        last = Some(r);
    }
}

/// What a case's forward and backward wrote: `y`, `rstd`, `dx` and, with a weight and dW, `dw`.
struct Outputs<T> {
    y: Vec<T>,
    rstd: Vec<f32>,
    dx: Vec<T>,
    dw: Option<Vec<T>>,
}

/// Runs the forward and then the backward of case `c` (with `args`) on `x`, the weight `w`
/// and `dy`, every output but an in-place dx poisoned with `poison` first.
fn launch_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    c: &Case,
    args: &RmsNormArgs,
    [x, w, dy]: [&[T]; 3],
    poison: Poison,
    desc: &str,
) -> Outputs<T> {
    let n = c.rows * c.cols;
    let (xd, wd) = (upload(stream, x), upload(stream, w));
    let weight: Option<&dyn DevicePtr<T>> = c.weighted.then_some(&wd);
    let mut y = poisoned_with::<T>(stream, n, poison);
    let mut rstd = poisoned_with::<f32>(stream, c.rows, poison);
    rms_norm_forward(stream, args, &xd, weight, &mut y, &mut rstd).expect(desc);

    let with_dw = c.weighted && c.dw;
    let mut dw = poisoned_with::<T>(stream, c.cols, poison);
    let mut dy_d = upload(stream, dy);
    let dwv: Option<&mut dyn DevicePtrMut<T>> = with_dw.then_some(&mut dw);
    let dx = if c.inplace {
        rms_norm_backward_inplace(stream, args, &mut dy_d, &xd, weight, &rstd, dwv).expect(desc);
        dy_d
    } else {
        let mut dx = poisoned_with::<T>(stream, n, poison);
        rms_norm_backward(stream, args, &dy_d, &xd, weight, &rstd, &mut dx, dwv).expect(desc);
        dx
    };
    Outputs {
        y: download(stream, &y),
        rstd: download(stream, &rstd),
        dx: download(stream, &dx),
        dw: with_dw.then(|| download(stream, &dw)),
    }
}

/// Runs every shape × mode × (weight and dW, frozen weight, no weight) × in-place case; a
/// failing case does not hide the others: all failures are collected and reported together.
fn sweep<T: Dtype>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    let mut seed = seed_base;
    for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
        for mode in CastingMode::ALL {
            for (weighted, dw) in [(true, true), (true, false), (false, false)] {
                for inplace in [false, true] {
                    let offset = [0.0, 1.0, 0.25][(i + mode as usize) % 3];
                    let case = Case {
                        rows,
                        cols,
                        mode,
                        weighted,
                        dw,
                        inplace,
                        offset,
                        seed,
                    };
                    failures.run(|| run_case::<T>(&stream, &case));
                    seed += 1;
                }
            }
        }
    }
    failures.finish();
}

#[test]
fn gpu_matches_reference_f32() {
    sweep::<f32>("gpu_matches_reference_f32", 10_000);
}

#[test]
fn gpu_matches_reference_f16() {
    sweep::<f16>("gpu_matches_reference_f16", 20_000);
}

#[test]
fn gpu_matches_reference_bf16() {
    sweep::<bf16>("gpu_matches_reference_bf16", 30_000);
}

/// Largest finite value of `T`.
fn max_finite<T: Element>() -> f64 {
    match T::NAME {
        "f16" => 65504.0,
        "bf16" => 3.3895313892515355e38,
        _ => f32::MAX as f64,
    }
}

/// Special rows, each run with an ordinary random row after it (67 or 64 columns: scalar and
/// vector kernels, f32 and 16-bit), in every mode, forward and backward, against the
/// reference: a NaN, +∞, −∞, a row near the largest finite value (its f32 sum of squares
/// overflows for f32 and bf16: it must give the reference's finite result, not r = 0), a row
/// of 2⁴⁵-sized values (r³ < 2⁻¹²⁶: the backward must not lose its second term), with eps = 0
/// an all-zero row (r = ∞: y and dx NaN, as in the reference), and an ordinary row with
/// subnormal weights (the packed 16-bit products must keep subnormal results, not flush them).
/// Cases whose reference holds NaN run again into finite poison ([`check_case`]), so an
/// element left unwritten cannot pass for a NaN.
fn special_rows<T: Dtype>(stream: &std::sync::Arc<liger_rs::cudarc::driver::CudaStream>) {
    let max = max_finite::<T>();
    let big = 2f64.powi(45).min(max / 4.0);
    for cols in [67, 64] {
        let mut rng = Rng::new(50_000 + cols as u64);
        let normal: Vec<T> = rng.vec(cols, 0.0, 1.0);
        let special = |kind: usize, rng: &mut Rng| -> Vec<T> {
            let mut row: Vec<T> = rng.vec(cols, 0.0, 1.0);
            match kind {
                0 => row[3] = T::from_f64(f64::NAN),
                1 => row[5] = T::from_f64(f64::INFINITY),
                2 => row[0] = T::from_f64(f64::NEG_INFINITY),
                3 => {
                    for v in row.iter_mut() {
                        let u = 0.5 + 0.5 * rng.uniform();
                        *v = T::from_f64(if rng.uniform() < 0.5 { -u } else { u } * max);
                    }
                }
                4 => row
                    .iter_mut()
                    .for_each(|v| *v = T::from_f64(v.to_f64() * big)),
                5 => row.iter_mut().for_each(|v| *v = T::from_f64(0.0)),
                _ => {}
            }
            row
        };
        for kind in 0..7 {
            let eps = if kind == 5 { 0.0 } else { 1e-6 };
            for mode in CastingMode::ALL {
                let mut x = special(kind, &mut rng);
                x.extend_from_slice(&normal);
                let mut w: Vec<T> = rng.vec(cols, 1.0, 0.5);
                if kind == 6 {
                    let tiny = min_normal::<T>();
                    w = (0..cols)
                        .map(|_| T::from_f64((rng.uniform() - 0.5) * tiny))
                        .collect();
                }
                let dy: Vec<T> = rng.vec(2 * cols, 0.0, 1.0);
                let case = Case {
                    rows: 2,
                    cols,
                    mode,
                    weighted: true,
                    dw: kind != 3,
                    inplace: false,
                    offset: 0.0,
                    seed: 0,
                };
                let desc = format!(
                    "special row {kind} {} {mode} cols {cols} eps {eps}",
                    T::NAME
                );
                check_case(stream, &case, &DataRows::all(2), &x, &w, &dy, eps, &desc);
            }
        }
    }
}

#[test]
fn gpu_special_values_match_the_reference() {
    let Some(stream) = gpu("gpu_special_values_match_the_reference") else {
        return;
    };
    let mut failures = Failures::new("gpu_special_values_match_the_reference");
    failures.run(|| special_rows::<f32>(&stream));
    failures.run(|| special_rows::<f16>(&stream));
    failures.run(|| special_rows::<bf16>(&stream));
    failures.finish();
}

/// Every mode, llama both with `offset = 0` (16-bit types: the packed weight product) and
/// without (16-bit: the `llama_offset` kernels, lane by lane).
const MODE_OFFSETS: [(CastingMode, f32); 4] = [
    (CastingMode::Llama, 0.0),
    (CastingMode::Llama, 1.0),
    (CastingMode::Gemma, 1.0),
    (CastingMode::None, 0.25),
];

#[test]
fn gpu_forward_rows_walk_grid_stride_or_take_a_block_each() {
    // Rows ≥ 4 waves of resident blocks run the forward's one-row-per-block kernels for K ≥ 2:
    // 7000 × 2048 bf16 (`_vw2`, 128 threads; four waves of `_v2` are 4752 rows on an H200),
    // 4000 × 2048 f32 (`_vw2`, 256 threads; four waves of `_v2` are 2640 rows), 2200 × 8192
    // f16 and 2200 × 4096 f32 (`_vw4`, 256 threads) and the shared-memory dW test's 9600 × 4096
    // 16-bit rows (`_vw4`). Between one and four
    // waves the `_v{K}` kernels walk rows grid-stride, prefetching each block's next row: on
    // an H200 2000 × 2048 bf16 (`_v2`, 1188 blocks), 1500 × 2048 f32 (`_v2` at 256 threads,
    // 660 blocks), 1500 × 4096 bf16 (`_v4`, 660 blocks) and 1000 × 4096 f32 (`_v4`, 528
    // blocks) give blocks 1–3 rows. The sweep's shapes are one row per block or fewer.
    let test = "gpu_forward_rows_walk_grid_stride_or_take_a_block_each";
    let Some(stream) = gpu(test) else {
        return;
    };
    let mut failures = Failures::new(test);
    for (i, (mode, offset)) in MODE_OFFSETS.into_iter().enumerate() {
        let case = |rows, cols, seed| Case {
            rows,
            cols,
            mode,
            weighted: i != 2,
            // Llama with an offset: a frozen weight (16-bit: the lane-by-lane `bwd_dx` kernels).
            dw: i != 1,
            inplace: i % 2 == 0,
            offset,
            seed,
        };
        let seed = 70_000 + 10 * i as u64;
        failures.run(|| run_case::<bf16>(&stream, &case(7000, 2048, seed)));
        failures.run(|| run_case::<f32>(&stream, &case(4000, 2048, seed + 1)));
        failures.run(|| run_case::<f16>(&stream, &case(2200, 8192, seed + 2)));
        failures.run(|| run_case::<f32>(&stream, &case(2200, 4096, seed + 6)));
        failures.run(|| run_case::<bf16>(&stream, &case(2000, 2048, seed + 3)));
        failures.run(|| run_case::<bf16>(&stream, &case(1500, 4096, seed + 4)));
        failures.run(|| run_case::<f32>(&stream, &case(1000, 4096, seed + 5)));
        failures.run(|| run_case::<f32>(&stream, &case(1500, 2048, seed + 7)));
    }
    failures.finish();
}

#[test]
fn gpu_many_rows_take_the_shared_memory_dw_kernels() {
    // 9600 × 4096 and 9600 × 2048 16-bit rows with a weight: the shared-memory dW kernels fit
    // more blocks per SM and every block gets ≥ 8 rows, so the host runs `rms_norm_bwd_vs2_*`
    // (on an H200 with the sm_90 build, in clusters of two that merge their dW rows; 4096
    // columns: 256 threads, 528 blocks, 18–19 rows each; 2048 columns: 128 threads, 1056
    // blocks, 9–10 rows each: 9 blocks per SM fit, 1188, but only 528 clusters of two, and
    // 9600 rows keep ≥ 8 rows for each of the 1188 in the host's test); the sweep's shapes keep
    // dW in registers. `rms_norm::tests::gpu_h200_suite_shapes_take_their_documented_kernels`
    // checks these choices. With the small shapes each dtype and mode (each `_vs2` kernel)
    // runs one of the two widths, bf16 and f16 taking turns, so each dtype runs both.
    let Some(stream) = gpu("gpu_many_rows_take_the_shared_memory_dw_kernels") else {
        return;
    };
    let mut failures = Failures::new("gpu_many_rows_take_the_shared_memory_dw_kernels");
    let small = common::small_shapes();
    for (i, (mode, offset)) in MODE_OFFSETS.into_iter().enumerate() {
        for cols in [4096, 2048] {
            let case = Case {
                rows: 9600,
                cols,
                mode,
                weighted: true,
                dw: true,
                inplace: i % 2 == 0,
                offset,
                seed: 60_000 + 10 * i as u64 + cols as u64 / 2048,
            };
            let bf16_turn = (i + cols / 2048).is_multiple_of(2);
            if !small || bf16_turn {
                failures.run(|| run_case::<bf16>(&stream, &case));
            }
            if !small || !bf16_turn {
                failures.run(|| run_case::<f16>(&stream, &case));
            }
        }
    }
    failures.finish();
}

/// A frozen weight's dx (the `bwd_dx` kernels) against the dx of the same call with `dw`,
/// bit for bit: the same threads per block, so the same row reductions.
fn frozen_dx_is_the_dw_calls<T: Dtype>(stream: &Arc<CudaStream>, rows: usize, cols: usize) {
    let args = RmsNormArgs::new(rows, cols).with_offset(1.0);
    let desc = format!("{rows}×{cols} {}", T::NAME);
    let mut rng = Rng::new(rows as u64 * 7 + cols as u64);
    let x = upload(stream, &rng.vec::<T>(rows * cols, 0.0, 2.0));
    let w = upload(stream, &rng.vec::<T>(cols, 0.0, 0.5));
    let dy = upload(stream, &rng.vec::<T>(rows * cols, 0.0, 1.0));
    let weight = Some(&w as &dyn DevicePtr<T>);
    let mut y = poisoned::<T>(stream, rows * cols);
    let mut rstd = poisoned::<f32>(stream, rows);
    rms_norm_forward(stream, &args, &x, weight, &mut y, &mut rstd).expect(&desc);
    let mut dx = [
        poisoned::<T>(stream, rows * cols),
        poisoned::<T>(stream, rows * cols),
    ];
    let mut dw = poisoned::<T>(stream, cols);
    let [with_dw, frozen] = &mut dx;
    let dwv = Some(&mut dw as &mut dyn DevicePtrMut<T>);
    rms_norm_backward(stream, &args, &dy, &x, weight, &rstd, with_dw, dwv).expect(&desc);
    rms_norm_backward(stream, &args, &dy, &x, weight, &rstd, frozen, None).expect(&desc);
    let bits = |b: &CudaSlice<T>| -> Vec<u64> {
        download(stream, b)
            .iter()
            .map(|v| v.to_f64().to_bits())
            .collect()
    };
    assert!(bits(with_dw) == bits(frozen), "frozen dx differs, {desc}");
}

#[test]
fn gpu_a_frozen_weight_gives_the_dw_calls_dx_bits() {
    // On an H200: `_vs2` (clustered) against `bwd_dx_v2` (bf16 9600×2048), `_v2` (bf16
    // 2048×4096 and f32 3000×2048, the f16 and bf16 ones lane by lane with the offset), the
    // scalar kernels (4095 columns).
    // With the small shapes, a sixteenth of the rows (the `_v2` dW kernels then).
    let Some(stream) = gpu("gpu_a_frozen_weight_gives_the_dw_calls_dx_bits") else {
        return;
    };
    let rows = |r: usize| if common::small_shapes() { r / 16 } else { r };
    frozen_dx_is_the_dw_calls::<bf16>(&stream, rows(9600), 2048);
    frozen_dx_is_the_dw_calls::<bf16>(&stream, rows(2048), 4096);
    frozen_dx_is_the_dw_calls::<f32>(&stream, rows(3000), 2048);
    frozen_dx_is_the_dw_calls::<f16>(&stream, rows(700), 4095);
}

#[test]
fn gpu_very_wide_rows_with_more_rows_than_scratch_blocks() {
    // 2¹⁸ + 3 columns: the dW scratch allows 2²⁶ / cols = 255 partial rows, fewer than the
    // 260 rows and than the resident grid, so some blocks walk two rows (with dW; without it
    // the grid is the resident blocks).
    let Some(stream) = gpu("gpu_very_wide_rows_with_more_rows_than_scratch_blocks") else {
        return;
    };
    for (weighted, dw, inplace) in [
        (true, true, false),
        (false, false, true),
        (true, false, true),
    ] {
        let case = Case {
            rows: 260,
            cols: (1 << 18) + 3,
            mode: CastingMode::Llama,
            weighted,
            dw,
            inplace,
            offset: 0.0,
            seed: 40_000,
        };
        run_case::<bf16>(&stream, &case);
    }
}

#[test]
fn gpu_offsets_beyond_2_pow_32_elements() {
    // x, y and dy of 2³² / cols + 8 rows: over 2³² bf16 elements (8 GiB each), so any 32-bit
    // element or byte offset wraps; 4096 columns take the vector kernels, 4100 the scalar
    // ones. All rows are zero except those of `common::sampled_rows`, which hold random data:
    // 8-row windows at the start, around elements 2³¹ and 2³² (4100 columns: the row that
    // straddles 2³²) and at the end (the last row), and 256 rows spread over the rest. Zero
    // rows add nothing to dW, so the data rows alone must match the reference: y, rstd, dx
    // (in place over dy, and for a frozen weight into its own buffer) and dW.
    let test = "gpu_offsets_beyond_2_pow_32_elements";
    let Some(stream) = gpu_for_huge(test) else {
        return;
    };
    for cols in [4096, 4100] {
        huge_case(&stream, cols);
    }
}

#[test]
fn sampled_rows_hold_the_ends_the_marks_and_a_spread() {
    // The rows of `huge_case` for 4100 columns: row 523776 holds element 2³¹, row 1047552
    // straddles 2³².
    let rows = (1usize << 32) / 4100 + 8;
    let runs = sampled_rows(rows, 8, &[523776, 1047552]);
    assert!(runs.windows(2).all(|p| p[0].end < p[1].start), "{runs:?}");
    assert!(
        runs.iter().all(|r| !r.is_empty() && r.end <= rows),
        "{runs:?}"
    );
    let has = |row: usize| runs.iter().any(|r| r.contains(&row));
    let must = [
        0,
        7,
        523772,
        523776,
        523779,
        1047548,
        1047552,
        1047555,
        rows - 1,
    ];
    assert!(must.iter().all(|&r| has(r)), "{runs:?}");
    let n: usize = runs.iter().map(|r| r.len()).sum();
    assert!((256..=256 + 4 * 8).contains(&n), "{n} rows");
    let largest_gap = runs.windows(2).map(|p| p[1].start - p[0].end).max();
    assert!(largest_gap <= Some(rows / 256), "{largest_gap:?}");
}

fn huge_case(stream: &Arc<CudaStream>, cols: usize) {
    let win = 8;
    let rows = (1usize << 32) / cols + win;
    let data = sampled_rows(rows, win, &[(1 << 31) / cols, (1 << 32) / cols]);
    let n_data: usize = data.iter().map(|r| r.len()).sum();
    let desc = format!("{rows}×{cols} bf16, {n_data} rows of data");
    let n = rows * cols;
    let mut rng = Rng::new(900 + cols as u64);
    let w: Vec<bf16> = rng.vec(cols, 1.0, 0.5);
    let w_d = upload(stream, &w);
    let mut x_d = stream.alloc_zeros::<bf16>(n).expect("8 GiB for x");
    let mut dy_d = stream.alloc_zeros::<bf16>(n).expect("8 GiB for dy");
    let x: Vec<bf16> = rng.vec(n_data * cols, 0.0, 2.0);
    let dy: Vec<bf16> = rng.vec(n_data * cols, 0.0, 1.0);
    upload_rows(stream, &mut x_d, &data, cols, &x);
    upload_rows(stream, &mut dy_d, &data, cols, &dy);
    let data_of = |buf: &CudaSlice<bf16>| widen(&download_rows(stream, buf, &data, cols));
    let args = RmsNormArgs::new(rows, cols);
    let weight = Some(&w_d as &dyn DevicePtr<bf16>);
    let mut y_d = poisoned_on_device::<bf16>(stream, n);
    let mut rstd_d = poisoned::<f32>(stream, rows);
    rms_norm_forward(stream, &args, &x_d, weight, &mut y_d, &mut rstd_d).expect(&desc);
    // A frozen weight first (the `bwd_dx` kernels, into a dx of its own), then dW in place.
    let mut dx_d = poisoned_on_device::<bf16>(stream, n);
    rms_norm_backward(stream, &args, &dy_d, &x_d, weight, &rstd_d, &mut dx_d, None).expect(&desc);
    let mut dw_d = poisoned::<bf16>(stream, cols);
    let dw = Some(&mut dw_d as &mut dyn DevicePtrMut<bf16>);
    rms_norm_backward_inplace(stream, &args, &mut dy_d, &x_d, weight, &rstd_d, dw).expect(&desc);

    let rstd_all = download(stream, &rstd_d);
    assert!(
        rstd_all.iter().all(|r| r.is_finite()),
        "an rstd row was not written, {desc}"
    );
    let rstd_w: Vec<f32> = data
        .iter()
        .flat_map(|r| rstd_all[r.clone()].to_vec())
        .collect();
    let rstd = widen(&rstd_w);
    let [ulps_y, ulps_r, ulps_g] = ulps::<bf16>(CastingMode::Llama);
    let data_args = RmsNormArgs::new(n_data, cols);
    let want = ref_forward(&data_args, &x, Some(&w)).unwrap();
    assert_close::<bf16>("y", &desc, &data_of(&y_d), &widen(&want.y), ulps_y, &[]);
    assert_close::<bf16>("rstd", &desc, &rstd, &widen(&want.rstd), ulps_r, &[]);
    let grads = ref_backward(&data_args, &dy, &x, Some(&w), &rstd_w).unwrap();
    let (dx_slack, dw_slack) = grad_slack(&dy, None, &x, Some(&w), &rstd, cols, 0.0);
    let want_dx = widen(&grads.dx);
    assert_close::<bf16>("dx", &desc, &data_of(&dy_d), &want_dx, ulps_g, &dx_slack);
    let frozen = data_of(&dx_d);
    assert_close::<bf16>(
        "dx, frozen weight",
        &desc,
        &frozen,
        &want_dx,
        ulps_g,
        &dx_slack,
    );
    let want_dw = widen(&grads.dw.expect("dw with a weight"));
    let got_dw = widen(&download(stream, &dw_d));
    assert_close::<bf16>("dw", &desc, &got_dw, &want_dw, ulps_g, &dw_slack);
}

#[test]
fn gpu_strided_rows_leave_the_gaps_alone() {
    let Some(stream) = gpu("gpu_strided_rows_leave_the_gaps_alone") else {
        return;
    };
    // Unaligned strides (scalar kernels) and 16-byte aligned ones (vector kernels).
    for (rows, cols, xs, ys) in [(37, 1000, 1013, 1024), (29, 1024, 1088, 1032)] {
        strided_case(&stream, rows, cols, xs, ys);
    }
}

fn strided_case(
    stream: &std::sync::Arc<liger_rs::cudarc::driver::CudaStream>,
    rows: usize,
    cols: usize,
    xs: usize,
    ys: usize,
) {
    let mut rng = Rng::new(7);
    let x: Vec<bf16> = rng.vec((rows - 1) * xs + cols, 0.0, 1.0);
    let w: Vec<bf16> = rng.vec(cols, 1.0, 0.3);
    let dy: Vec<bf16> = rng.vec((rows - 1) * ys + cols, 0.0, 1.0);
    let args = RmsNormArgs::new(rows, cols).with_strides(xs, ys);
    let (xd, wd, dyd) = (upload(stream, &x), upload(stream, &w), upload(stream, &dy));
    let sentinel = bf16::from_f32(-7.0);
    let mut y = upload(stream, &vec![sentinel; (rows - 1) * ys + cols]);
    let mut rstd = poisoned::<f32>(stream, rows);
    rms_norm_forward(stream, &args, &xd, Some(&wd), &mut y, &mut rstd).unwrap();
    let mut dx = upload(stream, &vec![sentinel; (rows - 1) * ys + cols]);
    let mut dw = poisoned::<bf16>(stream, cols);
    rms_norm_backward(
        stream,
        &args,
        &dyd,
        &xd,
        Some(&wd),
        &rstd,
        &mut dx,
        Some(&mut dw),
    )
    .unwrap();
    let (y, dx) = (download(stream, &y), download(stream, &dx));
    let compact = |v: &[bf16], stride: usize| -> Vec<bf16> {
        (0..rows)
            .flat_map(|r| v[r * stride..r * stride + cols].to_vec())
            .collect()
    };
    for (name, v) in [("y", &y), ("dx", &dx)] {
        for r in 0..rows - 1 {
            assert!(
                v[r * ys + cols..(r + 1) * ys]
                    .iter()
                    .all(|&e| e == sentinel),
                "{name}: gap after row {r} was written"
            );
        }
    }
    let contiguous = RmsNormArgs::new(rows, cols);
    let want = ref_forward(&contiguous, &compact(&x, xs), Some(&w)).unwrap();
    let [ulps_y, _, ulps_g] = ulps::<bf16>(CastingMode::Llama);
    let (y_c, dx_c) = (widen(&compact(&y, ys)), widen(&compact(&dx, ys)));
    assert_close::<bf16>("y", "strided", &y_c, &widen(&want.y), ulps_y, &[]);
    let rstd_gpu = download(stream, &rstd);
    let (dy_c, x_c) = (compact(&dy, ys), compact(&x, xs));
    let grads = ref_backward(&contiguous, &dy_c, &x_c, Some(&w), &rstd_gpu).unwrap();
    let rstd_gpu = widen(&rstd_gpu);
    let (dx_slack, dw_slack) = grad_slack(&dy_c, None, &x_c, Some(&w), &rstd_gpu, cols, 0.0);
    assert_close::<bf16>("dx", "strided", &dx_c, &widen(&grads.dx), ulps_g, &dx_slack);
    let dw_gpu = widen(&download(stream, &dw));
    let dw_want = widen(&grads.dw.unwrap());
    assert_close::<bf16>("dw", "strided", &dw_gpu, &dw_want, ulps_g, &dw_slack);
}
