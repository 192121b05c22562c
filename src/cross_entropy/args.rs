//! The cross-entropy calls' public arguments and their checks, shared by the GPU launchers,
//! the CPU reference and the candle CPU path.
use super::abi;
use crate::error::{Result, invalid};
use crate::validate::{Need, Spec, Strided, Table};
use std::str::FromStr;

/// How the per-row losses become the result (PyTorch's `reduction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// One loss per row (0 on ignored rows).
    None,
    /// The sum over the rows.
    Sum,
    /// The cross-entropy summed over the counted rows divided by their targets' summed class
    /// weight (their count when unweighted), plus the z-loss summed and divided by their
    /// count (Liger's normalisation; PyTorch's `mean` when there is no z-loss). NaN when
    /// every row is ignored, as PyTorch's.
    #[default]
    Mean,
}

impl Reduction {
    pub(crate) fn id(self) -> u32 {
        match self {
            Reduction::None => abi::NONE,
            Reduction::Sum => abi::SUM,
            Reduction::Mean => abi::MEAN,
        }
    }
}

impl FromStr for Reduction {
    type Err = crate::Error;

    /// `"none"`, `"sum"` or `"mean"`, as PyTorch spells them.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Reduction::None),
            "sum" => Ok(Reduction::Sum),
            "mean" => Ok(Reduction::Mean),
            _ => Err(invalid("reduction", "\"none\", \"sum\" or \"mean\"", s)),
        }
    }
}

/// The shape and options of a cross-entropy call over `rows` rows of `vocab` logits:
/// PyTorch's `cross_entropy(z, t, weight, ignore_index, reduction, label_smoothing)` with
/// Liger-Kernel's `lse_square_scale` (z-loss, `λ·lse²` per row) and `softcap` (the logits
/// become `c·tanh(z/c)` first, Gemma 2).
///
/// Per counted row `i` with target `t` and class weights `w` (1 without), `lse` the
/// log-sum-exp of its (soft-capped) logits `x` and `ε` the label smoothing:
/// `loss_i = (1 − ε)·w_t·(lse − x_t) + (ε/V)·Σ_j w_j·(lse − x_j) + λ·lse²`. A row whose target
/// is `ignore_index` has loss 0 and gradient 0 and is not counted; a target outside
/// `0..vocab` that is not `ignore_index` makes that row's loss, log-sum-exp and gradient NaN,
/// and so a reduced loss; with class weights under [`Reduction::Mean`] every row's gradient
/// too, as the mean's denominator sums the targets' weights (the device cannot report it; the
/// CPU reference and candle's CPU path return an error).
///
/// ```
/// use liger_rs::{CrossEntropyArgs, Reduction};
/// let args = CrossEntropyArgs::new(8192, 32000).with_label_smoothing(0.1);
/// assert_eq!((args.ignore_index, args.reduction), (-100, Reduction::Mean));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct CrossEntropyArgs {
    /// Rows (tokens).
    pub rows: usize,
    /// Classes per row, 1 ..= 2³¹ − 1.
    pub vocab: usize,
    /// Elements between consecutive rows of the logits (default `vocab`).
    pub logits_stride: usize,
    /// Elements between consecutive rows of the gradient (default `vocab`; an in-place call
    /// uses the logits' stride).
    pub grad_stride: usize,
    /// The target value of rows to ignore (default −100).
    pub ignore_index: i64,
    /// Label smoothing ε in `[0, 1]` (default 0).
    pub label_smoothing: f32,
    /// The z-loss factor λ ≥ 0 (`lse_square_scale`, default 0).
    pub lse_square_scale: f32,
    /// Soft-capping of the logits, `c > 0` (default none).
    pub softcap: Option<f32>,
    /// The reduction (default [`Reduction::Mean`]).
    pub reduction: Reduction,
}

impl CrossEntropyArgs {
    /// `rows` contiguous rows of `vocab` logits, PyTorch's defaults.
    pub fn new(rows: usize, vocab: usize) -> Self {
        CrossEntropyArgs {
            rows,
            vocab,
            logits_stride: vocab,
            grad_stride: vocab,
            ignore_index: -100,
            label_smoothing: 0.0,
            lse_square_scale: 0.0,
            softcap: None,
            reduction: Reduction::Mean,
        }
    }

    /// Sets the row stride of the logits (elements).
    pub fn with_logits_stride(mut self, stride: usize) -> Self {
        self.logits_stride = stride;
        self
    }

    /// Sets the row stride of the gradient (elements).
    pub fn with_grad_stride(mut self, stride: usize) -> Self {
        self.grad_stride = stride;
        self
    }

    /// Sets the ignored target value.
    pub fn with_ignore_index(mut self, ignore_index: i64) -> Self {
        self.ignore_index = ignore_index;
        self
    }

    /// Sets the label smoothing ε.
    pub fn with_label_smoothing(mut self, label_smoothing: f32) -> Self {
        self.label_smoothing = label_smoothing;
        self
    }

    /// Sets the z-loss factor λ.
    pub fn with_lse_square_scale(mut self, lse_square_scale: f32) -> Self {
        self.lse_square_scale = lse_square_scale;
        self
    }

    /// Sets the soft-capping of the logits.
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }

    /// Sets the reduction.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// Values of the loss output: `rows` with [`Reduction::None`], else 1.
    pub fn loss_len(&self) -> usize {
        match self.reduction {
            Reduction::None => self.rows,
            _ => 1,
        }
    }

    /// Checks the scalars (every launcher, the reference and candle's CPU path).
    pub(crate) fn check(&self) -> Result<()> {
        if self.vocab == 0 || self.vocab > i32::MAX as usize {
            return Err(invalid(
                "args.vocab",
                "1 ..= 2147483647 classes",
                self.vocab,
            ));
        }
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return Err(invalid(
                "args.label_smoothing",
                "a value in [0, 1]",
                self.label_smoothing,
            ));
        }
        if !(self.lse_square_scale.is_finite() && self.lse_square_scale >= 0.0) {
            return Err(invalid(
                "args.lse_square_scale",
                "a finite value ≥ 0",
                self.lse_square_scale,
            ));
        }
        if let Some(c) = self.softcap
            && !(c.is_finite() && c > 0.0)
        {
            return Err(invalid("args.softcap", "a finite value > 0", c));
        }
        Ok(())
    }

    /// Whether a call needs the count kernel: the mean's denominators, or the weights' sum
    /// for label smoothing.
    pub(crate) fn needs_count(&self, weighted: bool) -> bool {
        self.reduction == Reduction::Mean || (weighted && self.label_smoothing != 0.0)
    }

    fn rows_of(&self, stride: usize) -> Need {
        Need::Strided(
            Strided {
                rows: self.rows,
                row: self.vocab,
                stride,
            },
            "rows × row stride",
        )
    }

    fn stride_check(&self, arg: &'static str, stride: usize) -> Result<()> {
        crate::validate::span(arg, self.rows, self.vocab, stride).map(|_| ())
    }

    /// The buffers of every cross-entropy call, in the public functions' order: logits,
    /// target, weight, bias, loss, z_loss, lse, grad_loss, grad. `grad` is `None` for a call without a separate
    /// gradient buffer; `in_place` makes the logits the gradient (read, then written).
    pub(crate) fn table(&self, call: Call) -> Result<Table<9>> {
        self.check()?;
        self.stride_check("args.logits_stride", self.logits_stride)?;
        let logits = self.rows_of(self.logits_stride);
        let logits = if call.in_place {
            Spec::in_place("logits", logits)
        } else {
            Spec::read("logits", logits)
        };
        let grad = if call.grad && !call.in_place {
            self.stride_check("args.grad_stride", self.grad_stride)?;
            self.rows_of(self.grad_stride)
        } else {
            Need::Exactly(0, "no gradient buffer")
        };
        let rows = Need::Exactly(self.rows, "rows");
        let per_loss = Need::Exactly(self.loss_len(), LOSS);
        Ok(Table {
            specs: [
                logits,
                Spec::read("target", rows),
                Spec::read("weight", Need::Exactly(self.vocab, "vocab")),
                Spec::read("bias", Need::Exactly(self.vocab, "vocab")),
                Spec::written("loss", per_loss),
                Spec::written("z_loss", per_loss),
                if call.lse_read {
                    Spec::read("lse", rows)
                } else {
                    Spec::written("lse", rows)
                },
                Spec::read("grad_loss", per_loss),
                Spec::written("grad", grad),
            ],
            empty: false,
        })
    }
}

const LOSS: &str = "rows with Reduction::None, else 1";

/// What a call does with its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Call {
    /// It writes the logits' gradient.
    pub(crate) grad: bool,
    /// Into the logits themselves.
    pub(crate) in_place: bool,
    /// It reads the log-sum-exp (the backward) instead of writing it.
    pub(crate) lse_read: bool,
}
