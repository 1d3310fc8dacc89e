//! `burn-accelerate env` prints the version, backends, devices and config path.

use std::process::Command;

#[test]
fn env_prints_the_facts() {
    let dir = std::env::temp_dir().join(format!("ba-env-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("HF_HOME", &dir)
        .env("ACCELERATE_LOG_LEVEL", "INFO")
        .output()
        .expect("the binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(&format!("version: {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.contains("- Backend features: "), "{text}");
    assert!(text.contains("- Devices ("), "{text}");
    let expected = dir.join("accelerate").join("default_config.yaml");
    assert!(
        text.contains(&format!(
            "- Config file: {} (not found)",
            expected.display()
        )),
        "{text}"
    );
    assert!(text.contains("ACCELERATE_LOG_LEVEL=INFO"), "{text}");
}

#[test]
fn env_names_the_launcher_that_started_it() {
    let run = |vars: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
            .arg("env")
            .env_remove("SLURM_PROCID")
            .env_remove("OMPI_COMM_WORLD_SIZE")
            .env_remove("PMIX_RANK")
            .envs(vars.iter().copied())
            .output()
            .expect("the binary runs");
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines()
            .find(|l| l.starts_with("- Launcher: "))
            .unwrap_or_else(|| panic!("no launcher line in {text}"))
            .to_string()
    };
    assert!(run(&[]).contains("none"));
    let srun = run(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_JOB_NUM_NODES", "2"),
    ]);
    assert_eq!(
        srun,
        "- Launcher: SLURM (srun without an MPI plugin): rank 3 of 4, local rank 1, machine 1 of 2"
    );
}

/// Activation checkpointing, Burn's own checkpointing and what the sharding strategy holds at its peak.
#[test]
fn env_shows_checkpointing_and_what_full_shard_costs() {
    let dir = std::env::temp_dir().join(format!("ba-env-fsdp-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("HF_HOME", &dir)
        .env("ACCELERATE_USE_FSDP", "true")
        .env("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
        .env("FSDP_ACTIVATION_CHECKPOINTING", "true")
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "activation_checkpointing = true (environment FSDP_ACTIVATION_CHECKPOINTING)",
        "autodiff_checkpointing = false (default)",
        "- Peak memory under FULL_SHARD: with backward_blocks: 1/P",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
}

#[test]
fn env_shows_the_pipeline_and_where_each_rank_sits() {
    let dir = std::env::temp_dir().join(format!("env-pp-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("HF_HOME", &dir)
        .env("ACCELERATE_PP_SIZE", "4")
        .env("ACCELERATE_PP_MICROBATCHES", "12")
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "pp_size = 4 (environment ACCELERATE_PP_SIZE)",
        "pp_schedule = 1f1b (default)",
        "- Pipeline: 4 stages (1f1b schedule, 12 micro-batches per batch; each stage idle 20 % of a step); rank r \
         of W runs stage r / (W / 4) of data-parallel replica r % (W / 4)",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
}

#[test]
fn env_shows_the_tensor_parallel_dimension_of_the_mesh() {
    let dir = std::env::temp_dir().join(format!("env-tp-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("HF_HOME", &dir)
        .env("PARALLELISM_CONFIG_TP_SIZE", "2")
        .env("WORLD_SIZE", "4")
        .env("LOCAL_WORLD_SIZE", "4")
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "tp_size = 2 (environment PARALLELISM_CONFIG_TP_SIZE)",
        "- Mesh: pp 1 × dp_replicate 2 × dp_shard 1 × cp 1 × tp 2 (4 rank(s))",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
}

#[test]
fn env_shows_the_context_parallel_dimension_of_the_mesh_and_its_attention() {
    let dir = std::env::temp_dir().join(format!("env-cp-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("HF_HOME", &dir)
        .env("PARALLELISM_CONFIG_CP_SIZE", "2")
        .env("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
        .env("ACCELERATE_USE_FSDP", "true")
        .env("WORLD_SIZE", "8")
        .env("LOCAL_WORLD_SIZE", "8")
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "cp_size = 2 (environment PARALLELISM_CONFIG_CP_SIZE)",
        "cp_comm_strategy = ring (environment PARALLELISM_CONFIG_CP_COMM_STRATEGY)",
        "cp_load_balance = true (default)",
        "- Mesh: pp 1 × dp_replicate 1 × dp_shard 4 × cp 2 × tp 1 (8 rank(s))",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
}

#[test]
fn unknown_subcommand_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("frobnicate")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage"));
}

#[cfg(unix)]
#[test]
fn env_survives_variables_that_are_not_utf8_and_huge_timeouts() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = std::env::temp_dir().join(format!("ba-env-utf8-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("HF_HOME", &dir)
        .env("ACCELERATE_NOT_UTF8", OsStr::from_bytes(b"caf\xe9"))
        .env(OsStr::from_bytes(b"ACCELERATE_\xffNAME"), "x")
        .env("ACCELERATE_COLLECTIVE_TIMEOUT", "1e20")
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("ACCELERATE_NOT_UTF8=caf\u{fffd}"), "{text}");
    assert!(
        text.contains("ACCELERATE_COLLECTIVE_TIMEOUT=1e20"),
        "{text}"
    );
}

#[test]
fn env_says_which_gradient_transport_runs_and_why() {
    let transport = |vars: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
            .arg("env")
            .env_remove("ACCELERATE_GRADIENT_TRANSPORT")
            .env_remove("BURN_DEVICE")
            .env_remove("OMPI_COMM_WORLD_SIZE")
            .env_remove("SLURM_PROCID")
            .env_remove("PMIX_RANK")
            .envs(vars.iter().copied())
            .output()
            .expect("the binary runs");
        let text = String::from_utf8(out.stdout).unwrap();
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with(prefix))
                .unwrap_or_else(|| panic!("no `{prefix}` line in {text}"))
                .trim()
                .to_string()
        };
        // Where each call goes on the path chosen, one line each under the transport.
        let per_call: Vec<String> = text
            .lines()
            .skip_while(|l| !l.starts_with("- Gradient transport: "))
            .skip(1)
            .take_while(|l| l.starts_with("  - "))
            .map(|l| l.trim().to_string())
            .collect();
        (
            line("- Gradient transport: "),
            line("- gradient_transport = "),
            per_call,
        )
    };
    // In-process ranks on the CPU share one device: tensors pass between them as they are.
    let (chosen, setting, per_call) = transport(&[]);
    assert_eq!(
        chosen,
        "- Gradient transport: device exchange (in-process ranks sharing one device) (2 in-process ranks on one \
         device: tensors pass between them as they are), for 2 in-process ranks"
    );
    assert_eq!(setting, "- gradient_transport = auto (default)");
    assert_eq!(per_call.len(), 6, "{per_call:?}");
    assert!(
        per_call.contains(&"- send/recv: device".to_string()),
        "{per_call:?}"
    );
    let (chosen, setting, per_call) = transport(&[("ACCELERATE_GRADIENT_TRANSPORT", "host")]);
    assert!(chosen.contains("(gradient_transport = host)"), "{chosen}");
    assert!(
        per_call.iter().all(|l| l.ends_with(": host")),
        "{per_call:?}"
    );
    assert_eq!(
        setting,
        "- gradient_transport = host (environment ACCELERATE_GRADIENT_TRANSPORT)"
    );
    let (chosen, _, _) = transport(&[("ACCELERATE_GRADIENT_TRANSPORT", "device")]);
    assert!(chosen.contains("device exchange"), "{chosen}");
    // Under a launcher, its ranks are the ones described: CPU processes average in host memory, and say why.
    let launched = [
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];
    let (chosen, _, _) = transport(&launched);
    assert!(
        chosen.starts_with("- Gradient transport: host all-reduce (the ranks run on ")
            && chosen.contains("device collectives between them on CUDA only")
            && chosen.ends_with("for 4 processes, 2 on this machine"),
        "{chosen}"
    );
    // Asking for the device path where there is none: env shows the refusal a run would meet.
    let (chosen, _, _) = transport(
        &[
            &launched[..],
            &[("ACCELERATE_GRADIENT_TRANSPORT", "device")],
        ]
        .concat(),
    );
    assert!(
        chosen.starts_with("- Gradient transport: refused: "),
        "{chosen}"
    );
}

#[test]
fn a_bad_gradient_transport_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .arg("env")
        .env("ACCELERATE_GRADIENT_TRANSPORT", "nvlink")
        .output()
        .expect("the binary runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("ACCELERATE_GRADIENT_TRANSPORT")
            && text.contains("nvlink")
            && text.contains("auto, host or device"),
        "{text}"
    );
}
