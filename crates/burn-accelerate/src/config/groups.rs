//! The groups of an [`AcceleratorConfig`](super::AcceleratorConfig), one per concern: the device, precision,
//! gradient accumulation, data, schedulers, distribution, memory and recovery. Each field keeps the name
//! Accelerate's settings and [`Key`](super::Key) give it.

use serde::{Deserialize, Serialize};

use super::{GradientTransport, LossNormalization, SchedulerRule, ShardingStrategy};
use crate::precision::{LossScaler, MixedPrecision};

/// Where the accelerator computes and what it moves there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceSettings {
    /// Force a CPU backend (default `false`; `ACCELERATE_USE_CPU`).
    pub cpu: bool,
    /// Place models and batches on the accelerator's device (default `true`).
    pub device_placement: bool,
}

impl Default for DeviceSettings {
    fn default() -> Self {
        Self {
            cpu: false,
            device_placement: true,
        }
    }
}

/// The precision of the forward pass and fp16's loss scaling.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrecisionSettings {
    /// Precision of the forward pass (default `no`; `ACCELERATE_MIXED_PRECISION`).
    pub mixed_precision: MixedPrecision,
    /// Loss scaling for fp16 (torch's GradScaler defaults).
    pub loss_scaler: LossScaler,
}

/// Gradient accumulation, as Accelerate's `GradientAccumulationPlugin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AccumulationSettings {
    /// Micro-batches per optimizer step (default 1; `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`).
    pub gradient_accumulation_steps: usize,
    /// All-reduce gradients after every micro-batch instead of only on sync steps (default `false`).
    pub sync_each_batch: bool,
    /// How accumulated gradients are normalised (default: by the micro-batches actually accumulated).
    pub loss_normalization: LossNormalization,
}

impl Default for AccumulationSettings {
    fn default() -> Self {
        Self {
            gradient_accumulation_steps: 1,
            sync_each_batch: false,
            loss_normalization: LossNormalization::ActualMicroBatches,
        }
    }
}

/// How prepared dataloaders deal batches to the ranks, as Accelerate's `DataLoaderConfiguration`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataSettings {
    /// Split each batch between ranks instead of giving each rank its own batch (default `false`).
    pub split_batches: bool,
    /// Complete the last round of a prepared dataloader by cycling samples from the start of the epoch, so every
    /// rank gets the same number of full batches (default `true`).
    pub even_batches: bool,
}

impl Default for DataSettings {
    fn default() -> Self {
        Self {
            split_batches: false,
            even_batches: true,
        }
    }
}

/// How prepared schedulers (and the Learner's) advance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerSettings {
    /// Advance prepared schedulers with the optimizer, Accelerate's rule (default `true`).
    pub step_scheduler_with_optimizer: bool,
    /// How many times a prepared scheduler (and the Learner's) advances per optimizer step (default: once).
    pub scheduler_rule: SchedulerRule,
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        Self {
            step_scheduler_with_optimizer: true,
            scheduler_rule: SchedulerRule::OncePerOptimizerStep,
        }
    }
}

/// How the ranks share the training state and talk to each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DistributedSettings {
    /// How much of the training state each rank holds (default [`ShardingStrategy::NoShard`]; the config file's
    /// `distributed_type: FSDP` and `fsdp_config.fsdp_sharding_strategy`, `ACCELERATE_USE_FSDP` with
    /// `FSDP_SHARDING_STRATEGY`).
    pub sharding: ShardingStrategy,
    /// Ranks in each shard group of a hybrid strategy (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`): the state is
    /// sharded within groups of this many consecutive ranks and replicated across the groups (Accelerate's
    /// `ParallelismConfig.dp_shard_size`; `PARALLELISM_CONFIG_DP_SHARD_SIZE`). Default: the processes on one
    /// machine.
    pub dp_shard_size: Option<usize>,
    /// Tensor-parallel ranks: the mesh's `tp` dimension (Accelerate's `ParallelismConfig.tp_size`;
    /// `PARALLELISM_CONFIG_TP_SIZE`). Only 1 (the default) until tensor parallelism lands: a larger value is
    /// refused when the accelerator is built.
    pub tp_size: usize,
    /// Sequence parallelism under tensor parallelism (Megatron's `--sequence-parallel`, torchtitan's
    /// `enable_sequence_parallel`; `PARALLELISM_CONFIG_SEQUENCE_PARALLEL`): between the tensor-parallel regions
    /// (norms, dropout, residual adds) each rank holds its part of the sequence, all-gathered into each region and
    /// reduce-scattered out of it. Default `false`; no effect with `tp_size` 1.
    pub sequence_parallel: bool,
    /// Context-parallel ranks: the mesh's `cp` dimension (Accelerate's `ParallelismConfig.cp_size`, torchtitan's
    /// `context_parallel_degree`; `PARALLELISM_CONFIG_CP_SIZE`; default 1). Each rank of a context group holds a
    /// slice of every sequence; the group reads the same batches and joins the data-parallel gradient reduction.
    pub cp_size: usize,
    /// How a context group's attention reaches the whole sequence's keys and values (default
    /// [`ContextAttention::AllGather`](super::ContextAttention); Accelerate's `cp_comm_strategy`,
    /// `PARALLELISM_CONFIG_CP_COMM_STRATEGY=allgather|ring`).
    pub cp_comm_strategy: super::ContextAttention,
    /// Head-tail load balance of causal attention (torchtitan's `context_parallel_load_balancer`; default `true`;
    /// `PARALLELISM_CONFIG_CP_LOAD_BALANCE`): each sequence cut into `2 × cp_size` chunks, rank `r` holding chunks
    /// `r` and `2 × cp_size − 1 − r`, so that every rank computes as many unmasked scores. `false`: each rank one
    /// contiguous slice (the last rank then computes the most).
    pub cp_load_balance: bool,
    /// The dtype a block-wise pass of a sharded strategy gathers each block's parameters in (FSDP2's
    /// `param_dtype`; `FSDP_PARAM_DTYPE`). Default: the parameters' own. Each rank keeps its slices in their own
    /// dtype (the master weights); the block's gradients come back in this dtype.
    pub fsdp_param_dtype: Option<super::ShardDtype>,
    /// The dtype gradients are reduce-scattered in under a sharded strategy (FSDP2's `reduce_dtype`;
    /// `FSDP_REDUCE_DTYPE`). Default: the parameters' own.
    pub fsdp_reduce_dtype: Option<super::ShardDtype>,
    /// Size of one gradient all-reduce bucket in MiB (default 25).
    pub bucket_size_mb: f64,
    /// Which path tensors take between ranks: gradients, parameter slices and a pipeline's activations (default
    /// [`GradientTransport::Auto`]: the device where it can;
    /// `ACCELERATE_GRADIENT_TRANSPORT`).
    pub gradient_transport: GradientTransport,
    /// Seconds a collective waits for the other ranks before failing (default 300;
    /// `ACCELERATE_COLLECTIVE_TIMEOUT`).
    pub collective_timeout_secs: f64,
    /// Check operations and shapes across ranks before every collective (default `false`;
    /// `ACCELERATE_DEBUG_MODE`).
    pub debug: bool,
    /// Run as one process alone where a launcher's variables say this process is one of several it cannot join
    /// (a build without the `mpi` feature under `mpirun`, SLURM tasks without an MPI plugin, torchrun-style
    /// variables): N independent jobs on purpose. Default `false`: building the accelerator is then an error that
    /// says how to join them (`ACCELERATE_INDEPENDENT_PROCESSES`).
    pub independent_processes: bool,
}

impl Default for DistributedSettings {
    fn default() -> Self {
        Self {
            sharding: ShardingStrategy::NoShard,
            dp_shard_size: None,
            tp_size: 1,
            sequence_parallel: false,
            cp_size: 1,
            cp_comm_strategy: super::ContextAttention::AllGather,
            cp_load_balance: true,
            fsdp_param_dtype: None,
            fsdp_reduce_dtype: None,
            bucket_size_mb: 25.0,
            gradient_transport: GradientTransport::Auto,
            collective_timeout_secs: 300.0,
            debug: false,
            independent_processes: false,
        }
    }
}

/// What backward recomputes instead of keeping.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemorySettings {
    /// Recompute each block's forward pass during backward instead of keeping its activations, in
    /// [`Accelerator::backward_blocks`](crate::Accelerator::backward_blocks) (default `false`; the config file's
    /// `fsdp_config.fsdp_activation_checkpointing`, `FSDP_ACTIVATION_CHECKPOINTING`, as Accelerate names it).
    /// Block-wise `FULL_SHARD` recomputes its blocks whatever this says.
    pub activation_checkpointing: bool,
    /// Burn's own gradient checkpointing on the accelerator's autodiff device (its `Balanced` strategy:
    /// element-wise operations are recomputed in backward instead of kept; default `false`;
    /// `ACCELERATE_AUTODIFF_CHECKPOINTING`).
    pub autodiff_checkpointing: bool,
}

/// Continuing after an interruption.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RecoverySettings {
    /// Continue from the latest automatic checkpoint when [`Accelerator::resume`](crate::Accelerator::resume)
    /// is called (default `false`; `ACCELERATE_RESUME_FROM_LATEST`). A restarted job resumes whatever this says.
    pub resume_from_latest: bool,
    /// How many times a launcher has restarted this job after a failure (0 on the first run): set by
    /// `burn-accelerate launch --max-restarts` (`ACCELERATE_RESTART_COUNT`) or torchrun
    /// (`TORCHELASTIC_RESTART_COUNT`); a run with a count above 0 resumes from its latest checkpoint.
    pub restart_count: usize,
}
