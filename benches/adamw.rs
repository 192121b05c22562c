//! `cargo bench --bench adamw`: one AdamW step over the training example's 46 M parameters
//! and over a 1.0 B-parameter list of Llama-shaped tensors (f32 gradients; bf16 gradients with
//! bf16 weight copies), timed with CUDA events (median of 20 samples of 5 steps back to back,
//! after 3 warm-up steps), as GB/s on the 28 bytes per parameter a step must move (θ, m, v
//! read and written in f32, the gradient read, the copy written) beside a device-to-device
//! copy timed in the same run. With `--features candle` it also times candle-nn's `AdamW` and
//! this crate's candle optimizer on the same lists. `scripts/gpu/adamw_anchors.py` times
//! PyTorch's `AdamW(fused=True)` and `foreach=True` on them. `adamw -- --torch-cases DIR`
//! instead checks liger-rs's AdamW and SGD steps bit for bit against the PyTorch results that
//! `adamw_anchors.py --write-cases DIR` saved. Without a GPU it prints one line and exits 0.
use half::bf16;
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, sys};
use liger_rs::{
    AdamWArgs, AdamWTensor, Dtype, SgdArgs, SgdTensor, StepScalars, adamw_step,
    adamw_step_with_copies, sgd_step,
};
use std::sync::Arc;

/// Steps per timed sample: back to back, as in a training loop, so that a step's host work
/// overlaps the previous step's kernels.
const BACK_TO_BACK: usize = 5;

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
            for _ in 0..BACK_TO_BACK {
                f();
            }
            e.record(stream).expect("record");
            e.synchronize().expect("sync");
            s.elapsed_ms(&e).expect("elapsed") as f64 / BACK_TO_BACK as f64
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

/// Zero weights and moments with gradients of 0.01, as PyTorch's anchor and the candle rows
/// take them: an all-zero second moment would send every `√v` down the square root's slow
/// path for special inputs and time that instead.
fn tensors<G: Dtype>(stream: &Arc<CudaStream>, lens: &[usize]) -> Tensors<G> {
    let z = |n| stream.alloc_zeros::<f32>(n).expect("alloc");
    let g = G::from_f64(0.01);
    Tensors {
        bufs: lens.iter().map(|&n| [z(n), z(n), z(n)]).collect(),
        grads: lens
            .iter()
            .map(|&n| stream.clone_htod(&vec![g; n]).expect("upload"))
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

/// How many elements of `got` differ from `want` and by at most how many ulps, as
/// `count (≤N ulp)`.
fn differing(got: &[f32], want: &[f32]) -> String {
    let ulps = |(a, b): (&f32, &f32)| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs();
    let d: Vec<u64> = got.iter().zip(want).map(ulps).filter(|&u| u > 0).collect();
    format!("{} (≤{} ulp)", d.len(), d.iter().max().unwrap_or(&0))
}

/// Every step of each saved case, compared with PyTorch's fused AdamW bit for bit.
fn torch_cases(stream: &Arc<CudaStream>, dir: &str) {
    let meta = std::fs::read_to_string(format!("{dir}/cases.txt")).expect("cases.txt");
    println!("case,step,param_bits_differing,m_bits_differing,v_bits_differing");
    for line in meta.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f[3] == "sgd" {
            sgd_case(stream, dir, &f);
            continue;
        }
        let num = |i: usize| f[i].parse::<f64>().unwrap();
        let rule = if f[3] == "adam" {
            AdamWArgs::adam
        } else {
            AdamWArgs::new
        };
        let args = rule(num(4))
            .with_betas(num(5), num(6))
            .with_eps(num(7))
            .with_weight_decay(num(8))
            .with_amsgrad(f[9] == "1")
            .with_maximize(f[10] == "1");
        let (n, steps): (usize, usize) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        let z = || stream.alloc_zeros::<f32>(n).expect("alloc");
        let mut p = stream
            .clone_htod(&read(dir, &format!("{}.param0", f[0])))
            .expect("up");
        let (mut m, mut v, mut mx) = (z(), z(), z());
        for t in 1..=steps {
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
                differing(&stream.clone_dtoh(ours).expect("down"), &want)
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

/// An SGD case of [`torch_cases`]: `name n steps sgd lr momentum dampening weight_decay
/// nesterov maximize`; its buffer is saved as `m`.
fn sgd_case(stream: &Arc<CudaStream>, dir: &str, f: &[&str]) {
    let num = |i: usize| f[i].parse::<f64>().unwrap();
    let args = SgdArgs::new(num(4))
        .with_momentum(num(5))
        .with_dampening(num(6))
        .with_weight_decay(num(7))
        .with_nesterov(f[8] == "1")
        .with_maximize(f[9] == "1");
    let (n, steps): (usize, usize) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    let mut p = stream
        .clone_htod(&read(dir, &format!("{}.param0", f[0])))
        .expect("up");
    let mut b = stream.alloc_zeros::<f32>(n).expect("alloc");
    let momentum = args.momentum != 0.0;
    for t in 1..=steps {
        let g = stream
            .clone_htod(&read(dir, &format!("{}.grad{t}", f[0])))
            .expect("up");
        let mut list = [SgdTensor {
            param: &mut p,
            grad: &g,
            momentum_buffer: momentum.then_some(&mut b as &mut dyn DevicePtrMut<f32>),
        }];
        sgd_step(stream, &args, t == 1, &StepScalars::default(), &mut list).expect("step");
        let differ = |ours: &CudaSlice<f32>, what: &str| {
            let want = read(dir, &format!("{}.{what}{t}", f[0]));
            differing(&stream.clone_dtoh(ours).expect("down"), &want)
        };
        let bufs = match momentum {
            true => differ(&b, "m"),
            false => "-".into(),
        };
        println!("{},{t},{},{bufs},", f[0], differ(&p, "param"));
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
        drop(h);
        let ms = bf16_moments(&stream, &lens, &mut copies);
        // θ read and written (8 bytes), m and v in bf16 (8), the gradient and the copy (4).
        let small = 20.0 * n as f64;
        println!(
            "{name},{n},bf16+bf16 copy+bf16 moments,{ms:.3},{:.0},{copy_gbs:.0},{:.1}%",
            small / ms / 1e6,
            100.0 * copy * (small / bytes) / ms
        );
        drop(copies);
        #[cfg(feature = "candle")]
        candle_rows(name, &lens, copy);
    }
}

/// One step with bf16 gradients, bf16 copies and bf16 moments over `lens` (ms).
fn bf16_moments(stream: &Arc<CudaStream>, lens: &[usize], copies: &mut [CudaSlice<bf16>]) -> f64 {
    let g = bf16::from_f32(0.01);
    let mut params: Vec<CudaSlice<f32>> = lens
        .iter()
        .map(|&n| stream.alloc_zeros(n).expect("alloc"))
        .collect();
    let mut moments: Vec<[CudaSlice<bf16>; 2]> = lens
        .iter()
        .map(|&n| [0, 1].map(|_| stream.alloc_zeros(n).expect("alloc")))
        .collect();
    let grads: Vec<CudaSlice<bf16>> = lens
        .iter()
        .map(|&n| stream.clone_htod(&vec![g; n]).expect("upload"))
        .collect();
    time_ms(stream, || {
        let mut list: Vec<AdamWTensor<'_, bf16, bf16>> = params
            .iter_mut()
            .zip(moments.iter_mut())
            .zip(&grads)
            .map(|((p, [m, v]), g)| AdamWTensor {
                param: p,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: None,
            })
            .collect();
        let mut c: Vec<&mut dyn DevicePtrMut<bf16>> = copies.iter_mut().map(|c| c as _).collect();
        let s = StepScalars::default();
        adamw_step_with_copies(stream, &AdamWArgs::new(1e-4), 10.0, &s, &mut list, &mut c)
            .expect("step");
    })
}

/// With the `candle` feature: one step of candle-nn's `AdamW` and of
/// `liger_rs::candle::nn::AdamW` over f32 `Var`s of the same list (on candle's stream).
#[cfg(feature = "candle")]
fn candle_rows(name: &str, lens: &[usize], copy_ms: f64) {
    use candle_core::{DType, Device, Tensor, Var, backprop::GradStore};
    use candle_nn::{Optimizer, ParamsAdamW};
    let dev = Device::new_cuda(0).expect("candle CUDA");
    let Device::Cuda(cuda) = &dev else { return };
    let stream = cuda.cuda_stream();
    let vars: Vec<Var> = lens
        .iter()
        .map(|&n| Var::zeros(n, DType::F32, &dev).expect("var"))
        .collect();
    let mut grads = GradStore::default();
    for v in &vars {
        let g = Tensor::full(0.01f32, v.elem_count(), &dev).expect("grad");
        grads.insert(v.as_tensor(), g);
    }
    let n: usize = lens.iter().sum();
    let bytes = 28.0 * n as f64;
    let params = ParamsAdamW {
        lr: 1e-4,
        ..Default::default()
    };
    let mut theirs = candle_nn::AdamW::new(vars.clone(), params.clone()).expect("candle-nn");
    let ms = time_ms(&stream, || theirs.step(&grads).expect("step"));
    println!(
        "{name},{n},candle-nn AdamW (f32),{ms:.3},{:.0},,{:.1}%",
        bytes / ms / 1e6,
        100.0 * copy_ms / ms
    );
    drop(theirs);
    let mut ours = liger_rs::candle::nn::AdamW::new(vars, params).expect("liger-rs");
    let ms = time_ms(&stream, || ours.step(&grads).expect("step"));
    println!(
        "{name},{n},liger-rs candle AdamW (f32),{ms:.3},{:.0},,{:.1}%",
        bytes / ms / 1e6,
        100.0 * copy_ms / ms
    );
}
