//! The GPU-vs-reference suite of the GLU ops, SwiGLU's and GEGLU's (`tests/swiglu.rs`,
//! `tests/geglu.rs`): every dtype × layout (separate, fused gate-up) × mode (out of place, in
//! place) on many shapes, extreme gates, NaN and ±∞, offsets past 32 bits. [`Op`] names the op
//! and its launchers, reference and error bounds.
//!
//! With the small shapes (`LIGER_RS_TEST_SHAPES=small`, sized for compute-sanitizer) every
//! case keeps its shape, hence its kernel and grid: cases over 2²⁰ elements hold data in a few
//! windows of rows only ([`DataRows`]), and the test over 2³² elements skips.
use super::{
    DataRows, Failures, Poison, Rng, assert_close, assert_written, download, download_rows, gpu,
    gpu_for_huge, poisoned, poisoned_on_device, poisoned_with, sampled_rows, ulp, upload,
    upload_rows, widen,
};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream};
use liger_rs::reference::Element;
use liger_rs::reference::geglu::{gelu_erf, gelu_erf_grad, gelu_tanh, gelu_tanh_grad};
use liger_rs::reference::swiglu::{join_gate_up, sigmoid, silu, silu_grad, split_gate_up};
use liger_rs::{Dtype, Gelu, SwigluArgs, reference};
use std::sync::Arc;

mod special;
// The GLU test binaries call them; the others compile this module unused.
#[allow(unused_imports)]
pub use special::{extreme_gates, nan_and_inf, offsets_beyond_2_pow_32_elements};

type Stream = Arc<CudaStream>;

/// A GLU op: SwiGLU, or GEGLU in one form of GELU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Swiglu,
    Geglu(Gelu),
}

/// `√(2/π)` and the cubic coefficient of GELU's tanh form.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const CUBIC: f64 = 0.044715;

/// The tanh form's sigmoid argument: `gelu(z) = z·σ(u)`, `u = 2√(2/π)(z + 0.044715z³)`.
fn tanh_u(z: f64) -> f64 {
    2.0 * SQRT_2_OVER_PI * (z + CUBIC * z * z * z)
}

impl Op {
    /// The gate activation in f64 (the reference's).
    pub fn act(self, z: f64) -> f64 {
        match self {
            Op::Swiglu => silu(z),
            Op::Geglu(Gelu::Tanh) => gelu_tanh(z),
            Op::Geglu(_) => gelu_erf(z),
        }
    }

    /// Its derivative in f64.
    pub fn grad(self, z: f64) -> f64 {
        match self {
            Op::Swiglu => silu_grad(z),
            Op::Geglu(Gelu::Tanh) => gelu_tanh_grad(z),
            Op::Geglu(_) => gelu_erf_grad(z),
        }
    }

    /// Bound on |f32 act of the kernel − exact act(z)| (before any rounding to `T`) for
    /// elements of `bytes` bytes: SiLU's [`silu_err`]; GELU's f32 value is within 5.2 ulps of
    /// the exact one (the kernel's module docs) plus 2 for `ex2.approx`, here 16 ulps
    /// (relative), plus a few subnormal ulps; but the tanh form of the 16-bit types takes its
    /// sigmoid as SiLU does, at `u = 2√(2/π)(z + 0.044715z³)` rounded to f32 (≤ 2 ulps with
    /// its constants', so `e^{−|u|}` moves by 2·|u| ulps more than SiLU's at `u`):
    /// [`silu_err`]'s bound with `4|u| + 24` ulps (an f32 replay of the kernel with an exact
    /// `ex2` reaches 3.3·|u|); their erf form rounds its exponent `z²·log2 e/2` in plain f32
    /// and takes shorter polynomials: `8z² + 72` ulps (`scripts/geglu_fit.py`'s replay stays
    /// below 0.91 of that, plus `ex2.approx`'s 2 ulps).
    pub fn act_err(self, z: f64, bytes: usize) -> f64 {
        match self {
            Op::Swiglu => silu_err(z),
            Op::Geglu(_) if !z.is_finite() => 0.0,
            Op::Geglu(Gelu::Tanh) if bytes == 2 => {
                let u = tanh_u(z);
                (4.0 * u.abs() + 24.0) * U * self.act(z).abs() + (z.abs() + 2.0) * 8.0 * TINY
            }
            Op::Geglu(Gelu::Erf) if bytes == 2 => {
                (8.0 * z * z + 72.0) * U * self.act(z).abs() + (z.abs() + 2.0) * 8.0 * TINY
            }
            Op::Geglu(_) => 16.0 * U * self.act(z).abs() + (z.abs() + 2.0) * 8.0 * TINY,
        }
    }

    /// act'(z) is a difference of two terms that cancel at its zero: the sum of their
    /// magnitudes, and the f32 roundings (ulps of that sum) the kernel's act'·gm·b may be off
    /// by. SiLU: `σ(1 + |z|(1 − σ))`, (2|z| + 24) (its exponent's rounding grows with |z|);
    /// GELU tanh: `σ(u)(1 + |z·u'|(1 − σ(u)))`, erf: `Φ(z) + |z|φ(z)`, both 7 + 2 ulps (module
    /// docs of the kernel), here 32; the 16-bit types' forms (elements of `bytes` = 2): tanh as
    /// SiLU's at `u` with its rounding, `4|u| + 28`, erf `8z² + 72` (its plain f32 exponent).
    pub fn grad_terms(self, z: f64, bytes: usize) -> (f64, f64) {
        match self {
            Op::Swiglu => (
                sigmoid(z) * (1.0 + z.abs() * sigmoid(-z)),
                2.0 * z.abs() + 24.0,
            ),
            Op::Geglu(Gelu::Tanh) => {
                let u = tanh_u(z);
                let du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * z * z);
                let tail = if sigmoid(-u) == 0.0 {
                    0.0
                } else {
                    (z * du).abs() * sigmoid(-u)
                };
                let roundings = match bytes {
                    2 => 4.0 * u.abs() + 28.0,
                    _ => 32.0,
                };
                (sigmoid(u) * (1.0 + tail), roundings)
            }
            Op::Geglu(_) => {
                let zpdf = z * (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
                let zpdf = if zpdf.is_nan() { 0.0 } else { zpdf };
                let roundings = match bytes {
                    2 => 8.0 * z * z + 72.0,
                    _ => 32.0,
                };
                // Φ(z) = gelu'(z) − z·φ(z).
                ((gelu_erf_grad(z) - zpdf).abs() + zpdf.abs(), roundings)
            }
        }
    }

    /// The reference forward on contiguous separate rows.
    pub fn ref_forward<T: Element>(
        self,
        args: &SwigluArgs,
        a: &[T],
        b: &[T],
    ) -> liger_rs::Result<Vec<T>> {
        match self {
            Op::Swiglu => reference::swiglu_forward(args, a, b),
            Op::Geglu(g) => reference::geglu_forward(args, a, b, g == Gelu::Erf),
        }
    }

    /// The reference backward, `(da, db)`.
    pub fn ref_backward<T: Element>(
        self,
        args: &SwigluArgs,
        dc: &[T],
        a: &[T],
        b: &[T],
    ) -> liger_rs::Result<Grads<T>> {
        match self {
            Op::Swiglu => {
                reference::swiglu_backward(args, dc, a, b).map(|g| Grads { da: g.da, db: g.db })
            }
            Op::Geglu(g) => reference::geglu_backward(args, dc, a, b, g == Gelu::Erf)
                .map(|g| Grads { da: g.da, db: g.db }),
        }
    }
}

/// Gates where the activation is hard to differentiate numerically at gate multiplier `gm`:
/// far into the linear regime, far into the vanishing tail, near the zero of act'.
fn hard_gates(op: Op, gm: f32) -> [f64; 3] {
    let gm = gm as f64;
    match op {
        Op::Swiglu => [9.0, -9.0, -1.2785],
        Op::Geglu(_) => [9.0 / gm.abs(), -4.5 / gm.abs(), -0.752 / gm],
    }
}

/// The reference backward of `op` is `dm` times the gradient of `Σ w·c` for the forward's
/// `c`, with `dc = w`, by central differences in f64 (h = 1e-6: truncation ~h²·|c'''| ≈
/// 1e-12, cancellation ~1e-16·|loss|/h ≈ 1e-9), at random gates and [`hard_gates`].
pub fn reference_backward_matches_finite_differences(op: Op) {
    let h = 1e-6;
    for (seed, gm, dm) in [
        (1, 1.0f32, 1.0f32),
        (2, 1.7, 0.6),
        (3, -0.8, 2.5),
        (4, 0.3, 1.0),
    ] {
        let mut rng = Rng::new(seed);
        let n = 24;
        let mut a: Vec<f64> = rng.vec(n, 0.0, 2.5);
        a[..3].copy_from_slice(&hard_gates(op, gm));
        let b: Vec<f64> = rng.vec(n, 0.0, 1.0);
        let w: Vec<f64> = rng.vec(n, 0.0, 1.0);
        let args = SwigluArgs::new(1, n)
            .with_gate_multiplier(gm)
            .with_down_multiplier(dm);
        let grads = op.ref_backward(&args, &w, &a, &b).unwrap();
        let loss = |a: &[f64], b: &[f64]| -> f64 {
            let c = op.ref_forward(&args, a, b).unwrap();
            c.iter().zip(&w).map(|(c, w)| c * w).sum()
        };
        let case = format!("{op:?}, seed {seed}, gm {gm}, dm {dm}");
        let dm = dm as f64;
        for i in 0..n {
            let (mut ap, mut am, mut bp, mut bm) = (a.clone(), a.clone(), b.clone(), b.clone());
            ap[i] += h;
            am[i] -= h;
            bp[i] += h;
            bm[i] -= h;
            let fd_a = dm * (loss(&ap, &b) - loss(&am, &b)) / (2.0 * h);
            let fd_b = dm * (loss(&a, &bp) - loss(&a, &bm)) / (2.0 * h);
            for (what, fd, got) in [("da", fd_a, grads.da[i]), ("db", fd_b, grads.db[i])] {
                assert!(
                    (fd - got).abs() < 1e-7 * (1.0 + fd.abs()),
                    "{what}[{i}] {got} vs fd {fd}, {case}"
                );
            }
        }
    }
}

/// `glu_call!(op, swiglu_x / geglu_x(stream, args, buffers…))`: the launcher of `op` —
/// `liger_rs::swiglu_x(stream, args, buffers…)`, or `liger_rs::geglu_x(stream, args, gelu,
/// buffers…)` in `op`'s form of GELU.
macro_rules! glu_call {
    ($op:expr, $swiglu:ident / $geglu:ident($stream:expr, $args:expr, $($buf:expr),+ $(,)?)) => {
        match $op {
            $crate::common::glu::Op::Swiglu => liger_rs::$swiglu($stream, $args, $($buf),+),
            $crate::common::glu::Op::Geglu(gelu) => {
                liger_rs::$geglu($stream, $args, gelu, $($buf),+)
            }
        }
    };
}
// Only the GLU test binaries call it by path; the others compile this module unused.
#[allow(unused_imports)]
pub(crate) use glu_call;

/// The reference's gradients, either op.
pub struct Grads<T> {
    pub da: Vec<T>,
    pub db: Vec<T>,
}

// ---------------------------------------------------------------- tolerances

/// Allowed ulps of `T` (at the reference value) on top of the slack below: the GPU and the
/// reference each round once to `T` (½ ulp each), but when the GPU's value before rounding
/// lies in the next binade up its ulp is twice the reference's: ½ + 1 = 1.5.
const ULPS: f64 = 1.5;

/// f32 unit roundoff and smallest subnormal.
const U: f64 = 1.0 / (1u64 << 24) as f64;
const TINY: f64 = 1.401298464324817e-45;

/// Bound on |f32 silu of the kernel − exact silu(z)| (before any rounding to `T`).
///
/// The kernel forms `t = e^{−|z|}` with `ex2.approx.f32` (≤ 2 ulp) of the f32 argument
/// `−|z|·log2 e`, whose rounding (and that of the log2 e constant) moves `t` by up to
/// ≈ 1.5·|z| f32 ulps relative; σ or 1 − σ is `t·r`, so one of them carries that error, the
/// rest is a handful of f32 roundings. Hence `(2|z| + 20)·2⁻²⁴` relative, plus an absolute
/// term for the f32 subnormal range (σ below 2⁻¹²⁶ when z < −87, where `t` keeps fewer
/// bits): a few subnormal ulps of σ, multiplied by |z|. Exact 0/1 limits: no error for
/// infinite `z`.
fn silu_err(z: f64) -> f64 {
    if !z.is_finite() {
        return 0.0;
    }
    (2.0 * z.abs() + 20.0) * U * silu(z).abs() + (z.abs() + 2.0) * 8.0 * TINY
}

/// Per-element slack for `c`, `da`, `db` on top of 1 ulp of `T` (the final rounding to `T`
/// of a value that may sit on the other side of a rounding boundary than the exact one):
/// - `c = T(T(s)·b)`: `T(s)` may differ by one ulp of `T` at `s` (plus the f32 error of `s`
///   when that exceeds it, i.e. for f32), which the product scales by `|b|`; the product of
///   two `T` values is then rounded identically.
/// - `db = T(g·s)`: `|g|` times the silu error, plus the f32 product's rounding.
/// - `da = T(g·silu'·gm·b)`: silu' = σ(1 + z(1 − σ)) cancels near z ≈ −1.28, so its error is
///   relative to the magnitudes of its terms, σ(1 + |z|(1 − σ)), times |g·gm·b|, with
///   (2|z| + 24) f32 roundings (as for silu, plus the products), plus subnormal slack.
/// - GEGLU in 16 bits rounds where autograd does, `db = T(g·T(s))` and `da = T(T(g·b)·gelu'·gm)`:
///   `T(s)` may differ by one ulp of `T` at `s` as in `c` (times `|g|`), and `T(g·b)`, the
///   kernel's rounding of an f32 product (twice rounded when `dm ≠ 1`), by one ulp of `T` at
///   `g·b` (times `|gelu'·gm|`).
fn slacks<T: Element>(op: Op, a: &[T], b: &[T], dc: &[T], gm: f32, dm: f32) -> [Vec<f64>; 3] {
    let (gm, dm) = (gm as f64, dm as f64);
    let mut out = [Vec::new(), Vec::new(), Vec::new()];
    for i in 0..a.len() {
        let z = (a[i].to_f64() * gm) as f32 as f64;
        let bytes = std::mem::size_of::<T>();
        let (s, e, bv) = (op.act(z), op.act_err(z, bytes), b[i].to_f64().abs());
        let st = T::cast(s);
        let ulp_s = if st.is_finite() { ulp::<T>(st) } else { 0.0 };
        out[0].push(bv * (ulp_s + e));
        let g = (dc[i].to_f64() * dm) as f32 as f64;
        let autograd = matches!(op, Op::Geglu(_)) && bytes == 2;
        let act_ulp = if autograd { g.abs() * ulp_s } else { 0.0 };
        out[2].push(g.abs() * e + (g * s).abs() * 2.0 * U + TINY + act_ulp);
        let scale = (g * gm * bv).abs();
        let da = if z.is_finite() {
            let (terms, roundings) = op.grad_terms(z, bytes);
            scale * terms * roundings * U + (scale + 1.0) * (z.abs() + 2.0) * 16.0 * TINY
        } else {
            scale * op.grad(z) * 4.0 * U
        };
        let gb = T::cast(g * bv);
        let gb_ulp = if autograd && gb.is_finite() {
            (op.grad(z) * gm).abs() * ulp::<T>(gb)
        } else {
            0.0
        };
        out[1].push(da + gb_ulp);
    }
    out
}

// ---------------------------------------------------------------- GPU vs reference

/// (rows, cols, pad): 1×1, 1 column, odd and prime widths, Llama widths (11008, 14336) and
/// one past, n > 65536, many short rows (rows far beyond the grid: grid-stride), and padded
/// row strides (pad > 0: every buffer gets its own stride, gaps must stay untouched).
///
/// Both launch paths: the 16-byte vector kernels take the shapes whose `cols` is a multiple
/// of the lanes per vector (4 for f32, 8 for f16/bf16) and whose strides stay whole vectors
/// (pad a multiple of 8): 3×11008, 2×14336, 1000×64 contiguous; 9×2048 pad 8 (every buffer
/// strided, and the fused up half 16-byte aligned); 24000×56 pad 8 (7 or 14 vectors per
/// row, so tiles span many rows and the f32 walk sweeps the grid more than once); 5×20 pad
/// 4 takes the vector path for f32 only (20 is not a multiple of 8); 1300×8192 and
/// 200001×56 pad 8 have over four waves of tiles on an H200, so they run the
/// one-tile-per-block `_vw` kernels (8-byte vectors), the latter with strided rows, many rows
/// per tile and a last tile cut short; the library's unit test
/// `glu::plan::tests::gpu_h200_suite_shapes_take_their_documented_kernels` checks that choice.
/// The rest (odd widths, 14337, pad 13/7/1) take the scalar kernels.
const SHAPES: [(usize, usize, usize); 20] = [
    (1, 1, 0),
    (1, 3, 0),
    (3, 1, 0),
    (7, 41, 0),
    (5, 123, 0),
    (3, 11008, 0),
    (2, 14336, 0),
    (2, 14337, 0),
    (1, 70001, 0),
    (1000, 64, 0),
    (70000, 3, 0),
    (33, 4097, 0),
    (37, 1000, 13),
    (5, 129, 7),
    (2, 1025, 1),
    (9, 2048, 8),
    (24000, 56, 8),
    (5, 20, 4),
    (1300, 8192, 0),
    (200001, 56, 8),
];

/// Gate values mixed into the data (~2 %): the tails where σ is 0/1 or subnormal in f32, and
/// the largest magnitudes (those not finite in `T` are skipped). With gm > 1 the largest
/// overflow f32 in `a·gm`, which exercises the infinite-gate limits.
const HUGE: [f64; 12] = [
    1e4, -1e4, 95.0, -95.0, 30.0, -30.0, 60000.0, -60000.0, 3.0e38, -3.0e38, 200.0, -200.0,
];

struct Case {
    rows: usize,
    cols: usize,
    pad: usize,
    fused: bool,
    inplace: bool,
    gm: f32,
    dm: f32,
    seed: u64,
}

impl Case {
    /// Row strides (a or fused gate-up, b, c).
    fn strides(&self) -> (usize, usize, usize) {
        let p = self.pad;
        if self.fused {
            (2 * self.cols + p, 2 * self.cols + p, self.cols + 2 * p)
        } else {
            (self.cols + p, self.cols + 2 * p, self.cols + 3 * p)
        }
    }

    fn args(&self) -> SwigluArgs {
        let (sa, sb, sc) = self.strides();
        let base = if self.fused {
            SwigluArgs::fused(self.rows, self.cols)
        } else {
            SwigluArgs::new(self.rows, self.cols)
        };
        base.with_strides(sa, sb, sc)
            .with_gate_multiplier(self.gm)
            .with_down_multiplier(self.dm)
    }
}

fn span(rows: usize, width: usize, stride: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + width
    }
}

/// Elements outside the first `width` of each row must be NaN (poisoned, untouched) or, with
/// `orig`, equal to it.
fn check_gaps<T: Element>(
    what: &str,
    case: &str,
    buf: &[T],
    width: usize,
    stride: usize,
    orig: Option<&[T]>,
) {
    for (i, v) in buf.iter().enumerate() {
        if i % stride < width {
            continue;
        }
        let ok = match orig {
            None => v.to_f64().is_nan(),
            Some(o) => v.to_f64().to_bits() == o[i].to_f64().to_bits(),
        };
        assert!(ok, "{what}: gap element {i} was written ({v:?}), {case}");
    }
}

fn gate_value<T: Element>(rng: &mut Rng) -> T {
    if rng.uniform() < 0.02 {
        let v = HUGE[(rng.next_u64() % HUGE.len() as u64) as usize];
        if T::cast(v).is_finite() {
            return T::from_f64(v);
        }
    }
    T::from_f64(3.0 * rng.normal())
}

/// A strided buffer whose columns `< gate_cols` of each row are gate values and the rest
/// (the up half when fused, and the gaps) standard normal, in the rows of `rows`; zero in the
/// others.
fn data<T: Element>(
    rng: &mut Rng,
    rows: &DataRows,
    len: usize,
    stride: usize,
    gate_cols: usize,
) -> Vec<T> {
    (0..len)
        .map(|i| {
            if !rows.holds(i / stride) {
                T::from_f64(0.0)
            } else if i % stride < gate_cols {
                gate_value(rng)
            } else {
                T::from_f64(rng.normal())
            }
        })
        .collect()
}

fn run_case<T: Dtype>(stream: &Stream, op: Op, c: &Case) {
    let desc = format!(
        "{op:?} {}×{} pad {} {} fused={} inplace={} gm={} dm={} seed={}",
        c.rows,
        c.cols,
        c.pad,
        T::NAME,
        c.fused,
        c.inplace,
        c.gm,
        c.dm,
        c.seed
    );
    let (rows, cols) = (c.rows, c.cols);
    let (sa, sb, sc) = c.strides();
    let args = c.args();
    let mut rng = Rng::new(c.seed);
    // With the small shapes, a big case's other rows are zero, and so are their outputs.
    let data_rows = DataRows::of(rows, cols);
    let compact = |buf: &[T], stride, offset| data_rows.compact(buf, cols, stride, offset);
    let zero_rows = |what, buf: &[T], width, stride| {
        data_rows.assert_zero_rows(what, &desc, buf, width, stride, 0);
    };
    let dc_h: Vec<T> = data(&mut rng, &data_rows, span(rows, cols, sc), sc, 0);
    let dc_d = upload(stream, &dc_h);
    let dc = compact(&dc_h, sc, 0);
    let c_span = span(rows, cols, sc);

    // Inputs (host copies kept to check that nothing but the outputs changes).
    let (a_h, b_h): (Vec<T>, Vec<T>) = if c.fused {
        (
            data(&mut rng, &data_rows, span(rows, 2 * cols, sa), sa, cols),
            Vec::new(),
        )
    } else {
        (
            data(&mut rng, &data_rows, span(rows, cols, sa), sa, cols),
            data(&mut rng, &data_rows, span(rows, cols, sb), sb, 0),
        )
    };
    let a = compact(&a_h, sa, 0);
    let b = if c.fused {
        compact(&a_h, sa, cols)
    } else {
        compact(&b_h, sb, 0)
    };
    let mut a_d = upload(stream, &a_h);
    // The fused layout has no separate b (and an empty device buffer cannot be allocated).
    let mut b_d = upload(stream, if c.fused { &dc_h[..1] } else { &b_h });

    // The reference takes the data rows, contiguous and separate.
    let ref_args = SwigluArgs::new(a.len() / cols, cols)
        .with_gate_multiplier(c.gm)
        .with_down_multiplier(c.dm);
    let want_c = op.ref_forward(&ref_args, &a, &b).unwrap();
    let grads = op.ref_backward(&ref_args, &dc, &a, &b).unwrap();
    let [slack_c, slack_da, slack_db] = slacks(op, &a, &b, &dc, c.gm, c.dm);

    // Forward into a NaN-poisoned c.
    let mut c_d = poisoned::<T>(stream, c_span);
    if c.fused {
        glu_call!(
            op,
            swiglu_forward_fused / geglu_forward_fused(stream, &args, &a_d, &mut c_d)
        )
        .expect(&desc);
    } else {
        glu_call!(
            op,
            swiglu_forward / geglu_forward(stream, &args, &a_d, &b_d, &mut c_d)
        )
        .expect(&desc);
    }
    let c_got = download(stream, &c_d);
    check_gaps("c", &desc, &c_got, cols, sc, None);
    let got = widen(&compact(&c_got, sc, 0));
    zero_rows("c", &c_got, cols, sc);
    assert_close::<T>("c", &desc, &got, &widen(&want_c), ULPS, &slack_c);
    assert!(
        download(stream, &a_d) == a_h,
        "forward changed its input, {desc}"
    );
    if !c.fused {
        assert!(download(stream, &b_d) == b_h, "forward changed b, {desc}");
    }

    // In place, the zero rows of the buffers the backward overwrites hold ones (their dc is
    // zero, so their gradients stay zero): a row left untouched keeps its ones instead of
    // passing for a written zero.
    let ones_in_zero_rows = |buf: &mut CudaSlice<T>, host: &[T], width: usize, stride: usize| {
        if !data_rows.are_all() {
            let mut v = host.to_vec();
            data_rows.fill_zero_rows(&mut v, width, stride, T::from_f64(1.0));
            stream.memcpy_htod(&v, buf).expect("upload ones");
        }
    };

    // Backward: into poisoned buffers or over the inputs.
    let (da, db) = match (c.fused, c.inplace) {
        (false, false) => {
            let mut da_d = poisoned::<T>(stream, a_h.len());
            let mut db_d = poisoned::<T>(stream, b_h.len());
            glu_call!(
                op,
                swiglu_backward
                    / geglu_backward(stream, &args, &dc_d, &a_d, &b_d, &mut da_d, &mut db_d)
            )
            .expect(&desc);
            let (da_h, db_h) = (download(stream, &da_d), download(stream, &db_d));
            check_gaps("da", &desc, &da_h, cols, sa, None);
            check_gaps("db", &desc, &db_h, cols, sb, None);
            zero_rows("da", &da_h, cols, sa);
            zero_rows("db", &db_h, cols, sb);
            assert!(download(stream, &a_d) == a_h, "backward changed a, {desc}");
            assert!(download(stream, &b_d) == b_h, "backward changed b, {desc}");
            (compact(&da_h, sa, 0), compact(&db_h, sb, 0))
        }
        (false, true) => {
            ones_in_zero_rows(&mut a_d, &a_h, cols, sa);
            ones_in_zero_rows(&mut b_d, &b_h, cols, sb);
            glu_call!(
                op,
                swiglu_backward_inplace
                    / geglu_backward_inplace(stream, &args, &dc_d, &mut a_d, &mut b_d)
            )
            .expect(&desc);
            let (da_h, db_h) = (download(stream, &a_d), download(stream, &b_d));
            check_gaps("da", &desc, &da_h, cols, sa, Some(&a_h));
            check_gaps("db", &desc, &db_h, cols, sb, Some(&b_h));
            zero_rows("da", &da_h, cols, sa);
            zero_rows("db", &db_h, cols, sb);
            (compact(&da_h, sa, 0), compact(&db_h, sb, 0))
        }
        (true, false) => {
            let mut g_d = poisoned::<T>(stream, a_h.len());
            glu_call!(
                op,
                swiglu_backward_fused / geglu_backward_fused(stream, &args, &dc_d, &a_d, &mut g_d)
            )
            .expect(&desc);
            let g_h = download(stream, &g_d);
            check_gaps("d_gate_up", &desc, &g_h, 2 * cols, sa, None);
            zero_rows("d_gate_up", &g_h, 2 * cols, sa);
            assert!(
                download(stream, &a_d) == a_h,
                "backward changed gate_up, {desc}"
            );
            (compact(&g_h, sa, 0), compact(&g_h, sa, cols))
        }
        (true, true) => {
            ones_in_zero_rows(&mut a_d, &a_h, 2 * cols, sa);
            glu_call!(
                op,
                swiglu_backward_fused_inplace
                    / geglu_backward_fused_inplace(stream, &args, &dc_d, &mut a_d)
            )
            .expect(&desc);
            let g_h = download(stream, &a_d);
            check_gaps("d_gate_up", &desc, &g_h, 2 * cols, sa, Some(&a_h));
            zero_rows("d_gate_up", &g_h, 2 * cols, sa);
            (compact(&g_h, sa, 0), compact(&g_h, sa, cols))
        }
    };
    assert!(
        download(stream, &dc_d) == dc_h,
        "backward changed dc, {desc}"
    );
    assert_close::<T>("da", &desc, &widen(&da), &widen(&grads.da), ULPS, &slack_da);
    assert_close::<T>("db", &desc, &widen(&db), &widen(&grads.db), ULPS, &slack_db);
}

/// Runs one closure per case, collecting every failure instead of stopping at the first.
fn collect(test: &str, cases: usize, mut run: impl FnMut(usize)) {
    let mut failures = Failures::new(test);
    for i in 0..cases {
        failures.run(|| run(i));
    }
    failures.finish();
}

/// Every shape × {separate, fused} × {out of place, in place}, with the multipliers cycling
/// through 1 and other values so each layout and mode sees gm ≠ 1 and dm ≠ 1.
pub fn sweep<T: Dtype>(op: Op, test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let gms = [1.0f32, 0.75, 1.5];
    let dms = [1.0f32, 2.0, 0.3, 1.0];
    collect(test, SHAPES.len() * 4, |i| {
        let (rows, cols, pad) = SHAPES[i / 4];
        let case = Case {
            rows,
            cols,
            pad,
            fused: i % 4 >= 2,
            inplace: i % 2 == 1,
            gm: gms[i % 3],
            dm: dms[(i / 3) % 4],
            seed: seed_base + i as u64,
        };
        run_case::<T>(&stream, op, &case);
    });
}
