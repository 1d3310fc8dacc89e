//! `burn-accelerate launch` without MPI: settings reach the program with command line > environment > config
//! file > default, printed once with their sources; several processes of a program built without MPI are
//! refused before anything starts.

use std::path::PathBuf;
use std::process::Command;

fn launch() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"));
    for var in [
        "HF_HOME",
        "ACCELERATE_CONFIG_FILE",
        "ACCELERATE_MIXED_PRECISION",
        "ACCELERATE_DEBUG_MODE",
    ] {
        command.env_remove(var);
    }
    command.env("HF_HOME", std::env::temp_dir().join("ba-launch-no-config"));
    command.arg("launch");
    command
}

fn config_file() -> PathBuf {
    let file = std::env::temp_dir().join(format!("ba-launch-{}.yaml", std::process::id()));
    std::fs::write(
        &file,
        "distributed_type: 'NO'\nmixed_precision: bf16\ndebug: true\nnum_processes: 1\n",
    )
    .unwrap();
    file
}

/// Runs `env` under launch and returns (its ACCELERATE_* variables, launch's settings line).
fn run(command: &mut Command) -> (Vec<String>, String) {
    let out = command.arg("env").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let vars = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("ACCELERATE_"))
        .map(str::to_string)
        .collect();
    let settings = String::from_utf8_lossy(&out.stderr)
        .lines()
        .find(|l| l.starts_with("burn-accelerate launch:"))
        .unwrap_or_default()
        .to_string();
    (vars, settings)
}

#[test]
fn command_line_over_environment_over_config_file_over_default() {
    let file = config_file();
    // The file alone.
    let (vars, settings) = run(launch().arg("--config-file").arg(&file));
    assert!(
        vars.contains(&"ACCELERATE_MIXED_PRECISION=bf16".to_string()),
        "{vars:?}"
    );
    assert!(
        settings.contains(&format!(
            "mixed_precision=bf16 (config file {})",
            file.display()
        )),
        "{settings}"
    );
    assert!(settings.contains("debug=true (config file"), "{settings}");
    assert!(
        settings.contains("gradient_accumulation_steps=1 (default)"),
        "{settings}"
    );
    // The environment over the file.
    let (vars, settings) = run(launch()
        .env("ACCELERATE_MIXED_PRECISION", "fp16")
        .arg("--config_file")
        .arg(&file));
    assert!(
        vars.contains(&"ACCELERATE_MIXED_PRECISION=fp16".to_string()),
        "{vars:?}"
    );
    assert!(
        settings.contains("mixed_precision=fp16 (environment ACCELERATE_MIXED_PRECISION)"),
        "{settings}"
    );
    // The command line over both (both spellings of the flags).
    let (vars, settings) = run(launch()
        .env("ACCELERATE_MIXED_PRECISION", "fp16")
        .arg("--config-file")
        .arg(&file)
        .args([
            "--mixed_precision",
            "no",
            "--gradient-accumulation-steps",
            "4",
            "--cpu",
        ]));
    assert!(
        vars.contains(&"ACCELERATE_MIXED_PRECISION=no".to_string()),
        "{vars:?}"
    );
    assert!(
        vars.contains(&"ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4".to_string()),
        "{vars:?}"
    );
    assert!(
        vars.contains(&"ACCELERATE_USE_CPU=true".to_string()),
        "{vars:?}"
    );
    assert!(
        settings.contains("mixed_precision=no (command line)"),
        "{settings}"
    );
    assert!(
        settings.contains("num_processes=1 (config file"),
        "{settings}"
    );
    std::fs::remove_file(&file).ok();
}

#[test]
fn fsdp_flags_choose_the_sharding_and_reach_the_program() {
    let fsdp_vars = |out: &std::process::Output| -> Vec<String> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("FSDP_") || l.starts_with("ACCELERATE_USE_FSDP"))
            .map(str::to_string)
            .collect()
    };
    let settings = |out: &std::process::Output| -> String {
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .find(|l| l.starts_with("burn-accelerate launch:"))
            .unwrap_or_default()
            .to_string()
    };
    // Accelerate's `--use_fsdp` alone: FULL_SHARD.
    let out = launch().args(["--use_fsdp", "env"]).output().unwrap();
    assert!(
        settings(&out).contains("sharding=FULL_SHARD (command line)"),
        "{}",
        settings(&out)
    );
    let vars = fsdp_vars(&out);
    assert!(
        vars.contains(&"ACCELERATE_USE_FSDP=true".into()),
        "{vars:?}"
    );
    assert!(
        vars.contains(&"FSDP_SHARDING_STRATEGY=FULL_SHARD".into()),
        "{vars:?}"
    );
    // A strategy by Accelerate's number.
    let out = launch()
        .args(["--use-fsdp", "--fsdp_sharding_strategy", "2", "env"])
        .output()
        .unwrap();
    assert!(
        settings(&out).contains("sharding=SHARD_GRAD_OP (command line)"),
        "{}",
        settings(&out)
    );
    assert!(fsdp_vars(&out).contains(&"FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP".into()));
    // None: NO_SHARD by default.
    let out = launch().arg("env").output().unwrap();
    assert!(
        settings(&out).contains("sharding=NO_SHARD (default)"),
        "{}",
        settings(&out)
    );
    assert!(fsdp_vars(&out).contains(&"ACCELERATE_USE_FSDP=false".into()));
    // A hybrid strategy by Accelerate's number, with its shard groups: both reach the program.
    let out = launch()
        .args([
            "--fsdp-sharding-strategy",
            "4",
            "--parallelism_config_dp_shard_size",
            "2",
            "env",
        ])
        .output()
        .unwrap();
    assert!(
        settings(&out).contains("sharding=HYBRID_SHARD (command line)")
            && settings(&out).contains("dp_shard_size=2 (command line)"),
        "{}",
        settings(&out)
    );
    assert!(fsdp_vars(&out).contains(&"FSDP_SHARDING_STRATEGY=HYBRID_SHARD".into()));
    // Pipeline parallelism's flags reach the program.
    let out = launch()
        .args([
            "--pp-size",
            "2",
            "--pp_microbatches",
            "8",
            "--pp-schedule",
            "gpipe",
            "--pp-stage-blocks",
            "3,5",
            "env",
        ])
        .output()
        .unwrap();
    for setting in [
        "pp_size=2 (command line)",
        "pp_microbatches=8 (command line)",
        "pp_schedule=gpipe (command line)",
        "pp_stage_blocks=3,5 (command line)",
    ] {
        assert!(
            settings(&out).contains(setting),
            "{setting}: {}",
            settings(&out)
        );
    }
    assert!(fsdp_vars(&out).contains(&"FSDP_ACTIVATION_CHECKPOINTING=false".into()));
    // Activation checkpointing, with Accelerate's value (a value is required, so the program's name is never
    // taken for one).
    for args in [
        &["--fsdp_activation_checkpointing", "true", "env"][..],
        &["--fsdp-activation-checkpointing", "true", "env"][..],
    ] {
        let out = launch().args(args).output().unwrap();
        assert!(
            settings(&out).contains("activation_checkpointing=true (command line)"),
            "{args:?}: {}",
            settings(&out)
        );
        assert!(
            fsdp_vars(&out).contains(&"FSDP_ACTIVATION_CHECKPOINTING=true".into()),
            "{args:?}"
        );
    }
    // A strategy that does not exist is refused before anything starts, naming the ones that do.
    let out = launch()
        .args(["--fsdp-sharding-strategy", "HYBRID", "env"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("HYBRID_SHARD (4)"), "{stderr}");
}

#[test]
fn several_processes_of_a_program_without_mpi_are_refused_before_starting() {
    let out = launch()
        .args(["--num-processes", "2", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("built without burn-accelerate's `mpi` feature"),
        "{stderr}"
    );
    assert!(
        stderr.contains("--features burn-accelerate/mpi"),
        "{stderr}"
    );
    // Several machines need a hostfile; launch runs on machine 0 only.
    let out = launch()
        .args(["--num-machines", "2", "--num-processes", "4", "true"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--hostfile"));
    // A machine other than 0 is told the exact command to run on machine 0 instead.
    let out = launch()
        .args([
            "--num-machines",
            "2",
            "--num-processes",
            "4",
            "--machine-rank",
            "1",
        ])
        .args(["train", "--epochs", "3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "on machine 0 alone run `burn-accelerate launch --num-machines 2 --num-processes 4 --hostfile hosts \
             train --epochs 3`"
        ) && stderr.contains("srun --mpi=pmix train --epochs 3"),
        "{stderr}"
    );
}

/// `launch --max-restarts <n> --restart-backoff 0 <args>` of a shell script.
fn restarting(max_restarts: &str, extra: &[&str], script: &str) -> (Option<i32>, String) {
    let out = launch()
        .args(["--max-restarts", max_restarts, "--restart-backoff", "0"])
        .args(extra)
        .args(["sh", "-c", script])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg(unix)]
#[test]
fn a_killed_program_is_restarted_with_its_restart_count_until_the_limit() {
    // Killed on its first run only: the restart succeeds and sees its count.
    let (code, stderr) = restarting(
        "3",
        &[],
        r#"[ "$ACCELERATE_RESTART_COUNT" -ge 1 ] || kill -9 $$; echo "restart $ACCELERATE_RESTART_COUNT" >&2"#,
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("the program was ended by signal 9")
            && stderr.contains("restart 1 of 3")
            && stderr.contains("\nrestart 1\n")
            && stderr.contains("completed after 1 restart"),
        "{stderr}"
    );
    // Killed on every run: two restarts, then the signal's status and the reason.
    let (code, stderr) = restarting("2", &[], "kill -9 $$");
    assert_eq!(code, Some(128 + 9), "{stderr}");
    assert!(
        stderr.contains("restart 2 of 2") && stderr.contains("gave up after 2 restarts"),
        "{stderr}"
    );
}

#[test]
fn an_error_of_the_programs_own_is_restarted_only_with_restart_on_error() {
    let (code, stderr) = restarting("3", &[], "exit 3");
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("the program exited with status 3")
            && stderr.contains("--restart-on-error"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 1 of"), "{stderr}");
    let (code, stderr) = restarting(
        "3",
        &["--restart-on-error"],
        r#"[ "$ACCELERATE_RESTART_COUNT" -ge 2 ] || exit 3"#,
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("completed after 2 restarts"), "{stderr}");
    let out = launch()
        .args(["--max-restarts", "1", "--restart-backoff=-1", "true"])
        .output()
        .unwrap();
    let (code, stderr) = (out.status.code(), String::from_utf8_lossy(&out.stderr));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--restart-backoff -1: give the seconds"),
        "{stderr}"
    );
}

#[test]
fn one_process_passes_the_programs_exit_status_through() {
    let out = launch().args(["sh", "-c", "exit 3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
}
