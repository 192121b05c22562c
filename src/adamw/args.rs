//! The optimizers' public arguments and their checks, shared by the GPU launchers and the CPU
//! reference.
use super::abi::{AMSGRAD, DECOUPLED, MAXIMIZE, NESTEROV};
use crate::error::{Result, invalid};

/// The hyper-parameters of one AdamW (or Adam) step: PyTorch's `torch.optim.AdamW` /
/// `torch.optim.Adam` arguments, with the same defaults.
///
/// ```
/// use liger_rs::AdamWArgs;
/// let a = AdamWArgs::new(1e-3);
/// assert_eq!((a.beta1, a.beta2, a.eps, a.weight_decay, a.decoupled), (0.9, 0.999, 1e-8, 0.01, true));
/// let adam = AdamWArgs::adam(1e-3);
/// assert_eq!((adam.weight_decay, adam.decoupled), (0.0, false));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct AdamWArgs {
    /// Learning rate (> 0, finite).
    pub lr: f64,
    /// β1 in `[0, 1)`.
    pub beta1: f64,
    /// β2 in `[0, 1)`.
    pub beta2: f64,
    /// ε ≥ 0, added to `√v̂` (outside the square root).
    pub eps: f64,
    /// Weight decay λ ≥ 0.
    pub weight_decay: f64,
    /// Decoupled weight decay (AdamW: `θ ← θ − lr·λ·θ`); `false`: Adam's L2 (`g ← g + λ·θ`).
    pub decoupled: bool,
    /// amsgrad: the denominator takes the running maximum of v.
    pub amsgrad: bool,
    /// Ascend the objective instead of descending it.
    pub maximize: bool,
}

impl AdamWArgs {
    /// `torch.optim.AdamW(lr=lr)`'s defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn new(lr: f64) -> Self {
        AdamWArgs {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
            amsgrad: false,
            maximize: false,
        }
    }

    /// `torch.optim.Adam(lr=lr)`'s defaults: AdamW's betas and eps, L2 weight decay 0.
    pub fn adam(lr: f64) -> Self {
        AdamWArgs {
            weight_decay: 0.0,
            decoupled: false,
            ..AdamWArgs::new(lr)
        }
    }

    /// Sets β1 and β2.
    pub fn with_betas(mut self, beta1: f64, beta2: f64) -> Self {
        (self.beta1, self.beta2) = (beta1, beta2);
        self
    }

    /// Sets ε.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets amsgrad.
    pub fn with_amsgrad(mut self, amsgrad: bool) -> Self {
        self.amsgrad = amsgrad;
        self
    }

    /// Sets maximize.
    pub fn with_maximize(mut self, maximize: bool) -> Self {
        self.maximize = maximize;
        self
    }

    /// The checks of every call (PyTorch's, and finite values).
    pub(crate) fn check(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(invalid("args.lr", "a finite value ≥ 0", self.lr));
        }
        for (name, b) in [("args.beta1", self.beta1), ("args.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(invalid(name, "a value in [0, 1)", b));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(invalid("args.eps", "a finite value ≥ 0", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid(
                "args.weight_decay",
                "a finite value ≥ 0",
                self.weight_decay,
            ));
        }
        Ok(())
    }

    pub(crate) fn flags(&self) -> u32 {
        (if self.amsgrad { AMSGRAD } else { 0 })
            | (if self.maximize { MAXIMIZE } else { 0 })
            | (if self.decoupled { DECOUPLED } else { 0 })
    }
}

/// The hyper-parameters of one SGD step: PyTorch's `torch.optim.SGD` arguments, with the same
/// defaults.
///
/// ```
/// use liger_rs::SgdArgs;
/// let s = SgdArgs::new(0.1).with_momentum(0.9).with_nesterov(true);
/// assert_eq!((s.momentum, s.dampening, s.weight_decay, s.nesterov), (0.9, 0.0, 0.0, true));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SgdArgs {
    /// Learning rate (≥ 0, finite).
    pub lr: f64,
    /// Momentum μ ≥ 0 (0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient in the buffer.
    pub dampening: f64,
    /// L2 weight decay λ ≥ 0 (`g ← g + λ·θ`).
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0, as PyTorch requires).
    pub nesterov: bool,
    /// Ascend the objective instead of descending it.
    pub maximize: bool,
}

impl SgdArgs {
    /// `torch.optim.SGD(lr=lr)`'s defaults: no momentum, dampening 0, weight decay 0.
    pub fn new(lr: f64) -> Self {
        SgdArgs {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }

    /// Sets the momentum.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening.
    pub fn with_dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }

    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets Nesterov momentum.
    pub fn with_nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    /// Sets maximize.
    pub fn with_maximize(mut self, maximize: bool) -> Self {
        self.maximize = maximize;
        self
    }

    /// The checks of every call (PyTorch's, and finite values).
    pub(crate) fn check(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(invalid("args.lr", "a finite value ≥ 0", self.lr));
        }
        for (name, v) in [
            ("args.momentum", self.momentum),
            ("args.weight_decay", self.weight_decay),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(name, "a finite value ≥ 0", v));
            }
        }
        if !self.dampening.is_finite() {
            return Err(invalid("args.dampening", "a finite value", self.dampening));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(invalid(
                "args.nesterov",
                "momentum > 0 and dampening 0",
                format!("momentum {}, dampening {}", self.momentum, self.dampening),
            ));
        }
        Ok(())
    }

    pub(crate) fn flags(&self) -> u32 {
        (if self.nesterov { NESTEROV } else { 0 }) | (if self.maximize { MAXIMIZE } else { 0 })
    }
}

/// The norm [`clip_grad_norm`](crate::clip_grad_norm) clips by: PyTorch's `norm_type` 2 or
/// `inf`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormType {
    /// `√Σ g²` over every gradient element.
    #[default]
    L2,
    /// `max |g|` over every gradient element.
    Inf,
}

/// Checks a step count as PyTorch keeps it (f32, at least 1, a whole number).
pub(crate) fn check_step(step: f32) -> Result<()> {
    if !(step >= 1.0 && step.fract() == 0.0 && step < 16_777_216.0) {
        return Err(invalid("step", "a whole number 1 ..= 2²⁴ − 1", step));
    }
    Ok(())
}
