//! burn-train's `Learner` through the Accelerator (feature `train`).
//!
//! A `SupervisedTraining` runs with a few changed lines on one or many ranks (in-process, `mpirun`,
//! `burn-accelerate launch`), on any backend:
//!
//! ```ignore
//! let accelerator = Arc::new(Accelerator::new()?);
//! let train = LearnerLoader::train(accelerator.prepare_dataloader(train_loader)?);   // this rank's shard
//! let valid = LearnerLoader::valid(accelerator.prepare_dataloader(valid_loader)?);
//! let training = SupervisedTraining::new("runs", train, valid)
//!     .metric_train_numeric(LossMetric::new())
//!     .num_epochs(3);
//! let training = accelerator.prepare_training(training)?;      // the strategy; quiet on other ranks
//! let model = accelerator.prepare_model(model)?;                // under FULL_SHARD: this rank's slices
//! let result = training.launch(Learner::new(model, AdamConfig::new().init(), 1e-3));
//! ```
//!
//! Inside `TrainStep::step`, [`unshard`] gives the model to run on (gathered under `FULL_SHARD`), [`autocast`]
//! runs the forward pass under the accelerator's mixed precision and [`backward`] applies the fp16 loss scale; all
//! three are plain calls otherwise. [`backward_blocks`] runs a model made of blocks block by block (block-wise
//! `FULL_SHARD`, activation checkpointing, frozen blocks); [`backward_batch`] and, in the `InferenceStep`,
//! [`forward_batch`] take the whole batch through it in every mode, pipelines (`pp_size` > 1) included.
//!
//! How it relates to burn-train's own checkpoints: burn-train saves the model, optimizer and scheduler at
//! epoch ends and resumes at an epoch boundary (`SupervisedTraining::checkpoint(epoch)`); these still work
//! (written by the main process only), except under `FULL_SHARD` and `HYBRID_SHARD`, where each rank holds only its
//! slices of the model and they are refused. [`AcceleratedStrategy::save_every`] saves the whole run with
//! `save_state` (dataloader positions included) every n optimizer steps, and [`AcceleratedStrategy::resume`]
//! continues from it in the middle of an epoch, bit for bit on the CPU.

mod context;
mod gathering;
mod batch_steps;
mod loader;
mod renderers;
mod records;
mod stage_model;
mod strategy;

pub use batch_steps::{backward_batch, forward_batch};
/// The burn-train this module is built against (use it, or depend on the same version).
pub use burn_train;
pub use context::{autocast, backward};
pub use gathering::{backward_blocks, unshard};
pub use loader::LearnerLoader;
pub use renderers::{LineRenderer, QuietRenderer};
pub use strategy::AcceleratedStrategy;

use std::sync::Arc;

use crate::accelerator::Accelerator;
use crate::error::Result;

/// Whether this rank renders burn-train's progress, writes its metrics and decides early stopping: the main
/// process, or under a pipeline the last stage of the first replica (the stage that computes each batch's item).
pub(crate) fn reports(accelerator: &Accelerator) -> bool {
    match accelerator.stage() {
        Some(stages) => stages.layout.replica == 0 && stages.layout.is_last_stage(),
        None => accelerator.is_main_process(),
    }
}

impl Accelerator {
    /// Makes a burn-train `SupervisedTraining` train through this accelerator: the
    /// [`AcceleratedStrategy`], and on every rank but the main process no
    /// renderer output, no metric files and no `experiment.log` (only the main process reports and writes; under
    /// a pipeline, the last stage of the first replica, which computes the items).
    /// Pass prepared dataloaders through [`LearnerLoader`].
    ///
    /// On the main process, burn-train renders as usual with the feature `train-tui` (its terminal UI), else a
    /// [`LineRenderer`] prints one line per split of each epoch. Renderers are chosen here, replacing one set
    /// before: set a renderer of your own on the `SupervisedTraining` this returns.
    ///
    /// # Errors
    /// When this accelerator already prepared a training, or the strategy saves or resumes (`save_every`,
    /// `resume(true)`) without a project folder.
    pub fn prepare_training<M: burn_train::LearnerModel>(
        self: &Arc<Self>,
        training: burn_train::SupervisedTraining<M>,
    ) -> Result<burn_train::SupervisedTraining<M>> {
        self.prepare_training_with(training, |strategy| strategy)
    }

    /// [`prepare_training`](Self::prepare_training) with the strategy's options set by `configure` (gradient
    /// clipping, saving every n steps, resuming, a step limit).
    pub fn prepare_training_with<M: burn_train::LearnerModel>(
        self: &Arc<Self>,
        training: burn_train::SupervisedTraining<M>,
        configure: impl FnOnce(AcceleratedStrategy) -> AcceleratedStrategy,
    ) -> Result<burn_train::SupervisedTraining<M>> {
        let strategy = configure(AcceleratedStrategy::new(self.clone())?);
        strategy.validate()?;
        let training = training
            .with_training_strategy(burn_train::TrainingStrategy::Custom(Arc::new(strategy)));
        if reports(self) {
            // burn-train without its terminal UI prints a debug dump of its progress for every batch.
            #[cfg(not(feature = "train-tui"))]
            let training = training.renderer(Box::new(LineRenderer::new()));
            return Ok(training);
        }
        Ok(training
            .with_application_logger(None)
            .renderer(Box::new(QuietRenderer))
            .with_metric_logger(burn_train::logger::InMemoryMetricLogger::default()))
    }
}
