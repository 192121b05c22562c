//! candle-flash-attn's API with a backward: [`flash_attn`], [`flash_attn_windowed`],
//! [`flash_attn_alibi_windowed_softcap`], [`flash_attn_varlen`],
//! [`flash_attn_varlen_windowed`] and [`flash_attn_varlen_alibi_windowed_softcap`] take the
//! same arguments and shapes as candle-flash-attn 0.11's functions of those names, and are
//! differentiable (a [`CustomOp3`] whose backward runs [`crate::attention_backward`]), so
//! porting is the `use` line and the model can train:
//!
//! ```rust
//! // use candle_flash_attn::flash_attn;
//! use liger_rs::candle::flash_attn::flash_attn;
//! ```
//!
//! q is `[batch, seqlen_q, heads_q, head_dim]`, k and v `[batch, seqlen_k, heads_kv,
//! head_dim]` (any strides with a contiguous last dim: views of a fused QKV projection are
//! read in place; other layouts are copied first), heads_kv dividing heads_q (GQA, MQA); the
//! varlen forms take q `[total_q, heads_q, head_dim]`, k and v `[total_k, heads_kv, head_dim]`
//! and u32 offsets `[batch + 1]`. Beyond candle-flash-attn: f32 tensors (on CUDA cores), any
//! head_dim up to 256, and CPU tensors through [`crate::reference`]. ALiBi is not
//! implemented: the `alibi_slopes` argument must be `None`. [`flash_attn_bhtd`] takes
//! candle-nn's `[batch, heads, seq, head_dim]` layout without a copy. [`flash_attn_qkv`] takes
//! the output of one fused QKV projection and applies RoPE itself, one autograd node.
use super::{
    HostElem, On, by_dtype, by_host_dtype, crate_err, cuda, host_tensor, on, output, tensor,
};
use crate::AttentionArgs;
use crate::attention::Strides;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};
use std::sync::Mutex;

pub use super::qkv_attn::flash_attn_qkv;

const OP: &str = "flash-attn";

/// The scalar options of a call.
#[derive(Debug, Clone, Copy)]
struct Options {
    scale: f32,
    window_left: Option<usize>,
    window_right: Option<usize>,
    softcap: f32,
}

/// A packed batch's offsets and longest sequences.
struct Varlen {
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    max_q: usize,
    max_k: usize,
}

/// The autograd op: the forward's log-sum-exp is kept for the backward.
struct FlashAttn {
    options: Options,
    varlen: Option<Varlen>,
    lse: Mutex<Option<Tensor>>,
}

fn msg(text: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {text}"))
}

/// The strides of a `[B, S, H, d]` (or packed `[T, H, d]`) layout, its last dim contiguous.
fn strides(name: &str, l: &Layout, packed: bool) -> Result<Strides> {
    let s = l.stride();
    if s.last() != Some(&1) {
        return Err(msg(format!(
            "the last dim of `{name}` must be contiguous (strides {s:?})"
        )));
    }
    Ok(match packed {
        true => Strides {
            batch: 0,
            token: s[0],
            head: s[1],
        },
        false => Strides {
            batch: s[0],
            token: s[1],
            head: s[2],
        },
    })
}

impl FlashAttn {
    /// The launchers' arguments for tensors of these layouts.
    fn args(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<AttentionArgs> {
        let o = self.options;
        let packed = self.varlen.is_some();
        let (b, sq, hq, d, sk, hkv) = match &self.varlen {
            None => {
                let (b, sq, hq, d) = q.shape().dims4()?;
                let (bk, sk, hkv, dk) = k.shape().dims4()?;
                if (bk, dk) != (b, d) || v.shape().dims4()? != (bk, sk, hkv, dk) {
                    return Err(msg(format!(
                        "shape mismatch: q {:?}, k {:?}, v {:?}",
                        q.shape(),
                        k.shape(),
                        v.shape()
                    )));
                }
                (b, sq, hq, d, sk, hkv)
            }
            Some(var) => {
                let (tq, hq, d) = q.shape().dims3()?;
                let (tk, hkv, dk) = k.shape().dims3()?;
                if dk != d || v.shape().dims3()? != (tk, hkv, dk) {
                    return Err(msg(format!(
                        "shape mismatch: q {:?}, k {:?}, v {:?}",
                        q.shape(),
                        k.shape(),
                        v.shape()
                    )));
                }
                let b = var.seqlens_q.dims1()?.saturating_sub(1);
                let args = AttentionArgs::varlen(b, tq, tk, var.max_q, var.max_k, hq, hkv, d);
                return Ok(args
                    .with_scale(o.scale)
                    .with_window(o.window_left, o.window_right)
                    .with_softcap(o.softcap)
                    .with_strides(
                        strides("q", q, true)?,
                        strides("k", k, true)?,
                        strides("v", v, true)?,
                    ));
            }
        };
        Ok(AttentionArgs::new(b, sq, sk, hq, hkv, d)
            .with_scale(o.scale)
            .with_window(o.window_left, o.window_right)
            .with_softcap(o.softcap)
            .with_strides(
                strides("q", q, packed)?,
                strides("k", k, packed)?,
                strides("v", v, packed)?,
            ))
    }

    fn keep(&self, lse: Tensor) {
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(lse);
    }

    /// The offsets of a packed batch on the host.
    fn host_offsets(&self) -> Result<Option<(Vec<i32>, Vec<i32>)>> {
        let Some(var) = &self.varlen else {
            return Ok(None);
        };
        let to = |t: &Tensor| -> Result<Vec<i32>> {
            Ok(t.to_vec1::<u32>()?.into_iter().map(|x| x as i32).collect())
        };
        Ok(Some((to(&var.seqlens_q)?, to(&var.seqlens_k)?)))
    }

    fn cpu_forward<T: HostElem>(
        &self,
        [q, k, v]: [(&CpuStorage, &Layout); 3],
    ) -> Result<(CpuStorage, Shape)> {
        let args = self.args(q.1, k.1, v.1)?;
        let slice = |(s, l): (&CpuStorage, &Layout)| -> Result<Vec<T>> {
            Ok(s.as_slice::<T>()?[l.start_offset()..].to_vec())
        };
        let cu = self.host_offsets()?;
        let cu = cu.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
        let out =
            crate::reference::attention_forward(&args, &slice(q)?, &slice(k)?, &slice(v)?, cu)
                .map_err(crate_err)?;
        self.keep(host_tensor(out.lse, args.lse_len())?);
        Ok((T::to_cpu_storage_owned(out.o), q.1.shape().clone()))
    }

    fn cuda_forward<T: super::Elem>(
        &self,
        [q, k, v]: [(&CudaStorage, &Layout); 3],
    ) -> Result<(CudaStorage, Shape)> {
        let args = self.args(q.1, k.1, v.1)?;
        let device = &q.0.device;
        let stream = device.cuda_stream();
        let (qv, kv, vv) = (from::<T>(q)?, from::<T>(k)?, from::<T>(v)?);
        let mut o = match args.is_varlen() {
            // Tokens outside every sequence are written by no kernel.
            true => stream
                .alloc_zeros::<T>(args.out_len().max(1))
                .map_err(|e| crate_err(e.into()))?,
            false => output::<T>(&stream, args.out_len(), OP)?,
        };
        let mut lse = stream
            .alloc_zeros::<f32>(args.lse_len().max(1))
            .map_err(|e| crate_err(e.into()))?;
        match &self.varlen {
            None => crate::attention_forward(&stream, &args, &qv, &kv, &vv, &mut o, &mut lse),
            Some(var) => {
                let (cq_g, cq_l) = var.seqlens_q.storage_and_layout();
                let (ck_g, ck_l) = var.seqlens_k.storage_and_layout();
                let (cq, ck) = (
                    offsets(&cq_g, cq_l, "seqlens_q")?,
                    offsets(&ck_g, ck_l, "seqlens_k")?,
                );
                crate::attention_forward_varlen(
                    &stream, &args, &qv, &kv, &vv, &cq, &ck, &mut o, &mut lse,
                )
            }
        }
        .map_err(crate_err)?;
        let lse_len = args.lse_len().max(1);
        self.keep(tensor(super::wrap(lse, device), lse_len));
        Ok((super::wrap(o, device), q.1.shape().clone()))
    }

    fn backward(&self, [q, k, v, o, d_o]: [&Tensor; 5]) -> Result<[Tensor; 3]> {
        let lse = self
            .lse
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| msg("backward before forward".into()))?;
        let d_o = d_o.contiguous()?;
        match on(
            OP,
            &[("q", q), ("k", k), ("v", v), ("o", o), ("grad", &d_o)],
        )? {
            On::Cpu => {
                fn run<T: HostElem>(
                    op: &FlashAttn,
                    [q, k, v, d_o]: [&Tensor; 4],
                ) -> Result<[Tensor; 3]> {
                    let (qs, ql) = q.storage_and_layout();
                    let (ks, kl) = k.storage_and_layout();
                    let (vs, vl) = v.storage_and_layout();
                    let args = op.args(ql, kl, vl)?;
                    let slice = |s: &Storage, l: &Layout| -> Result<Vec<T>> {
                        match s {
                            Storage::Cpu(c) => Ok(c.as_slice::<T>()?[l.start_offset()..].to_vec()),
                            _ => Err(msg("tensors on different devices".into())),
                        }
                    };
                    let (qh, kh, vh) = (slice(&qs, ql)?, slice(&ks, kl)?, slice(&vs, vl)?);
                    let cu = op.host_offsets()?;
                    let cu = cu.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
                    let g = crate::reference::attention_backward(
                        &args,
                        &qh,
                        &kh,
                        &vh,
                        &d_o.flatten_all()?.to_vec1::<T>()?,
                        cu,
                    )
                    .map_err(crate_err)?;
                    Ok([
                        host_tensor(g.dq, q.shape().clone())?,
                        host_tensor(g.dk, k.shape().clone())?,
                        host_tensor(g.dv, v.shape().clone())?,
                    ])
                }
                by_host_dtype!(q.dtype(), OP, run(self, [q, k, v, &d_o]))
            }
            On::Cuda => {
                fn run<T: super::Elem>(
                    op: &FlashAttn,
                    [q, k, v, o, d_o, lse]: [&Tensor; 6],
                ) -> Result<[Tensor; 3]> {
                    let (qs, ql) = q.storage_and_layout();
                    let (ks, kl) = k.storage_and_layout();
                    let (vs, vl) = v.storage_and_layout();
                    let (os, ol) = o.storage_and_layout();
                    let (ds, dl) = d_o.storage_and_layout();
                    let (ls, ll) = lse.storage_and_layout();
                    let args = op.args(ql, kl, vl)?;
                    let (qc, kc, vc) = (
                        cuda(&qs, OP, "q")?,
                        cuda(&ks, OP, "k")?,
                        cuda(&vs, OP, "v")?,
                    );
                    let (oc, dc, lc) = (
                        cuda(&os, OP, "o")?,
                        cuda(&ds, OP, "grad")?,
                        cuda(&ls, OP, "lse")?,
                    );
                    let device = &qc.device;
                    let stream = device.cuda_stream();
                    let lse = lc.as_cuda_slice::<f32>()?.slice(ll.start_offset()..);
                    let (eq, ek) = args.extents();
                    let zeros = |n: usize| {
                        stream
                            .alloc_zeros::<T>(n.max(1))
                            .map_err(|e| crate_err(e.into()))
                    };
                    let (mut dq, mut dk, mut dv) = (
                        zeros(eq.span(&args.grads[0]).unwrap_or(0))?,
                        zeros(ek.span(&args.grads[1]).unwrap_or(0))?,
                        zeros(ek.span(&args.grads[2]).unwrap_or(0))?,
                    );
                    let (qv, kv, vv, ov, dov) = (
                        from::<T>((qc, ql))?,
                        from::<T>((kc, kl))?,
                        from::<T>((vc, vl))?,
                        from::<T>((oc, ol))?,
                        from::<T>((dc, dl))?,
                    );
                    match &op.varlen {
                        None => crate::attention_backward(
                            &stream, &args, &qv, &kv, &vv, &ov, &dov, &lse, &mut dq, &mut dk,
                            &mut dv,
                        ),
                        Some(var) => {
                            let (cq_g, cq_l) = var.seqlens_q.storage_and_layout();
                            let (ck_g, ck_l) = var.seqlens_k.storage_and_layout();
                            let (cq, ck) = (
                                offsets(&cq_g, cq_l, "seqlens_q")?,
                                offsets(&ck_g, ck_l, "seqlens_k")?,
                            );
                            crate::attention_backward_varlen(
                                &stream, &args, &qv, &kv, &vv, &ov, &dov, &lse, &cq, &ck, &mut dq,
                                &mut dk, &mut dv,
                            )
                        }
                    }
                    .map_err(crate_err)?;
                    Ok([
                        tensor(super::wrap(dq, device), q.shape().clone()),
                        tensor(super::wrap(dk, device), k.shape().clone()),
                        tensor(super::wrap(dv, device), v.shape().clone()),
                    ])
                }
                by_dtype!(q.dtype(), OP, run(self, [q, k, v, o, &d_o, &lse]))
            }
        }
    }
}

/// A tensor's elements from its layout's start (the launchers take its strides).
fn from<'a, T: super::Elem>(
    (s, l): (&'a CudaStorage, &Layout),
) -> Result<cudarc::driver::CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// A packed batch's u32 offsets on CUDA as the i32 the kernels read (the same bits for
/// offsets below 2³¹, which the kernels clamp to the tokens anyway).
fn offsets<'a>(
    s: &'a Storage,
    l: &Layout,
    name: &str,
) -> Result<cudarc::driver::CudaView<'a, i32>> {
    let c = cuda(s, OP, name)?;
    let (start, end) = l
        .contiguous_offsets()
        .ok_or(candle_core::Error::RequiresContiguous { op: OP })?;
    let view = c.as_cuda_slice::<u32>()?.slice(start..end);
    // SAFETY: u32 and i32 have the same size and every bit pattern is valid in both.
    unsafe { view.transmute::<i32>(end - start) }
        .ok_or_else(|| msg(format!("`{name}` cannot be read as i32")))
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        by_host_dtype!(
            q.dtype(),
            OP,
            cpu_fwd_t(self, [(q, q_l), (k, k_l), (v, v_l)])
        )
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
        v: &CudaStorage,
        v_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        by_dtype!(
            q.dtype(),
            OP,
            cuda_fwd_t(self, [(q, q_l), (k, k_l), (v, v_l)])
        )
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dq, dk, dv] = self.backward([q, k, v, res, grad_res])?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

fn cpu_fwd_t<T: HostElem>(
    op: &FlashAttn,
    s: [(&CpuStorage, &Layout); 3],
) -> Result<(CpuStorage, Shape)> {
    op.cpu_forward::<T>(s)
}

fn cuda_fwd_t<T: super::Elem>(
    op: &FlashAttn,
    s: [(&CudaStorage, &Layout); 3],
) -> Result<(CudaStorage, Shape)> {
    op.cuda_forward::<T>(s)
}

/// Applies the op after checking dtypes and devices in candle's terms; inputs whose last dim
/// is not contiguous are copied first (tracked by autograd).
fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: Options,
    varlen: Option<Varlen>,
) -> Result<Tensor> {
    on(OP, &[("q", q), ("k", k), ("v", v)])?;
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            return Err(msg(format!(
                "`{name}` is {:?} but `q` is {:?}",
                t.dtype(),
                q.dtype()
            )));
        }
    }
    if let Some(var) = &varlen {
        for (name, t) in [("seqlens_q", &var.seqlens_q), ("seqlens_k", &var.seqlens_k)] {
            if t.dtype() != DType::U32 {
                return Err(msg(format!("`{name}` must be u32, got {:?}", t.dtype())));
            }
            if !t.device().same_device(q.device()) {
                return Err(msg(format!("`{name}` is not on q's device")));
            }
        }
    }
    let last_contiguous = |t: &Tensor| -> Result<Tensor> {
        match t.stride().last() {
            Some(1) => Ok(t.clone()),
            _ => t.contiguous(),
        }
    };
    let op = FlashAttn {
        options,
        varlen,
        lse: Mutex::new(None),
    };
    last_contiguous(q)?.apply_op3(&last_contiguous(k)?, &last_contiguous(v)?, op)
}

fn options(
    scale: f32,
    window_left: Option<usize>,
    window_right: Option<usize>,
    softcap: f32,
) -> Options {
    Options {
        scale,
        window_left,
        window_right,
        softcap,
    }
}

fn no_alibi(alibi_slopes: Option<&Tensor>) -> Result<()> {
    match alibi_slopes {
        None => Ok(()),
        Some(_) => Err(msg("ALiBi slopes are not supported; pass None".into())),
    }
}

/// Attention `softmax(scale · q·kᵀ) · v` (causal: bottom-right aligned) over q
/// `[batch, seqlen_q, heads_q, head_dim]` and k, v `[batch, seqlen_k, heads_kv, head_dim]`;
/// returns `[batch, seqlen_q, heads_q, head_dim]`. Differentiable in q, k and v.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = causal.then_some(0);
    apply(q, k, v, options(softmax_scale, None, right, 0.0), None)
}

/// [`flash_attn`] with a window: query `i` sees keys `i − left ..= i + right` (bottom-right
/// aligned; `None`: unbounded on that side). `(None, Some(0))` is causal.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    apply(
        q,
        k,
        v,
        options(softmax_scale, window_size_left, window_size_right, 0.0),
        None,
    )
}

/// [`flash_attn_windowed`] with soft-capped scores `softcap · tanh(s / softcap)` (Gemma 2;
/// 0 for none). `alibi_slopes` must be `None`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    no_alibi(alibi_slopes)?;
    apply(
        q,
        k,
        v,
        options(softmax_scale, window_size_left, window_size_right, softcap),
        None,
    )
}

fn varlen(seqlens_q: &Tensor, seqlens_k: &Tensor, max_q: usize, max_k: usize) -> Option<Varlen> {
    Some(Varlen {
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        max_q,
        max_k,
    })
}

/// [`flash_attn`] on a packed batch: q `[total_q, heads_q, head_dim]`, k and v
/// `[total_k, heads_kv, head_dim]`, sequence `b` at tokens `seqlens_q[b]..seqlens_q[b + 1]`
/// (u32 `[batch + 1]`, from 0; `seqlens_k` for keys), none longer than `max_seqlen_q` /
/// `max_seqlen_k`. Returns `[total_q, heads_q, head_dim]`; tokens outside every sequence get
/// zeros. On CUDA the offsets are device data, not checked: a sequence longer than its
/// maximum is cut to it (its keys past the maximum ignored, its queries past it zero), where
/// the CPU path returns an error.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = causal.then_some(0);
    let var = varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    apply(q, k, v, options(softmax_scale, None, right, 0.0), var)
}

/// [`flash_attn_varlen`] with a window (see [`flash_attn_windowed`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let var = varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    apply(
        q,
        k,
        v,
        options(softmax_scale, window_size_left, window_size_right, 0.0),
        var,
    )
}

/// [`flash_attn_varlen_windowed`] with soft-capping; `alibi_slopes` must be `None`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    no_alibi(alibi_slopes)?;
    let var = varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    apply(
        q,
        k,
        v,
        options(softmax_scale, window_size_left, window_size_right, softcap),
        var,
    )
}

/// [`flash_attn`] on candle-nn's layout: q `[batch, heads_q, seq_q, head_dim]`, k and v
/// `[batch, heads_kv, seq_k, head_dim]`, returning `[batch, heads_q, seq_q, head_dim]`. The
/// transposes are views (the kernels take any head and token strides): no copy.
pub fn flash_attn_bhtd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let t = |x: &Tensor| x.transpose(1, 2);
    flash_attn(&t(q)?, &t(k)?, &t(v)?, softmax_scale, causal)?.transpose(1, 2)
}
