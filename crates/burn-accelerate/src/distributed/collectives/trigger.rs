//! Accelerate's triggers: a flag any rank raises (an early-stopping condition, say) that every rank sees.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::distributed::ProcessGroup;
use crate::error::Result;

/// One rank's trigger.
#[derive(Debug, Default)]
pub(crate) struct Trigger(AtomicBool);

impl Trigger {
    /// Raises this rank's trigger.
    pub fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether any rank raised its trigger since the last check that fired; lowers it when it fires. A
    /// collective: every rank calls it at the same point.
    pub fn check(&self, group: &ProcessGroup) -> Result<bool> {
        let fired = super::any_rank(group, "check_trigger", self.0.load(Ordering::Relaxed))?;
        if fired {
            self.0.store(false, Ordering::Relaxed);
        }
        Ok(fired)
    }
}
