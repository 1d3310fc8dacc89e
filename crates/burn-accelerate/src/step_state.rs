//! The state one training step shares between the accelerator, its optimizers, schedulers and dataloaders:
//! Accelerate's `GradientState`, plus the gradient buffer itself.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::grad::GradientBuffer;

/// A snapshot of the gradient-synchronisation state of the current step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradientState {
    /// Whether this micro-batch ends an accumulation window: gradients are synchronised and the optimizer steps.
    pub sync_gradients: bool,
    /// Whether the batch just yielded by a prepared dataloader was its last one for this epoch.
    pub end_of_dataloader: bool,
    /// The configured number of micro-batches per optimizer step.
    pub num_steps: usize,
    /// Samples of the last round of the active dataloader that are not padding (`None` with `drop_last`).
    pub remainder: Option<usize>,
}

#[derive(Debug)]
pub(crate) struct StepState {
    pub buffer: GradientBuffer,
    pub sync_gradients: bool,
    pub end_of_dataloader: bool,
    pub num_steps: usize,
    /// Whether any prepared optimizer skipped its latest step (fp16 overflow).
    pub optimizer_step_was_skipped: bool,
    /// Micro-batches counted by `accumulate` since the last sync (Accelerate's `step`).
    pub step: usize,
    /// `backward` calls since gradients were last synchronised.
    pub window: usize,
    /// See [`GradientState::remainder`].
    pub remainder: Option<usize>,
    /// The fp16 loss scaler, when fp16 is on.
    pub scaler: Option<crate::precision::LossScaler>,
    /// Whether the gradients of the current sync step hold an inf or NaN (on any rank).
    pub found_inf: bool,
}

/// A handle to the state of one rank, cloned into every prepared object of that rank.
#[derive(Debug, Clone)]
pub(crate) struct SharedStep(Arc<Mutex<StepState>>);

impl SharedStep {
    pub fn new(num_steps: usize, scaler: Option<crate::precision::LossScaler>) -> Self {
        Self(Arc::new(Mutex::new(StepState {
            buffer: GradientBuffer::new(),
            sync_gradients: true,
            end_of_dataloader: false,
            num_steps,
            optimizer_step_was_skipped: false,
            step: 0,
            window: 0,
            remainder: None,
            scaler,
            found_inf: false,
        })))
    }

    /// Locks the state. A rank's objects are used from one thread, so the lock is never contended; a poisoned
    /// lock (a panic while holding it) is recovered, since the state stays consistent between operations.
    pub fn lock(&self) -> MutexGuard<'_, StepState> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn snapshot(&self) -> GradientState {
        let s = self.lock();
        GradientState {
            sync_gradients: s.sync_gradients,
            end_of_dataloader: s.end_of_dataloader,
            num_steps: s.num_steps,
            remainder: s.remainder,
        }
    }
}
