//! Embedding lookup: the forward gathers a table row per token id, the backward sums the
//! gradient rows of each id into the table's gradient, in token order (deterministic, no
//! atomics), writing every row of it.
//!
//! The anatomy of every op family: [`args`] → [`plan`] (the kernel and its grid) → [`launch`]
//! (the one `#[repr(C)]` parameter block of [`abi`], which the device crate compiles too).
pub(crate) mod args;
mod launch;
pub(crate) mod plan;
// The device crate's file, as the package ships it: the kernels' parameter block, defined once.
#[path = "../../packaging/kernels-gpu/src/embedding/abi.rs"]
pub(crate) mod abi;

pub use args::EmbeddingArgs;

use crate::dtype::Dtype;
use crate::error::Result;
use crate::validate::{read, validate, write};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use std::sync::Arc;

// The sealed trait cannot be named outside the crate, so its crate-private types stay private.
#[allow(private_interfaces)]
mod sealed {
    use crate::identity::IdType;
    use crate::validate::{Access, Buf};
    use cudarc::driver::DevicePtr;

    /// Keeps [`TokenId`](super::TokenId) to the id types of the kernels, and names each.
    pub trait Sealed: Sized {
        /// The id type in the kernels' identities.
        const ID: IdType;
        /// `ids` as a buffer of the validation table.
        fn buf<T>(ids: &dyn DevicePtr<Self>) -> Buf<'_, T>;
    }
    impl Sealed for u32 {
        const ID: IdType = IdType::U32;
        fn buf<T>(ids: &dyn DevicePtr<Self>) -> Buf<'_, T> {
            Buf::U32(Access::Read(ids))
        }
    }
    impl Sealed for i64 {
        const ID: IdType = IdType::I64;
        fn buf<T>(ids: &dyn DevicePtr<Self>) -> Buf<'_, T> {
            Buf::I64(Access::Read(ids))
        }
    }
}

/// A token id type with embedding kernels: `u32` (candle's usual ids) or `i64` (PyTorch's).
/// Sealed.
pub trait TokenId: DeviceRepr + Copy + sealed::Sealed {
    /// The table row of this id, `None` outside `[0, vocab)` (such an id gathers a zero row
    /// and adds to no row of the gradient).
    fn row(self, vocab: usize) -> Option<usize>;
}

impl TokenId for u32 {
    fn row(self, vocab: usize) -> Option<usize> {
        (self as usize).lt(&vocab).then_some(self as usize)
    }
}

impl TokenId for i64 {
    fn row(self, vocab: usize) -> Option<usize> {
        usize::try_from(self).ok().filter(|&r| r < vocab)
    }
}

/// Embedding forward: `rows[t] = table[ids[t]]` for each of `args.tokens` ids
/// (`torch.nn.functional.embedding`), the rows copied exactly. An id outside
/// `[0, args.vocab)` gives a row of zeros (PyTorch raises a device-side assertion; the host
/// cannot see device ids without a synchronisation).
///
/// `table`: `[vocab, hidden]` rows `args.table_stride` apart; `ids`: exactly `tokens`;
/// `rows`: `[tokens, hidden]` rows `args.rows_stride` apart, written (elements between the
/// rows untouched).
///
/// # Errors
/// A bad argument, a buffer of another context or too short, `rows` overlapping another
/// buffer; a driver error.
///
/// ```no_run
/// use liger_rs::{EmbeddingArgs, embedding_forward, half::bf16};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let table = stream.clone_htod(&vec![bf16::ONE; 100 * 64])?;
/// let ids = stream.clone_htod(&[3u32, 7, 3])?;
/// let mut rows = stream.alloc_zeros::<bf16>(3 * 64)?;
/// embedding_forward(&stream, &EmbeddingArgs::new(3, 100, 64), &table, &ids, &mut rows)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn embedding_forward<T: Dtype, I: TokenId>(
    stream: &Arc<CudaStream>,
    args: &EmbeddingArgs,
    table: &impl DevicePtr<T>,
    ids: &impl DevicePtr<I>,
    rows: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let spec = args.table(false)?;
    let bufs = [read(table), Some(I::buf(ids)), write(rows)];
    let Some(taken) = validate(stream, &spec, bufs)? else {
        return Ok(());
    };
    let step = plan::forward(args, T::ELEM, I::ID);
    let p = launch::params(args, taken.ptrs);
    // SAFETY: the table, ids and rows were checked against `args`, which sized the plan.
    unsafe { launch::run(stream, &step, &p) }
}

/// Embedding backward: `grad_table[r] = Σ grad_rows[t]` over the tokens `t` with
/// `ids[t] = r`, summed in f32 in token order and rounded once (bitwise deterministic);
/// every row of `grad_table` is written, zero for an id no token has. Ids outside
/// `[0, vocab)` add to no row.
///
/// `grad_table`: `[vocab, hidden]` rows `args.table_stride` apart, written; `ids`: exactly
/// `tokens`; `grad_rows`: `[tokens, hidden]` rows `args.rows_stride` apart.
///
/// # Errors
/// As [`embedding_forward`], with `grad_table` the buffer written.
pub fn embedding_backward<T: Dtype, I: TokenId>(
    stream: &Arc<CudaStream>,
    args: &EmbeddingArgs,
    grad_table: &mut impl DevicePtrMut<T>,
    ids: &impl DevicePtr<I>,
    grad_rows: &impl DevicePtr<T>,
) -> Result<()> {
    let spec = args.table(true)?;
    let step = plan::backward(args, T::ELEM, I::ID)?;
    let bufs = [write(grad_table), Some(I::buf(ids)), read(grad_rows)];
    let Some(taken) = validate(stream, &spec, bufs)? else {
        return Ok(());
    };
    let p = launch::params(args, taken.ptrs);
    // SAFETY: as the forward's.
    unsafe { launch::run(stream, &step, &p) }
}
