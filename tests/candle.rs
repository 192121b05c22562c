//! candle interop (feature `candle`): the candle path against the plain API on the same data
//! and stream (same kernels, so the same numbers), for every op, dtype and layout form, forward,
//! explicit backward and candle's autograd (GPU); on the CPU (always run) the same calls against
//! the reference, every op's gradient against finite differences of its value, argument
//! errors. One binary for every candle test (each candle test binary links candle whole):
//! the sections `block` (a decoder layer's halves as one node each), `flash_attn`,
//! `cross_entropy` (and the fused linear cross-entropy), `ddp` (data parallel), `grad_slot`
//! and `candle_nn` (the candle-nn drop-ins and `AdamW`) have their own module docs.
#![cfg(feature = "candle")]
mod common;

use candle_core::{D, DType, Device, Tensor, Var, WithDType};
use common::glu::{Op as Glu, glu_call};
use common::{Rng, expect_err};
use half::{bf16, f16};
use liger_rs::candle::{
    RmsNormConfig, RopeConfig, SwigluConfig, geglu, geglu_backward, geglu_fused,
    geglu_fused_backward, nn, rms_norm, rms_norm_backward, rms_norm_forward, rope, rope_backward,
    rope_backward_with, rope_with, swiglu, swiglu_backward, swiglu_fused, swiglu_fused_backward,
};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use liger_rs::reference::Element;
use liger_rs::reference::rope::CosSinRows;
use liger_rs::{
    CastingMode, CosSinDtype, CosSinLayout, Dtype, Gelu, PositionIds, RmsNormArgs, RopeArgs,
    SwigluArgs,
};
use std::sync::{Arc, Mutex};

type Stream = Arc<CudaStream>;

/// The stream candle launches on for `dev`: the plain API runs there too.
fn stream_of(dev: &Device) -> Stream {
    match dev {
        Device::Cuda(d) => d.cuda_stream(),
        other => panic!("not a CUDA device: {other:?}"),
    }
}

/// An element type of this crate's kernels and of candle tensors.
trait El: Dtype + WithDType {}
impl<T: Dtype + WithDType> El for T {}

fn host<T: El>(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<T>())
        .expect("download tensor")
        .into_iter()
        .map(Element::to_f64)
        .collect()
}

fn host_buf<T: El>(stream: &Stream, buf: &CudaSlice<T>) -> Vec<f64> {
    stream
        .clone_dtoh(buf)
        .expect("download buffer")
        .into_iter()
        .map(Element::to_f64)
        .collect()
}

/// Equal values (−0 equals +0: candle's gradient accumulation adds to zeros), no NaN.
fn assert_same(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] candle {g:e} plain {w:e}"))
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: candle path differs from the plain API: {bad:?}"
    );
}

fn upload<T: DeviceRepr>(stream: &Stream, data: &[T]) -> CudaSlice<T> {
    stream.clone_htod(data).expect("upload")
}

fn alloc<T: El>(stream: &Stream, n: usize) -> CudaSlice<T> {
    stream.alloc_zeros::<T>(n).expect("alloc")
}

fn tensor<T: El>(data: &[T], shape: &[usize], dev: &Device) -> Tensor {
    Tensor::from_slice(data, shape, dev).expect("tensor")
}

/// How a `[rows, cols]` input reaches an op.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// A contiguous tensor.
    Contiguous,
    /// A contiguous view with a start offset: rows `1..=rows` of a `[rows + 2, cols]` tensor.
    Offset,
    /// A non-contiguous view: the transpose of a contiguous `[cols, rows]` tensor.
    Transposed,
}

const FORMS: [Form; 3] = [Form::Contiguous, Form::Offset, Form::Transposed];

impl Form {
    /// The contiguous tensor that [`Form::view`] turns into `data` `[rows, cols]`.
    fn base<T: El>(
        self,
        data: &[T],
        rows: usize,
        cols: usize,
        dev: &Device,
        rng: &mut Rng,
    ) -> Tensor {
        match self {
            Form::Contiguous => tensor(data, &[rows, cols], dev),
            Form::Offset => {
                let mut big = rng.vec::<T>(cols, 0.0, 1.0);
                big.extend_from_slice(data);
                big.extend(rng.vec::<T>(cols, 0.0, 1.0));
                tensor(&big, &[rows + 2, cols], dev)
            }
            Form::Transposed => {
                let t: Vec<T> = (0..cols * rows)
                    .map(|i| data[(i % rows) * cols + i / rows])
                    .collect();
                tensor(&t, &[cols, rows], dev)
            }
        }
    }

    /// The `[rows, cols]` view of a [`Form::base`] tensor (or of its gradient).
    fn view(self, base: &Tensor, rows: usize) -> Tensor {
        let t = match self {
            Form::Contiguous => base.clone(),
            Form::Offset => base.narrow(0, 1, rows).expect("narrow"),
            Form::Transposed => base.t().expect("transpose"),
        };
        match self {
            Form::Contiguous => assert!(t.is_contiguous() && t.layout().start_offset() == 0),
            Form::Offset => assert!(t.is_contiguous() && t.layout().start_offset() > 0),
            Form::Transposed => assert!(!t.is_contiguous()),
        }
        t
    }

    /// `data` `[rows, cols]` as a tensor of this form.
    fn tensor<T: El>(
        self,
        data: &[T],
        rows: usize,
        cols: usize,
        dev: &Device,
        rng: &mut Rng,
    ) -> Tensor {
        self.view(&self.base(data, rows, cols, dev, rng), rows)
    }

    /// `data` `[rows, cols]` as a tensor of this form computed from a variable, and that
    /// variable (its gradient goes through [`Form::view`] too).
    fn var<T: El>(
        self,
        data: &[T],
        rows: usize,
        cols: usize,
        dev: &Device,
        rng: &mut Rng,
    ) -> (Var, Tensor) {
        let v = Var::from_tensor(&self.base(data, rows, cols, dev, rng)).expect("var");
        let t = self.view(v.as_tensor(), rows);
        (v, t)
    }
}

/// The gradient of `v` seen through `form` (`[rows, cols]`).
fn grad_of(grads: &candle_core::backprop::GradStore, v: &Var, form: Form, rows: usize) -> Tensor {
    form.view(grads.get(v).expect("gradient of a variable"), rows)
}

#[path = "candle/block.rs"]
mod block;
#[path = "candle/candle_nn.rs"]
mod candle_nn;
#[path = "candle/composition.rs"]
mod composition;
#[path = "candle/cpu.rs"]
mod cpu;
#[path = "candle/cross_entropy.rs"]
mod cross_entropy;
#[path = "candle/ddp.rs"]
mod ddp;
#[path = "candle/flash_attn.rs"]
mod flash_attn;
#[path = "candle/fused_add.rs"]
mod fused_add;
#[path = "candle/grad_slot.rs"]
mod grad_slot;
#[path = "candle/gradients.rs"]
mod gradients;
#[path = "candle/rms_norm.rs"]
mod rms_norm;
#[path = "candle/rope.rs"]
mod rope;
#[path = "candle/swiglu.rs"]
mod swiglu;

use cpu::{
    GLUS, candle_glu, candle_glu_backward, candle_glu_fused, candle_glu_fused_backward, cpu_vals,
};
use rope::cos_sin;
