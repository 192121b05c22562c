//! `cargo bench --bench adamw`: one AdamW step over the training example's 46 M parameters
//! and over a 1.0 B-parameter list of Llama-shaped tensors (f32 gradients; bf16 gradients with
//! bf16 weight copies), timed with CUDA events (median of 20 after 3 warm-up steps), as GB/s
//! on the 28 bytes per parameter a step must move (θ, m, v read and written in f32, the
//! gradient read, the copy written) beside a device-to-device copy timed in the same run.
//! `scripts/gpu/adamw_anchors.py` times PyTorch's `AdamW(fused=True)` and `foreach=True` on
//! the same lists. `adamw -- --torch-cases DIR` instead checks liger-rs's steps bit for bit
//! against the PyTorch results that `adamw_anchors.py --write-cases DIR` saved. Without a
//! GPU it prints one line and exits 0.
use half::bf16;
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, sys};
use liger_rs::{AdamWArgs, AdamWTensor, Dtype, StepScalars, adamw_step, adamw_step_with_copies};
use std::sync::Arc;

fn time_ms(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let ctx = stream.context();
    let ev = || {
        ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event")
    };
    let mut ms: Vec<f64> = (0..20)
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
    ms[10]
}

/// The example's tensors (4 layers, hidden 1024, 16/4 heads of 64, intermediate 2816, vocab
/// 512) and a 1 B list (16 layers, hidden 2048, 16/4 heads of 128, intermediate 5632, vocab
/// 32000), as element counts.
fn shapes(layers: usize, h: usize, kv: usize, inter: usize, vocab: usize) -> Vec<usize> {
    let mut v = vec![vocab * h];
    for _ in 0..layers {
        v.extend([
            h,
            h * h,
            kv * h,
            kv * h,
            h * h,
            h,
            inter * h,
            inter * h,
            h * inter,
        ]);
    }
    v.extend([h, vocab * h]);
    v
}

struct Tensors<G> {
    bufs: Vec<[CudaSlice<f32>; 3]>,
    grads: Vec<CudaSlice<G>>,
}

fn tensors<G: Dtype>(stream: &Arc<CudaStream>, lens: &[usize]) -> Tensors<G> {
    let z = |n| stream.alloc_zeros::<f32>(n).expect("alloc");
    Tensors {
        bufs: lens.iter().map(|&n| [z(n), z(n), z(n)]).collect(),
        grads: lens
            .iter()
            .map(|&n| stream.alloc_zeros::<G>(n).expect("alloc"))
            .collect(),
    }
}

fn step<G: Dtype>(
    stream: &Arc<CudaStream>,
    t: &mut Tensors<G>,
    copies: Option<&mut [CudaSlice<bf16>]>,
) {
    let mut list: Vec<AdamWTensor<'_, G>> = t
        .bufs
        .iter_mut()
        .zip(t.grads.iter_mut())
        .map(|([p, m, v], g)| AdamWTensor {
            param: p,
            grad: &*g,
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        })
        .collect();
    let args = AdamWArgs::new(1e-4);
    let s = StepScalars::default();
    match copies {
        None => adamw_step(stream, &args, 10.0, &s, &mut list).expect("step"),
        Some(c) => {
            let mut c: Vec<&mut dyn DevicePtrMut<bf16>> = c.iter_mut().map(|c| c as _).collect();
            adamw_step_with_copies(stream, &args, 10.0, &s, &mut list, &mut c).expect("step")
        }
    }
}

/// Reads `DIR/NAME` as raw little-endian f32 (what numpy's `tofile` writes).
fn read(dir: &str, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(format!("{dir}/{name}")).unwrap_or_else(|e| panic!("{name}: {e}"));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Five steps of each saved case, compared with PyTorch's fused AdamW bit for bit.
fn torch_cases(stream: &Arc<CudaStream>, dir: &str) {
    let meta = std::fs::read_to_string(format!("{dir}/cases.txt")).expect("cases.txt");
    println!("case,step,param_bits_differing,m_bits_differing,v_bits_differing");
    for line in meta.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| f[i].parse::<f64>().unwrap();
        let args = AdamWArgs::new(num(2))
            .with_betas(num(3), num(4))
            .with_eps(num(5))
            .with_weight_decay(num(6))
            .with_amsgrad(f[7] == "1");
        let n: usize = f[1].parse().unwrap();
        let z = || stream.alloc_zeros::<f32>(n).expect("alloc");
        let mut p = stream
            .clone_htod(&read(dir, &format!("{}.param0", f[0])))
            .expect("up");
        let (mut m, mut v, mut mx) = (z(), z(), z());
        for t in 1..=5 {
            let g = stream
                .clone_htod(&read(dir, &format!("{}.grad{t}", f[0])))
                .expect("up");
            let mut list = [AdamWTensor {
                param: &mut p,
                grad: &g,
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
                max_exp_avg_sq: args
                    .amsgrad
                    .then_some(&mut mx as &mut dyn DevicePtrMut<f32>),
            }];
            adamw_step(stream, &args, t as f32, &StepScalars::default(), &mut list).expect("step");
            let differ = |ours: &CudaSlice<f32>, what: &str| {
                let want = read(dir, &format!("{}.{what}{t}", f[0]));
                let got = stream.clone_dtoh(ours).expect("down");
                got.iter()
                    .zip(&want)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count()
            };
            println!(
                "{},{t},{},{},{}",
                f[0],
                differ(&p, "param"),
                differ(&m, "m"),
                differ(&v, "v")
            );
        }
    }
}

fn main() {
    let ctx = match liger_rs::cuda_context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("adamw bench: no GPU ({e}); nothing to time");
            return;
        }
    };
    let stream = ctx.default_stream();
    let argv: Vec<String> = std::env::args().collect();
    if let Some(i) = argv.iter().position(|a| a == "--torch-cases") {
        torch_cases(&stream, &argv[i + 1]);
        return;
    }
    println!("list,params,grads,ms,GB/s,copy_GB/s,share_of_copy");
    for (name, lens) in [
        ("example_46M", shapes(4, 1024, 256, 2816, 512)),
        ("llama_1B", shapes(16, 2048, 512, 5632, 32000)),
    ] {
        let n: usize = lens.iter().sum();
        let bytes = 28.0 * n as f64;
        let a = stream
            .alloc_zeros::<u8>((bytes / 2.0) as usize)
            .expect("alloc");
        let mut b = stream
            .alloc_zeros::<u8>((bytes / 2.0) as usize)
            .expect("alloc");
        let copy = time_ms(&stream, || stream.memcpy_dtod(&a, &mut b).expect("copy"));
        let copy_gbs = bytes / copy / 1e6;
        let mut f = tensors::<f32>(&stream, &lens);
        let ms = time_ms(&stream, || step(&stream, &mut f, None));
        println!(
            "{name},{n},f32,{ms:.3},{:.0},{copy_gbs:.0},{:.1}%",
            bytes / ms / 1e6,
            100.0 * copy / ms
        );
        drop(f);
        let mut h = tensors::<bf16>(&stream, &lens);
        let mut copies: Vec<CudaSlice<bf16>> = lens
            .iter()
            .map(|&n| stream.alloc_zeros::<bf16>(n).expect("alloc"))
            .collect();
        let ms = time_ms(&stream, || step(&stream, &mut h, Some(&mut copies)));
        println!(
            "{name},{n},bf16+bf16 copy,{ms:.3},{:.0},{copy_gbs:.0},{:.1}%",
            bytes / ms / 1e6,
            100.0 * copy / ms
        );
    }
}
