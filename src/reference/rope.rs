//! RoPE on the CPU: the kernels' rotation with their f32 cast points, f64 between.
//!
//! Layouts, forms and argument rules are those of [`crate::rope_forward`] ([`RopeArgs`]): q
//! `[B, S, Hq, d]` and k `[B, S, Hk, d]` (or head-major `[B, H, S, d]`), token rows
//! contiguous or `q_stride`/`k_stride` apart (the slices then hold each buffer's span,
//! [`rope_forward_fused`] takes both in one slice), NeoX or interleaved pairs, full- or
//! half-width cos/sin rows, per-position, per-batch, gathered or multimodal tables. With `h = rotary_dim / 2`, pair `i < h` is
//! `(x1, x2) = (x[i], x[i + h])` (NeoX) or `(x[2i], x[2i + 1])` (interleaved), and `c`, `s`
//! are the pair's cos/sin entries (`i`, `2i` for interleaved full-width rows; `s → −s` in the
//! backward, an exact negation), all widened exactly, `F(·)` = rounding to f32
//! ([`Element::cast_f32`], the identity for f64) and `D(·)` = the one rounding to the element
//! type:
//!
//! | output | value                     |
//! |--------|---------------------------|
//! | `x1`   | `D(F(F(x1·c) − F(x2·s)))` |
//! | `x2`   | `D(F(F(x2·c) + F(x1·s)))` |
//!
//! This is exactly what the kernel computes (`mul.rn.f32` for each product, one
//! `sub`/`add.rn.f32`, no FMA): the f64 product of two values of at most 24 significant bits
//! is exact, so `F` of it is the f32 product; the f64 sum of two f32 values rounded to f32
//! equals the f32 sum. So for f32/f16/bf16 the GPU should agree bit for bit. Dims
//! `rotary_dim..head_dim` are left as they are. The tables may have their own element type
//! (the launchers take q's, or f32 with 16-bit q and k: [`crate::CosSinDtype`]); their
//! entries are widened exactly all the same. Unlike the kernels, which clamp device ids,
//! the reference rejects out-of-range position ids.
use super::Element;
use crate::RopeArgs;
use crate::error::{Result, invalid};
use crate::rope::{check_host_ids, check_sections};

/// Where each token's cos/sin row comes from (host form of [`crate::CosSinLayout`]); rows are
/// [`RopeArgs::table_row_len`] long (`r` below).
///
/// ```
/// use liger_rs::reference::rope::CosSinRows;
/// let ids = [3i64, 0];
/// assert_ne!(CosSinRows::Gathered(&ids), CosSinRows::PerPosition);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CosSinRows<'a> {
    /// cos, sin: `[seq_len, r]`; token `(b, s)` uses row `s`.
    PerPosition,
    /// cos, sin: `[batch, seq_len, r]`; token `(b, s)` uses row `b·seq_len + s`.
    PerBatch,
    /// cos, sin: `[max_pos, r]` (`max_pos = cos.len() / r`); token `(b, s)` uses row
    /// `position_ids[b·seq_len + s]`, which must lie in `0 .. max_pos`.
    Gathered(&'a [i64]),
    /// cos, sin: `[3, batch, seq_len, r]`; pair `i` of token `(b, s)` uses row `b·seq_len + s`
    /// of table 0 for `i < sections[0]`, of table 1 for `i < sections[0] + sections[1]`, else
    /// of table 2 ([`crate::CosSinLayout::Multimodal`]); the sections sum to `rotary_dim / 2`.
    Multimodal {
        /// Pairs from the t, h and w tables.
        sections: [usize; 3],
    },
    /// cos, sin: `[max_pos, r]`; pair `i` of token `(b, s)` uses row `ids[k·batch·seq_len +
    /// b·seq_len + s]` of the `[3, batch, seq_len]` ids, `k` by `sections` as for
    /// [`CosSinRows::Multimodal`] ([`crate::CosSinLayout::MultimodalGathered`]); every id
    /// must lie in `0 .. max_pos`.
    MultimodalGathered {
        /// Pairs read through the t, h and w ids.
        sections: [usize; 3],
        /// The ids `[3, batch, seq_len]`.
        ids: &'a [i64],
    },
}

/// The RoPE forward, in place on `q` and `k` (see the module docs for the rounding).
///
/// ```
/// use liger_rs::{RopeArgs, reference::rope::{CosSinRows, rope_forward}};
/// // One token, one head of 2 dims, rotated by 90°: (x1, x2) → (−x2, x1).
/// let (mut q, mut k) = (vec![1.0f64, 2.0], vec![3.0f64, 4.0]);
/// let args = RopeArgs::new(2);
/// rope_forward(&args, &mut q, &mut k, &[0.0, 0.0], &[1.0, 1.0], CosSinRows::PerPosition).unwrap();
/// assert_eq!((q, k), (vec![-2.0, 1.0], vec![-4.0, 3.0]));
/// ```
pub fn rope_forward<T: Element, C: Element>(
    args: &RopeArgs,
    q: &mut [T],
    k: &mut [T],
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<()> {
    rope(
        args,
        false,
        ["q", "k"],
        Tensors::Two(q, Some(k)),
        cos,
        sin,
        rows,
    )
}

/// The RoPE forward in place on q and k of one slice, laid out as
/// [`crate::rope_forward_fused`] lays them out: q's rows from element 0, k's from `k_offset`
/// (q's and k's rows must not share an element: the same checks as the launcher's).
///
/// ```
/// use liger_rs::{RopeArgs, reference::rope::{CosSinRows, rope_forward_fused}};
/// // Two tokens of [q 2 | k 2 | v 2]: q and k rotate by 90°, v stays.
/// let mut qkv = vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
/// let args = RopeArgs::new(2).with_seq_len(2).with_strides(6, 6);
/// let (cos, sin) = ([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]);
/// rope_forward_fused(&args, &mut qkv, 2, &cos, &sin, CosSinRows::PerPosition).unwrap();
/// assert_eq!(qkv, [-2.0, 1.0, -4.0, 3.0, 5.0, 6.0, -8.0, 7.0, -10.0, 9.0, 11.0, 12.0]);
/// ```
pub fn rope_forward_fused<T: Element, C: Element>(
    args: &RopeArgs,
    qkv: &mut [T],
    k_offset: usize,
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<()> {
    let qk = Tensors::Fused(qkv, k_offset);
    rope(args, false, ["q", "k"], qk, cos, sin, rows)
}

/// The RoPE backward in place on dq and dk of one slice, as [`rope_forward_fused`].
///
/// ```
/// use liger_rs::{RopeArgs, reference::rope::{CosSinRows, rope_backward_fused}};
/// let mut dqkv = vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
/// let args = RopeArgs::new(2).with_strides(6, 6);
/// rope_backward_fused(&args, &mut dqkv, 2, &[0.0, 0.0], &[1.0, 1.0], CosSinRows::PerPosition).unwrap();
/// assert_eq!(dqkv, [2.0, -1.0, 4.0, -3.0, 5.0, 6.0]);
/// ```
pub fn rope_backward_fused<T: Element, C: Element>(
    args: &RopeArgs,
    dqkv: &mut [T],
    k_offset: usize,
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<()> {
    let qk = Tensors::Fused(dqkv, k_offset);
    rope(args, true, ["dq", "dk"], qk, cos, sin, rows)
}

/// The RoPE backward (rotation by −θ), in place on `dq` and `dk`:
/// `g1 = D(F(F(dy1·c) + F(dy2·s)))`, `g2 = D(F(F(dy2·c) − F(dy1·s)))`.
///
/// ```
/// use liger_rs::{RopeArgs, reference::rope::{CosSinRows, rope_backward}};
/// // The backward rotates by −θ: by −90° here, (x1, x2) → (x2, −x1).
/// let (mut dq, mut dk) = (vec![1.0f64, 2.0], vec![3.0f64, 4.0]);
/// let args = RopeArgs::new(2);
/// rope_backward(&args, &mut dq, &mut dk, &[0.0, 0.0], &[1.0, 1.0], CosSinRows::PerPosition).unwrap();
/// assert_eq!((dq, dk), (vec![2.0, -1.0], vec![4.0, -3.0]));
/// ```
pub fn rope_backward<T: Element, C: Element>(
    args: &RopeArgs,
    dq: &mut [T],
    dk: &mut [T],
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<()> {
    rope(
        args,
        true,
        ["dq", "dk"],
        Tensors::Two(dq, Some(dk)),
        cos,
        sin,
        rows,
    )
}

/// RoPE on one tensor `x` shaped like q (`args.k_heads` must be 0): the forward, or the
/// backward with `backward`, in place.
#[cfg(feature = "candle")]
pub(crate) fn rope_one<T: Element, C: Element>(
    args: &RopeArgs,
    backward: bool,
    x: &mut [T],
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<()> {
    rope(
        args,
        backward,
        ["x", "k"],
        Tensors::Two(x, None),
        cos,
        sin,
        rows,
    )
}

/// Position ids as rows of a `max_pos`-row table: `want` of them, each in `0 .. max_pos` (the
/// launchers' check of host ids).
fn id_rows(ids: &[i64], want: usize, what: &str, max_pos: usize) -> Result<Vec<usize>> {
    if ids.len() != want {
        return Err(invalid(
            "position_ids",
            format!("length {want} ({what})"),
            ids.len(),
        ));
    }
    check_host_ids(ids, max_pos)?;
    Ok(ids.iter().map(|&id| id as usize).collect())
}

/// Checks everything, then returns each token's t, h and w cos/sin rows (the same row
/// three times for the layouts without sections) and the sections (`[r/2, 0, 0]` without).
fn token_rows<C>(
    args: &RopeArgs,
    tokens: usize,
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<(Vec<[usize; 3]>, [usize; 3])> {
    let (r, row) = (args.table_row_len(), args.table_row_name());
    let need = |n: usize, what: &str| -> Result<()> {
        let want = n
            .checked_mul(r)
            .ok_or_else(|| invalid("cos", what, "an overflow"))?;
        if cos.len() != want {
            return Err(invalid("cos", format!("length {want} ({what})"), cos.len()));
        }
        Ok(())
    };
    let mut sections = [args.rotary_dim / 2, 0, 0];
    match rows {
        CosSinRows::PerPosition => need(args.seq_len, &format!("seq_len × {row}"))?,
        CosSinRows::PerBatch => need(tokens, &format!("batch × seq_len × {row}"))?,
        CosSinRows::Multimodal { sections: s } => {
            check_sections(s, args.rotary_dim)?;
            sections = s;
            let n = tokens.saturating_mul(3);
            need(n, &format!("3 × batch × seq_len × {row}"))?
        }
        CosSinRows::Gathered(_) | CosSinRows::MultimodalGathered { .. } => {
            if let CosSinRows::MultimodalGathered { sections: s, .. } = rows {
                check_sections(s, args.rotary_dim)?;
                sections = s;
            }
            if cos.is_empty() || !cos.len().is_multiple_of(r) {
                return Err(invalid(
                    "cos",
                    format!("a table of max_pos ≥ 1 rows of {row} = {r}"),
                    format!("length {}", cos.len()),
                ));
            }
        }
    }
    if sin.len() != cos.len() {
        return Err(invalid(
            "sin",
            format!("length {} (the length of cos)", cos.len()),
            sin.len(),
        ));
    }
    let max_pos = cos.len() / r;
    let rows = match rows {
        CosSinRows::PerPosition => (0..tokens).map(|t| [t % args.seq_len; 3]).collect(),
        CosSinRows::PerBatch => (0..tokens).map(|t| [t; 3]).collect(),
        CosSinRows::Multimodal { .. } => (0..tokens)
            .map(|t| [t, tokens + t, 2 * tokens + t])
            .collect(),
        CosSinRows::Gathered(ids) => id_rows(ids, tokens, "batch × seq_len", max_pos)?
            .into_iter()
            .map(|p| [p; 3])
            .collect(),
        CosSinRows::MultimodalGathered { ids, .. } => {
            let want = tokens.saturating_mul(3);
            let p = id_rows(ids, want, "3 × batch × seq_len", max_pos)?;
            (0..tokens)
                .map(|t| [p[t], p[tokens + t], p[2 * tokens + t]])
                .collect()
        }
    };
    Ok((rows, sections))
}

/// The buffers a call rotates: q and maybe k, or both in one slice with k at an offset.
enum Tensors<'a, T> {
    Two(&'a mut [T], Option<&'a mut [T]>),
    Fused(&'a mut [T], usize),
}

fn rope<T: Element, C: Element>(
    args: &RopeArgs,
    backward: bool,
    names: [&'static str; 2],
    tensors: Tensors<'_, T>,
    cos: &[C],
    sin: &[C],
    rows: CosSinRows<'_>,
) -> Result<()> {
    let with_k = !matches!(tensors, Tensors::Two(_, None));
    let sizes = args.check_heads(with_k)?;
    // Contiguous buffers must be exactly their length, strided ones at least their span.
    let length = |name: &'static str, len: usize, want: usize, strided: bool, what: &str| match (
        strided, len,
    ) {
        (false, l) if l != want => Err(invalid(name, format!("length {want} ({what})"), l)),
        (true, l) if l < want => Err(invalid(name, format!("length ≥ {want} ({what})"), l)),
        _ => Ok(()),
    };
    let (q_what, k_what) = match (args.q_stride, args.k_stride) {
        (None, None) => (
            "batch × seq_len × q_heads × head_dim",
            "batch × seq_len × k_heads × head_dim",
        ),
        _ => (
            "(batch × seq_len − 1) × q_stride + q_heads × head_dim",
            "(batch × seq_len − 1) × k_stride + k_heads × head_dim",
        ),
    };
    let (qs, ks) = (args.q_stride.is_some(), args.k_stride.is_some());
    // (index into `bufs`, offset of its first row, heads) for q, then k.
    let mut bufs: Vec<&mut [T]> = Vec::new();
    let parts = match tensors {
        Tensors::Two(q, k) => {
            length(names[0], q.len(), sizes.q_len, qs, q_what)?;
            bufs.push(q);
            let mut p = vec![(0, 0, args.q_heads)];
            if let Some(k) = k {
                length(names[1], k.len(), sizes.k_len, ks, k_what)?;
                bufs.push(k);
                p.push((1, 0, args.k_heads));
            }
            p
        }
        Tensors::Fused(qkv, k_offset) => {
            let k_end = crate::rope::fused_k_end(&sizes, k_offset)?;
            let name = if backward { "dqkv" } else { "qkv" };
            let need = sizes.q_len.max(k_end);
            if qkv.len() < need {
                let what = "the span of q, and k_offset + the span of k";
                return Err(invalid(
                    name,
                    format!("length ≥ {need} ({what})"),
                    qkv.len(),
                ));
            }
            let direction = match backward {
                true => crate::rope::Pass::Backward,
                false => crate::rope::Pass::Forward,
            };
            crate::rope::check_fused_disjoint(&sizes, k_offset, direction)?;
            bufs.push(qkv);
            vec![(0, 0, args.q_heads), (0, k_offset, args.k_heads)]
        }
    };
    let (token_rows, [t_pairs, h_pairs, _]) = token_rows(args, sizes.tokens, cos, sin, rows)?;
    let (d, r, s_len) = (args.head_dim, args.rotary_dim, args.seq_len);
    let h = r / 2;
    let row_len = args.table_row_len();
    // The table entry of pair `i` is `i·cs_step` into the row.
    let cs_step = if args.interleaved && !args.half_tables {
        2
    } else {
        1
    };
    let f = T::cast_f32;
    for (n, &(which, offset, heads)) in parts.iter().enumerate() {
        let buf = &mut *bufs[which];
        let stride = [args.q_token_stride(), args.k_token_stride()][n];
        for (token, &[r_t, r_h, r_w]) in token_rows.iter().enumerate() {
            let (b, s) = (token / s_len, token % s_len);
            for hd in 0..heads {
                let at = offset
                    + if args.head_major {
                        ((b * heads + hd) * s_len + s) * d
                    } else {
                        token * stride + hd * d
                    };
                let head = &mut buf[at..at + d];
                for i in 0..h {
                    let (i1, i2) = if args.interleaved {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + h)
                    };
                    let (x1, x2) = (head[i1].to_f64(), head[i2].to_f64());
                    // The row of the pair's section (t, h or w; one row without sections).
                    let row = match i {
                        i if i < t_pairs => r_t,
                        i if i < t_pairs + h_pairs => r_h,
                        _ => r_w,
                    } * row_len;
                    let c = cos[row + i * cs_step].to_f64();
                    let s = sin[row + i * cs_step].to_f64();
                    let s = if backward { -s } else { s };
                    head[i1] = T::from_f64(f(f(x1 * c) - f(x2 * s)));
                    head[i2] = T::from_f64(f(f(x2 * c) + f(x1 * s)));
                }
            }
        }
    }
    Ok(())
}
