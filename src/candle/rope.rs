//! RoPE on candle tensors: q and k in HF's layout ([`rope`], [`rope_with`] and their explicit
//! backwards), and one tensor in candle-nn's layouts (the op behind `nn::rotary_emb`).
//!
//! Every call writes its output once from its inputs where they are (the general kernels'
//! out-of-place path): no copy of q, k or the tables. q and k may be views whose tokens lie
//! apart, each token's heads contiguous, such as `narrow`s of a fused QKV projection output
//! reshaped to `[B, S, Hq + 2·Hk, d]` ([`token_stride`]): they are read where they are too.
use super::{
    Elem, HostElem, On, by_dtype, by_host_dtype, crate_err, cuda, host, host_slice, host_tensor,
    on, output, same_dtype, same_shape, tensor, view, wrap,
};
use crate::reference::rope::{
    CosSinRows, rope_backward as ref_backward, rope_forward as ref_forward, rope_one,
};
use crate::rope::{Pass, rope_into};
use crate::{CosSinLayout, PositionIds, RopeArgs};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, D, DType, Layout, Result, Shape, Tensor,
};
use cudarc::driver::{CudaView, CudaViewMut};
use std::borrow::Cow;
use std::sync::Arc;

const ROPE: &str = "liger-rs rope";

/// How [`rope_with`] reads the cos/sin tables and pairs a head's dims (see [`RopeArgs`]).
///
/// The default is HF's NeoX form with full-width rows whose length is the rotary dim, except
/// that rows of exactly `head_dim / 2` are an error: that is also candle-nn's half-width
/// table of a full rotation, so the two readings must be told apart (`half_tables`, or the
/// `rotary_dim` of a partial rotary).
///
/// ```
/// use liger_rs::candle::RopeConfig;
/// // candle-nn's / Meta's [S, d/2] tables, GPT-J's adjacent pairs.
/// let gptj = RopeConfig::default().with_half_tables().with_interleaved();
/// // Persimmon: half of each head of 64 rotates, HF's full-width [S, 32] tables.
/// let partial = RopeConfig::default().with_rotary_dim(32);
/// assert!(gptj.half_tables && gptj.interleaved && partial.rotary_dim == Some(32));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RopeConfig {
    /// Leading dims of each head that rotate; `None`: the tables say (full-width rows: their
    /// length; half-width rows: twice it).
    pub rotary_dim: Option<usize>,
    /// cos/sin rows hold `rotary_dim / 2` values, one per pair (candle-nn's and Meta's
    /// tables), instead of `rotary_dim` (HF's `cat(freqs, freqs)`).
    pub half_tables: bool,
    /// Pair `i` is `(x[2i], x[2i + 1])` (GPT-J) instead of `(x[i], x[i + rotary_dim / 2])`.
    pub interleaved: bool,
}

impl RopeConfig {
    /// Sets the rotary dim (partial rotary: only the first `rotary_dim` dims of each head
    /// rotate), instead of reading it from the tables.
    ///
    /// ```
    /// let cfg = liger_rs::candle::RopeConfig::default().with_rotary_dim(32);
    /// assert_eq!(cfg.rotary_dim, Some(32));
    /// ```
    pub fn with_rotary_dim(self, rotary_dim: usize) -> Self {
        RopeConfig {
            rotary_dim: Some(rotary_dim),
            ..self
        }
    }

    /// Half-width cos/sin rows: `rotary_dim / 2` values, one per pair (candle-nn's and
    /// Meta's `[S, d/2]` tables).
    ///
    /// ```
    /// assert!(liger_rs::candle::RopeConfig::default().with_half_tables().half_tables);
    /// ```
    pub fn with_half_tables(self) -> Self {
        RopeConfig {
            half_tables: true,
            ..self
        }
    }

    /// Interleaved pairs: pair `i` is `(x[2i], x[2i + 1])` (GPT-J).
    ///
    /// ```
    /// assert!(liger_rs::candle::RopeConfig::default().with_interleaved().interleaved);
    /// ```
    pub fn with_interleaved(self) -> Self {
        RopeConfig {
            interleaved: true,
            ..self
        }
    }
}

/// Where each token's cos/sin row comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// Row `s` of a table of at least `seq_len` rows.
    PerPosition,
    /// Row `b·seq_len + s` of `[batch, seq_len, ·]` tables.
    PerBatch,
    /// Row `position_ids[b, s]`.
    Gathered,
}

/// A checked RoPE call: the launch's args (`k_heads = 0` for one tensor) and the rows.
#[derive(Debug, Clone, Copy)]
struct Plan {
    args: RopeArgs,
    rows: Rows,
}

/// A call's direction and inputs in one backend's form (storages with their layouts, host
/// slices or tensors): q, k (absent for one tensor), the cos/sin tables and the position ids
/// (`I`: as the backend reads them).
#[derive(Clone, Copy)]
struct Call<X, I> {
    dir: Pass,
    q: X,
    k: Option<X>,
    tables: [X; 2],
    ids: Option<I>,
}

impl<X, I> Call<X, I> {
    /// The call of `dir` on these inputs, in one line at each of its many call sites.
    fn new(dir: Pass, q: X, k: Option<X>, tables: [X; 2], ids: Option<I>) -> Self {
        Call {
            dir,
            q,
            k,
            tables,
            ids,
        }
    }
}

/// Elements between consecutive tokens of a `[batch, seq_len, heads, head_dim]` layout whose
/// tokens each hold their `heads × head_dim` elements contiguous, at least that far apart (a
/// `narrow` on the heads dim of `[B, S, H, d]`, e.g. q or k of a fused QKV output); `None`
/// for any other layout. Dims of size 1 may have any stride, as candle leaves them.
fn token_stride(layout: &Layout) -> Option<usize> {
    let (&[b, s, h, d], st) = (layout.dims(), layout.stride()) else {
        return None;
    };
    if (d > 1 && st[3] != 1) || (h > 1 && st[2] != d) {
        return None;
    }
    let row = h * d;
    let t = match (b, s) {
        (_, 2..) => st[1],
        (2.., _) => st[0],
        _ => row,
    };
    let batches_follow = b < 2 || s < 2 || st[0] == s * t;
    (t >= row && batches_follow).then_some(t)
}

/// `x` itself when the kernels read it where it is (contiguous, or tokens apart as
/// [`token_stride`] describes), else a contiguous copy.
fn token_rows(x: &Tensor) -> Result<Tensor> {
    match x.is_contiguous() || token_stride(x.layout()).is_some() {
        true => Ok(x.clone()),
        false => x.contiguous(),
    }
}

/// The token stride of a layout the call reads: `row` when contiguous, else its
/// [`token_stride`].
fn stride_of(layout: &Layout, row: usize) -> Result<usize> {
    match layout.is_contiguous() {
        true => Ok(row),
        false => token_stride(layout).ok_or(candle_core::Error::RequiresContiguous { op: ROPE }),
    }
}

/// The elements of `storage` from a layout's first token to the end of its last: `span`
/// elements from its start offset (a contiguous layout's own elements).
fn rows_view<'a, T: Elem>(
    storage: &'a CudaStorage,
    layout: &Layout,
    span: usize,
) -> Result<CudaView<'a, T>> {
    if layout.is_contiguous() {
        return view::<T>(storage, layout, ROPE);
    }
    let start = layout.start_offset();
    Ok(storage.as_cuda_slice::<T>()?.slice(start..start + span))
}

/// A CPU layout's elements token by token: borrowed when contiguous, else gathered from its
/// token rows ([`token_stride`]).
fn rows_slice<'a, T: HostElem>(storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [T]>> {
    if layout.is_contiguous() {
        return host_slice::<T>(storage, layout, ROPE).map(Cow::Borrowed);
    }
    let dims = layout.dims();
    let (tokens, row) = (dims[0] * dims[1], dims[2] * dims[3]);
    let stride = stride_of(layout, row)?;
    let all = storage.as_slice::<T>()?;
    let start = layout.start_offset();
    let rows = (0..tokens).flat_map(|t| all[start + t * stride..][..row].iter().copied());
    Ok(Cow::Owned(rows.collect()))
}

/// A call on CUDA storages.
type CudaCall<'a> = Call<(&'a CudaStorage, &'a Layout), (&'a CudaStorage, &'a Layout)>;
/// A call on CPU storages, with the ids on the host.
type CpuCall<'a> = Call<(&'a CpuStorage, &'a Layout), &'a [i64]>;

fn bad<V>(what: String) -> Result<V> {
    Err(candle_core::Error::Msg(format!("{ROPE}: {what}")))
}

impl Plan {
    /// The table elements the call reads: the first `seq_len` rows per position, every row
    /// otherwise.
    fn table_len(&self, cos_len: usize) -> usize {
        let a = &self.args;
        match self.rows {
            Rows::PerPosition => a.seq_len * a.table_row_len(),
            Rows::PerBatch | Rows::Gathered => cos_len,
        }
    }

    /// Elements of q and of k.
    fn lens(&self) -> (usize, usize) {
        let a = &self.args;
        let tokens = a.batch * a.seq_len;
        (
            tokens * a.q_heads * a.head_dim,
            tokens * a.k_heads * a.head_dim,
        )
    }

    /// The reference's row form (`ids` on the host for gathered rows).
    fn host_rows<'a>(&self, ids: Option<&'a [i64]>) -> Result<CosSinRows<'a>> {
        Ok(match (self.rows, ids) {
            (Rows::PerPosition, _) => CosSinRows::PerPosition,
            (Rows::PerBatch, _) => CosSinRows::PerBatch,
            (Rows::Gathered, Some(ids)) => CosSinRows::Gathered(ids),
            (Rows::Gathered, None) => return bad("position ids missing".into()),
        })
    }

    /// Rotates q (and k) on CUDA into one new buffer `[q | k]` (k absent for one tensor).
    fn cuda(&self, call: CudaCall<'_>) -> Result<CudaStorage> {
        fn run<T: Elem>(plan: &Plan, call: CudaCall<'_>) -> Result<CudaStorage> {
            let (q, [cos, sin]) = (call.q, call.tables);
            let device = &q.0.device;
            let stream = device.cuda_stream();
            let (q_len, k_len) = plan.lens();
            // q and k where they are: tokens apart when they are views (strided args).
            let a = &plan.args;
            let q_stride = stride_of(q.1, a.q_heads * a.head_dim)?;
            let k_stride = match call.k {
                Some((_, l)) => stride_of(l, a.k_heads * a.head_dim)?,
                None => 0,
            };
            let contiguous = q.1.is_contiguous() && call.k.is_none_or(|(_, l)| l.is_contiguous());
            let args = match contiguous {
                true => plan.args,
                false => plan.args.with_strides(q_stride, k_stride),
            };
            let spans = args.check_heads(call.k.is_some()).map_err(crate_err)?;
            let q_in = rows_view::<T>(q.0, q.1, spans.q_len)?;
            let k_in = call
                .k
                .map(|(s, l)| rows_view::<T>(s, l, spans.k_len))
                .transpose()?;
            let cos = view::<T>(cos.0, cos.1, ROPE)?;
            let need = plan.table_len(cos.len());
            let (cos, sin) = (cos.slice(..need), view::<T>(sin.0, sin.1, ROPE)?);
            let sin = sin.slice(..need);
            let layout = match (plan.rows, call.ids) {
                (Rows::PerPosition, _) => CosSinLayout::PerPosition,
                (Rows::PerBatch, _) => CosSinLayout::PerBatch,
                (Rows::Gathered, Some((s, l))) => CosSinLayout::Gathered(match s.dtype() {
                    DType::I32 => PositionIds::DeviceI32(view(s, l, ROPE)?),
                    _ => PositionIds::DeviceI64(view(s, l, ROPE)?),
                }),
                (Rows::Gathered, None) => return bad("position ids missing".into()),
            };
            let mut out = output::<T>(&stream, q_len + k_len, ROPE)?;
            let (mut q_out, mut k_out) = out.split_at_mut(q_len);
            let io = match &k_in {
                Some(k_in) => (&q_in, &mut q_out, Some((k_in, &mut k_out))),
                None => (
                    &q_in,
                    &mut q_out,
                    None::<(&CudaView<T>, &mut CudaViewMut<T>)>,
                ),
            };
            rope_into(&stream, &args, call.dir, io, &cos, &sin, &layout).map_err(crate_err)?;
            Ok(wrap(out, device))
        }
        by_dtype!(call.q.0.dtype(), ROPE, run(self, call))
    }

    /// Rotates q (and k) on host data into `[q | k]`, by the reference.
    fn host<T: HostElem>(&self, call: Call<&[T], &[i64]>) -> Result<Vec<T>> {
        let [cos, sin] = call.tables;
        let need = self.table_len(cos.len());
        let (cos, sin) = (&cos[..need], &sin[..need]);
        let rows = self.host_rows(call.ids)?;
        let backward = call.dir == Pass::Backward;
        let mut out = call.q.to_vec();
        match call.k {
            Some(k) => {
                let mut k = k.to_vec();
                if backward {
                    ref_backward(&self.args, &mut out, &mut k, cos, sin, rows)
                } else {
                    ref_forward(&self.args, &mut out, &mut k, cos, sin, rows)
                }
                .map_err(crate_err)?;
                out.extend(k);
            }
            None => rope_one(&self.args, backward, &mut out, cos, sin, rows).map_err(crate_err)?,
        }
        Ok(out)
    }

    /// [`Plan::host`] on CPU storages.
    fn cpu(&self, call: CpuCall<'_>) -> Result<CpuStorage> {
        fn run<'a, T: HostElem>(plan: &Plan, call: CpuCall<'a>) -> Result<CpuStorage> {
            let slice = |(s, l): (&'a CpuStorage, &'a Layout)| host_slice::<T>(s, l, ROPE);
            let k = call.k.map(|(s, l)| rows_slice::<T>(s, l)).transpose()?;
            let [cos, sin] = call.tables;
            let tables = [slice(cos)?, slice(sin)?];
            let q = rows_slice::<T>(call.q.0, call.q.1)?;
            let host = Call::new(call.dir, &q[..], k.as_deref(), tables, call.ids);
            Ok(T::to_cpu_storage_owned(plan.host(host)?))
        }
        by_host_dtype!(call.q.0.dtype(), ROPE, run(self, call))
    }

    /// Rotates tensors (contiguous, on one device) into a new flat `[q | k]` tensor without a
    /// graph.
    fn tensors(&self, call: Call<&Tensor, &Tensor>) -> Result<Tensor> {
        let (q, k, [cos, sin], ids) = (call.q, call.k, call.tables, call.ids);
        let (q_len, k_len) = self.lens();
        let mut named = vec![("q", q), ("cos", cos), ("sin", sin)];
        named.extend(k.map(|k| ("k", k)));
        named.extend(ids.map(|i| ("position_ids", i)));
        if on(ROPE, &named)? == On::Cpu {
            fn run<T: HostElem>(plan: &Plan, call: Call<&Tensor, &Tensor>) -> Result<Tensor> {
                let k = call.k.map(host::<T>).transpose()?;
                let ids = call.ids.map(host_ids).transpose()?;
                let [cos, sin] = call.tables;
                let tables = [&host::<T>(cos)?[..], &host::<T>(sin)?[..]];
                let q = host::<T>(call.q)?;
                let host = Call::new(call.dir, &q[..], k.as_deref(), tables, ids.as_deref());
                let out = plan.host(host)?;
                let n = out.len();
                host_tensor(out, n)
            }
            return by_host_dtype!(q.dtype(), ROPE, run(self, call));
        }
        let (q_s, q_l) = q.storage_and_layout();
        let k_guard = k.map(|k| k.storage_and_layout());
        let k_cuda = match &k_guard {
            Some((s, l)) => Some((cuda(s, ROPE, "k")?, *l)),
            None => None,
        };
        let (c_s, c_l) = cos.storage_and_layout();
        let (s_s, s_l) = sin.storage_and_layout();
        let ids_guard = ids.map(|i| i.storage_and_layout());
        let ids_cuda = match &ids_guard {
            Some((s, l)) => Some((cuda(s, ROPE, "position_ids")?, *l)),
            None => None,
        };
        let tables = [
            (cuda(&c_s, ROPE, "cos")?, c_l),
            (cuda(&s_s, ROPE, "sin")?, s_l),
        ];
        let q_cuda = (cuda(&q_s, ROPE, "q")?, q_l);
        let out = self.cuda(Call::new(call.dir, q_cuda, k_cuda, tables, ids_cuda))?;
        Ok(tensor(out, q_len + k_len))
    }
}

/// Position ids as host i64.
fn host_ids(ids: &Tensor) -> Result<Vec<i64>> {
    host::<i64>(&ids.to_dtype(DType::I64)?)
}

// ---------------------------------------------------------------------------------------------
// q and k, HF's layout
// ---------------------------------------------------------------------------------------------

/// A q-and-k call's plan and what it rotates by: `cos`, `sin` (contiguous) and the ids.
struct Pair {
    plan: Plan,
    cos: Tensor,
    sin: Tensor,
    position_ids: Option<Tensor>,
}

impl Pair {
    /// Checks q `[B, S, Hq, d]`, k `[B, S, Hk, d]`, the tables, the ids and `cfg`.
    fn new(
        [q, k]: [&Tensor; 2],
        [cos, sin]: [&Tensor; 2],
        position_ids: Option<&Tensor>,
        cfg: &RopeConfig,
    ) -> Result<Self> {
        let (&[b, s, hq, d], &[kb, ks, hk, kd]) = (q.dims(), k.dims()) else {
            return bad(format!(
                "q and k must be [batch, seq_len, heads, head_dim], got {:?} and {:?}",
                q.dims(),
                k.dims()
            ));
        };
        if (kb, ks, kd) != (b, s, d) {
            return bad(format!(
                "k {:?} must match q {:?} in batch, seq_len and head_dim",
                k.dims(),
                q.dims()
            ));
        }
        same_dtype(ROPE, q, k)?;
        same_dtype(ROPE, q, cos)?;
        same_shape(ROPE, cos, sin)?;
        same_dtype(ROPE, cos, sin)?;
        let w = cos.dims().last().copied().unwrap_or(0);
        let r = match (cfg.rotary_dim, cfg.half_tables) {
            (Some(r), half) => {
                let want = if half { r / 2 } else { r };
                if w != want {
                    let form = if half { "half" } else { "full" };
                    return bad(format!(
                        "cos/sin rows must be {want} long ({form}-width rows of rotary_dim = \
                         {r}), got {:?}",
                        cos.dims()
                    ));
                }
                r
            }
            (None, true) => 2 * w,
            (None, false) if 2 * w == d => {
                return bad(format!(
                    "cos/sin rows of {w} = head_dim / 2 are ambiguous: candle-nn's half-width \
                     table of a full rotation (liger_rs::candle::nn::rotary_emb::rope_thd takes \
                     q in this layout, or RopeConfig::default().with_half_tables()), or HF's \
                     full-width table of a partial rotary of rotary_dim = {w} \
                     (RopeConfig::default().with_rotary_dim({w})); say which with rope_with"
                ));
            }
            (None, false) => w,
        };
        let rows = match (cos.dims(), position_ids) {
            (&[_, _], Some(ids)) => {
                if ids.dims() != [b, s] || !matches!(ids.dtype(), DType::I64 | DType::I32) {
                    return bad(format!(
                        "position_ids must be i64 or i32 [{b}, {s}], got {:?} {:?}",
                        ids.dtype(),
                        ids.dims()
                    ));
                }
                Some(Rows::Gathered)
            }
            // A longer table without ids: its first rows, as candle-nn reads one.
            (&[rows, _], None) if rows >= s => Some(Rows::PerPosition),
            (&[1, cs, _], None) if cs == s => Some(Rows::PerPosition),
            (&[cb, cs, _], None) if cb == b && cs == s => Some(Rows::PerBatch),
            _ => None,
        };
        let Some(rows) = rows.filter(|_| w > 0) else {
            return bad(format!(
                "cos/sin must be [rows ≥ seq_len, w], [batch, seq_len, w] or [1, seq_len, w] \
                 (or [max_pos, w] with position_ids) for q {:?}, got {:?}",
                q.dims(),
                cos.dims()
            ));
        };
        let mut args = RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r);
        if cfg.half_tables {
            args = args.with_half_tables();
        }
        if cfg.interleaved {
            args = args.with_interleaved();
        }
        Ok(Pair {
            plan: Plan { args, rows },
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            position_ids: position_ids.map(Tensor::contiguous).transpose()?,
        })
    }

    /// Rotates contiguous q and k (or their gradients) into a new flat `[q | k]`.
    fn rotate(&self, dir: Pass, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let tables = [&self.cos, &self.sin];
        let ids = self.position_ids.as_ref();
        self.plan.tensors(Call::new(dir, q, Some(k), tables, ids))
    }

    /// `[q | k]` as two tensors shaped like q and k (views of `packed`, no copy).
    fn split(&self, packed: &Tensor) -> Result<(Tensor, Tensor)> {
        let a = &self.plan.args;
        let (q_len, k_len) = self.plan.lens();
        let q = packed.narrow(0, 0, q_len)?;
        let k = packed.narrow(0, q_len, k_len)?;
        Ok((
            q.reshape((a.batch, a.seq_len, a.q_heads, a.head_dim))?,
            k.reshape((a.batch, a.seq_len, a.k_heads, a.head_dim))?,
        ))
    }
}

/// RoPE forward with candle autograd (NeoX half-split rotation, as [`crate::rope_forward`])
/// on HF's tables: [`rope_with`] with the default [`RopeConfig`] (the rotary dim is the rows'
/// length; rows of `head_dim / 2` are an error, see there).
///
/// * `q`: `[batch, seq_len, q_heads, head_dim]`, `k`: `[batch, seq_len, k_heads, head_dim]`
///   (HF's `proj(h).view(B, S, H, d)` before its `transpose(1, 2)`; a transposed
///   `[B, H, S, d]` tensor is copied to this layout first).
/// * `cos`, `sin`: rows of `rotary_dim ≤ head_dim` elements (HF's `cat(freqs, freqs)`; only
///   the first half of a row is read; dims past `rotary_dim` pass through), shaped
///   `[rows ≥ seq_len, rotary_dim]` (the first `seq_len` rows, shared by the batch) or
///   `[1, seq_len, rotary_dim]`, `[batch, seq_len, rotary_dim]` (per batch row, what HF's
///   rotary embedding returns), or `[max_pos, rotary_dim]` with `position_ids`
///   `[batch, seq_len]` (i64 or i32; clamped into the table on CUDA, see
///   [`PositionIds::DeviceI64`]; on the CPU an id outside it is an error).
///
/// The inputs are not modified: one launch reads q and k where they are and writes both
/// rotated into one new `[q | k]` buffer; the results are views of it. The backward rotates
/// the gradients by −θ in one launch; `cos`, `sin` and the ids get no gradient.
///
/// ```no_run
/// use candle_core::{D, DType, Device, Tensor};
/// use liger_rs::candle::rope;
/// let dev = Device::new_cuda(0)?;
/// let (b, s, hq, hk, d) = (2, 16, 32, 8, 128);
/// let q = Tensor::randn(0f32, 1.0, (b, s, hq, d), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev)?;
/// let inv_freq: Vec<f32> = (0..d / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / d as f32)).collect();
/// let pos = Tensor::arange(0u32, s as u32, &dev)?.to_dtype(DType::F32)?;
/// let freqs = pos.unsqueeze(1)?.broadcast_mul(&Tensor::new(inv_freq, &dev)?.unsqueeze(0)?)?;
/// let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?; // [s, d]
/// let (q, k) = rope(&q, &k, &emb.cos()?, &emb.sin()?, None)?;
/// # let _ = (q, k);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    rope_with(q, k, cos, sin, position_ids, &RopeConfig::default())
}

/// [`rope`] with the table form, rotary dim and pairing of `cfg`: half-width rows (one value
/// per pair) with `cfg.half_tables`, interleaved pairs with `cfg.interleaved` (full-width
/// rows then hold one value per dim, `repeat_interleave(freqs, 2)`), a partial rotary whose
/// `rotary_dim` is explicit. Rows whose length does not fit `cfg` are an error.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{RopeConfig, rope_with};
/// let dev = Device::new_cuda(0)?;
/// let (b, s, hq, hk, d) = (1, 16, 8, 8, 64);
/// let q = Tensor::randn(0f32, 1.0, (b, s, hq, d), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev)?;
/// let cos = Tensor::ones((s, d / 2), DType::F32, &dev)?; // one value per pair
/// let sin = Tensor::zeros((s, d / 2), DType::F32, &dev)?;
/// let cfg = RopeConfig::default().with_half_tables().with_interleaved();
/// let (q, k) = rope_with(&q, &k, &cos, &sin, None, &cfg)?;
/// # let _ = (q, k);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_with(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
    cfg: &RopeConfig,
) -> Result<(Tensor, Tensor)> {
    let pair = Arc::new(Pair::new([q, k], [cos, sin], position_ids, cfg)?);
    on(ROPE, &[("q", q), ("k", k), ("cos", cos), ("sin", sin)])?;
    let op = PairOp { pair: pair.clone() };
    let packed = token_rows(q)?.apply_op2(&token_rows(k)?, op)?;
    pair.split(&packed)
}

/// RoPE backward without autograd: rotates the gradients `dq`, `dk` (shaped like the
/// forward's q and k) by −θ and returns them as new tensors; the inputs are not modified.
/// `cos`, `sin` and `position_ids` are those of the forward ([`rope`]). One launch.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::rope_backward;
/// let dev = Device::new_cuda(0)?;
/// let (b, s, hq, hk, d) = (1, 16, 8, 2, 64);
/// let dq = Tensor::ones((b, s, hq, d), DType::F32, &dev)?;
/// let dk = Tensor::ones((b, s, hk, d), DType::F32, &dev)?;
/// let cos = Tensor::ones((s, d), DType::F32, &dev)?; // θ = 0: the identity
/// let sin = Tensor::zeros((s, d), DType::F32, &dev)?;
/// let (dq2, dk2) = rope_backward(&dq, &dk, &cos, &sin, None)?;
/// # let _ = (dq2, dk2);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_backward(
    dq: &Tensor,
    dk: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    rope_backward_with(dq, dk, cos, sin, position_ids, &RopeConfig::default())
}

/// [`rope_backward`] with the forms of `cfg` (those of the forward, [`rope_with`]).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use liger_rs::candle::{RopeConfig, rope_backward_with};
/// let dev = Device::new_cuda(0)?;
/// let (b, s, h, d) = (1, 16, 4, 64);
/// let dq = Tensor::ones((b, s, h, d), DType::F32, &dev)?;
/// let cos = Tensor::ones((s, d / 2), DType::F32, &dev)?;
/// let sin = Tensor::zeros((s, d / 2), DType::F32, &dev)?;
/// let cfg = RopeConfig::default().with_half_tables();
/// let (dq2, dk2) = rope_backward_with(&dq, &dq, &cos, &sin, None, &cfg)?;
/// # let _ = (dq2, dk2);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_backward_with(
    dq: &Tensor,
    dk: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    position_ids: Option<&Tensor>,
    cfg: &RopeConfig,
) -> Result<(Tensor, Tensor)> {
    let pair = Pair::new([dq, dk], [cos, sin], position_ids, cfg)?;
    let packed = pair.rotate(Pass::Backward, &token_rows(dq)?, &token_rows(dk)?)?;
    pair.split(&packed)
}

/// The autograd op of [`rope_with`]: inputs q and k, output `[q | k]` flattened.
struct PairOp {
    pair: Arc<Pair>,
}

impl CustomOp2 for PairOp {
    fn name(&self) -> &'static str {
        ROPE
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = &self.pair;
        let ids = p.position_ids.as_ref().map(host_ids).transpose()?;
        let (c_s, c_l) = p.cos.storage_and_layout();
        let (s_s, s_l) = p.sin.storage_and_layout();
        let tables = [(cpu(&c_s, "cos")?, c_l), (cpu(&s_s, "sin")?, s_l)];
        let call = Call::new(
            Pass::Forward,
            (q, q_l),
            Some((k, k_l)),
            tables,
            ids.as_deref(),
        );
        let out = p.plan.cpu(call)?;
        let (q_len, k_len) = p.plan.lens();
        Ok((out, Shape::from(q_len + k_len)))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let p = &self.pair;
        let (c_s, c_l) = p.cos.storage_and_layout();
        let (s_s, s_l) = p.sin.storage_and_layout();
        let ids_guard = p.position_ids.as_ref().map(|i| i.storage_and_layout());
        let ids = match &ids_guard {
            Some((s, l)) => Some((cuda(s, ROPE, "position_ids")?, *l)),
            None => None,
        };
        let tables = [
            (cuda(&c_s, ROPE, "cos")?, c_l),
            (cuda(&s_s, ROPE, "sin")?, s_l),
        ];
        let call = Call::new(Pass::Forward, (q, q_l), Some((k, k_l)), tables, ids);
        let out = p.plan.cuda(call)?;
        let (q_len, k_len) = p.plan.lens();
        Ok((out, Shape::from(q_len + k_len)))
    }

    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let p = &self.pair;
        let (q_len, k_len) = p.plan.lens();
        let grad = grad.contiguous()?;
        let (gq, gk) = (grad.narrow(0, 0, q_len)?, grad.narrow(0, q_len, k_len)?);
        let packed = p.rotate(Pass::Backward, &gq, &gk)?;
        let (dq, dk) = p.split(&packed)?;
        Ok((Some(dq), Some(dk)))
    }
}

/// The CPU storage of a locked tensor storage (the tables of a CPU call are on the CPU).
fn cpu<'a>(storage: &'a candle_core::Storage, name: &str) -> Result<&'a CpuStorage> {
    match storage {
        candle_core::Storage::Cpu(s) => Ok(s),
        _ => bad(format!("`{name}` is not on the CPU device like q")),
    }
}

// ---------------------------------------------------------------------------------------------
// One tensor, candle-nn's layouts
// ---------------------------------------------------------------------------------------------

/// The layouts and pairs of candle-nn 0.11's `rotary_emb` functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NnRope {
    /// `rope`: xs `[b, h, t, d]`, NeoX pairs.
    Rope,
    /// `rope_i`: xs `[b, h, t, d]`, interleaved pairs.
    RopeI,
    /// `rope_thd`: xs `[b, t, h, d]`, NeoX pairs.
    RopeThd,
}

impl NnRope {
    fn name(self) -> &'static str {
        match self {
            NnRope::Rope => "rope",
            NnRope::RopeI => "rope_i",
            NnRope::RopeThd => "rope_thd",
        }
    }
}

/// candle-nn's rotary embedding `form` of `xs` by half-width `cos`/`sin` (`[t', d/2]` with
/// `t' ≥ t`, of which the first `t` rows are read, or `[b, t, d/2]`), with autograd for `xs`,
/// `cos` and `sin`; see [`super::nn::rotary_emb`].
pub(super) fn nn_rope(form: NnRope, xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let name = form.name();
    let nn_bad = |what: String| Err(candle_core::Error::Msg(format!("{ROPE} ({name}): {what}")));
    let &[b, n1, n2, d] = xs.dims() else {
        return nn_bad(format!(
            "xs must have 4 dims ({}), got {:?}",
            if form == NnRope::RopeThd {
                "[b, t, h, d]"
            } else {
                "[b, h, t, d]"
            },
            xs.dims()
        ));
    };
    let (h, t) = if form == NnRope::RopeThd {
        (n2, n1)
    } else {
        (n1, n2)
    };
    same_dtype(ROPE, xs, cos)?;
    same_dtype(ROPE, cos, sin)?;
    same_shape(ROPE, cos, sin)?;
    let w = cos.dims().last().copied().unwrap_or(0);
    if w * 2 != d {
        let why = if w == d {
            " (a full-width table such as HF's cat(freqs, freqs): candle-nn's rotary_emb \
             takes one value per pair, e.g. its first half, cos.narrow(D::Minus1, 0, d / 2))"
        } else {
            ""
        };
        return nn_bad(format!(
            "cos/sin rows must be head_dim / 2 = {} long (one value per pair) for xs {:?}, got \
             {:?}{why}",
            d / 2,
            xs.dims(),
            cos.dims()
        ));
    }
    let rows = match *cos.dims() {
        [rows, _] if rows >= t => Rows::PerPosition,
        [rows, _] => {
            return nn_bad(format!(
                "cos/sin have {rows} rows, fewer than the {t} positions of xs {:?}",
                xs.dims()
            ));
        }
        [cb, ct, _] if cb == b && ct == t => Rows::PerBatch,
        [cb, ct, _] => {
            // candle-nn indexes [b, t', d/2] tables as [b, t, d/2]: with t' ≠ t it reads rows
            // of other batch entries, so there is no meaning to keep.
            return nn_bad(format!(
                "per-batch cos/sin must be [{b}, {t}, {}] (batch and positions of xs {:?}), got \
                 [{cb}, {ct}, {w}]",
                d / 2,
                xs.dims()
            ));
        }
        _ => {
            return nn_bad(format!(
                "cos/sin must be [t, d/2] or [b, t, d/2], got {:?}",
                cos.dims()
            ));
        }
    };
    on(ROPE, &[("xs", xs), ("cos", cos), ("sin", sin)])?;
    let mut args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(t)
        .with_heads(h, 0)
        .with_half_tables();
    if form != NnRope::RopeThd {
        args = args.with_head_major();
    }
    if form == NnRope::RopeI {
        args = args.with_interleaved();
    }
    let op = OneOp {
        plan: Plan { args, rows },
    };
    xs.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// The autograd op of [`nn_rope`]: inputs xs, cos, sin; output shaped like xs.
struct OneOp {
    plan: Plan,
}

impl OneOp {
    /// The gradients of the tables: with `(x1, x2)` a pair of xs, `(g1, g2)` of the
    /// gradient, `dcos = Σ g1·x1 + g2·x2` and `dsin = Σ g2·x1 − g1·x2` over the heads (and the
    /// batch for shared tables), rows past `t` zero; candle ops in f32 for 16-bit dtypes.
    fn table_grads(&self, xs: &Tensor, grad: &Tensor, cos: &Tensor) -> Result<(Tensor, Tensor)> {
        let a = &self.plan.args;
        let dtype = xs.dtype();
        let wide = match dtype {
            DType::F16 | DType::BF16 => DType::F32,
            other => other,
        };
        let half = a.head_dim / 2;
        let pairs = |t: &Tensor| -> Result<(Tensor, Tensor)> {
            let t = t.to_dtype(wide)?;
            if a.interleaved {
                let (b, n1, n2, _) = t.dims4()?;
                let t = t.reshape((b, n1, n2, half, 2))?;
                Ok((
                    t.narrow(4, 0, 1)?.squeeze(4)?,
                    t.narrow(4, 1, 1)?.squeeze(4)?,
                ))
            } else {
                Ok((
                    t.narrow(D::Minus1, 0, half)?,
                    t.narrow(D::Minus1, half, half)?,
                ))
            }
        };
        // `xs` detached: products of the tracked input would record graph nodes holding the
        // gradient, which the gradient store would keep alive to its end.
        let ((x1, x2), (g1, g2)) = (pairs(&xs.detach())?, pairs(grad)?);
        let dc = ((&g1 * &x1)? + (&g2 * &x2)?)?;
        let ds = ((&g2 * &x1)? - (&g1 * &x2)?)?;
        let heads = if a.head_major { 1 } else { 2 };
        let t_cos = cos.dims()[cos.rank() - 2];
        let to_table = |v: Tensor| -> Result<Tensor> {
            let v = v.sum(heads)?; // [b, t, d/2]
            let v = match self.plan.rows {
                Rows::PerBatch => v,
                _ => v.sum(0)?.pad_with_zeros(0, 0, t_cos - a.seq_len)?,
            };
            v.to_dtype(dtype)
        };
        Ok((to_table(dc)?, to_table(ds)?))
    }
}

impl CustomOp3 for OneOp {
    fn name(&self) -> &'static str {
        ROPE
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xs_l: &Layout,
        cos: &CpuStorage,
        cos_l: &Layout,
        sin: &CpuStorage,
        sin_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let tables = [(cos, cos_l), (sin, sin_l)];
        let call = Call::new(Pass::Forward, (xs, xs_l), None, tables, None);
        let out = self.plan.cpu(call)?;
        Ok((out, xs_l.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xs_l: &Layout,
        cos: &CudaStorage,
        cos_l: &Layout,
        sin: &CudaStorage,
        sin_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let tables = [(cos, cos_l), (sin, sin_l)];
        let call = Call::new(Pass::Forward, (xs, xs_l), None, tables, None);
        let out = self.plan.cuda(call)?;
        Ok((out, xs_l.shape().clone()))
    }

    fn bwd(
        &self,
        xs: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dxs = self
            .plan
            .tensors(Call::new(Pass::Backward, &grad, None, [cos, sin], None))?
            .reshape(xs.shape())?;
        if !(cos.track_op() || sin.track_op()) {
            return Ok((Some(dxs), None, None));
        }
        let (dcos, dsin) = self.table_grads(xs, &grad, cos)?;
        Ok((
            Some(dxs),
            cos.track_op().then_some(dcos),
            sin.track_op().then_some(dsin),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn token_stride_finds_token_rows_with_contiguous_heads() {
        let fused = Tensor::zeros((2, 3, 7, 4), DType::F32, &Device::Cpu).unwrap();
        let stride = |t: &Tensor| token_stride(t.layout());
        // q (3 heads) and k (2 heads) of a fused [2, 3, 7·4] output: tokens 28 apart.
        assert_eq!(stride(&fused.narrow(2, 0, 3).unwrap()), Some(28));
        assert_eq!(stride(&fused.narrow(2, 3, 2).unwrap()), Some(28));
        assert_eq!(stride(&fused), Some(28));
        // One sequence, or one token per sequence: the other dim carries the stride.
        let one = fused.narrow(0, 1, 1).unwrap().narrow(2, 3, 2).unwrap();
        assert_eq!(stride(&one), Some(28));
        let per_batch = fused.narrow(1, 2, 1).unwrap().narrow(2, 0, 3).unwrap();
        assert_eq!(stride(&per_batch), Some(84));
        // Heads or dims not contiguous within a token, or positions that skip: no token rows.
        assert_eq!(stride(&fused.narrow(3, 0, 2).unwrap()), None);
        assert_eq!(stride(&fused.transpose(1, 2).unwrap()), None);
        assert_eq!(stride(&fused.narrow(1, 0, 2).unwrap()), None);
        assert_eq!(stride(&fused.reshape((6, 7, 4)).unwrap()), None);
    }
}
