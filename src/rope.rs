//! RoPE forward and backward launchers (kernels: `kernels-gpu/src/rope.rs`, reference:
//! [`crate::reference::rope`], semantics: DESIGN.md §3).
use crate::dtype::Dtype;
use crate::error::{Result, invalid};
use crate::launch::{Region, disjoint, exactly, item_grid, same_context};
use crate::module::kernels;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Heads one thread of a vector kernel rotates per step, for elements of `size` bytes
/// (`vec_heads` in `kernels-gpu/src/rope.rs`; must match): 2 in 16-bit types, 4 in f32.
fn vec_heads(size: usize) -> usize {
    match size {
        2 => 2,
        _ => 4,
    }
}

/// Threads per block of the scalar kernels: one block covers `BLOCK_THREADS / pairs` tokens when a token has fewer
/// pairs than this, else one token in `⌈pairs / BLOCK_THREADS⌉` passes.
const BLOCK_THREADS: usize = 256;

/// Shape of a RoPE call: q is `[batch, seq_len, q_heads, head_dim]` and k is
/// `[batch, seq_len, k_heads, head_dim]`, both contiguous (HuggingFace's
/// `proj(h).view(B, S, H, d)`, before its `.transpose(1, 2)`).
///
/// Only the first `rotary_dim` dims of each head rotate (NeoX half split inside them: dim `i`
/// pairs with `i + rotary_dim / 2`); dims `rotary_dim..head_dim` are left untouched (not even
/// rewritten). Each cos/sin row is `rotary_dim` long, as HuggingFace passes them for partial
/// rotary; only its first half is read (HF tables are `cat(freqs, freqs)`).
///
/// ```
/// use liger_rs::RopeArgs;
/// // Llama-3-8B attention: 32 q heads, 8 kv heads of 128; a partial-rotary variant.
/// let args = RopeArgs::new(2, 4096, 32, 8, 128);
/// assert_eq!(args.rotary_dim, 128);
/// assert_eq!(args.with_rotary_dim(64).rotary_dim, 64);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// cos/sin row.
    pub rotary_dim: usize,
}

impl RopeArgs {
    /// Full rotary (`rotary_dim = head_dim`).
    ///
    /// ```
    /// let args = liger_rs::RopeArgs::new(1, 16, 4, 4, 64);
    /// assert_eq!((args.seq_len, args.rotary_dim), (16, 64));
    /// ```
    pub fn new(
        batch: usize,
        seq_len: usize,
        q_heads: usize,
        k_heads: usize,
        head_dim: usize,
    ) -> Self {
        RopeArgs {
            batch,
            seq_len,
            q_heads,
            k_heads,
            head_dim,
            rotary_dim: head_dim,
        }
    }

    /// Sets the rotary dim (partial rotary: only the first `rotary_dim` dims rotate).
    ///
    /// ```
    /// assert_eq!(liger_rs::RopeArgs::new(1, 1, 1, 1, 128).with_rotary_dim(32).rotary_dim, 32);
    /// ```
    pub fn with_rotary_dim(self, rotary_dim: usize) -> Self {
        RopeArgs { rotary_dim, ..self }
    }

    /// Validates the shape; returns the sizes the launch needs (also used by the reference).
    pub(crate) fn check(&self) -> Result<RopeSizes> {
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
        if self.k_heads == 0 {
            return Err(invalid("args.k_heads", "at least 1", 0));
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
        let per_token = |heads: usize| heads.checked_mul(d).and_then(|n| n.checked_mul(tokens));
        let q_len = per_token(self.q_heads).ok_or_else(overflow)?;
        let k_len = per_token(self.k_heads).ok_or_else(overflow)?;
        Ok(RopeSizes {
            tokens,
            q_len,
            k_len,
            pairs,
        })
    }
}

/// Element counts derived from a checked [`RopeArgs`].
pub(crate) struct RopeSizes {
    /// `batch × seq_len`.
    pub(crate) tokens: usize,
    /// Elements of q.
    pub(crate) q_len: usize,
    /// Elements of k.
    pub(crate) k_len: usize,
    /// Rotated pairs per token, `(q_heads + k_heads) × rotary_dim / 2` (< 2^31).
    pub(crate) pairs: usize,
}

/// Where each token's cos/sin row comes from. Every row is `rotary_dim` elements of the
/// tensor dtype; token `(b, s)` is element `b·seq_len + s` of the flattened `[B, S]`.
///
/// ```no_run
/// use liger_rs::{CosSinLayout, PositionIds};
/// // Packed sequences of lengths 3 and 2 in one row of the batch: positions restart.
/// let ids: [i64; 5] = [0, 1, 2, 0, 1];
/// let layout = CosSinLayout::Gathered(PositionIds::Host(&ids));
/// # let _ = layout;
/// ```
#[derive(Debug)]
pub enum CosSinLayout<'a> {
    /// cos, sin: `[seq_len, rotary_dim]`, shared by every batch row (token `(b, s)` uses row `s`).
    PerPosition,
    /// cos, sin: `[batch, seq_len, rotary_dim]` (what HF's `LlamaRotaryEmbedding` returns).
    PerBatch,
    /// cos, sin: a table `[max_pos, rotary_dim]` (`max_pos = cos.len() / rotary_dim ≥ 1`),
    /// token `(b, s)` uses row `position_ids[b·seq_len + s]`.
    Gathered(PositionIds<'a>),
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

/// RoPE forward (NeoX half-split rotation by θ), in place on `q` and `k`, in one launch.
///
/// For every head of q and k and every `i < r/2` (`r = args.rotary_dim`), with
/// `x1 = x[i]`, `x2 = x[i + r/2]` and `c`, `s` = element `i` of the token's cos/sin row:
/// `x[i] ← x1·c − x2·s`, `x[i + r/2] ← x2·c + x1·s`, computed in f32 (each product rounded
/// to f32, no FMA) and rounded once to `T`. Dims `r..head_dim` are not written.
///
/// `q` must hold exactly `batch × seq_len × q_heads × head_dim` elements and `k`
/// `batch × seq_len × k_heads × head_dim` (layouts: [`RopeArgs`]); `cos`/`sin` are laid out
/// as `layout` says (their lengths must match it exactly; `sin` like `cos`). `q` and `k` must
/// not overlap each other, `cos`, `sin` or device position ids. One launch on `stream`, no
/// synchronisation, no allocation (except for [`PositionIds::Host`]).
///
/// ```no_run
/// use liger_rs::{CosSinLayout, RopeArgs, rope_forward};
/// use half::bf16;
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
/// let args = RopeArgs::new(b, s, hq, hk, d);
/// rope_forward(&stream, &args, &mut q, &mut k, &cos, &sin, &CosSinLayout::PerPosition)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    q: &mut impl DevicePtrMut<T>,
    k: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    rope(stream, args, Direction::Forward, q, k, cos, sin, layout)
}

/// RoPE backward (rotation by −θ), in place on the gradients `dq` and `dk`, in one launch.
///
/// With `dy1 = dx[i]`, `dy2 = dx[i + r/2]`: `dx[i] ← dy1·c + dy2·s`,
/// `dx[i + r/2] ← dy2·c − dy1·s`, f32 math and one rounding to `T`. `dq`/`dk` have the
/// shapes of `q`/`k`; `cos`, `sin` and `layout` are those of the forward. Otherwise as
/// [`rope_forward`].
///
/// ```no_run
/// use liger_rs::{CosSinLayout, PositionIds, RopeArgs, rope_backward};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (b, s, hq, hk, d, max_pos) = (1, 4, 4, 1, 64, 4096);
/// // Partial rotary: the first 32 dims rotate; cos/sin rows are 32 long.
/// let args = RopeArgs::new(b, s, hq, hk, d).with_rotary_dim(32);
/// let cos = stream.clone_htod(&vec![1.0f32; max_pos * 32])?;
/// let sin = stream.alloc_zeros::<f32>(max_pos * 32)?;
/// let ids = stream.clone_htod(&[0i32, 1, 0, 1])?; // device ids: clamped by the kernel
/// let layout = CosSinLayout::Gathered(PositionIds::DeviceI32(ids.as_view()));
/// let mut dq = stream.clone_htod(&vec![1.0f32; b * s * hq * d])?;
/// let mut dk = stream.clone_htod(&vec![1.0f32; b * s * hk * d])?;
/// rope_backward(&stream, &args, &mut dq, &mut dk, &cos, &sin, &layout)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    rope(stream, args, Direction::Backward, dq, dk, cos, sin, layout)
}

#[derive(Clone, Copy)]
enum Direction {
    Forward,
    Backward,
}

impl Direction {
    /// Kernel-name part and the names of the two in-place buffers.
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Direction::Forward => ("fwd", "q", "k"),
            Direction::Backward => ("bwd", "dq", "dk"),
        }
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

/// Elements per 16-byte vector if the vector kernels (`rope_{dir}_v_*`) apply, else `None`.
///
/// They need 16-byte aligned `q`, `k`, `cos`, `sin` (`ptrs`); `head_dim` and
/// `half = rotary_dim / 2` multiples of the lanes (so each half of each head, and each cos/sin
/// row, is whole aligned vectors; the dims past `rotary_dim` are then never touched, as in the
/// scalar kernels); at most `BLOCK_THREADS` vectors per half (one thread each); and a token's
/// `(q_heads + k_heads) × head_dim` below 2^31 (32-bit offsets within a token).
fn vector_lanes(args: &RopeArgs, elem_bytes: usize, ptrs: [u64; 4]) -> Option<usize> {
    let lanes = 16 / elem_bytes;
    let half = args.rotary_dim / 2;
    let token_elems = (args.q_heads.checked_add(args.k_heads))
        .and_then(|h| h.checked_mul(args.head_dim))
        .unwrap_or(usize::MAX);
    let ok = ptrs.iter().all(|p| p.is_multiple_of(16))
        && args.head_dim.is_multiple_of(lanes)
        && half.is_multiple_of(lanes)
        && half / lanes <= BLOCK_THREADS
        && token_elems < 1 << 31;
    ok.then_some(lanes)
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

#[allow(clippy::too_many_arguments)]
fn rope<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &RopeArgs,
    direction: Direction,
    q: &mut impl DevicePtrMut<T>,
    k: &mut impl DevicePtrMut<T>,
    cos: &impl DevicePtr<T>,
    sin: &impl DevicePtr<T>,
    layout: &CosSinLayout<'_>,
) -> Result<()> {
    let (dir, q_name, k_name) = direction.names();
    let sizes = args.check()?;
    let r = args.rotary_dim;
    same_context(stream, q_name, q)?;
    same_context(stream, k_name, k)?;
    same_context(stream, "cos", cos)?;
    same_context(stream, "sin", sin)?;
    exactly(
        q_name,
        q.len(),
        sizes.q_len,
        "batch × seq_len × q_heads × head_dim",
    )?;
    exactly(
        k_name,
        k.len(),
        sizes.k_len,
        "batch × seq_len × k_heads × head_dim",
    )?;

    // The cos/sin rows: how many there are and which kernel variant selects them.
    let table_rows = match layout {
        CosSinLayout::PerPosition => {
            let need = args
                .seq_len
                .checked_mul(r)
                .ok_or_else(|| invalid("cos", "seq_len × rotary_dim within usize", args.seq_len))?;
            exactly("cos", cos.len(), need, "seq_len × rotary_dim")?;
            args.seq_len
        }
        CosSinLayout::PerBatch => {
            let need = sizes.tokens.checked_mul(r).ok_or_else(|| {
                invalid(
                    "cos",
                    "batch × seq_len × rotary_dim within usize",
                    sizes.tokens,
                )
            })?;
            exactly("cos", cos.len(), need, "batch × seq_len × rotary_dim")?;
            sizes.tokens
        }
        CosSinLayout::Gathered(_) => {
            if cos.len() == 0 || !cos.len().is_multiple_of(r) {
                return Err(invalid(
                    "cos",
                    format!("a table of max_pos ≥ 1 rows of rotary_dim = {r} elements"),
                    format!("length {}", cos.len()),
                ));
            }
            cos.len() / r
        }
    };
    exactly("sin", sin.len(), cos.len(), "the length of cos")?;
    let variant = match layout {
        CosSinLayout::PerPosition => "pos",
        CosSinLayout::PerBatch => "batch",
        CosSinLayout::Gathered(ids) => {
            let len = match ids {
                PositionIds::Host(h) => h.len(),
                PositionIds::DeviceI32(v) => {
                    same_context(stream, "position_ids", v)?;
                    v.len()
                }
                PositionIds::DeviceI64(v) => {
                    same_context(stream, "position_ids", v)?;
                    v.len()
                }
            };
            exactly("position_ids", len, sizes.tokens, "batch × seq_len")?;
            match ids {
                PositionIds::Host(h) => {
                    if let Some((i, &id)) = h
                        .iter()
                        .enumerate()
                        .find(|&(_, &id)| id < 0 || id as u64 >= table_rows as u64)
                    {
                        return Err(invalid(
                            "position_ids",
                            format!(
                                "ids in 0 ..= {} (rows of the cos/sin table)",
                                table_rows - 1
                            ),
                            format!("position_ids[{i}] = {id}"),
                        ));
                    }
                    "ids64"
                }
                PositionIds::DeviceI32(_) => "ids32",
                PositionIds::DeviceI64(_) => "ids64",
            }
        }
    };
    if sizes.tokens == 0 {
        return Ok(());
    }

    let (q_ptr, _q) = q.device_ptr_mut(stream);
    let (k_ptr, _k) = k.device_ptr_mut(stream);
    let (cos_ptr, _cos) = cos.device_ptr(stream);
    let (sin_ptr, _sin) = sin.device_ptr(stream);
    let (ids_ptr, _ids, ids_region) = match layout {
        CosSinLayout::Gathered(PositionIds::DeviceI32(v)) => {
            let (p, g) = v.device_ptr(stream);
            (p, Some(g), Region::new::<i32>("position_ids", p, v.len()))
        }
        CosSinLayout::Gathered(PositionIds::DeviceI64(v)) => {
            let (p, g) = v.device_ptr(stream);
            (p, Some(g), Region::new::<i64>("position_ids", p, v.len()))
        }
        _ => (0, None, Region::new::<i64>("position_ids", 0, 0)),
    };
    disjoint(
        &[
            Region::new::<T>(q_name, q_ptr, sizes.q_len),
            Region::new::<T>(k_name, k_ptr, sizes.k_len),
        ],
        &[
            Region::new::<T>("cos", cos_ptr, cos.len()),
            Region::new::<T>("sin", sin_ptr, sin.len()),
            ids_region,
        ],
    )?;
    // Host ids go up only now that every check has passed; a fresh allocation is disjoint
    // from every argument by construction.
    let uploaded: Option<CudaSlice<i64>> = match layout {
        CosSinLayout::Gathered(PositionIds::Host(h)) => Some(stream.clone_htod(*h)?),
        _ => None,
    };
    let (ids_ptr, _uploaded) = match uploaded.as_ref() {
        Some(u) => {
            let (p, g) = u.device_ptr(stream);
            (p, Some(g))
        }
        None => (ids_ptr, None),
    };

    let kernels = kernels(stream.context())?;
    let ptrs = [q_ptr, k_ptr, cos_ptr, sin_ptr];
    let cfg = match vector_lanes(args, std::mem::size_of::<T>(), ptrs) {
        Some(lanes) => {
            let func = kernels.function(&format!("rope_{dir}_v_{}_{variant}", T::NAME))?;
            let heads = args.q_heads + args.k_heads;
            let vec_heads = vec_heads(std::mem::size_of::<T>());
            let (bx, by, bz) = vector_block(r / 2 / lanes, heads, sizes.tokens, vec_heads);
            let threads = bx * by * bz;
            // Grid-stride over tokens: as many blocks as are resident at once, at most one per
            // `bz` tokens; with many waves of token steps, one block per step (`item_grid`: the
            // kernel holds nothing for its next step, so it is its own twin).
            let resident = kernels.resident_blocks(&func, threads, 0)?;
            let steps = sizes.tokens.div_ceil(bz as usize);
            let (_, blocks) = item_grid(steps, resident, true);
            (
                func,
                LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (bx, by, bz),
                    shared_mem_bytes: 0,
                },
            )
        }
        None => {
            let func = kernels.function(&format!("rope_{dir}_{}_{variant}", T::NAME))?;
            let (tx, ty) = block_shape(sizes.pairs);
            let blocks = sizes.tokens.div_ceil(ty as usize).min(i32::MAX as usize);
            (
                func,
                LaunchConfig {
                    grid_dim: (blocks as u32, 1, 1),
                    block_dim: (tx, ty, 1),
                    shared_mem_bytes: 0,
                },
            )
        }
    };
    let (func, cfg) = cfg;
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
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&q_ptr)
        .arg(&k_ptr)
        .arg(&cos_ptr)
        .arg(&sin_ptr)
        .arg(&ids_ptr);
    for v in &dims {
        launch.arg(v);
    }
    // SAFETY: argument order and types match `rope_kernel!` in kernels-gpu (the same for the
    // scalar and the `_v_` kernels: 5 pointers, then
    // tokens, seq_len, q_heads, k_heads, head_dim, rotary_dim, table_rows as u64). `q`/`k` were
    // checked to hold exactly tokens × heads × head_dim elements and to be disjoint from each
    // other and the inputs; cos/sin hold every row the variant selects (`seq_len` rows for
    // `pos`, `tokens` for `batch`, `table_rows` for `ids*`, whose ids the kernel clamps), and
    // the ids buffer holds `tokens` ids of the variant's type. `rotary_dim` is even,
    // 2 ..= head_dim, and the per-token pair count is < 2^31. A `_v_` kernel runs only where
    // `vector_lanes` established its alignment and divisibility requirements, with
    // `blockDim.x = half / lanes` as it requires.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn vector_path_needs_whole_aligned_vectors_in_each_half() {
        let a = |d: usize, r: usize| RopeArgs::new(2, 3, 32, 8, d).with_rotary_dim(r);
        let aligned = [0x1000u64, 0x2000, 0x3000, 0x4000];
        // (d, r, bytes per element) → lanes or None.
        let cases = [
            ((128, 128, 2), Some(8)),
            ((128, 128, 4), Some(4)),
            ((64, 64, 2), Some(8)),
            ((256, 256, 2), Some(8)),
            ((96, 96, 2), Some(8)),  // half 48 = 6 vectors
            ((80, 80, 2), Some(8)),  // half 40 = 5 vectors
            ((80, 80, 4), Some(4)),  // half 40 = 10 vectors
            ((128, 64, 2), Some(8)), // partial rotary, half 32
            ((80, 32, 2), Some(8)),  // partial rotary, half 16
            ((8, 8, 4), Some(4)),    // half 4 = 1 vector
            ((92, 92, 2), None),     // head_dim·2 = 184 not a multiple of 16
            ((92, 92, 4), None),     // half 46 not a multiple of 4
            ((128, 40, 2), None),    // partial rotary, half 20 not a multiple of 8
            ((80, 60, 4), None),     // partial rotary, half 30 not a multiple of 4
            ((8, 8, 2), None),       // half 4 < 8 lanes
            ((6, 6, 4), None),
            ((16, 2, 2), None),
        ];
        for ((d, r, bytes), want) in cases {
            assert_eq!(
                vector_lanes(&a(d, r), bytes, aligned),
                want,
                "d={d} r={r} {bytes}B"
            );
        }
        // Any misaligned pointer (a view at an odd offset) takes the scalar path.
        for i in 0..4 {
            let mut p = aligned;
            p[i] += 2;
            assert_eq!(vector_lanes(&a(128, 128), 2, p), None, "pointer {i}");
            p[i] += 6; // 8-byte aligned: still not 16
            assert_eq!(vector_lanes(&a(128, 128), 2, p), None, "pointer {i}");
        }
        // More than BLOCK_THREADS vectors in a half, or 2^31 elements per token: scalar.
        let wide = RopeArgs::new(1, 1, 1, 1, 4096);
        assert_eq!(vector_lanes(&wide, 2, aligned), Some(8)); // 256 vectors per half
        assert_eq!(vector_lanes(&wide, 4, aligned), None); // 512
        let many = RopeArgs::new(1, 1, 1 << 24, 1 << 24, 64);
        assert_eq!(vector_lanes(&many, 2, aligned), None);
    }

    #[test]
    fn vector_block_covers_the_token_in_one_step_within_256_threads() {
        // The benchmark shape: 40 heads, d = 128 → 8 (16-bit, 2 heads per step) or 16 (f32, 4
        // heads per step) vectors per half.
        assert_eq!(vector_block(8, 40, 16384, vec_heads(2)), (8, 20, 1)); // 160 threads
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
    fn args_are_checked_without_overflow() {
        let ok = RopeArgs::new(2, 3, 4, 1, 8).check().unwrap();
        assert_eq!((ok.tokens, ok.q_len, ok.k_len, ok.pairs), (6, 192, 48, 20));
        let bad = |a: RopeArgs| match a.check() {
            Err(crate::Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("{a:?}: {:?}", other.map(|s| s.tokens)),
        };
        assert_eq!(bad(RopeArgs::new(1, 1, 1, 1, 7)), "args.head_dim");
        assert_eq!(bad(RopeArgs::new(1, 1, 1, 1, 0)), "args.head_dim");
        let a = RopeArgs::new(1, 1, 1, 1, 8);
        assert_eq!(bad(a.with_rotary_dim(3)), "args.rotary_dim");
        assert_eq!(bad(a.with_rotary_dim(0)), "args.rotary_dim");
        assert_eq!(bad(a.with_rotary_dim(10)), "args.rotary_dim");
        assert_eq!(bad(RopeArgs::new(1, 1, 0, 1, 8)), "args.q_heads");
        assert_eq!(bad(RopeArgs::new(1, 1, 1, 0, 8)), "args.k_heads");
        assert_eq!(bad(RopeArgs::new(usize::MAX, 2, 1, 1, 8)), "args");
        assert_eq!(bad(RopeArgs::new(1, 1, usize::MAX, 1, 8)), "args");
        assert_eq!(bad(RopeArgs::new(1, 1, 1 << 30, 1 << 30, 4)), "args");
    }
}
