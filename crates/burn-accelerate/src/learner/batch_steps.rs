//! A `TrainStep` and an `InferenceStep` that take the whole batch through a model made of blocks, in every mode
//! pipelines included: [`backward_batch`] and [`forward_batch`], the Learner's forms of
//! [`Accelerator::backward_batch`](crate::Accelerator::backward_batch) and
//! [`Accelerator::forward_batch`](crate::Accelerator::forward_batch).
//!
//! Under a pipeline (`pp_size` > 1) only the last stage computes the step's item (burn-train's
//! `RegressionOutput`, ...): there the head runs once more, without affecting the gradients, on the blocks'
//! outputs of every micro-batch together, so that the item is the whole batch's, as on one process. The other
//! stages have no item to return: their step ends, after its part of the pipeline, by unwinding (without a panic
//! message) to the [`AcceleratedStrategy`](super::AcceleratedStrategy), which reports the last stage's items.

use std::cell::RefCell;

use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_train::TrainOutput;

use super::gathering::{StepFailed, fail, installed, record};
use crate::error::Error;
use crate::model::{Blocks, Split};
use crate::pipeline_parallel::runtime::{Tops, whole_batch_top};

/// The payload a stage other than the last unwinds its step with once its part of a pipelined batch is done (it
/// has no item to return; the last stage reports it).
pub(crate) struct StageDone;

/// One batch's forward and backward pass through a model made of blocks ([`Blocks`]) inside a `TrainStep` run
/// by the [`AcceleratedStrategy`](super::AcceleratedStrategy), in every mode: under a pipeline (`pp_size` > 1)
/// the batch is split into micro-batches that flow through the stages
/// ([`Accelerator::backward_batch`](crate::Accelerator::backward_batch)); without a pipeline it is
/// [`backward_blocks`](super::backward_blocks) on the whole batch (block-wise `FULL_SHARD`, activation
/// checkpointing, frozen blocks). `before(model, micro_batch)` returns the first activation, `block` runs one
/// block, `after(model, x, micro_batch)` returns the step's item (burn-train's `RegressionOutput`, ...) and `loss`
/// its loss. Returns the `TrainOutput` for the step, its gradients already through the accelerator's pipeline.
///
/// Under a pipeline the last stage computes the item for the whole batch: `after` runs once more on the blocks'
/// outputs of all micro-batches together (no gradient of it reaches the step), and burn-train's metrics and
/// reports come from that stage (the renderer and metric files are the last stage's, see
/// [`Accelerator::prepare_training`](crate::Accelerator::prepare_training)). The other stages end the step after
/// their part. `batch` is cloned for that last call (a batch of tensors clones cheaply). Outside such a step it
/// is a plain forward pass and `backward` on the whole batch.
///
/// ```ignore
/// impl TrainStep for Net {
///     fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
///         burn_accelerate::learner::backward_batch(
///             self,
///             batch,
///             |net, b| net.embed(b.x.clone()),
///             |layer, x| layer.forward(x),
///             |net, x, b| net.regression(x, b.y.clone()),
///             |out| out.loss.clone(),
///         )
///     }
/// }
/// ```
pub fn backward_batch<M, B, O, const D: usize>(
    model: &M,
    batch: B,
    before: impl Fn(&M, &B) -> Tensor<D>,
    block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
    after: impl Fn(&M, Tensor<D>, &B) -> O,
    loss: impl Fn(&O) -> Tensor<1>,
) -> TrainOutput<O>
where
    M: Blocks + 'static,
    B: Split + Clone,
{
    let Some((accelerator, _)) = installed() else {
        let item = after(
            model,
            run_blocks(model, before(model, &batch), &block),
            &batch,
        );
        let grads = loss(&item).backward();
        return TrainOutput::new(model, grads, item);
    };
    let Some(stages) = accelerator.stage().cloned() else {
        // One stage: the block-wise pass of `backward_blocks` on the whole batch.
        return super::backward_blocks(
            model,
            |m| before(m, &batch),
            &block,
            |m, x| after(m, x, &batch),
            loss,
        );
    };
    record(|calls| calls.batch_pass = true);
    let last = stages.layout.is_last_stage();
    let tops: Tops<D> = RefCell::new(Vec::new());
    let whole = last.then(|| batch.clone());
    let result = accelerator.backward_batch_keeping(
        model,
        batch,
        (&before, &block, |m: &M, x, b: &B| loss(&after(m, x, b))),
        Some(&tops),
    );
    record(|calls| calls.block_pass = true);
    super::context::note_loss_scaled();
    let item = result.and_then(|_| match whole {
        // The item of the whole batch, on the head the stage holds (gathered under a sharded stage).
        Some(batch) => {
            let top = whole_batch_top(&tops).ok_or_else(|| {
                Error::other("backward_batch: the last stage kept no output of the blocks")
            })?;
            let head = accelerator.unshard(model)?;
            Ok(Some(after(&head, top.detach(), &batch)))
        }
        None => Ok(None),
    });
    match item {
        Ok(Some(item)) => TrainOutput {
            grads: GradientsParams::new(),
            item,
        },
        Ok(None) => std::panic::resume_unwind(Box::new(StageDone)),
        Err(e) => {
            fail(e);
            std::panic::resume_unwind(Box::new(StepFailed))
        }
    }
}

/// A forward pass for validation through a model made of blocks, inside an `InferenceStep` run by the
/// [`AcceleratedStrategy`](super::AcceleratedStrategy), with the closures of [`backward_batch`]
/// ([`Accelerator::forward_batch`](crate::Accelerator::forward_batch)): under `FULL_SHARD` and `HYBRID_SHARD`
/// block by block (each block gathered in turn, so that validation holds one block whole beside this rank's
/// slices); under a pipeline the micro-batches flow forward through the stages and the last stage runs `after`
/// on the blocks' outputs of the whole batch, returning the item (the other stages end the step after their
/// part, see [`backward_batch`]); otherwise `before`, every block and `after` on the whole batch.
///
/// ```ignore
/// impl InferenceStep for Net {
///     fn step(&self, batch: Batch) -> RegressionOutput {
///         burn_accelerate::learner::forward_batch(
///             self,
///             batch,
///             |net, b| net.embed(b.x.clone()),
///             |layer, x| layer.forward(x),
///             |net, x, b| net.regression(x, b.y.clone()),
///         )
///     }
/// }
/// ```
pub fn forward_batch<M, B, O, const D: usize>(
    model: &M,
    batch: B,
    before: impl Fn(&M, &B) -> Tensor<D>,
    block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
    after: impl Fn(&M, Tensor<D>, &B) -> O,
) -> O
where
    M: Blocks + 'static,
    B: Split + Clone,
{
    let Some((accelerator, _)) = installed() else {
        return after(
            model,
            run_blocks(model, before(model, &batch), &block),
            &batch,
        );
    };
    record(|calls| calls.batch_pass = true);
    let last = accelerator
        .stage()
        .is_none_or(|stages| stages.layout.is_last_stage());
    let tops: Tops<D> = RefCell::new(Vec::new());
    let head: RefCell<Option<M>> = RefCell::new(None);
    let whole = last.then(|| batch.clone());
    // The last stage keeps each micro-batch's output and the stage's model it ran on; the values handed to every
    // stage are one zero each.
    let result = accelerator.forward_batch(model, batch, &before, &block, |m: &M, x, _: &B| {
        let device = x.device();
        let mut kept = tops.borrow_mut();
        let i = kept.len();
        kept.push((i, x));
        head.borrow_mut().get_or_insert_with(|| m.clone());
        Tensor::<1>::zeros([1], (&device, DType::F32))
    });
    let item = result.and_then(|_| match whole {
        Some(batch) => {
            let top = whole_batch_top(&tops).ok_or_else(|| {
                Error::other("forward_batch: the last stage kept no output of the blocks")
            })?;
            let head = head
                .take()
                .ok_or_else(|| Error::other("forward_batch: the last stage ran no micro-batch"))?;
            Ok(Some(after(&head, top, &batch)))
        }
        None => Ok(None),
    });
    match item {
        Ok(Some(item)) => item,
        Ok(None) => std::panic::resume_unwind(Box::new(StageDone)),
        Err(e) => {
            fail(e);
            std::panic::resume_unwind(Box::new(StepFailed))
        }
    }
}

/// `x` through every block of `model`.
fn run_blocks<M: Blocks, const D: usize>(
    model: &M,
    x: Tensor<D>,
    block: &impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    model.blocks().iter().fold(x, |x, b| block(b, x))
}

/// Whether `payload` (what a step unwound with) is a stage's end without an item.
pub(crate) fn stage_done(payload: &(dyn std::any::Any + Send)) -> bool {
    payload.is::<StageDone>()
}

/// The error a rank that holds its slices (`FULL_SHARD`) ends validation with when its `InferenceStep` ran on
/// them.
pub(crate) fn slices_in_validation(sharding: crate::ShardingStrategy) -> Error {
    Error::InvalidArgument(format!(
        "AcceleratedStrategy: under {sharding} the Learner's model holds only this rank's slices, and every rank \
         validates; the InferenceStep must run on the whole model, `let model = \
         burn_accelerate::learner::unshard(self);`, or block by block with \
         `burn_accelerate::learner::forward_batch(self, batch, before, block, after)`"
    ))
}

/// The error a pipelined rank's step ends with when its `TrainStep` or `InferenceStep` ran the model whole.
pub(crate) fn whole_model_under_pipeline(stages: usize, training: bool) -> Error {
    let (step, call) = match training {
        true => ("TrainStep", "backward_batch"),
        false => ("InferenceStep", "forward_batch"),
    };
    Error::InvalidArgument(format!(
        "AcceleratedStrategy: under pp_size {stages} each rank holds only its stage's blocks, so the {step} \
         must take the batch through the stages: `burn_accelerate::learner::{call}(self, batch, before, block, \
         after{})`",
        if training { ", loss" } else { "" }
    ))
}
