//! The GLU ops' public arguments ([`SwigluArgs`], SwiGLU's and GEGLU's alike) and their
//! checks: what each buffer of a call must hold, for the GPU launchers, the CPU reference and
//! the candle ops alike.
use crate::error::{Result, invalid};
use crate::validate::Role;
use crate::validate::{Need, Spec, Table, span};

/// Shape and parameters of a SwiGLU call over `rows` rows of `cols` elements.
///
/// Separate layout ([`crate::swiglu_forward`], [`crate::swiglu_backward`], [`crate::swiglu_backward_inplace`]):
/// rows of `a` and `da` start `a_stride` elements apart, rows of `b` and `db` `b_stride`
/// apart, rows of `c` and `dc` `c_stride` apart, so row-slices of larger buffers work.
///
/// Fused gate-up layout ([`crate::swiglu_forward_fused`], [`crate::swiglu_backward_fused`],
/// [`crate::swiglu_backward_fused_inplace`]): one `[rows, 2·cols]` buffer with the gate in the first
/// `cols` elements of each row and the up projection in the next `cols`; its rows (and those
/// of its gradient) start `a_stride ≥ 2·cols` elements apart; `b_stride` is not used.
///
/// ```
/// use liger_rs::SwigluArgs;
/// let sep = SwigluArgs::new(8, 14336);
/// let fused = SwigluArgs::fused(8, 14336);
/// assert_eq!((sep.a_stride, fused.a_stride), (14336, 2 * 14336));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SwigluArgs {
    /// Number of rows (0 is allowed and launches nothing).
    pub rows: usize,
    /// Elements per row of `a`, `b` and `c` (≥ 1; no upper limit).
    pub cols: usize,
    /// `gm`: the gate is `z = a·gm` (finite; 1.0 for plain SwiGLU).
    pub gate_multiplier: f32,
    /// `dm` (finite; 1.0 for plain SwiGLU), backward only: the backward computes
    /// `g = f32(dc)·dm` and the gradients from `g`, so with `dc` the gradient of the loss with
    /// respect to `c·dm` it returns the gradients of `c·dm`. The forward does not apply it:
    /// it writes `c`, and multiplying by `dm` where the model does (the down projection's
    /// input) is the caller's; `liger_rs::candle`'s ops return `c·dm` themselves.
    pub down_multiplier: f32,
    /// Elements between the starts of consecutive rows of `a`/`da` (≥ `cols`), or of the
    /// fused gate-up buffer and its gradient (≥ `2·cols`).
    pub a_stride: usize,
    /// Elements between the starts of consecutive rows of `b`/`db` (≥ `cols`; separate layout).
    pub b_stride: usize,
    /// Elements between the starts of consecutive rows of `c`/`dc` (≥ `cols`).
    pub c_stride: usize,
}

impl SwigluArgs {
    /// Separate contiguous `a`, `b`, `c` of `rows × cols`; both multipliers 1.
    ///
    /// ```
    /// let args = liger_rs::SwigluArgs::new(2, 11008);
    /// assert_eq!((args.gate_multiplier, args.c_stride), (1.0, 11008));
    /// ```
    pub fn new(rows: usize, cols: usize) -> Self {
        SwigluArgs {
            rows,
            cols,
            gate_multiplier: 1.0,
            down_multiplier: 1.0,
            a_stride: cols,
            b_stride: cols,
            c_stride: cols,
        }
    }

    /// A contiguous fused gate-up buffer of `rows × 2·cols` (`a_stride = 2·cols`) and a
    /// contiguous `c` of `rows × cols`; both multipliers 1.
    ///
    /// ```
    /// let args = liger_rs::SwigluArgs::fused(2, 11008);
    /// assert_eq!((args.a_stride, args.c_stride), (22016, 11008));
    /// ```
    pub fn fused(rows: usize, cols: usize) -> Self {
        let stride = cols.saturating_mul(2);
        SwigluArgs {
            a_stride: stride,
            b_stride: stride,
            ..SwigluArgs::new(rows, cols)
        }
    }

    /// Sets the gate multiplier `gm`.
    ///
    /// ```
    /// assert_eq!(liger_rs::SwigluArgs::new(1, 8).with_gate_multiplier(0.5).gate_multiplier, 0.5);
    /// ```
    pub fn with_gate_multiplier(self, gate_multiplier: f32) -> Self {
        SwigluArgs {
            gate_multiplier,
            ..self
        }
    }

    /// Sets the down multiplier `dm` (backward only: see [`SwigluArgs::down_multiplier`]).
    ///
    /// ```
    /// assert_eq!(liger_rs::SwigluArgs::new(1, 8).with_down_multiplier(2.0).down_multiplier, 2.0);
    /// ```
    pub fn with_down_multiplier(self, down_multiplier: f32) -> Self {
        SwigluArgs {
            down_multiplier,
            ..self
        }
    }

    /// Sets the row strides of `a`/`da` (or the fused buffer), `b`/`db` and `c`/`dc`.
    ///
    /// ```
    /// let args = liger_rs::SwigluArgs::new(4, 8).with_strides(16, 8, 8); // a: 8 of every 16
    /// assert_eq!((args.a_stride, args.b_stride, args.c_stride), (16, 8, 8));
    /// ```
    pub fn with_strides(self, a_stride: usize, b_stride: usize, c_stride: usize) -> Self {
        SwigluArgs {
            a_stride,
            b_stride,
            c_stride,
            ..self
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.cols == 0 {
            return Err(invalid("args.cols", "at least 1 column", 0));
        }
        if !self.gate_multiplier.is_finite() {
            return Err(invalid(
                "args.gate_multiplier",
                "a finite value",
                self.gate_multiplier,
            ));
        }
        if !self.down_multiplier.is_finite() {
            return Err(invalid(
                "args.down_multiplier",
                "a finite value",
                self.down_multiplier,
            ));
        }
        Ok(())
    }

    /// What `a`, `b` and `c` must hold in the separate layout.
    fn separate_needs(&self) -> Result<[Need; 3]> {
        self.check()?;
        Ok([
            Need::AtLeast(
                span("args.a_stride", self.rows, self.cols, self.a_stride)?,
                SPAN_A,
            ),
            Need::AtLeast(
                span("args.b_stride", self.rows, self.cols, self.b_stride)?,
                SPAN_B,
            ),
            Need::AtLeast(
                span("args.c_stride", self.rows, self.cols, self.c_stride)?,
                SPAN_C,
            ),
        ])
    }

    /// What the fused gate-up buffer and `c` must hold.
    fn fused_needs(&self) -> Result<[Need; 2]> {
        self.check()?;
        let width = self
            .cols
            .checked_mul(2)
            .ok_or_else(|| invalid("args.cols", "2 × cols within usize", self.cols))?;
        if self.a_stride < width {
            return Err(invalid(
                "args.a_stride",
                format!("fused row stride ≥ 2 × cols = {width}"),
                self.a_stride,
            ));
        }
        Ok([
            Need::AtLeast(
                span("args.a_stride", self.rows, width, self.a_stride)?,
                SPAN_FUSED,
            ),
            Need::AtLeast(
                span("args.c_stride", self.rows, self.cols, self.c_stride)?,
                SPAN_C,
            ),
        ])
    }

    /// The table of the call with `buffers`: the fused layout's spans if any buffer is fused,
    /// else the separate layout's; empty without rows.
    pub(crate) fn table<const N: usize>(&self, buffers: &Buffers<N>) -> Result<Table<N>> {
        let needs = match buffers.iter().any(|b| b.2 == Of::Fused) {
            true => {
                let [fused, c] = self.fused_needs()?;
                [None, None, Some(c), Some(fused)]
            }
            false => {
                let [a, b, c] = self.separate_needs()?;
                [Some(a), Some(b), Some(c), None]
            }
        };
        let specs = buffers.map(|(name, role, of)| Spec {
            name,
            role,
            need: needs[of as usize].expect("the constant tables mix no layouts"),
        });
        Ok(Table {
            specs,
            empty: self.rows == 0,
        })
    }
}

/// The span a buffer of a call covers: `a`'s, `b`'s or `c`'s rows, or fused gate-up rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Of {
    A,
    B,
    C,
    Fused,
}

/// A launcher's buffers in signature order: name, role and span.
pub(crate) type Buffers<const N: usize> = [(&'static str, Role, Of); N];

const SPAN_A: &str = "(rows − 1) × a_stride + cols";
const SPAN_B: &str = "(rows − 1) × b_stride + cols";
const SPAN_C: &str = "(rows − 1) × c_stride + cols";
const SPAN_FUSED: &str = "(rows − 1) × a_stride + 2 × cols";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_spans_need_twice_the_columns() {
        let args = SwigluArgs::fused(3, 5);
        assert_eq!(
            args.fused_needs().unwrap(),
            [Need::AtLeast(30, SPAN_FUSED), Need::AtLeast(15, SPAN_C)]
        );
        let e = args.with_strides(9, 0, 5).fused_needs().unwrap_err();
        assert!(e.to_string().contains("2 × cols = 10"), "{e}");
        assert!(SwigluArgs::fused(1, usize::MAX).fused_needs().is_err());
        assert_eq!(
            SwigluArgs::new(2, 4)
                .with_strides(6, 5, 4)
                .separate_needs()
                .unwrap(),
            [
                Need::AtLeast(10, SPAN_A),
                Need::AtLeast(9, SPAN_B),
                Need::AtLeast(8, SPAN_C)
            ]
        );
    }
}
