//! The library's one error type.
use cudarc::driver::DriverError;
use std::fmt;

/// Everything a liger-rs call can fail with. Messages name the argument and what was expected.
///
/// ```
/// use liger_rs::{Error, calculate_settings};
/// match calculate_settings(0) {
///     Err(Error::InvalidArgument { arg, expected, got }) => {
///         assert_eq!((arg, expected.as_str(), got.as_str()), ("n_cols", "1 ..= 65536 columns", "0"));
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
///
/// `Debug` (what `?` in `main` prints) names the cause too: `NoDriver` carries its message,
/// the other variants their fields.
///
/// ```
/// let e = liger_rs::Error::NoDriver;
/// assert_eq!(
///     format!("{e:?}"),
///     "NoDriver(\"no CUDA driver: libcuda could not be loaded (is an NVIDIA driver installed?)\")"
/// );
/// ```
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (`libcuda.so` / `nvcuda.dll`) could not be loaded.
    NoDriver,
    /// The driver is present but the requested device does not exist.
    NoDevice {
        /// Device ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    Driver(DriverError),
    /// An argument has the wrong value, length or shape.
    InvalidArgument {
        /// The argument's name as in the function signature (e.g. `weight`, `args.cols`).
        arg: &'static str,
        /// What was expected, e.g. `length ≥ 4096 (rows × row stride)`.
        expected: String,
        /// What was given.
        got: String,
    },
    /// Two buffers overlap where the op needs them disjoint.
    Aliasing {
        /// The output argument.
        output: &'static str,
        /// The argument it overlaps.
        other: &'static str,
    },
    /// A buffer belongs to a different CUDA context than the stream.
    WrongContext {
        /// The argument's name.
        arg: &'static str,
    },
    /// A string that names no casting mode.
    UnknownCastingMode(String),
    /// The cuBLAS library (`libcublas.so`), which the ops with GEMMs load at run time, could
    /// not be loaded.
    NoBlas,
    /// A cuBLAS call failed.
    Blas {
        /// The cuBLAS function.
        call: &'static str,
        /// Its status.
        status: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver => write!(
                f,
                "no CUDA driver: libcuda could not be loaded (is an NVIDIA driver installed?)"
            ),
            Error::NoDevice { ordinal, count } => write!(
                f,
                "no CUDA device {ordinal}: the driver reports {count} device(s)"
            ),
            Error::Driver(_) => write!(f, "a CUDA driver call failed"),
            Error::InvalidArgument { arg, expected, got } => {
                write!(f, "invalid `{arg}`: expected {expected}, got {got}")
            }
            Error::Aliasing { output, other } => write!(
                f,
                "`{output}` overlaps `{other}`: the output must not share memory with it"
            ),
            Error::WrongContext { arg } => write!(
                f,
                "`{arg}` belongs to a different CUDA context than the stream"
            ),
            Error::UnknownCastingMode(s) => write!(
                f,
                "unknown casting mode {s:?}: expected one of \"llama\", \"gemma\", \"none\""
            ),
            Error::NoBlas => write!(
                f,
                "no cuBLAS: libcublas could not be loaded (is the CUDA toolkit's lib directory \
                 on the library path?)"
            ),
            Error::Blas { call, status } => write!(f, "{call} failed: {status}"),
        }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver => f.debug_tuple("NoDriver").field(&self.to_string()).finish(),
            Error::NoDevice { ordinal, count } => f
                .debug_struct("NoDevice")
                .field("ordinal", ordinal)
                .field("count", count)
                .finish(),
            Error::Driver(e) => f.debug_tuple("Driver").field(e).finish(),
            Error::InvalidArgument { arg, expected, got } => f
                .debug_struct("InvalidArgument")
                .field("arg", arg)
                .field("expected", expected)
                .field("got", got)
                .finish(),
            Error::Aliasing { output, other } => f
                .debug_struct("Aliasing")
                .field("output", output)
                .field("other", other)
                .finish(),
            Error::WrongContext { arg } => {
                f.debug_struct("WrongContext").field("arg", arg).finish()
            }
            Error::UnknownCastingMode(s) => f.debug_tuple("UnknownCastingMode").field(s).finish(),
            Error::NoBlas => f.debug_tuple("NoBlas").field(&self.to_string()).finish(),
            Error::Blas { call, status } => f
                .debug_struct("Blas")
                .field("call", call)
                .field("status", status)
                .finish(),
        }
    }
}

/// `source()` is the driver's error for [`Error::Driver`], whose own `Display` leaves the CUDA
/// result to it, so that reports that walk the chain (`anyhow`, `eyre`) show it once; `Debug`
/// (what `?` in `main` prints) shows it too.
///
/// ```
/// use std::error::Error as _;
/// let e = liger_rs::Error::Driver(liger_rs::cudarc::driver::DriverError(
///     liger_rs::cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
/// ));
/// assert!(e.source().is_some());
/// assert_eq!(e.to_string(), "a CUDA driver call failed");
/// assert!(liger_rs::Error::NoDriver.source().is_none());
/// ```
impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Driver(e) => Some(e),
            _ => None,
        }
    }
}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        Error::Driver(e)
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Builds an [`Error::InvalidArgument`].
pub(crate) fn invalid(
    arg: &'static str,
    expected: impl fmt::Display,
    got: impl fmt::Display,
) -> Error {
    Error::InvalidArgument {
        arg,
        expected: expected.to_string(),
        got: got.to_string(),
    }
}
