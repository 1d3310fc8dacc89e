use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::Device;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// Builds a [`DataLoader`], with the same calls as Burn's `DataLoaderBuilder`.
pub struct DataLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
    device: Option<Device>,
}

impl<I, O> DataLoaderBuilder<I, O> {
    /// A builder for loaders that turn items into batches with `batcher`.
    pub fn new(batcher: impl Batcher<I, O> + 'static) -> Self {
        Self {
            batcher: Arc::new(batcher),
            batch_size: 1,
            shuffle: None,
            drop_last: false,
            device: None,
        }
    }

    /// Items per batch (default 1). Zero is turned into one, with a warning.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        if batch_size == 0 {
            log::warn!("DataLoaderBuilder::batch_size(0) is not a batch size; using 1");
        }
        self.batch_size = batch_size.max(1);
        self
    }

    /// Shuffles the items each epoch, reproducibly from `seed` (epoch `e` uses the permutation of `(seed, e)`).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Drops the last batch of an epoch when it is smaller than the batch size.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The device batches are built on when the loader is not prepared (default: `Device::default()`).
    pub fn set_device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Builds the loader over `dataset`.
    pub fn build(self, dataset: impl Dataset<I> + 'static) -> DataLoader<I, O> {
        DataLoader {
            dataset: Arc::new(dataset),
            batcher: self.batcher,
            batch_size: self.batch_size,
            shuffle: self.shuffle,
            drop_last: self.drop_last,
            device: self.device.unwrap_or_default(),
            epoch: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// Batches of a dataset, in order or shuffled per epoch. Iterating yields `Result<O>`: a dataset item that
/// fails to load is an error, not a panic.
pub struct DataLoader<I, O> {
    pub(crate) dataset: Arc<dyn Dataset<I>>,
    pub(crate) batcher: Arc<dyn Batcher<I, O>>,
    pub(crate) batch_size: usize,
    pub(crate) shuffle: Option<u64>,
    pub(crate) drop_last: bool,
    pub(crate) device: Device,
    pub(crate) epoch: Arc<AtomicUsize>,
}

impl<I, O> Clone for DataLoader<I, O> {
    fn clone(&self) -> Self {
        Self {
            dataset: self.dataset.clone(),
            batcher: self.batcher.clone(),
            batch_size: self.batch_size,
            shuffle: self.shuffle,
            drop_last: self.drop_last,
            device: self.device.clone(),
            epoch: Arc::new(AtomicUsize::new(self.epoch.load(Ordering::Relaxed))),
        }
    }
}

impl<I, O> DataLoader<I, O> {
    /// Number of batches per epoch.
    pub fn len(&self) -> usize {
        let n = self.dataset.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// Whether an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of items in the dataset.
    pub fn num_items(&self) -> usize {
        self.dataset.len()
    }

    /// Items per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The epoch the next [`iter`](Self::iter) runs (each call to `iter` moves to the next epoch).
    pub fn epoch(&self) -> usize {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Sets the epoch the next [`iter`](Self::iter) runs, e.g. when resuming.
    pub fn set_epoch(&self, epoch: usize) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The item indices of `epoch`, in the order they are served.
    pub fn indices(&self, epoch: usize) -> Vec<usize> {
        let mut indices: Vec<usize> = (0..self.dataset.len()).collect();
        if let Some(seed) = self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(epoch as u64);
            indices.shuffle(&mut rng);
        }
        indices
    }

    /// The batches of `epoch` as lists of item indices.
    pub fn batch_indices(&self, epoch: usize) -> Vec<Vec<usize>> {
        let mut batches: Vec<Vec<usize>> = self
            .indices(epoch)
            .chunks(self.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        if self.drop_last && batches.last().is_some_and(|b| b.len() < self.batch_size) {
            batches.pop();
        }
        batches
    }

    /// Iterates over one epoch, building batches on the loader's device, and moves on to the next epoch.
    pub fn iter(&self) -> DataLoaderIter<'_, I, O> {
        let epoch = self.next_epoch();
        self.iter_batches(self.batch_indices(epoch), self.device.clone())
    }

    /// Claims the epoch to run next.
    pub(crate) fn next_epoch(&self) -> usize {
        self.epoch.fetch_add(1, Ordering::Relaxed)
    }

    /// Iterates over the given batches of indices, built on `device`.
    pub(crate) fn iter_batches(
        &self,
        batches: Vec<Vec<usize>>,
        device: Device,
    ) -> DataLoaderIter<'_, I, O> {
        DataLoaderIter {
            loader: self,
            batches: batches.into_iter(),
            device,
        }
    }

    /// Whether a partial last batch is dropped.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// The shuffle seed, if the loader shuffles.
    pub fn shuffle_seed(&self) -> Option<u64> {
        self.shuffle
    }

    pub(crate) fn load(&self, indices: Vec<usize>, device: &Device) -> Result<O> {
        let items = indices
            .into_iter()
            .map(|index| {
                self.dataset.get(index).map_err(|e| Error::Dataset {
                    index,
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<I>>>()?;
        Ok(self.batcher.batch(items, device))
    }
}

/// The batches of one epoch of a [`DataLoader`].
pub struct DataLoaderIter<'a, I, O> {
    pub(crate) loader: &'a DataLoader<I, O>,
    pub(crate) batches: std::vec::IntoIter<Vec<usize>>,
    pub(crate) device: Device,
}

impl<I, O> Iterator for DataLoaderIter<'_, I, O> {
    type Item = Result<O>;

    fn next(&mut self) -> Option<Self::Item> {
        let indices = self.batches.next()?;
        Some(self.loader.load(indices, &self.device))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.batches.size_hint()
    }
}

impl<I, O> ExactSizeIterator for DataLoaderIter<'_, I, O> {}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::InMemDataset;

    struct Ids;
    impl Batcher<usize, Vec<usize>> for Ids {
        fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
            items
        }
    }

    fn loader(n: usize, bs: usize) -> DataLoaderBuilder<usize, Vec<usize>> {
        let _ = n;
        DataLoaderBuilder::new(Ids).batch_size(bs)
    }

    #[test]
    fn sequential_batches_and_len() {
        let l = loader(10, 4).build(InMemDataset::new((0..10).collect()));
        assert_eq!(l.len(), 3);
        let batches: Vec<_> = l.iter().map(|b| b.unwrap()).collect();
        assert_eq!(
            batches,
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
        );
        let l = loader(10, 4)
            .drop_last(true)
            .build(InMemDataset::new((0..10).collect()));
        assert_eq!(l.len(), 2);
        assert_eq!(l.iter().count(), 2);
    }

    #[test]
    fn shuffle_is_a_reproducible_permutation_per_epoch() {
        let make = || {
            loader(50, 8)
                .shuffle(3)
                .build(InMemDataset::new((0..50).collect()))
        };
        let a = make();
        let b = make();
        let epoch0: Vec<usize> = a.iter().flat_map(|x| x.unwrap()).collect();
        let epoch1: Vec<usize> = a.iter().flat_map(|x| x.unwrap()).collect();
        assert_eq!(
            epoch0,
            b.iter().flat_map(|x| x.unwrap()).collect::<Vec<_>>()
        );
        assert_ne!(epoch0, epoch1, "each epoch has its own order");
        assert_ne!(epoch0, (0..50).collect::<Vec<_>>());
        let mut sorted = epoch1.clone();
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        b.set_epoch(1);
        assert_eq!(
            epoch1,
            b.iter().flat_map(|x| x.unwrap()).collect::<Vec<_>>()
        );
    }
}
