//! The bad-input tables of RMSNorm's and the fused add + RMSNorm's launchers.
use super::*;

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
