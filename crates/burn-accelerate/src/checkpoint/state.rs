//! `save_state` / `load_state`: everything needed to continue a run exactly where it stopped.
//!
//! A checkpoint folder holds `checkpoint.json` (written last: a folder without it is not a checkpoint),
//! `model.bpk`, `model_1.bpk`, ... (Burn records, which keep parameter ids so the optimizer state matches),
//! `optimizer*.bpk`, `scheduler*.bpk`, `objects.json` (registered objects) and one `rank_<i>.json` per rank
//! (data positions). The folder is written under a `.partial` name and renamed when complete.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::store::ModuleRecord;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::fs::{io, read, sync_dir, with_suffix, write_synced};
pub use crate::data::DataPosition;
use crate::distributed::strategy::StateScope;
use crate::error::{Error, Result};
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler};
use crate::precision::LossScaler;

/// The format tag of `checkpoint.json`.
pub const FORMAT: &str = "burn-accelerate-state/1";
const MANIFEST: &str = "checkpoint.json";

/// Where automatic checkpoints go (Accelerate's `ProjectConfiguration`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectConfiguration {
    /// The project folder.
    pub project_dir: Option<PathBuf>,
    /// Name checkpoints `project_dir/checkpoints/checkpoint_{iteration}` when `save_state` gets no folder.
    pub automatic_checkpoint_naming: bool,
    /// Keep at most this many automatic checkpoints (the oldest are removed).
    pub total_limit: Option<usize>,
    /// The number of the next automatic checkpoint. Unlike Accelerate, `load_state` restores it, so the next
    /// save does not overwrite an existing checkpoint.
    pub iteration: usize,
}

impl ProjectConfiguration {
    /// Automatic naming under `project_dir`.
    pub fn new(project_dir: impl Into<PathBuf>) -> Self {
        Self {
            project_dir: Some(project_dir.into()),
            automatic_checkpoint_naming: true,
            total_limit: None,
            iteration: 0,
        }
    }

    /// Keeps at most `limit` automatic checkpoints.
    pub fn total_limit(mut self, limit: usize) -> Self {
        self.total_limit = Some(limit);
        self
    }

    /// The folder of automatic checkpoints.
    pub fn checkpoints_dir(&self) -> Option<PathBuf> {
        self.project_dir.as_ref().map(|d| d.join("checkpoints"))
    }

    /// Complete automatic checkpoints, oldest first, as (iteration, folder).
    pub fn checkpoints(&self) -> Vec<(usize, PathBuf)> {
        let Some(dir) = self.checkpoints_dir() else {
            return Vec::new();
        };
        let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                let i = name.strip_prefix("checkpoint_")?.parse().ok()?;
                e.path().join(MANIFEST).exists().then(|| (i, e.path()))
            })
            .collect();
        found.sort();
        found
    }
}

/// A value that can be saved in and restored from a checkpoint. Implemented for every serde type.
pub trait Checkpointable: Send {
    /// The value's state.
    fn state_dict(&self) -> Result<serde_json::Value>;
    /// Restores the value from `state`.
    fn load_state_dict(&mut self, state: serde_json::Value) -> Result<()>;
}

impl<T: Serialize + DeserializeOwned + Send> Checkpointable for T {
    fn state_dict(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self)
            .map_err(|e| Error::InvalidArgument(format!("checkpoint object: {e}")))
    }

    fn load_state_dict(&mut self, state: serde_json::Value) -> Result<()> {
        *self = serde_json::from_value(state).map_err(|e| {
            Error::InvalidArgument(format!("checkpoint object does not match its type: {e}"))
        })?;
        Ok(())
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    iteration: usize,
    num_processes: usize,
    models: usize,
    optimizers: usize,
    schedulers: usize,
    objects: Vec<String>,
    scaler: Option<LossScaler>,
    /// Each optimizer's kind (`Adam`, ...), where known. Absent in older checkpoints.
    #[serde(default)]
    optimizer_kinds: Vec<Option<String>>,
    /// Whether each rank saved its own slice of the optimizer state (a sharded strategy). Absent in older
    /// checkpoints.
    #[serde(default)]
    optimizer_per_rank: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct RankState {
    dataloaders: Vec<DataPosition>,
    optimizer_steps: Vec<u64>,
    /// This rank's prepared dataloaders. Absent in older checkpoints.
    #[serde(default)]
    loaders: Vec<crate::data::LoaderFingerprint>,
}

/// What `save_state` writes, gathered from the training loop's objects (models and optimizers are owned by
/// the loop, so they are passed in rather than registered).
#[derive(Default)]
pub struct StateToSave {
    models: Vec<Vec<u8>>,
    optimizers: Vec<(Vec<u8>, u64)>,
    optimizer_kinds: Vec<Option<String>>,
    schedulers: Vec<Vec<u8>>,
}

fn record_error(what: &str) -> impl FnOnce(burn::store::RecordError) -> Error + '_ {
    move |e| Error::InvalidArgument(format!("save_state: cannot record the {what}: {e}"))
}

impl StateToSave {
    /// Nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a model (saved with its parameter ids, so its optimizer state matches on load).
    pub fn model<M: Module>(mut self, model: &M) -> Result<Self> {
        self.models
            .push(super::weights::record_bytes(model)?.to_vec());
        Ok(self)
    }

    /// Adds a prepared optimizer.
    pub fn optimizer(mut self, optimizer: &AcceleratedOptimizer) -> Result<Self> {
        let bytes = optimizer
            .inner()
            .to_record()
            .into_bytes()
            .map_err(record_error("optimizer"))?;
        self.optimizers
            .push((bytes.to_vec(), optimizer.num_steps()));
        self.optimizer_kinds
            .push(optimizer.kind().map(str::to_string));
        Ok(self)
    }

    /// Adds a burn-train Learner's model, optimizer (after `steps` steps) and scheduler records (the Learner
    /// keeps its optimizer and scheduler to itself and hands out records; their kind is not known).
    #[cfg(feature = "train")]
    pub(crate) fn records(
        mut self,
        records: crate::learner::LearnerRecords,
        steps: u64,
    ) -> Result<Self> {
        let model = records.model.into_bytes().map_err(record_error("model"))?;
        let optimizer = records
            .optimizer
            .into_bytes()
            .map_err(record_error("optimizer"))?;
        let scheduler = records
            .scheduler
            .into_bytes()
            .map_err(record_error("scheduler"))?;
        self.models.push(model.to_vec());
        self.optimizers.push((optimizer.to_vec(), steps));
        self.optimizer_kinds.push(None);
        self.schedulers.push(scheduler.to_vec());
        Ok(self)
    }

    /// Adds a prepared scheduler.
    pub fn scheduler(mut self, scheduler: &AcceleratedScheduler) -> Result<Self> {
        let bytes = scheduler
            .record()
            .into_bytes()
            .map_err(record_error("scheduler"))?;
        self.schedulers.push(bytes.to_vec());
        Ok(self)
    }
}

/// The parts of the state every rank contributes, besides `StateToSave`.
pub(crate) struct SaveContext<'a> {
    pub state: &'a crate::distributed::ProcessGroup,
    pub iteration: usize,
    pub scaler: Option<LossScaler>,
    pub objects: Vec<(String, serde_json::Value)>,
    pub positions: Vec<DataPosition>,
    pub loaders: Vec<crate::data::LoaderFingerprint>,
    /// Whether the optimizer state is one file from the main process or one slice per rank.
    pub optimizer_state: StateScope,
}

/// The file stem of the optimizer states: one set for the run, or one per rank when each rank holds a slice.
fn optimizer_stem(per_rank: bool, rank: usize) -> String {
    if per_rank {
        format!("optimizer_rank{rank}")
    } else {
        "optimizer".into()
    }
}

fn file(dir: &Path, stem: &str, i: usize, ext: &str) -> PathBuf {
    if i == 0 {
        dir.join(format!("{stem}.{ext}"))
    } else {
        dir.join(format!("{stem}_{i}.{ext}"))
    }
}

/// Writes a checkpoint into `dir` atomically, with every rank taking part. Each phase ends with every rank
/// learning every rank's outcome, so a failure anywhere (a full disk on the main process, a read-only folder)
/// stops all ranks at once with the same story, and the previous checkpoint is left as it was.
pub(crate) fn save(dir: &Path, parts: &StateToSave, ctx: SaveContext<'_>) -> Result<()> {
    let state = ctx.state;
    let main = state.is_main_process();
    let partial = with_suffix(dir, ".partial");
    let lock = state.agree(
        "save_state",
        if main {
            prepare(dir, &partial).map(Some)
        } else {
            Ok(None)
        },
    )?;
    let written = write_parts(&partial, parts, &ctx);
    state.agree("save_state", written)?;
    let committed = if main {
        commit(dir, &partial, parts, &ctx)
    } else {
        Ok(())
    };
    state.agree("save_state", committed)?;
    drop(lock);
    Ok(())
}

/// On the main process: locks the folder `dir` lives in, clears what an interrupted save left and creates the
/// `.partial` folder the ranks write into.
fn prepare(dir: &Path, partial: &Path) -> Result<super::fs::FolderLock> {
    let parent = super::fs::parent_dir(dir);
    std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
    let lock = super::fs::FolderLock::acquire(parent, dir)?;
    // Under the lock, anything at the `.partial` name is what an interrupted save left (or a planted link,
    // which is removed, never followed); the folder is then created exclusively.
    if let Ok(meta) = std::fs::symlink_metadata(partial) {
        if meta.is_dir() {
            std::fs::remove_dir_all(partial)
        } else {
            std::fs::remove_file(partial)
        }
        .map_err(io("removing an unfinished save", partial))?;
    }
    std::fs::create_dir(partial).map_err(io("creating", partial))?;
    Ok(lock)
}

/// Every rank writes its own file; the main process writes the models, optimizers, schedulers and objects.
fn write_parts(partial: &Path, parts: &StateToSave, ctx: &SaveContext<'_>) -> Result<()> {
    let state = ctx.state;
    let rank = RankState {
        dataloaders: ctx.positions.clone(),
        optimizer_steps: parts.optimizers.iter().map(|(_, s)| *s).collect(),
        loaders: ctx.loaders.clone(),
    };
    let rank_json = serde_json::to_vec_pretty(&rank).expect("plain data");
    write_synced(
        &partial.join(format!("rank_{}.json", state.process_index())),
        &rank_json,
    )?;
    let per_rank = ctx.optimizer_state == StateScope::PerRank;
    if per_rank || state.is_main_process() {
        let stem = optimizer_stem(per_rank, state.process_index());
        for (i, (bytes, _)) in parts.optimizers.iter().enumerate() {
            write_synced(&file(partial, &stem, i, "bpk"), bytes)?;
        }
    }
    if state.is_main_process() {
        for (i, bytes) in parts.models.iter().enumerate() {
            write_synced(&file(partial, "model", i, "bpk"), bytes)?;
        }
        for (i, bytes) in parts.schedulers.iter().enumerate() {
            write_synced(&file(partial, "scheduler", i, "bpk"), bytes)?;
        }
        let objects: BTreeMap<String, serde_json::Value> = ctx.objects.iter().cloned().collect();
        write_synced(
            &partial.join("objects.json"),
            &serde_json::to_vec_pretty(&objects).expect("JSON values"),
        )?;
    }
    Ok(())
}

/// On the main process: writes the manifest (what makes the folder a checkpoint) and puts the folder in place.
fn commit(dir: &Path, partial: &Path, parts: &StateToSave, ctx: &SaveContext<'_>) -> Result<()> {
    let manifest = Manifest {
        format: FORMAT.into(),
        iteration: ctx.iteration,
        num_processes: ctx.state.num_processes(),
        models: parts.models.len(),
        optimizers: parts.optimizers.len(),
        schedulers: parts.schedulers.len(),
        objects: ctx.objects.iter().map(|(n, _)| n.clone()).collect(),
        scaler: ctx.scaler.clone(),
        optimizer_kinds: parts.optimizer_kinds.clone(),
        optimizer_per_rank: ctx.optimizer_state == StateScope::PerRank,
    };
    write_synced(
        &partial.join(MANIFEST),
        &serde_json::to_vec_pretty(&manifest).expect("plain data"),
    )?;
    sync_dir(partial)?;
    // Replace: the old folder is moved aside before the new one takes its name, so that one complete
    // checkpoint exists at every instant. (A `.old` left by a save that stopped between its two renames, with
    // no `dir`, is the last complete checkpoint: it stays until the new one is in place.)
    let old = with_suffix(dir, ".old");
    if dir.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
        }
        std::fs::rename(dir, &old).map_err(io("moving the previous checkpoint aside", dir))?;
    }
    std::fs::rename(partial, dir).map_err(io("renaming the checkpoint into place", dir))?;
    sync_dir(super::fs::parent_dir(dir))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
    }
    Ok(())
}

/// A checkpoint read back by `load_state`: restore its parts into the training loop's objects, in the order
/// they were saved, then call [`finish`](Self::finish) to check that nothing was left out.
pub struct LoadedState {
    dir: PathBuf,
    manifest: Manifest,
    rank: RankState,
    objects: BTreeMap<String, serde_json::Value>,
    rank_index: usize,
    next_model: usize,
    next_optimizer: usize,
    next_scheduler: usize,
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
fn resolve(dir: &Path) -> Result<PathBuf> {
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
        if manifest.num_processes != num_processes {
            return Err(corrupt(
                &manifest_path,
                format!(
                    "saved by {} ranks, loaded by {num_processes}; resume with the same number of ranks",
                    manifest.num_processes
                ),
            ));
        }
        let rank_path = dir.join(format!("rank_{rank_index}.json"));
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
            next_model: 0,
            next_optimizer: 0,
            next_scheduler: 0,
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

    /// The bytes of the next saved part of `kind` (`model`, `optimizer`, `scheduler`), whose count and cursor
    /// are `saved` and `next`; returns its index, file and bytes.
    fn next_part(
        dir: &Path,
        kind: &str,
        saved: usize,
        next: &mut usize,
    ) -> Result<(usize, PathBuf, burn::tensor::Bytes)> {
        let i = *next;
        if i >= saved {
            return Err(corrupt(
                dir,
                format!("holds {saved} {kind}(s); asked for {kind} #{}", i + 1),
            ));
        }
        *next += 1;
        let path = file(dir, kind, i, "bpk");
        let bytes = burn::tensor::Bytes::from_bytes_vec(read(&path)?);
        Ok((i, path, bytes))
    }

    /// Restores the next saved model into `model` (same architecture), with the saved parameter ids.
    pub fn model<M: Module>(&mut self, model: M) -> Result<M> {
        let (path, record) = self.next_model_record()?;
        guarded(&path, "model", move || model.try_load_record(record))?
            .map_err(|e| corrupt(&path, format!("does not fit the model: {e}")))
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
        let (_, model) = self.next_model_record()?;
        let (_, _, optimizer, steps) = self.next_optimizer_record()?;
        let (_, scheduler) = self.next_scheduler_record()?;
        Ok((model, (optimizer, steps), scheduler))
    }

    /// The next saved model's record, and its file.
    fn next_model_record(&mut self) -> Result<(PathBuf, ModuleRecord)> {
        let (_, path, bytes) = Self::next_part(
            &self.dir,
            "model",
            self.manifest.models,
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

    /// The next saved optimizer's index, file, record and step count.
    fn next_optimizer_record(
        &mut self,
    ) -> Result<(usize, PathBuf, burn::optim::OptimizerRecord, u64)> {
        let stem = optimizer_stem(self.manifest.optimizer_per_rank, self.rank_index);
        let (i, path, bytes) = Self::next_part(
            &self.dir,
            &stem,
            self.manifest.optimizers,
            &mut self.next_optimizer,
        )?;
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
            self.manifest.schedulers,
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
