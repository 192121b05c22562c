//! How the walk runs each public launcher on a GPU: its buffers by name, what it writes.
use super::*;

// ---------------------------------------------------------------- launching a call

/// A public launcher run on a GPU.
pub(crate) trait Launch: Op {
    fn launch<T: Dtype>(
        self,
        stream: &Stream,
        args: &Self::Args,
        live: &mut Live<T>,
    ) -> liger_rs::Result<()>;

    /// The elements of output `name` (its name in the table; written or read and written)
    /// that an accepted call with `args` writes.
    fn writes(self, args: &Self::Args, name: &'static str) -> Vec<Region>;
}

/// Elements `start + r·stride + j` of a buffer, for `r < rows` and `j < width`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    pub(crate) start: usize,
    pub(crate) rows: usize,
    pub(crate) width: usize,
    pub(crate) stride: usize,
}

impl Region {
    /// `rows` rows of `width` elements, `stride` apart, from the buffer's start.
    fn rows(rows: usize, width: usize, stride: usize) -> Region {
        Region {
            start: 0,
            rows,
            width,
            stride,
        }
    }

    /// The first `n` elements.
    fn first(n: usize) -> Region {
        Region::rows(1, n, n)
    }

    pub(crate) fn elements(self) -> impl Iterator<Item = usize> {
        (0..self.rows)
            .flat_map(move |r| (0..self.width).map(move |j| self.start + r * self.stride + j))
    }
}

/// Panics for a name that is no output of `op`'s call.
pub(crate) fn no_output(op: impl Op, name: &str) -> ! {
    panic!("`{name}` is no output of {}", op.name())
}

impl Launch for Rms {
    fn launch<T: Dtype>(
        self,
        stream: &Stream,
        args: &RmsNormArgs,
        live: &mut Live<T>,
    ) -> liger_rs::Result<()> {
        let x = live.t("x");
        let weight = live.opt_t("weight");
        let weight = weight.as_deref().map(|w| w as _);
        let mut dw = live.opt_t("dw");
        let dw = dw.as_deref_mut().map(|d| d as _);
        match self {
            Rms::Forward => {
                let (mut y, mut rstd) = (live.t("y"), live.f32("rstd"));
                rms_norm_forward(stream, args, &*x, weight, &mut *y, &mut *rstd)
            }
            Rms::Backward => {
                let (dy, rstd, mut dx) = (live.t("dy"), live.f32("rstd"), live.t("dx"));
                rms_norm_backward(stream, args, &*dy, &*x, weight, &*rstd, &mut *dx, dw)
            }
            Rms::BackwardInplace => {
                let (mut dy_dx, rstd) = (live.t("dy_dx"), live.f32("rstd"));
                rms_norm_backward_inplace(stream, args, &mut *dy_dx, &*x, weight, &*rstd, dw)
            }
        }
    }

    fn writes(self, a: &RmsNormArgs, name: &'static str) -> Vec<Region> {
        match name {
            "y" | "dx" | "dy_dx" => vec![Region::rows(a.rows, a.cols, a.y_stride)],
            "rstd" => vec![Region::first(a.rows)],
            "dw" => vec![Region::first(a.cols)],
            _ => no_output(self, name),
        }
    }
}

impl Launch for FusedAdd {
    fn launch<T: Dtype>(
        self,
        stream: &Stream,
        args: &RmsNormArgs,
        live: &mut Live<T>,
    ) -> liger_rs::Result<()> {
        let weight = live.opt_t("weight");
        let weight = weight.as_deref().map(|w| w as _);
        let mut dw = live.opt_t("dw");
        let dw = dw.as_deref_mut().map(|d| d as _);
        match self {
            FusedAdd::Forward => {
                let (x, r, mut s) = (live.t("x"), live.t("r"), live.t("s"));
                let (mut y, mut rstd) = (live.t("y"), live.f32("rstd"));
                fused_add_rms_norm_forward(
                    stream, args, &*x, &*r, weight, &mut *s, &mut *y, &mut *rstd,
                )
            }
            FusedAdd::ForwardInplace => {
                let (mut x_s, r) = (live.t("x_s"), live.t("r"));
                let (mut y, mut rstd) = (live.t("y"), live.f32("rstd"));
                fused_add_rms_norm_forward_inplace(
                    stream, args, &mut *x_s, &*r, weight, &mut *y, &mut *rstd,
                )
            }
            FusedAdd::Backward => {
                let (dy, ds, s) = (live.t("dy"), live.t("ds"), live.t("s"));
                let (rstd, mut dx) = (live.f32("rstd"), live.t("dx"));
                fused_add_rms_norm_backward(
                    stream, args, &*dy, &*ds, &*s, weight, &*rstd, &mut *dx, dw,
                )
            }
            FusedAdd::BackwardInplace => {
                let (dy, mut ds_dx, s) = (live.t("dy"), live.t("ds_dx"), live.t("s"));
                let rstd = live.f32("rstd");
                fused_add_rms_norm_backward_inplace(
                    stream,
                    args,
                    &*dy,
                    &mut *ds_dx,
                    &*s,
                    weight,
                    &*rstd,
                    dw,
                )
            }
        }
    }

    fn writes(self, a: &RmsNormArgs, name: &'static str) -> Vec<Region> {
        match name {
            "s" | "x_s" => vec![Region::rows(a.rows, a.cols, a.x_stride)],
            "y" | "dx" | "ds_dx" => vec![Region::rows(a.rows, a.cols, a.y_stride)],
            "rstd" => vec![Region::first(a.rows)],
            "dw" => vec![Region::first(a.cols)],
            _ => no_output(self, name),
        }
    }
}

impl Launch for Rope {
    fn launch<T: Dtype>(
        self,
        stream: &Stream,
        call: &RopeCall,
        live: &mut Live<T>,
    ) -> liger_rs::Result<()> {
        let (cos, sin) = (live.t("cos"), live.t("sin"));
        let ids32;
        let ids64;
        let layout = match &call.layout {
            Layout::PerPosition => CosSinLayout::PerPosition,
            Layout::PerBatch => CosSinLayout::PerBatch,
            Layout::Host(ids) => CosSinLayout::Gathered(PositionIds::Host(ids)),
            Layout::DeviceI32 => {
                ids32 = live.i32("position_ids");
                CosSinLayout::Gathered(PositionIds::DeviceI32(ids32.as_view()))
            }
            Layout::DeviceI64 => {
                ids64 = live.i64("position_ids");
                CosSinLayout::Gathered(PositionIds::DeviceI64(ids64.as_view()))
            }
            Layout::Multimodal(sections) => CosSinLayout::Multimodal {
                sections: *sections,
            },
            Layout::MultimodalIds(sections) => {
                ids64 = live.i64("position_ids");
                CosSinLayout::MultimodalGathered {
                    sections: *sections,
                    position_ids: PositionIds::DeviceI64(ids64.as_view()),
                }
            }
        };
        let a = &call.args;
        if let Some(k_offset) = call.k_offset {
            let mut qkv = live.t("qkv");
            return match self {
                Rope::BackwardFused => {
                    rope_backward_fused(stream, a, &mut *qkv, k_offset, &*cos, &*sin, &layout)
                }
                _ => rope_forward_fused(stream, a, &mut *qkv, k_offset, &*cos, &*sin, &layout),
            };
        }
        let (mut q, mut k) = (live.t("q"), live.t("k"));
        let (q_out, k_out) = if call.into {
            (Some(live.t("q_out")), Some(live.t("k_out")))
        } else {
            (None, None)
        };
        match (self, q_out, k_out) {
            (Rope::Forward, ..) => rope_forward(stream, a, &mut *q, &mut *k, &*cos, &*sin, &layout),
            (Rope::Backward, ..) => {
                rope_backward(stream, a, &mut *q, &mut *k, &*cos, &*sin, &layout)
            }
            (Rope::ForwardInto, Some(mut qo), Some(mut ko)) => rope_forward_into(
                stream, a, &*q, &*k, &*cos, &*sin, &layout, &mut *qo, &mut *ko,
            ),
            (Rope::BackwardInto, Some(mut qo), Some(mut ko)) => rope_backward_into(
                stream, a, &*q, &*k, &*cos, &*sin, &layout, &mut *qo, &mut *ko,
            ),
            _ => unreachable!("out-of-place calls have q_out and k_out"),
        }
    }

    /// In place, q's and k's token rows (the rotary dims at least, the tail dims may be
    /// rewritten with their values), at their strides; out of place, all of q_out and k_out.
    fn writes(self, call: &RopeCall, name: &'static str) -> Vec<Region> {
        let a = &call.args;
        let tokens = tables::tokens(call);
        let (q_row, k_row) = (a.q_heads * a.head_dim, a.k_heads * a.head_dim);
        let q = Region::rows(tokens, q_row, a.q_stride.unwrap_or(q_row));
        let k = Region::rows(tokens, k_row, a.k_stride.unwrap_or(k_row));
        match name {
            "q" => vec![q],
            "k" => vec![k],
            "q_out" => vec![Region::first(tokens * q_row)],
            "k_out" => vec![Region::first(tokens * k_row)],
            "qkv" => {
                let start = call.k_offset.expect("a fused call's k offset");
                vec![q, Region { start, ..k }]
            }
            _ => no_output(self, name),
        }
    }
}

/// The SwiGLU-shaped launcher `launcher` of `glu` (SwiGLU's, or GEGLU's in one form).
pub(crate) fn launch_glu<T: Dtype>(
    launcher: Swiglu,
    glu: Glu,
    stream: &Stream,
    args: &SwigluArgs,
    live: &mut Live<T>,
) -> liger_rs::Result<()> {
    match launcher {
        Swiglu::Forward => {
            let (a, b, mut c) = (live.t("a"), live.t("b"), live.t("c"));
            glu_call!(
                glu,
                swiglu_forward / geglu_forward(stream, args, &*a, &*b, &mut *c)
            )
        }
        Swiglu::ForwardFused => {
            let (gate_up, mut c) = (live.t("gate_up"), live.t("c"));
            glu_call!(
                glu,
                swiglu_forward_fused / geglu_forward_fused(stream, args, &*gate_up, &mut *c)
            )
        }
        Swiglu::Backward => {
            let (dc, a, b) = (live.t("dc"), live.t("a"), live.t("b"));
            let (mut da, mut db) = (live.t("da"), live.t("db"));
            glu_call!(
                glu,
                swiglu_backward / geglu_backward(stream, args, &*dc, &*a, &*b, &mut *da, &mut *db)
            )
        }
        Swiglu::BackwardInplace => {
            let (dc, mut a, mut b) = (live.t("dc"), live.t("a"), live.t("b"));
            glu_call!(
                glu,
                swiglu_backward_inplace
                    / geglu_backward_inplace(stream, args, &*dc, &mut *a, &mut *b)
            )
        }
        Swiglu::BackwardFused => {
            let (dc, gate_up) = (live.t("dc"), live.t("gate_up"));
            let mut d_gate_up = live.t("d_gate_up");
            glu_call!(
                glu,
                swiglu_backward_fused
                    / geglu_backward_fused(stream, args, &*dc, &*gate_up, &mut *d_gate_up)
            )
        }
        Swiglu::BackwardFusedInplace => {
            let (dc, mut gate_up) = (live.t("dc"), live.t("gate_up"));
            glu_call!(
                glu,
                swiglu_backward_fused_inplace
                    / geglu_backward_fused_inplace(stream, args, &*dc, &mut *gate_up)
            )
        }
    }
}

/// A SwiGLU-shaped launcher: its shape and its op.
pub(crate) trait GluLauncher: Op<Args = SwigluArgs> {
    fn parts(self) -> (Swiglu, Glu);
}

impl GluLauncher for Swiglu {
    fn parts(self) -> (Swiglu, Glu) {
        (self, Glu::Swiglu)
    }
}

impl GluLauncher for Geglu {
    fn parts(self) -> (Swiglu, Glu) {
        (self.0, Glu::Geglu(self.1))
    }
}

impl<O: GluLauncher> Launch for O {
    fn launch<T: Dtype>(
        self,
        stream: &Stream,
        args: &SwigluArgs,
        live: &mut Live<T>,
    ) -> liger_rs::Result<()> {
        let (launcher, glu) = self.parts();
        launch_glu(launcher, glu, stream, args, live)
    }

    fn writes(self, a: &SwigluArgs, name: &'static str) -> Vec<Region> {
        match name {
            "c" => vec![Region::rows(a.rows, a.cols, a.c_stride)],
            "a" | "da" => vec![Region::rows(a.rows, a.cols, a.a_stride)],
            "b" | "db" => vec![Region::rows(a.rows, a.cols, a.b_stride)],
            "gate_up" | "d_gate_up" => vec![Region::rows(a.rows, 2 * a.cols, a.a_stride)],
            _ => no_output(self, name),
        }
    }
}

impl Launch for Ce {
    fn launch<T: Dtype>(
        self,
        stream: &Stream,
        args: &CrossEntropyArgs,
        live: &mut Live<T>,
    ) -> liger_rs::Result<()> {
        let target = live.i64("target");
        let weight = live.take("weight").map(|w| match w {
            Slice::F32(w) => w,
            _ => panic!("`weight` is f32"),
        });
        let weight = weight.as_deref().map(|w| w as _);
        let mut z_loss = live.take("z_loss").map(|z| match z {
            Slice::F32(z) => z,
            _ => panic!("`z_loss` is f32"),
        });
        let z_loss = z_loss.as_deref_mut().map(|z| z as _);
        match self {
            Ce::Forward => {
                let (z, mut loss, mut lse) = (live.t("logits"), live.f32("loss"), live.f32("lse"));
                cross_entropy_forward(
                    stream, args, &*z, &*target, weight, &mut *loss, z_loss, &mut *lse,
                )
            }
            Ce::ForwardBackward => {
                let (z, mut loss, mut grad) = (live.t("logits"), live.f32("loss"), live.t("grad"));
                cross_entropy_forward_backward(
                    stream, args, &*z, &*target, weight, &mut *loss, z_loss, &mut *grad,
                )
            }
            Ce::ForwardBackwardInplace => {
                let (mut z, mut loss) = (live.t("logits"), live.f32("loss"));
                cross_entropy_forward_backward_inplace(
                    stream, args, &mut *z, &*target, weight, &mut *loss, z_loss,
                )
            }
            Ce::Backward => {
                let (z, lse, gl) = (live.t("logits"), live.f32("lse"), live.f32("grad_loss"));
                let mut grad = live.t("grad");
                cross_entropy_backward(stream, args, &*z, &*target, weight, &*lse, &*gl, &mut *grad)
            }
            Ce::BackwardInplace => {
                let (mut z, lse, gl) = (live.t("logits"), live.f32("lse"), live.f32("grad_loss"));
                cross_entropy_backward_inplace(stream, args, &mut *z, &*target, weight, &*lse, &*gl)
            }
        }
    }

    fn writes(self, a: &CrossEntropyArgs, name: &'static str) -> Vec<Region> {
        match name {
            "loss" | "z_loss" => vec![Region::first(a.loss_len())],
            "lse" => vec![Region::first(a.rows)],
            "grad" => vec![Region::rows(a.rows, a.vocab, a.grad_stride)],
            "logits" => vec![Region::rows(a.rows, a.vocab, a.logits_stride)],
            _ => no_output(self, name),
        }
    }
}
