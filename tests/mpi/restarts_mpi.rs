//! `burn-accelerate launch --max-restarts` (feature `mpi`; needs Open MPI's `mpirun`): the checkpointing example,
//! on 2 MPI ranks, has a rank SIGKILLed at random steps (one of them during `save_state`), hang, or fail with an
//! error of its own; each restarted job must end with the weights of an uninterrupted run, bit for bit, and
//! only the failures a restart can cure are restarted. A 3-rank job whose hostfile loses a slot while it waits to
//! restart continues on 2 ranks under `--min-processes 2` (the parity harness, within its bounds).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use crate::examples;
use crate::parity;

use examples::{cli, example};

/// Steps of every run (the example saves every 25: 12 checkpoints).
const STEPS: usize = 300;
const SAVE_EVERY: usize = 25;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("restarts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `launch --num-processes 2 <launch_args> checkpointing --project-dir <dir>/run --save-final <dir>/final
/// <example_args>`.
fn launch(dir: &Path, launch_args: &[&str], example_args: &[&str]) -> Output {
    Command::new(cli())
        .args(["launch", "--num-processes", "2", "--restart-backoff", "0.1"])
        .args(launch_args)
        .arg(example("checkpointing"))
        .arg("--project-dir")
        .arg(dir.join("run"))
        .arg("--save-final")
        .arg(dir.join("final"))
        .args(["--steps", &STEPS.to_string()])
        .args(["--save-every", &SAVE_EVERY.to_string()])
        .args(example_args)
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        // Long enough that no collective times out spuriously on a loaded machine (which would add a restart the
        // trials do not expect; 20 s left little room for the ranks' start on a loaded 2-core machine); the hung
        // rank's test waits for it once.
        .env("ACCELERATE_COLLECTIVE_TIMEOUT", "60")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("burn-accelerate launch runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn weights(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("final/model.safetensors"))
        .unwrap_or_else(|e| panic!("no final weights in {}: {e}", dir.display()))
}

/// The final weights of an uninterrupted 2-rank run.
fn reference() -> &'static [u8] {
    static REFERENCE: OnceLock<Vec<u8>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let dir = temp_dir("reference");
        let out = launch(&dir, &[], &[]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let bytes = weights(&dir);
        std::fs::remove_dir_all(&dir).ok();
        bytes
    })
}

/// A small random generator (xorshift64*), seeded from the clock unless `RESTART_TRIALS_SEED` is set.
struct Random(u64);

impl Random {
    fn new() -> (Self, u64) {
        let seed = std::env::var("RESTART_TRIALS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        (Self(seed | 1), seed)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// The step the restarted run resumed at (0: it started from scratch, no checkpoint being complete), or `None`
/// when it printed neither line (it did not restart, or failed before saying).
fn resumed_step(stdout: &str) -> Option<usize> {
    stdout.lines().find_map(|l| {
        if l.starts_with("no complete checkpoint: starting from scratch") {
            return Some(0);
        }
        l.strip_prefix("resumed from ")?
            .split(" at step ")
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

#[test]
fn ranks_killed_at_random_steps_restart_and_end_with_the_uninterrupted_weights() {
    let reference = reference();
    let (mut random, seed) = Random::new();
    // Five kills after distinct random steps, then one while a random checkpoint is being written.
    let mut steps: Vec<usize> = Vec::new();
    while steps.len() < 5 {
        let step = 1 + random.below(STEPS - 1);
        if !steps.contains(&step) {
            steps.push(step);
        }
    }
    let save_step = SAVE_EVERY * (1 + random.below(STEPS / SAVE_EVERY - 1));
    let trials: Vec<(&str, usize, usize)> = steps
        .iter()
        .enumerate()
        .map(|(i, &step)| ("kill", step, i % 2))
        .chain([("kill-in-save", save_step, random.below(2))])
        .collect();
    let mut rows = Vec::new();
    for (i, (fault, step, rank)) in trials.iter().enumerate() {
        let dir = temp_dir(&format!("trial{i}"));
        let (step_text, rank_text) = (step.to_string(), rank.to_string());
        let out = launch(
            &dir,
            &["--max-restarts", "3"],
            &[
                "--fault",
                fault,
                "--fault-at",
                &step_text,
                "--fault-rank",
                &rank_text,
            ],
        );
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        let context = format!("trial {i} ({fault} rank {rank} at step {step}, seed {seed})");
        assert!(out.status.success(), "{context}\n{stdout}\n{stderr}");
        assert!(
            stderr.contains(&format!("rank {rank} exited on signal 9"))
                && stderr.contains("restart 1 of 3")
                && stderr.contains("completed after 1 restart"),
            "{context}: the kill and the restart are reported\n{stderr}"
        );
        if *fault == "kill-in-save" {
            assert!(
                stderr.contains("is killed during save_state"),
                "{context}: the kill landed outside the save\n{stderr}"
            );
        }
        let resumed = resumed_step(&stdout).unwrap_or_else(|| {
            panic!("{context}: the restarted run printed no resume line\n{stdout}")
        });
        // The latest complete checkpoint: the one before the interrupted save, or before the kill.
        let expected = if *fault == "kill-in-save" {
            step - SAVE_EVERY
        } else {
            // A kill after a save step lands before that step's save.
            (step - 1) / SAVE_EVERY * SAVE_EVERY
        };
        assert_eq!(resumed, expected, "{context}\n{stdout}");
        let identical = weights(&dir) == reference;
        rows.push(format!(
            "{fault:>12} rank {rank} step {step:>3}: completed, resumed at {resumed:>3} ({} steps lost), \
             weights {}",
            step - resumed,
            if identical { "identical" } else { "DIFFERENT" }
        ));
        assert!(identical, "{context}: the final weights differ\n{stdout}");
        std::fs::remove_dir_all(&dir).ok();
    }
    eprintln!(
        "restart trials (seed {seed}): {} run, {} completed, {} identical\n{}",
        trials.len(),
        rows.len(),
        rows.len(),
        rows.join("\n")
    );
}

/// A sharded job (`SHARD_GRAD_OP` from the launcher's FSDP flags: each rank saves its own slice of the optimizer
/// state) killed mid-run restarts from its last checkpoint and ends with the uninterrupted unsharded weights.
#[test]
fn a_sharded_job_killed_mid_run_restarts_and_ends_with_the_uninterrupted_weights() {
    let reference = reference();
    let dir = temp_dir("sharded");
    let step = SAVE_EVERY + SAVE_EVERY / 2;
    let out = launch(
        &dir,
        &[
            "--max-restarts",
            "2",
            "--use_fsdp",
            "--fsdp_sharding_strategy",
            "2",
        ],
        &[
            "--fault",
            "kill",
            "--fault-at",
            &step.to_string(),
            "--fault-rank",
            "1",
        ],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 1 exited on signal 9")
            && stderr.contains("completed after 1 restart"),
        "the kill and the restart are reported\n{stderr}"
    );
    let resumed = resumed_step(&stdout)
        .unwrap_or_else(|| panic!("the restarted run printed no resume line\n{stdout}"));
    assert_eq!(resumed, SAVE_EVERY, "{stdout}");
    let slices = std::fs::read_dir(dir.join("run/checkpoints"))
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| {
            std::fs::read_dir(e.path())
                .map(|files| {
                    files.filter_map(|f| f.ok()).any(|f| {
                        let name = f.file_name().to_string_lossy().into_owned();
                        name.contains("optimizer") && name.contains("rank1")
                    })
                })
                .unwrap_or(false)
        });
    assert!(slices, "each rank saved its own optimizer slice");
    assert!(
        weights(&dir) == reference,
        "the final weights differ from the uninterrupted unsharded run"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_hung_rank_is_turned_into_a_restart_by_the_collective_timeout() {
    let reference = reference();
    let dir = temp_dir("hang");
    let out = launch(
        &dir,
        &["--max-restarts", "2"],
        &["--fault", "hang", "--fault-at", "60"],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("timed out") && stderr.contains("restart 1 of 2"),
        "{stderr}"
    );
    assert_eq!(resumed_step(&stdout), Some(50), "{stdout}");
    assert!(weights(&dir) == reference, "the final weights differ");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_error_of_the_programs_own_is_restarted_only_when_asked() {
    let reference = reference();
    let dir = temp_dir("error");
    let fault = ["--fault", "error", "--fault-at", "80"];
    let out = launch(&dir, &["--max-restarts", "3"], &fault);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 1 exited with status 1") && stderr.contains("--restart-on-error"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 1 of"), "{stderr}");

    std::fs::remove_dir_all(&dir).ok();
    let out = launch(&dir, &["--max-restarts", "3", "--restart-on-error"], &fault);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("restart 1 of 3"), "{stderr}");
    assert!(weights(&dir) == reference, "the final weights differ");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn exhausted_restarts_end_the_launch_naming_the_last_failure() {
    let dir = temp_dir("exhausted");
    // The rank is killed on every run.
    let out = launch(
        &dir,
        &["--max-restarts", "2"],
        &["--fault", "kill", "--fault-at", "30", "--fault-runs", "9"],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
    assert!(
        stderr.contains("restart 2 of 2")
            && stderr.contains("rank 1 exited on signal 9")
            && stderr.contains("gave up after 2 restarts"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_program_that_fails_before_any_rank_reports_is_not_restarted() {
    // Each rank rejects its arguments (clap's status 2) before the library starts, so no rank can write why it
    // failed: an error of the program's own all the same, which a restart would only repeat.
    let out = Command::new(cli())
        .args(["launch", "--num-processes", "2", "--max-restarts", "2"])
        .args(["--restart-backoff", "0.1"])
        .arg(example("checkpointing"))
        .arg("--no-such-flag")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .expect("burn-accelerate launch runs");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("exited with status 2") && stderr.contains("--restart-on-error"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 1 of"), "restarted: {stderr}");
}

#[test]
fn a_job_that_loses_a_slot_restarts_on_the_slots_left_and_resumes_its_checkpoint() {
    use std::io::BufRead;
    let dir = temp_dir("min-processes");
    let hostfile = dir.join("hosts");
    std::fs::write(&hostfile, "localhost slots=3\n").unwrap();
    let out = dir.join("job");
    let mut child = Command::new(cli())
        .arg("launch")
        .arg("--hostfile")
        .arg(&hostfile)
        .args([
            "--num-processes",
            "3",
            "--max-restarts",
            "2",
            "--min-processes",
            "2",
        ])
        // Time for the test to take the slot away before the restart reads the hostfile again: the test does it as
        // soon as it reads the restart's line, which even a loaded machine does in far less.
        .args(["--restart-backoff", "10"])
        .arg(parity::harness())
        .arg("--out")
        .arg(&out)
        // Saved after step 10; rank 2 killed after step 14.
        .args(["--case", "resume", "--kill-at", "14", "--kill-rank", "2"])
        // Nothing waits out a collective here (launch stops the ranks left when one dies); a generous timeout keeps a
        // slow start of the restarted ranks on a loaded machine from counting as a hang.
        .env("ACCELERATE_COLLECTIVE_TIMEOUT", "120")
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("burn-accelerate launch runs");
    let stdout = child.stdout.take().unwrap();
    let stdout = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap());
    let mut stderr = String::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.contains("restart 1 of 2") {
            // A machine of the cluster is gone: one slot fewer.
            std::fs::write(&hostfile, "localhost slots=2\n").unwrap();
        }
        stderr.push_str(&line);
        stderr.push('\n');
    }
    let status = child.wait().unwrap();
    let stdout = stdout.join().unwrap();
    assert!(status.success(), "{stdout}\n{stderr}");
    for said in [
        "rank 2 exited on signal 9",
        "the job continues on 2 processes (it ran on 3",
        "completed after 1 restart",
    ] {
        assert!(stderr.contains(said), "`{said}` missing:\n{stderr}");
    }
    // One process straight through, and the samples 3 ranks used before the save (dealt as in-process ranks).
    let reference = dir.join("one");
    parity::run_local(&reference, &["--case", "resume"]);
    let dealt = dir.join("dealt");
    parity::run_local(&dealt, &["--case", "resume", "--processes", "3"]);
    let before = parity::trained_ids(&dealt, 3);
    let diff = parity::check_resumed(
        &reference,
        &before,
        (&out, 2, "NO_SHARD"),
        parity::bound("dp"),
        "3 ranks, one lost, restarted on 2",
    );
    println!("3 -> 2 ranks under launch --min-processes: max |Δ| vs one process {diff:e}");
    std::fs::remove_dir_all(&dir).ok();
}
