//! Where a prepared dataloader stands: what `save_state` records and `load_state` puts back, so that a run
//! resumes mid-epoch on the very next batch.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

/// The position of a prepared dataloader: the epoch of the next batch and how many batches of it were used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The epoch the next batch belongs to.
    pub epoch: usize,
    /// Batches of that epoch already yielded on this rank.
    pub batch: usize,
}

/// Where a prepared dataloader stands, shared with the accelerator so that `save_state` can record it and
/// `load_state` can put it back.
#[derive(Debug)]
pub(crate) struct LoaderCursor {
    /// The loader's "next epoch" counter.
    pub(super) epoch: Arc<AtomicUsize>,
    /// 1 + the epoch being iterated (0 before the first `iter`).
    pub(super) in_epoch: AtomicUsize,
    /// Batches yielded in that epoch (including skipped ones).
    pub(super) yielded: AtomicUsize,
    /// Batches to skip at the start of the next `iter`.
    pub(super) skip: AtomicUsize,
    /// Batches per epoch on this rank.
    pub(super) len: usize,
}

impl LoaderCursor {
    /// The epoch of the next batch and how many batches of it were used.
    pub(crate) fn position(&self) -> DataPosition {
        let in_epoch = self.in_epoch.load(Ordering::Relaxed);
        let yielded = self.yielded.load(Ordering::Relaxed);
        let (epoch, batch) = if in_epoch == 0 {
            (
                self.epoch.load(Ordering::Relaxed),
                self.skip.load(Ordering::Relaxed),
            )
        } else if yielded >= self.len {
            (in_epoch, 0)
        } else {
            (in_epoch - 1, yielded)
        };
        DataPosition { epoch, batch }
    }

    /// Makes the next `iter` run `position.epoch`, starting after `position.batch` batches.
    pub(crate) fn restore(&self, position: DataPosition) {
        self.epoch.store(position.epoch, Ordering::Relaxed);
        self.skip.store(position.batch, Ordering::Relaxed);
        self.in_epoch.store(0, Ordering::Relaxed);
        self.yielded.store(0, Ordering::Relaxed);
    }
}
