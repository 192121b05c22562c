//! The bad-input tables of every public launcher, shared by the GPU walk in
//! `tests/bad_input.rs` and the library's unit tests, which run the same rows through the
//! launchers' own checks with buffers as plain values (no GPU). See `tests/bad_input.rs` for
//! what a table is.
#![allow(dead_code)] // each includer uses its own part: the GPU walk, or the checks alone

use liger_rs::{
    CastingMode, CrossEntropyArgs, Error, Gelu, LinearCrossEntropyArgs, Reduction, RmsNormArgs,
    RopeArgs, SwigluArgs,
};
use std::collections::BTreeSet;

#[path = "tables/norm.rs"]
mod norm;
pub(crate) use norm::*;
#[path = "tables/rope.rs"]
mod rope;
pub(crate) use rope::*;
#[path = "tables/glu.rs"]
mod glu;
pub(crate) use glu::*;
#[path = "tables/cross_entropy.rs"]
mod cross_entropy;
pub(crate) use cross_entropy::*;

// ---------------------------------------------------------------- calls and rows

/// Element type of a buffer: the call's dtype `T` or a fixed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    T,
    F32,
    I32,
    I64,
}

impl Kind {
    pub(crate) fn size(self, t_size: usize) -> usize {
        match self {
            Kind::T => t_size,
            Kind::F32 | Kind::I32 => 4,
            Kind::I64 => 8,
        }
    }
}

/// What the launcher does with a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    In,
    Out,
    /// Read, then written in place.
    InOut,
}

/// Which end of another buffer an overlapping buffer covers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Edge {
    /// Its last element covers the start of the other.
    Head,
    /// Its first element covers the end of the other.
    Tail,
}

/// Where a buffer is placed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum At {
    /// Its own slot on device 0, through the stream's context handle.
    Own,
    /// Its own slot on device 0, through a second handle (`cuda_context(0)` again) on the
    /// same primary context.
    Twin,
    /// Its own slot on device 1 (another context).
    Other,
    /// Over one end of the named buffer.
    Over(&'static str, Edge),
}

pub(crate) struct Buf<A> {
    pub(crate) name: &'static str,
    pub(crate) kind: Kind,
    pub(crate) role: Role,
    /// Elements the call needs, from its scalars.
    pub(crate) need: fn(&A) -> usize,
    pub(crate) len: usize,
    pub(crate) at: At,
}

pub(crate) fn buf<A>(name: &'static str, kind: Kind, role: Role, need: fn(&A) -> usize) -> Buf<A> {
    Buf {
        name,
        kind,
        role,
        need,
        len: 0,
        at: At::Own,
    }
}

/// One call of a launcher: its scalars and its buffers, in signature order.
pub(crate) struct Call<A> {
    pub(crate) args: A,
    pub(crate) bufs: Vec<Buf<A>>,
}

impl<A> Call<A> {
    /// A call whose buffers hold exactly what `args` needs.
    pub(crate) fn new(args: A, bufs: Vec<Buf<A>>) -> Self {
        let mut call = Call { args, bufs };
        call.resize();
        call
    }

    pub(crate) fn resize(&mut self) {
        for b in &mut self.bufs {
            b.len = (b.need)(&self.args);
        }
    }

    pub(crate) fn buf(&mut self, name: &str) -> &mut Buf<A> {
        self.bufs
            .iter_mut()
            .find(|b| b.name == name)
            .unwrap_or_else(|| panic!("the call has no buffer `{name}`"))
    }

    pub(crate) fn remove(&mut self, name: &str) {
        let before = self.bufs.len();
        self.bufs.retain(|b| b.name != name);
        assert_eq!(
            self.bufs.len() + 1,
            before,
            "the call has no buffer `{name}`"
        );
    }
}

/// What a row's call must return.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Want {
    Ok,
    Invalid {
        arg: &'static str,
        /// A piece of `expected`.
        needle: &'static str,
    },
    Aliasing {
        output: &'static str,
        other: &'static str,
    },
    WrongContext {
        arg: &'static str,
    },
}

pub(crate) fn invalid(arg: &'static str, needle: &'static str) -> Want {
    Want::Invalid { arg, needle }
}

impl Want {
    /// The names it expects the error to carry.
    pub(crate) fn names(&self) -> Vec<&'static str> {
        match *self {
            Want::Ok => vec![],
            Want::Invalid { arg, .. } | Want::WrongContext { arg } => vec![arg],
            Want::Aliasing { output, other } => vec![output, other],
        }
    }

    pub(crate) fn renamed(self, f: impl Fn(&'static str) -> &'static str) -> Want {
        match self {
            Want::Ok => Want::Ok,
            Want::Invalid { arg, needle } => Want::Invalid {
                arg: f(arg),
                needle,
            },
            Want::Aliasing { output, other } => Want::Aliasing {
                output: f(output),
                other: f(other),
            },
            Want::WrongContext { arg } => Want::WrongContext { arg: f(arg) },
        }
    }
}

/// A row's change to the valid call.
pub(crate) type Change<A> = Box<dyn Fn(&mut Call<A>)>;

/// One table row: the argument walked, the change in words and in code, the outcome.
pub(crate) struct Row<A> {
    pub(crate) arg: &'static str,
    pub(crate) what: String,
    pub(crate) change: Change<A>,
    pub(crate) want: Want,
}

/// A table under construction.
pub(crate) struct Rows<A>(pub(crate) Vec<Row<A>>);

impl<A: 'static> Rows<A> {
    pub(crate) fn new() -> Self {
        Rows(Vec::new())
    }

    pub(crate) fn row(
        &mut self,
        arg: &'static str,
        what: &str,
        change: impl Fn(&mut Call<A>) + 'static,
        want: Want,
    ) {
        self.0.push(Row {
            arg,
            what: what.to_string(),
            change: Box::new(change),
            want,
        });
    }

    /// Changes the scalars only; the buffers stay as the valid call has them.
    pub(crate) fn field(
        &mut self,
        arg: &'static str,
        what: &str,
        change: impl Fn(&mut A) + 'static,
        want: Want,
    ) {
        self.row(arg, what, move |c| change(&mut c.args), want)
    }

    /// Changes the scalars, then gives every buffer what the new scalars need.
    pub(crate) fn reshape(
        &mut self,
        arg: &'static str,
        what: &str,
        change: impl Fn(&mut A) + 'static,
        want: Want,
    ) {
        let what = format!("{what}, every buffer resized to match");
        self.row(
            arg,
            &what,
            move |c| {
                change(&mut c.args);
                c.resize();
            },
            want,
        )
    }

    /// The buffer one element short: rejected naming it.
    pub(crate) fn short(&mut self, name: &'static str, needle: &'static str) {
        self.row(
            name,
            "one element short",
            move |c| c.buf(name).len -= 1,
            invalid(name, needle),
        )
    }

    /// The buffer one element long: `Ok` where a length is a minimum, rejected where it is
    /// exact.
    pub(crate) fn long(&mut self, name: &'static str, want: Want) {
        self.row(
            name,
            "one element long",
            move |c| c.buf(name).len += 1,
            want,
        )
    }
}

/// Every buffer from another context (rejected) and through a second handle on the stream's
/// own context (accepted).
pub(crate) fn context_rows<A: 'static>(rows: &mut Rows<A>, bufs: &[Buf<A>]) {
    for b in bufs {
        let name = b.name;
        rows.row(
            name,
            "from device 1 (another context)",
            move |c| c.buf(name).at = At::Other,
            Want::WrongContext { arg: name },
        );
        rows.row(
            name,
            "through a second handle on device 0's context",
            move |c| c.buf(name).at = At::Twin,
            Want::Ok,
        );
    }
}

/// Every pair of buffers overlapping at either end: an error naming the output first (the
/// earlier output when both are written), `Ok` when both are only read.
pub(crate) fn overlap_rows<A: 'static>(rows: &mut Rows<A>, bufs: &[Buf<A>]) {
    for (i, u) in bufs.iter().enumerate() {
        for v in &bufs[i + 1..] {
            let (moved, onto, want) = match (u.role, v.role) {
                (Role::In, Role::In) => (v.name, u.name, Want::Ok),
                (Role::In, _) => (
                    v.name,
                    u.name,
                    Want::Aliasing {
                        output: v.name,
                        other: u.name,
                    },
                ),
                _ => (
                    u.name,
                    v.name,
                    Want::Aliasing {
                        output: u.name,
                        other: v.name,
                    },
                ),
            };
            for edge in [Edge::Head, Edge::Tail] {
                let what = match edge {
                    Edge::Head => format!("its last element over the first of `{onto}`"),
                    Edge::Tail => format!("its first element over the last of `{onto}`"),
                };
                rows.row(
                    moved,
                    &what,
                    move |c| c.buf(moved).at = At::Over(onto, edge),
                    want,
                );
            }
        }
    }
}

/// One public launcher.
pub(crate) trait Op: Copy {
    /// Everything of a call that is not a buffer.
    type Args: PartialEq + 'static;
    fn name(self) -> &'static str;
    /// The valid call every row starts from.
    fn base(self) -> Call<Self::Args>;
    /// The written rows: scalars, lengths, combinations (context and overlap rows are
    /// generated).
    fn rows(self, rows: &mut Rows<Self::Args>);
    /// `Debug` of the library's args struct inside `Self::Args`.
    fn fields(args: &Self::Args) -> String;
    /// The launcher's name for a buffer (RoPE backward calls q and k dq and dk).
    fn rename(self, name: &'static str) -> &'static str {
        name
    }
}

/// The whole table of `op`: the valid call itself, the written rows, the generated ones.
pub(crate) fn table<O: Op>(op: O) -> Vec<Row<O::Args>> {
    let base = op.base();
    let mut rows = Rows::new();
    rows.row("(none)", "the valid call itself", |_| {}, Want::Ok);
    op.rows(&mut rows);
    context_rows(&mut rows, &base.bufs);
    overlap_rows(&mut rows, &base.bufs);
    rows.0
}

/// `(rows − 1) × stride + cols`, 0 without rows (saturating: resized calls are small).
pub(crate) fn span(rows: usize, cols: usize, stride: usize) -> usize {
    match rows {
        0 => 0,
        _ => (rows - 1).saturating_mul(stride).saturating_add(cols),
    }
}

// ---------------------------------------------------------------- placement

/// A buffer's bytes in an arena (0: device 0, 1: device 1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placed {
    pub(crate) name: &'static str,
    pub(crate) kind: Kind,
    pub(crate) role: Role,
    pub(crate) arena: usize,
    pub(crate) twin: bool,
    pub(crate) start: usize,
    pub(crate) bytes: usize,
    pub(crate) len: usize,
}

/// Places every buffer; returns the placements and the size of each arena. Own slots are
/// 256-byte aligned with a gap wider than any buffer around each, so that a buffer over one end
/// of another (its last element on the other's first, or its first on the other's last, at
/// its own alignment) overlaps nothing else.
pub(crate) fn place<A>(bufs: &[Buf<A>], t_size: usize) -> (Vec<Placed>, [usize; 2]) {
    const ALIGN: usize = 256;
    let bytes = |b: &Buf<A>| b.len * b.kind.size(t_size);
    let gap = bufs
        .iter()
        .map(bytes)
        .max()
        .unwrap_or(0)
        .next_multiple_of(ALIGN)
        + ALIGN;
    let mut end = [gap; 2];
    let mut placed = Vec::new();
    for b in bufs {
        let (arena, twin) = match b.at {
            At::Own => (0, false),
            At::Twin => (0, true),
            At::Other => (1, false),
            At::Over(..) => continue,
        };
        placed.push(Placed {
            name: b.name,
            kind: b.kind,
            role: b.role,
            arena,
            twin,
            start: end[arena],
            bytes: bytes(b),
            len: b.len,
        });
        end[arena] += bytes(b).next_multiple_of(ALIGN) + gap;
    }
    for b in bufs {
        let At::Over(onto, edge) = b.at else {
            continue;
        };
        let o = *placed
            .iter()
            .find(|p| p.name == onto)
            .unwrap_or_else(|| panic!("`{}` is over `{onto}`, which has no slot", b.name));
        let size = b.kind.size(t_size);
        let start = match edge {
            Edge::Head => o.start + size - bytes(b),
            Edge::Tail => (o.start + o.bytes - 1) / size * size,
        };
        placed.push(Placed {
            start,
            arena: o.arena,
            twin: false,
            name: b.name,
            kind: b.kind,
            role: b.role,
            bytes: bytes(b),
            len: b.len,
        });
    }
    (placed, end)
}

/// The pairs of buffers (names in order) that share a byte.
pub(crate) fn overlapping(placed: &[Placed]) -> BTreeSet<(&'static str, &'static str)> {
    let mut pairs = BTreeSet::new();
    for (i, p) in placed.iter().enumerate() {
        for q in &placed[i + 1..] {
            let shared = p.arena == q.arena
                && p.bytes > 0
                && q.bytes > 0
                && p.start < q.start + q.bytes
                && q.start < p.start + p.bytes;
            if shared {
                pairs.insert((p.name.min(q.name), p.name.max(q.name)));
            }
        }
    }
    pairs
}

/// Whether `got` is the error `want` describes.
pub(crate) fn rejected_as(got: &liger_rs::Result<()>, want: Want) -> bool {
    match (got, want) {
        (Err(Error::InvalidArgument { arg, expected, .. }), Want::Invalid { arg: a, needle }) => {
            *arg == a && expected.contains(needle)
        }
        (
            Err(Error::Aliasing { output, other }),
            Want::Aliasing {
                output: o,
                other: t,
            },
        ) => *output == o && *other == t,
        (Err(Error::WrongContext { arg }), Want::WrongContext { arg: a }) => *arg == a,
        _ => false,
    }
}

/// Every public launcher, by op.
pub(crate) const RMS: [Rms; 3] = [Rms::Forward, Rms::Backward, Rms::BackwardInplace];
pub(crate) const FUSED_ADD: [FusedAdd; 4] = [
    FusedAdd::Forward,
    FusedAdd::ForwardInplace,
    FusedAdd::Backward,
    FusedAdd::BackwardInplace,
];
pub(crate) const ROPE: [Rope; 6] = [
    Rope::Forward,
    Rope::Backward,
    Rope::ForwardInto,
    Rope::BackwardInto,
    Rope::ForwardFused,
    Rope::BackwardFused,
];
pub(crate) const SWIGLU: [Swiglu; 6] = [
    Swiglu::Forward,
    Swiglu::ForwardFused,
    Swiglu::Backward,
    Swiglu::BackwardInplace,
    Swiglu::BackwardFused,
    Swiglu::BackwardFusedInplace,
];
pub(crate) const GEGLU: [Geglu; 12] = [
    Geglu(Swiglu::Forward, Gelu::Tanh),
    Geglu(Swiglu::ForwardFused, Gelu::Tanh),
    Geglu(Swiglu::Backward, Gelu::Tanh),
    Geglu(Swiglu::BackwardInplace, Gelu::Tanh),
    Geglu(Swiglu::BackwardFused, Gelu::Tanh),
    Geglu(Swiglu::BackwardFusedInplace, Gelu::Tanh),
    Geglu(Swiglu::Forward, Gelu::Erf),
    Geglu(Swiglu::ForwardFused, Gelu::Erf),
    Geglu(Swiglu::Backward, Gelu::Erf),
    Geglu(Swiglu::BackwardInplace, Gelu::Erf),
    Geglu(Swiglu::BackwardFused, Gelu::Erf),
    Geglu(Swiglu::BackwardFusedInplace, Gelu::Erf),
];
pub(crate) const CE: [Ce; 5] = [
    Ce::Forward,
    Ce::ForwardBackward,
    Ce::ForwardBackwardInplace,
    Ce::Backward,
    Ce::BackwardInplace,
];
pub(crate) const FLCE: [Flce; 1] = [Flce];
