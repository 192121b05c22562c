//! RMSNorm: CPU reference against hand-computed values and finite differences (always run);
//! GPU kernels against the reference on many shapes, dtypes and modes; overlapping outputs
//! (every other argument check: `tests/bad_input.rs`).
//!
//! With the small shapes (`LIGER_RS_TEST_SHAPES=small`, sized for compute-sanitizer) every
//! case keeps its shape, hence its kernel and grid: cases over 2²⁰ elements hold data in a few
//! windows of rows only (`common::DataRows`), the shared-memory dW test runs each of its kernels
//! once, and the test over 2³² elements skips.
mod common;

use common::rms::{grad_slack, ulps};
use common::{
    DataRows, Failures, Poison, Rng, assert_close, assert_written, download, download_rows, gpu,
    gpu_for_huge, min_normal, poisoned, poisoned_on_device, poisoned_with, sampled_rows, upload,
    upload_rows, widen,
};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use liger_rs::reference::{
    Element, rms_norm_backward as ref_backward, rms_norm_backward_dx as ref_backward_dx,
    rms_norm_forward as ref_forward,
};
use liger_rs::{
    CastingMode, Dtype, Error, RmsNormArgs, rms_norm_backward, rms_norm_backward_inplace,
    rms_norm_forward,
};
use std::sync::Arc;

#[path = "rms_norm/bad_input.rs"]
mod bad_input;
#[path = "rms_norm/device.rs"]
mod device;
#[path = "rms_norm/reference.rs"]
mod reference;
