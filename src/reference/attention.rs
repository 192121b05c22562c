//! Attention (flash-attention 2 semantics, `liger_rs::attention_forward`): naive softmax
//! attention in f64, one query row at a time, with the launchers' masks, softcap, GQA and
//! packed batches. Only the results are rounded to the element type (o, dq, dk, dv) or to f32
//! (lse): the exact math the kernels approximate (they round probabilities to 16-bit types
//! before the products with v, dO, k and q, as flash-attention 2 does).
use crate::attention::args::{AttentionArgs, Extent, Strides};
use crate::error::{Result, invalid};
use crate::reference::Element;

/// The forward's results: o (contiguous `[B, Sq, Hq, d]`, packed: `[total_q, Hq, d]`) and
/// the log-sum-exp `[B, Hq, Sq]` (packed: `[Hq, total_q]`), as the launcher writes them.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOut<T> {
    /// The output.
    pub o: Vec<T>,
    /// Each query row's `log Σ exp(s)` (−∞ for a row that sees no key).
    pub lse: Vec<f32>,
}

/// The backward's results, each in the layout `args.grads` names (a buffer of its span).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGrads<T> {
    /// The queries' gradient.
    pub dq: Vec<T>,
    /// The keys' gradient, summed over each group's query heads.
    pub dk: Vec<T>,
    /// The values' gradient, summed likewise.
    pub dv: Vec<T>,
}

/// One sequence: its first query and key token and its lengths.
#[derive(Debug, Clone, Copy)]
struct Seq {
    q0: usize,
    k0: usize,
    sq: usize,
    sk: usize,
}

/// The sequences of a call, checking a packed batch's offsets (here they are host data).
fn sequences(args: &AttentionArgs, cu: Option<(&[i32], &[i32])>) -> Result<Vec<Seq>> {
    match (args.total_q.zip(args.total_k), cu) {
        (None, None) => Ok((0..args.batch)
            .map(|_| Seq {
                q0: 0,
                k0: 0,
                sq: args.seqlen_q,
                sk: args.seqlen_k,
            })
            .collect()),
        (Some((tq, tk)), Some((cq, ck))) => {
            let offsets = |name: &'static str, cu: &[i32], total: usize, max: usize| {
                if cu.len() != args.batch + 1 {
                    return Err(invalid(
                        name,
                        format!("{} offsets (batch + 1)", args.batch + 1),
                        cu.len(),
                    ));
                }
                let ok = cu[0] == 0
                    && cu
                        .windows(2)
                        .all(|w| w[0] <= w[1] && (w[1] - w[0]) as usize <= max)
                    && cu[args.batch] as usize <= total;
                if !ok {
                    return Err(invalid(
                        name,
                        format!(
                            "offsets from 0, non-decreasing, ≤ {total}, sequences ≤ {max} tokens"
                        ),
                        format!("{cu:?}"),
                    ));
                }
                Ok(())
            };
            offsets("cu_seqlens_q", cq, tq, args.seqlen_q)?;
            offsets("cu_seqlens_k", ck, tk, args.seqlen_k)?;
            Ok((0..args.batch)
                .map(|b| Seq {
                    q0: cq[b] as usize,
                    k0: ck[b] as usize,
                    sq: (cq[b + 1] - cq[b]) as usize,
                    sk: (ck[b + 1] - ck[b]) as usize,
                })
                .collect())
        }
        _ => Err(invalid(
            "cu_seqlens",
            "offsets exactly for a packed batch (AttentionArgs::varlen)",
            if cu.is_some() { "offsets" } else { "none" },
        )),
    }
}

fn check_len(arg: &'static str, len: usize, e: &Extent, s: &Strides) -> Result<()> {
    let span = e.span(s).unwrap_or(usize::MAX);
    if len < span {
        return Err(invalid(
            arg,
            format!("length ≥ {span} (its layout's span)"),
            len,
        ));
    }
    Ok(())
}

/// A head of a tensor: element `e` of head `h` of token `t` (from the buffer's start) of
/// sequence `b`.
fn at(s: &Strides, packed: bool, b: usize, t: usize, h: usize) -> usize {
    (if packed { 0 } else { b * s.batch }) + t * s.token + h * s.head
}

/// Whether query `i` sees key `j` of a sequence.
fn allows(args: &AttentionArgs, seq: &Seq, i: usize, j: usize) -> bool {
    let d = i as i64 + seq.sk as i64 - seq.sq as i64;
    let j = j as i64;
    args.window_right.is_none_or(|w| j <= d + w as i64)
        && args.window_left.is_none_or(|w| j >= d - w as i64)
}

/// The scores of query row `i` of head `h` (`None` where masked) and each score's slope
/// `∂s/∂(scale·q·k)` (the softcap's `1 − tanh²`, else 1).
#[allow(clippy::too_many_arguments)]
fn scores<T: Element>(
    args: &AttentionArgs,
    seq: &Seq,
    b: usize,
    h: usize,
    i: usize,
    q: &[T],
    k: &[T],
) -> Vec<Option<(f64, f64)>> {
    let packed = args.is_varlen();
    let hk = h / (args.heads_q / args.heads_kv);
    let qa = at(&args.q, packed, b, seq.q0 + i, h);
    (0..seq.sk)
        .map(|j| {
            if !allows(args, seq, i, j) {
                return None;
            }
            let ka = at(&args.k, packed, b, seq.k0 + j, hk);
            let dot: f64 = (0..args.head_dim)
                .map(|e| q[qa + e].to_f64() * k[ka + e].to_f64())
                .sum();
            let s = args.scale as f64 * dot;
            Some(if args.softcap > 0.0 {
                let c = args.softcap as f64;
                let t = (s / c).tanh();
                (c * t, 1.0 - t * t)
            } else {
                (s, 1.0)
            })
        })
        .collect()
}

/// `log Σ exp(s)` over the allowed scores (−∞ without any).
fn log_sum_exp(s: &[Option<(f64, f64)>]) -> f64 {
    let m = s
        .iter()
        .flatten()
        .map(|x| x.0)
        .fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + s
        .iter()
        .flatten()
        .map(|x| (x.0 - m).exp())
        .sum::<f64>()
        .ln()
}

/// The shape checks of both directions: the arguments, the offsets, q, k and v.
fn check<T>(
    args: &AttentionArgs,
    q: &[T],
    k: &[T],
    v: &[T],
    cu: Option<(&[i32], &[i32])>,
) -> Result<Vec<Seq>> {
    args.check()?;
    let (eq, ek) = args.extents();
    check_len("q", q.len(), &eq, &args.q)?;
    check_len("k", k.len(), &ek, &args.k)?;
    check_len("v", v.len(), &ek, &args.v)?;
    sequences(args, cu)
}

/// Attention forward (see [`crate::attention_forward`]; `cu` holds a packed batch's
/// `cu_seqlens_q` and `cu_seqlens_k`).
///
/// # Errors
/// As the launcher for the arguments and lengths, and for offsets that do not start at 0,
/// decrease, pass the tokens or make a sequence longer than its maximum.
pub fn attention_forward<T: Element>(
    args: &AttentionArgs,
    q: &[T],
    k: &[T],
    v: &[T],
    cu: Option<(&[i32], &[i32])>,
) -> Result<AttentionOut<T>> {
    let seqs = check(args, q, k, v, cu)?;
    let (packed, d) = (args.is_varlen(), args.head_dim);
    let out = args.out_strides();
    let mut o = vec![T::default(); args.out_len()];
    let mut lse = vec![0f32; args.lse_len()];
    let (lse_b, lse_h) = match args.total_q {
        Some(t) => (0, t),
        None => (args.heads_q * args.seqlen_q, args.seqlen_q),
    };
    for (b, seq) in seqs.iter().enumerate() {
        for h in 0..args.heads_q {
            let hk = h / (args.heads_q / args.heads_kv);
            for i in 0..seq.sq {
                let s = scores(args, seq, b, h, i, q, k);
                let l = log_sum_exp(&s);
                let oa = at(&out, packed, b, seq.q0 + i, h);
                for e in 0..d {
                    let mut acc = 0.0;
                    for (j, x) in s.iter().enumerate() {
                        if let Some((x, _)) = x {
                            let va = at(&args.v, packed, b, seq.k0 + j, hk);
                            acc += (x - l).exp() * v[va + e].to_f64();
                        }
                    }
                    o[oa + e] = T::from_f64(acc);
                }
                lse[b * lse_b + h * lse_h + seq.q0 + i] = l as f32;
            }
        }
    }
    Ok(AttentionOut { o, lse })
}

/// Attention backward from `d_o` (contiguous, shaped as the output), recomputing the
/// probabilities in f64 (see [`crate::attention_backward`]).
///
/// # Errors
/// As [`attention_forward`], and for a `d_o` shorter than the output.
pub fn attention_backward<T: Element>(
    args: &AttentionArgs,
    q: &[T],
    k: &[T],
    v: &[T],
    d_o: &[T],
    cu: Option<(&[i32], &[i32])>,
) -> Result<AttentionGrads<T>> {
    let seqs = check(args, q, k, v, cu)?;
    if d_o.len() < args.out_len() {
        return Err(invalid(
            "d_o",
            format!("length ≥ {} (the output's)", args.out_len()),
            d_o.len(),
        ));
    }
    let (packed, d, scale) = (args.is_varlen(), args.head_dim, args.scale as f64);
    let (eq, ek) = args.extents();
    let out = args.out_strides();
    let [gq, gk, gv] = args.grads;
    let span = |e: &Extent, s: &Strides| e.span(s).unwrap_or(0);
    let (mut dq, mut dk, mut dv) = (
        vec![0f64; span(&eq, &gq)],
        vec![0f64; span(&ek, &gk)],
        vec![0f64; span(&ek, &gv)],
    );
    for (b, seq) in seqs.iter().enumerate() {
        for h in 0..args.heads_q {
            let hk = h / (args.heads_q / args.heads_kv);
            for i in 0..seq.sq {
                let s = scores(args, seq, b, h, i, q, k);
                let l = log_sum_exp(&s);
                let (qa, da) = (
                    at(&args.q, packed, b, seq.q0 + i, h),
                    at(&out, packed, b, seq.q0 + i, h),
                );
                let dot = |va: usize| {
                    (0..d)
                        .map(|e| d_o[da + e].to_f64() * v[va + e].to_f64())
                        .sum::<f64>()
                };
                let p: Vec<Option<(f64, f64, f64)>> = s
                    .iter()
                    .enumerate()
                    .map(|(j, x)| {
                        x.map(|(x, slope)| {
                            (
                                (x - l).exp(),
                                slope,
                                dot(at(&args.v, packed, b, seq.k0 + j, hk)),
                            )
                        })
                    })
                    .collect();
                let delta: f64 = p.iter().flatten().map(|(p, _, dp)| p * dp).sum();
                let dqa = at(&gq, packed, b, seq.q0 + i, h);
                for (j, x) in p.iter().enumerate() {
                    let Some((p, slope, dp)) = *x else { continue };
                    let ds = p * (dp - delta) * slope;
                    let (ka, dka, dva) = (
                        at(&args.k, packed, b, seq.k0 + j, hk),
                        at(&gk, packed, b, seq.k0 + j, hk),
                        at(&gv, packed, b, seq.k0 + j, hk),
                    );
                    for e in 0..d {
                        dq[dqa + e] += scale * ds * k[ka + e].to_f64();
                        dk[dka + e] += scale * ds * q[qa + e].to_f64();
                        dv[dva + e] += p * d_o[da + e].to_f64();
                    }
                }
            }
        }
    }
    let cast = |v: Vec<f64>| v.into_iter().map(T::from_f64).collect();
    Ok(AttentionGrads {
        dq: cast(dq),
        dk: cast(dk),
        dv: cast(dv),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    /// Σ o·w for a fixed random w: a scalar loss whose gradient is the backward of `d_o = w`.
    fn loss(
        args: &AttentionArgs,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        w: &[f64],
        cu: Option<(&[i32], &[i32])>,
    ) -> f64 {
        let o = attention_forward(args, q, k, v, cu).unwrap().o;
        o.iter().zip(w).map(|(o, w)| o * w).sum()
    }

    /// The backward is the gradient of the forward: central differences of `Σ o·w` in f64
    /// agree with dq, dk, dv to 1e-6 relative (h = 1e-5: truncation ~h², rounding ~1e-16/h).
    fn check_gradients(args: AttentionArgs, cu: Option<(&[i32], &[i32])>) {
        let (eq, ek) = args.extents();
        let (q, k, v) = (
            random(eq.span(&args.q).unwrap(), 1),
            random(ek.span(&args.k).unwrap(), 2),
            random(ek.span(&args.v).unwrap(), 3),
        );
        let w = random(args.out_len(), 4);
        let g = attention_backward(&args, &q, &k, &v, &w, cu).unwrap();
        let h = 1e-5;
        let mut worst = 0f64;
        let mut checked = 0;
        for (which, grad) in [(0, &g.dq), (1, &g.dk), (2, &g.dv)] {
            for idx in 0..grad.len() {
                let mut t = [q.clone(), k.clone(), v.clone()];
                t[which][idx] += h;
                let up = loss(&args, &t[0], &t[1], &t[2], &w, cu);
                t[which][idx] -= 2.0 * h;
                let down = loss(&args, &t[0], &t[1], &t[2], &w, cu);
                let fd = (up - down) / (2.0 * h);
                worst = worst.max((fd - grad[idx]).abs() / (1.0 + fd.abs()));
                checked += 1;
            }
        }
        assert!(checked > 0);
        assert!(worst < 1e-6, "{args:?}: worst relative error {worst}");
    }

    #[test]
    fn the_backward_is_the_forwards_gradient() {
        check_gradients(AttentionArgs::new(2, 3, 4, 2, 1, 3), None);
        check_gradients(AttentionArgs::new(1, 4, 4, 2, 2, 2).with_causal(true), None);
        check_gradients(
            AttentionArgs::new(1, 3, 5, 2, 1, 2)
                .with_causal(true)
                .with_softcap(0.7),
            None,
        );
        check_gradients(
            AttentionArgs::new(1, 5, 5, 1, 1, 2).with_window(Some(1), Some(1)),
            None,
        );
        let cu_q = [0, 2, 2, 5];
        let cu_k = [0, 3, 4, 6];
        check_gradients(
            AttentionArgs::varlen(3, 5, 6, 3, 3, 2, 1, 2).with_causal(true),
            Some((&cu_q, &cu_k)),
        );
    }

    #[test]
    fn a_row_that_sees_no_key_is_zero_with_lse_minus_infinity() {
        // Sq > Sk causal: the first Sq − Sk queries see nothing (bottom-right alignment).
        let args = AttentionArgs::new(1, 3, 1, 1, 1, 2).with_causal(true);
        let out = attention_forward(&args, &[1.0f64; 6], &[1.0; 2], &[2.0; 2], None).unwrap();
        assert_eq!(out.o, [0.0, 0.0, 0.0, 0.0, 2.0, 2.0]);
        assert_eq!(out.lse[..2], [f32::NEG_INFINITY; 2]);
        assert_eq!(out.lse[2], std::f32::consts::SQRT_2);
    }

    #[test]
    fn bad_offsets_are_errors() {
        let args = AttentionArgs::varlen(2, 4, 4, 2, 2, 1, 1, 2);
        let x = [0f64; 8];
        for cu in [&[0, 3, 4][..], &[1, 2, 4], &[0, 3, 2], &[0, 2, 5], &[0, 4]] {
            assert!(
                attention_forward(&args, &x, &x, &x, Some((cu, &[0, 2, 4]))).is_err(),
                "{cu:?}"
            );
        }
        assert!(attention_forward(&args, &x, &x, &x, None).is_err());
        assert!(attention_forward(&args, &x, &x, &x, Some((&[0, 2, 4], &[0, 2, 4]))).is_ok());
    }
}
