//! Trains a small Llama-style decoder twice from the same initial weights: once with candle-nn's
//! differentiable ops (`ops::rms_norm_slow`, `rotary_emb::rope_slow`, `silu(gate) * up`, and
//! attention as matmul, mask, f32 softmax, matmul over repeated key/value heads) and once with
//! liger-rs's (each layer two autograd nodes over packed weights: `candle::attention_block`,
//! the RMSNorm, the QKV projection, RoPE and the fused attention with grouped key/value heads,
//! the output projection and the residual add, and `candle::swiglu_mlp_block`, the RMSNorm,
//! the gate-up projection, SwiGLU, the down projection and the residual add;
//! `candle::embedding`, `candle::fused_linear_cross_entropy` for the head and the loss, whose
//! `[tokens, vocab]` logits are never held whole, each node putting its weights' gradients
//! into the model's `GradSlot`s rather than candle's backward; and `candle::nn::AdamW`, the
//! fused optimizer step, which in
//! f16/bf16 also rewrites the compute-dtype copies of the weights that the forward uses),
//! then prints both loss curves side by side, each run's step time, tokens/s and peak device
//! memory, and how far apart the two curves are.
//!
//! ```sh
//! cargo run --release --features candle --example train_llama                 # f32 on GPU 0
//! cargo run --release --features candle --example train_llama -- --plot loss.svg   # and the curves
//! cargo run --release --features candle --example train_llama -- --dtype bf16
//! cargo run --release --features candle --example train_llama -- --cpu        # tiny model, CPU
//! cargo run --release --features candle --example train_llama -- --size llama --dtype bf16
//! NCCL_NVLS_ENABLE=0 cargo run --release --features nccl --example train_llama -- --ranks 2
//! cargo run --release --features candle --example train_llama -- --cpu --ranks 2
//! ```
//!
//! `--ranks N` (`parallel.rs`) trains each run data-parallel over N ranks, each on `batch / N`
//! rows of every batch with its gradients averaged over the ranks before clipping: on GPUs
//! 0..N−1 through NCCL (feature `nccl`), or with `--cpu` as threads on the CPU; beside it the
//! same run on one device, then both curves, whether the ranks' f32 weights ended equal, and
//! the scaling efficiency. In f32 it fails (exit code 1) if the curves differ by more than 1e-4
//! (relative) at any step, or if the ranks' weights differ.
//!
//! The model: token embedding, `--layers` pre-norm blocks (RMSNorm → attention with grouped
//! query heads and RoPE → residual; RMSNorm → SwiGLU MLP → residual), a final RMSNorm and an
//! untied head, every matrix a linear layer without a bias. Weights are kept in f32 and cast to
//! `--dtype` in the forward pass (candle-nn's attention softmax and the loss in f32; the fused
//! attention accumulates in f32), trained by AdamW with the gradients clipped to a global norm
//! of 1 in both runs (in candle ops for candle-nn, inside the fused step for liger-rs).
//!
//! The task is generated in code and can be learnt: each sequence is a walk on a fixed random
//! graph where every token has four possible successors (first half), followed by a copy of the
//! first half. The best possible loss is about ½·ln 4 ≈ 0.69 nats (the walk's choices; the copy
//! is fully predictable by attention), against ln(vocab) for a uniform guess.
//!
//! In f32 the example fails (exit code 1) if the two loss curves differ by more than 1e-3
//! (relative) in any of the first 50 steps: the fused ops must train like the ones they replace.
use candle_core::backprop::GradStore;
use candle_core::{D, DType, Device, Result, Tensor, Var};
use candle_nn::{AdamW, Embedding, Linear, Module, Optimizer, ParamsAdamW};
use liger_rs::candle::GradSlot;
use liger_rs::candle::ddp::{Collective, DataParallel, HostGroup, in_sync};
use liger_rs::cudarc::driver::sys;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::Instant;

mod data;
mod ops;
mod parallel;
use data::{Param, SUCCESSORS, Task, fingerprint, initial_weights};
use ops::{CandleNn, LigerRs};
use parallel::Reduce;

/// The fused ops the two runs differ in; the rest of the model is shared code.
trait FusedOps {
    /// Shown in the output.
    const NAME: &'static str;
    /// The optimizer (candle-nn's `ParamsAdamW`).
    type Opt: Optimizer<Config = ParamsAdamW>;
    /// The optimizer over the f32 master weights, and the weights the forward computes with
    /// where they are not the masters cast in the forward.
    fn optimizer(
        masters: Vec<Var>,
        params: ParamsAdamW,
        dtype: DType,
    ) -> Result<(Self::Opt, Option<Vec<Var>>)>;
    /// One optimizer step on `loss`, the gradients clipped to a global L2 norm of [`CLIP`].
    fn step(opt: &mut Self::Opt, model: &Model, loss: &Tensor) -> Result<()>;
    /// RMSNorm over the last dim, candle-nn's `ops::rms_norm(xs, alpha, eps)`.
    fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor>;
    /// The parameters as this run trains them, from [`initial_weights`]'s list (the same
    /// values; a run may join tensors that its ops take as one).
    fn parameters(init: &[Param]) -> Vec<Param> {
        init.to_vec()
    }
    /// Block `l`'s MLP half on the residual stream `xs`: `xs + down(silu(gate(h)) · up(h))`,
    /// `h` the RMSNorm of `xs` with the weight `{l}.mlp_norm`.
    fn mlp(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor>;
    /// The rows of the table `embed` `[vocab, hidden]` at `ids`: candle-nn's `Embedding`.
    fn embedding(model: &Model, ids: &Tensor) -> Result<Tensor>;
    /// Block `l`'s attention half on the residual stream `xs`: `xs + attention(h)`, `h` the
    /// RMSNorm of `xs` with the weight `{l}.attn_norm`, and the attention the q, k, v
    /// projections, RoPE on q and k, causal attention with grouped key/value heads, the
    /// output projection.
    fn attention(model: &Model, l: usize, xs: &Tensor) -> Result<Tensor>;
    /// Mean cross-entropy (f32) of the LM head `head` `[vocab, hidden]` over
    /// `xs [tokens, hidden]` against `targets [tokens]`.
    fn head_loss(model: &Model, xs: &Tensor, targets: &Tensor) -> Result<Tensor>;
}

/// Model, data and run sizes; every field can be set on the command line (`--name value`).
#[derive(Clone, Debug)]
struct Config {
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: usize,
    seq: usize,
    batch: usize,
    steps: usize,
    lr: f64,
    warmup: usize,
    seed: u64,
    dtype: DType,
    cpu: bool,
    mode: Mode,
    /// `--plot FILE.svg`: where to draw the loss curves.
    plot: Option<String>,
    /// `--ranks N`: data-parallel over N ranks (`parallel.rs`), each on `batch / N` rows.
    ranks: usize,
}

/// Which runs to make.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Both,
    Candle,
    Liger,
}

impl Config {
    /// The GPU default: 4 layers, hidden 1024, 16 query / 4 key-value heads of 64, sequences of
    /// 512 in batches of 8.
    fn gpu() -> Self {
        Config {
            layers: 4,
            hidden: 1024,
            heads: 16,
            kv_heads: 4,
            intermediate: 2816,
            vocab: 512,
            seq: 512,
            batch: 8,
            steps: 100,
            lr: 1e-3,
            warmup: 10,
            seed: 1,
            dtype: DType::F32,
            cpu: false,
            mode: Mode::Both,
            plot: None,
            ranks: 1,
        }
    }

    /// `--size llama`: 4 layers of a Llama-2-scale block (hidden 2048, 16 query / 4 key-value
    /// heads of 128, intermediate 5632), vocab 32000, sequences of 2048 in batches of 4.
    fn llama() -> Self {
        Config {
            hidden: 2048,
            intermediate: 5632,
            vocab: 32000,
            seq: 2048,
            batch: 4,
            ..Config::gpu()
        }
    }

    /// The `--cpu` default: the same architecture, small enough for a CPU in seconds.
    fn cpu() -> Self {
        Config {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            intermediate: 176,
            vocab: 64,
            seq: 64,
            batch: 4,
            steps: 30,
            cpu: true,
            ..Config::gpu()
        }
    }

    fn from_args() -> std::result::Result<Self, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        // The size picks the base configuration; the other flags then change it.
        let size = args
            .iter()
            .position(|a| a == "--size")
            .map(|i| args.get(i + 1).map(String::as_str).unwrap_or(""));
        let mut cfg = match (size, args.iter().any(|a| a == "--cpu")) {
            (Some("llama"), _) => Config::llama(),
            (Some("small") | None, false) => Config::gpu(),
            (None, true) => Config::cpu(),
            (Some("small"), true) => Config {
                cpu: true,
                ..Config::gpu()
            },
            (Some(other), _) => return Err(format!("--size {other}: small or llama")),
        };
        if args.iter().any(|a| a == "--cpu") {
            cfg.cpu = true;
        }
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            if flag == "--cpu" {
                continue;
            }
            if flag == "--size" {
                it.next();
                continue;
            }
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            let value = it.next().ok_or(format!("{flag} needs a value"))?;
            let int = || {
                value
                    .parse::<usize>()
                    .map_err(|e| format!("{flag} {value}: {e}"))
            };
            match flag.as_str() {
                "--layers" => cfg.layers = int()?,
                "--hidden" => cfg.hidden = int()?,
                "--heads" => cfg.heads = int()?,
                "--kv-heads" => cfg.kv_heads = int()?,
                "--intermediate" => cfg.intermediate = int()?,
                "--vocab" => cfg.vocab = int()?,
                "--seq" => cfg.seq = int()?,
                "--batch" => cfg.batch = int()?,
                "--steps" => cfg.steps = int()?,
                "--warmup" => cfg.warmup = int()?,
                "--seed" => cfg.seed = int()? as u64,
                "--lr" => cfg.lr = value.parse().map_err(|e| format!("--lr {value}: {e}"))?,
                "--dtype" => {
                    cfg.dtype = match value.as_str() {
                        "f32" => DType::F32,
                        "bf16" => DType::BF16,
                        "f16" => DType::F16,
                        _ => return Err(format!("--dtype {value}: f32, bf16 or f16")),
                    }
                }
                "--mode" => {
                    cfg.mode = match value.as_str() {
                        "both" => Mode::Both,
                        "candle" => Mode::Candle,
                        "liger" => Mode::Liger,
                        _ => return Err(format!("--mode {value}: both, candle or liger")),
                    }
                }
                "--plot" => cfg.plot = Some(value.clone()),
                "--ranks" => cfg.ranks = int()?,
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        let head_dim = cfg.hidden / cfg.heads.max(1);
        if cfg.heads == 0
            || cfg.hidden % cfg.heads != 0
            || head_dim % 2 != 0
            || cfg.kv_heads == 0
            || cfg.heads % cfg.kv_heads != 0
        {
            return Err(format!(
                "--hidden {} --heads {} --kv-heads {}: heads must divide hidden into an even \
                 head size, and kv-heads must divide heads",
                cfg.hidden, cfg.heads, cfg.kv_heads
            ));
        }
        if cfg.seq < 4 || cfg.vocab < 8 || cfg.steps == 0 || cfg.batch == 0 {
            return Err("--seq ≥ 4, --vocab ≥ 8, --steps ≥ 1 and --batch ≥ 1".into());
        }
        if cfg.ranks == 0 || !cfg.batch.is_multiple_of(cfg.ranks) {
            return Err(format!(
                "--ranks {} must divide --batch {} (each rank takes an equal share)",
                cfg.ranks, cfg.batch
            ));
        }
        Ok(cfg)
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    fn tokens_per_step(&self) -> usize {
        self.batch * self.seq
    }
}

/// The decoder, generic over the three fused ops.
struct Model<'a> {
    cfg: &'a Config,
    /// Each parameter's index in `vars`.
    index: HashMap<String, usize>,
    vars: Vec<Var>,
    /// The compute-dtype copies of `vars` that the optimizer keeps, if it keeps them.
    copies: Option<Vec<Var>>,
    /// Where the liger-rs run's nodes put each parameter's gradient (same order as `vars`).
    slots: Vec<GradSlot>,
    /// `[seq, head_dim/2]` in the compute dtype.
    cos: Tensor,
    sin: Tensor,
    /// `[seq, seq]`, −∞ above the diagonal, f32.
    mask: Tensor,
    /// A data-parallel run's gradient reducer (`parallel.rs`).
    reduce: Option<&'a dyn Reduce>,
}

const EPS: f32 = 1e-5;

impl<'a> Model<'a> {
    fn new(cfg: &'a Config, init: &[Param], dev: &Device) -> Result<Self> {
        let vars = init
            .iter()
            .map(|(_, shape, values)| Var::from_vec(values.clone(), shape.as_slice(), dev))
            .collect::<Result<Vec<_>>>()?;
        let half = cfg.head_dim() / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / cfg.head_dim() as f32))
            .collect();
        let positions = Tensor::arange(0u32, cfg.seq as u32, dev)?.to_dtype(DType::F32)?;
        let freqs = positions
            .reshape((cfg.seq, 1))?
            .broadcast_mul(&Tensor::from_vec(inv_freq, (1, half), dev)?)?;
        let mask: Vec<f32> = (0..cfg.seq)
            .flat_map(|i| (0..cfg.seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        Ok(Model {
            cfg,
            index: (init.iter().enumerate())
                .map(|(i, (name, _, _))| (name.clone(), i))
                .collect(),
            slots: vars.iter().map(|_| GradSlot::new()).collect(),
            vars,
            copies: None,
            cos: freqs.cos()?.to_dtype(cfg.dtype)?,
            sin: freqs.sin()?.to_dtype(cfg.dtype)?,
            mask: Tensor::from_vec(mask, (cfg.seq, cfg.seq), dev)?,
            reduce: None,
        })
    }

    /// In a data-parallel run, each gradient made the mean over the ranks (before clipping,
    /// so the norm clipped to is the global batch's).
    fn average(&self, grads: &mut GradStore) -> Result<()> {
        match self.reduce {
            Some(r) => r.average(grads),
            None => Ok(()),
        }
    }

    /// The weights the gradients are taken of: the optimizer's compute-dtype copies, or the
    /// masters.
    fn trained(&self) -> Vec<Var> {
        self.copies.clone().unwrap_or_else(|| self.vars.clone())
    }

    /// The parameter `name` in the compute dtype: the optimizer's copy, or the master cast (a
    /// no-op in f32; in f16/bf16 the gradient reaches the f32 master through the cast).
    fn weight(&self, name: &str) -> Result<Tensor> {
        self.weight_at(self.at(name))
    }

    /// The index of the parameter `name`.
    fn at(&self, name: &str) -> usize {
        *self
            .index
            .get(name)
            .expect("a parameter of initial_weights")
    }

    /// Parameter `i` in the compute dtype, as [`Model::weight`].
    fn weight_at(&self, i: usize) -> Result<Tensor> {
        match &self.copies {
            Some(c) => Ok(c[i].as_tensor().clone()),
            None => self.vars[i].as_tensor().to_dtype(self.cfg.dtype),
        }
    }

    /// Mean cross-entropy of the next-token predictions, f32.
    fn loss<O: FusedOps>(&self, inputs: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let cfg = self.cfg;
        let mut xs = O::embedding(self, inputs)?;
        for l in 0..cfg.layers {
            xs = O::attention(self, l, &xs)?;
            xs = O::mlp(self, l, &xs)?;
        }
        let xs = O::rms_norm(&xs, &self.weight("norm")?, EPS)?;
        let xs = xs.reshape((cfg.tokens_per_step(), cfg.hidden))?;
        O::head_loss(self, &xs, targets)
    }
}

/// What one run measured.
struct Run {
    name: &'static str,
    losses: Vec<f32>,
    /// Seconds per step, the loss read back (so the step's kernels have finished).
    step_s: Vec<f64>,
    /// Highest bytes in use in the device's memory pool during the run (where CUDA allocates
    /// from a pool, as cudarc does when the driver supports it).
    peak_bytes: Option<u64>,
    /// A data-parallel run's ranks (1 otherwise) and whether their f32 master weights ended
    /// equal on every rank.
    ranks: usize,
    in_sync: bool,
}

impl Run {
    /// Median step time after the first step (which loads kernels and warms the allocator,
    /// shown on its own).
    fn median_step_s(&self) -> f64 {
        let mut t: Vec<f64> = self.step_s.iter().skip(1).copied().collect();
        if t.is_empty() {
            return self.step_s[0];
        }
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }
}

/// The device's default memory pool, whose high-water mark gives a run's peak memory.
struct Pool(sys::CUmemoryPool);

impl Pool {
    fn of(dev: &Device) -> Option<Self> {
        let cuda = dev.as_cuda_device().ok()?;
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() {
            return None;
        }
        ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device handle comes from a live context.
        let rc = unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(Pool(pool))
    }

    /// Restarts the high-water mark at the bytes in use now.
    fn reset_peak(&self) {
        let mut zero = 0u64;
        // SAFETY: USED_MEM_HIGH takes a u64 and accepts only 0 (reset); the pool is the
        // device's, alive as long as the context.
        unsafe {
            sys::cuMemPoolSetAttribute(
                self.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            );
        }
    }

    fn peak(&self) -> Option<u64> {
        let mut bytes = 0u64;
        // SAFETY: USED_MEM_HIGH writes one u64.
        let rc = unsafe {
            sys::cuMemPoolGetAttribute(
                self.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut bytes as *mut u64).cast(),
            )
        };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(bytes)
    }
}

/// A one-line progress bar on a terminal, a line every tenth of the run otherwise.
fn progress(name: &str, step: usize, steps: usize, loss: f32, tokens_per_s: f64) {
    let done = step + 1;
    let line = format!(
        "{name:>9} [{:<30}] {done:>4}/{steps} loss {loss:.4} {:.1}k tokens/s",
        "#".repeat(30 * done / steps),
        tokens_per_s / 1e3
    );
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r{line}");
        if done == steps {
            let _ = writeln!(err);
        }
    } else if done == steps || done.is_multiple_of(steps.div_ceil(10)) {
        let _ = writeln!(err, "{line}");
    }
}

/// One run of `cfg.steps` steps on `dev`; with a collective, as its rank of a data-parallel
/// run: the model on its share of each batch (rank `r` of `n` takes rows `r·b/n..(r+1)·b/n`),
/// the gradients averaged, the loss reported the mean over the ranks.
fn train<O: FusedOps, C: Collective>(
    cfg: &Config,
    init: &[Param],
    task: &Task,
    dev: &Device,
    collective: Option<C>,
) -> Result<Run> {
    let pool = Pool::of(dev);
    let (rank, ranks) = collective
        .as_ref()
        .map_or((0, 1), |c| (c.rank(), c.world_size()));
    let local = Config {
        batch: cfg.batch / ranks,
        ..cfg.clone()
    };
    let mut model = Model::new(&local, &O::parameters(init), dev)?;
    let params = ParamsAdamW {
        lr: cfg.lr,
        ..ParamsAdamW::default()
    };
    let (mut opt, copies) = O::optimizer(model.vars.clone(), params, cfg.dtype)?;
    model.copies = copies;
    let ddp = match collective {
        Some(c) => Some(DataParallel::new(
            c,
            model.trained(),
            DataParallel::<C>::DEFAULT_BUCKET_BYTES,
        )?),
        None => None,
    };
    model.reduce = ddp.as_ref().map(|d| d as &dyn Reduce);
    dev.synchronize()?;
    if let Some(pool) = &pool {
        pool.reset_peak();
    }
    let (mut losses, mut step_s) = (Vec::new(), Vec::new());
    for step in 0..cfg.steps {
        let start = Instant::now();
        opt.set_learning_rate(cfg.lr * ((step + 1) as f64 / cfg.warmup.max(1) as f64).min(1.0));
        let (inputs, targets) = task.batch(cfg, step, dev)?;
        let rows = local.batch;
        let inputs = inputs.narrow(0, rank * rows, rows)?;
        let targets = targets.narrow(0, rank * rows * cfg.seq, rows * cfg.seq)?;
        let loss = model.loss::<O>(&inputs, &targets)?;
        O::step(&mut opt, &model, &loss)?;
        let loss = match &ddp {
            Some(d) => d.mean(&loss)?,
            None => loss.to_scalar::<f32>()?,
        };
        step_s.push(start.elapsed().as_secs_f64());
        losses.push(loss);
        if rank > 0 {
            continue;
        }
        progress(
            O::NAME,
            step,
            cfg.steps,
            loss,
            cfg.tokens_per_step() as f64 / step_s[step],
        );
    }
    dev.synchronize()?;
    Ok(Run {
        name: O::NAME,
        losses,
        step_s,
        peak_bytes: pool.and_then(|p| p.peak()),
        ranks,
        in_sync: match &ddp {
            Some(d) => in_sync(d.collective(), &model.vars)?,
            None => true,
        },
    })
}

/// Both runs clip the gradients to this global L2 norm, as PyTorch's `clip_grad_norm_`.
const CLIP: f64 = 1.0;

/// Steps over which the f32 curves must agree, and how closely (relative).
const AGREE_STEPS: usize = 50;
const AGREE_F32: f64 = 1e-3;

fn relative_gap(a: f32, b: f32) -> f64 {
    ((a as f64) - (b as f64)).abs() / (a as f64).abs().max(f64::MIN_POSITIVE)
}

fn report(cfg: &Config, runs: &[Run]) -> bool {
    println!();
    if let [a, b] = runs {
        println!("step  {:>10}  {:>10}  relative gap", a.name, b.name);
        for (i, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
            println!(
                "{:>4}  {x:>10.6}  {y:>10.6}  {:.2e}",
                i + 1,
                relative_gap(*x, *y)
            );
        }
    } else {
        for run in runs {
            println!("step  {:>10}", run.name);
            for (i, x) in run.losses.iter().enumerate() {
                println!("{:>4}  {x:>10.6}", i + 1);
            }
        }
    }
    println!();
    println!(
        "{:>9}  {:>15}  {:>12}  {:>12}  {:>16}  {:>10}",
        "ops", "first step (s)", "step (ms)", "tokens/s", "peak memory", "final loss"
    );
    for run in runs {
        let peak = run.peak_bytes.map_or("n/a".to_string(), |b| {
            format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
        });
        let step = run.median_step_s();
        println!(
            "{:>9}  {:>15.2}  {:>12.2}  {:>12.0}  {:>16}  {:>10.4}",
            run.name,
            run.step_s[0],
            step * 1e3,
            cfg.tokens_per_step() as f64 / step,
            peak,
            run.losses.last().copied().unwrap_or(f32::NAN)
        );
    }
    println!(
        "uniform guess: {:.4} (ln {}); best possible ≈ {:.4} (½ ln {SUCCESSORS})",
        (cfg.vocab as f64).ln(),
        cfg.vocab,
        0.5 * (SUCCESSORS as f64).ln()
    );
    let [a, b] = runs else { return true };
    let n = AGREE_STEPS.min(a.losses.len());
    let gap = (0..n)
        .map(|i| relative_gap(a.losses[i], b.losses[i]))
        // A NaN loss (a diverged run) is the largest gap, not one that `f64::max` drops.
        .fold(
            0f64,
            |m, g| if g.is_nan() { f64::INFINITY } else { m.max(g) },
        );
    let last = a.losses.len() - 1;
    println!(
        "largest relative gap over the first {n} steps: {gap:.2e}; at the last step: {:.2e}",
        relative_gap(a.losses[last], b.losses[last])
    );
    if cfg.dtype == DType::F32 && gap > AGREE_F32 {
        println!("FAIL: in f32 the curves must agree within {AGREE_F32:e}");
        return false;
    }
    true
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let cfg = match Config::from_args() {
        Ok(cfg) => cfg,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("{e}");
            }
            eprintln!(
                "usage: train_llama [--cpu] [--size small|llama] [--dtype f32|bf16|f16] \
                 [--mode both|candle|liger] [--steps N] [--layers N] [--hidden N] [--heads N] [--kv-heads N] \
                 [--intermediate N] [--vocab N] [--seq N] [--batch N] [--lr X] [--warmup N] \
                 [--seed N] [--plot FILE.svg] [--ranks N]"
            );
            std::process::exit(2);
        }
    };
    let dev = if cfg.cpu {
        Device::Cpu
    } else {
        match Device::new_cuda(0) {
            Ok(dev) => dev,
            Err(e) => {
                eprintln!("no CUDA device ({e}); `--cpu` trains a tiny model on the CPU instead");
                std::process::exit(1);
            }
        }
    };
    let head_dim = cfg.head_dim();
    println!(
        "{} layers, hidden {}, {} query / {} key-value heads of {head_dim}, intermediate {}, \
         vocab {}; batch {} × {} tokens; {} steps of AdamW (lr {}, {} warm-up); {:?} on {}",
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.intermediate,
        cfg.vocab,
        cfg.batch,
        cfg.seq,
        cfg.steps,
        cfg.lr,
        cfg.warmup,
        cfg.dtype,
        if cfg.cpu { "the CPU" } else { "GPU 0" }
    );
    let init = initial_weights(&cfg);
    let params: usize = init.iter().map(|(_, _, v)| v.len()).sum();
    println!("{:.1} M parameters", params as f64 / 1e6);
    let task = Task::new(cfg.vocab, cfg.seed);
    let (inputs, _) = task.batch(&cfg, 0, &Device::Cpu)?;
    let tokens = inputs.flatten_all()?.to_vec1::<u32>()?;
    let weights = init
        .iter()
        .flat_map(|(_, _, v)| v.iter().map(|x| x.to_bits() as u64));
    println!(
        "fingerprints: weights {:016x}, first batch {:016x}",
        fingerprint(weights),
        fingerprint(tokens.iter().map(|&t| t as u64))
    );
    if cfg.ranks > 1 {
        return parallel::main(&cfg, &init, &task, &dev);
    }
    let mut runs = Vec::new();
    if cfg.mode != Mode::Liger {
        runs.push(train::<CandleNn, HostGroup>(
            &cfg, &init, &task, &dev, None,
        )?);
    }
    if cfg.mode != Mode::Candle {
        runs.push(train::<LigerRs, HostGroup>(&cfg, &init, &task, &dev, None)?);
    }
    if let Some(path) = &cfg.plot {
        plot(&cfg, &runs, path)?;
        println!("loss curves drawn to {path}");
    }
    if !report(&cfg, &runs) {
        std::process::exit(1);
    }
    Ok(())
}

/// The runs' loss curves (loss against step, one line per run) as an SVG at `path`.
fn plot(
    cfg: &Config,
    runs: &[Run],
    path: &str,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let all = runs.iter().flat_map(|r| r.losses.iter().copied());
    let (lo, hi) = all.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let pad = 0.05 * (hi - lo).max(1e-3);
    let title = format!(
        "{} layers × hidden {}, vocab {}, {} × {} tokens, {:?}",
        cfg.layers, cfg.hidden, cfg.vocab, cfg.batch, cfg.seq, cfg.dtype
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(1..cfg.steps.max(2), (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats)")
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points = run.losses.iter().enumerate().map(|(s, &l)| (s + 1, l));
        chart
            // Wider lines first, so that curves which agree stay visible one over the other.
            .draw_series(LineSeries::new(
                points,
                color.stroke_width(4 - 2 * i.min(1) as u32),
            ))?
            .label(run.name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    root.present()?;
    Ok(())
}
