//! candle-nn's `AdamW` optimizer on this crate's fused update: [`AdamW`] implements
//! `candle_nn::Optimizer` with candle-nn's `ParamsAdamW`, so the port is the `use` line.
//!
//! Each step updates every variable with a gradient in place (candle's `inplace_op2`, one
//! launch per variable: θ, m, v read and written once, PyTorch's fused AdamW arithmetic);
//! the moments live in the optimizer as device buffers. Variables are f32 (the master
//! weights); CPU variables run the reference.
use super::crate_err;
use crate::reference::adamw::AdamWState;
use crate::{AdamWArgs, AdamWTensor, StepScalars};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp2, Layout, Result, Storage, Var};
use candle_nn::ParamsAdamW;
use cudarc::driver::CudaSlice;
use std::sync::Mutex;

const OP: &str = "liger-adamw";

/// A variable's moments.
enum Moments {
    Cuda(CudaSlice<f32>, CudaSlice<f32>),
    Cpu(Vec<f32>, Vec<f32>),
}

/// candle-nn's `AdamW` (the same `ParamsAdamW`, learning-rate accessors and `step`) on the
/// fused kernel, with PyTorch's `AdamW(fused=True)` arithmetic.
///
/// ```
/// use candle_core::{Device, Var};
/// use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};
/// let w = Var::new(&[1f32, -2.0, 3.0], &Device::Cpu)?;
/// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW { lr: 0.1, ..Default::default() })?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.backward_step(&loss)?;
/// assert!(w.as_tensor().to_vec1::<f32>()?[0] < 1.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct AdamW {
    vars: Vec<(Var, Moments)>,
    params: ParamsAdamW,
    step: usize,
}

impl AdamW {
    fn args(&self) -> AdamWArgs {
        AdamWArgs::new(self.params.lr)
            .with_betas(self.params.beta1, self.params.beta2)
            .with_eps(self.params.eps)
            .with_weight_decay(self.params.weight_decay)
    }
}

/// One variable's update, in place.
struct Update<'a> {
    args: AdamWArgs,
    step: f32,
    moments: Mutex<&'a mut Moments>,
}

impl InplaceOp2 for Update<'_> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let mut moments = self.moments.lock().unwrap_or_else(|p| p.into_inner());
        let Moments::Cpu(m, v) = &mut **moments else {
            return Err(candle_core::Error::Msg(format!(
                "{OP}: moments on another device"
            )));
        };
        let (CpuStorage::F32(p), CpuStorage::F32(g)) = (s1, s2) else {
            return Err(candle_core::Error::Msg(format!(
                "{OP}: variables must be f32"
            )));
        };
        let (Some((a, b)), Some((c, d))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            return Err(candle_core::Error::RequiresContiguous { op: OP });
        };
        let state = AdamWState {
            param: &mut p[a..b],
            grad: &g[c..d],
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        };
        crate::reference::adamw::adamw_step(&self.args, self.step, None, None, state)
            .map_err(crate_err)
    }

    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        let mut moments = self.moments.lock().unwrap_or_else(|p| p.into_inner());
        let Moments::Cuda(m, v) = &mut **moments else {
            return Err(candle_core::Error::Msg(format!(
                "{OP}: moments on another device"
            )));
        };
        let (Some((a, b)), Some((c, d))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            return Err(candle_core::Error::RequiresContiguous { op: OP });
        };
        let stream = s1.device.cuda_stream();
        let mut p = s1.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
        let g = s2.as_cuda_slice::<f32>()?.slice(c..d);
        let mut tensors = [AdamWTensor {
            param: &mut p,
            grad: &g,
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: None,
        }];
        crate::adamw_step(
            &stream,
            &self.args,
            self.step,
            &StepScalars::default(),
            &mut tensors,
        )
        .map_err(crate_err)
    }
}

impl candle_nn::Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|var| {
                if var.dtype() != DType::F32 {
                    return Err(candle_core::Error::Msg(format!(
                        "{OP}: variables are f32 master weights, got {:?}",
                        var.dtype()
                    )));
                }
                let n = var.elem_count();
                let moments = match &*var.storage_and_layout().0 {
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
                    Storage::Metal(_) => {
                        return Err(candle_core::Error::Msg(format!("{OP}: no Metal")));
                    }
                };
                Ok((var, moments))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            params,
            step: 0,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let (args, step) = (self.args(), self.step as f32);
        for (var, moments) in &mut self.vars {
            let Some(g) = grads.get(var) else { continue };
            if var.elem_count() == 0 {
                continue;
            }
            let g = g.contiguous()?;
            let op = Update {
                args,
                step,
                moments: Mutex::new(moments),
            };
            var.as_tensor().inplace_op2(&g, &op)?;
        }
        Ok(())
    }
}
