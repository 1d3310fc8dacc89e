//! The Learner strategy's validation epoch: on the main process over the whole split, or, where each rank holds a
//! part of the model (`FULL_SHARD`, `HYBRID_SHARD`, a pipeline), on every rank taking part in the gathers.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use burn_train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    SupervisedTrainingEventProcessor, TrainingError, TrainingItem, ValidLoader,
};

use super::{AcceleratedStrategy, training_error};
use crate::distributed::collectives;
use crate::error::Result;
use crate::learner::batch_steps::{slices_in_validation, stage_done, whole_model_under_pipeline};
use crate::learner::{context, gathering};

impl AcceleratedStrategy {
    /// One validation epoch, on the main process only (every rank where each holds a part of the model, see
    /// [`validate_on_every_rank`](Self::validate_on_every_rank)), over the whole split (a
    /// [`LearnerLoader::valid`] reads it as one process does): burn-train's metrics cannot be gathered across
    /// processes, so the main process computes them all and its metrics and early stopping equal a 1-rank run's.
    /// The other ranks wait, answering one heartbeat per validation batch so that no collective waits longer than
    /// one batch.
    ///
    /// [`LearnerLoader::valid`]: crate::learner::LearnerLoader::valid
    pub(super) fn valid_epoch<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) {
        let acc = &self.accelerator;
        let heartbeat = |done: bool| {
            if acc.num_processes() == 1 {
                return Ok(done);
            }
            collectives::any_rank(acc.process_group(), "learner_validation", done)
        };
        // Where each rank holds a part of the model, every rank validates, taking part in each gather.
        if self.holds_slices() {
            return self.validate_on_every_rank(
                learner,
                loader,
                processor,
                interrupter,
                &heartbeat,
            );
        }
        let model = learner.model();
        if !acc.is_main_process() {
            drop(model);
            return wait_for_validation(&heartbeat, interrupter);
        }
        self.validate_on_main(model, loader, processor, interrupter, || {
            heartbeat(false).map(|_| ())
        });
        if let Err(e) = heartbeat(true) {
            interrupter.fail(training_error(e));
        }
    }

    /// One validation epoch where each rank holds a part of the model (`FULL_SHARD`, `HYBRID_SHARD`, a
    /// pipeline): every rank takes each batch of the whole split through the model, taking part in its gathers
    /// (the `InferenceStep` runs on `learner::unshard(self)`, or block by block with
    /// [`learner::forward_batch`](crate::learner::forward_batch), which under a pipeline is a step of every rank), and the
    /// reporting rank (the main process; under a pipeline the last stage of the first replica, which computes the
    /// items) reports them. After each batch the ranks answer one heartbeat (a failed batch ends the epoch on every
    /// rank).
    fn validate_on_every_rank<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
        heartbeat: &dyn Fn(bool) -> Result<bool>,
    ) {
        let acc = &self.accelerator;
        let reporter = crate::learner::reports(acc);
        let stages = self.pipeline_stages();
        let precision = acc.config().precision.mixed_precision;
        let model = learner.model().valid();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let failed = match item {
                Err(e) => {
                    interrupter.fail(TrainingError::Dataset(e));
                    true
                }
                Ok(item) => {
                    iteration += 1;
                    let progress = iterator.progress();
                    let (result, calls) = {
                        let _context = context::enter(precision, None);
                        let _gathering = gathering::enter(acc.clone(), true);
                        let result =
                            catch_unwind(AssertUnwindSafe(|| InferenceStep::step(&model, item)));
                        (result, gathering::take_calls())
                    };
                    if let Some(e) = calls.failure {
                        interrupter.fail(training_error(e));
                        true
                    } else if let Some(error) = match stages {
                        Some(stages) if !calls.batch_pass => {
                            Some(whole_model_under_pipeline(stages, false))
                        }
                        None if !calls.batch_pass && calls.gathered.is_none() => {
                            Some(slices_in_validation(acc.config().distributed.sharding))
                        }
                        _ => None,
                    } {
                        interrupter.fail(training_error(error));
                        true
                    } else {
                        match result {
                            Ok(output) if reporter => {
                                let item =
                                    TrainingItem::new(output, progress, Some(iteration), None);
                                interrupter.fail_on_error(
                                    processor.process_valid(LearnerEvent::ProcessedItem(item)),
                                );
                            }
                            Ok(_) => {}
                            Err(panic) if stage_done(panic.as_ref()) => {}
                            Err(panic) => resume_unwind(panic),
                        }
                        false
                    }
                }
            };
            match heartbeat(failed) {
                Ok(false) => {}
                // A rank failed its batch: every rank ends the epoch here.
                Ok(true) => return,
                Err(e) => return interrupter.fail(training_error(e)),
            }
        }
        if let Err(e) = heartbeat(true) {
            interrupter.fail(training_error(e));
        }
    }

    /// The main process's validation loop; `between_batches` runs after each batch.
    fn validate_on_main<M: LearnerModel>(
        &self,
        model: M,
        loader: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
        between_batches: impl Fn() -> Result<()>,
    ) {
        let precision = self.accelerator.config().precision.mixed_precision;
        let model = model.valid();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let item = match item {
                Ok(item) => item,
                Err(e) => return interrupter.fail(TrainingError::Dataset(e)),
            };
            iteration += 1;
            let progress = iterator.progress();
            let output = {
                let _context = context::enter(precision, None);
                InferenceStep::step(&model, item)
            };
            let item = TrainingItem::new(output, progress, Some(iteration), None);
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::ProcessedItem(item)));
            if let Err(e) = between_batches() {
                return interrupter.fail(training_error(e));
            }
        }
    }
}

/// A rank that does not validate: answers the validating ranks' heartbeats until they say they are done.
fn wait_for_validation(heartbeat: &dyn Fn(bool) -> Result<bool>, interrupter: &Interrupter) {
    loop {
        match heartbeat(false) {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => return interrupter.fail(training_error(e)),
        }
    }
}
