//! The embedding kernels' parameter block, defined once for both sides: the device crate
//! compiles this file as `kernels_gpu::embedding::abi`, the host crate mounts it through
//! `#[path]` as `crate::embedding::abi`.

/// Threads per block of both kernels.
pub const THREADS: u32 = 256;
/// Table rows one backward block sums (its accumulators, in registers).
pub const BWD_ROWS: usize = 16;
/// Columns per thread of a backward block: a block covers `THREADS · BWD_COLS_PER_THREAD`
/// columns of its rows.
pub const BWD_COLS_PER_THREAD: usize = 4;
/// Columns of a backward block.
pub const BWD_TILE_COLS: usize = THREADS as usize * BWD_COLS_PER_THREAD;
/// Warps per block.
pub const WARPS: usize = THREADS as usize / 32;
/// 32-bit words of dynamic shared memory the backward uses: two sets of per-warp match
/// counts (consecutive id chunks alternate, one barrier per chunk) and one chunk's matches.
pub const BWD_SHARED_WORDS: usize = 2 * WARPS + THREADS as usize;

/// Everything an embedding kernel reads. The forward reads `table` and writes `rows`
/// (`y[t] = table[ids[t]]`); the backward reads `rows` (dy) and writes `table` (dW).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Params {
    /// The token ids, `[tokens]`, u32 or i64.
    pub ids: u64,
    /// The table `[vocab, hidden]` (forward) or its gradient (backward), rows `table_stride`
    /// elements apart.
    pub table: u64,
    /// The gathered rows `[tokens, hidden]` (forward) or their gradient (backward), rows
    /// `rows_stride` elements apart.
    pub rows: u64,
    /// Tokens.
    pub tokens: u64,
    /// Rows of the table.
    pub vocab: u64,
    /// Elements of a row.
    pub hidden: u64,
    /// Elements from one table row to the next.
    pub table_stride: u64,
    /// Elements from one gathered row to the next.
    pub rows_stride: u64,
}
