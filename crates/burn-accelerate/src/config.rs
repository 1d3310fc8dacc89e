//! The accelerator's configuration and where Accelerate keeps its config file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::env;
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
    /// Seconds a collective waits for the other ranks before failing (default 300;
    /// `ACCELERATE_COLLECTIVE_TIMEOUT`).
    pub collective_timeout_secs: f64,
}

impl Default for AcceleratorConfig {
    fn default() -> Self {
        Self {
            device_placement: true,
            step_scheduler_with_optimizer: true,
            split_batches: false,
            gradient_accumulation_steps: 1,
            cpu: false,
            mixed_precision: MixedPrecision::No,
            loss_scaler: LossScaler::default(),
            debug: false,
            even_batches: true,
            sync_each_batch: false,
            loss_normalization: LossNormalization::ActualMicroBatches,
            bucket_size_mb: 25.0,
            collective_timeout_secs: 300.0,
        }
    }
}

impl AcceleratorConfig {
    /// Defaults, overridden by the config file (`ACCELERATE_CONFIG_FILE`, else Accelerate's
    /// `default_config.yaml` when it exists), overridden by the `ACCELERATE_*` environment variables.
    pub fn from_file_and_env() -> Result<Self> {
        let mut config = Self::default();
        let file = env::var("ACCELERATE_CONFIG_FILE")
            .map(PathBuf::from)
            .or_else(|| default_config_file().filter(|p| p.exists()));
        if let Some(path) = file {
            config.apply_file(&path)?;
        }
        if let Some(cpu) = env::flag("ACCELERATE_USE_CPU")? {
            config.cpu = cpu;
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
        }
        if let Some(debug) = env::flag("ACCELERATE_DEBUG_MODE")? {
            config.debug = debug;
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
        }
        if let Some(steps) = env::first_usize(&["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])? {
            config.gradient_accumulation_steps = steps;
        }
        config.validate()?;
        Ok(config)
    }

    /// Applies the keys of an Accelerate config file (YAML). Keys Accelerate writes but burn-accelerate does
    /// not use are accepted; any other key is an error naming it.
    pub fn apply_file(&mut self, path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            operation: "reading the config file",
            path: path.to_path_buf(),
            source,
        })?;
        self.apply_yaml(&text, &path.display().to_string())
    }

    /// [`apply_file`](Self::apply_file) on the text of a file (`origin` names it in errors).
    pub fn apply_yaml(&mut self, text: &str, origin: &str) -> Result<()> {
        use serde_yaml_ng::Value;
        let value: Value = serde_yaml_ng::from_str(text).map_err(|e| {
            Error::config("config file", origin, origin, format!("valid YAML ({e})"))
        })?;
        let map = match value {
            Value::Mapping(map) => map,
            Value::Null => return Ok(()),
            _ => {
                return Err(Error::config(
                    "config file",
                    origin,
                    origin,
                    "a YAML mapping of keys to values",
                ));
            }
        };
        let text_of = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Bool(b) => if *b { "yes" } else { "no" }.to_string(),
            Value::Number(n) => n.to_string(),
            other => format!("{other:?}"),
        };
        for (key, value) in map {
            let key = text_of(&key);
            let raw = text_of(&value);
            let bad = |expected: &str| Error::config(&key, &raw, origin, expected);
            match key.as_str() {
                "mixed_precision" => {
                    self.mixed_precision = raw.parse().map_err(|_| bad("one of no, fp16, bf16"))?
                }
                "debug" => {
                    self.debug = env::parse_bool(&key, &raw).map_err(|_| bad("true or false"))?
                }
                "use_cpu" => {
                    self.cpu = env::parse_bool(&key, &raw).map_err(|_| bad("true or false"))?
                }
                "gradient_accumulation_steps" => {
                    self.gradient_accumulation_steps =
                        raw.parse().map_err(|_| bad("an integer >= 1"))?
                }
                k if ACCELERATE_KEYS.contains(&k) => {}
                _ => {
                    return Err(Error::config(
                        &key,
                        raw,
                        origin,
                        format!(
                            "a known key: mixed_precision, debug, use_cpu, gradient_accumulation_steps, or one of \
                             Accelerate's ({}); remove or correct it",
                            ACCELERATE_KEYS.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if self.gradient_accumulation_steps == 0 {
            return Err(Error::config(
                "gradient_accumulation_steps",
                "0",
                "configuration",
                "an integer >= 1",
            ));
        }
        self.loss_scaler.validate()?;
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

    /// The collective timeout as a duration.
    pub fn collective_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.collective_timeout_secs)
    }
}

/// Keys of Accelerate's config file that are accepted without effect here (launcher and plug-in settings).
const ACCELERATE_KEYS: &[&str] = &[
    "compute_environment",
    "deepspeed_config",
    "distributed_type",
    "downcast_bf16",
    "dynamo_config",
    "enable_cpu_affinity",
    "fsdp_config",
    "gpu_ids",
    "ipex_config",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "megatron_lm_config",
    "mpirun_config",
    "num_machines",
    "num_processes",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_mps_device",
];

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

#[cfg(test)]
mod tests {
    use super::*;

    const ACCELERATE_FILE: &str = "compute_environment: LOCAL_MACHINE
debug: true
distributed_type: 'NO'
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
";

    #[test]
    fn reads_accelerate_files() {
        let mut config = AcceleratorConfig::default();
        config
            .apply_yaml(ACCELERATE_FILE, "default_config.yaml")
            .unwrap();
        assert_eq!(config.mixed_precision, MixedPrecision::Bf16);
        assert!(config.debug && config.cpu);
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        let mut config = AcceleratorConfig::default();
        let err = config
            .apply_yaml("mixed_precison: fp16\n", "my.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mixed_precison") && err.contains("my.yaml"),
            "{err}"
        );
        let err = config
            .apply_yaml("mixed_precision: fp8\n", "my.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("one of no, fp16, bf16") && err.contains("fp8"),
            "{err}"
        );
        assert!(config.apply_yaml("- a list\n", "my.yaml").is_err());
        assert!(config.apply_yaml("", "empty.yaml").is_ok());
    }
}
