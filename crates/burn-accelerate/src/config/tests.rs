//! The configuration's tests: sources, precedence, the config file's keys, validation.

use super::*;
use crate::precision::MixedPrecision;

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
fn every_key_python_accelerate_writes_is_accepted_and_unusable_values_fail_only_in_effect() {
    // The shapes of Accelerate's own sample configs: fp8, FSDP, TPU commands, SageMaker, MPI, legacy keys.
    let fp8 = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nfp8_config:\n  backend: TE\n  \
               fp8_format: E4M3\nmixed_precision: fp8\nnum_processes: 2\ntp_config: {}\nparallelism_config: {}\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(fp8, "fp8.yaml").unwrap();
    assert_eq!(config.launch.num_processes, Some(2));
    assert!(config.validate().is_err(), "fp8 in effect");
    config.precision.mixed_precision = MixedPrecision::Bf16;
    config.set_source(
        Key::MixedPrecision,
        Source::Env("ACCELERATE_MIXED_PRECISION".into()),
    );
    config
        .validate()
        .expect("overridden: fp8 no longer takes effect");

    // `accelerate config`'s FSDP answers (FSDP1 and FSDP2 spellings).
    let fsdp = "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
                fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_cpu_ram_efficient_loading: true\n  \
                fsdp_forward_prefetch: false\n  fsdp_offload_params: false\n  fsdp_sharding_strategy: 2\n  \
                fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_sync_module_states: true\n  \
                fsdp_use_orig_params: true\nmixed_precision: 'no'\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(fsdp, "fsdp.yaml").unwrap();
    config.validate().unwrap();
    assert_eq!(config.distributed.sharding, ShardingStrategy::ShardGradOp);
    assert_eq!(
        config.source(Key::Sharding),
        Source::File("fsdp.yaml".into())
    );
    let fsdp2 = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(fsdp2, "fsdp2.yaml").unwrap();
    assert_eq!(config.distributed.sharding, ShardingStrategy::FullShard);
    let bare = "distributed_type: FSDP\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(bare, "bare.yaml").unwrap();
    assert_eq!(
        config.distributed.sharding,
        ShardingStrategy::FullShard,
        "Accelerate's default"
    );
    // Settings that would silently do nothing are refused: CPU offload; FSDP settings
    // under another distributed type are only warned about.
    let offload = "distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: true\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(offload, "offload.yaml").unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(
        err.contains("fsdp_offload_params") && err.contains("offload.yaml"),
        "{err}"
    );
    let hybrid = "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n\
                  parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  \
                  parallelism_config_dp_replicate_size: 3\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(hybrid, "hybrid.yaml").unwrap();
    assert_eq!(config.distributed.sharding, ShardingStrategy::HybridShard);
    assert_eq!(config.distributed.dp_shard_size, Some(2));
    assert_eq!(
        config.source(Key::DpShardSize),
        Source::File("hybrid.yaml".into())
    );
    let pipeline = "parallelism_config:\n  parallelism_config_pp_size: 4\n  \
                    parallelism_config_pp_microbatches: 8\n  parallelism_config_pp_schedule: GPipe\n  \
                    parallelism_config_pp_stage_blocks: 1,2,2,3\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(pipeline, "pp.yaml").unwrap();
    assert_eq!(config.pipeline.pp_size, 4);
    assert_eq!(config.pipeline.microbatches(), 8);
    assert_eq!(config.pipeline.pp_schedule, crate::PipelineSchedule::GPipe);
    assert_eq!(config.source(Key::PpSize), Source::File("pp.yaml".into()));
    assert_eq!(config.pipeline.pp_stage_blocks, Some(vec![1, 2, 2, 3]));
    config.validate().unwrap();
    let err = AcceleratorConfig::default()
        .apply_yaml(
            "parallelism_config:\n  parallelism_config_pp_schedule: zero-bubble\n",
            "pp.yaml",
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("pp_schedule") && err.contains("gpipe or 1f1b"),
        "{err}"
    );
    let err = AcceleratorConfig::default()
        .apply_yaml(
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID\n",
            "typo.yaml",
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fsdp_config.fsdp_sharding_strategy") && err.contains("HYBRID_SHARD (4)"),
        "{err}"
    );
    let other = "distributed_type: MULTI_CPU\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(other, "other.yaml").unwrap();
    assert_eq!(config.distributed.sharding, ShardingStrategy::NoShard);
    let deepspeed = "distributed_type: DEEPSPEED\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(deepspeed, "ds.yaml").unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("SHARD_GRAD_OP or FULL_SHARD"), "{err}");

    let tpu = "distributed_type: 'NO'\ntpu_name: test-tpu\ntpu_zone: us-central1-a\ncommand_file: run.sh\n\
               commands: [echo hi]\ncommand: null\ntpu_vm: []\ndowncast_bf16: 'no'\ndynamo_backend: 'NO'\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(tpu, "tpu.yaml").unwrap();
    config
        .validate()
        .expect("TPU keys without a TPU run have no effect");

    let sagemaker = "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\nec2_instance_type: ml.p3.2xlarge\n\
                     iam_role_name: role\nregion: us-east-1\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(sagemaker, "sm.yaml").unwrap();
    assert!(
        config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("SageMaker")
    );

    let legacy =
        "fp16: true\ndistributed_type: MULTI_CPU\nmpirun_config:\n  mpirun_hostfile: hosts\n";
    let mut config = AcceleratorConfig::default();
    config.apply_yaml(legacy, "old.yaml").unwrap();
    assert_eq!(
        config.precision.mixed_precision,
        MixedPrecision::Fp16,
        "Accelerate's legacy fp16 key"
    );
    assert_eq!(
        config.source(Key::MixedPrecision),
        Source::File("old.yaml".into())
    );
}

#[test]
fn json_files_are_read_as_json_and_unknown_keys_are_named() {
    let mut config = AcceleratorConfig::default();
    config
        .apply_yaml(
            r#"{"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "bf16",
                "num_processes": 1, "use_cpu": true, "dynamo_config": {}}"#,
            "cfg.json",
        )
        .unwrap();
    assert_eq!(config.precision.mixed_precision, MixedPrecision::Bf16);
    assert!(config.device.cpu);
    assert!(
        config
            .apply_yaml("{not json", "cfg.json")
            .unwrap_err()
            .to_string()
            .contains("JSON")
    );
    let err = config
        .apply_yaml(
            "mixed_precision: 'no'\nmy_own_key: 1\nanother: 2\n",
            "x.yaml",
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("my_own_key") && err.contains("another") && err.contains("x.yaml"),
        "{err}"
    );
}

#[test]
fn reads_accelerate_files() {
    let mut config = AcceleratorConfig::default();
    config
        .apply_yaml(ACCELERATE_FILE, "default_config.yaml")
        .unwrap();
    assert_eq!(config.precision.mixed_precision, MixedPrecision::Bf16);
    assert!(config.distributed.debug && config.device.cpu);
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
    // fp8 is accepted in the file and refused where it takes effect, naming the value and the file.
    let mut fp8 = AcceleratorConfig::default();
    fp8.apply_yaml("mixed_precision: fp8\n", "my.yaml").unwrap();
    let err = fp8.validate().unwrap_err().to_string();
    assert!(
        err.contains("no, fp16 or bf16") && err.contains("fp8") && err.contains("my.yaml"),
        "{err}"
    );
    assert!(config.apply_yaml("- a list\n", "my.yaml").is_err());
    assert!(config.apply_yaml("", "empty.yaml").is_ok());
}

#[test]
fn fsdp_mixed_precision_is_read_from_fsdp_config_and_bad_values_are_named() {
    let mut config = AcceleratorConfig::default();
    config
        .apply_yaml(
            "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  \
             fsdp_param_dtype: bf16\n  fsdp_reduce_dtype: fp32\n",
            "fsdp.yaml",
        )
        .unwrap();
    assert_eq!(config.distributed.fsdp_param_dtype, Some(ShardDtype::Bf16));
    assert_eq!(config.distributed.fsdp_reduce_dtype, Some(ShardDtype::Fp32));
    assert!(config.validate().is_ok());
    assert!(matches!(
        config.source(Key::FsdpParamDtype),
        Source::File(_)
    ));
    let err = AcceleratorConfig::default()
        .apply_yaml("fsdp_config:\n  fsdp_param_dtype: fp8\n", "fsdp.yaml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fsdp_config.fsdp_param_dtype")
            && err.contains("fp8")
            && err.contains("fsdp.yaml"),
        "{err}"
    );
}
