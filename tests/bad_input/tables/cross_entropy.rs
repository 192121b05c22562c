//! The bad-input tables of the cross-entropy and fused linear cross-entropy launchers.
use super::*;

// ---------------------------------------------------------------- cross-entropy

#[derive(Debug, Clone, Copy)]
pub(crate) enum Ce {
    Forward,
    ForwardBackward,
    ForwardBackwardInplace,
    Backward,
    BackwardInplace,
}

pub(crate) fn logits_span(a: &CrossEntropyArgs) -> usize {
    span(a.rows, a.vocab, a.logits_stride)
}

pub(crate) fn grad_span(a: &CrossEntropyArgs) -> usize {
    span(a.rows, a.vocab, a.grad_stride)
}

impl Ce {
    /// Whether the call writes a gradient buffer of its own (whose stride is `grad_stride`).
    pub(crate) fn separate_grad(self) -> bool {
        matches!(self, Ce::ForwardBackward | Ce::Backward)
    }

    pub(crate) fn in_place(self) -> bool {
        matches!(self, Ce::ForwardBackwardInplace | Ce::BackwardInplace)
    }

    pub(crate) fn backward(self) -> bool {
        matches!(self, Ce::Backward | Ce::BackwardInplace)
    }
}

impl Op for Ce {
    type Args = CrossEntropyArgs;

    fn name(self) -> &'static str {
        match self {
            Ce::Forward => "cross_entropy_forward",
            Ce::ForwardBackward => "cross_entropy_forward_backward",
            Ce::ForwardBackwardInplace => "cross_entropy_forward_backward_inplace",
            Ce::Backward => "cross_entropy_backward",
            Ce::BackwardInplace => "cross_entropy_backward_inplace",
        }
    }

    /// 3 rows of 8 classes, logits rows 11 apart (30 elements), gradient rows 13 apart (34),
    /// class weights, per-row losses.
    fn base(self) -> Call<CrossEntropyArgs> {
        let args = CrossEntropyArgs::new(3, 8)
            .with_logits_stride(11)
            .with_grad_stride(13)
            .with_reduction(Reduction::None);
        let role = if self.in_place() {
            Role::InOut
        } else {
            Role::In
        };
        let rows = |a: &CrossEntropyArgs| a.rows;
        let loss = |a: &CrossEntropyArgs| a.loss_len();
        let mut bufs = vec![
            buf("logits", Kind::T, role, logits_span),
            buf("target", Kind::I64, Role::In, rows),
            buf("weight", Kind::F32, Role::In, |a: &CrossEntropyArgs| {
                a.vocab
            }),
        ];
        if self.backward() {
            bufs.push(buf("lse", Kind::F32, Role::In, rows));
            bufs.push(buf("grad_loss", Kind::F32, Role::In, loss));
        } else {
            bufs.push(buf("loss", Kind::F32, Role::Out, loss));
            bufs.push(buf("z_loss", Kind::F32, Role::Out, loss));
        }
        if let Ce::Forward = self {
            bufs.push(buf("lse", Kind::F32, Role::Out, rows));
        }
        if self.separate_grad() {
            bufs.push(buf("grad", Kind::T, Role::Out, grad_span));
        }
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<CrossEntropyArgs>) {
        let stride = "rows × row stride within usize";
        let logits_stride = invalid("args.logits_stride", "row stride ≥ cols = 8");
        let vocab = invalid("args.vocab", "1 ..= 2147483647 classes");
        let smoothing = invalid("args.label_smoothing", "a value in [0, 1]");
        let lambda = invalid("args.lse_square_scale", "a finite value ≥ 0");
        let cap = invalid("args.softcap", "a finite value > 0");
        let per_loss = "length 3 (rows with Reduction::None, else 1)";
        t.field("args.rows", "one more than the buffers hold", |a| a.rows = 4, invalid("logits", "length ≥ 41 (rows × row stride)"));
        t.field("args.rows", "usize::MAX: rows × stride overflows", |a| a.rows = usize::MAX, invalid("args.logits_stride", stride));
        t.reshape("args.rows", "0, every buffer empty", |a| a.rows = 0, Want::Ok);
        t.field("args.vocab", "0", |a| a.vocab = 0, vocab);
        t.field("args.vocab", "2³¹", |a| a.vocab = 1 << 31, vocab);
        t.reshape("args.vocab", "1, strides too", |a| { a.vocab = 1; a.logits_stride = 1; a.grad_stride = 1 }, Want::Ok);
        t.field("args.logits_stride", "vocab − 1", |a| a.logits_stride = 7, logits_stride);
        t.field("args.logits_stride", "one more than the logits hold", |a| a.logits_stride = 12, invalid("logits", "length ≥ 32 (rows × row stride)"));
        t.reshape("args.logits_stride", "vocab (contiguous)", |a| a.logits_stride = 8, Want::Ok);
        if self.separate_grad() {
            t.field("args.grad_stride", "vocab − 1", |a| a.grad_stride = 7, invalid("args.grad_stride", "row stride ≥ cols = 8"));
            t.field("args.grad_stride", "one more than grad holds", |a| a.grad_stride = 14, invalid("grad", "length ≥ 36 (rows × row stride)"));
            t.reshape("args.grad_stride", "vocab (contiguous)", |a| a.grad_stride = 8, Want::Ok);
        } else {
            t.field("args.grad_stride", "vocab − 1: no gradient buffer of its own, unused", |a| a.grad_stride = 7, Want::Ok);
        }
        t.field("args.ignore_index", "1 (the seeded targets are 0 and 1)", |a| a.ignore_index = 1, Want::Ok);
        t.field("args.label_smoothing", "negative", |a| a.label_smoothing = -0.1, smoothing);
        t.field("args.label_smoothing", "above 1", |a| a.label_smoothing = 1.5, smoothing);
        t.field("args.label_smoothing", "NaN", |a| a.label_smoothing = f32::NAN, smoothing);
        t.field("args.label_smoothing", "0.1", |a| a.label_smoothing = 0.1, Want::Ok);
        t.field("args.lse_square_scale", "negative", |a| a.lse_square_scale = -1.0, lambda);
        t.field("args.lse_square_scale", "+∞", |a| a.lse_square_scale = f32::INFINITY, lambda);
        t.field("args.lse_square_scale", "1e-4", |a| a.lse_square_scale = 1e-4, Want::Ok);
        t.field("args.softcap", "0", |a| a.softcap = Some(0.0), cap);
        t.field("args.softcap", "negative", |a| a.softcap = Some(-30.0), cap);
        t.field("args.softcap", "NaN", |a| a.softcap = Some(f32::NAN), cap);
        t.field("args.softcap", "30", |a| a.softcap = Some(30.0), Want::Ok);
        t.reshape("args.reduction", "Mean", |a| a.reduction = Reduction::Mean, Want::Ok);
        t.reshape("args.reduction", "Sum", |a| a.reduction = Reduction::Sum, Want::Ok);
        t.short("logits", "length ≥ 30 (rows × row stride)");
        t.long("logits", Want::Ok);
        t.short("target", "length 3 (rows)");
        t.long("target", invalid("target", "length 3 (rows)"));
        t.short("weight", "length 8 (vocab)");
        t.long("weight", invalid("weight", "length 8 (vocab)"));
        t.row("weight", "None: unweighted", |c| c.remove("weight"), Want::Ok);
        if self.backward() || matches!(self, Ce::Forward) {
            t.short("lse", "length 3 (rows)");
            t.long("lse", invalid("lse", "length 3 (rows)"));
        }
        if self.backward() {
            t.short("grad_loss", per_loss);
            t.long("grad_loss", invalid("grad_loss", per_loss));
        } else {
            for name in ["loss", "z_loss"] {
                t.short(name, per_loss);
                t.long(name, invalid(name, per_loss));
            }
            t.row("z_loss", "None", |c| c.remove("z_loss"), Want::Ok);
        }
        if self.separate_grad() {
            t.short("grad", "length ≥ 34 (rows × row stride)");
            t.long("grad", Want::Ok);
        }
    }

    fn fields(args: &CrossEntropyArgs) -> String {
        format!("{args:?}")
    }
}

// ---------------------------------------------------------------- fused linear cross-entropy

/// `fused_linear_cross_entropy` (one launcher).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flce;

fn tokens_hidden(a: &LinearCrossEntropyArgs) -> usize {
    a.ce.rows.saturating_mul(a.hidden)
}

fn vocab_hidden(a: &LinearCrossEntropyArgs) -> usize {
    a.ce.vocab.saturating_mul(a.hidden)
}

impl Op for Flce {
    type Args = LinearCrossEntropyArgs;

    fn name(self) -> &'static str {
        "fused_linear_cross_entropy"
    }

    /// 3 tokens of hidden 4, a head of 8 classes with a bias, class weights, per-row losses,
    /// chunks of 2 tokens.
    fn base(self) -> Call<LinearCrossEntropyArgs> {
        let ce = CrossEntropyArgs::new(3, 8).with_reduction(Reduction::None);
        let args = LinearCrossEntropyArgs::with_ce(4, ce).with_chunk(2);
        let vocab = |a: &LinearCrossEntropyArgs| a.ce.vocab;
        let loss = |a: &LinearCrossEntropyArgs| a.ce.loss_len();
        let bufs = vec![
            buf("x", Kind::T, Role::In, tokens_hidden),
            buf("weight", Kind::T, Role::In, vocab_hidden),
            buf("bias", Kind::T, Role::In, vocab),
            buf(
                "target",
                Kind::I64,
                Role::In,
                |a: &LinearCrossEntropyArgs| a.ce.rows,
            ),
            buf("ce_weight", Kind::F32, Role::In, vocab),
            buf("loss", Kind::F32, Role::Out, loss),
            buf("z_loss", Kind::F32, Role::Out, loss),
            buf("dx", Kind::T, Role::Out, tokens_hidden),
            buf("dweight", Kind::F32, Role::Out, vocab_hidden),
            buf("dbias", Kind::F32, Role::Out, vocab),
        ];
        Call::new(args, bufs)
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<LinearCrossEntropyArgs>) {
        let vocab = invalid("args.vocab", "1 ..= 2147483647 classes");
        let hidden = invalid("args.hidden", "1 ..= 2147483647");
        let per_loss = "length 3 (tokens with Reduction::None, else 1)";
        t.field("args.rows", "one more token than the buffers hold", |a| a.ce.rows = 4, invalid("x", "length 16 (tokens × hidden)"));
        t.field("args.rows", "usize::MAX: tokens × hidden overflows", |a| a.ce.rows = usize::MAX, invalid("x", "a size within usize"));
        t.reshape("args.rows", "0, every buffer resized", |a| a.ce.rows = 0, Want::Ok);
        t.field("args.vocab", "0", |a| a.ce.vocab = 0, vocab);
        t.field("args.vocab", "2³¹", |a| a.ce.vocab = 1 << 31, vocab);
        t.reshape("args.vocab", "1", |a| a.ce.vocab = 1, Want::Ok);
        t.field("args.hidden", "0", |a| a.hidden = 0, hidden);
        t.field("args.hidden", "2³¹", |a| a.hidden = 1 << 31, hidden);
        t.reshape("args.hidden", "1", |a| a.hidden = 1, Want::Ok);
        t.field("args.chunk", "Some(0)", |a| a.chunk = Some(0), invalid("args.chunk", "at least 1 token"));
        t.field("args.chunk", "None: the default rule (every token in one chunk here)", |a| a.chunk = None, Want::Ok);
        t.field("args.chunk", "more tokens than the call has", |a| a.chunk = Some(1 << 40), Want::Ok);
        t.field("args.ignore_index", "1", |a| a.ce.ignore_index = 1, Want::Ok);
        t.field("args.label_smoothing", "above 1", |a| a.ce.label_smoothing = 1.5, invalid("args.label_smoothing", "a value in [0, 1]"));
        t.field("args.label_smoothing", "0.1", |a| a.ce.label_smoothing = 0.1, Want::Ok);
        t.field("args.lse_square_scale", "NaN", |a| a.ce.lse_square_scale = f32::NAN, invalid("args.lse_square_scale", "a finite value ≥ 0"));
        t.field("args.lse_square_scale", "1e-4", |a| a.ce.lse_square_scale = 1e-4, Want::Ok);
        t.field("args.softcap", "0", |a| a.ce.softcap = Some(0.0), invalid("args.softcap", "a finite value > 0"));
        t.field("args.softcap", "30", |a| a.ce.softcap = Some(30.0), Want::Ok);
        t.reshape("args.reduction", "Mean", |a| a.ce.reduction = Reduction::Mean, Want::Ok);
        t.reshape("args.reduction", "Sum", |a| a.ce.reduction = Reduction::Sum, Want::Ok);
        for (name, need) in [
            ("x", "length 12 (tokens × hidden)"),
            ("weight", "length 32 (vocab × hidden)"),
            ("bias", "length 8 (vocab)"),
            ("target", "length 3 (tokens)"),
            ("ce_weight", "length 8 (vocab)"),
            ("loss", per_loss),
            ("z_loss", per_loss),
            ("dx", "length 12 (tokens × hidden)"),
            ("dweight", "length 32 (vocab × hidden)"),
            ("dbias", "length 8 (vocab)"),
        ] {
            t.short(name, need);
            t.long(name, invalid(name, need));
        }
        t.row("bias", "None, dbias given", |c| c.remove("bias"), invalid("dbias", "no dbias without a bias"));
        t.row("dbias", "None, bias given", |c| c.remove("dbias"), invalid("dbias", "a dbias buffer for the bias"));
        t.row("bias", "None, and dbias None", |c| { c.remove("bias"); c.remove("dbias") }, Want::Ok);
        t.row("ce_weight", "None: unweighted", |c| c.remove("ce_weight"), Want::Ok);
        t.row("z_loss", "None", |c| c.remove("z_loss"), Want::Ok);
    }

    /// Flat: the head's fields and the cross-entropy's that the call uses (its strides are
    /// the chunk's, set by the call).
    fn fields(a: &LinearCrossEntropyArgs) -> String {
        let c = &a.ce;
        format!(
            "LinearCrossEntropyArgs {{ hidden: {}, chunk: {:?}, rows: {}, vocab: {}, \
             ignore_index: {}, label_smoothing: {:?}, lse_square_scale: {:?}, softcap: {:?}, \
             reduction: {:?} }}",
            a.hidden,
            a.chunk,
            c.rows,
            c.vocab,
            c.ignore_index,
            c.label_smoothing,
            c.lse_square_scale,
            c.softcap,
            c.reduction
        )
    }
}
