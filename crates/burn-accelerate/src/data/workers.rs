//! Worker threads that build a loader's batches ahead of the training loop: each worker takes the next batch
//! of the epoch's list, loads its items and runs the batcher (on the batches' device, so a GPU backend's upload
//! happens off the training thread too), and the loop receives the batches in the list's order, whatever order
//! the workers finish in. At most `num_workers × prefetch` batches are built ahead of the one the loop asks for.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use burn::tensor::Device;

use crate::error::{Error, Result};

/// How many batches ahead the workers may build: `prefetch` per worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkerSettings {
    /// Threads building batches (0: the loop builds each batch itself).
    pub num_workers: usize,
    /// Batches each worker may have ready ahead of the loop (at least 1).
    pub prefetch: usize,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            num_workers: 0,
            prefetch: 2,
        }
    }
}

/// Builds the batch of the given item indices on the given device: the loader's dataset and batcher.
pub(crate) type BuildBatch<O> = Arc<dyn Fn(&[usize], &Device) -> Result<O> + Send + Sync>;

/// Which batches the workers may take, shared with them.
struct Schedule {
    /// The next batch a worker takes.
    next: usize,
    /// Batches the loop has received.
    consumed: usize,
    /// Set when the loop stops listening (the iterator was dropped).
    stopped: bool,
}

struct Shared {
    schedule: Mutex<Schedule>,
    changed: Condvar,
    batches: Vec<Vec<usize>>,
    /// Batches that may be built ahead of the loop.
    window: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next batch to build, waiting while the workers are a full window ahead; `None` once every batch was
    /// taken or the loop stopped.
    fn take(&self) -> Option<usize> {
        let mut schedule = self.lock();
        loop {
            if schedule.stopped || schedule.next >= self.batches.len() {
                return None;
            }
            if schedule.next < schedule.consumed + self.window {
                schedule.next += 1;
                return Some(schedule.next - 1);
            }
            schedule = self
                .changed
                .wait(schedule)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// One epoch's batches, built by worker threads and handed out in order.
pub(crate) struct Prefetcher<O> {
    shared: Arc<Shared>,
    received: Receiver<(usize, Result<O>)>,
    ready: BTreeMap<usize, Result<O>>,
    handles: Vec<JoinHandle<()>>,
}

impl<O: Send + 'static> Prefetcher<O> {
    /// Starts `settings.num_workers` threads building `batches` with `build` on `device`.
    pub(crate) fn start(
        batches: Vec<Vec<usize>>,
        build: BuildBatch<O>,
        device: Device,
        settings: WorkerSettings,
    ) -> Self {
        let workers = settings.num_workers.max(1);
        let shared = Arc::new(Shared {
            schedule: Mutex::new(Schedule {
                next: 0,
                consumed: 0,
                stopped: false,
            }),
            changed: Condvar::new(),
            window: workers * settings.prefetch.max(1),
            batches,
        });
        let (send, received) = channel();
        let mut handles = Vec::with_capacity(workers);
        for i in 0..workers.min(shared.batches.len()) {
            let (shared, build, device, send) =
                (shared.clone(), build.clone(), device.clone(), send.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("loader-worker-{i}"))
                .spawn(move || work(&shared, &build, &device, &send));
            match spawned {
                Ok(handle) => handles.push(handle),
                // Fewer workers still build every batch; none at all is reported by `next`.
                Err(e) => crate::notice::warn_visibly(&format!(
                    "could not start dataloader worker {i} ({e}): fewer workers build the batches"
                )),
            }
        }
        Self {
            shared,
            received,
            ready: BTreeMap::new(),
            handles,
        }
    }
}

/// A worker: builds the batches it takes until none is left or the loop stops listening.
fn work<O>(
    shared: &Shared,
    build: &BuildBatch<O>,
    device: &Device,
    send: &Sender<(usize, Result<O>)>,
) {
    while let Some(k) = shared.take() {
        let indices = &shared.batches[k];
        let batch = catch_unwind(AssertUnwindSafe(|| build(indices, device))).unwrap_or_else(
            |payload| {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".into());
                Err(Error::Dataset {
                    index: indices.first().copied().unwrap_or(0),
                    reason: format!(
                        "a dataloader worker panicked building the batch of items {indices:?}: {message}"
                    ),
                })
            },
        );
        if send.send((k, batch)).is_err() {
            return;
        }
    }
}

impl<O> Prefetcher<O> {
    /// Batches not handed out yet.
    pub(crate) fn remaining(&self) -> usize {
        self.shared.batches.len() - self.shared.lock().consumed
    }

    /// The next batch in the epoch's order, waiting for the worker building it.
    pub(crate) fn next_batch(&mut self) -> Option<Result<O>> {
        let k = self.shared.lock().consumed;
        if k >= self.shared.batches.len() {
            return None;
        }
        let batch = loop {
            if let Some(batch) = self.ready.remove(&k) {
                break batch;
            }
            match self.received.recv() {
                Ok((i, batch)) => {
                    self.ready.insert(i, batch);
                }
                Err(_) => {
                    break Err(Error::Dataset {
                        index: self.shared.batches[k].first().copied().unwrap_or(0),
                        reason: "every dataloader worker stopped before building this batch (none could be \
                                 started?)"
                            .into(),
                    });
                }
            }
        };
        self.shared.lock().consumed = k + 1;
        self.shared.changed.notify_all();
        Some(batch)
    }
}

impl<O> Drop for Prefetcher<O> {
    /// Stops the workers: each finishes the batch in hand and exits.
    fn drop(&mut self) {
        self.shared.lock().stopped = true;
        self.shared.changed.notify_all();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}
