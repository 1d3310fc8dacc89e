//! The accelerator's configuration, where each setting came from, and where Accelerate keeps its config file.

pub mod env;
mod file;
mod key;
mod sharding;
mod transport;
mod variables;

pub use file::UnsupportedValue;
pub use key::Key;
pub use sharding::ShardingStrategy;
pub use transport::{GradientTransport, TRANSPORT_VAR};

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::precision::{LossScaler, MixedPrecision};

/// Settings of an [`Accelerator`](crate::Accelerator), resolved from (highest first) builder calls,
/// `ACCELERATE_*` environment variables and defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AcceleratorConfig {
    /// Place models and batches on the accelerator's device (default `true`).
    pub device_placement: bool,
    /// Advance prepared schedulers with the optimizer, Accelerate's rule (default `true`).
    pub step_scheduler_with_optimizer: bool,
    /// Split each batch between ranks instead of giving each rank its own batch (default `false`).
    pub split_batches: bool,
    /// How many times a prepared scheduler (and the Learner's) advances per optimizer step (default: once).
    pub scheduler_rule: SchedulerRule,
    /// Micro-batches per optimizer step (default 1; `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`).
    pub gradient_accumulation_steps: usize,
    /// Force a CPU backend (default `false`; `ACCELERATE_USE_CPU`).
    pub cpu: bool,
    /// Precision of the forward pass (default `no`; `ACCELERATE_MIXED_PRECISION`).
    pub mixed_precision: MixedPrecision,
    /// Loss scaling for fp16 (torch's GradScaler defaults).
    pub loss_scaler: LossScaler,
    /// Check operations and shapes across ranks before every collective (default `false`;
    /// `ACCELERATE_DEBUG_MODE`).
    pub debug: bool,
    /// Complete the last round of a prepared dataloader by cycling samples from the start of the epoch, so every
    /// rank gets the same number of full batches (default `true`).
    pub even_batches: bool,
    /// All-reduce gradients after every micro-batch instead of only on sync steps (default `false`).
    pub sync_each_batch: bool,
    /// How accumulated gradients are normalised (default: by the micro-batches actually accumulated).
    pub loss_normalization: LossNormalization,
    /// Size of one gradient all-reduce bucket in MiB (default 25).
    pub bucket_size_mb: f64,
    /// How much of the training state each rank holds (default [`ShardingStrategy::NoShard`]; the config file's
    /// `distributed_type: FSDP` and `fsdp_config.fsdp_sharding_strategy`, `ACCELERATE_USE_FSDP` with
    /// `FSDP_SHARDING_STRATEGY`).
    pub sharding: ShardingStrategy,
    /// Ranks in each shard group of a hybrid strategy (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`): the state is
    /// sharded within groups of this many consecutive ranks and replicated across the groups (Accelerate's
    /// `ParallelismConfig.dp_shard_size`; `PARALLELISM_CONFIG_DP_SHARD_SIZE`). Default: the processes on one
    /// machine.
    pub dp_shard_size: Option<usize>,
    /// Recompute each block's forward pass during backward instead of keeping its activations, in
    /// [`Accelerator::backward_blocks`](crate::Accelerator::backward_blocks) (default `false`; the config file's
    /// `fsdp_config.fsdp_activation_checkpointing`, `FSDP_ACTIVATION_CHECKPOINTING`, as Accelerate names it).
    /// Block-wise `FULL_SHARD` recomputes its blocks whatever this says.
    pub activation_checkpointing: bool,
    /// Burn's own gradient checkpointing on the accelerator's autodiff device (its `Balanced` strategy:
    /// element-wise operations are recomputed in backward instead of kept; default `false`;
    /// `ACCELERATE_AUTODIFF_CHECKPOINTING`).
    pub autodiff_checkpointing: bool,
    /// Which path gradients take between ranks (default [`GradientTransport::Auto`]: the device where it can;
    /// `ACCELERATE_GRADIENT_TRANSPORT`).
    pub gradient_transport: GradientTransport,
    /// Seconds a collective waits for the other ranks before failing (default 300;
    /// `ACCELERATE_COLLECTIVE_TIMEOUT`).
    pub collective_timeout_secs: f64,
    /// Continue from the latest automatic checkpoint when [`Accelerator::resume`](crate::Accelerator::resume)
    /// is called (default `false`; `ACCELERATE_RESUME_FROM_LATEST`). A restarted job resumes whatever this says.
    pub resume_from_latest: bool,
    /// How many times a launcher has restarted this job after a failure (0 on the first run): set by
    /// `burn-accelerate launch --max-restarts` (`ACCELERATE_RESTART_COUNT`) or torchrun
    /// (`TORCHELASTIC_RESTART_COUNT`); a run with a count above 0 resumes from its latest checkpoint.
    pub restart_count: usize,
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
/// ([`AcceleratorConfig::resume_from_latest`]).
pub const RESUME_VAR: &str = "ACCELERATE_RESUME_FROM_LATEST";

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

impl Default for AcceleratorConfig {
    fn default() -> Self {
        Self {
            device_placement: true,
            step_scheduler_with_optimizer: true,
            split_batches: false,
            scheduler_rule: SchedulerRule::OncePerOptimizerStep,
            gradient_accumulation_steps: 1,
            cpu: false,
            mixed_precision: MixedPrecision::No,
            loss_scaler: LossScaler::default(),
            debug: false,
            even_batches: true,
            sync_each_batch: false,
            loss_normalization: LossNormalization::ActualMicroBatches,
            bucket_size_mb: 25.0,
            sharding: ShardingStrategy::NoShard,
            dp_shard_size: None,
            activation_checkpointing: false,
            autodiff_checkpointing: false,
            gradient_transport: GradientTransport::Auto,
            collective_timeout_secs: 300.0,
            resume_from_latest: false,
            restart_count: 0,
            launch: LaunchSettings::default(),
            sources: BTreeMap::new(),
            unsupported: Vec::new(),
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
    /// config.mixed_precision = MixedPrecision::Bf16;
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
    fn values(&self) -> [(Key, String); 12] {
        [
            (Key::MixedPrecision, self.mixed_precision.to_string()),
            (Key::Cpu, self.cpu.to_string()),
            (Key::Debug, self.debug.to_string()),
            (
                Key::GradientAccumulationSteps,
                self.gradient_accumulation_steps.to_string(),
            ),
            (
                Key::CollectiveTimeoutSecs,
                self.collective_timeout_secs.to_string(),
            ),
            (Key::SplitBatches, self.split_batches.to_string()),
            (Key::EvenBatches, self.even_batches.to_string()),
            (Key::Sharding, self.sharding.to_string()),
            (
                Key::DpShardSize,
                self.dp_shard_size
                    .map_or_else(|| "processes per machine".into(), |n| n.to_string()),
            ),
            (
                Key::ActivationCheckpointing,
                self.activation_checkpointing.to_string(),
            ),
            (
                Key::AutodiffCheckpointing,
                self.autodiff_checkpointing.to_string(),
            ),
            (Key::GradientTransport, self.gradient_transport.to_string()),
        ]
    }

    /// [`apply_file`](Self::apply_file) on the text of a file (`origin` names it in errors, and a name ending
    /// in `.json` is read as JSON).
    pub fn apply_yaml(&mut self, text: &str, origin: &str) -> Result<()> {
        file::apply(self, file::parse(text, origin)?, origin)
    }

    /// Checks the values, and that no value of the config file this crate cannot honour is still in effect.
    pub fn validate(&self) -> Result<()> {
        for unsupported in &self.unsupported {
            let overridden = unsupported.key == "mixed_precision"
                && !matches!(self.source(Key::MixedPrecision), Source::File(_));
            if !overridden {
                return Err(unsupported.error());
            }
        }
        if self.gradient_accumulation_steps == 0 {
            return Err(Error::config(
                "gradient_accumulation_steps",
                "0",
                "configuration",
                "an integer >= 1",
            ));
        }
        self.loss_scaler.validate()?;
        if self.sharding.is_sharded() && self.sync_each_batch {
            return Err(Error::config(
                "sync_each_batch",
                "true",
                "configuration",
                format!(
                    "false with sharding {}: a sharded rank keeps only its own reduced gradients, so \
                     accumulating after a reduction would count the other ranks' shares again; leave \
                     sync_each_batch off (gradients are reduced once per accumulation window) or use NO_SHARD",
                    self.sharding
                ),
            ));
        }
        if !(self.bucket_size_mb.is_finite() && self.bucket_size_mb > 0.0) {
            return Err(Error::config(
                "bucket_size_mb",
                self.bucket_size_mb.to_string(),
                "configuration",
                "a positive number of MiB",
            ));
        }
        if !(self.collective_timeout_secs.is_finite() && self.collective_timeout_secs > 0.0) {
            return Err(Error::config(
                "collective_timeout_secs",
                self.collective_timeout_secs.to_string(),
                "configuration",
                "a positive number of seconds",
            ));
        }
        Ok(())
    }

    /// The collective timeout as a duration, at most [`MAX_COLLECTIVE_TIMEOUT`] (a longer one, up to
    /// `Duration::MAX` or `ACCELERATE_COLLECTIVE_TIMEOUT=1e20`, means "as long as possible", not an overflow).
    pub fn collective_timeout(&self) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.collective_timeout_secs)
            .unwrap_or(MAX_COLLECTIVE_TIMEOUT)
            .min(MAX_COLLECTIVE_TIMEOUT)
    }
}

/// Turns on per-block activation checkpointing (see [`AcceleratorConfig::activation_checkpointing`]), as
/// Accelerate's launcher names it.
pub const ACTIVATION_CHECKPOINTING_VAR: &str = "FSDP_ACTIVATION_CHECKPOINTING";

/// Turns on Burn's own gradient checkpointing on the autodiff device (see
/// [`AcceleratorConfig::autodiff_checkpointing`]).
pub const AUTODIFF_CHECKPOINTING_VAR: &str = "ACCELERATE_AUTODIFF_CHECKPOINTING";

/// The size of a hybrid strategy's shard groups, as Accelerate's launcher names it.
pub const DP_SHARD_SIZE_VAR: &str = "PARALLELISM_CONFIG_DP_SHARD_SIZE";

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
