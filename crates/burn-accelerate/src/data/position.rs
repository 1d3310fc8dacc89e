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

/// What a checkpoint records of a prepared dataloader besides its position, so that a resume with another
/// dataset, batch size, seed or sharding is refused instead of silently continuing on other data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderFingerprint {
    /// Items in the dataset.
    pub num_items: usize,
    /// The loader's batch size.
    pub batch_size: usize,
    /// The shuffle seed (`None`: not shuffled).
    pub shuffle_seed: Option<u64>,
    /// Whether the last incomplete batch is dropped.
    pub drop_last: bool,
    /// Batches per epoch on this rank, after sharding.
    pub batches_per_epoch: usize,
    /// The number of ranks the loader was prepared for. Absent in older checkpoints.
    #[serde(default)]
    pub num_processes: Option<usize>,
    /// Items per optimizer step over all ranks, without accumulation (the global batch). Absent in older
    /// checkpoints.
    #[serde(default)]
    pub total_batch_size: Option<usize>,
}

impl LoaderFingerprint {
    /// What differs from `saved`, in words; empty when they match. On the same number of ranks every rank's
    /// loader must match its saved self; on another number only the global view must: the dataset, seed,
    /// `drop_last` and the items per step over all ranks, so that the saved position (the same batch index on
    /// every rank) points at the same next sample. A loader saved `at_epoch_start` (an evaluation loader, or a
    /// save between epochs) may change its global batch: the next sample is the epoch's first either way.
    pub(crate) fn differences(&self, saved: &Self, at_epoch_start: bool) -> Vec<String> {
        match (saved.num_processes, self.num_processes) {
            (Some(then), Some(now)) if then != now => {
                self.global_differences(saved, (then, now), at_epoch_start)
            }
            _ => self.rank_differences(saved),
        }
    }

    /// `(what, when saved, now)` of every value that must match on any number of ranks, and, with `per_rank`,
    /// of those that must match on the same number.
    fn compared(&self, saved: &Self, per_rank: bool) -> Vec<(&'static str, String, String)> {
        let mut pairs = vec![
            (
                "dataset length",
                saved.num_items.to_string(),
                self.num_items.to_string(),
            ),
            (
                "shuffle seed",
                format!("{:?}", saved.shuffle_seed),
                format!("{:?}", self.shuffle_seed),
            ),
            (
                "drop_last",
                saved.drop_last.to_string(),
                self.drop_last.to_string(),
            ),
        ];
        if per_rank {
            pairs.push((
                "batch size",
                saved.batch_size.to_string(),
                self.batch_size.to_string(),
            ));
            pairs.push((
                "batches per epoch on this rank",
                saved.batches_per_epoch.to_string(),
                self.batches_per_epoch.to_string(),
            ));
        }
        pairs
    }

    /// The values of [`compared`](Self::compared) that differ, in words.
    fn mismatches(&self, saved: &Self, per_rank: bool) -> Vec<String> {
        self.compared(saved, per_rank)
            .into_iter()
            .filter(|(_, then, now)| then != now)
            .map(|(what, then, now)| format!("{what} {then} when saved, {now} now"))
            .collect()
    }

    fn global_differences(
        &self,
        saved: &Self,
        (then, now): (usize, usize),
        at_epoch_start: bool,
    ) -> Vec<String> {
        let mut out = self.mismatches(saved, false);
        match (saved.total_batch_size, self.total_batch_size) {
            (Some(global), Some(here)) if global != here && at_epoch_start => log::info!(
                "a prepared dataloader saved at the start of an epoch continues with {here} items per step over \
                 all ranks ({global} when saved on {then} rank(s))"
            ),
            (Some(global), Some(here)) if global != here => {
                let fix = if global.is_multiple_of(now) {
                    format!(
                        "give each of the {now} ranks {} items a batch (or prepare the loader with batch size \
                         {global} and split_batches)",
                        global / now
                    )
                } else {
                    format!(
                        "{global} items do not divide among {now} ranks: resume on a number of ranks that \
                         divides {global}"
                    )
                };
                out.push(format!(
                    "items per step over all ranks {global} when saved on {then} rank(s), {here} now on {now}: \
                     saved in the middle of an epoch, the position would point at other samples (and each step \
                     would average another batch); {fix}"
                ));
            }
            (None, _) | (_, None) => out.push(format!(
                "the checkpoint does not record the items per step over all ranks (saved by an older version): \
                 resume it on the {then} rank(s) that saved it"
            )),
            _ => {}
        }
        out
    }

    fn rank_differences(&self, saved: &Self) -> Vec<String> {
        self.mismatches(saved, true)
    }
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
    /// Batches per epoch on this rank ([`usize::MAX`] for a stream, whose length is known only at its end).
    pub(super) len: usize,
    /// The loader's dataset, batch size, seed and sharding.
    pub(super) fingerprint: LoaderFingerprint,
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

    /// A cursor for a stream: its own epoch counter, no known length.
    pub(super) fn for_stream(fingerprint: LoaderFingerprint) -> Self {
        Self {
            epoch: Arc::new(AtomicUsize::new(0)),
            in_epoch: AtomicUsize::new(0),
            yielded: AtomicUsize::new(0),
            skip: AtomicUsize::new(0),
            len: usize::MAX,
            fingerprint,
        }
    }

    /// Starts the next epoch: returns it and the batches to skip at its start (a restored position).
    pub(super) fn begin_epoch(&self) -> (usize, usize) {
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed);
        let skip = self.skip.swap(0, Ordering::Relaxed);
        self.in_epoch.store(epoch + 1, Ordering::Relaxed);
        self.yielded.store(skip, Ordering::Relaxed);
        (epoch, skip)
    }

    /// The epoch of a stream ended: the position is the next epoch's start.
    pub(super) fn end_epoch(&self) {
        self.yielded.store(self.len, Ordering::Relaxed);
    }

    /// Whether the number of batches per epoch is known (not a stream).
    pub(crate) fn has_length(&self) -> bool {
        self.len != usize::MAX
    }

    /// The loader's dataset, batch size, seed and sharding.
    pub(crate) fn fingerprint(&self) -> &LoaderFingerprint {
        &self.fingerprint
    }

    /// Makes the next `iter` run `position.epoch`, starting after `position.batch` batches.
    pub(crate) fn restore(&self, position: DataPosition) {
        self.epoch.store(position.epoch, Ordering::Relaxed);
        self.skip.store(position.batch, Ordering::Relaxed);
        self.in_epoch.store(0, Ordering::Relaxed);
        self.yielded.store(0, Ordering::Relaxed);
    }
}
