//! Embedding lookup: the forward gathers a table row per token, the backward sums each
//! row's tokens' gradients, deterministically. Host: `src/embedding/`, semantics:
//! `src/reference/embedding.rs`.
//!
//! The backward needs no atomics and no sort: each block owns [`abi::BWD_ROWS`] table rows
//! and [`abi::BWD_TILE_COLS`] columns, scans every id in chunks of one per thread, lists
//! the chunk's tokens that fall in its rows in token order (a ballot per warp, the warps'
//! counts through shared memory) and adds their gradient rows into f32 accumulators held in
//! registers. So each gradient element is the sum of its tokens in token order, rounded once,
//! and every table row, used or not, is written once. An id outside `[0, vocab)` gathers a
//! zero row and adds to no row.
pub mod abi;

use crate::identity::kernel_name;
use crate::{Bf16, Elem, block_idx, grid_dim, sync_threads, thread_idx, unroll};
use abi::{BWD_COLS_PER_THREAD, BWD_ROWS, BWD_TILE_COLS, Params, THREADS, WARPS};
use core::intrinsics::gpu::gpu_launch_sized_workgroup_mem;

unsafe extern "C" {
    #[link_name = "llvm.nvvm.vote.ballot.sync"]
    fn vote_ballot(mask: u32, pred: bool) -> u32;
}

/// A token id type of the kernels' `ids`.
pub(crate) trait TokenId: Copy {
    /// The table row it names, or `u64::MAX` outside `[0, vocab)`.
    fn row(self, vocab: u64) -> u64;
}

impl TokenId for u32 {
    #[inline(always)]
    fn row(self, vocab: u64) -> u64 {
        if (self as u64) < vocab {
            self as u64
        } else {
            u64::MAX
        }
    }
}

impl TokenId for i64 {
    #[inline(always)]
    fn row(self, vocab: u64) -> u64 {
        if self >= 0 && (self as u64) < vocab {
            self as u64
        } else {
            u64::MAX
        }
    }
}

/// `f(r)` for every accumulator row `r < BWD_ROWS`, unrolled so that the accumulators stay
/// in registers (a loop indexes them in local memory).
#[inline(always)]
fn each_row(mut f: impl FnMut(usize)) {
    const { assert!(BWD_ROWS == 16) };
    unroll::<2>(|h| unroll::<8>(|i| f(8 * h + i)));
}

/// `y[t] = table[ids[t]]`: blocks walk the tokens grid-stride, threads the columns.
///
/// # Safety
/// The host's checks: `ids` holds `tokens` ids, `table` and `rows` their strided rows.
#[inline(always)]
unsafe fn forward<T: Elem, I: TokenId>(p: &Params) {
    let (ids, table, rows) = (p.ids as *const I, p.table as *const T, p.rows as *mut T);
    let mut t = block_idx() as u64;
    while t < p.tokens {
        // SAFETY: `t < tokens`; a valid row is inside the table, and each column is below
        // `hidden`, inside its row.
        unsafe {
            let row = (*ids.add(t as usize)).row(p.vocab);
            let dst = rows.add((t * p.rows_stride) as usize);
            let mut c = thread_idx() as u64;
            while c < p.hidden {
                *dst.add(c as usize) = if row == u64::MAX {
                    T::from_f32(0.0)
                } else {
                    *table.add((row * p.table_stride + c) as usize)
                };
                c += THREADS as u64;
            }
        }
        t += grid_dim() as u64;
    }
}

/// `dW[r] = Σ_{t: ids[t] = r} dy[t]` for the block's rows and columns, in token order.
///
/// # Safety
/// The host's checks, as [`forward`]; the grid is `⌈vocab / BWD_ROWS⌉ · ⌈hidden /
/// BWD_TILE_COLS⌉` blocks of [`THREADS`] with [`abi::BWD_SHARED_WORDS`] words of shared
/// memory.
#[inline(always)]
unsafe fn backward<T: Elem, I: TokenId>(p: &Params) {
    let smem = gpu_launch_sized_workgroup_mem::<u32>();
    let (ids, dy, dw) = (p.ids as *const I, p.rows as *const T, p.table as *mut T);
    let tid = thread_idx();
    let (warp, lane) = (tid / 32, tid % 32);
    let tiles = p.hidden.div_ceil(BWD_TILE_COLS as u64);
    let b = block_idx() as u64;
    let r0 = b / tiles * BWD_ROWS as u64;
    let c0 = b % tiles * BWD_TILE_COLS as u64;
    let mut acc = [[0f32; BWD_COLS_PER_THREAD]; BWD_ROWS];
    let mut base = 0u64;
    let mut parity = 0;
    while base < p.tokens {
        let t = base + tid as u64;
        // SAFETY: `t < tokens`.
        let row = if t < p.tokens {
            unsafe { (*ids.add(t as usize)).row(p.vocab) }
        } else {
            u64::MAX
        };
        let hit = row >= r0 && row < r0 + BWD_ROWS as u64;
        // SAFETY: every lane of the warp votes.
        let ballot = unsafe { vote_ballot(u32::MAX, hit) };
        // SAFETY: shared memory holds BWD_SHARED_WORDS words: two sets of WARPS counts, then
        // THREADS list entries; the counts a set holds are read before the barrier after
        // which the set is written again, the list is written after every thread has read
        // the previous chunk's.
        unsafe {
            let counts = smem.add(parity * WARPS);
            if lane == 0 {
                *counts.add(warp) = ballot.count_ones();
            }
            sync_threads();
            let (mut before, mut total) = (0, 0);
            for w in 0..WARPS {
                let n = *counts.add(w);
                before += if w < warp { n } else { 0 };
                total += n;
            }
            if total != 0 {
                let list = smem.add(2 * WARPS);
                if hit {
                    let at = before + (ballot & ((1u32 << lane) - 1)).count_ones();
                    *list.add(at as usize) = ((tid as u32) << 8) | (row - r0) as u32;
                }
                sync_threads();
                for e in 0..total as usize {
                    let entry = *list.add(e);
                    let (token, local) = (base + (entry >> 8) as u64, (entry & 0xff) as usize);
                    let src = dy.add((token * p.rows_stride + c0) as usize);
                    unroll::<BWD_COLS_PER_THREAD>(|j| {
                        let c = tid + j * THREADS as usize;
                        if c0 + (c as u64) < p.hidden {
                            let v = (*src.add(c)).to_f32();
                            each_row(|r| {
                                if local == r {
                                    acc[r][j] += v;
                                }
                            });
                        }
                    });
                }
            }
        }
        base += THREADS as u64;
        parity ^= 1;
    }
    each_row(|r| {
        let row = r0 + r as u64;
        if row < p.vocab {
            unroll::<BWD_COLS_PER_THREAD>(|j| {
                let c = c0 + (tid + j * THREADS as usize) as u64;
                if c < p.hidden {
                    // SAFETY: `row < vocab`, `c < hidden`: inside the gradient's row.
                    unsafe {
                        *dw.add((row * p.table_stride + c) as usize) = T::from_f32(acc[r][j])
                    };
                }
            });
        }
    });
}

/// Entry points: `$body(p)` exported under the kernel's identity.
macro_rules! embedding_kernels {
    ($($dir:ident $elem:ident $ids:ident => $body:path;)*) => {
        $(
            const _: () = {
                /// # Safety
                /// The host's checks and plan, as the body's.
                #[unsafe(export_name = kernel_name!(Embedding, $dir, $elem, $ids))]
                // A `#[repr(C)]` struct of integers: the PTX parameter is its bytes.
                #[allow(improper_gpu_kernel_arg)]
                pub unsafe extern "gpu-kernel" fn kernel(p: Params) {
                    unsafe { $body(&p) }
                }
            };
        )*
    };
}

embedding_kernels! {
    Forward F32 U32 => forward::<f32, u32>;
    Forward F16 U32 => forward::<f16, u32>;
    Forward Bf16 U32 => forward::<Bf16, u32>;
    Forward F32 I64 => forward::<f32, i64>;
    Forward F16 I64 => forward::<f16, i64>;
    Forward Bf16 I64 => forward::<Bf16, i64>;
    Backward F32 U32 => backward::<f32, u32>;
    Backward F16 U32 => backward::<f16, u32>;
    Backward Bf16 U32 => backward::<Bf16, u32>;
    Backward F32 I64 => backward::<f32, i64>;
    Backward F16 I64 => backward::<f16, i64>;
    Backward Bf16 I64 => backward::<Bf16, i64>;
}
