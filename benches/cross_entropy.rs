//! `cargo bench --bench cross_entropy`: cross-entropy and fused linear cross-entropy timed
//! with CUDA events (median of 20 after 3 warm-up runs) at the shapes
//! `scripts/gpu/ce_anchors.py` times PyTorch and Liger-Kernel on, bf16:
//! - cross-entropy over 8192 × 32000 and 8192 × 128256 logits: the forward alone (the loss and
//!   lse), the forward with the gradient written in place (Liger's op), and the backward from
//!   the lse, as GB/s on the bytes each must move (read the logits; read and write them; read
//!   and write them) beside a device-to-device copy of the logits timed in the same run;
//! - fused linear cross-entropy at 8192 tokens × hidden 4096 × vocab 128256: the time of the
//!   forward and backward, and the device memory the call adds at its peak beyond its inputs
//!   and outputs (the memory pool's high-water mark).
//!
//! `cross_entropy -- --torch-cases DIR` instead checks liger-rs against the PyTorch and Liger
//! results `ce_anchors.py --write-cases DIR` saved for the same inputs; `-- --rows-only` times
//! the cross-entropy rows alone. Without a GPU it prints one line and exits 0.
use half::bf16;
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, sys};
use liger_rs::{
    CrossEntropyArgs, LinearCrossEntropyArgs, LinearCrossEntropyGrads, cross_entropy_backward,
    cross_entropy_forward, cross_entropy_forward_backward_inplace, fused_linear_cross_entropy,
};
use std::sync::Arc;

const WARMUP: usize = 3;
const REPS: usize = 20;

fn time_ms(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        f();
    }
    let ctx = stream.context();
    let ev = || {
        ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event")
    };
    let mut ms: Vec<f64> = (0..REPS)
        .map(|_| {
            let (s, e) = (ev(), ev());
            s.record(stream).expect("record");
            f();
            e.record(stream).expect("record");
            e.synchronize().expect("sync");
            s.elapsed_ms(&e).expect("elapsed") as f64
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[REPS / 2]
}

fn random(stream: &Arc<CudaStream>, n: usize, seed: u64, scale: f32) -> CudaSlice<bf16> {
    let mut x = seed | 1;
    let v: Vec<bf16> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        })
        .collect();
    stream.clone_htod(&v).expect("upload")
}

fn targets(stream: &Arc<CudaStream>, rows: usize, vocab: usize) -> CudaSlice<i64> {
    let t: Vec<i64> = (0..rows).map(|i| (i * 7919 % vocab) as i64).collect();
    stream.clone_htod(&t).expect("upload")
}

/// The default memory pool's bytes in use now, and its high-water mark reset to it.
fn pool_used(stream: &Arc<CudaStream>) -> u64 {
    let ctx = stream.context();
    let mut pool = std::ptr::null_mut();
    let mut used = 0u64;
    // SAFETY: queries and resets attributes of the device's default pool; the pointers are
    // valid for the values written.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .expect("pool");
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
        sys::cuMemPoolGetAttribute(pool, attr, &mut used as *mut u64 as *mut _)
            .result()
            .expect("used");
        let mut zero = 0u64;
        let high = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        sys::cuMemPoolSetAttribute(pool, high, &mut zero as *mut u64 as *mut _)
            .result()
            .expect("reset");
    }
    used
}

/// The default pool's high-water mark since the last [`pool_used`].
fn pool_high(stream: &Arc<CudaStream>) -> u64 {
    let ctx = stream.context();
    let mut pool = std::ptr::null_mut();
    let mut high = 0u64;
    // SAFETY: as in `pool_used`.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .expect("pool");
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        sys::cuMemPoolGetAttribute(pool, attr, &mut high as *mut u64 as *mut _)
            .result()
            .expect("high");
    }
    high
}

fn cross_entropy_rows(stream: &Arc<CudaStream>) {
    println!("op,rows,vocab,ms,GB/s,copy_GB/s,share_of_copy");
    for vocab in [32000, 128256] {
        let rows = 8192;
        let args = CrossEntropyArgs::new(rows, vocab);
        let bytes = (rows * vocab * 2) as f64;
        let mut z = random(stream, rows * vocab, 1, 4.0);
        let mut other = stream.alloc_zeros::<bf16>(rows * vocab).expect("alloc");
        let target = targets(stream, rows, vocab);
        let mut loss = stream.alloc_zeros::<f32>(1).expect("alloc");
        let mut lse = stream.alloc_zeros::<f32>(rows).expect("alloc");
        let g = stream.clone_htod(&[1.0f32]).expect("upload");
        let copy = time_ms(stream, || {
            stream.memcpy_dtod(&z, &mut other).expect("copy");
        });
        let copy_gbs = 2.0 * bytes / copy / 1e6;
        let fwd = time_ms(stream, || {
            cross_entropy_forward(stream, &args, &z, &target, None, &mut loss, None, &mut lse)
                .expect("forward")
        });
        let bwd = time_ms(stream, || {
            cross_entropy_backward(stream, &args, &z, &target, None, &lse, &g, &mut other)
                .expect("backward")
        });
        let fused = time_ms(stream, || {
            cross_entropy_forward_backward_inplace(
                stream, &args, &mut z, &target, None, &mut loss, None,
            )
            .expect("forward_backward")
        });
        for (op, ms, moved, copy_ms) in [
            ("ce_fwd", fwd, bytes, copy / 2.0),
            ("ce_fwd_bwd_inplace", fused, 2.0 * bytes, copy),
            ("ce_bwd", bwd, 2.0 * bytes, copy),
        ] {
            println!(
                "{op},{rows},{vocab},{ms:.4},{:.0},{copy_gbs:.0},{:.1}%",
                moved / ms / 1e6,
                100.0 * copy_ms / ms
            );
        }
    }
}

fn fused_linear(stream: &Arc<CudaStream>, chunk: Option<usize>) {
    let (t, h, v) = (8192, 4096, 128256);
    let mut args = LinearCrossEntropyArgs::new(t, h, v);
    if let Some(c) = chunk {
        args = args.with_chunk(c);
    }
    let x = random(stream, t * h, 2, 1.0);
    let w = random(stream, v * h, 3, 0.02);
    let target = targets(stream, t, v);
    let mut loss = stream.alloc_zeros::<f32>(1).expect("alloc");
    let mut dx = stream.alloc_zeros::<bf16>(t * h).expect("alloc");
    let mut dw = stream.alloc_zeros::<f32>(v * h).expect("alloc");
    let mut call = || {
        fused_linear_cross_entropy(
            stream,
            &args,
            &x,
            &w,
            None,
            &target,
            None,
            &mut loss,
            None,
            LinearCrossEntropyGrads {
                dx: &mut dx,
                dweight: &mut dw,
                dbias: None,
            },
        )
        .expect("fused linear cross-entropy")
    };
    let ms = time_ms(stream, &mut call);
    stream.synchronize().expect("sync");
    let before = pool_used(stream);
    call();
    stream.synchronize().expect("sync");
    let extra = pool_high(stream).saturating_sub(before);
    let flops = 3.0 * 2.0 * (t * h * v) as f64;
    println!(
        "flce,{t},{h},{v},chunk {},{ms:.3} ms,{:.0} TFLOP/s,{:.1} MiB extra (dW f32 {:.0} MiB, dx {:.0} MiB are outputs)",
        args.chunk_tokens(),
        flops / ms / 1e9,
        extra as f64 / (1 << 20) as f64,
        (v * h * 4) as f64 / (1 << 20) as f64,
        (t * h * 2) as f64 / (1 << 20) as f64,
    );
}

/// Reads `DIR/NAME` as raw little-endian values of `T` (what numpy's `tofile` writes).
fn read<T: Copy + Default>(dir: &str, name: &str) -> Vec<T> {
    let bytes = std::fs::read(format!("{dir}/{name}")).unwrap_or_else(|e| panic!("{name}: {e}"));
    let n = bytes.len() / size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: `v` holds `n` plain values, `bytes` at least their bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            v.as_mut_ptr() as *mut u8,
            n * size_of::<T>(),
        )
    };
    v
}

/// Compares liger-rs with PyTorch's and Liger's results on the inputs `ce_anchors.py` saved:
/// the loss, and the gradient as the largest difference relative to its largest element.
fn torch_cases(stream: &Arc<CudaStream>, dir: &str) {
    let meta = std::fs::read_to_string(format!("{dir}/cases.txt")).expect("cases.txt");
    println!("case,impl,loss,ours,loss_diff,grad_max_rel_diff");
    for line in meta.lines() {
        // name rows vocab label_smoothing lse_square_scale softcap(0 = none) ignore_index
        let f: Vec<&str> = line.split_whitespace().collect();
        let (name, rows, vocab) = (f[0], f[1].parse().unwrap(), f[2].parse().unwrap());
        let (eps, lambda, cap): (f32, f32, f32) = (
            f[3].parse().unwrap(),
            f[4].parse().unwrap(),
            f[5].parse().unwrap(),
        );
        let args = CrossEntropyArgs::new(rows, vocab)
            .with_label_smoothing(eps)
            .with_lse_square_scale(lambda)
            .with_softcap((cap > 0.0).then_some(cap))
            .with_ignore_index(f[6].parse().unwrap());
        let z: Vec<bf16> = read(dir, &format!("{name}.logits"));
        let t: Vec<i64> = read(dir, &format!("{name}.target"));
        let mut zd = stream.clone_htod(&z).expect("upload");
        let td = stream.clone_htod(&t).expect("upload");
        let mut loss = stream.alloc_zeros::<f32>(1).expect("alloc");
        cross_entropy_forward_backward_inplace(stream, &args, &mut zd, &td, None, &mut loss, None)
            .expect("cross-entropy");
        let ours = stream.clone_dtoh(&loss).expect("download")[0];
        let grad = stream.clone_dtoh(&zd).expect("download");
        for imp in ["torch", "liger"] {
            let Ok(bytes) = std::fs::read(format!("{dir}/{name}.{imp}.loss")) else {
                continue;
            };
            let theirs = f32::from_le_bytes(bytes[..4].try_into().unwrap());
            let g: Vec<bf16> = read(dir, &format!("{name}.{imp}.grad"));
            let scale = g.iter().fold(1e-30f32, |m, x| m.max(x.to_f32().abs()));
            let worst = g
                .iter()
                .zip(&grad)
                .map(|(a, b)| (a.to_f32() - b.to_f32()).abs())
                .fold(0.0f32, f32::max);
            println!(
                "{name},{imp},{theirs:.7},{ours:.7},{:.2e},{:.2e}",
                (ours - theirs).abs(),
                worst / scale
            );
        }
    }
}

/// The fused linear cross-entropy against PyTorch's `linear` + `cross_entropy` and Liger's
/// FLCE on the inputs `ce_anchors.py` saved: the loss, and dx and dW as the largest difference
/// relative to their largest element.
fn torch_flce_case(stream: &Arc<CudaStream>, dir: &str) {
    let meta = std::fs::read_to_string(format!("{dir}/flce.txt")).expect("flce.txt");
    let d: Vec<usize> = meta
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    let (t, h, v) = (d[0], d[1], d[2]);
    let x: Vec<bf16> = read(dir, "flce.x");
    let w: Vec<bf16> = read(dir, "flce.w");
    let target: Vec<i64> = read(dir, "flce.target");
    let (xd, wd) = (
        stream.clone_htod(&x).expect("up"),
        stream.clone_htod(&w).expect("up"),
    );
    let td = stream.clone_htod(&target).expect("up");
    let mut loss = stream.alloc_zeros::<f32>(1).expect("alloc");
    let mut dx = stream.alloc_zeros::<bf16>(t * h).expect("alloc");
    let mut dw = stream.alloc_zeros::<f32>(v * h).expect("alloc");
    fused_linear_cross_entropy(
        stream,
        &LinearCrossEntropyArgs::new(t, h, v),
        &xd,
        &wd,
        None,
        &td,
        None,
        &mut loss,
        None,
        LinearCrossEntropyGrads {
            dx: &mut dx,
            dweight: &mut dw,
            dbias: None,
        },
    )
    .expect("fused linear cross-entropy");
    let ours = stream.clone_dtoh(&loss).expect("down")[0];
    let dx: Vec<f32> = stream
        .clone_dtoh(&dx)
        .expect("down")
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let dw = stream.clone_dtoh(&dw).expect("down");
    let rel = |ours: &[f32], theirs: &[f32]| {
        let scale = theirs.iter().fold(1e-30f32, |m, x| m.max(x.abs()));
        let worst = ours
            .iter()
            .zip(theirs)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        worst / scale
    };
    println!("flce,impl,loss,ours,loss_diff,dx_max_rel_diff,dw_max_rel_diff");
    for imp in ["torch", "liger"] {
        let Ok(bytes) = std::fs::read(format!("{dir}/flce.{imp}.loss")) else {
            continue;
        };
        let theirs = f32::from_le_bytes(bytes[..4].try_into().unwrap());
        let (tdx, tdw): (Vec<f32>, Vec<f32>) = (
            read(dir, &format!("flce.{imp}.dx")),
            read(dir, &format!("flce.{imp}.dw")),
        );
        println!(
            "{t}x{h}x{v},{imp},{theirs:.7},{ours:.7},{:.2e},{:.2e},{:.2e}",
            (ours - theirs).abs(),
            rel(&dx, &tdx),
            rel(&dw, &tdw)
        );
    }
}

fn main() {
    let ctx = match liger_rs::cuda_context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("cross_entropy bench: no GPU ({e}); nothing to time");
            return;
        }
    };
    let stream = ctx.default_stream();
    let argv: Vec<String> = std::env::args().collect();
    if let Some(i) = argv.iter().position(|a| a == "--torch-cases") {
        torch_cases(&stream, &argv[i + 1]);
        torch_flce_case(&stream, &argv[i + 1]);
        return;
    }
    cross_entropy_rows(&stream);
    if argv.iter().any(|a| a == "--rows-only") {
        return;
    }
    fused_linear(&stream, None);
    // Liger-Kernel's chunk rule at this shape.
    fused_linear(&stream, Some(256));
}
