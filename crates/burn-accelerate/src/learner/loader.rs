//! A prepared dataloader as burn-train's `DataLoader`, so that a `SupervisedTraining` reads this rank's shard
//! exactly as `prepare_dataloader` cut it, and `save_state` records (and `load_state` restores) its position
//! in the middle of an epoch.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader as BurnDataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::Device;

use crate::data::{PreparedDataLoader, PreparedIter};

/// A [`PreparedDataLoader`] seen through burn-train's `DataLoader` trait: pass it to `SupervisedTraining::new`
/// (with [`LearnerLoader::train`] / [`LearnerLoader::valid`]). Batches are built on the accelerator's device,
/// which is the device the [`AcceleratedStrategy`](super::AcceleratedStrategy) trains on, so `to_device` keeps
/// them there; `slice` keeps the batches that start inside the item range.
///
/// A validation loader ([`LearnerLoader::valid`]) is read whole, as one process reads it: the strategy
/// validates on the main process only (under a pipeline, on every stage), so that burn-train's
/// metrics and early stopping see the whole split.
pub struct LearnerLoader<I, O> {
    inner: Arc<PreparedDataLoader<I, O>>,
    items: usize,
    range: Option<(usize, usize)>,
    whole: bool,
}

impl<I, O> Clone for LearnerLoader<I, O> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            items: self.items,
            range: self.range,
            whole: self.whole,
        }
    }
}

impl<I: Send + Sync + 'static, O: Send + 'static> LearnerLoader<I, O> {
    /// Wraps `loader` for burn-train: this rank's shard.
    pub fn new(loader: PreparedDataLoader<I, O>) -> Self {
        Self::wrap(loader, false)
    }

    fn wrap(loader: PreparedDataLoader<I, O>, whole: bool) -> Self {
        let batches = if whole {
            loader.inner().batch_indices(loader.epoch())
        } else {
            loader.batch_indices(loader.epoch())
        };
        Self {
            items: batches.iter().map(Vec::len).sum(),
            inner: Arc::new(loader),
            range: None,
            whole,
        }
    }

    /// `loader` as the training split of a `SupervisedTraining`: each rank reads its shard.
    pub fn train(loader: PreparedDataLoader<I, O>) -> Arc<dyn BurnDataLoader<O>> {
        Arc::new(Self::new(loader))
    }

    /// `loader` as the validation split of a `SupervisedTraining`: read whole, in the order and batches of one
    /// process, by the main process (the strategy validates there only, so that the logged metrics and early
    /// stopping equal a 1-rank run's).
    pub fn valid(loader: PreparedDataLoader<I, O>) -> Arc<dyn BurnDataLoader<O>> {
        Arc::new(Self::wrap(loader, true))
    }

    /// The prepared loader inside.
    pub fn prepared(&self) -> &PreparedDataLoader<I, O> {
        &self.inner
    }
}

thread_local! {
    /// Set when a [`LearnerLoader`] starts an epoch on this thread: the strategy checks that its training
    /// loader is a prepared one (burn-train hands it over as `Arc<dyn DataLoader>`, which cannot be asked).
    static PREPARED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) fn reset_prepared_flag() {
    PREPARED.with(|p| p.set(false));
}

pub(crate) fn prepared_flag() -> bool {
    PREPARED.with(|p| p.get())
}

/// One epoch of a [`LearnerLoader`], with burn-train's progress.
struct LearnerIter<'a, I, O> {
    inner: PreparedIter<'a, I, O>,
    batch_size: usize,
    total: usize,
    offset: usize,
    range: Option<(usize, usize)>,
}

impl<I, O> Iterator for LearnerIter<'_, I, O> {
    type Item = Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let batch = self.inner.next()?;
            let start = self.offset;
            self.offset = (self.offset + self.batch_size).min(self.total);
            let inside = self
                .range
                .is_none_or(|(from, to)| start >= from && start < to);
            if inside {
                return Some(batch.map_err(DatasetError::new));
            }
        }
    }
}

impl<I, O> DataLoaderIterator<O> for LearnerIter<'_, I, O> {
    fn progress(&self) -> Progress {
        let (from, to) = self.range.unwrap_or((0, self.total));
        Progress {
            items_processed: self.offset.clamp(from, to) - from,
            items_total: to.min(self.total) - from.min(self.total),
            unit: Some("items".into()),
        }
    }
}

impl<I: Send + Sync + 'static, O: Send + 'static> BurnDataLoader<O> for LearnerLoader<I, O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        PREPARED.with(|p| p.set(true));
        let (inner, batch_size) = if self.whole {
            (
                self.inner.iter_whole_epoch(),
                self.inner.inner().batch_size(),
            )
        } else {
            (self.inner.iter(), self.inner.batch_size())
        };
        Box::new(LearnerIter {
            inner,
            batch_size,
            total: self.items,
            offset: 0,
            range: self.range,
        })
    }

    fn num_items(&self) -> usize {
        match self.range {
            Some((from, to)) => to.min(self.items) - from.min(self.items),
            None => self.items,
        }
    }

    fn to_device(&self, _device: &Device) -> Arc<dyn BurnDataLoader<O>> {
        Arc::new(self.clone())
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn BurnDataLoader<O>> {
        let (from, to) = self.range.unwrap_or((0, self.items));
        Arc::new(Self {
            range: Some((from + start, (from + end).min(to))),
            ..self.clone()
        })
    }
}
