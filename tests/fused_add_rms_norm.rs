//! Fused residual add + RMSNorm: GPU kernels against the CPU reference
//! (`liger_rs::reference::fused_add_rms_norm_*`, checked by finite differences in its unit
//! tests) over many shapes, every dtype and mode, with and without a weight and dW, the sum
//! written to its own buffer, over `x` or over `r`, the gradient to its own buffer or over
//! `ds`, every output poisoned first (the argument checks: `tests/bad_input.rs`).
mod common;

use common::rms::{grad_slack, ulps};
use common::{
    Failures, Rng, assert_close, download, download_rows, gpu, gpu_for_huge, poisoned,
    poisoned_on_device, sampled_rows, skip_when_small, upload, upload_rows, widen,
};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use liger_rs::reference::{
    fused_add_rms_norm_backward as ref_backward, fused_add_rms_norm_forward as ref_forward,
};
use liger_rs::{
    CastingMode, Dtype, RmsNormArgs, fused_add_rms_norm_backward,
    fused_add_rms_norm_backward_inplace, fused_add_rms_norm_forward,
    fused_add_rms_norm_forward_inplace,
};
use std::sync::Arc;

/// (rows, cols): 1×1, odd and prime widths (scalar kernels), widths of whole 16-byte vectors
/// (vector kernels, one to four per thread, grid-stride and one row per block), the 65536
/// widest one-pass row and a wider one (chunked), Llama widths.
const SHAPES: [(usize, usize); 18] = [
    (1, 1),
    (3, 1),
    (2, 41),
    (7, 123),
    (257, 33),
    (64, 96),
    (9, 257),
    (5, 1025),
    (13, 2047),
    (1, 2048),
    (33, 4096),
    (3, 4097),
    (6, 5120),
    (17, 8193),
    (5, 11008),
    (2, 65536),
    (1, 65537),
    (1000, 64),
];

/// Where the forward writes the sum.
#[derive(Debug, Clone, Copy)]
enum SumInto {
    /// Its own buffer.
    Own,
    /// Over `x` (`fused_add_rms_norm_forward_inplace` with `x_s = x`).
    X,
    /// Over `r` (the same call with the operands swapped).
    R,
}

struct Case {
    rows: usize,
    cols: usize,
    mode: CastingMode,
    weighted: bool,
    dw: bool,
    sum_into: SumInto,
    grad_inplace: bool,
    offset: f32,
    seed: u64,
}

/// Runs case `c` on random data and checks every output: `s` bit for bit (one rounding of
/// an exact sum), `y`, `rstd`, `dx` and `dw` within `ulps` and `grad_slack` (`common::rms`).
fn run_case<T: Dtype>(stream: &Arc<CudaStream>, c: &Case) {
    let desc = format!(
        "{}×{} {} {} weight={} dw={} sum={:?} grad_inplace={} offset={} seed={}",
        c.rows,
        c.cols,
        T::NAME,
        c.mode,
        c.weighted,
        c.dw,
        c.sum_into,
        c.grad_inplace,
        c.offset,
        c.seed
    );
    let (n, cols) = (c.rows * c.cols, c.cols);
    let mut rng = Rng::new(c.seed);
    let x: Vec<T> = rng.vec(n, 0.0, 1.5);
    let r: Vec<T> = rng.vec(n, 0.0, 1.5);
    let w: Vec<T> = rng.vec(cols, if c.offset == 0.0 { 1.0 } else { 0.0 }, 0.5);
    let dy: Vec<T> = rng.vec(n, 0.0, 1.0);
    let ds: Vec<T> = rng.vec(n, 0.0, 1.0);
    let args = RmsNormArgs::new(c.rows, c.cols)
        .with_mode(c.mode)
        .with_offset(c.offset)
        .with_eps(1e-6);
    let [ulps_y, ulps_r, ulps_g] = ulps::<T>(c.mode);
    let weight_host = c.weighted.then_some(&w[..]);
    let want = ref_forward(&args, &x, &r, weight_host).unwrap();

    let wd = upload(stream, &w);
    let weight: Option<&dyn DevicePtr<T>> = c.weighted.then_some(&wd);
    let mut y = poisoned::<T>(stream, n);
    let mut rstd = poisoned::<f32>(stream, c.rows);
    let (xd, rd) = (upload(stream, &x), upload(stream, &r));
    let s_dev = match c.sum_into {
        SumInto::Own => {
            let mut s = poisoned::<T>(stream, n);
            fused_add_rms_norm_forward(stream, &args, &xd, &rd, weight, &mut s, &mut y, &mut rstd)
                .expect(&desc);
            s
        }
        SumInto::X => {
            let mut x_s = xd;
            fused_add_rms_norm_forward_inplace(
                stream, &args, &mut x_s, &rd, weight, &mut y, &mut rstd,
            )
            .expect(&desc);
            x_s
        }
        SumInto::R => {
            let mut r_s = rd;
            fused_add_rms_norm_forward_inplace(
                stream, &args, &mut r_s, &xd, weight, &mut y, &mut rstd,
            )
            .expect(&desc);
            r_s
        }
    };
    let s_got = download(stream, &s_dev);
    let bits = |v: &[T]| v.iter().map(|e| e.to_f64().to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&s_got), bits(&want.s), "s, {desc}");
    let rstd_got = download(stream, &rstd);
    let rstd_gpu = widen(&rstd_got);
    assert_close::<T>(
        "y",
        &desc,
        &widen(&download(stream, &y)),
        &widen(&want.y),
        ulps_y,
        &[],
    );
    assert_close::<T>("rstd", &desc, &rstd_gpu, &widen(&want.rstd), ulps_r, &[]);

    // The backward from the GPU's s and rstd, as training runs it.
    let grads = ref_backward(&args, &dy, &ds, &s_got, weight_host, &rstd_got).unwrap();
    let with_dw = c.weighted && c.dw;
    let mut dw = poisoned::<T>(stream, cols);
    let dyd = upload(stream, &dy);
    let mut dsd = upload(stream, &ds);
    let dx = {
        let dwv: Option<&mut dyn DevicePtrMut<T>> = with_dw.then_some(&mut dw);
        if c.grad_inplace {
            fused_add_rms_norm_backward_inplace(
                stream, &args, &dyd, &mut dsd, &s_dev, weight, &rstd, dwv,
            )
            .expect(&desc);
            download(stream, &dsd)
        } else {
            let mut dx = poisoned::<T>(stream, n);
            fused_add_rms_norm_backward(
                stream, &args, &dyd, &dsd, &s_dev, weight, &rstd, &mut dx, dwv,
            )
            .expect(&desc);
            download(stream, &dx)
        }
    };
    let (dx_slack, dw_slack) = grad_slack(
        &dy,
        Some(&ds),
        &s_got,
        weight_host,
        &rstd_gpu,
        cols,
        c.offset,
    );
    assert_close::<T>(
        "dx",
        &desc,
        &widen(&dx),
        &widen(&grads.dx),
        ulps_g,
        &dx_slack,
    );
    if with_dw {
        let want_dw = grads.dw.expect("a weight gives the reference's dw");
        let got_dw = widen(&download(stream, &dw));
        assert_close::<T>("dw", &desc, &got_dw, &widen(&want_dw), ulps_g, &dw_slack);
    }
}

/// Every shape × mode × (weight and dW, frozen weight, no weight) × gradient in place or not;
/// the sum's destination and the offset rotate with the case. All failures are reported
/// together.
fn sweep<T: Dtype>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    let mut seed = seed_base;
    for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
        for mode in CastingMode::ALL {
            for (weighted, dw) in [(true, true), (true, false), (false, false)] {
                for grad_inplace in [false, true] {
                    let k = seed as usize;
                    let case = Case {
                        rows,
                        cols,
                        mode,
                        weighted,
                        dw,
                        sum_into: [SumInto::Own, SumInto::X, SumInto::R][k % 3],
                        grad_inplace,
                        offset: [0.0, 1.0, 0.25][(i + mode as usize) % 3],
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
fn gpu_fused_add_matches_reference_f32() {
    sweep::<f32>("gpu_fused_add_matches_reference_f32", 40_000);
}

#[test]
fn gpu_fused_add_matches_reference_f16() {
    sweep::<f16>("gpu_fused_add_matches_reference_f16", 50_000);
}

#[test]
fn gpu_fused_add_matches_reference_bf16() {
    sweep::<bf16>("gpu_fused_add_matches_reference_bf16", 60_000);
}

/// Many rows: the one-row-per-block forward (`_vr`) and, with dW, the shared-memory dW
/// backward (`_vs`, in clusters in the sm_90 build), every placement of the sum and gradient.
#[test]
fn gpu_fused_add_many_rows() {
    let test = "gpu_fused_add_many_rows";
    let Some(stream) = gpu(test) else { return };
    if skip_when_small(test, "its point is the row count that picks the kernels") {
        return;
    }
    let mut failures = Failures::new(test);
    for (seed, (rows, cols, mode, offset)) in [
        (9000, 1024, CastingMode::Llama, 0.0),
        (9000, 2048, CastingMode::Gemma, 1.0),
        (4096, 4096, CastingMode::Llama, 1.0),
    ]
    .into_iter()
    .enumerate()
    {
        for (j, sum_into) in [SumInto::Own, SumInto::X, SumInto::R]
            .into_iter()
            .enumerate()
        {
            let case = Case {
                rows,
                cols,
                mode,
                weighted: true,
                dw: true,
                sum_into,
                grad_inplace: j == 1,
                offset,
                seed: 70_000 + 10 * seed as u64 + j as u64,
            };
            failures.run(|| run_case::<bf16>(&stream, &case));
        }
    }
    failures.finish();
}

#[test]
fn gpu_fused_add_strided_rows_leave_the_gaps_alone() {
    let Some(stream) = gpu("gpu_fused_add_strided_rows_leave_the_gaps_alone") else {
        return;
    };
    // Unaligned strides (scalar kernels) and 16-byte aligned ones (vector kernels); the sum
    // over `x` (at x's stride) in the second.
    for (rows, cols, xs, ys, over_x) in
        [(37, 1000, 1013, 1024, false), (29, 1024, 1088, 1032, true)]
    {
        strided_case(&stream, rows, cols, xs, ys, over_x);
    }
}

/// Strided rows: `x`, `r`, `s` at `xs`, `y`, `dy`, `ds`, `dx` at `ys`; the gaps between the
/// rows of the written buffers keep a sentinel, the rows match the reference (`s` exactly).
fn strided_case(
    stream: &Arc<CudaStream>,
    rows: usize,
    cols: usize,
    xs: usize,
    ys: usize,
    over_x: bool,
) {
    let mut rng = Rng::new(8);
    let (x_len, y_len) = ((rows - 1) * xs + cols, (rows - 1) * ys + cols);
    let x: Vec<bf16> = rng.vec(x_len, 0.0, 1.0);
    let r: Vec<bf16> = rng.vec(x_len, 0.0, 1.0);
    let w: Vec<bf16> = rng.vec(cols, 1.0, 0.3);
    let dy: Vec<bf16> = rng.vec(y_len, 0.0, 1.0);
    let ds: Vec<bf16> = rng.vec(y_len, 0.0, 1.0);
    let args = RmsNormArgs::new(rows, cols).with_strides(xs, ys);
    let sentinel = bf16::from_f32(-7.0);
    let (rd, wd, dyd, dsd) = (
        upload(stream, &r),
        upload(stream, &w),
        upload(stream, &dy),
        upload(stream, &ds),
    );
    let mut y = upload(stream, &vec![sentinel; y_len]);
    let mut rstd = poisoned::<f32>(stream, rows);
    // Over x, x's gaps keep x's values; into a buffer of its own, the sentinel.
    let (s_dev, s_gap) = if over_x {
        let mut x_s = upload(stream, &x);
        fused_add_rms_norm_forward_inplace(
            stream,
            &args,
            &mut x_s,
            &rd,
            Some(&wd),
            &mut y,
            &mut rstd,
        )
        .unwrap();
        (x_s, x.clone())
    } else {
        let xd = upload(stream, &x);
        let mut s = upload(stream, &vec![sentinel; x_len]);
        fused_add_rms_norm_forward(
            stream,
            &args,
            &xd,
            &rd,
            Some(&wd),
            &mut s,
            &mut y,
            &mut rstd,
        )
        .unwrap();
        (s, vec![sentinel; x_len])
    };
    let mut dx = upload(stream, &vec![sentinel; y_len]);
    let mut dw = poisoned::<bf16>(stream, cols);
    fused_add_rms_norm_backward(
        stream,
        &args,
        &dyd,
        &dsd,
        &s_dev,
        Some(&wd),
        &rstd,
        &mut dx,
        Some(&mut dw),
    )
    .unwrap();
    let (s_got, y, dx) = (
        download(stream, &s_dev),
        download(stream, &y),
        download(stream, &dx),
    );
    let compact = |v: &[bf16], stride: usize| -> Vec<bf16> {
        (0..rows)
            .flat_map(|r| v[r * stride..r * stride + cols].to_vec())
            .collect()
    };
    for r in 0..rows - 1 {
        let gap = |stride: usize| r * stride + cols..(r + 1) * stride;
        assert_eq!(s_got[gap(xs)], s_gap[gap(xs)], "s: gap after row {r}");
        for (name, v) in [("y", &y), ("dx", &dx)] {
            assert!(
                v[gap(ys)].iter().all(|&e| e == sentinel),
                "{name}: gap after row {r} was written"
            );
        }
    }
    let contiguous = RmsNormArgs::new(rows, cols);
    let want = ref_forward(&contiguous, &compact(&x, xs), &compact(&r, xs), Some(&w)).unwrap();
    assert_eq!(compact(&s_got, xs), want.s, "s, strided");
    let [ulps_y, _, ulps_g] = ulps::<bf16>(CastingMode::Llama);
    assert_close::<bf16>(
        "y",
        "strided",
        &widen(&compact(&y, ys)),
        &widen(&want.y),
        ulps_y,
        &[],
    );
    let rstd_gpu = download(stream, &rstd);
    let (dy_c, ds_c) = (compact(&dy, ys), compact(&ds, ys));
    let grads = ref_backward(&contiguous, &dy_c, &ds_c, &want.s, Some(&w), &rstd_gpu).unwrap();
    let rstd_gpu = widen(&rstd_gpu);
    let (dx_slack, dw_slack) =
        grad_slack(&dy_c, Some(&ds_c), &want.s, Some(&w), &rstd_gpu, cols, 0.0);
    assert_close::<bf16>(
        "dx",
        "strided",
        &widen(&compact(&dx, ys)),
        &widen(&grads.dx),
        ulps_g,
        &dx_slack,
    );
    let dw_want = widen(&grads.dw.unwrap());
    assert_close::<bf16>(
        "dw",
        "strided",
        &widen(&download(stream, &dw)),
        &dw_want,
        ulps_g,
        &dw_slack,
    );
}

#[test]
fn gpu_fused_add_offsets_beyond_2_pow_32_elements() {
    // x_s, r, y, dy and ds_dx of 2³² / cols + 8 bf16 rows: over 2³² elements (8 GiB each), so
    // any 32-bit element or byte offset wraps; 4096 columns take the vector kernels, 4100 the
    // scalar ones. All rows are zero except those of `common::sampled_rows`, which hold random
    // data and must match the reference: 8-row windows at the start, around elements 2³¹ and
    // 2³² (4100 columns: the row that straddles 2³²) and at the end (the last row), and 256
    // rows spread over the rest.
    let test = "gpu_fused_add_offsets_beyond_2_pow_32_elements";
    let Some(stream) = gpu_for_huge(test) else {
        return;
    };
    for cols in [4096, 4100] {
        huge_case(&stream, cols);
    }
}

fn huge_case(stream: &Arc<CudaStream>, cols: usize) {
    let win = 8;
    let rows = (1usize << 32) / cols + win;
    let data = sampled_rows(rows, win, &[(1 << 31) / cols, (1 << 32) / cols]);
    let n_data: usize = data.iter().map(|r| r.len()).sum();
    let desc = format!("{rows}×{cols} bf16, {n_data} rows of data");
    let n = rows * cols;
    let mut rng = Rng::new(910 + cols as u64);
    let w: Vec<bf16> = rng.vec(cols, 1.0, 0.5);
    let w_d = upload(stream, &w);
    let mut bufs: [CudaSlice<bf16>; 4] =
        std::array::from_fn(|_| stream.alloc_zeros::<bf16>(n).expect("8 GiB"));
    // x (then s), r, dy, ds (then dx): the data of their sampled rows, in row order.
    let host: [Vec<bf16>; 4] =
        std::array::from_fn(|k| rng.vec(n_data * cols, 0.0, if k < 2 { 1.5 } else { 1.0 }));
    for (buf, h) in bufs.iter_mut().zip(&host) {
        upload_rows(stream, buf, &data, cols, h);
    }
    let data_of = |buf: &CudaSlice<bf16>| download_rows(stream, buf, &data, cols);
    let [mut x_s, r_d, dy_d, mut ds_dx] = bufs;
    let args = RmsNormArgs::new(rows, cols);
    let weight = Some(&w_d as &dyn DevicePtr<bf16>);
    let mut y_d = poisoned_on_device::<bf16>(stream, n);
    let mut rstd_d = poisoned::<f32>(stream, rows);
    fused_add_rms_norm_forward_inplace(
        stream,
        &args,
        &mut x_s,
        &r_d,
        weight,
        &mut y_d,
        &mut rstd_d,
    )
    .expect(&desc);
    let mut dw_d = poisoned::<bf16>(stream, cols);
    let dw = Some(&mut dw_d as &mut dyn DevicePtrMut<bf16>);
    fused_add_rms_norm_backward_inplace(
        stream, &args, &dy_d, &mut ds_dx, &x_s, weight, &rstd_d, dw,
    )
    .expect(&desc);

    let rstd_all = download(stream, &rstd_d);
    assert!(
        rstd_all.iter().all(|r| r.is_finite()),
        "an rstd row was not written, {desc}"
    );
    let rstd_w: Vec<f32> = data
        .iter()
        .flat_map(|r| rstd_all[r.clone()].to_vec())
        .collect();
    let data_args = RmsNormArgs::new(n_data, cols);
    let [x, r, dy, ds] = &host;
    let want = ref_forward(&data_args, x, r, Some(&w)).unwrap();
    assert_eq!(data_of(&x_s), want.s, "s, {desc}");
    let [ulps_y, ulps_r, ulps_g] = ulps::<bf16>(CastingMode::Llama);
    assert_close::<bf16>(
        "y",
        &desc,
        &widen(&data_of(&y_d)),
        &widen(&want.y),
        ulps_y,
        &[],
    );
    let rstd = widen(&rstd_w);
    assert_close::<bf16>("rstd", &desc, &rstd, &widen(&want.rstd), ulps_r, &[]);
    let grads = ref_backward(&data_args, dy, ds, &want.s, Some(&w), &rstd_w).unwrap();
    let (dx_slack, dw_slack) = grad_slack(dy, Some(ds), &want.s, Some(&w), &rstd, cols, 0.0);
    assert_close::<bf16>(
        "dx",
        &desc,
        &widen(&data_of(&ds_dx)),
        &widen(&grads.dx),
        ulps_g,
        &dx_slack,
    );
    let want_dw = widen(&grads.dw.expect("dw with a weight"));
    assert_close::<bf16>(
        "dw",
        &desc,
        &widen(&download(stream, &dw_d)),
        &want_dw,
        ulps_g,
        &dw_slack,
    );
}

/// One forward and backward (with dW) of bf16 `rows × cols`: the bits of s, y, rstd, dx, dw.
fn fused_pass(stream: &Arc<CudaStream>, rows: usize, cols: usize) -> Vec<Vec<u32>> {
    let n = rows * cols;
    let mut rng = Rng::new(5);
    let [x, r, dy, ds]: [Vec<bf16>; 4] = std::array::from_fn(|_| rng.vec(n, 0.0, 1.0));
    let w: Vec<bf16> = rng.vec(cols, 1.0, 0.5);
    let args = RmsNormArgs::new(rows, cols);
    let [xd, rd, dyd, dsd, wd] = [&x, &r, &dy, &ds, &w].map(|h| upload(stream, h));
    let (mut s, mut y) = (poisoned::<bf16>(stream, n), poisoned::<bf16>(stream, n));
    let mut rstd = poisoned::<f32>(stream, rows);
    fused_add_rms_norm_forward(
        stream,
        &args,
        &xd,
        &rd,
        Some(&wd),
        &mut s,
        &mut y,
        &mut rstd,
    )
    .unwrap();
    let (mut dx, mut dw) = (poisoned::<bf16>(stream, n), poisoned::<bf16>(stream, cols));
    fused_add_rms_norm_backward(
        stream,
        &args,
        &dyd,
        &dsd,
        &s,
        Some(&wd),
        &rstd,
        &mut dx,
        Some(&mut dw),
    )
    .unwrap();
    let b16 = |v: Vec<bf16>| v.into_iter().map(|e| e.to_bits() as u32).collect();
    vec![
        b16(download(stream, &s)),
        b16(download(stream, &y)),
        download(stream, &rstd)
            .into_iter()
            .map(f32::to_bits)
            .collect(),
        b16(download(stream, &dx)),
        b16(download(stream, &dw)),
    ]
}

#[test]
fn gpu_fused_add_is_bitwise_deterministic() {
    let test = "gpu_fused_add_is_bitwise_deterministic";
    let Some(stream) = gpu(test) else { return };
    if skip_when_small(
        test,
        "its point is the many-row shapes of the _vr and _vs kernels",
    ) {
        return;
    }
    // The one-row-per-block forward and the shared-memory dW backward (clusters on sm_90), and
    // the scalar kernels.
    for (rows, cols) in [(16384, 2048), (4099, 1001)] {
        let first = fused_pass(&stream, rows, cols);
        for _ in 0..3 {
            assert!(
                fused_pass(&stream, rows, cols) == first,
                "{rows}×{cols}: bits differ between runs"
            );
        }
    }
}
