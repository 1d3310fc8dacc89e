//! Batches of a stream read in order (a file line by line, a generator): [`StreamLoader`], and its prepared form,
//! which deals each rank its share as Accelerate's `IterableDatasetShard` does and tells the accelerator where
//! the stream ends (for gradient accumulation and `gather_for_metrics`).

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::Device;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::dispatch::{Dispatcher, Progress, dispatched};
use super::position::{LoaderCursor, LoaderFingerprint};
use super::shard::ShardSpec;
use super::stream::shard_stream;
use crate::distributed::ProcessGroup;
use crate::error::Result;
use crate::grad::window::SharedStep;

/// Opens the stream anew for each epoch.
type Source<I> = Arc<dyn Fn() -> Box<dyn Iterator<Item = Result<I>>> + Send + Sync>;

/// Batches of a stream: `batch_size` items in the stream's order, the last batch partial unless `drop_last`.
/// Prepare it with [`Accelerator::prepare_stream`](crate::Accelerator::prepare_stream) to shard it between ranks.
///
/// ```
/// use burn::data::dataloader::batcher::Batcher;
/// use burn::tensor::{Device, Int, Tensor};
/// use burn_accelerate::Accelerator;
/// use burn_accelerate::data::StreamLoader;
///
/// struct Ids;
/// impl Batcher<i64, Tensor<1, Int>> for Ids {
///     fn batch(&self, items: Vec<i64>, device: &Device) -> Tensor<1, Int> {
///         Tensor::from_data(items.as_slice(), device)
///     }
/// }
///
/// // Every rank reads the whole stream (here 0..10) and keeps its share; gather_for_metrics gets it back whole.
/// let seen = burn_accelerate::launch(2, |acc| {
///     let stream = StreamLoader::new(Ids, 2, false, || (0..10i64).map(Ok));
///     let prepared = acc.prepare_stream(stream)?;
///     let mut seen = Vec::new();
///     for batch in prepared.iter() {
///         let ids = acc.gather_for_metrics(batch?)?.into_data().convert::<i64>();
///         seen.extend(ids.to_vec::<i64>().unwrap());
///     }
///     Ok(seen)
/// })?;
/// assert_eq!(seen[0], (0..10).collect::<Vec<_>>());
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
pub struct StreamLoader<I, O> {
    source: Source<I>,
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    drop_last: bool,
    dispatch: Option<Dispatcher<I>>,
}

impl<I: Clone + Serialize + DeserializeOwned + 'static, O> StreamLoader<I, O> {
    /// Accelerate's `dispatch_batches`: once prepared on several ranks, only the main process opens and reads
    /// the stream, and sends each round (every rank's batch of items) through the communicator, each rank
    /// keeping its slice: for a stream only the main process can read. The ranks get the items they would get
    /// reading the stream themselves.
    pub fn dispatch_batches(mut self, on: bool) -> Self {
        self.dispatch = on.then_some(dispatched::<I> as Dispatcher<I>);
        self
    }
}

impl<I: Clone + 'static, O> StreamLoader<I, O> {
    /// Batches of `batch_size` items of the stream `open` returns, called once per epoch. An `Err` item ends the
    /// epoch with that error (every rank reads the stream whole, so every rank meets it at the same batch).
    pub fn new<S, F>(
        batcher: impl Batcher<I, O> + 'static,
        batch_size: usize,
        drop_last: bool,
        open: F,
    ) -> Self
    where
        S: Iterator<Item = Result<I>> + 'static,
        F: Fn() -> S + Send + Sync + 'static,
    {
        Self {
            source: Arc::new(move || Box::new(open())),
            batcher: Arc::new(batcher),
            batch_size: batch_size.max(1),
            drop_last,
            dispatch: None,
        }
    }

    /// Items per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Whether a last partial chunk of the stream is dropped.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }
}

/// A [`StreamLoader`] prepared by the accelerator: each rank's batches of the stream, built on the accelerator's
/// device. `save_state` records its position (the epoch, and the batches of it used); after `load_state` the next
/// epoch reads the stream again from its start and skips the rounds already used, on any number of ranks with
/// the same global batch.
pub struct PreparedStreamLoader<I, O> {
    loader: StreamLoader<I, O>,
    spec: ShardSpec,
    device: Device,
    shared: SharedStep,
    group: Arc<ProcessGroup>,
    cursor: Arc<LoaderCursor>,
}

impl<I: Clone + 'static, O> PreparedStreamLoader<I, O> {
    pub(crate) fn new(
        loader: StreamLoader<I, O>,
        spec: ShardSpec,
        device: Device,
        shared: SharedStep,
        group: Arc<ProcessGroup>,
    ) -> Result<Self> {
        spec.validate(loader.batch_size)?;
        let fingerprint = LoaderFingerprint {
            // A stream's length is unknown: 0 stands for it, as for its batches per epoch.
            num_items: 0,
            batch_size: loader.batch_size,
            shuffle_seed: None,
            drop_last: loader.drop_last,
            batches_per_epoch: 0,
            num_processes: Some(spec.num_processes),
            total_batch_size: Some(if spec.split_batches {
                loader.batch_size
            } else {
                loader.batch_size * spec.num_processes
            }),
        };
        Ok(Self {
            loader,
            spec,
            device,
            shared,
            group,
            cursor: Arc::new(LoaderCursor::for_stream(fingerprint)),
        })
    }

    pub(crate) fn cursor(&self) -> Arc<LoaderCursor> {
        self.cursor.clone()
    }

    /// Items per batch on this rank.
    pub fn batch_size(&self) -> usize {
        if self.spec.split_batches {
            self.loader.batch_size / self.spec.num_processes
        } else {
            self.loader.batch_size
        }
    }

    /// Items of one chunk of the stream, over all ranks.
    fn chunk(&self) -> usize {
        self.batch_size() * self.spec.num_processes
    }

    /// One epoch of this rank's batches: the stream is opened again (and, after `load_state`, the rounds the
    /// saved run had used are read and skipped). While it runs, `gradient_state().end_of_dataloader` is true
    /// exactly on the last batch (read one batch ahead).
    pub fn iter(&self) -> PreparedStreamIter<'_, I, O> {
        let (_, skip) = self.cursor.begin_epoch();
        let progress = Progress::default();
        let (counter, slot) = (progress.read.clone(), progress.failed.clone());
        let open = move || -> Box<dyn Iterator<Item = I>> {
            Box::new((self.loader.source)().map_while(move |item| match item {
                Ok(item) => {
                    counter.set(counter.get() + 1);
                    Some(item)
                }
                Err(e) => {
                    *slot.borrow_mut() = Some(e);
                    None
                }
            }))
        };
        let (batch_size, drop_last) = (self.loader.batch_size, self.loader.drop_last);
        let shard: Box<dyn Iterator<Item = I>> = match self.loader.dispatch {
            Some(dispatch) if self.spec.num_processes > 1 => {
                // Only the main process opens the stream.
                let stream = self.group.is_main_process().then(open);
                dispatch(
                    stream,
                    self.group.clone(),
                    (batch_size, drop_last, self.spec),
                    progress.clone(),
                )
            }
            _ => Box::new(
                shard_stream(open(), batch_size, drop_last, self.spec)
                    .expect("the spec was validated when the loader was prepared"),
            ),
        };
        let mut iter = PreparedStreamIter {
            loader: self,
            shard,
            ahead: None,
            progress,
            finished: false,
        };
        // Every rank skips the same rounds (a dispatched stream's main process sends them all the same).
        for _ in 0..skip {
            match iter.take_batch() {
                Some(Ok(_)) => {}
                _ => break,
            }
        }
        iter.ahead = iter.take_batch();
        let empty = matches!(iter.ahead, None | Some(Err(_)));
        self.shared
            .lock()
            .state
            .begin_epoch(usize::from(!empty), None);
        iter
    }
}

/// The batches of one epoch of a [`PreparedStreamLoader`].
pub struct PreparedStreamIter<'a, I, O> {
    loader: &'a PreparedStreamLoader<I, O>,
    shard: Box<dyn Iterator<Item = I>>,
    /// The next batch's items, read one batch ahead to know which batch is the last.
    ahead: Option<Result<Vec<I>>>,
    /// Items read from the stream so far, and the error that ended it.
    progress: Progress,
    finished: bool,
}

impl<I: Clone + 'static, O> PreparedStreamIter<'_, I, O> {
    /// The items of this rank's next batch, or the stream's error.
    fn take_batch(&mut self) -> Option<Result<Vec<I>>> {
        let items: Vec<I> = self.shard.by_ref().take(self.loader.batch_size()).collect();
        if let Some(error) = self.progress.failed.borrow_mut().take() {
            return Some(Err(error));
        }
        (!items.is_empty()).then_some(Ok(items))
    }
}

impl<I: Clone + 'static, O> Iterator for PreparedStreamIter<'_, I, O> {
    type Item = Result<O>;

    fn next(&mut self) -> Option<Result<O>> {
        if self.finished {
            return None;
        }
        let current = self.ahead.take()?;
        let items = match current {
            Ok(items) => items,
            Err(error) => {
                self.finished = true;
                return Some(Err(error));
            }
        };
        self.ahead = self.take_batch();
        let last = self.ahead.is_none();
        self.loader
            .cursor
            .yielded
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if last {
            self.loader.cursor.end_epoch();
        }
        {
            let mut step = self.loader.shared.lock();
            step.state.batch_yielded(last);
            if last && !self.loader.loader.drop_last {
                // The real items of the last chunk, in rank order: what gather_for_metrics keeps of it.
                let chunk = self.loader.chunk();
                step.state
                    .set_remainder(Some(self.progress.read.get() % chunk));
            }
        }
        Some(Ok(self
            .loader
            .loader
            .batcher
            .batch(items, &self.loader.device)))
    }
}
