//! Embedding lookup on the CPU: the forward copies the rows exactly; the backward sums each
//! table row's token gradients in f64 and rounds once, `D(Σ_{t: ids[t] = r} dy[t])` (the
//! kernels sum in f32, in token order). Ids outside `[0, vocab)` gather zeros and add to no
//! row, as on the GPU.
use super::Element;
use crate::EmbeddingArgs;
use crate::TokenId;
use crate::error::{Result, invalid};

/// The scalars and the ids' count, then that `buf` holds `rows` rows `stride` apart.
fn check<T, I>(
    args: &EmbeddingArgs,
    ids: &[I],
    (arg, buf): (&'static str, &[T]),
    (rows, stride): (usize, usize),
) -> Result<()> {
    args.check()?;
    if ids.len() != args.tokens {
        return Err(invalid(
            "ids",
            format!("exactly {} ids (tokens)", args.tokens),
            ids.len(),
        ));
    }
    let need = rows.checked_sub(1).map_or(0, |r| r * stride + args.hidden);
    if buf.len() < need {
        return Err(invalid(
            arg,
            format!("at least {need} elements (rows × row stride)"),
            buf.len(),
        ));
    }
    Ok(())
}

/// `[tokens, hidden]`, contiguous: row `t` is `table[ids[t]]` (zeros for an id outside the
/// table). `table` is `[vocab, hidden]` with rows `args.table_stride` apart.
///
/// # Errors
/// As [`crate::embedding_forward`]'s argument checks.
///
/// ```
/// use liger_rs::{EmbeddingArgs, reference::embedding::embedding_forward};
/// let table = [1.0f32, 2.0, 3.0, 4.0];
/// let y = embedding_forward(&EmbeddingArgs::new(3, 2, 2), &table, &[1u32, 0, 9]).unwrap();
/// assert_eq!(y, [3.0, 4.0, 1.0, 2.0, 0.0, 0.0]);
/// ```
pub fn embedding_forward<T: Element, I: TokenId>(
    args: &EmbeddingArgs,
    table: &[T],
    ids: &[I],
) -> Result<Vec<T>> {
    check(args, ids, ("table", table), (args.vocab, args.table_stride))?;
    let mut out = vec![T::from_f64(0.0); args.tokens * args.hidden];
    for (t, id) in ids.iter().enumerate() {
        if let Some(r) = id.row(args.vocab) {
            let src = &table[r * args.table_stride..][..args.hidden];
            out[t * args.hidden..][..args.hidden].copy_from_slice(src);
        }
    }
    Ok(out)
}

/// `[vocab, hidden]`, contiguous: row `r` is the sum of `grad_rows[t]` over the tokens with
/// `ids[t] = r`, in f64, rounded once (zeros for an unused row). `grad_rows` is
/// `[tokens, hidden]` with rows `args.rows_stride` apart.
///
/// # Errors
/// As [`crate::embedding_backward`]'s argument checks.
///
/// ```
/// use liger_rs::{EmbeddingArgs, reference::embedding::embedding_backward};
/// let dy = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
/// let dw = embedding_backward(&EmbeddingArgs::new(3, 2, 2), &[1i64, 1, -1], &dy).unwrap();
/// assert_eq!(dw, [0.0, 0.0, 4.0, 6.0]);
/// ```
pub fn embedding_backward<T: Element, I: TokenId>(
    args: &EmbeddingArgs,
    ids: &[I],
    grad_rows: &[T],
) -> Result<Vec<T>> {
    check(
        args,
        ids,
        ("grad_rows", grad_rows),
        (args.tokens, args.rows_stride),
    )?;
    let mut sums = vec![0f64; args.vocab * args.hidden];
    for (t, id) in ids.iter().enumerate() {
        if let Some(r) = id.row(args.vocab) {
            let src = &grad_rows[t * args.rows_stride..][..args.hidden];
            for (s, v) in sums[r * args.hidden..][..args.hidden].iter_mut().zip(src) {
                *s += v.to_f64();
            }
        }
    }
    Ok(sums.into_iter().map(T::from_f64).collect())
}
