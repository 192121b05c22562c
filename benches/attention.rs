//! `cargo bench --bench attention`: the fused attention forward and backward timed with CUDA
//! events (median of 20 after 3 warm-up runs), as TFLOP/s on `4·B·Hq·Sq·Sk·d` forward FLOPs
//! (half of that causal) and 2.5× those backward, at the shapes `scripts/gpu/attention_anchors.py`
//! times PyTorch SDPA (flash) and FlexAttention on: B = 4, Hq = 16, Hkv = 4, bf16, seq 2048
//! and 8192, head_dim 128 and 64, causal and not. `LIGER_BENCH_ATTN=small` runs seq 2048 only.
//! Without a GPU it prints one line and exits 0.
use half::bf16;
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, sys::CUevent_flags};
use liger_rs::{AttentionArgs, attention_backward, attention_forward};
use std::sync::Arc;

const WARMUP: usize = 3;
const REPS: usize = 20;

fn time_ms(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        f();
    }
    let ctx = stream.context();
    let ev = || {
        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
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

fn random(stream: &Arc<CudaStream>, n: usize, seed: u64) -> CudaSlice<bf16> {
    let mut x = seed | 1;
    let v: Vec<bf16> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        })
        .collect();
    stream.clone_htod(&v).expect("upload")
}

fn main() {
    let ctx = match liger_rs::cuda_context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("attention bench: no GPU ({e}); nothing to time");
            return;
        }
    };
    let stream = ctx.default_stream();
    let small = std::env::var("LIGER_BENCH_ATTN").is_ok_and(|v| v == "small");
    let seqs: &[usize] = if small { &[2048] } else { &[2048, 8192] };
    let (b, hq, hkv) = (4, 16, 4);
    println!("op,seq,head_dim,causal,ms,TFLOP/s");
    for &s in seqs {
        for d in [128, 64] {
            for causal in [true, false] {
                let args = AttentionArgs::new(b, s, s, hq, hkv, d).with_causal(causal);
                let q = random(&stream, b * s * hq * d, 1);
                let k = random(&stream, b * s * hkv * d, 2);
                let v = random(&stream, b * s * hkv * d, 3);
                let d_o = random(&stream, b * s * hq * d, 4);
                let mut o = stream.alloc_zeros::<bf16>(args.out_len()).expect("alloc");
                let mut lse = stream.alloc_zeros::<f32>(args.lse_len()).expect("alloc");
                let mut dq = stream.alloc_zeros::<bf16>(q.len()).expect("alloc");
                let mut dk = stream.alloc_zeros::<bf16>(k.len()).expect("alloc");
                let mut dv = stream.alloc_zeros::<bf16>(v.len()).expect("alloc");
                let flops = 4.0 * (b * hq * s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
                let fwd = time_ms(&stream, || {
                    attention_forward(&stream, &args, &q, &k, &v, &mut o, &mut lse)
                        .expect("forward")
                });
                let bwd = time_ms(&stream, || {
                    attention_backward(
                        &stream, &args, &q, &k, &v, &o, &d_o, &lse, &mut dq, &mut dk, &mut dv,
                    )
                    .expect("backward")
                });
                let c = if causal { "causal" } else { "full" };
                println!("attn_fwd,{s},{d},{c},{fwd:.3},{:.1}", flops / fwd / 1e9);
                println!(
                    "attn_bwd,{s},{d},{c},{bwd:.3},{:.1}",
                    2.5 * flops / bwd / 1e9
                );
            }
        }
    }
}
