//! The [`Accelerator`]: the one object a training loop talks to. It is a facade: each call forwards to the
//! focused module that owns the concern (process state, placement, gradients, optimizer, data, logging).

use std::fmt;
use std::sync::{Arc, Once};

use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};

use crate::backend::{Backend, DeviceRequest, select_device};
use crate::comm::SingleProcess;
use crate::config::AcceleratorConfig;
use crate::data::{DataLoader, PreparedDataLoader};
use crate::error::{Error, Result};
use crate::grad::{self, NormType};
use crate::optim::{AcceleratedOptimizer, AcceleratedScheduler, SchedulerRule};
use crate::placement::ToDevice;
use crate::state::{DistributedType, ProcessState};
use crate::step_state::{GradientState, SharedStep};
use crate::sys;

/// Builds an [`Accelerator`]. Every setting not given here comes from the `ACCELERATE_*` environment variables,
/// else from the defaults of [`AcceleratorConfig`].
#[derive(Default)]
pub struct AcceleratorBuilder {
    device: DeviceRequest,
    device_placement: Option<bool>,
    step_scheduler_with_optimizer: Option<bool>,
    split_batches: Option<bool>,
    gradient_accumulation_steps: Option<usize>,
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

    /// Resolves the configuration, picks the device and creates the accelerator.
    ///
    /// # Errors
    /// An invalid setting or environment variable, or a requested backend that is not compiled in.
    pub fn build(self) -> Result<Accelerator> {
        let mut config = AcceleratorConfig::from_env()?;
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
        config.cpu |= self.device.cpu;
        config.validate()?;
        let request = DeviceRequest {
            cpu: config.cpu,
            ..self.device
        };
        let comm = Arc::new(SingleProcess::default());
        let local_rank = 0;
        let (device, backend) = select_device(&request, local_rank)?;
        let state = Arc::new(ProcessState::new(
            comm,
            local_rank,
            device.autodiff(),
            backend,
        ));
        Accelerator::from_parts(state, config)
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
/// let model: Linear = accelerator.prepare_model(LinearConfig::new(4, 1).init(accelerator.device()));
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
        let step = SharedStep::new(config.gradient_accumulation_steps);
        Ok(Self {
            state,
            config,
            step,
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
    pub fn print(&self, message: impl fmt::Display) {
        if self.is_local_main_process() {
            println!("{message}");
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

    /// Places `model` on the accelerator's device, ready for training (autodiff on; with device placement off,
    /// the model is returned as is).
    pub fn prepare_model<M: Module>(&self, model: M) -> M {
        if self.config.device_placement {
            model.fork(self.device()).train()
        } else {
            model
        }
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

    /// Prepares a dataloader: batches are built on the accelerator's device (unless device placement is off)
    /// and the accelerator tracks the end of each epoch.
    pub fn prepare_dataloader<I, O>(&self, loader: DataLoader<I, O>) -> PreparedDataLoader<I, O> {
        let device = self.config.device_placement.then(|| self.device().clone());
        PreparedDataLoader::new(loader, device, self.step.clone())
    }

    /// Moves a batch (any [`ToDevice`] value) to the accelerator's device.
    pub fn to_device<T: ToDevice>(&self, value: T) -> T {
        value.to_device(self.device())
    }

    // ----- gradients -----------------------------------------------------------------------------------

    /// Computes the gradients of `loss` with respect to `model`'s trainable parameters and adds them to the
    /// accelerator's gradient store, where the prepared optimizer finds them. With gradient accumulation the loss
    /// is divided by the number of micro-batches.
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
        let steps = self.config.gradient_accumulation_steps;
        let loss = if steps > 1 {
            loss.div_scalar(steps as f32)
        } else {
            loss
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
