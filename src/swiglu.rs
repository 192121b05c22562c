//! SwiGLU (SiLU-mul) forward and backward launchers (kernels: `kernels-gpu/src/swiglu.rs`,
//! reference: [`crate::reference::swiglu`]).
//!
//! With `z = f32(a)·gm`: forward `c = T(T(silu(z)) · b)` (silu in f32, rounded to `T`, then the
//! product of two `T` values — Liger ≥ 0.6); backward, from `g = f32(dc)·dm`,
//! `db = T(g·silu(z))`, `da = T(g·silu'(z)·gm·b)` with `silu'(z) = σ(1 + z(1 − σ))`, all in f32.
//! silu never overflows or turns NaN for finite `z`: large negative `z` gives −0, large
//! positive `z` gives `z` (and `silu'` 0 and 1). One launch per call, no allocation, no
//! synchronisation.
//!
//! The down multiplier `dm` applies in the backward only: the forward writes `c`, the
//! backward the gradients of `c·dm` (see [`SwigluArgs::down_multiplier`]).
//!
//! The launch machinery here serves GEGLU too (`src/geglu.rs`): every public launcher of
//! either op is one [`run`] of its [`Launcher`], the op a [`Glu`] that picks the kernels.
use crate::dtype::Dtype;
use crate::error::{Result, invalid};
use crate::identity::swiglu::{
    BWD_TILE_VECTOR_BYTES, BWD_VECS, BWD_VECS_TILE, FWD_VECS, FWD_VECS_TILE, ITEMS,
};
use crate::identity::{Direction, GeluForm, Kernel, SwigluPath};
use crate::launch::whole_grid;
use crate::module::{Kernels, kernels};
use crate::validate::Role::{self, InPlace, Read, Written};
use crate::validate::{Buf, Need, Spec, Table, read, span, validate, write};
use cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

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

/// Shape and parameters of a SwiGLU call over `rows` rows of `cols` elements.
///
/// Separate layout ([`swiglu_forward`], [`swiglu_backward`], [`swiglu_backward_inplace`]):
/// rows of `a` and `da` start `a_stride` elements apart, rows of `b` and `db` `b_stride`
/// apart, rows of `c` and `dc` `c_stride` apart, so row-slices of larger buffers work.
///
/// Fused gate-up layout ([`swiglu_forward_fused`], [`swiglu_backward_fused`],
/// [`swiglu_backward_fused_inplace`]): one `[rows, 2·cols]` buffer with the gate in the first
/// `cols` elements of each row and the up projection in the next `cols`; its rows (and those
/// of its gradient) start `a_stride ≥ 2·cols` elements apart; `b_stride` is not used.
///
/// ```
/// use liger_rs::SwigluArgs;
/// let sep = SwigluArgs::new(8, 14336);
/// let fused = SwigluArgs::fused(8, 14336);
/// assert_eq!((sep.a_stride, fused.a_stride), (14336, 2 * 14336));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SwigluArgs {
    /// Number of rows (0 is allowed and launches nothing).
    pub rows: usize,
    /// Elements per row of `a`, `b` and `c` (≥ 1; no upper limit).
    pub cols: usize,
    /// `gm`: the gate is `z = a·gm` (finite; 1.0 for plain SwiGLU).
    pub gate_multiplier: f32,
    /// `dm` (finite; 1.0 for plain SwiGLU), backward only: the backward computes
    /// `g = f32(dc)·dm` and the gradients from `g`, so with `dc` the gradient of the loss with
    /// respect to `c·dm` it returns the gradients of `c·dm`. The forward does not apply it:
    /// it writes `c`, and multiplying by `dm` where the model does (the down projection's
    /// input) is the caller's; `liger_rs::candle`'s ops return `c·dm` themselves.
    pub down_multiplier: f32,
    /// Elements between the starts of consecutive rows of `a`/`da` (≥ `cols`), or of the
    /// fused gate-up buffer and its gradient (≥ `2·cols`).
    pub a_stride: usize,
    /// Elements between the starts of consecutive rows of `b`/`db` (≥ `cols`; separate layout).
    pub b_stride: usize,
    /// Elements between the starts of consecutive rows of `c`/`dc` (≥ `cols`).
    pub c_stride: usize,
}

impl SwigluArgs {
    /// Separate contiguous `a`, `b`, `c` of `rows × cols`; both multipliers 1.
    ///
    /// ```
    /// let args = liger_rs::SwigluArgs::new(2, 11008);
    /// assert_eq!((args.gate_multiplier, args.c_stride), (1.0, 11008));
    /// ```
    pub fn new(rows: usize, cols: usize) -> Self {
        SwigluArgs {
            rows,
            cols,
            gate_multiplier: 1.0,
            down_multiplier: 1.0,
            a_stride: cols,
            b_stride: cols,
            c_stride: cols,
        }
    }

    /// A contiguous fused gate-up buffer of `rows × 2·cols` (`a_stride = 2·cols`) and a
    /// contiguous `c` of `rows × cols`; both multipliers 1.
    ///
    /// ```
    /// let args = liger_rs::SwigluArgs::fused(2, 11008);
    /// assert_eq!((args.a_stride, args.c_stride), (22016, 11008));
    /// ```
    pub fn fused(rows: usize, cols: usize) -> Self {
        let stride = cols.saturating_mul(2);
        SwigluArgs {
            a_stride: stride,
            b_stride: stride,
            ..SwigluArgs::new(rows, cols)
        }
    }

    /// Sets the gate multiplier `gm`.
    ///
    /// ```
    /// assert_eq!(liger_rs::SwigluArgs::new(1, 8).with_gate_multiplier(0.5).gate_multiplier, 0.5);
    /// ```
    pub fn with_gate_multiplier(self, gate_multiplier: f32) -> Self {
        SwigluArgs {
            gate_multiplier,
            ..self
        }
    }

    /// Sets the down multiplier `dm` (backward only: see [`SwigluArgs::down_multiplier`]).
    ///
    /// ```
    /// assert_eq!(liger_rs::SwigluArgs::new(1, 8).with_down_multiplier(2.0).down_multiplier, 2.0);
    /// ```
    pub fn with_down_multiplier(self, down_multiplier: f32) -> Self {
        SwigluArgs {
            down_multiplier,
            ..self
        }
    }

    /// Sets the row strides of `a`/`da` (or the fused buffer), `b`/`db` and `c`/`dc`.
    ///
    /// ```
    /// let args = liger_rs::SwigluArgs::new(4, 8).with_strides(16, 8, 8); // a: 8 of every 16
    /// assert_eq!((args.a_stride, args.b_stride, args.c_stride), (16, 8, 8));
    /// ```
    pub fn with_strides(self, a_stride: usize, b_stride: usize, c_stride: usize) -> Self {
        SwigluArgs {
            a_stride,
            b_stride,
            c_stride,
            ..self
        }
    }

    fn check(&self) -> Result<()> {
        if self.cols == 0 {
            return Err(invalid("args.cols", "at least 1 column", 0));
        }
        if !self.gate_multiplier.is_finite() {
            return Err(invalid(
                "args.gate_multiplier",
                "a finite value",
                self.gate_multiplier,
            ));
        }
        if !self.down_multiplier.is_finite() {
            return Err(invalid(
                "args.down_multiplier",
                "a finite value",
                self.down_multiplier,
            ));
        }
        Ok(())
    }

    /// What `a`, `b` and `c` must hold in the separate layout.
    fn separate_needs(&self) -> Result<[Need; 3]> {
        self.check()?;
        Ok([
            Need::AtLeast(
                span("args.a_stride", self.rows, self.cols, self.a_stride)?,
                SPAN_A,
            ),
            Need::AtLeast(
                span("args.b_stride", self.rows, self.cols, self.b_stride)?,
                SPAN_B,
            ),
            Need::AtLeast(
                span("args.c_stride", self.rows, self.cols, self.c_stride)?,
                SPAN_C,
            ),
        ])
    }

    /// What the fused gate-up buffer and `c` must hold.
    fn fused_needs(&self) -> Result<[Need; 2]> {
        self.check()?;
        let width = self
            .cols
            .checked_mul(2)
            .ok_or_else(|| invalid("args.cols", "2 × cols within usize", self.cols))?;
        if self.a_stride < width {
            return Err(invalid(
                "args.a_stride",
                format!("fused row stride ≥ 2 × cols = {width}"),
                self.a_stride,
            ));
        }
        Ok([
            Need::AtLeast(
                span("args.a_stride", self.rows, width, self.a_stride)?,
                SPAN_FUSED,
            ),
            Need::AtLeast(
                span("args.c_stride", self.rows, self.cols, self.c_stride)?,
                SPAN_C,
            ),
        ])
    }

    /// The table of the call with `buffers`: the fused layout's spans if any buffer is fused,
    /// else the separate layout's; empty without rows.
    pub(crate) fn table<const N: usize>(&self, buffers: &Buffers<N>) -> Result<Table<N>> {
        let needs = match buffers.iter().any(|b| b.2 == Of::Fused) {
            true => {
                let [fused, c] = self.fused_needs()?;
                [None, None, Some(c), Some(fused)]
            }
            false => {
                let [a, b, c] = self.separate_needs()?;
                [Some(a), Some(b), Some(c), None]
            }
        };
        let specs = buffers.map(|(name, role, of)| Spec {
            name,
            role,
            need: needs[of as usize].expect("the constant tables mix no layouts"),
        });
        Ok(Table {
            specs,
            empty: self.rows == 0,
        })
    }
}

/// The span a buffer of a call covers: `a`'s, `b`'s or `c`'s rows, or fused gate-up rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Of {
    A,
    B,
    C,
    Fused,
}

/// A launcher's buffers in signature order: name, role and span.
pub(crate) type Buffers<const N: usize> = [(&'static str, Role, Of); N];

/// A launcher of both ops (`swiglu_*` and `geglu_*` of one layout and mode): its buffers in
/// signature order, and the launch their validated pointers make (with the element size in
/// bytes, which places a fused row's up half).
pub(crate) struct Launcher<const N: usize> {
    pub(crate) buffers: Buffers<N>,
    launch: fn(&SwigluArgs, [u64; N], u64) -> Launch,
}

/// The pointers of a forward or a backward launch.
enum Launch {
    Forward(Forward),
    Backward(Backward),
}

/// [`swiglu_forward`], [`crate::geglu_forward`].
pub(crate) const FORWARD: Launcher<3> = Launcher {
    buffers: [
        ("a", Read, Of::A),
        ("b", Read, Of::B),
        ("c", Written, Of::C),
    ],
    launch: |args, [a, b, c], _| Launch::Forward(Forward::separate(args, a, b, c)),
};
/// [`swiglu_forward_fused`], [`crate::geglu_forward_fused`].
pub(crate) const FORWARD_FUSED: Launcher<2> = Launcher {
    buffers: [("gate_up", Read, Of::Fused), ("c", Written, Of::C)],
    launch: |args, [gate_up, c], size| Launch::Forward(Forward::fused(args, gate_up, c, size)),
};
/// [`swiglu_backward`], [`crate::geglu_backward`].
pub(crate) const BACKWARD: Launcher<5> = Launcher {
    buffers: [
        ("dc", Read, Of::C),
        ("a", Read, Of::A),
        ("b", Read, Of::B),
        ("da", Written, Of::A),
        ("db", Written, Of::B),
    ],
    launch: |args, [dc, a, b, da, db], _| {
        Launch::Backward(Backward::separate(args, dc, [a, b], [da, db]))
    },
};
/// [`swiglu_backward_inplace`], [`crate::geglu_backward_inplace`].
pub(crate) const BACKWARD_INPLACE: Launcher<3> = Launcher {
    buffers: [
        ("dc", Read, Of::C),
        ("a", InPlace, Of::A),
        ("b", InPlace, Of::B),
    ],
    launch: |args, [dc, a, b], _| Launch::Backward(Backward::separate(args, dc, [a, b], [a, b])),
};
/// [`swiglu_backward_fused`], [`crate::geglu_backward_fused`].
pub(crate) const BACKWARD_FUSED: Launcher<3> = Launcher {
    buffers: [
        ("dc", Read, Of::C),
        ("gate_up", Read, Of::Fused),
        ("d_gate_up", Written, Of::Fused),
    ],
    launch: |args, [dc, gate_up, d_gate_up], size| {
        Launch::Backward(Backward::fused(args, dc, gate_up, d_gate_up, size))
    },
};
/// [`swiglu_backward_fused_inplace`], [`crate::geglu_backward_fused_inplace`].
pub(crate) const BACKWARD_FUSED_INPLACE: Launcher<2> = Launcher {
    buffers: [("dc", Read, Of::C), ("gate_up", InPlace, Of::Fused)],
    launch: |args, [dc, gate_up], size| {
        Launch::Backward(Backward::fused(args, dc, gate_up, gate_up, size))
    },
};

/// Validates `bufs` against `launcher`'s table, then launches `glu`'s kernel on their pointers
/// (nothing without rows): every public SwiGLU and GEGLU launcher is one call of this.
pub(crate) fn run<'b, T: Dtype, const N: usize>(
    stream: &'b Arc<CudaStream>,
    args: &SwigluArgs,
    glu: Glu,
    launcher: &Launcher<N>,
    bufs: [Option<Buf<'b, T>>; N],
) -> Result<()> {
    let table = args.table(&launcher.buffers)?;
    let Some(call) = validate(stream, &table, bufs)? else {
        return Ok(());
    };
    let size = std::mem::size_of::<T>() as u64;
    // `call` holds the buffers' guards until the launch is queued.
    match (launcher.launch)(args, call.ptrs, size) {
        Launch::Forward(p) => launch_forward::<T>(stream, args, glu, p),
        Launch::Backward(p) => launch_backward::<T>(stream, args, glu, p),
    }
}

const SPAN_A: &str = "(rows − 1) × a_stride + cols";
const SPAN_B: &str = "(rows − 1) × b_stride + cols";
const SPAN_C: &str = "(rows − 1) × c_stride + cols";
const SPAN_FUSED: &str = "(rows − 1) × a_stride + 2 × cols";

/// Byte offset of the up half in a fused row of `size`-byte elements.
fn up_offset(cols: usize, size: u64) -> u64 {
    cols as u64 * size
}

/// Threads per block: enough for `cols` at `ITEMS` per thread, 32 ..= 256.
fn threads_for(cols: usize) -> usize {
    cols.div_ceil(ITEMS)
        .next_power_of_two()
        .clamp(32, MAX_THREADS)
}

/// The op a launch runs: SwiGLU, or GEGLU with its form of GELU (`src/geglu.rs`); both take
/// every launcher, layout and kernel path of this file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Glu {
    Swiglu,
    Geglu(GeluForm),
}

/// Which kernels a launch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// `swiglu_{fwd,bwd}_{dtype}`: any alignment, any shape.
    Scalar,
    /// `swiglu_{fwd,bwd}_v_{dtype}` (grid-stride over tiles): 16-byte vectors, `per_thread` of
    /// each operand per thread per tile; or `_vw_` (one tile per block), shaped by [`Whole`].
    Vector { per_thread: usize },
}

impl Path {
    /// The vector path when `cols` is a multiple of the lanes per 16-byte vector, every
    /// pointer (including a fused layout's up half) is 16-byte aligned, every row stride is a
    /// whole number of vectors, and `rows`, `cols` and the strides fit the kernels' 32-bit
    /// indexing; otherwise the scalar path.
    fn choose<T>(
        rows: usize,
        cols: usize,
        ptrs: &[u64],
        strides: &[usize],
        per_thread: usize,
    ) -> Path {
        let size = std::mem::size_of::<T>();
        let lanes = 16 / size;
        let vector = cols.is_multiple_of(lanes)
            && rows <= VEC_MAX
            && cols <= VEC_MAX
            && ptrs.iter().all(|p| p.is_multiple_of(16))
            && strides
                .iter()
                .all(|&s| s <= VEC_MAX && (s * size).is_multiple_of(16));
        if vector {
            Path::Vector { per_thread }
        } else {
            Path::Scalar
        }
    }

    /// The kernel of `glu`; `whole_grid`: the vector path's one-tile-per-block twin.
    fn kernel<T: Dtype>(self, glu: Glu, direction: Direction, whole_grid: bool) -> Kernel {
        let path = match (self, whole_grid) {
            (Path::Scalar, _) => SwigluPath::Scalar,
            (Path::Vector { .. }, false) => SwigluPath::Vector,
            (Path::Vector { .. }, true) => SwigluPath::Whole,
        };
        let elem = T::ELEM;
        match glu {
            Glu::Swiglu => Kernel::Swiglu {
                direction,
                path,
                elem,
            },
            Glu::Geglu(form) => Kernel::Geglu {
                direction,
                path,
                elem,
                form,
            },
        }
    }
}

/// Kernel and launch shape (see [`launch_shape`]).
fn config<T: Dtype>(
    kernels: &Kernels,
    glu: Glu,
    path: Path,
    direction: Direction,
    whole: Whole,
    rows: usize,
    cols: usize,
) -> Result<(Kernel, LaunchConfig)> {
    let func = kernels.function(path.kernel::<T>(glu, direction, false))?;
    let shape = launch_shape::<T>(path, whole, rows, cols, |threads| {
        kernels.resident_blocks(&func, threads, 0)
    })?;
    let cfg = LaunchConfig {
        grid_dim: (shape.grid, 1, 1),
        block_dim: (shape.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((path.kernel::<T>(glu, direction, shape.whole), cfg))
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
/// grid-stride kernel's resident blocks at `threads` per block.
///
/// Scalar: `threads` per block for `cols` (see [`threads_for`]), a tile is `ITEMS · threads`
/// columns of one row. Vector: the `rows × cols / lanes` vectors form one flat range, a tile
/// is `per_thread · threads` consecutive vectors, up to 256 threads per block (16-byte
/// vectors; `_vw`: the `whole` tile, in its own vectors).
fn launch_shape<T>(
    path: Path,
    whole: Whole,
    rows: usize,
    cols: usize,
    resident: impl FnOnce(u32) -> Result<usize>,
) -> Result<Shape> {
    let vecs = |bytes: usize| rows as u64 * (cols * std::mem::size_of::<T>() / bytes) as u64;
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

/// Pointers and strides of one forward launch.
struct Forward {
    a: u64,
    a_stride: usize,
    b: u64,
    b_stride: usize,
    c: u64,
}

impl Forward {
    fn separate(args: &SwigluArgs, a: u64, b: u64, c: u64) -> Self {
        Forward {
            a,
            a_stride: args.a_stride,
            b,
            b_stride: args.b_stride,
            c,
        }
    }

    /// Gate and up halves of each fused row, rows `a_stride` apart.
    fn fused(args: &SwigluArgs, gate_up: u64, c: u64, size: u64) -> Self {
        Forward {
            a: gate_up,
            a_stride: args.a_stride,
            b: gate_up + up_offset(args.cols, size),
            b_stride: args.a_stride,
            c,
        }
    }
}

/// The function and launch shape of `glu`'s kernel in `direction` for a launch with these
/// pointers and row strides (see [`Path::choose`] and [`config`]).
fn prepare<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    glu: Glu,
    direction: Direction,
    ptrs: &[u64],
    strides: &[usize],
) -> Result<(CudaFunction, LaunchConfig)> {
    let (per_thread, whole) = match direction {
        Direction::Forward => (FWD_VECS, FWD_WHOLE),
        _ => (BWD_VECS, BWD_WHOLE),
    };
    let path = Path::choose::<T>(args.rows, args.cols, ptrs, strides, per_thread);
    let kernels = kernels(stream.context())?;
    let (kernel, cfg) = config::<T>(&kernels, glu, path, direction, whole, args.rows, args.cols)?;
    Ok((kernels.function(kernel)?, cfg))
}

fn launch_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    glu: Glu,
    p: Forward,
) -> Result<()> {
    let strides = [p.a_stride, p.b_stride, args.c_stride];
    let ptrs = [p.a, p.b, p.c];
    let (func, cfg) = prepare::<T>(stream, args, glu, Direction::Forward, &ptrs, &strides)?;
    let [a_stride, b_stride, c_stride] = strides.map(|s| s as u64);
    let (rows, cols) = (args.rows as u64, args.cols as u64);
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&p.a)
        .arg(&a_stride)
        .arg(&p.b)
        .arg(&b_stride)
        .arg(&p.c)
        .arg(&c_stride)
        .arg(&rows)
        .arg(&cols)
        .arg(&args.gate_multiplier);
    // SAFETY: argument order and types match `glu_kernel!`'s forward in kernels-gpu (scalar and
    // vector kernels alike; the vector kernel only where `Path::choose` found every pointer
    // and stride aligned and the shape within 32 bits, with `config`'s grid); the caller
    // checked that each pointer covers `rows` rows of its stride and `cols` columns and that
    // `c` overlaps no input; the guards of every pointer outlive this call.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Pointers and strides of one backward launch (`da` uses `a_stride`, `db` `b_stride`).
struct Backward {
    dc: u64,
    a: u64,
    a_stride: usize,
    b: u64,
    b_stride: usize,
    da: u64,
    db: u64,
}

impl Backward {
    /// `[a, b]` read, `[da, db]` written (the same pointers in place).
    fn separate(args: &SwigluArgs, dc: u64, [a, b]: [u64; 2], [da, db]: [u64; 2]) -> Self {
        Backward {
            dc,
            a,
            a_stride: args.a_stride,
            b,
            b_stride: args.b_stride,
            da,
            db,
        }
    }

    /// Gate and up halves of each fused row of the input and of the gradient.
    fn fused(args: &SwigluArgs, dc: u64, gate_up: u64, d_gate_up: u64, size: u64) -> Self {
        let up = up_offset(args.cols, size);
        Backward {
            dc,
            a: gate_up,
            a_stride: args.a_stride,
            b: gate_up + up,
            b_stride: args.a_stride,
            da: d_gate_up,
            db: d_gate_up + up,
        }
    }
}

fn launch_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    glu: Glu,
    p: Backward,
) -> Result<()> {
    let strides = [p.a_stride, p.b_stride, args.c_stride];
    let ptrs = [p.dc, p.a, p.b, p.da, p.db];
    let (func, cfg) = prepare::<T>(stream, args, glu, Direction::Backward, &ptrs, &strides)?;
    let [a_stride, b_stride, c_stride] = strides.map(|s| s as u64);
    let (rows, cols) = (args.rows as u64, args.cols as u64);
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&p.dc)
        .arg(&c_stride)
        .arg(&p.a)
        .arg(&a_stride)
        .arg(&p.b)
        .arg(&b_stride)
        .arg(&p.da)
        .arg(&p.db)
        .arg(&rows)
        .arg(&cols)
        .arg(&args.gate_multiplier)
        .arg(&args.down_multiplier);
    // SAFETY: argument order and types match `glu_kernel!`'s backward in kernels-gpu (scalar and
    // vector kernels alike, chosen as in the forward); the caller checked every pointer
    // against its stride and length, and that outputs overlap no input (in place, `da = a`
    // and `db = b` exactly: each element is read, then written, by the same thread); the
    // guards of every pointer outlive this call.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// SwiGLU forward, separate gate and up: `c = T(T(silu(a·gm)) · b)`, element-wise over
/// `rows × cols`; `args.down_multiplier` is not applied (backward only).
///
/// `a`, `b` and `c` hold `rows` rows at `args.a_stride`, `args.b_stride`, `args.c_stride`
/// (see [`SwigluArgs`]). `c` must not overlap `a` or `b`. One launch on `stream`, no
/// allocation, no synchronisation.
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_forward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 14336);
/// let gate = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let up = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let mut c = stream.alloc_zeros::<bf16>(rows * cols)?;
/// swiglu_forward(&stream, &SwigluArgs::new(rows, cols), &gate, &up, &mut c)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `c` is overwritten (the `cols` elements of each row; elements between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize`; or `a`, `b` or `c` is shorter than its rows need. Each
///   error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `a`, `b` or `c` belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `c` overlaps `a` or `b`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_forward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    run(
        stream,
        args,
        Glu::Swiglu,
        &FORWARD,
        [read(a), read(b), write(c)],
    )
}

/// SwiGLU forward from a fused gate-up buffer `[rows, 2·cols]` (gate first in each row, rows
/// `args.a_stride` apart) into `c` `[rows, cols]` (rows `args.c_stride` apart); otherwise as
/// [`swiglu_forward`].
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_forward_fused};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 11008);
/// let gate_up = stream.clone_htod(&vec![0.5f32; rows * 2 * cols])?;
/// let mut c = stream.alloc_zeros::<f32>(rows * cols)?;
/// swiglu_forward_fused(&stream, &SwigluArgs::fused(rows, cols), &gate_up, &mut c)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `c` is overwritten (the `cols` elements of each row; elements between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize` (`args.a_stride` below 2 × `cols` included); or `gate_up`
///   or `c` is shorter than its rows need. Each error names the argument and, where it has one, the
///   expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `gate_up` or `c` belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `c` overlaps `gate_up`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_forward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    gate_up: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    run(
        stream,
        args,
        Glu::Swiglu,
        &FORWARD_FUSED,
        [read(gate_up), write(c)],
    )
}

/// SwiGLU backward into separate buffers: `da` (rows at `args.a_stride`) and `db` (rows at
/// `args.b_stride`) from `dc` (rows at `args.c_stride`), recomputing silu from `a` and `b`.
///
/// With `g = dc·dm` and `z = a·gm` (f32): `db = g·silu(z)`, `da = g·silu'(z)·gm·b`, each
/// rounded once to `T`. `da` and `db` must not overlap each other or any input; use
/// [`swiglu_backward_inplace`] to write them over `a` and `b`. One launch, no allocation.
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward};
/// use liger_rs::half::bf16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 14336);
/// let a = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let b = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let dc = stream.clone_htod(&vec![bf16::ONE; rows * cols])?;
/// let (mut da, mut db) = (stream.alloc_zeros::<bf16>(rows * cols)?, stream.alloc_zeros::<bf16>(rows * cols)?);
/// swiglu_backward(&stream, &SwigluArgs::new(rows, cols), &dc, &a, &b, &mut da, &mut db)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// Overwritten, never accumulated into: `da` and `db` (the `cols` elements of each row; elements
/// between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize`; or `dc`, `a`, `b`, `da` or `db` is shorter than its rows
///   need. Each error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dc`, `a`, `b`, `da` or `db` belongs to
///   another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `da` or `db` overlaps the other, `dc`, `a` or
///   `b`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_backward<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    da: &mut impl DevicePtrMut<T>,
    db: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), read(a), read(b), write(da), write(db)];
    run(stream, args, Glu::Swiglu, &BACKWARD, bufs)
}

/// SwiGLU backward writing `da` over `a` and `db` over `b` (the memory-saving mode of
/// Liger's seed); otherwise as [`swiglu_backward`].
///
/// `a` and `b` must not overlap each other ([`crate::Error::Aliasing`]; an interleaved
/// gate-up buffer goes through [`swiglu_backward_fused_inplace`]), nor `dc`.
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward_inplace};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 4096);
/// let mut a = stream.clone_htod(&vec![0.5f32; rows * cols])?; // becomes da
/// let mut b = stream.clone_htod(&vec![2.0f32; rows * cols])?; // becomes db
/// let dc = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let args = SwigluArgs::new(rows, cols).with_down_multiplier(0.5);
/// swiglu_backward_inplace(&stream, &args, &dc, &mut a, &mut b)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `a` and `b` are overwritten with `da` and `db` (the `cols` elements of each row; elements
/// between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize`; or `dc`, `a` or `b` is shorter than its rows need. Each
///   error names the argument and, where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dc`, `a` or `b` belongs to another CUDA
///   context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `a` or `b` overlaps the other or `dc`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_backward_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    a: &mut impl DevicePtrMut<T>,
    b: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), write(a), write(b)];
    run(stream, args, Glu::Swiglu, &BACKWARD_INPLACE, bufs)
}

/// SwiGLU backward from a fused gate-up buffer into a separate fused gradient buffer
/// `d_gate_up` `[rows, 2·cols]` (`da` in the first `cols` of each row, `db` in the next;
/// rows `args.a_stride` apart, like `gate_up`). `d_gate_up` must not overlap `gate_up` or
/// `dc`; otherwise as [`swiglu_backward`].
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward_fused};
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 11008);
/// let gate_up = stream.clone_htod(&vec![0.5f32; rows * 2 * cols])?;
/// let dc = stream.clone_htod(&vec![1.0f32; rows * cols])?;
/// let mut d_gate_up = stream.alloc_zeros::<f32>(rows * 2 * cols)?;
/// swiglu_backward_fused(&stream, &SwigluArgs::fused(rows, cols), &dc, &gate_up, &mut d_gate_up)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `d_gate_up` is overwritten, never accumulated into: `da` and `db` in the `2 × cols` elements of
/// each row (elements between rows are not written).
///
/// # Errors
///
/// Checked before anything is launched, leaving every buffer untouched:
///
/// * [`Error::InvalidArgument`](crate::Error::InvalidArgument): `args.cols` is 0,
///   `args.gate_multiplier` or `args.down_multiplier` is not finite, a stride is below its row's
///   width or its rows span past `usize` (`args.a_stride` below 2 × `cols` included); or `dc`,
///   `gate_up` or `d_gate_up` is shorter than its rows need. Each error names the argument and,
///   where it has one, the expected value.
/// * [`Error::WrongContext`](crate::Error::WrongContext): `dc`, `gate_up` or `d_gate_up` belongs to
///   another CUDA context than `stream`.
/// * [`Error::Aliasing`](crate::Error::Aliasing): `d_gate_up` overlaps `dc` or `gate_up`.
///
/// From the driver:
///
/// * [`Error::Driver`](crate::Error::Driver): a CUDA driver call failed: loading a kernel into the
///   stream's context (at its first launch there) or the launch, which also fails once an earlier
///   kernel has faulted in the context.
pub fn swiglu_backward_fused<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    gate_up: &impl DevicePtr<T>,
    d_gate_up: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), read(gate_up), write(d_gate_up)];
    run(stream, args, Glu::Swiglu, &BACKWARD_FUSED, bufs)
}

/// SwiGLU backward writing the fused gradient over the fused gate-up buffer (`da` over the
/// gate half, `db` over the up half of each row); `dc` must not overlap `gate_up`.
/// Otherwise as [`swiglu_backward_fused`].
///
/// ```no_run
/// use liger_rs::{SwigluArgs, swiglu_backward_fused_inplace};
/// use liger_rs::half::f16;
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// let (rows, cols) = (8, 11008);
/// let mut gate_up = stream.clone_htod(&vec![f16::ONE; rows * 2 * cols])?; // becomes d_gate_up
/// let dc = stream.clone_htod(&vec![f16::ONE; rows * cols])?;
/// swiglu_backward_fused_inplace(&stream, &SwigluArgs::fused(rows, cols), &dc, &mut gate_up)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Outputs
///
/// `gate_up` is overwritten with the fused gradient: `da` and `db` in the `2 × cols` elements of
/// each row (elements between rows are not written).
///
/// # Errors
///
/// As [`swiglu_backward_fused`]'s, with `gate_up` read and written in place of `d_gate_up`:
/// `gate_up` overlapping `dc` is [`Error::Aliasing`](crate::Error::Aliasing).
pub fn swiglu_backward_fused_inplace<T: Dtype>(
    stream: &Arc<CudaStream>,
    args: &SwigluArgs,
    dc: &impl DevicePtr<T>,
    gate_up: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let bufs = [read(dc), write(gate_up)];
    run(stream, args, Glu::Swiglu, &BACKWARD_FUSED_INPLACE, bufs)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn vector_path_needs_alignment_whole_vectors_and_32_bit_shapes() {
        let v = Path::Vector { per_thread: 2 };
        let choose = |rows, cols, ptrs: &[u64], strides: &[usize]| {
            (
                Path::choose::<f32>(rows, cols, ptrs, strides, 2),
                Path::choose::<f16>(rows, cols, ptrs, strides, 2),
                Path::choose::<bf16>(rows, cols, ptrs, strides, 2),
            )
        };
        // Aligned, contiguous, whole vectors (4 f32 or 8 half lanes): every dtype.
        assert_eq!(choose(3, 11008, &[256, 512, 1024], &[11008; 3]), (v, v, v));
        assert_eq!(choose(2, 14336, &[256, 512, 1024], &[14336; 3]), (v, v, v));
        assert_eq!(choose(1000, 64, &[256, 512, 1024], &[64; 3]), (v, v, v));
        // Padded strides that stay whole vectors (8 elements: 32 or 16 bytes).
        assert_eq!(
            choose(9, 2048, &[256, 512, 1024], &[2056, 2064, 2072]),
            (v, v, v)
        );
        // Fused gate-up: the up half starts `cols` elements in, so it must be aligned too.
        let fused = |cols: usize, size: usize| [256, 256 + (cols * size) as u64, 4096];
        assert_eq!(
            Path::choose::<f32>(4, 20, &fused(20, 4), &[40, 40, 20], 2),
            v
        );
        assert_eq!(
            Path::choose::<bf16>(4, 24, &fused(24, 2), &[48, 48, 24], 2),
            v
        );
        assert_eq!(
            Path::choose::<bf16>(4, 20, &fused(20, 2), &[40, 40, 20], 2),
            Path::Scalar
        );
        // Whole vectors for f32 (4 lanes) but not for the half types (8 lanes).
        let s = Path::Scalar;
        assert_eq!(choose(5, 20, &[256, 512, 1024], &[24, 28, 32]), (v, s, s));
        // Partial vectors: the scalar kernels.
        assert_eq!(choose(2, 14337, &[256, 512, 1024], &[14337; 3]), (s, s, s));
        assert_eq!(choose(1, 3, &[256, 512, 1024], &[3; 3]), (s, s, s));
        assert_eq!(choose(33, 4097, &[256, 512, 1024], &[4097; 3]), (s, s, s));
        // A misaligned pointer (an offset view) or a stride that is not whole vectors.
        assert_eq!(choose(3, 11008, &[256, 520, 1024], &[11008; 3]), (s, s, s));
        assert_eq!(
            choose(3, 11008, &[256, 512, 1024], &[11008, 11010, 11008]),
            (s, s, s)
        );
        assert_eq!(
            choose(37, 1000, &[256, 512, 1024], &[1013, 1026, 1039]),
            (s, s, s)
        );
        // Beyond the vector kernels' 32-bit indexing.
        let big = VEC_MAX + 1;
        assert_eq!(choose(big, 8, &[256], &[8]), (s, s, s));
        assert_eq!(choose(2, 8, &[256], &[big.next_multiple_of(8)]), (s, s, s));
        assert_eq!(choose(2, VEC_MAX - 7, &[256], &[VEC_MAX - 7]), (v, v, v));
    }

    #[test]
    fn launch_shapes_pick_whole_grids_for_many_waves_of_vector_tiles() {
        let shape = |path, per_thread, rows, cols, resident: usize| {
            let whole = Whole {
                vector_bytes: 16,
                per_thread,
                max_threads: MAX_THREADS,
            };
            launch_shape::<bf16>(path, whole, rows, cols, |_| Ok(resident)).unwrap()
        };
        let v = Path::Vector { per_thread: 3 };
        // Scalar shapes (no whole vectors, even none at all): grid-stride, never `_vw`.
        for (rows, cols) in [(1, 1), (3, 1), (70_000, 3), (2, 14337), (1, 70001)] {
            let s = shape(Path::Scalar, 4, rows, cols, 396);
            assert!(
                !s.whole && s.grid >= 1 && s.grid <= 396,
                "{rows}×{cols}: {s:?}"
            );
            assert!(s.threads >= 32 && s.threads <= 256);
        }
        // Few tiles: grid-stride over at most one block per tile.
        let s = shape(v, 4, 3, 11008, 396);
        assert_eq!((s.whole, s.grid, s.threads), (false, 6, 256));
        // The benchmark shape: 16384 × 1792 vectors, 38229 tiles of 768 ≥ 4 × 396, so one
        // block per tile of 4 × 256 vectors or 2 × 256.
        let s = shape(v, 4, 16384, 14336, 396);
        assert_eq!((s.whole, s.grid, s.threads), (true, 28672, 256));
        let s = shape(v, 2, 16384, 14336, 396);
        assert_eq!((s.whole, s.grid, s.threads), (true, 57344, 256));
        // Just under four waves stays grid-stride.
        let s = shape(v, 4, 3 * 512, 8 * 256, 396);
        assert_eq!((s.whole, s.grid), (false, 396));
        // Beyond a 32-bit grid index the whole grid does not fit: grid-stride, capped.
        let s = shape(v, 4, 1 << 30, 64, 396);
        assert!(!s.whole && s.grid == 396);
        let s = shape(v, 4, usize::MAX >> 4, 8, usize::MAX >> 8);
        assert!(!s.whole && s.grid as u64 * 768 <= i32::MAX as u64);
        // Driver errors pass through.
        let err = launch_shape::<f32>(v, BWD_WHOLE, 8, 8, |_| Err(crate::Error::NoDriver));
        assert!(err.is_err());
        // The forward's `_vw` tiles: 4 16-byte vectors × 128 threads, here over 16384 rows of
        // 1792 vectors each.
        let s = launch_shape::<bf16>(v, FWD_WHOLE, 16384, 1792 * 8, |_| Ok(396));
        let s = s.unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 57344, 128));
        let s = launch_shape::<f32>(v, FWD_WHOLE, 16384, 1792 * 4, |_| Ok(396));
        let s = s.unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 57344, 128));
        // The backward's: one 8-byte vector × 256 threads, over 16384 rows of 3584 of them.
        let s = launch_shape::<bf16>(v, BWD_WHOLE, 16384, 3584 * 4, |_| Ok(396)).unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 229376, 256));
        let s = launch_shape::<f32>(v, BWD_WHOLE, 16384, 3584 * 2, |_| Ok(396)).unwrap();
        assert_eq!((s.whole, s.grid, s.threads), (true, 229376, 256));
    }

    /// Every kernel the launchers can ask for: each path and twin of each op (SwiGLU, both
    /// GEGLU forms), element type and direction.
    pub(crate) fn launchable_kernels() -> Vec<Kernel> {
        fn of<T: Dtype>(out: &mut Vec<Kernel>, glu: Glu) {
            for direction in [Direction::Forward, Direction::Backward] {
                for path in [Path::Scalar, Path::Vector { per_thread: 1 }] {
                    for whole in [false, true] {
                        out.push(path.kernel::<T>(glu, direction, whole));
                    }
                }
            }
        }
        let mut out = Vec::new();
        for glu in [
            Glu::Swiglu,
            Glu::Geglu(GeluForm::Tanh),
            Glu::Geglu(GeluForm::Erf),
        ] {
            of::<f32>(&mut out, glu);
            of::<f16>(&mut out, glu);
            of::<bf16>(&mut out, glu);
        }
        out
    }

    #[test]
    fn kernel_names_are_their_parts() {
        let v = Path::Vector { per_thread: 2 };
        let name = |k: Kernel| k.name();
        let (fwd, bwd) = (Direction::Forward, Direction::Backward);
        let (s, tanh, erf) = (
            Glu::Swiglu,
            Glu::Geglu(GeluForm::Tanh),
            Glu::Geglu(GeluForm::Erf),
        );
        assert_eq!(name(v.kernel::<bf16>(s, fwd, false)), "swiglu_fwd_v_bf16");
        assert_eq!(name(v.kernel::<f32>(s, bwd, false)), "swiglu_bwd_v_f32");
        assert_eq!(name(v.kernel::<f16>(s, bwd, true)), "swiglu_bwd_vw_f16");
        let scalar = Path::Scalar;
        assert_eq!(name(scalar.kernel::<f16>(s, fwd, false)), "swiglu_fwd_f16");
        assert_eq!(name(scalar.kernel::<f16>(s, fwd, true)), "swiglu_fwd_f16");
        assert_eq!(
            name(v.kernel::<bf16>(tanh, fwd, true)),
            "geglu_fwd_vw_bf16_tanh"
        );
        assert_eq!(
            name(v.kernel::<f32>(erf, bwd, false)),
            "geglu_bwd_v_f32_erf"
        );
        assert_eq!(
            name(scalar.kernel::<f16>(erf, bwd, true)),
            "geglu_bwd_f16_erf"
        );
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
    fn fused_spans_need_twice_the_columns() {
        let args = SwigluArgs::fused(3, 5);
        assert_eq!(
            args.fused_needs().unwrap(),
            [Need::AtLeast(30, SPAN_FUSED), Need::AtLeast(15, SPAN_C)]
        );
        let e = args.with_strides(9, 0, 5).fused_needs().unwrap_err();
        assert!(e.to_string().contains("2 × cols = 10"), "{e}");
        assert!(SwigluArgs::fused(1, usize::MAX).fused_needs().is_err());
        assert_eq!(
            SwigluArgs::new(2, 4)
                .with_strides(6, 5, 4)
                .separate_needs()
                .unwrap(),
            [
                Need::AtLeast(10, SPAN_A),
                Need::AtLeast(9, SPAN_B),
                Need::AtLeast(8, SPAN_C)
            ]
        );
    }

    #[test]
    fn gpu_h200_suite_shapes_take_their_documented_kernels() {
        // tests/swiglu.rs's SHAPES on an H200: 1300×8192 and 200001×56 have over four waves of
        // tiles and run the one-tile-per-block `_vw` kernels, 24000×56 the grid-stride `_v`
        // ones. The suite's buffers for these shapes are aligned (whole vectors per row), so
        // they take the vector path, where this starts.
        let Some((_ctx, k)) = crate::module::h200_kernels(
            "swiglu::tests::gpu_h200_suite_shapes_take_their_documented_kernels",
        ) else {
            return;
        };
        fn check<T: Dtype>(k: &Kernels) {
            for (rows, cols, twin) in [(1300, 8192, true), (200001, 56, true), (24000, 56, false)] {
                for (direction, per_thread, whole) in [
                    (Direction::Forward, FWD_VECS, FWD_WHOLE),
                    (Direction::Backward, BWD_VECS, BWD_WHOLE),
                ] {
                    let path = Path::Vector { per_thread };
                    let glu = Glu::Swiglu;
                    let (got, _) = config::<T>(k, glu, path, direction, whole, rows, cols).unwrap();
                    let want = path.kernel::<T>(glu, direction, twin);
                    assert_eq!(got.name(), want.name(), "{rows}×{cols}");
                }
            }
        }
        check::<bf16>(&k);
        check::<f16>(&k);
        check::<f32>(&k);
    }
}
