//! `load_state`: a checkpoint folder read back, its parts restored into the training loop's objects in the
//! order they were saved.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::store::ModuleRecord;

use super::manifest::{FORMAT, MANIFEST, Manifest, RankState, file, model_stem, optimizer_stem};
use super::repartition;
use crate::data::DataPosition;
use crate::distributed::strategy::{StateScope, Strategy};
use crate::error::{Error, Result};
use crate::fs::{read, with_suffix};
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
    /// Whether the loading run is pipelined (`pp_size` > 1).
    pipelined: bool,
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

/// An optimizer record, and the file its tensors are read from as they are used (none: read in already).
type Backed = (burn::optim::OptimizerRecord, Option<crate::fs::Scratch>);

/// One parameter's state out of the optimizer record in the file at `path` (its tensors, scalars and module path,
/// the first parameter's with tensors), as a record of its own, and its number of tensors; `None` for a record
/// without tensors (an optimizer with no state).
fn sample_of(path: &Path) -> Result<Option<(burn::optim::OptimizerRecord, usize)>> {
    let unreadable =
        |e: burn_pack::Error| corrupt(path, format!("unreadable optimizer record: {e}"));
    let reader = burn_pack::Reader::from_file_exact(path).map_err(unreadable)?;
    let scalars = reader.scalars().clone();
    let metadata = reader.metadata().clone();
    let tensors = reader.into_tensors().map_err(unreadable)?;
    let Some(id) = tensors.iter().find_map(|t| t.param_id) else {
        return Ok(None);
    };
    let mut sample = Vec::new();
    for tensor in tensors.into_iter().filter(|t| t.param_id == Some(id)) {
        let bytes = tensor.to_bytes().map_err(unreadable)?;
        sample.push(burn_pack::Tensor::new(
            tensor.name.clone(),
            tensor.dtype,
            tensor.shape.clone(),
            Some(id),
            bytes,
        ));
    }
    let held = sample.len();
    let prefix = format!("{id}.");
    let mut writer = burn_pack::Writer::new(sample);
    for (key, value) in scalars.iter().filter(|(k, _)| k.starts_with(&prefix)) {
        writer = writer.with_scalar(key, *value);
    }
    if let Some(module_path) = metadata.get(&id.to_string()) {
        writer = writer.with_metadata(&id.to_string(), module_path);
    }
    let bytes = writer.into_bytes().map_err(unreadable)?;
    let record = guarded(path, "optimizer", || {
        burn::optim::OptimizerRecord::from_bytes(bytes)
    })?
    .map_err(|e| corrupt(path, format!("not an optimizer record: {e}")))?;
    Ok(Some((record, held)))
}

/// When a record's tensors are read from its file.
#[derive(Debug, Clone, Copy)]
enum Reading {
    /// As they are restored, one at a time (the file must outlive the restore).
    AsUsed,
    /// Into memory now, whole.
    Now,
}

/// The file at `path` in memory, as Burn's record readers take it.
fn read_bytes(path: &Path) -> std::result::Result<burn::tensor::Bytes, burn::store::RecordError> {
    std::fs::read(path)
        .map(burn::tensor::Bytes::from_bytes_vec)
        .map_err(|e| burn::store::RecordError::Io(format!("{}: {e}", path.display())))
}

/// The optimizer record in the file at `path`, read as `reading` says.
fn optimizer_record(path: &Path, reading: Reading) -> Result<burn::optim::OptimizerRecord> {
    guarded(path, "optimizer", || match reading {
        Reading::AsUsed => burn::optim::OptimizerRecord::load(path),
        Reading::Now => read_bytes(path).and_then(burn::optim::OptimizerRecord::from_bytes),
    })?
    .map_err(|e| {
        corrupt(
            path,
            format!("not an optimizer record (truncated or corrupt?): {e}"),
        )
    })
}

/// The model record in the file at `path`, read as `reading` says.
fn model_record(path: &Path, reading: Reading) -> Result<ModuleRecord> {
    guarded(path, "model", || match reading {
        Reading::AsUsed => ModuleRecord::load(path),
        Reading::Now => read_bytes(path).and_then(ModuleRecord::from_bytes),
    })?
    .map_err(|e| {
        corrupt(
            path,
            format!("not a model record (truncated or corrupt?): {e}"),
        )
    })
}

/// Reads in every parameter of `model` that a record left backed by its file: a CPU backend adopts a record's
/// bytes as they are, and a record read from a file reads each tensor only when first used. A restored model
/// must not depend on the checkpoint's files (a later save may remove them, and a re-cut record's scratch file
/// goes with the state), so each parameter is read now, one at a time.
fn read_in<M: Module>(model: &M) {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::{Bool, Int, Tensor};
    fn touch<const D: usize, K: burn::tensor::kind::Basic>(tensor: Tensor<D, K>) {
        let n = tensor.shape().num_elements();
        if n > 0 {
            // One element copied out: the tensor's whole buffer is read in, where it stays.
            let _ = tensor.reshape([n]).slice(0..1).into_data();
        } else {
            // An empty placeholder (another pipeline stage's parameter) still names its file: read in too.
            let _ = tensor.into_data();
        }
    }
    struct ReadIn;
    impl ModuleVisitor for ReadIn {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_autodiff() {
                touch(value.inner());
            } else {
                touch(value);
            }
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            touch(param.val());
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            touch(param.val());
        }
    }
    model.visit(&mut ReadIn);
}

/// Finds the folder to load: `dir` itself, or the previous checkpoint moved aside by a save interrupted
/// between its two renames.
pub(crate) fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(MANIFEST).exists() {
        return Ok(dir.to_path_buf());
    }
    let old = with_suffix(dir, ".old");
    if old.join(MANIFEST).exists() {
        crate::notice::warn_visibly(&format!(
            "{} is missing or incomplete; loading {}, the checkpoint a save was replacing when it stopped",
            dir.display(),
            old.display()
        ));
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
            pipelined: false,
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

    /// The saving run's pipeline stages, where it was pipelined (and recorded them).
    pub(crate) fn saved_pp_size(&self) -> Option<usize> {
        self.manifest.pp_size
    }

    /// Whether the saving run split parameters over its ranks (a sharded strategy).
    pub(crate) fn saved_split(&self) -> bool {
        !self.manifest.splits.is_empty()
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

    /// Checks the record file `path` against the CRC-32C the save recorded for it (in `checksums`, by file
    /// name; files without one are not read here), reading it a megabyte at a time: its records are then read
    /// from the file tensor by tensor, as they are restored.
    fn checked(path: &Path, checksums: &std::collections::BTreeMap<String, u32>) -> Result<()> {
        if !path.is_file() {
            return Err(corrupt(path, "missing: the checkpoint is incomplete"));
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(expected) = name.and_then(|n| checksums.get(&n)) {
            let actual = crate::fs::file_crc32c(path)?;
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
        Ok(())
    }

    /// The next saved part of `kind` (`model`, `optimizer`, `scheduler`), whose count and cursor are `saved` and
    /// `next`, checked against the CRC-32C the save recorded for it; returns its index and file.
    fn next_part(
        dir: &Path,
        kind: &str,
        (saved, checksums): (usize, &std::collections::BTreeMap<String, u32>),
        next: &mut usize,
    ) -> Result<(usize, PathBuf)> {
        let i = Self::advance(dir, kind, saved, next)?;
        let path = file(dir, kind, i, "bpk");
        Self::checked(&path, checksums)?;
        Ok((i, path))
    }

    /// Whether this rank holds the state the strategy scope `now` says it does in the layout the checkpoint was
    /// saved in (`per_rank`): the same files on the same number of ranks. Otherwise its part is re-cut from
    /// every saved file.
    fn same_layout(&self, per_rank: bool, now: Option<StateScope>) -> bool {
        let wants_per_rank = now == Some(StateScope::PerRank);
        // A pipeline whose stages keep their parameters whole drops what other stages train to placeholders, which
        // a fresh model holds whole until its first step: always re-cut, each parameter taken from a file that
        // holds it (never a placeholder, never a stale copy).
        let pipelined = self
            .strategy
            .as_ref()
            .is_some_and(|s| self.pipelined && s.slicings().is_empty());
        !pipelined
            && per_rank == wants_per_rank
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
            .map(|s| s.checkpoint_slicings())
            .unwrap_or_default()
            .iter()
            .map(|(id, cut)| repartition::SavedSplit::of(*id, cut).layout())
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
        move |id| match strategy.as_ref().and_then(|s| s.checkpoint_slicing(id)) {
            // A split of nothing: a sharded pipeline stage's placeholder for another stage's parameter.
            Some(cut) if cut.split.dims().iter().product::<usize>() == 0 => {
                repartition::Want::Placeholder(cut.split.dims().to_vec())
            }
            Some(cut) => repartition::Want::Part(cut),
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
            Self::checked(&path, &self.manifest.checksums)?;
            Ok((r, path))
        })
    }

    /// Restores the next saved model into `model` (same architecture), with the saved parameter ids. A state
    /// saved by another number of ranks, or under a strategy that keeps the model otherwise (`FULL_SHARD` keeps
    /// one record per rank), is re-cut: this rank takes each parameter it holds from the file that holds it.
    pub fn model<M: Module>(&mut self, model: M) -> Result<M> {
        let now = self.strategy.as_ref().map(|s| s.model_state());
        let (path, record) = if self.same_layout(self.manifest.model_per_rank, now) {
            let (path, record) = self.next_model_record(Reading::AsUsed)?;
            (path, (record, None))
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
            let scratch = repartition::model_record(sources, &model, &saved, want, &self.dir)?;
            let path = file(
                &self.dir,
                &model_stem(self.manifest.model_per_rank, 0),
                i,
                "bpk",
            );
            let record = model_record(scratch.path(), Reading::AsUsed)?;
            (path, (record, Some(scratch)))
        };
        // A re-cut record is read from its scratch file, kept until every parameter has been read in.
        let (record, _scratch) = record;
        let before = crate::grad::param_ids(&model);
        let model = guarded(&path, "model", move || model.try_load_record(record))?
            .map_err(|e| corrupt(&path, format!("does not fit the model: {e}")))?;
        guarded(&path, "model", || read_in(&model))?;
        if let Some(strategy) = &self.strategy {
            crate::distributed::strategy::note_restored_ids(strategy.as_ref(), before, &model);
        }
        crate::heap::release_free_heap();
        Ok(model)
    }

    /// The strategy told of restored models' parameter ids, and whether it trains a pipeline stage.
    pub(crate) fn with_strategy(
        mut self,
        strategy: std::sync::Arc<dyn crate::distributed::strategy::Strategy>,
        pipelined: bool,
    ) -> Self {
        self.strategy = Some(strategy);
        self.pipelined = pipelined;
        self
    }

    /// Restores the next saved optimizer state into `optimizer`. A state saved from another kind of
    /// optimizer is refused rather than dropped.
    ///
    /// Restoring copies nothing: each state tensor is read from its file when the optimizer first uses it. The
    /// file is a second name of the saved one, made beside the checkpoint's folder (removing or rotating the
    /// checkpoint is safe), or, for a state re-cut for another number of ranks or another strategy, a scratch
    /// file there holding this rank's share; either goes when the optimizer does.
    pub fn optimizer(&mut self, optimizer: &mut AcceleratedOptimizer) -> Result<()> {
        let (i, path, (record, backing), steps) = self.next_optimizer_record(Reading::AsUsed)?;
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
        // One parameter's state tried on a copy of the optimizer: restoring it all to count would copy it all.
        let read_from = backing.as_ref().map_or(path.as_path(), |b| b.path());
        if let Some((sample, held)) = sample_of(read_from)? {
            let taken = guarded(&path, "optimizer", || optimizer.takes(sample))?;
            if taken != held {
                return Err(corrupt(
                    &path,
                    format!(
                        "holds {held} state tensor(s) for one parameter, of which this optimizer could restore \
                         {taken}: it was saved by another kind of optimizer"
                    ),
                ));
            }
        }
        guarded(&path, "optimizer", || {
            optimizer.restore(record, steps, backing)
        })?;
        crate::heap::release_free_heap();
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
        // A pipelined Learner saved its stage's model as burn-train holds it (whole shapes: the Learner keeps its
        // copy of what the stage dropped, see `learner::stage_model`): the same stages on as many ranks (the
        // Learner checks the stages) each load their own record.
        let own_stage = self.pipelined
            && self.manifest.model_per_rank
            && self.manifest.pp_size.is_some()
            && self.manifest.num_processes == self.num_processes
            && self.same_splits();
        if !own_stage && !self.same_layout(self.manifest.model_per_rank, now) {
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
        // Read whole: the Learner loads them after this state (and a re-cut record's scratch file) is gone.
        let (_, model) = self.next_model_record(Reading::Now)?;
        let (_, _, (optimizer, _), steps) = self.next_optimizer_record(Reading::Now)?;
        let (_, scheduler) = self.next_scheduler_record()?;
        Ok((model, (optimizer, steps), scheduler))
    }

    /// The next saved model's record, and its file.
    fn next_model_record(&mut self, reading: Reading) -> Result<(PathBuf, ModuleRecord)> {
        let stem = model_stem(self.manifest.model_per_rank, self.rank_index);
        let (_, path) = Self::next_part(
            &self.dir,
            &stem,
            (self.manifest.models, &self.manifest.checksums),
            &mut self.next_model,
        )?;
        let record = model_record(&path, reading)?;
        Ok((path, record))
    }

    /// The next saved optimizer's index, file, record and step count. A state saved by another number of
    /// ranks, or under a strategy that partitions it otherwise, is re-cut: this rank reads every saved slice in
    /// turn and keeps the state of the parameters it steps.
    /// Read [`AsUsed`](Reading::AsUsed), the record's tensors come from a file kept with the returned scratch
    /// name (a link to the saved file, or the re-cut record), which the optimizer must keep.
    fn next_optimizer_record(&mut self, reading: Reading) -> Result<(usize, PathBuf, Backed, u64)> {
        let per_rank = self.manifest.optimizer_per_rank;
        let now = self.strategy.as_ref().map(|s| s.optimizer_state());
        let (i, path, record) = if self.same_layout(per_rank, now) {
            let stem = optimizer_stem(per_rank, self.rank_index);
            let (i, path) = Self::next_part(
                &self.dir,
                &stem,
                (self.manifest.optimizers, &self.manifest.checksums),
                &mut self.next_optimizer,
            )?;
            let backing = match reading {
                Reading::AsUsed => crate::fs::Scratch::link(&path, &self.dir, "optimizer"),
                Reading::Now => None,
            };
            let record = match &backing {
                Some(link) => optimizer_record(link.path(), Reading::AsUsed)?,
                None => optimizer_record(&path, Reading::Now)?,
            };
            (i, path, (record, backing))
        } else {
            let i = Self::advance(
                &self.dir,
                "optimizer",
                self.manifest.optimizers,
                &mut self.next_optimizer,
            )?;
            let saved = repartition::SavedSplits::new(&self.manifest.splits);
            let scratch = repartition::optimizer_record(
                self.saved_files(optimizer_stem, per_rank, i),
                &saved,
                self.want(|s| s.optimizer_state()),
                &self.dir,
            )?;
            let record = optimizer_record(scratch.path(), reading)?;
            let backing = matches!(reading, Reading::AsUsed).then_some(scratch);
            (
                i,
                file(&self.dir, &optimizer_stem(per_rank, 0), i, "bpk"),
                (record, backing),
            )
        };
        let steps = self.rank.optimizer_steps.get(i).copied().unwrap_or(0);
        Ok((i, path, record, steps))
    }

    /// The next saved scheduler's record, and its file.
    fn next_scheduler_record(
        &mut self,
    ) -> Result<(PathBuf, burn::lr_scheduler::LrSchedulerRecord)> {
        let (_, path) = Self::next_part(
            &self.dir,
            "scheduler",
            (self.manifest.schedulers, &self.manifest.checksums),
            &mut self.next_scheduler,
        )?;
        let bytes = burn::tensor::Bytes::from_bytes_vec(read(&path)?);
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
