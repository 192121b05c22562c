//! Where a RoPE call's cos/sin rows come from ([`CosSinLayout`], [`PositionIds`]) and what the
//! kernels and checks read of it.
use crate::identity::Rows as Source;
use crate::validate::{Access, Buf};
use cudarc::driver::CudaView;

/// Where each token's cos/sin row comes from. Every row is [`RopeArgs::table_row_len`](super::RopeArgs::table_row_len)
/// elements of the table dtype (q's, or f32 with 16-bit q and k: [`crate::CosSinDtype`];
/// `rotary_dim`, or `rotary_dim / 2` with half tables; written `r` below); token `(b, s)` is element `b·seq_len + s` of the flattened `[B, S]`.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, PositionIds};
/// // Packed sequences of lengths 3 and 2 in one row of the batch: positions restart.
/// let ids: [i64; 5] = [0, 1, 2, 0, 1];
/// let layout = CosSinLayout::Gathered(PositionIds::Host(&ids));
/// # let _ = layout;
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum CosSinLayout<'a> {
    /// cos, sin: `[seq_len, r]`, shared by every batch row (token `(b, s)` uses row `s`).
    PerPosition,
    /// cos, sin: `[batch, seq_len, r]` (what HF's `LlamaRotaryEmbedding` returns).
    PerBatch,
    /// cos, sin: a table `[max_pos, r]` (`max_pos = cos.len() / r ≥ 1`), token `(b, s)` uses
    /// row `position_ids[b·seq_len + s]`.
    Gathered(PositionIds<'a>),
    /// Qwen2-VL's multimodal RoPE (`mrope_section`): cos, sin `[3, batch, seq_len, r]`, the
    /// temporal, height and width tables one after another (what Qwen2-VL's rotary embedding
    /// computes from its `[3, batch, seq_len]` position ids). Pair `i < rotary_dim / 2` of
    /// token `(b, s)` reads table 0 for `i < sections[0]`, table 1 for `i < sections[0] +
    /// sections[1]`, else table 2, at row `b·seq_len + s` (entry `i`, `2i` interleaved, as
    /// for the other layouts). This is HuggingFace's `apply_multimodal_rotary_pos_emb`:
    /// splitting `cos` by `mrope_section * 2` and taking chunk `j` from table `j mod 3` gives
    /// dim `i` and dim `i + rotary_dim / 2` the same table. The sections must sum to
    /// `rotary_dim / 2`; each may be 0. In place on contiguous NeoX halves with full-width
    /// rows, the vector kernels take it where every section starts at a whole 16-byte vector
    /// of pairs (8 pairs in 16-bit types, 4 in f32; Qwen2-VL's `[16, 24, 24]` does), else the
    /// general kernels.
    Multimodal {
        /// Pairs taken from the t, h and w tables, in that order (`mrope_section`).
        sections: [usize; 3],
    },
    /// Qwen2-VL's multimodal RoPE straight from its `[3, batch, seq_len]` position ids
    /// (temporal, height, width rows), without the `[3, batch, seq_len, r]` tables: cos, sin
    /// are one table `[max_pos, r]` (`max_pos = cos.len() / r ≥ 1`, rows as HF's
    /// `cat(freqs, freqs)` for position `p`), and pair `i` of token `(b, s)` reads row
    /// `position_ids[k·batch·seq_len + b·seq_len + s]` with `k` = 0, 1 or 2 by `sections` as
    /// in [`CosSinLayout::Multimodal`], which this equals when that layout's tables hold
    /// these rows. Ids are checked (host) or clamped (device) as for
    /// [`CosSinLayout::Gathered`]; device ids must be `3 × batch × seq_len` long. Kernels as
    /// for [`CosSinLayout::Multimodal`].
    MultimodalGathered {
        /// Pairs read through the t, h and w ids, in that order (`mrope_section`).
        sections: [usize; 3],
        /// The ids `[3, batch, seq_len]`.
        position_ids: PositionIds<'a>,
    },
}

/// Position ids `[batch, seq_len]` into a cos/sin table ([`CosSinLayout::Gathered`]).
///
/// ```no_run
/// use liger_rs::{CosSinLayout, PositionIds};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// // Two packed sequences of 3 and 2 tokens in one row: positions restart at 0.
/// let host = [0i64, 1, 2, 0, 1];
/// let on_host = CosSinLayout::Gathered(PositionIds::Host(&host));
/// let ids = stream.clone_htod(&[0i32, 1, 2, 0, 1])?;
/// let on_device = CosSinLayout::Gathered(PositionIds::DeviceI32(ids.as_view()));
/// # let _ = (on_host, on_device);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum PositionIds<'a> {
    /// Ids in host memory: each must lie in `0 .. max_pos`, or the call returns an
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for `position_ids` naming the
    /// first bad index. The call then uploads them: one stream-ordered allocation of
    /// `batch × seq_len` i64 and a copy from pageable memory, which the driver performs
    /// synchronously with respect to the host (it waits for the stream's earlier work). Keep
    /// ids on the device in hot loops.
    Host(&'a [i64]),
    /// i32 ids on the device. They cannot be checked without a synchronisation, so the kernel
    /// clamps each id into `[0, max_pos)` (negative → row 0, too large → the last row): a bad
    /// id gives a wrong rotation, never an out-of-bounds read.
    DeviceI32(CudaView<'a, i32>),
    /// i64 ids on the device, clamped as [`PositionIds::DeviceI32`].
    DeviceI64(CudaView<'a, i64>),
}

/// Where a call's cos/sin rows come from, without the ids ([`CosSinLayout`]'s variants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TableRows {
    PerPosition,
    PerBatch,
    Gathered,
    /// The sections of the t, h and w tables.
    Multimodal([usize; 3]),
    /// The sections of the t, h and w rows of the ids into one table.
    MultimodalGathered([usize; 3]),
}

impl CosSinLayout<'_> {
    pub(crate) fn rows(&self) -> TableRows {
        match self {
            CosSinLayout::PerPosition => TableRows::PerPosition,
            CosSinLayout::PerBatch => TableRows::PerBatch,
            CosSinLayout::Gathered(_) => TableRows::Gathered,
            CosSinLayout::Multimodal { sections } => TableRows::Multimodal(*sections),
            CosSinLayout::MultimodalGathered { sections, .. } => {
                TableRows::MultimodalGathered(*sections)
            }
        }
    }

    /// The position ids, if the layout has them.
    pub(crate) fn position_ids(&self) -> Option<&PositionIds<'_>> {
        match self {
            CosSinLayout::Gathered(ids)
            | CosSinLayout::MultimodalGathered {
                position_ids: ids, ..
            } => Some(ids),
            _ => None,
        }
    }

    /// The position ids as a buffer of the call (in host memory: a length only).
    pub(crate) fn ids<T>(&self) -> Option<Buf<'_, T>> {
        match self.position_ids()? {
            PositionIds::Host(h) => Some(Buf::Host(h.len())),
            PositionIds::DeviceI32(v) => Some(Buf::I32(Access::Read(v))),
            PositionIds::DeviceI64(v) => Some(Buf::I64(Access::Read(v))),
        }
    }

    /// The kernels' identity of the rows' source (host ids are uploaded as i64).
    pub(crate) fn source(&self) -> Source {
        match self {
            CosSinLayout::PerPosition => Source::PerPosition,
            CosSinLayout::PerBatch => Source::PerBatch,
            CosSinLayout::Gathered(PositionIds::DeviceI32(_)) => Source::IdsI32,
            CosSinLayout::Gathered(_) => Source::IdsI64,
            CosSinLayout::Multimodal { .. } => Source::Multimodal,
            CosSinLayout::MultimodalGathered {
                position_ids: PositionIds::DeviceI32(_),
                ..
            } => Source::MultimodalIdsI32,
            CosSinLayout::MultimodalGathered { .. } => Source::MultimodalIdsI64,
        }
    }
}
