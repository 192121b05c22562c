//! Fused linear cross-entropy (Liger-Kernel's FLCE): the LM head's logits `x·Wᵀ (+ b)` and
//! their cross-entropy chunk by chunk of tokens, so that only one chunk of logits is ever
//! held, with the gradients of x, W and b computed in the same walk.
use super::abi;
use super::args::{CrossEntropyArgs, Reduction};
use super::launch::{self, Ptrs};
use super::plan::{self, Options};
use crate::blas::{Blas, Gemm};
use crate::dtype::Dtype;
use crate::error::{Result, invalid};
use crate::identity::{CePass, ElemType};
use crate::validate::{Access, Buf, Need, Spec, Table, read, validate, write};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use std::sync::Arc;

/// The shape and options of a fused linear cross-entropy call: `tokens` rows of `x`
/// `[tokens, hidden]`, the head `W [vocab, hidden]`, and the cross-entropy's options
/// ([`CrossEntropyArgs`], whose `rows` are the tokens).
///
/// ```
/// use liger_rs::{CrossEntropyArgs, LinearCrossEntropyArgs};
/// let args = LinearCrossEntropyArgs::new(8192, 4096, 128256);
/// assert_eq!(args.chunk_tokens(), 1024);
/// assert_eq!(args.with_chunk(256).chunk_tokens(), 256);
/// let ce = CrossEntropyArgs::new(8192, 128256).with_lse_square_scale(1e-4);
/// assert_eq!(LinearCrossEntropyArgs::with_ce(4096, ce).ce.lse_square_scale, 1e-4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LinearCrossEntropyArgs {
    /// The hidden size (x's row length, W's row length).
    pub hidden: usize,
    /// The cross-entropy over the logits: `rows` = tokens, `vocab` = W's rows (its strides
    /// are the chunk's and are set by the call).
    pub ce: CrossEntropyArgs,
    /// Tokens per chunk, or `None` for [`LinearCrossEntropyArgs::chunk_tokens`]'s rule.
    pub chunk: Option<usize>,
}

impl LinearCrossEntropyArgs {
    /// The fewest tokens per chunk by default: each chunk adds its share of dW (f32) by a GEMM
    /// whose inner dimension is the chunk, reading and writing all of dW; at 1024 tokens that
    /// costs 8 bytes per 2048 FLOPs of dW, where Liger's 256 at 8192 × 4096 × 128256 (bf16) made
    /// the call 1.8× slower on an H200 (75.8 ms against 41.5 ms) for 188 MiB less scratch.
    pub const MIN_CHUNK: usize = 1024;

    /// `tokens × hidden` inputs to a head of `vocab` classes, PyTorch's cross-entropy defaults.
    pub fn new(tokens: usize, hidden: usize, vocab: usize) -> Self {
        Self::with_ce(hidden, CrossEntropyArgs::new(tokens, vocab))
    }

    /// Inputs of `hidden` to the cross-entropy `ce` describes.
    pub fn with_ce(hidden: usize, ce: CrossEntropyArgs) -> Self {
        LinearCrossEntropyArgs {
            hidden,
            ce,
            chunk: None,
        }
    }

    /// Sets the tokens per chunk.
    pub fn with_chunk(mut self, tokens: usize) -> Self {
        self.chunk = Some(tokens);
        self
    }

    /// Tokens per chunk (at most the tokens): the set value, else the larger of
    /// [`Self::MIN_CHUNK`] and Liger-Kernel's rule, the power of two at or above
    /// `tokens / ⌈vocab / hidden⌉` (a chunk of logits about as large as x).
    pub fn chunk_tokens(&self) -> usize {
        let tokens = self.ce.rows.max(1);
        self.chunk
            .unwrap_or_else(|| {
                let inc = self.ce.vocab.div_ceil(self.hidden.max(1)).max(1);
                tokens
                    .div_ceil(inc)
                    .next_power_of_two()
                    .max(Self::MIN_CHUNK)
            })
            .min(tokens)
    }

    /// The call's buffers, in the public function's order (the gradients by their field
    /// names), after the scalars' checks.
    pub(crate) fn table(&self) -> Result<Table<10>> {
        self.ce.check()?;
        // cuBLAS takes dimensions and leading dimensions as 32-bit ints.
        if self.hidden == 0 || self.hidden > i32::MAX as usize {
            let expected = "1 ..= 2147483647 (cuBLAS's 32-bit dimensions)";
            return Err(invalid("args.hidden", expected, self.hidden));
        }
        if self.chunk == Some(0) {
            return Err(invalid("args.chunk", "at least 1 token", 0));
        }
        if self.chunk_tokens() > i32::MAX as usize {
            let expected = "at most 2147483647 tokens per chunk (cuBLAS's 32-bit dimensions)";
            return Err(invalid("args.chunk", expected, self.chunk_tokens()));
        }
        let (t, h, v) = (self.ce.rows, self.hidden, self.ce.vocab);
        let elems = |a: usize, b: usize, arg: &'static str| {
            a.checked_mul(b)
                .ok_or_else(|| invalid(arg, "a size within usize", format!("{a} × {b}")))
        };
        let (x, w) = (elems(t, h, "x")?, elems(v, h, "weight")?);
        let per_loss = Need::Exactly(self.ce.loss_len(), "tokens with Reduction::None, else 1");
        Ok(Table {
            specs: [
                Spec::read("x", Need::Exactly(x, "tokens × hidden")),
                Spec::read("weight", Need::Exactly(w, "vocab × hidden")),
                Spec::read("bias", Need::Exactly(v, "vocab")),
                Spec::read("target", Need::Exactly(t, "tokens")),
                Spec::read("ce_weight", Need::Exactly(v, "vocab")),
                Spec::written("loss", per_loss),
                Spec::written("z_loss", per_loss),
                Spec::written("dx", Need::Exactly(x, "tokens × hidden")),
                Spec::written("dweight", Need::Exactly(w, "vocab × hidden")),
                Spec::written("dbias", Need::Exactly(v, "vocab")),
            ],
            empty: false,
        })
    }
}

/// A bias and its gradient come together.
pub(crate) fn check_bias(bias: bool, dbias: bool) -> Result<()> {
    if bias != dbias {
        let (expected, got) = if bias {
            ("a dbias buffer for the bias", "none")
        } else {
            ("no dbias without a bias", "a dbias buffer")
        };
        return Err(invalid("dbias", expected, got));
    }
    Ok(())
}

/// The gradients a fused linear cross-entropy call writes.
pub struct LinearCrossEntropyGrads<'a, T> {
    /// `∂loss/∂x`, `[tokens, hidden]` in x's type.
    pub dx: &'a mut dyn DevicePtrMut<T>,
    /// `∂loss/∂W`, `f32 [vocab, hidden]`: summed over the chunks in f32.
    pub dweight: &'a mut dyn DevicePtrMut<f32>,
    /// `∂loss/∂b`, `f32 [vocab]`, with a bias.
    pub dbias: Option<&'a mut dyn DevicePtrMut<f32>>,
}

/// Fused linear cross-entropy forward and backward in one call: the loss of
/// `cross_entropy(x·Wᵀ + b, target)` ([`CrossEntropyArgs`]'s formula and options) and its
/// gradients for an upstream gradient of 1 (scale them by the loss's upstream gradient
/// afterwards; with [`Reduction::None`] they are those of the rows' sum), without ever holding
/// more than one chunk of logits.
///
/// x `[tokens, hidden]`, weight `[vocab, hidden]`, bias `[vocab]` (in x's type), target `i64
/// [tokens]`, ce_weight (class weights) `f32 [vocab]`, loss and z_loss `f32
/// [args.ce.loss_len()]`, gradients as [`LinearCrossEntropyGrads`] says. Per chunk of
/// [`LinearCrossEntropyArgs::chunk_tokens`] tokens: cuBLAS computes the logits in x's type
/// (f32 accumulation, rounded once), the cross-entropy kernel adds the bias, takes the loss
/// and overwrites the logits with their gradient, and cuBLAS computes the chunk's rows of dx
/// and adds the chunk's share of dW (and db) in f32.
///
/// Scratch on `stream`, freed behind the call: the chunk of logits (`chunk × vocab`
/// elements), the per-row losses of a reduced call, a 32 MiB cuBLAS workspace.
///
/// ```no_run
/// use liger_rs::{LinearCrossEntropyArgs, LinearCrossEntropyGrads, fused_linear_cross_entropy, half::bf16};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let args = LinearCrossEntropyArgs::new(4096, 2048, 32000);
/// let x = stream.alloc_zeros::<bf16>(4096 * 2048)?;
/// let w = stream.alloc_zeros::<bf16>(32000 * 2048)?;
/// let target = stream.clone_htod(&vec![1i64; 4096])?;
/// let (mut loss, mut dx) = (stream.alloc_zeros::<f32>(1)?, stream.alloc_zeros::<bf16>(4096 * 2048)?);
/// let mut dw = stream.alloc_zeros::<f32>(32000 * 2048)?;
/// let grads = LinearCrossEntropyGrads { dx: &mut dx, dweight: &mut dw, dbias: None };
/// fused_linear_cross_entropy(&stream, &args, &x, &w, None, &target, None, &mut loss, None, grads)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// As [`crate::cross_entropy_forward`] for the options and every buffer (x, weight, dx and
/// dweight hold exactly their shapes); [`Error::NoBlas`](crate::Error::NoBlas) without
/// cuBLAS, [`Error::Blas`](crate::Error::Blas) when a GEMM fails. A rejected call launches
/// nothing.
#[allow(clippy::too_many_arguments)]
pub fn fused_linear_cross_entropy<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &LinearCrossEntropyArgs,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    target: &impl DevicePtr<i64>,
    ce_weight: Option<&dyn DevicePtr<f32>>,
    loss: &mut impl DevicePtrMut<f32>,
    z_loss: Option<&mut dyn DevicePtrMut<f32>>,
    grads: LinearCrossEntropyGrads<'_, T>,
) -> Result<()> {
    let table = args.table()?;
    check_bias(bias.is_some(), grads.dbias.is_some())?;
    let bufs = [
        read(x),
        read(weight),
        bias.and_then(|b| read(b)),
        Some(Buf::I64(Access::Read(target))),
        ce_weight.map(|w| Buf::F32(Access::Read(w))),
        Some(Buf::F32(Access::Write(loss))),
        z_loss.map(|z| Buf::F32(Access::Write(z))),
        write(grads.dx),
        Some(Buf::F32(Access::Write(grads.dweight))),
        grads.dbias.map(|d| Buf::F32(Access::Write(d))),
    ];
    let Some(taken) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let [x, w, b, target, ce_w, loss, z_loss, dx, dw, db] = taken.ptrs;
    let (tokens, hidden, vocab) = (args.ce.rows, args.hidden, args.ce.vocab);
    let size = T::ELEM.size() as u64;
    let chunk = args.chunk_tokens();
    let blas = Blas::on(stream)?;
    // The chunk of logits (then their gradient), the ones that sum dz's columns into db, the
    // per-row losses and the count kernel's statistics: stream-ordered scratch.
    let logits: CudaSlice<T> = stream.alloc_zeros(chunk * vocab)?;
    let (logits, _logits_use) = logits.device_ptr(stream);
    let ones: Option<CudaSlice<T>> = match b {
        0 => None,
        _ => Some(stream.alloc_zeros(chunk)?),
    };
    let ones_ptr = match &ones {
        Some(o) => {
            let (p, _use) = o.device_ptr(stream);
            let one = match T::ELEM {
                ElemType::F32 => None,
                ElemType::F16 => Some(0x3c00u16),
                ElemType::Bf16 => Some(0x3f80u16),
            };
            // SAFETY: `chunk` elements of T at `p`, ordered on the stream.
            unsafe {
                match one {
                    Some(bits) => sys::cuMemsetD16Async(p, bits, chunk, stream.cu_stream()),
                    None => sys::cuMemsetD32Async(p, 1f32.to_bits(), chunk, stream.cu_stream()),
                }
            }
            .result()?;
            p
        }
        None => 0,
    };
    let reduced = args.ce.reduction != Reduction::None;
    let z_rows = reduced && (args.ce.lse_square_scale != 0.0 || z_loss != 0);
    let rows = if reduced { tokens } else { 0 };
    let zs = if z_rows { tokens } else { 0 };
    let scratch: CudaSlice<f32> = stream.alloc_zeros(rows + zs + abi::STATS)?;
    let (base, _scratch_use) = scratch.device_ptr(stream);
    let at = |i: usize| base + 4 * i as u64;
    let ce = args.ce.with_logits_stride(vocab).with_grad_stride(vocab);
    let opts = Options {
        weighted: ce_w != 0,
        bias: b != 0,
    };
    let max_blocks = plan::max_stage_blocks(crate::module::kernels(stream.context())?.sm90);
    let path = plan::gradient_path(
        plan::path(&ce, T::ELEM, opts, &[logits, b], &[vocab]),
        vocab,
        T::ELEM,
        max_blocks,
    );
    let ptrs = Ptrs {
        logits,
        grad: logits,
        target,
        weight: ce_w,
        bias: b,
        row_loss: if reduced { at(0) } else { loss },
        row_z: match (reduced, z_rows) {
            (true, true) => at(rows),
            (true, false) => 0,
            (false, _) => z_loss,
        },
        lse: 0,
        grad_loss: 0,
        stats: at(rows + zs),
        total: if reduced { loss } else { 0 },
        total_z: if reduced { z_loss } else { 0 },
    };
    let whole = launch::params(&ce, &ptrs, vocab);
    let count: Vec<plan::Step> = ce
        .needs_count(opts.weighted)
        .then(|| plan::stats_step(CePass::Count))
        .into_iter()
        .collect();
    let reduce: Vec<plan::Step> = reduced
        .then(|| plan::stats_step(CePass::Reduce))
        .into_iter()
        .collect();
    // SAFETY (every launch and GEMM below): `validate` checked every buffer against the
    // shapes; the scratch spans what the pointers name in it; all of it is ordered on
    // `stream` and freed behind the queued work.
    unsafe { launch::run(stream, &count, &whole)? };
    let mut c0 = 0;
    while c0 < tokens {
        let n = chunk.min(tokens - c0);
        let xc = x + c0 as u64 * hidden as u64 * size;
        // logitsᵀ (vocab × n, column-major) = W (hidden × vocab)ᵀ · xᵀ (hidden × n).
        unsafe {
            blas.gemm::<T>(&Gemm {
                trans_a: true,
                trans_b: false,
                m: vocab,
                n,
                k: hidden,
                a: w,
                lda: hidden,
                b: xc,
                ldb: hidden,
                c: logits,
                ldc: vocab,
                c_type: T::ELEM,
                beta: 0.0,
            })?
        };
        let rows_args = CrossEntropyArgs { rows: n, ..ce };
        let chunk_ptrs = Ptrs {
            target: target + 8 * c0 as u64,
            row_loss: ptrs.row_loss + 4 * c0 as u64,
            row_z: if ptrs.row_z != 0 {
                ptrs.row_z + 4 * c0 as u64
            } else {
                0
            },
            total: 0,
            total_z: 0,
            ..ptrs
        };
        let row_step = plan::rows_step(&rows_args, CePass::Forward, T::ELEM, path, max_blocks);
        unsafe {
            launch::run(
                stream,
                &[row_step],
                &launch::params(&rows_args, &chunk_ptrs, vocab),
            )?
        };
        // dxᵀ (hidden × n) = W (hidden × vocab) · dzᵀ (vocab × n).
        unsafe {
            blas.gemm::<T>(&Gemm {
                trans_a: false,
                trans_b: false,
                m: hidden,
                n,
                k: vocab,
                a: w,
                lda: hidden,
                b: logits,
                ldb: vocab,
                c: dx + c0 as u64 * hidden as u64 * size,
                ldc: hidden,
                c_type: T::ELEM,
                beta: 0.0,
            })?
        };
        let beta = if c0 == 0 { 0.0 } else { 1.0 };
        // dWᵀ (hidden × vocab) += xᵀ (hidden × n) · dz (n × vocab).
        unsafe {
            blas.gemm::<T>(&Gemm {
                trans_a: false,
                trans_b: true,
                m: hidden,
                n: vocab,
                k: n,
                a: xc,
                lda: hidden,
                b: logits,
                ldb: vocab,
                c: dw,
                ldc: hidden,
                c_type: ElemType::F32,
                beta,
            })?
        };
        if db != 0 {
            // db (vocab × 1) += dzᵀ (vocab × n) · 1 (n × 1).
            unsafe {
                blas.gemm::<T>(&Gemm {
                    trans_a: false,
                    trans_b: false,
                    m: vocab,
                    n: 1,
                    k: n,
                    a: logits,
                    lda: vocab,
                    b: ones_ptr,
                    ldb: n,
                    c: db,
                    ldc: vocab,
                    c_type: ElemType::F32,
                    beta,
                })?
            };
        }
        c0 += n;
    }
    if tokens == 0 {
        // No chunk ran: the gradients of no tokens are zeros.
        for (p, len) in [(dw, vocab * hidden), (db, vocab)] {
            if p != 0 {
                // SAFETY: `len` f32 at `p`, validated above.
                unsafe { sys::cuMemsetD32Async(p, 0, len, stream.cu_stream()) }.result()?;
            }
        }
    }
    unsafe { launch::run(stream, &reduce, &whole) }
}
