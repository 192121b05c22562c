//! The bad-input tables of SwiGLU's and GEGLU's launchers.
use super::*;

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
