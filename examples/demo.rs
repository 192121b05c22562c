//! First-run demo: RMSNorm forward and backward on a Llama-3-8B-shaped activation (bf16,
//! 4096 tokens × 4096 hidden) on GPU 0, a sample of the results checked against the CPU
//! reference, and the time of each call. Without a GPU it says why and runs the reference on a
//! small shape instead.
use half::bf16;
use liger_rs::reference;
use liger_rs::{CastingMode, RmsNormArgs, rms_norm_backward_inplace, rms_norm_forward};

fn data(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bf16::from_f64(((s >> 40) as f64 / (1u64 << 24) as f64) * 4.0 - 2.0)
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (rows, cols) = (4096, 4096);
    let args = RmsNormArgs::new(rows, cols)
        .with_eps(1e-5)
        .with_mode(CastingMode::Llama);
    let (x, w, dy) = (data(rows * cols, 1), data(cols, 2), data(rows * cols, 3));
    let ctx = match liger_rs::cuda_context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("no GPU ({e}); running the CPU reference on 4 × 64 instead");
            let out = reference::rms_norm_forward(
                &x[..256],
                Some(&w[..64]),
                64,
                1e-5,
                0.0,
                CastingMode::Llama,
            )?;
            let g = reference::rms_norm_backward(
                &dy[..256],
                &x[..256],
                Some(&w[..64]),
                &out.rstd,
                64,
                0.0,
                CastingMode::Llama,
            )?;
            println!(
                "reference: rstd[0] = {:.6}, y[0] = {}, dx[0] = {}, dw[0] = {}",
                out.rstd[0],
                out.y[0],
                g.dx[0],
                g.dw.unwrap()[0]
            );
            return Ok(());
        }
    };
    let stream = ctx.default_stream();
    println!(
        "device: {}  shape {rows} × {cols} bf16, llama mode",
        ctx.name()?
    );
    let (xd, wd) = (stream.clone_htod(&x)?, stream.clone_htod(&w)?);
    let mut dyd = stream.clone_htod(&dy)?;
    let (mut y, mut rstd) = (
        stream.alloc_zeros::<bf16>(rows * cols)?,
        stream.alloc_zeros::<f32>(rows)?,
    );
    let mut dw = stream.alloc_zeros::<bf16>(cols)?;
    let wv = wd.as_view();
    let start = ctx.new_event(Some(
        liger_rs::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
    ))?;
    let mid = ctx.new_event(Some(
        liger_rs::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
    ))?;
    let end = ctx.new_event(Some(
        liger_rs::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
    ))?;
    // One warm-up pair (module load, JIT of the PTX), then the timed pair on fresh dy.
    rms_norm_forward(&stream, &args, &xd, Some(&wv), &mut y, &mut rstd)?;
    start.record(&stream)?;
    rms_norm_forward(&stream, &args, &xd, Some(&wv), &mut y, &mut rstd)?;
    mid.record(&stream)?;
    rms_norm_backward_inplace(
        &stream,
        &args,
        &mut dyd,
        &xd,
        Some(&wv),
        &rstd,
        Some(&mut dw.as_view_mut()),
    )?;
    end.record(&stream)?;
    let (y, rstd, dx, dw) = (
        stream.clone_dtoh(&y)?,
        stream.clone_dtoh(&rstd)?,
        stream.clone_dtoh(&dyd)?,
        stream.clone_dtoh(&dw)?,
    );
    let (fwd_ms, bwd_ms) = (start.elapsed_ms(&mid)? as f64, mid.elapsed_ms(&end)? as f64);

    // Check 16 sampled rows (and the whole dW) against the reference.
    let sample: Vec<usize> = (0..16).map(|i| i * (rows / 16) + i).collect();
    let mut worst = 0.0f64;
    for &r in &sample {
        let row = r * cols..(r + 1) * cols;
        let want = reference::rms_norm_forward(
            &x[row.clone()],
            Some(&w),
            cols,
            1e-5,
            0.0,
            CastingMode::Llama,
        )?;
        let g = reference::rms_norm_backward(
            &dy[row.clone()],
            &x[row.clone()],
            Some(&w),
            &[rstd[r] as f64],
            cols,
            0.0,
            CastingMode::Llama,
        )?;
        for (got, want) in y[row.clone()]
            .iter()
            .zip(&want.y)
            .chain(dx[row].iter().zip(&g.dx))
        {
            let scale = want.to_f64().abs().max(1e-3);
            worst = worst.max((got.to_f64() - want.to_f64()).abs() / scale);
        }
    }
    let full = reference::rms_norm_forward(&x, Some(&w), cols, 1e-5, 0.0, CastingMode::Llama)?;
    let g =
        reference::rms_norm_backward(&dy, &x, Some(&w), &full.rstd, cols, 0.0, CastingMode::Llama)?;
    let dw_err = dw
        .iter()
        .zip(g.dw.as_ref().unwrap())
        .map(|(a, b)| (a.to_f64() - b.to_f64()).abs() / b.to_f64().abs().max(1.0))
        .fold(0.0, f64::max);
    let bytes = (rows * cols * 2) as f64;
    println!("{:<14} {:>9} {:>9}", "op", "ms", "GB/s");
    println!(
        "{:<14} {:>9.3} {:>9.0}",
        "rms_norm fwd",
        fwd_ms,
        2.0 * bytes / fwd_ms / 1e6
    );
    println!(
        "{:<14} {:>9.3} {:>9.0}",
        "rms_norm bwd",
        bwd_ms,
        3.0 * bytes / bwd_ms / 1e6
    );
    println!(
        "largest relative error vs reference: y/dx {worst:.2e} (bf16 ulp 7.8e-3), dw {dw_err:.2e}"
    );
    if worst > 1.6e-2 || dw_err > 1.6e-2 {
        return Err("results disagree with the CPU reference".into());
    }
    println!("ok");
    Ok(())
}
