//! The accelerator's configuration and where Accelerate keeps its config file.

use std::path::PathBuf;

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
    /// Defaults overridden by the `ACCELERATE_*` environment variables that are set.
    pub fn from_env() -> Result<Self> {
        let mut config = Self::default();
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
