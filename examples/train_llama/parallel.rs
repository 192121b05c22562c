//! `--ranks N`: each selected run data-parallel over N ranks, beside the same run on one
//! device with the same global batch. On GPUs (feature `nccl`): one thread per GPU 0..N−1,
//! each with its own candle device and stream, the gradients averaged through NCCL
//! (`liger_rs::candle::ddp::Nccl`). With `--cpu`: the ranks are threads on the CPU, combining
//! through host memory (`HostGroup`), which checks the loop without GPUs. The report: both
//! loss curves and their gap (in f32 within [`AGREE_RANKS_F32`], or the example exits 1),
//! whether the ranks' f32 master weights ended equal, tokens/s of both and the scaling
//! efficiency.
use super::*;

/// In f32 the data-parallel curve must follow the one-device curve this closely (relative),
/// at every step: the ranks change only the order of the gradient sums.
const AGREE_RANKS_F32: f64 = 1e-4;

/// What a data-parallel model needs of its reducer, for any collective.
pub(super) trait Reduce {
    /// Each gradient made the mean over the ranks.
    fn average(&self, grads: &mut GradStore) -> Result<()>;
}

impl<C: Collective> Reduce for DataParallel<C> {
    fn average(&self, grads: &mut GradStore) -> Result<()> {
        self.average_gradients(grads)
    }
}

pub(super) fn main(
    cfg: &Config,
    init: &[Param],
    task: &Task,
    dev: &Device,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    if !cfg.cpu {
        let gpus = liger_rs::cudarc::driver::CudaContext::device_count()? as usize;
        if gpus < cfg.ranks {
            return Err(format!(
                "--ranks {} needs {} GPUs; this machine has {gpus} (`--cpu --ranks {}` runs the \
                 ranks as threads on the CPU)",
                cfg.ranks, cfg.ranks, cfg.ranks
            )
            .into());
        }
    }
    let mut pairs = Vec::new();
    if cfg.mode != Mode::Liger {
        let one = train::<CandleNn, HostGroup>(cfg, init, task, dev, None)?;
        pairs.push((one, ranks::<CandleNn>(cfg, init, task)?));
    }
    if cfg.mode != Mode::Candle {
        let one = train::<LigerRs, HostGroup>(cfg, init, task, dev, None)?;
        pairs.push((one, ranks::<LigerRs>(cfg, init, task)?));
    }
    if !report(cfg, &pairs) {
        std::process::exit(1);
    }
    Ok(())
}

/// The run over `cfg.ranks` ranks: rank 0's record (its losses are the means over the ranks,
/// and it says whether every rank ended with the same weights).
fn ranks<O: FusedOps>(cfg: &Config, init: &[Param], task: &Task) -> Result<Run> {
    let runs = match cfg.cpu {
        true => std::thread::scope(|s| {
            let ranks: Vec<_> = HostGroup::new(cfg.ranks)
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let rank = g.rank();
                        or_exit(rank, || {
                            train::<O, HostGroup>(cfg, init, task, &Device::Cpu, Some(g))
                        })
                    })
                })
                .collect();
            join(ranks)
        }),
        false => on_gpus::<O>(cfg, init, task)?,
    };
    runs.into_iter()
        .next()
        .ok_or_else(|| candle_core::Error::Msg("no rank ran".into()))
}

/// Rank `rank`'s run; on its error or panic the process exits, since the other ranks would
/// wait for this one in their next collective.
fn or_exit(rank: usize, run: impl FnOnce() -> Result<Run>) -> Run {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(run)) => run,
        Ok(Err(e)) => {
            eprintln!("rank {rank}: {e}");
            std::process::exit(1)
        }
        Err(_) => {
            eprintln!("rank {rank} panicked");
            std::process::exit(1)
        }
    }
}

fn join(ranks: Vec<std::thread::ScopedJoinHandle<'_, Run>>) -> Vec<Run> {
    ranks
        .into_iter()
        .map(|h| {
            h.join()
                .expect("a rank exits the process rather than unwind")
        })
        .collect()
}

/// One thread per GPU, each creating its device and its NCCL rank (NCCL's initialisation
/// waits for every rank, so they are created concurrently).
#[cfg(feature = "nccl")]
fn on_gpus<O: FusedOps>(cfg: &Config, init: &[Param], task: &Task) -> Result<Vec<Run>> {
    use liger_rs::candle::ddp::Nccl;
    let id = Nccl::unique_id()?;
    Ok(std::thread::scope(|s| {
        let ranks: Vec<_> = (0..cfg.ranks)
            .map(|rank| {
                s.spawn(move || {
                    or_exit(rank, || {
                        let dev = Device::new_cuda(rank)?;
                        let nccl = Nccl::new(&dev, rank, cfg.ranks, id)?;
                        train::<O, Nccl>(cfg, init, task, &dev, Some(nccl))
                    })
                })
            })
            .collect();
        join(ranks)
    }))
}

#[cfg(not(feature = "nccl"))]
fn on_gpus<O: FusedOps>(cfg: &Config, _: &[Param], _: &Task) -> Result<Vec<Run>> {
    Err(candle_core::Error::Msg(format!(
        "--ranks {} on GPUs needs the `nccl` feature (cargo run --release --features nccl \
         --example train_llama -- --ranks {}); `--cpu --ranks {}` runs the ranks as threads on \
         the CPU",
        cfg.ranks, cfg.ranks, cfg.ranks
    )))
}

/// Each run against its data-parallel twin; false if a twin drifted apart or, in f32, left
/// the one-device curve.
fn report(cfg: &Config, pairs: &[(Run, Run)]) -> bool {
    let mut ok = true;
    for (one, many) in pairs {
        println!();
        println!(
            "{}: one device against {} ranks of {} rows, the same batches",
            one.name,
            many.ranks,
            cfg.batch / many.ranks
        );
        println!(
            "step  {:>10}  {:>10}  relative gap",
            "1 rank",
            format!("{} ranks", many.ranks)
        );
        let mut gap = 0f64;
        for (i, (x, y)) in one.losses.iter().zip(&many.losses).enumerate() {
            let g = relative_gap(*x, *y);
            // A NaN loss (a diverged run) is the largest gap, not one that `f64::max` drops.
            gap = if g.is_nan() {
                f64::INFINITY
            } else {
                gap.max(g)
            };
            println!("{:>4}  {x:>10.6}  {y:>10.6}  {g:.2e}", i + 1);
        }
        let tps = |r: &Run| cfg.tokens_per_step() as f64 / r.median_step_s();
        let peak = |r: &Run| {
            r.peak_bytes.map_or("n/a".to_string(), |b| {
                format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
            })
        };
        println!(
            "tokens/s: {:.0} on one device, {:.0} on {} ranks: scaling efficiency {:.1} %; \
             peak memory {} against {} on rank 0",
            tps(one),
            tps(many),
            many.ranks,
            100.0 * tps(many) / (many.ranks as f64 * tps(one)),
            peak(one),
            peak(many)
        );
        println!(
            "largest relative gap over {} steps: {gap:.2e}; the ranks' weights {}",
            one.losses.len(),
            if many.in_sync {
                "ended equal on every rank"
            } else {
                "DIFFER"
            }
        );
        if !many.in_sync {
            println!("FAIL: the ranks' weights drifted apart");
            ok = false;
        }
        if cfg.dtype == DType::F32 && gap > AGREE_RANKS_F32 {
            println!("FAIL: in f32 the data-parallel curve must follow within {AGREE_RANKS_F32:e}");
            ok = false;
        }
    }
    ok
}
