//! RoPE's public arguments ([`RopeArgs`]; the tables' [`CosSinLayout`](super::CosSinLayout) is in `layout.rs`) and
//! their checks: what each buffer of a call must hold, for the GPU launchers, the CPU reference
//! and the candle ops alike.
use super::layout::TableRows;
use crate::error::{Result, invalid};
use crate::identity::Pass;
use crate::validate::{Need, Spec, Strided, Table, overlaps};

/// Shape and form of a RoPE call: q is `[batch, seq_len, q_heads, head_dim]` and k is
/// `[batch, seq_len, k_heads, head_dim]`, contiguous (HuggingFace's
/// `proj(h).view(B, S, H, d)`, before its `.transpose(1, 2)`) or with token rows
/// [`RopeArgs::with_strides`] apart (views into a fused QKV projection), or head-major
/// `[batch, heads, seq_len, head_dim]` with [`RopeArgs::with_head_major`].
///
/// Only the first `rotary_dim` dims of each head rotate; dims `rotary_dim..head_dim` are left
/// untouched (not even rewritten). Pair `i < rotary_dim / 2` is `(x[i], x[i + rotary_dim / 2])`
/// (NeoX half split, the default) or `(x[2i], x[2i + 1])` ([`RopeArgs::with_interleaved`],
/// GPT-J). Each cos/sin row is `rotary_dim` long by default, one value per rotary dim, as
/// HuggingFace passes them; pair `i` reads the entry of its first dim, `i` (HF's
/// `cat(freqs, freqs)`: the first half) or `2i` interleaved (`repeat_interleave(freqs, 2)`).
/// With [`RopeArgs::with_half_tables`] a row holds `rotary_dim / 2` values, one per pair
/// (candle-nn's and Meta's tables), and pair `i` reads entry `i`.
///
/// ```
/// use liger_rs::RopeArgs;
/// // Llama-3-8B attention: 32 q heads, 8 kv heads of 128; a partial-rotary variant.
/// let args = RopeArgs::new(128).with_batch(2).with_seq_len(4096).with_heads(32, 8);
/// assert_eq!(args.rotary_dim, 128);
/// assert_eq!(args.with_rotary_dim(64).rotary_dim, 64);
/// // candle-nn's `rope_i` layout: [B, H, S, d], interleaved pairs, [S, d/2] tables.
/// let gptj = args.with_head_major().with_interleaved().with_half_tables();
/// assert!(gptj.head_major && gptj.interleaved && gptj.half_tables);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RopeArgs {
    /// Batch size B (0 is allowed and launches nothing).
    pub batch: usize,
    /// Sequence length S (0 is allowed and launches nothing).
    pub seq_len: usize,
    /// Heads of q (≥ 1).
    pub q_heads: usize,
    /// Heads of k (≥ 1; may differ from `q_heads` either way: GQA/MQA).
    pub k_heads: usize,
    /// Elements per head d (even, ≥ 2; need not be a power of two).
    pub head_dim: usize,
    /// Leading dims of each head that rotate (even, `2 ..= head_dim`); also the length of a
    /// cos/sin row (half of it with `half_tables`).
    pub rotary_dim: usize,
    /// Pairs are adjacent dims `(x[2i], x[2i + 1])` instead of the NeoX halves.
    pub interleaved: bool,
    /// cos/sin rows hold `rotary_dim / 2` values, one per pair, instead of `rotary_dim`.
    pub half_tables: bool,
    /// q and k are `[batch, heads, seq_len, head_dim]` instead of `[batch, seq_len, heads,
    /// head_dim]`.
    pub head_major: bool,
    /// Elements from the start of one token's q row (its `q_heads × head_dim` elements) to the
    /// next token's: `None` is contiguous, `q_heads × head_dim` ([`RopeArgs::with_strides`]).
    pub q_stride: Option<usize>,
    /// The same for k's rows of `k_heads × head_dim`.
    pub k_stride: Option<usize>,
}

impl RopeArgs {
    /// Heads of `head_dim` elements, full rotary (`rotary_dim = head_dim`), NeoX pairs,
    /// full-width cos/sin rows, q and k `[batch, seq_len, heads, head_dim]`; the other sizes
    /// start at one sequence of one token with one q head and one k head and are set by
    /// [`with_batch`](RopeArgs::with_batch), [`with_seq_len`](RopeArgs::with_seq_len) and
    /// [`with_heads`](RopeArgs::with_heads). A size left at 1 by mistake is caught by the
    /// launchers, which require q and k to be exactly their shape's length (at least their span
    /// with token strides).
    ///
    /// ```
    /// let args = liger_rs::RopeArgs::new(64).with_seq_len(16).with_heads(4, 4);
    /// assert_eq!((args.batch, args.seq_len, args.q_heads, args.rotary_dim), (1, 16, 4, 64));
    /// assert!(!args.interleaved && !args.half_tables && !args.head_major);
    /// ```
    pub fn new(head_dim: usize) -> Self {
        RopeArgs {
            batch: 1,
            seq_len: 1,
            q_heads: 1,
            k_heads: 1,
            head_dim,
            rotary_dim: head_dim,
            interleaved: false,
            half_tables: false,
            head_major: false,
            q_stride: None,
            k_stride: None,
        }
    }

    /// Sets the batch size B.
    ///
    /// ```
    /// assert_eq!(liger_rs::RopeArgs::new(128).with_batch(2).batch, 2);
    /// ```
    pub fn with_batch(self, batch: usize) -> Self {
        RopeArgs { batch, ..self }
    }

    /// Sets the sequence length S.
    ///
    /// ```
    /// assert_eq!(liger_rs::RopeArgs::new(128).with_seq_len(4096).seq_len, 4096);
    /// ```
    pub fn with_seq_len(self, seq_len: usize) -> Self {
        RopeArgs { seq_len, ..self }
    }

    /// Sets the heads of q and of k (GQA/MQA: `k_heads` may differ from `q_heads`).
    ///
    /// ```
    /// let args = liger_rs::RopeArgs::new(128).with_heads(32, 8);
    /// assert_eq!((args.q_heads, args.k_heads), (32, 8));
    /// ```
    pub fn with_heads(self, q_heads: usize, k_heads: usize) -> Self {
        RopeArgs {
            q_heads,
            k_heads,
            ..self
        }
    }

    /// Sets the rotary dim (partial rotary: only the first `rotary_dim` dims rotate).
    ///
    /// ```
    /// assert_eq!(liger_rs::RopeArgs::new(128).with_rotary_dim(32).rotary_dim, 32);
    /// ```
    pub fn with_rotary_dim(self, rotary_dim: usize) -> Self {
        RopeArgs { rotary_dim, ..self }
    }

    /// Interleaved pairs: pair `i` is `(x[2i], x[2i + 1])` (GPT-J, candle-nn's `rope_i`).
    ///
    /// ```
    /// assert!(liger_rs::RopeArgs::new(64).with_interleaved().interleaved);
    /// ```
    pub fn with_interleaved(self) -> Self {
        RopeArgs {
            interleaved: true,
            ..self
        }
    }

    /// Half-width cos/sin rows: `rotary_dim / 2` values, one per pair (candle-nn's `[S, d/2]`).
    ///
    /// ```
    /// let args = liger_rs::RopeArgs::new(64).with_half_tables();
    /// assert_eq!(args.table_row_len(), 32);
    /// ```
    pub fn with_half_tables(self) -> Self {
        RopeArgs {
            half_tables: true,
            ..self
        }
    }

    /// Head-major q and k: `[batch, heads, seq_len, head_dim]` (HF's layout after its
    /// `transpose(1, 2)`, candle-nn's `rope`).
    ///
    /// ```
    /// assert!(liger_rs::RopeArgs::new(64).with_head_major().head_major);
    /// ```
    pub fn with_head_major(self) -> Self {
        RopeArgs {
            head_major: true,
            ..self
        }
    }

    /// Token rows of q `q_stride` elements apart and of k `k_stride` apart (each at least its
    /// row, `heads × head_dim`; `[batch, seq_len]` token-major layouts only): q and k may then
    /// be views into a larger buffer, such as the fused QKV projection output
    /// `[batch, seq_len, (q_heads + 2·k_heads)·head_dim]` whose token rows hold q's heads,
    /// then k's, then v's ([`rope_forward_fused`](crate::rope_forward_fused) rotates both in
    /// place). A strided buffer must hold at least its span, `(batch·seq_len − 1)·stride +
    /// row` elements; the elements between its rows are neither read nor written.
    ///
    /// ```
    /// let (hq, hk, d) = (32, 8, 128);
    /// let fused = (hq + 2 * hk) * d; // elements per token of the QKV projection output
    /// let args = liger_rs::RopeArgs::new(d).with_heads(hq, hk).with_strides(fused, fused);
    /// assert_eq!((args.q_token_stride(), args.k_token_stride()), (fused, fused));
    /// assert_eq!(liger_rs::RopeArgs::new(d).with_heads(hq, hk).k_token_stride(), hk * d);
    /// ```
    pub fn with_strides(self, q_stride: usize, k_stride: usize) -> Self {
        RopeArgs {
            q_stride: Some(q_stride),
            k_stride: Some(k_stride),
            ..self
        }
    }

    /// Elements from one token's q row to the next: `q_stride`, or `q_heads × head_dim`
    /// (saturating).
    pub fn q_token_stride(&self) -> usize {
        self.q_stride
            .unwrap_or(self.q_heads.saturating_mul(self.head_dim))
    }

    /// Elements from one token's k row to the next: `k_stride`, or `k_heads × head_dim`
    /// (saturating).
    pub fn k_token_stride(&self) -> usize {
        self.k_stride
            .unwrap_or(self.k_heads.saturating_mul(self.head_dim))
    }

    /// Elements of a cos/sin row: `rotary_dim`, or `rotary_dim / 2` with `half_tables`.
    ///
    /// ```
    /// let args = liger_rs::RopeArgs::new(128).with_rotary_dim(64);
    /// assert_eq!((args.table_row_len(), args.with_half_tables().table_row_len()), (64, 32));
    /// ```
    pub fn table_row_len(&self) -> usize {
        if self.half_tables {
            self.rotary_dim / 2
        } else {
            self.rotary_dim
        }
    }

    /// What a cos/sin row's length is called in errors: `rotary_dim` or `rotary_dim / 2`.
    pub(crate) fn table_row_name(&self) -> &'static str {
        if self.half_tables {
            "rotary_dim / 2"
        } else {
            "rotary_dim"
        }
    }

    /// Whether the call takes the NeoX in-place kernels (scalar and vector) rather than the
    /// general ones: NeoX pairs, full-width rows, contiguous token-major q and k.
    pub(crate) fn neox_in_place(&self) -> bool {
        let contiguous = self.q_token_stride() == self.q_heads.saturating_mul(self.head_dim)
            && self.k_token_stride() == self.k_heads.saturating_mul(self.head_dim);
        !(self.interleaved || self.half_tables || self.head_major) && contiguous
    }

    /// Validates the shape of a call with k (`k_heads ≥ 1`) or on q alone (`k_heads = 0`);
    /// returns the sizes the launch needs (also used by the reference).
    pub(crate) fn check_heads(&self, with_k: bool) -> Result<RopeSizes> {
        let d = self.head_dim;
        if d == 0 || !d.is_multiple_of(2) {
            return Err(invalid("args.head_dim", "an even value ≥ 2", d));
        }
        let r = self.rotary_dim;
        if r == 0 || !r.is_multiple_of(2) || r > d {
            return Err(invalid(
                "args.rotary_dim",
                format!("an even value in 2 ..= head_dim = {d}"),
                r,
            ));
        }
        if self.q_heads == 0 {
            return Err(invalid("args.q_heads", "at least 1", 0));
        }
        if with_k && self.k_heads == 0 {
            return Err(invalid("args.k_heads", "at least 1", 0));
        }
        if !with_k && self.k_heads != 0 {
            return Err(invalid("args.k_heads", "0 (no k)", self.k_heads));
        }
        let half = r / 2;
        let pairs = self
            .q_heads
            .checked_add(self.k_heads)
            .and_then(|h| h.checked_mul(half))
            .filter(|&p| p < 1 << 31)
            .ok_or_else(|| {
                invalid(
                    "args",
                    "(q_heads + k_heads) × rotary_dim / 2 < 2^31",
                    format!("{} + {} heads, rotary_dim {r}", self.q_heads, self.k_heads),
                )
            })?;
        let overflow = || {
            invalid(
                "args",
                "batch × seq_len × heads × head_dim within usize",
                format!("{self:?}"),
            )
        };
        let tokens = self.batch.checked_mul(self.seq_len).ok_or_else(overflow)?;
        if self.head_major {
            for (arg, stride) in [
                ("args.q_stride", self.q_stride),
                ("args.k_stride", self.k_stride),
            ] {
                if let Some(stride) = stride {
                    return Err(invalid(arg, "None with head-major q and k", stride));
                }
            }
        }
        // Each buffer's token rows and their span (its length when contiguous).
        let rows = |heads: usize, stride: Option<usize>, arg: &'static str, what: &str| {
            let row = heads.checked_mul(d).ok_or_else(overflow)?;
            let stride = stride.unwrap_or(row);
            if stride < row {
                return Err(invalid(arg, format!("≥ {what} × head_dim = {row}"), stride));
            }
            let rows = Strided {
                rows: tokens,
                row,
                stride,
            };
            let span = match tokens {
                0 => Some(0),
                t => (t - 1).checked_mul(stride).and_then(|n| n.checked_add(row)),
            };
            let contiguous = tokens.checked_mul(row);
            match (span, contiguous) {
                (Some(span), Some(_)) => Ok((rows, span)),
                _ => Err(overflow()),
            }
        };
        let (q_rows, q_len) = rows(self.q_heads, self.q_stride, "args.q_stride", "q_heads")?;
        let (k_rows, k_len) = rows(self.k_heads, self.k_stride, "args.k_stride", "k_heads")?;
        Ok(RopeSizes {
            tokens,
            q_len,
            k_len,
            q_rows,
            k_rows,
            pairs,
        })
    }
}

/// Element counts derived from a checked [`RopeArgs`].
pub(crate) struct RopeSizes {
    /// `batch × seq_len`.
    pub(crate) tokens: usize,
    /// Elements q spans (its length when contiguous): `(tokens − 1)·q_stride + row`.
    pub(crate) q_len: usize,
    /// Elements k spans.
    pub(crate) k_len: usize,
    /// q's token rows (`q_heads × head_dim` elements each); `tokens × row` does not overflow.
    pub(crate) q_rows: Strided,
    /// k's token rows.
    pub(crate) k_rows: Strided,
    /// Rotated pairs per token, `(q_heads + k_heads) × rotary_dim / 2` (< 2^31).
    pub(crate) pairs: usize,
}

/// The names of a pass's q and k buffers, then of their outputs when they have their own.
/// The last is the one buffer of a fused call.
pub(crate) fn buffer_names(pass: Pass) -> [&'static str; 5] {
    match pass {
        Pass::Backward => ["dq", "dk", "dq_out", "dk_out", "dqkv"],
        _ => ["q", "k", "q_out", "k_out", "qkv"],
    }
}

impl RopeArgs {
    /// The buffers of a call, in the order of the out-of-place signatures: q, k, cos, sin,
    /// position ids, q_out, k_out (in place, q and k are read and written, and the outputs
    /// are left out); and the call's sizes. `with_k`: whether k is given (else `k_heads = 0`).
    pub(crate) fn table(
        &self,
        pass: Pass,
        rows: TableRows,
        out_of_place: bool,
        with_k: bool,
    ) -> Result<(RopeSizes, Table<7>)> {
        let [q_name, k_name, q_out_name, k_out_name, _] = buffer_names(pass);
        let sizes = self.check_heads(with_k)?;
        if out_of_place {
            // The general kernels index a token's items (pairs and copied tail dims) in 32 bits.
            (self.q_heads + self.k_heads)
                .checked_mul(self.head_dim)
                .filter(|&n| n < 1 << 31)
                .ok_or_else(|| {
                    invalid(
                        "args",
                        "(q_heads + k_heads) × head_dim < 2^31",
                        format!(
                            "{} + {} heads of {}",
                            self.q_heads, self.k_heads, self.head_dim
                        ),
                    )
                })?;
        }
        let q_all = Need::Exactly(
            sizes.tokens * sizes.q_rows.row,
            "batch × seq_len × q_heads × head_dim",
        );
        let k_all = Need::Exactly(
            sizes.tokens * sizes.k_rows.row,
            "batch × seq_len × k_heads × head_dim",
        );
        let q = match self.q_stride {
            Some(_) => Need::Strided(
                sizes.q_rows,
                "(batch × seq_len − 1) × q_stride + q_heads × head_dim",
            ),
            None => q_all,
        };
        let k = match self.k_stride {
            Some(_) => Need::Strided(
                sizes.k_rows,
                "(batch × seq_len − 1) × k_stride + k_heads × head_dim",
            ),
            None => k_all,
        };
        let (q, k) = match out_of_place {
            false => (Spec::in_place(q_name, q), Spec::in_place(k_name, k)),
            true => (Spec::read(q_name, q), Spec::read(k_name, k)),
        };
        let r = self.table_row_len();
        let half = self.half_tables;
        let cos = match rows {
            TableRows::PerPosition => {
                let need = self.seq_len.checked_mul(r).ok_or_else(|| {
                    let row = self.table_row_name();
                    invalid("cos", format!("seq_len × {row} within usize"), self.seq_len)
                })?;
                let what = match half {
                    false => "seq_len × rotary_dim",
                    true => "seq_len × rotary_dim / 2",
                };
                Need::Exactly(need, what)
            }
            TableRows::PerBatch => {
                let need = sizes.tokens.checked_mul(r).ok_or_else(|| {
                    let row = self.table_row_name();
                    let expected = format!("batch × seq_len × {row} within usize");
                    invalid("cos", expected, sizes.tokens)
                })?;
                let what = match half {
                    false => "batch × seq_len × rotary_dim",
                    true => "batch × seq_len × rotary_dim / 2",
                };
                Need::Exactly(need, what)
            }
            TableRows::Gathered | TableRows::MultimodalGathered(_) => {
                if let TableRows::MultimodalGathered(sections) = rows {
                    check_sections(sections, self.rotary_dim)?;
                }
                Need::Rows(
                    r,
                    match half {
                        false => "max_pos ≥ 1 rows of rotary_dim",
                        true => "max_pos ≥ 1 rows of rotary_dim / 2",
                    },
                )
            }
            TableRows::Multimodal(sections) => {
                check_sections(sections, self.rotary_dim)?;
                let need = sizes.tokens.checked_mul(3 * r).ok_or_else(|| {
                    let row = self.table_row_name();
                    let expected = format!("3 × batch × seq_len × {row} within usize");
                    invalid("cos", expected, sizes.tokens)
                })?;
                let what = match half {
                    false => "3 × batch × seq_len × rotary_dim",
                    true => "3 × batch × seq_len × rotary_dim / 2",
                };
                Need::Exactly(need, what)
            }
        };
        // Multimodal ids have three rows (t, h, w) of a token each (saturating: no buffer
        // holds usize::MAX ids, so an overflow is a wrong length).
        let ids = match rows {
            TableRows::MultimodalGathered(_) => {
                Need::Exactly(sizes.tokens.saturating_mul(3), "3 × batch × seq_len")
            }
            _ => Need::Exactly(sizes.tokens, "batch × seq_len"),
        };
        let specs = [
            q,
            k,
            Spec::read("cos", cos),
            Spec::read("sin", Need::LengthOf(2)),
            Spec::read("position_ids", ids),
            // Outputs are contiguous whatever the inputs' strides.
            Spec::written(q_out_name, q_all),
            Spec::written(k_out_name, k_all),
        ];
        let empty = sizes.tokens == 0;
        Ok((sizes, Table { specs, empty }))
    }
}

impl RopeArgs {
    /// TableRows of a checked cos/sin table of `cos_len` elements.
    pub(crate) fn table_rows(&self, rows: TableRows, sizes: &RopeSizes, cos_len: usize) -> usize {
        match rows {
            TableRows::PerPosition => self.seq_len,
            TableRows::PerBatch | TableRows::Multimodal(_) => sizes.tokens,
            TableRows::Gathered | TableRows::MultimodalGathered(_) => {
                cos_len / self.table_row_len()
            }
        }
    }
}

/// Multimodal sections must split the `rotary_dim / 2` pairs.
pub(crate) fn check_sections(sections: [usize; 3], rotary_dim: usize) -> Result<()> {
    let sum = sections.iter().try_fold(0usize, |a, &s| a.checked_add(s));
    if sum != Some(rotary_dim / 2) {
        return Err(invalid(
            "layout.sections",
            format!("three sizes summing to rotary_dim / 2 = {}", rotary_dim / 2),
            format!("{sections:?}"),
        ));
    }
    Ok(())
}

/// Host ids must each name a row of the `rows`-row cos/sin table.
pub(crate) fn check_host_ids(ids: &[i64], rows: usize) -> Result<()> {
    match ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id < 0 || id as u64 >= rows as u64)
    {
        Some((i, &id)) => Err(invalid(
            "position_ids",
            format!("ids in 0 ..= {} (rows of the cos/sin table)", rows - 1),
            format!("position_ids[{i}] = {id}"),
        )),
        None => Ok(()),
    }
}

/// Where k's span ends in a fused buffer (`k_offset` plus k's span), or an error naming
/// `k_offset` where that overflows `usize`; shared so the launcher and the CPU reference agree.
pub(crate) fn fused_k_end(sizes: &RopeSizes, k_offset: usize) -> Result<usize> {
    k_offset.checked_add(sizes.k_len).ok_or_else(|| {
        invalid(
            "k_offset",
            "k_offset + the span of k within usize",
            k_offset,
        )
    })
}

/// The buffer of a fused call: it must hold q's span from its start and k's from `k_offset`.
pub(crate) fn fused_spec(sizes: &RopeSizes, k_offset: usize, pass: Pass) -> Result<Spec> {
    let k_end = fused_k_end(sizes, k_offset)?;
    let need = match k_end > sizes.q_len {
        true => Need::AtLeast(k_end, "k_offset + the span of k"),
        false => Need::AtLeast(sizes.q_len, "the span of q"),
    };
    Ok(Spec::in_place(buffer_names(pass)[4], need))
}

/// q's rows from element 0 and k's from `k_offset` must share no element ([`overlaps`]).
pub(crate) fn check_fused_disjoint(sizes: &RopeSizes, k_offset: usize, pass: Pass) -> Result<()> {
    let overlap = overlaps(
        (0, sizes.q_len as u64, Some(sizes.q_rows)),
        (k_offset as u64, sizes.k_len as u64, Some(sizes.k_rows)),
    );
    let [output, other, ..] = buffer_names(pass);
    match overlap {
        true => Err(crate::Error::Aliasing { output, other }),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn strided_rows_span_from_the_first_row_to_the_last() {
        let a = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_strides(64, 64);
        let sizes = a.check_heads(true).unwrap();
        assert_eq!((sizes.q_len, sizes.k_len), (5 * 64 + 32, 5 * 64 + 16));
        assert_eq!((sizes.q_rows.row, sizes.k_rows.stride), (32, 64));
        let bad = |a: RopeArgs| match a.check_heads(true) {
            Err(crate::Error::InvalidArgument { arg, expected, .. }) => (arg, expected),
            other => panic!("{a:?}: {:?}", other.map(|s| s.tokens)),
        };
        assert_eq!(
            bad(a.with_strides(31, 64)),
            ("args.q_stride", "≥ q_heads × head_dim = 32".into())
        );
        assert_eq!(
            bad(a.with_strides(32, 15)),
            ("args.k_stride", "≥ k_heads × head_dim = 16".into())
        );
        assert_eq!(
            bad(a.with_head_major()),
            ("args.q_stride", "None with head-major q and k".into())
        );
        assert_eq!(bad(a.with_strides(usize::MAX, 64)).0, "args");
        // No tokens span nothing, whatever the stride.
        let empty = a.with_batch(0).check_heads(true).unwrap();
        assert_eq!((empty.q_len, empty.k_len), (0, 0));
    }

    #[test]
    pub(crate) fn fused_q_and_k_are_checked_row_by_row() {
        // [6 tokens, q 32 | k 16 | v 16]: k at 32 is disjoint, at 31 it overlaps q's last
        // column, at 48 (v's columns) it is disjoint again, at 64 − 16 + 1 it wraps onto the
        // next token's q.
        let a = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_strides(64, 64);
        let sizes = a.check_heads(true).unwrap();
        let fwd = Pass::Forward;
        let aliasing = Err(crate::Error::Aliasing {
            output: "q",
            other: "k",
        });
        assert_eq!(check_fused_disjoint(&sizes, 32, fwd), Ok(()));
        assert_eq!(check_fused_disjoint(&sizes, 31, fwd), aliasing);
        assert_eq!(check_fused_disjoint(&sizes, 48, fwd), Ok(()));
        assert_eq!(check_fused_disjoint(&sizes, 49, fwd), aliasing);
        assert_eq!(check_fused_disjoint(&sizes, 0, fwd), aliasing);
        let named = Err(crate::Error::Aliasing {
            output: "dq",
            other: "dk",
        });
        assert_eq!(check_fused_disjoint(&sizes, 31, Pass::Backward), named);
        // Different strides: the spans must not overlap (k after all of q here).
        let b = a.with_strides(64, 16);
        let sizes = b.check_heads(true).unwrap();
        assert_eq!(check_fused_disjoint(&sizes, 32, fwd), aliasing);
        assert_eq!(check_fused_disjoint(&sizes, sizes.q_len, fwd), Ok(()));
        // The buffer must hold q's span, and k's from k_offset.
        let sizes = a.check_heads(true).unwrap();
        let spec = fused_spec(&sizes, 32, fwd).unwrap();
        assert_eq!(
            spec.need,
            Need::AtLeast(32 + 5 * 64 + 16, "k_offset + the span of k")
        );
        assert_eq!(spec.name, "qkv");
        let spec = fused_spec(&sizes, 0, Pass::Backward).unwrap();
        assert_eq!(spec.need, Need::AtLeast(5 * 64 + 32, "the span of q"));
        assert_eq!(spec.name, "dqkv");
        assert!(fused_spec(&sizes, usize::MAX, fwd).is_err());
    }

    #[test]
    pub(crate) fn multimodal_sections_split_the_pairs() {
        assert!(check_sections([16, 24, 24], 128).is_ok());
        assert!(check_sections([0, 0, 4], 8).is_ok());
        for bad in [[16, 24, 23], [16, 24, 25], [usize::MAX, 2, 0]] {
            let err = check_sections(bad, 128).unwrap_err().to_string();
            assert!(err.contains("summing to rotary_dim / 2 = 64"), "{err}");
        }
        let a = RopeArgs::new(8).with_batch(2).with_seq_len(3);
        let (_, table) = a
            .table(Pass::Forward, TableRows::Multimodal([1, 2, 1]), false, true)
            .unwrap();
        assert_eq!(
            table.specs[2].need,
            Need::Exactly(3 * 6 * 8, "3 × batch × seq_len × rotary_dim")
        );
        let bad = a.table(Pass::Forward, TableRows::Multimodal([1, 2, 2]), false, true);
        assert!(bad.is_err());
        // One gathered table, [3, B, S] ids: three ids a token.
        let gathered = TableRows::MultimodalGathered([1, 2, 1]);
        let (_, table) = a.table(Pass::Forward, gathered, false, true).unwrap();
        assert_eq!(
            table.specs[2].need,
            Need::Rows(8, "max_pos ≥ 1 rows of rotary_dim")
        );
        assert_eq!(
            table.specs[4].need,
            Need::Exactly(18, "3 × batch × seq_len")
        );
        assert_eq!(a.table_rows(gathered, &a.check_heads(true).unwrap(), 40), 5);
        let bad = TableRows::MultimodalGathered([1, 2, 2]);
        assert!(a.table(Pass::Forward, bad, false, true).is_err());
    }

    #[test]
    pub(crate) fn q_alone_needs_zero_k_heads() {
        let q_only = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 0);
        let sizes = q_only.check_heads(false).unwrap();
        assert_eq!((sizes.q_len, sizes.k_len, sizes.pairs), (192, 0, 16));
        assert!(q_only.check_heads(true).is_err());
        assert!(
            RopeArgs::new(8)
                .with_batch(2)
                .with_seq_len(3)
                .with_heads(4, 1)
                .check_heads(false)
                .is_err()
        );
    }

    #[test]
    pub(crate) fn args_are_checked_without_overflow() {
        let ok = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 1)
            .check_heads(true)
            .unwrap();
        assert_eq!((ok.tokens, ok.q_len, ok.k_len, ok.pairs), (6, 192, 48, 20));
        let bad = |a: RopeArgs| match a.check_heads(true) {
            Err(crate::Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("{a:?}: {:?}", other.map(|s| s.tokens)),
        };
        assert_eq!(bad(RopeArgs::new(7)), "args.head_dim");
        assert_eq!(bad(RopeArgs::new(0)), "args.head_dim");
        let a = RopeArgs::new(8);
        assert_eq!(bad(a.with_rotary_dim(3)), "args.rotary_dim");
        assert_eq!(bad(a.with_rotary_dim(0)), "args.rotary_dim");
        assert_eq!(bad(a.with_rotary_dim(10)), "args.rotary_dim");
        assert_eq!(bad(RopeArgs::new(8).with_heads(0, 1)), "args.q_heads");
        assert_eq!(bad(RopeArgs::new(8).with_heads(1, 0)), "args.k_heads");
        assert_eq!(
            bad(RopeArgs::new(8).with_batch(usize::MAX).with_seq_len(2)),
            "args"
        );
        assert_eq!(bad(RopeArgs::new(8).with_heads(usize::MAX, 1)), "args");
        assert_eq!(bad(RopeArgs::new(4).with_heads(1 << 30, 1 << 30)), "args");
    }
}
