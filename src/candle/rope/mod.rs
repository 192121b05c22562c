//! RoPE on candle tensors: q and k in HF's layout ([`rope`], [`rope_with`] and their explicit
//! backwards), and one tensor in candle-nn's layouts (the op behind `nn::rotary_emb`).
//!
//! Every call writes its output once from its inputs where they are (the general kernels'
//! out-of-place path): no copy of q, k or the tables. q and k may be views whose tokens lie
//! apart, each token's heads contiguous, such as `narrow`s of a fused QKV projection output
//! reshaped to `[B, S, Hq + 2·Hk, d]` ([`token_stride`]): they are read where they are too.
use super::{
    Elem, HostElem, On, crate_err, cuda, host, host_slice, host_tensor, on, output, same_dtype,
    same_shape, tensor, view, wrap,
};
use crate::reference::rope::{
    CosSinRows, rope_backward as ref_backward, rope_forward as ref_forward, rope_one,
};
use crate::rope::{Pass, rope_into};
use crate::{CosSinDtype, CosSinLayout, PositionIds, RopeArgs};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, D, DType, Layout, Result, Shape, Tensor,
};
use cudarc::driver::{CudaView, CudaViewMut};
use std::borrow::Cow;
use std::sync::Arc;

const ROPE: &str = "liger-rs rope";

/// `$f::<T, C>` for q of dtype `$q` and tables of `$t`: the same dtype, or f32 tables with
/// f16/bf16 q ([`CosSinDtype`]); f64 too on the host (`host`, the reference's type).
macro_rules! by_dtypes {
    ($q:expr, $t:expr, $f:ident($($arg:expr),*)) => {
        by_dtypes!(@ $q, $t, $f($($arg),*),)
    };
    (host $q:expr, $t:expr, $f:ident($($arg:expr),*)) => {
        by_dtypes!(@ $q, $t, $f($($arg),*), (DType::F64, DType::F64) => $f::<f64, f64>($($arg),*),)
    };
    (@ $q:expr, $t:expr, $f:ident($($arg:expr),*), $($host:tt)*) => {
        match ($q, $t) {
            (DType::F32, DType::F32) => $f::<f32, f32>($($arg),*),
            (DType::F16, DType::F16) => $f::<half::f16, half::f16>($($arg),*),
            (DType::BF16, DType::BF16) => $f::<half::bf16, half::bf16>($($arg),*),
            (DType::F16, DType::F32) => $f::<half::f16, f32>($($arg),*),
            (DType::BF16, DType::F32) => $f::<half::bf16, f32>($($arg),*),
            $($host)*
            (q, _) => Err(candle_core::Error::UnsupportedDTypeForOp(q, ROPE)),
        }
    };
}

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
struct Call<X, I, Tb = X> {
    dir: Pass,
    q: X,
    k: Option<X>,
    tables: [Tb; 2],
    ids: Option<I>,
}

impl<X, I, Tb> Call<X, I, Tb> {
    /// The call of `dir` on these inputs, in one line at each of its many call sites.
    fn new(dir: Pass, q: X, k: Option<X>, tables: [Tb; 2], ids: Option<I>) -> Self {
        Call {
            dir,
            q,
            k,
            tables,
            ids,
        }
    }
}

/// Checks that the cos/sin tables' dtype suits q's: the same, or f32 with f16/bf16 q.
fn table_dtype(q: &Tensor, cos: &Tensor) -> Result<()> {
    match (q.dtype(), cos.dtype()) {
        (DType::F16 | DType::BF16, DType::F32) => Ok(()),
        _ => same_dtype(ROPE, q, cos),
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
        fn run<T: Elem, C: Elem + CosSinDtype<T>>(
            plan: &Plan,
            call: CudaCall<'_>,
        ) -> Result<CudaStorage> {
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
            let cos = view::<C>(cos.0, cos.1, ROPE)?;
            let need = plan.table_len(cos.len());
            let (cos, sin) = (cos.slice(..need), view::<C>(sin.0, sin.1, ROPE)?);
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
        let (q, t) = (call.q.0.dtype(), call.tables[0].0.dtype());
        by_dtypes!(q, t, run(self, call))
    }

    /// Rotates q (and k) on host data into `[q | k]`, by the reference.
    fn host<T: HostElem, C: HostElem>(&self, call: Call<&[T], &[i64], &[C]>) -> Result<Vec<T>> {
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
        fn run<'a, T: HostElem, C: HostElem>(plan: &Plan, call: CpuCall<'a>) -> Result<CpuStorage> {
            let slice = |(s, l): (&'a CpuStorage, &'a Layout)| host_slice::<C>(s, l, ROPE);
            let k = call.k.map(|(s, l)| rows_slice::<T>(s, l)).transpose()?;
            let [cos, sin] = call.tables;
            let tables = [slice(cos)?, slice(sin)?];
            let q = rows_slice::<T>(call.q.0, call.q.1)?;
            let host = Call::new(call.dir, &q[..], k.as_deref(), tables, call.ids);
            Ok(T::to_cpu_storage_owned(plan.host(host)?))
        }
        let (q, t) = (call.q.0.dtype(), call.tables[0].0.dtype());
        by_dtypes!(host q, t, run(self, call))
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
            fn run<T: HostElem, C: HostElem>(
                plan: &Plan,
                call: Call<&Tensor, &Tensor>,
            ) -> Result<Tensor> {
                let k = call.k.map(host::<T>).transpose()?;
                let ids = call.ids.map(host_ids).transpose()?;
                let [cos, sin] = call.tables;
                let tables = [&host::<C>(cos)?[..], &host::<C>(sin)?[..]];
                let q = host::<T>(call.q)?;
                let host = Call::new(call.dir, &q[..], k.as_deref(), tables, ids.as_deref());
                let out = plan.host(host)?;
                let n = out.len();
                host_tensor(out, n)
            }
            return by_dtypes!(host q.dtype(), cos.dtype(), run(self, call));
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

/// The CPU storage of a locked tensor storage (the tables of a CPU call are on the CPU).
fn cpu<'a>(storage: &'a candle_core::Storage, name: &str) -> Result<&'a CpuStorage> {
    match storage {
        candle_core::Storage::Cpu(s) => Ok(s),
        _ => bad(format!("`{name}` is not on the CPU device like q")),
    }
}

mod nn;
mod pair;
pub(super) use nn::{NnRope, nn_rope};
pub use pair::{rope, rope_backward, rope_backward_with, rope_with};

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

    #[test]
    fn f32_tables_with_16_bit_q_and_k_on_the_cpu_are_the_reference() {
        use crate::reference::rope::{CosSinRows, rope_forward};
        use half::bf16;
        let (s, h, d) = (3, 2, 4);
        let q: Vec<bf16> = (0..s * h * d)
            .map(|i| bf16::from_f32(0.37 * i as f32 - 1.1))
            .collect();
        let k: Vec<bf16> = q.iter().rev().copied().collect();
        // Angles whose f32 cos/sin differ from their bf16 roundings.
        let cos: Vec<f32> = (0..s * d).map(|i| (0.3 + 0.41 * i as f32).cos()).collect();
        let sin: Vec<f32> = (0..s * d).map(|i| (0.3 + 0.41 * i as f32).sin()).collect();
        let dev = Device::Cpu;
        let t = |v: &[bf16]| Tensor::from_slice(v, (1, s, h, d), &dev).unwrap();
        let (cos_t, sin_t) = (
            Tensor::from_slice(&cos, (s, d), &dev).unwrap(),
            Tensor::from_slice(&sin, (s, d), &dev).unwrap(),
        );
        let (qr, kr) = rope(&t(&q), &t(&k), &cos_t, &sin_t, None).unwrap();
        let args = RopeArgs::new(d).with_seq_len(s).with_heads(h, h);
        let (mut qw, mut kw) = (q.clone(), k.clone());
        rope_forward(&args, &mut qw, &mut kw, &cos, &sin, CosSinRows::PerPosition).unwrap();
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
        assert_eq!((flat(&qr), flat(&kr)), (qw.clone(), kw));
        // The bf16-rounded tables give other bits: the f32 entries reach the math.
        let round = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let (mut qb, mut kb) = (q.clone(), k.clone());
        let (cb, sb) = (round(&cos), round(&sin));
        rope_forward(&args, &mut qb, &mut kb, &cb, &sb, CosSinRows::PerPosition).unwrap();
        assert_ne!(qb, qw);
        // Tables of another 16-bit type than q's are refused.
        let f16_cos = cos_t.to_dtype(DType::F16).unwrap();
        let f16_sin = sin_t.to_dtype(DType::F16).unwrap();
        assert!(rope(&t(&q), &t(&k), &f16_cos, &f16_sin, None).is_err());
    }
}
