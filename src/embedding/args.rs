//! The embedding's public arguments and their checks, shared by the GPU launchers and the CPU
//! reference.
use crate::error::{Result, invalid};
use crate::validate::{Need, Spec, Strided, Table, span};

/// The shape of one embedding call: `tokens` ids into a table of `vocab` rows of `hidden`
/// elements (`torch.nn.functional.embedding` without `padding_idx`, `max_norm` or
/// `sparse`). Rows may be strided: `table_stride` elements from one table row to the next,
/// `rows_stride` from one gathered row (or its gradient) to the next; both default to
/// `hidden`.
///
/// ```
/// use liger_rs::EmbeddingArgs;
/// let a = EmbeddingArgs::new(8192, 32000, 2048).with_strides(2048, 4096);
/// assert_eq!((a.tokens, a.vocab, a.hidden, a.table_stride, a.rows_stride), (8192, 32000, 2048, 2048, 4096));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EmbeddingArgs {
    /// Token ids (rows gathered).
    pub tokens: usize,
    /// Rows of the table (≥ 1).
    pub vocab: usize,
    /// Elements of a row (≥ 1).
    pub hidden: usize,
    /// Elements from one table row to the next (≥ `hidden`).
    pub table_stride: usize,
    /// Elements from one gathered row to the next (≥ `hidden`).
    pub rows_stride: usize,
}

impl EmbeddingArgs {
    /// Contiguous rows.
    pub fn new(tokens: usize, vocab: usize, hidden: usize) -> Self {
        EmbeddingArgs {
            tokens,
            vocab,
            hidden,
            table_stride: hidden,
            rows_stride: hidden,
        }
    }

    /// Sets the row strides of the table (and its gradient) and of the gathered rows (and
    /// theirs), in elements.
    pub fn with_strides(mut self, table_stride: usize, rows_stride: usize) -> Self {
        (self.table_stride, self.rows_stride) = (table_stride, rows_stride);
        self
    }

    /// Checks the scalars (every launcher, the reference and candle's CPU path).
    pub(crate) fn check(&self) -> Result<()> {
        if self.vocab == 0 {
            return Err(invalid("args.vocab", "at least 1 row", self.vocab));
        }
        if self.hidden == 0 {
            return Err(invalid("args.hidden", "at least 1 element", self.hidden));
        }
        span(
            "args.table_stride",
            self.vocab,
            self.hidden,
            self.table_stride,
        )?;
        span(
            "args.rows_stride",
            self.tokens,
            self.hidden,
            self.rows_stride,
        )?;
        Ok(())
    }

    fn strided(rows: usize, row: usize, stride: usize) -> Need {
        Need::Strided(Strided { rows, row, stride }, "rows × row stride")
    }

    /// The buffers of a call in the public functions' order: the table (or its gradient),
    /// the ids, the gathered rows (or their gradient). The forward reads the table and
    /// writes the rows, the backward reads the rows and writes the table's gradient.
    pub(crate) fn table(&self, backward: bool) -> Result<Table<3>> {
        self.check()?;
        let table = Self::strided(self.vocab, self.hidden, self.table_stride);
        let rows = Self::strided(self.tokens, self.hidden, self.rows_stride);
        let ids = Need::Exactly(self.tokens, "tokens");
        Ok(Table {
            specs: if backward {
                [
                    Spec::written("grad_table", table),
                    Spec::read("ids", ids),
                    Spec::read("grad_rows", rows),
                ]
            } else {
                [
                    Spec::read("table", table),
                    Spec::read("ids", ids),
                    Spec::written("rows", rows),
                ]
            },
            // The backward writes every row of the table's gradient, zero without tokens.
            empty: !backward && self.tokens == 0,
        })
    }
}
