//! The step pipeline: what happens between a loss and the optimizer step, in one place.
//!
//! ```text
//! backward(loss, model):
//!   precision.scale_loss ─> loss.backward ─> grads.collect ─> step_state.record_backward
//!     Local      : done (accumulate on this rank, no communication)
//!     SyncOnly   : sync.average(scale 1)                         (sync_each_batch inside a window)
//!     EndWindow  : normalise (1/micro-batches) ─> precision.unscaled ─> sync.average(scale)
//!                  ─> precision.verdict (fp16 overflow on any rank?) ─> step_state.record_overflow
//! optimizer.step(model): step_state.take_verdict ─> Step: apply grads | Skip: drop them | Accumulate: keep
//! ```
//!
//! The pipeline composes three seams — [`Precision`], [`GradientSync`] and the [`StepState`] — and owns no
//! policy of its own beyond the order above; a device-side all-reduce or a training strategy (burn-train's
//! Learner) reuses it by supplying another [`GradientSync`] or by calling [`StepPipeline::process`] with
//! gradients it computed itself.
//!
//! [`StepState`]: super::step_state::StepState

use std::sync::{Mutex, MutexGuard};

use burn::module::Module;
use burn::tensor::Tensor;

use super::buffer::GradSource;
use super::step_state::{BackwardPlan, SharedStep};
use super::sync::{GradientSync, broadcast_module, trainable_params};
use super::{GradientBuffer, has_non_finite, param_ids};
use crate::config::{AcceleratorConfig, LossNormalization};
use crate::error::{Error, Result};
use crate::precision::Precision;

/// A rank's step pipeline.
#[derive(Debug)]
pub(crate) struct StepPipeline {
    shared: SharedStep,
    precision: Mutex<Precision>,
    sync: Box<dyn GradientSync>,
    normalization: LossNormalization,
    accumulation_steps: usize,
    sync_each_batch: bool,
}

impl StepPipeline {
    /// The pipeline of a rank configured by `config`, averaging gradients through `sync`.
    pub fn new(config: &AcceleratorConfig, sync: Box<dyn GradientSync>) -> Self {
        Self {
            shared: SharedStep::new(config.gradient_accumulation_steps),
            precision: Mutex::new(Precision::new(
                config.mixed_precision,
                config.loss_scaler.clone(),
            )),
            sync,
            normalization: config.loss_normalization,
            accumulation_steps: config.gradient_accumulation_steps,
            sync_each_batch: config.sync_each_batch,
        }
    }

    /// Averages `grads` (flat gradients of parameters of their own) across ranks exactly as a sync step of
    /// `backward` does, bucketing included, and returns them: the sync path alone, for the benchmarks.
    pub fn sync_flat_for_bench(&self, grads: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>> {
        let mut buffer = super::buffer::GradientBuffer::new();
        let params: Vec<(burn::module::ParamId, usize)> = grads
            .iter()
            .map(|g| (burn::module::ParamId::new(), g.dims()[0]))
            .collect();
        for ((id, _), grad) in params.iter().zip(grads) {
            buffer.add(*id, grad);
        }
        self.sync.average(&mut buffer, &params, 1.0)?;
        let ids: Vec<_> = params.iter().map(|(id, _)| *id).collect();
        Ok(buffer.flat(&ids))
    }

    /// The step state and gradients, shared with prepared optimizers, schedulers and dataloaders.
    pub fn shared(&self) -> &SharedStep {
        &self.shared
    }

    /// The rank's precision.
    pub fn precision(&self) -> MutexGuard<'_, Precision> {
        self.precision.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `module` with rank 0's weights on every rank (the first step of `prepare_model`).
    pub fn broadcast_initial<M: Module>(&self, module: M) -> Result<M> {
        broadcast_module(self.sync.as_ref(), module)
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
        let mut grads = self.precision().scale_loss(loss).backward();
        self.process(&mut grads, model)
    }

    /// The pipeline after `backward`: collects `model`'s gradients from `grads` (the graph's `Gradients`, or the
    /// `GradientsParams` burn-train's `TrainStep` returns), then normalises, averages across ranks, unscales and
    /// decides the step as the accumulation window requires.
    pub fn process<M: Module, S: GradSource>(&self, grads: &mut S, model: &M) -> Result<()> {
        let mut core = self.shared.lock();
        let before = core.grads.len();
        core.grads.collect(model, grads);
        if before == 0 && core.grads.is_empty() {
            return Err(Error::InvalidArgument(
                "backward: none of the model's parameters received a gradient; pass the model the loss was \
                 computed with"
                    .into(),
            ));
        }
        let plan = core
            .state
            .record_backward(self.sync_each_batch && self.sync.is_distributed());
        let micro_batches = match plan {
            BackwardPlan::Local => return Ok(()),
            BackwardPlan::SyncOnly => return self.average(&mut core.grads, model, 1.0),
            BackwardPlan::EndWindow { micro_batches } => micro_batches,
        };
        let mut precision = self.precision();
        let scale = precision.unscaled(self.normalisation(micro_batches));
        self.average(&mut core.grads, model, scale)?;
        if precision.loss_scale().is_some() {
            let grads = &mut core.grads;
            let overflow = precision.verdict(|| has_non_finite(grads, &param_ids(model)))?;
            core.state.record_overflow(overflow);
        }
        Ok(())
    }

    /// The factor that turns a window's summed gradients into their mean (see [`LossNormalization`]).
    fn normalisation(&self, micro_batches: usize) -> f32 {
        match self.normalization {
            LossNormalization::ActualMicroBatches => 1.0 / micro_batches as f32,
            LossNormalization::Nominal => 1.0 / self.accumulation_steps as f32,
        }
    }

    fn average<M: Module>(&self, grads: &mut GradientBuffer, model: &M, scale: f32) -> Result<()> {
        let params = if self.sync.is_distributed() {
            trainable_params(model)
        } else {
            Vec::new()
        };
        self.sync.average(grads, &params, scale)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::module::ParamId;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;

    use super::*;
    use crate::precision::{LossScaler, MixedPrecision};

    /// A test double of the sync seam: records each call's scale, and halves nothing (a world of one that
    /// claims to be distributed, as a device all-reduce on one GPU would be).
    #[derive(Debug, Default)]
    struct Recording(Calls);

    /// Each call's number of parameters and scale.
    type Calls = Arc<Mutex<Vec<(usize, f32)>>>;

    impl GradientSync for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }
        fn is_distributed(&self) -> bool {
            true
        }
        fn average(
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
        fn broadcast_from_root(&self, flat: Tensor<1>) -> Result<Tensor<1>> {
            Ok(flat)
        }
    }

    fn pipeline(config: AcceleratorConfig) -> (StepPipeline, Calls) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let sync = Box::new(Recording(calls.clone()));
        (StepPipeline::new(&config, sync), calls)
    }

    fn step(pipeline: &StepPipeline, model: &Linear) {
        pipeline.begin_micro_batch();
        let device = model.weight.device();
        let loss = model.forward(Tensor::<2>::ones([2, 3], &device)).sum();
        pipeline.backward(loss, model).unwrap();
    }

    #[test]
    fn the_sync_seam_is_called_once_per_window_with_normalisation_and_unscaling() {
        let config = AcceleratorConfig {
            gradient_accumulation_steps: 2,
            mixed_precision: MixedPrecision::Fp16,
            loss_scaler: LossScaler::with_init_scale(4.0),
            ..AcceleratorConfig::default()
        };
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
        let config = AcceleratorConfig {
            gradient_accumulation_steps: 3,
            sync_each_batch: true,
            ..AcceleratorConfig::default()
        };
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
