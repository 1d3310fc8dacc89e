//! The checkpointer of one rank: where automatic checkpoints go, which objects and dataloader positions a
//! checkpoint holds besides the models, optimizers and schedulers the loop passes in, and `save_state` /
//! `load_state` themselves.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::Checkpointable;
use super::{LoadedState, ProjectConfiguration, SaveContext, StateToSave, save};
use crate::data::LoaderCursor;
use crate::distributed::ProcessGroup;
use crate::distributed::strategy::StateScope;
use crate::error::{Error, Result};
use crate::precision::LossScaler;

/// An object registered for checkpointing, with its name.
type RegisteredObject = (String, Arc<Mutex<dyn Checkpointable>>);

/// Locks a mutex, recovering from poisoning (the guarded values stay consistent between operations).
fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Project configuration, registered objects and prepared dataloaders of one rank.
#[derive(Default)]
pub(crate) struct Checkpointer {
    project: Mutex<ProjectConfiguration>,
    objects: Mutex<Vec<RegisteredObject>>,
    loaders: Mutex<Vec<Arc<LoaderCursor>>>,
}

/// How a save holds the training state: one optimizer state and model record or one per rank, how a sharded
/// strategy split each parameter, and the pipeline's and tensor parallelism's sizes where they are above 1.
#[derive(Debug)]
pub(crate) struct StateLayout {
    /// One optimizer state or one per rank.
    pub optimizer_state: StateScope,
    /// One model record or one per rank.
    pub model_state: StateScope,
    /// How a sharded strategy split each parameter (none where every rank holds every parameter whole).
    pub splits: Vec<super::repartition::SavedSplit>,
    /// The pipeline's stages, when the run is pipelined.
    pub pp_size: Option<usize>,
    /// The tensor-parallel ranks per group, under tensor parallelism.
    pub tp_size: Option<usize>,
}

impl Checkpointer {
    /// A checkpointer for `project`.
    pub fn new(project: ProjectConfiguration) -> Self {
        Self {
            project: Mutex::new(project),
            ..Self::default()
        }
    }

    /// The automatic-checkpoint settings.
    pub fn project(&self) -> ProjectConfiguration {
        lock(&self.project).clone()
    }

    /// Records a prepared dataloader, whose position every checkpoint saves.
    pub fn track_loader(&self, cursor: Arc<LoaderCursor>) {
        lock(&self.loaders).push(cursor);
    }

    /// Registers `value` under `name` (one name per object).
    pub fn register(&self, name: &str, value: Arc<Mutex<dyn Checkpointable>>) -> Result<()> {
        let mut objects = lock(&self.objects);
        if objects.iter().any(|(n, _)| n == name) {
            return Err(Error::InvalidArgument(format!(
                "register_for_checkpointing: `{name}` is already registered; use one name per object"
            )));
        }
        objects.push((name.to_string(), value));
        Ok(())
    }

    /// The folder a save goes to, its iteration, and whether it is an automatic checkpoint.
    fn target(&self, dir: Option<&Path>) -> Result<(PathBuf, usize, bool)> {
        let project = lock(&self.project);
        match dir {
            Some(d) => Ok((d.to_path_buf(), project.iteration, false)),
            None => {
                let root = project
                    .checkpoints_dir()
                    .filter(|_| project.automatic_checkpoint_naming)
                    .ok_or_else(|| {
                        Error::InvalidArgument(
                            "save_state(None) needs automatic checkpoint naming: set \
                             `AcceleratorBuilder::project_configuration(ProjectConfiguration::new(dir))`, \
                             or pass a folder"
                                .into(),
                        )
                    })?;
                let iteration = project.iteration;
                refuse_another_runs_checkpoints(&project, &root)?;
                Ok((
                    root.join(format!("checkpoint_{iteration}")),
                    iteration,
                    true,
                ))
            }
        }
    }

    /// Saves `parts`, the loss `scaler`, the registered objects and every loader's position into `dir` (or the
    /// next automatic checkpoint), with every rank taking part; returns the folder.
    pub fn save_state(
        &self,
        rank: &ProcessGroup,
        dir: Option<&Path>,
        parts: &StateToSave,
        scaler: Option<LossScaler>,
        layout: StateLayout,
    ) -> Result<PathBuf> {
        let StateLayout {
            optimizer_state,
            model_state,
            splits,
            pp_size,
            tp_size,
        } = layout;
        // Every rank learns whether every rank may write there (a refusal on one must not leave the others
        // waiting in the save's collectives).
        let (dir, iteration, automatic) = rank.agree("save_state", self.target(dir))?;
        let objects = lock(&self.objects)
            .iter()
            .map(|(name, value)| Ok((name.clone(), lock(value).state_dict()?)))
            .collect::<Result<Vec<_>>>()?;
        let positions = lock(&self.loaders).iter().map(|c| c.position()).collect();
        let loaders = lock(&self.loaders)
            .iter()
            .map(|c| c.fingerprint().clone())
            .collect();
        let ctx = SaveContext {
            state: rank,
            iteration,
            scaler,
            objects,
            positions,
            loaders,
            optimizer_state,
            model_state,
            splits,
            pp_size,
            tp_size,
        };
        save::save(&dir, parts, ctx)?;
        if automatic {
            let pruned = self.advance_and_prune(rank.is_main_process());
            rank.agree("save_state", pruned)?;
        }
        Ok(dir)
    }

    /// Moves automatic naming to the next iteration and removes the checkpoints beyond `total_limit` (on the
    /// main process).
    fn advance_and_prune(&self, main: bool) -> Result<()> {
        let mut project = lock(&self.project);
        project.iteration += 1;
        if let Some(limit) = project.total_limit
            && main
        {
            let existing = project.checkpoints();
            for (_, old) in existing.iter().take(existing.len().saturating_sub(limit)) {
                std::fs::remove_dir_all(old).map_err(|source| Error::Io {
                    operation: "removing an old checkpoint",
                    path: old.clone(),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// Opens `dir` (or the latest automatic checkpoint), puts every prepared dataloader back at its saved
    /// position, restores the registered objects and the automatic-naming iteration. The caller restores the
    /// loss scaler ([`LoadedState::scaler`]) and the loop's models, optimizers and schedulers.
    pub fn load_state(&self, rank: &ProcessGroup, dir: Option<&Path>) -> Result<LoadedState> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => {
                let project = lock(&self.project);
                let (_, latest) = project.checkpoints().pop().ok_or_else(|| {
                    Error::InvalidArgument(match project.checkpoints_dir() {
                        Some(dir) => format!(
                            "load_state(None): no complete checkpoint in {}; save one with \
                             save_state(None) first, or pass the folder to load",
                            dir.display()
                        ),
                        None => "load_state(None) loads the latest automatic checkpoint, but no project \
                                 folder is set: use AcceleratorBuilder::project_configuration(\
                                 ProjectConfiguration::new(dir)), or pass the folder to load"
                            .into(),
                    })
                })?;
                latest
            }
        };
        // Every rank learns whether every rank could restore its part, so that none trains on alone.
        let restored = self.restore(rank, &dir);
        rank.agree("load_state", restored)
    }

    /// Opens the checkpoint `dir` on this rank and restores the positions, objects and naming iteration.
    fn restore(&self, rank: &ProcessGroup, dir: &Path) -> Result<LoadedState> {
        let mut loaded = LoadedState::open(dir, rank.process_index(), rank.num_processes())?;
        self.restore_positions(&loaded)?;
        self.restore_objects(&mut loaded)?;
        let next = loaded.iteration().checked_add(1).ok_or_else(|| Error::Checkpoint {
            path: loaded.dir().to_path_buf(),
            reason: format!(
                "records iteration {}, which cannot be continued; the file was edited or is corrupt",
                loaded.iteration()
            ),
        })?;
        lock(&self.project).iteration = next;
        Ok(loaded)
    }

    fn restore_positions(&self, loaded: &LoadedState) -> Result<()> {
        let loaders = lock(&self.loaders);
        if loaded.positions().len() != loaders.len() {
            return Err(Error::Checkpoint {
                path: loaded.dir().to_path_buf(),
                reason: format!(
                    "saved the positions of {} prepared dataloader(s), but {} are prepared now; prepare the same \
                     dataloaders, in the same order, before load_state",
                    loaded.positions().len(),
                    loaders.len()
                ),
            });
        }
        let saved = loaded.loader_fingerprints();
        for (i, (cursor, position)) in loaders.iter().zip(loaded.positions()).enumerate() {
            let now = cursor.fingerprint();
            if let Some(saved) = saved.get(i) {
                let differences = now.differences(saved, position.batch == 0);
                if !differences.is_empty() {
                    return Err(Error::Checkpoint {
                        path: loaded.dir().to_path_buf(),
                        reason: format!(
                            "prepared dataloader #{i} differs from the one this checkpoint was saved with: {}; \
                             resume with the same dataset, batch size, seed and drop_last (the saved position \
                             would otherwise point into other data)",
                            differences.join(", ")
                        ),
                    });
                }
            }
            let past_the_end = cursor.has_length() && position.batch > now.batches_per_epoch;
            if past_the_end || position.epoch >= usize::MAX / 2 {
                return Err(Error::Checkpoint {
                    path: loaded.dir().to_path_buf(),
                    reason: format!(
                        "records dataloader #{i} at epoch {} after batch {}, but an epoch has {} batches here; \
                         the file was edited or is corrupt",
                        position.epoch, position.batch, now.batches_per_epoch
                    ),
                });
            }
        }
        for (cursor, position) in loaders.iter().zip(loaded.positions()) {
            cursor.restore(*position);
        }
        Ok(())
    }

    fn restore_objects(&self, loaded: &mut LoadedState) -> Result<()> {
        let objects = lock(&self.objects);
        for (name, value) in objects.iter() {
            let state = loaded.take_object(name).ok_or_else(|| Error::Checkpoint {
                path: loaded.dir().to_path_buf(),
                reason: format!(
                    "has no object `{name}`; it was registered after this checkpoint was saved"
                ),
            })?;
            lock(value).load_state_dict(state)?;
        }
        let left = loaded.remaining_objects();
        if !left.is_empty() {
            return Err(Error::Checkpoint {
                path: loaded.dir().to_path_buf(),
                reason: format!(
                    "holds object(s) {left:?} that are not registered; register every object that was saved \
                     (register_for_checkpointing) before load_state"
                ),
            });
        }
        Ok(())
    }
}

/// Refuses an automatic save whose numbering would mix with checkpoints already in `root` (Accelerate refuses
/// to overwrite a checkpoint folder too): complete checkpoints numbered at or after the next iteration belong
/// to another run, which this one would overwrite, and which `total_limit` would prune in its place.
fn refuse_another_runs_checkpoints(project: &ProjectConfiguration, root: &Path) -> Result<()> {
    let theirs: Vec<usize> = project
        .checkpoints()
        .into_iter()
        .map(|(i, _)| i)
        .filter(|&i| i >= project.iteration)
        .collect();
    let (Some(first), Some(last)) = (theirs.first(), theirs.last()) else {
        return Ok(());
    };
    Err(Error::InvalidArgument(format!(
        "save_state(None): {} already holds checkpoint_{first}..=checkpoint_{last} of an earlier run, and this \
         run would write checkpoint_{} next, overwriting or pruning that run's checkpoints; to continue that run \
         call `accelerator.load_state(None)` (or `accelerator.resume()`, which a job restarted by `launch \
         --max-restarts` needs) before training; to start fresh use another project folder (or \
         remove {}); to number after them set `ProjectConfiguration {{ iteration: {}, .. }}`",
        root.display(),
        project.iteration,
        root.display(),
        last + 1
    )))
}
