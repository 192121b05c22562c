//! RMSNorm's public arguments ([`RmsNormArgs`], RMSNorm's and the fused residual add's) and
//! their checks: what each buffer of a call must hold, for the GPU launchers, the CPU reference
//! and the candle ops alike.
use super::plan::row_settings;
use crate::CastingMode;
use crate::error::{Result, invalid};
use crate::settings::LaunchSettings;
use crate::validate::{Need, Spec, Table, span};

/// Shape and parameters of an RMSNorm call over `rows` rows of `cols` elements.
///
/// Rows of `x` start `x_stride` elements apart; rows of `y` (forward) and of `dy`/`dx`
/// (backward) start `y_stride` elements apart, so a row-slice of a larger buffer works.
///
/// ```
/// use liger_rs::{CastingMode, RmsNormArgs};
/// // Gemma-style: (1 + w) weights, f32 math throughout; x is the first 2048 columns of a
/// // [tokens, 3 × 2048] buffer.
/// let args = RmsNormArgs::new(8, 2048)
///     .with_mode(CastingMode::Gemma)
///     .with_offset(1.0)
///     .with_eps(1e-6)
///     .with_strides(3 * 2048, 2048);
/// assert_eq!((args.x_stride, args.y_stride), (6144, 2048));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RmsNormArgs {
    /// Number of rows (0 is allowed and launches nothing).
    pub rows: usize,
    /// Elements per row (the normalised dimension), ≥ 1. Rows up to [`MAX_FUSED_SIZE`](crate::MAX_FUSED_SIZE)
    /// (65536) take the fast paths; wider rows run the scalar kernels with 1024 threads
    /// walking the row in chunks (one extra read of the row from cache).
    pub cols: usize,
    /// Added to the mean square before the inverse square root (finite, ≥ 0). With `eps = 0`
    /// an all-zero row has rstd = +∞, so its `y` and `dx` are NaN, as in the reference (and
    /// PyTorch). Non-finite inputs propagate as in the reference: a NaN makes its row NaN, a
    /// ±∞ gives rstd = 0 (`y` 0 except NaN at the ∞, the row's `dx` NaN), and rows near the
    /// largest finite value are normalised without overflow (the sum of squares is rescaled).
    pub eps: f32,
    /// Added to the weight (`1.0` for Gemma-style `(1 + w)` weights). In
    /// [`CastingMode::Llama`] with f16/bf16 tensors, `offset + w` is an f32 value, so any offset
    /// other than ±0 takes kernels that multiply lane by lane in f32 instead of one packed
    /// 16-bit product: more registers, fewer blocks per SM (on an H200 the lane-by-lane code
    /// measured 10 % slower forward at 4096 columns, 20 % backward at 8192). Results are the
    /// same bits either way. Gemma-style weights usually run [`CastingMode::Gemma`].
    pub offset: f32,
    /// Where values are rounded to the tensor dtype.
    pub mode: CastingMode,
    /// Elements between the starts of consecutive rows of `x` (≥ `cols`).
    pub x_stride: usize,
    /// Elements between the starts of consecutive rows of `y`, `dy` and `dx` (≥ `cols`).
    pub y_stride: usize,
}

impl RmsNormArgs {
    /// Contiguous rows, `eps = 1e-6`, `offset = 0`, [`CastingMode::Llama`].
    ///
    /// ```
    /// let args = liger_rs::RmsNormArgs::new(4, 4096);
    /// assert_eq!((args.x_stride, args.y_stride, args.eps), (4096, 4096, 1e-6));
    /// ```
    pub fn new(rows: usize, cols: usize) -> Self {
        RmsNormArgs {
            rows,
            cols,
            eps: 1e-6,
            offset: 0.0,
            mode: CastingMode::Llama,
            x_stride: cols,
            y_stride: cols,
        }
    }

    /// Sets `eps`.
    ///
    /// ```
    /// assert_eq!(liger_rs::RmsNormArgs::new(1, 8).with_eps(1e-5).eps, 1e-5);
    /// ```
    pub fn with_eps(self, eps: f32) -> Self {
        RmsNormArgs { eps, ..self }
    }

    /// Sets the weight offset.
    ///
    /// ```
    /// assert_eq!(liger_rs::RmsNormArgs::new(1, 8).with_offset(1.0).offset, 1.0);
    /// ```
    pub fn with_offset(self, offset: f32) -> Self {
        RmsNormArgs { offset, ..self }
    }

    /// Sets the casting mode.
    ///
    /// ```
    /// use liger_rs::{CastingMode, RmsNormArgs};
    /// assert_eq!(RmsNormArgs::new(1, 8).with_mode(CastingMode::None).mode, CastingMode::None);
    /// ```
    pub fn with_mode(self, mode: CastingMode) -> Self {
        RmsNormArgs { mode, ..self }
    }

    /// Sets the row strides of `x` and of `y`/`dy`/`dx`.
    ///
    /// ```
    /// let args = liger_rs::RmsNormArgs::new(2, 8).with_strides(24, 8); // x: 8 of every 24 columns
    /// assert_eq!((args.x_stride, args.y_stride), (24, 8));
    /// ```
    pub fn with_strides(self, x_stride: usize, y_stride: usize) -> Self {
        RmsNormArgs {
            x_stride,
            y_stride,
            ..self
        }
    }

    pub(crate) fn check(&self) -> Result<LaunchSettings> {
        let settings = row_settings(self.cols)?;
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(invalid("args.eps", "a finite value ≥ 0", self.eps));
        }
        if !self.offset.is_finite() {
            return Err(invalid("args.offset", "a finite value", self.offset));
        }
        Ok(settings)
    }

    /// What `x` must hold.
    pub(crate) fn x_need(&self) -> Result<Need> {
        let span = span("args.x_stride", self.rows, self.cols, self.x_stride)?;
        Ok(Need::AtLeast(span, "rows × x_stride"))
    }

    /// What `y`, `dy` and `dx` must hold.
    pub(crate) fn y_need(&self) -> Result<Need> {
        let span = span("args.y_stride", self.rows, self.cols, self.y_stride)?;
        Ok(Need::AtLeast(span, "rows × y_stride"))
    }

    /// The buffers of [`rms_norm_forward`], and the block shape.
    pub(crate) fn forward_table(&self) -> Result<(LaunchSettings, Table<4>)> {
        let settings = self.check()?;
        let specs = [
            Spec::read("x", self.x_need()?),
            Spec::read("weight", Need::Exactly(self.cols, "cols")),
            Spec::written("y", self.y_need()?),
            Spec::written("rstd", Need::AtLeast(self.rows, "rows")),
        ];
        let empty = self.rows == 0;
        Ok((settings, Table { specs, empty }))
    }

    /// The buffers of [`rms_norm_backward`] (`in_place`: of [`rms_norm_backward_inplace`],
    /// whose `dy_dx` stands first, read and written, and `dx` is left out), and the block
    /// shape.
    /// `dw` needs a weight; a weight without `dw` is frozen (dX only). Without rows, a given
    /// `dw` is still zeroed.
    pub(crate) fn backward_table(
        &self,
        in_place: bool,
        weight: bool,
        dw: bool,
    ) -> Result<(LaunchSettings, Table<6>)> {
        let settings = self.check()?;
        if dw && !weight {
            return Err(invalid("dw", "None (no weight is given)", "a buffer"));
        }
        let y = self.y_need()?;
        let specs = [
            match in_place {
                false => Spec::read("dy", y),
                true => Spec::in_place("dy_dx", y),
            },
            Spec::read("x", self.x_need()?),
            Spec::read("weight", Need::Exactly(self.cols, "cols")),
            Spec::read("rstd", Need::AtLeast(self.rows, "rows")),
            Spec::written("dx", y),
            Spec::written("dw", Need::Exactly(self.cols, "cols")),
        ];
        let empty = self.rows == 0 && !dw;
        Ok((settings, Table { specs, empty }))
    }
}
