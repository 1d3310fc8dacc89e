//! The [`Accelerator`]: the one object a training loop talks to. It is a facade: each call forwards to the
//! focused part that owns the concern — the rank's [`ProcessState`], the [`StepPipeline`] (precision, gradient
//! sync, step state), the checkpointer, the dataloader preparation in [`data`](crate::data), placement and
//! the collectives in [`ops`](crate::ops). See the crate documentation's "How a step flows".

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};

use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::checkpoint::{
    Checkpointable, Checkpointer, LoadOptions, LoadReport, LoadedState, ProjectConfiguration,
    SaveOptions, StateToSave,
};
use crate::comm::ReduceOp;
use crate::config::AcceleratorConfig;
use crate::data::{DataLoader, PreparedDataLoader};
use crate::error::Result;
use crate::grad::step::StepPipeline;
use crate::grad::{self, GradientState, NormType};
use crate::ops::{self, Trigger};
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler, SchedulerRule};
use crate::placement::ToDevice;
use crate::precision::{self, CastFloats, LossScaler, MixedPrecision};
use crate::state::{DistributedType, ProcessState};
use crate::sys;

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
    pipeline: StepPipeline,
    checkpointer: Checkpointer,
    trigger: Trigger,
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
    /// An accelerator for an already resolved rank.
    pub(crate) fn from_parts(
        state: Arc<ProcessState>,
        config: AcceleratorConfig,
        project: ProjectConfiguration,
    ) -> Result<Self> {
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
        let bucket_bytes = (config.bucket_size_mb * 1024.0 * 1024.0) as usize;
        let sync = grad::sync::for_rank(&state, bucket_bytes);
        log::debug!(
            "rank {} of {}: gradients sync by {}",
            state.process_index(),
            state.num_processes(),
            sync.name()
        );
        Ok(Self {
            pipeline: StepPipeline::new(&config, sync),
            checkpointer: Checkpointer::new(project),
            trigger: Trigger::default(),
            state,
            config,
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
        let model = self.pipeline.broadcast_initial(model)?;
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
        let shared = self.pipeline.shared().clone();
        AcceleratedOptimizer::new(optimizer.into(), learning_rate.into(), shared)
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
        let shared = self.pipeline.shared().clone();
        AcceleratedScheduler::new(scheduler.into(), optimizer, shared, rule)
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
        loader: DataLoader<I, O>,
    ) -> Result<PreparedDataLoader<I, O>> {
        let shared = self.pipeline.shared().clone();
        let prepared = PreparedDataLoader::prepare(loader, &self.state, &self.config, shared)?;
        self.checkpointer.track_loader(prepared.cursor());
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
        precision::autocast(self.config.mixed_precision, model, inputs, f)
    }

    /// The current fp16 loss scale (`None` unless fp16 is on).
    pub fn loss_scale(&self) -> Option<f64> {
        self.pipeline.precision().loss_scale()
    }

    /// The fp16 loss scaler's state (for checkpoints).
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        self.pipeline.precision().scaler().cloned()
    }

    /// Restores the fp16 loss scaler's state (from a checkpoint).
    pub fn set_loss_scaler(&self, scaler: LossScaler) -> Result<()> {
        self.pipeline.precision().set_scaler(scaler)
    }

    // ----- memory ----------------------------------------------------------------------------------------

    /// Drops the stored gradients, forgets the current accumulation window and returns the device's cached
    /// memory (Accelerate's `free_memory`). Call it at the start of each attempt of a batch-size search, after
    /// dropping the previous attempt's model, optimizer and dataloader.
    pub fn free_memory(&self) {
        {
            let mut core = self.pipeline.shared().lock();
            core.grads.clear();
            core.state.reset_window();
        }
        crate::memory::release_memory(self.device());
    }

    /// Forces the device to finish computing `loss` and the stored gradients, and reports a failure there — on
    /// GPU backends an out-of-memory failure surfaces only when a result is read — before the optimizer step,
    /// so that a failed step never reaches the parameters. Costs one small read; call it between `backward`
    /// and `optimizer.step` inside a batch-size search.
    ///
    /// # Errors
    /// [`Error::Execution`](crate::Error::Execution) with the backend's message (check it with
    /// [`OutOfMemory::is_out_of_memory`](crate::memory::OutOfMemory)).
    pub fn check_step<const D: usize>(&self, loss: &Tensor<D>) -> Result<()> {
        let mut core = self.pipeline.shared().lock();
        let ids = core.grads.ids();
        grad::check_executed(&mut core.grads, &ids, loss.clone())
    }

    /// Runs `f` with a batch size from `starting_batch_size` down, shrinking it by 10% after each out-of-memory
    /// failure until `f` succeeds (Accelerate's `find_executable_batch_size`). With several ranks every rank tries
    /// the same sizes: an out-of-memory failure on any rank shrinks the batch for all. Every retry is logged.
    /// Use [`BatchSizeFinder`](crate::memory::BatchSizeFinder) for halving or a floor.
    ///
    /// # Errors
    /// `f`'s own error when it is not an out-of-memory failure; an error listing every size tried when even
    /// a batch of 1 runs out of memory. A collective: every rank calls it.
    pub fn find_executable_batch_size<T, E>(
        &self,
        starting_batch_size: usize,
        f: impl FnMut(usize) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, crate::memory::BatchSizeError<E>>
    where
        E: crate::memory::OutOfMemory + fmt::Display + From<crate::Error>,
    {
        crate::memory::BatchSizeFinder::new(starting_batch_size).run_on(self, f)
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
        let mut written = Vec::new();
        if self.is_main_process() {
            if options.safe_serialization {
                written = crate::checkpoint::weights::write_safetensors(
                    model,
                    dir,
                    max,
                    options.layout,
                    &options.remap,
                )?;
            } else {
                written.push(crate::checkpoint::weights::write_burnpack(model, dir)?);
            }
        }
        self.wait_for_everyone()?;
        Ok(written)
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
        crate::checkpoint::weights::load_weights(model, path.as_ref(), options)
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
        self.checkpointer
            .save_state(&self.state, dir, parts, scaler)
    }

    /// Loads a training state saved by [`save_state`](Self::save_state) from `dir`, or, with `None`, from the
    /// latest automatic checkpoint. The loss scaler, the prepared dataloaders' positions (the next `iter`
    /// resumes mid-epoch where the save happened), the registered objects and the automatic-naming iteration
    /// (so the next save does not overwrite it) are restored here; restore models, optimizers and schedulers
    /// from the returned [`LoadedState`], then call its `finish`.
    pub fn load_state(&self, dir: Option<&Path>) -> Result<LoadedState> {
        let loaded = self.checkpointer.load_state(&self.state, dir)?;
        if let Some(scaler) = loaded.scaler() {
            self.pipeline.precision().restore_scaler(scaler);
        }
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
        match self.gradient_state().samples_to_keep() {
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
        if let Some(keep) = self.gradient_state().samples_to_keep() {
            all.truncate(keep);
        }
        Ok(all)
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
        self.trigger.raise();
    }

    /// Whether any rank raised its trigger since the last check that fired; resets the triggers when it
    /// fires. A collective: every rank must call it at the same point.
    pub fn check_trigger(&self) -> Result<bool> {
        self.trigger.check(&self.state)
    }

    // ----- gradients -----------------------------------------------------------------------------------

    /// Marks the start of a micro-batch under gradient accumulation and returns whether it ends the window
    /// (Accelerate's `with accelerator.accumulate(model):`). Call it once per batch, before `backward`. The
    /// window ends every `gradient_accumulation_steps` batches and on the last batch of a prepared dataloader;
    /// on other batches `backward` only accumulates locally (no communication) and the optimizer does nothing.
    pub fn accumulate(&self) -> bool {
        self.pipeline.begin_micro_batch()
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
        self.pipeline.backward(loss, model)
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
        let grads = &mut self.pipeline.shared().lock().grads;
        grad::clip_grad_norm(grads, &ids, max_norm, norm_type)
    }

    /// Clamps every gradient of `model` into `[-clip_value, clip_value]` (torch's `clip_grad_value_`).
    pub fn clip_grad_value<M: Module>(&self, model: &M, clip_value: f64) -> Result<()> {
        let ids = grad::param_ids(model);
        grad::clip_grad_value(&mut self.pipeline.shared().lock().grads, &ids, clip_value)
    }

    /// The stored gradient of one parameter, in its shape (e.g. to inspect or log it).
    pub fn grad<const D: usize>(
        &self,
        param: &burn::module::Param<Tensor<D>>,
    ) -> Option<Tensor<D>> {
        self.pipeline.shared().lock().grads.get::<D>(param.id)
    }

    /// Drops every stored gradient (the prepared optimizer does it after each step).
    pub fn zero_grad(&self) {
        self.pipeline.shared().lock().grads.clear();
    }

    /// Whether the current micro-batch synchronises gradients and steps the optimizer.
    pub fn sync_gradients(&self) -> bool {
        self.pipeline.shared().lock().state.sync_gradients()
    }

    /// The gradient-synchronisation state of the current step.
    pub fn gradient_state(&self) -> GradientState {
        self.pipeline.shared().snapshot()
    }

    /// Whether the latest optimizer step was skipped (fp16 overflow).
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.pipeline.shared().lock().state.last_step_skipped()
    }
}
