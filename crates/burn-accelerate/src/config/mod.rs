//! The accelerator's configuration, where each setting came from, and where Accelerate keeps its config file.

pub mod env;
mod file;
mod sharding;
mod transport;

pub use file::UnsupportedValue;
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
    pub sources: BTreeMap<String, Source>,
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
    /// An [`AcceleratorBuilder`](crate::AcceleratorBuilder) call (or a command-line flag).
    Builder,
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
        let env_source = |var: &str| Source::Env(var.to_string());
        if let Some(cpu) = env::flag("ACCELERATE_USE_CPU")? {
            config.cpu = cpu;
            config.set_source("cpu", env_source("ACCELERATE_USE_CPU"));
        }
        if let Some(value) = env::var("ACCELERATE_MIXED_PRECISION") {
            config.mixed_precision = value.parse().map_err(|_| {
                Error::config(
                    "ACCELERATE_MIXED_PRECISION",
                    &value,
                    "environment",
                    "one of no, fp16, bf16",
                )
            })?;
            config.set_source("mixed_precision", env_source("ACCELERATE_MIXED_PRECISION"));
        }
        if let Some(debug) = env::flag("ACCELERATE_DEBUG_MODE")? {
            config.debug = debug;
            config.set_source("debug", env_source("ACCELERATE_DEBUG_MODE"));
        }
        if let Some(value) = env::var("ACCELERATE_COLLECTIVE_TIMEOUT") {
            config.collective_timeout_secs = value.parse().map_err(|_| {
                Error::config(
                    "ACCELERATE_COLLECTIVE_TIMEOUT",
                    &value,
                    "environment",
                    "a number of seconds",
                )
            })?;
            config.set_source(
                "collective_timeout_secs",
                env_source("ACCELERATE_COLLECTIVE_TIMEOUT"),
            );
        }
        if let Some(resume) = env::flag(RESUME_VAR)? {
            config.resume_from_latest = resume;
            config.set_source("resume_from_latest", env_source(RESUME_VAR));
        }
        if let Some((var, count)) = env::first_usize_named(RESTART_COUNT_VARS)? {
            config.restart_count = count;
            config.set_source("restart_count", env_source(var));
        }
        if let Some(sharding) = sharding_from_env()? {
            config.sharding = sharding;
            config.set_source("sharding", env_source(FSDP_VARS[0]));
        }
        if let Some((var, size)) = env::first_usize_named(&[DP_SHARD_SIZE_VAR])? {
            config.dp_shard_size = Some(size);
            config.set_source("dp_shard_size", env_source(var));
        }
        if let Some(on) = env::flag(ACTIVATION_CHECKPOINTING_VAR)? {
            config.activation_checkpointing = on;
            config.set_source(
                "activation_checkpointing",
                env_source(ACTIVATION_CHECKPOINTING_VAR),
            );
        }
        if let Some(on) = env::flag(AUTODIFF_CHECKPOINTING_VAR)? {
            config.autodiff_checkpointing = on;
            config.set_source(
                "autodiff_checkpointing",
                env_source(AUTODIFF_CHECKPOINTING_VAR),
            );
        }
        if let Some(value) = env::var(TRANSPORT_VAR) {
            config.gradient_transport = value.parse().map_err(|_| {
                Error::config(TRANSPORT_VAR, &value, "environment", "auto, host or device")
            })?;
            config.set_source("gradient_transport", env_source(TRANSPORT_VAR));
        }
        if let Some(steps) = env::first_usize(&["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])? {
            config.gradient_accumulation_steps = steps;
            config.set_source(
                "gradient_accumulation_steps",
                env_source("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
            );
        }
        Ok(config)
    }

    /// Applies the keys of an Accelerate config file (`.yaml`, or `.json` read as JSON); see the rules in the
    /// module documentation of the file reader: Accelerate's keys are accepted (used or ignored with a warning),
    /// other keys are an error naming them.
    pub fn apply_file(&mut self, path: &Path) -> Result<()> {
        file::apply_path(self, path)
    }

    /// Where `key` (a field name) got its value.
    pub fn source(&self, key: &str) -> Source {
        self.sources.get(key).cloned().unwrap_or(Source::Default)
    }

    /// Records where `key` got its value.
    pub(crate) fn set_source(&mut self, key: &str, source: Source) {
        self.sources.insert(key.to_string(), source);
    }

    /// The settings a run uses, each with its value and where it came from (what `burn-accelerate env` prints).
    pub fn settings(&self) -> Vec<(&'static str, String, Source)> {
        let entries: [(&'static str, String); 12] = [
            ("mixed_precision", self.mixed_precision.to_string()),
            ("cpu", self.cpu.to_string()),
            ("debug", self.debug.to_string()),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps.to_string(),
            ),
            (
                "collective_timeout_secs",
                self.collective_timeout_secs.to_string(),
            ),
            ("split_batches", self.split_batches.to_string()),
            ("even_batches", self.even_batches.to_string()),
            ("sharding", self.sharding.to_string()),
            (
                "dp_shard_size",
                self.dp_shard_size
                    .map_or_else(|| "processes per machine".into(), |n| n.to_string()),
            ),
            (
                "activation_checkpointing",
                self.activation_checkpointing.to_string(),
            ),
            (
                "autodiff_checkpointing",
                self.autodiff_checkpointing.to_string(),
            ),
            ("gradient_transport", self.gradient_transport.to_string()),
        ];
        entries
            .into_iter()
            .map(|(key, value)| (key, value, self.source(key)))
            .collect()
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
                && !matches!(self.source("mixed_precision"), Source::File(_));
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

/// The sharding the environment asks for, if any.
fn sharding_from_env() -> Result<Option<ShardingStrategy>> {
    let strategy = env::var(FSDP_VARS[1])
        .map(|value| {
            value.parse::<ShardingStrategy>().map_err(|_| {
                Error::config(
                    FSDP_VARS[1],
                    &value,
                    "environment",
                    "FULL_SHARD (1), SHARD_GRAD_OP (2) or NO_SHARD (3)",
                )
            })
        })
        .transpose()?;
    Ok(match env::flag(FSDP_VARS[0])? {
        Some(true) => Some(strategy.unwrap_or(ShardingStrategy::FullShard)),
        Some(false) => Some(ShardingStrategy::NoShard),
        None => strategy,
    })
}

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
