//! The one validation path of every launcher. A launcher describes its call as a [`Table`]: for
//! each buffer argument its name, [`Role`] and the elements it must hold ([`Need`]), a pure
//! function of the call's scalars. [`validate`] then checks, in this order for every op, each
//! buffer's context against the stream's, each length, and (unless the call is empty) takes
//! the device pointers and checks that every written buffer is disjoint from every other.
//!
//! The checks themselves ([`check_buffers`], [`check_disjoint`]) work on plain values (lengths,
//! context ids, element sizes, pointers), so unit tests run them without a GPU.
use crate::error::{Error, Result, invalid};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

/// What a launcher does with a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Only read.
    Read,
    /// Only written.
    Written,
    /// Read, then written in place.
    InPlace,
}

/// The elements a buffer must hold; each `&str` says what the count is, for the error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// At least this many (a strided span: elements past it are never touched).
    AtLeast(usize, &'static str),
    /// Exactly this many.
    Exactly(usize, &'static str),
    /// At least one whole row of this many elements (a table whose row count is its length).
    Rows(usize, &'static str),
    /// Exactly the length of the table's buffer at this index.
    LengthOf(usize),
}

/// One buffer argument of a call: its name as in the launcher's signature, what the launcher
/// does with it, and what it must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spec {
    pub(crate) name: &'static str,
    pub(crate) role: Role,
    pub(crate) need: Need,
}

impl Spec {
    pub(crate) fn read(name: &'static str, need: Need) -> Self {
        Spec {
            name,
            role: Role::Read,
            need,
        }
    }

    pub(crate) fn written(name: &'static str, need: Need) -> Self {
        Spec {
            name,
            role: Role::Written,
            need,
        }
    }

    pub(crate) fn in_place(name: &'static str, need: Need) -> Self {
        Spec {
            name,
            role: Role::InPlace,
            need,
        }
    }
}

/// A call's buffers in signature order, and whether the call has nothing to do (no rows or
/// tokens), in which case it returns before touching any buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Table<const N: usize> {
    pub(crate) specs: [Spec; N],
    pub(crate) empty: bool,
}

/// A buffer as the checks see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Elements.
    pub(crate) len: usize,
    /// The `CUcontext` it belongs to, as an integer.
    pub(crate) context: usize,
    /// Bytes per element.
    pub(crate) elem_bytes: usize,
}

/// Elements a `rows × cols` block with row stride `stride` spans: `(rows − 1)·stride + cols`.
pub(crate) fn span(arg: &'static str, rows: usize, cols: usize, stride: usize) -> Result<usize> {
    if stride < cols {
        return Err(invalid(arg, format!("row stride ≥ cols = {cols}"), stride));
    }
    match rows {
        0 => Ok(0),
        _ => (rows - 1)
            .checked_mul(stride)
            .and_then(|n| n.checked_add(cols))
            .ok_or_else(|| {
                invalid(
                    arg,
                    "rows × row stride within usize",
                    format!("{rows} × {stride}"),
                )
            }),
    }
}

/// Checks every given buffer's context against `context`, then every given buffer's length
/// (`None`: an optional buffer left out).
pub(crate) fn check_buffers<const N: usize>(
    table: &Table<N>,
    seen: &[Option<Seen>; N],
    context: usize,
) -> Result<()> {
    for (spec, seen) in table.specs.iter().zip(seen) {
        if seen.is_some_and(|s| s.context != context) {
            return Err(Error::WrongContext { arg: spec.name });
        }
    }
    for (spec, buf) in table.specs.iter().zip(seen) {
        let Some(Seen { len, .. }) = *buf else {
            continue;
        };
        let expected = match spec.need {
            Need::AtLeast(need, what) if len < need => format!("length ≥ {need} ({what})"),
            Need::Exactly(need, what) if len != need => format!("length {need} ({what})"),
            Need::Rows(row, what) if len == 0 || !len.is_multiple_of(row) => {
                let expected = format!("a table of {what} = {row}");
                return Err(invalid(spec.name, expected, format!("length {len}")));
            }
            Need::LengthOf(i) => match seen[i] {
                Some(other) if other.len != len => {
                    let name = table.specs[i].name;
                    format!("length {} (the length of {name})", other.len)
                }
                _ => continue,
            },
            _ => continue,
        };
        return Err(invalid(spec.name, expected, len));
    }
    Ok(())
}

/// The bytes from `ptr` a checked buffer covers in the launch: a span's elements (those past
/// it are never touched), else the whole buffer.
fn extent(spec: &Spec, seen: &Option<Seen>, ptr: u64) -> (u64, u64) {
    match seen {
        None => (ptr, 0),
        Some(s) => {
            let elems = match spec.need {
                Need::AtLeast(need, _) => need,
                _ => s.len,
            };
            (ptr, (elems * s.elem_bytes) as u64)
        }
    }
}

/// Checks that every written buffer (in place or not) is disjoint from every other buffer, to
/// the byte: a kernel reads each element of an input after other threads may have written
/// an overlapping output. Pairs are tried in table order, each written buffer first against
/// the buffers before it, then after it, so the error names the written buffer.
pub(crate) fn check_disjoint<const N: usize>(
    table: &Table<N>,
    seen: &[Option<Seen>; N],
    ptrs: &[u64; N],
) -> Result<()> {
    let extents: [(u64, u64); N] =
        std::array::from_fn(|i| extent(&table.specs[i], &seen[i], ptrs[i]));
    let overlap = |(a, a_len): (u64, u64), (b, b_len): (u64, u64)| {
        a_len > 0 && b_len > 0 && a < b + b_len && b < a + a_len
    };
    for (i, out) in table.specs.iter().enumerate() {
        if out.role == Role::Read {
            continue;
        }
        for (j, other) in table.specs.iter().enumerate() {
            // A pair of written buffers is tried once, from the earlier one.
            let tried = j < i && other.role != Role::Read;
            if j != i && !tried && overlap(extents[i], extents[j]) {
                return Err(Error::Aliasing {
                    output: out.name,
                    other: other.name,
                });
            }
        }
    }
    Ok(())
}

/// A buffer argument, read or written, of element type `E`.
pub(crate) enum Access<'b, E> {
    Read(&'b dyn DevicePtr<E>),
    Write(&'b mut dyn DevicePtrMut<E>),
}

/// A buffer of the call's element type to read.
pub(crate) fn read<'b, T>(buf: &'b dyn DevicePtr<T>) -> Option<Buf<'b, T>> {
    Some(Buf::T(Access::Read(buf)))
}

/// A buffer of the call's element type to write (or to read, then write in place).
pub(crate) fn write<'b, T>(buf: &'b mut dyn DevicePtrMut<T>) -> Option<Buf<'b, T>> {
    Some(Buf::T(Access::Write(buf)))
}

impl<'b, E> Access<'b, E> {
    fn seen(&self) -> Seen {
        let (len, stream) = match self {
            Access::Read(b) => (b.len(), b.stream()),
            Access::Write(b) => (b.len(), b.stream()),
        };
        Seen {
            len,
            context: stream.context().cu_ctx() as usize,
            elem_bytes: size_of::<E>(),
        }
    }

    /// The device pointer, and the guard that records the access on the buffer's events when
    /// dropped (after the launch).
    fn take(self, stream: &'b CudaStream) -> (u64, Option<SyncOnDrop<'b>>) {
        let (ptr, guard) = match self {
            Access::Read(b) => b.device_ptr(stream),
            Access::Write(b) => b.device_ptr_mut(stream),
        };
        (ptr, Some(guard))
    }
}

/// A buffer argument of a call whose buffers differ in element type: the call's `T`, f32
/// (`rstd`), i32 or i64 (position ids), or ids in host memory (a length only: no context and
/// no device pointer).
pub(crate) enum Buf<'b, T> {
    T(Access<'b, T>),
    F32(Access<'b, f32>),
    I32(Access<'b, i32>),
    I64(Access<'b, i64>),
    Host(usize),
}

impl<'b, T> Buf<'b, T> {
    fn seen(&self, context: usize) -> Seen {
        match self {
            Buf::T(a) => a.seen(),
            Buf::F32(a) => a.seen(),
            Buf::I32(a) => a.seen(),
            Buf::I64(a) => a.seen(),
            Buf::Host(len) => Seen {
                len: *len,
                context,
                elem_bytes: 0,
            },
        }
    }

    fn take(self, stream: &'b CudaStream) -> (u64, Option<SyncOnDrop<'b>>) {
        match self {
            Buf::T(a) => a.take(stream),
            Buf::F32(a) => a.take(stream),
            Buf::I32(a) => a.take(stream),
            Buf::I64(a) => a.take(stream),
            Buf::Host(_) => (0, None),
        }
    }
}

/// The device pointers of a validated call (0 for a buffer left out or in host memory), in
/// table order, and the guards that must live until the launch is queued.
pub(crate) struct Taken<'b, const N: usize> {
    pub(crate) ptrs: [u64; N],
    _guards: [Option<SyncOnDrop<'b>>; N],
}

/// Checks the call `table` describes with `bufs` (in table order, `None` for an optional
/// buffer left out) on `stream`: contexts, lengths, then, unless the call is empty (`None`
/// back: nothing to launch), the device pointers and that written buffers overlap no other.
pub(crate) fn validate<'b, T, const N: usize>(
    stream: &'b CudaStream,
    table: &Table<N>,
    bufs: [Option<Buf<'b, T>>; N],
) -> Result<Option<Taken<'b, N>>> {
    let context = stream.context().cu_ctx() as usize;
    let seen = bufs.each_ref().map(|b| b.as_ref().map(|b| b.seen(context)));
    check_buffers(table, &seen, context)?;
    if table.empty {
        return Ok(None);
    }
    let taken = bufs.map(|b| b.map_or((0, None), |b| b.take(stream)));
    let ptrs = taken.each_ref().map(|t| t.0);
    check_disjoint(table, &seen, &ptrs)?;
    Ok(Some(Taken {
        ptrs,
        _guards: taken.map(|t| t.1),
    }))
}
