//! Accelerate's triggers: a flag any rank raises (an early-stopping condition, say) that every rank sees.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::DType;

use crate::comm::{ReduceBuffer, ReduceOp};
use crate::error::Result;
use crate::state::ProcessState;

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
    pub fn check(&self, state: &ProcessState) -> Result<bool> {
        let mine = i64::from(self.0.load(Ordering::Relaxed));
        let all = super::all_reduce_host(
            state,
            "check_trigger",
            (DType::I64, &[1]),
            ReduceBuffer::I64(vec![mine]),
            ReduceOp::Max,
        )?;
        let fired = matches!(all, ReduceBuffer::I64(v) if v.first().copied().unwrap_or(0) > 0);
        if fired {
            self.0.store(false, Ordering::Relaxed);
        }
        Ok(fired)
    }
}
