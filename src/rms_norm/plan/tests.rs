//! The plan on an H200 and an A100, and every kernel the launchers can ask for.
use super::super::abi;
use super::*;
use crate::identity::ElemType;
use crate::identity::RmsNormLayout::Resident;
use half::{bf16, f16};

fn path<T: Dtype>(cols: usize, ptrs: &[u64], strides: &[usize], cap: usize) -> Path {
    let settings = row_settings(cols).unwrap();
    Path::choose::<T>(settings, cols, ptrs, strides, fwd_rule::<T>(), |_| Ok(cap)).unwrap()
}

#[test]
fn vector_path_needs_alignment_and_whole_vectors() {
    let vector = |per_thread, threads| Path::Vector {
        per_thread,
        threads,
    };
    assert_eq!(
        path::<bf16>(4096, &[256, 512], &[4096], 1024),
        vector(4, 128)
    );
    assert_eq!(path::<bf16>(2048, &[256], &[2048], 1024), vector(2, 128));
    assert_eq!(path::<bf16>(1024, &[256], &[1024], 1024), vector(1, 128));
    // f32: K = 2 up to 256 threads.
    assert_eq!(path::<f32>(1024, &[256], &[1024], 1024), vector(2, 128));
    assert_eq!(path::<f32>(2048, &[256], &[2048], 1024), vector(2, 256));
    // No K keeps its step's threads: the most vectors per thread.
    assert_eq!(path::<f32>(4096, &[256], &[4096], 1024), vector(4, 256));
    assert_eq!(path::<bf16>(16384, &[256], &[16384], 1024), vector(4, 512));
    assert_eq!(path::<f32>(100, &[256], &[100], 1024), vector(1, 32));
    // A kernel whose registers allow only 256 threads caps the choice.
    assert_eq!(path::<bf16>(11008, &[256], &[11008], 1024), vector(4, 352));
    // Misaligned pointer, odd stride, partial vector, too wide: the scalar kernels.
    let scalar = |cols| Path::Scalar {
        threads: row_settings(cols).unwrap().threads(),
    };
    assert_eq!(path::<bf16>(11008, &[256], &[11008], 256), scalar(11008));
    assert_eq!(path::<bf16>(4096, &[256, 2], &[4096], 1024), scalar(4096));
    assert_eq!(path::<bf16>(4096, &[256], &[4100], 1024), scalar(4096));
    assert_eq!(path::<bf16>(4097, &[256], &[4097], 1024), scalar(4097));
    assert_eq!(path::<bf16>(65536, &[256], &[65536], 1024), scalar(65536));
    // Wider than one pass: the scalar kernels with the widest block.
    assert_eq!(path::<f32>(65540, &[256], &[65540], 1024), scalar(65540));
    assert_eq!(scalar(1 << 20), Path::Scalar { threads: 1024 });
    // A stride no second row uses may be any size (one row).
    assert_eq!(
        path::<bf16>(4096, &[256], &[usize::MAX], 1024),
        scalar(4096)
    );
    assert_eq!(path::<f32>(2048, &[256], &[1 << 62], 1024), vector(2, 256));
}

#[test]
fn cols_must_be_positive_and_may_exceed_one_pass() {
    let err = RmsNormArgs::new(1, 0).check().unwrap_err();
    assert!(err.to_string().contains("args.cols"), "{err}");
    assert_eq!(RmsNormArgs::new(1, 65536).check().unwrap().threads(), 1024);
    assert_eq!(
        RmsNormArgs::new(1, 1 << 24).check().unwrap().threads(),
        1024
    );
}

/// Every kernel the launchers can ask for: each path of each rule at every block size,
/// its twins, in every mode, with and without a weight offset, the dX-only backward, and
/// the dW reductions.
pub(crate) fn launchable_kernels() -> Vec<Kernel> {
    fn of<T: Dtype>() -> Vec<Kernel> {
        let mut out = Vec::new();
        for mode in CastingMode::ALL {
            for offset in [0.0, 1.0] {
                let args = RmsNormArgs::new(1, 8).with_mode(mode).with_offset(offset);
                for (step, rule) in [
                    (forward_step(false), fwd_rule::<T>()),
                    (forward_step(true), fwd_rule::<T>()),
                    (backward_step(true, false), &BWD_RULE),
                    (backward_step(false, false), &BWD_RULE),
                    (backward_step(true, true), &BWD_RULE),
                    (backward_step(false, true), &BWD_RULE),
                ] {
                    let add = step.0 == NormInput::Add;
                    let scalar = Path::Scalar { threads: 32 };
                    out.push(scalar.kernel::<T>(step, &args));
                    for (per_thread, threads) in rule
                        .per_thread()
                        .flat_map(|k| (5..=10).map(move |t| (k, 1 << t)))
                    {
                        let path = Path::Vector {
                            per_thread,
                            threads,
                        };
                        out.push(path.kernel::<T>(step, &args));
                        match step.1 {
                            NormPass::Forward => out.extend(forward_twin::<T>(path, &args, add)),
                            pass => {
                                let dw = pass == NormPass::Backward;
                                let twin = shared_dw_kernel::<T>(path, &args, dw, add);
                                out.extend(twin.map(|k| k.0))
                            }
                        }
                    }
                }
            }
        }
        out.push(Kernel::RmsNormDwReduce { elem: T::ELEM });
        out
    }
    [of::<f32>(), of::<f16>(), of::<bf16>()].concat()
}

#[test]
fn each_entry_takes_one_parameter_block_of_the_hosts_size() {
    crate::module::tests::assert_one_param_block(&launchable_kernels(), size_of::<abi::Params>());
}

#[test]
pub(crate) fn kernel_names_are_their_parts() {
    let v = Path::Vector {
        per_thread: 2,
        threads: 256,
    };
    let gemma = RmsNormArgs::new(1, 8).with_mode(CastingMode::Gemma);
    let name = |k: Kernel| k.name();
    assert_eq!(
        name(v.kernel::<bf16>(forward_step(false), &gemma)),
        "rms_norm_fwd_v2_bf16_gemma"
    );
    let llama = RmsNormArgs::new(1, 8);
    assert_eq!(
        name(vector_kernel::<f16>(
            forward_step(false),
            RmsNormLayout::Whole,
            4,
            &llama
        )),
        "rms_norm_fwd_vw4_f16_llama"
    );
    let s = Path::Scalar { threads: 128 };
    let none = RmsNormArgs::new(1, 8).with_mode(CastingMode::None);
    assert_eq!(
        name(s.kernel::<f32>(backward_step(true, false), &none)),
        "rms_norm_bwd_f32_none"
    );
    assert_eq!(
        name(s.kernel::<f32>(backward_step(false, false), &none)),
        "rms_norm_bwd_dx_f32_none"
    );
    assert_eq!(
        name(v.kernel::<bf16>(backward_step(false, false), &gemma)),
        "rms_norm_bwd_dx_v2_bf16_gemma"
    );
    // The fused residual add's twins.
    assert_eq!(
        name(v.kernel::<bf16>(forward_step(true), &gemma)),
        "rms_norm_add_fwd_v2_bf16_gemma"
    );
    assert_eq!(
        name(s.kernel::<f32>(backward_step(true, true), &none)),
        "rms_norm_add_bwd_f32_none"
    );
    assert_eq!(
        name(v.kernel::<bf16>(backward_step(false, true), &gemma)),
        "rms_norm_add_bwd_dx_v2_bf16_gemma"
    );
    assert_eq!(
        name(Kernel::RmsNormDwReduce {
            elem: ElemType::Bf16
        }),
        "rms_norm_dw_reduce_bf16"
    );
    // 16-bit rows with a 1 + w weight: the lane-by-lane twins.
    let offset = llama.with_offset(1.0);
    assert_eq!(
        name(shared_dw_kernel::<bf16>(v, &offset, true, false).unwrap().0),
        "rms_norm_bwd_vs2_bf16_llama_offset"
    );
    assert_eq!(
        name(shared_dw_kernel::<bf16>(v, &offset, true, true).unwrap().0),
        "rms_norm_add_bwd_vs2_bf16_llama_offset"
    );
    // f32 rows of two vectors keep dW in registers: no `_vs2`.
    assert_eq!(shared_dw_kernel::<f32>(v, &offset, true, false), None);
    assert_eq!(shared_dw_kernel::<bf16>(v, &offset, false, false), None);
}

#[test]
fn cluster_grids_hold_whole_clusters_that_fit_at_once() {
    assert_eq!(DW_CLUSTER, 2);
    // H200, bf16 16384×2048 (`_vs2`, sm_90 build): 1188 blocks fit at once (9 per SM),
    // but only 528 clusters of two (a cluster's blocks share a GPC).
    assert_eq!(cluster_grid(1188, 528), (1056, 2));
    // An odd grid loses its last block where the clusters fit.
    assert_eq!(cluster_grid(1187, 594), (1186, 2));
    assert_eq!(cluster_grid(528, 264), (528, 2));
    // No whole cluster: the plain grid.
    assert_eq!(cluster_grid(1, 594), (1, 1));
    assert_eq!(cluster_grid(1188, 0), (1188, 1));
}

#[test]
fn frozen_weight_grid_holds_4_mib_of_rows_when_each_block_gets_32_rows() {
    let sms = 132;
    // 16384 rows: f32 4096 and 8192 columns, f32 2048 (and 16-bit 4096).
    assert_eq!(dx_grid_cap(16384, 16384, sms), 256);
    assert_eq!(dx_grid_cap(16384, 32768, sms), sms);
    assert_eq!(dx_grid_cap(16384, 8192, sms), 512);
    // Too few rows for 32 per block: no cap.
    assert_eq!(dx_grid_cap(16384, 4096, sms), usize::MAX);
    assert_eq!(dx_grid_cap(2048, 16384, sms), usize::MAX);
    assert_eq!(dx_grid_cap(32 * 256 - 1, 16384, sms), usize::MAX);
    assert_eq!(dx_grid_cap(32 * 256, 16384, sms), 256);
}

#[test]
fn dw_goes_to_shared_memory_only_for_more_blocks_and_many_rows() {
    // bf16 4096 on an H200: 4 blocks per SM with dW in shared memory, 2 in registers.
    let (regs, shared) = (2 * 132, 4 * 132);
    assert!(shared_dw(16384, regs, shared));
    assert!(shared_dw(SMEM_DW_MIN_ROWS * shared, regs, shared));
    assert!(!shared_dw(SMEM_DW_MIN_ROWS * shared - 1, regs, shared));
    // Shared memory fits no more blocks than registers do: registers.
    assert!(!shared_dw(1 << 20, shared, shared));
    assert!(!shared_dw(1 << 20, shared, regs));
}

#[test]
fn llama_offsets_other_than_zero_take_the_lane_by_lane_kernels_in_16_bit_types() {
    let llama = RmsNormArgs::new(1, 8);
    let v = Path::Vector {
        per_thread: 1,
        threads: 32,
    };
    for offset in [0.0, -0.0] {
        let args = llama.with_offset(offset);
        assert_eq!(vector_mode::<bf16>(&args), Mode::Llama);
        assert_eq!(vector_mode::<f16>(&args), Mode::Llama);
    }
    for offset in [1.0, -2.5e-3] {
        let args = llama.with_offset(offset);
        assert_eq!(vector_mode::<bf16>(&args), Mode::LlamaOffset);
        assert_eq!(
            v.kernel::<f16>(backward_step(true, false), &args).name(),
            "rms_norm_bwd_v1_f16_llama_offset"
        );
        // In f32 the rounding D is the identity: the packed product is the same expression.
        assert_eq!(vector_mode::<f32>(&args), Mode::Llama);
        // The scalar kernels take any offset.
        let s = Path::Scalar { threads: 128 };
        assert_eq!(
            s.kernel::<bf16>(forward_step(false), &args).name(),
            "rms_norm_fwd_bf16_llama"
        );
        for mode in [CastingMode::Gemma, CastingMode::None] {
            assert_eq!(
                vector_mode::<bf16>(&args.with_mode(mode)),
                mode.kernel_mode()
            );
        }
    }
}

/// 16-byte aligned stand-ins for device pointers: the paths look only at alignment.
const ALIGNED: u64 = 1 << 20;

fn gpu_args(rows: usize, cols: usize, mode: CastingMode, offset: f32) -> RmsNormArgs {
    RmsNormArgs::new(rows, cols)
        .with_mode(mode)
        .with_offset(offset)
}

/// The forward's kernel, grid and threads for contiguous, aligned buffers with a weight.
fn forward_choice<T: Dtype>(kernels: &Kernels, args: &RmsNormArgs) -> (String, u32, u32) {
    let settings = args.check().unwrap();
    let capacity = |k| {
        capacity(
            kernels,
            vector_kernel::<T>(forward_step(false), Resident, k, args),
        )
    };
    let (cols, rule) = (args.cols, fwd_rule::<T>());
    let path = Path::choose::<T>(settings, cols, &[ALIGNED; 3], &[cols; 2], rule, capacity);
    let path = path.unwrap();
    let (kernel, grid) = forward_kernel::<T>(kernels, path, args, false).unwrap();
    (kernel.name(), grid, path.threads())
}

/// A [`BackwardLaunch`] with its kernel's name.
#[derive(Debug, PartialEq)]
struct Launched {
    kernel: String,
    threads: u32,
    grid: usize,
    smem: u32,
    cluster: usize,
}

/// The backward launch for contiguous, aligned buffers, with or without dW.
fn backward_choice<T: Dtype>(
    ctx: &CudaContext,
    kernels: &Kernels,
    args: &RmsNormArgs,
    dw: bool,
) -> Launched {
    let settings = args.check().unwrap();
    let capacity = |k| {
        capacity(
            kernels,
            vector_kernel::<T>(backward_step(dw, false), Resident, k, args),
        )
    };
    let cols = args.cols;
    let path = Path::choose::<T>(
        settings,
        cols,
        &[ALIGNED; 4],
        &[cols; 2],
        &BWD_RULE,
        capacity,
    );
    let launch = backward_launch::<T>(ctx, kernels, path.unwrap(), args, dw, false).unwrap();
    Launched {
        kernel: launch.kernel.name(),
        threads: launch.threads,
        grid: launch.grid,
        smem: launch.smem,
        cluster: launch.cluster,
    }
}

#[test]
fn gpu_h200_suite_shapes_take_their_documented_kernels() {
    // The kernels, grids and clusters that tests/rms_norm/device.rs's comments (and
    // PERFORMANCE.md) say its shapes run on an H200: if a kernel's registers or a host rule
    // change, the suites would still pass on whatever kernel ran; this says which did.
    let Some((ctx, k)) = crate::module::h200_kernels(
        "rms_norm::plan::tests::gpu_h200_suite_shapes_take_their_documented_kernels",
    ) else {
        return;
    };
    let llama = |rows, cols| gpu_args(rows, cols, CastingMode::Llama, 0.0);
    use ElemType::{Bf16, F16, F32};
    let forward = |elem, args: &RmsNormArgs| match elem {
        Bf16 => forward_choice::<bf16>(&k, args),
        F16 => forward_choice::<f16>(&k, args),
        F32 => forward_choice::<f32>(&k, args),
    };
    let gemma = gpu_args(2200, 8192, CastingMode::Gemma, 1.0);
    // `gpu_forward_rows_walk_grid_stride_or_take_a_block_each`: one row per block from
    // four waves of resident blocks, grid-stride below.
    for (elem, args, kernel, grid, threads) in [
        (Bf16, llama(7000, 2048), "vw2_bf16_llama", 7000, 128),
        (F32, llama(4000, 2048), "vw2_f32_llama", 4000, 256),
        (F16, llama(2200, 8192), "vw4_f16_llama", 2200, 256),
        (F16, gemma, "vw4_f16_gemma", 2200, 256),
        (F32, llama(2200, 4096), "vw4_f32_llama", 2200, 256),
        (Bf16, llama(9600, 4096), "vw4_bf16_llama", 9600, 128),
        (Bf16, llama(2000, 2048), "v2_bf16_llama", 1188, 128),
        (F32, llama(1500, 2048), "v2_f32_llama", 660, 256),
        (Bf16, llama(1500, 4096), "v4_bf16_llama", 660, 128),
        (F32, llama(1000, 4096), "v4_f32_llama", 528, 256),
    ] {
        let want = (format!("rms_norm_fwd_{kernel}"), grid, threads);
        assert_eq!(forward(elem, &args), want);
    }
    // `gpu_many_rows_take_the_shared_memory_dw_kernels`: dW in shared memory, in clusters
    // of two, for every mode (at 2048 columns 9 blocks per SM fit, 1188, but only 528
    // clusters of two); for f32 rows of two vectors dW stays in registers and no cluster
    // runs (the bench's 16384×2048 f32 and 2048×4096 bf16 too). Without dW (a frozen
    // weight, or none) the `bwd_dx` kernels run, no cluster: bf16 `_v2` at 55 registers
    // (ptxas 12.9 and 13.0, sm_90) fits 9 blocks of 128 threads per SM (1188; at up to 64
    // registers 8), against the dW `_v2`'s 4 (528).
    let bwd = |kernel: &str, threads, grid, smem, cluster| Launched {
        kernel: kernel.to_string(),
        threads,
        grid,
        smem,
        cluster,
    };
    let shared = |cols: usize| REDUCE_SMEM_BYTES + 4 * cols as u32;
    assert_eq!(
        backward_choice::<bf16>(&ctx, &k, &llama(9600, 2048), true),
        bwd("rms_norm_bwd_vs2_bf16_llama", 128, 1056, shared(2048), 2)
    );
    assert_eq!(
        backward_choice::<bf16>(&ctx, &k, &llama(9600, 4096), true),
        bwd("rms_norm_bwd_vs2_bf16_llama", 256, 528, shared(4096), 2)
    );
    assert_eq!(
        backward_choice::<bf16>(&ctx, &k, &llama(16384, 2048), true),
        bwd("rms_norm_bwd_vs2_bf16_llama", 128, 1056, shared(2048), 2)
    );
    for (mode, offset) in [
        (CastingMode::Llama, 1.0),
        (CastingMode::Gemma, 1.0),
        (CastingMode::None, 0.25),
    ] {
        for cols in [2048, 4096] {
            let args = gpu_args(9600, cols, mode, offset);
            for got in [
                backward_choice::<bf16>(&ctx, &k, &args, true),
                backward_choice::<f16>(&ctx, &k, &args, true),
            ] {
                assert!(got.kernel.starts_with("rms_norm_bwd_vs2_"), "{got:?}");
                assert_eq!((got.cluster, got.grid % 2), (2, 0), "{got:?}");
            }
        }
    }
    let no_dw = backward_choice::<bf16>(&ctx, &k, &llama(9600, 2048), false);
    assert_eq!(
        bwd(
            "rms_norm_bwd_dx_v2_bf16_llama",
            128,
            no_dw.grid,
            REDUCE_SMEM_BYTES,
            1
        ),
        no_dw
    );
    assert!(no_dw.grid >= 8 * 132, "{no_dw:?}");
    let f32_2048 = backward_choice::<f32>(&ctx, &k, &llama(16384, 2048), true);
    assert_eq!(
        (f32_2048.kernel.as_str(), f32_2048.cluster),
        ("rms_norm_bwd_v2_f32_llama", 1)
    );
    let small = backward_choice::<bf16>(&ctx, &k, &llama(2048, 4096), true);
    assert_eq!(
        (small.kernel.as_str(), small.cluster),
        ("rms_norm_bwd_v2_bf16_llama", 1)
    );
}
