//! Warpgroup tensor-core building blocks through inline PTX (sm_90a): `wgmma.mma_async`
//! m64nNk16 with f32 accumulators, operands in shared memory named by matrix descriptors (or
//! the A operand in registers), and the shared-memory layout those descriptors read.
//!
//! A warpgroup is four consecutive warps; warp `w` of it owns rows `16w..16w + 16` of the
//! 64-row product, and within a warp the accumulator and register-A fragments are those of
//! `mma.sync` m16n8k16 ([`super::mma`]), repeated along N: accumulator `acc[j]` is the n8 tile
//! `j`. So the online softmax of the `mma.sync` forward runs unchanged on these registers.
//!
//! Tiles are stored for the 128-byte swizzle: the head is cut into blocks of 64 elements (128
//! bytes), each block a run of `rows` rows of 128 bytes, and chunk `c` (16 bytes) of row `r`
//! of a block sits at chunk `c ^ (r % 8)`; a tile starts 1024-byte aligned, so the swizzle the
//! hardware applies to an address (its bits 4–6 XOR bits 7–9) is this one. The same bytes are
//! a K-major operand (Q as A, K as B: rows are M or N, the head is the k dimension) and an
//! MN-major one (V as B: rows are the k dimension, the head is N).
use super::Half;
use super::mma::each;
use super::mma::{ldmatrix_x4, load_rows};
use core::arch::asm;

/// Bytes of one 8-row group of a tile (the swizzle's period).
const GROUP: u64 = 1024;

/// Byte offset of chunk `chunk` (16 bytes) of row `row` in a tile of `rows` rows.
#[inline(always)]
pub(crate) const fn swizzled(rows: usize, row: usize, chunk: usize) -> u32 {
    ((chunk / 8) * rows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) << 4)) as u32
}

/// A descriptor of the operand at shared address `addr`, its 8-row groups `sbo` bytes apart
/// and its 64-element blocks `lbo` bytes apart (read only for MN-major operands).
#[inline(always)]
const fn descriptor(addr: u32, lbo: u64, sbo: u64) -> u64 {
    ((addr as u64 & 0x3_ffff) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)
}

/// The descriptor of k-step `kk` (16 elements of the head) of a K-major tile at `tile`, of
/// `rows` rows: within a 64-element block a k-step is 32 bytes further along the rows.
#[inline(always)]
pub(crate) const fn k_major(tile: u32, rows: usize, kk: usize) -> u64 {
    descriptor(
        tile + ((kk / 4) * rows * 128 + (kk % 4) * 32) as u32,
        1 << 4,
        GROUP,
    )
}

/// The descriptor of k-step `kk` (rows `16kk..16kk + 16`) of an MN-major tile at `tile`, of
/// `rows` rows: its 64-element blocks (along N) `rows · 128` bytes apart.
#[inline(always)]
pub(crate) const fn mn_major(tile: u32, rows: usize, kk: usize) -> u64 {
    descriptor(tile + (kk * 16 * 128) as u32, (rows * 128) as u64, GROUP)
}

/// Starts copying `rows` rows of `D` 16-bit elements into the tile at shared address `tile`
/// (all `N` threads of the block call it): row `r` from `base + r·stride` elements, zeros for
/// rows `r ≥ valid`.
///
/// # Safety
/// `base` and `stride` are 16-byte aligned and rows `< valid` readable; `tile` is 1024-byte
/// aligned with room for the tile.
#[inline(always)]
pub(crate) unsafe fn load_tile<const D: usize, const N: usize>(
    tile: u32,
    base: u64,
    stride: usize,
    rows: usize,
    valid: usize,
    tid: usize,
) {
    unsafe {
        load_rows::<D, N>(tile, (base, stride), rows, valid, tid, |r, c| {
            swizzled(rows, r, c)
        })
    }
}

/// The register A fragments (`mma.sync`'s, see the module docs) of warp `warp`'s 16 rows of a
/// K-major tile of 64 rows at `tile`: k-step `kk` in `f[kk]` (`D / 16` of them). Lane `l`
/// names row `l % 16` of the warp's and chunk `2kk + l / 16`, the order of the four matrices.
///
/// # Safety
/// The tile has landed and a barrier followed; every lane of the warp executes it.
#[inline(always)]
pub(crate) unsafe fn a_frags<const D: usize>(tile: u32, warp: usize, lane: usize) -> [[u32; 4]; 8] {
    let row = 16 * warp + (lane & 15);
    let mut f = [[0u32; 4]; 8];
    each::<8>(|kk| {
        if kk < D / 16 {
            f[kk] = unsafe { ldmatrix_x4(tile + swizzled(64, row, 2 * kk + (lane >> 4))) };
        }
    });
    f
}

/// Makes this thread's completed shared-memory writes (`cp.async` included, once waited for)
/// visible to the async proxy that `wgmma` reads operands through; a barrier after it makes
/// the whole block's visible.
#[inline(always)]
pub(crate) fn proxy_fence() {
    // SAFETY: a memory fence.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) }
}

/// Orders the warpgroup's register writes before the `wgmma` that follow (needed before the
/// first `wgmma` of a group whose accumulators or A registers were written since).
#[inline(always)]
pub(crate) fn fence() {
    // SAFETY: a warpgroup-wide ordering instruction; every thread of the block executes it.
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) }
}

/// Two warpgroups of a block take turns at a step's first product (FA3's ping-pong): the
/// second waits here (named barrier 1) until the first has issued its own ([`turn_done`]), so
/// the tensor cores run the first's product before the second's and the first's softmax
/// overlaps the second's product instead of both waiting at once. A no-op for a lone
/// warpgroup. Every warpgroup calls it once per step, active or not. The forward's alone: the
/// backward's kernels, whose steps issue two or three products, measured slower with it.
#[inline(always)]
pub(crate) fn turn_wait(wg: usize, wgs: usize) {
    if wgs == 2 && wg == 1 {
        // SAFETY: a named barrier of both warpgroups' 256 threads; the first warpgroup arrives.
        // Each step starts at the block's barrier 0, so the first cannot arrive for the next
        // step before this wait has completed this one.
        unsafe { asm!("bar.sync 1, 256;", options(nostack)) }
    }
}

/// The first warpgroup's side of [`turn_wait`], after issuing its step's first product.
#[inline(always)]
pub(crate) fn turn_done(wg: usize, wgs: usize) {
    if wgs == 2 && wg == 0 {
        // SAFETY: as `turn_wait`; arriving does not block.
        unsafe { asm!("bar.arrive 1, 256;", options(nostack)) }
    }
}

/// Closes the group of `wgmma` issued since the last call.
#[inline(always)]
pub(crate) fn commit() {
    // SAFETY: as `fence`.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) }
}

/// `wgmma.wait_group 0` with `acc` passing through it: the accumulators' later reads depend on
/// the wait, so the compiler cannot move them before it.
macro_rules! wait_with {
    ($name:ident, $n:literal, $first:literal $($i:literal)*) => {
        /// Waits for every committed `wgmma` group of the warpgroup, then hands back `acc`.
        #[inline(always)]
        pub(crate) fn $name(acc: &mut [[f32; 4]; $n / 4]) {
            // SAFETY: the tiles of `acc` are its contiguous elements.
            let a = unsafe { &mut *(acc as *mut [[f32; 4]; $n / 4] as *mut [f32; $n]) };
            // SAFETY: as `fence`; the registers pass through unchanged.
            unsafe {
                asm!(
                    concat!("wgmma.wait_group.sync.aligned 0; // {", stringify!($first), "}"
                        $(, " {", stringify!($i), "}")*),
                    inout(reg32) a[$first], $(inout(reg32) a[$i],)*
                    options(nostack)
                )
            }
        }
    };
}

/// [`wait32`] or [`wait64`], by the tile count of `acc` (8 or 16).
#[inline(always)]
pub(crate) fn wait<const NT: usize>(acc: &mut [[f32; 4]; NT]) {
    const { assert!(NT == 8 || NT == 16) };
    let at = acc as *mut [[f32; 4]; NT];
    // SAFETY: `NT` is the tile count cast to (the const branch).
    unsafe {
        if NT == 8 {
            wait32(&mut *(at as *mut [[f32; 4]; 8]))
        } else {
            wait64(&mut *(at as *mut [[f32; 4]; 16]))
        }
    }
}

/// `acc (64×N) = acc·[accumulate] + A·B` for one k-step: A (64×16) and B (16×N, stored as
/// N rows of k) read from shared memory through the K-major descriptors `a` and `b`.
macro_rules! ss {
    ($name:ident, $shape:literal, $ty:literal, $n:literal, $first:literal $($i:literal)*) => {
        /// One `wgmma` with both operands K-major in shared memory.
        ///
        /// # Safety
        /// `a` and `b` describe landed, proxy-fenced tiles; every thread of the warpgroup
        /// executes it; `acc` is read only after a wait ([`wait32`], [`wait64`]).
        #[inline(always)]
        pub(crate) unsafe fn $name(acc: &mut [[f32; 4]; $n / 4], a: u64, b: u64, accumulate: bool) {
            // SAFETY: the tiles of `acc` are its contiguous elements.
            let d = unsafe { &mut *(acc as *mut [[f32; 4]; $n / 4] as *mut [f32; $n]) };
            unsafe {
                asm!(
                    concat!(
                        "{{ .reg .pred p; setp.ne.b32 p, {z}, 0; wgmma.mma_async.sync.aligned.", $shape, ".f32.",
                        $ty, ".", $ty, " {{{", stringify!($first), "}"
                        $(, ", {", stringify!($i), "}")*,
                        "}}, {a}, {b}, p, 1, 1, 0, 0; }}"
                    ),
                    inout(reg32) d[$first], $(inout(reg32) d[$i],)*
                    a = in(reg64) a, b = in(reg64) b, z = in(reg32) accumulate as u32,
                    options(nostack)
                )
            }
        }
    };
}

/// `acc (64×N) = acc·[accumulate] + A·B` for one k-step: A (64×16) in registers, B (16×N)
/// in shared memory through the descriptor `b`, MN-major (`$tb` 1) or K-major (0).
macro_rules! rs {
    ($name:ident, $shape:literal, $ty:literal, $tb:literal, $n:literal, $first:literal $($i:literal)*) => {
        /// One `wgmma` with A from registers and B in shared memory (see the macro).
        ///
        /// # Safety
        /// As the shared-memory form; `a` was written before the last [`fence`].
        #[inline(always)]
        pub(crate) unsafe fn $name(
            acc: &mut [[f32; 4]; $n / 4],
            a: &[u32; 4],
            b: u64,
            accumulate: bool,
        ) {
            // SAFETY: the tiles of `acc` are its contiguous elements.
            let d = unsafe { &mut *(acc as *mut [[f32; 4]; $n / 4] as *mut [f32; $n]) };
            unsafe {
                asm!(
                    concat!(
                        "{{ .reg .pred p; setp.ne.b32 p, {z}, 0; wgmma.mma_async.sync.aligned.", $shape, ".f32.", $ty, ".", $ty,
                        " {{{", stringify!($first), "}" $(, ", {", stringify!($i), "}")*,
                        "}}, {{{a0}, {a1}, {a2}, {a3}}}, {b}, p, 1, 1, ", $tb, "; }}"
                    ),
                    inout(reg32) d[$first], $(inout(reg32) d[$i],)*
                    a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2],
                    a3 = in(reg32) a[3], b = in(reg64) b, z = in(reg32) accumulate as u32,
                    options(nostack)
                )
            }
        }
    };
}

/// The register lists of 32 and 64 accumulators.
macro_rules! regs32 {
    ($m:ident $(, $arg:tt)*) => {
        $m!($($arg,)* 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27
            28 29 30 31);
    };
}
macro_rules! regs64 {
    ($m:ident $(, $arg:tt)*) => {
        $m!($($arg,)* 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27
            28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55
            56 57 58 59 60 61 62 63);
    };
}

regs32!(wait_with, wait32, 32);
regs64!(wait_with, wait64, 64);
regs32!(ss, ss_n64_bf16, "m64n64k16", "bf16", 32);
regs32!(ss, ss_n64_f16, "m64n64k16", "f16", 32);
regs64!(ss, ss_n128_bf16, "m64n128k16", "bf16", 64);
regs64!(ss, ss_n128_f16, "m64n128k16", "f16", 64);
regs32!(rs, rs_n64_bf16, "m64n64k16", "bf16", "1", 32);
regs32!(rs, rs_n64_f16, "m64n64k16", "f16", "1", 32);
regs64!(rs, rs_n128_bf16, "m64n128k16", "bf16", "1", 64);
regs64!(rs, rs_n128_f16, "m64n128k16", "f16", "1", 64);
regs32!(rs, rsk_n64_bf16, "m64n64k16", "bf16", "0", 32);
regs32!(rs, rsk_n64_f16, "m64n64k16", "f16", "0", 32);
regs64!(rs, rsk_n128_bf16, "m64n128k16", "bf16", "0", 64);
regs64!(rs, rsk_n128_f16, "m64n128k16", "f16", "0", 64);

/// `S = Q·Kᵀ` for a warpgroup's 64 query rows and `8·NT` keys (64 or 128) over a `D`-wide
/// head: `q` a K-major tile of 64 rows, `k` one of `8·NT`. Issued and committed, not waited
/// for.
///
/// # Safety
/// As [`ss_n64_bf16`].
#[inline(always)]
pub(crate) unsafe fn scores<T: Half, const D: usize, const NT: usize>(
    acc: &mut [[f32; 4]; NT],
    q: u32,
    k: u32,
) {
    const { assert!(NT == 8 || NT == 16) };
    fence();
    each::<8>(|kk| {
        if kk < D / 16 {
            let (a, b) = (k_major(q, 64, kk), k_major(k, 8 * NT, kk));
            let more = kk > 0;
            // SAFETY: `NT` is the tile count the product writes (the const branch).
            unsafe {
                if NT == 8 {
                    let acc = &mut *(acc as *mut [[f32; 4]; NT] as *mut [[f32; 4]; 8]);
                    match T::IS_BF16 {
                        true => ss_n64_bf16(acc, a, b, more),
                        false => ss_n64_f16(acc, a, b, more),
                    }
                } else {
                    let acc = &mut *(acc as *mut [[f32; 4]; NT] as *mut [[f32; 4]; 16]);
                    match T::IS_BF16 {
                        true => ss_n128_bf16(acc, a, b, more),
                        false => ss_n128_f16(acc, a, b, more),
                    }
                }
            }
        }
    });
    commit();
}

/// A store of `q`'s fragments to `at` predicated on `flag == 1`: an ordinary use of them after
/// each tile's products. Without it ptxas (12.9, 13.0) treats registers read only by `wgmma`
/// as dead after their last product in the loop body, and gives the next value (the packed P
/// of `O += P·V`) the same registers, so the next tile's `S = Q·Kᵀ` reads P.
#[inline(always)]
pub(crate) fn keep_alive(q: &[[u32; 4]; 8], flag: u32, at: u32) {
    each::<8>(|kk| {
        // SAFETY: `flag` is never 1 (the caller's); the store would write 16 bytes of the block's tile.
        unsafe {
            asm!(
                "{{ .reg .pred p; setp.eq.u32 p, {f}, 1; @p st.shared.v4.u32 [{a}], {{{q0}, {q1}, {q2}, {q3}}}; }}",
                f = in(reg32) flag, a = in(reg32) at, q0 = in(reg32) q[kk][0], q1 = in(reg32) q[kk][1],
                q2 = in(reg32) q[kk][2], q3 = in(reg32) q[kk][3], options(nostack)
            )
        }
    });
}

/// [`scores`] with Q's fragments in registers ([`a_frags`]): only K is read from shared
/// memory, half the operand bytes per product of the shared-memory form at 64 keys.
///
/// # Safety
/// As [`rsk_n64_bf16`].
#[inline(always)]
pub(crate) unsafe fn scores_rs<T: Half, const D: usize, const NT: usize>(
    acc: &mut [[f32; 4]; NT],
    q: &[[u32; 4]; 8],
    k: u32,
) {
    const { assert!(NT == 8 || NT == 16) };
    fence();
    each::<8>(|kk| {
        if kk < D / 16 {
            let b = k_major(k, 8 * NT, kk);
            let more = kk > 0;
            // SAFETY: `NT` is the tile count the product writes (the const branch).
            unsafe {
                if NT == 8 {
                    let acc = &mut *(acc as *mut [[f32; 4]; NT] as *mut [[f32; 4]; 8]);
                    match T::IS_BF16 {
                        true => rsk_n64_bf16(acc, &q[kk], b, more),
                        false => rsk_n64_f16(acc, &q[kk], b, more),
                    }
                } else {
                    let acc = &mut *(acc as *mut [[f32; 4]; NT] as *mut [[f32; 4]; 16]);
                    match T::IS_BF16 {
                        true => rsk_n128_bf16(acc, &q[kk], b, more),
                        false => rsk_n128_f16(acc, &q[kk], b, more),
                    }
                }
            }
        }
    });
    commit();
}

/// `O += P·V` for a warpgroup's 64 query rows over `8·NT` keys (64 or 128): `p` the score
/// tile's accumulators (rounded to `T` here, as the A operand), `v` an MN-major tile of `8·NT`
/// key rows of a `D`-wide head. Issued and committed, not waited for.
///
/// # Safety
/// As [`rs_n128_bf16`].
#[inline(always)]
pub(crate) unsafe fn pv<T: Half, const D: usize, const NT: usize>(
    o: &mut [[f32; 4]; 16],
    p: &[[f32; 4]; NT],
    v: u32,
) {
    const { assert!(NT == 8 || NT == 16) };
    let a: [[u32; 4]; 8] = core::array::from_fn(|kk| {
        if 2 * kk + 1 < NT {
            let (lo, hi) = (&p[2 * kk], &p[2 * kk + 1]);
            [
                T::pack2(lo[0], lo[1]),
                T::pack2(lo[2], lo[3]),
                T::pack2(hi[0], hi[1]),
                T::pack2(hi[2], hi[3]),
            ]
        } else {
            [0; 4]
        }
    });
    fence();
    each::<8>(|kk| {
        if kk < NT / 2 {
            let b = mn_major(v, 8 * NT, kk);
            unsafe {
                if D == 128 {
                    if T::IS_BF16 {
                        rs_n128_bf16(o, &a[kk], b, true)
                    } else {
                        rs_n128_f16(o, &a[kk], b, true)
                    }
                } else {
                    // SAFETY: the first 8 of the 16 tiles (the head's 64 columns).
                    let half = &mut *(o as *mut [[f32; 4]; 16] as *mut [[f32; 4]; 8]);
                    if T::IS_BF16 {
                        rs_n64_bf16(half, &a[kk], b, true)
                    } else {
                        rs_n64_f16(half, &a[kk], b, true)
                    }
                }
            }
        }
    });
    commit();
}
