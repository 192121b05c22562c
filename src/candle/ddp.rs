//! Data-parallel training: every rank (one per GPU, in its own thread or process) runs the
//! same model on its share of the global batch, and [`DataParallel::average_gradients`] makes
//! every rank's gradients the mean over the ranks before the optimizer step, so the ranks'
//! weights stay bitwise equal and the step is the single-device step on the whole batch.
//!
//! The collective is a [`Collective`]: `Nccl` (feature `nccl`: NCCL through cudarc's
//! bindings, on the tensors' own device stream, so it is ordered with candle's work and this
//! crate's kernels without a synchronisation), or [`HostGroup`], ranks as threads of one
//! process combining through host memory (any device, the CPU included: what the CPU tests
//! use, and a way to check a data-parallel loop without several GPUs; not fast).
//!
//! Gradients are reduced in buckets of about [`DataParallel::DEFAULT_BUCKET_BYTES`] (PyTorch
//! DDP's `bucket_cap_mb`), the last parameters first, each bucket one flat tensor: one
//! collective call per bucket instead of one per parameter. candle's backward hands back
//! every gradient at once (it has no per-parameter hooks), so the buckets are reduced after
//! the backward, back to back on the device stream; they do not overlap it.
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Var};
//! use liger_rs::candle::ddp::{Collective, DataParallel, HostGroup};
//!
//! // Two ranks as two threads on the CPU; with GPUs, `Nccl::new(&device, rank, n, id)`.
//! let rank_grads = std::thread::scope(|s| {
//!     let ranks: Vec<_> = HostGroup::new(2)
//!         .into_iter()
//!         .map(|group| {
//!             s.spawn(move || -> candle_core::Result<Vec<f32>> {
//!                 let w = Var::ones(4, DType::F32, &Device::Cpu)?;
//!                 let bytes = DataParallel::<HostGroup>::DEFAULT_BUCKET_BYTES;
//!                 let ddp = DataParallel::new(group, vec![w.clone()], bytes)?;
//!                 // Rank r's loss is r · Σw, so its gradient is r everywhere.
//!                 let r = ddp.collective().rank() as f64;
//!                 let mut grads = (w.as_tensor() * r)?.sum_all()?.backward()?;
//!                 ddp.average_gradients(&mut grads)?;
//!                 grads.get(&w).expect("a gradient").to_vec1::<f32>()
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|h| h.join().expect("rank")).collect::<Vec<_>>()
//! });
//! for grads in rank_grads {
//!     assert_eq!(grads?, vec![0.5; 4]); // the mean of 0 and 1, on both ranks
//! }
//! # Ok(())
//! # }
//! ```
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use std::ops::Range;
use std::sync::{Arc, Barrier, Mutex};

fn msg(text: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("liger-ddp: {text}"))
}

/// How [`Collective::all_reduce`] combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over the ranks.
    Sum,
    /// The largest value over the ranks.
    Max,
    /// The smallest value over the ranks.
    Min,
    /// The mean over the ranks (NCCL's `ncclAvg`).
    Avg,
}

/// A group of ranks that can combine equal-shaped tensors: one value per rank, each rank
/// calling the same collectives in the same order (as NCCL requires). A rank that stops
/// calling (an error returned before the call, a panic) leaves the others waiting in their
/// next collective, as with NCCL, and a group in which one rank's call failed is not usable
/// again: a data-parallel loop must stop every rank on one's error (the training example
/// exits the process).
pub trait Collective {
    /// This rank's index, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces `t` on every rank by `op` over the ranks' `t`, in place; every rank gets the
    /// same bits.
    ///
    /// # Errors
    /// `t` not contiguous, or on another kind of device (or another GPU) than the collective
    /// serves, or the collective failing (NCCL's error, a rank that left the group).
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()>;
}

/// Ranks as threads of one process: [`HostGroup::new`] returns one handle per rank, to move
/// into its thread. Each call copies the rank's tensor to the host as f64, waits for every
/// rank, combines the values in rank order (so every rank computes the same bits) and rounds
/// the result once to the tensor's dtype. Any device, the CPU included; a test double for
/// `Nccl`, not fast.
pub struct HostGroup {
    rank: usize,
    shared: Arc<HostShared>,
}

struct HostShared {
    world_size: usize,
    barrier: Barrier,
    parts: Mutex<Vec<Vec<f64>>>,
}

impl HostGroup {
    /// One handle for each of `world_size` ranks, rank `i` at index `i`.
    ///
    /// # Panics
    /// `world_size` is 0.
    pub fn new(world_size: usize) -> Vec<HostGroup> {
        assert!(world_size > 0, "a group has at least one rank");
        let shared = Arc::new(HostShared {
            world_size,
            barrier: Barrier::new(world_size),
            parts: Mutex::new(vec![Vec::new(); world_size]),
        });
        (0..world_size)
            .map(|rank| HostGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl Collective for HostGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        if !t.is_contiguous() {
            return Err(msg("all_reduce of a non-contiguous tensor".into()));
        }
        let mine = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let poisoned = || msg("a rank panicked inside an all_reduce".into());
        self.shared.parts.lock().map_err(|_| poisoned())?[self.rank] = mine;
        self.shared.barrier.wait();
        let combined = {
            let parts = self.shared.parts.lock().map_err(|_| poisoned())?;
            let n = parts[self.rank].len();
            if parts.iter().any(|p| p.len() != n) {
                return Err(msg("all_reduce over tensors of different sizes".into()));
            }
            let mut acc = parts[0].clone();
            for part in &parts[1..] {
                for (a, &b) in acc.iter_mut().zip(part) {
                    *a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => *a + b,
                        ReduceOp::Max => a.max(b),
                        ReduceOp::Min => a.min(b),
                    };
                }
            }
            if op == ReduceOp::Avg {
                let n = parts.len() as f64;
                acc.iter_mut().for_each(|a| *a /= n);
            }
            acc
        };
        // No rank overwrites its part with the next call's before every rank has read them.
        self.shared.barrier.wait();
        let result = Tensor::from_vec(combined, t.shape(), &Device::Cpu)?
            .to_dtype(t.dtype())?
            .to_device(t.device())?;
        // A flattened contiguous tensor shares `t`'s storage: this writes `t` in place.
        t.flatten_all()?.slice_set(&result.flatten_all()?, 0, 0)
    }
}

#[cfg(feature = "nccl")]
pub use nccl::{Nccl, NcclId};

#[cfg(feature = "nccl")]
mod nccl {
    use super::{Collective, ReduceOp, msg};
    use candle_core::backend::BackendStorage;
    use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};
    use cudarc::nccl::safe::{Comm, ReduceOp as NcclOp};

    /// The id that every rank of one NCCL group is created with: [`Nccl::unique_id`] on one
    /// rank, then handed to the others (a copy within a process; its bytes,
    /// [`NcclId::internal`], between processes).
    pub use cudarc::nccl::safe::Id as NcclId;

    /// One rank of an NCCL communicator on one CUDA device (feature `nccl`). Its collectives
    /// run on the device's candle stream ([`CudaDevice::cuda_stream`]), so they are ordered
    /// with the work queued before and after them on that device; like NCCL's, each call
    /// returns once queued. Not `Send`: create it in the thread that drives its device.
    ///
    /// [`CudaDevice::cuda_stream`]: candle_core::CudaDevice::cuda_stream
    pub struct Nccl {
        comm: Comm,
    }

    impl Nccl {
        /// A fresh group id (NCCL's `ncclGetUniqueId`), made once and given to every rank.
        ///
        /// # Errors
        /// NCCL's error.
        pub fn unique_id() -> Result<NcclId> {
            NcclId::new().map_err(|e| msg(format!("ncclGetUniqueId: {e:?}")))
        }

        /// Rank `rank` of `world_size` on `device`, joining the group `id`: blocks until every
        /// rank has joined (NCCL's `ncclCommInitRank`), so the ranks must be created
        /// concurrently, one per thread or process, each on its own GPU.
        ///
        /// # Errors
        /// `device` is not a CUDA device, `rank ≥ world_size`, binding the device's context
        /// to this thread fails, or NCCL's error (e.g. two ranks on one GPU).
        pub fn new(device: &Device, rank: usize, world_size: usize, id: NcclId) -> Result<Self> {
            let Device::Cuda(cuda) = device else {
                return Err(msg(format!("NCCL needs a CUDA device, not {device:?}")));
            };
            if rank >= world_size {
                return Err(msg(format!("rank {rank} of a group of {world_size}")));
            }
            // NCCL creates the communicator on the calling thread's current device, which a
            // fresh thread does not have and another thread may have set to another GPU.
            let stream = cuda.cuda_stream();
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| msg(format!("binding {device:?}'s context: {e:?}")))?;
            let comm = Comm::from_rank(stream, rank, world_size, id)
                .map_err(|e| msg(format!("ncclCommInitRank (rank {rank}): {e:?}")))?;
            Ok(Nccl { comm })
        }
    }

    impl Collective for Nccl {
        fn rank(&self) -> usize {
            self.comm.rank()
        }

        fn world_size(&self) -> usize {
            self.comm.world_size()
        }

        fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
            if !t.is_contiguous() {
                return Err(msg("all_reduce of a non-contiguous tensor".into()));
            }
            t.inplace_op1(&AllReduce {
                comm: &self.comm,
                op,
            })
        }
    }

    struct AllReduce<'a> {
        comm: &'a Comm,
        op: ReduceOp,
    }

    impl AllReduce<'_> {
        fn run<T: cudarc::nccl::safe::NcclType + candle_core::cuda_backend::CudaDType>(
            &self,
            storage: &mut CudaStorage,
            layout: &Layout,
        ) -> Result<()> {
            let op = match self.op {
                ReduceOp::Sum => NcclOp::Sum,
                ReduceOp::Max => NcclOp::Max,
                ReduceOp::Min => NcclOp::Min,
                ReduceOp::Avg => NcclOp::Avg,
            };
            let start = layout.start_offset();
            let slice = storage.as_cuda_slice_mut::<T>()?;
            // NCCL would read and write another GPU's memory, unordered with its stream.
            if slice.context().cu_ctx() != self.comm.context().cu_ctx() {
                return Err(msg(format!(
                    "all_reduce of a tensor on GPU {} through a rank on GPU {}",
                    slice.ordinal(),
                    self.comm.ordinal()
                )));
            }
            let mut view = slice.slice_mut(start..start + layout.shape().elem_count());
            self.comm
                .all_reduce_in_place(&mut view, &op)
                .map_err(|e| msg(format!("ncclAllReduce: {e:?}")))?;
            Ok(())
        }
    }

    impl InplaceOp1 for AllReduce<'_> {
        fn name(&self) -> &'static str {
            "liger-ddp-all-reduce"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
            Err(msg("NCCL reduces CUDA tensors, not CPU ones".into()))
        }

        fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
            match storage.dtype() {
                DType::F32 => self.run::<f32>(storage, layout),
                DType::F64 => self.run::<f64>(storage, layout),
                DType::BF16 => self.run::<half::bf16>(storage, layout),
                DType::F16 => self.run::<half::f16>(storage, layout),
                other => Err(msg(format!("all_reduce of {other:?}"))),
            }
        }
    }
}

/// Whether each of `vars` holds the same values on every rank of `collective` (the largest and
/// the smallest value over the ranks are equal, element by element; a NaN counts as differing,
/// −0 as +0): the check that a data-parallel run's ranks have not drifted apart, e.g. over f32
/// masters whose compute-dtype copies are what [`DataParallel`] reduces. One host read for all
/// of them. Collective: every rank calls it with the same variables.
///
/// # Errors
/// The collective's errors; `vars` empty.
pub fn in_sync<C: Collective + ?Sized>(collective: &C, vars: &[Var]) -> Result<bool> {
    let (mut differ, mut nans) = (
        Vec::with_capacity(vars.len()),
        Vec::with_capacity(vars.len()),
    );
    for v in vars {
        let t = v.as_tensor();
        let (hi, lo) = (t.copy()?, t.copy()?);
        collective.all_reduce(&hi, ReduceOp::Max)?;
        collective.all_reduce(&lo, ReduceOp::Min)?;
        differ.push(hi.ne(&lo)?.to_dtype(DType::F32)?.sum_all()?);
        // Max and Min pass over a NaN (NCCL's as `f64::max` does): each rank counts its own.
        nans.push(t.ne(t)?.to_dtype(DType::F32)?.sum_all()?);
    }
    let nans = Tensor::stack(&nans, 0)?.sum_all()?.reshape(1)?;
    collective.all_reduce(&nans, ReduceOp::Sum)?;
    let differ = Tensor::stack(&differ, 0)?.sum_all()?.reshape(1)?;
    Ok((differ + nans)?.sum_all()?.to_scalar::<f32>()? == 0.0)
}

/// The gradient reducer of a data-parallel model: the parameters in buckets, and the
/// collective that averages their gradients.
pub struct DataParallel<C: Collective> {
    collective: C,
    vars: Vec<Var>,
    /// Ranges of `vars`, last parameters first, each of one dtype.
    buckets: Vec<Range<usize>>,
}

impl<C: Collective> DataParallel<C> {
    /// PyTorch DDP's default bucket (`bucket_cap_mb = 25`).
    pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

    /// The reducer for `vars` (every parameter that gets a gradient, in the same order on
    /// every rank) over `collective`, in buckets of at most `bucket_bytes` (a parameter larger
    /// than that is a bucket of its own).
    ///
    /// # Errors
    /// No parameters, or `bucket_bytes` is 0.
    pub fn new(collective: C, vars: Vec<Var>, bucket_bytes: usize) -> Result<Self> {
        if vars.is_empty() || bucket_bytes == 0 {
            return Err(msg(format!(
                "{} parameters in buckets of {bucket_bytes} bytes",
                vars.len()
            )));
        }
        let mut buckets = Vec::new();
        let mut end = vars.len();
        while end > 0 {
            let mut start = end - 1;
            let mut bytes = vars[start].elem_count() * vars[start].dtype().size_in_bytes();
            while start > 0 {
                let v = &vars[start - 1];
                let more = v.elem_count() * v.dtype().size_in_bytes();
                if v.dtype() != vars[start].dtype() || bytes + more > bucket_bytes {
                    break;
                }
                bytes += more;
                start -= 1;
            }
            buckets.push(start..end);
            end = start;
        }
        Ok(DataParallel {
            collective,
            vars,
            buckets,
        })
    }

    /// The collective, e.g. for this rank's index.
    pub fn collective(&self) -> &C {
        &self.collective
    }

    /// The buckets, as ranges of the parameters in the order [`DataParallel::new`] took them,
    /// in the order they are reduced.
    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// Replaces each parameter's gradient in `grads` by its mean over the ranks
    /// ([`ReduceOp::Avg`]), one collective call per bucket. A parameter without a
    /// gradient takes part with zeros and gets the mean, even when no rank has one (where
    /// PyTorch's DDP leaves it without a gradient, so that an optimizer skips it: leave such a
    /// parameter out of the reducer's). Each gradient becomes a view into its bucket's flat
    /// tensor; a bucket of one parameter is its gradient itself, averaged in place.
    ///
    /// # Errors
    /// The collective's errors; a gradient whose shape or dtype is not its parameter's.
    pub fn average_gradients(&self, grads: &mut GradStore) -> Result<()> {
        for range in &self.buckets {
            let vars = &self.vars[range.clone()];
            let mut flat = Vec::with_capacity(vars.len());
            for v in vars {
                let g = match grads.get(v) {
                    Some(g) if g.shape() == v.shape() && g.dtype() == v.dtype() => {
                        g.flatten_all()?
                    }
                    Some(g) => {
                        return Err(msg(format!(
                            "a gradient {:?} {:?} for a parameter {:?} {:?}",
                            g.dtype(),
                            g.shape(),
                            v.dtype(),
                            v.shape()
                        )));
                    }
                    None => v.zeros_like()?.flatten_all()?,
                };
                flat.push(g);
            }
            let flat = Tensor::cat(&flat, 0)?;
            self.collective.all_reduce(&flat, ReduceOp::Avg)?;
            let mut at = 0;
            for v in vars {
                let n = v.elem_count();
                grads.insert(v, flat.narrow(0, at, n)?.reshape(v.shape())?);
                at += n;
            }
        }
        Ok(())
    }

    /// Whether every parameter holds the same values on every rank: [`in_sync`] over this
    /// reducer's parameters. Collective: every rank calls it.
    ///
    /// # Errors
    /// The collective's errors.
    pub fn in_sync(&self) -> Result<bool> {
        in_sync(&self.collective, &self.vars)
    }

    /// The mean over the ranks of a scalar (e.g. each rank's loss on its share of the batch):
    /// with equal shares, the loss of the whole batch. Collective: every rank calls it.
    ///
    /// # Errors
    /// `value` is not a scalar; the collective's errors.
    pub fn mean(&self, value: &Tensor) -> Result<f32> {
        let v = value.to_dtype(DType::F32)?.reshape(1)?.copy()?;
        self.collective.all_reduce(&v, ReduceOp::Avg)?;
        v.to_vec1::<f32>().map(|v| v[0])
    }
}
