//! A burn-train `Learner` keeps its optimizer and scheduler private; its own checkpointer is the public way in
//! and out. These checkpointers hold one record in memory instead of writing a file, so that the strategy can
//! put the Learner's state into `save_state` and take it back from `load_state`.

use std::sync::{Arc, Mutex};

use burn::lr_scheduler::LrSchedulerRecord;
use burn::optim::OptimizerRecord;
use burn::store::ModuleRecord;
use burn_train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn_train::metric::store::EventStoreClient;
use burn_train::{Learner, LearnerModel, LearningCheckpointer};

/// One record, in memory.
struct Slot<R>(Arc<Mutex<Option<R>>>);

impl<R: Checkpoint> Checkpointer<R> for Slot<R> {
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(record);
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize) -> Result<R, CheckpointerError> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| CheckpointerError::Unknown("no record to restore".into()))
    }
}

/// Saves every time it is asked.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(
        &mut self,
        _epoch: usize,
        _store: &EventStoreClient,
    ) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// The three records of a Learner.
pub(crate) struct LearnerRecords {
    pub model: ModuleRecord,
    pub optimizer: OptimizerRecord,
    pub scheduler: LrSchedulerRecord,
}

fn take<R>(slot: &Arc<Mutex<Option<R>>>) -> Option<R> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The model, optimizer and scheduler records of `learner`, taken through burn-train's own checkpointer (its
/// fields are private); restoring needs no such detour (`Learner::load_model` / `load_optim` /
/// `load_scheduler`).
pub(crate) fn records<M: LearnerModel>(
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Option<LearnerRecords> {
    let model = Arc::new(Mutex::new(None));
    let optimizer = Arc::new(Mutex::new(None));
    let scheduler = Arc::new(Mutex::new(None));
    {
        let mut checkpointer = LearningCheckpointer::<M>::new(
            AsyncCheckpointer::new(Slot(model.clone())),
            AsyncCheckpointer::new(Slot(optimizer.clone())),
            AsyncCheckpointer::new(Slot(scheduler.clone())),
            Box::new(Always),
        );
        checkpointer.checkpoint(learner, 0, store);
        // Dropping the checkpointer waits for its writer threads: the slots are filled after this.
    }
    Some(LearnerRecords {
        model: take(&model)?,
        optimizer: take(&optimizer)?,
        scheduler: take(&scheduler)?,
    })
}
