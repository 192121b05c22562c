//! Casting modes of RMSNorm (where values are rounded to the tensor dtype).
use crate::error::{Error, Result};
use crate::identity::Mode;
use std::{fmt, str::FromStr};

/// Where RMSNorm rounds to the tensor dtype `D` (`r` is the inverse RMS of the row; the exact
/// cast points are in [`crate::reference::rms_norm`]).
///
/// ```
/// use liger_rs::CastingMode;
/// let mode: CastingMode = "gemma".parse()?;
/// assert_eq!(mode, CastingMode::Gemma);
/// assert!("Gemma".parse::<CastingMode>().is_err()); // exact names, as Liger
/// # Ok::<(), liger_rs::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum CastingMode {
    /// HF `LlamaRMSNorm`: statistics in f32, `y = D(D(x·r) · (offset + w))`; rstd is f32.
    #[default]
    Llama,
    /// HF `GemmaRMSNorm`: everything in f32, `y = D(x·r·(offset + w))`; rstd is f32.
    Gemma,
    /// Everything in `D` (eps and offset rounded to `D`); rstd holds a `D` value.
    None,
}

impl CastingMode {
    /// All modes, in kernel order.
    ///
    /// ```
    /// use liger_rs::CastingMode;
    /// assert_eq!(CastingMode::ALL.len(), 3);
    /// assert_eq!(CastingMode::ALL[0], CastingMode::Llama);
    /// ```
    pub const ALL: [CastingMode; 3] = [CastingMode::Llama, CastingMode::Gemma, CastingMode::None];

    /// The lowercase name used in kernel names and by [`FromStr`].
    ///
    /// ```
    /// assert_eq!(liger_rs::CastingMode::Gemma.name(), "gemma");
    /// ```
    pub fn name(self) -> &'static str {
        self.kernel_mode().name()
    }

    /// The mode of the kernels that implement it (the vector kernels may run
    /// [`Mode::LlamaOffset`] for [`CastingMode::Llama`] instead).
    pub(crate) fn kernel_mode(self) -> Mode {
        match self {
            CastingMode::Llama => Mode::Llama,
            CastingMode::Gemma => Mode::Gemma,
            CastingMode::None => Mode::None,
        }
    }
}

impl fmt::Display for CastingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CastingMode {
    type Err = Error;

    /// Parses `"llama"`, `"gemma"` or `"none"` (exact, lowercase, as Liger).
    fn from_str(s: &str) -> Result<Self> {
        CastingMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| Error::UnknownCastingMode(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_names() {
        for m in CastingMode::ALL {
            assert_eq!(m.name().parse::<CastingMode>().unwrap(), m);
            assert_eq!(m.to_string(), m.name());
        }
    }

    #[test]
    fn rejects_others_naming_the_valid_set() {
        for s in ["", "Llama", "gemma ", "bf16"] {
            let e = s.parse::<CastingMode>().unwrap_err();
            assert_eq!(e, Error::UnknownCastingMode(s.to_string()));
            let msg = e.to_string();
            assert!(msg.contains("\"llama\", \"gemma\", \"none\""), "{msg}");
        }
    }
}
