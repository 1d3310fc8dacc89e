//! The [`Accelerator`]'s checkpoint calls: model weights (safetensors or Burn records, PyTorch's or Burn's
//! layout) and the whole training state, each forwarded to [`checkpoint`](crate::checkpoint).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Module;

use super::Accelerator;
use crate::checkpoint::{
    Checkpointable, LoadOptions, LoadReport, LoadedState, ProjectConfiguration, SaveOptions,
    StateToSave,
};
use crate::error::Result;

impl Accelerator {
    /// Returns the plain Burn module of a prepared model. A prepared model *is* a plain Burn module (there is
    /// no wrapper to strip), so this is the identity; it exists so that code ported from Accelerate reads the
    /// same.
    pub fn unwrap_model<M: Module>(&self, model: M) -> M {
        model
    }

    /// Saves `model`'s weights into `dir` in Hugging Face's layout: `model.safetensors`, or shards no larger
    /// than `max_shard_size` (`"10GB"`, `"500MB"`, `"1GiB"`) named `model-00001-of-0000N.safetensors` with
    /// `model.safetensors.index.json`; files of an earlier save that this one does not use are removed. Tensors
    /// are in PyTorch's layout, so the file loads into the matching `torch.nn` module (see
    /// [`WeightLayout`](crate::checkpoint::WeightLayout); [`save_model_with`](Self::save_model_with) chooses).
    /// With `safe_serialization` off, writes Burn's `model.bpk` instead (keeps parameter ids). Only the main
    /// process writes; call it on every rank (under `FULL_SHARD` every rank takes part in gathering the
    /// parameters, as [`unshard`](Self::unshard) does).
    pub fn save_model<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
        safe_serialization: bool,
    ) -> Result<Vec<PathBuf>> {
        let options = SaveOptions {
            max_shard_size: max_shard_size.to_string(),
            safe_serialization,
            ..SaveOptions::default()
        };
        self.save_model_with(model, dir, &options)
    }

    /// [`save_model`](Self::save_model) with every option: the tensor layout (PyTorch's or Burn's) and key
    /// remapping.
    ///
    /// ```
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn_accelerate::Accelerator;
    /// use burn_accelerate::checkpoint::{KeyRemap, SaveOptions, WeightLayout};
    ///
    /// let accelerator = Accelerator::new()?;
    /// let model: Linear = LinearConfig::new(3, 2).init(accelerator.device());
    /// let dir = std::env::temp_dir().join(format!("doc-save-{}", std::process::id()));
    /// let options = SaveOptions {
    ///     layout: WeightLayout::PyTorch,                  // weight: [2, 3], as torch.nn.Linear(3, 2) has it
    ///     remap: KeyRemap::new().rule("^", "model.")?,    // keys `model.weight`, `model.bias`
    ///     ..SaveOptions::default()
    /// };
    /// accelerator.save_model_with(&model, &dir, &options)?;
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn save_model_with<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        options: &SaveOptions,
    ) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        if self.stage().is_some() {
            return Err(crate::Error::InvalidArgument(
                "save_model: under a pipeline (pp_size > 1) each rank holds only its stage's blocks; save with \
                 `accelerator.save_blocks(&model, dir, max_shard_size)`, which fetches each from its stage"
                    .into(),
            ));
        }
        let max = crate::checkpoint::parse_size(&options.max_shard_size)?;
        let sharded =
            || crate::distributed::strategy::param_fetcher(self.step.strategy().as_ref(), model);
        // Under tensor parallelism each split parameter is gathered whole from the group as it is written (its
        // part first joined from the data-parallel group's slices under a sharded strategy).
        if options.safe_serialization
            && let Some(tp) = self.tensor.as_ref().filter(|t| t.context.size > 1)
        {
            let fetcher = crate::tensor_parallel::fetch::TpFetcher::of(tp, model, sharded());
            return self.save_sharded_model(model, dir, max, options, std::rc::Rc::new(fetcher));
        }
        if options.safe_serialization
            && let Some(fetcher) = sharded()
        {
            return self.save_sharded_model(model, dir, max, options, std::rc::Rc::new(fetcher));
        }
        // Every rank holds the whole model (or, under FULL_SHARD with Burn's record format, takes part in
        // gathering it), and the main process writes it.
        let whole = self.unshard(model)?;
        let model = &whole;
        let write = || -> Result<Vec<PathBuf>> {
            let parent = crate::fs::parent_dir(dir);
            std::fs::create_dir_all(parent).map_err(crate::error::io("creating", parent))?;
            let _lock = crate::fs::FolderLock::acquire(parent, dir)?;
            if options.safe_serialization {
                crate::checkpoint::safetensors::write_safetensors(
                    model,
                    dir,
                    max,
                    options.layout,
                    &options.remap,
                )
            } else {
                Ok(vec![crate::checkpoint::safetensors::write_burnpack(
                    model, dir,
                )?])
            }
        };
        // The main process writes; every rank learns at once whether it worked.
        let written = if self.is_main_process() {
            write()
        } else {
            Ok(Vec::new())
        };
        self.group.agree("save_model", written)
    }

    /// [`save_model`](Self::save_model) of a model made of blocks, under a pipeline too: each rank holds only its
    /// stage's blocks there, so every parameter is fetched from the stage that trains it, one at a time, and the
    /// main process writes one file of the whole model (no rank ever holds it). Without a pipeline, the same as
    /// `save_model`. Call it on every rank.
    ///
    /// # Errors
    /// As [`save_model`](Self::save_model).
    pub fn save_blocks<M: crate::Blocks>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>> {
        let Some(stages) = self.stage().cloned() else {
            return self.save_model(model, dir, max_shard_size, true);
        };
        let dir = dir.as_ref();
        let max = crate::checkpoint::parse_size(max_shard_size)?;
        let whole = self.unshard(model)?;
        let fetcher = crate::pipeline_parallel::fetch::StageFetcher::new(
            &stages,
            &self.group,
            stages.world.clone(),
            &whole,
        )?;
        let options = SaveOptions {
            max_shard_size: max_shard_size.to_string(),
            ..SaveOptions::default()
        };
        self.save_sharded_model(&whole, dir, max, &options, std::rc::Rc::new(fetcher))
    }

    /// `save_model` under `FULL_SHARD` (or a pipeline): the main process writes each parameter as it is fetched
    /// from its owner, one at a time, while the other ranks take part in the same fetches: no rank ever holds the
    /// whole model.
    fn save_sharded_model<M: Module>(
        &self,
        model: &M,
        dir: &Path,
        max: u64,
        options: &SaveOptions,
        fetcher: std::rc::Rc<dyn crate::distributed::strategy::LazyParams>,
    ) -> Result<Vec<PathBuf>> {
        let lazy =
            || -> std::rc::Rc<dyn crate::distributed::strategy::LazyParams> { fetcher.clone() };
        // Every rank plans the same file (a bad key remapping fails everywhere alike); the main process also
        // takes the folder's lock. All agree before the first fetch, so that no rank waits on one that stopped.
        let planned = crate::checkpoint::safetensors::plan(
            model,
            options.layout,
            &options.remap,
            Some(lazy()),
        );
        let prepared = planned.and_then(|tensors| {
            if !self.is_main_process() {
                return Ok((tensors, None));
            }
            let parent = crate::fs::parent_dir(dir);
            std::fs::create_dir_all(parent).map_err(crate::error::io("creating", parent))?;
            let lock = crate::fs::FolderLock::acquire(parent, dir)?;
            Ok((tensors, Some(lock)))
        });
        let (ready, prepared) = match prepared {
            Ok(p) => (Ok(()), Some(p)),
            Err(e) => (Err(e), None),
        };
        self.group.agree("save_model", ready)?;
        let Some((tensors, lock)) = prepared else {
            return Err(crate::error::Error::InvalidArgument(
                "save_model: the ranks agreed on a plan this rank did not make".into(),
            ));
        };
        // The writer fetches each parameter at its first band; the other ranks make the same fetches in the
        // same order.
        let written = match lock {
            Some(_lock) => crate::checkpoint::safetensors::write_planned(
                tensors,
                dir,
                max,
                options.layout,
                &mut || {},
            ),
            None => {
                crate::checkpoint::safetensors::drain_planned(&tensors, max).map(|()| Vec::new())
            }
        };
        drop(fetcher);
        self.group.agree("save_model", written)
    }

    /// Loads weights saved by [`save_model`](Self::save_model) or by Hugging Face tools (a `.safetensors`
    /// file, a folder, or an index) into `model`, matching parameters by path. The layout is the one the file
    /// records, else PyTorch's (what PyTorch and Hugging Face tools write); `options.layout` overrides it and
    /// `options.remap` renames the checkpoint's keys first (e.g. strip `model.`). Returns the model and what was
    /// renamed or did not match (Accelerate does not report missing keys); with `options.strict`, any mismatch
    /// is an error.
    ///
    /// Into a model prepared with a strategy that holds parameters as dim-0 slices (`FULL_SHARD`), every rank
    /// reads only its own rows of each tensor, straight from the memory-mapped file (in PyTorch's `[out, in]`
    /// layout a Burn slice is a band of columns), and lets go of each tensor's pages once copied: no rank builds
    /// a whole tensor or holds the file, so a pretrained model larger than one rank's memory loads. Call it on
    /// every rank after [`prepare_model`](Self::prepare_model) (before it, every rank loads the whole model); a
    /// rank that fails to read its slices makes the call fail on every rank.
    ///
    /// Into a model prepared with [`prepare_tensor_parallel`](Self::prepare_tensor_parallel), each rank keeps its
    /// slice of each split layer: a slice of rows is read alone, as above; a slice of columns from its whole
    /// tensor, one tensor at a time, cut and let go, so a rank holds its share of the model and one whole tensor at
    /// most.
    pub fn load_checkpoint_in_model<M: Module>(
        &self,
        model: M,
        path: impl AsRef<Path>,
        options: &LoadOptions,
    ) -> Result<(M, LoadReport)> {
        let strategy = self.step.strategy();
        let tensor = self.tensor.as_deref();
        let loaded = crate::checkpoint::safetensors::read::load_weights_parts(
            model,
            path.as_ref(),
            options,
            &|id| strategy.slicing(id),
            &|id| tensor.and_then(|t| t.slice_of_param(id)),
        );
        crate::heap::release_free_heap();
        if strategy.slicings().is_empty() && tensor.is_none() {
            // Every rank holds the whole model: a rank may load on its own.
            return loaded;
        }
        // Each rank reads its own slices: a file one rank cannot read stops every rank, with its story.
        self.group.agree("load_checkpoint_in_model", loaded)
    }

    /// Registers a value to be saved by every `save_state` and restored by every `load_state`, under `name`
    /// (Accelerate's `register_for_checkpointing`). Any serde type works.
    pub fn register_for_checkpointing<T: Checkpointable + 'static>(
        &self,
        name: &str,
        value: Arc<std::sync::Mutex<T>>,
    ) -> Result<()> {
        self.checkpointer.register(name, value)
    }

    /// The automatic-checkpoint settings.
    pub fn project_configuration(&self) -> ProjectConfiguration {
        self.checkpointer.project()
    }

    /// Saves the training state into `dir`, or, with `None`, into the next automatic checkpoint
    /// (`project_dir/checkpoints/checkpoint_{iteration}`, keeping at most `total_limit`). Along with `parts`
    /// (models, optimizers, schedulers), it records the loss scaler, every prepared dataloader's position on
    /// every rank, and the registered objects. The folder appears only once complete. Call it on every rank,
    /// after the optimizer step that ends an accumulation window: a checkpoint holds no gradients, so a save with
    /// gradients still waiting for their step (inside a window) is refused rather than resumed without them.
    /// Returns the folder.
    pub fn save_state(&self, dir: Option<&Path>, parts: &StateToSave) -> Result<PathBuf> {
        self.step.check_no_pending_gradients("save_state")?;
        let scaler = self.loss_scaler();
        let strategy = self.step.strategy();
        let mut splits: Vec<_> = strategy
            .checkpoint_slicings()
            .iter()
            .map(|(id, cut)| crate::checkpoint::repartition::SavedSplit::of(*id, cut))
            .collect();
        let pp_size = self.stage().map(|stages| stages.layout.stages);
        if let Some(stages) = self.stage() {
            splits = every_stage_splits(self, stages, splits)?;
        }
        let tp = self.parallel_dims().tp;
        let layout = crate::checkpoint::StateLayout {
            optimizer_state: strategy.optimizer_state(),
            model_state: strategy.model_state(),
            splits,
            pp_size,
            tp_size: (tp > 1).then_some(tp),
        };
        self.checkpointer
            .save_state(&self.group, dir, parts, scaler, layout)
    }

    /// Loads a training state saved by [`save_state`](Self::save_state) from `dir`, or, with `None`, from the
    /// latest automatic checkpoint. The loss scaler, the prepared dataloaders' positions (the next `iter`
    /// resumes mid-epoch where the save happened), the registered objects and the automatic-naming iteration
    /// (so the next save does not overwrite it) are restored here; restore models, optimizers and schedulers
    /// from the returned [`LoadedState`], then call its `finish`.
    pub fn load_state(&self, dir: Option<&Path>) -> Result<LoadedState> {
        let loaded = self
            .checkpointer
            .load_state(&self.group, dir)?
            .with_strategy(self.step.strategy().clone(), self.stage().is_some());
        // A pipeline's ranks each saved their stage's part (and, sharded, their slices of it, the manifest listing
        // every stage's splits): sharded stages re-cut for another number of data-parallel replicas of the same
        // stages.
        let strategy = self.step.strategy();
        if let Some(stages) = self.stage()
            && (loaded.saved_split() || !strategy.slicings().is_empty())
            && match loaded.saved_pp_size() {
                Some(pp) => pp != stages.layout.stages,
                None => loaded.saved_num_processes() != self.num_processes(),
            }
        {
            let saved = match loaded.saved_pp_size() {
                Some(pp) => format!("{pp} pipeline stages"),
                None => {
                    "a pipeline whose manifest does not list every stage's slices (an older save)"
                        .into()
                }
            };
            return Err(crate::Error::InvalidArgument(format!(
                "load_state: {} was saved by {} ranks of {saved}, and this run has {} ranks of {} stages: a \
                 pipelined state whose stages are sharded resumes on the same pp_size, with any number of \
                 data-parallel replicas; set pp_size as the saving run did",
                loaded.dir().display(),
                loaded.saved_num_processes(),
                self.num_processes(),
                stages.layout.stages
            )));
        }
        // Under tensor parallelism each rank's records hold its slices, which the manifest lists: another tp_size
        // or number of ranks re-cuts them, each rank reading its own from the saved files one tensor at a time.
        if let Some(scaler) = loaded.scaler() {
            self.step.precision().restore_scaler(scaler);
        }
        Ok(loaded)
    }

    /// How many times a launcher restarted this job after a failure: 0 on the first run, `k` on the `k`-th
    /// restart of `burn-accelerate launch --max-restarts` (or torchrun's).
    pub fn restart_count(&self) -> usize {
        self.config().recovery.restart_count
    }

    /// Whether [`resume`](Self::resume) continues from a checkpoint: the run asked for it
    /// ([`resume_from_latest`](crate::AcceleratorBuilder::resume_from_latest)), or a launcher restarted it.
    pub fn resumes(&self) -> bool {
        self.config().recovery.resume_from_latest || self.restart_count() > 0
    }

    /// Loads the latest complete automatic checkpoint when this run [`resumes`](Self::resumes) and one exists;
    /// `None` otherwise (a first run, or a restart before the first save: training starts from scratch). A
    /// checkpoint whose save was interrupted is never complete, so it is never the one resumed from. Call it on
    /// every rank, after preparing, where `load_state` would go; restore the parts from the returned state as
    /// after [`load_state`](Self::load_state). The main process picks the folder, so every rank loads the same.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, ProjectConfiguration, StateToSave};
    ///
    /// let dir = std::env::temp_dir().join(format!("doc-resume-{}", std::process::id()));
    /// let project = ProjectConfiguration::new(&dir);
    /// let first = Accelerator::builder().project_configuration(project.clone()).build()?;
    /// assert!(first.resume()?.is_none(), "a first run starts from scratch");
    /// first.save_state(None, &StateToSave::new())?;
    ///
    /// // A restarted job (the launcher sets ACCELERATE_RESTART_COUNT), or one asked to resume:
    /// let again = Accelerator::builder().project_configuration(project).resume_from_latest(true).build()?;
    /// let state = again.resume()?.expect("the checkpoint just saved");
    /// assert!(state.dir().ends_with("checkpoint_0"));
    /// state.finish()?;
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`load_state`](Self::load_state); asking to resume ([`resume_from_latest`]) without a project folder.
    ///
    /// [`resume_from_latest`]: crate::AcceleratorBuilder::resume_from_latest
    pub fn resume(&self) -> Result<Option<LoadedState>> {
        if !self.resumes() {
            return Ok(None);
        }
        let project = self.project_configuration();
        if project.checkpoints_dir().is_none() {
            if self.config().recovery.resume_from_latest {
                return Err(crate::Error::InvalidArgument(
                    "resume: resume_from_latest(true) continues from the latest automatic checkpoint of the \
                     project folder, but none is set; build the accelerator with \
                     `.project_configuration(ProjectConfiguration::new(dir))`"
                        .into(),
                ));
            }
            if self.is_main_process() {
                crate::notice::warn_visibly(&format!(
                    "restart {} of this job starts from scratch: it keeps no checkpoints (set a project folder \
                     and call save_state(None) to resume from the last one)",
                    self.restart_count()
                ));
            }
            return Ok(None);
        }
        let latest = project.checkpoints().pop().map(|(_, dir)| dir);
        let latest = self.broadcast_object(&latest, 0)?;
        let restart = match self.restart_count() {
            0 => String::new(),
            k => format!(" (restart {k})"),
        };
        let Some(dir) = latest else {
            if self.is_main_process() {
                log::info!(
                    "no checkpoint to resume from yet{restart}: training starts from scratch"
                );
            }
            return Ok(None);
        };
        if self.is_main_process() {
            log::info!("resuming from {}{restart}", dir.display());
        }
        self.load_state(Some(&dir)).map(Some)
    }
}

/// Under a pipeline, every parameter's split as the stage that trains it saved it, with the ranks of that stage
/// as the only files holding its parts: each stage splits its own blocks, holds the others' as empty
/// placeholders, and, sharded, keeps stale slices of the embeddings or head that another stage trains; a load on
/// another number of data-parallel replicas then reads each parameter from its stage's files alone. (A
/// collective: every rank passes its own `splits`.)
fn every_stage_splits(
    accelerator: &Accelerator,
    stages: &crate::pipeline_parallel::Stages,
    splits: Vec<crate::checkpoint::repartition::SavedSplit>,
) -> Result<Vec<crate::checkpoint::repartition::SavedSplit>> {
    let mine: Vec<_> = splits
        .into_iter()
        .map(|split| {
            let held = split.dims.iter().product::<usize>() > 0;
            let trains = stages
                .trains_here(burn::module::ParamId::from(split.id))
                .unwrap_or(held);
            (split, held && trains)
        })
        .collect();
    let ranks = stages.stage_ranks;
    let mut by_id: std::collections::BTreeMap<
        u64,
        (crate::checkpoint::repartition::SavedSplit, bool),
    > = Default::default();
    for (rank, splits) in accelerator.gather_object(&mine)?.into_iter().enumerate() {
        let stage = rank / ranks;
        for (mut split, trains) in splits {
            if trains {
                split.holders = Some(stage * ranks..(stage + 1) * ranks);
            }
            match by_id.get(&split.id) {
                Some((_, true)) => {}
                _ if trains => {
                    by_id.insert(split.id, (split, true));
                }
                None => {
                    by_id.insert(split.id, (split, false));
                }
                Some(_) => {}
            }
        }
    }
    Ok(by_id.into_values().map(|(split, _)| split).collect())
}
