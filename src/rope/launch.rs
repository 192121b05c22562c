//! Pointers → a parameter block → one launch.
use super::abi::Params;
use super::args::{RopeArgs, RopeSizes};
use super::layout::TableRows;
use super::plan::{Plan, general_form};
use crate::error::Result;
use crate::launch::{Launch, arg, launch_ex};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};

/// The device pointers of one launch (their guards held by the caller): `q` and `k` (0
/// without k) are read, and written in place (`out = None`) or to the `(q_out, k_out)`
/// pointers; the cos/sin tables, and the ids (0 unless gathered).
pub(crate) struct Io {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) out: Option<(u64, u64)>,
    pub(crate) cos: u64,
    pub(crate) sin: u64,
    pub(crate) ids: u64,
}

/// The parameter block of a call over cos/sin tables of `table_rows` rows from `rows`: in
/// place the outputs are the inputs with their strides; out of place they are contiguous.
pub(crate) fn params(
    args: &RopeArgs,
    sizes: &RopeSizes,
    io: &Io,
    (table_rows, rows): (usize, TableRows),
) -> Params {
    let (q_out, k_out) = io.out.unwrap_or((io.q, io.k));
    let (q_stride, k_stride) = (args.q_token_stride() as u64, args.k_token_stride() as u64);
    let (q_out_stride, k_out_stride) = match io.out {
        None => (q_stride, k_stride),
        Some(_) => (sizes.q_rows.row as u64, sizes.k_rows.row as u64),
    };
    Params {
        q: io.q,
        k: io.k,
        q_out,
        k_out,
        cos: io.cos,
        sin: io.sin,
        ids: io.ids,
        tokens: sizes.tokens as u64,
        seq_len: args.seq_len as u64,
        q_heads: args.q_heads as u64,
        k_heads: args.k_heads as u64,
        head_dim: args.head_dim as u64,
        rotary_dim: args.rotary_dim as u64,
        table_rows: table_rows as u64,
        q_stride,
        k_stride,
        q_out_stride,
        k_out_stride,
        sections: sections(rows),
        form: general_form(args, io.out.is_some()).0,
        pad: 0,
    }
}

/// [`Params::sections`]: the first pair of the h table and of the w table (0 for the other
/// layouts; both < 2³¹ once checked).
pub(crate) fn sections(rows: TableRows) -> [u32; 2] {
    match rows {
        TableRows::Multimodal([t, h, _]) | TableRows::MultimodalGathered([t, h, _]) => {
            [t as u32, (t + h) as u32]
        }
        _ => [0, 0],
    }
}

/// One launch of `func` (the plan's kernel) with `p` on `stream`.
///
/// # Safety
/// `p` names buffers that the call's checks validated: q and k hold their span,
/// `(tokens − 1)·stride + heads × head_dim` elements (k absent, 0 and unused, when
/// `k_heads = 0`), their outputs exactly `tokens × heads × head_dim`, every output its input
/// (in place, with its stride) or disjoint from every other buffer, q and k rows disjoint;
/// cos/sin hold every row the variant selects (`seq_len` rows per position, `tokens` per
/// batch, `table_rows` gathered, whose ids the kernel clamps, 3 × `tokens` multimodal, whose
/// sections sum to rotary_dim / 2) in rows of the width `form` tells, and the ids buffer
/// holds `tokens` ids of the variant's type (3 × `tokens` multimodal); all alive and ordered on
/// `stream` until the launch completes. `plan` is [`super::plan::plan`]'s for `p`: the scalar
/// and `_v_` kernels only on contiguous NeoX halves with full-width rows and no multimodal
/// tables, the vector kernels only where their alignment and divisibility hold, with
/// `blockDim.x = half / lanes`.
pub(crate) unsafe fn run(
    stream: &CudaStream,
    func: &CudaFunction,
    plan: &Plan,
    p: &Params,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (plan.grid, 1, 1),
        block_dim: plan.block,
        shared_mem_bytes: 0,
    };
    // SAFETY: every RoPE entry takes one `Params` by value (the plan tests tie each entry's
    // parameter to its size); the caller vouches for the buffers.
    unsafe { launch_ex(stream, func, cfg, &mut [arg(p)], Launch::Plain) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_the_first_pairs_of_the_h_and_w_tables() {
        assert_eq!(sections(TableRows::Multimodal([16, 24, 24])), [16, 40]);
        assert_eq!(sections(TableRows::MultimodalGathered([1, 2, 1])), [1, 3]);
        assert_eq!(sections(TableRows::PerBatch), [0, 0]);
    }
}
