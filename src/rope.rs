//! RoPE forward and backward launchers (kernels: `kernels-gpu/src/rope.rs`, reference:
//! [`crate::reference::rope`], semantics in its docs).
use crate::dtype::Dtype;
use crate::error::{Result, invalid};
pub(crate) use crate::identity::Direction;
use crate::identity::rope::{form, vec_heads};
use crate::identity::{Kernel, RopePath, Rows as Source};
use crate::launch::item_grid;
use crate::module::kernels;
use crate::validate::{Access, Buf, Need, Spec, Strided, Table, overlaps, read, validate, write};
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Threads per block of the scalar kernels: one block covers `BLOCK_THREADS / pairs` tokens when a token has fewer
/// pairs than this, else one token in `⌈pairs / BLOCK_THREADS⌉` passes.
const BLOCK_THREADS: usize = 256;

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
    fn neox_in_place(&self) -> bool {
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

/// Where each token's cos/sin row comes from. Every row is [`RopeArgs::table_row_len`]
/// elements of the tensor dtype (`rotary_dim`, or `rotary_dim / 2` with half tables; written
/// `r` below); token `(b, s)` is element `b·seq_len + s` of the flattened `[B, S]`.
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

/// RoPE forward (rotation by θ), in place on `q` and `k`, in one launch.
///
/// For every head of q and k and every pair `i < r/2` (`r = args.rotary_dim`), with
/// `(x1, x2)` the pair's two dims (`x[i]`, `x[i + r/2]`, or `x[2i]`, `x[2i + 1]` interleaved)
/// and `c`, `s` its entries of the token's cos/sin rows ([`RopeArgs`]): `x1 ← x1·c − x2·s`,
/// `x2 ← x2·c + x1·s`, computed in f32 (each product rounded to f32, no FMA) and rounded once
/// to `T`. Dims `r..head_dim` are not written.
///
/// `q` must hold exactly `batch × seq_len × q_heads × head_dim` elements and `k`
/// `batch × seq_len × k_heads × head_dim` (layouts: [`RopeArgs`]), or with token strides
/// ([`RopeArgs::with_strides`]) at least their span, `(batch × seq_len − 1) × stride + row`;
/// `cos`/`sin` are laid out as `layout` says (their lengths must match it exactly; `sin` like
/// `cos`). `q` and `k` must not overlap each other (strided rows of the same stride: compared
/// row by row), `cos`, `sin` or device position ids. One launch on `stream`, no
/// synchronisation, no allocation (except for [`PositionIds::Host`]). Token-major calls take
/// 16-byte vector kernels (either pair layout, any table width, token strides and row source;
/// multimodal tables with contiguous NeoX halves and full-width rows) where pointers, head and
/// rotary widths, strides and multimodal sections are whole vectors; head-major and the other
/// calls take the general kernels (one element pair per thread, every form).
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (b, s, hq, hk, d) = (2, 16, 8, 2, 128);
/// // cos/sin [s, d] for positions 0..s, as HF builds them: cat(freqs, freqs).
/// let (mut cos, mut sin) = (Vec::new(), Vec::new());
/// for p in 0..s {
///     for i in 0..d {
///         let theta = p as f64 * 10000f64.powf(-2.0 * (i % (d / 2)) as f64 / d as f64);
///         cos.push(bf16::from_f64(theta.cos()));
///         sin.push(bf16::from_f64(theta.sin()));
///     }
/// }
/// let (cos, sin) = (stream.clone_htod(&cos)?, stream.clone_htod(&sin)?);
/// let mut q = stream.clone_htod(&vec![bf16::ONE; b * s * hq * d])?;
/// let mut k = stream.clone_htod(&vec![bf16::ONE; b * s * hk * d])?;
/// let args = RopeArgs::new(d).with_batch(b).with_seq_len(s).with_heads(hq, hk);
/// rope_forward(&stream, &args, &mut q, &mut k, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `q` and `k` are overwritten in place: dims `0..rotary_dim` of every head; dims past `rotary_dim`
/// are not written.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.head_dim` is 0 or odd,
///   `args.rotary_dim` is 0, odd or above `head_dim`, `args.q_heads` or `args.k_heads` is 0,
///   (q_heads + k_heads) × rotary_dim / 2 reaches 2³¹ or a length overflows `usize`;
///   `args.q_stride` or `args.k_stride` is below its row or set with `head_major`; `q` or `k` is
///   not exactly its shape's length (strided: shorter than its span); multimodal `sections` do
///   not sum to `rotary_dim / 2`; `cos` does not have the length `layout` needs (`sin` must
///   match it), device position ids are not `batch × seq_len` long, or a host position id lies
///   outside the table. Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `q`, `k`, `cos`, `sin` or device position
///   ids belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `q` or `k` overlaps the other, `cos`, `sin` or
///   device position ids.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there), uploading host position ids (a stream-ordered
///   allocation and a copy), or the launch, which also fails once an earlier kernel has faulted in
///   the context.
pub fn rope_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    q: &mut impl DevicePtrMut<T>,
    k: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(q), write(k), None, None];
    rope_call(stream, args, Direction::Forward, io, cos, sin, layout)
}

/// RoPE backward (rotation by −θ), in place on the gradients `dq` and `dk`, in one launch.
///
/// With `(dy1, dy2)` a pair of the gradient: `dy1 ← dy1·c + dy2·s`, `dy2 ← dy2·c − dy1·s`,
/// f32 math and one rounding to `T`. `dq`/`dk` have the
/// shapes of `q`/`k`; `cos`, `sin` and `layout` are those of the forward. Otherwise as
/// [`rope_forward`].
///
/// ```no_run
/// use liger_rs::{CosSinLayout, PositionIds, RopeArgs, rope_backward};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (b, s, hq, hk, d, max_pos) = (1, 4, 4, 1, 64, 4096);
/// // Partial rotary: the first 32 dims rotate; cos/sin rows are 32 long.
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_rotary_dim(32);
/// let cos = stream.clone_htod(&vec![1.0f32; max_pos * 32])?;
/// let sin = stream.alloc_zeros::<f32>(max_pos * 32)?;
/// let ids = stream.clone_htod(&[0i32, 1, 0, 1])?; // device ids: clamped by the kernel
/// let layout = CosSinLayout::Gathered(PositionIds::DeviceI32(ids.as_view()));
/// let mut dq = stream.clone_htod(&vec![1.0f32; b * s * hq * d])?;
/// let mut dk = stream.clone_htod(&vec![1.0f32; b * s * hk * d])?;
/// rope_backward(&stream, &args, &mut dq, &mut dk, &cos, &sin, &layout)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `dq` and `dk` are overwritten in place: dims `0..rotary_dim` of every head; dims past
/// `rotary_dim` are not written.
///
/// # Errors
///
/// As [`rope_forward`]'s, with `dq` and `dk` in place of `q` and `k` (the names the errors
/// give).
pub fn rope_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(dq), write(dk), None, None];
    rope_call(stream, args, Direction::Backward, io, cos, sin, layout)
}

/// RoPE forward in place on q and k that lie in one buffer `qkv`: q's token rows start at
/// element 0, `args.q_token_stride()` elements apart, and k's at element `k_offset`,
/// `args.k_token_stride()` apart ([`RopeArgs::with_strides`]), e.g. the fused QKV projection
/// output `[batch, seq_len, (q_heads + 2·k_heads)·head_dim]` with both strides
/// `(q_heads + 2·k_heads)·head_dim` and `k_offset = q_heads·head_dim`: q and k rotate in
/// place, v and every other element of `qkv` are neither read nor written. The rotation,
/// `cos`, `sin` and `layout` are those of [`rope_forward`], and so are the kernels: vector
/// kernels where both strides, `k_offset` and the widths are whole 16-byte vectors (as for a
/// fused QKV buffer of bf16 heads of 128 and a 16-byte aligned start).
///
/// `qkv` must hold q's span from its start and k's from `k_offset`; q's and k's rows must
/// share no element. With equal strides this is checked row by row (disjoint column ranges
/// of the same token rows, as in a fused QKV buffer, pass); with different strides the two
/// spans must not overlap.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward_fused};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (b, s, hq, hk, d) = (2, 16, 8, 2, 64);
/// let fused = (hq + 2 * hk) * d;
/// // The QKV projection output [b, s, (hq + 2·hk)·d]: per token q's heads, k's, v's.
/// let mut qkv = stream.clone_htod(&vec![1.0f32; b * s * fused])?;
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_strides(fused, fused);
/// rope_forward_fused(&stream, &args, &mut qkv, hq * d, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// The rows of q and k in `qkv` are overwritten in place: dims `0..rotary_dim` of every head;
/// nothing else in `qkv` is written.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): as [`rope_forward`]'s for
///   `args`, `cos`, `sin` and the position ids; `args.q_stride` or `args.k_stride` below its
///   row (`heads × head_dim`) or set with `head_major`; `qkv` shorter than q's span or than
///   `k_offset` plus k's span (named `qkv`); `k_offset` plus k's span overflows `usize`.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `qkv`, `cos`, `sin` or device
///   position ids belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `qkv`'s span overlaps `cos`, `sin` or
///   device position ids (output `qkv`), or q's rows overlap k's (output `q`, other `k`).
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): as [`rope_forward`].
pub fn rope_forward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    qkv: &mut impl DevicePtrMut<T>,
    k_offset: usize,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(qkv), None, None, None];
    let fused = Some(k_offset);
    rope_call_in(
        stream,
        args,
        Direction::Forward,
        io,
        fused,
        cos,
        sin,
        layout,
    )
}

/// RoPE backward (rotation by −θ) in place on dq and dk that lie in one buffer `dqkv`, as
/// [`rope_forward_fused`] lays out q and k (the gradient of the fused QKV projection output:
/// dv's columns are neither read nor written). The rotation is [`rope_backward`]'s; errors
/// as [`rope_forward_fused`], with `dqkv`, `dq` and `dk` for `qkv`, `q` and `k`.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_backward_fused};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (s, hq, hk, d) = (16, 4, 4, 64);
/// let fused = (hq + 2 * hk) * d;
/// let mut dqkv = stream.clone_htod(&vec![1.0f32; s * fused])?;
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let args = RopeArgs::new(d).with_seq_len(s).with_heads(hq, hk).with_strides(fused, fused);
/// rope_backward_fused(&stream, &args, &mut dqkv, hq * d, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_backward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dqkv: &mut impl DevicePtrMut<T>,
    k_offset: usize,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let io = [write(dqkv), None, None, None];
    let fused = Some(k_offset);
    rope_call_in(
        stream,
        args,
        Direction::Backward,
        io,
        fused,
        cos,
        sin,
        layout,
    )
}

/// The names of a direction's q and k buffers, then of their outputs when they have their own.
/// The last is the one buffer of a fused call.
fn buffer_names(direction: Direction) -> [&'static str; 5] {
    match direction {
        Direction::Backward => ["dq", "dk", "dq_out", "dk_out", "dqkv"],
        _ => ["q", "k", "q_out", "k_out", "qkv"],
    }
}

/// `(tx, ty)`: threads per token and tokens per block (see `BLOCK_THREADS`).
fn block_shape(pairs: usize) -> (u32, u32) {
    if pairs <= BLOCK_THREADS {
        (pairs as u32, (BLOCK_THREADS / pairs) as u32)
    } else {
        let passes = pairs.div_ceil(BLOCK_THREADS);
        (pairs.div_ceil(passes).next_multiple_of(32) as u32, 1)
    }
}

/// The path of a call of elements of `elem_bytes` with cos/sin rows from `rows`: the general
/// kernels (`rope_{dir}_g_*`) out of place (`out_of_place`) or head-major; else the vector
/// kernels where they apply (`rope_{dir}_v_*` for contiguous NeoX halves with full-width rows
/// and no multimodal tables, `_va_` for other NeoX calls, `_vi_` for interleaved pairs;
/// multimodal tables only with contiguous NeoX halves and full-width rows); else the scalar
/// kernels for contiguous NeoX calls without multimodal tables, and the general kernels for
/// the rest.
///
/// The vector kernels need 16-byte aligned `q`, `k`, `cos`, `sin` (`ptrs`); `head_dim`,
/// `half = rotary_dim / 2`, both token strides and both multimodal section starts multiples of
/// the lanes per vector (so each half of each head, each cos/sin row and each section is whole
/// aligned vectors; the dims past `rotary_dim` are then never touched, as in the scalar
/// kernels); at most `BLOCK_THREADS` vectors per half (one thread each); and a token's
/// `(q_heads + k_heads) × head_dim` below 2^31 (32-bit offsets within a token).
fn path(
    args: &RopeArgs,
    out_of_place: bool,
    rows: TableRows,
    elem_bytes: usize,
    ptrs: [u64; 4],
) -> RopePath {
    if out_of_place || args.head_major {
        return RopePath::General;
    }
    let lanes = 16 / elem_bytes;
    let half = args.rotary_dim / 2;
    let token_elems = (args.q_heads.checked_add(args.k_heads))
        .and_then(|h| h.checked_mul(args.head_dim))
        .unwrap_or(usize::MAX);
    let (starts, multimodal) = match rows {
        TableRows::Multimodal([t, h, _]) | TableRows::MultimodalGathered([t, h, _]) => {
            ([t, t + h], true)
        }
        _ => ([0, 0], false),
    };
    let whole = [
        args.head_dim,
        half,
        args.q_token_stride(),
        args.k_token_stride(),
        starts[0],
        starts[1],
    ];
    // Multimodal tables on the vector kernels: contiguous NeoX halves with full-width rows
    // (Qwen2-VL's case), the combination the GPU tests run there.
    let vector = ptrs.iter().all(|p| p.is_multiple_of(16))
        && (!multimodal || args.neox_in_place())
        && whole.iter().all(|n| n.is_multiple_of(lanes))
        && half / lanes <= BLOCK_THREADS
        && token_elems < 1 << 31;
    let common = args.neox_in_place() && !multimodal;
    match (vector, args.interleaved, common) {
        (true, true, _) => RopePath::VectorInterleaved,
        (true, false, true) => RopePath::Vector,
        (true, false, false) => RopePath::VectorAny,
        (false, _, true) => RopePath::Scalar,
        (false, _, false) => RopePath::General,
    }
}

/// `(bx, by, bz)` block of a vector kernel: `bx` = vectors per half (one per thread), `by` =
/// head lanes (each thread rotates heads `y, y + by, …`, `vec_heads` per step: `by` is
/// `⌈heads / vec_heads⌉` so one step covers the token, capped at `BLOCK_THREADS` threads per
/// token), `bz` = tokens per block (≤ `tokens`, ≤ 64), chosen up to `BLOCK_THREADS` threads to
/// waste the smallest fraction of the block's lanes, the most tokens among equals (small
/// blocks would hit the per-SM block limit before the thread limit).
fn vector_block(vph: usize, heads: usize, tokens: usize, vec_heads: usize) -> (u32, u32, u32) {
    let bx = vph.clamp(1, BLOCK_THREADS);
    let by = heads
        .div_ceil(vec_heads)
        .clamp(1, (BLOCK_THREADS / bx).max(1));
    let per_token = bx * by;
    let max_bz = (BLOCK_THREADS / per_token).clamp(1, 64).min(tokens.max(1));
    // Fraction of idle lanes: (padded − used) / padded, compared without division.
    let waste = |bz: usize| {
        let used = per_token * bz;
        let padded = used.next_multiple_of(32);
        ((padded - used) as u64, padded as u64)
    };
    let bz = (1..=max_bz)
        .min_by(|&a, &b| {
            let ((wa, pa), (wb, pb)) = (waste(a), waste(b));
            (wa * pb).cmp(&(wb * pa)).then(b.cmp(&a))
        })
        .unwrap_or(1);
    (bx as u32, by as u32, bz as u32)
}

/// RoPE forward out of place: the rotation of [`rope_forward`] read from `q` and `k` and
/// written to `q_out` and `k_out` (shaped like them, dims past `rotary_dim` copied), in one
/// launch; `q` and `k` are not modified.
///
/// Arguments as [`rope_forward`]; `q_out` and `k_out` must not overlap each other or any input
/// (`q` and `k` may overlap each other: they are only read). Out of place always takes the
/// general kernels, so a caller that would otherwise copy q and k first reads and writes each
/// element once instead of twice; in place, [`rope_forward`] may take the vector kernels.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward_into};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (b, s, hq, hk, d) = (1, 16, 8, 2, 64);
/// // candle-nn's tables: [s, d/2], one value per pair; q and k head-major [b, h, s, d].
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_half_tables()
///     .with_head_major();
/// let cos = stream.clone_htod(&vec![1.0f32; s * d / 2])?;
/// let sin = stream.alloc_zeros::<f32>(s * d / 2)?;
/// let q = stream.clone_htod(&vec![1.0f32; b * hq * s * d])?;
/// let k = stream.clone_htod(&vec![1.0f32; b * hk * s * d])?;
/// let (mut q_rot, mut k_rot) = (stream.alloc_zeros::<f32>(q.len())?, stream.alloc_zeros::<f32>(k.len())?);
/// rope_forward_into(&stream, &args, &q, &k, &cos, &sin, &CosSinLayout::PerPosition, &mut q_rot, &mut k_rot)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `q_out` and `k_out` are overwritten whole: the rotated dims, and dims past `rotary_dim` copied
/// from `q` and `k`, which are only read.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.head_dim` is 0 or odd,
///   `args.rotary_dim` is 0, odd or above `head_dim`, `args.q_heads` or `args.k_heads` is 0,
///   (q_heads + k_heads) × rotary_dim / 2 or (q_heads + k_heads) × head_dim reaches 2³¹, or a
///   length overflows `usize`; `q` or `k` is not exactly its shape's length (with token
///   strides, [`RopeArgs::with_strides`]: shorter than its span), or `q_out` or `k_out` not
///   exactly its shape's length (outputs are contiguous);
///   `cos` does not have the length `layout` needs (`sin` must match it), device position ids are
///   not `batch × seq_len` long, or a host position id lies outside the table. Each error names the
///   argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `q`, `k`, `cos`, `sin`, device position
///   ids, `q_out` or `k_out` belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `q_out` or `k_out` overlaps the other, `q`, `k`,
///   `cos`, `sin` or device position ids.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there), uploading host position ids (a stream-ordered
///   allocation and a copy), or the launch, which also fails once an earlier kernel has faulted in
///   the context.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward_into<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
    q_out: &mut impl DevicePtrMut<T>,
    k_out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let io = (q, q_out, Some((k, k_out)));
    rope_into(stream, args, Direction::Forward, io, cos, sin, layout)
}

/// RoPE backward out of place: the rotation by −θ of [`rope_backward`] read from `dq` and
/// `dk` and written to `dq_out` and `dk_out`; otherwise as [`rope_forward_into`].
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_backward_into};
/// let stream = liger_rs::cuda_context(0)?.default_stream();
/// let (b, s, hq, hk, d) = (1, 16, 8, 2, 64);
/// let args = RopeArgs::new(d)
///     .with_batch(b)
///     .with_seq_len(s)
///     .with_heads(hq, hk)
///     .with_interleaved();
/// let cos = stream.clone_htod(&vec![1.0f32; s * d])?;
/// let sin = stream.alloc_zeros::<f32>(s * d)?;
/// let dq = stream.clone_htod(&vec![1.0f32; b * s * hq * d])?;
/// let dk = stream.clone_htod(&vec![1.0f32; b * s * hk * d])?;
/// let (mut gq, mut gk) = (stream.alloc_zeros::<f32>(dq.len())?, stream.alloc_zeros::<f32>(dk.len())?);
/// rope_backward_into(&stream, &args, &dq, &dk, &cos, &sin, &CosSinLayout::PerPosition, &mut gq, &mut gk)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `dq_out` and `dk_out` are overwritten whole: the rotated dims, and dims past `rotary_dim` copied
/// from `dq` and `dk`, which are only read.
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.head_dim` is 0 or odd,
///   `args.rotary_dim` is 0, odd or above `head_dim`, `args.q_heads` or `args.k_heads` is 0,
///   (q_heads + k_heads) × rotary_dim / 2 or (q_heads + k_heads) × head_dim reaches 2³¹, or a
///   length overflows `usize`; `dq` or `dk` is not exactly its shape's length (with token
///   strides, [`RopeArgs::with_strides`]: shorter than its span), or `dq_out` or `dk_out` not
///   exactly its shape's length (outputs are contiguous);
///   `cos` does not have the length `layout` needs (`sin` must match it), device position ids are
///   not `batch × seq_len` long, or a host position id lies outside the table. Each error names the
///   argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dq`, `dk`, `cos`, `sin`, device position
///   ids, `dq_out` or `dk_out` belong to another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `dq_out` or `dk_out` overlaps the other, `dq`,
///   `dk`, `cos`, `sin` or device position ids.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there), uploading host position ids (a stream-ordered
///   allocation and a copy), or the launch, which also fails once an earlier kernel has faulted in
///   the context.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward_into<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dq: &impl DevicePtr<T>,
    dk: &impl DevicePtr<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
    dq_out: &mut impl DevicePtrMut<T>,
    dk_out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let io = (dq, dq_out, Some((dk, dk_out)));
    rope_into(stream, args, Direction::Backward, io, cos, sin, layout)
}

/// The q input and output of an out-of-place call, and k's (`None`: q alone, with
/// `args.k_heads = 0`).
pub(crate) type OutOfPlace<'a, Q, QO, K, KO> = (&'a Q, &'a mut QO, Option<(&'a K, &'a mut KO)>);

/// RoPE out of place on the general kernels, with or without k (see [`rope_forward_into`]).
pub(crate) fn rope_into<T, Q, QO, K, KO>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    direction: Direction,
    (q, q_out, k): OutOfPlace<'_, Q, QO, K, KO>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()>
where
    T: Dtype,
    Q: DevicePtr<T>,
    QO: DevicePtrMut<T>,
    K: DevicePtr<T>,
    KO: DevicePtrMut<T>,
{
    let (k, k_out) = match k {
        Some((k, k_out)) => (read(k), write(k_out)),
        None => (None, None),
    };
    let io = [read(q), k, write(q_out), k_out];
    rope_call(stream, args, direction, io, cos, sin, layout)
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
    fn rows(&self) -> TableRows {
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
    fn position_ids(&self) -> Option<&PositionIds<'_>> {
        match self {
            CosSinLayout::Gathered(ids)
            | CosSinLayout::MultimodalGathered {
                position_ids: ids, ..
            } => Some(ids),
            _ => None,
        }
    }

    /// The position ids as a buffer of the call (in host memory: a length only).
    fn ids<T>(&self) -> Option<Buf<'_, T>> {
        match self.position_ids()? {
            PositionIds::Host(h) => Some(Buf::Host(h.len())),
            PositionIds::DeviceI32(v) => Some(Buf::I32(Access::Read(v))),
            PositionIds::DeviceI64(v) => Some(Buf::I64(Access::Read(v))),
        }
    }

    /// The kernels' identity of the rows' source (host ids are uploaded as i64).
    fn source(&self) -> Source {
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

impl RopeArgs {
    /// The buffers of a call, in the order of the out-of-place signatures: q, k, cos, sin,
    /// position ids, q_out, k_out (in place, q and k are read and written, and the outputs
    /// are left out); and the call's sizes. `with_k`: whether k is given (else `k_heads = 0`).
    pub(crate) fn table(
        &self,
        direction: Direction,
        rows: TableRows,
        out_of_place: bool,
        with_k: bool,
    ) -> Result<(RopeSizes, Table<7>)> {
        let [q_name, k_name, q_out_name, k_out_name, _] = buffer_names(direction);
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

/// The general kernels' `sections` argument: the first pair of the h table in bits 0..32 and
/// of the w table in bits 32..64 (0 for the other layouts; both < 2³¹ once checked).
fn packed_sections(rows: TableRows) -> u64 {
    match rows {
        TableRows::Multimodal([t, h, _]) | TableRows::MultimodalGathered([t, h, _]) => {
            t as u64 | ((t + h) as u64) << 32
        }
        _ => 0,
    }
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

/// Validates and launches a call: `[q, k, q_out, k_out]` as in [`RopeArgs::table`] (in place,
/// the outputs `None`; without k, k and k_out `None`).
#[allow(clippy::too_many_arguments)]
fn rope_call<'b, T: Dtype>(
    stream: &'b Arc<CudaStream>,
    args: &RopeArgs,
    direction: Direction,
    [q, k, q_out, k_out]: [Option<Buf<'b, T>>; 4],
    cos: &'b impl DevicePtr<T>,
    sin: &'b impl DevicePtr<T>,
    layout: &'b CosSinLayout<'_>,
) -> Result<()> {
    rope_call_in(
        stream,
        args,
        direction,
        [q, k, q_out, k_out],
        None,
        cos,
        sin,
        layout,
    )
}

/// [`rope_call`], or with `fused = Some(k_offset)` the in-place call on q and k of one buffer
/// (`q`: [`rope_forward_fused`]'s `qkv`, `k` None): k starts `k_offset` elements into it.
#[allow(clippy::too_many_arguments)]
fn rope_call_in<'b, T: Dtype>(
    stream: &'b Arc<CudaStream>,
    args: &RopeArgs,
    direction: Direction,
    [q, k, q_out, k_out]: [Option<Buf<'b, T>>; 4],
    fused: Option<usize>,
    cos: &'b impl DevicePtr<T>,
    sin: &'b impl DevicePtr<T>,
    layout: &'b CosSinLayout<'_>,
) -> Result<()> {
    let out_of_place = q_out.is_some();
    let with_k = k.is_some() || fused.is_some();
    let (sizes, mut table) = args.table(direction, layout.rows(), out_of_place, with_k)?;
    if let Some(k_offset) = fused {
        table.specs[0] = fused_spec(&sizes, k_offset, direction)?;
    }
    let bufs = [q, k, read(cos), read(sin), layout.ids(), q_out, k_out];
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [q, mut k, cos_ptr, sin_ptr, ids_ptr, q_out, k_out] = call.ptrs;
    if let Some(k_offset) = fused {
        check_fused_disjoint(&sizes, k_offset, direction)?;
        k = q + (k_offset * size_of::<T>()) as u64;
    }
    let rows = args.table_rows(layout.rows(), &sizes, cos.len());
    // Host ids go up only now that every check has passed; a fresh allocation is disjoint
    // from every argument by construction.
    let uploaded: Option<CudaSlice<i64>> = match layout.position_ids() {
        Some(PositionIds::Host(h)) => {
            check_host_ids(h, rows)?;
            Some(stream.clone_htod(*h)?)
        }
        _ => None,
    };
    let (ids_ptr, _uploaded) = match uploaded.as_ref() {
        Some(u) => {
            let (p, g) = u.device_ptr(stream);
            (p, Some(g))
        }
        None => (ids_ptr, None),
    };
    let io = Io {
        q,
        k,
        out: out_of_place.then_some((q_out, k_out)),
        cos: cos_ptr,
        sin: sin_ptr,
        ids: ids_ptr,
    };
    let rows = (rows, layout.rows());
    launch::<T>(stream, args, direction, &sizes, io, rows, layout.source())
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
pub(crate) fn fused_spec(sizes: &RopeSizes, k_offset: usize, direction: Direction) -> Result<Spec> {
    let k_end = fused_k_end(sizes, k_offset)?;
    let need = match k_end > sizes.q_len {
        true => Need::AtLeast(k_end, "k_offset + the span of k"),
        false => Need::AtLeast(sizes.q_len, "the span of q"),
    };
    Ok(Spec::in_place(buffer_names(direction)[4], need))
}

/// q's rows from element 0 and k's from `k_offset` must share no element ([`overlaps`]).
pub(crate) fn check_fused_disjoint(
    sizes: &RopeSizes,
    k_offset: usize,
    direction: Direction,
) -> Result<()> {
    let overlap = overlaps(
        (0, sizes.q_len as u64, Some(sizes.q_rows)),
        (k_offset as u64, sizes.k_len as u64, Some(sizes.k_rows)),
    );
    let [output, other, ..] = buffer_names(direction);
    match overlap {
        true => Err(crate::Error::Aliasing { output, other }),
        false => Ok(()),
    }
}

/// The device pointers of one launch (their guards held by the caller): `q` and `k` (0
/// without k) are read, and written in place (`out = None`) or to the `(q_out, k_out)`
/// pointers; the cos/sin tables, and the ids (0 unless gathered).
struct Io {
    q: u64,
    k: u64,
    out: Option<(u64, u64)>,
    cos: u64,
    sin: u64,
    ids: u64,
}

/// The form bits of a general-kernel call, and the work items of one token: each head's
/// pairs, and out of place its tail dims past `rotary_dim`, which the kernel copies.
fn general_form(args: &RopeArgs, out_of_place: bool) -> (u32, usize) {
    let tail = if out_of_place {
        args.head_dim - args.rotary_dim
    } else {
        0
    };
    let bits = [
        (args.interleaved, form::INTERLEAVED),
        (args.head_major, form::HEAD_MAJOR),
        (args.half_tables, form::HALF_TABLES),
        (tail > 0, form::COPY_TAIL),
    ];
    let flags = bits
        .iter()
        .filter(|(on, _)| *on)
        .fold(0, |f, (_, bit)| f | bit);
    let items = (args.q_heads + args.k_heads) * (args.rotary_dim / 2 + tail);
    (flags, items)
}

/// Launches the kernels of `path` (scalar, vector or general), over
/// cos/sin tables of `table_rows` rows from `source`.
fn launch<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    direction: Direction,
    sizes: &RopeSizes,
    io: Io,
    (table_rows, rows): (usize, TableRows),
    source: Source,
) -> Result<()> {
    let r = args.rotary_dim;
    let (cos_ptr, sin_ptr, ids_ptr) = (io.cos, io.sin, io.ids);
    let (q_write, k_write) = io.out.unwrap_or((io.q, io.k));
    let kernels = kernels(stream.context())?;
    let elem_bytes = std::mem::size_of::<T>();
    let path = path(
        args,
        io.out.is_some(),
        rows,
        elem_bytes,
        [io.q, io.k, cos_ptr, sin_ptr],
    );
    let func = kernels.function(Kernel::Rope {
        direction,
        path,
        elem: T::ELEM,
        rows: source,
    })?;
    let dims = [
        sizes.tokens,
        args.seq_len,
        args.q_heads,
        args.k_heads,
        args.head_dim,
        r,
        table_rows,
    ]
    .map(|v| v as u64);
    // The form bits and the general kernels' work items per token.
    let (form, items) = general_form(args, io.out.is_some());
    let vector = matches!(
        path,
        RopePath::Vector | RopePath::VectorAny | RopePath::VectorInterleaved
    );
    let cfg = if vector {
        let lanes = 16 / elem_bytes;
        let heads = args.q_heads + args.k_heads;
        let vec_heads = vec_heads(lanes);
        let (bx, by, bz) = vector_block(r / 2 / lanes, heads, sizes.tokens, vec_heads);
        let threads = bx * by * bz;
        // Grid-stride over tokens: as many blocks as are resident at once, at most one per
        // `bz` tokens; with many waves of token steps, one block per step (`item_grid`: the
        // kernel holds nothing for its next step, so it is its own twin).
        let resident = kernels.resident_blocks(&func, threads, 0)?;
        let steps = sizes.tokens.div_ceil(bz as usize);
        let (_, blocks) = item_grid(steps, resident, true);
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (bx, by, bz),
            shared_mem_bytes: 0,
        }
    } else {
        let items = match path {
            RopePath::General => items,
            _ => sizes.pairs,
        };
        let (tx, ty) = block_shape(items);
        let blocks = sizes.tokens.div_ceil(ty as usize).min(i32::MAX as usize);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (tx, ty, 1),
            shared_mem_bytes: 0,
        }
    };
    let mut launch = stream.launch_builder(&func);
    launch.arg(&io.q).arg(&io.k);
    if path == RopePath::General {
        launch.arg(&q_write).arg(&k_write);
    }
    launch.arg(&cos_ptr).arg(&sin_ptr).arg(&ids_ptr);
    for v in &dims {
        launch.arg(v);
    }
    // Token strides of q, k and, out of place, of their contiguous outputs.
    let (q_stride, k_stride) = (args.q_token_stride() as u64, args.k_token_stride() as u64);
    let strides = match io.out {
        None => [q_stride, k_stride, q_stride, k_stride],
        Some(_) => [
            q_stride,
            k_stride,
            sizes.q_rows.row as u64,
            sizes.k_rows.row as u64,
        ],
    };
    let sections = packed_sections(rows);
    match path {
        RopePath::General => strides.iter().fold(&mut launch, |l, v| l.arg(v)),
        RopePath::Scalar => &mut launch,
        _ => launch.arg(&strides[0]).arg(&strides[1]),
    };
    if path != RopePath::Scalar {
        launch.arg(&sections).arg(&form);
    }
    // SAFETY: argument order and types match `rope_entry!` in kernels-gpu: q and k (then, on
    // the general path, their outputs), cos, sin and ids, the 7 sizes as u64 (tokens, seq_len,
    // q_heads, k_heads, head_dim, rotary_dim, table_rows), then the token strides (the general
    // path's 4, the vector paths' q and k) and the packed sections as u64 and the form bits as
    // u32 (none of these on the scalar path). q/k were checked to hold their span,
    // `(tokens − 1)·stride + heads × head_dim` elements (exactly, when contiguous; strided only
    // token-major, where the strides apply; k absent, null and unused, when k_heads = 0), their
    // outputs exactly tokens × heads × head_dim, every output to be its input (in place, with
    // its stride) or disjoint from every other buffer, q and k rows disjoint
    // (`check_disjoint`, or `check_fused_disjoint` in one buffer); cos/sin hold every row the
    // variant selects (`seq_len` rows for `pos`, `tokens` for `batch`, `table_rows` for
    // `ids*`, whose ids the kernel clamps, 3 × `tokens` for `mrope`, whose sections sum to
    // rotary_dim / 2) in rows of `table_row_len` elements, as `form` tells the kernels, and the
    // ids buffer holds `tokens` ids of the variant's type (3 × `tokens` multimodal).
    // `rotary_dim` is even, 2 ..= head_dim, `tokens > 0` implies `seq_len ≥ 1`, and a token's
    // items (pairs, plus tail dims out of place: `RopeArgs::table` checked heads × head_dim <
    // 2^31) are below 2^31. The scalar and `_v_` kernels run only on contiguous NeoX halves
    // with full-width rows and no multimodal tables, and the `_v_`, `_va_` and `_vi_` kernels
    // only where `path` established their alignment and divisibility requirements, with
    // `blockDim.x = half / lanes` as they require.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::identity::{ElemType, Rows};

    /// Every kernel the launchers can ask for: each path takes each element type, direction
    /// and cos/sin row source, but multimodal rows only the `_va_` and general paths.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let mut out = Vec::new();
        for &direction in &[Direction::Forward, Direction::Backward] {
            for &path in RopePath::ALL {
                for &elem in ElemType::ALL {
                    for &rows in Rows::ALL {
                        let multimodal = [
                            Rows::Multimodal,
                            Rows::MultimodalIdsI32,
                            Rows::MultimodalIdsI64,
                        ];
                        let neox_only = [RopePath::Scalar, RopePath::Vector];
                        let not_multimodal = [RopePath::VectorInterleaved];
                        if multimodal.contains(&rows)
                            && (neox_only.contains(&path) || not_multimodal.contains(&path))
                        {
                            continue;
                        }
                        out.push(Kernel::Rope {
                            direction,
                            path,
                            elem,
                            rows,
                        });
                    }
                }
            }
        }
        out
    }

    #[test]
    fn kernel_names_are_their_parts() {
        let kernel = |path, rows| Kernel::Rope {
            direction: Direction::Backward,
            path,
            elem: ElemType::F16,
            rows,
        };
        assert_eq!(
            kernel(RopePath::General, Rows::IdsI32).name(),
            "rope_bwd_g_f16_ids32"
        );
        assert_eq!(
            kernel(RopePath::Vector, Rows::PerPosition).name(),
            "rope_bwd_v_f16_pos"
        );
        assert_eq!(
            kernel(RopePath::Scalar, Rows::PerBatch).name(),
            "rope_bwd_f16_batch"
        );
    }

    #[test]
    fn block_shape_covers_every_pair_within_256_threads() {
        for pairs in 1..3000 {
            let (tx, ty) = block_shape(pairs);
            assert!(tx * ty <= BLOCK_THREADS as u32 && ty >= 1, "{pairs}");
            let passes = pairs.div_ceil(tx as usize);
            assert_eq!(passes, pairs.div_ceil(BLOCK_THREADS), "{pairs}: {tx}×{ty}");
            if pairs > BLOCK_THREADS {
                assert!(tx.is_multiple_of(32) && ty == 1, "{pairs}");
            }
        }
        assert_eq!(block_shape(2560), (256, 1));
        assert_eq!(block_shape(300), (160, 1));
        assert_eq!(block_shape(2), (2, 128));
    }

    #[test]
    fn path_is_general_out_of_place_or_head_major_and_vector_on_whole_aligned_vectors() {
        let a = |d: usize, r: usize| {
            RopeArgs::new(d)
                .with_batch(2)
                .with_seq_len(3)
                .with_heads(32, 8)
                .with_rotary_dim(r)
        };
        let pos = TableRows::PerPosition;
        let in_place =
            |args: &RopeArgs, bytes: usize, ptrs: [u64; 4]| path(args, false, pos, bytes, ptrs);
        let aligned = [0x1000u64, 0x2000, 0x3000, 0x4000];
        // (d, r, bytes per element) → the path in place.
        let (v, s) = (RopePath::Vector, RopePath::Scalar);
        let (va, vi, g) = (
            RopePath::VectorAny,
            RopePath::VectorInterleaved,
            RopePath::General,
        );
        let cases = [
            ((128, 128, 2), v),
            ((128, 128, 4), v),
            ((64, 64, 2), v),
            ((256, 256, 2), v),
            ((96, 96, 2), v),  // half 48 = 6 vectors
            ((80, 80, 2), v),  // half 40 = 5 vectors
            ((80, 80, 4), v),  // half 40 = 10 vectors
            ((128, 64, 2), v), // partial rotary, half 32
            ((80, 32, 2), v),  // partial rotary, half 16
            ((8, 8, 4), v),    // half 4 = 1 vector
            ((92, 92, 2), s),  // head_dim·2 = 184 not a multiple of 16
            ((92, 92, 4), s),  // half 46 not a multiple of 4
            ((128, 40, 2), s), // partial rotary, half 20 not a multiple of 8
            ((80, 60, 4), s),  // partial rotary, half 30 not a multiple of 4
            ((8, 8, 2), s),    // half 4 < 8 lanes
            ((6, 6, 4), s),
            ((16, 2, 2), s),
        ];
        for ((d, r, bytes), want) in cases {
            assert_eq!(
                in_place(&a(d, r), bytes, aligned),
                want,
                "d={d} r={r} {bytes}B"
            );
            // Interleaved pairs or half-width tables: the same rule, on the vector kernels of
            // any form or the general ones.
            let (iv, ig) = (a(d, r).with_interleaved(), a(d, r).with_half_tables());
            let want_i = if want == v { vi } else { g };
            assert_eq!(
                in_place(&iv, bytes, aligned),
                want_i,
                "d={d} r={r} {bytes}B"
            );
            let want_h = if want == v { va } else { g };
            assert_eq!(
                in_place(&ig, bytes, aligned),
                want_h,
                "d={d} r={r} {bytes}B"
            );
        }
        // Any misaligned pointer (a view at an odd offset) leaves the vector paths.
        for i in 0..4 {
            let mut p = aligned;
            p[i] += 2;
            assert_eq!(in_place(&a(128, 128), 2, p), s, "pointer {i}");
            assert_eq!(in_place(&a(128, 128).with_interleaved(), 2, p), g);
            p[i] += 6; // 8-byte aligned: still not 16
            assert_eq!(in_place(&a(128, 128), 2, p), s, "pointer {i}");
        }
        // More than BLOCK_THREADS vectors in a half, or 2^31 elements per token: scalar.
        let wide = RopeArgs::new(4096);
        assert_eq!(in_place(&wide, 2, aligned), v); // 256 vectors per half
        assert_eq!(in_place(&wide, 4, aligned), s); // 512
        let many = RopeArgs::new(64).with_heads(1 << 24, 1 << 24);
        assert_eq!(in_place(&many, 2, aligned), s);
        // Out of place, or head-major, is the general path whatever the alignment.
        assert_eq!(path(&a(128, 128), true, pos, 2, aligned), g);
        assert_eq!(in_place(&a(128, 128).with_head_major(), 2, aligned), g);
        // Token rows apart from each other (views into a fused QKV buffer) keep the vector
        // path when the strides are whole vectors; else the general path.
        let fused = (32 + 2 * 8) * 128;
        assert_eq!(
            in_place(&a(128, 128).with_strides(fused, fused), 2, aligned),
            va
        );
        let odd = a(128, 128).with_strides(fused + 4, fused);
        assert_eq!(in_place(&odd, 2, aligned), g);
        assert_eq!(in_place(&odd, 4, aligned), va); // 4 f32 lanes
        assert_eq!(
            in_place(&a(128, 128).with_strides(32 * 128, 8 * 128), 2, aligned),
            v
        );
        // Multimodal tables: vector where both section starts are whole vectors, else general
        // (never scalar).
        let mm = |t, h, w| TableRows::Multimodal([t, h, w]);
        let gathered = TableRows::MultimodalGathered([16, 24, 24]);
        assert_eq!(path(&a(128, 128), false, mm(16, 24, 24), 2, aligned), va);
        assert_eq!(path(&a(128, 128), false, gathered, 2, aligned), va);
        assert_eq!(path(&a(128, 128), false, mm(20, 24, 20), 2, aligned), g);
        assert_eq!(path(&a(128, 128), false, mm(20, 24, 20), 4, aligned), va);
        assert_eq!(path(&a(128, 128), false, mm(24, 20, 20), 2, aligned), g);
        // Other forms with multimodal tables: general.
        for other in [
            a(128, 128).with_interleaved(),
            a(128, 128).with_half_tables(),
            a(128, 128).with_strides(fused, fused),
        ] {
            assert_eq!(path(&other, false, mm(16, 24, 24), 2, aligned), g);
        }
        let misaligned = [0x1002, 0x2000, 0x3000, 0x4000];
        assert_eq!(path(&a(128, 128), false, mm(16, 24, 24), 2, misaligned), g);
    }

    #[test]
    fn strided_rows_span_from_the_first_row_to_the_last() {
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
    fn fused_q_and_k_are_checked_row_by_row() {
        // [6 tokens, q 32 | k 16 | v 16]: k at 32 is disjoint, at 31 it overlaps q's last
        // column, at 48 (v's columns) it is disjoint again, at 64 − 16 + 1 it wraps onto the
        // next token's q.
        let a = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_strides(64, 64);
        let sizes = a.check_heads(true).unwrap();
        let fwd = Direction::Forward;
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
        assert_eq!(check_fused_disjoint(&sizes, 31, Direction::Backward), named);
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
        let spec = fused_spec(&sizes, 0, Direction::Backward).unwrap();
        assert_eq!(spec.need, Need::AtLeast(5 * 64 + 32, "the span of q"));
        assert_eq!(spec.name, "dqkv");
        assert!(fused_spec(&sizes, usize::MAX, fwd).is_err());
    }

    #[test]
    fn multimodal_sections_split_the_pairs() {
        assert!(check_sections([16, 24, 24], 128).is_ok());
        assert!(check_sections([0, 0, 4], 8).is_ok());
        for bad in [[16, 24, 23], [16, 24, 25], [usize::MAX, 2, 0]] {
            let err = check_sections(bad, 128).unwrap_err().to_string();
            assert!(err.contains("summing to rotary_dim / 2 = 64"), "{err}");
        }
        let packed = packed_sections(TableRows::Multimodal([16, 24, 24]));
        assert_eq!((packed as u32, (packed >> 32) as u32), (16, 40));
        assert_eq!(packed_sections(TableRows::PerBatch), 0);
        let a = RopeArgs::new(8).with_batch(2).with_seq_len(3);
        let (_, table) = a
            .table(
                Direction::Forward,
                TableRows::Multimodal([1, 2, 1]),
                false,
                true,
            )
            .unwrap();
        assert_eq!(
            table.specs[2].need,
            Need::Exactly(3 * 6 * 8, "3 × batch × seq_len × rotary_dim")
        );
        let bad = a.table(
            Direction::Forward,
            TableRows::Multimodal([1, 2, 2]),
            false,
            true,
        );
        assert!(bad.is_err());
        // One gathered table, [3, B, S] ids: three ids a token.
        let gathered = TableRows::MultimodalGathered([1, 2, 1]);
        let (_, table) = a.table(Direction::Forward, gathered, false, true).unwrap();
        assert_eq!(
            table.specs[2].need,
            Need::Rows(8, "max_pos ≥ 1 rows of rotary_dim")
        );
        assert_eq!(
            table.specs[4].need,
            Need::Exactly(18, "3 × batch × seq_len")
        );
        assert_eq!(a.table_rows(gathered, &a.check_heads(true).unwrap(), 40), 5);
        assert_eq!(packed_sections(gathered), 1 | 3 << 32);
        let bad = TableRows::MultimodalGathered([1, 2, 2]);
        assert!(a.table(Direction::Forward, bad, false, true).is_err());
    }

    #[test]
    fn vector_block_covers_the_token_in_one_step_within_256_threads() {
        // The benchmark shape: 40 heads, d = 128 → 8 (16-bit, 2 heads per step) or 16 (f32, 4
        // heads per step) vectors per half.
        assert_eq!(vector_block(8, 40, 16384, vec_heads(8)), (8, 20, 1)); // 160 threads
        assert_eq!(vector_block(16, 40, 16384, vec_heads(4)), (16, 10, 1));
        // 15 threads per token: 17 tokens fill 255 of 8 warps' 256 lanes (the least waste);
        // with 4 tokens, 4 fill 60 of 64 (as good as 2 in 32, and more per block).
        assert_eq!(vector_block(5, 10, 100, 4), (5, 3, 17));
        assert_eq!(vector_block(5, 10, 4, 4), (5, 3, 4));
        // Tiny tokens (f32 d = 16, 1 + 1 heads): 64 tokens of 2 threads, not 16 of them.
        assert_eq!(vector_block(2, 2, 1 << 20, 4), (2, 1, 64));
        for vec_heads in [2, 4] {
            for vph in 1..=256 {
                for heads in [2, 3, 5, 10, 40, 41, 300, 1 << 20] {
                    for tokens in [1, 3, 1000] {
                        let (bx, by, bz) = vector_block(vph, heads, tokens, vec_heads);
                        let (bx, by, bz) = (bx as usize, by as usize, bz as usize);
                        assert_eq!(bx, vph);
                        assert!(bx * by * bz <= BLOCK_THREADS && by >= 1 && bz >= 1);
                        assert!(bz <= tokens && bz <= 64);
                        if heads.div_ceil(vec_heads) * vph <= BLOCK_THREADS {
                            assert!(by * vec_heads >= heads, "{vph} {heads}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn general_form_bits_and_items() {
        let a = RopeArgs::new(16)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_rotary_dim(8);
        // In place the tail is not touched; out of place each head copies its 8 tail dims.
        assert_eq!(general_form(&a, false), (0, 6 * 4));
        assert_eq!(general_form(&a, true), (form::COPY_TAIL, 6 * (4 + 8)));
        let all = a.with_interleaved().with_half_tables().with_head_major();
        let bits = form::INTERLEAVED | form::HEAD_MAJOR | form::HALF_TABLES;
        assert_eq!(general_form(&all, false).0, bits);
        let full = RopeArgs::new(16).with_head_major();
        assert_eq!(general_form(&full, true), (form::HEAD_MAJOR, 2 * 8));
        assert!(RopeArgs::new(8).neox_in_place());
        assert!(!full.neox_in_place());
    }

    #[test]
    fn q_alone_needs_zero_k_heads() {
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
    fn args_are_checked_without_overflow() {
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
