//! Settings that only take effect through a call in the loop: `gradient_accumulation_steps` through
//! [`Accelerator::accumulate`] and mixed precision through [`Accelerator::autocast`]. A program written without
//! those calls would run as if the setting were off (`launch --gradient-accumulation-steps 2` on a loop that
//! never calls `accumulate`), so the first `backward` that finds a setting in force and its call missing warns,
//! once, on the main process.

use std::sync::atomic::{AtomicBool, Ordering};

use super::Accelerator;
use crate::config::Key;
use crate::precision::MixedPrecision;

/// Which applying calls a rank has made, and which warnings it gave.
#[derive(Debug, Default)]
pub(crate) struct SettingsApplied {
    autocast: AtomicBool,
    accumulation_warned: AtomicBool,
    precision_warned: AtomicBool,
}

impl SettingsApplied {
    /// An autocast scope ran (the accelerator's, or the Learner's inside a `TrainStep`).
    pub fn note_autocast(&self) {
        self.autocast.store(true, Ordering::Relaxed);
    }

    /// Warns (main process, once each) about settings in force whose applying call never came. Call it when a
    /// gradient is about to be taken: by then a loop that applies them has made both calls.
    pub fn check(&self, accelerator: &Accelerator) {
        if !accelerator.is_main_process() {
            return;
        }
        let config = accelerator.config();
        let unused = accelerator
            .step()
            .shared()
            .lock()
            .state
            .accumulation_unused();
        if unused && !self.accumulation_warned.swap(true, Ordering::Relaxed) {
            log::warn!(
                "gradient_accumulation_steps is {} (from {}), but `accelerator.accumulate()` was never \
                     called, so every batch steps the optimizer and the setting does nothing; call \
                     `accelerator.accumulate()` at the start of each batch, before `backward` (Accelerate's \
                     `with accelerator.accumulate(model):`)",
                config.accumulation.gradient_accumulation_steps,
                config.source(Key::GradientAccumulationSteps)
            );
        }
        if config.precision.mixed_precision != MixedPrecision::No
            && !self.autocast.load(Ordering::Relaxed)
            && !self.precision_warned.swap(true, Ordering::Relaxed)
        {
            log::warn!(
                "mixed_precision is {} (from {}), but no forward pass ran inside `accelerator.autocast(..)` \
                     (`burn_accelerate::learner::autocast` in a burn-train step), so the model computes in f32 \
                     and the setting does nothing; compute the loss inside `accelerator.autocast(&model, batch, \
                     |model, batch| model.loss(batch))`",
                config.precision.mixed_precision,
                config.source(Key::MixedPrecision)
            );
        }
    }
}
