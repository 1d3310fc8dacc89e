use burn::tensor::Device;

use super::loader::{DataLoader, DataLoaderIter};
use crate::error::Result;
use crate::step_state::SharedStep;

/// A [`DataLoader`] prepared by the [`Accelerator`](crate::Accelerator): batches are built on the accelerator's
/// device (unless device placement is off) and the accelerator learns when an epoch ends.
pub struct PreparedDataLoader<I, O> {
    loader: DataLoader<I, O>,
    device: Device,
    shared: SharedStep,
}

impl<I, O> PreparedDataLoader<I, O> {
    pub(crate) fn new(
        loader: DataLoader<I, O>,
        device: Option<Device>,
        shared: SharedStep,
    ) -> Self {
        let device = device.unwrap_or_else(|| loader.device.clone());
        Self {
            loader,
            device,
            shared,
        }
    }

    /// Batches per epoch on this rank (read it after `prepare_dataloader`: it changes with the number of ranks).
    pub fn len(&self) -> usize {
        self.loader.len()
    }

    /// Whether an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Items per batch on this rank.
    pub fn batch_size(&self) -> usize {
        self.loader.batch_size()
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

    /// The loader before preparation.
    pub fn inner(&self) -> &DataLoader<I, O> {
        &self.loader
    }

    /// Iterates over one epoch. While it runs, `accelerator.gradient_state().end_of_dataloader` is true exactly
    /// when the batch just yielded is the epoch's last.
    pub fn iter(&self) -> PreparedIter<'_, I, O> {
        let mut inner = self.loader.iter();
        inner.device = self.device.clone();
        self.shared.lock().end_of_dataloader = inner.len() == 0;
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
