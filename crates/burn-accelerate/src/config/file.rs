//! Accelerate's config file (`default_config.yaml`, or any `.yaml`/`.json` given with `--config-file`), read so
//! that one file serves both tools.
//!
//! Every key Accelerate 1.x writes is accepted. The keys that mean something here are used; the others
//! (DeepSpeed, FSDP, TPU, dynamo, SageMaker, … settings) are ignored with one warning naming them. Only keys
//! Accelerate itself does not know are an error. Values this crate cannot honour (`mixed_precision: fp8`,
//! `distributed_type: FSDP`, a SageMaker `compute_environment`) are an error only where they would take
//! effect: when an accelerator or a launch would use them, and only if nothing overrides them.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::sync::Mutex;

use serde_yaml_ng::Value;

use super::{AcceleratorConfig, Key, Source};
use crate::config::ShardingStrategy;
use crate::config::env;
use crate::error::{Error, Result};
use crate::precision::MixedPrecision;

/// Keys of Accelerate's config files that burn-accelerate does not use (accepted with a warning): its
/// `ClusterConfig` and `SageMakerConfig` fields and the legacy keys its loader converts.
const IGNORED_KEYS: &[&str] = &[
    "additional_args",
    "base_job_name",
    "command",
    "command_file",
    "commands",
    "deepspeed_config",
    "downcast_bf16",
    "dynamo_backend",
    "dynamo_config",
    "ec2_instance_type",
    "enable_cpu_affinity",
    "fp8_config",
    "gpu_ids",
    "iam_role_name",
    "image_uri",
    "ipex_config",
    "main_training_function",
    "megatron_lm_config",
    "mpirun_config",
    "profile",
    "py_version",
    "pytorch_version",
    "rdzv_backend",
    "region",
    "sagemaker_inputs_file",
    "sagemaker_metrics_file",
    "same_network",
    "tp_config",
    "tpu_env",
    "tpu_name",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_vm",
    "tpu_zone",
    "transformers_version",
    "use_mps_device",
];

/// Values of ignored keys that Accelerate writes by default and that ask for nothing (no warning for them).
const ACCELERATE_DEFAULTS: &[(&str, &str)] = &[
    ("gpu_ids", "all"),
    ("main_training_function", "main"),
    ("rdzv_backend", "static"),
    ("same_network", "yes"),
    ("region", "us-east-1"),
];

/// Keys used here (by the accelerator, or by `burn-accelerate launch`).
const USED_KEYS: &[&str] = &[
    "compute_environment",
    "debug",
    "distributed_type",
    "fp16",
    "fsdp_config",
    "gradient_accumulation_steps",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "num_machines",
    "num_processes",
    "parallelism_config",
    "use_cpu",
];

/// Distributed types this crate runs (Accelerate's names).
const SUPPORTED_DISTRIBUTED: &[&str] = &["NO", "MULTI_CPU", "MULTI_GPU", "FSDP"];

/// `fsdp_config` keys that ask for nothing here when they keep these values (Accelerate's defaults, or what
/// burn-accelerate does anyway: whole-model sync of the initial weights, original parameters kept).
const FSDP_NEUTRAL: &[(&str, &str)] = &[
    ("fsdp_offload_params", "no"),
    ("fsdp_sync_module_states", "yes"),
    ("fsdp_use_orig_params", "yes"),
    ("fsdp_cpu_ram_efficient_loading", "yes"),
    ("fsdp_cpu_ram_efficient_loading", "no"),
    ("fsdp_forward_prefetch", "no"),
];

/// Reads `fsdp_config`: the sharding strategy it asks for (`fsdp_sharding_strategy`, or FSDP2's
/// `fsdp_reshard_after_forward`), the keys it sets that change nothing here (to warn about), and the values
/// this crate cannot honour (CPU offload).
fn read_fsdp_config(
    value: &Value,
    origin: &str,
    config: &mut AcceleratorConfig,
    ignored: &mut BTreeSet<String>,
) -> Result<Option<ShardingStrategy>> {
    let Value::Mapping(map) = value else {
        return match value {
            Value::Null => Ok(None),
            _ => Err(Error::config(
                "fsdp_config",
                text_of(value),
                origin,
                "a mapping of fsdp_* keys",
            )),
        };
    };
    let mut strategy = None;
    for (key, value) in map {
        let (key, raw) = (text_of(key), text_of(value));
        match key.as_str() {
            "fsdp_sharding_strategy" => {
                strategy = Some(raw.parse::<ShardingStrategy>().map_err(|e| match e {
                    Error::InvalidConfig { expected, .. } => {
                        Error::config("fsdp_config.fsdp_sharding_strategy", &raw, origin, expected)
                    }
                    other => other,
                })?)
            }
            "fsdp_reshard_after_forward" if strategy.is_none() => {
                let reshard = env::parse_bool(&key, &raw).map_err(|_| {
                    Error::config("fsdp_config.fsdp_reshard_after_forward", &raw, origin, "true or false")
                })?;
                strategy = Some(ShardingStrategy::from_reshard_after_forward(reshard));
            }
            "fsdp_reshard_after_forward" => {}
            "fsdp_activation_checkpointing" => {
                config.memory.activation_checkpointing = env::parse_bool(&key, &raw).map_err(|_| {
                    Error::config(
                        "fsdp_config.fsdp_activation_checkpointing",
                        &raw,
                        origin,
                        "true or false",
                    )
                })?;
                config.set_source(
                    Key::ActivationCheckpointing,
                    Source::File(origin.to_string()),
                );
            }
            "fsdp_param_dtype" | "fsdp_reduce_dtype" => {
                let dtype = raw.parse::<super::ShardDtype>().map_err(|_| {
                    Error::config(format!("fsdp_config.{key}"), &raw, origin, "fp32, bf16 or fp16")
                })?;
                let which = if key == "fsdp_param_dtype" {
                    config.distributed.fsdp_param_dtype = Some(dtype);
                    Key::FsdpParamDtype
                } else {
                    config.distributed.fsdp_reduce_dtype = Some(dtype);
                    Key::FsdpReduceDtype
                };
                config.set_source(which, Source::File(origin.to_string()));
            }
            "fsdp_offload_params" if raw != "no" => config.unsupported.push(UnsupportedValue {
                key: "fsdp_config.fsdp_offload_params",
                value: raw,
                origin: origin.to_string(),
                why: "false (parameters and optimizer state stay on the training device; sharding divides them \
                      between the ranks instead)",
            }),
            k if FSDP_NEUTRAL.contains(&(k, raw.as_str())) || raw.is_empty() => {}
            _ => {
                ignored.insert(format!("fsdp_config.{key}"));
            }
        }
    }
    Ok(strategy)
}

/// Reads `parallelism_config` (Accelerate's `ParallelismConfig`): `parallelism_config_dp_shard_size` sets the shard
/// groups of a hybrid strategy; a replicate size follows from it; `parallelism_config_pp_size`,
/// `parallelism_config_pp_microbatches` and `parallelism_config_pp_schedule` set pipeline parallelism;
/// `parallelism_config_tp_size` and `parallelism_config_cp_size` the mesh's `tp` and `cp` dimensions (`cp` only 1
/// until context parallelism lands: a larger value is refused when the accelerator is built).
fn read_parallelism_config(
    value: &Value,
    origin: &str,
    config: &mut AcceleratorConfig,
    ignored: &mut BTreeSet<String>,
) -> Result<()> {
    let Value::Mapping(map) = value else {
        return match value {
            Value::Null => Ok(()),
            _ => Err(Error::config(
                "parallelism_config",
                text_of(value),
                origin,
                "a mapping of parallelism_config_* keys",
            )),
        };
    };
    for (key, value) in map {
        let (key, raw) = (text_of(key), text_of(value));
        match key.as_str() {
            "parallelism_config_dp_shard_size" => {
                let size = positive(
                    &key,
                    &raw,
                    origin,
                    "a number of ranks per shard group (1 or more)",
                )?;
                config.distributed.dp_shard_size = Some(size);
                config.set_source(Key::DpShardSize, Source::File(origin.to_string()));
            }
            "parallelism_config_pp_size" | "parallelism_config_pp_microbatches" => {
                let count = positive(&key, &raw, origin, "a count of 1 or more")?;
                let source = Source::File(origin.to_string());
                if key == "parallelism_config_pp_size" {
                    config.pipeline.pp_size = count;
                    config.set_source(Key::PpSize, source);
                } else {
                    config.pipeline.pp_microbatches = Some(count);
                    config.set_source(Key::PpMicrobatches, source);
                }
            }
            "parallelism_config_pp_stage_blocks" => {
                let counts = crate::config::PipelineSettings::parse_stage_blocks(&raw).map_err(|_| {
                    Error::config(
                        "parallelism_config.parallelism_config_pp_stage_blocks",
                        &raw,
                        origin,
                        "counts of blocks per stage separated by commas, each 1 or more (`3,5`)",
                    )
                })?;
                config.pipeline.pp_stage_blocks = Some(counts);
                config.set_source(Key::PpStageBlocks, Source::File(origin.to_string()));
            }
            "parallelism_config_pp_schedule" => {
                config.pipeline.pp_schedule = raw.parse().map_err(|_| {
                    Error::config(
                        "parallelism_config.parallelism_config_pp_schedule",
                        &raw,
                        origin,
                        "gpipe or 1f1b",
                    )
                })?;
                config.set_source(Key::PpSchedule, Source::File(origin.to_string()));
            }
            "parallelism_config_tp_size" | "parallelism_config_cp_size" => {
                let size = positive(&key, &raw, origin, "a number of ranks (1 or more)")?;
                let source = Source::File(origin.to_string());
                if key == "parallelism_config_tp_size" {
                    config.distributed.tp_size = size;
                    config.set_source(Key::TpSize, source);
                } else {
                    config.distributed.cp_size = size;
                    config.set_source(Key::CpSize, source);
                }
            }
            "parallelism_config_cp_comm_strategy" => {
                config.distributed.cp_comm_strategy = raw.parse().map_err(|_| {
                    Error::config(
                        "parallelism_config.parallelism_config_cp_comm_strategy",
                        &raw,
                        origin,
                        "allgather or ring (alltoall)",
                    )
                })?;
                config.set_source(Key::CpCommStrategy, Source::File(origin.to_string()));
            }
            "parallelism_config_dp_replicate_size" => {}
            _ if raw.is_empty() || raw == "1" => {}
            _ => {
                ignored.insert(format!("parallelism_config.{key}"));
            }
        }
    }
    Ok(())
}

/// A value read from a config file that this crate cannot honour: an error where it would take effect.
#[derive(Debug, Clone, PartialEq)]
pub struct UnsupportedValue {
    /// The key (`mixed_precision`, `distributed_type`, `compute_environment`).
    pub key: &'static str,
    /// The value as written.
    pub value: String,
    /// The file.
    pub origin: String,
    /// What is supported instead.
    pub why: &'static str,
}

impl UnsupportedValue {
    /// The error a run gets while the value is in effect.
    pub fn error(&self) -> Error {
        Error::config(
            self.key,
            &self.value,
            &self.origin,
            format!(
                "a value burn-accelerate can honour: {}; change it (`burn-accelerate config`), override it (for \
                 mixed_precision: ACCELERATE_MIXED_PRECISION or the builder), or pass another --config-file",
                self.why
            ),
        )
    }
}

/// The value `raw` of `parallelism_config.{key}` as a count of 1 or more; else an error naming the key, the file
/// and what it expects.
fn positive(key: &str, raw: &str, origin: &str, expected: &str) -> Result<usize> {
    raw.parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| Error::config(format!("parallelism_config.{key}"), raw, origin, expected))
}

/// Warns once per process about the ignored keys of a file.
fn warn_ignored(origin: &str, keys: &BTreeSet<String>) {
    static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    if keys.is_empty() {
        return;
    }
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    if warned
        .get_or_insert_with(HashSet::new)
        .insert(origin.to_string())
    {
        let list: Vec<&str> = keys.iter().map(String::as_str).collect();
        log::warn!(
            "config file {origin}: ignoring Accelerate settings that burn-accelerate does not use: {}",
            list.join(", ")
        );
    }
}

/// The text of a scalar value (`true` -> `yes`), as Accelerate's own loader reads it.
fn text_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Bool(b) => if *b { "yes" } else { "no" }.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Null => String::new(),
        other => format!("{other:?}"),
    }
}

/// Parses the text of a config file; `.json` files are read as JSON, everything else as YAML.
pub(crate) fn parse(text: &str, origin: &str) -> Result<Vec<(String, Value)>> {
    let value: Value = if origin.ends_with(".json") {
        let json: serde_json::Value = serde_json::from_str(text).map_err(|e| {
            Error::config("config file", origin, origin, format!("valid JSON ({e})"))
        })?;
        serde_yaml_ng::to_value(json).map_err(|e| {
            Error::config("config file", origin, origin, format!("plain JSON ({e})"))
        })?
    } else {
        serde_yaml_ng::from_str(text).map_err(|e| {
            Error::config("config file", origin, origin, format!("valid YAML ({e})"))
        })?
    };
    match value {
        Value::Mapping(map) => Ok(map.into_iter().map(|(k, v)| (text_of(&k), v)).collect()),
        Value::Null => Ok(Vec::new()),
        _ => Err(Error::config(
            "config file",
            origin,
            origin,
            "a mapping of keys to values",
        )),
    }
}

/// Applies the entries of a config file to `config`.
pub(crate) fn apply(
    config: &mut AcceleratorConfig,
    entries: Vec<(String, Value)>,
    origin: &str,
) -> Result<()> {
    let source = Source::File(origin.to_string());
    let mut ignored = BTreeSet::new();
    let mut unknown = Vec::new();
    let mut legacy_fp16 = false;
    let mut has_mixed_precision = false;
    let mut fsdp: Option<ShardingStrategy> = None;
    let mut distributed: Option<String> = None;
    for (key, value) in entries {
        let raw = text_of(&value);
        let bad = |expected: &str| Error::config(&key, &raw, origin, expected);
        let number = |expected: &str| -> Result<Option<usize>> {
            if raw.is_empty() {
                Ok(None)
            } else {
                raw.parse().map(Some).map_err(|_| bad(expected))
            }
        };
        match key.as_str() {
            "mixed_precision" => {
                has_mixed_precision = true;
                if raw.eq_ignore_ascii_case("fp8") {
                    config.unsupported.push(UnsupportedValue {
                        key: "mixed_precision",
                        value: raw.clone(),
                        origin: origin.to_string(),
                        why: "no, fp16 or bf16 (Burn has no fp8 kernels)",
                    });
                } else {
                    config.precision.mixed_precision =
                        raw.parse().map_err(|_| bad("one of no, fp16, bf16"))?;
                }
                config.set_source(Key::MixedPrecision, source.clone());
            }
            "fp16" => {
                legacy_fp16 = env::parse_bool(&key, &raw).map_err(|_| bad("true or false"))?
            }
            "debug" => {
                config.distributed.debug =
                    env::parse_bool(&key, &raw).map_err(|_| bad("true or false"))?;
                config.set_source(Key::Debug, source.clone());
            }
            "use_cpu" => {
                config.device.cpu =
                    env::parse_bool(&key, &raw).map_err(|_| bad("true or false"))?;
                config.set_source(Key::Cpu, source.clone());
            }
            "gradient_accumulation_steps" => {
                config.accumulation.gradient_accumulation_steps =
                    raw.parse().map_err(|_| bad("an integer >= 1"))?;
                config.set_source(Key::GradientAccumulationSteps, source.clone());
            }
            "distributed_type" => {
                let kind = raw.to_ascii_uppercase();
                if !SUPPORTED_DISTRIBUTED.contains(&kind.as_str()) {
                    config.unsupported.push(UnsupportedValue {
                        key: "distributed_type",
                        value: raw.clone(),
                        origin: origin.to_string(),
                        why: "NO, MULTI_CPU, MULTI_GPU or FSDP (data parallelism, sharded or not; no DeepSpeed, \
                              Megatron-LM or TPU: for ZeRO stages 2 and 3 use FSDP with SHARD_GRAD_OP or FULL_SHARD)",
                    });
                }
                distributed = Some(kind.clone());
                config.launch.distributed_type = Some(kind);
            }
            "fsdp_config" => fsdp = read_fsdp_config(&value, origin, config, &mut ignored)?,
            "parallelism_config" => read_parallelism_config(&value, origin, config, &mut ignored)?,
            "compute_environment" => {
                if !raw.eq_ignore_ascii_case("LOCAL_MACHINE") {
                    config.unsupported.push(UnsupportedValue {
                        key: "compute_environment",
                        value: raw.clone(),
                        origin: origin.to_string(),
                        why: "LOCAL_MACHINE (burn-accelerate does not launch on Amazon SageMaker)",
                    });
                }
            }
            "num_processes" => config.launch.num_processes = number("a number of processes")?,
            "num_machines" => config.launch.num_machines = number("a number of machines")?,
            "machine_rank" => config.launch.machine_rank = number("this machine's rank")?,
            "main_process_port" => {
                config.launch.main_process_port = number("a port number")?.map(|p| p as u16)
            }
            "main_process_ip" => {
                config.launch.main_process_ip = (!raw.is_empty()).then(|| raw.clone())
            }
            k if IGNORED_KEYS.contains(&k) => {
                // A key Accelerate writes with an empty or default value means nothing either way.
                let empty = matches!(&value, Value::Null)
                    || matches!(&value, Value::Mapping(m) if m.is_empty())
                    || matches!(&value, Value::Sequence(s) if s.is_empty())
                    || matches!(&value, Value::Bool(false))
                    || raw == "no"
                    || ACCELERATE_DEFAULTS.contains(&(k, raw.as_str()));
                if !empty {
                    ignored.insert(key.clone());
                }
            }
            _ => unknown.push(key),
        }
    }
    if !unknown.is_empty() {
        return Err(Error::config(
            unknown.join(", "),
            "",
            origin,
            format!(
                "a key Accelerate knows ({}); remove or correct it",
                USED_KEYS
                    .iter()
                    .chain(IGNORED_KEYS)
                    .copied()
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if distributed.as_deref() == Some("FSDP") {
        // Accelerate's FSDP plugin defaults to FULL_SHARD.
        config.distributed.sharding = fsdp.unwrap_or(ShardingStrategy::FullShard);
        config.set_source(Key::Sharding, source.clone());
    } else if fsdp.is_some_and(|s| s.is_sharded()) {
        ignored.insert("fsdp_config (distributed_type is not FSDP)".into());
    }
    config.unsupported.retain(|u| {
        u.key != "fsdp_config.fsdp_offload_params" || distributed.as_deref() == Some("FSDP")
    });
    if legacy_fp16 && !has_mixed_precision {
        // Accelerate's loader turns the old `fp16: true` into `mixed_precision: fp16`.
        config.precision.mixed_precision = MixedPrecision::Fp16;
        config.set_source(Key::MixedPrecision, source);
    }
    warn_ignored(origin, &ignored);
    Ok(())
}

/// Reads and applies the file at `path`.
pub(crate) fn apply_path(config: &mut AcceleratorConfig, path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        operation: "reading the config file",
        path: path.to_path_buf(),
        source,
    })?;
    let origin = path.display().to_string();
    apply(config, parse(&text, &origin)?, &origin)
}
