//! What a `TrainStep` running under the [`AcceleratedStrategy`](super::AcceleratedStrategy) needs from the
//! accelerator: its mixed-precision mode (for [`autocast`]) and its fp16 loss scale (for [`backward`]).
//! burn-train calls `TrainStep::step(&model, batch)` with nothing else, so the strategy installs them for the
//! thread that runs the step, for as long as it runs. Under a strategy that holds only each rank's slices of the
//! parameters between steps (`FULL_SHARD`, `HYBRID_SHARD`), the strategy gathers the whole model before the step
//! and leaves it here for [`unshard`].

use std::any::Any;
use std::cell::RefCell;

use burn::module::Module;
use burn::tensor::{Gradients, Tensor};

use crate::precision::{self, CastFloats, MixedPrecision};

#[derive(Debug, Clone, Copy)]
struct StepContext {
    precision: MixedPrecision,
    loss_scale: Option<f64>,
    scaled: bool,
    autocast: bool,
}

thread_local! {
    static CONTEXT: RefCell<Option<StepContext>> = const { RefCell::new(None) };
    /// The whole model the strategy gathered for this step, until [`unshard`] takes it.
    static GATHERED: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Leaves the whole model `model`, gathered for this step, for [`unshard`] to take.
pub(crate) fn leave_gathered<M: Module + 'static>(model: M) {
    GATHERED.with(|g| *g.borrow_mut() = Some(Box::new(model)));
}

/// Whether the step took the model [`leave_gathered`] left (clearing it either way).
pub(crate) fn gathered_was_taken() -> bool {
    GATHERED.with(|g| g.borrow_mut().take()).is_none()
}

/// The model a `TrainStep` runs its forward pass on, under the
/// [`AcceleratedStrategy`](super::AcceleratedStrategy): under `FULL_SHARD` or `HYBRID_SHARD`, where each rank
/// holds only its slices of the parameters between steps, the whole model the strategy gathered for this step
/// (FSDP's model-as-one-unit: gathered before the forward pass, its gradients reduce-scattered after the backward
/// pass, released with the step); otherwise, and outside a step, `model` itself (a cheap clone). Pass the model
/// it returns to `TrainOutput::new`, whose gradients are those of its parameters.
///
/// ```ignore
/// impl TrainStep for Net {
///     fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
///         let net = burn_accelerate::learner::unshard(self);
///         let out = net.forward_regression(batch);
///         TrainOutput::new(&net, burn_accelerate::learner::backward(out.loss.clone()), out)
///     }
/// }
/// ```
pub fn unshard<M: Module + 'static>(model: &M) -> M {
    let gathered = GATHERED.with(|g| g.borrow_mut().take());
    match gathered.map(|m| m.downcast::<M>()) {
        Some(Ok(whole)) => *whole,
        Some(Err(other)) => {
            // Another module than the Learner's (a sub-module): leave the gathered model for the right call.
            GATHERED.with(|g| *g.borrow_mut() = Some(other));
            model.clone()
        }
        None => model.clone(),
    }
}

/// Installs the context of one training step on this thread; returns the guard that removes it.
pub(crate) fn enter(precision: MixedPrecision, loss_scale: Option<f64>) -> Guard {
    CONTEXT.with(|c| {
        *c.borrow_mut() = Some(StepContext {
            precision,
            loss_scale,
            scaled: false,
            autocast: false,
        })
    });
    Guard
}

/// Whether [`backward`] scaled a loss since the context was installed.
pub(crate) fn loss_was_scaled() -> bool {
    CONTEXT.with(|c| c.borrow().is_some_and(|c| c.scaled))
}

/// Whether [`autocast`] ran since the context was installed.
pub(crate) fn autocast_was_used() -> bool {
    CONTEXT.with(|c| c.borrow().is_some_and(|c| c.autocast))
}

/// Removes the step context when dropped.
pub(crate) struct Guard;

impl Drop for Guard {
    fn drop(&mut self) {
        CONTEXT.with(|c| *c.borrow_mut() = None);
    }
}

/// Runs `f(model, inputs)` under the accelerator's mixed precision, inside a `TrainStep` or `InferenceStep`
/// run by the [`AcceleratedStrategy`](super::AcceleratedStrategy): the model and inputs in bf16/fp16, the
/// outputs handed back in f32 ([`Accelerator::autocast`](crate::Accelerator::autocast) for a burn-train
/// step). Outside such a step, or without mixed precision, it is a plain call.
///
/// ```ignore
/// impl TrainStep for Net {
///     fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
///         let out = burn_accelerate::learner::autocast(self, batch, |net, b| net.forward_regression(b));
///         TrainOutput::new(self, burn_accelerate::learner::backward(out.loss.clone()), out)
///     }
/// }
/// ```
pub fn autocast<M: Module, I: CastFloats, O: CastFloats>(
    model: &M,
    inputs: I,
    f: impl FnOnce(&M, I) -> O,
) -> O {
    let mode = CONTEXT.with(|c| {
        let mut c = c.borrow_mut();
        let c = c.as_mut()?;
        c.autocast = true;
        Some(c.precision)
    });
    match mode {
        Some(mode) => precision::autocast(mode, model, inputs, f),
        None => f(model, inputs),
    }
}

/// `loss.backward()` for a `TrainStep` run by the [`AcceleratedStrategy`](super::AcceleratedStrategy):
/// under fp16 it multiplies the loss by the current loss scale first (the strategy unscales the gradients,
/// checks them for overflow on every rank and skips the step together). Without fp16 it is `loss.backward()`.
/// Under fp16 the strategy refuses a step whose loss did not go through here, since its gradients would be
/// unscaled twice.
pub fn backward<const D: usize>(loss: Tensor<D>) -> Gradients {
    let scale = CONTEXT.with(|c| {
        let mut c = c.borrow_mut();
        let c = c.as_mut()?;
        c.scaled = true;
        c.loss_scale
    });
    match scale {
        Some(scale) => loss.mul_scalar(scale).backward(),
        None => loss.backward(),
    }
}
