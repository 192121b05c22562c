//! The bad-input tables of RoPE's launchers.
use super::*;

// ---------------------------------------------------------------- RoPE

#[derive(Debug, Clone, Copy)]
pub(crate) enum Rope {
    Forward,
    Backward,
    ForwardInto,
    BackwardInto,
    ForwardFused,
    BackwardFused,
}

impl Rope {
    /// Out of place: q and k are only read, `q_out` and `k_out` written.
    pub(crate) fn into(self) -> bool {
        matches!(self, Rope::ForwardInto | Rope::BackwardInto)
    }

    /// q and k in one buffer `qkv`, k at [`FUSED_K_OFFSET`].
    pub(crate) fn fused(self) -> bool {
        matches!(self, Rope::ForwardFused | Rope::BackwardFused)
    }
}

/// Where k starts in the fused calls' `qkv`: after q's 32 columns of each 64-element token row.
pub(crate) const FUSED_K_OFFSET: usize = 32;

/// Where the cos/sin rows come from ([`CosSinLayout`] without the borrowed ids).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Layout {
    PerPosition,
    PerBatch,
    Host(Vec<i64>),
    DeviceI32,
    DeviceI64,
    /// Qwen2-VL's three tables, with these sections.
    Multimodal([usize; 3]),
    /// Qwen2-VL's `[3, B, S]` device i64 ids into the gathered table, with these sections.
    MultimodalIds([usize; 3]),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RopeCall {
    pub(crate) args: RopeArgs,
    pub(crate) layout: Layout,
    pub(crate) into: bool,
    /// A fused call's k offset in `qkv` (then there are no `q` and `k` buffers).
    pub(crate) k_offset: Option<usize>,
}

/// Rows of the valid call's gathered cos/sin table.
pub(crate) const MAX_POS: usize = 5;

pub(crate) fn tokens(c: &RopeCall) -> usize {
    c.args.batch.saturating_mul(c.args.seq_len)
}

/// Elements from the first token row of `row` elements to the end of the last, `stride`
/// apart (saturating).
fn rows_span(c: &RopeCall, row: usize, stride: usize) -> usize {
    match tokens(c) {
        0 => 0,
        t => (t - 1).saturating_mul(stride).saturating_add(row),
    }
}

/// The span of q (its length when contiguous).
pub(crate) fn q_len(c: &RopeCall) -> usize {
    let row = c.args.q_heads.saturating_mul(c.args.head_dim);
    rows_span(c, row, c.args.q_stride.unwrap_or(row))
}

/// The span of k.
pub(crate) fn k_len(c: &RopeCall) -> usize {
    let row = c.args.k_heads.saturating_mul(c.args.head_dim);
    rows_span(c, row, c.args.k_stride.unwrap_or(row))
}

/// The contiguous outputs of an out-of-place call.
pub(crate) fn q_out_len(c: &RopeCall) -> usize {
    tokens(c).saturating_mul(c.args.q_heads * c.args.head_dim)
}

pub(crate) fn k_out_len(c: &RopeCall) -> usize {
    tokens(c).saturating_mul(c.args.k_heads * c.args.head_dim)
}

/// A fused call's `qkv`: q's span from 0 and k's from `k_offset`.
pub(crate) fn qkv_len(c: &RopeCall) -> usize {
    q_len(c).max(c.k_offset.unwrap_or(0).saturating_add(k_len(c)))
}

/// Multimodal ids: three rows (t, h, w) of `batch × seq_len`.
pub(crate) fn multimodal_ids_len(c: &RopeCall) -> usize {
    tokens(c).saturating_mul(3)
}

pub(crate) fn table_len(c: &RopeCall) -> usize {
    let rows = match c.layout {
        Layout::PerPosition => c.args.seq_len,
        Layout::PerBatch => tokens(c),
        Layout::Multimodal(_) => 3 * tokens(c),
        _ => MAX_POS,
    };
    rows * c.args.table_row_len()
}

/// A valid call for `args` under `layout`: q and k (read and written in place, or read with
/// `into`, then `q_out` and `k_out` written; with `k_offset`, one buffer `qkv` read and
/// written in place instead), cos and sin, device ids if any.
pub(crate) fn rope_call(
    args: RopeArgs,
    layout: Layout,
    into: bool,
    k_offset: Option<usize>,
) -> Call<RopeCall> {
    let role = if into { Role::In } else { Role::InOut };
    let mut bufs = match k_offset {
        Some(_) => vec![buf("qkv", Kind::T, Role::InOut, qkv_len)],
        None => vec![
            buf("q", Kind::T, role, q_len),
            buf("k", Kind::T, role, k_len),
        ],
    };
    bufs.push(buf("cos", Kind::T, Role::In, table_len));
    bufs.push(buf("sin", Kind::T, Role::In, table_len));
    match layout {
        Layout::DeviceI32 => bufs.push(buf("position_ids", Kind::I32, Role::In, tokens)),
        Layout::DeviceI64 => bufs.push(buf("position_ids", Kind::I64, Role::In, tokens)),
        Layout::MultimodalIds(_) => {
            bufs.push(buf("position_ids", Kind::I64, Role::In, multimodal_ids_len))
        }
        _ => {}
    }
    if into {
        bufs.push(buf("q_out", Kind::T, Role::Out, q_out_len));
        bufs.push(buf("k_out", Kind::T, Role::Out, k_out_len));
    }
    let call = RopeCall {
        args,
        layout,
        into,
        k_offset,
    };
    Call::new(call, bufs)
}

/// Starts the row over from the valid call under another layout.
pub(crate) fn relayout(c: &mut Call<RopeCall>, layout: Layout) {
    *c = rope_call(c.args.args, layout, c.args.into, c.args.k_offset);
}

/// The valid call under host ids (0, 1, …, 4, 0, …), with `change` applied to the ids.
pub(crate) fn with_host_ids(c: &mut Call<RopeCall>, change: impl Fn(&mut Vec<i64>)) {
    let mut ids: Vec<i64> = (0..tokens(&c.args)).map(|i| (i % MAX_POS) as i64).collect();
    change(&mut ids);
    relayout(c, Layout::Host(ids));
}

/// The rows of the fused calls: every field of the args, `qkv` (its span from q's first row to
/// k's last), the tables and ids. q's and k's rows overlapping within `qkv` (k_offset) are
/// walked in `tests/rope.rs`, which names them `q` and `k`.
#[rustfmt::skip]
fn fused_rows(t: &mut Rows<RopeCall>) {
    let qkv = |needle| invalid("qkv", needle);
    let table = invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
    t.short("qkv", "length ≥ 368 (k_offset + the span of k)");
    t.long("qkv", Want::Ok);
    t.short("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
    t.long("cos", table);
    t.short("sin", "length 30 (the length of cos)");
    t.long("sin", invalid("sin", "length 30 (the length of cos)"));
    t.short("position_ids", "length 6 (batch × seq_len)");
    t.long("position_ids", invalid("position_ids", "length 6 (batch × seq_len)"));
    t.field("args.batch", "3: k's rows past qkv", |c| c.args.batch = 3, qkv("length ≥ 560 (k_offset + the span of k)"));
    t.reshape("args.batch", "1", |c| c.args.batch = 1, Want::Ok);
    t.field("args.seq_len", "4: k's rows past qkv", |c| c.args.seq_len = 4, qkv("length ≥ 496 (k_offset + the span of k)"));
    t.field("args.q_heads", "0", |c| c.args.q_heads = 0, invalid("args.q_heads", "at least 1"));
    t.field("args.q_heads", "3 (fewer columns of q in each row)", |c| c.args.q_heads = 3, Want::Ok);
    t.field("args.k_heads", "0", |c| c.args.k_heads = 0, invalid("args.k_heads", "at least 1"));
    t.field("args.k_heads", "9: a k row wider than its stride", |c| c.args.k_heads = 9, invalid("args.k_stride", "≥ k_heads × head_dim = 72"));
    t.field("args.head_dim", "7 (odd)", |c| c.args.head_dim = 7, invalid("args.head_dim", "an even value ≥ 2"));
    t.field("args.rotary_dim", "5 (odd)", |c| c.args.rotary_dim = 5, invalid("args.rotary_dim", "an even value in 2 ..= head_dim = 8"));
    t.reshape("args.interleaved", "interleaved pairs", |c| c.args.interleaved = true, Want::Ok);
    t.field("args.half_tables", "gathered: the 30 elements are 10 rows of 3", |c| c.args.half_tables = true, Want::Ok);
    t.field("args.head_major", "with strides", |c| c.args.head_major = true, invalid("args.q_stride", "None with head-major q and k"));
    t.field("args.q_stride", "31 < q_heads × head_dim", |c| c.args.q_stride = Some(31), invalid("args.q_stride", "≥ q_heads × head_dim = 32"));
    t.field("args.k_stride", "15 < k_heads × head_dim", |c| c.args.k_stride = Some(15), invalid("args.k_stride", "≥ k_heads × head_dim = 16"));
    t.row("layout", "PerPosition", |c| relayout(c, Layout::PerPosition), Want::Ok);
    t.row("layout", "MultimodalGathered, i64 ids", |c| relayout(c, Layout::MultimodalIds([2, 1, 0])), Want::Ok);
}

impl Op for Rope {
    type Args = RopeCall;

    fn name(self) -> &'static str {
        match self {
            Rope::Forward => "rope_forward",
            Rope::Backward => "rope_backward",
            Rope::ForwardInto => "rope_forward_into",
            Rope::BackwardInto => "rope_backward_into",
            Rope::ForwardFused => "rope_forward_fused",
            Rope::BackwardFused => "rope_backward_fused",
        }
    }

    /// q [2, 3, 4, 8] (192), k [2, 3, 2, 8] (96), partial rotary 6, cos/sin a table of 5 rows
    /// of 6 (30) gathered by 6 device i64 ids; out of place, q_out and k_out like q and k.
    /// Fused: q and k in one `qkv` of 6 token rows of 64 (q 32 | k 16 | v 16), 368 elements
    /// from q's first to k's last.
    fn base(self) -> Call<RopeCall> {
        let args = RopeArgs::new(8)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_rotary_dim(6);
        match self.fused() {
            true => rope_call(
                args.with_strides(64, 64),
                Layout::DeviceI64,
                false,
                Some(FUSED_K_OFFSET),
            ),
            false => rope_call(args, Layout::DeviceI64, self.into(), None),
        }
    }

    #[rustfmt::skip]
    fn rows(self, t: &mut Rows<RopeCall>) {
        if self.fused() {
            return fused_rows(t);
        }
        let q = |needle| invalid("q", needle);
        let k = |needle| invalid("k", needle);
        let shape = "batch × seq_len × heads × head_dim within usize";
        let pairs = "(q_heads + k_heads) × rotary_dim / 2 < 2^31";
        let head_dim = invalid("args.head_dim", "an even value ≥ 2");
        let rotary_dim = invalid("args.rotary_dim", "an even value in 2 ..= head_dim = 8");
        let table = invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
        let per_position = invalid("cos", "length 18 (seq_len × rotary_dim)");
        let per_batch = invalid("cos", "length 36 (batch × seq_len × rotary_dim)");
        let ids_len = invalid("position_ids", "length 6 (batch × seq_len)");
        let ids_range = invalid("position_ids", "ids in 0 ..= 4 (rows of the cos/sin table)");
        t.field("args.batch", "one more than q and k hold", |c| c.args.batch = 3, q("length 288 (batch × seq_len × q_heads × head_dim)"));
        t.field("args.batch", "usize::MAX: tokens overflow", |c| c.args.batch = usize::MAX, invalid("args", shape));
        t.reshape("args.batch", "1", |c| c.args.batch = 1, Want::Ok);
        t.field("args.seq_len", "one more than q and k hold", |c| c.args.seq_len = 4, q("length 256 (batch × seq_len × q_heads × head_dim)"));
        t.field("args.seq_len", "usize::MAX: tokens overflow", |c| c.args.seq_len = usize::MAX, invalid("args", shape));
        t.field("args.q_heads", "0", |c| c.args.q_heads = 0, invalid("args.q_heads", "at least 1"));
        t.field("args.q_heads", "one more than q holds", |c| c.args.q_heads = 5, q("length 240 (batch × seq_len × q_heads × head_dim)"));
        t.field("args.q_heads", "2^40: pairs per token overflow", |c| c.args.q_heads = 1 << 40, invalid("args", pairs));
        t.reshape("args.q_heads", "1 (fewer than k_heads)", |c| c.args.q_heads = 1, Want::Ok);
        t.field("args.k_heads", "0", |c| c.args.k_heads = 0, invalid("args.k_heads", "at least 1"));
        t.field("args.k_heads", "one more than k holds", |c| c.args.k_heads = 3, k("length 144 (batch × seq_len × k_heads × head_dim)"));
        t.field("args.k_heads", "2^40: pairs per token overflow", |c| c.args.k_heads = 1 << 40, invalid("args", pairs));
        t.field("args.head_dim", "0", |c| c.args.head_dim = 0, head_dim);
        t.field("args.head_dim", "7 (odd)", |c| c.args.head_dim = 7, head_dim);
        t.field("args.head_dim", "4 < rotary_dim", |c| c.args.head_dim = 4, invalid("args.rotary_dim", "an even value in 2 ..= head_dim = 4"));
        t.field("args.head_dim", "10: more than q and k hold", |c| c.args.head_dim = 10, q("length 240 (batch × seq_len × q_heads × head_dim)"));
        t.reshape("args.head_dim", "6 = rotary_dim", |c| c.args.head_dim = 6, Want::Ok);
        t.field("args.rotary_dim", "0", |c| c.args.rotary_dim = 0, rotary_dim);
        t.field("args.rotary_dim", "5 (odd)", |c| c.args.rotary_dim = 5, rotary_dim);
        t.field("args.rotary_dim", "10 > head_dim", |c| c.args.rotary_dim = 10, rotary_dim);
        t.field("args.rotary_dim", "4: cos is not whole rows of 4", |c| c.args.rotary_dim = 4, invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 4"));
        t.reshape("args.rotary_dim", "8 = head_dim (full rotary)", |c| c.args.rotary_dim = 8, Want::Ok);
        t.reshape("args.rotary_dim", "2, the least", |c| c.args.rotary_dim = 2, Want::Ok);
        t.short("q", "length 192 (batch × seq_len × q_heads × head_dim)");
        t.long("q", q("length 192 (batch × seq_len × q_heads × head_dim)"));
        t.short("k", "length 96 (batch × seq_len × k_heads × head_dim)");
        t.long("k", k("length 96 (batch × seq_len × k_heads × head_dim)"));
        t.short("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6");
        t.long("cos", table);
        t.row("cos", "one row fewer, sin too (a table of 4 rows)", |c| { c.buf("cos").len -= 6; c.buf("sin").len -= 6 }, Want::Ok);
        t.row("cos", "empty, sin too", |c| { c.buf("cos").len = 0; c.buf("sin").len = 0 }, invalid("cos", "max_pos ≥ 1 rows"));
        t.short("sin", "length 30 (the length of cos)");
        t.long("sin", invalid("sin", "length 30 (the length of cos)"));
        t.short("position_ids", "length 6 (batch × seq_len)");
        t.long("position_ids", ids_len);
        t.row("layout", "PerPosition", |c| relayout(c, Layout::PerPosition), Want::Ok);
        t.row("layout", "PerPosition, cos one short", |c| { relayout(c, Layout::PerPosition); c.buf("cos").len -= 1 }, per_position);
        t.row("layout", "PerPosition, cos one long", |c| { relayout(c, Layout::PerPosition); c.buf("cos").len += 1 }, per_position);
        t.row("layout", "PerPosition, sin one short", |c| { relayout(c, Layout::PerPosition); c.buf("sin").len -= 1 }, invalid("sin", "length 18 (the length of cos)"));
        t.row("layout", "PerPosition with the gathered table", |c| { relayout(c, Layout::PerPosition); c.buf("cos").len = 30; c.buf("sin").len = 30 }, per_position);
        t.row("layout", "PerBatch", |c| relayout(c, Layout::PerBatch), Want::Ok);
        t.row("layout", "PerBatch, cos one short", |c| { relayout(c, Layout::PerBatch); c.buf("cos").len -= 1 }, per_batch);
        t.row("layout", "PerBatch, cos one long", |c| { relayout(c, Layout::PerBatch); c.buf("cos").len += 1 }, per_batch);
        t.row("layout", "PerBatch with a [seq_len, rotary_dim] table", |c| { relayout(c, Layout::PerBatch); c.buf("cos").len = 18; c.buf("sin").len = 18 }, per_batch);
        t.row("layout", "host ids", |c| with_host_ids(c, |_| {}), Want::Ok);
        t.row("position_ids", "host ids, one short", |c| with_host_ids(c, |ids| { ids.pop(); }), ids_len);
        t.row("position_ids", "host ids, one long", |c| with_host_ids(c, |ids| ids.push(0)), ids_len);
        t.row("position_ids", "a host id of −1", |c| with_host_ids(c, |ids| ids[4] = -1), ids_range);
        t.row("position_ids", "a host id of max_pos", |c| with_host_ids(c, |ids| ids[2] = 5), ids_range);
        t.row("layout", "device i32 ids", |c| relayout(c, Layout::DeviceI32), Want::Ok);
        t.row("position_ids", "i32 ids, one short", |c| { relayout(c, Layout::DeviceI32); c.buf("position_ids").len -= 1 }, ids_len);
        t.row("position_ids", "i32 ids, one long", |c| { relayout(c, Layout::DeviceI32); c.buf("position_ids").len += 1 }, ids_len);
        t.row("position_ids", "i32 ids from device 1", |c| { relayout(c, Layout::DeviceI32); c.buf("position_ids").at = At::Other }, Want::WrongContext { arg: "position_ids" });
        let (q_w, k_w) = if self.into() { ("q_out", "k_out") } else { ("q", "k") };
        t.row(q_w, "its first element over the last i32 id", move |c| { relayout(c, Layout::DeviceI32); c.buf(q_w).at = At::Over("position_ids", Edge::Tail) }, Want::Aliasing { output: q_w, other: "position_ids" });
        t.row(k_w, "its last element over the first i32 id", move |c| { relayout(c, Layout::DeviceI32); c.buf(k_w).at = At::Over("position_ids", Edge::Head) }, Want::Aliasing { output: k_w, other: "position_ids" });
        t.reshape("args.interleaved", "interleaved pairs", |c| c.args.interleaved = true, Want::Ok);
        t.reshape("args.head_major", "head-major q and k", |c| c.args.head_major = true, Want::Ok);
        t.reshape("args.half_tables", "half-width rows of 3", |c| c.args.half_tables = true, Want::Ok);
        t.row("args.half_tables", "with full-width per-position rows", |c| { relayout(c, Layout::PerPosition); c.args.args.half_tables = true }, invalid("cos", "length 9 (seq_len × rotary_dim / 2)"));
        t.row("args.half_tables", "gathered: the 30 elements are 10 rows of 3", |c| c.args.args.half_tables = true, Want::Ok);
        // The out-of-place kernels index a token's pairs and copied tail dims in 32 bits.
        let wide = if self.into() { invalid("args", "(q_heads + k_heads) × head_dim < 2^31") } else { q("length 12884901888") };
        t.field("args.q_heads", "2^28: heads × head_dim ≥ 2^31", |c| c.args.q_heads = 1 << 28, wide);
        // Token rows apart: q 40 and k 24 elements per token (views into wider buffers).
        let spans = |c: &mut RopeArgs| *c = c.with_strides(40, 24);
        t.reshape("args.q_stride", "q rows 40 apart, k rows 24 apart", move |c| spans(&mut c.args), Want::Ok);
        t.reshape("args.k_stride", "16 = k's row (k contiguous), q rows 40 apart", |c| c.args = c.args.with_strides(40, 16), Want::Ok);
        t.field("args.q_stride", "31 < q_heads × head_dim", |c| c.args.q_stride = Some(31), invalid("args.q_stride", "≥ q_heads × head_dim = 32"));
        t.field("args.k_stride", "15 < k_heads × head_dim", |c| c.args.k_stride = Some(15), invalid("args.k_stride", "≥ k_heads × head_dim = 16"));
        t.field("args.q_stride", "usize::MAX: the span overflows", |c| c.args.q_stride = Some(usize::MAX), invalid("args", shape));
        t.field("args.q_stride", "set with head-major q and k", |c| { c.args.head_major = true; c.args.q_stride = Some(32) }, invalid("args.q_stride", "None with head-major q and k"));
        t.field("args.k_stride", "set with head-major q and k", |c| { c.args.head_major = true; c.args.k_stride = Some(16) }, invalid("args.k_stride", "None with head-major q and k"));
        t.row("q", "strided, one short of its span", move |c| { spans(&mut c.args.args); c.resize(); c.buf("q").len -= 1 }, q("length ≥ 232 ((batch × seq_len − 1) × q_stride + q_heads × head_dim)"));
        t.row("k", "strided, one short of its span", move |c| { spans(&mut c.args.args); c.resize(); c.buf("k").len -= 1 }, k("length ≥ 136 ((batch × seq_len − 1) × k_stride + k_heads × head_dim)"));
        t.row("q", "strided, one long (a view into a wider buffer)", move |c| { spans(&mut c.args.args); c.resize(); c.buf("q").len += 1 }, Want::Ok);
        // Qwen2-VL's three tables: [3, batch, seq_len, rotary_dim], sections summing to 3.
        let multimodal = invalid("cos", "length 108 (3 × batch × seq_len × rotary_dim)");
        t.row("layout", "Multimodal", |c| relayout(c, Layout::Multimodal([1, 0, 2])), Want::Ok);
        t.row("layout", "Multimodal, cos one short", |c| { relayout(c, Layout::Multimodal([1, 1, 1])); c.buf("cos").len -= 1 }, multimodal);
        t.row("layout", "Multimodal, cos one long", |c| { relayout(c, Layout::Multimodal([1, 1, 1])); c.buf("cos").len += 1 }, multimodal);
        t.row("layout", "Multimodal, sin one short", |c| { relayout(c, Layout::Multimodal([1, 1, 1])); c.buf("sin").len -= 1 }, invalid("sin", "length 108 (the length of cos)"));
        t.row("layout", "Multimodal, sections summing to 4", |c| relayout(c, Layout::Multimodal([1, 1, 2])), invalid("layout.sections", "three sizes summing to rotary_dim / 2 = 3"));
        // [3, batch, seq_len] ids into the gathered table of 5 rows.
        let mm_ids = invalid("position_ids", "length 18 (3 × batch × seq_len)");
        t.row("layout", "MultimodalGathered, i64 ids", |c| relayout(c, Layout::MultimodalIds([2, 1, 0])), Want::Ok);
        t.row("position_ids", "MultimodalGathered, one id short", |c| { relayout(c, Layout::MultimodalIds([2, 1, 0])); c.buf("position_ids").len -= 1 }, mm_ids);
        t.row("position_ids", "MultimodalGathered, one id long", |c| { relayout(c, Layout::MultimodalIds([2, 1, 0])); c.buf("position_ids").len += 1 }, mm_ids);
        t.row("position_ids", "MultimodalGathered, batch × seq_len ids", |c| { relayout(c, Layout::MultimodalIds([2, 1, 0])); c.buf("position_ids").len = 6 }, mm_ids);
        t.row("layout", "MultimodalGathered, sections summing to 2", |c| relayout(c, Layout::MultimodalIds([1, 1, 0])), invalid("layout.sections", "three sizes summing to rotary_dim / 2 = 3"));
        t.row("layout", "MultimodalGathered, cos not whole rows", |c| { relayout(c, Layout::MultimodalIds([1, 1, 1])); c.buf("cos").len -= 1; c.buf("sin").len -= 1 }, invalid("cos", "a table of max_pos ≥ 1 rows of rotary_dim = 6"));
        if self.into() {
            t.short("q_out", "length 192 (batch × seq_len × q_heads × head_dim)");
            t.long("q_out", invalid("q_out", "length 192 (batch × seq_len × q_heads × head_dim)"));
            t.short("k_out", "length 96 (batch × seq_len × k_heads × head_dim)");
            t.long("k_out", invalid("k_out", "length 96 (batch × seq_len × k_heads × head_dim)"));
        }
    }

    fn fields(args: &RopeCall) -> String {
        format!("{:?}", args.args)
    }

    fn rename(self, name: &'static str) -> &'static str {
        match (self, name) {
            (Rope::Backward | Rope::BackwardInto, "q") => "dq",
            (Rope::Backward | Rope::BackwardInto, "k") => "dk",
            (Rope::BackwardInto, "q_out") => "dq_out",
            (Rope::BackwardInto, "k_out") => "dk_out",
            (Rope::BackwardFused, "qkv") => "dqkv",
            _ => name,
        }
    }
}
