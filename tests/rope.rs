//! RoPE: CPU reference against hand-computed rotations, finite differences, its own inverse,
//! HF's multimodal table selection and fused QKV buffers (always run); GPU kernels against the
//! reference on many shapes, dtypes and cos/sin forms (f32 tables with 16-bit q and k too),
//! fused QKV views, multimodal tables,
//! 64-bit offsets, clamped device ids; empty calls (every rejected call is a row of
//! `tests/bad_input.rs`).
//!
//! With the small shapes (`LIGER_RS_TEST_SHAPES=small`, sized for compute-sanitizer) the
//! sweep's largest scalar shape runs fewer tokens and the test over 2³² elements skips.
mod common;

use common::{
    Failures, Rng, assert_close, download, download_rows, expect_invalid, gpu, gpu_for_huge,
    sampled_rows, sized, upload, upload_rows,
};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream};
use liger_rs::reference::Element;
use liger_rs::reference::rope::{
    CosSinRows, rope_backward as ref_backward, rope_backward_fused as ref_backward_fused,
    rope_forward as ref_forward, rope_forward_fused as ref_forward_fused,
};
use liger_rs::{
    CosSinDtype, CosSinLayout, Dtype, Error, PositionIds, RopeArgs, rope_backward,
    rope_backward_fused, rope_backward_into, rope_forward, rope_forward_fused, rope_forward_into,
};
use std::sync::Arc;

// ---------------------------------------------------------------- shared helpers

/// `n` values uniform in (−2, 2) rounded to `T` (cheaper than normals for the big cases).
fn uniform<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f64(4.0 * rng.uniform() - 2.0))
        .collect()
}

/// HF-style cos/sin rows (`rotary_dim` long) for the given positions: `θ_i = p · 10000^(−2i/r)`,
/// the row is `cat(f(θ), f(θ))`. With `poison`, the second half of every row is NaN instead:
/// the kernels must read only the first half.
fn cos_sin<T: Element>(positions: &[i64], r: usize, poison: bool) -> (Vec<T>, Vec<T>) {
    let h = r / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &p in positions {
        let theta = |i: usize| p as f64 * 10000f64.powf(-2.0 * i as f64 / r as f64);
        for half in 0..2 {
            for i in 0..h {
                if half == 1 && poison {
                    cos.push(T::from_f64(f64::NAN));
                    sin.push(T::from_f64(f64::NAN));
                } else {
                    cos.push(T::from_f64(theta(i).cos()));
                    sin.push(T::from_f64(theta(i).sin()));
                }
            }
        }
    }
    (cos, sin)
}

/// Packed sequences: each batch row is cut into segments of random length whose positions
/// restart (at 0, or at a small offset as for a continued sequence).
fn packed_ids(rng: &mut Rng, batch: usize, seq: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut s = 0;
        while s < seq {
            let len = 1 + (rng.next_u64() as usize) % seq.clamp(1, 64);
            let start = if rng.next_u64().is_multiple_of(4) {
                rng.next_u64() % 5
            } else {
                0
            };
            for p in 0..len.min(seq - s) {
                ids.push((start as usize + p) as i64);
            }
            s += len;
        }
    }
    ids
}

fn bits<T: Element>(v: T) -> u64 {
    v.to_f64().to_bits()
}

/// The cos/sin table of a GPU case whose rows come from `rows`: on the host (for the
/// reference) and on the device, with the position ids in the form `rows` hands them over.
struct Tables<T> {
    rows: Form,
    cos: Vec<T>,
    sin: Vec<T>,
    ids: Vec<i64>,
    cos_d: CudaSlice<T>,
    sin_d: CudaSlice<T>,
    ids32_d: Option<CudaSlice<i32>>,
    ids64_d: Option<CudaSlice<i64>>,
}

impl<T: Dtype> Tables<T> {
    /// [`form_positions`]' HF-style rows for `args`' batch and sequence ([`cos_sin`]: second
    /// halves NaN with `poison`), laid out as `args`' form reads them ([`table_in_form`]).
    fn new(
        stream: &Arc<CudaStream>,
        args: &RopeArgs,
        rows: Form,
        poison: bool,
        rng: &mut Rng,
    ) -> Self {
        let (positions, ids) = form_positions(rows, args.batch, args.seq_len, rng);
        let (cos, sin) = cos_sin::<T>(&positions, args.rotary_dim, poison);
        let (cos, sin) = (table_in_form(args, &cos), table_in_form(args, &sin));
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let ids32_d =
            (matches!(rows, Form::Ids32) && !ids.is_empty()).then(|| upload_ids(stream, &ids32));
        let ids64_d =
            (matches!(rows, Form::Ids64) && !ids.is_empty()).then(|| upload_ids(stream, &ids));
        Tables {
            rows,
            cos_d: upload(stream, &cos),
            sin_d: upload(stream, &sin),
            cos,
            sin,
            ids,
            ids32_d,
            ids64_d,
        }
    }

    /// The reference's row source.
    fn ref_rows(&self) -> CosSinRows<'_> {
        match self.rows {
            Form::PerPosition => CosSinRows::PerPosition,
            Form::PerBatch => CosSinRows::PerBatch,
            _ => CosSinRows::Gathered(&self.ids),
        }
    }

    /// The launchers' layout.
    fn layout(&self) -> CosSinLayout<'_> {
        match self.rows {
            Form::PerPosition => CosSinLayout::PerPosition,
            Form::PerBatch => CosSinLayout::PerBatch,
            Form::Ids32 => CosSinLayout::Gathered(PositionIds::DeviceI32(
                self.ids32_d.as_ref().expect("device ids").as_view(),
            )),
            Form::Ids64 => CosSinLayout::Gathered(PositionIds::DeviceI64(
                self.ids64_d.as_ref().expect("device ids").as_view(),
            )),
            Form::Host => CosSinLayout::Gathered(PositionIds::Host(&self.ids)),
        }
    }
}

#[path = "rope/device.rs"]
mod device;
#[path = "rope/empty.rs"]
mod empty;
#[path = "rope/forms.rs"]
mod forms;
#[path = "rope/fused.rs"]
mod fused;
#[path = "rope/multimodal.rs"]
mod multimodal;
#[path = "rope/reference.rs"]
mod reference;

use device::{FORMS, Form, check, form_positions, upload_ids};
use forms::{FORM_BITS, check_directions, in_form, table_in_form};
use reference::{SMALL, f64_tables, form};
