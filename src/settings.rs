//! Launch settings for row-block kernels, as Liger-Kernel's `calculate_settings`.
use crate::error::{Result, invalid};

/// The widest row a single block handles (Liger's `MAX_FUSED_SIZE`).
///
/// ```
/// assert_eq!(liger_rs::MAX_FUSED_SIZE, 1 << 16);
/// ```
pub const MAX_FUSED_SIZE: usize = 65536;

/// Block shape for a kernel that gives one block to each row of `n_cols` columns.
///
/// ```
/// let s = liger_rs::calculate_settings(100).unwrap();
/// assert_eq!((s.block_size, s.num_warps, s.threads()), (128, 4, 128));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchSettings {
    /// Columns covered per block pass: the next power of two of `n_cols`.
    pub block_size: usize,
    /// Warps per block.
    pub num_warps: u32,
}

impl LaunchSettings {
    /// Threads per block (`num_warps × 32`).
    ///
    /// ```
    /// assert_eq!(liger_rs::calculate_settings(65536).unwrap().threads(), 1024);
    /// ```
    pub fn threads(&self) -> u32 {
        self.num_warps * 32
    }
}

/// Liger's row-block rule: `block_size` = next power of two of `n_cols`; warps = 32 if
/// `block_size ≥ 32768`, 16 if `≥ 8192`, 8 if `≥ 2048`, else 4.
///
/// Errors when `n_cols` is 0 or its block would exceed [`MAX_FUSED_SIZE`].
///
/// ```
/// let s = liger_rs::calculate_settings(4096).unwrap();
/// assert_eq!((s.block_size, s.num_warps), (4096, 8));
/// ```
pub fn calculate_settings(n_cols: usize) -> Result<LaunchSettings> {
    if n_cols == 0 || n_cols > MAX_FUSED_SIZE {
        return Err(invalid(
            "n_cols",
            format!("1 ..= {MAX_FUSED_SIZE} columns"),
            n_cols,
        ));
    }
    let block_size = n_cols.next_power_of_two();
    let num_warps = match block_size {
        32768.. => 32,
        8192.. => 16,
        2048.. => 8,
        _ => 4,
    };
    Ok(LaunchSettings {
        block_size,
        num_warps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_liger_table() {
        let table = [
            (1, 1, 4),
            (3, 4, 4),
            (1024, 1024, 4),
            (1025, 2048, 8),
            (2048, 2048, 8),
            (4097, 8192, 16),
            (8192, 8192, 16),
            (16384, 16384, 16),
            (16385, 32768, 32),
            (65536, 65536, 32),
        ];
        for (n, block, warps) in table {
            let s = calculate_settings(n).unwrap();
            assert_eq!((s.block_size, s.num_warps), (block, warps), "n_cols = {n}");
            assert_eq!(s.threads(), warps * 32);
        }
    }

    #[test]
    fn rejects_zero_and_too_wide() {
        for n in [0, MAX_FUSED_SIZE + 1, 1 << 20] {
            let e = calculate_settings(n).unwrap_err().to_string();
            assert!(e.contains("n_cols") && e.contains("65536"), "{e}");
        }
    }
}
