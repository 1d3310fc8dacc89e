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
        Ok(Self {
            loader,
            device,
            shared,
            spec,
        })
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
        self.batch_indices(self.epoch()).len()
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
        let inner = self
            .loader
            .iter_batches(self.batch_indices(epoch), self.device.clone());
        {
            let mut state = self.shared.lock();
            state.end_of_dataloader = inner.len() == 0;
            state.remainder = (!self.loader.drop_last())
                .then(|| self.loader.num_items() % self.total_batch_size());
        }
        PreparedIter {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The batches of one epoch of a [`PreparedDataLoader`].
pub struct PreparedIter<'a, I, O> {
    inner: DataLoaderIter<'a, I, O>,
    shared: SharedStep,
}

impl<I, O> Iterator for PreparedIter<'_, I, O> {
    type Item = Result<O>;

    fn next(&mut self) -> Option<Self::Item> {
        let batch = self.inner.next()?;
        self.shared.lock().end_of_dataloader = self.inner.len() == 0;
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

impl<I, O> ExactSizeIterator for PreparedIter<'_, I, O> {}
