//! candle-nn's `AdamW` optimizer on this crate's fused update: [`AdamW`] implements
//! `candle_nn::Optimizer` with candle-nn's `ParamsAdamW` (and its `new_lr`, `params` and
//! `set_params`), so for f32 variables the port is the `use` line; a f16/bf16 model keeps f32
//! masters through [`AdamW::new_mixed`]. As in PyTorch, and unlike candle-nn (one count for
//! the optimizer), each variable's bias correction counts its own updates: a variable without
//! a gradient in a step is not updated and its count does not advance.
//!
//! A step on CUDA is one multi-tensor launch per 32 variables (PyTorch's
//! `AdamW(fused=True)` arithmetic): every variable's storage is write-locked through candle's
//! own in-place-op locks, held together for the launch, and θ, m, v are read and written once.
//! [`AdamW::new_mixed`] keeps f32 masters and hands the model f16/bf16 copies, which the same
//! launch rewrites; [`AdamW::clip_grad_norm`] clips the next step by the global norm. CPU
//! variables run the reference.
use super::{crate_err, cuda, view};
use crate::reference::Element;
use crate::reference::adamw::{self as reference, AdamWState};
use crate::{AdamWArgs, AdamWTensor, Dtype, NormType, StepScalars};
use candle_core::backprop::GradStore;
use candle_core::cuda_backend::CudaDType;
use candle_core::{
    CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Result, Storage, Tensor, Var,
};
use candle_nn::ParamsAdamW;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use std::cell::RefCell;

const OP: &str = "liger-adamw";

fn msg(text: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {text}"))
}

/// A variable's moments.
enum Moments {
    Cuda(CudaSlice<f32>, CudaSlice<f32>),
    Cpu(Vec<f32>, Vec<f32>),
}

/// One optimized variable: its f32 master, the low-precision copy the model uses (mixed
/// precision), its moments.
struct Entry {
    master: Var,
    copy: Option<Var>,
    moments: Moments,
    /// Steps that updated it: PyTorch counts a parameter's steps from its first gradient.
    steps: usize,
}

impl Entry {
    fn new(master: Var, copy: Option<Var>) -> Result<Self> {
        if master.dtype() != DType::F32 {
            return Err(msg(format!(
                "variables are f32 master weights, got {:?}",
                master.dtype()
            )));
        }
        let n = master.elem_count();
        let moments = match &*master.storage_and_layout().0 {
            Storage::Cuda(s) => {
                let stream = s.device.cuda_stream();
                let z = || {
                    stream
                        .alloc_zeros::<f32>(n.max(1))
                        .map_err(|e| crate_err(e.into()))
                };
                Moments::Cuda(z()?, z()?)
            }
            Storage::Cpu(_) => Moments::Cpu(vec![0.0; n], vec![0.0; n]),
            Storage::Metal(_) => return Err(msg("no Metal".into())),
        };
        Ok(Entry {
            master,
            copy,
            moments,
            steps: 0,
        })
    }

    /// The variable the model uses, whose gradient the step takes.
    fn used(&self) -> &Var {
        self.copy.as_ref().unwrap_or(&self.master)
    }
}

/// The clip factor the next step applies: `[norm, factor, non-finite]` on the device, or the
/// factor.
enum Clip {
    Cuda(Tensor),
    Cpu(f32),
}

/// candle-nn's `AdamW` (the same `ParamsAdamW`, learning-rate accessors and `step`) on the
/// fused kernel, with PyTorch's `AdamW(fused=True)` arithmetic.
///
/// The moments are allocated, zeroed, updated and freed on the variables' device stream as the
/// calling thread sees it, and `Device::new_cuda`'s stream is per thread (one per host
/// thread): build, step and drop the optimizer on one thread, or synchronize the device
/// before it moves to another, as for any candle tensor.
///
/// ```
/// use candle_core::{Device, Var};
/// use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
/// let w = Var::new(&[1f32, -2.0, 3.0], &Device::Cpu)?;
/// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW { lr: 0.1, ..Default::default() })?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// let grads = loss.backward()?;
/// let norm = opt.clip_grad_norm(&grads, 1.0)?; // √(4 + 16 + 36), clipped to 1 in the step
/// assert!((norm.to_scalar::<f32>()? - 56f32.sqrt()).abs() < 1e-5);
/// opt.step(&grads)?;
/// assert!(w.as_tensor().to_vec1::<f32>()?[0] < 1.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct AdamW {
    entries: Vec<Entry>,
    params: ParamsAdamW,
    clip: Option<Clip>,
}

impl AdamW {
    fn args(&self) -> AdamWArgs {
        AdamWArgs::new(self.params.lr)
            .with_betas(self.params.beta1, self.params.beta2)
            .with_eps(self.params.eps)
            .with_weight_decay(self.params.weight_decay)
    }

    /// Mixed precision: f32 master weights in, their `dtype` (f16 or bf16) copies out for
    /// the model to use. The gradients are taken from the copies; each step updates the
    /// masters and rewrites the copies (the updated masters rounded once) in the same launch.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
    /// let master = Var::new(&[1f32, -2.0], &Device::Cpu)?;
    /// let (mut opt, copies) = AdamW::new_mixed(vec![master.clone()], ParamsAdamW::default(), DType::BF16)?;
    /// let loss = copies[0].as_tensor().to_dtype(DType::F32)?.sqr()?.sum_all()?;
    /// opt.backward_step(&loss)?;
    /// let (m, c) = (master.as_tensor().to_vec1::<f32>()?, copies[0].as_tensor().to_vec1::<half::bf16>()?);
    /// assert_eq!(c[0], half::bf16::from_f32(m[0]));
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// A master that is not f32, a `dtype` other than f16 or bf16.
    pub fn new_mixed(
        masters: Vec<Var>,
        params: ParamsAdamW,
        dtype: DType,
    ) -> Result<(Self, Vec<Var>)> {
        if !matches!(dtype, DType::F16 | DType::BF16) {
            return Err(msg(format!("copies are f16 or bf16, got {dtype:?}")));
        }
        let mut entries = Vec::with_capacity(masters.len());
        let mut copies = Vec::with_capacity(masters.len());
        for master in masters {
            let copy = Var::from_tensor(&master.as_tensor().to_dtype(dtype)?)?;
            copies.push(copy.clone());
            entries.push(Entry::new(master, Some(copy))?);
        }
        let opt = AdamW {
            entries,
            params,
            clip: None,
        };
        Ok((opt, copies))
    }

    /// candle-nn's `AdamW::new_lr`: the default parameters with learning rate `learning_rate`.
    ///
    /// # Errors
    /// As [`candle_nn::Optimizer::new`]: a floating-point variable that is not f32.
    pub fn new_lr(vars: Vec<Var>, learning_rate: f64) -> Result<Self> {
        let params = ParamsAdamW {
            lr: learning_rate,
            ..ParamsAdamW::default()
        };
        <Self as candle_nn::Optimizer>::new(vars, params)
    }

    /// The parameters (candle-nn's `AdamW::params`).
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Replaces the parameters for the next steps (candle-nn's `AdamW::set_params`).
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// The variables a step over `list` writes: the masters, then the copies.
    fn targets(&self, list: &[(usize, Tensor)]) -> Vec<Tensor> {
        let masters = list
            .iter()
            .map(|(i, _)| self.entries[*i].master.as_tensor());
        let copies = list
            .iter()
            .filter_map(|(i, _)| self.entries[*i].copy.as_ref().map(|c| c.as_tensor()));
        masters.chain(copies).cloned().collect()
    }

    /// The variables with a gradient in `grads` (and elements), with that gradient.
    fn with_grads(&self, grads: &GradStore) -> Result<Vec<(usize, Tensor)>> {
        let mut out = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if e.master.elem_count() == 0 {
                continue;
            }
            if let Some(g) = grads.get(e.used()) {
                out.push((i, g.contiguous()?));
            }
        }
        Ok(out)
    }

    /// The global L2 norm of the gradients in `grads` (PyTorch's `clip_grad_norm_`), returned
    /// as a scalar f32 tensor on the variables' device without a host synchronisation; the
    /// next [`step`](candle_nn::Optimizer::step) scales every gradient by
    /// `min(1, max_norm / (norm + 1e-6))` inside its update (no extra pass).
    ///
    /// # Errors
    /// `max_norm` not > 0; gradients of another device.
    pub fn clip_grad_norm(&mut self, grads: &GradStore, max_norm: f64) -> Result<Tensor> {
        if max_norm.is_nan() || max_norm <= 0.0 {
            let e = crate::error::invalid("max_norm", "a value > 0", max_norm);
            return Err(crate_err(e));
        }
        let list = self.with_grads(grads)?;
        let device = match self.entries.first() {
            Some(e) => e.master.device().clone(),
            None => Device::Cpu,
        };
        if list.is_empty() {
            self.clip = None;
            return Tensor::zeros((), DType::F32, &device);
        }
        let dtype = list[0].1.dtype();
        if let Device::Cuda(dev) = &device {
            let guards: Vec<_> = list.iter().map(|(_, g)| g.storage_and_layout()).collect();
            let mut out = dev
                .cuda_stream()
                .alloc_zeros::<f32>(3)
                .map_err(|e| crate_err(e.into()))?;
            match dtype {
                DType::F32 => norm_into::<f32>(&guards, max_norm, &mut out)?,
                DType::F16 => norm_into::<f16>(&guards, max_norm, &mut out)?,
                DType::BF16 => norm_into::<bf16>(&guards, max_norm, &mut out)?,
                other => return Err(msg(format!("gradients of {other:?}"))),
            }
            let both = super::tensor(super::wrap(out, dev), 3);
            let norm = both.narrow(0, 0, 1)?.reshape(())?;
            self.clip = Some(Clip::Cuda(both));
            return Ok(norm);
        }
        let host: Vec<Vec<f32>> = list
            .iter()
            .map(|(_, g)| g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>())
            .collect::<Result<_>>()?;
        let slices: Vec<&[f32]> = host.iter().map(|h| &h[..]).collect();
        let (norm, factor) = reference::clip_grad_norm(&slices, max_norm as f32, NormType::L2);
        self.clip = Some(Clip::Cpu(factor));
        Tensor::new(norm as f32, &Device::Cpu)
    }

    /// The CPU step of the variables of `list`, all at step `step`: the reference on each
    /// variable, then the copies.
    fn step_cpu(&mut self, list: &[(usize, Tensor)], step: usize, clip: Option<f32>) -> Result<()> {
        let reads: Vec<&Tensor> = list.iter().map(|(_, g)| g).collect();
        distinct(&self.targets(list), &reads)?;
        let args = self.args();
        for (i, g) in list {
            let e = &mut self.entries[*i];
            let Moments::Cpu(m, v) = &mut e.moments else {
                return Err(msg("moments on another device".into()));
            };
            let moments = RefCell::new((m, v));
            let master = e.master.as_tensor();
            let g = g.flatten_all()?;
            // The gradient in its own type: a clip rounds `g·c` to it, as the kernel does.
            match g.dtype() {
                DType::F32 => host_update(master, args, step, clip, g.to_vec1::<f32>()?, moments),
                DType::F16 => host_update(master, args, step, clip, g.to_vec1::<f16>()?, moments),
                DType::BF16 => host_update(master, args, step, clip, g.to_vec1::<bf16>()?, moments),
                other => Err(msg(format!("gradients of {other:?}"))),
            }?;
            if let Some(c) = &e.copy {
                c.set(&e.master.as_tensor().to_dtype(c.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The CUDA step of the variables of `list`, all at step `step`: every variable
    /// write-locked at once, then the fused launches.
    fn step_cuda(
        &mut self,
        list: &[(usize, Tensor)],
        step: usize,
        clip: Option<&Tensor>,
    ) -> Result<()> {
        let targets = self.targets(list);
        let copy_dtype = self.entries[list[0].0].copy.as_ref().map(|c| c.dtype());
        let reads: Vec<&Tensor> = list.iter().map(|(_, g)| g).chain(clip).collect();
        distinct(&targets, &reads)?;
        let grad_dtype = list[0].1.dtype();
        let guards: Vec<_> = list.iter().map(|(_, g)| g.storage_and_layout()).collect();
        let clip_guard = clip.map(|c| c.storage_and_layout());
        let layouts: Vec<Layout> = targets.iter().map(|t| t.layout().clone()).collect();
        let (args, step) = (self.args(), step as f32);
        let mut moments: Vec<&mut Moments> = Vec::with_capacity(list.len());
        let mut wanted = list.iter().map(|(i, _)| *i).peekable();
        for (i, e) in self.entries.iter_mut().enumerate() {
            if wanted.peek() == Some(&i) {
                wanted.next();
                moments.push(&mut e.moments);
            }
        }
        let fused = Fused {
            args,
            step,
            grads: &guards,
            clip: clip_guard.as_ref(),
            layouts: &layouts,
        };
        let mut launch = |storages: &mut [&mut CudaStorage]| -> Result<()> {
            match (grad_dtype, copy_dtype) {
                (DType::F32, None) => fused.run::<f32, bf16>(storages, &mut moments, false),
                (DType::F16, Some(DType::F16)) => {
                    fused.run::<f16, f16>(storages, &mut moments, true)
                }
                (DType::BF16, Some(DType::BF16)) => {
                    fused.run::<bf16, bf16>(storages, &mut moments, true)
                }
                (g, c) => Err(msg(format!("gradients of {g:?} for copies of {c:?}"))),
            }
        };
        with_written(&targets, &mut launch)
    }
}

/// The global L2 norm of the gradients under `guards` into `out` (`[norm, factor,
/// non-finite]`).
fn norm_into<G: Dtype + CudaDType>(
    guards: &[(candle_core::StorageRef<'_>, &Layout)],
    max_norm: f64,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let views: Vec<CudaView<'_, G>> = guards
        .iter()
        .map(|(s, l)| view::<G>(cuda(s, OP, "grad")?, l, OP))
        .collect::<Result<_>>()?;
    let grads: Vec<&dyn DevicePtr<G>> = views.iter().map(|v| v as _).collect();
    let stream = out.stream().clone();
    crate::clip_grad_norm(&stream, &grads, max_norm as f32, NormType::L2, out).map_err(crate_err)
}

/// Every written storage distinct from every other storage of the step (a repeated one would
/// deadlock on its own lock, a read one would race).
fn distinct(written: &[Tensor], read: &[&Tensor]) -> Result<()> {
    let key = |t: &Tensor| &*t.storage_and_layout().0 as *const Storage as usize;
    let w: Vec<usize> = written.iter().map(key).collect();
    let r: Vec<usize> = read.iter().map(|t| key(t)).collect();
    for (i, a) in w.iter().enumerate() {
        if w[..i].contains(a) || r.contains(a) {
            return Err(msg(
                "a variable shares its storage with another variable or a gradient".into(),
            ));
        }
    }
    Ok(())
}

/// Runs `f` over the CUDA storages of `targets` (in that order), all write-locked at once
/// through candle's `inplace_op1`, nested; the locks are taken in storage order, as candle's
/// in-place ops take theirs, so that concurrent in-place ops cannot deadlock against a step.
fn with_written(
    targets: &[Tensor],
    f: &mut dyn FnMut(&mut [&mut CudaStorage]) -> Result<()>,
) -> Result<()> {
    let key = |t: &Tensor| &*t.storage_and_layout().0 as *const Storage as usize;
    let mut order: Vec<usize> = (0..targets.len()).collect();
    order.sort_by_key(|&i| key(&targets[i]));
    let sorted: Vec<&Tensor> = order.iter().map(|&i| &targets[i]).collect();
    let held = RefCell::new(Vec::with_capacity(targets.len()));
    let mut unsort = |locked: &mut [&mut CudaStorage]| -> Result<()> {
        let mut slots: Vec<Option<&mut CudaStorage>> = (0..locked.len()).map(|_| None).collect();
        for (k, s) in locked.iter_mut().enumerate() {
            slots[order[k]] = Some(&mut **s);
        }
        let mut in_order: Vec<&mut CudaStorage> = slots.into_iter().flatten().collect();
        f(&mut in_order)
    };
    let body = RefCell::new(&mut unsort as &mut dyn FnMut(&mut [&mut CudaStorage]) -> Result<()>);
    match sorted.split_first() {
        Some((first, rest)) => first.inplace_op1(&Nest {
            rest,
            held: &held,
            body: &body,
        }),
        None => Ok(()),
    }
}

type Body<'f> = RefCell<&'f mut dyn FnMut(&mut [&mut CudaStorage]) -> Result<()>>;

/// One level of [`with_written`]: records its storage and locks the next, or runs the body.
struct Nest<'a, 'f> {
    rest: &'a [&'a Tensor],
    held: &'a RefCell<Vec<*mut CudaStorage>>,
    body: &'a Body<'f>,
}

impl InplaceOp1 for Nest<'_, '_> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        Err(msg("variables on the CPU and on CUDA in one step".into()))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, _: &Layout) -> Result<()> {
        self.held.borrow_mut().push(storage as *mut CudaStorage);
        if let Some((next, rest)) = self.rest.split_first() {
            return next.inplace_op1(&Nest {
                rest,
                held: self.held,
                body: self.body,
            });
        }
        let held = self.held.borrow();
        // SAFETY: each pointer is the storage behind a write guard that an enclosing
        // `inplace_op1` frame holds until this call returns, and the storages are distinct
        // (`distinct`), so these mutable references neither dangle nor alias.
        let mut storages: Vec<&mut CudaStorage> =
            held.iter().map(|&p| unsafe { &mut *p }).collect();
        (self.body.borrow_mut())(&mut storages)
    }
}

/// The fused launch over locked storages: the masters first, then the copies.
struct Fused<'a, 'g> {
    args: AdamWArgs,
    step: f32,
    grads: &'a [(candle_core::StorageRef<'g>, &'g Layout)],
    clip: Option<&'a (candle_core::StorageRef<'g>, &'g Layout)>,
    layouts: &'a [Layout],
}

impl Fused<'_, '_> {
    fn run<G: Dtype + CudaDType, C: Dtype + CudaDType>(
        &self,
        storages: &mut [&mut CudaStorage],
        moments: &mut [&mut Moments],
        with_copies: bool,
    ) -> Result<()> {
        let n = moments.len();
        let stream = storages[0].device.cuda_stream();
        let (masters, copies) = storages.split_at_mut(n);
        let range = |l: &Layout| {
            l.contiguous_offsets()
                .ok_or(candle_core::Error::RequiresContiguous { op: OP })
        };
        let mut params: Vec<CudaViewMut<'_, f32>> = Vec::with_capacity(n);
        for (s, l) in masters.iter_mut().zip(self.layouts) {
            let (a, b) = range(l)?;
            params.push(s.as_cuda_slice_mut::<f32>()?.slice_mut(a..b));
        }
        let mut copy_views: Vec<CudaViewMut<'_, C>> = Vec::with_capacity(copies.len());
        for (s, l) in copies.iter_mut().zip(&self.layouts[n..]) {
            let (a, b) = range(l)?;
            copy_views.push(s.as_cuda_slice_mut::<C>()?.slice_mut(a..b));
        }
        let grads: Vec<CudaView<'_, G>> = self
            .grads
            .iter()
            .map(|(s, l)| view::<G>(cuda(s, OP, "grad")?, l, OP))
            .collect::<Result<_>>()?;
        let clip = match self.clip {
            Some((s, l)) => Some(view::<f32>(cuda(s, OP, "clip")?, l, OP)?),
            None => None,
        };
        let mut tensors = Vec::with_capacity(n);
        for ((p, g), m) in params.iter_mut().zip(&grads).zip(moments.iter_mut()) {
            let Moments::Cuda(m, v) = &mut **m else {
                return Err(msg("moments on another device".into()));
            };
            tensors.push(AdamWTensor {
                param: p,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: None,
            });
        }
        let scalars = StepScalars {
            clip: clip.as_ref().map(|c| c as &dyn DevicePtr<f32>),
            ..Default::default()
        };
        let r = if with_copies {
            let mut c: Vec<&mut dyn DevicePtrMut<C>> =
                copy_views.iter_mut().map(|c| c as _).collect();
            crate::adamw_step_with_copies(
                &stream,
                &self.args,
                self.step,
                &scalars,
                &mut tensors,
                &mut c,
            )
        } else {
            crate::adamw_step(&stream, &self.args, self.step, &scalars, &mut tensors)
        };
        r.map_err(crate_err)
    }
}

/// Updates `master` in place through the reference, with its gradient `grad` and moments.
fn host_update<'a, G: Element>(
    master: &Tensor,
    args: AdamWArgs,
    step: usize,
    clip: Option<f32>,
    grad: Vec<G>,
    moments: RefCell<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
) -> Result<()> {
    master.inplace_op1(&HostUpdate {
        args,
        step: step as f32,
        clip,
        grad,
        moments,
    })
}

/// One CPU variable's update, in place, through the reference.
struct HostUpdate<'a, G> {
    args: AdamWArgs,
    step: f32,
    clip: Option<f32>,
    grad: Vec<G>,
    moments: RefCell<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
}

impl<G: Element> InplaceOp1 for HostUpdate<'_, G> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let CpuStorage::F32(p) = storage else {
            return Err(msg("variables must be f32".into()));
        };
        let (a, b) = layout
            .contiguous_offsets()
            .ok_or(candle_core::Error::RequiresContiguous { op: OP })?;
        let mut moments = self.moments.borrow_mut();
        let (m, v) = &mut *moments;
        let state = AdamWState {
            param: &mut p[a..b],
            grad: &self.grad,
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        };
        reference::adamw_step(&self.args, self.step, self.clip, None, state).map_err(crate_err)
    }
}

impl candle_nn::Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let entries = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|v| Entry::new(v, None))
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            entries,
            params,
            clip: None,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let clip = self.clip.take();
        let list = self.with_grads(grads)?;
        let on_cuda = |i: usize| matches!(self.entries[i].moments, Moments::Cuda(..));
        let Some(&(first, _)) = list.first() else {
            return Ok(());
        };
        let cuda = on_cuda(first);
        if list.iter().any(|(i, _)| on_cuda(*i) != cuda) {
            return Err(msg("variables on the CPU and on CUDA in one step".into()));
        }
        // Each variable's step is its own count plus one (PyTorch's per-parameter `step`): a
        // variable that had no gradient in some steps (frozen for a while, an expert that got
        // no tokens) is corrected for its own updates. One update per count, in entry order.
        let mut groups: Vec<(usize, Vec<(usize, Tensor)>)> = Vec::new();
        for (i, g) in list {
            let step = self.entries[i].steps + 1;
            match groups.iter_mut().find(|(s, _)| *s == step) {
                Some((_, group)) => group.push((i, g)),
                None => groups.push((step, vec![(i, g)])),
            }
        }
        for (step, group) in &groups {
            match (cuda, &clip) {
                (true, Some(Clip::Cuda(t))) => self.step_cuda(group, *step, Some(t)),
                (true, None) => self.step_cuda(group, *step, None),
                (false, Some(Clip::Cpu(f))) => self.step_cpu(group, *step, Some(*f)),
                (false, None) => self.step_cpu(group, *step, None),
                _ => Err(msg("the clip factor is on another device".into())),
            }?;
            for (i, _) in group {
                self.entries[*i].steps = *step;
            }
        }
        Ok(())
    }
}
