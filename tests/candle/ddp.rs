//! `liger_rs::candle::ddp`: the in-process host group's collectives against sums computed
//! here, the buckets, gradient averaging against the single-rank gradient of the whole batch,
//! a short data-parallel run whose ranks stay bitwise equal and follow the single-rank run
//! (all on the CPU, always run); NCCL on one GPU and on two (feature `nccl`).
use crate::common::{self, Rng};
use candle_core::{DType, Device, Tensor, Var};
use liger_rs::candle::ddp::{Collective, DataParallel, HostGroup, ReduceOp};
use liger_rs::candle::nn::{AdamW, Optimizer, ParamsAdamW};

/// Runs `body(rank, group)` on one thread per rank and returns the ranks' results in order.
fn on_ranks<R: Send>(n: usize, body: impl Fn(HostGroup) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = HostGroup::new(n)
            .into_iter()
            .map(|g| s.spawn(|| body(g)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    })
}

#[test]
fn host_group_reduces_in_rank_order_and_every_rank_gets_the_same_bits() {
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let got = on_ranks(3, |g| {
            let r = g.rank() as f64;
            let values: Vec<f64> = (0..7).map(|i| (i as f64 - 3.0) * (r + 1.0) + r).collect();
            let t = Tensor::new(values.as_slice(), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("tensor");
            let view = t.reshape((7, 1)).expect("view");
            let mut out = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                let x = view.copy().expect("copy");
                g.all_reduce(&x, op).expect("all_reduce");
                out.push(
                    x.to_dtype(DType::F64)
                        .and_then(|x| x.flatten_all()?.to_vec1::<f64>()),
                );
            }
            (
                g.world_size(),
                out.into_iter()
                    .map(|r| r.expect("read"))
                    .collect::<Vec<_>>(),
            )
        });
        for (rank, (world, out)) in got.iter().enumerate() {
            assert_eq!(*world, 3);
            assert_eq!(out, &got[0].1, "{dtype:?}: rank {rank} differs from rank 0");
        }
        let part = |r: f64, i: usize| (i as f64 - 3.0) * (r + 1.0) + r;
        for i in 0..7 {
            let vals = [0.0, 1.0, 2.0].map(|r| part(r, i));
            let want = [
                vals.iter().sum::<f64>(),
                vals.iter().copied().fold(f64::MIN, f64::max),
                vals.iter().copied().fold(f64::MAX, f64::min),
            ];
            for (k, w) in want.iter().enumerate() {
                // Small integers: exact in every dtype here.
                assert_eq!(got[0].1[k][i], *w, "{dtype:?} op {k} element {i}");
            }
            // The mean, rounded once to the dtype.
            let mean = Tensor::new(&[want[0] / 3.0], &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype)?.to_dtype(DType::F64)?.to_vec1::<f64>())
                .expect("mean");
            assert_eq!(got[0].1[3][i], mean[0], "{dtype:?} mean, element {i}");
        }
    }
}

#[test]
fn host_group_refuses_non_contiguous_tensors() {
    let g = HostGroup::new(1).pop().expect("rank");
    let t = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).expect("tensor");
    let r = g.all_reduce(&t.t().expect("transpose"), ReduceOp::Sum);
    common::expect_err("a transposed tensor", r, &["non-contiguous"]);
}

fn var(n: usize, dtype: DType) -> Var {
    Var::zeros(n, dtype, &Device::Cpu).expect("var")
}

#[test]
fn buckets_take_the_last_parameters_first_up_to_the_byte_cap_and_one_dtype_each() {
    let g = || HostGroup::new(1).pop().expect("rank");
    // f32: 4 bytes each. Caps of 40 bytes: [8, 2] from the end, then [9] (too big with 2 more), ...
    let vars = vec![
        var(3, DType::F32),
        var(9, DType::F32),
        var(8, DType::F32),
        var(2, DType::F32),
    ];
    let ddp = DataParallel::new(g(), vars, 40).expect("ddp");
    assert_eq!(ddp.buckets(), &[2..4, 1..2, 0..1]);
    // A parameter over the cap is a bucket of its own; a dtype change ends a bucket.
    let vars = vec![
        var(2, DType::F32),
        var(2, DType::F32),
        var(100, DType::F32),
        var(4, DType::BF16),
        var(4, DType::F32),
    ];
    let ddp = DataParallel::new(g(), vars, 64).expect("ddp");
    assert_eq!(ddp.buckets(), &[4..5, 3..4, 2..3, 0..2]);
    let all = DataParallel::new(g(), vec![var(5, DType::F32), var(5, DType::F32)], 1 << 20);
    let one_bucket = all.expect("ddp").buckets().to_vec();
    assert_eq!((one_bucket.len(), &one_bucket[0]), (1, &(0..2)));
    let none = DataParallel::new(g(), Vec::new(), 64).map(|_| ());
    common::expect_err("no parameters", none, &["0 parameters"]);
    let zero = DataParallel::new(g(), vec![var(1, DType::F32)], 0).map(|_| ());
    common::expect_err("empty buckets", zero, &["0 bytes"]);
}

/// A linear model `y = x·w + b` with a mean squared error: the data, the initial weights.
struct Problem {
    x: Vec<f32>,
    y: Vec<f32>,
    w: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Problem {
    fn new(rows: usize, cols: usize) -> Self {
        let mut rng = Rng::new(5);
        Problem {
            x: rng.vec::<f32>(rows * cols, 0.0, 1.0),
            y: rng.vec::<f32>(rows, 0.0, 1.0),
            w: rng.vec::<f32>(cols, 0.0, 0.5),
            rows,
            cols,
        }
    }

    /// Rows `range` of the batch.
    fn shard(&self, range: std::ops::Range<usize>) -> (Tensor, Tensor) {
        let n = range.len();
        let x = &self.x[range.start * self.cols..range.end * self.cols];
        let x = Tensor::from_slice(x, (n, self.cols), &Device::Cpu).expect("x");
        let y = Tensor::from_slice(&self.y[range], (n, 1), &Device::Cpu).expect("y");
        (x, y)
    }

    fn loss(&self, w: &Var, b: &Var, (x, y): &(Tensor, Tensor)) -> Tensor {
        let p = x
            .matmul(&w.as_tensor().reshape((self.cols, 1)).expect("w"))
            .and_then(|p| p.broadcast_add(b.as_tensor()))
            .expect("prediction");
        (p - y).and_then(|d| d.sqr()?.mean_all()).expect("loss")
    }
}

/// `steps` AdamW steps on `shards` (each rank its shard, the gradients averaged), returning
/// each rank's losses (the mean over the ranks), weights and whether the ranks were in sync.
fn train(p: &Problem, ranks: usize, steps: usize) -> Vec<(Vec<f32>, Vec<f32>, bool)> {
    on_ranks(ranks, |g| {
        let per = p.rows / ranks;
        let shard = p.shard(g.rank() * per..(g.rank() + 1) * per);
        let w = Var::from_slice(&p.w, p.cols, &Device::Cpu).expect("w");
        let b = Var::zeros(1, DType::F32, &Device::Cpu).expect("b");
        let ddp = DataParallel::new(g, vec![w.clone(), b.clone()], 16).expect("ddp");
        let params = ParamsAdamW {
            lr: 0.05,
            ..ParamsAdamW::default()
        };
        let mut opt = AdamW::new(vec![w.clone(), b.clone()], params).expect("adamw");
        let mut losses = Vec::new();
        for _ in 0..steps {
            let loss = p.loss(&w, &b, &shard);
            let mut grads = loss.backward().expect("backward");
            ddp.average_gradients(&mut grads).expect("average");
            opt.step(&grads).expect("step");
            losses.push(ddp.mean(&loss).expect("mean"));
        }
        let weights = w.as_tensor().to_vec1::<f32>().expect("w");
        (losses, weights, ddp.in_sync().expect("in_sync"))
    })
}

#[test]
fn averaged_gradients_are_the_gradient_of_the_whole_batch() {
    let p = Problem::new(24, 5);
    let whole = {
        let w = Var::from_slice(&p.w, p.cols, &Device::Cpu).expect("w");
        let b = Var::zeros(1, DType::F32, &Device::Cpu).expect("b");
        let grads = p
            .loss(&w, &b, &p.shard(0..p.rows))
            .backward()
            .expect("backward");
        [&w, &b].map(|v| grads.get(v).expect("grad").to_vec1::<f32>().expect("read"))
    };
    for ranks in [2, 3, 4] {
        let got = on_ranks(ranks, |g| {
            let per = p.rows / ranks;
            let shard = p.shard(g.rank() * per..(g.rank() + 1) * per);
            let w = Var::from_slice(&p.w, p.cols, &Device::Cpu).expect("w");
            let b = Var::zeros(1, DType::F32, &Device::Cpu).expect("b");
            let ddp = DataParallel::new(g, vec![w.clone(), b.clone()], 1 << 20).expect("ddp");
            let mut grads = p.loss(&w, &b, &shard).backward().expect("backward");
            ddp.average_gradients(&mut grads).expect("average");
            [&w, &b].map(|v| grads.get(v).expect("grad").to_vec1::<f32>().expect("read"))
        });
        for (rank, g) in got.iter().enumerate() {
            assert_eq!(
                g, &got[0],
                "{ranks} ranks: rank {rank}'s gradients differ from rank 0's"
            );
            for (k, (a, b)) in g.iter().flatten().zip(whole.iter().flatten()).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{ranks} ranks, element {k}: {a} against the whole batch's {b}"
                );
            }
        }
    }
}

#[test]
fn data_parallel_ranks_stay_bitwise_equal_and_follow_the_single_rank_run() {
    let p = Problem::new(32, 6);
    let single = train(&p, 1, 30).pop().expect("one rank");
    assert!(single.2);
    for ranks in [2, 4] {
        let runs = train(&p, ranks, 30);
        for (rank, (losses, weights, in_sync)) in runs.iter().enumerate() {
            assert!(*in_sync, "{ranks} ranks: rank {rank} drifted");
            assert_eq!(weights, &runs[0].1, "{ranks} ranks: rank {rank}'s weights");
            assert_eq!(losses, &runs[0].0, "{ranks} ranks: rank {rank}'s losses");
            for (step, (a, b)) in losses.iter().zip(&single.0).enumerate() {
                let gap = ((a - b) / b).abs();
                assert!(
                    gap < 1e-4,
                    "{ranks} ranks, step {step}: loss {a} against {b}"
                );
            }
        }
        assert!(
            runs[0].0[29] < 0.5 * runs[0].0[0],
            "the loss did not fall: {:?}",
            runs[0].0
        );
    }
}

#[test]
fn in_sync_sees_one_rank_drifting() {
    let got = on_ranks(3, |g| {
        let rank = g.rank();
        let w = Var::ones(4, DType::F32, &Device::Cpu).expect("w");
        let ddp = DataParallel::new(g, vec![w.clone()], 1 << 20).expect("ddp");
        let before = ddp.in_sync().expect("in_sync");
        if rank == 2 {
            w.set(&Tensor::new(&[1f32, 1.0, 1.0 + f32::EPSILON, 1.0], &Device::Cpu).expect("t"))
                .expect("set");
        }
        (before, ddp.in_sync().expect("in_sync"))
    });
    assert!(
        got.iter().all(|&(before, after)| before && !after),
        "{got:?}"
    );
    // A NaN on one rank only, whichever: Max and Min pass over it, the count does not.
    for nan_rank in 0..2 {
        let got = on_ranks(2, |g| {
            let v = if g.rank() == nan_rank { f32::NAN } else { 1.0 };
            let w = Var::new(&[v, 2.0], &Device::Cpu).expect("w");
            DataParallel::new(g, vec![w], 1 << 20)
                .and_then(|d| d.in_sync())
                .expect("in_sync")
        });
        assert_eq!(got, [false, false], "a NaN on rank {nan_rank}");
    }
}

/// A gradient of another dtype than its parameter's is refused before any collective.
#[test]
fn a_gradient_of_another_dtype_is_refused() {
    let got = on_ranks(1, |g| {
        let w = Var::zeros(2, DType::F32, &Device::Cpu).expect("w");
        let ddp = DataParallel::new(g, vec![w.clone()], 1 << 20).expect("ddp");
        let mut grads = w
            .as_tensor()
            .sum_all()
            .and_then(|l| l.backward())
            .expect("grads");
        let half = Tensor::zeros(2, DType::F16, &Device::Cpu).expect("f16");
        grads.insert(&w, half);
        ddp.average_gradients(&mut grads).map(|_| ())
    });
    common::expect_err(
        "an f16 gradient",
        got.into_iter().next().expect("one rank"),
        &["F16"],
    );
}

#[test]
fn a_parameter_without_a_gradient_gets_the_mean_of_the_others() {
    let got = on_ranks(2, |g| {
        let rank = g.rank();
        let w = Var::zeros(3, DType::F32, &Device::Cpu).expect("w");
        let ddp = DataParallel::new(g, vec![w.clone()], 1 << 20).expect("ddp");
        let mut grads = match rank {
            0 => (w.as_tensor() * 4.0).and_then(|t| t.sum_all()?.backward()),
            _ => Tensor::zeros(1, DType::F32, &Device::Cpu)
                .and_then(|t| Var::from_tensor(&t)?.as_tensor().sum_all()?.backward()),
        }
        .expect("backward");
        ddp.average_gradients(&mut grads).expect("average");
        grads.get(&w).expect("grad").to_vec1::<f32>().expect("read")
    });
    assert_eq!(got, vec![vec![2.0; 3]; 2]);
}

#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use liger_rs::candle::ddp::Nccl;

    /// One rank on GPU 0: NCCL's all-reduce over one rank leaves the values as they are, and
    /// averaging is the identity.
    #[test]
    fn gpu_nccl_one_rank_is_the_identity() {
        let test = "gpu_nccl_one_rank_is_the_identity";
        let Some(dev) = common::candle_gpu(test) else {
            return;
        };
        let id = Nccl::unique_id().expect("id");
        let nccl = Nccl::new(&dev, 0, 1, id).expect("nccl");
        assert_eq!((nccl.rank(), nccl.world_size()), (0, 1));
        let mut rng = Rng::new(3);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let values = rng.vec::<f32>(1000, 0.0, 1.0);
            let t = Tensor::from_slice(&values, 1000, &dev)
                .and_then(|t| t.to_dtype(dtype))
                .expect("tensor");
            let before = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_vec1::<f32>())
                .expect("read");
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                nccl.all_reduce(&t, op).expect("all_reduce");
            }
            let after = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_vec1::<f32>())
                .expect("read");
            assert_eq!(before, after, "{dtype:?}");
        }
        let cpu = Tensor::zeros(4, DType::F32, &Device::Cpu).expect("cpu");
        let on_cpu = nccl.all_reduce(&cpu, ReduceOp::Sum);
        common::expect_err("a CPU tensor", on_cpu, &["CUDA tensors"]);
        let cpu_rank = Nccl::new(&Device::Cpu, 0, 1, id).map(|_| ());
        common::expect_err("a CPU device", cpu_rank, &["CUDA device"]);
        let past = Nccl::new(&dev, 1, 1, id).map(|_| ());
        common::expect_err("rank 1 of 1", past, &["rank 1 of a group of 1"]);
    }

    /// Two ranks on GPUs 0 and 1, one fresh thread each (no current device: the rank's must be
    /// bound for NCCL): NCCL's sums, a tensor on the other rank's GPU refused, and a
    /// data-parallel run whose ranks stay in sync and match the host group's.
    #[test]
    fn gpu_nccl_two_ranks_sum_and_stay_in_sync() {
        let test = "gpu_nccl_two_ranks_sum_and_stay_in_sync";
        let devices = match (Device::new_cuda(0), Device::new_cuda(1)) {
            (Ok(a), Ok(b)) => [a, b],
            (Err(e), _) | (_, Err(e)) => {
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                let why = format!("needs a second GPU ({first})");
                common::skip(test, &why, common::Need::Gpus(2));
                return;
            }
        };
        let id = Nccl::unique_id().expect("id");
        let got: Vec<(Vec<f32>, bool)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (dev, other) = (devices[rank].clone(), devices[1 - rank].clone());
                    s.spawn(move || {
                        let nccl = Nccl::new(&dev, rank, 2, id).expect("nccl");
                        let t = Tensor::new(&[1f32 + rank as f32, 10.0, -3.0 * rank as f32], &dev)
                            .expect("t");
                        nccl.all_reduce(&t, ReduceOp::Sum).expect("sum");
                        let elsewhere = Tensor::zeros(3, DType::F32, &other)
                            .expect("a tensor on the other GPU");
                        common::expect_err(
                            "a tensor on the other rank's GPU",
                            nccl.all_reduce(&elsewhere, ReduceOp::Sum),
                            &["through a rank on GPU"],
                        );
                        let w = Var::ones(5, DType::F32, &dev).expect("w");
                        let ddp = DataParallel::new(nccl, vec![w.clone()], 1 << 20).expect("ddp");
                        let x = Tensor::full(rank as f32 + 1.0, 5, &dev).expect("x");
                        let mut grads = (w.as_tensor() * &x)
                            .and_then(|t| t.sum_all()?.backward())
                            .expect("backward");
                        ddp.average_gradients(&mut grads).expect("average");
                        let g = grads.get(&w).expect("grad").to_vec1::<f32>().expect("read");
                        assert_eq!(g, vec![1.5; 5], "rank {rank}");
                        (
                            t.to_vec1::<f32>().expect("read"),
                            ddp.in_sync().expect("in_sync"),
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect()
        });
        for (rank, (sum, in_sync)) in got.iter().enumerate() {
            assert_eq!(sum, &vec![3.0, 20.0, -3.0], "rank {rank}");
            assert!(in_sync, "rank {rank}");
        }
    }
}
