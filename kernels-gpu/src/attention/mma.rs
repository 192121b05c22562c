//! Tensor-core building blocks through inline PTX (sm_80): `mma.sync` m16n8k16 with f32
//! accumulators, `ldmatrix` from shared memory, `cp.async` from global to shared memory.
//!
//! Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16"): with `g = lane / 4` and
//! `c = lane % 4`, an A fragment (16×16, row-major) is four words holding rows `g`, `g + 8`
//! at columns `2c, 2c + 1` (words 0, 1) and `2c + 8, 2c + 9` (words 2, 3); a B fragment
//! (16×8, k × n) two words at k = `2c, 2c + 1` and `2c + 8, 2c + 9`, column n = `g`; an
//! accumulator (16×8) four f32 at rows `g` (0, 1) and `g + 8` (2, 3), columns `2c, 2c + 1`.
//! An accumulator pair of n-tiles `2t, 2t + 1` packed to 16 bits is the A fragment of k-step
//! `t` (the probabilities of a score tile feed the next product straight from registers).
//!
//! Shared-memory tiles hold rows of `D` 16-bit elements as 16-byte chunks, chunk `c` of row
//! `r` at chunk `c ^ (r % 8)`: the eight rows an `ldmatrix` matrix reads at one logical chunk
//! then fall in eight different bank groups (no conflicts), as do `cp.async` writes.
#[cfg(not(target_feature = "sm_90a"))]
use super::Half;
use core::arch::asm;

pub(crate) use crate::cp_async::{commit, cp_async_16, shared_addr, wait_all, wait_one_pending};

/// Calls `f(0), …, f(N − 1)` as straight-line code (`N ≤ 16`), so that register arrays indexed
/// by the argument keep constant indices.
#[inline(always)]
pub(super) fn each<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 16) };
    macro_rules! step {
        ($($i:literal)*) => { $( if N > $i { f($i); } )* };
    }
    step!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
}

/// `d = a·b + d` on one m16n8k16 tile (bf16 or f16 operands, f32 accumulators).
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
pub(crate) fn mma<T: Half>(d: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
    // SAFETY: a register-only warp-wide instruction; every lane of the warp executes it.
    unsafe {
        if T::IS_BF16 {
            asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
                d0 = inout(reg32) d[0], d1 = inout(reg32) d[1], d2 = inout(reg32) d[2], d3 = inout(reg32) d[3],
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b0, b1 = in(reg32) b1,
                options(pure, nomem, nostack)
            );
        } else {
            asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
                d0 = inout(reg32) d[0], d1 = inout(reg32) d[1], d2 = inout(reg32) d[2], d3 = inout(reg32) d[3],
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b0, b1 = in(reg32) b1,
                options(pure, nomem, nostack)
            );
        }
    }
}

/// Four 8×8 matrices of 16-bit elements from shared memory (`ldmatrix.x4`): lanes `8m..8m+8`
/// give the row addresses of matrix `m`, and word `m` of each lane holds its part of matrix
/// `m` (row `lane / 4`, columns `2·(lane % 4)`, `+1`).
///
/// # Safety
/// `addr` is a 16-byte aligned shared-memory address (`.shared` window) of 16 valid bytes;
/// every lane of the warp executes it.
#[inline(always)]
pub(crate) unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly)
        );
    }
    [a, b, c, d]
}

/// As [`ldmatrix_x4`], each matrix transposed (`.trans`): word `m` of a lane holds rows
/// `2·(lane % 4)`, `+1` of matrix `m` at column `lane / 4`.
///
/// # Safety
/// As [`ldmatrix_x4`].
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
pub(crate) unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly)
        );
    }
    [a, b, c, d]
}

/// A lane's `ldmatrix` addresses in a swizzled tile of `D`-element rows, for one of the three
/// patterns below. Every row a lane addresses is `≡ lane (mod 8)`, so the swizzle XORs its
/// chunk with `lane % 8` alone: the four chunk offsets within a group of eight chunks are
/// computed once per lane, and an address is then a register plus constants.
#[cfg(not(target_feature = "sm_90a"))]
#[derive(Clone, Copy)]
pub(crate) struct Lanes {
    /// Byte offset of the lane's row, plus each of its four chunk offsets.
    at: [u32; 4],
}

#[cfg(not(target_feature = "sm_90a"))]
impl Lanes {
    /// The lane's addresses when it names row `row` (≡ lane mod 8) and chunks
    /// `2·(first + i) + bit` (the swizzle changes only a chunk's low three bits).
    #[inline(always)]
    fn new<const D: usize>(lane: usize, row: usize, bit: usize, first: usize) -> Self {
        let x = lane & 7;
        let rb = (row * D * 2) as u32;
        Lanes {
            at: [0, 1, 2, 3].map(|i| rb + ((((2 * (first + i) + bit) ^ x) << 4) as u32)),
        }
    }

    /// A fragments of rows `16·block..`: lane rows `lane % 16`, chunks `2kk + lane / 16`.
    #[inline(always)]
    pub(crate) fn a<const D: usize>(lane: usize, block: usize) -> Self {
        Self::new::<D>(lane, 16 * block + (lane & 15), lane >> 4, 0)
    }

    /// B fragments from n-major rows (`ldmatrix` as stored): lane rows
    /// `lane % 8 + 8·(lane / 16)`, chunks `2kk + (lane / 8) % 2`.
    #[inline(always)]
    pub(crate) fn b<const D: usize>(lane: usize) -> Self {
        Self::new::<D>(lane, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, 0)
    }

    /// B fragments from k-major rows (`ldmatrix.trans`): lane rows `lane % 16` ordered
    /// `lane % 8 + 8·((lane / 8) % 2)`, chunks `2dp + lane / 16`.
    #[inline(always)]
    pub(crate) fn bt<const D: usize>(lane: usize) -> Self {
        Self::bt_from::<D>(lane, 0)
    }

    /// As [`Lanes::bt`], chunk pairs counted from `first` (a column group that varies by warp:
    /// indexing the offsets by it would put them in local memory).
    #[inline(always)]
    pub(crate) fn bt_from<const D: usize>(lane: usize, first: usize) -> Self {
        Self::new::<D>(
            lane,
            (lane & 7) + (((lane >> 3) & 1) << 3),
            lane >> 4,
            first,
        )
    }

    /// The lane's address for chunk pair `pair` (its chunks `2·pair`, `2·pair + 1`) of the rows
    /// `16·rows16` further down.
    #[inline(always)]
    pub(crate) fn at<const D: usize>(&self, tile: u32, rows16: usize, pair: usize) -> u32 {
        tile + self.at[pair & 3] + ((pair >> 2) << 7) as u32 + (rows16 * 16 * D * 2) as u32
    }
}

/// Byte offset of chunk `chunk` (16 bytes) of row `row` in a tile of `D`-element rows.
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
pub(crate) const fn swizzled<const D: usize>(row: usize, chunk: usize) -> u32 {
    (row * D * 2 + ((chunk ^ (row & 7)) << 4)) as u32
}

/// Starts copying `rows` rows of `D` 16-bit elements into the tile at shared address `tile`
/// (all `N` threads of the block call it): row `r` from `base + r·stride` elements, zeros for
/// rows `r ≥ valid`.
///
/// # Safety
/// `base` and `stride` are 16-byte aligned and rows `< valid` readable; `tile` has room.
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
pub(crate) unsafe fn load_tile<const D: usize, const N: usize>(
    tile: u32,
    base: u64,
    stride: usize,
    rows: usize,
    valid: usize,
    tid: usize,
) {
    unsafe { load_rows::<D, N>(tile, (base, stride), rows, valid, tid, swizzled::<D>) }
}

/// As [`load_tile`], chunk `c` of row `r` stored at byte `at(r, c)` of the tile.
///
/// # Safety
/// As [`load_tile`]; `at` stays within the tile's room.
#[inline(always)]
pub(crate) unsafe fn load_rows<const D: usize, const N: usize>(
    tile: u32,
    (base, stride): (u64, usize),
    rows: usize,
    valid: usize,
    tid: usize,
    at: impl Fn(usize, usize) -> u32,
) {
    let chunks = D / 8;
    let mut idx = tid;
    while idx < rows * chunks {
        let (r, c) = (idx / chunks, idx % chunks);
        let ok = r < valid;
        let src = if ok {
            base + ((r * stride + c * 8) * 2) as u64
        } else {
            base
        };
        unsafe { cp_async_16(tile + at(r, c), src, ok) };
        idx += N;
    }
}

/// `acc[n] += A · Bᵀ` for the `n8` n-tiles (8 rows each) of a `D`-wide tile of B rows, A given
/// by `a(kk)` per k-step: B rows are the n dimension, their elements the k dimension
/// (`ldmatrix` without transposition: K for scores, V for dP, Q or dO for the dK/dV kernel's
/// transposed scores). The sm_80 build's (the forward, dQ and dK/dV).
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
pub(crate) unsafe fn mma_abt<T: Half, const D: usize>(
    acc: &mut [[f32; 4]; 8],
    tile: u32,
    lane: usize,
    n8: usize,
    mut a: impl FnMut(usize) -> [u32; 4],
) {
    let l = Lanes::b::<D>(lane);
    each::<8>(|kk| {
        if kk < D / 16 {
            let af = a(kk);
            each::<4>(|np| {
                if np < n8 / 2 {
                    let b = unsafe { ldmatrix_x4(l.at::<D>(tile, np, kk)) };
                    mma::<T>(&mut acc[2 * np], &af, b[0], b[1]);
                    mma::<T>(&mut acc[2 * np + 1], &af, b[2], b[3]);
                }
            });
        }
    });
}

/// `acc[n] += P · B` over `k16` k-steps of 16 rows of a `D`-wide tile of B rows (the k
/// dimension; their elements the n dimension: `ldmatrix.trans`), with P's accumulator tiles
/// `p` (two per k-step) packed to 16 bits as the A operand (the sm_80 build's forward and dQ).
#[cfg(not(target_feature = "sm_90a"))]
#[inline(always)]
pub(crate) unsafe fn mma_pb<T: Half, const D: usize>(
    acc: &mut [[f32; 4]; 16],
    p: &[[f32; 4]; 8],
    tile: u32,
    lane: usize,
    k16: usize,
) {
    let l = Lanes::bt::<D>(lane);
    each::<4>(|kk| {
        if kk < k16 {
            let (lo, hi) = (&p[2 * kk], &p[2 * kk + 1]);
            let a = [
                T::pack2(lo[0], lo[1]),
                T::pack2(lo[2], lo[3]),
                T::pack2(hi[0], hi[1]),
                T::pack2(hi[2], hi[3]),
            ];
            each::<8>(|dp| {
                if dp < D / 16 {
                    let b = unsafe { ldmatrix_x4_trans(l.at::<D>(tile, kk, dp)) };
                    mma::<T>(&mut acc[2 * dp], &a, b[0], b[1]);
                    mma::<T>(&mut acc[2 * dp + 1], &a, b[2], b[3]);
                }
            });
        }
    });
}
