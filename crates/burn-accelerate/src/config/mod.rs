//! The accelerator's configuration, where each setting came from, and where Accelerate keeps its config file.

pub mod env;
mod context;
mod key;
mod pipeline;
mod shard_dtype;
mod sharding;
mod file;
mod transport;
mod groups;
mod variables;

pub use context::{CP_COMM_STRATEGY_VAR, CP_LOAD_BALANCE_VAR, ContextAttention};
pub use file::UnsupportedValue;
pub use groups::{
    AccumulationSettings, DataSettings, DeviceSettings, DistributedSettings, MemorySettings,
    PrecisionSettings, RecoverySettings, SchedulerSettings,
};
pub use key::Key;
pub use pipeline::{
    PP_MICROBATCHES_VAR, PP_SCHEDULE_VAR, PP_SIZE_VAR, PP_STAGE_BLOCKS_VAR, PipelineSchedule,
    PipelineSettings,
};
pub use shard_dtype::ShardDtype;
pub use sharding::ShardingStrategy;
pub use transport::{GradientTransport, TRANSPORT_VAR};

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::precision::MixedPrecision;

/// Settings of an [`Accelerator`](crate::Accelerator), resolved from (highest first) builder calls,
/// `ACCELERATE_*` environment variables, the config file and defaults, grouped by concern.
///
/// ```
/// use burn_accelerate::config::{AcceleratorConfig, Key, Source};
/// let config = AcceleratorConfig::default();
/// assert_eq!(config.accumulation.gradient_accumulation_steps, 1);
/// assert!(config.data.even_batches);
/// assert_eq!(config.source(Key::GradientAccumulationSteps), Source::Default);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AcceleratorConfig {
    /// Where the accelerator computes and what it moves there.
    pub device: DeviceSettings,
    /// The forward pass's precision and fp16's loss scaling.
    pub precision: PrecisionSettings,
    /// Gradient accumulation.
    pub accumulation: AccumulationSettings,
    /// How prepared dataloaders deal batches to the ranks.
    pub data: DataSettings,
    /// How prepared schedulers advance.
    pub scheduler: SchedulerSettings,
    /// Sharding, the gradient transport and the collectives.
    pub distributed: DistributedSettings,
    /// Pipeline parallelism: stages, micro-batches and their schedule.
    pub pipeline: PipelineSettings,
    /// What backward recomputes instead of keeping.
    pub memory: MemorySettings,
    /// Continuing after an interruption.
    pub recovery: RecoverySettings,
    /// What the config file says about launching (read by `burn-accelerate launch`).
    pub launch: LaunchSettings,
    /// Where each setting that did not keep its default came from (see [`source`](Self::source)).
    #[serde(skip)]
    pub sources: BTreeMap<Key, Source>,
    /// Values of the config file this crate cannot honour; [`validate`](Self::validate) refuses those still in
    /// effect.
    #[serde(skip)]
    pub unsupported: Vec<UnsupportedValue>,
}

/// The variable that asks every run to continue from its latest checkpoint
/// ([`RecoverySettings::resume_from_latest`]).
pub const RESUME_VAR: &str = "ACCELERATE_RESUME_FROM_LATEST";

/// The environment variable that sets [`DistributedSettings::independent_processes`]: processes a launcher
/// started together that cannot join each other run as independent jobs, on purpose.
pub const INDEPENDENT_VAR: &str = "ACCELERATE_INDEPENDENT_PROCESSES";

/// The variables a launcher tells a restarted job its restart count in, first found wins: `burn-accelerate
/// launch --max-restarts`'s own, then torchrun's.
pub const RESTART_COUNT_VARS: &[&str] = &["ACCELERATE_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"];

/// The launch settings of a config file (Accelerate's keys of the same names).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LaunchSettings {
    /// `distributed_type`: `NO`, `MULTI_CPU`, `MULTI_GPU`.
    pub distributed_type: Option<String>,
    /// `num_processes`: processes in all.
    pub num_processes: Option<usize>,
    /// `num_machines`.
    pub num_machines: Option<usize>,
    /// `machine_rank`: this machine's index.
    pub machine_rank: Option<usize>,
    /// `main_process_ip`.
    pub main_process_ip: Option<String>,
    /// `main_process_port`.
    pub main_process_port: Option<u16>,
}

/// Where a resolved setting came from, highest precedence first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Source {
    /// An [`AcceleratorBuilder`](crate::AcceleratorBuilder) call.
    Builder,
    /// A launcher's command-line flag (`burn-accelerate launch --mixed-precision bf16`).
    CommandLine,
    /// An environment variable, named.
    Env(String),
    /// The config file, named.
    File(String),
    /// The default.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Builder => f.write_str("builder"),
            Source::CommandLine => f.write_str("command line"),
            Source::Env(var) => write!(f, "environment {var}"),
            Source::File(path) => write!(f, "config file {path}"),
            Source::Default => f.write_str("default"),
        }
    }
}

impl AcceleratorConfig {
    /// Defaults, overridden by the config file ([`config_file`]: `ACCELERATE_CONFIG_FILE`, else Accelerate's
    /// `default_config.yaml` when it exists), overridden by the `ACCELERATE_*` environment variables; checked.
    ///
    /// # Errors
    /// A malformed file or variable, an unknown key, or a value this crate cannot honour that nothing overrides.
    pub fn from_file_and_env() -> Result<Self> {
        let config = Self::read_file_and_env()?;
        config.validate()?;
        Ok(config)
    }

    /// [`from_file_and_env`](Self::from_file_and_env) without the final check, to show what a file and the
    /// environment say (`burn-accelerate env`, `config show`) even when a run would refuse it.
    pub fn read_file_and_env() -> Result<Self> {
        let mut config = Self::default();
        if let Some(path) = config_file() {
            config.apply_file(&path)?;
        }
        variables::read(&mut config)?;
        Ok(config)
    }

    /// Applies the settings that environment variables carry (as [`read_file_and_env`](Self::read_file_and_env)
    /// reads them from the process's environment), taking each variable's value from `lookup` instead: a
    /// launcher's planned variables, a job description. Values are trimmed; an empty one counts as unset.
    ///
    /// ```
    /// use burn_accelerate::{AcceleratorConfig, MixedPrecision};
    /// let mut config = AcceleratorConfig::default();
    /// config.apply_env_from(|name| (name == "ACCELERATE_MIXED_PRECISION").then(|| "bf16".to_string()))?;
    /// assert_eq!(config.precision.mixed_precision, MixedPrecision::Bf16);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// A value its variable cannot hold; the error names the variable.
    pub fn apply_env_from(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        let lookup = |name: &str| {
            lookup(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        variables::read_from(self, &lookup)
    }

    /// Applies the keys of an Accelerate config file (`.yaml`, or `.json` read as JSON); see the rules in the
    /// module documentation of the file reader: Accelerate's keys are accepted (used or ignored with a warning),
    /// other keys are an error naming them.
    pub fn apply_file(&mut self, path: &Path) -> Result<()> {
        file::apply_path(self, path)
    }

    /// Where the setting `key` got its value.
    pub fn source(&self, key: Key) -> Source {
        self.sources.get(&key).cloned().unwrap_or(Source::Default)
    }

    /// Records where the setting `key` got its value: a launcher that sets a field from its own flag records
    /// [`Source::CommandLine`], so that [`validate`](Self::validate) and what it prints know the flag won.
    pub fn set_source(&mut self, key: Key, source: Source) {
        self.sources.insert(key, source);
    }

    /// The environment variables that carry this configuration's launch settings ([`launch_settings`]) to the
    /// processes a launcher starts: the same variables every run reads, so each process resolves what the
    /// launcher resolved from its flags, the environment and the config file.
    ///
    /// [`launch_settings`]: Self::launch_settings
    ///
    /// ```
    /// use burn_accelerate::config::{AcceleratorConfig, Key, Source};
    /// use burn_accelerate::MixedPrecision;
    /// let mut config = AcceleratorConfig::default();
    /// config.precision.mixed_precision = MixedPrecision::Bf16;
    /// config.set_source(Key::MixedPrecision, Source::CommandLine);
    /// let env = config.launch_env();
    /// assert!(env.contains(&("ACCELERATE_MIXED_PRECISION", "bf16".to_string())));
    /// assert!(env.contains(&("ACCELERATE_USE_FSDP", "false".to_string())));
    /// ```
    pub fn launch_env(&self) -> Vec<(&'static str, String)> {
        variables::write(self)
    }

    /// The settings a launcher carries to its processes ([`launch_env`](Self::launch_env)), each with its value
    /// and where it came from, as [`settings`](Self::settings) gives them.
    pub fn launch_settings(&self) -> Vec<(&'static str, String, Source)> {
        let carried: Vec<Key> = variables::carried().collect();
        self.values()
            .into_iter()
            .filter(|(key, _)| carried.contains(key))
            .map(|(key, value)| (key.name(), value, self.source(key)))
            .collect()
    }

    /// The settings a run uses, each with its value and where it came from (what `burn-accelerate env` prints).
    pub fn settings(&self) -> Vec<(&'static str, String, Source)> {
        self.values()
            .into_iter()
            .map(|(key, value)| (key.name(), value, self.source(key)))
            .collect()
    }

    /// The values [`settings`](Self::settings) shows, in its order.
    fn values(&self) -> [(Key, String); 24] {
        [
            (
                Key::MixedPrecision,
                self.precision.mixed_precision.to_string(),
            ),
            (Key::Cpu, self.device.cpu.to_string()),
            (Key::Debug, self.distributed.debug.to_string()),
            (
                Key::IndependentProcesses,
                self.distributed.independent_processes.to_string(),
            ),
            (
                Key::GradientAccumulationSteps,
                self.accumulation.gradient_accumulation_steps.to_string(),
            ),
            (
                Key::CollectiveTimeoutSecs,
                self.distributed.collective_timeout_secs.to_string(),
            ),
            (Key::SplitBatches, self.data.split_batches.to_string()),
            (Key::EvenBatches, self.data.even_batches.to_string()),
            (Key::Sharding, self.distributed.sharding.to_string()),
            (
                Key::FsdpParamDtype,
                self.distributed
                    .fsdp_param_dtype
                    .map_or_else(|| "the parameters' own".into(), |d| d.to_string()),
            ),
            (
                Key::FsdpReduceDtype,
                self.distributed
                    .fsdp_reduce_dtype
                    .map_or_else(|| "the parameters' own".into(), |d| d.to_string()),
            ),
            (
                Key::DpShardSize,
                self.distributed
                    .dp_shard_size
                    .map_or_else(|| "processes per machine".into(), |n| n.to_string()),
            ),
            (Key::TpSize, self.distributed.tp_size.to_string()),
            (
                Key::SequenceParallel,
                self.distributed.sequence_parallel.to_string(),
            ),
            (Key::CpSize, self.distributed.cp_size.to_string()),
            (
                Key::CpCommStrategy,
                self.distributed.cp_comm_strategy.to_string(),
            ),
            (
                Key::CpLoadBalance,
                self.distributed.cp_load_balance.to_string(),
            ),
            (Key::PpSize, self.pipeline.pp_size.to_string()),
            (
                Key::PpMicrobatches,
                self.pipeline.microbatches().to_string(),
            ),
            (Key::PpSchedule, self.pipeline.pp_schedule.to_string()),
            (
                Key::PpStageBlocks,
                self.pipeline
                    .stage_blocks_text()
                    .unwrap_or_else(|| "by parameters".into()),
            ),
            (
                Key::ActivationCheckpointing,
                self.memory.activation_checkpointing.to_string(),
            ),
            (
                Key::AutodiffCheckpointing,
                self.memory.autodiff_checkpointing.to_string(),
            ),
            (
                Key::GradientTransport,
                self.distributed.gradient_transport.to_string(),
            ),
        ]
    }

    /// [`apply_file`](Self::apply_file) on the text of a file (`origin` names it in errors, and a name ending
    /// in `.json` is read as JSON).
    pub fn apply_yaml(&mut self, text: &str, origin: &str) -> Result<()> {
        file::apply(self, file::parse(text, origin)?, origin)
    }

    /// Checks the values, and that no value of the config file this crate cannot honour is still in effect. An
    /// error names the setting, its value and where it came from (the variable, the file, the builder).
    pub fn validate(&self) -> Result<()> {
        for unsupported in &self.unsupported {
            let overridden = unsupported.key == "mixed_precision"
                && !matches!(self.source(Key::MixedPrecision), Source::File(_));
            if !overridden {
                return Err(unsupported.error());
            }
        }
        if self.accumulation.gradient_accumulation_steps == 0 {
            return Err(Error::config(
                "gradient_accumulation_steps",
                "0",
                self.source(Key::GradientAccumulationSteps).to_string(),
                "an integer >= 1",
            ));
        }
        self.precision.loss_scaler.validate()?;
        if self.distributed.sharding.is_sharded() && self.accumulation.sync_each_batch {
            return Err(Error::config(
                "sync_each_batch",
                "true",
                self.source(Key::SyncEachBatch).to_string(),
                format!(
                    "false with sharding {}: a sharded rank keeps only its own reduced gradients, so \
                     accumulating after a reduction would count the other ranks' shares again; leave \
                     sync_each_batch off (gradients are reduced once per accumulation window) or use NO_SHARD",
                    self.distributed.sharding
                ),
            ));
        }
        let half = match self.distributed.fsdp_param_dtype {
            Some(ShardDtype::Bf16) => Some((ShardDtype::Bf16, MixedPrecision::Bf16)),
            Some(ShardDtype::Fp16) => Some((ShardDtype::Fp16, MixedPrecision::Fp16)),
            _ => None,
        };
        if let Some((param, needed)) = half
            && self.precision.mixed_precision != needed
        {
            return Err(Error::config(
                "fsdp_param_dtype",
                param.to_string(),
                self.source(Key::FsdpParamDtype).to_string(),
                format!(
                    "fp32, or {param} with mixed_precision {needed} (now {}): blocks gathered in {param} compute \
                     in it, so the forward pass must run in {param} (cast the blocks' inputs with autocast)",
                    self.precision.mixed_precision
                ),
            ));
        }
        if self.pipeline.pp_size == 0 {
            return Err(Error::config(
                "pp_size",
                "0",
                self.source(Key::PpSize).to_string(),
                "a number of pipeline stages >= 1 (1: no pipeline)",
            ));
        }
        if self.pipeline.pp_microbatches == Some(0) {
            return Err(Error::config(
                "pp_microbatches",
                "0",
                self.source(Key::PpMicrobatches).to_string(),
                "a number of micro-batches per batch >= 1",
            ));
        }
        if let Some(counts) = &self.pipeline.pp_stage_blocks
            && (counts.len() != self.pipeline.pp_size || counts.contains(&0))
        {
            return Err(Error::config(
                "pp_stage_blocks",
                self.pipeline.stage_blocks_text().unwrap_or_default(),
                self.source(Key::PpStageBlocks).to_string(),
                format!(
                    "one count of blocks per stage, each 1 or more: {} of them for pp_size {}",
                    self.pipeline.pp_size, self.pipeline.pp_size
                ),
            ));
        }
        if !(self.distributed.bucket_size_mb.is_finite() && self.distributed.bucket_size_mb > 0.0) {
            return Err(Error::config(
                "bucket_size_mb",
                self.distributed.bucket_size_mb.to_string(),
                self.source(Key::BucketSizeMb).to_string(),
                "a positive number of MiB",
            ));
        }
        if !(self.distributed.collective_timeout_secs.is_finite()
            && self.distributed.collective_timeout_secs > 0.0)
        {
            return Err(Error::config(
                "collective_timeout_secs",
                self.distributed.collective_timeout_secs.to_string(),
                self.source(Key::CollectiveTimeoutSecs).to_string(),
                "a positive number of seconds",
            ));
        }
        Ok(())
    }

    /// The collective timeout as a duration, at most [`MAX_COLLECTIVE_TIMEOUT`] (a longer one, up to
    /// `Duration::MAX` or `ACCELERATE_COLLECTIVE_TIMEOUT=1e20`, means "as long as possible", not an overflow).
    pub fn collective_timeout(&self) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.distributed.collective_timeout_secs)
            .unwrap_or(MAX_COLLECTIVE_TIMEOUT)
            .min(MAX_COLLECTIVE_TIMEOUT)
    }
}

/// Turns on per-block activation checkpointing (see [`MemorySettings::activation_checkpointing`]), as
/// Accelerate's launcher names it.
pub const ACTIVATION_CHECKPOINTING_VAR: &str = "FSDP_ACTIVATION_CHECKPOINTING";

/// Turns on Burn's own gradient checkpointing on the autodiff device (see
/// [`MemorySettings::autodiff_checkpointing`]).
pub const AUTODIFF_CHECKPOINTING_VAR: &str = "ACCELERATE_AUTODIFF_CHECKPOINTING";

/// The size of a hybrid strategy's shard groups, as Accelerate's launcher names it.
pub const DP_SHARD_SIZE_VAR: &str = "PARALLELISM_CONFIG_DP_SHARD_SIZE";
/// The environment variable that sets [`DistributedSettings::tp_size`].
pub const TP_SIZE_VAR: &str = "PARALLELISM_CONFIG_TP_SIZE";
/// The environment variable that sets [`DistributedSettings::sequence_parallel`].
pub const SEQUENCE_PARALLEL_VAR: &str = "PARALLELISM_CONFIG_SEQUENCE_PARALLEL";
/// The environment variable that sets [`DistributedSettings::cp_size`].
pub const CP_SIZE_VAR: &str = "PARALLELISM_CONFIG_CP_SIZE";

/// The variables that ask for sharding, as Accelerate's launcher sets them: `ACCELERATE_USE_FSDP=true` and
/// `FSDP_SHARDING_STRATEGY` (a name or Accelerate's number; `FULL_SHARD` when only the first is set).
pub const FSDP_VARS: [&str; 2] = ["ACCELERATE_USE_FSDP", "FSDP_SHARDING_STRATEGY"];

/// The longest collective timeout: 30 days. Longer requests are cut to it, so that deadlines never overflow.
pub const MAX_COLLECTIVE_TIMEOUT: std::time::Duration = burn_accelerate_comm::MAX_TIMEOUT;

/// How gradients accumulated over several micro-batches are normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    /// Divide by the number of micro-batches actually accumulated in the window, so that a short last window
    /// (at the end of the dataloader) is weighted like a full one. The default.
    ActualMicroBatches,
    /// Divide by `gradient_accumulation_steps` always, as Accelerate does: a short last window makes a smaller
    /// update.
    Nominal,
}

/// How many times a learning-rate scheduler advances per optimizer step, the same for a prepared scheduler
/// ([`Accelerator::prepare_scheduler`](crate::Accelerator::prepare_scheduler)) and burn-train's Learner.
///
/// A schedule is written for a number of optimizer steps. Which rule keeps a 1-process schedule on P ranks
/// depends on how the program divides its data:
///
/// | the program on P ranks | batches per rank and epoch | rule that keeps the 1-process schedule |
/// |---|---|---|
/// | divides the global batch (`batch_size(global / P)`, or `split_batches`) | as on 1 process | [`OncePerOptimizerStep`](Self::OncePerOptimizerStep) |
/// | keeps the 1-process batch on every rank (the global batch grows P times) | 1/P of 1 process | [`Accelerate`](Self::Accelerate) |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerRule {
    /// Once per optimizer step on any number of ranks (the default; what the Learner always did).
    #[default]
    OncePerOptimizerStep,
    /// Accelerate's `AcceleratedScheduler`: `num_processes` times per optimizer step, unless `split_batches`
    /// is on (then once).
    Accelerate,
}

impl SchedulerRule {
    /// Scheduler steps per optimizer step on `num_processes` ranks.
    pub fn steps_per_optimizer_step(self, num_processes: usize, split_batches: bool) -> usize {
        match self {
            SchedulerRule::Accelerate if !split_batches => num_processes.max(1),
            _ => 1,
        }
    }
}

/// The folder Accelerate keeps its configuration in: `$HF_HOME/accelerate`, else
/// `$XDG_CACHE_HOME/huggingface/accelerate`, else `~/.cache/huggingface/accelerate`.
pub fn config_dir() -> Option<PathBuf> {
    if let Some(hf_home) = env::var("HF_HOME") {
        return Some(PathBuf::from(hf_home).join("accelerate"));
    }
    let cache = env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("huggingface").join("accelerate"))
}

/// The default config file, `default_config.yaml` in [`config_dir`], shared with Accelerate.
pub fn default_config_file() -> Option<PathBuf> {
    config_dir().map(|d| d.join("default_config.yaml"))
}

/// The config file a run reads: `ACCELERATE_CONFIG_FILE` (what `--config-file` sets), else the
/// [`default_config_file`] when it exists.
pub fn config_file() -> Option<PathBuf> {
    env::var("ACCELERATE_CONFIG_FILE")
        .map(PathBuf::from)
        .or_else(|| default_config_file().filter(|p| p.exists()))
}

#[cfg(test)]
mod tests;
