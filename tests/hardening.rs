//! Cross-op guarantees: thread safety of the public types, bitwise determinism of every op
//! (dW included), the RMSNorm backward replayed from a captured CUDA graph (with and without
//! cudarc's event tracking, on created and per-thread streams), its kept dW scratch across
//! shapes, streams, threads sharing a stream, per-thread streams of many threads and
//! `release_scratch` from another thread, every op driven from several threads on several
//! streams at once and on two GPUs at once (skipped with one GPU), and no panic without a
//! driver or GPU.
//!
//! With the small shapes (`LIGER_RS_TEST_SHAPES=small`, sized for compute-sanitizer) the
//! RMSNorm rows are 600 instead of 3000 or 2500 (more than the 528 blocks of the 2048- and
//! 4096-column vector backward's grid on an H200, so its partial rows and kept scratch are as
//! large), the loops repeat fewer times and the capture with cudarc managing streams skips.
mod common;

use common::{Need, Rng, download, gpu, sized, skip, skip_when_small, upload};
use half::bf16;
use liger_rs::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream};
use liger_rs::reference::{self, rope::CosSinRows};
use liger_rs::{
    CastingMode, CosSinLayout, Error, RmsNormArgs, RopeArgs, SwigluArgs, rms_norm_backward,
    rms_norm_forward, rope_backward, rope_forward, swiglu_backward, swiglu_forward,
};
use std::sync::Arc;

fn send_sync<T: Send + Sync>() {}

#[test]
fn public_types_are_send_and_sync() {
    send_sync::<RmsNormArgs>();
    send_sync::<RopeArgs>();
    send_sync::<SwigluArgs>();
    send_sync::<CastingMode>();
    send_sync::<liger_rs::Error>();
    send_sync::<CosSinLayout<'static>>();
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Outputs of one pass of every op, forward and backward, on fixed inputs.
struct Pass {
    y: Vec<u16>,
    rstd: Vec<u32>,
    dx: Vec<u16>,
    dw: Vec<u16>,
    q: Vec<u16>,
    k: Vec<u16>,
    c: Vec<u16>,
    da: Vec<u16>,
    db: Vec<u16>,
}

/// Shapes: `cols` 4096 takes the vector kernels, 4095 the scalar ones (RMSNorm).
fn one_pass(stream: &Arc<CudaStream>, seed: u64, rows: usize, cols: usize) -> Pass {
    let mut rng = Rng::new(seed);
    let rms = rms_run(stream, &mut rng, rows, cols);

    let (b, s, hq, hk, d) = (2, 33, 8, 2, 128);
    let rope_args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let (mut q, mut k) = (
        upload(stream, &rng.vec::<bf16>(b * s * hq * d, 0.0, 1.0)),
        upload(stream, &rng.vec::<bf16>(b * s * hk * d, 0.0, 1.0)),
    );
    let (cos, sin) = (
        upload(stream, &rng.vec::<bf16>(s * d, 0.0, 0.7)),
        upload(stream, &rng.vec::<bf16>(s * d, 0.0, 0.7)),
    );
    rope_forward(
        stream,
        &rope_args,
        &mut q,
        &mut k,
        &cos,
        &sin,
        &CosSinLayout::PerPosition,
    )
    .unwrap();
    rope_backward(
        stream,
        &rope_args,
        &mut q,
        &mut k,
        &cos,
        &sin,
        &CosSinLayout::PerPosition,
    )
    .unwrap();

    let sw = SwigluArgs::new(rows, cols);
    let (a, bb, dc) = (
        upload(stream, &rng.vec::<bf16>(rows * cols, 0.0, 3.0)),
        upload(stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0)),
        upload(stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0)),
    );
    let mut c = common::poisoned::<bf16>(stream, rows * cols);
    let (mut da, mut db) = (
        common::poisoned::<bf16>(stream, rows * cols),
        common::poisoned::<bf16>(stream, rows * cols),
    );
    swiglu_forward(stream, &sw, &a, &bb, &mut c).unwrap();
    swiglu_backward(stream, &sw, &dc, &a, &bb, &mut da, &mut db).unwrap();
    let dl = |v: &CudaSlice<bf16>| bits(&download(stream, v));
    Pass {
        y: dl(&rms.y),
        rstd: download(stream, &rms.rstd)
            .iter()
            .map(|r| r.to_bits())
            .collect(),
        dx: dl(&rms.dx),
        dw: dl(&rms.dw),
        q: dl(&q),
        k: dl(&k),
        c: dl(&c),
        da: dl(&da),
        db: dl(&db),
    }
}

#[test]
fn gpu_every_op_is_bitwise_deterministic() {
    let Some(stream) = gpu("gpu_every_op_is_bitwise_deterministic") else {
        return;
    };
    // 3000 (small shapes: 600) rows: the RMSNorm backward spreads them over hundreds of
    // blocks, so dW is a sum of many partial rows whose order must not depend on scheduling.
    let rows = sized(3000, 600);
    for (rows, cols) in [(rows, 4096), (rows, 4095)] {
        let first = one_pass(&stream, 99, rows, cols);
        for run in 1..=sized(3, 1) {
            let again = one_pass(&stream, 99, rows, cols);
            let case = format!("{rows}×{cols}, run {run}");
            assert!(first.y == again.y, "rms y differs, {case}");
            assert!(first.rstd == again.rstd, "rms rstd differs, {case}");
            assert!(first.dx == again.dx, "rms dx differs, {case}");
            assert!(first.dw == again.dw, "rms dw differs, {case}");
            assert!(
                first.q == again.q && first.k == again.k,
                "rope differs, {case}"
            );
            assert!(first.c == again.c, "swiglu c differs, {case}");
            assert!(
                first.da == again.da && first.db == again.db,
                "swiglu grads differ, {case}"
            );
        }
    }
}

/// The RMSNorm backward captured into a CUDA graph and replayed gives the eager call's bits.
/// On sm_90 and later its dW reduction is a programmatic dependent launch, which the capture
/// keeps as a programmatic edge; the replays' outputs are poisoned before each, and between
/// them an eager call replaces the stream's kept dW scratch. On a created stream of a handle
/// without cudarc's event tracking, and on a per-thread stream of a handle with it (candle's
/// configuration: tracking on, no created stream, so cudarc records and waits on no events).
/// Where cudarc manages several streams' synchronisation (tracking on and a created stream),
/// every use of a buffer waits on the event of its last use, and a capture may not wait on an
/// event recorded before it: CUDA refuses that capture, which must come back as an error.
#[test]
fn gpu_rms_norm_backward_replays_from_a_captured_graph() {
    let test = "gpu_rms_norm_backward_replays_from_a_captured_graph";
    if gpu(test).is_none() {
        return;
    }
    let untracked = liger_rs::cuda_context(0).unwrap();
    // SAFETY: this handle's buffers are used on one stream only, in order.
    unsafe { untracked.disable_event_tracking() };
    let created = untracked.new_stream().unwrap();
    replay_captured_backward("created stream, tracking off", created).unwrap();
    let tracked = liger_rs::cuda_context(0).unwrap();
    assert!(tracked.is_event_tracking() && !tracked.is_in_multi_stream_mode());
    replay_captured_backward(
        "per-thread stream, tracking on",
        tracked.per_thread_stream(),
    )
    .unwrap();
    let managed_case = format!("{test} (created stream, cudarc managing streams)");
    let why = "compute-sanitizer reports the API errors of a refused capture, which are this \
               case's point";
    if skip_when_small(&managed_case, why) {
        return;
    }
    let managed = liger_rs::cuda_context(0).unwrap();
    let stream = managed.new_stream().unwrap();
    assert!(managed.is_managing_stream_synchronization());
    match replay_captured_backward("created stream, cudarc managing streams", stream) {
        Ok(()) => println!("a capture with cudarc managing streams replays correctly"),
        Err(e) => {
            println!("a capture with cudarc managing streams is refused: {e}");
            assert!(e.contains("CAPTURE"), "not a capture error: {e}");
        }
    }
}

/// Captures and replays the backward as above; `Err` if the capture is refused.
fn replay_captured_backward(what: &str, stream: Arc<CudaStream>) -> Result<(), String> {
    let (rows, cols) = (sized(3000, 700), 4096);
    let mut rng = Rng::new(7);
    let args = RmsNormArgs::new(rows, cols);
    let x = upload(&stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0));
    let w = upload(&stream, &rng.vec::<bf16>(cols, 1.0, 0.3));
    let dy = upload(&stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0));
    let (mut y, mut rstd) = (
        common::poisoned::<bf16>(&stream, rows * cols),
        common::poisoned::<f32>(&stream, rows),
    );
    rms_norm_forward(&stream, &args, &x, Some(&w), &mut y, &mut rstd).unwrap();
    let backward = |dx: &mut CudaSlice<bf16>, dw: &mut CudaSlice<bf16>| {
        rms_norm_backward(&stream, &args, &dy, &x, Some(&w), &rstd, dx, Some(dw))
    };
    let (mut dx, mut dw) = (
        common::poisoned::<bf16>(&stream, rows * cols),
        common::poisoned::<bf16>(&stream, cols),
    );
    backward(&mut dx, &mut dw).unwrap();
    let eager = (bits(&download(&stream, &dx)), bits(&download(&stream, &dw)));

    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = backward(&mut dx, &mut dw);
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    let recorded = stream.context().check_err();
    let graph = match (captured, ended) {
        (Ok(()), Ok(Some(graph))) => graph,
        (captured, ended) => {
            return Err(format!(
                "{what}: backward {captured:?}, end of capture {:?}, cudarc's recorded error \
                 {recorded:?}",
                ended.map(|g| g.is_some())
            ));
        }
    };
    assert!(recorded.is_ok(), "{what}: {recorded:?}");
    for replay in 1..=2 {
        if replay == 2 {
            // An eager call that needs more partial rows replaces the stream's kept scratch
            // (64 × 65536 f32, one row per row; the backward above has at most 528 rows of
            // 4096 on an H200); the graph allocates its own, so its replay must not notice.
            checked_rms_norm(&stream, 9, 64, 65536);
        }
        common::poison(&stream, &mut dx);
        common::poison(&stream, &mut dw);
        graph.launch().unwrap();
        let again = (bits(&download(&stream, &dx)), bits(&download(&stream, &dw)));
        assert!(again.0 == eager.0, "{what}: dx differs, replay {replay}");
        assert!(again.1 == eager.1, "{what}: dw differs, replay {replay}");
    }
    Ok(())
}

/// `got` within 2⁻⁶ of `want`, relative to each element's magnitude or the RMS of `want`,
/// whichever is larger: loose next to the op tests' few ulps, tight enough to catch one
/// call's results mixed with another's.
fn close(what: &str, got: &[bf16], want: &[bf16]) {
    let rms = (want.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g.to_f64() - w.to_f64()).abs() / w.to_f64().abs().max(rms);
        assert!(err < 1.0 / 64.0, "{what}[{i}] {g} vs {w}");
    }
}

/// One bf16 RMSNorm forward and backward (llama, with a weight, outputs poisoned first) on
/// `stream`, inputs drawn from `rng`: the host inputs and the device outputs.
struct RmsRun {
    x: Vec<bf16>,
    w: Vec<bf16>,
    dy: Vec<bf16>,
    y: CudaSlice<bf16>,
    rstd: CudaSlice<f32>,
    dx: CudaSlice<bf16>,
    dw: CudaSlice<bf16>,
}

fn rms_run(stream: &Arc<CudaStream>, rng: &mut Rng, rows: usize, cols: usize) -> RmsRun {
    let x: Vec<bf16> = rng.vec(rows * cols, 0.0, 1.0);
    let w: Vec<bf16> = rng.vec(cols, 1.0, 0.3);
    let dy: Vec<bf16> = rng.vec(rows * cols, 0.0, 1.0);
    let args = RmsNormArgs::new(rows, cols);
    let (xd, wd, dyd) = (upload(stream, &x), upload(stream, &w), upload(stream, &dy));
    let (mut y, mut rstd) = (
        common::poisoned::<bf16>(stream, rows * cols),
        common::poisoned::<f32>(stream, rows),
    );
    let (mut dx, mut dw) = (
        common::poisoned::<bf16>(stream, rows * cols),
        common::poisoned::<bf16>(stream, cols),
    );
    rms_norm_forward(stream, &args, &xd, Some(&wd), &mut y, &mut rstd).unwrap();
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
    RmsRun {
        x,
        w,
        dy,
        y,
        rstd,
        dx,
        dw,
    }
}

/// [`rms_run`] from seed `seed`, its y, dx and dW checked against the CPU reference.
fn checked_rms_norm(stream: &Arc<CudaStream>, seed: u64, rows: usize, cols: usize) {
    let run = rms_run(stream, &mut Rng::new(seed), rows, cols);
    let what = format!("seed {seed}, {rows} x {cols}");
    let args = RmsNormArgs::new(rows, cols);
    let want = reference::rms_norm_forward(&args, &run.x, Some(&run.w)).unwrap();
    close(&format!("{what}: y"), &download(stream, &run.y), &want.y);
    let rstd = download(stream, &run.rstd);
    let (dy, x, w) = (&run.dy, &run.x, Some(&run.w[..]));
    let want = reference::rms_norm_backward(&args, dy, x, w, &rstd).unwrap();
    close(&format!("{what}: dx"), &download(stream, &run.dx), &want.dx);
    close(
        &format!("{what}: dw"),
        &download(stream, &run.dw),
        &want.dw.unwrap(),
    );
}

/// RMSNorm backward calls from four threads on one stream at once. Each call takes a dW
/// scratch buffer for itself from its backward's launch to its dW reduction's, so another
/// call's backward, queued between them, cannot overwrite its partial rows.
#[test]
fn gpu_rms_norm_backward_from_many_threads_on_one_stream() {
    let Some(default) = gpu("gpu_rms_norm_backward_from_many_threads_on_one_stream") else {
        return;
    };
    let stream = default.context().new_stream().unwrap();
    std::thread::scope(|scope| {
        for id in 0..4u64 {
            let stream = stream.clone();
            scope.spawn(move || {
                for iter in 0..sized(6, 2) {
                    checked_rms_norm(&stream, 100 * id + iter, 300 + id as usize, 2048);
                }
            });
        }
    });
}

/// The kept dW scratch across shapes and streams: rounds of backward calls on ten streams
/// (more than the eight a context keeps scratch for, so streams are dropped and come back),
/// with shapes that need more partial rows, then fewer, then more again (the buffer grows and
/// is reused), and `release_scratch` between two rounds; every dx and dW checked.
#[test]
fn gpu_rms_norm_backward_keeps_scratch_across_shapes_and_streams() {
    let Some(default) = gpu("gpu_rms_norm_backward_keeps_scratch_across_shapes_and_streams") else {
        return;
    };
    let ctx = default.context().clone();
    let streams: Vec<_> = (0..10).map(|_| ctx.new_stream().unwrap()).collect();
    let (many, more) = (sized(3000, 600), sized(2500, 600));
    let shapes = [(64, 1024), (many, 4096), (5, 8192), (more, 2048), (1, 4095)];
    for (round, &(rows, cols)) in shapes.iter().enumerate() {
        for (i, stream) in streams.iter().enumerate() {
            checked_rms_norm(stream, (10 * round + i) as u64, rows, cols);
        }
        if round == 2 {
            liger_rs::release_scratch(&ctx).unwrap();
        }
    }
}

/// Inputs of one bf16 RMSNorm backward with a weight (llama), uploaded, and the dW bits it
/// gives alone.
struct DwCase {
    args: RmsNormArgs,
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    rstd: CudaSlice<f32>,
    dx: CudaSlice<bf16>,
    dw: CudaSlice<bf16>,
}

impl DwCase {
    fn new(stream: &Arc<CudaStream>, seed: u64, rows: usize, cols: usize) -> Self {
        let mut rng = Rng::new(seed);
        let args = RmsNormArgs::new(rows, cols);
        let x = upload(stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0));
        let w = upload(stream, &rng.vec::<bf16>(cols, 1.0, 0.3));
        let dy = upload(stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0));
        let mut y = common::poisoned::<bf16>(stream, rows * cols);
        let mut rstd = common::poisoned::<f32>(stream, rows);
        rms_norm_forward(stream, &args, &x, Some(&w), &mut y, &mut rstd).unwrap();
        let dx = common::poisoned::<bf16>(stream, rows * cols);
        let dw = common::poisoned::<bf16>(stream, cols);
        DwCase {
            args,
            x,
            w,
            dy,
            rstd,
            dx,
            dw,
        }
    }

    /// Queues the backward on `stream` (dW poisoned first).
    fn queue(&mut self, stream: &Arc<CudaStream>) {
        common::poison(stream, &mut self.dw);
        let (a, dy, x, rstd) = (&self.args, &self.dy, &self.x, &self.rstd);
        rms_norm_backward(
            stream,
            a,
            dy,
            x,
            Some(&self.w),
            rstd,
            &mut self.dx,
            Some(&mut self.dw),
        )
        .unwrap();
    }

    fn dw_bits(&self, stream: &Arc<CudaStream>) -> Vec<u16> {
        bits(&download(stream, &self.dw))
    }
}

/// The failure this library once had: threads on `per_thread_stream` (one handle, 0x2, that
/// names a different stream in each thread; candle's stream) sharing one dW scratch buffer
/// while their backwards ran at once. Each thread computes its dW alone (under a lock), then
/// all run weighted backwards at once, and every call's dW must have the alone-result's bits:
/// 1000 calls in all, over 2, 4 and 8 threads (40 with the small shapes).
#[test]
fn gpu_rms_norm_backward_on_per_thread_streams_of_many_threads() {
    let test = "gpu_rms_norm_backward_on_per_thread_streams_of_many_threads";
    let Some(default) = gpu(test) else {
        return;
    };
    let ctx = default.context().clone();
    let (rows, cols) = (sized(8192, 600), 2048);
    // The small shapes (compute-sanitizer) keep every thread count with a few calls each.
    let calls_per = [(2, sized(150, 6)), (4, sized(100, 3)), (8, sized(50, 2))];
    for (threads, calls) in calls_per {
        let alone = std::sync::Mutex::new(());
        let start = std::sync::Barrier::new(threads);
        let differing: usize = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let (ctx, alone, start) = (&ctx, &alone, &start);
                    scope.spawn(move || {
                        let stream = ctx.per_thread_stream();
                        let mut case = DwCase::new(&stream, 500 + t as u64, rows, cols);
                        let want = {
                            let _alone = alone.lock().unwrap();
                            case.queue(&stream);
                            case.dw_bits(&stream)
                        };
                        start.wait();
                        (0..calls)
                            .filter(|_| {
                                case.queue(&stream);
                                case.dw_bits(&stream) != want
                            })
                            .count()
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(
            differing,
            0,
            "{threads} threads: {differing} of {} calls gave another dW",
            threads * calls
        );
    }
}

/// `release_scratch` from another thread while backwards are queued on per-thread and created
/// streams, with shapes that grow the scratch between rounds: each round queues several calls
/// before it reads dW back, and every dW keeps the alone-result's bits.
#[test]
fn gpu_release_scratch_from_another_thread_while_backwards_are_queued() {
    let test = "gpu_release_scratch_from_another_thread_while_backwards_are_queued";
    let Some(default) = gpu(test) else {
        return;
    };
    let ctx = default.context().clone();
    let done = std::sync::atomic::AtomicBool::new(false);
    let shapes = [
        (sized(2000, 400), 2048),
        (sized(600, 120), 8192),
        (64, 1024),
    ];
    std::thread::scope(|scope| {
        let releaser = scope.spawn(|| {
            let mut releases = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                liger_rs::release_scratch(&ctx).unwrap();
                releases += 1;
                // A pause, not a spin: under compute-sanitizer the driver serialises its calls,
                // and a spinning releaser starves the workers.
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            releases
        });
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let ctx = &ctx;
                scope.spawn(move || {
                    let stream = match t % 2 {
                        0 => ctx.per_thread_stream(),
                        _ => ctx.new_stream().unwrap(),
                    };
                    for round in 0..sized(12, 3) {
                        let (rows, cols) = shapes[round % shapes.len()];
                        let mut case =
                            DwCase::new(&stream, 900 + 10 * t + round as u64, rows, cols);
                        case.queue(&stream);
                        let want = case.dw_bits(&stream);
                        for _ in 0..sized(8, 2) {
                            case.queue(&stream);
                        }
                        let got = case.dw_bits(&stream);
                        assert!(got == want, "thread {t}, round {round}: dW differs");
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(releaser.join().unwrap() > 0);
    });
}

/// One thread's work on its own stream: every op on its own data, checked against the CPU
/// reference (same cast points; the kernels agree with it to within a few ulps, see the op
/// tests — here a looser 2⁻⁶ relative bound suffices to catch cross-talk between threads).
fn worker(stream: Arc<CudaStream>, id: u64) {
    let mut rng = Rng::new(1000 + id);
    let (rows, cols) = (64 + id as usize, 1024);
    let close =
        |what: &str, got: &[bf16], want: &[bf16]| close(&format!("thread {id}: {what}"), got, want);
    for iter in 0..sized(4, 2) {
        checked_rms_norm(&stream, 1000 + 10 * id + iter, rows, cols);

        let (s, hq, hk, d) = (17, 4, 2, 64);
        let ra = RopeArgs::new(d).with_seq_len(s).with_heads(hq, hk);
        let (mut qh, mut kh): (Vec<bf16>, Vec<bf16>) =
            (rng.vec(s * hq * d, 0.0, 1.0), rng.vec(s * hk * d, 0.0, 1.0));
        let (ch, sh): (Vec<bf16>, Vec<bf16>) = (rng.vec(s * d, 0.0, 0.7), rng.vec(s * d, 0.0, 0.7));
        let (mut q, mut k) = (upload(&stream, &qh), upload(&stream, &kh));
        let (cd, sd) = (upload(&stream, &ch), upload(&stream, &sh));
        rope_forward(
            &stream,
            &ra,
            &mut q,
            &mut k,
            &cd,
            &sd,
            &CosSinLayout::PerPosition,
        )
        .unwrap();
        reference::rope_forward(&ra, &mut qh, &mut kh, &ch, &sh, CosSinRows::PerPosition).unwrap();
        close("rope q", &download(&stream, &q), &qh);
        close("rope k", &download(&stream, &k), &kh);

        let sw = SwigluArgs::new(rows, cols);
        let (ah, bh): (Vec<bf16>, Vec<bf16>) = (
            rng.vec(rows * cols, 0.0, 3.0),
            rng.vec(rows * cols, 0.0, 1.0),
        );
        let (ad, bd) = (upload(&stream, &ah), upload(&stream, &bh));
        let mut c = common::poisoned::<bf16>(&stream, rows * cols);
        swiglu_forward(&stream, &sw, &ad, &bd, &mut c).unwrap();
        close(
            "swiglu c",
            &download(&stream, &c),
            &reference::swiglu_forward(&sw, &ah, &bh).unwrap(),
        );
    }
}

#[test]
fn gpu_ops_from_many_threads_and_streams() {
    let Some(stream) = gpu("gpu_ops_from_many_threads_and_streams") else {
        return;
    };
    let ctx = stream.context().clone();
    std::thread::scope(|scope| {
        for id in 0..6 {
            let s = ctx.new_stream().expect("new stream");
            scope.spawn(move || worker(s, id));
        }
    });
}

#[test]
fn gpu_two_devices_at_once() {
    // Every op on devices 0 and 1 concurrently, two threads and streams per device: each
    // context loads its own module (the per-context cache) and every result is checked.
    let Some(stream) = gpu("gpu_two_devices_at_once") else {
        return;
    };
    let second = match liger_rs::cuda_context(1) {
        Ok(ctx) => ctx,
        Err(e) => {
            let why = format!("needs a second GPU ({e})");
            skip("gpu_two_devices_at_once", &why, Need::Gpus(2));
            return;
        }
    };
    let contexts = [stream.context().clone(), second];
    std::thread::scope(|scope| {
        for id in 0..4 {
            let s = contexts[id % 2].new_stream().expect("new stream");
            scope.spawn(move || worker(s, 10 + id as u64));
        }
    });
}

/// On a machine without a driver or GPU (CI) opening a device is an error, never a panic:
/// every launcher needs a stream, and a stream only comes from an opened context.
#[test]
fn no_driver_is_an_error_not_a_panic() {
    match liger_rs::cuda_context(0) {
        Ok(_) => println!("a GPU is present: cuda_context(0) succeeded"),
        Err(e @ (Error::NoDriver | Error::NoDevice { .. } | Error::Driver(_))) => {
            println!("no GPU, as an error: {e}")
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
    let e = liger_rs::cuda_context(usize::MAX).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NoDriver | Error::NoDevice { .. } | Error::Driver(_)
        ),
        "{e:?}"
    );
}

/// Set in the child process of [`gpu_first_kernel_loads_inside_a_global_graph_capture`].
const FRESH_PROCESS_ENV: &str = "LIGER_RS_TEST_FRESH_PROCESS";

/// A context's first call and its kernels' first loads may happen inside a graph capture of
/// the strictest mode (global, which refuses potentially unsafe calls from every thread): in a
/// fresh process (this binary run again for this test alone, so nothing is loaded yet) the
/// RMSNorm forward and backward with dW are captured before any eager call, and the graph
/// gives the bits of the same calls made eagerly afterwards.
#[test]
fn gpu_first_kernel_loads_inside_a_global_graph_capture() {
    let test = "gpu_first_kernel_loads_inside_a_global_graph_capture";
    if std::env::var_os(FRESH_PROCESS_ENV).is_some() {
        first_loads_inside_a_capture();
        return;
    }
    if gpu(test).is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let child = std::process::Command::new(exe)
        .args([test, "--exact", "--nocapture"])
        .env(FRESH_PROCESS_ENV, "1")
        .output()
        .expect("run this test in a fresh process");
    let out = String::from_utf8_lossy(&child.stdout) + String::from_utf8_lossy(&child.stderr);
    assert!(
        child.status.success() && out.contains("1 passed"),
        "the fresh process failed:\n{out}"
    );
}

/// The child's part of [`gpu_first_kernel_loads_inside_a_global_graph_capture`].
fn first_loads_inside_a_capture() {
    let ctx = liger_rs::cuda_context(0).expect("the parent found a GPU");
    // SAFETY: this handle's buffers are used on one stream only, in order.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let (rows, cols) = (sized(3000, 600), 4096);
    let mut rng = Rng::new(11);
    let args = RmsNormArgs::new(rows, cols);
    let x = upload(&stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0));
    let w = upload(&stream, &rng.vec::<bf16>(cols, 1.0, 0.3));
    let dy = upload(&stream, &rng.vec::<bf16>(rows * cols, 0.0, 1.0));
    let mut y = common::poisoned::<bf16>(&stream, rows * cols);
    let mut rstd = common::poisoned::<f32>(&stream, rows);
    let mut dx = common::poisoned::<bf16>(&stream, rows * cols);
    let mut dw = common::poisoned::<bf16>(&stream, cols);
    let both = |y: &mut CudaSlice<bf16>,
                rstd: &mut CudaSlice<f32>,
                dx: &mut CudaSlice<bf16>,
                dw: &mut CudaSlice<bf16>| {
        rms_norm_forward(&stream, &args, &x, Some(&w), y, rstd)?;
        rms_norm_backward(&stream, &args, &dy, &x, Some(&w), rstd, dx, Some(dw))
    };
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    let captured = both(&mut y, &mut rstd, &mut dx, &mut dw);
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    let graph = match (captured, ended) {
        (Ok(()), Ok(Some(graph))) => graph,
        (captured, ended) => panic!(
            "first calls inside a global capture: {captured:?}, end of capture {:?}",
            ended.map(|g| g.is_some())
        ),
    };
    graph.launch().unwrap();
    let replayed = (
        bits(&download(&stream, &y)),
        bits(&download(&stream, &dx)),
        bits(&download(&stream, &dw)),
    );
    for buf in [&mut y, &mut dx, &mut dw] {
        common::poison(&stream, buf);
    }
    common::poison(&stream, &mut rstd);
    both(&mut y, &mut rstd, &mut dx, &mut dw).unwrap();
    assert!(replayed.0 == bits(&download(&stream, &y)), "y differs");
    assert!(replayed.1 == bits(&download(&stream, &dx)), "dx differs");
    assert!(replayed.2 == bits(&download(&stream, &dw)), "dw differs");
}
