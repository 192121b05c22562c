//! Every kernel's identity and the constants that the host and the kernels must agree on.
//!
//! This file is compiled twice: as `kernels_gpu::identity`, where each kernel's entry name is
//! built at its instantiation from [`kernel_name!`] (`#[unsafe(export_name = …)]`), and by the
//! host crate through `#[path]` (from `packaging/kernels-gpu/src/`, as the package ships it),
//! whose launchers build the same names with [`Kernel::name`] and read the same constants. So
//! it depends on nothing and builds for both targets; the host's tests check that every name
//! its launchers can ask for is an entry of the PTX, and every entry one of those names.
//!
//! An entry name's variant names the kernel choice, in one vocabulary for every op. The *path*
//! is what a kernel's accesses need: *scalar* (any alignment and width: no name part), *vector*
//! (16-byte vectors on aligned pointers and strides, rows of whole vectors: `v`), and RoPE's
//! *general* (the forms its NeoX kernels do not take: `g`). A vector kernel's *grid* is how its
//! blocks cover the items (RMSNorm rows, SwiGLU tiles, RoPE token steps): a *resident grid*, as
//! many blocks as fit at once walking the items grid-stride (`v` alone), or a *whole grid*, one
//! item per block over a grid of every item (`vw`: RMSNorm's forward, SwiGLU, GEGLU), which the
//! host runs from four waves of items. RoPE's vector kernel keeps no next-item state and runs on
//! either grid; RMSNorm's backward `vs` is a resident grid with dW in shared memory.
//!
//! An entry name is its parts joined by `_`: the op, the direction, the variant (none for the
//! scalar kernels), the element type, then the op's last part (RMSNorm: the casting mode,
//! RoPE: the cos/sin rows, and `t32` for f32 tables with 16-bit q and k, GEGLU: the form of
//! GELU), e.g. `rms_norm_fwd_vw2_bf16_llama`,
//! `rms_norm_bwd_dx_v2_f16_none`, `rms_norm_add_fwd_vw2_bf16_llama` (the fused residual add),
//! `rope_bwd_g_f16_ids32`, `swiglu_fwd_vw_f32`, `geglu_bwd_v_bf16_erf`; RMSNorm's dW reduction
//! is `rms_norm_dw_reduce_{elem}`.

/// An enum whose values name parts of entry names, and a macro `$lit!(Value)` that gives the
/// same name as a literal for `concat!` (a value's name is spelt once, here).
macro_rules! names {
    (
        $(#[$doc:meta])*
        pub enum $name:ident / $lit:ident {
            $($(#[$vdoc:meta])* $value:ident = $text:literal,)*
        }
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $value,)*
        }

        impl $name {
            /// Every value, in declaration order.
            // Only the host's tests enumerate identities, and not of every enum.
            #[allow(dead_code)]
            pub const ALL: &'static [$name] = &[$($name::$value,)*];

            /// Its part of an entry name.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$value => $text,)*
                }
            }
        }

        /// The name of a value as a literal (see the enum of the same values).
        // The device crate's `export_name`s use these; the host uses the enum.
        #[allow(unused_macros)]
        macro_rules! $lit {
            $(($value) => { $text };)*
        }
        #[allow(unused_imports)]
        pub(crate) use $lit;
    };
}

names! {
    /// The op: the first part of every entry name.
    pub enum Op / op_name {
        /// RMSNorm and the fused residual add (`kernels-gpu/src/rms_norm/`).
        RmsNorm = "rms_norm",
        /// RoPE (`kernels-gpu/src/rope/`).
        Rope = "rope",
        /// SwiGLU (`kernels-gpu/src/glu/`, [`Gate::Silu`]).
        Swiglu = "swiglu",
        /// GEGLU (`kernels-gpu/src/glu/`, GELU's [`Gate`]s).
        Geglu = "geglu",
        /// Attention (`kernels-gpu/src/attention/`).
        Attention = "attn",
        /// Cross-entropy (`kernels-gpu/src/cross_entropy/`).
        CrossEntropy = "ce",
        /// The optimizers: AdamW, Adam and SGD (`kernels-gpu/src/adamw/`).
        AdamW = "adamw",
        /// Embedding lookup (`kernels-gpu/src/embedding/`).
        Embedding = "embedding",
    }
}

names! {
    /// The element type of an embedding's token ids: the last part of its entry name.
    pub enum IdType / id_type_name {
        /// `u32` (candle's usual ids).
        U32 = "u32",
        /// `i64` (PyTorch's).
        I64 = "i64",
    }
}

names! {
    /// What an optimizer kernel computes: the second part of its entry name.
    pub enum AdamWPass / adamw_pass_name {
        /// The AdamW/Adam update of θ, m, v (and the copy) over many tensors.
        Update = "step",
        /// [`AdamWPass::Update`] with bf16 moments.
        UpdateBf16States = "step16",
        /// The SGD update of θ and the momentum buffer (and the copy) over many tensors.
        Sgd = "sgd",
        /// Per-block sums of the squared gradients.
        SumSquares = "sumsq",
        /// The global norm and the clip factor from the sums (one block).
        Norm = "norm",
    }
}

names! {
    /// What a cross-entropy kernel computes: the second part of its entry name.
    pub enum CePass / ce_pass_name {
        /// Each row's loss and log-sum-exp, and its gradient when asked.
        Forward = "fwd",
        /// Each row's gradient from its saved log-sum-exp.
        Backward = "bwd",
        /// The mean's denominators and the class weights' sum (one block).
        Count = "count",
        /// The reduced loss from the per-row losses (one block).
        Reduce = "reduce",
    }
}

names! {
    /// A cross-entropy row kernel's path: the variant part of its entry name.
    pub enum CePath / ce_path_name {
        /// Element loads: any alignment and stride (no name part); no bias, class weights,
        /// label smoothing or softcap.
        Scalar = "",
        /// 16-byte vector loads and stores on 16-byte aligned rows; no bias, class weights,
        /// label smoothing or softcap.
        Vector = "v",
        /// As [`CePath::Scalar`], with every option.
        ScalarFull = "x",
        /// As [`CePath::Vector`], with every option.
        VectorFull = "vx",
        /// The forward with the gradient on rows staged in shared memory, as
        /// [`CePath::Vector`] (vocabularies of whole vectors), a row per block or per
        /// thread-block cluster (sm_90).
        Staged = "s",
    }
}

names! {
    /// What an attention kernel computes: the second part of its entry name.
    pub enum AttnPass / attn_pass_name {
        /// The forward: the output and each query row's log-sum-exp.
        Forward = "fwd",
        /// The backward's preprocessing: `Σ dO·O` of each query row.
        Prep = "bwd_pre",
        /// The backward's dQ.
        Dq = "bwd_dq",
        /// The backward's dK and dV, each block over every query head of its group.
        DkDv = "bwd_dkdv",
    }
}

names! {
    /// An attention kernel's path: the variant part of its entry name.
    pub enum AttnPath / attn_path_name {
        /// One warp per row, f32 arithmetic in CUDA cores: any element type, head_dim up to
        /// 256, any alignment (no name part).
        Simt = "",
        /// Tensor cores (`mma.sync` m16n8k16, `ldmatrix`, `cp.async`) at head_dim 64, 16-bit
        /// elements, 16-byte aligned rows.
        Mma64 = "mma64",
        /// As [`AttnPath::Mma64`] at head_dim 128.
        Mma128 = "mma128",
    }
}

names! {
    /// What an RMSNorm kernel computes: the pass part of its entry name.
    pub enum NormPass / norm_pass_name {
        /// The forward.
        Forward = "fwd",
        /// The backward, with dW partial rows.
        Backward = "bwd",
        /// The backward of dX alone, for a frozen or absent weight: no dW partial rows and no
        /// reduction.
        BackwardDx = "bwd_dx",
    }
}

names! {
    /// The row an RMSNorm kernel normalises: the part of its entry name before the pass.
    pub enum NormInput / norm_input_name {
        /// `x` (no name part).
        Plain = "",
        /// The fused residual add: the sum `s = x + r`, written out by the forward; the
        /// backward adds the sum's incoming gradient `ds` to dX.
        Add = "add",
    }
}

names! {
    /// The element type the kernel reads and writes.
    pub enum ElemType / elem_name {
        /// `f32`.
        F32 = "f32",
        /// IEEE half precision.
        F16 = "f16",
        /// bfloat16.
        Bf16 = "bf16",
    }
}

impl ElemType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::F16 | ElemType::Bf16 => 2,
        }
    }
}

names! {
    /// RMSNorm's casting mode as the kernels see it: the host's three, and Llama's cast points
    /// where `offset + w` is not exact in a 16-bit type (see [`packed_weight`]).
    pub enum Mode / mode_name {
        /// HF LlamaRMSNorm: f32 statistics, `D(x·r)` then the weight product.
        Llama = "llama",
        /// HF GemmaRMSNorm: everything in f32, one cast at the end.
        Gemma = "gemma",
        /// Everything in the tensor dtype.
        None = "none",
        /// Llama's cast points where the vector kernels form the weight product lane by lane in
        /// f32 (16-bit types with an offset other than ±0); the scalar kernels take any offset
        /// in [`Mode::Llama`].
        LlamaOffset = "llama_offset",
    }
}

names! {
    /// The grid of an RMSNorm vector kernel: the variant is this name followed by the 16-byte
    /// vectors per thread (`vw2`).
    pub enum RmsNormLayout / rms_norm_layout_name {
        /// A resident grid walks the rows, each block loading its next row early.
        Resident = "v",
        /// Forward, whole grid: one row per block over a grid of every row.
        Whole = "vw",
        /// Backward: a resident grid as [`RmsNormLayout::Resident`], each block's dW partial row
        /// in shared memory.
        SharedDw = "vs",
    }
}

names! {
    /// A RoPE kernel's path: the variant part of its name.
    pub enum RopePath / rope_path_name {
        /// NeoX halves in place, one element pair per thread (no name part).
        Scalar = "",
        /// NeoX halves in place, contiguous, full-width tables, 16-byte vectors, on a resident
        /// or a whole grid of token steps.
        Vector = "v",
        /// As [`RopePath::Vector`], token-major rows any stride apart, either table width,
        /// every row source.
        VectorAny = "va",
        /// As [`RopePath::VectorAny`] on interleaved pairs.
        VectorInterleaved = "vi",
        /// Every form, in place or not (interleaved pairs, head-major, half-width tables).
        General = "g",
    }
}

names! {
    /// Where a RoPE kernel takes a token's cos/sin row from: the last part of its name.
    pub enum Rows / rows_name {
        /// `[S, r]` tables shared by the batch: row = token mod seq_len.
        PerPosition = "pos",
        /// `[B, S, r]` tables: row = token.
        PerBatch = "batch",
        /// A `[max_pos, r]` table gathered through i32 position ids (clamped).
        IdsI32 = "ids32",
        /// As [`Rows::IdsI32`] with i64 ids.
        IdsI64 = "ids64",
        /// Qwen2-VL's multimodal RoPE: three `[B, S, r]` tables (t, h, w) one after another,
        /// row = token in the table that the pair's frequency section names (`_va` and general
        /// paths only).
        Multimodal = "mrope",
        /// Qwen2-VL's multimodal RoPE on a `[max_pos, r]` table gathered through i32 position
        /// ids `[3, B, S]` (t, h, w; clamped), each pair by its frequency section (`_va` and
        /// general paths only).
        MultimodalIdsI32 = "mrope_ids32",
        /// As [`Rows::MultimodalIdsI32`] with i64 ids.
        MultimodalIdsI64 = "mrope_ids64",
    }
}

names! {
    /// The element type of a RoPE kernel's cos/sin tables: the last part of its name.
    pub enum RopeTable / rope_table_name {
        /// q's and k's (no name part).
        Elem = "",
        /// f32, with f16 or bf16 q and k (HF's Llama 4 and Liger keep f32 tables).
        F32 = "t32",
    }
}

names! {
    /// What a GLU, RoPE or embedding kernel computes: the second part of its entry name.
    pub enum Pass / pass_name {
        /// The forward.
        Forward = "fwd",
        /// The backward.
        Backward = "bwd",
    }
}

names! {
    /// A GLU kernel's path and, for vectors, its grid: the variant part of its name.
    pub enum GluPath / glu_path_name {
        /// Any alignment, any shape (no name part).
        Scalar = "",
        /// 16-byte vectors on a resident grid, grid-stride over tiles.
        Vector = "v",
        /// 16-byte vectors on a whole grid: one tile per block over a grid of every tile.
        Whole = "vw",
    }
}

names! {
    /// A GLU kernel's gate: SiLU (the op SwiGLU, no last name part) or a form of GELU (the op
    /// GEGLU, the form its last part).
    pub enum Gate / gate_name {
        /// SiLU: SwiGLU.
        Silu = "",
        /// GELU's tanh approximation (PyTorch's `approximate="tanh"`): GEGLU.
        GeluTanh = "tanh",
        /// The exact GELU through the normal CDF (PyTorch's `approximate="none"`): GEGLU.
        GeluErf = "erf",
    }
}

impl Gate {
    /// The op whose kernels take this gate: the first part of their names.
    pub const fn op(self) -> Op {
        match self {
            Gate::Silu => Op::Swiglu,
            Gate::GeluTanh | Gate::GeluErf => Op::Geglu,
        }
    }
}

/// The shape of an RMSNorm forward or backward kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RmsNormShape {
    /// Scalar loads, any alignment and width (no name part).
    Scalar,
    /// `per_thread` 16-byte vectors per thread, on the grid `layout` names.
    Vector {
        /// The grid.
        layout: RmsNormLayout,
        /// 16-byte vectors of a row per thread.
        per_thread: usize,
    },
}

/// One kernel of the PTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// An RMSNorm forward or backward, of `x` or of the fused residual add's sum.
    RmsNorm {
        /// `x`, or the sum.
        input: NormInput,
        /// The pass.
        pass: NormPass,
        /// Scalar or vector.
        shape: RmsNormShape,
        /// The element type.
        elem: ElemType,
        /// The casting mode.
        mode: Mode,
    },
    /// RMSNorm's dW reduction.
    RmsNormDwReduce {
        /// The element type of dW.
        elem: ElemType,
    },
    /// A RoPE forward or backward.
    Rope {
        /// The pass.
        pass: Pass,
        /// The path.
        path: RopePath,
        /// The element type.
        elem: ElemType,
        /// The cos/sin rows.
        rows: Rows,
        /// The cos/sin element type.
        table: RopeTable,
    },
    /// A GLU forward or backward: SwiGLU or GEGLU, by its gate.
    Glu {
        /// The gate (and so the op).
        gate: Gate,
        /// The pass.
        pass: Pass,
        /// The path.
        path: GluPath,
        /// The element type.
        elem: ElemType,
    },
    /// A cross-entropy row kernel.
    CrossEntropy {
        /// [`CePass::Forward`] or [`CePass::Backward`].
        pass: CePass,
        /// The path.
        path: CePath,
        /// The element type of the logits and their gradient.
        elem: ElemType,
    },
    /// A cross-entropy one-block kernel: [`CePass::Count`] or [`CePass::Reduce`].
    CrossEntropyStats {
        /// The pass.
        pass: CePass,
    },
    /// An optimizer kernel.
    AdamW {
        /// The pass.
        pass: AdamWPass,
        /// The gradients' element type (none for [`AdamWPass::Norm`]).
        grad: Option<ElemType>,
        /// The weights' copy type (the updates only).
        copy: Option<ElemType>,
    },
    /// An embedding forward or backward.
    Embedding {
        /// The pass.
        pass: Pass,
        /// The element type of the table and the rows.
        elem: ElemType,
        /// The ids' type.
        ids: IdType,
    },
    /// An attention kernel.
    Attention {
        /// The pass.
        pass: AttnPass,
        /// The path ([`AttnPath::Simt`] for [`AttnPass::Prep`]).
        path: AttnPath,
        /// The element type.
        elem: ElemType,
    },
}

/// The name part of RMSNorm's dW reduction (`rms_norm_dw_reduce_{elem}`), as a literal.
macro_rules! dw_reduce_name {
    () => {
        "dw_reduce"
    };
}
#[allow(unused_imports)]
pub(crate) use dw_reduce_name;

/// A kernel's entry name from its parts, at compile time: the twin of [`Kernel::name`] for
/// `export_name`. `kernel_name!(RmsNorm, Plain Forward, Whole 2, Bf16, Llama)`, `kernel_name!(RmsNorm, Add Backward, SharedDw 1, F16, None)`,
/// `kernel_name!(RmsNorm, DwReduce, F32)`, `kernel_name!(Rope, Backward, General, F16, IdsI32)`,
/// `kernel_name!(Glu, Silu, Forward, Scalar, F32)`, `kernel_name!(Glu, GeluErf, Backward, Whole, Bf16)`
/// (a gate other than `Silu` is GELU's, whose op is GEGLU);
/// values as in the enums. Both crates mount
/// this file as `crate::identity`.
#[allow(unused_macros)]
macro_rules! kernel_name {
    (RmsNorm, DwReduce, $elem:ident) => {
        concat!($crate::identity::op_name!(RmsNorm), "_", $crate::identity::dw_reduce_name!(), "_",
            $crate::identity::elem_name!($elem))
    };
    (RmsNorm, Plain $pass:ident, Scalar, $elem:ident, $mode:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(RmsNorm), norm_pass_name($pass), elem_name($elem), mode_name($mode))
    };
    (RmsNorm, Plain $pass:ident, $layout:ident $k:literal, $elem:ident, $mode:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(RmsNorm), norm_pass_name($pass), kernel_name(@vector $layout $k),
            elem_name($elem), mode_name($mode))
    };
    (RmsNorm, $input:ident $pass:ident, Scalar, $elem:ident, $mode:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(RmsNorm), norm_input_name($input), norm_pass_name($pass), elem_name($elem),
            mode_name($mode))
    };
    (RmsNorm, $input:ident $pass:ident, $layout:ident $k:literal, $elem:ident, $mode:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(RmsNorm), norm_input_name($input), norm_pass_name($pass),
            kernel_name(@vector $layout $k), elem_name($elem), mode_name($mode))
    };
    (Rope, $pass:ident, Scalar, $elem:ident, $rows:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Rope), pass_name($pass), elem_name($elem), rows_name($rows))
    };
    (Rope, $pass:ident, $path:ident, $elem:ident, $rows:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Rope), pass_name($pass), rope_path_name($path), elem_name($elem),
            rows_name($rows))
    };
    (Rope, $pass:ident, $path:ident, $elem:ident, $rows:ident, $table:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Rope), pass_name($pass), rope_path_name($path), elem_name($elem),
            rows_name($rows), rope_table_name($table))
    };
    (Glu, Silu, $pass:ident, Scalar, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Swiglu), pass_name($pass), elem_name($elem))
    };
    (Glu, Silu, $pass:ident, $path:ident, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Swiglu), pass_name($pass), glu_path_name($path), elem_name($elem))
    };
    (Glu, $gate:ident, $pass:ident, Scalar, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Geglu), pass_name($pass), elem_name($elem), gate_name($gate))
    };
    (Glu, $gate:ident, $pass:ident, $path:ident, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Geglu), pass_name($pass), glu_path_name($path), elem_name($elem),
            gate_name($gate))
    };
    (Attention, $pass:ident, Simt, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Attention), attn_pass_name($pass), elem_name($elem))
    };
    (Attention, $pass:ident, $path:ident, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Attention), attn_pass_name($pass), attn_path_name($path), elem_name($elem))
    };
    (AdamW, $pass:ident) => {
        $crate::identity::kernel_name!(@join op_name(AdamW), adamw_pass_name($pass))
    };
    (AdamW, $pass:ident, $grad:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(AdamW), adamw_pass_name($pass), elem_name($grad))
    };
    (AdamW, $pass:ident, $grad:ident, None) => {
        $crate::identity::kernel_name!(@join
            op_name(AdamW), adamw_pass_name($pass), elem_name($grad))
    };
    (AdamW, $pass:ident, $grad:ident, $copy:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(AdamW), adamw_pass_name($pass), elem_name($grad), elem_name($copy))
    };
    (Embedding, $pass:ident, $elem:ident, $ids:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(Embedding), pass_name($pass), elem_name($elem), id_type_name($ids))
    };
    (CrossEntropy, $pass:ident) => {
        $crate::identity::kernel_name!(@join op_name(CrossEntropy), ce_pass_name($pass))
    };
    (CrossEntropy, $pass:ident, Scalar, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(CrossEntropy), ce_pass_name($pass), elem_name($elem))
    };
    (CrossEntropy, $pass:ident, $path:ident, $elem:ident) => {
        $crate::identity::kernel_name!(@join
            op_name(CrossEntropy), ce_pass_name($pass), ce_path_name($path), elem_name($elem))
    };
    // An RMSNorm vector kernel's variant: its layout's name, then its vectors per thread.
    (@vector $layout:ident $k:literal) => {
        concat!($crate::identity::rms_norm_layout_name!($layout), $k)
    };
    // The parts, each a name macro of this file and its argument, joined by `_`.
    (@join $first:ident($($arg:tt)*) $(, $part:ident($($args:tt)*))*) => {
        concat!(
            $crate::identity::$first!($($arg)*)
            $(, "_", $crate::identity::$part!($($args)*))*
        )
    };
}
#[allow(unused_imports)]
pub(crate) use kernel_name;

// The device needs names only at compile time (`kernel_name!`); formatting stays off its PTX.
#[cfg(not(target_arch = "nvptx64"))]
impl Kernel {
    /// The entry name: the parts that [`kernel_name!`] joins, in the same order.
    pub fn name(&self) -> String {
        let (variant, pass_part);
        let parts: [&str; 5] = match *self {
            Kernel::RmsNorm {
                input,
                pass,
                shape,
                elem,
                mode,
            } => {
                variant = match shape {
                    RmsNormShape::Scalar => String::new(),
                    RmsNormShape::Vector { layout, per_thread } => {
                        format!("{}{per_thread}", layout.name())
                    }
                };
                pass_part = match input {
                    NormInput::Plain => pass.name().to_string(),
                    _ => format!("{}_{}", input.name(), pass.name()),
                };
                [
                    Op::RmsNorm.name(),
                    &pass_part,
                    &variant,
                    elem.name(),
                    mode.name(),
                ]
            }
            Kernel::RmsNormDwReduce { elem } => {
                [Op::RmsNorm.name(), dw_reduce_name!(), "", elem.name(), ""]
            }
            Kernel::Rope {
                pass,
                path,
                elem,
                rows,
                ..
            } => [
                Op::Rope.name(),
                pass.name(),
                path.name(),
                elem.name(),
                rows.name(),
            ],
            Kernel::Glu {
                gate,
                pass,
                path,
                elem,
            } => [
                gate.op().name(),
                pass.name(),
                path.name(),
                elem.name(),
                gate.name(),
            ],
            Kernel::CrossEntropy { pass, path, elem } => [
                Op::CrossEntropy.name(),
                pass.name(),
                path.name(),
                elem.name(),
                "",
            ],
            Kernel::CrossEntropyStats { pass } => {
                [Op::CrossEntropy.name(), pass.name(), "", "", ""]
            }
            Kernel::AdamW { pass, grad, copy } => [
                Op::AdamW.name(),
                pass.name(),
                grad.map_or("", ElemType::name),
                copy.map_or("", ElemType::name),
                "",
            ],
            Kernel::Embedding { pass, elem, ids } => [
                Op::Embedding.name(),
                pass.name(),
                elem.name(),
                ids.name(),
                "",
            ],
            Kernel::Attention { pass, path, elem } => [
                Op::Attention.name(),
                pass.name(),
                path.name(),
                elem.name(),
                "",
            ],
        };
        // RoPE's table type follows its rows.
        let table = match *self {
            Kernel::Rope { table, .. } => table.name(),
            _ => "",
        };
        let parts: Vec<&str> = parts
            .into_iter()
            .chain([table])
            .filter(|p| !p.is_empty())
            .collect();
        parts.join("_")
    }
}

/// Whether RMSNorm has a [`RmsNormLayout::SharedDw`] backward of `elem` with `per_thread`
/// vectors per thread: f32 rows of two vectors per thread keep dW in registers (at 16384×2048
/// on an H200 `_v2`, 4 blocks per SM, measured +4 % over `_vs2`, 5).
pub const fn has_shared_dw(elem: ElemType, per_thread: usize) -> bool {
    elem.size() == 2 || per_thread == 1
}

/// f32 slots of dynamic shared memory that the RMSNorm kernels' block reductions use from
/// offset 0: one value per warp for each of two sums, in two sets that consecutive rows
/// alternate (one barrier per row). The `_vs` backward keeps its dW row after them.
pub const SUM_SLOTS: usize = 4 * 32;
