//! The scalar kernels' bodies: any alignment, columns strided by the block.
use super::*;

/// The scalar forward; `ADD` first writes the row's sum `s = D(x + res)` to `s`, then
/// normalises `s` as RMSNorm normalises `x` (the same code, so RMSNorm's compiles as it did
/// before the fused add). Each thread reads back only the elements of `s` it wrote, so `s`
/// may be `x` or `res`.
#[inline(always)]
pub(super) unsafe fn forward<T: Elem, const MODE: u32, const ADD: bool>(a: Fwd<T>) {
    // One line for the struct, not one per field (rustfmt's layout of a struct pattern).
    #[rustfmt::skip]
    let Fwd { x, x_stride, res, res_stride, s, s_stride, w, y, y_stride, rstd, rows, cols, eps, offset } = a;
    // `ADD`: the row normalised is the sum.
    let (add_x, add_x_stride) = (x, x_stride);
    let (x, x_stride) = match ADD {
        true => (s.cast_const(), s_stride),
        false => (x, x_stride),
    };
    let (tid, nt) = (thread_idx(), block_dim());
    let mut row = block_idx();
    let mut parity = 0;
    while row < rows {
        if ADD {
            let xa = unsafe { add_x.add(row * add_x_stride) };
            let ra = unsafe { res.add(row * res_stride) };
            let sr = unsafe { s.add(row * s_stride) };
            let mut c = tid;
            while c < cols {
                let sum = unsafe { (*xa.add(c)).to_f32() + (*ra.add(c)).to_f32() };
                unsafe { *sr.add(c) = T::from_f32(sum) };
                c += nt;
            }
        }
        let xr = unsafe { x.add(row * x_stride) };
        let yr = unsafe { y.add(row * y_stride) };
        let mut acc = 0.0f32;
        let mut c = tid;
        while c < cols {
            let v = unsafe { *xr.add(c) }.to_f32();
            acc += if MODE == mode::NONE {
                T::round(v * v)
            } else {
                v * v
            };
            c += nt;
        }
        let scaled = |s: f32| {
            let (mut sum, mut c) = (0.0f32, tid);
            while c < cols {
                let v = unsafe { *xr.add(c) }.to_f32() * s;
                sum += v * v;
                c += nt;
            }
            sum
        };
        let r = inverse_rms::<T, MODE>(acc, scaled, cols, eps, parity);
        parity ^= 1;
        if tid == 0 {
            unsafe { *rstd.add(row) = r };
        }
        let mut c = tid;
        while c < cols {
            let v = unsafe { *xr.add(c) }.to_f32();
            let out = if w.is_null() {
                v * r
            } else {
                let wc = unsafe { *w.add(c) }.to_f32();
                match MODE {
                    mode::LLAMA => T::round(v * r) * (offset + wc),
                    mode::GEMMA => v * r * (offset + wc),
                    _ => T::round(v * r) * T::round(T::round(offset) + wc),
                }
            };
            unsafe { *yr.add(c) = T::from_f32(out) };
            c += nt;
        }
        row += grid_dim();
    }
}

/// The scalar backward; `DW` accumulates the weight's dW partial row (see [`computes_dw`]),
/// `ADD` adds `ds` to each dX element before rounding it (read by the thread that then writes
/// that element, so `dx` may be `ds`).
#[inline(always)]
pub(super) unsafe fn backward<T: Elem, const MODE: u32, const DW: bool, const ADD: bool>(
    a: Bwd<T>,
) {
    // One line for the fields, not one per field (rustfmt's layout of a struct pattern).
    #[rustfmt::skip]
    let Bwd {
        dy, dy_stride, ds, ds_stride, x, x_stride, w, rstd, dx, dx_stride, dw_partial, rows,
        cols, offset,
    } = a;
    let (tid, nt) = (thread_idx(), block_dim());
    // `wrapping_add`: `dw_partial` is null without dW, and `add` off null is undefined.
    let part = dw_partial.wrapping_add(block_idx() * cols);
    let load_w = |c: usize| {
        if w.is_null() {
            None
        } else {
            Some(unsafe { *w.add(c) }.to_f32())
        }
    };
    let mut first = true;
    let mut row = block_idx();
    let mut parity = 0;
    while row < rows {
        let dyr = unsafe { dy.add(row * dy_stride) };
        let xr = unsafe { x.add(row * x_stride) };
        let dxr = unsafe { dx.add(row * dx_stride) };
        let r = unsafe { *rstd.add(row) };
        let mut acc = 0.0f32;
        let mut c = tid;
        while c < cols {
            let g = unsafe { *dyr.add(c) }.to_f32();
            let v = unsafe { *xr.add(c) }.to_f32();
            acc += scaled_grad::<T, MODE>(g, load_w(c), offset) * (v * r);
            c += nt;
        }
        let mean = block_sum(acc, parity) / cols as f32;
        parity ^= 1;
        let mut c = tid;
        while c < cols {
            let g = unsafe { *dyr.add(c) }.to_f32();
            let v = unsafe { *xr.add(c) }.to_f32();
            let wc = load_w(c);
            let m = scaled_grad::<T, MODE>(g, wc, offset);
            let mut out = r * (m - mean * (v * r));
            if ADD {
                out += unsafe { *ds.add(row * ds_stride + c) }.to_f32();
            }
            unsafe { *dxr.add(c) = T::from_f32(out) };
            if DW && wc.is_some() {
                let normed = if MODE == mode::LLAMA {
                    T::round(v * r)
                } else {
                    v * r
                };
                let contrib = g * normed;
                let slot = unsafe { part.add(c) };
                unsafe { *slot = if first { contrib } else { *slot + contrib } };
            }
            c += nt;
        }
        first = false;
        row += grid_dim();
    }
}
