//! First-run demo: one Llama-3-8B-shaped norm → attention-RoPE → MLP step on GPU 0, forward and
//! backward, in bf16: RMSNorm over [4096 tokens, 4096 hidden], RoPE on q [1, 4096, 32, 128] and
//! k [1, 4096, 8, 128], SwiGLU over [4096, 14336]. A sample of every output is checked against
//! the CPU reference, and each op's time and throughput is printed. Without a GPU it says why
//! and runs the CPU reference on a small shape instead.
use half::bf16;
use liger_rs::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys::CUevent_flags};
use liger_rs::reference::{self, rope::CosSinRows};
use liger_rs::{
    CastingMode, CosSinLayout, RmsNormArgs, RopeArgs, SwigluArgs, rms_norm_backward_inplace,
    rms_norm_forward, rope_backward, rope_forward, swiglu_backward, swiglu_forward,
};
use std::sync::Arc;

const TOKENS: usize = 4096;
const HIDDEN: usize = 4096;
const HEADS: (usize, usize, usize) = (32, 8, 128);
const INTERMEDIATE: usize = 14336;
const EPS: f32 = 1e-5;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Deterministic pseudo-random bf16 values in [−2, 2).
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

/// HF's cos/sin tables [positions, head_dim]: cat(freqs, freqs), base 500000 (Llama 3).
fn tables(positions: usize, d: usize) -> (Vec<bf16>, Vec<bf16>) {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..positions {
        for i in 0..d {
            let theta = p as f64 * 500000f64.powf(-2.0 * (i % (d / 2)) as f64 / d as f64);
            cos.push(bf16::from_f64(theta.cos()));
            sin.push(bf16::from_f64(theta.sin()));
        }
    }
    (cos, sin)
}

/// Largest |got − want| / max(|want|, rms(want)): a few bf16 ulps (2⁻⁸ each) is agreement; a
/// NaN anywhere is the worst error, ∞ (`f64::max` would drop it).
fn worst_error(got: &[bf16], want: &[bf16]) -> f64 {
    let rms = (want.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    got.iter()
        .zip(want)
        .map(|(g, w)| (g.to_f64() - w.to_f64()).abs() / w.to_f64().abs().max(rms))
        .fold(
            0.0,
            |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) },
        )
}

struct Timer<'a> {
    stream: &'a Arc<CudaStream>,
    rows: Vec<(&'static str, f64, f64)>,
}

impl Timer<'_> {
    /// Runs `f` once to warm up, then once between two events; records ms and GB/s.
    fn time(&mut self, name: &'static str, bytes: f64, mut f: impl FnMut() -> Res<()>) -> Res<()> {
        println!("[{}/8] {name} …", self.rows.len() + 1);
        f()?;
        let event = || -> Res<CudaEvent> {
            let e = self
                .stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            e.record(self.stream)?;
            Ok(e)
        };
        let start = event()?;
        f()?;
        let end = event()?;
        let ms = start.elapsed_ms(&end)? as f64;
        self.rows.push((name, ms, bytes / ms / 1e6));
        Ok(())
    }
}

fn main() -> Res<()> {
    let ctx = match liger_rs::cuda_context(0) {
        Ok(ctx) => ctx,
        Err(e) => return cpu_only(&e.to_string()),
    };
    let stream = ctx.default_stream();
    let (hq, hk, d) = HEADS;
    println!(
        "device: {}; bf16; {TOKENS} tokens, hidden {HIDDEN}, heads {hq}/{hk}×{d}, MLP {INTERMEDIATE}",
        ctx.name()?
    );
    let (x, w, dy) = (
        data(TOKENS * HIDDEN, 1),
        data(HIDDEN, 2),
        data(TOKENS * HIDDEN, 3),
    );
    let (q, k) = (data(TOKENS * hq * d, 4), data(TOKENS * hk * d, 5));
    let (dq, dk) = (data(TOKENS * hq * d, 6), data(TOKENS * hk * d, 7));
    let (cos, sin) = tables(TOKENS, d);
    let (a, b, dc) = (
        data(TOKENS * INTERMEDIATE, 8),
        data(TOKENS * INTERMEDIATE, 9),
        data(TOKENS * INTERMEDIATE, 10),
    );

    let up = |v: &[bf16]| stream.clone_htod(v);
    let (xd, wd, cosd, sind) = (up(&x)?, up(&w)?, up(&cos)?, up(&sin)?);
    let (ad, bd, dcd) = (up(&a)?, up(&b)?, up(&dc)?);
    let (mut y, mut rstd) = (
        stream.alloc_zeros::<bf16>(TOKENS * HIDDEN)?,
        stream.alloc_zeros::<f32>(TOKENS)?,
    );
    let mut dw = stream.alloc_zeros::<bf16>(HIDDEN)?;
    let mut c = stream.alloc_zeros::<bf16>(TOKENS * INTERMEDIATE)?;
    let (mut da, mut db) = (
        stream.alloc_zeros::<bf16>(TOKENS * INTERMEDIATE)?,
        stream.alloc_zeros::<bf16>(TOKENS * INTERMEDIATE)?,
    );
    let (mut qd, mut kd, mut dqd, mut dkd, mut dyd) =
        (up(&q)?, up(&k)?, up(&dq)?, up(&dk)?, up(&dy)?);

    let rms = RmsNormArgs::new(TOKENS, HIDDEN)
        .with_eps(EPS)
        .with_mode(CastingMode::Llama);
    let rope = RopeArgs::new(d).with_seq_len(TOKENS).with_heads(hq, hk);
    let mlp = SwigluArgs::new(TOKENS, INTERMEDIATE);
    let s = 2.0; // bytes per bf16
    let (nx, nqk, nm) = (
        (TOKENS * HIDDEN) as f64,
        (TOKENS * (hq + hk) * d) as f64,
        (TOKENS * INTERMEDIATE) as f64,
    );
    let mut t = Timer {
        stream: &stream,
        rows: Vec::new(),
    };
    t.time("rms_norm forward", 2.0 * nx * s, || {
        Ok(rms_norm_forward(
            &stream,
            &rms,
            &xd,
            Some(&wd),
            &mut y,
            &mut rstd,
        )?)
    })?;
    let layout = CosSinLayout::PerPosition;
    // RoPE is in place: the warm-up run rotates too, so the check below expects two rotations.
    t.time("rope forward", 2.0 * nqk * s, || {
        Ok(rope_forward(
            &stream, &rope, &mut qd, &mut kd, &cosd, &sind, &layout,
        )?)
    })?;
    t.time("rope backward", 2.0 * nqk * s, || {
        Ok(rope_backward(
            &stream, &rope, &mut dqd, &mut dkd, &cosd, &sind, &layout,
        )?)
    })?;
    t.time("swiglu forward", 3.0 * nm * s, || {
        Ok(swiglu_forward(&stream, &mlp, &ad, &bd, &mut c)?)
    })?;
    t.time("swiglu backward", 5.0 * nm * s, || {
        Ok(swiglu_backward(
            &stream, &mlp, &dcd, &ad, &bd, &mut da, &mut db,
        )?)
    })?;
    // In place over dy: the timed run sees dx from the warm-up as its dy, so dx is checked
    // from a separate run on fresh dy below.
    let rms_backward = |dyd: &mut CudaSlice<bf16>, dw: &mut CudaSlice<bf16>| {
        rms_norm_backward_inplace(&stream, &rms, dyd, &xd, Some(&wd), &rstd, Some(dw))
    };
    t.time("rms_norm backward", 3.0 * nx * s, || {
        Ok(rms_backward(&mut dyd, &mut dw)?)
    })?;
    println!("[7/8] checking samples against the CPU reference …");
    let mut dyd = up(&dy)?;
    rms_backward(&mut dyd, &mut dw)?;
    let down = |v| stream.clone_dtoh(v);
    let (y, dx, dw, c, da, db) = (
        down(&y)?,
        down(&dyd)?,
        down(&dw)?,
        down(&c)?,
        down(&da)?,
        down(&db)?,
    );
    let (qg, kg, dqg, dkg) = (down(&qd)?, down(&kd)?, down(&dqd)?, down(&dkd)?);
    let rstd = stream.clone_dtoh(&rstd)?;

    let mut worst: Vec<(&str, f64)> = Vec::new();
    let sample: Vec<usize> = (0..16).map(|i| i * (TOKENS / 16) + 7 * i).collect();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    let rms_row = RmsNormArgs::new(1, HIDDEN).with_eps(EPS);
    for &r in &sample {
        let row = r * HIDDEN..(r + 1) * HIDDEN;
        let f = reference::rms_norm_forward(&rms_row, &x[row.clone()], Some(&w))?;
        got.extend_from_slice(&y[row.clone()]);
        want.extend(f.y);
        let (dy_r, x_r) = (&dy[row.clone()], &x[row.clone()]);
        let g = reference::rms_norm_backward(&rms_row, dy_r, x_r, Some(&w), &[rstd[r]])?;
        got.extend_from_slice(&dx[row]);
        want.extend(g.dx);
    }
    worst.push(("rms_norm y, dx (16 rows)", worst_error(&got, &want)));
    let full = reference::rms_norm_forward(&rms, &x, Some(&w))?;
    let g = reference::rms_norm_backward(&rms, &dy, &x, Some(&w), &full.rstd)?;
    worst.push((
        "rms_norm dw (all)",
        worst_error(&dw, &g.dw.unwrap_or_default()),
    ));

    let (mut got, mut want) = (Vec::new(), Vec::new());
    let one = RopeArgs::new(d).with_heads(hq, hk);
    for &tk in &sample {
        let (qs, ks) = (
            tk * hq * d..(tk + 1) * hq * d,
            tk * hk * d..(tk + 1) * hk * d,
        );
        let (cr, sr) = (&cos[tk * d..(tk + 1) * d], &sin[tk * d..(tk + 1) * d]);
        let (mut q1, mut k1) = (q[qs.clone()].to_vec(), k[ks.clone()].to_vec());
        for _ in 0..2 {
            reference::rope_forward(&one, &mut q1, &mut k1, cr, sr, CosSinRows::PerPosition)?;
        }
        let (mut dq1, mut dk1) = (dq[qs.clone()].to_vec(), dk[ks.clone()].to_vec());
        for _ in 0..2 {
            reference::rope_backward(&one, &mut dq1, &mut dk1, cr, sr, CosSinRows::PerPosition)?;
        }
        got.extend(
            qg[qs.clone()]
                .iter()
                .chain(&kg[ks.clone()])
                .chain(&dqg[qs])
                .chain(&dkg[ks]),
        );
        want.extend(q1.into_iter().chain(k1).chain(dq1).chain(dk1));
    }
    worst.push(("rope q, k, dq, dk (16 tokens)", worst_error(&got, &want)));

    let (mut got, mut want) = (Vec::new(), Vec::new());
    let mlp_row = SwigluArgs::new(1, INTERMEDIATE);
    for &r in &sample {
        let row = r * INTERMEDIATE..(r + 1) * INTERMEDIATE;
        let (a_r, b_r) = (&a[row.clone()], &b[row.clone()]);
        let cw = reference::swiglu_forward(&mlp_row, a_r, b_r)?;
        let gw = reference::swiglu_backward(&mlp_row, &dc[row.clone()], a_r, b_r)?;
        got.extend(
            c[row.clone()]
                .iter()
                .chain(&da[row.clone()])
                .chain(&db[row]),
        );
        want.extend(cw.into_iter().chain(gw.da).chain(gw.db));
    }
    worst.push(("swiglu c, da, db (16 rows)", worst_error(&got, &want)));

    println!("[8/8] done\n");
    println!("{:<18} {:>9} {:>9}", "op", "ms", "GB/s");
    for (name, ms, gbps) in &t.rows {
        println!("{name:<18} {ms:>9.3} {gbps:>9.0}");
    }
    println!("\nworst error vs reference (relative; one bf16 ulp is 3.9e-3..7.8e-3):");
    let mut ok = true;
    for (name, e) in &worst {
        let pass = *e <= 1.6e-2;
        ok &= pass;
        println!(
            "  {name:<30} {e:.2e} {}",
            if pass { "ok" } else { "MISMATCH" }
        );
    }
    if !ok {
        return Err("results disagree with the CPU reference".into());
    }
    Ok(())
}

/// No GPU: one line saying why, then the reference on a small shape.
fn cpu_only(why: &str) -> Res<()> {
    println!("no GPU ({why}); running the CPU reference on a small shape instead");
    let (rows, hidden, inter, (hq, hk, d)) = (4, 64, 96, (4, 2, 16));
    let (x, w, dy) = (
        data(rows * hidden, 1),
        data(hidden, 2),
        data(rows * hidden, 3),
    );
    let rms = RmsNormArgs::new(rows, hidden).with_eps(EPS);
    let f = reference::rms_norm_forward(&rms, &x, Some(&w))?;
    let g = reference::rms_norm_backward(&rms, &dy, &x, Some(&w), &f.rstd)?;
    let (mut q, mut k) = (data(rows * hq * d, 4), data(rows * hk * d, 5));
    let (cos, sin) = tables(rows, d);
    reference::rope_forward(
        &RopeArgs::new(d).with_seq_len(rows).with_heads(hq, hk),
        &mut q,
        &mut k,
        &cos,
        &sin,
        CosSinRows::PerPosition,
    )?;
    let (a, b) = (data(rows * inter, 8), data(rows * inter, 9));
    let c = reference::swiglu_forward(&SwigluArgs::new(rows, inter), &a, &b)?;
    println!(
        "reference: rms y[0] = {}, dx[0] = {}, rope q[1] = {}, swiglu c[0] = {}",
        f.y[0], g.dx[0], q[1], c[0]
    );
    Ok(())
}
