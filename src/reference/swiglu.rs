//! SwiGLU (SiLU-mul) on the CPU: Liger's cast points (see `swiglu_forward`) with f64 in between.
//!
//! `D(·)` rounds to the element type, `F(·)` to f32 ([`Element::cast_f32`], the identity for
//! f64) where the kernels materialise an f32 value from a product of inputs:
//!
//! | value | reference                                   |
//! |-------|---------------------------------------------|
//! | gate  | `z = F(a·gm)`                                |
//! | `c`   | `D(D(silu(z)) · b)` (Liger ≥ 0.6)            |
//! | `g`   | `F(dc·dm)`                                   |
//! | `db`  | `D(g · silu(z))`                             |
//! | `da`  | `D(g · silu'(z) · gm · b)`                   |
//!
//! with `silu(z) = z·σ(z)` and `silu'(z) = σ(z)·(1 + z·(1 − σ(z)))` in f64. [`sigmoid`] never
//! overflows (it exponentiates only `−|z|`), so silu is finite for every finite `z`; an
//! infinite `z` takes the limits silu(−∞) = −0, silu(+∞) = +∞, silu'(−∞) = 0, silu'(+∞) = 1
//! (the GPU kernels do the same). NaN propagates.
use super::Element;
use crate::SwigluArgs;
use crate::error::{Result, invalid};

/// Backward results: the gradients of the gate `a` and of the up projection `b`.
///
/// ```
/// use liger_rs::{SwigluArgs, reference::swiglu::swiglu_backward};
/// let g = swiglu_backward(&SwigluArgs::new(1, 3), &[1.0f64; 3], &[0.0; 3], &[1.0; 3]).unwrap();
/// assert_eq!((g.da.len(), g.db.len()), (3, 3));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SwigluGrads<T> {
    /// Gradient of `a` (same layout as `a`).
    pub da: Vec<T>,
    /// Gradient of `b` (same layout as `b`).
    pub db: Vec<T>,
}

/// `(σ(z), 1 − σ(z))` without overflow or cancellation: from `t = e^{−|z|} ∈ [0, 1]`,
/// `r = 1/(1 + t)`, they are `(r, t·r)` for `z ≥ 0` and `(t·r, r)` otherwise.
fn sigmoid_pair(z: f64) -> (f64, f64) {
    let t = (-z.abs()).exp();
    let r = 1.0 / (1.0 + t);
    if z >= 0.0 { (r, t * r) } else { (t * r, r) }
}

/// The logistic function `1/(1 + e^{−z})`, finite for every `z` (0 at −∞, 1 at +∞).
///
/// ```
/// use liger_rs::reference::swiglu::sigmoid;
/// assert_eq!(sigmoid(0.0), 0.5);
/// assert_eq!(sigmoid(-1e300), 0.0);
/// assert_eq!(sigmoid(f64::INFINITY), 1.0);
/// ```
pub fn sigmoid(z: f64) -> f64 {
    sigmoid_pair(z).0
}

/// `silu(z) = z·σ(z)`; −0 for large negative `z` (and −∞), `z` for large positive `z`.
///
/// ```
/// use liger_rs::reference::swiglu::silu;
/// assert_eq!(silu(1e4), 1e4);
/// assert_eq!(silu(-1e4), 0.0);
/// assert_eq!(silu(f64::NEG_INFINITY), 0.0);
/// ```
pub fn silu(z: f64) -> f64 {
    let sig = sigmoid(z);
    if sig == 0.0 { -0.0 } else { z * sig }
}

/// `silu'(z) = σ(z)·(1 + z·(1 − σ(z)))`; 0 for large negative `z`, 1 for large positive.
///
/// ```
/// use liger_rs::reference::swiglu::silu_grad;
/// assert_eq!(silu_grad(0.0), 0.5);
/// assert_eq!(silu_grad(1e4), 1.0);
/// assert_eq!(silu_grad(f64::NEG_INFINITY), 0.0);
/// ```
pub fn silu_grad(z: f64) -> f64 {
    let (sig, one_minus) = sigmoid_pair(z);
    if sig == 0.0 {
        return 0.0;
    }
    let z_one_minus = if one_minus == 0.0 { 0.0 } else { z * one_minus };
    sig * (1.0 + z_one_minus)
}

fn check_multiplier(arg: &'static str, m: f32) -> Result<f64> {
    if m.is_finite() {
        Ok(m as f64)
    } else {
        Err(invalid(arg, "a finite value", m))
    }
}

fn check_like<T>(arg: &'static str, v: &[T], like: usize) -> Result<()> {
    if v.len() != like {
        return Err(invalid(arg, format!("length {like} (like a)"), v.len()));
    }
    Ok(())
}

/// Checks the shape of `args` for the reference, which takes the separate layout with
/// contiguous rows: `cols ≥ 1` and every stride equal to `cols`; then that each of `bufs`
/// holds exactly `rows × cols` elements.
fn check_separate<T>(args: &SwigluArgs, bufs: &[(&'static str, &[T])]) -> Result<()> {
    let cols = args.cols;
    if cols == 0 {
        return Err(invalid("args.cols", "at least 1 column", cols));
    }
    let strides = [
        ("args.a_stride", args.a_stride),
        ("args.b_stride", args.b_stride),
        ("args.c_stride", args.c_stride),
    ];
    for (arg, stride) in strides {
        if stride != cols {
            let expected = format!(
                "cols = {cols} (the reference takes separate contiguous rows: split_gate_up \
                 splits a fused buffer)"
            );
            return Err(invalid(arg, expected, stride));
        }
    }
    let len = args.rows.checked_mul(cols).ok_or_else(|| {
        invalid(
            "args.rows",
            "rows × cols within usize",
            format!("{} × {cols}", args.rows),
        )
    })?;
    for &(arg, buf) in bufs {
        if buf.len() != len {
            return Err(invalid(
                arg,
                format!("length {len} (rows × cols)"),
                buf.len(),
            ));
        }
    }
    Ok(())
}

/// The gate `z = F(a·gm)`.
fn gate<T: Element>(a: T, gm: f64) -> f64 {
    T::cast_f32(a.to_f64() * gm)
}

/// The SwiGLU forward `c = D(D(silu(F(a·gm))) · b)` with `gm = args.gate_multiplier`, as
/// [`crate::swiglu_forward`] computes it: `a`, `b` (and the returned `c`) are `args.rows`
/// contiguous rows of `args.cols` elements, exactly; strides other than `cols` are an
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) ([`split_gate_up`] turns a
/// fused gate-up buffer into `a` and `b`).
///
/// ```
/// use liger_rs::{SwigluArgs, reference::swiglu::{sigmoid, swiglu_forward}};
/// let c = swiglu_forward(&SwigluArgs::new(1, 2), &[0.0f64, 1.0], &[3.0, 2.0]).unwrap();
/// assert_eq!(c, vec![0.0, 2.0 * sigmoid(1.0)]);
/// ```
pub fn swiglu_forward<T: Element>(args: &SwigluArgs, a: &[T], b: &[T]) -> Result<Vec<T>> {
    glu_forward(args, a, b, silu)
}

/// The forward `c = D(D(act(F(a·gm))) · b)` of a GLU whose gate activation is `act` (in f64),
/// after checking `args`, `a` and `b` as [`swiglu_forward`] does: SwiGLU's and GEGLU's.
pub(super) fn glu_forward<T: Element>(
    args: &SwigluArgs,
    a: &[T],
    b: &[T],
    act: impl Fn(f64) -> f64,
) -> Result<Vec<T>> {
    check_separate(args, &[("a", a), ("b", b)])?;
    let gm = check_multiplier("args.gate_multiplier", args.gate_multiplier)?;
    Ok(a.iter()
        .zip(b)
        .map(|(&a, &b)| T::from_f64(T::cast(act(gate(a, gm))) * b.to_f64()))
        .collect())
}

/// The SwiGLU backward, as [`crate::swiglu_backward`] computes it: with `z = F(a·gm)` and
/// `g = F(dc·dm)` (`gm`, `dm` the multipliers of `args`), `db = D(g·silu(z))` and
/// `da = D(g·silu'(z)·gm·b)`; `dc`, `a`, `b` shaped as in [`swiglu_forward`].
///
/// ```
/// use liger_rs::{SwigluArgs, reference::swiglu::swiglu_backward};
/// // z = 0: σ = 1/2, silu = 0, silu' = 1/2.
/// let g = swiglu_backward(&SwigluArgs::new(1, 1), &[1.0f64], &[0.0], &[4.0]).unwrap();
/// assert_eq!((g.da[0], g.db[0]), (2.0, 0.0));
/// ```
pub fn swiglu_backward<T: Element>(
    args: &SwigluArgs,
    dc: &[T],
    a: &[T],
    b: &[T],
) -> Result<SwigluGrads<T>> {
    let (da, db) = glu_backward(args, [dc, a, b], silu, silu_grad, BackwardCasts::Fused)?;
    Ok(SwigluGrads { da, db })
}

/// Where a GLU backward rounds in 16-bit types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BackwardCasts {
    /// Liger's SwiGLU: `db = D(g·act(z))`, `da = D(g·act'(z)·gm·b)`, one rounding each.
    Fused,
    /// PyTorch autograd through `act(a) * b` in the dtype (HF's MLP, Liger's GEGLU):
    /// `db = D(g·D(act(z)))`, `da = D(D(g·b)·act'(z)·gm)`.
    Autograd,
}

/// The backward `(da, db)` of a GLU whose gate activation is `act` with derivative `grad`
/// (in f64): `db = D(g·act(z))`, `da = D(g·act'(z)·gm·b)` with `z = F(a·gm)`, `g = F(dc·dm)`,
/// after checking `args` and the buffers as [`swiglu_backward`] does: SwiGLU's and GEGLU's.
pub(super) fn glu_backward<T: Element>(
    args: &SwigluArgs,
    [dc, a, b]: [&[T]; 3],
    act: impl Fn(f64) -> f64,
    grad: impl Fn(f64) -> f64,
    casts: BackwardCasts,
) -> Result<(Vec<T>, Vec<T>)> {
    check_separate(args, &[("dc", dc), ("a", a), ("b", b)])?;
    let gm = check_multiplier("args.gate_multiplier", args.gate_multiplier)?;
    let dm = check_multiplier("args.down_multiplier", args.down_multiplier)?;
    let mut da = Vec::with_capacity(a.len());
    let mut db = Vec::with_capacity(a.len());
    for ((&dc, &a), &b) in dc.iter().zip(a).zip(b) {
        let z = gate(a, gm);
        let g = T::cast_f32(dc.to_f64() * dm);
        // `D` rounds to 16 bits only in 16-bit types; in f32 and f64 both orders are Liger's.
        if casts == BackwardCasts::Autograd && T::MANTISSA_DIGITS < f32::MANTISSA_DIGITS {
            db.push(T::from_f64(g * T::cast(act(z))));
            da.push(T::from_f64(T::cast(g * b.to_f64()) * (grad(z) * gm)));
        } else {
            db.push(T::from_f64(g * act(z)));
            da.push(T::from_f64(g * grad(z) * gm * b.to_f64()));
        }
    }
    Ok((da, db))
}

fn check_fused<T>(arg: &'static str, v: &[T], cols: usize) -> Result<usize> {
    let width = cols
        .checked_mul(2)
        .filter(|&w| w > 0)
        .ok_or_else(|| invalid("cols", "1 ..= usize::MAX / 2", cols))?;
    if !v.len().is_multiple_of(width) {
        return Err(invalid(
            arg,
            format!("a multiple of 2 × cols = {width} elements"),
            v.len(),
        ));
    }
    Ok(v.len() / width)
}

/// Splits a contiguous fused gate-up buffer `[rows, 2·cols]` into its gate and up halves
/// (each `[rows, cols]`, contiguous).
///
/// ```
/// use liger_rs::reference::swiglu::split_gate_up;
/// let (a, b) = split_gate_up(&[1, 2, 3, 4, 5, 6, 7, 8], 2).unwrap();
/// assert_eq!((a, b), (vec![1, 2, 5, 6], vec![3, 4, 7, 8]));
/// ```
pub fn split_gate_up<T: Copy>(gate_up: &[T], cols: usize) -> Result<(Vec<T>, Vec<T>)> {
    check_fused("gate_up", gate_up, cols)?;
    let mut a = Vec::with_capacity(gate_up.len() / 2);
    let mut b = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks(2 * cols) {
        a.extend_from_slice(&row[..cols]);
        b.extend_from_slice(&row[cols..]);
    }
    Ok((a, b))
}

/// Interleaves contiguous `[rows, cols]` halves into one fused `[rows, 2·cols]` buffer (gate
/// first): the inverse of [`split_gate_up`], e.g. to compare `da`, `db` with a fused gradient.
///
/// ```
/// use liger_rs::reference::swiglu::join_gate_up;
/// assert_eq!(join_gate_up(&[1, 2, 5, 6], &[3, 4, 7, 8], 2).unwrap(), vec![1, 2, 3, 4, 5, 6, 7, 8]);
/// ```
pub fn join_gate_up<T: Copy>(a: &[T], b: &[T], cols: usize) -> Result<Vec<T>> {
    if cols == 0 {
        return Err(invalid("cols", "at least 1", 0));
    }
    if !a.len().is_multiple_of(cols) {
        return Err(invalid(
            "a",
            format!("a multiple of cols = {cols} elements"),
            a.len(),
        ));
    }
    check_like("b", b, a.len())?;
    let mut out = Vec::with_capacity(2 * a.len());
    for (ra, rb) in a.chunks(cols).zip(b.chunks(cols)) {
        out.extend_from_slice(ra);
        out.extend_from_slice(rb);
    }
    Ok(out)
}
