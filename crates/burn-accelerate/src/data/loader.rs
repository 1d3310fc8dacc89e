use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::Device;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::workers::{Prefetcher, WorkerSettings};
use crate::error::{Error, Result};

/// Starts the workers of one epoch: the generic function instantiated where the item and batch types allow
/// threads (see [`DataLoaderBuilder::num_workers`]).
type StartWorkers<I, O> = fn(&DataLoader<I, O>, Vec<Vec<usize>>, Device) -> Prefetcher<O>;

/// Builds a [`DataLoader`], with the same calls as Burn's `DataLoaderBuilder`.
pub struct DataLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
    device: Option<Device>,
    workers: WorkerSettings,
    start_workers: Option<StartWorkers<I, O>>,
}

impl<I: 'static, O: Send + 'static> DataLoaderBuilder<I, O> {
    /// Builds batches on `n` worker threads, ahead of the loop (Burn's and PyTorch's `num_workers`; default 0:
    /// each batch is built by the loop when it asks). The batches, their order and their content are those of
    /// `num_workers(0)` on every rank and epoch, shuffled or not, and a resumed run continues exactly; a dataset
    /// error or a panic in the batcher reaches the loop as an error naming the items. Batches are built on the
    /// loader's device (a prepared loader's: the accelerator's), so a GPU upload happens on the workers too.
    /// A batcher that draws random numbers (augmentation) draws them on the workers, in no fixed order.
    pub fn num_workers(mut self, n: usize) -> Self {
        self.workers.num_workers = n;
        self.start_workers = Some(start_workers::<I, O>);
        self
    }

    /// Batches each worker may build ahead of the loop (PyTorch's `prefetch_factor`; default 2, at least 1).
    /// More smooths out batches of uneven cost, at the memory of that many batches.
    pub fn prefetch_factor(mut self, batches: usize) -> Self {
        self.workers.prefetch = batches.max(1);
        self
    }
}

/// Starts `loader`'s workers on `batches`.
fn start_workers<I: 'static, O: Send + 'static>(
    loader: &DataLoader<I, O>,
    batches: Vec<Vec<usize>>,
    device: Device,
) -> Prefetcher<O> {
    let (dataset, batcher) = (loader.dataset.clone(), loader.batcher.clone());
    let build = Arc::new(move |indices: &[usize], device: &Device| {
        load_items(dataset.as_ref(), batcher.as_ref(), indices, device)
    });
    Prefetcher::start(batches, build, device, loader.workers)
}

/// The batch of `indices`: each item read from `dataset` (a failure names its index), then `batcher`.
fn load_items<I, O>(
    dataset: &dyn Dataset<I>,
    batcher: &dyn Batcher<I, O>,
    indices: &[usize],
    device: &Device,
) -> Result<O> {
    // A plain loop into a vector of the batch's size: collecting `Result`s would move every item through the
    // (much larger) error type, several times.
    let mut items = Vec::with_capacity(indices.len());
    for &index in indices {
        match dataset.get(index) {
            Ok(item) => items.push(item),
            Err(e) => {
                return Err(Error::Dataset {
                    index,
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(batcher.batch(items, device))
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
            workers: WorkerSettings::default(),
            start_workers: None,
        }
    }

    /// Items per batch (default 1). Zero is turned into one, with a warning.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        if batch_size == 0 {
            crate::notice::warn_visibly(
                "DataLoaderBuilder::batch_size(0) is not a batch size; using 1",
            );
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
            workers: self.workers,
            start_workers: self.start_workers,
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
    workers: WorkerSettings,
    start_workers: Option<StartWorkers<I, O>>,
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
            workers: self.workers,
            start_workers: self.start_workers,
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
        let source = match self.start_workers {
            Some(start) if self.workers.num_workers > 0 => {
                Source::Workers(start(self, batches, device))
            }
            _ => Source::Inline {
                batches: batches.into_iter(),
                device,
            },
        };
        DataLoaderIter {
            loader: self,
            source,
        }
    }

    /// Worker threads building batches ahead of the loop (0: none).
    pub fn num_workers(&self) -> usize {
        self.workers.num_workers
    }

    /// Whether a partial last batch is dropped.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// The shuffle seed, if the loader shuffles.
    pub fn shuffle_seed(&self) -> Option<u64> {
        self.shuffle
    }

    pub(crate) fn load(&self, indices: &[usize], device: &Device) -> Result<O> {
        load_items(
            self.dataset.as_ref(),
            self.batcher.as_ref(),
            indices,
            device,
        )
    }
}

/// Where an epoch's batches come from.
enum Source<O> {
    /// Built by the loop, one when asked.
    Inline {
        batches: std::vec::IntoIter<Vec<usize>>,
        device: Device,
    },
    /// Built ahead by worker threads.
    Workers(Prefetcher<O>),
}

/// The batches of one epoch of a [`DataLoader`]. Dropping it mid-epoch stops the loader's workers.
pub struct DataLoaderIter<'a, I, O> {
    loader: &'a DataLoader<I, O>,
    source: Source<O>,
}

impl<I, O> Iterator for DataLoaderIter<'_, I, O> {
    type Item = Result<O>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.source {
            Source::Inline { batches, device } => {
                let indices = batches.next()?;
                Some(self.loader.load(&indices, device))
            }
            Source::Workers(prefetcher) => prefetcher.next_batch(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match &self.source {
            Source::Inline { batches, .. } => batches.len(),
            Source::Workers(prefetcher) => prefetcher.remaining(),
        };
        (n, Some(n))
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

    /// A batcher that counts the batches it built and can fail on one item.
    struct Counting {
        built: Arc<AtomicUsize>,
        panic_on: Option<usize>,
    }
    impl Batcher<usize, Vec<usize>> for Counting {
        fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
            if let Some(bad) = self.panic_on
                && items.contains(&bad)
            {
                panic!("item {bad} is corrupt");
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
            self.built.fetch_add(1, Ordering::SeqCst);
            items
        }
    }

    fn epochs(loader: &DataLoader<usize, Vec<usize>>, n: usize) -> Vec<Vec<usize>> {
        (0..n)
            .flat_map(|_| loader.iter().map(|b| b.unwrap()))
            .collect()
    }

    #[test]
    fn workers_yield_the_batches_of_the_loop_in_its_order() {
        let make = |workers: usize| {
            let builder = DataLoaderBuilder::new(Ids).batch_size(7).shuffle(5);
            let builder = if workers > 0 {
                builder.num_workers(workers).prefetch_factor(3)
            } else {
                builder
            };
            builder.build(InMemDataset::new((0..200).collect()))
        };
        let inline = epochs(&make(0), 3);
        for workers in [1, 4] {
            let loader = make(workers);
            assert_eq!(loader.num_workers(), workers);
            assert_eq!(epochs(&loader, 3), inline, "{workers} workers");
            let mut iter = loader.iter();
            assert_eq!(iter.len(), 29);
            iter.next();
            assert_eq!(iter.len(), 28, "the remaining count with workers");
        }
    }

    #[test]
    fn a_failing_item_or_batcher_is_an_error_naming_the_items_and_the_epoch_goes_on() {
        struct Failing;
        impl Dataset<usize> for Failing {
            fn get(
                &self,
                index: usize,
            ) -> std::result::Result<usize, burn::data::dataset::DatasetError> {
                if index == 13 {
                    return Err(burn::data::dataset::DatasetError::new(
                        std::io::Error::other("unreadable"),
                    ));
                }
                Ok(index)
            }
            fn len(&self) -> usize {
                40
            }
        }
        let loader = DataLoaderBuilder::new(Ids)
            .batch_size(10)
            .num_workers(2)
            .build(Failing);
        let batches: Vec<_> = loader.iter().collect();
        assert_eq!(batches.len(), 4);
        let err = batches[1].as_ref().unwrap_err().to_string();
        assert!(err.contains("13"), "{err}");
        assert!(batches[0].is_ok() && batches[2].is_ok() && batches[3].is_ok());

        let built = Arc::new(AtomicUsize::new(0));
        let loader = DataLoaderBuilder::new(Counting {
            built,
            panic_on: Some(25),
        })
        .batch_size(10)
        .num_workers(3)
        .build(InMemDataset::new((0..40).collect()));
        let batches: Vec<_> = loader.iter().collect();
        let err = batches[2].as_ref().unwrap_err().to_string();
        assert!(
            err.contains("worker panicked")
                && err.contains("item 25 is corrupt")
                && err.contains("20"),
            "{err}"
        );
        assert_eq!(batches.iter().filter(|b| b.is_ok()).count(), 3);
    }

    #[test]
    fn workers_stay_a_window_ahead_and_stop_when_the_epoch_is_dropped() {
        let built = Arc::new(AtomicUsize::new(0));
        let loader = DataLoaderBuilder::new(Counting {
            built: built.clone(),
            panic_on: None,
        })
        .batch_size(1)
        .num_workers(2)
        .prefetch_factor(2)
        .build(InMemDataset::new((0..1000).collect()));
        // The workers hold the batcher while they run: its count tells whether they are gone.
        let idle = Arc::strong_count(&loader.batcher);
        let mut iter = loader.iter();
        let _ = iter.next();
        // One batch taken, and the workers fill their window of 2 workers x 2 batches beyond it (waiting as long
        // as a loaded machine needs, never for a fixed time).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while built.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let ahead = built.load(Ordering::SeqCst);
        assert!((2..=5).contains(&ahead), "{ahead} batches built");
        assert!(
            Arc::strong_count(&loader.batcher) > idle,
            "the workers hold the batcher"
        );
        drop(iter);
        // Dropping the epoch ends the workers (their batcher is released), not only blocks them.
        assert_eq!(
            Arc::strong_count(&loader.batcher),
            idle,
            "the workers stopped"
        );
        assert!(built.load(Ordering::SeqCst) <= 5);
    }
}
