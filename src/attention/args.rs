//! The attention calls' public arguments and their checks, shared by the GPU launchers, the
//! CPU reference and the candle CPU path.
use super::abi::SIMT_MAX_HEAD_DIM;
use crate::error::{Result, invalid};
use crate::validate::{Need, Spec, Strided, Table};

/// Where each element of a `[tokens, heads, head_dim]` tensor lies: element `(b, t, h, e)`
/// (sequence, token, head, element of the head) at `b·batch + t·token + h·head + e` elements
/// from the buffer's start (the last dimension is contiguous). In a packed batch (varlen)
/// `batch` is unused: sequence `b`'s tokens start at `cu_seqlens[b]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Elements between sequences.
    pub batch: usize,
    /// Elements between consecutive tokens.
    pub token: usize,
    /// Elements between consecutive heads of a token.
    pub head: usize,
}

impl Strides {
    /// The contiguous layout `[B, S, H, d]` (or `[total, H, d]`).
    pub fn contiguous(seqlen: usize, heads: usize, head_dim: usize) -> Self {
        Strides {
            batch: seqlen * heads * head_dim,
            token: heads * head_dim,
            head: head_dim,
        }
    }
}

/// The shape and options of an attention call (flash-attention 2 semantics):
/// `softmax(scale · q·kᵀ (soft-capped, masked)) · v` per query head, over key/value head
/// `h / (heads_q / heads_kv)` (GQA, MQA).
///
/// q is `[batch, seqlen_q, heads_q, head_dim]`, k and v `[batch, seqlen_k, heads_kv, head_dim]`
/// (candle-flash-attn's layout; any strides, [`AttentionArgs::with_strides`]), the output and
/// its gradient contiguous `[batch, seqlen_q, heads_q, head_dim]`, the log-sum-exp f32
/// `[batch, heads_q, seqlen_q]`. A packed batch ([`AttentionArgs::varlen`]) has q
/// `[total_q, heads_q, head_dim]`, k and v `[total_k, heads_kv, head_dim]`, sequence `b` at
/// tokens `cu_seqlens[b]..cu_seqlens[b + 1]`, and the log-sum-exp `[heads_q, total_q]`.
///
/// Masks align to the bottom-right corner when `seqlen_q ≠ seqlen_k`, as flash-attention ≥ 2.1:
/// query `i` sees key `j` iff `i + sk − sq − window_left ≤ j ≤ i + sk − sq + window_right`
/// (an absent side unbounded; causal is `window_right = 0`). A query row that sees no key gets
/// a zero output and a log-sum-exp of −∞.
///
/// ```
/// use liger_rs::AttentionArgs;
/// let args = AttentionArgs::new(4, 2048, 2048, 16, 4, 128).with_causal(true);
/// assert_eq!(args.scale, 1.0 / 128f32.sqrt());
/// assert_eq!(args.window_right, Some(0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct AttentionArgs {
    /// Sequences.
    pub batch: usize,
    /// Query tokens per sequence (in a packed batch: the longest sequence, `max_seqlen_q`).
    pub seqlen_q: usize,
    /// Key tokens per sequence (in a packed batch: `max_seqlen_k`).
    pub seqlen_k: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads; divides `heads_q`.
    pub heads_kv: usize,
    /// Elements per head (1 ..= 256; 64 and 128 run on tensor cores in f16 and bf16).
    pub head_dim: usize,
    /// The factor on `q·k` (default `1/√head_dim`).
    pub scale: f32,
    /// Keys left of the diagonal a query sees (`None`: all).
    pub window_left: Option<usize>,
    /// Keys right of the diagonal a query sees (`None`: all; `Some(0)`: causal).
    pub window_right: Option<usize>,
    /// Soft-capping `c·tanh(s/c)` of the scaled scores (Gemma 2), or 0 for none.
    pub softcap: f32,
    /// Query tokens of a packed batch (`Some` makes the call varlen).
    pub total_q: Option<usize>,
    /// Key tokens of a packed batch.
    pub total_k: Option<usize>,
    /// The layout of q (and, by default, of dq).
    pub q: Strides,
    /// The layout of k.
    pub k: Strides,
    /// The layout of v.
    pub v: Strides,
    /// The layout of dq, dk and dv written by the backward.
    pub grads: [Strides; 3],
}

/// Tokens, heads and elements of each tensor of a call, for its checks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Extent {
    pub(crate) sequences: usize,
    pub(crate) tokens: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) packed: bool,
}

impl Extent {
    /// Elements from the first to one past the last element the layout names (0 without any).
    pub(crate) fn span(&self, s: &Strides) -> Option<usize> {
        if self.sequences == 0 || self.tokens == 0 || self.heads == 0 {
            return Some(0);
        }
        let seqs = if self.packed { 0 } else { self.sequences - 1 };
        seqs.checked_mul(s.batch)?
            .checked_add((self.tokens - 1).checked_mul(s.token)?)?
            .checked_add((self.heads - 1).checked_mul(s.head)?)?
            .checked_add(self.head_dim)
    }

    /// Whether the layout names each element once: heads apart by a whole head, tokens by
    /// all of a token's heads, sequences by all of a sequence's tokens.
    pub(crate) fn injective(&self, s: &Strides) -> bool {
        let head = self.heads <= 1 || s.head >= self.head_dim;
        let token_span = (self.heads.max(1) - 1) * s.head + self.head_dim;
        let token = self.tokens <= 1 || s.token >= token_span;
        let seq_span = (self.tokens.max(1) - 1) * s.token + token_span;
        let seq = self.packed || self.sequences <= 1 || s.batch >= seq_span;
        head && token && seq
    }

    /// The need of a buffer of this layout: rows of heads one token stride apart where the
    /// layout is that (so that views of one fused buffer pass the overlap checks), else a span.
    fn need(&self, s: &Strides, what: &'static str) -> Need {
        let rows = if self.packed {
            self.tokens
        } else {
            self.sequences * self.tokens
        };
        let row = self.heads * self.head_dim;
        let one_row_per_token = s.head == self.head_dim
            && (self.packed || self.sequences <= 1 || s.batch == self.tokens * s.token)
            && s.token >= row;
        match self.span(s) {
            Some(_) if one_row_per_token && rows > 0 => Need::Strided(
                Strided {
                    rows,
                    row,
                    stride: s.token,
                },
                what,
            ),
            Some(n) => Need::AtLeast(n, what),
            None => Need::AtLeast(usize::MAX, what),
        }
    }
}

/// What each tensor's length must cover (for the error messages).
const SPAN: &str = "its layout's span: (batch − 1)·batch stride + (tokens − 1)·token stride + (heads − 1)·head stride + head_dim";
const LSE: &str = "batch × heads_q × seqlen_q (packed: heads_q × total_q)";
const CU: &str = "batch + 1";

impl AttentionArgs {
    /// Attention over `batch` sequences of `seqlen_q` queries and `seqlen_k` keys, contiguous
    /// `[B, S, H, d]` tensors, scale `1/√head_dim`, no mask.
    pub fn new(
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Self {
        let q = Strides::contiguous(seqlen_q, heads_q, head_dim);
        let k = Strides::contiguous(seqlen_k, heads_kv, head_dim);
        AttentionArgs {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
            scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            window_left: None,
            window_right: None,
            softcap: 0.0,
            total_q: None,
            total_k: None,
            q,
            k,
            v: k,
            grads: [q, k, k],
        }
    }

    /// A packed batch (flash-attention's varlen): `batch` sequences laid end to end in q
    /// `[total_q, heads_q, head_dim]` and k, v `[total_k, heads_kv, head_dim]`, sequence `b` at
    /// tokens `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` (and `cu_seqlens_k` for keys), none longer
    /// than `max_seqlen_q` / `max_seqlen_k`. The kernels clamp the offsets to the tokens and
    /// each length to its maximum, so that bad offsets cannot address outside the tensors (they
    /// are device data: checking them would synchronise): a sequence longer than its maximum
    /// is cut to it (its keys past the maximum ignored, the outputs of its queries past it
    /// left unwritten, as are those of tokens outside every sequence).
    #[allow(clippy::too_many_arguments)]
    pub fn varlen(
        batch: usize,
        total_q: usize,
        total_k: usize,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Self {
        let mut args = AttentionArgs::new(
            batch,
            max_seqlen_q,
            max_seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
        );
        args.total_q = Some(total_q);
        args.total_k = Some(total_k);
        args.q = Strides::contiguous(total_q, heads_q, head_dim);
        args.k = Strides::contiguous(total_k, heads_kv, head_dim);
        args.v = args.k;
        args.grads = [args.q, args.k, args.k];
        args
    }

    /// Causal masking (`window_right = 0`, bottom-right aligned), or none on the right.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.window_right = if causal { Some(0) } else { None };
        self
    }

    /// The factor on `q·k`.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }

    /// A sliding window (Mistral: `window_left = Some(w)`, `window_right = Some(0)`).
    pub fn with_window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_left = left;
        self.window_right = right;
        self
    }

    /// Soft-capping of the scores (Gemma 2: 50.0); 0 turns it off.
    pub fn with_softcap(mut self, softcap: f32) -> Self {
        self.softcap = softcap;
        self
    }

    /// The layouts of q, k and v, e.g. views of one fused QKV projection `[B, S, (Hq + 2·Hkv)·d]`
    /// (token stride `(Hq + 2·Hkv)·d` for all three, k and v starting `Hq·d` and `(Hq + Hkv)·d`
    /// elements in). The gradients keep their own layouts ([`AttentionArgs::with_grad_strides`]).
    pub fn with_strides(mut self, q: Strides, k: Strides, v: Strides) -> Self {
        self.q = q;
        self.k = k;
        self.v = v;
        self
    }

    /// The layouts of dq, dk and dv (default: contiguous), e.g. views of one fused gradient
    /// buffer shaped as the QKV projection.
    pub fn with_grad_strides(mut self, dq: Strides, dk: Strides, dv: Strides) -> Self {
        self.grads = [dq, dk, dv];
        self
    }

    /// Whether the call is a packed batch.
    pub fn is_varlen(&self) -> bool {
        self.total_q.is_some()
    }

    /// The query and key/value tensors' extents.
    pub(crate) fn extents(&self) -> (Extent, Extent) {
        let packed = self.is_varlen();
        let e = |tokens: usize, heads: usize| Extent {
            sequences: self.batch,
            tokens,
            heads,
            head_dim: self.head_dim,
            packed,
        };
        (
            e(self.total_q.unwrap_or(self.seqlen_q), self.heads_q),
            e(self.total_k.unwrap_or(self.seqlen_k), self.heads_kv),
        )
    }

    /// Query rows of the log-sum-exp: `batch·heads_q·seqlen_q`, or `heads_q·total_q`.
    pub fn lse_len(&self) -> usize {
        match self.total_q {
            Some(t) => self.heads_q * t,
            None => self.batch * self.heads_q * self.seqlen_q,
        }
    }

    /// Elements of the contiguous output `[batch, seqlen_q, heads_q, head_dim]` (packed:
    /// `[total_q, heads_q, head_dim]`).
    pub fn out_len(&self) -> usize {
        let (q, _) = self.extents();
        q.tokens * if q.packed { 1 } else { self.batch } * self.heads_q * self.head_dim
    }

    /// The output's (and its gradient's) contiguous layout.
    pub(crate) fn out_strides(&self) -> Strides {
        let (q, _) = self.extents();
        Strides::contiguous(q.tokens, self.heads_q, self.head_dim)
    }

    /// Checks the scalars: every shape and option the kernels take.
    pub(crate) fn check(&self) -> Result<()> {
        const MAX: usize = i32::MAX as usize;
        let (d, max_d) = (self.head_dim, SIMT_MAX_HEAD_DIM as usize);
        if d == 0 || d > max_d {
            return Err(invalid("args.head_dim", format!("1 ..= {max_d}"), d));
        }
        if self.heads_q == 0 || self.heads_q > 65535 {
            return Err(invalid("args.heads_q", "1 ..= 65535", self.heads_q));
        }
        if self.heads_kv == 0 || !self.heads_q.is_multiple_of(self.heads_kv) {
            return Err(invalid(
                "args.heads_kv",
                format!("a divisor of heads_q = {}", self.heads_q),
                self.heads_kv,
            ));
        }
        if self.batch > 65535 {
            return Err(invalid("args.batch", "at most 65535 sequences", self.batch));
        }
        for (arg, v) in [
            ("args.seqlen_q", self.seqlen_q),
            ("args.seqlen_k", self.seqlen_k),
            ("args.total_q", self.total_q.unwrap_or(0)),
            ("args.total_k", self.total_k.unwrap_or(0)),
            ("args.window_left", self.window_left.unwrap_or(0)),
            ("args.window_right", self.window_right.unwrap_or(0)),
        ] {
            if v > MAX {
                return Err(invalid(arg, format!("at most {MAX}"), v));
            }
        }
        if self.total_q.is_some() != self.total_k.is_some() {
            return Err(invalid(
                "args.total_k",
                "given exactly when total_q is (a packed batch)",
                format!("{:?}", self.total_k),
            ));
        }
        if !self.scale.is_finite() {
            return Err(invalid("args.scale", "a finite number", self.scale));
        }
        if !(self.softcap.is_finite() && self.softcap >= 0.0) {
            return Err(invalid(
                "args.softcap",
                "0 (none) or a finite positive number",
                self.softcap,
            ));
        }
        let (eq, ek) = self.extents();
        let layouts = [
            ("args.q", &self.q, eq),
            ("args.k", &self.k, ek),
            ("args.v", &self.v, ek),
            ("args.grads[0] (dq)", &self.grads[0], eq),
            ("args.grads[1] (dk)", &self.grads[1], ek),
            ("args.grads[2] (dv)", &self.grads[2], ek),
        ];
        for (i, (arg, s, e)) in layouts.into_iter().enumerate() {
            if e.span(s).is_none() {
                return Err(invalid(
                    arg,
                    "a layout whose span fits in usize",
                    format!("{s:?}"),
                ));
            }
            if i >= 3 && !e.injective(s) {
                return Err(invalid(
                    arg,
                    "a written layout that names each element once (head stride ≥ head_dim, token stride ≥ a token's heads, batch stride ≥ a sequence's tokens)",
                    format!("{s:?}"),
                ));
            }
        }
        Ok(())
    }

    /// The window as the kernels take it: −1 for an unbounded side.
    pub(crate) fn window(&self) -> (i32, i32) {
        let side = |w: Option<usize>| w.map_or(-1, |w| w as i32);
        (side(self.window_left), side(self.window_right))
    }

    /// The forward's buffers: q, k, v, o, lse, then cu_seqlens_q, cu_seqlens_k.
    pub(crate) fn forward_table(&self) -> Result<Table<7>> {
        self.check()?;
        let (eq, ek) = self.extents();
        let out = self.out_strides();
        let cu = self.cu_need();
        Ok(Table {
            specs: [
                Spec::read("q", eq.need(&self.q, SPAN)),
                Spec::read("k", ek.need(&self.k, SPAN)),
                Spec::read("v", ek.need(&self.v, SPAN)),
                Spec::written("o", eq.need(&out, SPAN)),
                Spec::written("lse", Need::AtLeast(self.lse_len(), LSE)),
                Spec::read("cu_seqlens_q", cu),
                Spec::read("cu_seqlens_k", cu),
            ],
            empty: self.batch == 0 || eq.tokens == 0,
        })
    }

    /// The backward's buffers: q, k, v, o, do, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k.
    pub(crate) fn backward_table(&self) -> Result<Table<11>> {
        self.check()?;
        let (eq, ek) = self.extents();
        let out = self.out_strides();
        let cu = self.cu_need();
        Ok(Table {
            specs: [
                Spec::read("q", eq.need(&self.q, SPAN)),
                Spec::read("k", ek.need(&self.k, SPAN)),
                Spec::read("v", ek.need(&self.v, SPAN)),
                Spec::read("o", eq.need(&out, SPAN)),
                Spec::read("d_o", eq.need(&out, SPAN)),
                Spec::read("lse", Need::AtLeast(self.lse_len(), LSE)),
                Spec::written("dq", eq.need(&self.grads[0], SPAN)),
                Spec::written("dk", ek.need(&self.grads[1], SPAN)),
                Spec::written("dv", ek.need(&self.grads[2], SPAN)),
                Spec::read("cu_seqlens_q", cu),
                Spec::read("cu_seqlens_k", cu),
            ],
            empty: self.batch == 0 || (eq.tokens == 0 && ek.tokens == 0),
        })
    }

    fn cu_need(&self) -> Need {
        Need::Exactly(if self.is_varlen() { self.batch + 1 } else { 0 }, CU)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::validate::{Seen, check_buffers, check_disjoint};

    fn arg_of(r: Result<()>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected an invalid argument, got {other:?}"),
        }
    }

    #[test]
    fn every_bad_scalar_names_its_field() {
        let ok = AttentionArgs::new(2, 8, 8, 4, 2, 64);
        assert!(ok.check().is_ok());
        let cases: [(AttentionArgs, &str); 9] = [
            (AttentionArgs::new(2, 8, 8, 4, 2, 0), "args.head_dim"),
            (AttentionArgs::new(2, 8, 8, 4, 2, 257), "args.head_dim"),
            (AttentionArgs::new(2, 8, 8, 0, 1, 64), "args.heads_q"),
            (AttentionArgs::new(2, 8, 8, 4, 3, 64), "args.heads_kv"),
            (AttentionArgs::new(2, 8, 8, 4, 0, 64), "args.heads_kv"),
            (AttentionArgs::new(70000, 8, 8, 4, 2, 64), "args.batch"),
            (ok.with_scale(f32::NAN), "args.scale"),
            (ok.with_softcap(-1.0), "args.softcap"),
            (ok.with_window(Some(1 << 31), None), "args.window_left"),
        ];
        for (args, field) in cases {
            assert_eq!(arg_of(args.check()), field, "{args:?}");
        }
        // A written layout that names an element twice: heads overlapping in dq.
        let s = Strides {
            batch: 8 * 4 * 64,
            token: 4 * 64,
            head: 32,
        };
        let overlapping = ok.with_grad_strides(s, ok.k, ok.k);
        assert_eq!(arg_of(overlapping.check()), "args.grads[0] (dq)");
        // Read layouts may alias (a broadcast k, say).
        let broadcast = Strides {
            batch: 0,
            token: 64,
            head: 0,
        };
        assert!(ok.with_strides(ok.q, broadcast, broadcast).check().is_ok());
    }

    #[test]
    fn lengths_cover_the_layouts_span() {
        let args = AttentionArgs::new(2, 3, 5, 4, 2, 8);
        let table = args.forward_table().unwrap();
        let seen = |len: usize| {
            Some(Seen {
                len,
                context: 1,
                elem_bytes: 2,
            })
        };
        let (q, k, o, lse) = (2 * 3 * 4 * 8, 2 * 5 * 2 * 8, 2 * 3 * 4 * 8, 2 * 4 * 3);
        let lens = [seen(q), seen(k), seen(k), seen(o), seen(lse), None, None];
        assert!(check_buffers(&table, &lens, 1).is_ok());
        let mut short = lens;
        short[1] = seen(k - 1);
        assert!(matches!(
            check_buffers(&table, &short, 1),
            Err(Error::InvalidArgument { arg: "k", .. })
        ));
        let mut short_lse = lens;
        short_lse[4] = seen(lse - 1);
        assert!(matches!(
            check_buffers(&table, &short_lse, 1),
            Err(Error::InvalidArgument { arg: "lse", .. })
        ));
        // A packed batch needs batch + 1 offsets.
        let packed = AttentionArgs::varlen(3, 10, 12, 5, 6, 2, 1, 8);
        let table = packed.forward_table().unwrap();
        let lens = [
            seen(160),
            seen(96),
            seen(96),
            seen(160),
            seen(20),
            seen(4),
            seen(3),
        ];
        assert!(matches!(
            check_buffers(&table, &lens, 1),
            Err(Error::InvalidArgument {
                arg: "cu_seqlens_k",
                ..
            })
        ));
    }

    #[test]
    fn views_of_one_fused_buffer_pass_and_outputs_over_inputs_fail() {
        // q, k, v and dq, dk, dv as column views of fused [B, S, (Hq + 2·Hkv)·d] buffers.
        let (b, s, hq, hkv, d) = (2, 4, 4, 2, 8);
        let row = (hq + 2 * hkv) * d;
        let st = Strides {
            batch: s * row,
            token: row,
            head: d,
        };
        let args = AttentionArgs::new(b, s, s, hq, hkv, d)
            .with_strides(st, st, st)
            .with_grad_strides(st, st, st);
        let table = args.backward_table().unwrap();
        let n = b * s * row;
        let e = 2u64;
        let seen = |len: usize| {
            Some(Seen {
                len,
                context: 1,
                elem_bytes: 2,
            })
        };
        let lens = [
            seen(n),
            seen(n - hq * d),
            seen(n - (hq + hkv) * d),
            seen(b * s * hq * d),
            seen(b * s * hq * d),
            Some(Seen {
                len: b * hq * s,
                context: 1,
                elem_bytes: 4,
            }),
            seen(n),
            seen(n - hq * d),
            seen(n - (hq + hkv) * d),
            None,
            None,
        ];
        check_buffers(&table, &lens, 1).unwrap();
        let (qkv, o, d_o, lse, grads) =
            (0x10000u64, 0x40000u64, 0x50000u64, 0x60000u64, 0x80000u64);
        let k_at = (hq * d) as u64 * e;
        let v_at = ((hq + hkv) * d) as u64 * e;
        let ptrs = [
            qkv,
            qkv + k_at,
            qkv + v_at,
            o,
            d_o,
            lse,
            grads,
            grads + k_at,
            grads + v_at,
            0,
            0,
        ];
        check_disjoint(&table, &lens, &ptrs).unwrap();
        // dk written over the fused input: rejected, naming dk.
        let mut bad = ptrs;
        bad[7] = qkv + k_at;
        assert_eq!(
            check_disjoint(&table, &lens, &bad),
            Err(Error::Aliasing {
                output: "dk",
                other: "k"
            })
        );
    }
}
