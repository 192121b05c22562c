//! Which launches a step runs: tensors in groups of up to [`TENSORS`], each group one launch
//! of blocks of [`BLOCK_ELEMS`] elements. A pure function of the lengths, unit-tested without
//! a GPU.
use super::abi::{BLOCK_ELEMS, TENSORS};
use crate::error::{Result, invalid};
use crate::identity::{AdamWPass, ElemType, Kernel};

/// One launch: the tensors `start..start + first_blocks.len()` of the call, each tensor's
/// first block, and the blocks in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) start: usize,
    pub(crate) first_blocks: Vec<u64>,
    pub(crate) blocks: u32,
}

/// The launches over tensors of `lens` elements.
///
/// # Errors
/// A group of more than 2³¹ − 1 blocks (a tensor of more than 8.8·10¹² elements).
pub(crate) fn groups(lens: &[usize]) -> Result<Vec<Group>> {
    let mut out = Vec::new();
    for (g, chunk) in lens.chunks(TENSORS).enumerate() {
        let mut first_blocks = Vec::with_capacity(chunk.len());
        let mut blocks = 0u64;
        for &len in chunk {
            first_blocks.push(blocks);
            blocks += (len as u64).div_ceil(BLOCK_ELEMS);
        }
        if blocks > i32::MAX as u64 {
            return Err(invalid(
                "tensors",
                "at most 2³¹ − 1 blocks of 4096 per launch",
                blocks,
            ));
        }
        out.push(Group {
            start: g * TENSORS,
            first_blocks,
            blocks: blocks as u32,
        });
    }
    Ok(out)
}

/// The update kernel of `pass` (AdamW's or SGD's) for gradients of `grad` and copies of
/// `copy`.
pub(crate) fn update(pass: AdamWPass, grad: ElemType, copy: Option<ElemType>) -> Kernel {
    Kernel::AdamW {
        pass,
        grad: Some(grad),
        copy,
    }
}

/// The sum-of-squares kernel for gradients of `grad`.
pub(crate) fn sum_squares(grad: ElemType) -> Kernel {
    Kernel::AdamW {
        pass: AdamWPass::SumSquares,
        grad: Some(grad),
        copy: None,
    }
}

/// The norm kernel.
pub(crate) const NORM: Kernel = Kernel::AdamW {
    pass: AdamWPass::Norm,
    grad: None,
    copy: None,
};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every kernel a call can plan.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        let mut v = vec![NORM];
        for g in ElemType::ALL.iter().copied() {
            v.push(sum_squares(g));
            for pass in [
                AdamWPass::Update,
                AdamWPass::UpdateBf16States,
                AdamWPass::Sgd,
            ] {
                v.push(update(pass, g, None));
                v.push(update(pass, g, Some(ElemType::F16)));
                v.push(update(pass, g, Some(ElemType::Bf16)));
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
    fn tensors_go_in_groups_of_32_in_blocks_of_4096() {
        let lens: Vec<usize> = (0..70).map(|i| i * 1000).collect();
        let g = groups(&lens).unwrap();
        assert_eq!(g.len(), 3);
        assert_eq!((g[0].start, g[1].start, g[2].start), (0, 32, 64));
        // 0, 1000, 2000, 3000, 4000 elements: 0, 1, 1, 1, 1 blocks.
        assert_eq!(&g[0].first_blocks[..6], &[0, 0, 1, 2, 3, 4]);
        assert_eq!(g[2].first_blocks.len(), 6);
        let total: u64 = lens[64..].iter().map(|&l| (l as u64).div_ceil(4096)).sum();
        assert_eq!(g[2].blocks as u64, total);
        assert!(groups(&[]).unwrap().is_empty());
        assert_eq!(
            update(AdamWPass::Update, ElemType::Bf16, None).name(),
            "adamw_step_bf16"
        );
        assert_eq!(
            update(AdamWPass::Update, ElemType::F32, Some(ElemType::Bf16)).name(),
            "adamw_step_f32_bf16"
        );
        assert_eq!(
            update(AdamWPass::Sgd, ElemType::F16, None).name(),
            "adamw_sgd_f16"
        );
        assert_eq!(NORM.name(), "adamw_norm");
    }
}
