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
    /// Whole rows of this many elements, at least one (a table that has as many rows as its
    /// length holds).
    Rows(usize, &'static str),
    /// Exactly the length of the table's buffer at this index.
    LengthOf(usize),
    /// At least the span of these rows (as [`span`] counts it): only the rows are touched, so a written
    /// buffer of rows may interleave with another of the same stride whose rows it does not
    /// overlap ([`check_disjoint`]).
    Strided(Strided, &'static str),
}

/// `rows` rows of `row` elements whose starts lie `stride ≥ row` elements apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Strided {
    pub(crate) rows: usize,
    pub(crate) row: usize,
    pub(crate) stride: usize,
}

impl Strided {
    /// Elements from the first row's start to the last row's end (0 without rows); the caller
    /// has checked that it fits in `usize`, as [`span`] does.
    fn span(&self) -> usize {
        match self.rows {
            0 => 0,
            n => (n - 1) * self.stride + self.row,
        }
    }
}

/// Whether rows `a` starting at byte `a_at` and rows `b` at `b_at`, both of `stride` bytes
/// (rows and row lengths in bytes here), share a byte. Exact: row `i` of `a` and row `j` of
/// `b` overlap iff `−b.row < d + m·stride < a.row` with `d = b_at − a_at`, `m = j − i`, so some
/// `m` in `[−(a.rows − 1), b.rows − 1]` must lie strictly between `(−b.row − d) / stride` and
/// `(a.row − d) / stride`.
pub(crate) fn rows_overlap(a_at: u64, a: Strided, b_at: u64, b: Strided) -> bool {
    if a.rows == 0 || b.rows == 0 || a.row == 0 || b.row == 0 {
        return false;
    }
    let (d, stride) = (b_at as i128 - a_at as i128, a.stride.max(1) as i128);
    let lo = (-(b.row as i128) - d).div_euclid(stride) + 1;
    let hi = -(-(a.row as i128 - d)).div_euclid(stride) - 1;
    lo.max(1 - a.rows as i128) <= hi.min(b.rows as i128 - 1)
}

/// Whether two buffers, each `(start, length, rows)` in one unit (bytes or elements), share a
/// unit: row by row where both are rows of one stride ([`rows_overlap`]: disjoint columns of
/// the same rows pass), else by their extents from first to last unit.
pub(crate) fn overlaps(
    (a_at, a_len, a_rows): (u64, u64, Option<Strided>),
    (b_at, b_len, b_rows): (u64, u64, Option<Strided>),
) -> bool {
    match (a_rows, b_rows) {
        (Some(a), Some(b)) if a.stride == b.stride => rows_overlap(a_at, a, b_at, b),
        _ => a_len > 0 && b_len > 0 && a_at < b_at + b_len && b_at < a_at + a_len,
    }
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
            Need::Strided(rows, what) if len < rows.span() => {
                format!("length ≥ {} ({what})", rows.span())
            }
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
                Need::Strided(rows, _) => rows.span(),
                _ => s.len,
            };
            (ptr, (elems * s.elem_bytes) as u64)
        }
    }
}

/// The rows of a [`Need::Strided`] buffer in bytes.
fn byte_rows(spec: &Spec, seen: &Option<Seen>) -> Option<Strided> {
    match (spec.need, seen) {
        (Need::Strided(r, _), Some(s)) => Some(Strided {
            rows: r.rows,
            row: r.row * s.elem_bytes,
            // Saturating: a one-row buffer may take any stride, which its overlap test never
            // multiplies.
            stride: r.stride.saturating_mul(s.elem_bytes),
        }),
        _ => None,
    }
}

/// Checks that every written buffer (in place or not) is disjoint from every other buffer, to
/// the byte: a kernel reads each element of an input after other threads may have written
/// an overlapping output. Two buffers of rows ([`Need::Strided`]) with the same stride in bytes
/// are compared row by row ([`rows_overlap`], so q and k views of one fused buffer, disjoint
/// columns of the same rows, pass); any other pair by the bytes from its first to its last
/// element. Pairs are tried in table order, each written buffer first against the buffers
/// before it, then after it, so the error names the written buffer.
pub(crate) fn check_disjoint<const N: usize>(
    table: &Table<N>,
    seen: &[Option<Seen>; N],
    ptrs: &[u64; N],
) -> Result<()> {
    let extents: [(u64, u64); N] =
        std::array::from_fn(|i| extent(&table.specs[i], &seen[i], ptrs[i]));
    let rows: [Option<Strided>; N] = std::array::from_fn(|i| byte_rows(&table.specs[i], &seen[i]));
    let overlap = |i: usize, j: usize| {
        let ((a, a_len), (b, b_len)) = (extents[i], extents[j]);
        overlaps((a, a_len, rows[i]), (b, b_len, rows[j]))
    };
    for (i, out) in table.specs.iter().enumerate() {
        if out.role == Role::Read {
            continue;
        }
        for (j, other) in table.specs.iter().enumerate() {
            // A pair of written buffers is tried once, from the earlier one.
            let tried = j < i && other.role != Role::Read;
            if j != i && !tried && overlap(i, j) {
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
pub enum Access<'b, E> {
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
/// (`rstd`), another float type (RoPE's cos/sin tables: [`crate::CosSinDtype`]), i32 or i64 (position ids), u32 or i64 (token ids), or ids in host memory (a length only: no context and
/// no device pointer).
// `pub` in this private module: the sealed `Dtype` builds them (`Sealed::read`).
pub enum Buf<'b, T> {
    T(Access<'b, T>),
    F32(Access<'b, f32>),
    F16(Access<'b, half::f16>),
    Bf16(Access<'b, half::bf16>),
    I32(Access<'b, i32>),
    U32(Access<'b, u32>),
    I64(Access<'b, i64>),
    Host(usize),
}

impl<'b, T> Buf<'b, T> {
    fn seen(&self, context: usize) -> Seen {
        match self {
            Buf::T(a) => a.seen(),
            Buf::F32(a) => a.seen(),
            Buf::F16(a) => a.seen(),
            Buf::Bf16(a) => a.seen(),
            Buf::I32(a) => a.seen(),
            Buf::U32(a) => a.seen(),
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
            Buf::F16(a) => a.take(stream),
            Buf::Bf16(a) => a.take(stream),
            Buf::I32(a) => a.take(stream),
            Buf::U32(a) => a.take(stream),
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

/// The checks of [`validate`] in their order, over plain values: every buffer's context and
/// length ([`check_buffers`]); then, unless the call is empty (`None` back), `take()` gives
/// the pointers (with whatever must live as long as they are used) and every written buffer
/// must overlap no other ([`check_disjoint`]).
pub(crate) fn check<const N: usize, G>(
    table: &Table<N>,
    seen: &[Option<Seen>; N],
    context: usize,
    take: impl FnOnce() -> ([u64; N], G),
) -> Result<Option<([u64; N], G)>> {
    check_buffers(table, seen, context)?;
    if table.empty {
        return Ok(None);
    }
    let (ptrs, guards) = take();
    check_disjoint(table, seen, &ptrs)?;
    Ok(Some((ptrs, guards)))
}

/// Checks the call `table` describes with `bufs` (in table order, `None` for an optional
/// buffer left out) on `stream` ([`check`]); `None` back: the call is empty, nothing to
/// launch.
pub(crate) fn validate<'b, T, const N: usize>(
    stream: &'b CudaStream,
    table: &Table<N>,
    bufs: [Option<Buf<'b, T>>; N],
) -> Result<Option<Taken<'b, N>>> {
    let context = stream.context().cu_ctx() as usize;
    let seen = bufs.each_ref().map(|b| b.as_ref().map(|b| b.seen(context)));
    let take = || {
        let taken = bufs.map(|b| b.map_or((0, None), |b| b.take(stream)));
        (taken.each_ref().map(|t| t.0), taken.map(|t| t.1))
    };
    Ok(
        check(table, &seen, context, take)?.map(|(ptrs, guards)| Taken {
            ptrs,
            _guards: guards,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: usize = 7;

    fn seen(len: usize, elem_bytes: usize) -> Option<Seen> {
        Some(Seen {
            len,
            context: CTX,
            elem_bytes,
        })
    }

    fn table<const N: usize>(specs: [Spec; N]) -> Table<N> {
        Table {
            specs,
            empty: false,
        }
    }

    #[test]
    fn span_counts_the_last_row_once() {
        assert_eq!(span("x", 0, 4, 4).unwrap(), 0);
        assert_eq!(span("x", 1, 4, 100).unwrap(), 4);
        assert_eq!(span("x", 3, 4, 6).unwrap(), 16);
        assert!(
            span("x", 3, 4, 3)
                .unwrap_err()
                .to_string()
                .contains("row stride ≥ cols = 4")
        );
        assert!(span("x", usize::MAX, 4, 4).is_err());
    }

    #[test]
    fn every_context_is_checked_before_any_length() {
        let t = table([
            Spec::read("a", Need::AtLeast(4, "rows")),
            Spec::written("b", Need::Exactly(4, "cols")),
        ]);
        let other = Some(Seen {
            context: CTX + 1,
            ..seen(4, 4).unwrap()
        });
        let got = check_buffers(&t, &[seen(3, 4), other], CTX).unwrap_err();
        assert_eq!(got, Error::WrongContext { arg: "b" });
        let got = check_buffers(&t, &[seen(3, 4), seen(5, 4)], CTX).unwrap_err();
        assert_eq!(
            got.to_string(),
            "invalid `a`: expected length ≥ 4 (rows), got 3"
        );
        let got = check_buffers(&t, &[seen(4, 4), seen(5, 4)], CTX).unwrap_err();
        assert_eq!(
            got.to_string(),
            "invalid `b`: expected length 4 (cols), got 5"
        );
        // A buffer left out is neither measured nor placed.
        assert!(check_buffers(&t, &[seen(9, 4), None], CTX).is_ok());
        assert!(check_disjoint(&t, &[seen(9, 4), None], &[64, 64]).is_ok());
    }

    #[test]
    fn tables_of_rows_and_lengths_of_other_buffers() {
        let t = table([
            Spec::read("cos", Need::Rows(6, "max_pos ≥ 1 rows of rotary_dim")),
            Spec::read("sin", Need::LengthOf(0)),
        ]);
        assert!(check_buffers(&t, &[seen(12, 2), seen(12, 2)], CTX).is_ok());
        for len in [0, 13] {
            let got = check_buffers(&t, &[seen(len, 2), seen(len, 2)], CTX).unwrap_err();
            assert_eq!(
                got.to_string(),
                format!(
                    "invalid `cos`: expected a table of max_pos ≥ 1 rows of rotary_dim = 6, \
                     got length {len}"
                )
            );
        }
        let got = check_buffers(&t, &[seen(12, 2), seen(18, 2)], CTX).unwrap_err();
        assert_eq!(
            got.to_string(),
            "invalid `sin`: expected length 12 (the length of cos), got 18"
        );
    }

    #[test]
    fn overlap_is_byte_exact_over_the_span() {
        // `a` spans 4 f32 (1000..1016) of its 8; `c` 1 u16.
        let t = table([
            Spec::written("a", Need::AtLeast(4, "rows")),
            Spec::read("b", Need::Exactly(4, "cols")),
            Spec::read("c", Need::Exactly(1, "one")),
            Spec::read("e", Need::Exactly(0, "none")),
        ]);
        let seen = [seen(8, 4), seen(4, 4), seen(1, 2), seen(0, 4)];
        assert!(check_disjoint(&t, &seen, &[1000, 1016, 1016, 1004]).is_ok());
        let got = check_disjoint(&t, &seen, &[1000, 1016, 1014, 1004]).unwrap_err();
        assert_eq!(
            got,
            Error::Aliasing {
                output: "a",
                other: "c"
            }
        );
        // Read buffers may share memory.
        assert!(check_disjoint(&t, &seen, &[1000, 2000, 2000, 2000]).is_ok());
    }

    /// Every byte of rows `r` at `at`.
    fn bytes(at: u64, r: Strided) -> Vec<u64> {
        let rows = 0..r.rows as u64;
        rows.flat_map(|i| (0..r.row as u64).map(move |c| at + i * r.stride as u64 + c))
            .collect()
    }

    #[test]
    fn rows_overlap_is_exact() {
        let mut cases = 0;
        for stride in 1..7 {
            for (a_row, b_row) in [
                (1, 1),
                (1, 3),
                (2, 2),
                (3, 1),
                (stride, 1),
                (stride, stride),
            ] {
                if a_row > stride || b_row > stride {
                    continue;
                }
                for (a_rows, b_rows) in [(0, 2), (1, 1), (1, 4), (3, 2), (4, 4)] {
                    for b_at in 90..130 {
                        let a = Strided {
                            rows: a_rows,
                            row: a_row,
                            stride,
                        };
                        let b = Strided {
                            rows: b_rows,
                            row: b_row,
                            stride,
                        };
                        let want = bytes(100, a).iter().any(|x| bytes(b_at, b).contains(x));
                        assert_eq!(rows_overlap(100, a, b_at, b), want, "{a:?} {b:?} {b_at}");
                        assert_eq!(rows_overlap(b_at, b, 100, a), want, "{b:?} {a:?} {b_at}");
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases > 1000);
    }

    #[test]
    fn interleaved_rows_of_one_stride_are_disjoint_column_ranges() {
        // A fused [3 tokens, q 4 | k 2 | v 2] f16 buffer at 1000: q and k rows are 8 apart.
        let q = Strided {
            rows: 3,
            row: 4,
            stride: 8,
        };
        let k = Strided {
            rows: 3,
            row: 2,
            stride: 8,
        };
        let t = table([
            Spec::in_place("q", Need::Strided(q, "q rows")),
            Spec::in_place("k", Need::Strided(k, "k rows")),
            Spec::read("cos", Need::Exactly(4, "n")),
        ]);
        let two = [seen(24, 2), seen(20, 2)];
        let seen = [two[0], two[1], seen(4, 2)];
        assert!(check_disjoint(&t, &seen, &[1000, 1008, 5000]).is_ok());
        // k one element earlier covers q's last column of every row.
        let named = Error::Aliasing {
            output: "q",
            other: "k",
        };
        assert_eq!(check_disjoint(&t, &seen, &[1000, 1006, 5000]), Err(named));
        // k's rows end where the next token's q row starts: still disjoint.
        assert!(check_disjoint(&t, &seen, &[1000, 1012, 5000]).is_ok());
        // cos within the span of q but between its rows still counts as an overlap: only
        // two buffers of rows are compared row by row.
        let named = Error::Aliasing {
            output: "q",
            other: "cos",
        };
        assert_eq!(check_disjoint(&t, &seen, &[1000, 1008, 1012]), Err(named));
        // Rows of different strides are compared by their spans.
        let k3 = Strided { stride: 9, ..k };
        let t = table([
            Spec::in_place("q", Need::Strided(q, "q rows")),
            Spec::in_place("k", Need::Strided(k3, "k rows")),
        ]);
        let named = Error::Aliasing {
            output: "q",
            other: "k",
        };
        assert_eq!(check_disjoint(&t, &two, &[1000, 1008]), Err(named));
        // A strided buffer's length must cover its span, not its rows × stride.
        let (fits, short) = (two[1], two[1].map(|s| Seen { len: 19, ..s }));
        assert!(check_buffers(&t, &[fits, fits], CTX).is_ok());
        let got = check_buffers(&t, &[short, fits], CTX).unwrap_err();
        assert_eq!(
            got.to_string(),
            "invalid `q`: expected length ≥ 20 (q rows), got 19"
        );
    }

    #[test]
    fn an_overlap_names_the_written_buffer_then_the_earlier_of_two() {
        let t = table([
            Spec::read("in", Need::Exactly(4, "n")),
            Spec::in_place("io", Need::Exactly(4, "n")),
            Spec::written("out", Need::Exactly(4, "n")),
        ]);
        let seen = [seen(4, 4), seen(4, 4), seen(4, 4)];
        let aliasing = |ptrs| check_disjoint(&t, &seen, &ptrs).unwrap_err();
        let named = |output, other| Error::Aliasing { output, other };
        assert_eq!(aliasing([100, 100, 500]), named("io", "in"));
        assert_eq!(aliasing([100, 500, 100]), named("out", "in"));
        assert_eq!(aliasing([100, 500, 500]), named("io", "out"));
    }

    #[test]
    fn an_empty_call_takes_no_pointers() {
        let mut t = table([Spec::written("y", Need::AtLeast(0, "rows"))]);
        t.empty = true;
        let got = check(&t, &[seen(0, 4)], CTX, || -> ([u64; 1], ()) {
            panic!("took the pointers of an empty call")
        });
        assert_eq!(got, Ok(None));
        // Its lengths and contexts are still checked.
        t.specs[0].need = Need::AtLeast(1, "rows");
        assert!(check(&t, &[seen(0, 4)], CTX, || ([0], ())).is_err());
    }
}
