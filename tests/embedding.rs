//! The embedding kernels on the GPU against the reference (`liger_rs::reference::embedding`):
//! the forward bit for bit (a copy), the backward bit for bit against the kernels' stated
//! arithmetic (an f32 sum in token order, rounded once) and within that sum's error of the
//! f64 reference. Every element type and id type; tables whose rows and columns are not whole
//! blocks; strided rows; no tokens; one id for every token; ids outside the table; outputs
//! poisoned before each launch (NaN, then finite), so an element left unwritten fails;
//! determinism; rejected calls (on the CPU, through the reference's shared checks).
mod common;

use common::{Failures, Poison, Rng, assert_close, download, gpu, poisoned_with, upload, widen};
use half::{bf16, f16};
use liger_rs::cudarc::driver::CudaStream;
use liger_rs::reference::{Element, embedding as reference};
use liger_rs::{Dtype, EmbeddingArgs, TokenId, embedding_backward, embedding_forward};
use std::sync::Arc;

/// An id type of the tests: its values from a host integer.
trait Id: TokenId + std::fmt::Debug {
    fn of(v: i64) -> Self;
}
impl Id for u32 {
    fn of(v: i64) -> Self {
        v as u32
    }
}
impl Id for i64 {
    fn of(v: i64) -> Self {
        v
    }
}

/// One case's shape and ids.
struct Case<I> {
    args: EmbeddingArgs,
    ids: Vec<I>,
    name: String,
}

/// Random ids below `vocab`; every `bad`-th one (if any) outside `[0, vocab)`: `vocab` itself,
/// far above it, and, for i64, negative.
fn ids<I: Id>(rng: &mut Rng, tokens: usize, vocab: usize, bad: Option<usize>) -> Vec<I> {
    (0..tokens)
        .map(|t| match bad {
            Some(k) if t % k == k - 1 => match t / k % 3 {
                0 => I::of(vocab as i64),
                1 => I::of(u32::MAX as i64),
                _ => I::of(-1),
            },
            _ => I::of((rng.next_u64() % vocab as u64) as i64),
        })
        .collect()
}

fn cases<I: Id>(rng: &mut Rng) -> Vec<Case<I>> {
    // (tokens, vocab, hidden, table stride pad, rows stride pad, ids outside every k-th).
    let shapes = [
        (1, 1, 1, 0, 0, None),
        (37, 17, 5, 0, 0, None),
        (300, 40, 1025, 3, 0, Some(7)),
        (257, 1000, 2048, 0, 8, None),
        (1000, 33, 64, 0, 0, Some(5)),
        (0, 20, 130, 0, 0, None),
        (4096, 3, 96, 1, 2, None),
    ];
    let mut out = Vec::new();
    for (tokens, vocab, hidden, tpad, rpad, bad) in shapes {
        let args =
            EmbeddingArgs::new(tokens, vocab, hidden).with_strides(hidden + tpad, hidden + rpad);
        out.push(Case {
            name: format!("{tokens} tokens, {vocab} × {hidden}, pads {tpad}/{rpad}, bad {bad:?}"),
            ids: ids::<I>(rng, tokens, vocab, bad),
            args,
        });
    }
    // Every token the same id: one row sums them all, in one block.
    out.push(Case {
        args: EmbeddingArgs::new(2000, 50, 300),
        ids: vec![I::of(31); 2000],
        name: "2000 tokens of one id".into(),
    });
    out
}

/// Elements a strided buffer of `rows` rows must hold.
fn span(rows: usize, hidden: usize, stride: usize) -> usize {
    rows.checked_sub(1).map_or(0, |r| r * stride + hidden)
}

/// The backward as the kernels compute it: each row's gradients added in f32 in token
/// order, rounded once; `[vocab, hidden]` contiguous.
fn f32_in_token_order<T: Element, I: TokenId>(args: &EmbeddingArgs, ids: &[I], dy: &[T]) -> Vec<T> {
    let mut acc = vec![0f32; args.vocab * args.hidden];
    for (t, id) in ids.iter().enumerate() {
        if let Some(r) = id.row(args.vocab) {
            for c in 0..args.hidden {
                acc[r * args.hidden + c] += dy[t * args.rows_stride + c].to_f64() as f32;
            }
        }
    }
    acc.into_iter().map(|v| T::from_f64(v as f64)).collect()
}

/// `buf`'s rows (`rows` of `hidden`, `stride` apart) packed contiguously.
fn rows_of<T: Copy>(buf: &[T], rows: usize, hidden: usize, stride: usize) -> Vec<T> {
    (0..rows)
        .flat_map(|r| buf[r * stride..][..hidden].iter().copied())
        .collect()
}

fn check_case<T: Dtype, I: Id>(stream: &Arc<CudaStream>, rng: &mut Rng, case: &Case<I>) {
    let a = case.args;
    let what = format!(
        "{}, {} ids: {}",
        T::NAME,
        std::any::type_name::<I>(),
        case.name
    );
    let table: Vec<T> = rng.vec(span(a.vocab, a.hidden, a.table_stride), 0.0, 1.0);
    let dy: Vec<T> = rng.vec(span(a.tokens, a.hidden, a.rows_stride), 0.0, 1.0);
    // Buffers of at least one element (CUDA allocates no empty ones), passed as views of
    // the exact lengths.
    let padded = |n: usize| n.max(1);
    let mut ids_host = case.ids.clone();
    ids_host.resize(padded(a.tokens), I::of(0));
    let mut dy_host = dy.clone();
    dy_host.resize(padded(dy.len()), T::from_f64(0.0));
    let (d_table, d_ids, d_dy) = (
        upload(stream, &table),
        stream.clone_htod(&ids_host).expect("upload"),
        upload(stream, &dy_host),
    );
    let (d_ids, d_dy) = (d_ids.slice(..a.tokens), d_dy.slice(..dy.len()));
    let rows_len = span(a.tokens, a.hidden, a.rows_stride);
    let table_len = span(a.vocab, a.hidden, a.table_stride);

    // Each output twice, into NaN and into finite poison: the written elements agree.
    let mut runs = Vec::new();
    for poison in [Poison::Nan, Poison::Finite] {
        let mut y = poisoned_with::<T>(stream, padded(rows_len), poison);
        embedding_forward(stream, &a, &d_table, &d_ids, &mut y.slice_mut(..rows_len))
            .expect("forward");
        let mut dw = poisoned_with::<T>(stream, table_len, poison);
        embedding_backward(stream, &a, &mut dw, &d_ids, &d_dy).expect("backward");
        runs.push((download(stream, &y), download(stream, &dw)));
    }
    let [(y0, dw0), (y1, dw1)] = [runs.remove(0), runs.remove(0)];
    let y = rows_of(&y0, a.tokens, a.hidden, a.rows_stride);
    common::assert_written(
        "y",
        &what,
        &y,
        &rows_of(&y1, a.tokens, a.hidden, a.rows_stride),
    );
    let dw = rows_of(&dw0, a.vocab, a.hidden, a.table_stride);
    common::assert_written(
        "dW",
        &what,
        &dw,
        &rows_of(&dw1, a.vocab, a.hidden, a.table_stride),
    );

    let y_want = reference::embedding_forward(&a, &table, &case.ids).expect("reference forward");
    let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&y), bits(&y_want), "forward, {what}");
    assert_eq!(
        bits(&dw),
        bits(&f32_in_token_order(&a, &case.ids, &dy)),
        "backward against the f32 sum, {what}"
    );

    // Against f64: the f32 sum's error, at most (terms − 1)·2⁻²⁴·Σ|terms| per element.
    let dw_want = reference::embedding_backward(&a, &case.ids, &dy).expect("reference backward");
    let mut abs = vec![0f64; a.vocab * a.hidden];
    let mut count = vec![0f64; a.vocab];
    for (t, id) in case.ids.iter().enumerate() {
        if let Some(r) = id.row(a.vocab) {
            count[r] += 1.0;
            for c in 0..a.hidden {
                abs[r * a.hidden + c] += dy[t * a.rows_stride + c].to_f64().abs();
            }
        }
    }
    let slack: Vec<f64> = abs
        .iter()
        .enumerate()
        .map(|(i, s)| count[i / a.hidden] * 2f64.powi(-24) * s)
        .collect();
    assert_close::<T>("dW", &what, &widen(&dw), &widen(&dw_want), 1.0, &slack);
}

fn sweep<T: Dtype>(test: &str, seed: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut rng = Rng::new(seed);
    let mut failures = Failures::new(test);
    for case in cases::<u32>(&mut rng) {
        failures.run(|| check_case::<T, u32>(&stream, &mut Rng::new(seed + 1), &case));
    }
    for case in cases::<i64>(&mut rng) {
        failures.run(|| check_case::<T, i64>(&stream, &mut Rng::new(seed + 2), &case));
    }
    failures.finish();
}

#[test]
fn gpu_embedding_matches_the_reference_f32() {
    sweep::<f32>("gpu_embedding_matches_the_reference_f32", 1);
}

#[test]
fn gpu_embedding_matches_the_reference_f16() {
    sweep::<f16>("gpu_embedding_matches_the_reference_f16", 2);
}

#[test]
fn gpu_embedding_matches_the_reference_bf16() {
    sweep::<bf16>("gpu_embedding_matches_the_reference_bf16", 3);
}

/// A Llama-sized backward twice on fresh buffers: the same bits.
#[test]
fn gpu_embedding_backward_is_deterministic() {
    let Some(stream) = gpu("gpu_embedding_backward_is_deterministic") else {
        return;
    };
    let mut rng = Rng::new(9);
    let a = EmbeddingArgs::new(common::sized(8192, 512), 32000, 2048);
    let ids: Vec<u32> = (0..a.tokens)
        .map(|_| (rng.next_u64() % 512) as u32)
        .collect();
    let dy: Vec<bf16> = rng.vec(a.tokens * a.hidden, 0.0, 1.0);
    let d_ids = stream.clone_htod(&ids).expect("upload");
    let d_dy = upload(&stream, &dy);
    let run = || {
        let mut dw = poisoned_with::<bf16>(&stream, a.vocab * a.hidden, Poison::Nan);
        embedding_backward(&stream, &a, &mut dw, &d_ids, &d_dy).expect("backward");
        download(&stream, &dw)
    };
    let (first, second) = (run(), run());
    assert!(
        first
            .iter()
            .zip(&second)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );
    assert!(first.iter().all(|v| v.is_finite()), "every row written");
}

#[test]
fn bad_arguments_are_errors() {
    let a = EmbeddingArgs::new(2, 3, 4);
    let table = [0f32; 12];
    let ok = reference::embedding_forward(&a, &table, &[0u32, 2]);
    assert!(ok.is_ok());
    let check = |r: liger_rs::Result<Vec<f32>>, arg: &str, needle: &str| {
        common::expect_invalid(r.map(|_| ()), arg, needle)
    };
    check(
        reference::embedding_forward(&EmbeddingArgs::new(2, 0, 4), &table, &[0u32, 2]),
        "args.vocab",
        "at least 1 row",
    );
    check(
        reference::embedding_forward(&EmbeddingArgs::new(2, 3, 0), &table, &[0u32, 2]),
        "args.hidden",
        "at least 1 element",
    );
    check(
        reference::embedding_forward(&a.with_strides(3, 4), &table, &[0u32, 2]),
        "args.table_stride",
        "row stride ≥ cols = 4",
    );
    check(
        reference::embedding_forward(&a.with_strides(4, 2), &table, &[0u32, 2]),
        "args.rows_stride",
        "row stride ≥ cols = 4",
    );
    check(
        reference::embedding_forward(&a, &table, &[0u32]),
        "ids",
        "exactly 2 ids",
    );
    check(
        reference::embedding_forward(&a, &table[..11], &[0u32, 1]),
        "table",
        "at least 12 elements",
    );
    check(
        reference::embedding_backward(&a, &[0i64, 1], &[0f32; 7]),
        "grad_rows",
        "at least 8 elements",
    );
}
