//! Embedding lookup with candle autograd: one node whose backward is this crate's
//! deterministic kernel (candle-nn's `Embedding` is an `index_select` and two reshapes; the
//! `index_select`'s backward, candle's CUDA `index_add`, has one thread per column walk every
//! id, adding in the tensor's dtype).
use super::grad_slot::GradSlot;
use super::{
    Elem, HostElem, by_dtype, by_host_dtype, crate_err, cuda, host, host_slice, host_tensor, on,
    output, tensor, view, wrap,
};
use crate::reference::embedding as reference;
use crate::{EmbeddingArgs, TokenId};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};

const OP: &str = "liger-rs embedding";

/// The node: the table `[vocab, hidden]` and the ids (u32 or i64, any shape); the table's
/// gradient goes to `slot` where one is given.
struct Embed {
    vocab: usize,
    hidden: usize,
    slot: Option<GradSlot>,
}

impl Embed {
    fn args(&self, tokens: usize) -> EmbeddingArgs {
        EmbeddingArgs::new(tokens, self.vocab, self.hidden)
    }

    fn out_shape(&self, ids: &Shape) -> Shape {
        let mut dims = ids.dims().to_vec();
        dims.push(self.hidden);
        Shape::from(dims)
    }
}

/// Runs `$f::<[G,] I>(args)` for the id type `I` of `$dtype` (u32 or i64).
macro_rules! by_id_type {
    ($dtype:expr, $f:ident $(<$g:ty>)? ($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::U32 => $f::<$($g,)? u32>($($arg),*),
            DType::I64 => $f::<$($g,)? i64>($($arg),*),
            other => bail!("{OP}: ids must be u32 or i64, got {other:?}"),
        }
    };
}

fn fwd_cpu<T: HostElem>(
    op: &Embed,
    (t, tl): (&CpuStorage, &Layout),
    (i, il): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    fn ids<T: HostElem, I: TokenId + candle_core::WithDType>(
        op: &Embed,
        table: &[T],
        (i, il): (&CpuStorage, &Layout),
    ) -> Result<Vec<T>> {
        let ids = host_slice::<I>(i, il, OP)?;
        reference::embedding_forward(&op.args(ids.len()), table, ids).map_err(crate_err)
    }
    let table = host_slice::<T>(t, tl, OP)?;
    let y = by_id_type!(i.dtype(), ids<T>(op, table, (i, il)))?;
    Ok((T::to_cpu_storage_owned(y), op.out_shape(il.shape())))
}

fn fwd_cuda<T: Elem>(
    op: &Embed,
    (t, tl): (&CudaStorage, &Layout),
    (i, il): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    fn ids<T: Elem, I: TokenId + candle_core::cuda::CudaDType>(
        op: &Embed,
        (t, tl): (&CudaStorage, &Layout),
        (i, il): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let device = &t.device;
        let stream = device.cuda_stream();
        let table = view::<T>(t, tl, OP)?;
        let ids = view::<I>(i, il, OP)?;
        let args = op.args(ids.len());
        let mut y = output::<T>(&stream, args.tokens * args.hidden, OP)?;
        crate::embedding_forward(&stream, &args, &table, &ids, &mut y).map_err(crate_err)?;
        Ok(wrap(y, device))
    }
    let y = by_id_type!(i.dtype(), ids<T>(op, (t, tl), (i, il)))?;
    Ok((y, op.out_shape(il.shape())))
}

/// The table's gradient from the rows' `dy` (contiguous), on the ids' device.
fn backward(op: &Embed, ids: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let shape = Shape::from((op.vocab, op.hidden));
    if ids.device().is_cpu() {
        fn run<T: HostElem>(op: &Embed, ids: &Tensor, dy: &Tensor) -> Result<Vec<T>> {
            fn typed<T: HostElem, I: TokenId + candle_core::WithDType>(
                op: &Embed,
                ids: &Tensor,
                dy: &[T],
            ) -> Result<Vec<T>> {
                let ids = host::<I>(ids)?;
                reference::embedding_backward(&op.args(ids.len()), &ids, dy).map_err(crate_err)
            }
            let dy = host::<T>(dy)?;
            by_id_type!(ids.dtype(), typed<T>(op, ids, &dy))
        }
        fn to_tensor<T: HostElem>(op: &Embed, ids: &Tensor, dy: &Tensor) -> Result<Tensor> {
            host_tensor(run::<T>(op, ids, dy)?, (op.vocab, op.hidden))
        }
        return by_host_dtype!(dy.dtype(), OP, to_tensor(op, ids, dy));
    }
    fn run<T: Elem>(op: &Embed, ids: &Tensor, dy: &Tensor) -> Result<CudaStorage> {
        fn typed<T: Elem, I: TokenId + candle_core::cuda::CudaDType>(
            op: &Embed,
            ids: &Tensor,
            dy: &Tensor,
        ) -> Result<CudaStorage> {
            let (is, il) = ids.storage_and_layout();
            let (ds, dl) = dy.storage_and_layout();
            let (is, ds) = (cuda(&is, OP, "ids")?, cuda(&ds, OP, "grad")?);
            let device = &ds.device;
            let stream = device.cuda_stream();
            let ids = view::<I>(is, il, OP)?;
            let dy = view::<T>(ds, dl, OP)?;
            let args = op.args(ids.len());
            let mut dw = output::<T>(&stream, args.vocab * args.hidden, OP)?;
            crate::embedding_backward(&stream, &args, &mut dw, &ids, &dy).map_err(crate_err)?;
            Ok(wrap(dw, device))
        }
        by_id_type!(ids.dtype(), typed<T>(op, ids, dy))
    }
    let dw = by_dtype!(dy.dtype(), OP, run(op, ids, dy))?;
    Ok(tensor(dw, shape))
}

impl CustomOp2 for Embed {
    fn name(&self) -> &'static str {
        OP
    }
    fn cpu_fwd(
        &self,
        t: &CpuStorage,
        tl: &Layout,
        i: &CpuStorage,
        il: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_host_dtype!(t.dtype(), OP, fwd_cpu(self, (t, tl), (i, il)))
    }
    fn cuda_fwd(
        &self,
        t: &CudaStorage,
        tl: &Layout,
        i: &CudaStorage,
        il: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(t.dtype(), OP, fwd_cuda(self, (t, tl), (i, il)))
    }
    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dw = match table.track_op() {
            true => Some(backward(self, ids, &dy.contiguous()?)?),
            false => None,
        };
        Ok((GradSlot::hand_on(self.slot.as_ref(), table, dw)?, None))
    }
}

/// `table[ids]`: the rows of `table [vocab, hidden]` at `ids` (u8, u32 or i64, any shape),
/// `[..ids, hidden]`, as one autograd node (candle-nn's `Embedding::forward`, with a
/// gradient for the table). The backward sums each row's token gradients in f32 in token
/// order (bitwise deterministic) with this crate's kernel on CUDA, the reference on the CPU.
/// An id outside `[0, vocab)` gathers a zero row and adds to no row of the gradient (candle's
/// CUDA `index_select` fails a device-side assertion there, which ends the context).
///
/// f32, f16 and bf16 on CUDA; those and f64 on the CPU.
///
/// # Errors
/// A table that is not 2-D, ids of another type, tensors on different devices; the
/// launchers' errors.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let table = Var::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu)?;
/// let ids = Tensor::new(&[[2u32, 0, 2]], &Device::Cpu)?;
/// let y = liger_rs::candle::embedding(table.as_tensor(), &ids)?; // [1, 3, 2]
/// assert_eq!(y.to_vec3::<f32>()?, [[[5.0, 6.0], [1.0, 2.0], [5.0, 6.0]]]);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&table).unwrap().to_vec2::<f32>()?, [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    lookup(table, ids, None)
}

/// [`embedding`] whose backward puts the table's gradient into `slot` (summed with what it
/// holds) instead of handing it to candle's backward (see [`GradSlot`]).
///
/// # Errors
/// As [`embedding`].
pub fn embedding_with_slot(table: &Tensor, ids: &Tensor, slot: &GradSlot) -> Result<Tensor> {
    lookup(table, ids, Some(slot))
}

fn lookup(table: &Tensor, ids: &Tensor, slot: Option<&GradSlot>) -> Result<Tensor> {
    on(OP, &[("table", table), ("ids", ids)]).map(|_| ())?;
    let (vocab, hidden) = match *table.dims() {
        [v, h] => (v, h),
        _ => bail!(
            "{OP}: table must be [vocab, hidden], got {:?}",
            table.dims()
        ),
    };
    let ids = match ids.dtype() {
        DType::U32 | DType::I64 => ids.contiguous()?,
        DType::U8 => ids.to_dtype(DType::U32)?,
        other => bail!("{OP}: ids must be u8, u32 or i64, got {other:?}"),
    };
    let op = Embed {
        vocab,
        hidden,
        slot: slot.cloned(),
    };
    table.contiguous()?.apply_op2(&ids, op)
}

/// candle-nn's `Embedding` (same constructor, accessors and `Module::forward`), its forward
/// [`embedding`]: one autograd node with a deterministic backward.
///
/// ```
/// use liger_rs::candle::nn::{Embedding, Module};
/// use candle_core::{DType, Device, Tensor};
/// let emb = Embedding::new(Tensor::eye(4, DType::F32, &Device::Cpu)?, 4);
/// let y = emb.forward(&Tensor::new(&[3u32, 1], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Embedding {
    embeddings: Tensor,
    hidden_size: usize,
}

impl Embedding {
    /// A lookup into `embeddings` `[vocab, hidden_size]`.
    pub fn new(embeddings: Tensor, hidden_size: usize) -> Self {
        Embedding {
            embeddings,
            hidden_size,
        }
    }

    /// The table, `[vocab, hidden_size]`.
    pub fn embeddings(&self) -> &Tensor {
        &self.embeddings
    }

    /// Elements of a row.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }
}

impl From<candle_nn::Embedding> for Embedding {
    /// The same table.
    fn from(e: candle_nn::Embedding) -> Self {
        Embedding::new(e.embeddings().clone(), e.hidden_size())
    }
}

impl candle_core::Module for Embedding {
    /// As candle-nn's: the rows of `indexes`, `[..indexes, hidden_size]` (a table whose rows
    /// are not `hidden_size` wide is an error, as candle-nn's reshape makes it).
    fn forward(&self, indexes: &Tensor) -> Result<Tensor> {
        let mut dims = indexes.dims().to_vec();
        dims.push(self.hidden_size);
        embedding(&self.embeddings, indexes)?.reshape(dims)
    }
}
