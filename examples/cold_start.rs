//! Cold start: how long each op's first forward and first backward take in a fresh process,
//! where the driver JIT-compiles the kernels that call launches, next to a second call. Run it
//! with the driver's JIT cache off, so that every process starts cold:
//!
//! ```text
//! CUDA_CACHE_DISABLE=1 cargo run --release --example cold_start              # every op
//! CUDA_CACHE_DISABLE=1 cargo run --release --example cold_start -- rms_norm  # one op alone
//! ```
//!
//! Each line is one op on Llama-3-8B shapes in bf16 (RMSNorm over [4096, 4096] with a weight,
//! RoPE on q [1, 4096, 32, 128] and k [1, 4096, 8, 128], SwiGLU over [4096, 14336]): the wall
//! time of its first forward and first backward, each up to the end of its GPU work, then of
//! the second ones. The context is created first and timed on its own line; the first op of a
//! process also pays the one-time cut of the embedded PTX into its kernels' modules. Without a
//! GPU it says why and exits 0.
use half::bf16;
use liger_rs::cudarc::driver::{CudaStream, sys};
use liger_rs::{
    CosSinLayout, RmsNormArgs, RopeArgs, SwigluArgs, rms_norm_backward_inplace, rms_norm_forward,
    rope_backward, rope_forward, swiglu_backward, swiglu_forward,
};
use std::sync::Arc;
use std::time::Instant;

const TOKENS: usize = 4096;
const HIDDEN: usize = 4096;
const HEADS: (usize, usize, usize) = (32, 8, 128);
const INTERMEDIATE: usize = 14336;
const OPS: [&str; 3] = ["rms_norm", "rope", "swiglu"];

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Milliseconds that `f` and the GPU work it queues on `stream` take.
fn wall_ms(stream: &Arc<CudaStream>, f: &mut dyn FnMut() -> Res<()>) -> Res<f64> {
    let start = Instant::now();
    f()?;
    stream.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// Times the first and the second forward and backward (`call(false)`, `call(true)`) and
/// prints one line.
fn report(stream: &Arc<CudaStream>, op: &str, mut call: impl FnMut(bool) -> Res<()>) -> Res<()> {
    let mut time = |backward| wall_ms(stream, &mut || call(backward));
    let first = (time(false)?, time(true)?);
    let second = (time(false)?, time(true)?);
    println!(
        "{op:<9} first forward {:9.1} ms, first backward {:9.1} ms (second: {:.2} ms, {:.2} ms)",
        first.0, first.1, second.0, second.1
    );
    Ok(())
}

fn rms_norm(stream: &Arc<CudaStream>) -> Res<()> {
    let (rows, cols) = (TOKENS, HIDDEN);
    let x = stream.clone_htod(&vec![bf16::from_f32(0.5); rows * cols])?;
    let w = stream.clone_htod(&vec![bf16::ONE; cols])?;
    let mut y = stream.alloc_zeros::<bf16>(rows * cols)?;
    let mut rstd = stream.alloc_zeros::<f32>(rows)?;
    let mut dy = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
    let mut dw = stream.alloc_zeros::<bf16>(cols)?;
    stream.synchronize()?;
    let args = RmsNormArgs::new(rows, cols);
    report(stream, "rms_norm", |backward| {
        if backward {
            rms_norm_backward_inplace(stream, &args, &mut dy, &x, Some(&w), &rstd, Some(&mut dw))?;
        } else {
            rms_norm_forward(stream, &args, &x, Some(&w), &mut y, &mut rstd)?;
        }
        Ok(())
    })
}

fn rope(stream: &Arc<CudaStream>) -> Res<()> {
    let (hq, hk, d) = HEADS;
    let args = RopeArgs::new(d).with_seq_len(TOKENS).with_heads(hq, hk);
    let mut q = stream.clone_htod(&vec![bf16::ONE; TOKENS * hq * d])?;
    let mut k = stream.clone_htod(&vec![bf16::ONE; TOKENS * hk * d])?;
    let cos = stream.clone_htod(&vec![bf16::ONE; TOKENS * d])?;
    let sin = stream.clone_htod(&vec![bf16::ZERO; TOKENS * d])?;
    stream.synchronize()?;
    let layout = CosSinLayout::PerPosition;
    report(stream, "rope", |backward| {
        match backward {
            true => rope_backward(stream, &args, &mut q, &mut k, &cos, &sin, &layout)?,
            false => rope_forward(stream, &args, &mut q, &mut k, &cos, &sin, &layout)?,
        }
        Ok(())
    })
}

fn swiglu(stream: &Arc<CudaStream>) -> Res<()> {
    let n = TOKENS * INTERMEDIATE;
    let args = SwigluArgs::new(TOKENS, INTERMEDIATE);
    let a = stream.clone_htod(&vec![bf16::from_f32(0.5); n])?;
    let b = stream.clone_htod(&vec![bf16::ONE; n])?;
    let dc = stream.clone_htod(&vec![bf16::ONE; n])?;
    let mut c = stream.alloc_zeros::<bf16>(n)?;
    let (mut da, mut db) = (
        stream.alloc_zeros::<bf16>(n)?,
        stream.alloc_zeros::<bf16>(n)?,
    );
    stream.synchronize()?;
    report(stream, "swiglu", |backward| {
        match backward {
            true => swiglu_backward(stream, &args, &dc, &a, &b, &mut da, &mut db)?,
            false => swiglu_forward(stream, &args, &a, &b, &mut c)?,
        }
        Ok(())
    })
}

fn main() -> Res<()> {
    let ops: Vec<String> = std::env::args().skip(1).collect();
    if let Some(op) = ops.iter().find(|op| !OPS.contains(&op.as_str())) {
        return Err(format!("unknown op {op:?}: expected some of {OPS:?}").into());
    }
    let var = |v: &str| std::env::var(v).unwrap_or_else(|_| "unset".into());
    println!(
        "CUDA_CACHE_DISABLE={}, CUDA_MODULE_LOADING={}, {}={}",
        var("CUDA_CACHE_DISABLE"),
        var("CUDA_MODULE_LOADING"),
        liger_rs::BASELINE_PTX_ENV,
        var(liger_rs::BASELINE_PTX_ENV)
    );
    let start = Instant::now();
    let ctx = match liger_rs::cuda_context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("no GPU ({e}): nothing to time");
            return Ok(());
        }
    };
    let stream = ctx.default_stream();
    stream.synchronize()?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let (mut driver, mut loading) = (0, sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING);
    // SAFETY: each call writes one value; the driver is loaded (a context exists).
    unsafe {
        sys::cuDriverGetVersion(&mut driver).result()?;
        sys::cuModuleGetLoadingMode(&mut loading).result()?;
    }
    println!(
        "context  {ms:.1} ms ({}, compute capability {:?}, driver CUDA {}.{}, {loading:?})",
        ctx.name()?,
        ctx.compute_capability()?,
        driver / 1000,
        driver % 1000 / 10
    );
    for op in OPS {
        if !ops.is_empty() && !ops.iter().any(|o| o == op) {
            continue;
        }
        match op {
            "rms_norm" => rms_norm(&stream)?,
            "rope" => rope(&stream)?,
            _ => swiglu(&stream)?,
        }
    }
    Ok(())
}
