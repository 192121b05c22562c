//! The SIMT path: one warp per query row (forward, dQ, the preprocessing) or per key row
//! (dK/dV), lane `l` holding elements `l, l + 32, …` of a head (up to eight: head_dim ≤ 256).
//! Dot products are warp sums (butterfly: every lane gets the same bits), so the online
//! softmax runs identically in every lane. f32 arithmetic throughout; unlike the tensor-core
//! path, probabilities are not rounded to the element type before they weight V.
use super::abi::{Params, SIMT_ROWS};
use super::{Score, Seq, block_y, block_z, exp2, lse_of, lse_offset, lse2_for_backward, offset};
use super::{safe_max, shfl_xor};
use crate::{Elem, block_idx, thread_idx, unroll};

/// Elements per lane.
const PER_LANE: usize = 8;

/// Sum over the warp; every lane gets the same bits.
#[inline(always)]
fn warp_sum(mut v: f32) -> f32 {
    v += shfl_xor(v, 16);
    v += shfl_xor(v, 8);
    v += shfl_xor(v, 4);
    v += shfl_xor(v, 2);
    v + shfl_xor(v, 1)
}

/// This lane's elements of the head at `ptr + at` (0 beyond head_dim).
#[inline(always)]
unsafe fn load<T: Elem>(ptr: u64, at: usize, d: usize, lane: usize) -> [f32; PER_LANE] {
    let mut v = [0.0; PER_LANE];
    let p = ptr as *const T;
    unroll::<PER_LANE>(|k| {
        let e = lane + 32 * k;
        if e < d {
            // SAFETY: the host checked that the tensor spans every head it names.
            v[k] = unsafe { (*p.add(at + e)).to_f32() };
        }
    });
    v
}

/// Stores this lane's elements of a head to `ptr + at`, rounded to `T`.
#[inline(always)]
unsafe fn store<T: Elem>(ptr: u64, at: usize, d: usize, lane: usize, v: &[f32; PER_LANE]) {
    let p = ptr as *mut T;
    unroll::<PER_LANE>(|k| {
        let e = lane + 32 * k;
        if e < d {
            // SAFETY: as in `load`.
            unsafe { *p.add(at + e) = T::from_f32(v[k]) };
        }
    });
}

#[inline(always)]
fn dot(a: &[f32; PER_LANE], b: &[f32; PER_LANE]) -> f32 {
    let mut s = 0.0;
    unroll::<PER_LANE>(|k| s = crate::fma(a[k], b[k], s));
    warp_sum(s)
}

/// This warp's row of the block: `(row, lane)`.
#[inline(always)]
fn row_and_lane() -> (usize, usize) {
    (
        block_idx() * SIMT_ROWS as usize + (thread_idx() >> 5),
        thread_idx() & 31,
    )
}

/// The forward of one query row: online softmax over the keys it sees, then `O = Σ p·V / Σ p`
/// and the row's log-sum-exp.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn forward<T: Elem>(p: &Params) {
    let (i, lane) = row_and_lane();
    let (b, h) = (block_z(), block_y());
    // SAFETY: the host passes `batch + 1` offsets in a packed batch; `b < batch`.
    let s = unsafe { Seq::of(p, b) };
    if i as i64 >= s.sq {
        return;
    }
    let (d, hk) = (p.head_dim as usize, h / (p.heads_q / p.heads_kv) as usize);
    let score = Score::new(p);
    let tok = s.q_start + i;
    // SAFETY: every load below lies inside the tensors the host checked.
    let q = unsafe { load::<T>(p.q.ptr, offset(&p.q, b, tok, h), d, lane) };
    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, [0.0f32; PER_LANE]);
    let (lo, hi) = s.keys(i as i64, i as i64);
    let mut j = lo;
    while j < hi {
        if s.allows(i as i64, j) {
            let kt = s.k_start + j as usize;
            let k = unsafe { load::<T>(p.k.ptr, offset(&p.k, b, kt, hk), d, lane) };
            let x = score.of(dot(&q, &k));
            let m_new = if x > m { x } else { m };
            let (corr, e) = (exp2(m - safe_max(m_new)), exp2(x - safe_max(m_new)));
            let v = unsafe { load::<T>(p.v.ptr, offset(&p.v, b, kt, hk), d, lane) };
            unroll::<PER_LANE>(|k| acc[k] = crate::fma(e, v[k], acc[k] * corr));
            l = crate::fma(l, corr, e);
            m = m_new;
        }
        j += 1;
    }
    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
    unroll::<PER_LANE>(|k| acc[k] *= inv);
    unsafe {
        store::<T>(p.o.ptr, offset(&p.o, b, tok, h), d, lane, &acc);
        if lane == 0 {
            *(p.lse as *mut f32).add(lse_offset(p, b, h, tok)) = lse_of(m, l);
        }
    }
}

/// The backward's preprocessing: `delta = Σ_e dO·O` of one query row, in f32.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn prep<T: Elem>(p: &Params) {
    let (i, lane) = row_and_lane();
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    if i as i64 >= s.sq {
        return;
    }
    let d = p.head_dim as usize;
    let tok = s.q_start + i;
    let (o, d_o) = unsafe {
        (
            load::<T>(p.o.ptr, offset(&p.o, b, tok, h), d, lane),
            load::<T>(p.d_o.ptr, offset(&p.d_o, b, tok, h), d, lane),
        )
    };
    let delta = dot(&o, &d_o);
    if lane == 0 {
        unsafe { *(p.delta as *mut f32).add(lse_offset(p, b, h, tok)) = delta };
    }
}

/// What the backward reads of query row `tok` of head `h`: this lane's elements of q and dO,
/// and the row's log-sum-exp (log2 units, as the backward subtracts it) and delta.
///
/// # Safety
/// The row exists: `lse` and `delta` span every row, q and dO every head.
#[inline(always)]
unsafe fn query_row<T: Elem>(
    p: &Params,
    b: usize,
    h: usize,
    tok: usize,
    lane: usize,
) -> ([f32; PER_LANE], [f32; PER_LANE], f32, f32) {
    let (d, at) = (p.head_dim as usize, lse_offset(p, b, h, tok));
    unsafe {
        (
            load::<T>(p.q.ptr, offset(&p.q, b, tok, h), d, lane),
            load::<T>(p.d_o.ptr, offset(&p.d_o, b, tok, h), d, lane),
            lse2_for_backward(*(p.lse as *const f32).add(at)),
            *(p.delta as *const f32).add(at),
        )
    }
}

/// The probability of a (query, key) pair and its dS (times the softcap's slope), from q, k,
/// dO and v.
#[inline(always)]
fn prob_and_ds(
    score: &Score,
    [q, k, d_o, v]: [&[f32; PER_LANE]; 4],
    lse2: f32,
    delta: f32,
) -> (f32, f32) {
    let (x, slope) = score.with_slope(dot(q, k));
    let pr = exp2(x - lse2);
    (pr, pr * (dot(d_o, v) - delta) * slope)
}

/// dQ of one query row: `scale · Σ_j dS_j·K_j` over the keys it sees, with
/// `dS = P ∘ (dP − delta)` (times the softcap's slope).
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dq<T: Elem>(p: &Params) {
    let (i, lane) = row_and_lane();
    let (b, h) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    if i as i64 >= s.sq {
        return;
    }
    let (d, hk) = (p.head_dim as usize, h / (p.heads_q / p.heads_kv) as usize);
    let score = Score::new(p);
    let tok = s.q_start + i;
    let (q, d_o, lse2, delta) = unsafe { query_row::<T>(p, b, h, tok, lane) };
    let mut acc = [0.0f32; PER_LANE];
    let (lo, hi) = s.keys(i as i64, i as i64);
    let mut j = lo;
    while j < hi {
        if s.allows(i as i64, j) {
            let kt = s.k_start + j as usize;
            let k = unsafe { load::<T>(p.k.ptr, offset(&p.k, b, kt, hk), d, lane) };
            let v = unsafe { load::<T>(p.v.ptr, offset(&p.v, b, kt, hk), d, lane) };
            let (_, ds) = prob_and_ds(&score, [&q, &k, &d_o, &v], lse2, delta);
            unroll::<PER_LANE>(|e| acc[e] = crate::fma(ds, k[e], acc[e]));
        }
        j += 1;
    }
    unroll::<PER_LANE>(|e| acc[e] *= p.scale);
    unsafe { store::<T>(p.dq.ptr, offset(&p.dq, b, tok, h), d, lane, &acc) };
}

/// dK and dV of one key row, summed over every query head of its group and every query that
/// sees it: `dV = Σ P·dO`, `dK = scale · Σ dS·Q`.
///
/// # Safety
/// As the entry points'.
#[inline(always)]
pub(crate) unsafe fn dkdv<T: Elem>(p: &Params) {
    let (j, lane) = row_and_lane();
    let (b, hk) = (block_z(), block_y());
    let s = unsafe { Seq::of(p, b) };
    if j as i64 >= s.sk {
        return;
    }
    let d = p.head_dim as usize;
    let group = (p.heads_q / p.heads_kv) as usize;
    let score = Score::new(p);
    let kt = s.k_start + j;
    let (k, v) = unsafe {
        (
            load::<T>(p.k.ptr, offset(&p.k, b, kt, hk), d, lane),
            load::<T>(p.v.ptr, offset(&p.v, b, kt, hk), d, lane),
        )
    };
    let (mut dk, mut dv) = ([0.0f32; PER_LANE], [0.0f32; PER_LANE]);
    let (lo, hi) = s.queries(j as i64, j as i64);
    for h in hk * group..(hk + 1) * group {
        let mut i = lo;
        while i < hi {
            if s.allows(i, j as i64) {
                let tok = s.q_start + i as usize;
                let (q, d_o, lse2, delta) = unsafe { query_row::<T>(p, b, h, tok, lane) };
                let (pr, ds) = prob_and_ds(&score, [&q, &k, &d_o, &v], lse2, delta);
                unroll::<PER_LANE>(|e| {
                    dv[e] = crate::fma(pr, d_o[e], dv[e]);
                    dk[e] = crate::fma(ds, q[e], dk[e]);
                });
            }
            i += 1;
        }
    }
    unroll::<PER_LANE>(|e| dk[e] *= p.scale);
    unsafe {
        store::<T>(p.dk.ptr, offset(&p.dk, b, kt, hk), d, lane, &dk);
        store::<T>(p.dv.ptr, offset(&p.dv, b, kt, hk), d, lane, &dv);
    }
}
