//! The environment variables that carry settings, each paired with the setting it sets. Every run reads them
//! ([`AcceleratorConfig::read_file_and_env`]) and a launcher writes them for the processes it starts
//! ([`AcceleratorConfig::launch_env`]) from this one table, so the two cannot drift apart.

use super::{
    ACTIVATION_CHECKPOINTING_VAR, AUTODIFF_CHECKPOINTING_VAR, AcceleratorConfig, CP_SIZE_VAR,
    DP_SHARD_SIZE_VAR, FSDP_VARS, INDEPENDENT_VAR, Key, PP_MICROBATCHES_VAR, PP_SCHEDULE_VAR,
    PP_SIZE_VAR, PP_STAGE_BLOCKS_VAR, RESTART_COUNT_VARS, RESUME_VAR, SEQUENCE_PARALLEL_VAR,
    ShardingStrategy, Source, TP_SIZE_VAR, TRANSPORT_VAR, env,
};
use crate::error::{Error, Result};

/// One variable: its name, the setting it carries, how its text sets that setting, and what a launcher writes
/// into it (`None`: a launcher leaves it as it finds it).
struct Variable {
    name: &'static str,
    key: Key,
    read: fn(&mut AcceleratorConfig, &str, &str) -> Result<()>,
    write: Option<fn(&AcceleratorConfig) -> Option<String>>,
}

/// Parses `text`, or says what the variable `name` should hold.
fn parse<T: std::str::FromStr>(name: &str, text: &str, expected: &str) -> Result<T> {
    text.parse()
        .map_err(|_| Error::config(name, text, "environment", expected))
}

const COUNT: &str = "a non-negative integer";

/// The variables with one setting each (sharding and the restart count, read from two variables, are below).
const VARIABLES: &[Variable] = &[
    Variable {
        name: "ACCELERATE_USE_CPU",
        key: Key::Cpu,
        read: |c, name, text| env::parse_bool(name, text).map(|v| c.device.cpu = v),
        write: Some(|c| Some(c.device.cpu.to_string())),
    },
    Variable {
        name: "ACCELERATE_MIXED_PRECISION",
        key: Key::MixedPrecision,
        read: |c, name, text| {
            parse(name, text, "one of no, fp16, bf16").map(|v| c.precision.mixed_precision = v)
        },
        write: Some(|c| Some(c.precision.mixed_precision.to_string())),
    },
    Variable {
        name: "ACCELERATE_DEBUG_MODE",
        key: Key::Debug,
        read: |c, name, text| env::parse_bool(name, text).map(|v| c.distributed.debug = v),
        write: Some(|c| Some(c.distributed.debug.to_string())),
    },
    Variable {
        name: "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        key: Key::GradientAccumulationSteps,
        read: |c, name, text| {
            parse(name, text, COUNT).map(|v| c.accumulation.gradient_accumulation_steps = v)
        },
        write: Some(|c| Some(c.accumulation.gradient_accumulation_steps.to_string())),
    },
    Variable {
        name: DP_SHARD_SIZE_VAR,
        key: Key::DpShardSize,
        read: |c, name, text| {
            parse(name, text, COUNT).map(|v| c.distributed.dp_shard_size = Some(v))
        },
        write: Some(|c| c.distributed.dp_shard_size.map(|n| n.to_string())),
    },
    Variable {
        name: TP_SIZE_VAR,
        key: Key::TpSize,
        read: |c, name, text| parse(name, text, COUNT).map(|v| c.distributed.tp_size = v),
        write: Some(|c| (c.distributed.tp_size != 1).then(|| c.distributed.tp_size.to_string())),
    },
    Variable {
        name: SEQUENCE_PARALLEL_VAR,
        key: Key::SequenceParallel,
        read: |c, name, text| {
            env::parse_bool(name, text).map(|v| c.distributed.sequence_parallel = v)
        },
        write: Some(|c| c.distributed.sequence_parallel.then(|| "true".to_string())),
    },
    Variable {
        name: CP_SIZE_VAR,
        key: Key::CpSize,
        read: |c, name, text| parse(name, text, COUNT).map(|v| c.distributed.cp_size = v),
        write: Some(|c| (c.distributed.cp_size != 1).then(|| c.distributed.cp_size.to_string())),
    },
    Variable {
        name: super::CP_COMM_STRATEGY_VAR,
        key: Key::CpCommStrategy,
        read: |c, name, text| {
            parse(name, text, "allgather or ring").map(|v| c.distributed.cp_comm_strategy = v)
        },
        write: Some(|c| {
            (c.distributed.cp_comm_strategy != super::ContextAttention::AllGather)
                .then(|| c.distributed.cp_comm_strategy.to_string())
        }),
    },
    Variable {
        name: super::CP_LOAD_BALANCE_VAR,
        key: Key::CpLoadBalance,
        read: |c, name, text| {
            env::parse_bool(name, text).map(|v| c.distributed.cp_load_balance = v)
        },
        write: Some(|c| (!c.distributed.cp_load_balance).then(|| "false".to_string())),
    },
    Variable {
        name: PP_SIZE_VAR,
        key: Key::PpSize,
        read: |c, name, text| parse(name, text, COUNT).map(|v| c.pipeline.pp_size = v),
        write: Some(|c| Some(c.pipeline.pp_size.to_string())),
    },
    Variable {
        name: PP_MICROBATCHES_VAR,
        key: Key::PpMicrobatches,
        read: |c, name, text| {
            parse(name, text, COUNT).map(|v| c.pipeline.pp_microbatches = Some(v))
        },
        write: Some(|c| c.pipeline.pp_microbatches.map(|n| n.to_string())),
    },
    Variable {
        name: PP_SCHEDULE_VAR,
        key: Key::PpSchedule,
        read: |c, name, text| {
            parse(name, text, "gpipe or 1f1b").map(|v| c.pipeline.pp_schedule = v)
        },
        write: Some(|c| Some(c.pipeline.pp_schedule.to_string())),
    },
    Variable {
        name: PP_STAGE_BLOCKS_VAR,
        key: Key::PpStageBlocks,
        read: |c, name, text| {
            super::PipelineSettings::parse_stage_blocks(text)
                .map_err(|_| {
                    Error::config(
                        name,
                        text,
                        "environment",
                        "counts of blocks per stage separated by commas, each 1 or more (`3,5`)",
                    )
                })
                .map(|v| c.pipeline.pp_stage_blocks = Some(v))
        },
        write: Some(|c| c.pipeline.stage_blocks_text()),
    },
    Variable {
        name: "FSDP_PARAM_DTYPE",
        key: Key::FsdpParamDtype,
        read: |c, name, text| {
            parse(name, text, "fp32, bf16 or fp16")
                .map(|v| c.distributed.fsdp_param_dtype = Some(v))
        },
        write: Some(|c| c.distributed.fsdp_param_dtype.map(|d| d.to_string())),
    },
    Variable {
        name: "FSDP_REDUCE_DTYPE",
        key: Key::FsdpReduceDtype,
        read: |c, name, text| {
            parse(name, text, "fp32, bf16 or fp16")
                .map(|v| c.distributed.fsdp_reduce_dtype = Some(v))
        },
        write: Some(|c| c.distributed.fsdp_reduce_dtype.map(|d| d.to_string())),
    },
    Variable {
        name: ACTIVATION_CHECKPOINTING_VAR,
        key: Key::ActivationCheckpointing,
        read: |c, name, text| {
            env::parse_bool(name, text).map(|v| c.memory.activation_checkpointing = v)
        },
        write: Some(|c| Some(c.memory.activation_checkpointing.to_string())),
    },
    Variable {
        name: AUTODIFF_CHECKPOINTING_VAR,
        key: Key::AutodiffCheckpointing,
        read: |c, name, text| {
            env::parse_bool(name, text).map(|v| c.memory.autodiff_checkpointing = v)
        },
        write: None,
    },
    Variable {
        name: "ACCELERATE_COLLECTIVE_TIMEOUT",
        key: Key::CollectiveTimeoutSecs,
        read: |c, name, text| {
            parse(name, text, "a number of seconds")
                .map(|v| c.distributed.collective_timeout_secs = v)
        },
        write: None,
    },
    Variable {
        name: TRANSPORT_VAR,
        key: Key::GradientTransport,
        read: |c, name, text| {
            parse(name, text, "auto, host or device").map(|v| c.distributed.gradient_transport = v)
        },
        write: None,
    },
    Variable {
        name: INDEPENDENT_VAR,
        key: Key::IndependentProcesses,
        read: |c, name, text| {
            env::parse_bool(name, text).map(|v| c.distributed.independent_processes = v)
        },
        write: None,
    },
    Variable {
        name: RESUME_VAR,
        key: Key::ResumeFromLatest,
        read: |c, name, text| {
            env::parse_bool(name, text).map(|v| c.recovery.resume_from_latest = v)
        },
        write: None,
    },
];

/// Sets every setting the environment carries, recording each variable as its source.
pub(super) fn read(config: &mut AcceleratorConfig) -> Result<()> {
    read_from(config, &env::var)
}

/// [`read`], with `lookup` giving each variable's trimmed, non-empty text.
pub(super) fn read_from(
    config: &mut AcceleratorConfig,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    for variable in VARIABLES {
        if let Some(text) = lookup(variable.name) {
            (variable.read)(config, variable.name, &text)?;
            config.set_source(variable.key, Source::Env(variable.name.to_string()));
        }
    }
    // The first restart-count variable set wins.
    let restart = RESTART_COUNT_VARS
        .iter()
        .find_map(|name| lookup(name).map(|text| (*name, text)));
    if let Some((name, text)) = restart {
        config.recovery.restart_count = parse(name, &text, COUNT)?;
        config.set_source(Key::RestartCount, Source::Env(name.to_string()));
    }
    if let Some(sharding) = sharding(lookup)? {
        config.distributed.sharding = sharding;
        config.set_source(Key::Sharding, Source::Env(FSDP_VARS[0].to_string()));
    }
    Ok(())
}

/// The sharding the environment asks for, if any: `ACCELERATE_USE_FSDP=true` alone means `FULL_SHARD`.
fn sharding(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<ShardingStrategy>> {
    let strategy = lookup(FSDP_VARS[1])
        .map(|text| {
            parse::<ShardingStrategy>(
                FSDP_VARS[1],
                &text,
                "FULL_SHARD (1), SHARD_GRAD_OP (2), NO_SHARD (3), HYBRID_SHARD (4) or _HYBRID_SHARD_ZERO2 (5)",
            )
        })
        .transpose()?;
    let used = lookup(FSDP_VARS[0])
        .map(|text| env::parse_bool(FSDP_VARS[0], &text))
        .transpose()?;
    Ok(match used {
        Some(true) => Some(strategy.unwrap_or(ShardingStrategy::FullShard)),
        Some(false) => Some(ShardingStrategy::NoShard),
        None => strategy,
    })
}

/// The settings a launcher carries, in the order it writes them.
pub(super) fn carried() -> impl Iterator<Item = Key> {
    VARIABLES
        .iter()
        .filter(|v| v.write.is_some())
        .map(|v| v.key)
        .chain([Key::Sharding])
}

/// The variables a launcher sets for its processes, with this configuration's values.
pub(super) fn write(config: &AcceleratorConfig) -> Vec<(&'static str, String)> {
    let mut vars: Vec<(&'static str, String)> = VARIABLES
        .iter()
        .filter_map(|v| Some((v.name, (v.write?)(config)?)))
        .collect();
    vars.push((
        FSDP_VARS[0],
        config.distributed.sharding.is_sharded().to_string(),
    ));
    vars.push((FSDP_VARS[1], config.distributed.sharding.to_string()));
    vars
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MixedPrecision;
    use crate::config::GradientTransport;

    fn read_back(vars: &[(&'static str, String)]) -> AcceleratorConfig {
        let mut config = AcceleratorConfig::default();
        let lookup = |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
        };
        read_from(&mut config, &lookup).unwrap();
        config
    }

    #[test]
    fn what_a_launcher_writes_every_process_reads_back() {
        let mut launched = AcceleratorConfig::default();
        launched.precision.mixed_precision = MixedPrecision::Bf16;
        launched.accumulation.gradient_accumulation_steps = 4;
        launched.distributed.debug = true;
        launched.device.cpu = true;
        launched.distributed.sharding = ShardingStrategy::HybridShardZero2;
        launched.distributed.dp_shard_size = Some(3);
        launched.distributed.tp_size = 2;
        launched.distributed.sequence_parallel = true;
        launched.distributed.cp_size = 3;
        launched.distributed.cp_comm_strategy = crate::config::ContextAttention::Ring;
        launched.distributed.cp_load_balance = false;
        launched.distributed.fsdp_param_dtype = Some(crate::ShardDtype::Bf16);
        launched.distributed.fsdp_reduce_dtype = Some(crate::ShardDtype::Fp32);
        launched.memory.activation_checkpointing = true;
        launched.pipeline.pp_size = 2;
        launched.pipeline.pp_microbatches = Some(6);
        launched.pipeline.pp_schedule = crate::PipelineSchedule::GPipe;
        launched.pipeline.pp_stage_blocks = Some(vec![3, 5]);
        launched.set_source(Key::MixedPrecision, Source::CommandLine);
        let vars = launched.launch_env();
        let read = read_back(&vars);
        for key in carried() {
            assert_eq!(
                read.settings()
                    .iter()
                    .find(|s| s.0 == key.name())
                    .map(|s| &s.1),
                launched
                    .settings()
                    .iter()
                    .find(|s| s.0 == key.name())
                    .map(|s| &s.1),
                "{key}"
            );
            assert!(matches!(read.source(key), Source::Env(_)), "{key}");
        }
        // Every setting a launcher carries differs from its default here, so a variable it forgot fails above.
        let defaults = AcceleratorConfig::default();
        for key in carried() {
            let value = |c: &AcceleratorConfig| {
                c.settings()
                    .into_iter()
                    .find(|s| s.0 == key.name())
                    .map(|s| s.1)
            };
            assert_ne!(
                value(&launched),
                value(&defaults),
                "{key} keeps its default in this test"
            );
        }
        // Without a shard size the variable is left out, and each process takes its machine's processes.
        launched.distributed.dp_shard_size = None;
        let vars = launched.launch_env();
        assert!(vars.iter().all(|(name, _)| *name != DP_SHARD_SIZE_VAR));
        assert_eq!(read_back(&vars).distributed.dp_shard_size, None);
    }

    #[test]
    fn the_variables_are_read_with_their_names_in_errors_and_sources() {
        let vars = [
            ("ACCELERATE_GRADIENT_TRANSPORT", "host".to_string()),
            ("TORCHELASTIC_RESTART_COUNT", "2".to_string()),
            ("ACCELERATE_USE_FSDP", "yes".to_string()),
        ];
        let config = read_back(&vars);
        assert_eq!(
            config.distributed.gradient_transport,
            GradientTransport::Host
        );
        assert_eq!(config.recovery.restart_count, 2);
        assert_eq!(
            config.source(Key::RestartCount),
            Source::Env("TORCHELASTIC_RESTART_COUNT".into())
        );
        assert_eq!(
            config.distributed.sharding,
            ShardingStrategy::FullShard,
            "USE_FSDP alone"
        );
        let mut config = AcceleratorConfig::default();
        let bad = |name: &str| (name == "FSDP_SHARDING_STRATEGY").then(|| "6".to_string());
        let err = read_from(&mut config, &bad).unwrap_err().to_string();
        assert!(
            err.contains("FSDP_SHARDING_STRATEGY") && err.contains("HYBRID_SHARD (4)"),
            "{err}"
        );
    }
}
