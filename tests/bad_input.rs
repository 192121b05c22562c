//! Bad input never reaches a kernel. For every public launcher one table (in
//! `bad_input/tables/`, by op family; how each launcher runs here in `bad_input/launch.rs`)
//! starts from a valid call and walks every argument: each row changes the call in one way (an args field out of
//! range, a buffer one element short or long, an unsupported combination, two buffers that
//! overlap, a buffer from another CUDA context) and names what must come back: `Ok`, or the
//! error variant, the argument it names and a piece of the expected value. Context and overlap
//! rows are generated from each call's buffer list (every buffer from device 1 and through a
//! second handle on device 0's context; every pair of buffers overlapping at either end,
//! forbidden exactly when one of them is written).
//!
//! Every buffer of a call lives in one arena filled with 0xFF bytes (NaN in every dtype), with
//! seeded data in the buffers the call reads. A rejected call must leave the arena bit for bit
//! as it was: nothing was launched. An accepted call must write every element of its outputs
//! that its arguments name (none may keep the 0xFF bytes) and change no other byte: not its
//! inputs, not the gaps between strided rows, not an element past what it needs, not the
//! arena between buffers. A buffer it reads and writes in place, whose new values may equal
//! the old, must change in every row it writes and nowhere else.
//!
//! `the_tables_walk_every_argument` checks the tables themselves, without a GPU: every buffer
//! is walked one short and one long, every field of the args struct is changed by some row,
//! every name a row expects is an argument of the call, and each row's buffers overlap exactly
//! where the row says. The library's unit tests (`src/bad_input.rs`) run the same rows
//! through each launcher's checks with buffers as plain values, so every row's outcome is
//! checked without a GPU too; what only this walk shows is that nothing is launched on a
//! rejection and that an accepted call writes what it must and nothing else, with real
//! contexts and memory. `the_written_regions_end_where_the_buffers_do` checks, without a GPU,
//! that what the walk expects an accepted call to write ends where the buffer's needed length
//! does.
mod common;
#[path = "bad_input/launch.rs"]
mod launch;
#[path = "bad_input/tables.rs"]
mod tables;

use common::glu::{Op as Glu, glu_call};
use common::{Failures, Need, Rng, gpu, skip};
use half::{bf16, f16};
use liger_rs::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use liger_rs::{
    CosSinLayout, Dtype, Error, PositionIds, RmsNormArgs, SwigluArgs, fused_add_rms_norm_backward,
    fused_add_rms_norm_backward_inplace, fused_add_rms_norm_forward,
    fused_add_rms_norm_forward_inplace, rms_norm_backward, rms_norm_backward_inplace,
    rms_norm_forward, rope_backward, rope_backward_into, rope_forward, rope_forward_into,
};
use liger_rs::{
    CrossEntropyArgs, cross_entropy_backward, cross_entropy_backward_inplace,
    cross_entropy_forward, cross_entropy_forward_backward, cross_entropy_forward_backward_inplace,
};
// The fused RoPE launchers, apart from the shared list above.
use launch::*;
use liger_rs::{rope_backward_fused, rope_forward_fused};
use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use tables::*;

type Stream = Arc<CudaStream>;

// ---------------------------------------------------------------- running a row

/// Device 0's stream, a second handle on its context, and device 1's stream if there is one.
struct Gpu {
    stream: Stream,
    twin: Stream,
    other: Result<Stream, Error>,
}

impl Gpu {
    fn open(test: &str) -> Option<Gpu> {
        let stream = gpu(test)?;
        let twin = liger_rs::cuda_context(0).expect("device 0 again");
        let other = liger_rs::cuda_context(1).map(|ctx| ctx.default_stream());
        Some(Gpu {
            stream,
            twin: twin.default_stream(),
            other,
        })
    }
}

/// Device memory holding every buffer of a call placed in it; starts as 0xFF bytes.
struct Arena {
    stream: Stream,
    mem: CudaSlice<u8>,
}

impl Arena {
    fn new(stream: &Stream, bytes: usize) -> Arena {
        let mem = stream.clone_htod(&vec![0xFFu8; bytes]).expect("arena");
        Arena {
            stream: stream.clone(),
            mem,
        }
    }

    fn ptr(&self) -> u64 {
        let (ptr, _guard) = self.mem.device_ptr(&self.stream);
        ptr
    }

    fn bytes(&self) -> Vec<u8> {
        self.stream.clone_dtoh(&self.mem).expect("download arena")
    }
}

/// A handle on part of an arena. Dropping it releases the handle (its events and stream), not
/// the memory: the arena owns that.
struct Handle<E>(Option<CudaSlice<E>>);

impl<E> Drop for Handle<E> {
    fn drop(&mut self) {
        if let Some(slice) = self.0.take() {
            slice.leak();
        }
    }
}

impl<E> Deref for Handle<E> {
    type Target = CudaSlice<E>;

    fn deref(&self) -> &CudaSlice<E> {
        self.0.as_ref().expect("a live handle")
    }
}

impl<E> DerefMut for Handle<E> {
    fn deref_mut(&mut self) -> &mut CudaSlice<E> {
        self.0.as_mut().expect("a live handle")
    }
}

enum Slice<T> {
    T(Handle<T>),
    F32(Handle<f32>),
    I32(Handle<i32>),
    I64(Handle<i64>),
}

/// The buffers of one call, handed to the launcher by name.
struct Live<T> {
    slices: Vec<(&'static str, Slice<T>)>,
}

impl<T> Live<T> {
    fn take(&mut self, name: &str) -> Option<Slice<T>> {
        let i = self.slices.iter().position(|(n, _)| *n == name)?;
        Some(self.slices.swap_remove(i).1)
    }

    fn opt_t(&mut self, name: &str) -> Option<Handle<T>> {
        self.take(name).map(|s| match s {
            Slice::T(s) => s,
            _ => panic!("`{name}` is not of the call's dtype"),
        })
    }

    fn t(&mut self, name: &str) -> Handle<T> {
        self.opt_t(name)
            .unwrap_or_else(|| panic!("the call has no buffer `{name}`"))
    }

    fn f32(&mut self, name: &str) -> Handle<f32> {
        match self.take(name) {
            Some(Slice::F32(s)) => s,
            _ => panic!("the call has no f32 buffer `{name}`"),
        }
    }

    fn i32(&mut self, name: &str) -> Handle<i32> {
        match self.take(name) {
            Some(Slice::I32(s)) => s,
            _ => panic!("the call has no i32 buffer `{name}`"),
        }
    }

    fn i64(&mut self, name: &str) -> Handle<i64> {
        match self.take(name) {
            Some(Slice::I64(s)) => s,
            _ => panic!("the call has no i64 buffer `{name}`"),
        }
    }
}

/// A handle on `p`'s elements at `ptr` through `stream`, holding `data()` if the call reads it.
///
/// # Safety
/// `ptr` must point at `p.len` elements inside an allocation that outlives every use of the
/// handle.
unsafe fn handle<E: liger_rs::cudarc::driver::DeviceRepr>(
    stream: &Stream,
    ptr: u64,
    p: &Placed,
    data: impl FnOnce() -> Vec<E>,
) -> Handle<E> {
    // SAFETY: as the caller promises; `Handle` never frees the memory.
    let mut slice = Handle(Some(unsafe { stream.upgrade_device_ptr::<E>(ptr, p.len) }));
    if p.role != Role::Out && p.len > 0 {
        stream.memcpy_htod(&data(), &mut *slice).expect("upload");
    }
    slice
}

/// The arenas of a call and a handle on each placed buffer; buffers the call reads hold seeded
/// data (ids: 0 and 1), the others keep the arena's 0xFF bytes.
fn materialize<T: Dtype>(
    gpu: &Gpu,
    placed: &[Placed],
    size: [usize; 2],
    seed: u64,
) -> (Vec<Arena>, Live<T>) {
    let mut arenas = vec![Arena::new(&gpu.stream, size[0])];
    if placed.iter().any(|p| p.arena == 1) {
        let other = gpu.other.as_ref().expect("a second GPU");
        arenas.push(Arena::new(other, size[1]));
    }
    let mut rng = Rng::new(seed);
    let mut live = Live { slices: Vec::new() };
    for p in placed {
        let arena = &arenas[p.arena];
        let stream = if p.twin { &gpu.twin } else { &arena.stream };
        let ptr = arena.ptr() + p.start as u64;
        let n = p.len;
        // SAFETY: `place` put `p` inside its arena, which outlives `live`.
        let slice = unsafe {
            match p.kind {
                Kind::T => Slice::T(handle(stream, ptr, p, || rng.vec(n, 0.5, 0.25))),
                Kind::F32 => Slice::F32(handle(stream, ptr, p, || rng.vec(n, 1.0, 0.1))),
                Kind::I32 => Slice::I32(handle(stream, ptr, p, || {
                    (0..n as i32).map(|i| i % 2).collect()
                })),
                Kind::I64 => Slice::I64(handle(stream, ptr, p, || {
                    (0..n as i64).map(|i| i % 2).collect()
                })),
            }
        };
        live.slices.push((p.name, slice));
    }
    (arenas, live)
}

/// Checks the arenas of a call of `op` with `args` that was accepted: every element of an
/// output (`Role::Out`) that the call writes ([`Launch::writes`]) has lost the arena's 0xFF
/// bytes, every row it writes of a buffer it reads and writes in place changed (its elements
/// may keep their values, a row of random data does not), and no byte changed anywhere else.
fn check_writes<O: Launch>(
    op: O,
    args: &O::Args,
    (placed, t_size): (&[Placed], usize),
    before: &[Vec<u8>],
    after: &[Vec<u8>],
    case: &str,
) {
    let mut may_change: Vec<Vec<bool>> = before.iter().map(|a| vec![false; a.len()]).collect();
    for p in placed.iter().filter(|p| p.role != Role::In) {
        let (name, size) = (op.rename(p.name), p.kind.size(t_size));
        let regions = op.writes(args, p.name);
        if p.role == Role::InOut {
            // Random data rewritten in place may keep an element's value, never a whole row's.
            for (g, r) in regions.iter().enumerate().filter(|(_, r)| r.width > 0) {
                for row in 0..r.rows {
                    let first = p.start + (r.start + row * r.stride) * size;
                    let bytes = first..first + r.width * size;
                    assert!(
                        before[p.arena][bytes.clone()] != after[p.arena][bytes],
                        "{case}: accepted, but row {row} of region {g} of `{name}`, written in \
                         place, is unchanged"
                    );
                }
            }
        }
        for i in regions.into_iter().flat_map(Region::elements) {
            assert!(i < p.len, "{case}: `{name}` has no element {i}");
            let bytes = p.start + i * size..p.start + (i + 1) * size;
            let poisoned = after[p.arena][bytes.clone()].iter().all(|&b| b == 0xFF);
            assert!(
                p.role != Role::Out || !poisoned,
                "{case}: accepted, but `{name}` element {i} was not written"
            );
            may_change[p.arena][bytes].fill(true);
        }
    }
    for (arena, (b, a)) in before.iter().zip(after).enumerate() {
        let changed = (0..b.len()).find(|&i| b[i] != a[i] && !may_change[arena][i]);
        if let Some(at) = changed {
            let owner = placed
                .iter()
                .find(|p| p.arena == arena && (p.start..p.start + p.bytes).contains(&at));
            let place = match owner {
                Some(p) => format!(
                    "`{}` element {}",
                    op.rename(p.name),
                    (at - p.start) / p.kind.size(t_size)
                ),
                None => "outside every buffer".to_string(),
            };
            panic!("{case}: accepted, but byte {at} of arena {arena} ({place}) changed");
        }
    }
}

/// Runs `call` of `op` on dtype `T` and checks it against `want`: rejected as described with
/// every arena bit for bit as before, or accepted having written every element it must and
/// nothing else ([`check_writes`]).
fn run_row<T: Dtype, O: Launch>(gpu: &Gpu, op: O, call: &Call<O::Args>, want: Want, case: &str) {
    let (placed, size) = place(&call.bufs, size_of::<T>());
    let seed = case
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    let (arenas, mut live) = materialize::<T>(gpu, &placed, size, seed);
    let before: Vec<Vec<u8>> = arenas.iter().map(Arena::bytes).collect();
    let got = op.launch::<T>(&gpu.stream, &call.args, &mut live);
    let after: Vec<Vec<u8>> = arenas.iter().map(Arena::bytes).collect();
    match want.renamed(|n| op.rename(n)) {
        Want::Ok => {
            assert!(got.is_ok(), "{case}: expected Ok, got {got:?}");
            let layout = (&placed[..], size_of::<T>());
            check_writes(op, &call.args, layout, &before, &after, case);
        }
        want => {
            assert!(
                rejected_as(&got, want),
                "{case}: expected {want:?}, got {got:?}"
            );
            assert!(
                before == after,
                "{case}: rejected, but the call wrote to its buffers"
            );
        }
    }
}

/// Every row of every op in `ops` on dtype `T`; without a second GPU, rows with a buffer on
/// device 1 are left out and added to `skipped` as (op, argument, change).
fn walk<T: Dtype, O: Launch>(
    gpu: &Gpu,
    ops: &[O],
    failures: &mut Failures,
    skipped: &mut BTreeSet<(&'static str, &'static str, String)>,
) {
    for &op in ops {
        for r in table(op) {
            let mut call = op.base();
            (r.change)(&mut call);
            let arg = op.rename(r.arg);
            if gpu.other.is_err() && call.bufs.iter().any(|b| matches!(b.at, At::Other)) {
                skipped.insert((op.name(), arg, r.what));
                continue;
            }
            let case = format!("{} {} `{arg}` {}", T::NAME, op.name(), r.what);
            failures.run(|| run_row::<T, O>(gpu, op, &call, r.want, &case));
        }
    }
}

/// Walks the tables of `ops` on every dtype.
fn gpu_walk<O: Launch>(test: &str, ops: &[O]) {
    let Some(gpu) = Gpu::open(test) else {
        return;
    };
    let mut failures = Failures::new(test);
    let mut skipped = BTreeSet::new();
    walk::<f32, O>(&gpu, ops, &mut failures, &mut skipped);
    walk::<f16, O>(&gpu, ops, &mut failures, &mut skipped);
    walk::<bf16, O>(&gpu, ops, &mut failures, &mut skipped);
    if let Err(e) = &gpu.other {
        let names: BTreeSet<String> = skipped
            .iter()
            .map(|(op, arg, _)| format!("{op} `{arg}`"))
            .collect();
        let names: Vec<String> = names.into_iter().collect();
        let why = format!(
            "{} rows with a buffer from another context need a second GPU ({e}): {}",
            skipped.len(),
            names.join(", ")
        );
        skip(test, &why, Need::Gpus(2));
    }
    failures.finish();
}

#[test]
fn gpu_rms_norm_bad_input_never_reaches_a_kernel() {
    gpu_walk("gpu_rms_norm_bad_input_never_reaches_a_kernel", &RMS);
}

#[test]
fn gpu_fused_add_rms_norm_bad_input_never_reaches_a_kernel() {
    gpu_walk(
        "gpu_fused_add_rms_norm_bad_input_never_reaches_a_kernel",
        &FUSED_ADD,
    );
}

#[test]
fn gpu_rope_bad_input_never_reaches_a_kernel() {
    gpu_walk("gpu_rope_bad_input_never_reaches_a_kernel", &ROPE);
}

#[test]
fn gpu_swiglu_bad_input_never_reaches_a_kernel() {
    gpu_walk("gpu_swiglu_bad_input_never_reaches_a_kernel", &SWIGLU);
}

#[test]
fn gpu_geglu_bad_input_never_reaches_a_kernel() {
    gpu_walk("gpu_geglu_bad_input_never_reaches_a_kernel", &GEGLU);
}

#[test]
fn gpu_cross_entropy_bad_input_never_reaches_a_kernel() {
    gpu_walk("gpu_cross_entropy_bad_input_never_reaches_a_kernel", &CE);
}

// ---------------------------------------------------------------- the tables themselves

/// `field: value` pairs of a struct's `Debug` (flat structs only).
fn fields(debug: &str) -> Vec<(String, String)> {
    let inner = debug
        .split_once(" { ")
        .and_then(|(_, rest)| rest.strip_suffix(" }"))
        .unwrap_or_else(|| panic!("not a struct's Debug: {debug}"));
    inner
        .split(", ")
        .map(|kv| {
            let (k, v) = kv.split_once(": ").expect("field: value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Checks the tables of `ops` (see the module doc); returns the number of rows.
fn audit<O: Op>(ops: &[O]) -> usize {
    let mut total = 0;
    for &op in ops {
        let base = op.base();
        let base_fields = fields(&O::fields(&base.args));
        let (mut short, mut long, mut changed) =
            (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        let table = table(op);
        for r in &table {
            let mut call = op.base();
            (r.change)(&mut call);
            let case = format!("{} `{}` {}", op.name(), r.arg, r.what);
            let now = fields(&O::fields(&call.args));
            let moved: BTreeSet<&str> = base_fields
                .iter()
                .zip(&now)
                .filter(|(b, n)| b != n)
                .map(|((f, _), _)| f.as_str())
                .collect();
            changed.extend(moved.iter().map(|f| f.to_string()));
            if let Some(f) = r.arg.strip_prefix("args.") {
                assert!(moved.contains(f), "{case}: changes {moved:?}, not {f}");
            }
            // Rows that change one buffer's length by one and nothing else.
            let same_buffers =
                call.bufs.len() == base.bufs.len()
                    && call.bufs.iter().zip(&base.bufs).all(|(c, b)| {
                        c.name == b.name && matches!((c.at, b.at), (At::Own, At::Own))
                    });
            if call.args == base.args && same_buffers {
                let deltas: Vec<(&str, isize)> = call
                    .bufs
                    .iter()
                    .zip(&base.bufs)
                    .filter(|(c, b)| c.len != b.len)
                    .map(|(c, b)| (c.name, c.len as isize - b.len as isize))
                    .collect();
                match (deltas.as_slice(), r.want) {
                    ([(name, -1)], Want::Invalid { arg, .. }) if arg == *name => {
                        short.insert(*name);
                    }
                    ([(name, 1)], _) => {
                        long.insert(*name);
                    }
                    _ => {}
                }
            }
            // Every name the row expects is an argument of the call.
            for name in r.want.names() {
                // `layout.sections`: a field of RoPE's `layout` argument.
                let known = name == "args"
                    || name == "position_ids"
                    || name == "layout.sections"
                    || base.bufs.iter().any(|b| b.name == name)
                    || name
                        .strip_prefix("args.")
                        .is_some_and(|f| base_fields.iter().any(|(k, _)| k == f));
                assert!(known, "{case}: expects `{name}`, which is no argument");
            }
            // Device 1 exactly where a wrong context is expected.
            let others: Vec<&str> = call
                .bufs
                .iter()
                .filter(|b| matches!(b.at, At::Other))
                .map(|b| b.name)
                .collect();
            match r.want {
                Want::WrongContext { arg } => assert_eq!(others, [arg], "{case}"),
                _ => assert!(others.is_empty(), "{case}: {others:?} on device 1"),
            }
            // Buffers overlap exactly where the row puts one over another, whatever the dtype.
            let over: BTreeSet<(&str, &str)> = call
                .bufs
                .iter()
                .filter_map(|b| match b.at {
                    At::Over(onto, _) => Some((b.name.min(onto), b.name.max(onto))),
                    _ => None,
                })
                .collect();
            for t_size in [2, 4] {
                let (placed, _) = place(&call.bufs, t_size);
                assert_eq!(
                    overlapping(&placed),
                    over,
                    "{case}: overlaps ({t_size}-byte T)"
                );
            }
        }
        for b in &base.bufs {
            assert!(
                short.contains(b.name),
                "{}: no row makes `{}` one short",
                op.name(),
                b.name
            );
            assert!(
                long.contains(b.name),
                "{}: no row makes `{}` one long",
                op.name(),
                b.name
            );
        }
        for (f, _) in &base_fields {
            assert!(
                changed.contains(f),
                "{}: no row changes args.{f}",
                op.name()
            );
        }
        println!("{}: {} rows", op.name(), table.len());
        total += table.len();
    }
    total
}

#[test]
fn the_tables_walk_every_argument() {
    let rows = audit(&RMS)
        + audit(&FUSED_ADD)
        + audit(&ROPE)
        + audit(&SWIGLU)
        + audit(&GEGLU)
        + audit(&CE)
        + audit(&FLCE);
    println!("{rows} rows in all");
}

/// Checks [`Launch::writes`] of `ops` against their tables: on every row the launcher must
/// accept, what it writes of each output ends exactly where the output's needed length does.
fn audit_writes<O: Launch>(ops: &[O]) {
    for &op in ops {
        for r in table(op).into_iter().filter(|r| r.want == Want::Ok) {
            let mut call = op.base();
            (r.change)(&mut call);
            for b in call.bufs.iter().filter(|b| b.role != Role::In) {
                let regions = op.writes(&call.args, b.name);
                let last = regions.into_iter().flat_map(Region::elements).max();
                assert_eq!(
                    last.map_or(0, |i| i + 1),
                    (b.need)(&call.args),
                    "{} `{}` {}: where the writes to `{}` end",
                    op.name(),
                    r.arg,
                    r.what,
                    b.name
                );
            }
        }
    }
}

#[test]
fn the_written_regions_end_where_the_buffers_do() {
    audit_writes(&RMS);
    audit_writes(&FUSED_ADD);
    audit_writes(&ROPE);
    audit_writes(&SWIGLU);
    audit_writes(&GEGLU);
    audit_writes(&CE);
}
