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
    /// process writes; call it on every rank.
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
        let max = crate::checkpoint::parse_size(&options.max_shard_size)?;
        let write = || -> Result<Vec<PathBuf>> {
            let parent = crate::checkpoint::fs::parent_dir(dir);
            std::fs::create_dir_all(parent).map_err(crate::error::io("creating", parent))?;
            let _lock = crate::checkpoint::fs::FolderLock::acquire(parent, dir)?;
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

    /// Loads weights saved by [`save_model`](Self::save_model) or by Hugging Face tools (a `.safetensors`
    /// file, a folder, or an index) into `model`, matching parameters by path. The layout is the one the file
    /// records, else PyTorch's (what PyTorch and Hugging Face tools write); `options.layout` overrides it and
    /// `options.remap` renames the checkpoint's keys first (e.g. strip `model.`). Returns the model and what was
    /// renamed or did not match (Accelerate does not report missing keys); with `options.strict`, any mismatch
    /// is an error.
    pub fn load_checkpoint_in_model<M: Module>(
        &self,
        model: M,
        path: impl AsRef<Path>,
        options: &LoadOptions,
    ) -> Result<(M, LoadReport)> {
        crate::checkpoint::safetensors::load_weights(model, path.as_ref(), options)
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
    /// every rank, and the registered objects. The folder appears only once complete. Call it on every rank.
    /// Returns the folder.
    pub fn save_state(&self, dir: Option<&Path>, parts: &StateToSave) -> Result<PathBuf> {
        let scaler = self.loss_scaler();
        let optimizer_state = self.pipeline.strategy().optimizer_state();
        self.checkpointer
            .save_state(&self.group, dir, parts, scaler, optimizer_state)
    }

    /// Loads a training state saved by [`save_state`](Self::save_state) from `dir`, or, with `None`, from the
    /// latest automatic checkpoint. The loss scaler, the prepared dataloaders' positions (the next `iter`
    /// resumes mid-epoch where the save happened), the registered objects and the automatic-naming iteration
    /// (so the next save does not overwrite it) are restored here; restore models, optimizers and schedulers
    /// from the returned [`LoadedState`], then call its `finish`.
    pub fn load_state(&self, dir: Option<&Path>) -> Result<LoadedState> {
        let loaded = self.checkpointer.load_state(&self.group, dir)?;
        if let Some(scaler) = loaded.scaler() {
            self.pipeline.precision().restore_scaler(scaler);
        }
        Ok(loaded)
    }
}
