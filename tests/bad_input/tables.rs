//! The bad-input tables of every public launcher, shared by the GPU walk in
//! `tests/bad_input.rs` and the library's unit tests, which run the same rows through the
//! launchers' own checks with buffers as plain values (no GPU). See `tests/bad_input.rs` for
//! what a table is.
#![allow(dead_code)] // each includer uses its own part: the GPU walk, or the checks alone

use liger_rs::{
    CastingMode, CrossEntropyArgs, Error, Gelu, LinearCrossEntropyArgs, Reduction, RmsNormArgs,
    RopeArgs, SwigluArgs,
};
use std::collections::BTreeSet;

// ---------------------------------------------------------------- calls and rows

/// Element type of a buffer: the call's dtype `T` or a fixed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    T,
    F32,
    I32,
    I64,
}

impl Kind {
    pub(crate) fn size(self, t_size: usize) -> usize {
        match self {
            Kind::T => t_size,
            Kind::F32 | Kind::I32 => 4,
            Kind::I64 => 8,
        }
    }
}

/// What the launcher does with a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    In,
    Out,
    /// Read, then written in place.
    InOut,
}

/// Which end of another buffer an overlapping buffer covers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Edge {
    /// Its last element covers the start of the other.
    Head,
    /// Its first element covers the end of the other.
    Tail,
}

/// Where a buffer is placed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum At {
    /// Its own slot on device 0, through the stream's context handle.
    Own,
    /// Its own slot on device 0, through a second handle (`cuda_context(0)` again) on the
    /// same primary context.
    Twin,
    /// Its own slot on device 1 (another context).
    Other,
    /// Over one end of the named buffer.
    Over(&'static str, Edge),
}

pub(crate) struct Buf<A> {
    pub(crate) name: &'static str,
    pub(crate) kind: Kind,
    pub(crate) role: Role,
    /// Elements the call needs, from its scalars.
    pub(crate) need: fn(&A) -> usize,
    pub(crate) len: usize,
    pub(crate) at: At,
}

pub(crate) fn buf<A>(name: &'static str, kind: Kind, role: Role, need: fn(&A) -> usize) -> Buf<A> {
    Buf {
        name,
        kind,
        role,
        need,
        len: 0,
        at: At::Own,
    }
}

/// One call of a launcher: its scalars and its buffers, in signature order.
pub(crate) struct Call<A> {
    pub(crate) args: A,
    pub(crate) bufs: Vec<Buf<A>>,
}

impl<A> Call<A> {
    /// A call whose buffers hold exactly what `args` needs.
    pub(crate) fn new(args: A, bufs: Vec<Buf<A>>) -> Self {
        let mut call = Call { args, bufs };
        call.resize();
        call
    }

    pub(crate) fn resize(&mut self) {
        for b in &mut self.bufs {
            b.len = (b.need)(&self.args);
        }
    }

    pub(crate) fn buf(&mut self, name: &str) -> &mut Buf<A> {
        self.bufs
            .iter_mut()
            .find(|b| b.name == name)
            .unwrap_or_else(|| panic!("the call has no buffer `{name}`"))
    }

    pub(crate) fn remove(&mut self, name: &str) {
        let before = self.bufs.len();
        self.bufs.retain(|b| b.name != name);
        assert_eq!(
            self.bufs.len() + 1,
            before,
            "the call has no buffer `{name}`"
        );
    }
}

/// What a row's call must return.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Want {
    Ok,
    Invalid {
        arg: &'static str,
        /// A piece of `expected`.
        needle: &'static str,
    },
    Aliasing {
        output: &'static str,
        other: &'static str,
    },
    WrongContext {
        arg: &'static str,
    },
}

pub(crate) fn invalid(arg: &'static str, needle: &'static str) -> Want {
    Want::Invalid { arg, needle }
}

impl Want {
    /// The names it expects the error to carry.
    pub(crate) fn names(&self) -> Vec<&'static str> {
        match *self {
            Want::Ok => vec![],
            Want::Invalid { arg, .. } | Want::WrongContext { arg } => vec![arg],
            Want::Aliasing { output, other } => vec![output, other],
        }
    }

    pub(crate) fn renamed(self, f: impl Fn(&'static str) -> &'static str) -> Want {
        match self {
            Want::Ok => Want::Ok,
            Want::Invalid { arg, needle } => Want::Invalid {
                arg: f(arg),
                needle,
            },
            Want::Aliasing { output, other } => Want::Aliasing {
                output: f(output),
                other: f(other),
            },
            Want::WrongContext { arg } => Want::WrongContext { arg: f(arg) },
        }
    }
}

/// A row's change to the valid call.
pub(crate) type Change<A> = Box<dyn Fn(&mut Call<A>)>;

/// One table row: the argument walked, the change in words and in code, the outcome.
pub(crate) struct Row<A> {
    pub(crate) arg: &'static str,
    pub(crate) what: String,
    pub(crate) change: Change<A>,
    pub(crate) want: Want,
}

/// A table under construction.
pub(crate) struct Rows<A>(pub(crate) Vec<Row<A>>);

impl<A: 'static> Rows<A> {
    pub(crate) fn new() -> Self {
        Rows(Vec::new())
    }

    pub(crate) fn row(
        &mut self,
        arg: &'static str,
        what: &str,
        change: impl Fn(&mut Call<A>) + 'static,
        want: Want,
    ) {
        self.0.push(Row {
            arg,
            what: what.to_string(),
            change: Box::new(change),
            want,
        });
    }

    /// Changes the scalars only; the buffers stay as the valid call has them.
    pub(crate) fn field(
        &mut self,
        arg: &'static str,
        what: &str,
        change: impl Fn(&mut A) + 'static,
        want: Want,
    ) {
        self.row(arg, what, move |c| change(&mut c.args), want)
    }

    /// Changes the scalars, then gives every buffer what the new scalars need.
    pub(crate) fn reshape(
        &mut self,
        arg: &'static str,
        what: &str,
        change: impl Fn(&mut A) + 'static,
        want: Want,
    ) {
        let what = format!("{what}, every buffer resized to match");
        self.row(
            arg,
            &what,
            move |c| {
                change(&mut c.args);
                c.resize();
            },
            want,
        )
    }

    /// The buffer one element short: rejected naming it.
    pub(crate) fn short(&mut self, name: &'static str, needle: &'static str) {
        self.row(
            name,
            "one element short",
            move |c| c.buf(name).len -= 1,
            invalid(name, needle),
        )
    }

    /// The buffer one element long: `Ok` where a length is a minimum, rejected where it is
    /// exact.
    pub(crate) fn long(&mut self, name: &'static str, want: Want) {
        self.row(
            name,
            "one element long",
            move |c| c.buf(name).len += 1,
            want,
        )
    }
}

/// Every buffer from another context (rejected) and through a second handle on the stream's
/// own context (accepted).
pub(crate) fn context_rows<A: 'static>(rows: &mut Rows<A>, bufs: &[Buf<A>]) {
    for b in bufs {
        let name = b.name;
        rows.row(
            name,
            "from device 1 (another context)",
            move |c| c.buf(name).at = At::Other,
            Want::WrongContext { arg: name },
        );
        rows.row(
            name,
            "through a second handle on device 0's context",
            move |c| c.buf(name).at = At::Twin,
            Want::Ok,
        );
    }
}

/// Every pair of buffers overlapping at either end: an error naming the output first (the
/// earlier output when both are written), `Ok` when both are only read.
pub(crate) fn overlap_rows<A: 'static>(rows: &mut Rows<A>, bufs: &[Buf<A>]) {
    for (i, u) in bufs.iter().enumerate() {
        for v in &bufs[i + 1..] {
            let (moved, onto, want) = match (u.role, v.role) {
                (Role::In, Role::In) => (v.name, u.name, Want::Ok),
                (Role::In, _) => (
                    v.name,
                    u.name,
                    Want::Aliasing {
                        output: v.name,
                        other: u.name,
                    },
                ),
                _ => (
                    u.name,
                    v.name,
                    Want::Aliasing {
                        output: u.name,
                        other: v.name,
                    },
                ),
            };
            for edge in [Edge::Head, Edge::Tail] {
                let what = match edge {
                    Edge::Head => format!("its last element over the first of `{onto}`"),
                    Edge::Tail => format!("its first element over the last of `{onto}`"),
                };
                rows.row(
                    moved,
                    &what,
                    move |c| c.buf(moved).at = At::Over(onto, edge),
                    want,
                );
            }
        }
    }
}

/// One public launcher.
pub(crate) trait Op: Copy {
    /// Everything of a call that is not a buffer.
    type Args: PartialEq + 'static;
    fn name(self) -> &'static str;
    /// The valid call every row starts from.
    fn base(self) -> Call<Self::Args>;
    /// The written rows: scalars, lengths, combinations (context and overlap rows are
    /// generated).
    fn rows(self, rows: &mut Rows<Self::Args>);
    /// `Debug` of the library's args struct inside `Self::Args`.
    fn fields(args: &Self::Args) -> String;
    /// The launcher's name for a buffer (RoPE backward calls q and k dq and dk).
    fn rename(self, name: &'static str) -> &'static str {
        name
    }
}

/// The whole table of `op`: the valid call itself, the written rows, the generated ones.
pub(crate) fn table<O: Op>(op: O) -> Vec<Row<O::Args>> {
    let base = op.base();
    let mut rows = Rows::new();
    rows.row("(none)", "the valid call itself", |_| {}, Want::Ok);
    op.rows(&mut rows);
    context_rows(&mut rows, &base.bufs);
    overlap_rows(&mut rows, &base.bufs);
    rows.0
}

/// `(rows − 1) × stride + cols`, 0 without rows (saturating: resized calls are small).
pub(crate) fn span(rows: usize, cols: usize, stride: usize) -> usize {
    match rows {
        0 => 0,
        _ => (rows - 1).saturating_mul(stride).saturating_add(cols),
    }
}

// ---------------------------------------------------------------- RMSNorm

#[derive(Debug, Clone, Copy)]
pub(crate) enum Rms {
    Forward,
    Backward,
    BackwardInplace,
}

pub(crate) fn x_span(a: &RmsNormArgs) -> usize {
    span(a.rows, a.cols, a.x_stride)
}

pub(crate) fn y_span(a: &RmsNormArgs) -> usize {
    span(a.rows, a.cols, a.y_stride)
}

impl Op for Rms {
    type Args = RmsNormArgs;

    fn name(self) -> &'static str {
        match self {
            Rms::Forward => "rms_norm_forward",
            Rms::Backward => "rms_norm_backward",
            Rms::BackwardInplace => "rms_norm_backward_inplace",
        }
    }

    /// 3 rows of 8, x rows 11 apart (x: 30 elements), y/dy/dx rows 13 apart (34), a weight.
    fn base(self) -> Call<RmsNormArgs> {
        let args = RmsNormArgs::new(3, 8).with_strides(11, 13);
        let x = buf("x", Kind::T, Role::In, x_span);
        let weight = buf("weight", Kind::T, Role::In, |a: &RmsNormArgs| a.cols);
        let rows = |a: &RmsNormArgs| a.rows;
        let dw = buf("dw", Kind::T, Role::Out, |a: &RmsNormArgs| a.cols);
        let bufs = match self {
            Rms::Forward => vec![
                x,
                weight,
                buf("y", Kind::T, Role::Out, y_span),
                buf("rstd", Kind::F32, Role::Out, rows),
            ],
            Rms::Backward => vec![
                buf("dy", Kind::T, Role::In, y_span),
                x,
                weight,
                buf("rstd", Kind::F32, Role::In, rows),
                buf("dx", Kind::T, Role::Out, y_span),
                dw,
            ],
            Rms::BackwardInplace => vec![
                buf("dy_dx", Kind::T, Role::InOut, y_span),
                x,
                weight,
                buf("rstd", Kind::F32, Role::In, rows),
                dw,
            ],
        };
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<RmsNormArgs>) {
        // The y-strided buffer; the first buffer the launcher measures, and what it needs with
        // one more row; the stride of the span computed first (an overflow of rows × stride is
        // reported against it).
        let (y, first, first_need, first_stride) = match self {
            Rms::Forward => ("y", "x", "length ≥ 41 (rows × x_stride)", "args.x_stride"),
            Rms::Backward => ("dy", "dy", "length ≥ 47 (rows × y_stride)", "args.y_stride"),
            Rms::BackwardInplace => ("dy_dx", "dy_dx", "length ≥ 47 (rows × y_stride)", "args.y_stride"),
        };
        let cols = invalid("args.cols", "at least 1 column");
        let eps = invalid("args.eps", "a finite value ≥ 0");
        let offset = invalid("args.offset", "a finite value");
        let x_stride = invalid("args.x_stride", "row stride ≥ cols = 8");
        let y_stride = invalid("args.y_stride", "row stride ≥ cols = 8");
        let overflow = "rows × row stride within usize";
        t.field("args.rows", "one more than the buffers hold", |a| a.rows = 4, invalid(first, first_need));
        t.field("args.rows", "usize::MAX: rows × stride overflows", |a| a.rows = usize::MAX, invalid(first_stride, overflow));
        t.field("args.cols", "0", |a| a.cols = 0, cols);
        t.reshape("args.cols", "65536, the widest one-pass row, strides too", |a| { *a = a.with_strides(65536, 65536); a.cols = 65536 }, Want::Ok);
        t.reshape("args.cols", "65537, a chunked row, strides too", |a| { *a = a.with_strides(65537, 65537); a.cols = 65537 }, Want::Ok);
        t.field("args.eps", "negative", |a| a.eps = -1e-6, eps);
        t.field("args.eps", "NaN", |a| a.eps = f32::NAN, eps);
        t.field("args.eps", "+∞", |a| a.eps = f32::INFINITY, eps);
        t.field("args.eps", "0", |a| a.eps = 0.0, Want::Ok);
        t.field("args.offset", "NaN", |a| a.offset = f32::NAN, offset);
        t.field("args.offset", "−∞", |a| a.offset = f32::NEG_INFINITY, offset);
        t.field("args.offset", "1 (Gemma's 1 + w)", |a| a.offset = 1.0, Want::Ok);
        t.field("args.mode", "Gemma", |a| a.mode = CastingMode::Gemma, Want::Ok);
        t.field("args.mode", "None", |a| a.mode = CastingMode::None, Want::Ok);
        t.field("args.x_stride", "cols − 1", |a| a.x_stride = 7, x_stride);
        t.field("args.x_stride", "0", |a| a.x_stride = 0, x_stride);
        t.field("args.x_stride", "usize::MAX: rows × stride overflows", |a| a.x_stride = usize::MAX, invalid("args.x_stride", overflow));
        t.field("args.x_stride", "one more than x holds", |a| a.x_stride = 12, invalid("x", "length ≥ 32 (rows × x_stride)"));
        t.reshape("args.x_stride", "cols (contiguous)", |a| a.x_stride = 8, Want::Ok);
        t.field("args.y_stride", "cols − 1", |a| a.y_stride = 7, y_stride);
        t.field("args.y_stride", "0", |a| a.y_stride = 0, y_stride);
        t.field("args.y_stride", "usize::MAX: rows × stride overflows", |a| a.y_stride = usize::MAX, invalid("args.y_stride", overflow));
        t.field("args.y_stride", "one more than the y-strided buffers hold", |a| a.y_stride = 14, invalid(y, "length ≥ 36 (rows × y_stride)"));
        t.reshape("args.y_stride", "cols (contiguous)", |a| a.y_stride = 8, Want::Ok);
        t.short("x", "length ≥ 30 (rows × x_stride)");
        t.long("x", Want::Ok);
        t.short("weight", "length 8 (cols)");
        t.long("weight", invalid("weight", "length 8 (cols)"));
        t.short(y, "length ≥ 34 (rows × y_stride)");
        t.long(y, Want::Ok);
        t.short("rstd", "length ≥ 3 (rows)");
        t.long("rstd", Want::Ok);
        match self {
            Rms::Forward => {
                t.row("weight", "None: y is the normalised x", |c| c.remove("weight"), Want::Ok);
            }
            Rms::Backward | Rms::BackwardInplace => {
                t.short("dw", "length 8 (cols)");
                t.long("dw", invalid("dw", "length 8 (cols)"));
                t.row("dw", "None while a weight is given: frozen, dx alone", |c| c.remove("dw"), Want::Ok);
                t.row("dw", "given without a weight", |c| c.remove("weight"), invalid("dw", "None (no weight is given)"));
                t.row("weight", "None, and dw None", |c| { c.remove("weight"); c.remove("dw") }, Want::Ok);
            }
        }
        if let Rms::Backward = self {
            t.short("dx", "length ≥ 34 (rows × y_stride)");
            t.long("dx", Want::Ok);
        }
    }

    fn fields(args: &RmsNormArgs) -> String {
        format!("{args:?}")
    }
}

// ---------------------------------------------------------------- fused add + RMSNorm

#[derive(Debug, Clone, Copy)]
pub(crate) enum FusedAdd {
    Forward,
    ForwardInplace,
    Backward,
    BackwardInplace,
}

impl Op for FusedAdd {
    type Args = RmsNormArgs;

    fn name(self) -> &'static str {
        match self {
            FusedAdd::Forward => "fused_add_rms_norm_forward",
            FusedAdd::ForwardInplace => "fused_add_rms_norm_forward_inplace",
            FusedAdd::Backward => "fused_add_rms_norm_backward",
            FusedAdd::BackwardInplace => "fused_add_rms_norm_backward_inplace",
        }
    }

    /// As RMSNorm's: 3 rows of 8, x, r, s rows 11 apart (30 elements), y, dy, ds, dx rows 13
    /// apart (34), a weight.
    fn base(self) -> Call<RmsNormArgs> {
        let args = RmsNormArgs::new(3, 8).with_strides(11, 13);
        let weight = buf("weight", Kind::T, Role::In, |a: &RmsNormArgs| a.cols);
        let rows = |a: &RmsNormArgs| a.rows;
        let dw = buf("dw", Kind::T, Role::Out, |a: &RmsNormArgs| a.cols);
        let r = buf("r", Kind::T, Role::In, x_span);
        let y = buf("y", Kind::T, Role::Out, y_span);
        let dy = buf("dy", Kind::T, Role::In, y_span);
        let s_in = buf("s", Kind::T, Role::In, x_span);
        let bufs = match self {
            FusedAdd::Forward => vec![
                buf("x", Kind::T, Role::In, x_span),
                r,
                weight,
                buf("s", Kind::T, Role::Out, x_span),
                y,
                buf("rstd", Kind::F32, Role::Out, rows),
            ],
            FusedAdd::ForwardInplace => vec![
                buf("x_s", Kind::T, Role::InOut, x_span),
                r,
                weight,
                y,
                buf("rstd", Kind::F32, Role::Out, rows),
            ],
            FusedAdd::Backward => vec![
                dy,
                buf("ds", Kind::T, Role::In, y_span),
                s_in,
                weight,
                buf("rstd", Kind::F32, Role::In, rows),
                buf("dx", Kind::T, Role::Out, y_span),
                dw,
            ],
            FusedAdd::BackwardInplace => vec![
                dy,
                buf("ds_dx", Kind::T, Role::InOut, y_span),
                s_in,
                weight,
                buf("rstd", Kind::F32, Role::In, rows),
                dw,
            ],
        };
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<RmsNormArgs>) {
        // The x-strided buffers and the y-strided ones; the first buffer the launcher
        // measures, and what it needs with one more row; the stride of the span computed first.
        let (xs, ys, first, first_need, first_stride): (&[&'static str], &[&'static str], _, _, _) = match self {
            FusedAdd::Forward => (&["x", "r", "s"], &["y"], "x", "length ≥ 41 (rows × x_stride)", "args.x_stride"),
            FusedAdd::ForwardInplace => (&["x_s", "r"], &["y"], "x_s", "length ≥ 41 (rows × x_stride)", "args.x_stride"),
            FusedAdd::Backward => (&["s"], &["dy", "ds", "dx"], "dy", "length ≥ 47 (rows × y_stride)", "args.y_stride"),
            FusedAdd::BackwardInplace => (&["s"], &["dy", "ds_dx"], "dy", "length ≥ 47 (rows × y_stride)", "args.y_stride"),
        };
        let (x_first, y_first) = (xs[0], ys[0]);
        let overflow = "rows × row stride within usize";
        t.field("args.rows", "one more than the buffers hold", |a| a.rows = 4, invalid(first, first_need));
        t.field("args.rows", "usize::MAX: rows × stride overflows", |a| a.rows = usize::MAX, invalid(first_stride, overflow));
        t.field("args.cols", "0", |a| a.cols = 0, invalid("args.cols", "at least 1 column"));
        t.reshape("args.cols", "65537, a chunked row, strides too", |a| { *a = a.with_strides(65537, 65537); a.cols = 65537 }, Want::Ok);
        t.field("args.eps", "NaN", |a| a.eps = f32::NAN, invalid("args.eps", "a finite value ≥ 0"));
        t.field("args.offset", "NaN", |a| a.offset = f32::NAN, invalid("args.offset", "a finite value"));
        t.field("args.offset", "1 (Gemma's 1 + w)", |a| a.offset = 1.0, Want::Ok);
        t.field("args.mode", "None", |a| a.mode = CastingMode::None, Want::Ok);
        t.field("args.x_stride", "cols − 1", |a| a.x_stride = 7, invalid("args.x_stride", "row stride ≥ cols = 8"));
        t.field("args.x_stride", "one more than the x-strided buffers hold", |a| a.x_stride = 12, invalid(x_first, "length ≥ 32 (rows × x_stride)"));
        t.reshape("args.x_stride", "cols (contiguous)", |a| a.x_stride = 8, Want::Ok);
        t.field("args.y_stride", "cols − 1", |a| a.y_stride = 7, invalid("args.y_stride", "row stride ≥ cols = 8"));
        t.field("args.y_stride", "one more than the y-strided buffers hold", |a| a.y_stride = 14, invalid(y_first, "length ≥ 36 (rows × y_stride)"));
        t.reshape("args.y_stride", "cols (contiguous)", |a| a.y_stride = 8, Want::Ok);
        for &b in xs {
            t.short(b, "length ≥ 30 (rows × x_stride)");
            t.long(b, Want::Ok);
        }
        for &b in ys {
            t.short(b, "length ≥ 34 (rows × y_stride)");
            t.long(b, Want::Ok);
        }
        t.short("weight", "length 8 (cols)");
        t.long("weight", invalid("weight", "length 8 (cols)"));
        t.short("rstd", "length ≥ 3 (rows)");
        t.long("rstd", Want::Ok);
        match self {
            FusedAdd::Forward | FusedAdd::ForwardInplace => {
                t.row("weight", "None: y is the normalised sum", |c| c.remove("weight"), Want::Ok);
            }
            FusedAdd::Backward | FusedAdd::BackwardInplace => {
                t.short("dw", "length 8 (cols)");
                t.long("dw", invalid("dw", "length 8 (cols)"));
                t.row("dw", "None while a weight is given: frozen, dx alone", |c| c.remove("dw"), Want::Ok);
                t.row("dw", "given without a weight", |c| c.remove("weight"), invalid("dw", "None (no weight is given)"));
                t.row("weight", "None, and dw None", |c| { c.remove("weight"); c.remove("dw") }, Want::Ok);
            }
        }
    }

    fn fields(args: &RmsNormArgs) -> String {
        format!("{args:?}")
    }
}

// ---------------------------------------------------------------- RoPE

#[derive(Debug, Clone, Copy)]
pub(crate) enum Rope {
    Forward,
    Backward,
    ForwardInto,
    BackwardInto,
    ForwardFused,
    BackwardFused,
}

impl Rope {
    /// Out of place: q and k are only read, `q_out` and `k_out` written.
    pub(crate) fn into(self) -> bool {
        matches!(self, Rope::ForwardInto | Rope::BackwardInto)
    }

    /// q and k in one buffer `qkv`, k at [`FUSED_K_OFFSET`].
    pub(crate) fn fused(self) -> bool {
        matches!(self, Rope::ForwardFused | Rope::BackwardFused)
    }
}

/// Where k starts in the fused calls' `qkv`: after q's 32 columns of each 64-element token row.
pub(crate) const FUSED_K_OFFSET: usize = 32;

/// Where the cos/sin rows come from ([`CosSinLayout`] without the borrowed ids).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Layout {
    PerPosition,
    PerBatch,
    Host(Vec<i64>),
    DeviceI32,
    DeviceI64,
    /// Qwen2-VL's three tables, with these sections.
    Multimodal([usize; 3]),
    /// Qwen2-VL's `[3, B, S]` device i64 ids into the gathered table, with these sections.
    MultimodalIds([usize; 3]),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RopeCall {
    pub(crate) args: RopeArgs,
    pub(crate) layout: Layout,
    pub(crate) into: bool,
    /// A fused call's k offset in `qkv` (then there are no `q` and `k` buffers).
    pub(crate) k_offset: Option<usize>,
}

/// Rows of the valid call's gathered cos/sin table.
pub(crate) const MAX_POS: usize = 5;

pub(crate) fn tokens(c: &RopeCall) -> usize {
    c.args.batch.saturating_mul(c.args.seq_len)
}

/// Elements from the first token row of `row` elements to the end of the last, `stride`
/// apart (saturating).
fn rows_span(c: &RopeCall, row: usize, stride: usize) -> usize {
    match tokens(c) {
        0 => 0,
        t => (t - 1).saturating_mul(stride).saturating_add(row),
    }
}

/// The span of q (its length when contiguous).
pub(crate) fn q_len(c: &RopeCall) -> usize {
    let row = c.args.q_heads.saturating_mul(c.args.head_dim);
    rows_span(c, row, c.args.q_stride.unwrap_or(row))
}

/// The span of k.
pub(crate) fn k_len(c: &RopeCall) -> usize {
    let row = c.args.k_heads.saturating_mul(c.args.head_dim);
    rows_span(c, row, c.args.k_stride.unwrap_or(row))
}

/// The contiguous outputs of an out-of-place call.
pub(crate) fn q_out_len(c: &RopeCall) -> usize {
    tokens(c).saturating_mul(c.args.q_heads * c.args.head_dim)
}

pub(crate) fn k_out_len(c: &RopeCall) -> usize {
    tokens(c).saturating_mul(c.args.k_heads * c.args.head_dim)
}

/// A fused call's `qkv`: q's span from 0 and k's from `k_offset`.
pub(crate) fn qkv_len(c: &RopeCall) -> usize {
    q_len(c).max(c.k_offset.unwrap_or(0).saturating_add(k_len(c)))
}

/// Multimodal ids: three rows (t, h, w) of `batch × seq_len`.
pub(crate) fn multimodal_ids_len(c: &RopeCall) -> usize {
    tokens(c).saturating_mul(3)
}

pub(crate) fn table_len(c: &RopeCall) -> usize {
    let rows = match c.layout {
        Layout::PerPosition => c.args.seq_len,
        Layout::PerBatch => tokens(c),
        Layout::Multimodal(_) => 3 * tokens(c),
        _ => MAX_POS,
    };
    rows * c.args.table_row_len()
}

/// A valid call for `args` under `layout`: q and k (read and written in place, or read with
/// `into`, then `q_out` and `k_out` written; with `k_offset`, one buffer `qkv` read and
/// written in place instead), cos and sin, device ids if any.
pub(crate) fn rope_call(
    args: RopeArgs,
    layout: Layout,
    into: bool,
    k_offset: Option<usize>,
) -> Call<RopeCall> {
    let role = if into { Role::In } else { Role::InOut };
    let mut bufs = match k_offset {
        Some(_) => vec![buf("qkv", Kind::T, Role::InOut, qkv_len)],
        None => vec![
            buf("q", Kind::T, role, q_len),
            buf("k", Kind::T, role, k_len),
        ],
    };
    bufs.push(buf("cos", Kind::T, Role::In, table_len));
    bufs.push(buf("sin", Kind::T, Role::In, table_len));
    match layout {
        Layout::DeviceI32 => bufs.push(buf("position_ids", Kind::I32, Role::In, tokens)),
        Layout::DeviceI64 => bufs.push(buf("position_ids", Kind::I64, Role::In, tokens)),
        Layout::MultimodalIds(_) => {
            bufs.push(buf("position_ids", Kind::I64, Role::In, multimodal_ids_len))
        }
        _ => {}
    }
    if into {
        bufs.push(buf("q_out", Kind::T, Role::Out, q_out_len));
        bufs.push(buf("k_out", Kind::T, Role::Out, k_out_len));
    }
    let call = RopeCall {
        args,
        layout,
        into,
        k_offset,
    };
    Call::new(call, bufs)
}

/// Starts the row over from the valid call under another layout.
pub(crate) fn relayout(c: &mut Call<RopeCall>, layout: Layout) {
    *c = rope_call(c.args.args, layout, c.args.into, c.args.k_offset);
}

/// The valid call under host ids (0, 1, …, 4, 0, …), with `change` applied to the ids.
pub(crate) fn with_host_ids(c: &mut Call<RopeCall>, change: impl Fn(&mut Vec<i64>)) {
    let mut ids: Vec<i64> = (0..tokens(&c.args)).map(|i| (i % MAX_POS) as i64).collect();
    change(&mut ids);
    relayout(c, Layout::Host(ids));
}

/// The rows of the fused calls: every field of the args, `qkv` (its span from q's first row to
/// k's last), the tables and ids. q's and k's rows overlapping within `qkv` (k_offset) are
/// walked in `tests/rope.rs`, which names them `q` and `k`.
#[rustfmt::skip]
fn fused_rows(t: &mut Rows<RopeCall>) {
    let qkv = |needle| invalid("qkv", needle);
    let table = invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
    t.short("qkv", "length ≥ 368 (k_offset + the span of k)");
    t.long("qkv", Want::Ok);
    t.short("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
    t.long("cos", table);
    t.short("sin", "length 30 (the length of cos)");
    t.long("sin", invalid("sin", "length 30 (the length of cos)"));
    t.short("position_ids", "length 6 (batch × seq_len)");
    t.long("position_ids", invalid("position_ids", "length 6 (batch × seq_len)"));
    t.field("args.batch", "3: k's rows past qkv", |c| c.args.batch = 3, qkv("length ≥ 560 (k_offset + the span of k)"));
    t.reshape("args.batch", "1", |c| c.args.batch = 1, Want::Ok);
    t.field("args.seq_len", "4: k's rows past qkv", |c| c.args.seq_len = 4, qkv("length ≥ 496 (k_offset + the span of k)"));
    t.field("args.q_heads", "0", |c| c.args.q_heads = 0, invalid("args.q_heads", "at least 1"));
    t.field("args.q_heads", "3 (fewer columns of q in each row)", |c| c.args.q_heads = 3, Want::Ok);
    t.field("args.k_heads", "0", |c| c.args.k_heads = 0, invalid("args.k_heads", "at least 1"));
    t.field("args.k_heads", "9: a k row wider than its stride", |c| c.args.k_heads = 9, invalid("args.k_stride", "≥ k_heads × head_dim = 72"));
    t.field("args.head_dim", "7 (odd)", |c| c.args.head_dim = 7, invalid("args.head_dim", "an even value ≥ 2"));
    t.field("args.rotary_dim", "5 (odd)", |c| c.args.rotary_dim = 5, invalid("args.rotary_dim", "an even value in 2 ..= head_dim = 8"));
    t.reshape("args.interleaved", "interleaved pairs", |c| c.args.interleaved = true, Want::Ok);
    t.field("args.half_tables", "gathered: the 30 elements are 10 rows of 3", |c| c.args.half_tables = true, Want::Ok);
    t.field("args.head_major", "with strides", |c| c.args.head_major = true, invalid("args.q_stride", "None with head-major q and k"));
    t.field("args.q_stride", "31 < q_heads × head_dim", |c| c.args.q_stride = Some(31), invalid("args.q_stride", "≥ q_heads × head_dim = 32"));
    t.field("args.k_stride", "15 < k_heads × head_dim", |c| c.args.k_stride = Some(15), invalid("args.k_stride", "≥ k_heads × head_dim = 16"));
    t.row("layout", "PerPosition", |c| relayout(c, Layout::PerPosition), Want::Ok);
    t.row("layout", "MultimodalGathered, i64 ids", |c| relayout(c, Layout::MultimodalIds([2, 1, 0])), Want::Ok);
}

impl Op for Rope {
    type Args = RopeCall;

    fn name(self) -> &'static str {
        match self {
            Rope::Forward => "rope_forward",
            Rope::Backward => "rope_backward",
            Rope::ForwardInto => "rope_forward_into",
            Rope::BackwardInto => "rope_backward_into",
            Rope::ForwardFused => "rope_forward_fused",
            Rope::BackwardFused => "rope_backward_fused",
        }
    }

    /// q [2, 3, 4, 8] (192), k [2, 3, 2, 8] (96), partial rotary 6, cos/sin a table of 5 rows
    /// of 6 (30) gathered by 6 device i64 ids; out of place, q_out and k_out like q and k.
    /// Fused: q and k in one `qkv` of 6 token rows of 64 (q 32 | k 16 | v 16), 368 elements
    /// from q's first to k's last.
    fn base(self) -> Call<RopeCall> {
        let args = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_rotary_dim(6);
        match self.fused() {
            true => rope_call(
                args.with_strides(64, 64),
                Layout::DeviceI64,
                false,
                Some(FUSED_K_OFFSET),
            ),
            false => rope_call(args, Layout::DeviceI64, self.into(), None),
        }
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<RopeCall>) {
        if self.fused() {
            return fused_rows(t);
        }
        let q = |needle| invalid("q", needle);
        let k = |needle| invalid("k", needle);
        let shape = "batch × seq_len × heads × head_dim within usize";
        let pairs = "(q_heads + k_heads) × rotary_dim / 2 < 2^31";
        let head_dim = invalid("args.head_dim", "an even value ≥ 2");
        let rotary_dim = invalid("args.rotary_dim", "an even value in 2 ..= head_dim = 8");
        let table = invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
        let per_position = invalid("cos", "length 18 (seq_len × rotary_dim)");
        let per_batch = invalid("cos", "length 36 (batch × seq_len × rotary_dim)");
        let ids_len = invalid("position_ids", "length 6 (batch × seq_len)");
        let ids_range = invalid("position_ids", "ids in 0 ..= 4 (rows of the cos/sin table)");
        t.field("args.batch", "one more than q and k hold", |c| c.args.batch = 3, q("length 288 (batch × seq_len × q_heads × head_dim)"));
        t.field("args.batch", "usize::MAX: tokens overflow", |c| c.args.batch = usize::MAX, invalid("args", shape));
        t.reshape("args.batch", "1", |c| c.args.batch = 1, Want::Ok);
        t.field("args.seq_len", "one more than q and k hold", |c| c.args.seq_len = 4, q("length 256 (batch × seq_len × q_heads × head_dim)"));
        t.field("args.seq_len", "usize::MAX: tokens overflow", |c| c.args.seq_len = usize::MAX, invalid("args", shape));
        t.field("args.q_heads", "0", |c| c.args.q_heads = 0, invalid("args.q_heads", "at least 1"));
        t.field("args.q_heads", "one more than q holds", |c| c.args.q_heads = 5, q("length 240 (batch × seq_len × q_heads × head_dim)"));
        t.field("args.q_heads", "2^40: pairs per token overflow", |c| c.args.q_heads = 1 << 40, invalid("args", pairs));
        t.reshape("args.q_heads", "1 (fewer than k_heads)", |c| c.args.q_heads = 1, Want::Ok);
        t.field("args.k_heads", "0", |c| c.args.k_heads = 0, invalid("args.k_heads", "at least 1"));
        t.field("args.k_heads", "one more than k holds", |c| c.args.k_heads = 3, k("length 144 (batch × seq_len × k_heads × head_dim)"));
        t.field("args.k_heads", "2^40: pairs per token overflow", |c| c.args.k_heads = 1 << 40, invalid("args", pairs));
        t.field("args.head_dim", "0", |c| c.args.head_dim = 0, head_dim);
        t.field("args.head_dim", "7 (odd)", |c| c.args.head_dim = 7, head_dim);
        t.field("args.head_dim", "4 < rotary_dim", |c| c.args.head_dim = 4, invalid("args.rotary_dim", "an even value in 2 ..= head_dim = 4"));
        t.field("args.head_dim", "10: more than q and k hold", |c| c.args.head_dim = 10, q("length 240 (batch × seq_len × q_heads × head_dim)"));
        t.reshape("args.head_dim", "6 = rotary_dim", |c| c.args.head_dim = 6, Want::Ok);
        t.field("args.rotary_dim", "0", |c| c.args.rotary_dim = 0, rotary_dim);
        t.field("args.rotary_dim", "5 (odd)", |c| c.args.rotary_dim = 5, rotary_dim);
        t.field("args.rotary_dim", "10 > head_dim", |c| c.args.rotary_dim = 10, rotary_dim);
        t.field("args.rotary_dim", "4: cos is not whole rows of 4", |c| c.args.rotary_dim = 4, invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 4"));
        t.reshape("args.rotary_dim", "8 = head_dim (full rotary)", |c| c.args.rotary_dim = 8, Want::Ok);
        t.reshape("args.rotary_dim", "2, the least", |c| c.args.rotary_dim = 2, Want::Ok);
        t.short("q", "length 192 (batch × seq_len × q_heads × head_dim)");
        t.long("q", q("length 192 (batch × seq_len × q_heads × head_dim)"));
        t.short("k", "length 96 (batch × seq_len × k_heads × head_dim)");
        t.long("k", k("length 96 (batch × seq_len × k_heads × head_dim)"));
        t.short("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
        t.long("cos", table);
        t.row("cos", "one row fewer, sin too (a table of 4 rows)", |c| { c.buf("cos").len -= 6; c.buf("sin").len -= 6 }, Want::Ok);
        t.row("cos", "empty, sin too", |c| { c.buf("cos").len = 0; c.buf("sin").len = 0 }, invalid("cos", "max_pos ≥ 1 rows"));
        t.short("sin", "length 30 (the length of cos)");
        t.long("sin", invalid("sin", "length 30 (the length of cos)"));
        t.short("position_ids", "length 6 (batch × seq_len)");
        t.long("position_ids", ids_len);
        t.row("layout", "PerPosition", |c| relayout(c, Layout::PerPosition), Want::Ok);
        t.row("layout", "PerPosition, cos one short", |c| { relayout(c, Layout::PerPosition); c.buf("cos").len -= 1 }, per_position);
        t.row("layout", "PerPosition, cos one long", |c| { relayout(c, Layout::PerPosition); c.buf("cos").len += 1 }, per_position);
        t.row("layout", "PerPosition, sin one short", |c| { relayout(c, Layout::PerPosition); c.buf("sin").len -= 1 }, invalid("sin", "length 18 (the length of cos)"));
        t.row("layout", "PerPosition with the gathered table", |c| { relayout(c, Layout::PerPosition); c.buf("cos").len = 30; c.buf("sin").len = 30 }, per_position);
        t.row("layout", "PerBatch", |c| relayout(c, Layout::PerBatch), Want::Ok);
        t.row("layout", "PerBatch, cos one short", |c| { relayout(c, Layout::PerBatch); c.buf("cos").len -= 1 }, per_batch);
        t.row("layout", "PerBatch, cos one long", |c| { relayout(c, Layout::PerBatch); c.buf("cos").len += 1 }, per_batch);
        t.row("layout", "PerBatch with a [seq_len, rotary_dim] table", |c| { relayout(c, Layout::PerBatch); c.buf("cos").len = 18; c.buf("sin").len = 18 }, per_batch);
        t.row("layout", "host ids", |c| with_host_ids(c, |_| {}), Want::Ok);
        t.row("position_ids", "host ids, one short", |c| with_host_ids(c, |ids| { ids.pop(); }), ids_len);
        t.row("position_ids", "host ids, one long", |c| with_host_ids(c, |ids| ids.push(0)), ids_len);
        t.row("position_ids", "a host id of −1", |c| with_host_ids(c, |ids| ids[4] = -1), ids_range);
        t.row("position_ids", "a host id of max_pos", |c| with_host_ids(c, |ids| ids[2] = 5), ids_range);
        t.row("layout", "device i32 ids", |c| relayout(c, Layout::DeviceI32), Want::Ok);
        t.row("position_ids", "i32 ids, one short", |c| { relayout(c, Layout::DeviceI32); c.buf("position_ids").len -= 1 }, ids_len);
        t.row("position_ids", "i32 ids, one long", |c| { relayout(c, Layout::DeviceI32); c.buf("position_ids").len += 1 }, ids_len);
        t.row("position_ids", "i32 ids from device 1", |c| { relayout(c, Layout::DeviceI32); c.buf("position_ids").at = At::Other }, Want::WrongContext { arg: "position_ids" });
        let (q_w, k_w) = if self.into() { ("q_out", "k_out") } else { ("q", "k") };
        t.row(q_w, "its first element over the last i32 id", move |c| { relayout(c, Layout::DeviceI32); c.buf(q_w).at = At::Over("position_ids", Edge::Tail) }, Want::Aliasing { output: q_w, other: "position_ids" });
        t.row(k_w, "its last element over the first i32 id", move |c| { relayout(c, Layout::DeviceI32); c.buf(k_w).at = At::Over("position_ids", Edge::Head) }, Want::Aliasing { output: k_w, other: "position_ids" });
        t.reshape("args.interleaved", "interleaved pairs", |c| c.args.interleaved = true, Want::Ok);
        t.reshape("args.head_major", "head-major q and k", |c| c.args.head_major = true, Want::Ok);
        t.reshape("args.half_tables", "half-width rows of 3", |c| c.args.half_tables = true, Want::Ok);
        t.row("args.half_tables", "with full-width per-position rows", |c| { relayout(c, Layout::PerPosition); c.args.args.half_tables = true }, invalid("cos", "length 9 (seq_len × rotary_dim / 2)"));
        t.row("args.half_tables", "gathered: the 30 elements are 10 rows of 3", |c| c.args.args.half_tables = true, Want::Ok);
        // The out-of-place kernels index a token's pairs and copied tail dims in 32 bits.
        let wide = if self.into() { invalid("args", "(q_heads + k_heads) × head_dim < 2^31") } else { q("length 12884901888") };
        t.field("args.q_heads", "2^28: heads × head_dim ≥ 2^31", |c| c.args.q_heads = 1 << 28, wide);
        // Token rows apart: q 40 and k 24 elements per token (views into wider buffers).
        let spans = |c: &mut RopeArgs| *c = c.with_strides(40, 24);
        t.reshape("args.q_stride", "q rows 40 apart, k rows 24 apart", move |c| spans(&mut c.args), Want::Ok);
        t.reshape("args.k_stride", "16 = k's row (k contiguous), q rows 40 apart", |c| c.args = c.args.with_strides(40, 16), Want::Ok);
        t.field("args.q_stride", "31 < q_heads × head_dim", |c| c.args.q_stride = Some(31), invalid("args.q_stride", "≥ q_heads × head_dim = 32"));
        t.field("args.k_stride", "15 < k_heads × head_dim", |c| c.args.k_stride = Some(15), invalid("args.k_stride", "≥ k_heads × head_dim = 16"));
        t.field("args.q_stride", "usize::MAX: the span overflows", |c| c.args.q_stride = Some(usize::MAX), invalid("args", shape));
        t.field("args.q_stride", "set with head-major q and k", |c| { c.args.head_major = true; c.args.q_stride = Some(32) }, invalid("args.q_stride", "None with head-major q and k"));
        t.field("args.k_stride", "set with head-major q and k", |c| { c.args.head_major = true; c.args.k_stride = Some(16) }, invalid("args.k_stride", "None with head-major q and k"));
        t.row("q", "strided, one short of its span", move |c| { spans(&mut c.args.args); c.resize(); c.buf("q").len -= 1 }, q("length ≥ 232 ((batch × seq_len − 1) × q_stride + q_heads × head_dim)"));
        t.row("k", "strided, one short of its span", move |c| { spans(&mut c.args.args); c.resize(); c.buf("k").len -= 1 }, k("length ≥ 136 ((batch × seq_len − 1) × k_stride + k_heads × head_dim)"));
        t.row("q", "strided, one long (a view into a wider buffer)", move |c| { spans(&mut c.args.args); c.resize(); c.buf("q").len += 1 }, Want::Ok);
        // Qwen2-VL's three tables: [3, batch, seq_len, rotary_dim], sections summing to 3.
        let multimodal = invalid("cos", "length 108 (3 × batch × seq_len × rotary_dim)");
        t.row("layout", "Multimodal", |c| relayout(c, Layout::Multimodal([1, 0, 2])), Want::Ok);
        t.row("layout", "Multimodal, cos one short", |c| { relayout(c, Layout::Multimodal([1, 1, 1])); c.buf("cos").len -= 1 }, multimodal);
        t.row("layout", "Multimodal, cos one long", |c| { relayout(c, Layout::Multimodal([1, 1, 1])); c.buf("cos").len += 1 }, multimodal);
        t.row("layout", "Multimodal, sin one short", |c| { relayout(c, Layout::Multimodal([1, 1, 1])); c.buf("sin").len -= 1 }, invalid("sin", "length 108 (the length of cos)"));
        t.row("layout", "Multimodal, sections summing to 4", |c| relayout(c, Layout::Multimodal([1, 1, 2])), invalid("layout.sections", "three sizes summing to rotary_dim / 2 = 3"));
        // [3, batch, seq_len] ids into the gathered table of 5 rows.
        let mm_ids = invalid("position_ids", "length 18 (3 × batch × seq_len)");
        t.row("layout", "MultimodalGathered, i64 ids", |c| relayout(c, Layout::MultimodalIds([2, 1, 0])), Want::Ok);
        t.row("position_ids", "MultimodalGathered, one id short", |c| { relayout(c, Layout::MultimodalIds([2, 1, 0])); c.buf("position_ids").len -= 1 }, mm_ids);
        t.row("position_ids", "MultimodalGathered, one id long", |c| { relayout(c, Layout::MultimodalIds([2, 1, 0])); c.buf("position_ids").len += 1 }, mm_ids);
        t.row("position_ids", "MultimodalGathered, batch × seq_len ids", |c| { relayout(c, Layout::MultimodalIds([2, 1, 0])); c.buf("position_ids").len = 6 }, mm_ids);
        t.row("layout", "MultimodalGathered, sections summing to 2", |c| relayout(c, Layout::MultimodalIds([1, 1, 0])), invalid("layout.sections", "three sizes summing to rotary_dim / 2 = 3"));
        t.row("layout", "MultimodalGathered, cos not whole rows", |c| { relayout(c, Layout::MultimodalIds([1, 1, 1])); c.buf("cos").len -= 1; c.buf("sin").len -= 1 }, invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6"));
        if self.into() {
            t.short("q_out", "length 192 (batch × seq_len × q_heads × head_dim)");
            t.long("q_out", invalid("q_out", "length 192 (batch × seq_len × q_heads × head_dim)"));
            t.short("k_out", "length 96 (batch × seq_len × k_heads × head_dim)");
            t.long("k_out", invalid("k_out", "length 96 (batch × seq_len × k_heads × head_dim)"));
        }
    }

    fn fields(args: &RopeCall) -> String {
        format!("{:?}", args.args)
    }

    fn rename(self, name: &'static str) -> &'static str {
        match (self, name) {
            (Rope::Backward | Rope::BackwardInto, "q") => "dq",
            (Rope::Backward | Rope::BackwardInto, "k") => "dk",
            (Rope::BackwardInto, "q_out") => "dq_out",
            (Rope::BackwardInto, "k_out") => "dk_out",
            (Rope::BackwardFused, "qkv") => "dqkv",
            _ => name,
        }
    }
}

// ---------------------------------------------------------------- SwiGLU

#[derive(Debug, Clone, Copy)]
pub(crate) enum Swiglu {
    Forward,
    ForwardFused,
    Backward,
    BackwardInplace,
    BackwardFused,
    BackwardFusedInplace,
}

pub(crate) fn a_span(a: &SwigluArgs) -> usize {
    span(a.rows, a.cols, a.a_stride)
}

pub(crate) fn b_span(a: &SwigluArgs) -> usize {
    span(a.rows, a.cols, a.b_stride)
}

pub(crate) fn c_span(a: &SwigluArgs) -> usize {
    span(a.rows, a.cols, a.c_stride)
}

pub(crate) fn fused_span(a: &SwigluArgs) -> usize {
    span(a.rows, a.cols.saturating_mul(2), a.a_stride)
}

impl Swiglu {
    pub(crate) fn fused(self) -> bool {
        matches!(
            self,
            Swiglu::ForwardFused | Swiglu::BackwardFused | Swiglu::BackwardFusedInplace
        )
    }

    /// Rows common to the separate layout: a rows 11 apart (30 elements), b 13 (34), c 10 (28).
    #[rustfmt::skip]
    pub(crate) fn separate_rows(self, t: &mut Rows<SwigluArgs>) {
        let (first, first_need, c) = match self {
            Swiglu::Forward => ("a", "length ≥ 41 ((rows − 1) × a_stride + cols)", "c"),
            _ => ("dc", "length ≥ 38 ((rows − 1) × c_stride + cols)", "dc"),
        };
        let overflow = "rows × row stride within usize";
        let stride = |arg| invalid(arg, "row stride ≥ cols = 8");
        t.field("args.rows", "one more than the buffers hold", |a| a.rows = 4, invalid(first, first_need));
        t.field("args.rows", "usize::MAX: rows × stride overflows", |a| a.rows = usize::MAX, invalid("args.a_stride", overflow));
        t.field("args.cols", "0", |a| a.cols = 0, invalid("args.cols", "at least 1 column"));
        t.reshape("args.cols", "1", |a| a.cols = 1, Want::Ok);
        t.field("args.a_stride", "cols − 1", |a| a.a_stride = 7, stride("args.a_stride"));
        t.field("args.a_stride", "0", |a| a.a_stride = 0, stride("args.a_stride"));
        t.field("args.a_stride", "usize::MAX: rows × stride overflows", |a| a.a_stride = usize::MAX, invalid("args.a_stride", overflow));
        t.field("args.a_stride", "one more than the a-strided buffers hold", |a| a.a_stride = 12, invalid("a", "length ≥ 32 ((rows − 1) × a_stride + cols)"));
        t.reshape("args.a_stride", "cols (contiguous)", |a| a.a_stride = 8, Want::Ok);
        t.field("args.b_stride", "cols − 1", |a| a.b_stride = 7, stride("args.b_stride"));
        t.field("args.b_stride", "0", |a| a.b_stride = 0, stride("args.b_stride"));
        t.field("args.b_stride", "usize::MAX: rows × stride overflows", |a| a.b_stride = usize::MAX, invalid("args.b_stride", overflow));
        t.field("args.b_stride", "one more than the b-strided buffers hold", |a| a.b_stride = 14, invalid("b", "length ≥ 36 ((rows − 1) × b_stride + cols)"));
        t.reshape("args.b_stride", "cols (contiguous)", |a| a.b_stride = 8, Want::Ok);
        t.field("args.c_stride", "cols − 1", |a| a.c_stride = 7, stride("args.c_stride"));
        t.field("args.c_stride", "0", |a| a.c_stride = 0, stride("args.c_stride"));
        t.field("args.c_stride", "usize::MAX: rows × stride overflows", |a| a.c_stride = usize::MAX, invalid("args.c_stride", overflow));
        t.field("args.c_stride", "one more than the c-strided buffer holds", |a| a.c_stride = 11, invalid(c, "length ≥ 30 ((rows − 1) × c_stride + cols)"));
        t.reshape("args.c_stride", "cols (contiguous)", |a| a.c_stride = 8, Want::Ok);
        t.short("a", "length ≥ 30 ((rows − 1) × a_stride + cols)");
        t.long("a", Want::Ok);
        t.short("b", "length ≥ 34 ((rows − 1) × b_stride + cols)");
        t.long("b", Want::Ok);
        t.short(c, "length ≥ 28 ((rows − 1) × c_stride + cols)");
        t.long(c, Want::Ok);
    }

    /// Rows common to the fused layout: gate-up rows 19 apart (54 elements), c 10 (28).
    #[rustfmt::skip]
    pub(crate) fn fused_rows(self, t: &mut Rows<SwigluArgs>) {
        let (first, first_need, c) = match self {
            Swiglu::ForwardFused => ("gate_up", "length ≥ 73 ((rows − 1) × a_stride + 2 × cols)", "c"),
            _ => ("dc", "length ≥ 38 ((rows − 1) × c_stride + cols)", "dc"),
        };
        let overflow = "rows × row stride within usize";
        let fused_stride = invalid("args.a_stride", "fused row stride ≥ 2 × cols = 16");
        let c_stride = invalid("args.c_stride", "row stride ≥ cols = 8");
        t.field("args.rows", "one more than the buffers hold", |a| a.rows = 4, invalid(first, first_need));
        t.field("args.rows", "usize::MAX: rows × stride overflows", |a| a.rows = usize::MAX, invalid("args.a_stride", overflow));
        t.field("args.cols", "0", |a| a.cols = 0, invalid("args.cols", "at least 1 column"));
        t.field("args.cols", "usize::MAX / 2 + 1: 2 × cols overflows", |a| a.cols = usize::MAX / 2 + 1, invalid("args.cols", "2 × cols within usize"));
        t.field("args.cols", "10: a gate-up row is wider than a_stride", |a| a.cols = 10, invalid("args.a_stride", "fused row stride ≥ 2 × cols = 20"));
        t.reshape("args.cols", "9", |a| a.cols = 9, Want::Ok);
        t.field("args.a_stride", "2 × cols − 1", |a| a.a_stride = 15, fused_stride);
        t.field("args.a_stride", "cols (enough for a separate row)", |a| a.a_stride = 8, fused_stride);
        t.field("args.a_stride", "0", |a| a.a_stride = 0, fused_stride);
        t.field("args.a_stride", "usize::MAX: rows × stride overflows", |a| a.a_stride = usize::MAX, invalid("args.a_stride", overflow));
        t.field("args.a_stride", "one more than the gate-up buffers hold", |a| a.a_stride = 20, invalid("gate_up", "length ≥ 56 ((rows − 1) × a_stride + 2 × cols)"));
        t.reshape("args.a_stride", "2 × cols (contiguous)", |a| a.a_stride = 16, Want::Ok);
        t.field("args.b_stride", "0 (the fused layout does not use it)", |a| a.b_stride = 0, Want::Ok);
        t.field("args.c_stride", "cols − 1", |a| a.c_stride = 7, c_stride);
        t.field("args.c_stride", "0", |a| a.c_stride = 0, c_stride);
        t.field("args.c_stride", "usize::MAX: rows × stride overflows", |a| a.c_stride = usize::MAX, invalid("args.c_stride", overflow));
        t.field("args.c_stride", "one more than the c-strided buffer holds", |a| a.c_stride = 11, invalid(c, "length ≥ 30 ((rows − 1) × c_stride + cols)"));
        t.reshape("args.c_stride", "cols (contiguous)", |a| a.c_stride = 8, Want::Ok);
        t.short("gate_up", "length ≥ 54 ((rows − 1) × a_stride + 2 × cols)");
        t.long("gate_up", Want::Ok);
        t.short(c, "length ≥ 28 ((rows − 1) × c_stride + cols)");
        t.long(c, Want::Ok);
    }
}

impl Op for Swiglu {
    type Args = SwigluArgs;

    fn name(self) -> &'static str {
        match self {
            Swiglu::Forward => "swiglu_forward",
            Swiglu::ForwardFused => "swiglu_forward_fused",
            Swiglu::Backward => "swiglu_backward",
            Swiglu::BackwardInplace => "swiglu_backward_inplace",
            Swiglu::BackwardFused => "swiglu_backward_fused",
            Swiglu::BackwardFusedInplace => "swiglu_backward_fused_inplace",
        }
    }

    fn base(self) -> Call<SwigluArgs> {
        let args = match self.fused() {
            false => SwigluArgs::new(3, 8).with_strides(11, 13, 10),
            true => SwigluArgs::fused(3, 8).with_strides(19, 16, 10),
        };
        let (a, b) = (
            buf("a", Kind::T, Role::In, a_span),
            buf("b", Kind::T, Role::In, b_span),
        );
        let dc = buf("dc", Kind::T, Role::In, c_span);
        let gate_up = buf("gate_up", Kind::T, Role::In, fused_span);
        let bufs = match self {
            Swiglu::Forward => vec![a, b, buf("c", Kind::T, Role::Out, c_span)],
            Swiglu::ForwardFused => vec![gate_up, buf("c", Kind::T, Role::Out, c_span)],
            Swiglu::Backward => vec![
                dc,
                a,
                b,
                buf("da", Kind::T, Role::Out, a_span),
                buf("db", Kind::T, Role::Out, b_span),
            ],
            Swiglu::BackwardInplace => vec![
                dc,
                Buf {
                    role: Role::InOut,
                    ..a
                },
                Buf {
                    role: Role::InOut,
                    ..b
                },
            ],
            Swiglu::BackwardFused => vec![
                dc,
                gate_up,
                buf("d_gate_up", Kind::T, Role::Out, fused_span),
            ],
            Swiglu::BackwardFusedInplace => vec![
                dc,
                Buf {
                    role: Role::InOut,
                    ..gate_up
                },
            ],
        };
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<SwigluArgs>) {
        let gate = invalid("args.gate_multiplier", "a finite value");
        let down = invalid("args.down_multiplier", "a finite value");
        t.field("args.gate_multiplier", "NaN", |a| a.gate_multiplier = f32::NAN, gate);
        t.field("args.gate_multiplier", "+∞", |a| a.gate_multiplier = f32::INFINITY, gate);
        t.field("args.gate_multiplier", "−0.5", |a| a.gate_multiplier = -0.5, Want::Ok);
        t.field("args.down_multiplier", "NaN", |a| a.down_multiplier = f32::NAN, down);
        t.field("args.down_multiplier", "−∞", |a| a.down_multiplier = f32::NEG_INFINITY, down);
        t.field("args.down_multiplier", "2", |a| a.down_multiplier = 2.0, Want::Ok);
        match self.fused() {
            false => self.separate_rows(t),
            true => self.fused_rows(t),
        }
        match self {
            Swiglu::Backward => {
                t.short("da", "length ≥ 30 ((rows − 1) × a_stride + cols)");
                t.long("da", Want::Ok);
                t.short("db", "length ≥ 34 ((rows − 1) × b_stride + cols)");
                t.long("db", Want::Ok);
            }
            Swiglu::BackwardFused => {
                t.short("d_gate_up", "length ≥ 54 ((rows − 1) × a_stride + 2 × cols)");
                t.long("d_gate_up", Want::Ok);
            }
            _ => {}
        }
    }

    fn fields(args: &SwigluArgs) -> String {
        format!("{args:?}")
    }
}

// ---------------------------------------------------------------- placement

/// A buffer's bytes in an arena (0: device 0, 1: device 1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placed {
    pub(crate) name: &'static str,
    pub(crate) kind: Kind,
    pub(crate) role: Role,
    pub(crate) arena: usize,
    pub(crate) twin: bool,
    pub(crate) start: usize,
    pub(crate) bytes: usize,
    pub(crate) len: usize,
}

/// Places every buffer; returns the placements and the size of each arena. Own slots are
/// 256-byte aligned with a gap wider than any buffer around each, so that a buffer over one end
/// of another (its last element on the other's first, or its first on the other's last, at
/// its own alignment) overlaps nothing else.
pub(crate) fn place<A>(bufs: &[Buf<A>], t_size: usize) -> (Vec<Placed>, [usize; 2]) {
    const ALIGN: usize = 256;
    let bytes = |b: &Buf<A>| b.len * b.kind.size(t_size);
    let gap = bufs
        .iter()
        .map(bytes)
        .max()
        .unwrap_or(0)
        .next_multiple_of(ALIGN)
        + ALIGN;
    let mut end = [gap; 2];
    let mut placed = Vec::new();
    for b in bufs {
        let (arena, twin) = match b.at {
            At::Own => (0, false),
            At::Twin => (0, true),
            At::Other => (1, false),
            At::Over(..) => continue,
        };
        placed.push(Placed {
            name: b.name,
            kind: b.kind,
            role: b.role,
            arena,
            twin,
            start: end[arena],
            bytes: bytes(b),
            len: b.len,
        });
        end[arena] += bytes(b).next_multiple_of(ALIGN) + gap;
    }
    for b in bufs {
        let At::Over(onto, edge) = b.at else {
            continue;
        };
        let o = *placed
            .iter()
            .find(|p| p.name == onto)
            .unwrap_or_else(|| panic!("`{}` is over `{onto}`, which has no slot", b.name));
        let size = b.kind.size(t_size);
        let start = match edge {
            Edge::Head => o.start + size - bytes(b),
            Edge::Tail => (o.start + o.bytes - 1) / size * size,
        };
        placed.push(Placed {
            start,
            arena: o.arena,
            twin: false,
            name: b.name,
            kind: b.kind,
            role: b.role,
            bytes: bytes(b),
            len: b.len,
        });
    }
    (placed, end)
}

/// The pairs of buffers (names in order) that share a byte.
pub(crate) fn overlapping(placed: &[Placed]) -> BTreeSet<(&'static str, &'static str)> {
    let mut pairs = BTreeSet::new();
    for (i, p) in placed.iter().enumerate() {
        for q in &placed[i + 1..] {
            let shared = p.arena == q.arena
                && p.bytes > 0
                && q.bytes > 0
                && p.start < q.start + q.bytes
                && q.start < p.start + p.bytes;
            if shared {
                pairs.insert((p.name.min(q.name), p.name.max(q.name)));
            }
        }
    }
    pairs
}

/// Whether `got` is the error `want` describes.
pub(crate) fn rejected_as(got: &liger_rs::Result<()>, want: Want) -> bool {
    match (got, want) {
        (Err(Error::InvalidArgument { arg, expected, .. }), Want::Invalid { arg: a, needle }) => {
            *arg == a && expected.contains(needle)
        }
        (
            Err(Error::Aliasing { output, other }),
            Want::Aliasing {
                output: o,
                other: t,
            },
        ) => *output == o && *other == t,
        (Err(Error::WrongContext { arg }), Want::WrongContext { arg: a }) => *arg == a,
        _ => false,
    }
}

// ---------------------------------------------------------------- GEGLU

/// A GEGLU launcher: the SwiGLU launcher of the same layout and mode with a form of GELU. Its
/// buffers and checks are SwiGLU's (one validation path), so its rows are too; the form is an
/// enum, valid in every value, so no row changes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geglu(pub(crate) Swiglu, pub(crate) Gelu);

impl Op for Geglu {
    type Args = SwigluArgs;

    fn name(self) -> &'static str {
        match (self.0, self.1) {
            (Swiglu::Forward, Gelu::Tanh) => "geglu_forward (tanh)",
            (Swiglu::ForwardFused, Gelu::Tanh) => "geglu_forward_fused (tanh)",
            (Swiglu::Backward, Gelu::Tanh) => "geglu_backward (tanh)",
            (Swiglu::BackwardInplace, Gelu::Tanh) => "geglu_backward_inplace (tanh)",
            (Swiglu::BackwardFused, Gelu::Tanh) => "geglu_backward_fused (tanh)",
            (Swiglu::BackwardFusedInplace, Gelu::Tanh) => "geglu_backward_fused_inplace (tanh)",
            (Swiglu::Forward, _) => "geglu_forward (erf)",
            (Swiglu::ForwardFused, _) => "geglu_forward_fused (erf)",
            (Swiglu::Backward, _) => "geglu_backward (erf)",
            (Swiglu::BackwardInplace, _) => "geglu_backward_inplace (erf)",
            (Swiglu::BackwardFused, _) => "geglu_backward_fused (erf)",
            (Swiglu::BackwardFusedInplace, _) => "geglu_backward_fused_inplace (erf)",
        }
    }

    fn base(self) -> Call<SwigluArgs> {
        self.0.base()
    }

    fn rows(self, t: &mut Rows<SwigluArgs>) {
        self.0.rows(t)
    }

    fn fields(args: &SwigluArgs) -> String {
        Swiglu::fields(args)
    }
}

// ---------------------------------------------------------------- cross-entropy

#[derive(Debug, Clone, Copy)]
pub(crate) enum Ce {
    Forward,
    ForwardBackward,
    ForwardBackwardInplace,
    Backward,
    BackwardInplace,
}

pub(crate) fn logits_span(a: &CrossEntropyArgs) -> usize {
    span(a.rows, a.vocab, a.logits_stride)
}

pub(crate) fn grad_span(a: &CrossEntropyArgs) -> usize {
    span(a.rows, a.vocab, a.grad_stride)
}

impl Ce {
    /// Whether the call writes a gradient buffer of its own (whose stride is `grad_stride`).
    pub(crate) fn separate_grad(self) -> bool {
        matches!(self, Ce::ForwardBackward | Ce::Backward)
    }

    pub(crate) fn in_place(self) -> bool {
        matches!(self, Ce::ForwardBackwardInplace | Ce::BackwardInplace)
    }

    pub(crate) fn backward(self) -> bool {
        matches!(self, Ce::Backward | Ce::BackwardInplace)
    }
}

impl Op for Ce {
    type Args = CrossEntropyArgs;

    fn name(self) -> &'static str {
        match self {
            Ce::Forward => "cross_entropy_forward",
            Ce::ForwardBackward => "cross_entropy_forward_backward",
            Ce::ForwardBackwardInplace => "cross_entropy_forward_backward_inplace",
            Ce::Backward => "cross_entropy_backward",
            Ce::BackwardInplace => "cross_entropy_backward_inplace",
        }
    }

    /// 3 rows of 8 classes, logits rows 11 apart (30 elements), gradient rows 13 apart (34),
    /// class weights, per-row losses.
    fn base(self) -> Call<CrossEntropyArgs> {
        let args = CrossEntropyArgs::new(3, 8)
            .with_logits_stride(11)
            .with_grad_stride(13)
            .with_reduction(Reduction::None);
        let role = if self.in_place() {
            Role::InOut
        } else {
            Role::In
        };
        let rows = |a: &CrossEntropyArgs| a.rows;
        let loss = |a: &CrossEntropyArgs| a.loss_len();
        let mut bufs = vec![
            buf("logits", Kind::T, role, logits_span),
            buf("target", Kind::I64, Role::In, rows),
            buf("weight", Kind::F32, Role::In, |a: &CrossEntropyArgs| {
                a.vocab
            }),
        ];
        if self.backward() {
            bufs.push(buf("lse", Kind::F32, Role::In, rows));
            bufs.push(buf("grad_loss", Kind::F32, Role::In, loss));
        } else {
            bufs.push(buf("loss", Kind::F32, Role::Out, loss));
            bufs.push(buf("z_loss", Kind::F32, Role::Out, loss));
        }
        if let Ce::Forward = self {
            bufs.push(buf("lse", Kind::F32, Role::Out, rows));
        }
        if self.separate_grad() {
            bufs.push(buf("grad", Kind::T, Role::Out, grad_span));
        }
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<CrossEntropyArgs>) {
        let stride = "rows × row stride within usize";
        let logits_stride = invalid("args.logits_stride", "row stride ≥ cols = 8");
        let vocab = invalid("args.vocab", "1 ..= 2147483647 classes");
        let smoothing = invalid("args.label_smoothing", "a value in [0, 1]");
        let lambda = invalid("args.lse_square_scale", "a finite value ≥ 0");
        let cap = invalid("args.softcap", "a finite value > 0");
        let per_loss = "length 3 (rows with Reduction::None, else 1)";
        t.field("args.rows", "one more than the buffers hold", |a| a.rows = 4, invalid("logits", "length ≥ 41 (rows × row stride)"));
        t.field("args.rows", "usize::MAX: rows × stride overflows", |a| a.rows = usize::MAX, invalid("args.logits_stride", stride));
        t.reshape("args.rows", "0, every buffer empty", |a| a.rows = 0, Want::Ok);
        t.field("args.vocab", "0", |a| a.vocab = 0, vocab);
        t.field("args.vocab", "2³¹", |a| a.vocab = 1 << 31, vocab);
        t.reshape("args.vocab", "1, strides too", |a| { a.vocab = 1; a.logits_stride = 1; a.grad_stride = 1 }, Want::Ok);
        t.field("args.logits_stride", "vocab − 1", |a| a.logits_stride = 7, logits_stride);
        t.field("args.logits_stride", "one more than the logits hold", |a| a.logits_stride = 12, invalid("logits", "length ≥ 32 (rows × row stride)"));
        t.reshape("args.logits_stride", "vocab (contiguous)", |a| a.logits_stride = 8, Want::Ok);
        if self.separate_grad() {
            t.field("args.grad_stride", "vocab − 1", |a| a.grad_stride = 7, invalid("args.grad_stride", "row stride ≥ cols = 8"));
            t.field("args.grad_stride", "one more than grad holds", |a| a.grad_stride = 14, invalid("grad", "length ≥ 36 (rows × row stride)"));
            t.reshape("args.grad_stride", "vocab (contiguous)", |a| a.grad_stride = 8, Want::Ok);
        } else {
            t.field("args.grad_stride", "vocab − 1: no gradient buffer of its own, unused", |a| a.grad_stride = 7, Want::Ok);
        }
        t.field("args.ignore_index", "1 (the seeded targets are 0 and 1)", |a| a.ignore_index = 1, Want::Ok);
        t.field("args.label_smoothing", "negative", |a| a.label_smoothing = -0.1, smoothing);
        t.field("args.label_smoothing", "above 1", |a| a.label_smoothing = 1.5, smoothing);
        t.field("args.label_smoothing", "NaN", |a| a.label_smoothing = f32::NAN, smoothing);
        t.field("args.label_smoothing", "0.1", |a| a.label_smoothing = 0.1, Want::Ok);
        t.field("args.lse_square_scale", "negative", |a| a.lse_square_scale = -1.0, lambda);
        t.field("args.lse_square_scale", "+∞", |a| a.lse_square_scale = f32::INFINITY, lambda);
        t.field("args.lse_square_scale", "1e-4", |a| a.lse_square_scale = 1e-4, Want::Ok);
        t.field("args.softcap", "0", |a| a.softcap = Some(0.0), cap);
        t.field("args.softcap", "negative", |a| a.softcap = Some(-30.0), cap);
        t.field("args.softcap", "NaN", |a| a.softcap = Some(f32::NAN), cap);
        t.field("args.softcap", "30", |a| a.softcap = Some(30.0), Want::Ok);
        t.reshape("args.reduction", "Mean", |a| a.reduction = Reduction::Mean, Want::Ok);
        t.reshape("args.reduction", "Sum", |a| a.reduction = Reduction::Sum, Want::Ok);
        t.short("logits", "length ≥ 30 (rows × row stride)");
        t.long("logits", Want::Ok);
        t.short("target", "length 3 (rows)");
        t.long("target", invalid("target", "length 3 (rows)"));
        t.short("weight", "length 8 (vocab)");
        t.long("weight", invalid("weight", "length 8 (vocab)"));
        t.row("weight", "None: unweighted", |c| c.remove("weight"), Want::Ok);
        if self.backward() || matches!(self, Ce::Forward) {
            t.short("lse", "length 3 (rows)");
            t.long("lse", invalid("lse", "length 3 (rows)"));
        }
        if self.backward() {
            t.short("grad_loss", per_loss);
            t.long("grad_loss", invalid("grad_loss", per_loss));
        } else {
            for name in ["loss", "z_loss"] {
                t.short(name, per_loss);
                t.long(name, invalid(name, per_loss));
            }
            t.row("z_loss", "None", |c| c.remove("z_loss"), Want::Ok);
        }
        if self.separate_grad() {
            t.short("grad", "length ≥ 34 (rows × row stride)");
            t.long("grad", Want::Ok);
        }
    }

    fn fields(args: &CrossEntropyArgs) -> String {
        format!("{args:?}")
    }
}

// ---------------------------------------------------------------- fused linear cross-entropy

/// `fused_linear_cross_entropy` (one launcher).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flce;

fn tokens_hidden(a: &LinearCrossEntropyArgs) -> usize {
    a.ce.rows.saturating_mul(a.hidden)
}

fn vocab_hidden(a: &LinearCrossEntropyArgs) -> usize {
    a.ce.vocab.saturating_mul(a.hidden)
}

impl Op for Flce {
    type Args = LinearCrossEntropyArgs;

    fn name(self) -> &'static str {
        "fused_linear_cross_entropy"
    }

    /// 3 tokens of hidden 4, a head of 8 classes with a bias, class weights, per-row losses,
    /// chunks of 2 tokens.
    fn base(self) -> Call<LinearCrossEntropyArgs> {
        let ce = CrossEntropyArgs::new(3, 8).with_reduction(Reduction::None);
        let args = LinearCrossEntropyArgs::with_ce(4, ce).with_chunk(2);
        let vocab = |a: &LinearCrossEntropyArgs| a.ce.vocab;
        let loss = |a: &LinearCrossEntropyArgs| a.ce.loss_len();
        let bufs = vec![
            buf("x", Kind::T, Role::In, tokens_hidden),
            buf("weight", Kind::T, Role::In, vocab_hidden),
            buf("bias", Kind::T, Role::In, vocab),
            buf(
                "target",
                Kind::I64,
                Role::In,
                |a: &LinearCrossEntropyArgs| a.ce.rows,
            ),
            buf("ce_weight", Kind::F32, Role::In, vocab),
            buf("loss", Kind::F32, Role::Out, loss),
            buf("z_loss", Kind::F32, Role::Out, loss),
            buf("dx", Kind::T, Role::Out, tokens_hidden),
            buf("dweight", Kind::F32, Role::Out, vocab_hidden),
            buf("dbias", Kind::F32, Role::Out, vocab),
        ];
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<LinearCrossEntropyArgs>) {
        let vocab = invalid("args.vocab", "1 ..= 2147483647 classes");
        let hidden = invalid("args.hidden", "1 ..= 2147483647");
        let per_loss = "length 3 (tokens with Reduction::None, else 1)";
        t.field("args.rows", "one more token than the buffers hold", |a| a.ce.rows = 4, invalid("x", "length 16 (tokens × hidden)"));
        t.field("args.rows", "usize::MAX: tokens × hidden overflows", |a| a.ce.rows = usize::MAX, invalid("x", "a size within usize"));
        t.reshape("args.rows", "0, every buffer resized", |a| a.ce.rows = 0, Want::Ok);
        t.field("args.vocab", "0", |a| a.ce.vocab = 0, vocab);
        t.field("args.vocab", "2³¹", |a| a.ce.vocab = 1 << 31, vocab);
        t.reshape("args.vocab", "1", |a| a.ce.vocab = 1, Want::Ok);
        t.field("args.hidden", "0", |a| a.hidden = 0, hidden);
        t.field("args.hidden", "2³¹", |a| a.hidden = 1 << 31, hidden);
        t.reshape("args.hidden", "1", |a| a.hidden = 1, Want::Ok);
        t.field("args.chunk", "Some(0)", |a| a.chunk = Some(0), invalid("args.chunk", "at least 1 token"));
        t.field("args.chunk", "None: the default rule (every token in one chunk here)", |a| a.chunk = None, Want::Ok);
        t.field("args.chunk", "more tokens than the call has", |a| a.chunk = Some(1 << 40), Want::Ok);
        t.field("args.ignore_index", "1", |a| a.ce.ignore_index = 1, Want::Ok);
        t.field("args.label_smoothing", "above 1", |a| a.ce.label_smoothing = 1.5, invalid("args.label_smoothing", "a value in [0, 1]"));
        t.field("args.label_smoothing", "0.1", |a| a.ce.label_smoothing = 0.1, Want::Ok);
        t.field("args.lse_square_scale", "NaN", |a| a.ce.lse_square_scale = f32::NAN, invalid("args.lse_square_scale", "a finite value ≥ 0"));
        t.field("args.lse_square_scale", "1e-4", |a| a.ce.lse_square_scale = 1e-4, Want::Ok);
        t.field("args.softcap", "0", |a| a.ce.softcap = Some(0.0), invalid("args.softcap", "a finite value > 0"));
        t.field("args.softcap", "30", |a| a.ce.softcap = Some(30.0), Want::Ok);
        t.reshape("args.reduction", "Mean", |a| a.ce.reduction = Reduction::Mean, Want::Ok);
        t.reshape("args.reduction", "Sum", |a| a.ce.reduction = Reduction::Sum, Want::Ok);
        for (name, need) in [
            ("x", "length 12 (tokens × hidden)"),
            ("weight", "length 32 (vocab × hidden)"),
            ("bias", "length 8 (vocab)"),
            ("target", "length 3 (tokens)"),
            ("ce_weight", "length 8 (vocab)"),
            ("loss", per_loss),
            ("z_loss", per_loss),
            ("dx", "length 12 (tokens × hidden)"),
            ("dweight", "length 32 (vocab × hidden)"),
            ("dbias", "length 8 (vocab)"),
        ] {
            t.short(name, need);
            t.long(name, invalid(name, need));
        }
        t.row("bias", "None, dbias given", |c| c.remove("bias"), invalid("dbias", "no dbias without a bias"));
        t.row("dbias", "None, bias given", |c| c.remove("dbias"), invalid("dbias", "a dbias buffer for the bias"));
        t.row("bias", "None, and dbias None", |c| { c.remove("bias"); c.remove("dbias") }, Want::Ok);
        t.row("ce_weight", "None: unweighted", |c| c.remove("ce_weight"), Want::Ok);
        t.row("z_loss", "None", |c| c.remove("z_loss"), Want::Ok);
    }

    /// Flat: the head's fields and the cross-entropy's that the call uses (its strides are
    /// the chunk's, set by the call).
    fn fields(a: &LinearCrossEntropyArgs) -> String {
        let c = &a.ce;
        format!(
            "LinearCrossEntropyArgs {{ hidden: {}, chunk: {:?}, rows: {}, vocab: {}, \
             ignore_index: {}, label_smoothing: {:?}, lse_square_scale: {:?}, softcap: {:?}, \
             reduction: {:?} }}",
            a.hidden,
            a.chunk,
            c.rows,
            c.vocab,
            c.ignore_index,
            c.label_smoothing,
            c.lse_square_scale,
            c.softcap,
            c.reduction
        )
    }
}

/// Every public launcher, by op.
pub(crate) const RMS: [Rms; 3] = [Rms::Forward, Rms::Backward, Rms::BackwardInplace];
pub(crate) const FUSED_ADD: [FusedAdd; 4] = [
    FusedAdd::Forward,
    FusedAdd::ForwardInplace,
    FusedAdd::Backward,
    FusedAdd::BackwardInplace,
];
pub(crate) const ROPE: [Rope; 6] = [
    Rope::Forward,
    Rope::Backward,
    Rope::ForwardInto,
    Rope::BackwardInto,
    Rope::ForwardFused,
    Rope::BackwardFused,
];
pub(crate) const SWIGLU: [Swiglu; 6] = [
    Swiglu::Forward,
    Swiglu::ForwardFused,
    Swiglu::Backward,
    Swiglu::BackwardInplace,
    Swiglu::BackwardFused,
    Swiglu::BackwardFusedInplace,
];
pub(crate) const GEGLU: [Geglu; 12] = [
    Geglu(Swiglu::Forward, Gelu::Tanh),
    Geglu(Swiglu::ForwardFused, Gelu::Tanh),
    Geglu(Swiglu::Backward, Gelu::Tanh),
    Geglu(Swiglu::BackwardInplace, Gelu::Tanh),
    Geglu(Swiglu::BackwardFused, Gelu::Tanh),
    Geglu(Swiglu::BackwardFusedInplace, Gelu::Tanh),
    Geglu(Swiglu::Forward, Gelu::Erf),
    Geglu(Swiglu::ForwardFused, Gelu::Erf),
    Geglu(Swiglu::Backward, Gelu::Erf),
    Geglu(Swiglu::BackwardInplace, Gelu::Erf),
    Geglu(Swiglu::BackwardFused, Gelu::Erf),
    Geglu(Swiglu::BackwardFusedInplace, Gelu::Erf),
];
pub(crate) const CE: [Ce; 5] = [
    Ce::Forward,
    Ce::ForwardBackward,
    Ce::ForwardBackwardInplace,
    Ce::Backward,
    Ce::BackwardInplace,
];
pub(crate) const FLCE: [Flce; 1] = [Flce];
