//! The synthetic task and the initial weights, generated in code: the same on every machine.
use super::*;

/// SplitMix64: the data and the initial weights are the same on every machine.
pub(super) struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// `Σ (2i + 1)·xᵢ` modulo 2⁶⁴ over a sequence (f32 bits or tokens): what
/// `scripts/gpu/train_llama.py` prints for its weights and data, so the two sides can be
/// seen to train the same model on the same batches.
pub(super) fn fingerprint(xs: impl Iterator<Item = u64>) -> u64 {
    xs.enumerate().fold(0u64, |h, (i, x)| {
        h.wrapping_add(x.wrapping_mul(2 * i as u64 + 1))
    })
}

/// Successors per token in the random walk: the walk half of each sequence costs ln 4 nats a
/// token at best.
pub(super) const SUCCESSORS: usize = 4;

/// The synthetic task: a fixed graph, and batches drawn from it by step number.
pub(super) struct Task {
    successors: Vec<[u32; SUCCESSORS]>,
    vocab: usize,
    seed: u64,
}

impl Task {
    pub(super) fn new(vocab: usize, seed: u64) -> Self {
        let mut rng = Rng(seed ^ 0x7A5C);
        let successors = (0..vocab)
            .map(|_| std::array::from_fn(|_| rng.below(vocab) as u32))
            .collect();
        Task {
            successors,
            vocab,
            seed,
        }
    }

    /// Inputs `[batch, seq]` and targets `[batch·seq]` (the inputs shifted by one) of `step`.
    pub(super) fn batch(
        &self,
        cfg: &Config,
        step: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let mut rng = Rng(self.seed ^ (step as u64).wrapping_mul(0x51_7CC1_B727_220A));
        let len = cfg.seq + 1;
        let half = len / 2;
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..cfg.batch {
            let mut tokens = vec![rng.below(self.vocab) as u32];
            while tokens.len() < half {
                let last = *tokens.last().expect("starts with one token") as usize;
                tokens.push(self.successors[last][rng.below(SUCCESSORS)]);
            }
            while tokens.len() < len {
                tokens.push(tokens[tokens.len() - half]);
            }
            inputs.extend_from_slice(&tokens[..cfg.seq]);
            targets.extend_from_slice(&tokens[1..]);
        }
        Ok((
            Tensor::from_vec(inputs, (cfg.batch, cfg.seq), dev)?,
            Tensor::from_vec(targets, cfg.batch * cfg.seq, dev)?,
        ))
    }
}

/// One initial value per trainable tensor, by name; each run makes its own `Var`s from these.
/// A named parameter: shape and initial values.
pub(super) type Param = (String, Vec<usize>, Vec<f32>);

pub(super) fn initial_weights(cfg: &Config) -> Vec<Param> {
    let mut rng = Rng(cfg.seed);
    let mut normal = |name: String, shape: Vec<usize>| {
        let n = shape.iter().product();
        let values = (0..n).map(|_| (0.02 * rng.normal()) as f32).collect();
        (name, shape, values)
    };
    let ones = |name: String, n: usize| (name, vec![n], vec![1f32; n]);
    let (h, kv) = (cfg.hidden, cfg.kv_heads * cfg.head_dim());
    let mut w = vec![normal("embed".into(), vec![cfg.vocab, h])];
    for l in 0..cfg.layers {
        w.push(ones(format!("{l}.attn_norm"), h));
        w.push(normal(format!("{l}.q"), vec![h, h]));
        w.push(normal(format!("{l}.k"), vec![kv, h]));
        w.push(normal(format!("{l}.v"), vec![kv, h]));
        w.push(normal(format!("{l}.o"), vec![h, h]));
        w.push(ones(format!("{l}.mlp_norm"), h));
        w.push(normal(format!("{l}.gate"), vec![cfg.intermediate, h]));
        w.push(normal(format!("{l}.up"), vec![cfg.intermediate, h]));
        w.push(normal(format!("{l}.down"), vec![h, cfg.intermediate]));
    }
    w.push(ones("norm".into(), h));
    w.push(normal("head".into(), vec![cfg.vocab, h]));
    w
}
