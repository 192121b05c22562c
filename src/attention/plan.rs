//! Which kernels an attention call runs, on which grids: a pure function of the arguments,
//! the element type and the buffers' alignment, unit-tested without a GPU.
use super::abi::{
    SIMT_ROWS, THREADS, dkdv_keys, dkdv_shared_bytes, dkdv_shared_bytes_sm90, dkdv_threads,
    dq_rows, dq_shared_bytes, dq_shared_bytes_sm90, dq_threads, fwd_rows, fwd_shared_bytes,
    fwd_shared_bytes_sm90, warpgroups,
};
use super::args::AttentionArgs;
use crate::identity::{AttnPass, AttnPath, ElemType, Kernel};

/// One kernel launch of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    /// The kernel.
    pub(crate) kernel: Kernel,
    /// Blocks along x (row blocks), y (heads), z (sequences); x may be 0 (nothing to do).
    pub(crate) grid: (u32, u32, u32),
    /// Threads per block.
    pub(crate) threads: u32,
    /// Dynamic shared memory per block, in bytes.
    pub(crate) shared: u32,
}

/// The tensor-core path at this head_dim, if there is one.
fn mma_path(head_dim: usize) -> Option<AttnPath> {
    match head_dim {
        64 => Some(AttnPath::Mma64),
        128 => Some(AttnPath::Mma128),
        _ => None,
    }
}

/// The path of a call: tensor cores for 16-bit elements at head_dim 64 or 128 when every
/// buffer starts 16-byte aligned and every stride is a whole number of 16-byte chunks (what
/// `cp.async` copies), otherwise SIMT.
pub(crate) fn path(
    args: &AttentionArgs,
    elem: ElemType,
    ptrs: &[u64],
    strides: &[usize],
) -> AttnPath {
    let aligned = ptrs.iter().all(|p| p.is_multiple_of(16))
        // Wrapping: a stride only one row ever takes may be any size; 16 divides 2⁶⁴.
        && strides.iter().all(|s| s.wrapping_mul(elem.size()).is_multiple_of(16));
    match (elem, mma_path(args.head_dim)) {
        (ElemType::F16 | ElemType::Bf16, Some(path)) if aligned => path,
        _ => AttnPath::Simt,
    }
}

/// The rows along a grid's x dimension: blocks of `per_block` rows over `rows` rows.
fn blocks(rows: usize, per_block: u32) -> u32 {
    rows.div_ceil(per_block as usize) as u32
}

fn shared(path: AttnPath, f: fn(u32) -> u32) -> u32 {
    match path {
        AttnPath::Simt => 0,
        AttnPath::Mma64 => f(64),
        AttnPath::Mma128 => f(128),
    }
}

/// The forward: one launch over blocks of query rows of every head of every sequence. `sm90`:
/// the sm_90a build's kernels are in use (two warpgroups per block and longer key tiles, so
/// more shared memory).
pub(crate) fn forward(args: &AttentionArgs, elem: ElemType, path: AttnPath, sm90: bool) -> Step {
    let (rows, threads) = if path == AttnPath::Simt {
        (SIMT_ROWS, THREADS)
    } else {
        (
            fwd_rows(sm90, args.head_dim as u32),
            THREADS * warpgroups(sm90, args.head_dim as u32),
        )
    };
    Step {
        kernel: Kernel::Attention {
            pass: AttnPass::Forward,
            path,
            elem,
        },
        grid: (
            blocks(args.seqlen_q, rows),
            args.heads_q as u32,
            args.batch as u32,
        ),
        threads,
        shared: shared(
            path,
            [fwd_shared_bytes, fwd_shared_bytes_sm90][sm90 as usize],
        ),
    }
}

/// The backward: the preprocessing (`Σ dO·O` per query row), then dQ over blocks of query
/// rows and dK/dV over blocks of key rows (each over its group's query heads). `sm90`: the
/// sm_90a build's kernels are in use, whose tensor-core dQ and dK/dV kernels (`wgmma`; dQ
/// with one warpgroup, dK/dV with two at head_dim 128) take other tiles, so other shared
/// memory, than the sm_80 build's (`mma.sync`; dK/dV with eight warps).
pub(crate) fn backward(
    args: &AttentionArgs,
    elem: ElemType,
    path: AttnPath,
    sm90: bool,
) -> [Step; 3] {
    let d = args.head_dim as u32;
    let ((rows, dq_block), (keys, dkdv_block)) = if path == AttnPath::Simt {
        ((SIMT_ROWS, THREADS), (SIMT_ROWS, THREADS))
    } else {
        (
            (dq_rows(sm90, d), dq_threads(sm90, d)),
            (dkdv_keys(sm90, d), dkdv_threads(sm90, d)),
        )
    };
    let kernel = |pass, path| Kernel::Attention { pass, path, elem };
    let (hq, hkv, b) = (args.heads_q as u32, args.heads_kv as u32, args.batch as u32);
    [
        Step {
            kernel: kernel(AttnPass::Prep, AttnPath::Simt),
            grid: (blocks(args.seqlen_q, SIMT_ROWS), hq, b),
            threads: THREADS,
            shared: 0,
        },
        Step {
            kernel: kernel(AttnPass::Dq, path),
            grid: (blocks(args.seqlen_q, rows), hq, b),
            threads: dq_block,
            shared: shared(path, [dq_shared_bytes, dq_shared_bytes_sm90][sm90 as usize]),
        },
        Step {
            kernel: kernel(AttnPass::DkDv, path),
            grid: (blocks(args.seqlen_k, keys), hkv, b),
            threads: dkdv_block,
            shared: shared(
                path,
                [dkdv_shared_bytes, dkdv_shared_bytes_sm90][sm90 as usize],
            ),
        },
    ]
}

/// [`forward`] on a device whose blocks may opt in to `max_shared` bytes of shared memory: a
/// tensor-core kernel that needs more runs on the CUDA-core kernel instead.
pub(crate) fn forward_within(
    args: &AttentionArgs,
    elem: ElemType,
    path: AttnPath,
    sm90: bool,
    max_shared: u32,
) -> Step {
    let step = forward(args, elem, path, sm90);
    match step.shared <= max_shared {
        true => step,
        false => forward(args, elem, AttnPath::Simt, sm90),
    }
}

/// [`backward`] on a device whose blocks may opt in to `max_shared` bytes of shared memory,
/// each pass on its own: the sm_80 build's tensor-core dK/dV at head_dim 128 takes 194 KiB,
/// more than an A100 gives a block (163 KiB) or an sm_86/89/120 GPU (99 KiB), so there it runs
/// on the CUDA-core kernel while dQ keeps the tensor cores.
pub(crate) fn backward_within(
    args: &AttentionArgs,
    elem: ElemType,
    path: AttnPath,
    sm90: bool,
    max_shared: u32,
) -> [Step; 3] {
    let steps = backward(args, elem, path, sm90);
    let simt = backward(args, elem, AttnPath::Simt, sm90);
    std::array::from_fn(|i| match steps[i].shared <= max_shared {
        true => steps[i],
        false => simt[i],
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every kernel a call can plan: each pass on each path the element type takes.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let mut v = Vec::new();
        for elem in ElemType::ALL.iter().copied() {
            for d in [64, 128, 8] {
                let args = AttentionArgs::new(1, 1, 1, 1, 1, d);
                let path = path(&args, elem, &[0], &[d]);
                v.push(forward(&args, elem, path, false).kernel);
                v.extend(backward(&args, elem, path, false).map(|s| s.kernel));
            }
        }
        v.sort_by_key(|k| k.name());
        v.dedup();
        v
    }

    #[test]
    fn each_entry_takes_one_parameter_block_of_the_hosts_size() {
        crate::module::tests::assert_one_param_block(
            &launchable_kernels(),
            size_of::<super::super::abi::Params>(),
        );
    }

    #[test]
    fn tensor_cores_take_aligned_16_bit_heads_of_64_and_128() {
        let a = AttentionArgs::new(1, 8, 8, 2, 1, 128);
        assert_eq!(
            path(&a, ElemType::Bf16, &[0, 256], &[256, 128]),
            AttnPath::Mma128
        );
        assert_eq!(
            path(&a, ElemType::F16, &[0, 256], &[256, 128]),
            AttnPath::Mma128
        );
        assert_eq!(
            path(&a, ElemType::F32, &[0, 256], &[256, 128]),
            AttnPath::Simt
        );
        // A pointer or a stride off the 16-byte grid.
        assert_eq!(
            path(&a, ElemType::Bf16, &[2, 256], &[256, 128]),
            AttnPath::Simt
        );
        assert_eq!(
            path(&a, ElemType::Bf16, &[0, 256], &[260, 128]),
            AttnPath::Simt
        );
        let a = AttentionArgs::new(1, 8, 8, 2, 1, 64);
        assert_eq!(path(&a, ElemType::Bf16, &[0], &[64]), AttnPath::Mma64);
        for d in [8, 32, 96, 100, 256] {
            let a = AttentionArgs::new(1, 8, 8, 2, 1, d);
            assert_eq!(
                path(&a, ElemType::Bf16, &[0], &[256]),
                AttnPath::Simt,
                "{d}"
            );
        }
    }

    #[test]
    fn grids_cover_every_row_block_head_and_sequence() {
        let a = AttentionArgs::new(4, 2049, 100, 16, 4, 128);
        let f = forward(&a, ElemType::Bf16, AttnPath::Mma128, false);
        assert_eq!(f.grid, (33, 16, 4));
        assert_eq!(f.shared, 49 * 1024);
        // The `wgmma` forward's K and V tiles of 128 keys at head_dim 128, of 64 at 64.
        // Two warpgroups of 64 query rows each share them, in two stages (one block per SM).
        let f90 = forward(&a, ElemType::Bf16, AttnPath::Mma128, true);
        assert_eq!(
            (f90.grid, f90.threads, f90.shared),
            ((17, 16, 4), 256, 161 * 1024)
        );
        assert_eq!(f.threads, 128);
        let a64 = AttentionArgs::new(4, 2049, 100, 16, 4, 64);
        let shared64 = |sm90| forward(&a64, ElemType::Bf16, AttnPath::Mma64, sm90).shared;
        assert_eq!((shared64(false), shared64(true)), (25 * 1024, 25 * 1024));
        // At head_dim 64 one warpgroup of 64 rows in both builds.
        let f64 = forward(&a64, ElemType::Bf16, AttnPath::Mma64, true);
        assert_eq!((f64.grid, f64.threads), ((33, 16, 4), 128));
        let s = forward(&a, ElemType::F32, AttnPath::Simt, true);
        assert_eq!((s.grid, s.shared), ((513, 16, 4), 0));
        for sm90 in [false, true] {
            let [pre, dq, dkdv] = backward(&a, ElemType::Bf16, AttnPath::Mma128, sm90);
            assert_eq!(pre.grid, (513, 16, 4));
            // dQ over blocks of 128 query rows (two warpgroups) in the sm_90a build at
            // head_dim 128, of 64 in the sm_80 one.
            assert_eq!(dq.grid, (if sm90 { 17 } else { 33 }, 16, 4));
            // Key blocks per key/value head: of 128 keys (two warpgroups) in the sm_90a
            // build at head_dim 128, of 64 (eight warps) in the sm_80 one.
            assert_eq!(dkdv.grid, (if sm90 { 1 } else { 2 }, 4, 4));
            assert!(dkdv.shared > 48 * 1024 && dkdv.shared <= 227 * 1024);
            let dkdv_threads = 256;
            let dq_threads = if sm90 { 256 } else { 128 };
            assert_eq!(
                (pre.threads, dq.threads, dkdv.threads),
                (128, dq_threads, dkdv_threads)
            );
            // No query rows: the forward and dQ have nothing to launch, dK/dV still zero the
            // keys.
            let a = AttentionArgs::new(2, 0, 5, 2, 2, 64);
            let [pre, dq, dkdv] = backward(&a, ElemType::F16, AttnPath::Mma64, sm90);
            assert_eq!((pre.grid.0, dq.grid.0, dkdv.grid.0), (0, 0, 1));
        }
        // The `wgmma` dQ kernel: each warpgroup's Q and dO and three stages of 64-key K and V
        // tiles (one block of two warpgroups per SM at head_dim 128); the `mma.sync` one takes
        // 32-key tiles at 128.
        let dq = |d, sm90| {
            backward(
                &AttentionArgs::new(1, 8, 8, 1, 1, d),
                ElemType::Bf16,
                mma_path(d).unwrap(),
                sm90,
            )[1]
            .shared
        };
        assert_eq!((dq(128, true), dq(64, true)), (161 * 1024, 65 * 1024));
        assert_eq!((dq(128, false), dq(64, false)), (64 * 1024, 48 * 1024));
        // The `wgmma` dK/dV kernel: each warpgroup's K and V and three stages of Q and dO
        // tiles with their statistics, one block of two warpgroups per SM at head_dim 128.
        let dkdv = |d| {
            backward(
                &AttentionArgs::new(1, 8, 8, 1, 1, d),
                ElemType::Bf16,
                mma_path(d).unwrap(),
                true,
            )[2]
            .shared
        };
        assert_eq!((dkdv(128), dkdv(64)), (164 * 1024, 68 * 1024));
    }

    /// A tensor-core step that needs more shared memory than the device gives a block runs
    /// on the CUDA-core kernel and the other steps keep theirs: the sm_80 build's dK/dV at
    /// head_dim 128 on an A100 (163 KiB) and on an sm_86/89/120 GPU (99 KiB), and at 64 on
    /// the latter; the forward (49 KiB at 128) and dQ (64 KiB) fit both.
    #[test]
    fn steps_beyond_the_devices_shared_memory_run_on_cuda_cores() {
        let path_of = |s: Step| match s.kernel {
            Kernel::Attention { path, .. } => path,
            other => unreachable!("{other:?}"),
        };
        let (s, e) = (AttnPath::Simt, ElemType::Bf16);
        for (d, t) in [(128, AttnPath::Mma128), (64, AttnPath::Mma64)] {
            let a = AttentionArgs::new(2, 300, 300, 8, 2, d);
            for kib in [227, 163, 99] {
                let max = kib * 1024;
                let got = backward_within(&a, e, t, false, max).map(path_of);
                let dkdv = match backward(&a, e, t, false)[2].shared <= max {
                    true => t,
                    false => s,
                };
                assert_eq!(got, [s, t, dkdv], "head_dim {d}, {kib} KiB");
                assert_eq!(
                    (dkdv == s),
                    (d == 128 && kib < 227) || (d == 64 && kib == 99),
                    "head_dim {d}, {kib} KiB"
                );
                assert_eq!(path_of(forward_within(&a, e, t, false, max)), t);
                assert!(
                    backward_within(&a, e, t, false, max)
                        .iter()
                        .all(|x| x.shared <= max)
                );
            }
        }
        // A device that gives too little for the forward too.
        let a = AttentionArgs::new(1, 8, 8, 1, 1, 128);
        let f = forward_within(&a, e, AttnPath::Mma128, false, 48 * 1024);
        assert_eq!((path_of(f), f.shared), (s, 0));
    }
}
