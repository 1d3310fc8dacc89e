//! The [`Accelerator`]: the one object a training loop talks to, and the [`AcceleratorBuilder`] that makes it.
//! It is a facade: each call forwards to the focused part that owns the concern — the rank's
//! [`ProcessGroup`] and the [`collectives`](crate::distributed::collectives), the step pipeline (precision,
//! distribution strategy, step window), the checkpointer, the dataloader preparation in
//! [`data`](crate::data) and placement. See the crate documentation's "How a step flows".
//!
//! Its methods are grouped by concern: identity, preparation, precision and gradients here; collectives,
//! checkpoints and memory in the files beside this one.

mod blocks;
mod builder;
mod checkpointing;
mod collectives;
#[doc(hidden)]
pub mod internals;
mod memory;
mod prepare;
mod tensor_parallel;
mod settings_applied;
mod tracking;

pub use builder::{AcceleratorBuilder, launch};
pub(crate) use settings_applied::SettingsApplied;

use std::fmt;
use std::sync::{Arc, Mutex, Once};

use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};

use crate::backend::ToDevice;
use crate::backend::sys;
use crate::checkpoint::{Checkpointer, ProjectConfiguration};
use crate::config::AcceleratorConfig;
use crate::data::{DataLoader, PreparedDataLoader};
use crate::distributed::collectives::Trigger;
use crate::distributed::mesh::Mesh;
use crate::distributed::{DistributedType, ProcessGroup};
use crate::error::Result;
use crate::grad::{self, GradientState, NormType};
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler, SchedulerPolicy};
use crate::parallelize::Parallelized;
use crate::precision::{self, CastFloats, LossScaler, MixedPrecision};
use crate::step::StepPipeline;
use crate::tracking::{LogWith, Trackers};

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
    group: Arc<ProcessGroup>,
    /// The mesh: its dimensions, this rank's place, and its data-parallel group (the ranks that read different
    /// data: every rank, or under a pipeline the ranks of this rank's stage).
    mesh: Mesh,
    config: AcceleratorConfig,
    /// The step pipeline: every backward's path to the optimizer step.
    step: StepPipeline,
    /// This rank's pipeline stage, under pipeline parallelism (`pp_size` > 1): what `backward_batch` and
    /// `forward_batch` run, built with the accelerator.
    stage: Option<Arc<crate::pipeline_parallel::Stages>>,
    /// This rank's tensor-parallel strategy, under tensor parallelism (`tp_size` > 1).
    tensor: Option<Arc<crate::tensor_parallel::strategy::TensorParallel>>,
    checkpointer: Checkpointer,
    trigger: Trigger,
    trackers: Mutex<Trackers>,
    applied: SettingsApplied,
}

/// `model` with every float parameter carrying `device`'s gradient-checkpointing strategy (Burn's
/// `autodiff_checkpointing` setting): Burn refuses an operation between tensors of different strategies, and a
/// parameter made before the setting, or moved by `fork` to an equal device, keeps its own.
fn with_device_checkpointing<M: Module>(model: M, device: &Device) -> M {
    struct Align(burn::tensor::GradientCheckpointingStrategy);
    impl burn::module::ModuleMapper for Align {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            let strategy = self.0;
            param.map(|t| {
                if t.is_autodiff() && t.gradient_checkpointing_strategy() != Some(strategy) {
                    t.with_gradient_checkpointing_strategy(strategy)
                } else {
                    t
                }
            })
        }
    }
    match device.gradient_checkpointing_strategy() {
        Some(strategy) => model.map(&mut Align(strategy)),
        None => model,
    }
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
        group: Arc<ProcessGroup>,
        config: AcceleratorConfig,
        project: ProjectConfiguration,
        log_with: Vec<LogWith>,
        parallelized: Parallelized,
    ) -> Result<Self> {
        group.install_for_thread();
        if group.is_main_process() {
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
        log::debug!(
            "rank {} of {}: training distributed by {}",
            group.process_index(),
            group.num_processes(),
            parallelized.strategy.name()
        );
        let Parallelized {
            mesh,
            strategy,
            stages,
            tensor,
            context,
        } = parallelized;
        // This thread's tensor-parallel modules talk over this rank's group (none: every module whole), and its
        // attention over its context group (none: every sequence whole).
        crate::tensor_parallel::context::install(tensor.as_ref().map(|t| t.context.clone()));
        crate::context_parallel::group::install(context);
        Ok(Self {
            trackers: Mutex::new(Trackers::new(log_with, project.project_dir.as_deref())),
            step: StepPipeline::new(&config, strategy),
            stage: stages,
            tensor,
            checkpointer: Checkpointer::new(project),
            trigger: Trigger::default(),
            applied: SettingsApplied::default(),
            group,
            mesh,
            config,
        })
    }

    // ----- who and where -------------------------------------------------------------------------------

    /// The device of this rank, with autodiff on.
    pub fn device(&self) -> &Device {
        self.group.device()
    }

    /// The resolved settings.
    pub fn config(&self) -> &AcceleratorConfig {
        &self.config
    }

    /// This rank's process group: its identity, device and communicator.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The shared handle of this rank's process group (what strategies and transports hold).
    pub(crate) fn group_arc(&self) -> Arc<ProcessGroup> {
        self.group.clone()
    }

    /// The step pipeline (for the Learner strategy and the benchmarks).
    pub(crate) fn step(&self) -> &StepPipeline {
        &self.step
    }

    /// This rank's pipeline stage, under pipeline parallelism.
    pub(crate) fn stage(&self) -> Option<&Arc<crate::pipeline_parallel::Stages>> {
        self.stage.as_ref()
    }

    /// The global rank.
    pub fn process_index(&self) -> usize {
        self.group.process_index()
    }

    /// The rank on this machine.
    pub fn local_process_index(&self) -> usize {
        self.group.local_process_index()
    }

    /// The number of ranks.
    pub fn num_processes(&self) -> usize {
        self.group.num_processes()
    }

    /// The kind of run: `FSDP` when several ranks shard the training state, as Accelerate says.
    pub fn distributed_type(&self) -> DistributedType {
        match self.group.distributed_type() {
            DistributedType::No => DistributedType::No,
            launched => self.step.strategy().distributed_type(launched),
        }
    }

    /// How training is distributed on this rank, in words: `single device`, `data parallel over host
    /// all-reduce`, `data parallel over device collectives (NCCL)`, `sharded data parallel (SHARD_GRAD_OP) over
    /// host reduce and broadcast`, `sharded data parallel (FULL_SHARD) over device exchange (in-process ranks
    /// sharing one device)`. The main process also logs the transport and why it was chosen.
    pub fn strategy_name(&self) -> String {
        self.step.strategy().name()
    }

    /// How many values (tensor elements) this rank's collectives and messages have passed through host memory so
    /// far: gradients, parameters and results of `reduce` or `gather` copied out of the device and back. Read it
    /// before and after a step to see what the step copies: 0 where every exchange stays on the device (in-process
    /// ranks sharing one device), the parameters or gradients where they go through host memory.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, GradientTransport, ReduceOp};
    /// use burn::tensor::Tensor;
    ///
    /// let through_host = |transport| {
    ///     Accelerator::builder().gradient_transport(transport).launch(2, |acc| {
    ///         let before = acc.host_values();
    ///         let x = Tensor::<1>::ones([1000], acc.device());
    ///         acc.reduce(x, ReduceOp::Sum)?;
    ///         Ok(acc.host_values() - before)
    ///     })
    /// };
    /// // A user's `reduce` goes through host memory; so do 1000 values of it on each rank.
    /// assert_eq!(through_host(GradientTransport::Host)?, vec![1000, 1000]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn host_values(&self) -> u64 {
        self.process_group().host_values()
    }

    /// Whether this is global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.group.is_main_process()
    }

    /// Whether this is rank 0 on its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.group.is_local_main_process()
    }

    /// Whether this is the last rank.
    pub fn is_last_process(&self) -> bool {
        self.group.is_last_process()
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
        self.group.wait_for_everyone()
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
    /// With `device_specific`, rank `i` uses `seed + i` so that ranks draw different numbers. The
    /// tensor-parallel modules' dropout ([`tensor_parallel::dropout`](crate::tensor_parallel::dropout())) takes
    /// `seed` itself: the ranks of a tensor-parallel group draw the same masks where the model is whole.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        crate::tensor_parallel::manual_seed(seed);
        let seed = if device_specific {
            seed.wrapping_add(self.process_index() as u64)
        } else {
            seed
        };
        self.device().seed(seed);
    }

    // ----- prepare -------------------------------------------------------------------------------------

    /// `model` with every parameter whole on this rank, for the forward and backward pass.
    ///
    /// Under [`ShardingStrategy::FullShard`](crate::ShardingStrategy::FullShard) a prepared model holds only this
    /// rank's dim-0 slice of each parameter between steps; `unshard` all-gathers the slices (every
    /// rank must call it, in the same order). Under any other sharding every rank holds the whole model and
    /// this is a cheap clone, so a loop written with it runs unchanged in every mode:
    ///
    /// ```text
    /// let whole = accelerator.unshard(&model)?;
    /// let loss = whole.forward(batch);
    /// accelerator.backward(loss, &whole)?;      // gradients reduce-scattered: this rank keeps its slices
    /// model = optimizer.try_step(model)?;       // steps this rank's slices; SHARD_GRAD_OP gathers them again
    /// ```
    ///
    /// Pass the whole model to `backward`; drop it after the step, or it keeps the other ranks' parameters
    /// alive. Burn's autodiff graph holds every parameter used in the forward pass until the backward pass, so
    /// with `unshard` the peak holds the whole parameters and gradients; between steps only this rank's. For a
    /// model made of blocks, [`backward_blocks`](Self::backward_blocks) gathers one block at a time instead, and
    /// the peak holds this rank's share.
    ///
    /// Under tensor parallelism the layers a plan split are gathered whole from the tensor-parallel group too: the
    /// whole model, for a digest, a save or an evaluation (its modules then run whole, without collectives). Train
    /// the prepared model itself, through `backward` or `backward_blocks`.
    ///
    /// # Errors
    /// A failed all-gather (a rank died, a timeout).
    pub fn unshard<M: Module>(&self, model: &M) -> Result<M> {
        let model = self.step.unshard(model)?;
        match &self.tensor {
            // Each tensor-parallel rank's slices gathered whole.
            Some(tensor) => tensor.gather_whole(model),
            None => Ok(model),
        }
    }

    /// Wraps a Burn optimizer (`AdamConfig::new().init()`, ...) with its learning rate.
    pub fn prepare_optimizer(
        &self,
        optimizer: impl Into<ModuleOptimizer>,
        learning_rate: impl Into<ModuleLearningRate>,
    ) -> AcceleratedOptimizer {
        let shared = self.step.shared().clone();
        let strategy = self.step.strategy().clone();
        let type_name = std::any::type_name_of_val(&optimizer);
        let kinds = (
            crate::optim::optimizer_kind(type_name),
            crate::optim::whole_tensor_kind(type_name),
        );
        AcceleratedOptimizer::new(
            optimizer.into(),
            learning_rate.into(),
            shared,
            strategy,
            kinds,
        )
    }

    /// Wraps a Burn scheduler and ties it to `optimizer`, whose learning rate it sets from now on. It advances
    /// once per optimizer step by default, on any number of ranks, so a schedule sized in optimizer steps of the
    /// prepared dataloader (`epochs * train.len()`) ends with the training;
    /// [`SchedulerRule::Accelerate`](crate::SchedulerRule::Accelerate) restores Accelerate's rule.
    pub fn prepare_scheduler(
        &self,
        scheduler: impl Into<ModuleLrScheduler>,
        optimizer: &AcceleratedOptimizer,
    ) -> AcceleratedScheduler {
        let steps = self.scheduler_steps_per_optimizer_step();
        let rule = SchedulerPolicy {
            step_with_optimizer: self.config.scheduler.step_scheduler_with_optimizer,
            steps_per_optimizer_step: steps,
        };
        let shared = self.step.shared().clone();
        AcceleratedScheduler::new(scheduler.into(), optimizer, shared, rule)
    }

    /// How many times schedulers advance per optimizer step on this run (see
    /// [`SchedulerRule`](crate::SchedulerRule)); warns once, on the main process, when Accelerate's rule makes a
    /// schedule run faster than on one process for a program that divides its global batch.
    pub(crate) fn scheduler_steps_per_optimizer_step(&self) -> usize {
        let steps = self
            .config
            .scheduler
            .scheduler_rule
            // The ranks that read different batches (under a pipeline, the replicas).
            .steps_per_optimizer_step(self.mesh.dp.num_processes(), self.config.data.split_batches);
        if steps > 1 && self.is_main_process() {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                log::warn!(
                    "schedulers advance {steps} times per optimizer step (SchedulerRule::Accelerate on {steps} \
                     ranks without split_batches): this keeps a 1-process schedule only when every rank takes \
                     the 1-process batch; a program that divides its global batch across ranks reaches the end \
                     of its schedule {steps} times too early (use the default SchedulerRule::OncePerOptimizerStep)"
                );
            });
        }
        steps
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
        // A pipeline's stages read the same batches: the shuffle seed of the run's rank 0 on every stage.
        if self.mesh.dp.num_processes() != self.num_processes()
            && let Some(seed) = loader.shuffle
        {
            loader.shuffle = Some(self.broadcast_object(&seed, 0)?);
        }
        let shared = self.step.shared().clone();
        let prepared = PreparedDataLoader::prepare(loader, &self.mesh.dp, &self.config, shared)?;
        self.checkpointer.track_loader(prepared.cursor());
        Ok(prepared)
    }

    /// Prepares a [`StreamLoader`](crate::data::StreamLoader), a dataset read in order without random access:
    /// every rank reads the stream and keeps its share, dealt as Accelerate's `IterableDatasetShard` deals it
    /// (see [`shard_stream`](crate::data::shard_stream)); batches are built on the accelerator's device, and the
    /// stream's end drives gradient accumulation and `gather_for_metrics` as a prepared dataloader's does.
    /// `save_state` records its position with the prepared dataloaders' (in the order they were prepared), and
    /// after `load_state` its next epoch skips the rounds already used.
    ///
    /// # Errors
    /// With `split_batches`, a batch size the ranks cannot divide.
    pub fn prepare_stream<I: Clone + 'static, O>(
        &self,
        loader: crate::data::StreamLoader<I, O>,
    ) -> Result<crate::data::PreparedStreamLoader<I, O>> {
        let spec = crate::data::ShardSpec {
            num_processes: self.mesh.dp.num_processes(),
            rank: self.mesh.dp.process_index(),
            split_batches: self.config.data.split_batches,
            even_batches: self.config.data.even_batches,
        };
        let prepared = crate::data::PreparedStreamLoader::new(
            loader,
            spec,
            self.device().clone(),
            self.step.shared().clone(),
            self.group.clone(),
        )?;
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
        self.config.precision.mixed_precision
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
        self.applied.note_autocast();
        precision::autocast(self.config.precision.mixed_precision, model, inputs, f)
    }

    /// Which settings were applied by their calls in the loop (for the Learner strategy).
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn settings_applied(&self) -> &SettingsApplied {
        &self.applied
    }

    /// The current fp16 loss scale (`None` unless fp16 is on).
    pub fn loss_scale(&self) -> Option<f64> {
        self.step.precision().loss_scale()
    }

    /// The fp16 loss scaler's state (for checkpoints).
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        self.step.precision().scaler().cloned()
    }

    /// Restores the fp16 loss scaler's state (from a checkpoint).
    pub fn set_loss_scaler(&self, scaler: LossScaler) -> Result<()> {
        self.step.precision().set_scaler(scaler)
    }

    // ----- gradients -----------------------------------------------------------------------------------

    /// Marks the start of a micro-batch under gradient accumulation and returns whether it ends the window
    /// (Accelerate's `with accelerator.accumulate(model):`). Call it once per batch, before `backward`. The
    /// window ends every `gradient_accumulation_steps` batches and on the last batch of a prepared dataloader;
    /// on other batches `backward` only accumulates locally (no communication) and the optimizer does nothing.
    pub fn accumulate(&self) -> bool {
        self.step.begin_micro_batch()
    }

    /// Computes the gradients of `loss` with respect to `model`'s trainable parameters and adds them to the
    /// accelerator's gradient store, where the prepared optimizer finds them. On a step that synchronises
    /// gradients (every step without accumulation), the accumulated gradients are divided by the number of
    /// micro-batches in the window (see [`LossNormalization`](crate::config::LossNormalization)) and, with several ranks, averaged across ranks
    /// with bucketed all-reduces.
    ///
    /// # Errors
    /// When `loss` is not connected to an autodiff graph (the model was not prepared, or the loss was computed
    /// from detached tensors), or no parameter of `model` received a gradient.
    pub fn backward<const D: usize, M: Module>(&self, loss: Tensor<D>, model: &M) -> Result<()> {
        self.applied.check(self);
        self.step.backward(loss, model)
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
        // A gradient held alike on several ranks of those the norm combines counts once.
        let strategy = self.step.strategy();
        let counted: Vec<_> = ids
            .iter()
            .copied()
            .filter(|id| strategy.counts_in_norm(*id))
            .collect();
        let total = self.step.total_norm();
        let mut core = self.step.shared().lock();
        let started = std::time::Instant::now();
        let norm = grad::clip_grad_norm_counting(
            &mut core.grads,
            (&ids, &counted),
            max_norm,
            norm_type,
            &total,
        );
        core.phases.gradient_sync += started.elapsed();
        norm
    }

    /// Clamps every gradient of `model` into `[-clip_value, clip_value]` (torch's `clip_grad_value_`). Under a
    /// sharded strategy each rank clamps the gradients it holds (a rank that owns no parameter holds none).
    pub fn clip_grad_value<M: Module>(&self, model: &M, clip_value: f64) -> Result<()> {
        let ids = grad::param_ids(model);
        let strategy = self.step.strategy();
        grad::clip_grad_value(
            &mut self.step.shared().lock().grads,
            &ids,
            clip_value,
            |operation| strategy.no_gradients_held(operation),
        )
    }

    /// The stored gradient of one parameter, in its shape (e.g. to inspect or log it).
    pub fn grad<const D: usize>(
        &self,
        param: &burn::module::Param<Tensor<D>>,
    ) -> Option<Tensor<D>> {
        self.step.shared().lock().grads.get::<D>(param.id)
    }

    /// Drops every stored gradient (the prepared optimizer does it after each step; the same as
    /// [`AcceleratedOptimizer::zero_grad`], for loops that take gradients without a prepared optimizer).
    pub fn zero_grad(&self) {
        self.step.shared().lock().grads.clear();
    }

    /// Whether the current micro-batch synchronises gradients and steps the optimizer.
    pub fn sync_gradients(&self) -> bool {
        self.step.shared().lock().state.sync_gradients()
    }

    /// The gradient-synchronisation state of the current step.
    pub fn gradient_state(&self) -> GradientState {
        self.step.shared().snapshot()
    }

    /// The time this rank spent in each phase of its training steps so far: backward, gradient sync, optimizer
    /// (see [`StepPhases`](crate::StepPhases)).
    pub fn step_phases(&self) -> crate::StepPhases {
        self.step.shared().lock().phases
    }

    /// Starts [`step_phases`](Self::step_phases) over from zero (after a warm-up, say).
    pub fn reset_step_phases(&self) {
        self.step.shared().lock().phases = crate::StepPhases::default();
    }

    /// Whether the latest optimizer step was skipped (fp16 overflow).
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.step.shared().lock().state.last_step_skipped()
    }
}
