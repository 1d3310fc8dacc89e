//! `save_state`: everything needed to continue a run exactly where it stopped, written into a folder under a
//! `.partial` name and renamed when complete, with every rank taking part.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::Module;
#[cfg(feature = "train")]
use burn::store::ModuleRecord;

use super::manifest::{FORMAT, MANIFEST, Manifest, RankState, file, model_stem, optimizer_stem};
use crate::data::DataPosition;
use crate::distributed::strategy::StateScope;
use crate::fs::{FolderLock, io, parent_dir, sync_dir, with_suffix, write_synced};
use burn::tensor::Bytes;

use crate::error::{Error, Result};
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler};
use crate::precision::LossScaler;

/// What `save_state` writes, gathered from the training loop's objects (models and optimizers are owned by
/// the loop, so they are passed in rather than registered).
///
/// Nothing is copied when a part is added: the part's tensors are shared (Burn's tensors are values, so what is
/// saved is what the part held when added) and copied to the file only when `save_state` writes them, each
/// model tensor as the file reaches it. A save needs at most one copy of a rank's optimizer state (Burn's
/// `to_record`) on top of training, not a copy of every part. Build it just before `save_state`: held across
/// an optimizer step, it keeps the old values alive beside the new ones.
#[derive(Default)]
pub struct StateToSave {
    models: Vec<ModelPart>,
    optimizers: Vec<(OptimizerPart, u64)>,
    optimizer_kinds: Vec<Option<String>>,
    schedulers: Vec<Bytes>,
}

/// A model's record: its tensors, read as the file is written, or Burn's serialised record (a Learner's).
enum ModelPart {
    Tensors(Vec<burn_pack::Tensor>),
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    Bytes(Bytes),
}

/// An optimizer's state: the optimizer (its state tensors shared, not copied), recorded when written, or Burn's
/// serialised record (a Learner's).
enum OptimizerPart {
    Live(Box<burn::optim::ModuleOptimizer>),
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    Bytes(Bytes),
}

impl ModelPart {
    fn write(&self, path: &Path) -> Result<()> {
        match self {
            ModelPart::Tensors(tensors) => {
                super::safetensors::write::write_record(tensors.clone(), path)
            }
            ModelPart::Bytes(bytes) => write_synced(path, bytes),
        }
    }
}

impl OptimizerPart {
    fn write(&self, path: &Path) -> Result<()> {
        match self {
            OptimizerPart::Live(optimizer) => optimizer
                .to_record()
                .save(path)
                .map_err(|e| crate::fs::io("writing", path)(std::io::Error::other(e.to_string()))),
            OptimizerPart::Bytes(bytes) => write_synced(path, bytes),
        }
    }
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
        self.models.push(ModelPart::Tensors(
            super::safetensors::write::record_tensors(model),
        ));
        Ok(self)
    }

    /// Adds a prepared optimizer.
    pub fn optimizer(mut self, optimizer: &AcceleratedOptimizer) -> Result<Self> {
        self.optimizers.push((
            OptimizerPart::Live(Box::new(optimizer.inner().clone())),
            optimizer.num_steps(),
        ));
        self.optimizer_kinds
            .push(optimizer.kind().map(str::to_string));
        Ok(self)
    }

    /// Adds a burn-train Learner's model, optimizer (after `steps` steps) and scheduler records (the Learner
    /// keeps its optimizer and scheduler to itself and hands out records; their kind is not known).
    #[cfg(feature = "train")]
    pub(crate) fn records(
        mut self,
        (model, optimizer, scheduler): (
            ModuleRecord,
            burn::optim::OptimizerRecord,
            burn::lr_scheduler::LrSchedulerRecord,
        ),
        steps: u64,
    ) -> Result<Self> {
        let model = model.into_bytes().map_err(record_error("model"))?;
        let optimizer = optimizer.into_bytes().map_err(record_error("optimizer"))?;
        let scheduler = scheduler.into_bytes().map_err(record_error("scheduler"))?;
        self.models.push(ModelPart::Bytes(model));
        self.optimizers
            .push((OptimizerPart::Bytes(optimizer), steps));
        self.optimizer_kinds.push(None);
        self.schedulers.push(scheduler);
        Ok(self)
    }

    /// Adds a prepared scheduler.
    pub fn scheduler(mut self, scheduler: &AcceleratedScheduler) -> Result<Self> {
        let bytes = scheduler
            .record()
            .into_bytes()
            .map_err(record_error("scheduler"))?;
        self.schedulers.push(bytes);
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
    /// Whether each model is one record from the main process or one per rank (`FULL_SHARD`).
    pub model_state: StateScope,
    /// How the strategy split each parameter over the ranks (none where every rank holds every parameter).
    pub splits: Vec<super::repartition::SavedSplit>,
    /// The pipeline's stages, when the run is pipelined (`splits` then holds every rank's).
    pub pp_size: Option<usize>,
    /// The tensor-parallel ranks per group, under tensor parallelism.
    pub tp_size: Option<usize>,
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
fn prepare(dir: &Path, partial: &Path) -> Result<FolderLock> {
    let parent = parent_dir(dir);
    std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
    let lock = FolderLock::acquire(parent, dir)?;
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
        for (i, (optimizer, _)) in parts.optimizers.iter().enumerate() {
            optimizer.write(&file(partial, &stem, i, "bpk"))?;
        }
    }
    let models_per_rank = ctx.model_state == StateScope::PerRank;
    if models_per_rank || state.is_main_process() {
        let stem = model_stem(models_per_rank, state.process_index());
        for (i, model) in parts.models.iter().enumerate() {
            model.write(&file(partial, &stem, i, "bpk"))?;
        }
    }
    if state.is_main_process() {
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

/// The CRC-32C of every record file the main process wrote into `partial`, by file name (read back a
/// megabyte at a time).
fn checksums(
    partial: &Path,
    parts: &StateToSave,
    optimizer_per_rank: bool,
    models_per_rank: bool,
) -> Result<BTreeMap<String, u32>> {
    let mut names = Vec::new();
    if !models_per_rank {
        names.extend((0..parts.models.len()).map(|i| ("model", i)));
    }
    names.extend((0..parts.schedulers.len()).map(|i| ("scheduler", i)));
    if !optimizer_per_rank {
        names.extend((0..parts.optimizers.len()).map(|i| ("optimizer", i)));
    }
    let mut sums = BTreeMap::new();
    for (stem, i) in names {
        let name = file(Path::new(""), stem, i, "bpk")
            .to_string_lossy()
            .into_owned();
        sums.insert(name.clone(), crate::fs::file_crc32c(&partial.join(name))?);
    }
    Ok(sums)
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
        model_per_rank: ctx.model_state == StateScope::PerRank,
        checksums: checksums(
            partial,
            parts,
            ctx.optimizer_state == StateScope::PerRank,
            ctx.model_state == StateScope::PerRank,
        )?,
        splits: ctx.splits.clone(),
        pp_size: ctx.pp_size,
        tp_size: ctx.tp_size,
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
    sync_dir(parent_dir(dir))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
    }
    Ok(())
}
