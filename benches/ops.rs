//! `cargo bench`: every op and direction timed with CUDA events, as GB/s on the minimum bytes
//! each op must move (each input read once, each output written once: each row's `bytes`), as
//! a share of the device-to-device copy bandwidth measured in the same run (1 GiB), and as a
//! share of a copy of the op's own byte count (the "same-size" copy: what the bytes of a small
//! op cost as a copy, launch and tail included).
//! `LIGER_BENCH_CSV=path` also writes the rows as CSV; `LIGER_BENCH_OPS=rms_norm,swiglu` (any
//! of rms_norm, rope, swiglu, geglu) limits the run to those ops (e.g. to profile one kernel);
//! rms_norm includes the fused residual add + RMSNorm and its unfused baseline (an NVRTC add
//! kernel, then our RMSNorm), whose ratio it prints; rope includes, besides the NeoX rows,
//! interleaved pairs (`rope_i`), q and k as views into one fused QKV buffer (`rope_qkv`) and
//! Qwen2-VL's multimodal tables (`mrope`), and bf16 q and k with f32 tables (`rope_t32`,
//! `rope_i_t32`); geglu has the tanh form and the exact (erf) form.
//! `scripts/gpu/liger_anchors.py` times Liger-Kernel on the rows the large-shape anchors lack
//! (fused add, GEGLU tanh, `rope_i`, `rope_qkv`, `mrope`) with the same op and shape strings.
//! `ops -- --torch-cases DIR` instead runs GEGLU on the cases `scripts/gpu/glu_cases.py write
//! DIR` saved (HF's MLP in bf16 and f16) and writes liger-rs's outputs beside them for
//! `glu_cases.py compare DIR`.
//! Without a GPU it prints one line and exits 0.
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, sys::CUevent_flags};
use liger_rs::{
    CosSinDtype, CosSinLayout, Dtype, Gelu, RmsNormArgs, RopeArgs, SwigluArgs, geglu_backward,
    geglu_forward, rms_norm_backward_inplace, rms_norm_forward, rope_backward, rope_backward_fused,
    rope_forward, rope_forward_fused, swiglu_backward, swiglu_forward,
};
use std::sync::Arc;

const WARMUP: usize = 10;
const REPS: usize = 100;

/// Median time in µs of `REPS` runs of `f`, each bracketed by its own pair of CUDA events.
fn time_us(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        f();
    }
    let ctx = stream.context();
    let events: Vec<_> = (0..REPS)
        .map(|_| {
            let start = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            start.record(stream).expect("record");
            f();
            let end = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            end.record(stream).expect("record");
            (start, end)
        })
        .collect();
    stream.synchronize().expect("synchronize");
    let mut us: Vec<f64> = events
        .iter()
        .map(|(s, e)| s.elapsed_ms(e).expect("elapsed") as f64 * 1e3)
        .collect();
    us.sort_by(f64::total_cmp);
    us[REPS / 2]
}

/// Median µs of a device-to-device copy that reads and writes `n` bytes each, between buffers
/// of at least `n` bytes.
fn copy_us(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<u8>,
    dst: &mut CudaSlice<u8>,
    n: usize,
) -> f64 {
    let src = src.slice(..n);
    let mut dst = dst.slice_mut(..n);
    time_us(stream, || stream.memcpy_dtod(&src, &mut dst).expect("copy"))
}

/// Device-to-device copy of 1 GiB: bytes read + written per second, in GB/s.
fn copy_bandwidth(stream: &Arc<CudaStream>) -> f64 {
    let n = 1 << 30;
    let src = stream.alloc_zeros::<u8>(n).expect("alloc");
    let mut dst = stream.alloc_zeros::<u8>(n).expect("alloc");
    2.0 * n as f64 / copy_us(stream, &src, &mut dst, n) / 1e3
}

/// Each row's same-size copy: a device-to-device copy reading and writing half the row's
/// bytes each, timed like the ops (after them, with their buffers freed). For a small op it is
/// the fairer yardstick: launch, ramp-up and the last wave cost the copy as they cost the op.
fn same_size_copies(stream: &Arc<CudaStream>, rows: &[Row]) -> Vec<f64> {
    let n = rows.iter().map(|r| r.bytes as usize / 2).max().unwrap_or(0);
    let src = stream.alloc_zeros::<u8>(n).expect("alloc");
    let mut dst = stream.alloc_zeros::<u8>(n).expect("alloc");
    rows.iter()
        .map(|r| copy_us(stream, &src, &mut dst, r.bytes as usize / 2))
        .collect()
}

struct Row {
    op: &'static str,
    shape: String,
    dtype: &'static str,
    us: f64,
    bytes: f64,
}

fn random<T: Dtype>(stream: &Arc<CudaStream>, n: usize, seed: u64) -> CudaSlice<T> {
    let mut s = seed;
    let host: Vec<T> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            T::from_f64(((s >> 40) as f64 / (1u64 << 24) as f64) * 4.0 - 2.0)
        })
        .collect();
    stream.clone_htod(&host).expect("upload")
}

fn rms_norm<T: Dtype>(stream: &Arc<CudaStream>, rows: usize, cols: usize, out: &mut Vec<Row>) {
    let args = RmsNormArgs::new(rows, cols);
    let x = random::<T>(stream, rows * cols, 1);
    let w = random::<T>(stream, cols, 2);
    let mut y = stream.alloc_zeros::<T>(rows * cols).expect("alloc");
    let mut rstd = stream.alloc_zeros::<f32>(rows).expect("alloc");
    let mut dy = random::<T>(stream, rows * cols, 3);
    let mut dw = stream.alloc_zeros::<T>(cols).expect("alloc");
    let fwd = time_us(stream, || {
        rms_norm_forward(stream, &args, &x, Some(&w), &mut y, &mut rstd).expect("rms fwd")
    });
    let bwd = time_us(stream, || {
        rms_norm_backward_inplace(stream, &args, &mut dy, &x, Some(&w), &rstd, Some(&mut dw))
            .expect("rms bwd")
    });
    // A frozen weight (LoRA/PEFT): dX alone, the same bytes without the dW work and reduction.
    let bwd_nodw = time_us(stream, || {
        rms_norm_backward_inplace(stream, &args, &mut dy, &x, Some(&w), &rstd, None)
            .expect("rms bwd without dw")
    });
    let (shape, s) = (format!("{rows}x{cols}"), std::mem::size_of::<T>() as f64);
    let mn = (rows * cols) as f64;
    out.push(Row {
        op: "rms_norm_fwd",
        shape: shape.clone(),
        dtype: T::NAME,
        us: fwd,
        bytes: 2.0 * mn * s,
    });
    out.push(Row {
        op: "rms_norm_bwd",
        shape: shape.clone(),
        dtype: T::NAME,
        us: bwd,
        bytes: 3.0 * mn * s,
    });
    out.push(Row {
        op: "rms_norm_bwd_nodw",
        shape,
        dtype: T::NAME,
        us: bwd_nodw,
        bytes: 3.0 * mn * s,
    });
}

/// The unfused baseline's residual add, `c = a + b` in bf16 (round to nearest even), compiled
/// at run time with NVRTC (the bench's alone: the library has no add kernel): one 16-byte
/// vector of 8 elements per thread over a grid of every vector, so each element is read and
/// written once at full width. `c` may be `a` or `b`.
const ADD_BF16_SRC: &str = r#"
extern "C" __global__ void add_bf16(const uint4* a, const uint4* b, uint4* c, unsigned long long n8) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    uint4 x = a[i], y = b[i];
    unsigned int xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w}, out[4];
    for (int k = 0; k < 4; ++k) {
        unsigned int r = 0;
        for (int h = 0; h < 2; ++h) {
            float f = __uint_as_float(((xs[k] >> (16 * h)) & 0xFFFFu) << 16)
                    + __uint_as_float(((ys[k] >> (16 * h)) & 0xFFFFu) << 16);
            unsigned int u = __float_as_uint(f);
            u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            r |= (u & 0xFFFFu) << (16 * h);
        }
        out[k] = r;
    }
    c[i] = make_uint4(out[0], out[1], out[2], out[3]);
}
"#;

/// The NVRTC add of [`ADD_BF16_SRC`] as a launcher of `c = a + b` over `n` bf16 elements
/// (device pointers, `n` a multiple of 8), or why it is not available (no NVRTC library).
fn nvrtc_add_bf16(stream: &Arc<CudaStream>) -> Result<impl Fn(u64, u64, u64, usize) + '_, String> {
    use liger_rs::cudarc::driver::{LaunchConfig, PushKernelArg};
    let ptx = liger_rs::cudarc::nvrtc::compile_ptx(ADD_BF16_SRC).map_err(|e| format!("{e:?}"))?;
    let module = stream
        .context()
        .load_module(ptx)
        .map_err(|e| e.to_string())?;
    let func = module
        .load_function("add_bf16")
        .map_err(|e| e.to_string())?;
    Ok(move |a: u64, b: u64, c: u64, n: usize| {
        let n8 = (n / 8) as u64;
        let cfg = LaunchConfig {
            grid_dim: ((n8 as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&func);
        launch.arg(&a).arg(&b).arg(&c).arg(&n8);
        // SAFETY: the kernel's parameters are three pointers and a u64; every pointer covers
        // `n` bf16 elements of this stream's context (the callers' buffers).
        unsafe { launch.launch(cfg) }.expect("add launch");
    })
}

/// The fused residual add + RMSNorm (bf16, weight with dW) forward and backward, and the
/// unfused pair timed the same way: the NVRTC add then our RMSNorm forward; our RMSNorm
/// backward in place, then the add of the sum's incoming gradient (in place). Each in place
/// where the fused op is: the sum over the residual, the gradient over `ds`. Minimum bytes:
/// fused forward reads x, r and writes s, y (4·M·N·s), unfused add 3 + RMSNorm 2; fused
/// backward reads dy, ds, s and writes dx (4), unfused RMSNorm backward 3 + add 3.
fn fused_add_rms_norm(stream: &Arc<CudaStream>, rows: usize, cols: usize, out: &mut Vec<Row>) {
    use liger_rs::cudarc::driver::DevicePtr;
    use liger_rs::{
        fused_add_rms_norm_backward_inplace, fused_add_rms_norm_forward_inplace,
        rms_norm_backward_inplace,
    };
    let args = RmsNormArgs::new(rows, cols);
    let n = rows * cols;
    let h = random::<bf16>(stream, n, 11);
    let mut residual = random::<bf16>(stream, n, 12);
    let w = random::<bf16>(stream, cols, 13);
    let mut y = stream.alloc_zeros::<bf16>(n).expect("alloc");
    let mut rstd = stream.alloc_zeros::<f32>(rows).expect("alloc");
    let dy = random::<bf16>(stream, n, 14);
    let mut ds = random::<bf16>(stream, n, 15);
    let mut dw = stream.alloc_zeros::<bf16>(cols).expect("alloc");
    // Repeated calls add `h` into the residual again and again; the values stay finite over
    // the few hundred calls here (|h| ≤ 2), and the time does not depend on them.
    let fwd = time_us(stream, || {
        fused_add_rms_norm_forward_inplace(
            stream,
            &args,
            &mut residual,
            &h,
            Some(&w),
            &mut y,
            &mut rstd,
        )
        .expect("fused add fwd")
    });
    let bwd = time_us(stream, || {
        fused_add_rms_norm_backward_inplace(
            stream,
            &args,
            &dy,
            &mut ds,
            &residual,
            Some(&w),
            &rstd,
            Some(&mut dw),
        )
        .expect("fused add bwd")
    });
    let (shape, s) = (format!("{rows}x{cols}"), 2.0);
    let mn = n as f64;
    out.push(Row {
        op: "fused_add_fwd",
        shape: shape.clone(),
        dtype: "bf16",
        us: fwd,
        bytes: 4.0 * mn * s,
    });
    out.push(Row {
        op: "fused_add_bwd",
        shape: shape.clone(),
        dtype: "bf16",
        us: bwd,
        bytes: 4.0 * mn * s,
    });
    let add = match nvrtc_add_bf16(stream) {
        Ok(add) => add,
        Err(e) => {
            println!("unfused add + RMSNorm rows skipped: NVRTC unavailable ({e})");
            return;
        }
    };
    let ptr = |b: &CudaSlice<bf16>| {
        let (p, _record) = b.device_ptr(stream);
        p
    };
    let (h_p, res_p, ds_p) = (ptr(&h), ptr(&residual), ptr(&ds));
    let mut dy_dx = random::<bf16>(stream, n, 14);
    let dy_p = ptr(&dy_dx);
    let unfused_fwd = time_us(stream, || {
        add(res_p, h_p, res_p, n);
        rms_norm_forward(stream, &args, &residual, Some(&w), &mut y, &mut rstd).expect("rms fwd")
    });
    let unfused_bwd = time_us(stream, || {
        rms_norm_backward_inplace(
            stream,
            &args,
            &mut dy_dx,
            &residual,
            Some(&w),
            &rstd,
            Some(&mut dw),
        )
        .expect("rms bwd");
        add(ds_p, dy_p, ds_p, n);
    });
    out.push(Row {
        op: "add+rms_fwd",
        shape: shape.clone(),
        dtype: "bf16",
        us: unfused_fwd,
        bytes: 5.0 * mn * s,
    });
    out.push(Row {
        op: "rms+add_bwd",
        shape,
        dtype: "bf16",
        us: unfused_bwd,
        bytes: 6.0 * mn * s,
    });
    println!(
        "fused add + RMSNorm bf16 {rows}x{cols}: forward {:.2}× the unfused pair, backward {:.2}×",
        unfused_fwd / fwd,
        unfused_bwd / bwd
    );
}

/// Qwen2-VL's `mrope_section` for head_dim 128: pairs from the temporal, height and width tables.
const MROPE_SECTION: [usize; 3] = [16, 24, 24];

/// The RoPE forms the bench times, on the same q [b, s, hq, d] and k [b, s, hk, d].
#[derive(Clone, Copy)]
enum RopeForm {
    /// NeoX halves, [s, d] tables, contiguous q and k (HF's Llama; `rope_*`).
    Neox,
    /// Interleaved pairs `(x[2i], x[2i + 1])` with [s, d/2] tables, one cos/sin per pair as
    /// Liger's llama4 rope takes its complex `freqs_cis` (`rope_i_*`).
    Interleaved,
    /// q and k as token-strided views into one fused QKV projection buffer [b, s, (hq + 2·hk)·d],
    /// rotated in place; the v columns are neither read nor written (`rope_qkv_*`).
    FusedQkv,
    /// Qwen2-VL's multimodal RoPE: [3, b, s, d] tables (temporal, height, width), as Liger's
    /// qwen2vl mrope takes them, split by [`MROPE_SECTION`] (`mrope_*`).
    Multimodal,
}

/// RoPE forward and backward in place in one of the [`RopeForm`]s, q and k token-major (HF's
/// layout before its `transpose(1, 2)`). Minimum bytes: q and k read and written once,
/// 2·(|q| + |k|)·s in every form. The cos/sin tables are not counted (on these shapes what a
/// call reads of them is under 2 % of q and k's bytes, the [3, b, s, d] multimodal tables
/// included), nor is the v part of the fused QKV buffer, which is not touched.
///
/// With tables `C` other than `T` (f32 with 16-bit q and k) the op names gain `_t32`: `rope_t32_*`,
/// `rope_i_t32_*` (Liger's llama4 rope takes f32 tables).
fn rope<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    form: RopeForm,
    shape: [usize; 5],
    out: &mut Vec<Row>,
) {
    let [b, s, hq, hk, d] = shape;
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let fused = (hq + 2 * hk) * d;
    let (args, table_len, layout, fwd_op, bwd_op) = match form {
        RopeForm::Neox => (
            args,
            s * d,
            CosSinLayout::PerPosition,
            "rope_fwd",
            "rope_bwd",
        ),
        RopeForm::Interleaved => (
            args.with_interleaved().with_half_tables(),
            s * d / 2,
            CosSinLayout::PerPosition,
            "rope_i_fwd",
            "rope_i_bwd",
        ),
        RopeForm::FusedQkv => (
            args.with_strides(fused, fused),
            s * d,
            CosSinLayout::PerPosition,
            "rope_qkv_fwd",
            "rope_qkv_bwd",
        ),
        RopeForm::Multimodal => (
            args,
            3 * b * s * d,
            CosSinLayout::Multimodal {
                sections: MROPE_SECTION,
            },
            "mrope_fwd",
            "mrope_bwd",
        ),
    };
    let (nq, nk) = (b * s * hq * d, b * s * hk * d);
    let (fwd_op, bwd_op) = match (C::NAME == T::NAME, fwd_op) {
        (true, _) => (fwd_op, bwd_op),
        (false, "rope_fwd") => ("rope_t32_fwd", "rope_t32_bwd"),
        (false, "rope_i_fwd") => ("rope_i_t32_fwd", "rope_i_t32_bwd"),
        (false, op) => panic!("no f32-table row for {op}"),
    };
    let cos = random::<C>(stream, table_len, 6);
    let sin = random::<C>(stream, table_len, 7);
    let (fwd, bwd) = match form {
        RopeForm::FusedQkv => {
            let mut qkv = random::<T>(stream, b * s * fused, 4);
            let fwd = time_us(stream, || {
                rope_forward_fused(stream, &args, &mut qkv, hq * d, &cos, &sin, &layout)
                    .expect(fwd_op)
            });
            let bwd = time_us(stream, || {
                rope_backward_fused(stream, &args, &mut qkv, hq * d, &cos, &sin, &layout)
                    .expect(bwd_op)
            });
            (fwd, bwd)
        }
        _ => {
            let mut q = random::<T>(stream, nq, 4);
            let mut k = random::<T>(stream, nk, 5);
            let fwd = time_us(stream, || {
                rope_forward(stream, &args, &mut q, &mut k, &cos, &sin, &layout).expect(fwd_op)
            });
            let bwd = time_us(stream, || {
                rope_backward(stream, &args, &mut q, &mut k, &cos, &sin, &layout).expect(bwd_op)
            });
            (fwd, bwd)
        }
    };
    let shape = format!("{b}x{s}x{hq}/{hk}x{d}");
    let bytes = 2.0 * (nq + nk) as f64 * std::mem::size_of::<T>() as f64;
    out.push(Row {
        op: fwd_op,
        shape: shape.clone(),
        dtype: T::NAME,
        us: fwd,
        bytes,
    });
    out.push(Row {
        op: bwd_op,
        shape,
        dtype: T::NAME,
        us: bwd,
        bytes,
    });
}

/// SwiGLU (`gelu` None) or GEGLU forward and out-of-place backward on separate gate/up
/// buffers.
fn glu<T: Dtype>(
    stream: &Arc<CudaStream>,
    gelu: Option<Gelu>,
    rows: usize,
    cols: usize,
    out: &mut Vec<Row>,
) {
    let args = SwigluArgs::new(rows, cols);
    let n = rows * cols;
    let a = random::<T>(stream, n, 8);
    let b = random::<T>(stream, n, 9);
    let dc = random::<T>(stream, n, 10);
    let mut c = stream.alloc_zeros::<T>(n).expect("alloc");
    let mut da = stream.alloc_zeros::<T>(n).expect("alloc");
    let mut db = stream.alloc_zeros::<T>(n).expect("alloc");
    let (fwd_op, bwd_op) = match gelu {
        None => ("swiglu_fwd", "swiglu_bwd"),
        Some(Gelu::Tanh) => ("geglu_fwd", "geglu_bwd"),
        Some(_) => ("geglu_erf_fwd", "geglu_erf_bwd"),
    };
    let fwd = time_us(stream, || {
        match gelu {
            None => swiglu_forward(stream, &args, &a, &b, &mut c),
            Some(g) => geglu_forward(stream, &args, g, &a, &b, &mut c),
        }
        .expect(fwd_op)
    });
    let bwd = time_us(stream, || {
        match gelu {
            None => swiglu_backward(stream, &args, &dc, &a, &b, &mut da, &mut db),
            Some(g) => geglu_backward(stream, &args, g, &dc, &a, &b, &mut da, &mut db),
        }
        .expect(bwd_op)
    });
    let (shape, s) = (format!("{rows}x{cols}"), std::mem::size_of::<T>() as f64);
    out.push(Row {
        op: fwd_op,
        shape: shape.clone(),
        dtype: T::NAME,
        us: fwd,
        bytes: 3.0 * n as f64 * s,
    });
    out.push(Row {
        op: bwd_op,
        shape,
        dtype: T::NAME,
        us: bwd,
        bytes: 5.0 * n as f64 * s,
    });
}

/// GEGLU on each case of `dir/cases.txt` (`name rows cols tanh|erf bf16|f16`): reads
/// `NAME.{a,b,dc}` (16-bit little-endian), writes `NAME.ours.{c,da,db}`.
fn glu_torch_cases(stream: &Arc<CudaStream>, dir: &str) {
    let meta = std::fs::read_to_string(format!("{dir}/cases.txt")).expect("cases.txt");
    for line in meta.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (name, rows, cols) = (f[0], f[1].parse().unwrap(), f[2].parse().unwrap());
        let gelu = match f[3] {
            "erf" => Gelu::Erf,
            _ => Gelu::Tanh,
        };
        let case = format!("{dir}/{name}");
        match f[4] {
            "bf16" => glu_case(
                stream,
                &case,
                rows,
                cols,
                gelu,
                bf16::from_bits,
                bf16::to_bits,
            ),
            _ => glu_case(
                stream,
                &case,
                rows,
                cols,
                gelu,
                f16::from_bits,
                f16::to_bits,
            ),
        }
        println!("{name}: written");
    }
}

/// One case of [`glu_torch_cases`], its 16-bit values converted by `from` and `to`.
fn glu_case<T: Dtype>(
    stream: &Arc<CudaStream>,
    case: &str,
    rows: usize,
    cols: usize,
    gelu: Gelu,
    from: fn(u16) -> T,
    to: fn(T) -> u16,
) {
    let load = |part: &str| -> CudaSlice<T> {
        let bytes = std::fs::read(format!("{case}.{part}")).expect("case file");
        let v: Vec<T> = bytes
            .chunks_exact(2)
            .map(|w| from(u16::from_le_bytes([w[0], w[1]])))
            .collect();
        assert_eq!(v.len(), rows * cols, "{case}.{part}");
        stream.clone_htod(&v).expect("upload")
    };
    let save = |part: &str, d: &CudaSlice<T>| {
        let v = stream.clone_dtoh(d).expect("download");
        let bytes: Vec<u8> = v.into_iter().flat_map(|x| to(x).to_le_bytes()).collect();
        std::fs::write(format!("{case}.ours.{part}"), bytes).expect("write");
    };
    let (a, b, dc) = (load("a"), load("b"), load("dc"));
    let args = SwigluArgs::new(rows, cols);
    let mut c = stream.alloc_zeros::<T>(rows * cols).expect("alloc");
    let (mut da, mut db) = (
        stream.alloc_zeros::<T>(rows * cols).expect("alloc"),
        stream.alloc_zeros::<T>(rows * cols).expect("alloc"),
    );
    geglu_forward(stream, &args, gelu, &a, &b, &mut c).expect("geglu_forward");
    geglu_backward(stream, &args, gelu, &dc, &a, &b, &mut da, &mut db).expect("geglu_backward");
    save("c", &c);
    save("da", &da);
    save("db", &db);
}

fn main() {
    let ctx = match liger_rs::cuda_context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("liger-rs bench: no GPU, nothing measured ({e})");
            return;
        }
    };
    let stream = ctx.default_stream();
    let argv: Vec<String> = std::env::args().collect();
    if let Some(i) = argv.iter().position(|a| a == "--torch-cases") {
        glu_torch_cases(&stream, &argv[i + 1]);
        return;
    }
    println!("device: {}", ctx.name().unwrap_or_default());
    let copy = copy_bandwidth(&stream);
    println!("device-to-device copy: {copy:.0} GB/s");
    let ops = std::env::var("LIGER_BENCH_OPS").unwrap_or_default();
    let run = |op: &str| ops.is_empty() || ops.split(',').any(|o| o.trim() == op);
    let mut rows = Vec::new();
    if run("rms_norm") {
        for cols in [2048, 4096, 8192] {
            rms_norm::<bf16>(&stream, 16384, cols, &mut rows);
        }
        for cols in [2048, 4096, 8192] {
            rms_norm::<f32>(&stream, 16384, cols, &mut rows);
        }
        rms_norm::<f16>(&stream, 16384, 4096, &mut rows);
        rms_norm::<bf16>(&stream, 2048, 4096, &mut rows);
        rms_norm::<f32>(&stream, 2048, 4096, &mut rows);
        for cols in [4096, 2048] {
            fused_add_rms_norm(&stream, 16384, cols, &mut rows);
        }
    }
    if run("rope") {
        let llama = [4, 4096, 32, 8, 128];
        rope::<bf16, bf16>(&stream, RopeForm::Neox, llama, &mut rows);
        rope::<f32, f32>(&stream, RopeForm::Neox, llama, &mut rows);
        rope::<f16, f16>(&stream, RopeForm::Neox, llama, &mut rows);
        rope::<bf16, bf16>(&stream, RopeForm::Neox, [1, 1024, 32, 8, 128], &mut rows);
        for form in [
            RopeForm::Interleaved,
            RopeForm::FusedQkv,
            RopeForm::Multimodal,
        ] {
            rope::<bf16, bf16>(&stream, form, llama, &mut rows);
            rope::<f32, f32>(&stream, form, llama, &mut rows);
        }
        rope::<bf16, f32>(&stream, RopeForm::Neox, llama, &mut rows);
        rope::<bf16, f32>(&stream, RopeForm::Interleaved, llama, &mut rows);
    }
    if run("swiglu") {
        glu::<bf16>(&stream, None, 16384, 14336, &mut rows);
        glu::<f32>(&stream, None, 16384, 8192, &mut rows);
        glu::<f16>(&stream, None, 16384, 14336, &mut rows);
        glu::<bf16>(&stream, None, 2048, 14336, &mut rows);
    }
    if run("geglu") {
        // The tanh form (Liger's); the exact form, which Liger lacks, on the same shapes.
        for gelu in [Gelu::Tanh, Gelu::Erf] {
            glu::<bf16>(&stream, Some(gelu), 16384, 14336, &mut rows);
            glu::<f32>(&stream, Some(gelu), 16384, 8192, &mut rows);
        }
    }

    let same = same_size_copies(&stream, &rows);
    println!(
        "{:<14} {:<20} {:<5} {:>10} {:>8} {:>7} {:>10}",
        "op", "shape", "dtype", "median µs", "GB/s", "% copy", "% same-size"
    );
    let mut csv = String::from("op,shape,dtype,median_us,gbps,pct_copy,pct_same_size_copy\n");
    for (r, same_us) in rows.iter().zip(same) {
        let gbps = r.bytes / r.us / 1e3;
        let pct = 100.0 * gbps / copy;
        let pct_same = 100.0 * same_us / r.us;
        println!(
            "{:<14} {:<20} {:<5} {:>10.1} {:>8.0} {:>6.1}% {:>10.1}%",
            r.op, r.shape, r.dtype, r.us, gbps, pct, pct_same
        );
        csv.push_str(&format!(
            "{},{},{},{:.2},{:.0},{:.1},{:.1}\n",
            r.op, r.shape, r.dtype, r.us, gbps, pct, pct_same
        ));
    }
    if let Ok(path) = std::env::var("LIGER_BENCH_CSV") {
        std::fs::write(&path, csv).expect("write LIGER_BENCH_CSV");
        println!("wrote {path}");
    }
}
