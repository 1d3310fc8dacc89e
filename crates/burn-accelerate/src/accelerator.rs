//! The [`Accelerator`]: the one object a training loop talks to. It is a facade: each call forwards to the
//! focused module that owns the concern (process state, placement, gradients, optimizer, data, logging).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::Duration;

use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::{Backend, DeviceRequest, select_device};
use crate::checkpoint::{
    Checkpointable, LoadOptions, LoadReport, LoadedState, ProjectConfiguration, StateToSave,
};
use crate::comm::{Communicator, ReduceOp};
use crate::config::{AcceleratorConfig, LossNormalization};
use crate::data::prepared_cursor::LoaderCursor;
use crate::data::{DataLoader, PreparedDataLoader, ShardSpec};
use crate::error::{Error, Result};
use crate::grad::{self, NormType};
use crate::ops;
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler, SchedulerRule};
use crate::placement::ToDevice;
use crate::precision::{self, CastFloats, LossScaler, MixedPrecision};
use crate::state::{DistributedType, ProcessState};
use crate::step_state::{GradientState, SharedStep};
use crate::sys;

/// Builds an [`Accelerator`]. Every setting not given here comes from the `ACCELERATE_*` environment variables,
/// else from the defaults of [`AcceleratorConfig`].
#[derive(Default, Clone)]
pub struct AcceleratorBuilder {
    device: DeviceRequest,
    device_placement: Option<bool>,
    step_scheduler_with_optimizer: Option<bool>,
    split_batches: Option<bool>,
    gradient_accumulation_steps: Option<usize>,
    debug: Option<bool>,
    collective_timeout: Option<Duration>,
    even_batches: Option<bool>,
    mixed_precision: Option<MixedPrecision>,
    loss_scaler: Option<LossScaler>,
    sync_each_batch: Option<bool>,
    loss_normalization: Option<LossNormalization>,
    bucket_size_mb: Option<f64>,
    project: Option<ProjectConfiguration>,
}

impl AcceleratorBuilder {
    /// Runs on this device (autodiff is switched on for it).
    pub fn device(mut self, device: Device) -> Self {
        self.device.device = Some(device);
        self
    }

    /// Runs on this backend's device for the local rank.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.device.backend = Some(backend);
        self
    }

    /// Forces a CPU backend (like `ACCELERATE_USE_CPU=1`).
    pub fn cpu(mut self, cpu: bool) -> Self {
        self.device.cpu = cpu;
        self
    }

    /// Whether models and batches are placed on the accelerator's device (default `true`). With `false`, place
    /// them yourself on [`Accelerator::device`].
    pub fn device_placement(mut self, on: bool) -> Self {
        self.device_placement = Some(on);
        self
    }

    /// Whether prepared schedulers follow the optimizer (default `true`); with `false` each
    /// `scheduler.step()` advances the schedule once, whatever the optimizer did.
    pub fn step_scheduler_with_optimizer(mut self, on: bool) -> Self {
        self.step_scheduler_with_optimizer = Some(on);
        self
    }

    /// Split each batch between ranks instead of giving every rank a batch of its own (default `false`).
    pub fn split_batches(mut self, on: bool) -> Self {
        self.split_batches = Some(on);
        self
    }

    /// Micro-batches per optimizer step (default 1).
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.gradient_accumulation_steps = Some(steps);
        self
    }

    /// Whether prepared dataloaders complete their last round by cycling samples from the start of the epoch, so
    /// that every rank gets the same number of full batches (default `true`). With `false`, ranks may get
    /// different numbers of batches, and collectives in the loop can then fail.
    pub fn even_batches(mut self, on: bool) -> Self {
        self.even_batches = Some(on);
        self
    }

    /// Precision of the forward pass inside [`Accelerator::autocast`] (default `no`;
    /// `ACCELERATE_MIXED_PRECISION`). fp16 adds dynamic loss scaling.
    pub fn mixed_precision(mut self, precision: MixedPrecision) -> Self {
        self.mixed_precision = Some(precision);
        self
    }

    /// The fp16 loss scaler's settings (torch's `GradScaler` defaults otherwise).
    pub fn loss_scaler(mut self, scaler: LossScaler) -> Self {
        self.loss_scaler = Some(scaler);
        self
    }

    /// All-reduce gradients after every micro-batch, not only on sync steps (default `false`).
    pub fn sync_each_batch(mut self, on: bool) -> Self {
        self.sync_each_batch = Some(on);
        self
    }

    /// How accumulated gradients are normalised (default [`LossNormalization::ActualMicroBatches`]).
    pub fn loss_normalization(mut self, normalization: LossNormalization) -> Self {
        self.loss_normalization = Some(normalization);
        self
    }

    /// Where `save_state` puts automatic checkpoints (Accelerate's `project_config`).
    pub fn project_configuration(mut self, project: ProjectConfiguration) -> Self {
        self.project = Some(project);
        self
    }

    /// Size of one gradient all-reduce bucket, in MiB (default 25).
    pub fn bucket_size_mb(mut self, mib: f64) -> Self {
        self.bucket_size_mb = Some(mib);
        self
    }

    /// Debug mode: before every collective, ranks compare the operation and tensor shapes, so that a mismatch
    /// is an error on every rank instead of a hang (like `ACCELERATE_DEBUG_MODE=1`). Costs one small exchange per
    /// collective.
    pub fn debug(mut self, on: bool) -> Self {
        self.debug = Some(on);
        self
    }

    /// How long a collective waits for the other ranks before failing with an error that names the missing
    /// ranks (default 300 s; `ACCELERATE_COLLECTIVE_TIMEOUT=<seconds>`).
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.collective_timeout = Some(timeout);
        self
    }

    /// Resolves the configuration, picks the device and creates the accelerator.
    ///
    /// # Errors
    /// An invalid setting or environment variable, or a requested backend that is not compiled in.
    pub fn build(self) -> Result<Accelerator> {
        let config = self.resolve()?;
        let (comm, local_rank) = crate::launch::process_comm(&config)?;
        self.build_rank(config, comm, local_rank)
    }

    /// Runs `f` on `num_processes` ranks, one thread each, every one with its own accelerator (Accelerate's
    /// `notebook_launcher`/`debug_launcher`). Rank `i` gets device `i` when the backend has several devices,
    /// else the backend's device. Returns every rank's result in rank order, or the error that caused the
    /// failure (a panic, or the first rank's own error rather than the errors it caused on the others).
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// let ranks = Accelerator::builder().launch(3, |acc| Ok(acc.process_index()))?;
    /// assert_eq!(ranks, vec![0, 1, 2]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn launch<T, F>(self, num_processes: usize, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Accelerator) -> Result<T> + Send + Sync,
    {
        crate::launch::run(self, num_processes, f)
    }

    /// The configuration: builder values over environment variables over defaults.
    pub(crate) fn resolve(&self) -> Result<AcceleratorConfig> {
        let mut config = AcceleratorConfig::from_file_and_env()?;
        if let Some(v) = self.device_placement {
            config.device_placement = v;
        }
        if let Some(v) = self.step_scheduler_with_optimizer {
            config.step_scheduler_with_optimizer = v;
        }
        if let Some(v) = self.split_batches {
            config.split_batches = v;
        }
        if let Some(v) = self.gradient_accumulation_steps {
            config.gradient_accumulation_steps = v;
        }
        if let Some(v) = self.debug {
            config.debug = v;
        }
        if let Some(v) = self.even_batches {
            config.even_batches = v;
        }
        if let Some(v) = self.mixed_precision {
            config.mixed_precision = v;
        }
        if let Some(v) = self.loss_scaler.clone() {
            config.loss_scaler = v;
        }
        if let Some(v) = self.sync_each_batch {
            config.sync_each_batch = v;
        }
        if let Some(v) = self.loss_normalization {
            config.loss_normalization = v;
        }
        if let Some(v) = self.bucket_size_mb {
            config.bucket_size_mb = v;
        }
        if let Some(v) = self.collective_timeout {
            config.collective_timeout_secs = v.as_secs_f64();
        }
        config.cpu |= self.device.cpu;
        config.validate()?;
        Ok(config)
    }

    /// The accelerator of the rank `comm` speaks for, `local_rank` on this machine.
    pub(crate) fn build_rank(
        &self,
        config: AcceleratorConfig,
        comm: Arc<dyn Communicator>,
        local_rank: usize,
    ) -> Result<Accelerator> {
        let request = DeviceRequest {
            cpu: config.cpu,
            ..self.device.clone()
        };
        let (device, backend) = select_device(&request, local_rank)?;
        config
            .mixed_precision
            .check(&device, |dtype| device.supports_dtype(dtype))?;
        let state = ProcessState::new(comm, local_rank, device.autodiff(), backend)
            .with_debug(config.debug);
        let accelerator = Accelerator::from_parts(Arc::new(state), config)?;
        *lock(&accelerator.project) = self.project.clone().unwrap_or_default();
        Ok(accelerator)
    }
}

/// The entry point of burn-accelerate: prepare your model, optimizer, scheduler and dataloaders with it, call
/// [`backward`](Self::backward) instead of `loss.backward()`, and the same loop runs on any device and, with the
/// distributed launchers, on any number of ranks.
///
/// ```
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::SgdConfig;
/// use burn::tensor::Tensor;
/// use burn_accelerate::Accelerator;
///
/// let accelerator = Accelerator::new()?;
/// let model: Linear = accelerator.prepare_model(LinearConfig::new(4, 1).init(accelerator.device()))?;
/// let mut optimizer = accelerator.prepare_optimizer(SgdConfig::new().init(), 0.1);
///
/// let x = Tensor::<2>::ones([8, 4], accelerator.device());
/// let loss = model.forward(x).powi_scalar(2).mean();
/// accelerator.backward(loss, &model)?;
/// let model = optimizer.step(model);
/// # let _ = model;
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
pub struct Accelerator {
    state: Arc<ProcessState>,
    config: AcceleratorConfig,
    step: SharedStep,
    trigger: std::sync::atomic::AtomicBool,
    project: std::sync::Mutex<ProjectConfiguration>,
    loaders: std::sync::Mutex<Vec<Arc<LoaderCursor>>>,
    objects: std::sync::Mutex<Vec<RegisteredObject>>,
}

impl fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accelerator")
            .field("process_index", &self.process_index())
            .field("num_processes", &self.num_processes())
            .field("device", self.device())
            .field("distributed_type", &self.distributed_type())
            .field("config", &self.config)
            .finish()
    }
}

impl Accelerator {
    /// An accelerator with every setting from the environment or the defaults.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// A builder to choose the device and settings.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    /// An accelerator for an already resolved rank.
    pub(crate) fn from_parts(state: Arc<ProcessState>, config: AcceleratorConfig) -> Result<Self> {
        state.install_for_thread();
        if state.is_main_process() {
            static KERNEL_CHECK: Once = Once::new();
            KERNEL_CHECK.call_once(|| {
                if let Some(warning) = sys::kernel_release()
                    .as_deref()
                    .and_then(sys::kernel_warning)
                {
                    log::warn!("{warning}");
                }
            });
        }
        let scaler =
            (config.mixed_precision == MixedPrecision::Fp16).then(|| config.loss_scaler.clone());
        let step = SharedStep::new(config.gradient_accumulation_steps, scaler);
        Ok(Self {
            state,
            config,
            step,
            trigger: std::sync::atomic::AtomicBool::new(false),
            project: std::sync::Mutex::new(ProjectConfiguration::default()),
            loaders: std::sync::Mutex::new(Vec::new()),
            objects: std::sync::Mutex::new(Vec::new()),
        })
    }

    // ----- who and where -------------------------------------------------------------------------------

    /// The device of this rank, with autodiff on.
    pub fn device(&self) -> &Device {
        self.state.device()
    }

    /// The resolved settings.
    pub fn config(&self) -> &AcceleratorConfig {
        &self.config
    }

    /// This rank's identity.
    pub fn state(&self) -> &ProcessState {
        &self.state
    }

    /// The global rank.
    pub fn process_index(&self) -> usize {
        self.state.process_index()
    }

    /// The rank on this machine.
    pub fn local_process_index(&self) -> usize {
        self.state.local_process_index()
    }

    /// The number of ranks.
    pub fn num_processes(&self) -> usize {
        self.state.num_processes()
    }

    /// The kind of run.
    pub fn distributed_type(&self) -> DistributedType {
        self.state.distributed_type()
    }

    /// Whether this is global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }

    /// Whether this is rank 0 on its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }

    /// Whether this is the last rank.
    pub fn is_last_process(&self) -> bool {
        self.state.is_last_process()
    }

    // ----- process control -----------------------------------------------------------------------------

    /// Prints `message` once per machine (on the local main process), like `accelerator.print`.
    /// Output errors (a closed pipe) are ignored rather than panicking.
    pub fn print(&self, message: impl fmt::Display) {
        if self.is_local_main_process() {
            use std::io::Write;
            let _ = writeln!(std::io::stdout().lock(), "{message}");
        }
    }

    /// Blocks until every rank reaches this call (immediate with one process).
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.state.wait_for_everyone()
    }

    /// Runs `f` on the main process first, then on the others (e.g. to download or preprocess once).
    pub fn main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let out = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(out)
    }

    /// Seeds the device's random generator (parameter initialisation, dropout, `Tensor::random`).
    /// With `device_specific`, rank `i` uses `seed + i` so that ranks draw different numbers.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let seed = if device_specific {
            seed.wrapping_add(self.process_index() as u64)
        } else {
            seed
        };
        self.device().seed(seed);
    }

    // ----- prepare -------------------------------------------------------------------------------------

    /// Prepares `model` for training: with several ranks, every rank gets rank 0's weights (so ranks start
    /// identical whatever their seeds); then the model is placed on the accelerator's device with autodiff on
    /// (unless device placement is off).
    pub fn prepare_model<M: Module>(&self, model: M) -> Result<M> {
        let model = if self.num_processes() > 1 {
            crate::grad::broadcast_params(&self.state, model)?
        } else {
            model
        };
        Ok(if self.config.device_placement {
            model.fork(self.device()).train()
        } else {
            model
        })
    }

    /// Wraps a Burn optimizer (`AdamConfig::new().init()`, ...) with its learning rate.
    pub fn prepare_optimizer(
        &self,
        optimizer: impl Into<ModuleOptimizer>,
        learning_rate: impl Into<ModuleLearningRate>,
    ) -> AcceleratedOptimizer {
        AcceleratedOptimizer::new(optimizer.into(), learning_rate.into(), self.step.clone())
    }

    /// Wraps a Burn scheduler and ties it to `optimizer`, whose learning rate it sets from now on.
    pub fn prepare_scheduler(
        &self,
        scheduler: impl Into<ModuleLrScheduler>,
        optimizer: &AcceleratedOptimizer,
    ) -> AcceleratedScheduler {
        let rule = SchedulerRule {
            step_with_optimizer: self.config.step_scheduler_with_optimizer,
            split_batches: self.config.split_batches,
            num_processes: self.num_processes(),
        };
        AcceleratedScheduler::new(scheduler.into(), optimizer, self.step.clone(), rule)
    }

    /// Prepares a dataloader: each rank gets its shard of every epoch (batch `i` goes to rank `i % P`, or every
    /// batch is split with `split_batches`), the shuffle seed is taken from rank 0 so that all ranks agree on
    /// the order, batches are built on the accelerator's device (unless device placement is off), and the
    /// accelerator tracks the end of each epoch.
    ///
    /// # Errors
    /// With `split_batches`, a batch size that the number of ranks does not divide; a failed seed exchange.
    pub fn prepare_dataloader<I, O>(
        &self,
        mut loader: DataLoader<I, O>,
    ) -> Result<PreparedDataLoader<I, O>> {
        if self.num_processes() > 1
            && let Some(seed) = loader.shuffle
        {
            loader.shuffle = Some(self.broadcast_object(&seed, 0)?);
        }
        let spec = ShardSpec {
            num_processes: self.num_processes(),
            rank: self.process_index(),
            split_batches: self.config.split_batches,
            even_batches: self.config.even_batches,
        };
        let device = self.config.device_placement.then(|| self.device().clone());
        let prepared = PreparedDataLoader::new(loader, device, self.step.clone(), spec)?;
        lock(&self.loaders).push(prepared.cursor());
        Ok(prepared)
    }

    /// Moves a batch (any [`ToDevice`] value) to the accelerator's device.
    pub fn to_device<T: ToDevice>(&self, value: T) -> T {
        value.to_device(self.device())
    }

    // ----- precision -------------------------------------------------------------------------------------

    /// The configured forward precision.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.config.mixed_precision
    }

    /// Runs `f` under autocast: with mixed precision on, `f` gets a copy of `model` whose float parameters are
    /// differentiable casts of the f32 originals and `inputs` with their float tensors cast, and its float
    /// outputs are cast back to f32. Gradients reach the f32 parameters of `model` (the master weights). With
    /// mixed precision off, `f(model, inputs)` runs unchanged.
    ///
    /// ```
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn::tensor::{DType, Tensor};
    /// use burn_accelerate::{Accelerator, MixedPrecision};
    ///
    /// let accelerator = Accelerator::builder().mixed_precision(MixedPrecision::Bf16).build()?;
    /// let model: Linear = accelerator.prepare_model(LinearConfig::new(4, 2).init(accelerator.device()))?;
    /// let x = Tensor::<2>::ones([3, 4], accelerator.device());
    /// let y = accelerator.autocast(&model, x, |m, x| {
    ///     assert_eq!(x.dtype(), DType::BF16); // computed in bf16
    ///     m.forward(x)
    /// });
    /// assert_eq!(y.dtype(), DType::F32); // handed back in f32
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn autocast<M: Module, I: CastFloats, O: CastFloats>(
        &self,
        model: &M,
        inputs: I,
        f: impl FnOnce(&M, I) -> O,
    ) -> O {
        match self.config.mixed_precision.dtype() {
            None => f(model, inputs),
            Some(dtype) => {
                let half = precision::cast_module(model, dtype);
                f(&half, inputs.cast_floats(dtype)).cast_floats(burn::tensor::FloatDType::F32)
            }
        }
    }

    /// The current fp16 loss scale (`None` unless fp16 is on).
    pub fn loss_scale(&self) -> Option<f64> {
        self.step.lock().scaler.as_ref().map(|s| s.scale)
    }

    /// The fp16 loss scaler's state (for checkpoints).
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        self.step.lock().scaler.clone()
    }

    /// Restores the fp16 loss scaler's state (from a checkpoint).
    pub fn set_loss_scaler(&self, scaler: LossScaler) -> Result<()> {
        scaler.validate()?;
        let mut state = self.step.lock();
        if state.scaler.is_none() {
            return Err(Error::InvalidArgument(format!(
                "set_loss_scaler: this accelerator runs with mixed_precision={}, which has no loss scaler",
                self.config.mixed_precision
            )));
        }
        state.scaler = Some(scaler);
        Ok(())
    }

    // ----- checkpoints -----------------------------------------------------------------------------------

    /// Returns the plain Burn module of a prepared model. A prepared model *is* a plain Burn module (there is
    /// no wrapper to strip), so this is the identity; it exists so that code ported from Accelerate reads the
    /// same.
    pub fn unwrap_model<M: Module>(&self, model: M) -> M {
        model
    }

    /// Saves `model`'s weights into `dir` in Hugging Face's layout: `model.safetensors`, or shards no larger
    /// than `max_shard_size` (`"10GB"`, `"500MB"`, `"1GiB"`) named `model-00001-of-0000N.safetensors` with
    /// `model.safetensors.index.json`; files of an earlier save that this one does not use are removed. With
    /// `safe_serialization` off, writes Burn's `model.bpk` instead (keeps parameter ids). Only the main process
    /// writes; call it on every rank.
    pub fn save_model<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
        safe_serialization: bool,
    ) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        let max = crate::checkpoint::parse_size(max_shard_size)?;
        let mut written = Vec::new();
        if self.is_main_process() {
            if safe_serialization {
                written = crate::checkpoint::weights::write_safetensors(model, dir, max)?;
            } else {
                written.push(crate::checkpoint::weights::write_burnpack(model, dir)?);
            }
        }
        self.wait_for_everyone()?;
        Ok(written)
    }

    /// Loads weights saved by [`save_model`](Self::save_model) or by Hugging Face tools (a `.safetensors`
    /// file, a folder, or an index) into `model`, matching parameters by path. Returns the model and what did
    /// not match (Accelerate does not report missing keys); with `options.strict`, any mismatch is an error.
    pub fn load_checkpoint_in_model<M: Module>(
        &self,
        model: M,
        path: impl AsRef<Path>,
        options: &LoadOptions,
    ) -> Result<(M, LoadReport)> {
        crate::checkpoint::weights::load_weights(model, path.as_ref(), options)
    }

    /// Registers a value to be saved by every `save_state` and restored by every `load_state`, under `name`
    /// (Accelerate's `register_for_checkpointing`). Any serde type works.
    pub fn register_for_checkpointing<T: Checkpointable + 'static>(
        &self,
        name: &str,
        value: Arc<std::sync::Mutex<T>>,
    ) -> Result<()> {
        let mut objects = lock(&self.objects);
        if objects.iter().any(|(n, _)| n == name) {
            return Err(Error::InvalidArgument(format!(
                "register_for_checkpointing: `{name}` is already registered; use one name per object"
            )));
        }
        objects.push((name.to_string(), value));
        Ok(())
    }

    /// The automatic-checkpoint settings.
    pub fn project_configuration(&self) -> ProjectConfiguration {
        lock(&self.project).clone()
    }

    /// Saves the training state into `dir`, or, with `None`, into the next automatic checkpoint
    /// (`project_dir/checkpoints/checkpoint_{iteration}`, keeping at most `total_limit`). Along with `parts`
    /// (models, optimizers, schedulers), it records the loss scaler, every prepared dataloader's position on
    /// every rank, and the registered objects. The folder appears only once complete. Call it on every rank.
    /// Returns the folder.
    pub fn save_state(&self, dir: Option<&Path>, parts: &StateToSave) -> Result<PathBuf> {
        let (dir, iteration, automatic) = {
            let project = lock(&self.project);
            match dir {
                Some(d) => (d.to_path_buf(), project.iteration, false),
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
                    (
                        root.join(format!("checkpoint_{}", project.iteration)),
                        project.iteration,
                        true,
                    )
                }
            }
        };
        if let Some(parent) = dir.parent()
            && self.is_main_process()
        {
            std::fs::create_dir_all(parent).map_err(|source| Error::Io {
                operation: "creating",
                path: parent.to_path_buf(),
                source,
            })?;
        }
        let objects = lock(&self.objects)
            .iter()
            .map(|(name, value)| Ok((name.clone(), lock(value).state_dict()?)))
            .collect::<Result<Vec<_>>>()?;
        let positions = lock(&self.loaders).iter().map(|c| c.position()).collect();
        let ctx = crate::checkpoint::state::SaveContext {
            state: &self.state,
            iteration,
            scaler: self.loss_scaler(),
            objects,
            positions,
        };
        crate::checkpoint::state::save(&dir, parts, ctx)?;
        if automatic {
            let mut project = lock(&self.project);
            project.iteration += 1;
            if let Some(limit) = project.total_limit
                && self.is_main_process()
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
        }
        self.wait_for_everyone()?;
        Ok(dir)
    }

    /// Loads a training state saved by [`save_state`](Self::save_state) from `dir`, or, with `None`, from the
    /// latest automatic checkpoint. The loss scaler, the prepared dataloaders' positions (the next `iter`
    /// resumes mid-epoch where the save happened), the registered objects and the automatic-naming iteration
    /// (so the next save does not overwrite it) are restored here; restore models, optimizers and schedulers
    /// from the returned [`LoadedState`], then call its `finish`.
    pub fn load_state(&self, dir: Option<&Path>) -> Result<LoadedState> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => {
                let project = lock(&self.project);
                let (_, latest) = project.checkpoints().pop().ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "load_state(None): no complete checkpoint under {:?}",
                        project.checkpoints_dir()
                    ))
                })?;
                latest
            }
        };
        let mut loaded = LoadedState::open(&dir, self.process_index(), self.num_processes())?;
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
        for (cursor, position) in loaders.iter().zip(loaded.positions()) {
            cursor.restore(*position);
        }
        drop(loaders);
        {
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
        }
        if let Some(scaler) = loaded.scaler() {
            let mut state = self.step.lock();
            if state.scaler.is_some() {
                state.scaler = Some(scaler.clone());
            }
        }
        lock(&self.project).iteration = loaded.iteration() + 1;
        Ok(loaded)
    }

    // ----- collectives ----------------------------------------------------------------------------------

    /// Concatenates every rank's tensor along dimension 0, in rank order; the first dimension may differ
    /// between ranks (no padding is left in the result). See [`ops::gather`](crate::ops::gather).
    pub fn gather<const D: usize, K: Basic>(&self, tensor: Tensor<D, K>) -> Result<Tensor<D, K>> {
        ops::gather(&self.state, tensor)
    }

    /// [`gather`](Self::gather) for evaluation: on the last batch of a prepared dataloader, the samples that
    /// `even_batches` repeated to fill the last round are dropped, so metrics see every sample exactly once.
    /// Pass per-sample tensors (first dimension = batch), not per-batch aggregates.
    pub fn gather_for_metrics<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
    ) -> Result<Tensor<D, K>> {
        let gathered = self.gather(tensor)?;
        match self.metrics_remainder() {
            Some(keep) if keep < gathered.dims()[0] => Ok(gathered.narrow(0, 0, keep)),
            _ => Ok(gathered),
        }
    }

    /// [`gather_for_metrics`](Self::gather_for_metrics) for per-sample values that are not tensors (labels,
    /// ids, strings): every rank's items, concatenated in rank order, without the repeated tail.
    pub fn gather_for_metrics_objects<T: Serialize + DeserializeOwned>(
        &self,
        items: &[T],
    ) -> Result<Vec<T>> {
        let mut all: Vec<T> = ops::gather_object_as::<[T], Vec<T>>(&self.state, items)?
            .into_iter()
            .flatten()
            .collect();
        if let Some(keep) = self.metrics_remainder() {
            all.truncate(keep);
        }
        Ok(all)
    }

    /// How many gathered samples to keep: the real samples of the last round, on the last batch only.
    fn metrics_remainder(&self) -> Option<usize> {
        let state = self.step.snapshot();
        match (state.end_of_dataloader, state.remainder) {
            (true, Some(r)) if r > 0 => Some(r),
            _ => None,
        }
    }

    /// Combines every rank's tensor with `op` (sum, mean, max, min); every rank gets the result.
    pub fn reduce<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>> {
        ops::reduce(&self.state, tensor, op)
    }

    /// Returns rank `from`'s tensor on every rank.
    pub fn broadcast<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        from: usize,
    ) -> Result<Tensor<D, K>> {
        ops::broadcast(&self.state, tensor, from)
    }

    /// Pads `tensor` along `dim` with `pad_value` to the largest size across ranks (after the data, or before
    /// it with `pad_first`).
    pub fn pad_across_processes<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        dim: usize,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor<D, K>> {
        ops::pad_across_processes(&self.state, tensor, dim, pad_value, pad_first)
    }

    /// Gathers one serializable value per rank, in rank order (unlike Accelerate, a single process also gets a
    /// one-element `Vec`, and lists are not flattened).
    pub fn gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        ops::gather_object(&self.state, value)
    }

    /// Returns rank `from`'s value on every rank.
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
        from: usize,
    ) -> Result<T> {
        ops::broadcast_object(&self.state, value, from)
    }

    /// This rank's share of `items` (contiguous; the first `len % num_processes` ranks get one more). With
    /// `apply_padding`, every rank gets the same count (shorter shares repeat their last item).
    pub fn split_between_processes<T: Clone>(&self, items: &[T], apply_padding: bool) -> Vec<T> {
        ops::split_between_processes(
            items,
            self.process_index(),
            self.num_processes(),
            apply_padding,
        )
    }

    /// Raises this rank's trigger (e.g. an early-stopping condition); [`check_trigger`](Self::check_trigger)
    /// reports it on every rank.
    pub fn set_trigger(&self) {
        self.trigger
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether any rank raised its trigger since the last check that fired; resets the triggers when it
    /// fires. A collective: every rank must call it at the same point.
    pub fn check_trigger(&self) -> Result<bool> {
        use std::sync::atomic::Ordering;
        let mine = i64::from(self.trigger.load(Ordering::Relaxed));
        let fired = match self
            .state
            .comm()
            .all_reduce(crate::comm::ReduceBuffer::I64(vec![mine]), ReduceOp::Max)?
        {
            crate::comm::ReduceBuffer::I64(v) => v.first().copied().unwrap_or(0) > 0,
            _ => false,
        };
        if fired {
            self.trigger.store(false, Ordering::Relaxed);
        }
        Ok(fired)
    }

    // ----- gradients -----------------------------------------------------------------------------------

    /// Marks the start of a micro-batch under gradient accumulation and returns whether it ends the window
    /// (Accelerate's `with accelerator.accumulate(model):`). Call it once per batch, before `backward`. The
    /// window ends every `gradient_accumulation_steps` batches and on the last batch of a prepared dataloader;
    /// on other batches `backward` only accumulates locally (no communication) and the optimizer does nothing.
    pub fn accumulate(&self) -> bool {
        let mut state = self.step.lock();
        if state.end_of_dataloader {
            state.step = 0;
            state.sync_gradients = true;
        } else {
            state.step += 1;
            state.sync_gradients = state.step.is_multiple_of(state.num_steps);
        }
        state.sync_gradients
    }

    /// Computes the gradients of `loss` with respect to `model`'s trainable parameters and adds them to the
    /// accelerator's gradient store, where the prepared optimizer finds them. On a step that synchronises
    /// gradients (every step without accumulation), the accumulated gradients are divided by the number of
    /// micro-batches in the window (see [`LossNormalization`]) and, with several ranks, averaged across ranks
    /// with bucketed all-reduces.
    ///
    /// # Errors
    /// When `loss` is not connected to an autodiff graph (the model was not prepared, or the loss was computed
    /// from detached tensors), or no parameter of `model` received a gradient.
    pub fn backward<const D: usize, M: Module>(&self, loss: Tensor<D>, model: &M) -> Result<()> {
        if !loss.is_tracked() {
            return Err(Error::InvalidArgument(
                "backward: the loss is not connected to any parameter that requires a gradient; prepare the \
                 model with `accelerator.prepare_model(model)` (or create it on `accelerator.device()`) and \
                 compute the loss from its output"
                    .into(),
            ));
        }
        let loss_scale = self.step.lock().scaler.as_ref().map(|s| s.scale);
        let loss = match loss_scale {
            Some(scale) => loss.mul_scalar(scale as f32),
            None => loss,
        };
        let mut grads = loss.backward();
        let mut state = self.step.lock();
        let before = state.buffer.len();
        state.buffer.collect(model, &mut grads);
        if state.buffer.len() == before && before == 0 {
            return Err(Error::InvalidArgument(
                "backward: none of the model's parameters received a gradient; pass the model the loss was \
                 computed with"
                    .into(),
            ));
        }
        state.window += 1;
        let syncing = state.sync_gradients;
        let world = self.num_processes();
        let communicate_now = syncing || (self.config.sync_each_batch && world > 1);
        if !communicate_now {
            return Ok(());
        }
        let mut scale = if !syncing {
            1.0
        } else {
            match self.config.loss_normalization {
                LossNormalization::ActualMicroBatches => 1.0 / state.window as f32,
                LossNormalization::Nominal => 1.0 / self.config.gradient_accumulation_steps as f32,
            }
        };
        if syncing {
            state.window = 0;
            // Undo the fp16 loss scaling on the sync step, before anything looks at the gradients.
            if let Some(loss_scale) = loss_scale {
                scale /= loss_scale as f32;
            }
        }
        if world > 1 {
            let params = grad::trainable_params(model);
            let bucket = (self.config.bucket_size_mb * 1024.0 * 1024.0) as usize;
            grad::all_reduce_mean(
                self.state.comm().as_ref(),
                &mut state.buffer,
                &params,
                scale,
                bucket,
            )?;
        } else if scale != 1.0 {
            state.buffer.scale_all(scale);
        }
        if syncing && loss_scale.is_some() {
            // An overflow on any rank reaches every rank through the averaged gradients, so all ranks agree.
            let ids = grad::param_ids(model);
            let found_inf = grad::has_non_finite(&mut state.buffer, &ids)?;
            state.found_inf = found_inf;
            if let Some(scaler) = state.scaler.as_mut() {
                scaler.update(found_inf);
            }
        }
        Ok(())
    }

    /// Clips the gradients of `model` so that their global L2 norm is at most `max_norm`; returns the norm
    /// before clipping (torch's `clip_grad_norm_`). Call it between `backward` and the optimizer step, usually
    /// when [`sync_gradients`](Self::sync_gradients) is true.
    pub fn clip_grad_norm<M: Module>(&self, model: &M, max_norm: f64) -> Result<f64> {
        self.clip_grad_norm_with(model, max_norm, NormType::L2)
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) with another norm.
    pub fn clip_grad_norm_with<M: Module>(
        &self,
        model: &M,
        max_norm: f64,
        norm_type: NormType,
    ) -> Result<f64> {
        let ids = grad::param_ids(model);
        grad::clip_grad_norm(&mut self.step.lock().buffer, &ids, max_norm, norm_type)
    }

    /// Clamps every gradient of `model` into `[-clip_value, clip_value]` (torch's `clip_grad_value_`).
    pub fn clip_grad_value<M: Module>(&self, model: &M, clip_value: f64) -> Result<()> {
        let ids = grad::param_ids(model);
        grad::clip_grad_value(&mut self.step.lock().buffer, &ids, clip_value)
    }

    /// The stored gradient of one parameter, in its shape (e.g. to inspect or log it).
    pub fn grad<const D: usize>(
        &self,
        param: &burn::module::Param<Tensor<D>>,
    ) -> Option<Tensor<D>> {
        self.step.lock().buffer.get::<D>(param.id)
    }

    /// Drops every stored gradient (the prepared optimizer does it after each step).
    pub fn zero_grad(&self) {
        self.step.lock().buffer.clear();
    }

    /// Whether the current micro-batch synchronises gradients and steps the optimizer.
    pub fn sync_gradients(&self) -> bool {
        self.step.lock().sync_gradients
    }

    /// The gradient-synchronisation state of the current step.
    pub fn gradient_state(&self) -> GradientState {
        self.step.snapshot()
    }

    /// Whether the latest optimizer step was skipped (fp16 overflow).
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.step.lock().optimizer_step_was_skipped
    }
}

/// An object registered for checkpointing, with its name.
type RegisteredObject = (String, Arc<std::sync::Mutex<dyn Checkpointable>>);

/// Locks a mutex, recovering from poisoning (the guarded values stay consistent between operations).
fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
