//! `load_state`: a checkpoint folder read back, its parts restored into the training loop's objects in the
//! order they were saved.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::store::ModuleRecord;

use super::fs::{read, with_suffix};
use super::manifest::{FORMAT, MANIFEST, Manifest, RankState, file, model_stem, optimizer_stem};
use super::repartition;
use crate::data::DataPosition;
use crate::distributed::strategy::{StateScope, Strategy};
use crate::error::{Error, Result};
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler};
use crate::precision::LossScaler;

/// A checkpoint read back by `load_state`: restore its parts into the training loop's objects, in the order
/// they were saved, then call [`finish`](Self::finish) to check that nothing was left out.
#[derive(Debug)]
pub struct LoadedState {
    dir: PathBuf,
    manifest: Manifest,
    rank: RankState,
    objects: BTreeMap<String, serde_json::Value>,
    rank_index: usize,
    /// The number of ranks loading it (the manifest says how many saved it).
    num_processes: usize,
    next_model: usize,
    next_optimizer: usize,
    next_scheduler: usize,
    /// Told when a restored model's parameters take the saved ids (a sharded strategy keys what it knows of
    /// each parameter by id).
    strategy: Option<std::sync::Arc<dyn crate::distributed::strategy::Strategy>>,
}

fn corrupt(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Runs a Burn call on the bytes of `path`: some malformed records make Burn panic (an `expect` on a field)
/// rather than return an error; that panic becomes an error naming the file.
fn guarded<T>(path: &Path, what: &str, call: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).map_err(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        corrupt(
            path,
            format!("Burn could not read this {what} record (corrupt, or from another program): {message}"),
        )
    })
}

/// Finds the folder to load: `dir` itself, or the previous checkpoint moved aside by a save interrupted
/// between its two renames.
pub(crate) fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(MANIFEST).exists() {
        return Ok(dir.to_path_buf());
    }
    let old = with_suffix(dir, ".old");
    if old.join(MANIFEST).exists() {
        log::warn!(
            "{} is missing or incomplete; loading {}, the checkpoint a save was replacing when it stopped",
            dir.display(),
            old.display()
        );
        return Ok(old);
    }
    Err(corrupt(
        dir,
        format!("no {MANIFEST} here: not a checkpoint, or a save that did not finish"),
    ))
}

impl LoadedState {
    pub(crate) fn open(dir: &Path, rank_index: usize, num_processes: usize) -> Result<Self> {
        let dir = resolve(dir)?;
        let manifest_path = dir.join(MANIFEST);
        let manifest: Manifest = serde_json::from_slice(&read(&manifest_path)?)
            .map_err(|e| corrupt(&manifest_path, format!("unreadable: {e}")))?;
        if manifest.format != FORMAT {
            return Err(corrupt(
                &manifest_path,
                format!("format `{}`, expected `{FORMAT}`", manifest.format),
            ));
        }
        // The same number of ranks: each reads its own file. Another number: every rank reads rank 0's, whose
        // positions and step counts are the run's (the global batch is the same, so the positions are too:
        // `Checkpointer::restore_positions` checks it).
        let saved_rank = if manifest.num_processes == num_processes {
            rank_index
        } else {
            0
        };
        let rank_path = dir.join(format!("rank_{saved_rank}.json"));
        let rank: RankState = serde_json::from_slice(&read(&rank_path)?)
            .map_err(|e| corrupt(&rank_path, format!("unreadable: {e}")))?;
        let objects_path = dir.join("objects.json");
        let objects = serde_json::from_slice(&read(&objects_path)?)
            .map_err(|e| corrupt(&objects_path, format!("unreadable: {e}")))?;
        Ok(Self {
            dir,
            manifest,
            rank,
            objects,
            rank_index,
            num_processes,
            next_model: 0,
            next_optimizer: 0,
            next_scheduler: 0,
            strategy: None,
        })
    }

    /// The folder the state was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The automatic-naming iteration the checkpoint was saved at.
    pub fn iteration(&self) -> usize {
        self.manifest.iteration
    }

    pub(crate) fn scaler(&self) -> Option<&LossScaler> {
        self.manifest.scaler.as_ref()
    }

    /// The prepared dataloaders this rank had when saving (empty for older checkpoints).
    pub(crate) fn loader_fingerprints(&self) -> &[crate::data::LoaderFingerprint] {
        &self.rank.loaders
    }

    pub(crate) fn positions(&self) -> &[DataPosition] {
        &self.rank.dataloaders
    }

    pub(crate) fn take_object(&mut self, name: &str) -> Option<serde_json::Value> {
        self.objects.remove(name)
    }

    pub(crate) fn remaining_objects(&self) -> Vec<String> {
        self.objects.keys().cloned().collect()
    }

    /// The number of ranks that saved this state.
    pub fn saved_num_processes(&self) -> usize {
        self.manifest.num_processes
    }

    /// Moves the cursor `next` of the parts of `kind` (`model`, `optimizer`, `scheduler`), of which `saved` were
    /// saved, to the next one; returns its index.
    fn advance(dir: &Path, kind: &str, saved: usize, next: &mut usize) -> Result<usize> {
        let i = *next;
        if i >= saved {
            return Err(corrupt(
                dir,
                format!("holds {saved} {kind}(s); asked for {kind} #{}", i + 1),
            ));
        }
        *next += 1;
        Ok(i)
    }

    /// The bytes of the record file `path`, checked against the CRC-32C the save recorded for it (in
    /// `checksums`, by file name; files without one are read unchecked).
    fn checked(
        path: &Path,
        checksums: &std::collections::BTreeMap<String, u32>,
    ) -> Result<burn::tensor::Bytes> {
        let bytes = read(path)?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(expected) = name.and_then(|n| checksums.get(&n)) {
            let actual = crc32c::crc32c(&bytes);
            if actual != *expected {
                return Err(corrupt(
                    path,
                    format!(
                        "its CRC-32C is {actual:#010x}, but the save recorded {expected:#010x}: the file changed \
                         after it was written (a damaged disk or an incomplete copy); restore the file or load \
                         an earlier checkpoint"
                    ),
                ));
            }
        }
        Ok(burn::tensor::Bytes::from_bytes_vec(bytes))
    }

    /// The bytes of the next saved part of `kind` (`model`, `optimizer`, `scheduler`), whose count and cursor
    /// are `saved` and `next`, checked against the CRC-32C the save recorded for it; returns its index, file and
    /// bytes.
    fn next_part(
        dir: &Path,
        kind: &str,
        (saved, checksums): (usize, &std::collections::BTreeMap<String, u32>),
        next: &mut usize,
    ) -> Result<(usize, PathBuf, burn::tensor::Bytes)> {
        let i = Self::advance(dir, kind, saved, next)?;
        let path = file(dir, kind, i, "bpk");
        let bytes = Self::checked(&path, checksums)?;
        Ok((i, path, bytes))
    }

    /// Whether this rank holds the state the strategy scope `now` says it does in the layout the checkpoint was
    /// saved in (`per_rank`): the same files on the same number of ranks. Otherwise its part is re-cut from
    /// every saved file.
    fn same_layout(&self, per_rank: bool, now: Option<StateScope>) -> bool {
        let wants_per_rank = now == Some(StateScope::PerRank);
        per_rank == wants_per_rank
            && (!per_rank
                || (self.manifest.num_processes == self.num_processes && self.same_splits()))
    }

    /// Whether the strategy splits the parameters as the saved run did (the same shapes, parts and owners,
    /// whatever the ids): each rank's saved file holds exactly its part then.
    fn same_splits(&self) -> bool {
        let mut saved: Vec<_> = self
            .manifest
            .splits
            .iter()
            .map(repartition::SavedSplit::layout)
            .collect();
        let mut now: Vec<_> = self
            .strategy
            .as_ref()
            .map(|s| s.splits())
            .unwrap_or_default()
            .iter()
            .map(|(id, split)| repartition::SavedSplit::of(*id, split).layout())
            .collect();
        saved.sort();
        now.sort();
        saved == now
    }

    /// What this rank holds of parameter `id` under the strategy: its part where it holds parts of what `scope`
    /// says (the model's parameters, the optimizer's state) per rank, else the whole.
    fn want(
        &self,
        scope: fn(&dyn Strategy) -> StateScope,
    ) -> impl Fn(burn::module::ParamId) -> repartition::Want + 'static {
        let strategy = self
            .strategy
            .clone()
            .filter(|s| scope(s.as_ref()) == StateScope::PerRank);
        move |id| match strategy.as_ref().and_then(|s| s.split(id)) {
            Some((split, q)) => repartition::Want::Part(split, q),
            None => repartition::Want::Whole,
        }
    }

    /// The files saved for part `i` of `stem` (`model`, `optimizer`): one per saving rank when `per_rank`, else
    /// the one; each read and checked in turn.
    fn saved_files(
        &self,
        stem: fn(bool, usize) -> String,
        per_rank: bool,
        i: usize,
    ) -> impl Iterator<Item = Result<repartition::Source>> + '_ {
        let ranks = if per_rank {
            self.manifest.num_processes
        } else {
            1
        };
        (0..ranks).map(move |r| {
            let path = file(&self.dir, &stem(per_rank, r), i, "bpk");
            let bytes = Self::checked(&path, &self.manifest.checksums)?;
            Ok((r, path, bytes))
        })
    }

    /// Restores the next saved model into `model` (same architecture), with the saved parameter ids. A state
    /// saved by another number of ranks, or under a strategy that keeps the model otherwise (`FULL_SHARD` keeps
    /// one record per rank), is re-cut: this rank takes each parameter it holds from the file that holds it.
    pub fn model<M: Module>(&mut self, model: M) -> Result<M> {
        let now = self.strategy.as_ref().map(|s| s.model_state());
        let (path, record) = if self.same_layout(self.manifest.model_per_rank, now) {
            self.next_model_record()?
        } else {
            let i = Self::advance(
                &self.dir,
                "model",
                self.manifest.models,
                &mut self.next_model,
            )?;
            let sources = self.saved_files(model_stem, self.manifest.model_per_rank, i);
            let saved = repartition::SavedSplits::new(&self.manifest.splits);
            let want = self.want(|s| s.model_state());
            let bytes = repartition::model_bytes(sources, &model, &saved, want)?;
            let path = file(
                &self.dir,
                &model_stem(self.manifest.model_per_rank, 0),
                i,
                "bpk",
            );
            let record = guarded(&path, "model", || ModuleRecord::from_bytes(bytes))?
                .map_err(|e| corrupt(&path, format!("not a model record: {e}")))?;
            (path, record)
        };
        let before = crate::grad::param_ids(&model);
        let model = guarded(&path, "model", move || model.try_load_record(record))?
            .map_err(|e| corrupt(&path, format!("does not fit the model: {e}")))?;
        if let Some(strategy) = &self.strategy {
            let after = crate::grad::param_ids(&model);
            let renamed: Vec<_> = before
                .into_iter()
                .zip(after)
                .filter(|(a, b)| a != b)
                .collect();
            strategy.params_renamed(&renamed);
        }
        Ok(model)
    }

    /// The strategy told of restored models' parameter ids.
    pub(crate) fn with_strategy(
        mut self,
        strategy: std::sync::Arc<dyn crate::distributed::strategy::Strategy>,
    ) -> Self {
        self.strategy = Some(strategy);
        self
    }

    /// Restores the next saved optimizer state into `optimizer`. A state saved from another kind of
    /// optimizer, or for another model, is refused rather than dropped.
    pub fn optimizer(&mut self, optimizer: &mut AcceleratedOptimizer) -> Result<()> {
        let (i, path, record, steps) = self.next_optimizer_record()?;
        if let (Some(Some(saved)), Some(now)) =
            (self.manifest.optimizer_kinds.get(i), optimizer.kind())
            && saved != now
        {
            return Err(corrupt(
                &path,
                format!(
                    "holds the state of a `{saved}` optimizer, but the prepared optimizer is a `{now}`; resume \
                     with the optimizer the run was saved with"
                ),
            ));
        }
        let (held, taken) = guarded(&path, "optimizer", || optimizer.restore(record, steps))?;
        if taken != held {
            return Err(corrupt(
                &path,
                format!(
                    "holds {held} optimizer state tensor(s), of which this optimizer could restore {taken}: it \
                     was saved by another kind of optimizer or for another model"
                ),
            ));
        }
        Ok(())
    }

    /// Restores the next saved scheduler state into `scheduler` (and its optimizer's learning rate).
    pub fn scheduler(&mut self, scheduler: &mut AcceleratedScheduler) -> Result<()> {
        let (path, record) = self.next_scheduler_record()?;
        guarded(&path, "scheduler", || scheduler.restore(record))
    }

    /// The next model, optimizer (with its step count) and scheduler as Burn records, for burn-train's Learner.
    #[cfg(feature = "train")]
    pub(crate) fn records(
        &mut self,
    ) -> Result<(
        ModuleRecord,
        (burn::optim::OptimizerRecord, u64),
        burn::lr_scheduler::LrSchedulerRecord,
    )> {
        let now = self.strategy.as_ref().map(|s| s.model_state());
        if !self.same_layout(self.manifest.model_per_rank, now) {
            return Err(corrupt(
                &self.dir,
                format!(
                    "holds one model record per rank (saved under FULL_SHARD by {} ranks), which the Learner \
                     cannot load; load it in a training loop (`load_state` then `LoadedState::model`), or merge \
                     it with `burn-accelerate merge-weights`",
                    self.manifest.num_processes
                ),
            ));
        }
        let (_, model) = self.next_model_record()?;
        let (_, _, optimizer, steps) = self.next_optimizer_record()?;
        let (_, scheduler) = self.next_scheduler_record()?;
        Ok((model, (optimizer, steps), scheduler))
    }

    /// The next saved model's record, and its file.
    fn next_model_record(&mut self) -> Result<(PathBuf, ModuleRecord)> {
        let stem = model_stem(self.manifest.model_per_rank, self.rank_index);
        let (_, path, bytes) = Self::next_part(
            &self.dir,
            &stem,
            (self.manifest.models, &self.manifest.checksums),
            &mut self.next_model,
        )?;
        let record = guarded(&path, "model", || ModuleRecord::from_bytes(bytes))?.map_err(|e| {
            corrupt(
                &path,
                format!("not a model record (truncated or corrupt?): {e}"),
            )
        })?;
        Ok((path, record))
    }

    /// The next saved optimizer's index, file, record and step count. A state saved by another number of
    /// ranks, or under a strategy that partitions it otherwise, is re-cut: this rank reads every saved slice in
    /// turn and keeps the state of the parameters it steps.
    fn next_optimizer_record(
        &mut self,
    ) -> Result<(usize, PathBuf, burn::optim::OptimizerRecord, u64)> {
        let per_rank = self.manifest.optimizer_per_rank;
        let now = self.strategy.as_ref().map(|s| s.optimizer_state());
        let (i, path, bytes) = if self.same_layout(per_rank, now) {
            let stem = optimizer_stem(per_rank, self.rank_index);
            Self::next_part(
                &self.dir,
                &stem,
                (self.manifest.optimizers, &self.manifest.checksums),
                &mut self.next_optimizer,
            )?
        } else {
            let i = Self::advance(
                &self.dir,
                "optimizer",
                self.manifest.optimizers,
                &mut self.next_optimizer,
            )?;
            let saved = repartition::SavedSplits::new(&self.manifest.splits);
            let bytes = repartition::optimizer_bytes(
                self.saved_files(optimizer_stem, per_rank, i),
                &saved,
                self.want(|s| s.optimizer_state()),
            )?;
            (
                i,
                file(&self.dir, &optimizer_stem(per_rank, 0), i, "bpk"),
                bytes,
            )
        };
        let record = guarded(&path, "optimizer", || {
            burn::optim::OptimizerRecord::from_bytes(bytes)
        })?
        .map_err(|e| {
            corrupt(
                &path,
                format!("not an optimizer record (truncated or corrupt?): {e}"),
            )
        })?;
        let steps = self.rank.optimizer_steps.get(i).copied().unwrap_or(0);
        Ok((i, path, record, steps))
    }

    /// The next saved scheduler's record, and its file.
    fn next_scheduler_record(
        &mut self,
    ) -> Result<(PathBuf, burn::lr_scheduler::LrSchedulerRecord)> {
        let (_, path, bytes) = Self::next_part(
            &self.dir,
            "scheduler",
            (self.manifest.schedulers, &self.manifest.checksums),
            &mut self.next_scheduler,
        )?;
        let record = guarded(&path, "scheduler", || {
            burn::lr_scheduler::LrSchedulerRecord::from_bytes(bytes)
        })?
        .map_err(|e| {
            corrupt(
                &path,
                format!("not a scheduler record (truncated or corrupt?): {e}"),
            )
        })?;
        Ok((path, record))
    }

    /// Checks that every saved model, optimizer and scheduler was restored.
    pub fn finish(self) -> Result<()> {
        let left = [
            ("model", self.manifest.models, self.next_model),
            ("optimizer", self.manifest.optimizers, self.next_optimizer),
            ("scheduler", self.manifest.schedulers, self.next_scheduler),
        ];
        for (what, saved, restored) in left {
            if restored != saved {
                return Err(corrupt(
                    &self.dir,
                    format!(
                        "holds {saved} {what}(s) but {restored} were restored; restore them all, in order"
                    ),
                ));
            }
        }
        Ok(())
    }
}
