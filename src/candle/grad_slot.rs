//! A parameter's gradient handed straight to the training loop instead of to candle's
//! `GradStore`.
//!
//! candle's backward sums every gradient a node returns into the store: the first one for a
//! tensor goes into a fresh zero-filled tensor of its size (a fill and an add, and for a moment
//! three buffers of the parameter's size). The nodes that take a [`GradSlot`]
//! ([`attention_block_with_slots`](super::attention_block_with_slots),
//! [`swiglu_mlp_block_with_slots`](super::swiglu_mlp_block_with_slots),
//! [`embedding_with_slot`](super::embedding_with_slot),
//! [`fused_linear_cross_entropy_with_slot`](super::fused_linear_cross_entropy_with_slot))
//! put the parameter's gradient into the slot as their backward computes it and return none
//! for it; the loop moves it into the store ([`GradSlot::drain_into`]) before the optimizer
//! reads the store.
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Where a parameter's gradient goes when the node that uses the parameter takes this slot;
/// the gradients of every use are summed.
///
/// Clones share the slot (keep one clone with the model, pass `&slot` to each forward). A
/// slot is `Send + Sync`: the sum happens under a lock, in the order candle's backward runs
/// the nodes. It holds what the backwards put into it until [`take`](Self::take) or
/// [`drain_into`](Self::drain_into) empties it, so a loop empties it every step (a step that
/// does not sums the next step's gradient into this one, as a gradient-accumulation loop
/// wants).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use liger_rs::candle::{GradSlot, embedding_with_slot};
/// let dev = Device::Cpu;
/// let table = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?;
/// let ids = Tensor::new(&[1u32, 1, 0], &dev)?;
/// let slot = GradSlot::new();
/// let y = embedding_with_slot(table.as_tensor(), &ids, &slot)?;
/// let mut grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&table).is_none()); // the gradient is in the slot
/// slot.drain_into(&mut grads, table.as_tensor())?;
/// assert_eq!(grads.get(&table).unwrap().to_vec2::<f32>()?, [[1.0, 1.0], [2.0, 2.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct GradSlot(Arc<Mutex<Option<Tensor>>>);

impl std::fmt::Debug for GradSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.lock().as_ref().map(|g| g.shape().clone());
        f.debug_tuple("GradSlot").field(&held).finish()
    }
}

impl GradSlot {
    /// An empty slot.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Tensor>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sum of the gradients put into the slot since it was last emptied (none if no
    /// backward put one), leaving it empty.
    pub fn take(&self) -> Option<Tensor> {
        self.lock().take()
    }

    /// Empties the slot into `grads` as `param`'s gradient, added to one the store already
    /// holds for it (a use of `param` by a node without this slot). An empty slot leaves
    /// `grads` as it is.
    ///
    /// # Errors
    /// A held gradient and the store's of other shapes or dtypes, as candle's add.
    pub fn drain_into(&self, grads: &mut GradStore, param: &Tensor) -> Result<()> {
        let Some(g) = self.take() else {
            return Ok(());
        };
        let sum = plus(grads.remove(param), g)?;
        grads.insert(param, sum);
        Ok(())
    }

    /// Adds `g` to what the slot holds.
    pub(crate) fn add(&self, g: Tensor) -> Result<()> {
        let mut held = self.lock();
        *held = Some(plus(held.take(), g)?);
        Ok(())
    }

    /// A node's gradient `g` of `param`: into `slot` where one is given (and `param` tracks a
    /// gradient: candle keeps a gradient only for such a tensor), returned for candle's
    /// backward where none is.
    pub(crate) fn hand_on(
        slot: Option<&GradSlot>,
        param: &Tensor,
        g: Option<Tensor>,
    ) -> Result<Option<Tensor>> {
        match (slot, g) {
            (Some(slot), Some(g)) if param.track_op() => slot.add(g).map(|()| None),
            (Some(_), _) => Ok(None),
            (None, g) => Ok(g),
        }
    }

    /// `t` (a CPU tensor) as a node whose backward puts its gradient into this slot: a copy of
    /// `t` whose gradient goes nowhere else. The nodes that take a slot route their CPU
    /// composition through it, so a slot gets its gradient on every device.
    pub(crate) fn route(&self, t: &Tensor) -> Result<Tensor> {
        t.apply_op1(Route(self.clone()))
    }
}

/// `before + g`, or `g` alone.
fn plus(before: Option<Tensor>, g: Tensor) -> Result<Tensor> {
    match before {
        Some(before) => before + g,
        None => Ok(g),
    }
}

/// The node of [`GradSlot::route`].
struct Route(GradSlot);

impl CustomOp1 for Route {
    fn name(&self) -> &'static str {
        "liger-rs grad slot"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let mut out = s.device().zeros_impl(l.shape(), s.dtype())?;
        s.copy_strided_src(&mut out, 0, l)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        self.0.add(grad.clone())?;
        Ok(None)
    }
}
