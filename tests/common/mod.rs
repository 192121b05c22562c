//! Helpers shared by the op tests: the GPU (or a skip, see [`skip`]), the shapes' size
//! ([`sized`]), seeded random data, poisoned outputs and tolerance checks against the f64
//! reference.
#![allow(dead_code)] // each test binary uses its own subset

pub mod glu;
pub mod rms;
pub mod skip;

/// `r` is an error whose message holds every needle (candle's calls).
#[cfg(feature = "candle")]
pub fn expect_err<V: std::fmt::Debug>(what: &str, r: candle_core::Result<V>, needles: &[&str]) {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "{what}: message {msg:?} lacks {n:?}");
            }
        }
    }
}

/// CUDA device 0 as candle opens it, or `None` after skipping `test` (see [`skip`]).
#[cfg(feature = "candle")]
pub fn candle_gpu(test: &str) -> Option<candle_core::Device> {
    match candle_core::Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            let first = e.to_string().lines().next().unwrap_or_default().to_string();
            skip(test, &format!("no GPU ({first})"), Need::Gpus(1));
            None
        }
    }
}

/// Attention over a fused `qkv` `[b, t, (hq + 2·hkv)·d]` in candle ops: candle-nn's
/// `rope_slow` on `[b, h, t, d]` heads with `rope`'s first `t` rows, softmax attention over
/// key/value heads repeated per group, a bottom-right causal mask where asked. `[b, t, hq·d]`.
#[cfg(feature = "candle")]
pub fn qkv_attention_slow(
    qkv: &candle_core::Tensor,
    (hq, hkv): (usize, usize),
    rope: Option<(&candle_core::Tensor, &candle_core::Tensor)>,
    scale: f64,
    causal: bool,
) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::Tensor;
    let (b, t, row) = qkv.dims3()?;
    let d = row / (hq + 2 * hkv);
    let heads = |at: usize, h: usize| {
        qkv.narrow(2, at * d, h * d)?
            .reshape((b, t, h, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (mut q, mut k, v) = (heads(0, hq)?, heads(hq, hkv)?, heads(hq + hkv, hkv)?);
    if let Some((c, s)) = rope {
        let table = |x: &Tensor| x.narrow(0, 0, t)?.to_dtype(qkv.dtype());
        let (c, s) = (table(c)?, table(s)?);
        q = candle_nn::rotary_emb::rope_slow(&q, &c, &s)?;
        k = candle_nn::rotary_emb::rope_slow(&k, &c, &s)?;
    }
    let rep = |x: Tensor| -> candle_core::Result<Tensor> {
        x.unsqueeze(2)?
            .broadcast_as((b, hkv, hq / hkv, t, d))?
            .reshape((b, hq, t, d))
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let mut scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    if causal {
        let mask: Vec<f64> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), qkv.device())?.to_dtype(qkv.dtype())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let p = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, hq * d))
}

/// `got` is within `bound · max|want|` of `want` everywhere (a NaN fails), named `what`.
pub fn assert_within(what: &str, got: &[f32], want: &[f32], bound: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = got.iter().zip(want).fold(0f32, |m, (a, b)| {
        if a.is_nan() {
            f32::NAN
        } else {
            m.max((a - b).abs())
        }
    });
    assert!(err <= bound * scale, "{what}: error {err} of max {scale}");
}

use liger_rs::cudarc::driver::result::memset_d8_async;
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use liger_rs::reference::Element;
use liger_rs::{Dtype, Error};
pub use skip::{Need, skip};
use std::ops::Range;
use std::sync::Arc;

/// The default stream of device 0, or `None` after skipping `test` (see [`skip`]).
pub fn gpu(test: &str) -> Option<Arc<CudaStream>> {
    match liger_rs::cuda_context(0) {
        Ok(ctx) => Some(ctx.default_stream()),
        Err(e) => {
            skip(test, &format!("no GPU ({e})"), Need::Gpus(1));
            None
        }
    }
}

/// `LIGER_RS_TEST_SHAPES=small` gives the GPU tests their sanitizer-sized shapes: every code
/// path and kernel variant a test exercises (dtypes, modes, layouts, the kernel each shape is
/// there for) with far fewer rows, elements and repetitions, so that each suite runs under
/// compute-sanitizer within minutes; tests whose point is their size skip. Unset, empty or
/// `full`: the full shapes.
pub const TEST_SHAPES_ENV: &str = "LIGER_RS_TEST_SHAPES";

/// Whether [`TEST_SHAPES_ENV`] asks for the small shapes; any value other than `small`,
/// `full` or empty panics, so a misspelt value cannot run the full shapes unnoticed.
pub fn small_shapes() -> bool {
    match std::env::var(TEST_SHAPES_ENV) {
        Ok(v) if v == "small" => true,
        Ok(v) if v == "full" || v.is_empty() => false,
        Err(std::env::VarError::NotPresent) => false,
        other => panic!("{TEST_SHAPES_ENV}={other:?}: expected `small` or `full`"),
    }
}

/// `full`, or `small` where [`TEST_SHAPES_ENV`] asks for the small shapes.
pub fn sized<T>(full: T, small: T) -> T {
    if small_shapes() { small } else { full }
}

/// With the small shapes, skips `test`, whose point is its size (`why` says what needs it;
/// the full-size run covers it), and returns `true`; otherwise `false`.
pub fn skip_when_small(test: &str, why: &str) -> bool {
    let small = small_shapes();
    if small {
        let why = format!("{TEST_SHAPES_ENV}=small, and {why}; the full-size run covers it");
        skip(test, &why, Need::FullShapes);
    }
    small
}

/// The GPU's stream for a test over 2³² elements, or `None` where it skips: no GPU ([`gpu`]),
/// or the small shapes ([`skip_when_small`]).
pub fn gpu_for_huge(test: &str) -> Option<Arc<CudaStream>> {
    let stream = gpu(test)?;
    let why = "64-bit offsets need buffers of over 2³² elements (8 GiB)";
    (!skip_when_small(test, why)).then_some(stream)
}

/// Single rows a test over 2³² elements spreads over its buffers ([`sampled_rows`]).
const SPREAD_ROWS: usize = 256;

/// The rows of a test over 2³² elements that hold random data and are checked against the
/// reference, as disjoint runs in order: `win` rows at the start, around each row of `marks`
/// (where an element offset crosses 2³¹ or 2³²) and at the end, and 256 single rows spread
/// evenly over all `rows`. The other rows hold zeros and are never copied: a few hundred rows
/// travel instead of gigabytes.
pub fn sampled_rows(rows: usize, win: usize, marks: &[usize]) -> Vec<Range<usize>> {
    let win = win.min(rows);
    let around = |m: usize| {
        let start = m.saturating_sub(win / 2).min(rows - win);
        start..start + win
    };
    let spread = |i: usize| {
        let r = (2 * i + 1) * rows / (2 * SPREAD_ROWS);
        r..r + 1
    };
    let mut runs = vec![0..win, rows - win..rows];
    runs.extend(marks.iter().map(|&m| around(m)));
    runs.extend((0..SPREAD_ROWS).map(spread));
    runs.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::new();
    for r in runs {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

/// Writes `data` (the rows of `runs`, one after another, `width` elements each) into those
/// rows of `buf`.
pub fn upload_rows<T: Dtype>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    runs: &[Range<usize>],
    width: usize,
    data: &[T],
) {
    let mut at = 0;
    for r in runs {
        let n = r.len() * width;
        let mut rows = buf.slice_mut(r.start * width..r.end * width);
        stream
            .memcpy_htod(&data[at..at + n], &mut rows)
            .expect("upload rows");
        at += n;
    }
    assert_eq!(at, data.len(), "data for the rows of {runs:?}");
}

/// The rows of `runs` of `buf` (`width` elements each), one after another.
pub fn download_rows<T: Dtype>(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    runs: &[Range<usize>],
    width: usize,
) -> Vec<T> {
    runs.iter()
        .flat_map(|r| {
            let rows = buf.slice(r.start * width..r.end * width);
            stream.clone_dtoh(&rows).expect("download rows")
        })
        .collect()
}

/// Cases of more elements than this hold data in [`DataRows`] windows with the small shapes.
const SPARSE_FROM: usize = 1 << 20;
/// Elements per [`DataRows`] window, at most (and at least one row, at most 16).
const WINDOW_ELEMENTS: usize = 1 << 17;

/// The rows of a case that hold random data and are checked against the CPU reference, whose
/// cost per element dwarfs the GPU's: every row, or, with the small shapes and a case of more
/// than 2²⁰ elements, three windows of up to 16 rows (at the start, in the middle, at the
/// end). The other rows hold zeros, whose outputs are known exactly and checked as such, so
/// the GPU still runs every row (the row count picks the kernel and its grid) while the host
/// computes the reference for a few. A buffer a call overwrites in place holds ones in those
/// rows instead ([`DataRows::fill_zero_rows`]), so that a row it leaves untouched cannot pass
/// for a written zero.
pub struct DataRows {
    rows: usize,
    /// The windows, or `None`: every row.
    windows: Option<[std::ops::Range<usize>; 3]>,
}

impl DataRows {
    /// Every one of `rows` rows.
    pub fn all(rows: usize) -> Self {
        DataRows {
            rows,
            windows: None,
        }
    }

    /// The rows of a case of `rows × cols` elements (see [`DataRows`]).
    pub fn of(rows: usize, cols: usize) -> Self {
        let w = (WINDOW_ELEMENTS / cols.max(1)).clamp(1, 16);
        if !small_shapes() || rows.saturating_mul(cols) <= SPARSE_FROM || rows <= 3 * w {
            return DataRows::all(rows);
        }
        let mid = rows / 2 - w / 2;
        DataRows {
            rows,
            windows: Some([0..w, mid..mid + w, rows - w..rows]),
        }
    }

    /// Whether `row` holds data.
    pub fn holds(&self, row: usize) -> bool {
        let windows = self.windows.as_ref();
        windows.is_none_or(|ws| ws.iter().any(|w| w.contains(&row)))
    }

    /// Whether every row holds data.
    pub fn are_all(&self) -> bool {
        self.windows.is_none()
    }

    /// The rows that hold data, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.rows).filter(|&r| self.holds(r))
    }

    /// The rows that hold zeros, in order.
    pub fn zero_rows(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.rows).filter(|&r| !self.holds(r))
    }

    /// `rows × cols` values `mean + scale·N(0,1)` rounded to `T` in the rows that hold data
    /// (drawn in order: with every row, exactly [`Rng::vec`]'s values), zeros elsewhere.
    pub fn vec<T: Element>(&self, rng: &mut Rng, cols: usize, mean: f64, scale: f64) -> Vec<T> {
        let Some(windows) = &self.windows else {
            return rng.vec(self.rows * cols, mean, scale);
        };
        let mut v = vec![T::from_f64(0.0); self.rows * cols];
        for w in windows {
            v[w.start * cols..w.end * cols].copy_from_slice(&rng.vec(w.len() * cols, mean, scale));
        }
        v
    }

    /// Columns `offset..offset + cols` of the rows that hold data, of a buffer whose rows start
    /// `stride` elements apart, one after another.
    pub fn compact<T: Copy>(&self, buf: &[T], cols: usize, stride: usize, offset: usize) -> Vec<T> {
        self.iter()
            .flat_map(|r| buf[r * stride + offset..r * stride + offset + cols].to_vec())
            .collect()
    }

    /// Sets columns `0..cols` of the zero rows of `buf` (rows `stride` elements apart) to
    /// `value`.
    pub fn fill_zero_rows<T: Copy>(&self, buf: &mut [T], cols: usize, stride: usize, value: T) {
        for r in self.zero_rows() {
            buf[r * stride..r * stride + cols].fill(value);
        }
    }

    /// Asserts that columns `offset..offset + cols` of the zero rows of `buf` (rows `stride`
    /// elements apart) are zero: the output of an op on zero inputs.
    pub fn assert_zero_rows<T: Element>(
        &self,
        what: &str,
        case: &str,
        buf: &[T],
        cols: usize,
        stride: usize,
        offset: usize,
    ) {
        for r in self.zero_rows() {
            let row = &buf[r * stride + offset..r * stride + offset + cols];
            if let Some(c) = row.iter().position(|v| v.to_f64() != 0.0) {
                panic!(
                    "{what}: zero row {r} column {c} is {:?}, not 0, {case}",
                    row[c]
                );
            }
        }
    }
}

/// SplitMix64: small, seedable, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// `n` values `mean + scale·N(0,1)` rounded to `T`.
    pub fn vec<T: Element>(&mut self, n: usize, mean: f64, scale: f64) -> Vec<T> {
        (0..n)
            .map(|_| T::from_f64(mean + scale * self.normal()))
            .collect()
    }
}

/// A device buffer of `n` NaNs: elements a kernel fails to write stay NaN and fail the check.
pub fn poisoned<T: Dtype>(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    stream
        .clone_htod(&vec![T::from_f64(f64::NAN); n])
        .expect("upload poison")
}

/// A device buffer of `n` elements with every bit set (NaN in f32, f16 and bf16), filled on
/// the device: for buffers too large to poison through a host copy.
pub fn poisoned_on_device<T: Dtype>(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    poisoned_with(stream, n, Poison::Nan)
}

/// Sets every bit of `buf` (NaN in f32, f16 and bf16) on the device, ordered on `stream`.
pub fn poison<T: Dtype>(stream: &Arc<CudaStream>, buf: &mut CudaSlice<T>) {
    poison_with(stream, buf, Poison::Nan);
}

/// What an output holds before the call that must write it. NaN fails every comparison with
/// a finite reference value but passes one with a NaN, so where the reference holds NaN a
/// case runs once into each poison and [`assert_written`] requires the same bits of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poison {
    /// Every bit set: NaN in f32, f16 and bf16.
    Nan,
    /// Every byte 0x3C: finite in f32 (≈ 0.0115), f16 (≈ 1.06) and bf16 (≈ 0.0115), and
    /// unlike [`Poison::Nan`] in every byte.
    Finite,
}

/// A device buffer of `n` elements, each byte `poison`'s, filled on the device.
pub fn poisoned_with<T: Dtype>(stream: &Arc<CudaStream>, n: usize, poison: Poison) -> CudaSlice<T> {
    // SAFETY: `poison_with` writes every byte before anything reads the buffer.
    let mut buf = unsafe { stream.alloc::<T>(n) }.expect("allocate");
    poison_with(stream, &mut buf, poison);
    buf
}

/// Sets every byte of `buf` to `poison`'s on the device, ordered on `stream`.
pub fn poison_with<T: Dtype>(stream: &Arc<CudaStream>, buf: &mut CudaSlice<T>, poison: Poison) {
    let byte = match poison {
        Poison::Nan => 0xFF,
        Poison::Finite => 0x3C,
    };
    let bytes = buf.len() * std::mem::size_of::<T>();
    let (ptr, _record) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` covers `bytes` bytes of this stream's context; the memset is ordered on
    // `stream` before any later use of the buffer.
    unsafe { memset_d8_async(ptr, byte, bytes, stream.cu_stream()) }.expect("poison");
}

/// Asserts that output `what` of the same calls run into [`Poison::Nan`] (`nan_run`) and into
/// [`Poison::Finite`] (`finite_run`) holds the same bits: the kernels are deterministic, and an
/// element neither run wrote keeps its run's poison, which differ.
pub fn assert_written<T: Element>(what: &str, case: &str, nan_run: &[T], finite_run: &[T]) {
    assert_eq!(nan_run.len(), finite_run.len(), "{what} length, {case}");
    let bits = |v: T| v.to_f64().to_bits();
    let differ = nan_run
        .iter()
        .zip(finite_run)
        .position(|(&a, &b)| bits(a) != bits(b));
    if let Some(i) = differ {
        panic!(
            "{what}: element {i} is {:?} after the run into NaN poison but {:?} after the run \
             into finite poison: not written, {case}",
            nan_run[i], finite_run[i]
        );
    }
}

pub fn upload<T: Dtype>(stream: &Arc<CudaStream>, data: &[T]) -> CudaSlice<T> {
    stream.clone_htod(data).expect("upload")
}

pub fn download<T: Dtype>(stream: &Arc<CudaStream>, buf: &CudaSlice<T>) -> Vec<T> {
    stream.clone_dtoh(buf).expect("download")
}

/// Smallest positive normal value of `T` (below it the spacing is fixed: subnormals).
pub fn min_normal<T: Element>() -> f64 {
    match T::NAME {
        "f16" => 2f64.powi(-14),
        "f32" | "bf16" => 2f64.powi(-126),
        _ => f64::MIN_POSITIVE,
    }
}

/// Spacing of `T` at `v`.
pub fn ulp<T: Element>(v: f64) -> f64 {
    let p = T::MANTISSA_DIGITS as i32;
    let a = v.abs().max(min_normal::<T>());
    2f64.powi(a.log2().floor() as i32 - (p - 1))
}

/// Checks `|got − want| ≤ ulps · ulp_T(want) + slack[i]` element by element (`slack` empty:
/// none). `ulps` counts rounding differences in the output dtype; `slack` bounds f32
/// arithmetic error that scales with the terms an element was computed from rather than with
/// the element itself (cancellation, long sums). Panics with the first failures, the case
/// description (which includes the seed) and the worst error in ulps.
pub fn assert_close<T: Element>(
    what: &str,
    case: &str,
    got: &[f64],
    want: &[f64],
    ulps: f64,
    slack: &[f64],
) {
    assert_eq!(got.len(), want.len(), "{what} length, {case}");
    assert!(
        slack.is_empty() || slack.len() == want.len(),
        "{what} slack length"
    );
    let mut bad = Vec::new();
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            let bound = ulps * ulp::<T>(w) + slack.get(i).copied().unwrap_or(0.0);
            let err = (g - w).abs();
            worst = worst.max(err / ulp::<T>(w));
            err <= bound // NaN `g` fails here
        };
        if !ok && bad.len() < 5 {
            let extra = slack
                .get(i)
                .map(|s| format!(" slack {s:e}"))
                .unwrap_or_default();
            bad.push(format!("[{i}] got {g:e} want {w:e}{extra}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{what} ({}) mismatch, {case}; {ulps} ulp allowed, worst {worst:.1} ulp: {}",
        T::NAME,
        bad.join("; ")
    );
}

pub fn widen<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// Asserts that `result` is an [`Error::InvalidArgument`] for `arg` whose message contains
/// `needle` (the expected value it names).
pub fn expect_invalid(result: liger_rs::Result<()>, arg: &str, needle: &str) {
    match result {
        Err(e @ Error::InvalidArgument { arg: a, .. }) if a == arg => {
            let msg = e.to_string();
            assert!(
                msg.contains(needle),
                "`{arg}`: message {msg:?} lacks {needle:?}"
            );
        }
        other => panic!("expected InvalidArgument for `{arg}`, got {other:?}"),
    }
}

/// Runs many cases of one test, catching each case's panic, so that one (device) run reports
/// every failing case rather than the first; [`Failures::finish`] fails the test if any did.
pub struct Failures {
    test: String,
    cases: usize,
    failed: Vec<String>,
}

impl Failures {
    pub fn new(test: &str) -> Self {
        Failures {
            test: test.to_string(),
            cases: 0,
            failed: Vec::new(),
        }
    }

    /// Runs one case; a panic is recorded with its message.
    pub fn run(&mut self, case: impl FnOnce()) {
        self.cases += 1;
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(case)) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            self.failed.push(msg);
        }
    }

    /// Panics listing every failed case, or if no case ran (a test that runs none must say
    /// why through [`skip`]); otherwise prints how many passed.
    pub fn finish(self) {
        let Failures {
            test,
            cases,
            failed,
        } = self;
        assert!(cases > 0, "{test}: no case ran");
        assert!(
            failed.is_empty(),
            "{test}: {} of {cases} cases failed:\n{}",
            failed.len(),
            failed.join("\n")
        );
        println!("{test}: {cases} cases passed");
    }
}
