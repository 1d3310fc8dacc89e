//! `burn-accelerate env` prints the version, backends, devices and config path.

#[path = "../../burn-accelerate/tests/support/isolation.rs"]
mod isolation;

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
