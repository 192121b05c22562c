//! Which kernel a GLU call runs, on which grid: a pure function of the pass, the gate, the
//! element type, the parameter block (its pointers' alignment and its shape) and the device's
//! resident blocks, unit-tested without a GPU.
use super::abi::{
    BWD_TILE_VECTOR_BYTES, BWD_VECS, BWD_VECS_TILE, FWD_VECS, FWD_VECS_TILE, ITEMS, Params,
};
use crate::error::Result;
use crate::identity::{ElemType, Gate, GluPath, Kernel, Pass};
use crate::launch::whole_grid;

/// Most threads per block.
const MAX_THREADS: usize = 256;
/// Most threads per block of the forward `_vw` kernels: on an H200, 128 measured +0.4 % (f32
/// 16384×8192) and +1.2 % (bf16 2048×14336) over [`MAX_THREADS`], level for 16-bit
/// 16384×14336; the backward keeps [`MAX_THREADS`] (128 measured −0.3 % with two 16-byte
/// vectors, −0.1 % with one 8-byte vector in the CUDA C stand-in).
const FWD_THREADS_WHOLE: usize = 128;
/// Largest `rows`, `cols` and row stride the vector kernels take (they index in 32 bits).
const VEC_MAX: usize = i32::MAX as usize;

/// Tile of a one-tile-per-block `_vw` kernel: vector bytes, vectors per thread and most
/// threads per block.
#[derive(Debug, Clone, Copy)]
struct Whole {
    vector_bytes: usize,
    per_thread: usize,
    max_threads: usize,
}

/// The forward `_vw` tile (every dtype): 16-byte vectors.
const FWD_WHOLE: Whole = Whole {
    vector_bytes: 16,
    per_thread: FWD_VECS_TILE,
    max_threads: FWD_THREADS_WHOLE,
};

/// The backward `_vw` tile (every dtype): 8-byte vectors.
const BWD_WHOLE: Whole = Whole {
    vector_bytes: BWD_TILE_VECTOR_BYTES,
    per_thread: BWD_VECS_TILE,
    max_threads: MAX_THREADS,
};

/// One launch: the kernel, its blocks and threads per block (no shared memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) kernel: Kernel,
    pub(crate) grid: u32,
    pub(crate) threads: u32,
}

/// The launch of `gate`'s `pass` on `p` (`p.rows > 0`, `p.cols > 0`): the vector path where
/// [`vector`] allows it, else the scalar one; its grid from [`shape`]. `resident(kernel,
/// threads)`: the resident blocks of the grid-stride `kernel` at `threads` per block.
pub(crate) fn plan(
    pass: Pass,
    gate: Gate,
    elem: ElemType,
    p: &Params,
    resident: impl FnOnce(Kernel, u32) -> Result<usize>,
) -> Result<Plan> {
    let (ptrs, per_thread, whole): (&[u64], _, _) = match pass {
        Pass::Forward => (&[p.a, p.b, p.c], FWD_VECS, FWD_WHOLE),
        Pass::Backward => (&[p.c, p.a, p.b, p.da, p.db], BWD_VECS, BWD_WHOLE),
    };
    let strides = [p.a_stride, p.b_stride, p.c_stride].map(|s| s as usize);
    let (rows, cols) = (p.rows as usize, p.cols as usize);
    let path = match vector(elem.size(), rows, cols, ptrs, &strides) {
        true => Path::Vector { per_thread },
        false => Path::Scalar,
    };
    let kernel = |path| Kernel::Glu {
        gate,
        pass,
        path,
        elem,
    };
    let grid_stride = kernel(path.name(false));
    let s = shape(path, whole, elem.size(), rows, cols, |threads| {
        resident(grid_stride, threads)
    })?;
    Ok(Plan {
        kernel: kernel(path.name(s.whole)),
        grid: s.grid,
        threads: s.threads,
    })
}

/// Whether the vector kernels take these buffers: `cols` a multiple of the lanes per 16-byte
/// vector, every pointer (a fused layout's up half included) 16-byte aligned, every row stride
/// a whole number of vectors, and `rows`, `cols` and the strides within the kernels' 32-bit
/// indexing.
fn vector(size: usize, rows: usize, cols: usize, ptrs: &[u64], strides: &[usize]) -> bool {
    cols.is_multiple_of(16 / size)
        && rows <= VEC_MAX
        && cols <= VEC_MAX
        && ptrs.iter().all(|p| p.is_multiple_of(16))
        && strides
            .iter()
            .all(|&s| s <= VEC_MAX && (s * size).is_multiple_of(16))
}

/// The kernels' paths as the grid is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Any alignment, any shape.
    Scalar,
    /// 16-byte vectors, `per_thread` of each operand per thread per tile of the grid-stride
    /// kernel; its one-tile-per-block twin is shaped by [`Whole`].
    Vector { per_thread: usize },
}

impl Path {
    /// The kernel's path; `whole`: the vector path's one-tile-per-block twin.
    fn name(self, whole: bool) -> GluPath {
        match (self, whole) {
            (Path::Scalar, _) => GluPath::Scalar,
            (Path::Vector { .. }, false) => GluPath::Vector,
            (Path::Vector { .. }, true) => GluPath::Whole,
        }
    }
}

/// Threads per block of the scalar kernels: enough for `cols` at `ITEMS` per thread,
/// 32 ..= 256.
fn threads_for(cols: usize) -> usize {
    cols.div_ceil(ITEMS)
        .next_power_of_two()
        .clamp(32, MAX_THREADS)
}

/// A launch's shape: the kernel variant, blocks and threads per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    /// Whether the one-tile-per-block `_vw` twin runs (else the grid-stride kernel).
    whole: bool,
    grid: u32,
    threads: u32,
}

/// As many blocks as fit on the device at once (the kernels walk their tiles grid-stride),
/// never more than there are tiles; or, for the vector path with many waves of tiles
/// ([`whole_grid`]), the `_vw` twin with one block per tile. `resident(threads)` is the
/// grid-stride kernel's resident blocks at `threads` per block; `size` the element's bytes.
///
/// Scalar: `threads` per block for `cols` (see [`threads_for`]), a tile is `ITEMS · threads`
/// columns of one row. Vector: the `rows × cols / lanes` vectors form one flat range, a tile
/// is `per_thread · threads` consecutive vectors, up to 256 threads per block (16-byte
/// vectors; `_vw`: the `whole` tile, in its own vectors).
fn shape(
    path: Path,
    whole: Whole,
    size: usize,
    rows: usize,
    cols: usize,
    resident: impl FnOnce(u32) -> Result<usize>,
) -> Result<Shape> {
    let vecs = |bytes: usize| rows as u64 * (cols * size / bytes) as u64;
    let vector_shape = |vecs: u64, per_thread: usize, max_threads: usize| {
        let threads =
            (vecs.div_ceil(per_thread as u64).next_multiple_of(32) as usize).clamp(32, max_threads);
        let per_tile = (per_thread * threads) as u64;
        (threads, vecs.div_ceil(per_tile), per_tile)
    };
    let (threads, tiles, per_tile) = match path {
        Path::Scalar => {
            let threads = threads_for(cols);
            let tiles = (rows as u64).saturating_mul(cols.div_ceil(ITEMS * threads) as u64);
            (threads, tiles, (ITEMS * threads) as u64)
        }
        Path::Vector { per_thread } => vector_shape(vecs(16), per_thread, MAX_THREADS),
    };
    let resident = resident(threads as u32)?;
    // The vector kernels index `grid · per_tile` vectors in 32 bits.
    let max_grid = |per_tile: u64| (i32::MAX as u64 / per_tile).max(1);
    // Only the vector path has `_vw` twins (and `vecs > 0`: `cols` is whole vectors).
    let whole = match path {
        Path::Vector { .. } if whole_grid(tiles, resident) => Some(vector_shape(
            vecs(whole.vector_bytes),
            whole.per_thread,
            whole.max_threads,
        ))
        .filter(|w| w.1 <= max_grid(w.2)),
        _ => None,
    };
    Ok(match whole {
        Some((threads, tiles, _)) => Shape {
            whole: true,
            grid: tiles as u32,
            threads: threads as u32,
        },
        None => Shape {
            whole: false,
            grid: tiles.min((resident as u64).clamp(1, max_grid(per_tile))) as u32,
            threads: threads as u32,
        },
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A block of `rows × cols` on contiguous aligned buffers.
    fn block(rows: usize, cols: usize) -> Params {
        let (rows, cols) = (rows as u64, cols as u64);
        Params {
            a: 1 << 32,
            b: 2 << 32,
            c: 3 << 32,
            da: 4 << 32,
            db: 5 << 32,
            a_stride: cols,
            b_stride: cols,
            c_stride: cols,
            rows,
            cols,
            gate_multiplier: 1.0,
            down_multiplier: 1.0,
        }
    }

    /// Every kernel the launchers can ask for: each gate, pass, path and element type.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let mut out = Vec::new();
        for &gate in Gate::ALL {
            for &pass in Pass::ALL {
                for &path in GluPath::ALL {
                    for &elem in ElemType::ALL {
                        out.push(Kernel::Glu {
                            gate,
                            pass,
                            path,
                            elem,
                        });
                    }
                }
            }
        }
        out
    }

    #[test]
    fn each_entry_takes_one_parameter_block_of_the_hosts_size() {
        crate::module::tests::assert_one_param_block(&launchable_kernels(), size_of::<Params>());
    }

    #[test]
    fn vector_path_needs_alignment_whole_vectors_and_32_bit_shapes() {
        let choose = |rows, cols, ptrs: &[u64], strides: &[usize]| {
            (
                vector(4, rows, cols, ptrs, strides),
                vector(2, rows, cols, ptrs, strides),
            )
        };
        let (v, s) = (true, false);
        // Aligned, contiguous, whole vectors (4 f32 or 8 half lanes): every dtype.
        assert_eq!(choose(3, 11008, &[256, 512, 1024], &[11008; 3]), (v, v));
        assert_eq!(choose(2, 14336, &[256, 512, 1024], &[14336; 3]), (v, v));
        assert_eq!(choose(1000, 64, &[256, 512, 1024], &[64; 3]), (v, v));
        // Padded strides that stay whole vectors (8 elements: 32 or 16 bytes).
        let padded = [2056, 2064, 2072];
        assert_eq!(choose(9, 2048, &[256, 512, 1024], &padded), (v, v));
        // Fused gate-up: the up half starts `cols` elements in, so it must be aligned too.
        let fused = |cols: usize, size: usize| [256, 256 + (cols * size) as u64, 4096];
        assert!(vector(4, 4, 20, &fused(20, 4), &[40, 40, 20]));
        assert!(vector(2, 4, 24, &fused(24, 2), &[48, 48, 24]));
        assert!(!vector(2, 4, 20, &fused(20, 2), &[40, 40, 20]));
        // Whole vectors for f32 (4 lanes) but not for the half types (8 lanes).
        assert_eq!(choose(5, 20, &[256, 512, 1024], &[24, 28, 32]), (v, s));
        // Partial vectors: the scalar kernels.
        assert_eq!(choose(2, 14337, &[256, 512, 1024], &[14337; 3]), (s, s));
        assert_eq!(choose(1, 3, &[256, 512, 1024], &[3; 3]), (s, s));
        assert_eq!(choose(33, 4097, &[256, 512, 1024], &[4097; 3]), (s, s));
        // A misaligned pointer (an offset view) or a stride that is not whole vectors.
        assert_eq!(choose(3, 11008, &[256, 520, 1024], &[11008; 3]), (s, s));
        let odd = [11008, 11010, 11008];
        assert_eq!(choose(3, 11008, &[256, 512, 1024], &odd), (s, s));
        let odd = [1013, 1026, 1039];
        assert_eq!(choose(37, 1000, &[256, 512, 1024], &odd), (s, s));
        // Beyond the vector kernels' 32-bit indexing.
        let big = VEC_MAX + 1;
        assert_eq!(choose(big, 8, &[256], &[8]), (s, s));
        assert_eq!(choose(2, 8, &[256], &[big.next_multiple_of(8)]), (s, s));
        assert_eq!(choose(2, VEC_MAX - 7, &[256], &[VEC_MAX - 7]), (v, v));
    }

    #[test]
    fn launch_shapes_pick_whole_grids_for_many_waves_of_vector_tiles() {
        let shape_of = |path, per_thread, rows, cols, resident: usize| {
            let whole = Whole {
                vector_bytes: 16,
                per_thread,
                max_threads: MAX_THREADS,
            };
            shape(path, whole, 2, rows, cols, |_| Ok(resident)).unwrap()
        };
        let v = Path::Vector { per_thread: 3 };
        // Scalar shapes (no whole vectors, even none at all): grid-stride, never `_vw`.
        for (rows, cols) in [(1, 1), (3, 1), (70_000, 3), (2, 14337), (1, 70001)] {
            let s = shape_of(Path::Scalar, 4, rows, cols, 396);
            assert!(
                !s.whole && s.grid >= 1 && s.grid <= 396,
                "{rows}×{cols}: {s:?}"
            );
            assert!(s.threads >= 32 && s.threads <= 256);
        }
        // Few tiles: grid-stride over at most one block per tile.
        let s = shape_of(v, 4, 3, 11008, 396);
        assert_eq!((s.whole, s.grid, s.threads), (false, 6, 256));
        // The benchmark shape: 16384 × 1792 vectors, 38229 tiles of 768 ≥ 4 × 396, so one
        // block per tile of 4 × 256 vectors or 2 × 256.
        let s = shape_of(v, 4, 16384, 14336, 396);
        assert_eq!((s.whole, s.grid, s.threads), (true, 28672, 256));
        let s = shape_of(v, 2, 16384, 14336, 396);
        assert_eq!((s.whole, s.grid, s.threads), (true, 57344, 256));
        // Just under four waves stays grid-stride.
        let s = shape_of(v, 4, 3 * 512, 8 * 256, 396);
        assert_eq!((s.whole, s.grid), (false, 396));
        // Beyond a 32-bit grid index the whole grid does not fit: grid-stride, capped.
        let s = shape_of(v, 4, 1 << 30, 64, 396);
        assert!(!s.whole && s.grid == 396);
        let s = shape_of(v, 4, usize::MAX >> 4, 8, usize::MAX >> 8);
        assert!(!s.whole && s.grid as u64 * 768 <= i32::MAX as u64);
        // Driver errors pass through.
        let err = shape(v, BWD_WHOLE, 4, 8, 8, |_| Err(crate::Error::NoDriver));
        assert!(err.is_err());
        // The forward's `_vw` tiles: 4 16-byte vectors × 128 threads, here over 16384 rows of
        // 1792 vectors each.
        let s = shape(v, FWD_WHOLE, 2, 16384, 1792 * 8, |_| Ok(396)).unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 57344, 128));
        let s = shape(v, FWD_WHOLE, 4, 16384, 1792 * 4, |_| Ok(396)).unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 57344, 128));
        // The backward's: one 8-byte vector × 256 threads, over 16384 rows of 3584 of them.
        let s = shape(v, BWD_WHOLE, 2, 16384, 3584 * 4, |_| Ok(396)).unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 229376, 256));
        let s = shape(v, BWD_WHOLE, 4, 16384, 3584 * 2, |_| Ok(396)).unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 229376, 256));
    }

    #[test]
    fn plans_name_the_kernel_of_their_gate_pass_path_and_grid() {
        let name = |pass, gate, elem, p: &Params, resident| {
            plan(pass, gate, elem, p, |_, _| Ok(resident))
                .unwrap()
                .kernel
                .name()
        };
        let (fwd, bwd) = (Pass::Forward, Pass::Backward);
        let (silu, tanh, erf) = (Gate::Silu, Gate::GeluTanh, Gate::GeluErf);
        let (f32_, f16_, bf16_) = (ElemType::F32, ElemType::F16, ElemType::Bf16);
        // A few tiles: the grid-stride `_v` kernel; many waves of them: the `_vw` twin. On an
        // H200 (132 SMs) and an A100 (108) alike at these sizes.
        for resident in [132 * 4, 108 * 4] {
            let small = block(3, 11008);
            assert_eq!(
                name(fwd, silu, bf16_, &small, resident),
                "swiglu_fwd_v_bf16"
            );
            assert_eq!(name(bwd, silu, f32_, &small, resident), "swiglu_bwd_v_f32");
            let large = block(16384, 14336);
            assert_eq!(name(bwd, silu, f16_, &large, resident), "swiglu_bwd_vw_f16");
            assert_eq!(
                name(fwd, tanh, bf16_, &large, resident),
                "geglu_fwd_vw_bf16_tanh"
            );
            assert_eq!(
                name(bwd, erf, f32_, &small, resident),
                "geglu_bwd_v_f32_erf"
            );
        }
        // Partial vectors, and a misaligned gradient: the scalar kernels.
        let odd = block(3, 11007);
        assert_eq!(name(fwd, silu, f16_, &odd, 528), "swiglu_fwd_f16");
        let misaligned = Params {
            da: (4 << 32) + 2,
            ..block(16384, 14336)
        };
        assert_eq!(name(bwd, erf, f16_, &misaligned, 528), "geglu_bwd_f16_erf");
        // The forward never reads the gradients' pointers.
        assert_eq!(
            name(fwd, erf, f16_, &misaligned, 528),
            "geglu_fwd_vw_f16_erf"
        );
        // The resident blocks asked for are the grid-stride kernel's, at the planned threads.
        let p = plan(fwd, silu, bf16_, &block(16384, 14336), |k, threads| {
            assert_eq!((k.name().as_str(), threads), ("swiglu_fwd_v_bf16", 256));
            Ok(528)
        })
        .unwrap();
        assert_eq!((p.grid, p.threads), (57344, 128));
    }

    #[test]
    fn threads_cover_small_rows_without_waste_and_cap_at_256() {
        assert_eq!(threads_for(1), 32);
        assert_eq!(threads_for(128), 32);
        assert_eq!(threads_for(129), 64);
        assert_eq!(threads_for(1000), 256);
        assert_eq!(threads_for(70001), 256);
    }

    #[test]
    fn gpu_h200_suite_shapes_take_their_documented_kernels() {
        // tests/swiglu.rs's SHAPES on an H200: 1300×8192 and 200001×56 have over four waves of
        // tiles and run the one-tile-per-block `_vw` kernels, 24000×56 the grid-stride `_v`
        // ones. The suite's buffers for these shapes are aligned (whole vectors per row), so
        // they take the vector path, where this starts.
        let Some((_ctx, k)) = crate::module::h200_kernels(
            "glu::plan::tests::gpu_h200_suite_shapes_take_their_documented_kernels",
        ) else {
            return;
        };
        for elem in ElemType::ALL.iter().copied() {
            for (rows, cols, twin) in [(1300, 8192, true), (200001, 56, true), (24000, 56, false)] {
                for pass in [Pass::Forward, Pass::Backward] {
                    let got = plan(pass, Gate::Silu, elem, &block(rows, cols), |kernel, t| {
                        k.resident_blocks(&k.function(kernel)?, t, 0)
                    })
                    .unwrap();
                    let path = if twin {
                        GluPath::Whole
                    } else {
                        GluPath::Vector
                    };
                    let want = Kernel::Glu {
                        gate: Gate::Silu,
                        pass,
                        path,
                        elem,
                    };
                    assert_eq!(got.kernel.name(), want.name(), "{rows}×{cols}");
                }
            }
        }
    }
}
