//! [`AcceleratedStrategy`]: burn-train's training strategy seam, filled by the accelerator's step pipeline.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Mutex};

use burn::data::dataset::DatasetError;
use burn_train::checkpoint::CheckpointerError;
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    EventProcessorTraining, Interrupter, Learner, LearnerEvent, LearnerModel, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents,
    TrainingError, TrainingItem, ValidLoader,
};
use serde::{Deserialize, Serialize};

mod validation;

use super::batch_steps::{stage_done, whole_model_under_pipeline};
use super::context;
use super::gathering;
use super::records;
use crate::accelerator::Accelerator;
use crate::checkpoint::StateToSave;
use crate::distributed::collectives;
use crate::distributed::strategy::{StateScope, note_restored_ids};
use crate::error::{Error, Result};
use crate::precision::MixedPrecision;
use crate::step::StepOutcome;

/// Where a Learner run stands, saved with every checkpoint the strategy writes (registered as
/// `burn_train_learner`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct LearnerProgress {
    /// burn-train's epoch number (from 1) the next batch belongs to.
    epoch: usize,
    /// Optimizer steps taken.
    steps: usize,
}

/// burn-train's training strategy, run by the [`Accelerator`]: a `SupervisedTraining` trains through the step
/// pipeline on in-process ranks, under `mpirun` or `burn-accelerate launch`, on any backend.
///
/// - Gradients are averaged across ranks on synchronising steps only (gradient accumulation as the
///   accelerator is configured, normalised by the micro-batches actually accumulated), unscaled and checked for
///   fp16 overflow on every rank (a step skipped on one is skipped on all), clipped by their global norm when
///   asked, and the scheduler advances as the accelerator's [`SchedulerRule`](crate::SchedulerRule) says (once per
///   optimizer step by default).
/// - Every rank starts from rank 0's weights and trains on its own shard (pass prepared dataloaders through
///   [`LearnerLoader`](super::LearnerLoader)); only the main process renders, logs metrics, writes burn-train's
///   checkpoints and decides early stopping (the decision reaches every rank). Validation runs on the main
///   process over the whole split, so the logged metrics and early stopping equal a 1-rank run's.
/// - Under `FULL_SHARD` and `HYBRID_SHARD` the Learner holds this rank's slices of the model between steps (build it
///   with `accelerator.prepare_model(model)?`) and its optimizer steps them: the whole model is gathered for each
///   step, handed to the `TrainStep` by [`learner::unshard`](super::unshard) and released after it, gradients are
///   reduce-scattered, and the returned model is gathered on every rank. Every rank validates (taking part in
///   the gathers): the `InferenceStep` runs on `learner::unshard(self)`, or block by block with
///   [`learner::forward_batch`](super::forward_batch) (one block whole at a time). burn-train's epoch
///   checkpoints are refused there (the main process would write its slices only): use `save_every`.
/// - Under a pipeline (`pp_size` > 1) each rank's Learner holds its stage's blocks (build it with
///   `accelerator.prepare_blocks(model)?`); the `TrainStep` takes the batch through the stages with
///   [`learner::backward_batch`](super::backward_batch), the `InferenceStep` with
///   [`learner::forward_batch`](super::forward_batch). The last stage computes each batch's item, so the last stage
///   of the first replica renders, logs the metrics and decides early stopping; every replica's stages validate
///   on the whole split (the first replica's last stage reports); the run returns each rank's stage (save it with
///   [`save_blocks`](crate::Accelerator::save_blocks)). burn-train's epoch checkpoints are refused: use
///   `save_every`.
/// - [`save_every`](Self::save_every) saves the whole run with `save_state` (model, optimizer, scheduler,
///   dataloader positions) every n optimizer steps; [`resume`](Self::resume) continues from the latest such
///   checkpoint, in the middle of an epoch, bit for bit.
///
/// Build it with [`Accelerator::prepare_training`](crate::Accelerator::prepare_training), which also silences
/// the other ranks' renderer and loggers.
pub struct AcceleratedStrategy {
    accelerator: Arc<Accelerator>,
    progress: Arc<Mutex<LearnerProgress>>,
    max_grad_norm: Option<f64>,
    save_every: Option<usize>,
    max_steps: Option<usize>,
    resume: bool,
    return_slices: bool,
}

impl std::fmt::Debug for AcceleratedStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceleratedStrategy")
            .field("max_grad_norm", &self.max_grad_norm)
            .field("save_every", &self.save_every)
            .field("max_steps", &self.max_steps)
            .field("resume", &self.resume)
            .field("return_slices", &self.return_slices)
            .finish()
    }
}

/// The name the strategy's progress is registered under.
const PROGRESS: &str = "burn_train_learner";

impl AcceleratedStrategy {
    /// A strategy training through `accelerator` (one per accelerator: it registers its progress for
    /// checkpointing).
    ///
    /// # Errors
    /// When a strategy was already made for this accelerator.
    pub fn new(accelerator: Arc<Accelerator>) -> Result<Self> {
        // The strategy says whether the Learner can train through it (it runs the forward pass on its own model).
        accelerator.step().strategy().check_learner()?;
        let progress = Arc::new(Mutex::new(LearnerProgress::default()));
        accelerator
            .register_for_checkpointing(PROGRESS, progress.clone())
            .map_err(|_| {
                Error::InvalidArgument(
                    "AcceleratedStrategy::new: this accelerator already has a Learner strategy; make one per \
                     accelerator"
                        .into(),
                )
            })?;
        Ok(Self {
            accelerator,
            progress,
            max_grad_norm: None,
            save_every: None,
            max_steps: None,
            resume: false,
            return_slices: false,
        })
    }

    /// Clips the averaged gradients to this global L2 norm before each optimizer step.
    pub fn max_grad_norm(mut self, max_norm: f64) -> Self {
        self.max_grad_norm = Some(max_norm);
        self
    }

    /// Saves the whole run (`save_state` into the project's automatic checkpoints) every `steps` optimizer
    /// steps. Needs a project folder (`AcceleratorBuilder::project_configuration`).
    pub fn save_every(mut self, steps: usize) -> Self {
        self.save_every = (steps > 0).then_some(steps);
        self
    }

    /// Stops after `steps` optimizer steps in all (counting those before a resume), saving first when
    /// [`save_every`](Self::save_every) is set.
    pub fn max_steps(mut self, steps: usize) -> Self {
        self.max_steps = Some(steps);
        self
    }

    /// Continues from the latest automatic checkpoint, if there is one: weights, optimizer, scheduler, the
    /// dataloaders' positions (mid-epoch) and the epoch. burn-train's own `checkpoint(epoch)` resumes at epoch
    /// boundaries from its own files; this replaces it.
    pub fn resume(mut self, resume: bool) -> Self {
        self.resume = resume;
        self
    }

    /// Under `FULL_SHARD` and `HYBRID_SHARD`, returns each rank's slices of the trained model instead of gathering
    /// it whole on every rank at the end (a model that does not fit one rank would not fit there either): save it
    /// with `accelerator.save_model` (one parameter at a time), evaluate it with `accelerator.forward_batch` (one
    /// block at a time) or gather it with `accelerator.unshard`.
    pub fn return_slices(mut self, slices: bool) -> Self {
        self.return_slices = slices;
        self
    }

    /// Refuses options that cannot work with this accelerator, before training starts: saving or resuming
    /// needs a project folder for the automatic checkpoints.
    pub(crate) fn validate(&self) -> Result<()> {
        let project = self.accelerator.project_configuration();
        let has_folder = project.automatic_checkpoint_naming && project.checkpoints_dir().is_some();
        let option = match (self.save_every, self.resume) {
            (Some(n), _) => format!("save_every({n})"),
            (None, true) => "resume(true)".to_string(),
            (None, false) => return Ok(()),
        };
        if has_folder {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "prepare_training: the strategy's {option} keeps its checkpoints in the project folder, but the \
             accelerator has none; build it with \
             `.project_configuration(ProjectConfiguration::new(\"runs\"))` (any folder), or drop {option}"
        )))
    }

    /// Whether each rank holds only its part of the parameters between steps (`FULL_SHARD`, `HYBRID_SHARD`: its
    /// slices; a pipeline: its stage): the Learner's model is then the prepared model's part, which burn-train's
    /// optimizer steps, and the model is gathered for each step (by [`learner::unshard`](super::unshard), or block
    /// by block), for each validation batch, and (but for a pipeline) for the trained model the run returns.
    fn holds_slices(&self) -> bool {
        self.accelerator.step().strategy().model_state() == StateScope::PerRank
    }

    /// The number of stages, under a pipeline.
    fn pipeline_stages(&self) -> Option<usize> {
        self.accelerator.stage().map(|s| s.layout.stages)
    }

    /// The trained model the run returns: whole (gathered on every rank when it holds slices, unless
    /// [`return_slices`](Self::return_slices)); under a pipeline, this rank's stage (no rank holds the whole
    /// model).
    fn trained_model<M: LearnerModel>(&self, learner: &Learner<M>) -> Result<M> {
        if let Some(stages) = self.accelerator.stage() {
            // The copies the Learner kept of what only other stages train (`Stages::keeps_rest`) go.
            let elsewhere = stages
                .rest_elsewhere
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let elsewhere = elsewhere.clone().unwrap_or_default();
            return Ok(super::stage_model::with_placeholders(
                learner.model(),
                &elsewhere,
            ));
        }
        if self.holds_slices() && !self.return_slices {
            self.accelerator.unshard(&learner.model())
        } else {
            Ok(learner.model())
        }
    }

    fn progress(&self) -> LearnerProgress {
        *self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_progress(&self, progress: LearnerProgress) {
        *self.progress.lock().unwrap_or_else(|p| p.into_inner()) = progress;
    }
}

/// An error of ours, as burn-train's interrupter takes it.
fn training_error(error: Error) -> TrainingError {
    match error {
        Error::Dataset { .. } => TrainingError::Dataset(DatasetError::new(error)),
        other => TrainingError::Checkpoint(CheckpointerError::Unknown(format!(
            "burn-accelerate: {other}"
        ))),
    }
}

impl AcceleratedStrategy {
    /// Whether any rank wants to stop (an interruption or an error on any rank stops all of them together).
    fn anyone_stops(&self, interrupter: &Interrupter, local: bool) -> bool {
        let acc = &self.accelerator;
        let local = local || interrupter.should_stop();
        if acc.num_processes() == 1 {
            return local;
        }
        // One flag per rank through the collectives (no device tensor to build and read back).
        match collectives::any_rank(acc.process_group(), "learner_stop", local) {
            Ok(stop) => stop,
            Err(e) => {
                interrupter.fail(training_error(e));
                true
            }
        }
    }

    /// Saves the run into the next automatic checkpoint; `next_epoch` is the epoch the next batch belongs to.
    fn save<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        store: &EventStoreClient,
        next_epoch: usize,
    ) -> Result<()> {
        let mut progress = self.progress();
        progress.epoch = next_epoch;
        self.set_progress(progress);
        let records = records::records(learner, store).ok_or_else(|| {
            Error::InvalidArgument("the Learner did not hand out its records".into())
        })?;
        let records = (records.model, records.optimizer, records.scheduler);
        let parts = StateToSave::new().records(records, progress.steps as u64)?;
        self.accelerator.save_state(None, &parts).map(|_| ())
    }

    /// Restores the latest automatic checkpoint into `learner`, if there is one (the progress object, with the
    /// epoch to continue, comes back with it).
    fn restore<M: LearnerModel>(&self, learner: &mut Learner<M>) -> Result<()> {
        let acc = &self.accelerator;
        if acc.project_configuration().checkpoints().is_empty() {
            return Ok(());
        }
        let mut state = acc.load_state(None)?;
        if let Some(stages) = self.pipeline_stages() {
            let (saved, ranks) = (state.saved_pp_size(), state.saved_num_processes());
            if saved != Some(stages) || ranks != acc.num_processes() {
                let saved = saved.map_or("no pipeline".to_string(), |p| format!("pp_size {p}"));
                return Err(Error::InvalidArgument(format!(
                    "AcceleratedStrategy: the latest checkpoint was saved by {ranks} ranks with {saved}, and this \
                     run has pp_size {stages} on {} ranks; the Learner resumes a pipeline on the stages and ranks \
                     that saved it (each rank loads its stage's part): resume with those settings, or load the \
                     checkpoint in a loop of your own (`accelerator.load_state`), which re-cuts it",
                    acc.num_processes()
                )));
            }
        }
        let (model, (optimizer, _), scheduler) = state.records()?;
        state.finish()?;
        // The record carries the saved parameter ids: the strategy learns them (a sharded one keys its slices
        // by id).
        let before = crate::grad::param_ids(&learner.model());
        learner.load_model(model);
        note_restored_ids(acc.step().strategy().as_ref(), before, &learner.model());
        learner.load_optim(optimizer);
        learner.load_scheduler(scheduler);
        Ok(())
    }

    /// Checks burn-train's settings against the accelerator's, gives every rank rank 0's weights and resumes
    /// when asked.
    fn setup<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        grad_accumulation: Option<usize>,
        epoch_checkpoints: bool,
    ) -> Result<()> {
        let acc = &self.accelerator;
        if let Some(n) = grad_accumulation
            && n != acc.config().accumulation.gradient_accumulation_steps
        {
            return Err(Error::InvalidArgument(format!(
                "SupervisedTraining::grads_accumulation({n}) differs from the accelerator's \
                 gradient_accumulation_steps ({}); set it on the accelerator \
                 (AcceleratorBuilder::gradient_accumulation_steps) and leave burn-train's unset",
                acc.config().accumulation.gradient_accumulation_steps
            )));
        }
        if let Some(stages) = self.pipeline_stages() {
            if epoch_checkpoints {
                return Err(Error::InvalidArgument(format!(
                    "AcceleratedStrategy: under pp_size {stages} each rank holds only its stage's blocks, so \
                     burn-train's epoch checkpoints (written by one process) would hold a part of the model; save \
                     with `prepare_training_with(training, |s| s.save_every(n))` (each rank its part, resumed \
                     with `.resume(true)`) and drop `with_default_checkpointers`"
                )));
            }
            if !super::stage_model::has_placeholder(&learner.model()) {
                return Err(Error::InvalidArgument(format!(
                    "AcceleratedStrategy: under pp_size {stages} each rank holds only its stage's blocks, and \
                     burn-train's Learner cannot change the shapes of its model; build the Learner with the \
                     prepared stage: `Learner::new(accelerator.prepare_blocks(model)?, optimizer, learning_rate)`"
                )));
            }
        } else if self.holds_slices() {
            let sharding = acc.config().distributed.sharding;
            if epoch_checkpoints {
                return Err(Error::InvalidArgument(format!(
                    "AcceleratedStrategy: under {sharding} each rank holds only its slices of the model, so \
                     burn-train's epoch checkpoints (written by the main process) would hold a part of it; save \
                     with `prepare_training_with(training, |s| s.save_every(n))` (each rank its part, resumed \
                     with `.resume(true)`) and drop `with_default_checkpointers`"
                )));
            }
            // A record cannot change a model's shapes: the Learner must be built with the prepared slices (the
            // strategy knows how a prepared model's parameters are split; a model as drawn has ids it never saw).
            let strategy = acc.step().strategy();
            let prepared = crate::grad::param_ids(&learner.model())
                .into_iter()
                .any(|id| strategy.slicing(id).is_some());
            if !prepared {
                return Err(Error::InvalidArgument(format!(
                    "AcceleratedStrategy: under {sharding} each rank holds only its slices of the parameters \
                     between steps, and burn-train's Learner cannot change the shapes of its model; build the \
                     Learner with the prepared model: `Learner::new(accelerator.prepare_model(model)?, \
                     optimizer, learning_rate)`"
                )));
            }
        } else {
            let model = acc.prepare_model(learner.model())?;
            learner.load_model(model.into_record());
        }
        // A job restarted by its launcher continues from its latest checkpoint, as `resume(true)` asks.
        if self.resume || acc.resumes() {
            self.restore(learner)?;
        }
        Ok(())
    }

    /// One training epoch over this rank's shard; returns whether training must stop.
    fn train_epoch<M: LearnerModel>(
        &self,
        epoch: usize,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
        store: &EventStoreClient,
    ) -> bool {
        let acc = &self.accelerator;
        let reporter = super::reports(acc);
        let precision = acc.config().precision.mixed_precision;
        let pipeline = acc.step();
        super::loader::reset_prepared_flag();
        let mut iterator = loader.iter();
        if acc.num_processes() > 1 && !super::loader::prepared_flag() {
            interrupter.fail(training_error(Error::InvalidArgument(
                "AcceleratedStrategy: with several ranks the training dataloader must be a prepared one \
                 (`LearnerLoader::train(accelerator.prepare_dataloader(loader)?)`), or every rank would \
                 train on all the data"
                    .into(),
            )));
            return self.anyone_stops(interrupter, true);
        }
        let lr_steps = acc.scheduler_steps_per_optimizer_step();
        let mut iteration = 0;
        loop {
            let item = match iterator.next() {
                None => return false,
                Some(Ok(item)) => item,
                Some(Err(e)) => {
                    interrupter.fail(TrainingError::Dataset(e));
                    return self.anyone_stops(interrupter, true);
                }
            };
            iteration += 1;
            let progress = iterator.progress();
            acc.accumulate();
            let holds_slices = self.holds_slices();
            let (output, calls) = {
                let scale = if precision == MixedPrecision::Fp16 {
                    acc.loss_scale()
                } else {
                    None
                };
                let _context = context::enter(precision, scale);
                let _gathering = gathering::enter(acc.clone(), holds_slices);
                let result = catch_unwind(AssertUnwindSafe(|| learner.train_step(item)));
                let calls = gathering::take_calls();
                if let Some(e) = calls.failure {
                    interrupter.fail(training_error(e));
                    return self.anyone_stops(interrupter, true);
                }
                if let Some(stages) = self.pipeline_stages()
                    && !calls.batch_pass
                {
                    // A step on the stage's model runs into the placeholders of the other stages' blocks.
                    interrupter.fail(training_error(whole_model_under_pipeline(stages, true)));
                    return self.anyone_stops(interrupter, true);
                }
                if holds_slices && calls.gathered.is_none() && !calls.block_pass {
                    // A step on the Learner's slices fails in its first layer (or trains wrong): say what to call.
                    interrupter.fail(training_error(Error::InvalidArgument(format!(
                        "AcceleratedStrategy: under {} the Learner's model holds only this rank's slices; the \
                         TrainStep must run its forward pass on the whole model, `let model = \
                         burn_accelerate::learner::unshard(self);` (passing it to `TrainOutput::new(&model, ..)`), \
                         or block by block with `burn_accelerate::learner::backward_blocks(self, ..)`",
                        acc.config().distributed.sharding
                    ))));
                    return self.anyone_stops(interrupter, true);
                }
                // A pipeline's stage other than the last ends its step without an item.
                let output = match result {
                    Ok(output) => Some(output),
                    Err(panic) if stage_done(panic.as_ref()) => None,
                    Err(panic) => resume_unwind(panic),
                };
                if context::autocast_was_used() {
                    acc.settings_applied().note_autocast();
                }
                acc.settings_applied().check(acc);
                if precision == MixedPrecision::Fp16 && !context::loss_was_scaled() {
                    interrupter.fail(training_error(Error::InvalidArgument(
                        "fp16 through the Learner: the TrainStep must back-propagate with \
                         `burn_accelerate::learner::backward(loss)` (which applies the loss scale), not \
                         `loss.backward()`"
                            .into(),
                    )));
                    return self.anyone_stops(interrupter, true);
                }
                (output, calls)
            };
            // The step pipeline's outcome: whether this batch ended an accumulation window (every rank is at the
            // same point then), and the gradients to apply (none while accumulating, or after an fp16 overflow:
            // skipped on every rank, and the scheduler waits). A block-wise pass put its gradients through the
            // pipeline already.
            let (grads, item) = match output {
                Some(output) => (output.grads, Some(output.item)),
                None => (burn::optim::GradientsParams::new(), None),
            };
            let outcome = if calls.block_pass {
                pipeline.finish_processed(&learner.model(), self.max_grad_norm)
            } else {
                // Under FULL_SHARD, the gradients are those of the model `learner::unshard` gathered.
                let whole = calls
                    .gathered
                    .and_then(|m| m.downcast::<M>().ok())
                    .map(|m| *m);
                pipeline.finish(
                    grads,
                    || whole.unwrap_or_else(|| learner.model()),
                    self.max_grad_norm,
                )
            };
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(e) => {
                    interrupter.fail(training_error(e));
                    return self.anyone_stops(interrupter, true);
                }
            };
            let synchronising = outcome.ends_window();
            let mut stop = false;
            if let StepOutcome::Apply(grads) = outcome {
                for _ in 0..lr_steps {
                    learner.lr_step();
                }
                learner.optimizer_step(grads);
                match pipeline.share_stepped(|| learner.model()) {
                    Ok(Some(model)) => learner.load_model(model.into_record()),
                    Ok(None) => {}
                    Err(e) => {
                        interrupter.fail(training_error(e));
                        return self.anyone_stops(interrupter, true);
                    }
                }
                let mut progress = self.progress();
                progress.steps += 1;
                self.set_progress(progress);
                let reached = self.max_steps.is_some_and(|m| progress.steps >= m);
                let due = self
                    .save_every
                    .is_some_and(|n| progress.steps.is_multiple_of(n));
                if due || (reached && self.save_every.is_some()) {
                    let next_epoch = if acc.gradient_state().end_of_dataloader {
                        epoch + 1
                    } else {
                        epoch
                    };
                    if let Err(e) = self.save(learner, store, next_epoch) {
                        interrupter.fail(training_error(e));
                        return self.anyone_stops(interrupter, true);
                    }
                }
                stop = reached;
            }
            if synchronising {
                stop = self.anyone_stops(interrupter, stop);
            }
            if reporter && let Some(item) = item {
                let item =
                    TrainingItem::new(item, progress, Some(iteration), Some(learner.lr_current()));
                interrupter
                    .fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
            }
            if stop {
                return true;
            }
        }
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for AcceleratedStrategy {
    fn train(
        &self,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        mut components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let main = super::reports(&self.accelerator);
        let interrupter = components.interrupter.clone();
        let starting_epoch = components.checkpoint.unwrap_or(0) + 1;
        if main {
            interrupter.fail_on_error(components.event_processor.process_train(
                LearnerEvent::Start {
                    total_epochs: components.num_epochs,
                    starting_epoch,
                    label: components.label.clone(),
                },
            ));
        }
        let summary = components.summary.clone();
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        if main {
            let summary = summary.and_then(|s| s.init().ok());
            interrupter.fail_on_error(processor.process_train(LearnerEvent::End(summary)));
        }
        let model = model.valid();
        interrupter.fail_on_error(processor.flush());
        LearningResult {
            model,
            renderer: processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let TrainingComponents {
            num_epochs,
            mut checkpointer,
            grad_accumulation,
            interrupter,
            mut early_stopping,
            event_processor: mut processor,
            event_store,
            ..
        } = components;
        let acc = &self.accelerator;
        // The rank that renders, logs the metrics and decides (the last stage under a pipeline).
        let main = super::reports(acc);
        learner.fork(acc.device());
        let setup = self.setup(&mut learner, grad_accumulation, checkpointer.is_some());
        if let Err(e) = acc.process_group().agree("AcceleratedStrategy", setup) {
            interrupter.fail(training_error(e));
            return (learner.model(), processor);
        }
        let train_items = dataloader_train.num_items();
        let valid_items = dataloader_valid.num_items();
        let mut epoch = starting_epoch.max(self.progress().epoch);
        while epoch <= num_epochs {
            if main {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train_items,
                }));
            }
            let stop = self.train_epoch(
                epoch,
                &mut learner,
                &dataloader_train,
                &mut processor,
                &interrupter,
                &event_store,
            );
            if main {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
            }
            if stop {
                break;
            }
            if main {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid_items,
                }));
            }
            self.valid_epoch(&learner, &dataloader_valid, &mut processor, &interrupter);
            let mut stop = false;
            if main {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
                if checkpointer.is_some() || early_stopping.is_some() {
                    interrupter.fail_on_error(processor.flush());
                }
                // burn-train's own epoch checkpoints and early stopping: the reporting rank's metrics decide.
                if let Some(checkpointer) = &mut checkpointer {
                    checkpointer.checkpoint(&learner, epoch, &event_store);
                }
                if let Some(early_stopping) = &mut early_stopping {
                    stop = early_stopping.should_stop(epoch, &event_store);
                }
            }
            if self.anyone_stops(&interrupter, stop) {
                break;
            }
            epoch += 1;
        }
        // The trained model, whole on every rank.
        match self.trained_model(&learner) {
            Ok(model) => (model, processor),
            Err(e) => {
                interrupter.fail(training_error(e));
                (learner.model(), processor)
            }
        }
    }
}
