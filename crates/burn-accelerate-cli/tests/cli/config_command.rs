//! `burn-accelerate config` and config files driven through the real binary: where the file lives, round trips,
//! Accelerate's sample configs (fp8, FSDP, TPU, SageMaker, MPI, legacy keys, unknown keys), precedence.

use crate::python;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-cli-config-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The binary with a clean environment for config lookup (`vars` added).
fn cli(vars: &[(&str, &Path)]) -> Command {
    let binary = Path::new(env!("CARGO_BIN_EXE_burn-accelerate"));
    // Spawning a missing binary fails with a bare `NotFound`: say which path, and what its folder holds.
    assert!(
        binary.is_file(),
        "the command's binary {} is missing (its folder holds {:?}); another build may have replaced it",
        binary.display(),
        binary
            .parent()
            .and_then(|d| std::fs::read_dir(d).ok())
            .map(|entries| entries
                .filter_map(|e| e.ok().map(|e| e.file_name()))
                .filter(|n| n.to_string_lossy().starts_with("burn-accelerate"))
                .collect::<Vec<_>>())
    );
    let mut command = Command::new(binary);
    for var in [
        "HF_HOME",
        "XDG_CACHE_HOME",
        "ACCELERATE_CONFIG_FILE",
        "ACCELERATE_MIXED_PRECISION",
    ] {
        command.env_remove(var);
    }
    for (k, v) in vars {
        command.env(k, v);
    }
    command
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn sample(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/configs")
        .join(name)
}

#[test]
fn default_config_goes_where_accelerate_keeps_it() {
    let root = temp_dir("location");
    let cases: [(&str, PathBuf); 3] = [
        ("HF_HOME", root.join("hf").join("accelerate")),
        (
            "XDG_CACHE_HOME",
            root.join("xdg").join("huggingface").join("accelerate"),
        ),
        (
            "HOME",
            root.join("home")
                .join(".cache")
                .join("huggingface")
                .join("accelerate"),
        ),
    ];
    for (var, expected_dir) in cases {
        let base = root.join(match var {
            "HF_HOME" => "hf",
            "XDG_CACHE_HOME" => "xdg",
            _ => "home",
        });
        let out = cli(&[(var, &base), ("HOME", &root.join("home"))])
            .args(["config", "default"])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{var}: {stderr}");
        let file = expected_dir.join("default_config.yaml");
        assert!(
            stdout.contains(&file.display().to_string()),
            "{var}: {stdout}"
        );
        assert!(file.is_file(), "{var}: {}", file.display());
        std::fs::remove_file(&file).unwrap();
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn config_default_round_trips_and_keeps_an_existing_file() {
    let dir = temp_dir("round");
    let hf = dir.join("hf");
    let ok = cli(&[("HF_HOME", &hf)])
        .args(["config", "default", "--mixed-precision", "bf16"])
        .status()
        .unwrap();
    assert!(ok.success());
    let file = hf.join("accelerate/default_config.yaml");
    let written = std::fs::read_to_string(&file).unwrap();
    // Quoted as PyYAML needs: unquoted NO / no read as booleans there.
    assert!(
        written.contains("distributed_type: 'NO'") && written.contains("downcast_bf16: 'no'"),
        "{written}"
    );
    let out = cli(&[("HF_HOME", &hf)])
        .args(["config", "show"])
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains(&format!(
            "mixed_precision = bf16 (config file {})",
            file.display()
        )),
        "{stdout}"
    );
    assert!(!stdout.contains("refuses"), "{stdout}");

    let again = cli(&[("HF_HOME", &hf)])
        .args(["config", "default"])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(text(&again).1.contains("--force"), "{:?}", text(&again));
    let forced = cli(&[("HF_HOME", &hf)])
        .args(["config", "default", "--force"])
        .status()
        .unwrap();
    assert!(forced.success());
    assert!(
        std::fs::read_to_string(&file)
            .unwrap()
            .contains("mixed_precision: 'no'")
    );

    // JSON where the name says so, read back as JSON; underscore spellings of the flags work too.
    let json = dir.join("cfg.json");
    let ok = cli(&[])
        .args(["config", "default", "--config_file"])
        .arg(&json)
        .args(["--mixed_precision", "fp16"])
        .status()
        .unwrap();
    assert!(ok.success());
    let value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(value["mixed_precision"], "fp16");
    assert_eq!(value["distributed_type"], "NO");
    let out = cli(&[])
        .arg("--config-file")
        .arg(&json)
        .arg("env")
        .output()
        .unwrap();
    assert!(
        text(&out).0.contains("mixed_precision = fp16 (config file"),
        "{:?}",
        text(&out)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn accelerates_sample_configs_load_or_give_the_stated_error() {
    let env = |name: &str| {
        let out = cli(&[])
            .arg("--config-file")
            .arg(sample(name))
            .arg("env")
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {:?}", text(&out));
        text(&out)
    };
    let (stdout, stderr) = env("single.yaml");
    assert!(
        stdout.contains("mixed_precision = bf16 (config file")
            && stdout.contains("cpu = true (config file"),
        "{stdout}"
    );
    assert!(!stdout.contains("refuses"), "{stdout}");
    assert!(
        stderr.contains("ignoring Accelerate settings") && stderr.contains("command_file"),
        "{stderr}"
    );
    assert!(
        stderr.contains("tpu_name") && !stderr.contains("rdzv_backend"),
        "defaults are not noise: {stderr}"
    );

    let (stdout, _) = env("fp8.yaml");
    assert!(
        stdout.contains("A run refuses these settings") && stdout.contains("\"fp8\""),
        "{stdout}"
    );
    let (stdout, stderr) = env("fsdp.yaml");
    assert!(
        stdout.contains("sharding = FULL_SHARD (config file") && !stdout.contains("refuses"),
        "{stdout}"
    );
    assert!(
        stderr.contains("fsdp_config.fsdp_auto_wrap_policy"),
        "FSDP settings that change nothing here are named: {stderr}"
    );
    let (stdout, _) = env("sagemaker.yaml");
    assert!(stdout.contains("AMAZON_SAGEMAKER"), "{stdout}");
    let (stdout, _) = env("mpi_multicpu.yaml");
    assert!(!stdout.contains("refuses"), "{stdout}");
    let (stdout, _) = env("legacy_0_11.yaml");
    assert!(
        stdout.contains("mixed_precision = fp16 (config file"),
        "old `fp16: true`: {stdout}"
    );
    let (stdout, _) = env("invalid_keys.yaml");
    assert!(
        stdout.contains("unreadable")
            && stdout.contains("invalid_key")
            && stdout.contains("another_invalid_key"),
        "{stdout}"
    );
    let out = cli(&[])
        .arg("--config-file")
        .arg(sample("mpi_multicpu.yaml"))
        .args(["config", "show"])
        .output()
        .unwrap();
    assert!(
        text(&out).0.contains(
            "launch: distributed_type=MULTI_CPU num_processes=8 num_machines=2 machine_rank=0"
        ),
        "{:?}",
        text(&out)
    );
}

#[test]
fn the_environment_overrides_the_file_and_lifts_an_fp8_refusal() {
    let out = cli(&[])
        .env("ACCELERATE_MIXED_PRECISION", "bf16")
        .arg("--config-file")
        .arg(sample("fp8.yaml"))
        .arg("env")
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("mixed_precision = bf16 (environment ACCELERATE_MIXED_PRECISION)"),
        "{stdout}"
    );
    assert!(!stdout.contains("refuses"), "{stdout}");
}

/// With `BURN_ACCELERATE_PYTHON` (CI sets it), PyYAML reads the file back as Accelerate does.
#[test]
fn pyyaml_reads_the_written_file_as_accelerate_does() {
    let Some(python) = python::python_with(&["yaml"]) else {
        return;
    };
    let dir = temp_dir("pyyaml");
    let file = dir.join("default_config.yaml");
    assert!(
        cli(&[])
            .args(["config", "default", "--config-file"])
            .arg(&file)
            .status()
            .unwrap()
            .success()
    );
    let script = "import sys, yaml\nc = yaml.safe_load(open(sys.argv[1]))\nassert c['distributed_type'] == 'NO', c\n\
                  assert c['downcast_bf16'] == 'no', c\nassert c['mixed_precision'] == 'no', c\nprint('pyyaml ok')";
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(&file)
        .output()
        .unwrap();
    assert!(text(&out).0.contains("pyyaml ok"), "{:?}", text(&out));
    std::fs::remove_dir_all(&dir).ok();
}

/// The questionnaire answered with arrow keys in a pseudo-terminal (util-linux `script` provides it).
#[test]
fn the_questionnaire_answered_in_a_terminal_writes_the_expected_file() {
    if Command::new("script").arg("--version").output().is_err() {
        python::skipped("no `script` (util-linux): the terminal questionnaire test is skipped");
        return;
    }
    let dir = temp_dir("pty");
    let file = dir.join("answers.yaml");
    let command = format!(
        "{} config --config-file {}",
        env!("CARGO_BIN_EXE_burn-accelerate"),
        file.display()
    );
    let mut child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // The terminal's output, read as it comes: each answer is typed once its question is on the screen, however
    // slow the machine (no fixed keystroke timing).
    let screen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let screen = screen.clone();
        let mut stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = stdout.read(&mut chunk) {
                screen
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        })
    };
    // multi-GPU (two downs), 1 machine (default), 3 processes, CPU only: no, checks: no, bf16 (two downs).
    let answers: [(&str, &[&str]); 6] = [
        ("Which type of machine", &["\x1b[B", "\x1b[B", "\r"]),
        ("How many different machines", &["\r"]),
        ("How many processes", &["3", "\r"]),
        ("CPU only", &["\r"]),
        ("checked while running", &["\r"]),
        ("mixed precision", &["\x1b[B", "\x1b[B", "\r"]),
    ];
    let mut seen = 0;
    for (question, keys) in answers {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let text = screen.lock().unwrap().clone();
            if let Some(at) = text[seen..].find(question) {
                seen += at + question.len();
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the question {question:?} never appeared; the screen so far:\n{text}"
            );
            // A questionnaire that ended (the binary missing, a crash) asks nothing more: say so now rather than
            // wait out the deadline.
            if let Ok(Some(status)) = child.try_wait() {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let text = screen.lock().unwrap().clone();
                if !text[seen..].contains(question) {
                    panic!(
                        "the questionnaire ended ({status}) before asking {question:?}; the screen:\n{text}"
                    );
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        for key in keys {
            // A short pause between keys lets the menu redraw (the wait above is what makes the test robust).
            std::thread::sleep(std::time::Duration::from_millis(50));
            use std::io::Write;
            stdin.write_all(key.as_bytes()).unwrap();
            stdin.flush().unwrap();
        }
    }
    drop(stdin);
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let screen = screen.lock().unwrap().clone();
    assert!(
        status.success(),
        "the questionnaire failed: {status}\n{screen}"
    );
    let written =
        std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("no file ({e}): {screen}"));
    for line in [
        "distributed_type: MULTI_GPU",
        "num_processes: 3",
        "num_machines: 1",
        "use_cpu: false",
        "debug: false",
        "mixed_precision: bf16",
    ] {
        assert!(written.contains(line), "{line} missing from:\n{written}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The same questions over a pipe take numbered or named answers, one per line.
#[test]
fn the_questionnaire_answered_over_a_pipe_writes_the_expected_file() {
    let dir = temp_dir("pipe");
    let file = dir.join("answers.json");
    let mut child = cli(&[])
        .args(["config", "--config-file"])
        .arg(&file)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        // multi-CPU, 2 machines, rank 0, ip, port, 8 processes, checks: yes, fp16
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"multi-CPU\n2\n\n10.0.0.1\n\n8\nyes\nfp16\n")
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(value["distributed_type"], "MULTI_CPU");
    assert_eq!(value["num_machines"], 2);
    assert_eq!(value["main_process_ip"], "10.0.0.1");
    assert_eq!(value["main_process_port"], 29500);
    assert_eq!(value["num_processes"], 8);
    assert_eq!(value["use_cpu"], true);
    assert_eq!(value["debug"], true);
    assert_eq!(value["mixed_precision"], "fp16");
    std::fs::remove_dir_all(&dir).ok();
}

/// An FSDP config written by Python as Accelerate writes its files (`yaml.safe_dump` of the config's dict, FSDP
/// answers included): the sharding it asks for is the one a run gets, by name and by Accelerate's number.
#[test]
fn an_fsdp_config_written_by_python_selects_the_sharding() {
    let Some(python) = python::python_with(&["yaml"]) else {
        return;
    };
    let dir = temp_dir("python-fsdp");
    for (strategy, expected) in [("SHARD_GRAD_OP", "SHARD_GRAD_OP"), ("1", "FULL_SHARD")] {
        let file = dir.join(format!("fsdp_{strategy}.yaml"));
        let script = format!(
            "import sys, yaml\n\
             config = {{'compute_environment': 'LOCAL_MACHINE', 'debug': False, 'distributed_type': 'FSDP',\n\
             'downcast_bf16': 'no', 'enable_cpu_affinity': False,\n\
             'fsdp_config': {{'fsdp_activation_checkpointing': False, 'fsdp_auto_wrap_policy': 'NO_WRAP',\n\
             'fsdp_cpu_ram_efficient_loading': True, 'fsdp_offload_params': False,\n\
             'fsdp_sharding_strategy': {value}, 'fsdp_state_dict_type': 'SHARDED_STATE_DICT',\n\
             'fsdp_sync_module_states': True, 'fsdp_use_orig_params': True, 'fsdp_version': 1}},\n\
             'machine_rank': 0, 'main_training_function': 'main', 'mixed_precision': 'no', 'num_machines': 1,\n\
             'num_processes': 2, 'rdzv_backend': 'static', 'same_network': True, 'tpu_env': [],\n\
             'tpu_use_cluster': False, 'tpu_use_sudo': False, 'use_cpu': True}}\n\
             yaml.safe_dump(config, open(sys.argv[1], 'w'))",
            value = if strategy == "1" {
                "1".to_string()
            } else {
                format!("'{strategy}'")
            }
        );
        let out = Command::new(&python)
            .args(["-c", &script])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{:?}", text(&out));
        let out = cli(&[])
            .arg("--config-file")
            .arg(&file)
            .arg("env")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(
            stdout.contains(&format!("sharding = {expected} (config file")),
            "{strategy}: {stdout}"
        );
        assert!(!stdout.contains("refuses"), "{stdout}");
        assert!(
            stderr.contains("fsdp_config.fsdp_state_dict_type"),
            "settings that change nothing here are named: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
