//! The calls of a `TrainStep` that reach the accelerator itself, under the
//! [`AcceleratedStrategy`](super::AcceleratedStrategy): [`unshard`] (the whole model for this step, where the
//! Learner holds each rank's slices) and [`backward_blocks`] (a forward and backward pass block by block). The
//! strategy installs the accelerator for the thread that runs the step and reads back, after it, what the step
//! called: the gathered model (for the gradients' pipeline), whether the gradients already went through the
//! pipeline (a block-wise pass), and an error the step could not return.

use std::any::Any;
use std::cell::RefCell;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_train::TrainOutput;

use crate::accelerator::Accelerator;
use crate::error::Error;
use crate::model::Blocks;

/// The accelerator of the step running on this thread, and whether the Learner's model holds this rank's slices.
struct Installed {
    accelerator: Arc<Accelerator>,
    holds_slices: bool,
}

/// What the step called.
#[derive(Default)]
pub(crate) struct StepCalls {
    /// The whole model [`unshard`] gathered (a `Box<M>` of the Learner's model type).
    pub gathered: Option<Box<dyn Any>>,
    /// Whether [`backward_blocks`] or `backward_batch` ran: its gradients are in the pipeline, and the
    /// `TrainOutput`'s are empty.
    pub block_pass: bool,
    /// Whether `forward_batch`, or `backward_batch` under a pipeline, took the batch through the blocks (a
    /// pipeline's stages, or the blocks gathered one by one).
    pub batch_pass: bool,
    /// The first error of a call that could not return it.
    pub failure: Option<Error>,
}

thread_local! {
    static INSTALLED: RefCell<Option<Installed>> = const { RefCell::new(None) };
    static CALLS: RefCell<Option<StepCalls>> = const { RefCell::new(None) };
}

/// Installs `accelerator` for the step about to run on this thread; the guard removes it.
pub(crate) fn enter(accelerator: Arc<Accelerator>, holds_slices: bool) -> Guard {
    INSTALLED.with(|i| {
        *i.borrow_mut() = Some(Installed {
            accelerator,
            holds_slices,
        })
    });
    CALLS.with(|c| *c.borrow_mut() = Some(StepCalls::default()));
    Guard
}

/// What the step called since [`enter`].
pub(crate) fn take_calls() -> StepCalls {
    CALLS.with(|c| c.borrow_mut().take()).unwrap_or_default()
}

/// Removes the installed accelerator when dropped.
pub(crate) struct Guard;

impl Drop for Guard {
    fn drop(&mut self) {
        INSTALLED.with(|i| *i.borrow_mut() = None);
        CALLS.with(|c| *c.borrow_mut() = None);
    }
}

pub(super) fn installed() -> Option<(Arc<Accelerator>, bool)> {
    INSTALLED.with(|i| {
        i.borrow()
            .as_ref()
            .map(|i| (i.accelerator.clone(), i.holds_slices))
    })
}

pub(super) fn record(f: impl FnOnce(&mut StepCalls)) {
    CALLS.with(|c| {
        if let Some(calls) = c.borrow_mut().as_mut() {
            f(calls);
        }
    });
}

pub(super) fn fail(error: Error) {
    record(|calls| {
        calls.failure.get_or_insert(error);
    });
}

/// The model a `TrainStep` runs its forward pass on, under the
/// [`AcceleratedStrategy`](super::AcceleratedStrategy): under `FULL_SHARD` or `HYBRID_SHARD`, where the Learner
/// holds only this rank's slices of the parameters between steps, the whole model, gathered now on every rank
/// (FSDP's model-as-one-unit: its gradients are reduce-scattered after the backward pass and the gathered
/// parameters released with the step); otherwise, and outside a step, `model` itself (a cheap clone). Pass the
/// model it returns to `TrainOutput::new`, whose gradients are those of its parameters. A failed gather (a rank
/// died, a timeout) ends the run with its error after the step.
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
    let Some((accelerator, true)) = installed() else {
        return model.clone();
    };
    match accelerator.unshard(model) {
        Ok(whole) => {
            let kept = whole.clone();
            record(|calls| calls.gathered = Some(Box::new(kept)));
            whole
        }
        Err(e) => {
            fail(e);
            model.clone()
        }
    }
}

/// One batch's forward and backward pass through a model made of blocks ([`Blocks`]), inside a `TrainStep` run
/// by the [`AcceleratedStrategy`](super::AcceleratedStrategy): [`Accelerator::backward_blocks`] on the Learner's
/// model, so that block-wise `FULL_SHARD` gathers one block at a time (the peak holds one gathered block),
/// activation checkpointing recomputes each block in the backward pass, and frozen blocks are skipped, as in a
/// loop of your own. `before` returns the first activation, `block` runs one block, `after` returns the step's
/// item (burn-train's `RegressionOutput`, ...) and `loss` its loss. Returns the `TrainOutput` for the step: its
/// gradients already went through the accelerator's pipeline (under `FULL_SHARD`, reduce-scattered block by
/// block). Outside such a step it is a plain forward pass and `backward`.
///
/// ```ignore
/// impl TrainStep for Net {
///     fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
///         burn_accelerate::learner::backward_blocks(
///             self,
///             |net| net.embed(batch.x.clone()),
///             |layer, x| layer.forward(x),
///             |net, x| net.regression(x, batch.y.clone()),
///             |out| out.loss.clone(),
///         )
///     }
/// }
/// ```
pub fn backward_blocks<M, O, const D: usize>(
    model: &M,
    before: impl Fn(&M) -> Tensor<D>,
    block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
    after: impl FnOnce(&M, Tensor<D>) -> O,
    loss: impl Fn(&O) -> Tensor<1>,
) -> TrainOutput<O>
where
    M: Blocks + 'static,
{
    let forward = |model: &M| {
        let mut x = before(model);
        for b in model.blocks() {
            x = block(b, x);
        }
        x
    };
    let Some((accelerator, _)) = installed() else {
        let item = after(model, forward(model));
        let grads = loss(&item).backward();
        return TrainOutput::new(model, grads, item);
    };
    let mut item = None;
    let result = accelerator.backward_blocks(model, &before, &block, |model, x| {
        let out = after(model, x);
        let value = loss(&out);
        item = Some(out);
        value
    });
    record(|calls| calls.block_pass = true);
    super::context::note_loss_scaled();
    match (result, item) {
        (Ok(_), Some(item)) => TrainOutput {
            grads: GradientsParams::new(),
            item,
        },
        (result, _) => {
            // No item to return: the step unwinds, without a panic message, to the strategy, which ends the run
            // with the error.
            fail(result.err().unwrap_or_else(|| {
                Error::InvalidArgument("backward_blocks: the pass ended without its loss".into())
            }));
            std::panic::resume_unwind(Box::new(StepFailed))
        }
    }
}

/// The payload a step unwinds with after a call of this module failed (its error is in [`StepCalls::failure`]).
pub(crate) struct StepFailed;
