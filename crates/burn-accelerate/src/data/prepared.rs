use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::Device;

use super::loader::{DataLoader, DataLoaderIter};
use super::shard::{ShardSpec, shard};
use crate::error::Result;
use crate::step_state::SharedStep;

/// A [`DataLoader`] prepared by the [`Accelerator`](crate::Accelerator): each rank gets its shard of every epoch
/// (Accelerate's batch dealing, `split_batches` and `even_batches` rules), batches are built on the accelerator's
/// device (unless device placement is off), and the accelerator learns when an epoch ends.
pub struct PreparedDataLoader<I, O> {
    loader: DataLoader<I, O>,
    device: Device,
    shared: SharedStep,
    spec: ShardSpec,
    cursor: Arc<LoaderCursor>,
}

/// Where a prepared dataloader stands, shared with the accelerator so that `save_state` can record it and
/// `load_state` can put it back.
#[derive(Debug)]
pub(crate) struct LoaderCursor {
    /// The loader's "next epoch" counter.
    epoch: Arc<AtomicUsize>,
    /// 1 + the epoch being iterated (0 before the first `iter`).
    in_epoch: AtomicUsize,
    /// Batches yielded in that epoch (including skipped ones).
    yielded: AtomicUsize,
    /// Batches to skip at the start of the next `iter`.
    skip: AtomicUsize,
    /// Batches per epoch on this rank.
    len: usize,
}

impl LoaderCursor {
    /// The epoch of the next batch and how many batches of it were used.
    pub(crate) fn position(&self) -> crate::checkpoint::state::DataPosition {
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
        crate::checkpoint::state::DataPosition { epoch, batch }
    }

    /// Makes the next `iter` run `position.epoch`, starting after `position.batch` batches.
    pub(crate) fn restore(&self, position: crate::checkpoint::state::DataPosition) {
        self.epoch.store(position.epoch, Ordering::Relaxed);
        self.skip.store(position.batch, Ordering::Relaxed);
        self.in_epoch.store(0, Ordering::Relaxed);
        self.yielded.store(0, Ordering::Relaxed);
    }
}

impl<I, O> PreparedDataLoader<I, O> {
    pub(crate) fn new(
        loader: DataLoader<I, O>,
        device: Option<Device>,
        shared: SharedStep,
        spec: ShardSpec,
    ) -> Result<Self> {
        spec.validate(loader.batch_size())?;
        let device = device.unwrap_or_else(|| loader.device.clone());
        let len = shard(
            loader.batch_indices(0),
            loader.batch_size(),
            loader.drop_last(),
            spec,
        )
        .len();
        let cursor = Arc::new(LoaderCursor {
            epoch: loader.epoch.clone(),
            in_epoch: AtomicUsize::new(0),
            yielded: AtomicUsize::new(0),
            skip: AtomicUsize::new(0),
            len,
        });
        Ok(Self {
            loader,
            device,
            shared,
            spec,
            cursor,
        })
    }

    pub(crate) fn cursor(&self) -> Arc<LoaderCursor> {
        self.cursor.clone()
    }

    /// Skips the first `n` batches of the next epoch on this rank (Accelerate's `skip_first_batches`), e.g. to
    /// resume in the middle of an epoch by hand. `load_state` does this itself for prepared dataloaders.
    pub fn skip_first_batches(&self, n: usize) {
        self.cursor.skip.store(n, Ordering::Relaxed);
    }

    /// This rank's batches of `epoch`, as item indices.
    pub fn batch_indices(&self, epoch: usize) -> Vec<Vec<usize>> {
        shard(
            self.loader.batch_indices(epoch),
            self.loader.batch_size(),
            self.loader.drop_last(),
            self.spec,
        )
    }

    /// Batches per epoch on this rank (read it after `prepare_dataloader`: it changes with the number of ranks).
    pub fn len(&self) -> usize {
        self.cursor.len
    }

    /// Whether an epoch yields no batch on this rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Items per batch on this rank.
    pub fn batch_size(&self) -> usize {
        if self.spec.split_batches {
            self.loader.batch_size() / self.spec.num_processes
        } else {
            self.loader.batch_size()
        }
    }

    /// Items per optimizer step over all ranks (without accumulation).
    pub fn total_batch_size(&self) -> usize {
        if self.spec.split_batches {
            self.loader.batch_size()
        } else {
            self.loader.batch_size() * self.spec.num_processes
        }
    }

    /// The epoch the next [`iter`](Self::iter) runs.
    pub fn epoch(&self) -> usize {
        self.loader.epoch()
    }

    /// Sets the epoch the next [`iter`](Self::iter) runs.
    pub fn set_epoch(&self, epoch: usize) {
        self.loader.set_epoch(epoch)
    }

    /// The device batches are built on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How the epoch is divided between ranks.
    pub fn shard_spec(&self) -> ShardSpec {
        self.spec
    }

    /// The loader before preparation.
    pub fn inner(&self) -> &DataLoader<I, O> {
        &self.loader
    }

    /// Iterates over this rank's share of one epoch. While it runs, `accelerator.gradient_state()
    /// .end_of_dataloader` is true exactly when the batch just yielded is the epoch's last, which is what
    /// `gather_for_metrics` and gradient accumulation rely on.
    pub fn iter(&self) -> PreparedIter<'_, I, O> {
        let epoch = self.loader.next_epoch();
        let skip = self.cursor.skip.swap(0, Ordering::Relaxed);
        let mut batches = self.batch_indices(epoch);
        batches.drain(..skip.min(batches.len()));
        self.cursor.in_epoch.store(epoch + 1, Ordering::Relaxed);
        self.cursor.yielded.store(skip, Ordering::Relaxed);
        let inner = self.loader.iter_batches(batches, self.device.clone());
        {
            let mut state = self.shared.lock();
            state.end_of_dataloader = inner.len() == 0;
            state.remainder = (!self.loader.drop_last())
                .then(|| self.loader.num_items() % self.total_batch_size());
        }
        PreparedIter {
            inner,
            shared: self.shared.clone(),
            cursor: self.cursor.clone(),
        }
    }
}

/// The batches of one epoch of a [`PreparedDataLoader`].
pub struct PreparedIter<'a, I, O> {
    inner: DataLoaderIter<'a, I, O>,
    shared: SharedStep,
    cursor: Arc<LoaderCursor>,
}

impl<I, O> Iterator for PreparedIter<'_, I, O> {
    type Item = Result<O>;

    fn next(&mut self) -> Option<Self::Item> {
        let batch = self.inner.next()?;
        self.shared.lock().end_of_dataloader = self.inner.len() == 0;
        self.cursor.yielded.fetch_add(1, Ordering::Relaxed);
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

impl<I, O> ExactSizeIterator for PreparedIter<'_, I, O> {}
