//! Which kernel an embedding call runs, on which grid: a pure function of the arguments and
//! the element types, unit-tested without a GPU.
use super::abi::{BWD_ROWS, BWD_SHARED_WORDS, BWD_TILE_COLS, THREADS};
use super::args::EmbeddingArgs;
use crate::error::{Result, invalid};
use crate::identity::{ElemType, IdType, Kernel, Pass};

/// The one launch of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) kernel: Kernel,
    pub(crate) grid: u32,
    pub(crate) block: u32,
    pub(crate) shared: u32,
}

/// The forward: a block per token (walking the tokens grid-stride past 2³¹ − 1).
pub(crate) fn forward(args: &EmbeddingArgs, elem: ElemType, ids: IdType) -> Step {
    Step {
        kernel: Kernel::Embedding {
            pass: Pass::Forward,
            elem,
            ids,
        },
        grid: args.tokens.min(i32::MAX as usize) as u32,
        block: THREADS,
        shared: 0,
    }
}

/// The backward: a block per [`BWD_ROWS`] table rows and [`BWD_TILE_COLS`] columns.
///
/// # Errors
/// More than 2³¹ − 1 blocks (a table of more than about 3.5·10¹³ elements).
pub(crate) fn backward(args: &EmbeddingArgs, elem: ElemType, ids: IdType) -> Result<Step> {
    let blocks = args.vocab.div_ceil(BWD_ROWS) as u64 * args.hidden.div_ceil(BWD_TILE_COLS) as u64;
    if blocks > i32::MAX as u64 {
        return Err(invalid(
            "args",
            "a table of at most 2³¹ − 1 blocks of 16 rows × 1024 columns",
            format!("{} × {}", args.vocab, args.hidden),
        ));
    }
    Ok(Step {
        kernel: Kernel::Embedding {
            pass: Pass::Backward,
            elem,
            ids,
        },
        grid: blocks as u32,
        block: THREADS,
        shared: (4 * BWD_SHARED_WORDS) as u32,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every kernel a call can plan.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let args = EmbeddingArgs::new(1, 1, 1);
        let mut v = Vec::new();
        for &elem in ElemType::ALL {
            for &ids in IdType::ALL {
                v.push(forward(&args, elem, ids).kernel);
                v.push(backward(&args, elem, ids).unwrap().kernel);
            }
        }
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
    fn grids_cover_the_tokens_and_the_table() {
        let args = EmbeddingArgs::new(8192, 32000, 2048);
        let f = forward(&args, ElemType::Bf16, IdType::U32);
        assert_eq!((f.grid, f.block, f.shared), (8192, 256, 0));
        assert_eq!(f.kernel.name(), "embedding_fwd_bf16_u32");
        let b = backward(&args, ElemType::F32, IdType::I64).unwrap();
        // 2000 row blocks × 2 column tiles.
        assert_eq!((b.grid, b.block, b.shared), (4000, 256, 4 * (16 + 256)));
        assert_eq!(b.kernel.name(), "embedding_bwd_f32_i64");
        let odd = EmbeddingArgs::new(3, 17, 1025);
        assert_eq!(
            backward(&odd, ElemType::F16, IdType::U32).unwrap().grid,
            2 * 2
        );
        let huge = EmbeddingArgs::new(1, 1 << 40, 1 << 20);
        assert!(backward(&huge, ElemType::F16, IdType::U32).is_err());
        let many = EmbeddingArgs::new(1 << 33, 2, 2);
        assert_eq!(
            forward(&many, ElemType::F16, IdType::U32).grid,
            i32::MAX as u32
        );
    }
}
