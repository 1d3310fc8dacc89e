//! [`AcceleratorBuilder`]: the settings of an [`Accelerator`], resolved from builder calls over `ACCELERATE_*`
//! environment variables over the config file over defaults, and the rank it runs as.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;

use crate::accelerator::Accelerator;
use crate::backend::{Backend, DeviceRequest, select_device};
use crate::checkpoint::ProjectConfiguration;
use crate::config::{
    AcceleratorConfig, GradientTransport, Key, LossNormalization, SchedulerRule, ShardingStrategy,
    Source,
};
use crate::distributed::ProcessGroup;
use crate::distributed::cluster::{self, ClusterEnvironment};
use crate::distributed::strategy::Strategy;
use crate::error::Result;
use crate::parallelize::Parallelized;
use crate::precision::{LossScaler, MixedPrecision};
use crate::tracking::{LogWith, Tracker, TrackerInit};

/// Builds an [`Accelerator`]. Every setting not given here comes from the `ACCELERATE_*` environment variables,
/// else from the defaults of [`AcceleratorConfig`].
#[derive(Default, Clone)]
pub struct AcceleratorBuilder {
    device: DeviceRequest,
    device_placement: Option<bool>,
    step_scheduler_with_optimizer: Option<bool>,
    split_batches: Option<bool>,
    scheduler_rule: Option<SchedulerRule>,
    gradient_accumulation_steps: Option<usize>,
    debug: Option<bool>,
    collective_timeout: Option<Duration>,
    even_batches: Option<bool>,
    mixed_precision: Option<MixedPrecision>,
    loss_scaler: Option<LossScaler>,
    sync_each_batch: Option<bool>,
    loss_normalization: Option<LossNormalization>,
    bucket_size_mb: Option<f64>,
    sharding: Option<ShardingStrategy>,
    dp_shard_size: Option<usize>,
    pp_size: Option<usize>,
    tp_size: Option<usize>,
    cp_size: Option<usize>,
    cp_comm_strategy: Option<crate::config::ContextAttention>,
    cp_load_balance: Option<bool>,
    pp_microbatches: Option<usize>,
    pp_schedule: Option<crate::config::PipelineSchedule>,
    pp_stage_blocks: Option<Vec<usize>>,
    fsdp_param_dtype: Option<crate::config::ShardDtype>,
    fsdp_reduce_dtype: Option<crate::config::ShardDtype>,
    activation_checkpointing: Option<bool>,
    autodiff_checkpointing: Option<bool>,
    gradient_transport: Option<GradientTransport>,
    resume_from_latest: Option<bool>,
    independent_processes: Option<bool>,
    sequence_parallel: Option<bool>,
    project: Option<ProjectConfiguration>,
    log_with: Vec<LogWith>,
    strategy: Option<StrategyFactory>,
}

/// Makes the distribution strategy of one rank (a test double, or a strategy chosen by a later setting).
pub(crate) type StrategyFactory =
    Arc<dyn Fn(&Arc<ProcessGroup>) -> Result<Arc<dyn Strategy>> + Send + Sync>;

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

    /// How many times schedulers advance per optimizer step (default [`SchedulerRule::OncePerOptimizerStep`];
    /// [`SchedulerRule::Accelerate`] restores Accelerate's `num_processes` times).
    pub fn scheduler_rule(mut self, rule: SchedulerRule) -> Self {
        self.scheduler_rule = Some(rule);
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

    /// Adds experiment trackers (Accelerate's `log_with`); call it again to add more. They start with
    /// [`Accelerator::init_trackers`] and write under the project configuration's `project_dir`. See
    /// [`tracking`](crate::tracking).
    pub fn log_with(mut self, trackers: LogWith) -> Self {
        self.log_with.push(trackers);
        self
    }

    /// Adds a tracker of your own, made by `factory` when the trackers start (on the main process only,
    /// unless the tracker's [`Tracker::main_process_only`] is `false`).
    pub fn log_with_tracker<F>(self, factory: F) -> Self
    where
        F: Fn(&TrackerInit) -> Result<Box<dyn Tracker>> + Send + Sync + 'static,
    {
        self.log_with(LogWith::Custom(Arc::new(factory)))
    }

    /// Size of one gradient all-reduce bucket, in MiB (default 25).
    pub fn bucket_size_mb(mut self, mib: f64) -> Self {
        self.bucket_size_mb = Some(mib);
        self
    }

    /// How much of the training state each rank holds (default [`ShardingStrategy::NoShard`]): with
    /// [`ShardGradOp`](ShardingStrategy::ShardGradOp) each rank keeps the reduced gradients and optimizer state of
    /// its own dim-0 slice of every parameter only (FSDP2's even slices); with
    /// [`FullShard`](ShardingStrategy::FullShard) its slices of the parameters too, between steps. Overrides the
    /// config file's `distributed_type: FSDP` and `FSDP_SHARDING_STRATEGY`.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, ShardingStrategy};
    /// use burn::nn::LinearConfig;
    /// use burn::optim::AdamConfig;
    /// use burn::tensor::Tensor;
    ///
    /// let states = Accelerator::builder()
    ///     .sharding(ShardingStrategy::ShardGradOp)
    ///     .launch(2, |acc| {
    ///         let model = acc.prepare_model(LinearConfig::new(8, 8).init(acc.device()))?;
    ///         let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    ///         let x = Tensor::<2>::ones([4, 8], acc.device());
    ///         acc.backward(acc.unshard(&model)?.forward(x).sum(), &model)?;
    ///         let _model = optimizer.try_step(model)?;
    ///         // Each rank steps 4 of the weight's 8 rows and 4 of the bias's 8 values: Adam's two moments of
    ///         // 36 f32 values.
    ///         optimizer.state_bytes()
    ///     })?;
    /// assert_eq!(states, vec![2 * 36 * 4, 2 * 36 * 4]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn sharding(mut self, strategy: ShardingStrategy) -> Self {
        self.sharding = Some(strategy);
        self
    }

    /// Ranks in each shard group of a hybrid strategy ([`ShardingStrategy::HybridShard`],
    /// [`HybridShardZero2`](ShardingStrategy::HybridShardZero2)): the state is sharded within groups of this many
    /// consecutive ranks and replicated across the groups (default: the processes of one machine;
    /// `PARALLELISM_CONFIG_DP_SHARD_SIZE`, as Accelerate's `ParallelismConfig.dp_shard_size`). It must divide the
    /// number of ranks.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, ShardingStrategy};
    /// // 4 ranks as 2 replicas of 2 shards: each rank holds half the optimizer state.
    /// let names = Accelerator::builder()
    ///     .sharding(ShardingStrategy::HybridShard)
    ///     .dp_shard_size(2)
    ///     .launch(4, |acc| Ok(acc.strategy_name()))?;
    /// assert!(names[0].contains("2 replicas of 2 shards"), "{}", names[0]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn dp_shard_size(mut self, ranks: usize) -> Self {
        self.dp_shard_size = Some(ranks);
        self
    }

    /// Pipeline stages: [`Accelerator::backward_batch`] cuts the model's blocks into this many contiguous stages,
    /// one per group of `world / pp_size` ranks, and runs each batch through them as micro-batches (default 1:
    /// no pipeline; `ACCELERATE_PP_SIZE`). It must divide the number of ranks; the ranks of one stage train it
    /// data-parallel under the [`sharding`](Self::sharding) strategy.
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// let layout = Accelerator::builder()
    ///     .pp_size(2)
    ///     .launch(4, |acc| Ok(acc.pipeline_layout()))?;
    /// assert_eq!(layout[3].stage, 1);
    /// assert_eq!(layout[3].replica, 1);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn pp_size(mut self, stages: usize) -> Self {
        self.pp_size = Some(stages);
        self
    }

    /// Tensor-parallel ranks: the layers a plan splits ([`Accelerator::prepare_tensor_parallel`]) are held in
    /// slices over groups of this many consecutive ranks, which read the same data; the groups train
    /// data-parallel (`NO_SHARD`) with each other (default 1; `PARALLELISM_CONFIG_TP_SIZE`). It must divide the
    /// number of ranks.
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// let places = Accelerator::builder()
    ///     .tp_size(2)
    ///     .launch(4, |acc| Ok(acc.mesh_coords()))?;
    /// assert_eq!((places[1].tp, places[2].tp), (1, 0));
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn tp_size(mut self, ranks: usize) -> Self {
        self.tp_size = Some(ranks);
        self
    }

    /// Context-parallel ranks (Accelerate's `cp_size`, torchtitan's `context_parallel_degree`; default 1;
    /// `PARALLELISM_CONFIG_CP_SIZE`): each sequence is cut over groups of this many ranks, which read the same
    /// batches and attend across each other through
    /// [`context_parallel::attention`](crate::context_parallel::attention); the groups' ranks join the
    /// data-parallel gradient reduction. It must divide the number of ranks.
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// let places = Accelerator::builder()
    ///     .cp_size(2)
    ///     .launch(4, |acc| Ok(acc.mesh_coords()))?;
    /// assert_eq!((places[1].cp, places[2].cp, places[2].dp_replicate), (1, 0, 1));
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn cp_size(mut self, ranks: usize) -> Self {
        self.cp_size = Some(ranks);
        self
    }

    /// How context parallelism's attention reaches the keys and values of the whole sequence (default
    /// [`ContextAttention::AllGather`](crate::config::ContextAttention); `PARALLELISM_CONFIG_CP_COMM_STRATEGY`).
    pub fn cp_comm_strategy(mut self, mode: crate::config::ContextAttention) -> Self {
        self.cp_comm_strategy = Some(mode);
        self
    }

    /// Head-tail load balance of context parallelism's causal attention (default `true`;
    /// `PARALLELISM_CONFIG_CP_LOAD_BALANCE`); see
    /// [`DistributedSettings::cp_load_balance`](crate::config::DistributedSettings::cp_load_balance).
    pub fn cp_load_balance(mut self, balanced: bool) -> Self {
        self.cp_load_balance = Some(balanced);
        self
    }

    /// Sequence parallelism under tensor parallelism (Megatron's `--sequence-parallel`; default `false`;
    /// `PARALLELISM_CONFIG_SEQUENCE_PARALLEL`): between the tensor-parallel regions each rank holds its part of
    /// the sequence (`[batch, seq / tp_size, d_model]`), all-gathered into each region and reduce-scattered out of
    /// its row-parallel layers, so that the norms', dropout's and residual adds' activations per rank fall with
    /// `tp_size`. The model's first activation comes out split from a [`ParallelEmbedding`] (and
    /// [`sequence_part`] for one's own additions, such as position embeddings); a parameter the plan keeps whole
    /// then sees this rank's part of the sequence, and its gradient is summed over the tensor-parallel ranks.
    ///
    /// [`ParallelEmbedding`]: crate::tensor_parallel::ParallelEmbedding
    /// [`sequence_part`]: crate::tensor_parallel::sequence_part
    pub fn sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = Some(on);
        self
    }

    /// Micro-batches each batch of [`Accelerator::backward_batch`] is split into under a pipeline (default:
    /// `pp_size`; `ACCELERATE_PP_MICROBATCHES`).
    pub fn pp_microbatches(mut self, micro_batches: usize) -> Self {
        self.pp_microbatches = Some(micro_batches);
        self
    }

    /// The pipeline's schedule (default [`PipelineSchedule::OneFOneB`](crate::PipelineSchedule);
    /// `ACCELERATE_PP_SCHEDULE=gpipe|1f1b`).
    pub fn pp_schedule(mut self, schedule: crate::config::PipelineSchedule) -> Self {
        self.pp_schedule = Some(schedule);
        self
    }

    /// How many blocks each pipeline stage runs, first stage first (default: cut by the blocks' parameters;
    /// `ACCELERATE_PP_STAGE_BLOCKS=3,5`): one count per stage, summing to the model's blocks. Give the first and
    /// the last stage fewer blocks when what precedes or follows the blocks (an embedding, a large head) weighs.
    pub fn pp_stage_blocks(mut self, counts: Vec<usize>) -> Self {
        self.pp_stage_blocks = Some(counts);
        self
    }

    /// FSDP2's `param_dtype`: the dtype [`Accelerator::backward_blocks`] gathers each block's parameters in under a
    /// strategy that reshards them (`FULL_SHARD`, `HYBRID_SHARD`): half the traffic and half the gathered block in
    /// bf16 or fp16, where each rank keeps its slices (and their optimizer state) in the parameters' own dtype.
    /// The block's gradients are reduced in [`fsdp_reduce_dtype`](Self::fsdp_reduce_dtype), by default the
    /// parameters' own. A block gathered in a half dtype computes in it: use it with
    /// [`mixed_precision`](Self::mixed_precision) of the same dtype, casting the blocks' inputs with
    /// [`Accelerator::autocast`] as mixed precision does; then the weights are those of the same run without it, bit
    /// for bit (a half-precision forward casts the parameters to the same values; the gradients cast back to
    /// f32 are the same). Default: the parameters' own (`FSDP_PARAM_DTYPE`).
    pub fn fsdp_param_dtype(mut self, dtype: crate::config::ShardDtype) -> Self {
        self.fsdp_param_dtype = Some(dtype);
        self
    }

    /// FSDP2's `reduce_dtype`: the dtype gradients are reduce-scattered in under a sharded strategy (default: the
    /// parameters' own, e.g. f32 for f32 master weights; `FSDP_REDUCE_DTYPE`). bf16 halves the traffic and rounds
    /// each rank's contribution and the sum.
    pub fn fsdp_reduce_dtype(mut self, dtype: crate::config::ShardDtype) -> Self {
        self.fsdp_reduce_dtype = Some(dtype);
        self
    }

    /// Recomputes each block's forward pass during backward instead of keeping its activations, in
    /// [`Accelerator::backward_blocks`] (Accelerate's `fsdp_activation_checkpointing`; default off;
    /// `FSDP_ACTIVATION_CHECKPOINTING`). Only the activations between blocks are kept, for one more forward pass
    /// per step. Block-wise `FULL_SHARD` recomputes its blocks whatever this says.
    pub fn activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = Some(on);
        self
    }

    /// Burn's own gradient checkpointing on the autodiff device (its `Balanced` strategy: memory-bound
    /// operations are recomputed in backward, compute-bound ones still keep their output; default off;
    /// `ACCELERATE_AUTODIFF_CHECKPOINTING`). It needs no blocks and combines with
    /// [`activation_checkpointing`](Self::activation_checkpointing).
    pub fn autodiff_checkpointing(mut self, on: bool) -> Self {
        self.autodiff_checkpointing = Some(on);
        self
    }

    /// Which path tensors take between ranks: gradients, the parameter slices of sharded training and a
    /// pipeline's activations (default [`GradientTransport::Auto`]: the device
    /// when every rank is a CUDA device and NCCL loads, host memory otherwise; `ACCELERATE_GRADIENT_TRANSPORT`).
    /// [`GradientTransport::Host`] forces host memory; [`GradientTransport::Device`] makes building fail where the
    /// device path is not available, with the reason.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, GradientTransport};
    /// let names = Accelerator::builder()
    ///     .gradient_transport(GradientTransport::Host)
    ///     .launch(2, |acc| Ok(acc.strategy_name()))?;
    /// assert!(names[0].contains("host all-reduce"), "{}", names[0]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn gradient_transport(mut self, transport: GradientTransport) -> Self {
        self.gradient_transport = Some(transport);
        self
    }

    /// Debug mode: before every collective, ranks compare the operation and tensor shapes, so that a mismatch
    /// is an error on every rank instead of a hang (like `ACCELERATE_DEBUG_MODE=1`). Costs one small exchange per
    /// collective.
    pub fn debug(mut self, on: bool) -> Self {
        self.debug = Some(on);
        self
    }

    /// Makes [`Accelerator::resume`] continue from the latest automatic checkpoint of the project folder, when
    /// there is one (`ACCELERATE_RESUME_FROM_LATEST`). A job restarted by `burn-accelerate launch
    /// --max-restarts` (or torchrun) resumes without it.
    pub fn resume_from_latest(mut self, on: bool) -> Self {
        self.resume_from_latest = Some(on);
        self
    }

    /// Lets a process a launcher started with others it cannot join (a build without the `mpi` feature under
    /// `mpirun`, SLURM tasks without an MPI plugin, torchrun-style variables) run alone, as one of several
    /// independent jobs on purpose (`ACCELERATE_INDEPENDENT_PROCESSES`); it then says so on standard error, even
    /// without a logger. Without it, building the accelerator there is an error that says how to join them.
    pub fn independent_processes(mut self, on: bool) -> Self {
        self.independent_processes = Some(on);
        self
    }

    /// How long a collective waits for the other ranks before failing with an error that names the missing
    /// ranks (default 300 s; `ACCELERATE_COLLECTIVE_TIMEOUT=<seconds>`).
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.collective_timeout = Some(timeout);
        self
    }

    /// Resolves the configuration, finds how this process was started ([`cluster::detect`]: a single process,
    /// or an MPI job with the `mpi` feature), picks the device and creates the accelerator.
    ///
    /// # Errors
    /// An invalid setting or environment variable, or a requested backend that is not compiled in.
    pub fn build(self) -> Result<Accelerator> {
        let config = self.resolve()?;
        let cluster = cluster::detect(&config)?;
        self.build_rank(config, cluster.as_ref())
    }

    /// Creates the accelerator of the rank that `cluster` describes: the seam for running on a communicator of
    /// your own (an engine this crate does not ship, or a test double that wraps one).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use burn_accelerate::Accelerator;
    /// use burn_accelerate::distributed::cluster::InProcess;
    /// use burn_accelerate::distributed::comm::InProcessGroup;
    ///
    /// let group = InProcessGroup::new(1, std::time::Duration::from_secs(5));
    /// let accelerator = Accelerator::builder().build_in(&InProcess::new(Arc::new(group.comm(0))))?;
    /// assert_eq!(accelerator.num_processes(), 1);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`build`](Self::build).
    pub fn build_in(&self, cluster: &dyn ClusterEnvironment) -> Result<Accelerator> {
        let config = self.resolve()?;
        self.build_rank(config, cluster)
    }

    /// The configuration: builder values over environment variables over defaults.
    pub(crate) fn resolve(&self) -> Result<AcceleratorConfig> {
        let mut config = AcceleratorConfig::read_file_and_env()?;
        // Each builder value replaces the resolved one, and the field's name is recorded as coming from here.
        macro_rules! override_with_builder {
            ($($group:ident . $field:ident => $key:ident),* $(,)?) => {$(
                if let Some(v) = self.$field.clone() {
                    config.$group.$field = v;
                    config.set_source(Key::$key, Source::Builder);
                }
            )*};
        }
        override_with_builder!(
            device.device_placement => DevicePlacement,
            scheduler.step_scheduler_with_optimizer => StepSchedulerWithOptimizer,
            data.split_batches => SplitBatches,
            scheduler.scheduler_rule => SchedulerRule,
            accumulation.gradient_accumulation_steps => GradientAccumulationSteps,
            distributed.debug => Debug,
            data.even_batches => EvenBatches,
            precision.mixed_precision => MixedPrecision,
            precision.loss_scaler => LossScaler,
            accumulation.sync_each_batch => SyncEachBatch,
            accumulation.loss_normalization => LossNormalization,
            distributed.bucket_size_mb => BucketSizeMb,
            distributed.sharding => Sharding,
            memory.activation_checkpointing => ActivationCheckpointing,
            memory.autodiff_checkpointing => AutodiffCheckpointing,
            distributed.gradient_transport => GradientTransport,
            recovery.resume_from_latest => ResumeFromLatest,
            distributed.independent_processes => IndependentProcesses,
            distributed.sequence_parallel => SequenceParallel,
        );
        if let Some(size) = self.dp_shard_size {
            config.distributed.dp_shard_size = Some(size);
            config.set_source(Key::DpShardSize, Source::Builder);
        }
        if let Some(stages) = self.pp_size {
            config.pipeline.pp_size = stages;
            config.set_source(Key::PpSize, Source::Builder);
        }
        if let Some(ranks) = self.tp_size {
            config.distributed.tp_size = ranks;
            config.set_source(Key::TpSize, Source::Builder);
        }
        if let Some(ranks) = self.cp_size {
            config.distributed.cp_size = ranks;
            config.set_source(Key::CpSize, Source::Builder);
        }
        if let Some(mode) = self.cp_comm_strategy {
            config.distributed.cp_comm_strategy = mode;
            config.set_source(Key::CpCommStrategy, Source::Builder);
        }
        if let Some(balanced) = self.cp_load_balance {
            config.distributed.cp_load_balance = balanced;
            config.set_source(Key::CpLoadBalance, Source::Builder);
        }
        if let Some(micro_batches) = self.pp_microbatches {
            config.pipeline.pp_microbatches = Some(micro_batches);
            config.set_source(Key::PpMicrobatches, Source::Builder);
        }
        if let Some(schedule) = self.pp_schedule {
            config.pipeline.pp_schedule = schedule;
            config.set_source(Key::PpSchedule, Source::Builder);
        }
        if let Some(counts) = self.pp_stage_blocks.clone() {
            config.pipeline.pp_stage_blocks = Some(counts);
            config.set_source(Key::PpStageBlocks, Source::Builder);
        }
        if let Some(dtype) = self.fsdp_param_dtype {
            config.distributed.fsdp_param_dtype = Some(dtype);
            config.set_source(Key::FsdpParamDtype, Source::Builder);
        }
        if let Some(dtype) = self.fsdp_reduce_dtype {
            config.distributed.fsdp_reduce_dtype = Some(dtype);
            config.set_source(Key::FsdpReduceDtype, Source::Builder);
        }
        if let Some(timeout) = self.collective_timeout {
            config.distributed.collective_timeout_secs = timeout.as_secs_f64();
            config.set_source(Key::CollectiveTimeoutSecs, Source::Builder);
        }
        if self.device.cpu {
            config.device.cpu = true;
            config.set_source(Key::Cpu, Source::Builder);
        }
        config.validate()?;
        Ok(config)
    }

    /// Distributes training with the strategy `make` returns for each rank instead of the one chosen from the
    /// settings.
    pub(crate) fn strategy(mut self, make: StrategyFactory) -> Self {
        self.strategy = Some(make);
        self
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
    ///
    /// # Errors
    /// `num_processes` is 0, a setting is invalid, a rank thread cannot be started, or a rank fails.
    pub fn launch<T, F>(self, num_processes: usize, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Accelerator) -> Result<T> + Send + Sync,
    {
        let config = self.resolve()?;
        let timeout = config.collective_timeout();
        crate::distributed::launch_ranks(num_processes, timeout, |cluster| {
            f(self.build_rank(config.clone(), cluster)?)
        })
    }

    /// The accelerator of the rank `cluster` describes.
    pub(crate) fn build_rank(
        &self,
        config: AcceleratorConfig,
        cluster: &dyn ClusterEnvironment,
    ) -> Result<Accelerator> {
        let project = self.project.clone().unwrap_or_default();
        if project.total_limit == Some(0) {
            return Err(crate::error::Error::InvalidArgument(
                "ProjectConfiguration::total_limit(0) would delete every checkpoint, the one just written \
                 included: keep at least 1, or leave the limit unset to keep them all"
                    .into(),
            ));
        }
        let request = DeviceRequest {
            cpu: config.device.cpu,
            ..self.device.clone()
        };
        let local_rank = cluster.local_rank();
        let (device, backend) = select_device(&request, local_rank)?;
        config
            .precision
            .mixed_precision
            .check(&device, |dtype| device.supports_dtype(dtype))?;
        let device = if config.memory.autodiff_checkpointing {
            device.autodiff().gradient_checkpointing()
        } else {
            device.autodiff()
        };
        let state = ProcessGroup::new(cluster.communicator(), local_rank, device, backend)
            .with_debug(config.distributed.debug);
        let group = Arc::new(state);
        let parallelized = match &self.strategy {
            Some(make) => Parallelized::with_strategy(&group, make(&group)?),
            None => Parallelized::build(&group, &config)?,
        };
        Accelerator::from_parts(group, config, project, self.log_with.clone(), parallelized)
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
}

/// Runs `f` on `num_processes` in-process ranks with the default settings; see
/// [`AcceleratorBuilder::launch`].
///
/// ```
/// use burn_accelerate::{ReduceOp, launch};
/// use burn::tensor::Tensor;
///
/// let sums = launch(2, |acc| {
///     let x = Tensor::<1>::from_floats([acc.process_index() as f32 + 1.0], acc.device());
///     Ok(acc.reduce(x, ReduceOp::Sum)?.into_scalar::<f32>())
/// })?;
/// assert_eq!(sums, vec![3.0, 3.0]);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
pub fn launch<T, F>(num_processes: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Accelerator) -> Result<T> + Send + Sync,
{
    Accelerator::builder().launch(num_processes, f)
}
