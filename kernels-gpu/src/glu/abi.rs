//! The GLU kernels' parameter block and tile constants, defined once for both sides: the device
//! crate compiles this file as `kernels_gpu::glu::abi`, the host crate mounts it through
//! `#[path]` as `crate::glu::abi`. SwiGLU and GEGLU share it (the same kernels with another
//! gate).

/// Everything a GLU kernel reads. Pointers are device addresses of the element type; strides
/// count elements between the starts of consecutive rows.
///
/// The forward reads `a` (gate) and `b` (up) and writes `c`. The backward reads `c` (there the
/// incoming gradient `dc`), `a` and `b`, and writes `da` (rows `a_stride` apart) and `db`
/// (rows `b_stride` apart); in place `da = a` and `db = b`. The fused gate-up layout is
/// `b = a + cols` with `b_stride = a_stride`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Params {
    /// The gate.
    pub a: u64,
    /// The up projection.
    pub b: u64,
    /// The forward's output `c`, or the backward's incoming gradient `dc`.
    pub c: u64,
    /// The backward's gradient of `a` (0 in the forward).
    pub da: u64,
    /// The backward's gradient of `b` (0 in the forward).
    pub db: u64,
    /// Row stride of `a` and `da`.
    pub a_stride: u64,
    /// Row stride of `b` and `db`.
    pub b_stride: u64,
    /// Row stride of `c` (`dc`).
    pub c_stride: u64,
    /// Rows.
    pub rows: u64,
    /// Elements per row (≥ 1).
    pub cols: u64,
    /// `gm`: the gate is `z = a·gm`.
    pub gate_multiplier: f32,
    /// `dm`: the backward's incoming gradient is `dc·dm` (the forward ignores it).
    pub down_multiplier: f32,
}

/// Elements per thread per tile of the scalar kernels.
pub const ITEMS: usize = 4;
/// 16-byte vectors of each operand per thread per tile of the forward `_v` kernels.
pub const FWD_VECS: usize = 3;
/// The same for the backward `_v` kernels.
pub const BWD_VECS: usize = 3;
/// 16-byte vectors of each operand per thread of the forward `_vw` kernels: with no next
/// tile in registers they fit more than the `_v` kernels' [`FWD_VECS`].
pub const FWD_VECS_TILE: usize = 4;
/// Bytes of each vector of the backward `_vw` kernels (every element type). On an H200,
/// 8 bytes per thread per operand measured the highest DRAM throughput for this
/// five-stream pattern of every width (4, 8, 16 bytes), vector count (1, 2, 4) and block
/// size (128, 256) tried: +0.9 % (f32 16384×8192) and +1.5 % (bf16 2048×14336) over two
/// 16-byte vectors, level for 16-bit 16384×14336. The forward measured 1–6 % lower with
/// it and keeps 16 bytes.
pub const BWD_TILE_VECTOR_BYTES: usize = 8;
/// Vectors of [`BWD_TILE_VECTOR_BYTES`] of each operand per thread of the backward `_vw`
/// kernels.
pub const BWD_VECS_TILE: usize = 1;
