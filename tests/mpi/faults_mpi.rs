//! The MPI fault matrix under `mpirun -np 3` (feature `mpi`): rank 1 panics, returns an error, is SIGKILLed, calls
//! another collective, all-reduces another length or stays silent, while ranks 0 and 2 all-reduce a small
//! (< 256 KiB, MPI's non-blocking call) or a large (≥ 256 KiB, MPI's blocking call) buffer with debug mode off.
//! Every case must end the whole job, with an error naming rank 1 or the mismatch; cases that are not a timeout
//! end within the collective timeout, timed from the moment the ranks start their work (mpirun's start-up on a
//! loaded machine is not counted), and no job may outlive the timeout by more than a generous margin. A save that fails on the main process (rank 0) must stop every rank at once.

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::examples;

/// The collective timeout of the run whose silent rank must be named after it.
const TIMEOUT_SECS: f64 = 10.0;
/// The collective timeout of every other run: one ending well before it ended by the fault, not by a timeout,
/// however loaded the machine (those runs take a second or two).
const LONG_TIMEOUT_SECS: f64 = 60.0;
/// The bound on a whole job (mpirun's start and teardown included), which only shows that nothing hangs:
/// generous, for a loaded machine.
const MARGIN_SECS: f64 = 60.0;
const SIZES: [(&str, usize); 2] = [("small", 1 << 10), ("large", 1 << 20)];

struct Run {
    stdout: String,
    stderr: String,
    success: bool,
    /// From the moment the first rank started its work (after mpirun's start-up) to the end of the job.
    elapsed: Duration,
}

fn unix_now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

fn run(fault: &str, bytes: usize) -> Run {
    let timeout = if fault == "silent" {
        TIMEOUT_SECS
    } else {
        LONG_TIMEOUT_SECS
    };
    let program = examples::example("mpi_faults");
    let start = Instant::now();
    let out = examples::own_mpi_session(&mut Command::new("mpirun"))
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "3"])
        .arg(&program)
        .args(["--fault", fault, "--bytes", &bytes.to_string()])
        .args(["--timeout", &timeout.to_string()])
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env_remove("ACCELERATE_DEBUG_MODE")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("mpirun runs (install openmpi-bin)");
    let whole = start.elapsed();
    let end = unix_now();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let work_start = stdout
        .lines()
        .filter_map(|l| {
            l.split(" starts at ")
                .nth(1)?
                .strip_suffix(" ms")?
                .parse()
                .ok()
        })
        .min()
        .map(Duration::from_millis)
        .unwrap_or_else(|| panic!("{fault}/{bytes}: no rank started its work:\n{stdout}"));
    let run = Run {
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        success: out.status.success(),
        elapsed: end.saturating_sub(work_start),
    };
    assert!(
        !run.success,
        "{fault}/{bytes}: the job must fail\n{}\n{}",
        run.stdout, run.stderr
    );
    let limit = timeout + MARGIN_SECS;
    assert!(
        whole.as_secs_f64() < limit,
        "{fault}/{bytes}: the job took {:.1} s (limit {limit} s)\n{}\n{}",
        whole.as_secs_f64(),
        run.stdout,
        run.stderr
    );
    run
}

/// The line rank `rank` printed about its error.
fn error_line(run: &Run, rank: usize) -> &str {
    run.stdout
        .lines()
        .find(|l| l.starts_with(&format!("rank {rank} got after")))
        .unwrap_or_else(|| {
            panic!(
                "rank {rank} printed no error:\n{}\n{}",
                run.stdout, run.stderr
            )
        })
}

#[test]
fn a_rank_that_panics_or_returns_an_error_aborts_the_job_at_once() {
    for (size, bytes) in SIZES {
        for (fault, status) in [("panic", 101), ("error", 1)] {
            let run = run(fault, bytes);
            assert!(
                run.stderr.contains(&format!(
                    "rank 1 exits with status {status}; aborting the MPI job"
                )),
                "{fault}/{size}:\n{}",
                run.stderr
            );
            // Not a timeout: the others are stopped as soon as rank 1 exits.
            assert!(
                run.elapsed.as_secs_f64() < LONG_TIMEOUT_SECS,
                "{fault}/{size}: {:?}",
                run.elapsed
            );
            assert!(!run.stdout.contains("timed out"), "{}", run.stdout);
        }
    }
}

#[test]
fn a_rank_killed_by_sigkill_ends_the_job_and_is_named() {
    for (size, bytes) in SIZES {
        let run = run("sigkill", bytes);
        assert!(
            run.stderr.contains("process rank 1") && run.stderr.contains("signal 9"),
            "{size}:\n{}",
            run.stderr
        );
        assert!(
            run.elapsed.as_secs_f64() < LONG_TIMEOUT_SECS,
            "{size}: {:?}",
            run.elapsed
        );
    }
}

/// Runs `fault` at both sizes and checks that every rank printed the same error, with `kind` and the line
/// `expected(len)` gives for the all-reduce length, well before any timeout.
fn every_rank_gets_the_same_error(fault: &str, kind: &str, expected: impl Fn(usize) -> String) {
    for (size, bytes) in SIZES {
        let run = run(fault, bytes);
        let want = expected(bytes / 4);
        for rank in 0..3 {
            let line = error_line(&run, rank);
            assert!(line.contains(kind), "{size}: {line}");
            assert!(line.contains(&want), "{size}: {line}");
        }
        assert!(
            run.elapsed.as_secs_f64() < LONG_TIMEOUT_SECS,
            "{size}: not a timeout: {:?}",
            run.elapsed
        );
    }
}

#[test]
fn a_rank_in_another_collective_gives_every_rank_the_same_error_at_once() {
    every_rank_gets_the_same_error("collective", "ranks called different collectives", |len| {
        format!(
            "rank 0: all_reduce (sum) of {len} x f32, rank 1: barrier, rank 2: all_reduce (sum) of {len} x f32"
        )
    });
}

#[test]
fn an_all_reduce_of_another_length_gives_every_rank_the_same_error_at_once() {
    every_rank_gets_the_same_error("length", "incompatible inputs", |len| {
        format!("rank 1: all_reduce (sum) of {} x f32", len + 1)
    });
}

#[test]
fn a_silent_rank_is_named_after_the_timeout() {
    for (size, bytes) in SIZES {
        let run = run("silent", bytes);
        for rank in [0, 2] {
            let line = error_line(&run, rank);
            assert!(
                line.contains("timed out after 10s: rank(s) [1] did not arrive"),
                "{size}: {line}"
            );
            // Each rank's own wait, from the start of its collective: the whole timeout.
            let waited: f64 = line
                .split("got after ")
                .nth(1)
                .and_then(|rest| rest.split('s').next())
                .and_then(|secs| secs.parse().ok())
                .unwrap_or_else(|| panic!("{size}: {line}"));
            assert!(waited >= TIMEOUT_SECS - 0.05, "{size}: {line}");
        }
    }
}

#[test]
fn a_save_that_fails_on_the_main_process_stops_every_rank_at_once() {
    let run = run("save", 1 << 10);
    let line = error_line(&run, 0);
    assert!(line.contains("mpi-faults-blocked"), "{line}");
    for rank in [1, 2] {
        let line = error_line(&run, rank);
        assert!(
            line.contains("save_state: rank 0 failed, so every rank stops"),
            "{line}"
        );
    }
    assert!(
        run.elapsed.as_secs_f64() < LONG_TIMEOUT_SECS,
        "not a timeout: {:?}",
        run.elapsed
    );
}

/// A pipeline stage that runs out of memory (LibTorch's panic, on the last stage, for micro-batches of more than 3
/// rows) under `mpirun`, 2 and 4 stages a process each: the step fails on every stage at once and
/// `find_executable_batch_size` shrinks the batch for all of them, 16 to 6 rows, long before the collective
/// timeout.
#[test]
fn a_pipeline_stage_out_of_memory_shrinks_the_batch_of_every_stage() {
    for np in ["2", "4"] {
        let out = examples::own_mpi_session(&mut Command::new("mpirun"))
            .args(["--allow-run-as-root", "--oversubscribe", "-np", np])
            .arg(examples::example("mpi_faults"))
            .args(["--fault", "pipeline-oom", "--stages", np])
            .args(["--timeout", &LONG_TIMEOUT_SECS.to_string()])
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
            .env_remove("ACCELERATE_DEBUG_MODE")
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("mpirun runs (install openmpi-bin)");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let fitted: Vec<&str> = stdout.lines().filter(|l| l.contains(" fitted ")).collect();
        assert_eq!(
            fitted.len(),
            np.parse::<usize>().unwrap(),
            "{stdout}\n{stderr}"
        );
        for line in fitted {
            assert!(
                line.contains("fitted 6 after trying [16, 14, 12, 10, 9, 8, 7, 6]"),
                "{line}"
            );
            let secs: f64 = line
                .rsplit(" in ")
                .next()
                .and_then(|s| s.strip_suffix('s'))
                .and_then(|s| s.parse().ok())
                .unwrap_or(f64::MAX);
            assert!(secs < LONG_TIMEOUT_SECS / 2.0, "{line}");
        }
    }
}
