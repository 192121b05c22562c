//! Which kernel a RoPE call runs, on which block and grid: a pure function of the arguments, the
//! element type, the parameter block (its pointers' alignment) and the device's resident blocks,
//! unit-tested without a GPU.
use super::abi::{Params, form, vec_heads};
use super::args::{RopeArgs, RopeSizes};
use super::layout::TableRows;
use crate::error::Result;
use crate::identity::{ElemType, Kernel, Pass, RopePath, RopeTable, Rows as Source};
use crate::launch::item_grid;

/// Threads per block of the scalar kernels: one block covers `BLOCK_THREADS / pairs` tokens when a token has fewer
/// pairs than this, else one token in `⌈pairs / BLOCK_THREADS⌉` passes.
const BLOCK_THREADS: usize = 256;

/// `(tx, ty)`: threads per token and tokens per block (see `BLOCK_THREADS`).
fn block_shape(pairs: usize) -> (u32, u32) {
    if pairs <= BLOCK_THREADS {
        (pairs as u32, (BLOCK_THREADS / pairs) as u32)
    } else {
        let passes = pairs.div_ceil(BLOCK_THREADS);
        (pairs.div_ceil(passes).next_multiple_of(32) as u32, 1)
    }
}

/// The path of a call of elements of `elem_bytes` with cos/sin rows from `rows`: the general
/// kernels (`rope_{dir}_g_*`) out of place (`out_of_place`) or head-major; else the vector
/// kernels where they apply (`rope_{dir}_v_*` for contiguous NeoX halves with full-width rows
/// and no multimodal tables, `_va_` for other NeoX calls, `_vi_` for interleaved pairs;
/// multimodal tables only with contiguous NeoX halves and full-width rows); else the scalar
/// kernels for contiguous NeoX calls without multimodal tables, and the general kernels for
/// the rest. f32 tables with 16-bit q and k (`f32_tables`) have no scalar kernels: those calls
/// take the general ones.
///
/// The vector kernels need 16-byte aligned `q`, `k`, `cos`, `sin` (`ptrs`); `head_dim`,
/// `half = rotary_dim / 2`, both token strides and both multimodal section starts multiples of
/// the lanes per vector (so each half of each head, each cos/sin row and each section is whole
/// aligned vectors; the dims past `rotary_dim` are then never touched, as in the scalar
/// kernels); at most `BLOCK_THREADS` vectors per half (one thread each); and a token's
/// `(q_heads + k_heads) × head_dim` below 2^31 (32-bit offsets within a token).
fn path(
    args: &RopeArgs,
    out_of_place: bool,
    rows: TableRows,
    (elem_bytes, f32_tables): (usize, bool),
    ptrs: [u64; 4],
) -> RopePath {
    if out_of_place || args.head_major {
        return RopePath::General;
    }
    let lanes = 16 / elem_bytes;
    let half = args.rotary_dim / 2;
    let token_elems = (args.q_heads.checked_add(args.k_heads))
        .and_then(|h| h.checked_mul(args.head_dim))
        .unwrap_or(usize::MAX);
    let (starts, multimodal) = match rows {
        TableRows::Multimodal([t, h, _]) | TableRows::MultimodalGathered([t, h, _]) => {
            ([t, t + h], true)
        }
        _ => ([0, 0], false),
    };
    let whole = [
        args.head_dim,
        half,
        args.q_token_stride(),
        args.k_token_stride(),
        starts[0],
        starts[1],
    ];
    // Multimodal tables on the vector kernels: contiguous NeoX halves with full-width rows
    // (Qwen2-VL's case), the combination the GPU tests run there.
    let vector = ptrs.iter().all(|p| p.is_multiple_of(16))
        && (!multimodal || args.neox_in_place())
        && whole.iter().all(|n| n.is_multiple_of(lanes))
        && half / lanes <= BLOCK_THREADS
        && token_elems < 1 << 31;
    let common = args.neox_in_place() && !multimodal;
    match (vector, args.interleaved, common) {
        (true, true, _) => RopePath::VectorInterleaved,
        (true, false, true) => RopePath::Vector,
        (true, false, false) => RopePath::VectorAny,
        (false, _, true) if !f32_tables => RopePath::Scalar,
        (false, _, _) => RopePath::General,
    }
}

/// `(bx, by, bz)` block of a vector kernel: `bx` = vectors per half (one per thread), `by` =
/// head lanes (each thread rotates heads `y, y + by, …`, `vec_heads` per step: `by` is
/// `⌈heads / vec_heads⌉` so one step covers the token, capped at `BLOCK_THREADS` threads per
/// token), `bz` = tokens per block (≤ `tokens`, ≤ 64), chosen up to `BLOCK_THREADS` threads to
/// waste the smallest fraction of the block's lanes, the most tokens among equals (small
/// blocks would hit the per-SM block limit before the thread limit).
fn vector_block(vph: usize, heads: usize, tokens: usize, vec_heads: usize) -> (u32, u32, u32) {
    let bx = vph.clamp(1, BLOCK_THREADS);
    let by = heads
        .div_ceil(vec_heads)
        .clamp(1, (BLOCK_THREADS / bx).max(1));
    let per_token = bx * by;
    let max_bz = (BLOCK_THREADS / per_token).clamp(1, 64).min(tokens.max(1));
    // Fraction of idle lanes: (padded − used) / padded, compared without division.
    let waste = |bz: usize| {
        let used = per_token * bz;
        let padded = used.next_multiple_of(32);
        ((padded - used) as u64, padded as u64)
    };
    let bz = (1..=max_bz)
        .min_by(|&a, &b| {
            let ((wa, pa), (wb, pb)) = (waste(a), waste(b));
            (wa * pb).cmp(&(wb * pa)).then(b.cmp(&a))
        })
        .unwrap_or(1);
    (bx as u32, by as u32, bz as u32)
}

/// The form bits of a general-kernel call, and the work items of one token: each head's
/// pairs, and out of place its tail dims past `rotary_dim`, which the kernel copies.
pub(crate) fn general_form(args: &RopeArgs, out_of_place: bool) -> (u32, usize) {
    let tail = if out_of_place {
        args.head_dim - args.rotary_dim
    } else {
        0
    };
    let bits = [
        (args.interleaved, form::INTERLEAVED),
        (args.head_major, form::HEAD_MAJOR),
        (args.half_tables, form::HALF_TABLES),
        (tail > 0, form::COPY_TAIL),
    ];
    let flags = bits
        .iter()
        .filter(|(on, _)| *on)
        .fold(0, |f, (_, bit)| f | bit);
    let items = (args.q_heads + args.k_heads) * (args.rotary_dim / 2 + tail);
    (flags, items)
}

/// One launch: the kernel, its blocks and its block shape (no shared memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) kernel: Kernel,
    pub(crate) grid: u32,
    pub(crate) block: (u32, u32, u32),
}

/// The launch of `pass` on `p` (`sizes.tokens > 0`) for q and k of `elem` and tables of
/// `table_elem`, cos/sin rows from `rows` (`source` their kernel variant); `out_of_place`: the
/// outputs are not the inputs. `resident(kernel,
/// threads)`: the resident blocks of the vector `kernel` at `threads` per block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan(
    args: &RopeArgs,
    pass: Pass,
    (elem, table_elem): (ElemType, ElemType),
    sizes: &RopeSizes,
    (rows, source): (TableRows, Source),
    out_of_place: bool,
    p: &Params,
    resident: impl FnOnce(Kernel, u32) -> Result<usize>,
) -> Result<Plan> {
    let elem_bytes = elem.size();
    let table = if table_elem == elem {
        RopeTable::Elem
    } else {
        RopeTable::F32
    };
    let path = path(
        args,
        out_of_place,
        rows,
        (elem_bytes, table == RopeTable::F32),
        [p.q, p.k, p.cos, p.sin],
    );
    let kernel = Kernel::Rope {
        pass,
        path,
        elem,
        rows: source,
        table,
    };
    let vector = matches!(
        path,
        RopePath::Vector | RopePath::VectorAny | RopePath::VectorInterleaved
    );
    if vector {
        let lanes = 16 / elem_bytes;
        let heads = args.q_heads + args.k_heads;
        let (bx, by, bz) = vector_block(
            args.rotary_dim / 2 / lanes,
            heads,
            sizes.tokens,
            vec_heads(lanes),
        );
        // Grid-stride over tokens: as many blocks as are resident at once, at most one per
        // `bz` tokens; with many waves of token steps, one block per step (`item_grid`: the
        // kernel holds nothing for its next step, so it is its own twin).
        let resident = resident(kernel, bx * by * bz)?;
        let steps = sizes.tokens.div_ceil(bz as usize);
        let (_, grid) = item_grid(steps, resident, true);
        return Ok(Plan {
            kernel,
            grid,
            block: (bx, by, bz),
        });
    }
    let items = match path {
        RopePath::General => general_form(args, out_of_place).1,
        _ => sizes.pairs,
    };
    let (tx, ty) = block_shape(items);
    let grid = sizes.tokens.div_ceil(ty as usize).min(i32::MAX as usize) as u32;
    Ok(Plan {
        kernel,
        grid,
        block: (tx, ty, 1),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::identity::Rows;

    #[test]
    fn each_entry_takes_one_parameter_block_of_the_hosts_size() {
        crate::module::tests::assert_one_param_block(&launchable_kernels(), size_of::<Params>());
    }

    /// Every kernel the launchers can ask for: each path takes each element type, pass
    /// and cos/sin row source, but multimodal rows only the `_va_` and general paths; f32
    /// tables with 16-bit q and k every path but the scalar one.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let mut out = Vec::new();
        let tables = [
            (ElemType::F32, RopeTable::Elem),
            (ElemType::F16, RopeTable::Elem),
            (ElemType::Bf16, RopeTable::Elem),
            (ElemType::F16, RopeTable::F32),
            (ElemType::Bf16, RopeTable::F32),
        ];
        for &pass in Pass::ALL {
            for &path in RopePath::ALL {
                for (elem, table) in tables {
                    if table == RopeTable::F32 && path == RopePath::Scalar {
                        continue;
                    }
                    for &rows in Rows::ALL {
                        let multimodal = [
                            Rows::Multimodal,
                            Rows::MultimodalIdsI32,
                            Rows::MultimodalIdsI64,
                        ];
                        let neox_only = [RopePath::Scalar, RopePath::Vector];
                        let not_multimodal = [RopePath::VectorInterleaved];
                        if multimodal.contains(&rows)
                            && (neox_only.contains(&path) || not_multimodal.contains(&path))
                        {
                            continue;
                        }
                        out.push(Kernel::Rope {
                            pass,
                            path,
                            elem,
                            rows,
                            table,
                        });
                    }
                }
            }
        }
        out
    }

    #[test]
    fn kernel_names_are_their_parts() {
        let kernel = |path, rows| Kernel::Rope {
            pass: Pass::Backward,
            path,
            elem: ElemType::F16,
            rows,
            table: RopeTable::Elem,
        };
        assert_eq!(
            kernel(RopePath::General, Rows::IdsI32).name(),
            "rope_bwd_g_f16_ids32"
        );
        assert_eq!(
            kernel(RopePath::Vector, Rows::PerPosition).name(),
            "rope_bwd_v_f16_pos"
        );
        assert_eq!(
            kernel(RopePath::Scalar, Rows::PerBatch).name(),
            "rope_bwd_f16_batch"
        );
        let f32_tables = Kernel::Rope {
            pass: Pass::Backward,
            path: RopePath::VectorAny,
            elem: ElemType::F16,
            rows: Rows::MultimodalIdsI64,
            table: RopeTable::F32,
        };
        assert_eq!(f32_tables.name(), "rope_bwd_va_f16_mrope_ids64_t32");
    }

    #[test]
    fn block_shape_covers_every_pair_within_256_threads() {
        for pairs in 1..3000 {
            let (tx, ty) = block_shape(pairs);
            assert!(tx * ty <= BLOCK_THREADS as u32 && ty >= 1, "{pairs}");
            let passes = pairs.div_ceil(tx as usize);
            assert_eq!(passes, pairs.div_ceil(BLOCK_THREADS), "{pairs}: {tx}×{ty}");
            if pairs > BLOCK_THREADS {
                assert!(tx.is_multiple_of(32) && ty == 1, "{pairs}");
            }
        }
        assert_eq!(block_shape(2560), (256, 1));
        assert_eq!(block_shape(300), (160, 1));
        assert_eq!(block_shape(2), (2, 128));
    }

    #[test]
    fn path_is_general_out_of_place_or_head_major_and_vector_on_whole_aligned_vectors() {
        let a = |d: usize, r: usize| {
            RopeArgs::new(d)
                .with_batch(2)
                .with_seq_len(3)
                .with_heads(32, 8)
                .with_rotary_dim(r)
        };
        let pos = TableRows::PerPosition;
        let in_place = |args: &RopeArgs, bytes: usize, ptrs: [u64; 4]| {
            path(args, false, pos, (bytes, false), ptrs)
        };
        let aligned = [0x1000u64, 0x2000, 0x3000, 0x4000];
        // (d, r, bytes per element) → the path in place.
        let (v, s) = (RopePath::Vector, RopePath::Scalar);
        let (va, vi, g) = (
            RopePath::VectorAny,
            RopePath::VectorInterleaved,
            RopePath::General,
        );
        let cases = [
            ((128, 128, 2), v),
            ((128, 128, 4), v),
            ((64, 64, 2), v),
            ((256, 256, 2), v),
            ((96, 96, 2), v),  // half 48 = 6 vectors
            ((80, 80, 2), v),  // half 40 = 5 vectors
            ((80, 80, 4), v),  // half 40 = 10 vectors
            ((128, 64, 2), v), // partial rotary, half 32
            ((80, 32, 2), v),  // partial rotary, half 16
            ((8, 8, 4), v),    // half 4 = 1 vector
            ((92, 92, 2), s),  // head_dim·2 = 184 not a multiple of 16
            ((92, 92, 4), s),  // half 46 not a multiple of 4
            ((128, 40, 2), s), // partial rotary, half 20 not a multiple of 8
            ((80, 60, 4), s),  // partial rotary, half 30 not a multiple of 4
            ((8, 8, 2), s),    // half 4 < 8 lanes
            ((6, 6, 4), s),
            ((16, 2, 2), s),
        ];
        for ((d, r, bytes), want) in cases {
            assert_eq!(
                in_place(&a(d, r), bytes, aligned),
                want,
                "d={d} r={r} {bytes}B"
            );
            // Interleaved pairs or half-width tables: the same rule, on the vector kernels of
            // any form or the general ones.
            let (iv, ig) = (a(d, r).with_interleaved(), a(d, r).with_half_tables());
            let want_i = if want == v { vi } else { g };
            assert_eq!(
                in_place(&iv, bytes, aligned),
                want_i,
                "d={d} r={r} {bytes}B"
            );
            let want_h = if want == v { va } else { g };
            assert_eq!(
                in_place(&ig, bytes, aligned),
                want_h,
                "d={d} r={r} {bytes}B"
            );
        }
        // Any misaligned pointer (a view at an odd offset) leaves the vector paths.
        for i in 0..4 {
            let mut p = aligned;
            p[i] += 2;
            assert_eq!(in_place(&a(128, 128), 2, p), s, "pointer {i}");
            assert_eq!(in_place(&a(128, 128).with_interleaved(), 2, p), g);
            p[i] += 6; // 8-byte aligned: still not 16
            assert_eq!(in_place(&a(128, 128), 2, p), s, "pointer {i}");
        }
        // f32 tables with 16-bit q and k: the vector paths of the q/k vectors (a table row of
        // whole q/k vectors is whole f32 vectors); the calls of the scalar path go general.
        let f32_tables = |args: &RopeArgs, ptrs| path(args, false, pos, (2, true), ptrs);
        assert_eq!(f32_tables(&a(128, 128), aligned), v);
        assert_eq!(f32_tables(&a(128, 128).with_interleaved(), aligned), vi);
        assert_eq!(f32_tables(&a(128, 128).with_half_tables(), aligned), va);
        assert_eq!(f32_tables(&a(92, 92), aligned), g);
        assert_eq!(
            f32_tables(&a(128, 128), [0x1002, 0x2000, 0x3000, 0x4000]),
            g
        );
        // More than BLOCK_THREADS vectors in a half, or 2^31 elements per token: scalar.
        let wide = RopeArgs::new(4096);
        assert_eq!(in_place(&wide, 2, aligned), v); // 256 vectors per half
        assert_eq!(in_place(&wide, 4, aligned), s); // 512
        let many = RopeArgs::new(64).with_heads(1 << 24, 1 << 24);
        assert_eq!(in_place(&many, 2, aligned), s);
        // Out of place, or head-major, is the general path whatever the alignment.
        assert_eq!(path(&a(128, 128), true, pos, (2, false), aligned), g);
        assert_eq!(in_place(&a(128, 128).with_head_major(), 2, aligned), g);
        // Token rows apart from each other (views into a fused QKV buffer) keep the vector
        // path when the strides are whole vectors; else the general path.
        let fused = (32 + 2 * 8) * 128;
        assert_eq!(
            in_place(&a(128, 128).with_strides(fused, fused), 2, aligned),
            va
        );
        let odd = a(128, 128).with_strides(fused + 4, fused);
        assert_eq!(in_place(&odd, 2, aligned), g);
        assert_eq!(in_place(&odd, 4, aligned), va); // 4 f32 lanes
        assert_eq!(
            in_place(&a(128, 128).with_strides(32 * 128, 8 * 128), 2, aligned),
            v
        );
        // Multimodal tables: vector where both section starts are whole vectors, else general
        // (never scalar).
        let mm = |t, h, w| TableRows::Multimodal([t, h, w]);
        let gathered = TableRows::MultimodalGathered([16, 24, 24]);
        assert_eq!(
            path(&a(128, 128), false, mm(16, 24, 24), (2, false), aligned),
            va
        );
        assert_eq!(path(&a(128, 128), false, gathered, (2, false), aligned), va);
        assert_eq!(
            path(&a(128, 128), false, mm(20, 24, 20), (2, false), aligned),
            g
        );
        assert_eq!(
            path(&a(128, 128), false, mm(20, 24, 20), (4, false), aligned),
            va
        );
        assert_eq!(
            path(&a(128, 128), false, mm(24, 20, 20), (2, false), aligned),
            g
        );
        // Other forms with multimodal tables: general.
        for other in [
            a(128, 128).with_interleaved(),
            a(128, 128).with_half_tables(),
            a(128, 128).with_strides(fused, fused),
        ] {
            assert_eq!(path(&other, false, mm(16, 24, 24), (2, false), aligned), g);
        }
        let misaligned = [0x1002, 0x2000, 0x3000, 0x4000];
        assert_eq!(
            path(&a(128, 128), false, mm(16, 24, 24), (2, false), misaligned),
            g
        );
    }

    #[test]
    fn vector_block_covers_the_token_in_one_step_within_256_threads() {
        // The benchmark shape: 40 heads, d = 128 → 8 (16-bit, 2 heads per step) or 16 (f32, 4
        // heads per step) vectors per half.
        assert_eq!(vector_block(8, 40, 16384, vec_heads(8)), (8, 20, 1)); // 160 threads
        assert_eq!(vector_block(16, 40, 16384, vec_heads(4)), (16, 10, 1));
        // 15 threads per token: 17 tokens fill 255 of 8 warps' 256 lanes (the least waste);
        // with 4 tokens, 4 fill 60 of 64 (as good as 2 in 32, and more per block).
        assert_eq!(vector_block(5, 10, 100, 4), (5, 3, 17));
        assert_eq!(vector_block(5, 10, 4, 4), (5, 3, 4));
        // Tiny tokens (f32 d = 16, 1 + 1 heads): 64 tokens of 2 threads, not 16 of them.
        assert_eq!(vector_block(2, 2, 1 << 20, 4), (2, 1, 64));
        for vec_heads in [2, 4] {
            for vph in 1..=256 {
                for heads in [2, 3, 5, 10, 40, 41, 300, 1 << 20] {
                    for tokens in [1, 3, 1000] {
                        let (bx, by, bz) = vector_block(vph, heads, tokens, vec_heads);
                        let (bx, by, bz) = (bx as usize, by as usize, bz as usize);
                        assert_eq!(bx, vph);
                        assert!(bx * by * bz <= BLOCK_THREADS && by >= 1 && bz >= 1);
                        assert!(bz <= tokens && bz <= 64);
                        if heads.div_ceil(vec_heads) * vph <= BLOCK_THREADS {
                            assert!(by * vec_heads >= heads, "{vph} {heads}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn general_form_bits_and_items() {
        let a = RopeArgs::new(16)
            .with_batch(2)
            .with_seq_len(3)
            .with_heads(4, 2)
            .with_rotary_dim(8);
        // In place the tail is not touched; out of place each head copies its 8 tail dims.
        assert_eq!(general_form(&a, false), (0, 6 * 4));
        assert_eq!(general_form(&a, true), (form::COPY_TAIL, 6 * (4 + 8)));
        let all = a.with_interleaved().with_half_tables().with_head_major();
        let bits = form::INTERLEAVED | form::HEAD_MAJOR | form::HALF_TABLES;
        assert_eq!(general_form(&all, false).0, bits);
        let full = RopeArgs::new(16).with_head_major();
        assert_eq!(general_form(&full, true), (form::HEAD_MAJOR, 2 * 8));
        assert!(RopeArgs::new(8).neox_in_place());
        assert!(!full.neox_in_place());
    }
}
