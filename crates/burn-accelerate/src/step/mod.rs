//! The step pipeline: what happens between a loss and the optimizer step, in one place, for every loop.
//!
//! ```text
//! backward(loss, model) / finish(grads, model):
//!   precision.scale_loss ─> loss.backward ─> grads.collect ─> window.record_backward
//!     Local      : done (accumulate on this rank, no communication)
//!     SyncOnly   : strategy.reduce_gradients(scale 1)            (sync_each_batch inside a window)
//!     EndWindow  : normalise (1/micro-batches) ─> precision.unscaled ─> strategy.reduce_gradients(scale)
//!                  ─> precision.verdict (fp16 overflow on any rank?) ─> window.record_overflow
//! take_outcome(model) ─> Accumulate (keep the gradients) | Apply(gradients) | Skip (drop them)
//! after applying: strategy shares the stepped parameters (sharded strategies only)
//! ```
//!
//! The pipeline composes three seams — [`Precision`], the distribution [`Strategy`] and the step window
//! ([`crate::grad::window`]) — and owns no policy of its own beyond the order above. Its [`StepOutcome`] is the
//! one answer both consumers act on: the prepared optimizer ([`AcceleratedOptimizer`](crate::optim)) and
//! burn-train's Learner strategy (`crate::learner`), which hands in gradients its `TrainStep` computed through
//! [`StepPipeline::finish`]. A single device without accumulation, loss scaling or clipping is a case of
//! `finish` that hands the gradients straight back.

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;

use std::sync::Arc;

use burn::optim::GradientsParams;

use crate::config::{AcceleratorConfig, LossNormalization};
use crate::distributed::strategy::{
    Strategy, after_prepare, broadcast_module, share_stepped_lazily, trainable_params, unshard,
};
use crate::error::{Error, Result};
pub(crate) use crate::grad::window::StepOutcome;
use crate::grad::window::{BackwardPlan, SharedStep, model_key};
use crate::grad::{
    GradSource, GradientBuffer, NormType, clip_grad_norm, has_non_finite, param_ids,
};
use crate::precision::Precision;

pub(crate) mod block_wise;

/// Whether the gradients a backward pass left in the buffer were reduced across ranks already (a block-wise pass
/// reduces each part as it produces it), and scaled for the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reduced {
    /// Not reduced: the window's end reduces them.
    No,
    /// Reduced (the mean over the ranks), not yet normalised or unscaled.
    Unscaled,
    /// Reduced with the window's normalisation and unscaling already (the backward pass was the whole window).
    Scaled,
}

/// A rank's step pipeline.
#[derive(Debug)]
pub(crate) struct StepPipeline {
    pub(crate) shared: SharedStep,
    pub(crate) precision: Mutex<Precision>,
    pub(crate) strategy: Arc<dyn Strategy>,
    pub(crate) normalization: LossNormalization,
    pub(crate) accumulation_steps: usize,
    pub(crate) sync_each_batch: bool,
    /// Whether the blocks of the last block-wise pass drew random numbers (dropout): they then take the
    /// process's generator in turns with the other ranks of the process (`pipeline::blocks`). Unknown, so `true`,
    /// before the first pass.
    pub(crate) blocks_draw: std::sync::atomic::AtomicBool,
    /// Checkpointed passes' seeds: a base drawn once from the device's generator, and the passes seeded from it
    /// since (`pipeline::blocks`).
    pub(crate) recompute_seeds: Mutex<Option<(u64, u64)>>,
    /// The micro-batches a pipelined window ran so far (a short last batch runs fewer than `pp_microbatches`).
    pub(crate) window_splits: Mutex<usize>,
    /// Each model's parts of what is outside its blocks, learnt on its first block-wise `FULL_SHARD` pass.
    pub(crate) rest_parts:
        Mutex<std::collections::HashMap<crate::grad::window::ModelKey, block_wise::RestParts>>,
}

impl StepPipeline {
    /// The pipeline of a rank configured by `config`, distributed by `strategy`.
    pub fn new(config: &AcceleratorConfig, strategy: Arc<dyn Strategy>) -> Self {
        Self {
            shared: SharedStep::new(config.accumulation.gradient_accumulation_steps),
            precision: Mutex::new(Precision::new(
                config.precision.mixed_precision,
                config.precision.loss_scaler.clone(),
            )),
            strategy,
            normalization: config.accumulation.loss_normalization,
            accumulation_steps: config.accumulation.gradient_accumulation_steps,
            sync_each_batch: config.accumulation.sync_each_batch,
            blocks_draw: std::sync::atomic::AtomicBool::new(true),
            recompute_seeds: Mutex::new(None),
            window_splits: Mutex::new(0),
            rest_parts: Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// Whether the blocks of the last block-wise pass drew random numbers (`true` before the first).
    pub(crate) fn blocks_draw(&self) -> bool {
        self.blocks_draw.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_blocks_draw(&self, draws: bool) {
        self.blocks_draw
            .store(draws, std::sync::atomic::Ordering::Relaxed);
    }

    /// Averages `grads` (flat gradients of parameters of their own) across ranks exactly as a sync step of
    /// `backward` does, bucketing included, and returns them: the sync path alone, for the benchmarks.
    pub fn sync_flat_for_bench(&self, grads: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>> {
        let mut buffer = GradientBuffer::new();
        let params: Vec<(burn::module::ParamId, usize)> = grads
            .iter()
            .map(|g| (burn::module::ParamId::new(), g.dims()[0]))
            .collect();
        for ((id, _), grad) in params.iter().zip(grads) {
            buffer.add(*id, grad);
        }
        self.strategy.reduce_gradients(&mut buffer, &params, 1.0)?;
        let ids: Vec<_> = params.iter().map(|(id, _)| *id).collect();
        Ok(buffer.flat(&ids))
    }

    /// Fails when gradients are waiting to be applied (inside an accumulation window, or between a window's last
    /// `backward` and its optimizer step): a checkpoint holds no gradients, so a state saved now would resume
    /// without them. `operation` names the call for the message.
    pub fn check_no_pending_gradients(&self, operation: &str) -> Result<()> {
        let core = self.shared.lock();
        if !core.state.window_open() && core.grads.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{operation}: the gradients of {} parameter(s) are waiting for the optimizer step (inside an accumulation \
             window, or between `backward` and `optimizer.step`), and a checkpoint holds no gradients, so a run \
             resumed from it would train without them; save after the optimizer step that ends the window (when \
             `accelerator.sync_gradients()` is true)",
            core.grads.len()
        )))
    }

    /// The step state and gradients, shared with prepared optimizers, schedulers and dataloaders.
    pub fn shared(&self) -> &SharedStep {
        &self.shared
    }

    /// The rank's precision.
    pub fn precision(&self) -> MutexGuard<'_, Precision> {
        self.precision.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The distribution strategy.
    pub fn strategy(&self) -> &Arc<dyn Strategy> {
        &self.strategy
    }

    /// `module` with rank 0's weights on every rank (the first step of `prepare_model`).
    pub fn broadcast_initial<M: Module>(&self, module: M, ids: &[u64]) -> Result<M> {
        broadcast_module(self.strategy.as_ref(), module, ids)
    }

    /// The last step of `prepare_model`: a sharded strategy learns the model's parameters, and under
    /// `FULL_SHARD` this rank keeps only its own.
    pub fn after_prepare<M: Module>(&self, module: M) -> Result<M> {
        after_prepare(self.strategy.as_ref(), module)
    }

    /// `module` with every parameter whole on this rank (see [`unshard`]).
    pub fn unshard<M: Module>(&self, module: &M) -> Result<M> {
        unshard(self.strategy.as_ref(), module)
    }

    /// After an optimizer applied [`StepOutcome::Apply`]'s gradients to the model `model` gives (see
    /// [`Strategy::after_step`]): the model the strategy placed, or `None`, without asking for the model, where it
    /// leaves it as it is (data parallelism, a single device).
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub fn share_stepped<M: Module>(&self, model: impl FnOnce() -> M) -> Result<Option<M>> {
        share_stepped_lazily(self.strategy.as_ref(), model)
    }

    /// The pipeline for gradients computed outside [`backward`](Self::backward) (burn-train's `TrainStep`): runs
    /// them through [`process`](Self::process), clips them to `max_grad_norm` when the window ends, and returns
    /// the outcome. Call [`begin_micro_batch`](Self::begin_micro_batch) first, as for `backward`. On a single
    /// device without accumulation, loss scaling or clipping, the gradients are handed straight back: the
    /// pipeline would return these very values.
    /// `model` is asked for only when the gradients go through the pipeline.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub fn finish<M: Module>(
        &self,
        mut grads: GradientsParams,
        model: impl FnOnce() -> M,
        max_grad_norm: Option<f64>,
    ) -> Result<StepOutcome> {
        let alone_in_window = self.accumulation_steps == 1
            && max_grad_norm.is_none()
            && self.precision().loss_scale().is_none();
        if alone_in_window {
            match self.strategy.reduce_unbuffered(grads) {
                Ok(reduced) => {
                    let mut core = self.shared.lock();
                    core.state.record_backward(None, false);
                    return Ok(core.state.take_verdict(None).with(reduced));
                }
                Err(handed_back) => grads = handed_back,
            }
        }
        let model = model();
        self.process(&mut grads, &model)?;
        self.finish_processed(&model, max_grad_norm)
    }

    /// [`finish`](Self::finish) of gradients that already went through the pipeline (a block-wise pass inside
    /// burn-train's `TrainStep`): clips them to `max_grad_norm` when the window ends, and returns the outcome for
    /// `model`'s parameters.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub fn finish_processed<M: Module>(
        &self,
        model: &M,
        max_grad_norm: Option<f64>,
    ) -> Result<StepOutcome> {
        if let Some(max_norm) = max_grad_norm {
            let mut core = self.shared.lock();
            if core.state.sync_gradients() {
                let started = Instant::now();
                clip_grad_norm(
                    &mut core.grads,
                    &param_ids(model),
                    max_norm,
                    NormType::L2,
                    &self.total_norm(),
                )?;
                core.phases.gradient_sync += started.elapsed();
            }
        }
        Ok(self.shared.take_outcome(model))
    }

    /// The total norm of a model's gradients from the norms of those this rank holds (the strategy's
    /// [`gradient_norm`](Strategy::gradient_norm)).
    pub fn total_norm(&self) -> impl Fn(Vec<Tensor<1>>, NormType) -> Result<f64> + '_ {
        |norms, norm_type| self.strategy.gradient_norm(norms, norm_type)
    }

    /// A micro-batch starts; returns whether it ends the accumulation window.
    pub fn begin_micro_batch(&self) -> bool {
        self.shared.lock().state.begin_micro_batch()
    }

    /// Back-propagates `loss` (scaled for fp16) and runs the gradients of `model` through the pipeline.
    pub fn backward<const D: usize, M: Module>(&self, loss: Tensor<D>, model: &M) -> Result<()> {
        if !loss.is_tracked() {
            return Err(Error::InvalidArgument(
                "backward: the loss is not connected to any parameter that requires a gradient; prepare the \
                 model with `accelerator.prepare_model(model)` (or create it on `accelerator.device()`) and \
                 compute the loss from its output"
                    .into(),
            ));
        }
        let started = Instant::now();
        let scaled = self.precision().scale_loss(loss);
        // Through the tensor-parallel regions' cuts, where the forward pass made any.
        let mut grads = crate::graph_cut::backward(scaled)?;
        crate::tensor_parallel::dropout::next_pass();
        self.collect_and_end(&mut grads, model, started)
    }

    /// The pipeline after `backward`: collects `model`'s gradients from `grads` (the graph's `Gradients`, or the
    /// `GradientsParams` burn-train's `TrainStep` returns), then normalises, averages across ranks, unscales and
    /// decides the step as the accumulation window requires.
    pub fn process<M: Module, S: GradSource>(&self, grads: &mut S, model: &M) -> Result<()> {
        self.collect_and_end(grads, model, Instant::now())
    }

    /// [`process`](Self::process) of a backward pass that began at `started`: its time up to the end of the
    /// collection counts as backward.
    fn collect_and_end<M: Module, S: GradSource>(
        &self,
        grads: &mut S,
        model: &M,
        started: Instant,
    ) -> Result<()> {
        let mut core = self.shared.lock();
        let added = core.grads.collect(model, grads);
        core.phases.backward += started.elapsed();
        // This backward reached none of the model's parameters. On several ranks, a rank whose part of the batch
        // reached none of them (data-dependent routing) takes part in the reduction with zeros: an error there would
        // leave its peers waiting in the collective. Alone, it is the mistake the strategy's error names (another
        // model's gradients in the buffer, a GAN's other half, do not hide it).
        if added == 0 {
            self.strategy.backward_reached_nothing()?;
        }
        self.end_backward(&mut core, model, Reduced::No)
    }

    /// The window's part of a backward pass whose gradients are in the buffer: on a window's last micro-batch,
    /// normalise, unscale and average them across ranks (or, when they were reduced already, as a block-wise
    /// pass reduces each block's gradients as it produces them, only scale them unless that was done too), then
    /// take the fp16 verdict.
    fn end_backward<M: Module>(
        &self,
        core: &mut crate::grad::window::StepCore,
        model: &M,
        reduced: Reduced,
    ) -> Result<()> {
        // Alone, a sync is the strategy's reduction at scale 1: nothing.
        let sync_each_batch = self.sync_each_batch && reduced == Reduced::No;
        let plan = core
            .state
            .record_backward(model_key(model), sync_each_batch);
        let started = Instant::now();
        let outcome = self.end_window(core, model, reduced, plan);
        core.phases.gradient_sync += started.elapsed();
        outcome
    }

    /// [`end_backward`](Self::end_backward) once the window decided `plan`.
    fn end_window<M: Module>(
        &self,
        core: &mut crate::grad::window::StepCore,
        model: &M,
        reduced: Reduced,
        plan: BackwardPlan,
    ) -> Result<()> {
        let micro_batches = match plan {
            BackwardPlan::Local => return Ok(()),
            BackwardPlan::SyncOnly => return self.average(&mut core.grads, model, 1.0),
            BackwardPlan::EndWindow { micro_batches } => micro_batches,
        };
        let mut precision = self.precision();
        let scale = precision.unscaled(self.normalisation(micro_batches));
        match reduced {
            Reduced::No => self.average(&mut core.grads, model, scale)?,
            // Only this model's gradients: another model's window goes on (a GAN's other half).
            Reduced::Unscaled if scale != 1.0 => core
                .grads
                .map_flat(&param_ids(model), |g| g.mul_scalar(scale)),
            Reduced::Unscaled | Reduced::Scaled => {}
        }
        self.record_overflow(&mut precision, core, &param_ids(model), model_key(model))
    }

    /// Under fp16 loss scaling, whether any gradient of `ids` overflowed on any rank (the strategy's
    /// [`any_rank`](Strategy::any_rank)), recorded as the window of `key`'s verdict; nothing without loss scaling.
    pub(crate) fn record_overflow(
        &self,
        precision: &mut Precision,
        core: &mut crate::grad::window::StepCore,
        ids: &[burn::module::ParamId],
        key: crate::grad::window::ModelKey,
    ) -> Result<()> {
        if precision.loss_scale().is_some() {
            let grads = &mut core.grads;
            let strategy = &self.strategy;
            let overflow = precision.verdict(|| strategy.any_rank(has_non_finite(grads, ids)?))?;
            core.state.record_overflow(key, overflow);
        }
        Ok(())
    }

    /// The factor that turns a window's summed gradients into their mean (see [`LossNormalization`]).
    fn normalisation(&self, micro_batches: usize) -> f32 {
        self.normalisation_of(micro_batches, 1)
    }

    /// [`normalisation`](Self::normalisation) of a window of `backwards` backward passes of `splits`
    /// micro-batches each (a pipeline's batch): the mean over every micro-batch of the window.
    fn normalisation_of(&self, backwards: usize, splits: usize) -> f32 {
        match self.normalization {
            LossNormalization::ActualMicroBatches => 1.0 / (backwards * splits) as f32,
            LossNormalization::Nominal => 1.0 / (self.accumulation_steps * splits) as f32,
        }
    }

    /// The normalisation of a pipelined window that ran `splits` micro-batches in all, of `per_batch` each
    /// (`pp_microbatches`) but for a short last batch: the mean over every micro-batch it ran, or the nominal
    /// count's under `LossNormalization::Nominal`.
    pub(crate) fn normalisation_of_splits(&self, splits: usize, per_batch: usize) -> f32 {
        match self.normalization {
            LossNormalization::ActualMicroBatches => 1.0 / splits.max(1) as f32,
            LossNormalization::Nominal => 1.0 / (self.accumulation_steps * per_batch) as f32,
        }
    }

    /// Averages the gradients of `model`'s trainable parameters across ranks, times `scale`; the gradients of
    /// other models (a GAN's other half, inside its own window) are left as they are.
    fn average<M: Module>(&self, grads: &mut GradientBuffer, model: &M, scale: f32) -> Result<()> {
        if self.strategy.reduces_to_itself(scale) {
            return Ok(());
        }
        self.average_params(grads, model, &trainable_params(model), scale)
    }

    /// [`average`](Self::average) of `params`, parameters of `module` (a pipeline stage's share of it).
    pub(crate) fn average_params<M: Module>(
        &self,
        grads: &mut GradientBuffer,
        module: &M,
        params: &[(burn::module::ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        if self.strategy.reduces_to_itself(scale) {
            return Ok(());
        }
        // A rank whose part of the batch reached none of them still makes every other rank's collective calls.
        grads.hold_one_of(module, params);
        self.strategy.reduce_gradients(grads, params, scale)
    }
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;

    use super::*;
    use crate::distributed::strategy::{GradientSync, ParamPlacement, StateScopes, StrategyInfo};
    use crate::precision::{LossScaler, MixedPrecision};

    /// A test double of the strategy seam: records each call's scale, and halves nothing (a world of one that
    /// claims to be distributed, as a device all-reduce on one GPU would be).
    #[derive(Debug, Default)]
    struct Recording(Calls);

    /// Each call's number of parameters and scale.
    type Calls = Arc<Mutex<Vec<(usize, f32)>>>;

    impl StrategyInfo for Recording {
        fn name(&self) -> String {
            "recording".into()
        }

        fn rank(&self) -> usize {
            0
        }
    }

    impl GradientSync for Recording {
        fn reduce_gradients(
            &self,
            grads: &mut GradientBuffer,
            params: &[(ParamId, usize)],
            scale: f32,
        ) -> Result<()> {
            self.0.lock().unwrap().push((params.len(), scale));
            let ids: Vec<ParamId> = params.iter().map(|(id, _)| *id).collect();
            grads.map_flat(&ids, |g| g.mul_scalar(scale));
            Ok(())
        }

        fn broadcast(&self, flat: Tensor<1>, _root: usize) -> Result<Tensor<1>> {
            Ok(flat)
        }
    }

    impl ParamPlacement for Recording {}

    impl StateScopes for Recording {}

    fn pipeline(config: AcceleratorConfig) -> (StepPipeline, Calls) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let strategy = Arc::new(Recording(calls.clone()));
        (StepPipeline::new(&config, strategy), calls)
    }

    fn step(pipeline: &StepPipeline, model: &Linear) {
        pipeline.begin_micro_batch();
        let device = model.weight.device();
        let loss = model.forward(Tensor::<2>::ones([2, 3], &device)).sum();
        pipeline.backward(loss, model).unwrap();
    }

    #[test]
    fn the_sync_seam_is_called_once_per_window_with_normalisation_and_unscaling() {
        let mut config = AcceleratorConfig::default();
        config.accumulation.gradient_accumulation_steps = 2;
        config.precision.mixed_precision = MixedPrecision::Fp16;
        config.precision.loss_scaler = LossScaler::with_init_scale(4.0);
        let (pipeline, calls) = pipeline(config);
        let model: Linear = LinearConfig::new(3, 1).init(&Device::default().autodiff());
        for _ in 0..4 {
            step(&pipeline, &model);
        }
        // Two windows of two micro-batches: 1/2 normalisation, 1/4 unscaling, weight and bias each time.
        assert_eq!(*calls.lock().unwrap(), vec![(2, 0.125), (2, 0.125)]);
        assert_eq!(pipeline.precision().loss_scale(), Some(4.0), "no overflow");
    }

    #[test]
    fn sync_each_batch_averages_inside_the_window_without_normalising() {
        let mut config = AcceleratorConfig::default();
        config.accumulation.gradient_accumulation_steps = 3;
        config.accumulation.sync_each_batch = true;
        let (pipeline, calls) = pipeline(config);
        let model: Linear = LinearConfig::new(3, 1).init(&Device::default().autodiff());
        for _ in 0..3 {
            step(&pipeline, &model);
        }
        assert_eq!(
            *calls.lock().unwrap(),
            vec![(2, 1.0), (2, 1.0), (2, 1.0 / 3.0)]
        );
    }
}
