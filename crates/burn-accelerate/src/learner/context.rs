//! What a `TrainStep` running under the [`AcceleratedStrategy`](super::AcceleratedStrategy) needs from the
//! accelerator: its mixed-precision mode (for [`autocast`]) and its fp16 loss scale (for [`backward`]).
//! burn-train calls `TrainStep::step(&model, batch)` with nothing else, so the strategy installs them for the
//! thread that runs the step, for as long as it runs (the calls that reach the accelerator itself, `unshard` and
//! `backward_blocks`, are in `gathering`).

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

/// Notes that the loss scale was applied by other means (a block-wise pass scales its loss itself).
pub(crate) fn note_loss_scaled() {
    CONTEXT.with(|c| {
        if let Some(c) = c.borrow_mut().as_mut() {
            c.scaled = true;
        }
    });
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
