use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::Device;

use super::loader::{DataLoader, DataLoaderIter};
use super::position::{LoaderCursor, LoaderFingerprint};
use super::shard::{ShardSpec, shard};
use crate::config::AcceleratorConfig;
use crate::distributed::ProcessGroup;
use crate::error::Result;
use crate::grad::window::SharedStep;

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

impl<I, O> PreparedDataLoader<I, O> {
    /// Prepares `loader` for a rank (see [`Accelerator::prepare_dataloader`](crate::Accelerator)): the shuffle
    /// seed comes from rank 0, the shard from the rank and the config.
    pub(crate) fn prepare(
        mut loader: DataLoader<I, O>,
        group: &ProcessGroup,
        config: &AcceleratorConfig,
        shared: SharedStep,
    ) -> Result<Self> {
        if group.num_processes() > 1
            && let Some(seed) = loader.shuffle
        {
            loader.shuffle = Some(crate::distributed::collectives::broadcast_object(
                group, &seed, 0,
            )?);
        }
        let spec = ShardSpec {
            num_processes: group.num_processes(),
            rank: group.process_index(),
            split_batches: config.data.split_batches,
            even_batches: config.data.even_batches,
        };
        let device = config
            .device
            .device_placement
            .then(|| group.device().clone());
        Self::new(loader, device, shared, spec)
    }

    fn new(
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
        let fingerprint = LoaderFingerprint {
            num_items: loader.num_items(),
            batch_size: loader.batch_size(),
            shuffle_seed: loader.shuffle_seed(),
            drop_last: loader.drop_last(),
            batches_per_epoch: len,
            num_processes: Some(spec.num_processes),
            total_batch_size: Some(if spec.split_batches {
                loader.batch_size()
            } else {
                loader.batch_size() * spec.num_processes
            }),
        };
        let cursor = Arc::new(LoaderCursor {
            epoch: loader.epoch.clone(),
            in_epoch: AtomicUsize::new(0),
            yielded: AtomicUsize::new(0),
            skip: AtomicUsize::new(0),
            len,
            fingerprint,
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
        self.iter_over(|epoch| self.batch_indices(epoch))
    }

    /// Iterates over one whole epoch as one process would, with this rank's device and tracking: the batches
    /// of the loader before preparation (the Learner's validation on the main process).
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn iter_whole_epoch(&self) -> PreparedIter<'_, I, O> {
        self.iter_over(|epoch| self.loader.batch_indices(epoch))
    }

    /// One epoch over the batches `batches_of(epoch)`.
    fn iter_over(
        &self,
        batches_of: impl FnOnce(usize) -> Vec<Vec<usize>>,
    ) -> PreparedIter<'_, I, O> {
        // The cursor's epoch counter is the loader's own.
        let (epoch, skip) = self.cursor.begin_epoch();
        let mut batches = batches_of(epoch);
        batches.drain(..skip.min(batches.len()));
        let inner = self.loader.iter_batches(batches, self.device.clone());
        let remainder =
            (!self.loader.drop_last()).then(|| self.loader.num_items() % self.total_batch_size());
        self.shared.lock().state.begin_epoch(inner.len(), remainder);
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
        self.shared
            .lock()
            .state
            .batch_yielded(self.inner.len() == 0);
        self.cursor.yielded.fetch_add(1, Ordering::Relaxed);
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

impl<I, O> ExactSizeIterator for PreparedIter<'_, I, O> {}
