//! Real processes against one process, value by value (feature `mpi`; needs Open MPI's `mpirun`). Each rank of
//! the parity harness writes its final weights; the tests compare every rank with one process and with the
//! others, resume a job killed under `mpirun` bit for bit (on the same number of processes) and within the
//! parity bounds (on another: 2 -> 3, 3 -> 2, every strategy, with accumulation and in fp16; hybrid meshes to and
//! from other strategies; a stream saved mid-epoch), gather an uneven evaluation set on 3 processes, and launch
//! through `burn-accelerate launch --hostfile`. The scenarios of
//! `tests/suite/many_models.rs` (two models with accumulation, a layer unfrozen after `prepare_model`, data-dependent
//! routing, a rank's own error) run under `mpirun` too, every strategy.

use crate::examples;
use crate::parity;
use crate::scenarios;

use std::path::Path;
use std::process::{Command, Output};

use parity::{
    CASES, assert_success, check_cases_did_something, compare_case, harness, report, run_local,
    scratch, weights,
};

/// `mpirun -np <np> parity_harness --out <out> <args>`.
fn mpirun(np: usize, out: &Path, args: &[&str]) -> Output {
    let out = out.to_str().expect("a UTF-8 path");
    examples::mpirun(np, &harness(), &[&["--out", out], args].concat())
}

#[test]
fn every_process_ends_with_the_weights_of_one_process_in_every_case() {
    let dir = scratch("mpirun");
    let one = dir.join("p1");
    run_local(&one, &[]);
    check_cases_did_something(&one);
    for p in [2, 3] {
        let ranks = dir.join(format!("mpi{p}"));
        assert_success(&mpirun(p, &ranks, &[]));
        // The same ranks as threads of one process.
        let in_process = dir.join(format!("in{p}"));
        run_local(&in_process, &["--processes", &p.to_string()]);
        for (case, bound) in CASES {
            let diff = compare_case(&one, &ranks, p, case, bound);
            let engines = parity::max_abs_diff(
                &weights(&ranks.join(case).join("rank0.safetensors")),
                &weights(&in_process.join(case).join("rank0.safetensors")),
            );
            println!(
                "mpirun -np {p} {case}: max |Δ| vs 1 process {diff:e}, vs {p} in-process ranks {engines:e}"
            );
            // The MPI engine and the in-process one reduce in the same order: the same bits.
            assert_eq!(engines, 0.0, "{case}, P={p}: mpirun vs in-process ranks");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gather_for_metrics_on_three_processes_returns_every_sample_once_on_every_rank() {
    let dir = scratch("gather");
    run_local(&dir.join("p1"), &["--case", "eval"]);
    assert_success(&mpirun(3, &dir.join("mpi3"), &["--case", "eval"]));
    let one = report(&dir.join("p1"), "eval", 0);
    let ids: Vec<i64> = (0..103).collect();
    assert_eq!(one["gathered_ids"], serde_json::json!(ids));
    for rank in 0..3 {
        let mine = report(&dir.join("mpi3"), "eval", rank);
        assert_eq!(mine["num_processes"], 3);
        assert_eq!(
            mine["gathered_ids"],
            serde_json::json!(ids),
            "rank {rank}: 103 samples in batches of 8 on 3 ranks, each once, in order"
        );
        // Every gathered loss is the one process's loss of the same sample, computed on another rank.
        assert_eq!(
            mine["gathered_losses"], one["gathered_losses"],
            "rank {rank}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A stream under `mpirun -np 3`, read by every process or dispatched from the main process
/// (`dispatch_batches`): every rank gathers each of its 103 ids once, in order; dispatched, only the main process
/// opened it.
#[test]
fn a_dispatched_stream_under_mpirun_is_read_by_the_main_process_alone() {
    let dir = scratch("stream-mpi");
    let ids: Vec<i64> = (0..103).collect();
    for dispatch in [false, true] {
        let out = dir.join(format!("dispatch-{dispatch}"));
        let mut args = vec!["--case", "stream"];
        if dispatch {
            args.push("--dispatch-batches");
        }
        assert_success(&mpirun(3, &out, &args));
        for rank in 0..3 {
            let mine = report(&out, "stream", rank);
            assert_eq!(
                mine["gathered_ids"],
                serde_json::json!(ids),
                "dispatch {dispatch}, rank {rank}"
            );
            let opened = if dispatch && rank > 0 { 0 } else { 1 };
            assert_eq!(
                mine["stream_opened"], opened,
                "dispatch {dispatch}, rank {rank}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A stream saved by N processes after 2 rounds of 24 ids continues on M (`mpirun` both times), read by every
/// process or dispatched from the main process: every resumed rank gathers exactly the ids after the save, then
/// the next epoch whole; dispatched, only the main process opens the stream.
#[test]
fn a_stream_saved_under_mpirun_continues_on_another_number_of_processes() {
    let dir = scratch("stream-resume-mpi");
    for dispatch in [false, true] {
        for (n, m) in [(2, 3), (3, 2)] {
            let what = format!("mpirun {n} -> {m}, dispatch_batches {dispatch}");
            let out = dir.join(format!("{dispatch}-{n}to{m}"));
            let mut args = vec!["--case", "stream", "--stream-save-rounds", "2"];
            if dispatch {
                args.push("--dispatch-batches");
            }
            assert_success(&mpirun(n, &out, &args));
            for rank in 0..n {
                let saved = report(&out, "stream", rank);
                let first: Vec<i64> = (0..48).collect();
                assert_eq!(
                    saved["gathered_ids"],
                    serde_json::json!(first),
                    "{what}, rank {rank}"
                );
            }
            args.push("--resume");
            assert_success(&mpirun(m, &out, &args));
            let expected: Vec<i64> = (48..103).chain(0..103).collect();
            for rank in 0..m {
                let resumed = report(&out, "stream", rank);
                assert_eq!(
                    resumed["gathered_ids"],
                    serde_json::json!(expected),
                    "{what}, rank {rank}: the rest of the epoch, then the next whole"
                );
                let opened = if dispatch && rank > 0 { 0 } else { 2 };
                assert_eq!(resumed["stream_opened"], opened, "{what}, rank {rank}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A state moves between hybrid meshes and the other strategies under `mpirun`: saved by 4 processes as 2
/// replicas of 2 shards (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`), it resumes on 2 `FULL_SHARD` and 3 `NO_SHARD`
/// processes; saved by 2 `FULL_SHARD` processes, on 4 as a hybrid mesh. Each within the `dp` bound of one process
/// straight through, every sample used once.
#[test]
fn a_hybrid_state_resumes_under_mpirun_on_other_meshes() {
    let dir = scratch("hybrid-resize-mpi");
    let reference = dir.join("one");
    run_local(&reference, &["--case", "resume"]);
    let hybrid = ["--sharding", "HYBRID_SHARD", "--dp-shard-size", "2"];
    let zero2 = ["--sharding", "_HYBRID_SHARD_ZERO2", "--dp-shard-size", "2"];
    let full = ["--sharding", "FULL_SHARD"];
    let plain = ["--sharding", "NO_SHARD"];
    type Plan<'a> = ((usize, &'a [&'a str]), Vec<(usize, &'a [&'a str])>);
    let plans: [Plan; 3] = [
        ((4, &hybrid), vec![(2, &full), (3, &plain)]),
        ((4, &zero2), vec![(2, &full), (4, &hybrid)]),
        ((2, &full), vec![(4, &zero2)]),
    ];
    for (i, ((n, saved_with), resumes)) in plans.iter().enumerate() {
        let saved = dir.join(format!("saved{i}"));
        assert_success(&mpirun(
            *n,
            &saved,
            &[&["--case", "resume"][..], saved_with].concat(),
        ));
        let before = parity::trained_ids(&saved, *n);
        for (m, resumed_with) in resumes {
            let what = format!("mpirun {n} {saved_with:?} -> {m} {resumed_with:?}");
            let resumed = dir.join(format!("saved{i}-m{m}"));
            parity::copy_dir(&saved.join("resume-state"), &resumed.join("resume-state"));
            let args = [&["--case", "resume", "--resume"][..], resumed_with].concat();
            assert_success(&mpirun(*m, &resumed, &args));
            let diff = parity::check_resumed(
                &reference,
                &before,
                (&resumed, *m, resumed_with[1]),
                parity::bound("dp"),
                &what,
            );
            println!("{what}: max |Δ| vs one process {diff:e}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_job_killed_under_mpirun_resumes_bit_for_bit() {
    let dir = scratch("resume");
    for p in [2, 3] {
        let whole = dir.join(format!("whole{p}"));
        assert_success(&mpirun(p, &whole, &["--case", "resume"]));
        let broken = dir.join(format!("broken{p}"));
        // Saved after step 10, the last rank killed by SIGKILL after step 14: the job must fail.
        let last = (p - 1).to_string();
        let killed = mpirun(
            p,
            &broken,
            &["--case", "resume", "--kill-at", "14", "--kill-rank", &last],
        );
        assert!(!killed.status.success(), "the killed job must fail");
        assert!(
            String::from_utf8_lossy(&killed.stderr).contains("is killed after step 14"),
            "{}",
            String::from_utf8_lossy(&killed.stderr)
        );
        assert_success(&mpirun(p, &broken, &["--case", "resume", "--resume"]));
        for rank in 0..p {
            let file = format!("rank{rank}.safetensors");
            assert_eq!(
                weights(&broken.join("resume").join(&file)),
                weights(&whole.join("resume").join(&file)),
                "P={p}, rank {rank}: resumed weights differ from the uninterrupted run"
            );
            let resumed = report(&broken, "resume", rank);
            assert_eq!(resumed["resumed_at"], 10, "P={p}, rank {rank}");
            assert_eq!(resumed["steps"], 11, "P={p}, rank {rank}: steps 11 to 21");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_job_saved_by_n_processes_and_killed_resumes_on_m_processes() {
    let dir = scratch("any-ranks-mpi");
    // (name, harness flags, the parity case whose bound applies)
    let variants: [(&str, &[&str], &str); 3] = [
        ("f32", &[], "dp"),
        ("accumulation", &["--accumulation", "3"], "accumulation"),
        ("fp16", &["--mixed-precision", "fp16"], "fp16"),
    ];
    for (variant, flags, case) in variants {
        let reference = dir.join(format!("{variant}-one"));
        run_local(&reference, &[&["--case", "resume"], flags].concat());
        for sharding in ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"] {
            let common = [&["--case", "resume", "--sharding", sharding], flags].concat();
            for (n, m) in [(2, 3), (3, 2)] {
                let what = format!("mpirun {variant} {sharding} {n} -> {m}");
                // Saved after step 10, the last rank killed after step 14: the job fails.
                let run = dir.join(format!("{variant}-{sharding}-{n}to{m}"));
                let last = (n - 1).to_string();
                let kill = ["--kill-at", "14", "--kill-rank", &last];
                let killed = mpirun(n, &run, &[&common[..], &kill].concat());
                assert!(!killed.status.success(), "{what}: the killed job must fail");
                assert!(
                    String::from_utf8_lossy(&killed.stderr).contains("is killed after step 14"),
                    "{what}: {}",
                    String::from_utf8_lossy(&killed.stderr)
                );
                // The samples the N ranks used before the save (the killed job wrote no report; the same
                // ranks in-process deal the same samples).
                let dealt = dir.join(format!("{variant}-{sharding}-{n}-in-process"));
                let procs = n.to_string();
                run_local(&dealt, &[&["--processes", &procs], &common[..]].concat());
                let before = parity::trained_ids(&dealt, n);
                assert_success(&mpirun(m, &run, &[&common[..], &["--resume"]].concat()));
                let diff = parity::check_resumed(
                    &reference,
                    &before,
                    (&run, m, sharding),
                    parity::bound(case),
                    &what,
                );
                if variant == "fp16" {
                    // The killed job wrote no report: the same ranks in-process saved the same scaler.
                    parity::check_scaler_resumed(&reference, (&dealt, n), (&run, m), &what);
                }
                println!("{what}: max |Δ| vs one process {diff:e}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `HYBRID_SHARD` and `_HYBRID_SHARD_ZERO2` on 4 MPI processes as 2 replicas of 2 shards (sub-communicators
/// from `MPI_Comm_split`): the same bits as 4 in-process ranks of the same mesh, and within 1e-6 of `NO_SHARD`.
#[test]
fn hybrid_sharding_under_mpirun_matches_in_process_ranks_and_no_shard() {
    let dir = scratch("hybrid-mpi");
    let cases = ["dp", "accumulation", "clip-norm", "fp16"];
    let case_args: Vec<&str> = cases.iter().flat_map(|c| ["--case", *c]).collect();
    // 2 replicas of 2 shards on 4 processes; on 2 processes, 1 x 2 (all shards: FULL_SHARD's layout) and 2 x 1
    // (all replicas: data parallelism's).
    for (p, shard) in [(4, 2), (2, 2), (2, 1)] {
        let unsharded = dir.join(format!("no-shard-{p}"));
        if !unsharded.exists() {
            assert_success(&mpirun(p, &unsharded, &case_args));
        }
        for mode in ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] {
            let size = shard.to_string();
            let args = [
                &["--sharding", mode, "--dp-shard-size", &size][..],
                &case_args,
            ]
            .concat();
            let ranks = dir.join(format!("mpi-{mode}-{p}x{shard}"));
            assert_success(&mpirun(p, &ranks, &args));
            let in_process = dir.join(format!("in-{mode}-{p}x{shard}"));
            let procs = p.to_string();
            run_local(&in_process, &[&["--processes", &procs][..], &args].concat());
            for case in cases {
                let diff = compare_case(&unsharded, &ranks, p, case, 1e-6);
                let engines = parity::max_abs_diff(
                    &weights(&ranks.join(case).join("rank0.safetensors")),
                    &weights(&in_process.join(case).join("rank0.safetensors")),
                );
                println!(
                    "mpirun -np {p} {mode} {}x{shard} {case}: max |Δ| vs NO_SHARD {diff:e}, vs in-process \
                     {engines:e}",
                    p / shard
                );
                assert_eq!(engines, 0.0, "{mode} {case}: mpirun vs in-process ranks");
                assert_eq!(report(&ranks, case, 0)["sharding"], mode);
            }
        }
    }
    // The same mesh through `burn-accelerate launch` and Accelerate's flag names.
    let launched = dir.join("launched");
    let out = Command::new(examples::cli())
        .args([
            "launch",
            "--num-processes",
            "4",
            "--use_fsdp",
            "--fsdp_sharding_strategy",
            "4",
        ])
        .args(["--parallelism_config_dp_shard_size", "2"])
        .arg(harness())
        .arg("--out")
        .arg(&launched)
        .args(["--case", "dp"])
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .unwrap();
    assert_success(&out);
    for rank in 0..4 {
        let file = format!("rank{rank}.safetensors");
        assert_eq!(
            weights(&launched.join("dp").join(&file)),
            weights(&dir.join("mpi-HYBRID_SHARD-4x2").join("dp").join(&file)),
            "rank {rank}: launch --fsdp_sharding_strategy 4 --parallelism_config_dp_shard_size 2"
        );
        let env = &report(&launched, "dp", rank)["env"];
        assert_eq!(env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], "2", "{env}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn launch_with_a_hostfile_forwards_the_settings_to_every_rank() {
    let dir = scratch("hostfile");
    let hostfile = dir.join("hosts");
    std::fs::write(&hostfile, "localhost slots=3\n").unwrap();
    let out = examples::own_mpi_session(&mut Command::new(examples::cli()))
        .arg("launch")
        .arg("--hostfile")
        .arg(&hostfile)
        .args(["--num-processes", "3", "--mixed-precision", "bf16"])
        .args(["--gradient-accumulation-steps", "2"])
        .args(["--num-cpu-threads-per-process", "1"])
        .arg(harness())
        .arg("--out")
        .arg(&dir)
        .args(["--case", "env"])
        .env_remove("ACCELERATE_MIXED_PRECISION")
        .env_remove("RAYON_NUM_THREADS")
        .output()
        .unwrap();
    assert_success(&out);
    for rank in 0..3 {
        let seen = report(&dir, "env", rank);
        assert_eq!(seen["rank"], rank);
        assert_eq!(seen["num_processes"], 3, "rank {rank}: {seen}");
        assert_eq!(seen["mixed_precision"], "bf16", "rank {rank}: {seen}");
        assert_eq!(
            seen["gradient_accumulation_steps"], 2,
            "rank {rank}: {seen}"
        );
        assert_eq!(
            seen["env"]["ACCELERATE_MIXED_PRECISION"], "bf16",
            "rank {rank}"
        );
        assert_eq!(seen["env"]["RAYON_NUM_THREADS"], "1", "rank {rank}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `SHARD_GRAD_OP` and whole-model `FULL_SHARD` under `mpirun -np 2`, `3` and `4`: every case of the harness equals
/// `NO_SHARD`'s in-process ranks (bit for bit where the sums keep their order; within 1e-6 on 4 processes, where
/// Open MPI sums in a tree), and a sharded job killed by SIGKILL resumes bit for bit.
#[test]
fn sharded_processes_train_the_weights_of_unsharded_ones_and_resume_after_a_kill() {
    sharded_processes_against_unsharded("sharded-mpi", &[2, 3, 4], &[]);
}

/// Block-wise `FULL_SHARD` (`backward_blocks`, one block gathered at a time) under `mpirun -np 2`, `3` and `4`:
/// every case equals `NO_SHARD`'s in-process ranks (the sharded bounds), and a block-wise job killed by SIGKILL
/// resumes bit for bit.
#[test]
fn block_wise_full_shard_processes_train_the_weights_of_unsharded_ones_and_resume_after_a_kill() {
    sharded_processes_against_unsharded("blockwise-mpi", &[2, 3, 4], &["--blocks"]);
}

/// Under `mpirun -np p` for each of `ranks`, `SHARD_GRAD_OP` and `FULL_SHARD` with the harness's `extra` flags
/// against `NO_SHARD` on as many in-process ranks, with two bucket sizes, then a kill and resume.
fn sharded_processes_against_unsharded(name: &str, ranks: &[usize], extra: &[&str]) {
    let dir = scratch(name);
    for &p in ranks {
        let procs = p.to_string();
        let unsharded = dir.join(format!("in{p}"));
        run_local(&unsharded, &["--processes", &procs]);
        // Block-wise passes change only FULL_SHARD's path (SHARD_GRAD_OP runs them as a plain pass).
        let modes: &[&str] = if extra.is_empty() {
            &["SHARD_GRAD_OP", "FULL_SHARD"]
        } else {
            &["FULL_SHARD"]
        };
        for &sharding in modes {
            // Grouped rounds (the default bucket) and parameters sent alone (a 4 KiB bucket).
            for bucket in ["25", "0.004"] {
                let sharded = dir.join(format!("mpi{p}-{sharding}-{bucket}"));
                let args = ["--sharding", sharding, "--bucket-size-mb", bucket];
                assert_success(&mpirun(p, &sharded, &[&args[..], extra].concat()));
                for (case, _) in CASES {
                    // Open MPI sums 4 ranks' contributions in another order than in-process ranks do (a tree,
                    // not rank order): the same bits are not promised there, the parity bound is.
                    let bound = if p > 3 {
                        1e-6
                    } else if extra.contains(&"--blocks") {
                        parity::blockwise_bound(case)
                    } else {
                        parity::sharded_bound(case)
                    };
                    let diff = parity::compare_sharded_within(&unsharded, &sharded, p, case, bound);
                    println!(
                        "mpirun -np {p} {sharding} bucket {bucket} MiB {case}: max |Δ| vs NO_SHARD = {diff:e}"
                    );
                }
            }
            // Saved after step 10, the last rank killed by SIGKILL after step 14, resumed: the same bits as
            // the uninterrupted run.
            let resume = [&["--case", "resume", "--sharding", sharding][..], extra].concat();
            let resume = &resume[..];
            let whole = dir.join(format!("whole{p}-{sharding}"));
            assert_success(&mpirun(p, &whole, resume));
            let broken = dir.join(format!("broken{p}-{sharding}"));
            let last = (p - 1).to_string();
            let killed = mpirun(
                p,
                &broken,
                &[resume, &["--kill-at", "14", "--kill-rank", &last]].concat(),
            );
            assert!(!killed.status.success(), "the killed job must fail");
            // Killed where it was told to (not failed for another reason before the kill).
            assert!(
                String::from_utf8_lossy(&killed.stderr).contains("is killed after step 14"),
                "P={p} {sharding}: {}",
                String::from_utf8_lossy(&killed.stderr)
            );
            assert_success(&mpirun(p, &broken, &[resume, &["--resume"]].concat()));
            for rank in 0..p {
                let file = format!("rank{rank}.safetensors");
                assert_eq!(
                    weights(&broken.join("resume").join(&file)),
                    weights(&whole.join("resume").join(&file)),
                    "P={p} {sharding}, rank {rank}: resumed weights differ from the uninterrupted run"
                );
                let resumed = report(&broken, "resume", rank);
                assert_eq!(resumed["resumed_at"], 10, "P={p} {sharding}, rank {rank}");
                assert_eq!(
                    resumed["steps"], 11,
                    "P={p} {sharding}, rank {rank}: steps 11 to 21"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_sharded_example_under_launch_prints_the_unsharded_loss() {
    let lines = |out: Output| -> Vec<String> {
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("final_loss=") || l.starts_with("rank "))
            .map(str::to_string)
            .collect()
    };
    let example = examples::example("sharded_training");
    let launched = lines(
        Command::new(examples::cli())
            .arg("launch")
            .args([
                "--num-processes",
                "2",
                "--use_fsdp",
                "--fsdp_sharding_strategy",
                "2",
            ])
            .arg(&example)
            .env_remove("ACCELERATE_USE_FSDP")
            .env_remove("FSDP_SHARDING_STRATEGY")
            .output()
            .unwrap(),
    );
    let plain = lines(
        Command::new(&example)
            .args(["--processes", "2", "--sharding", "NO_SHARD"])
            .output()
            .unwrap(),
    );
    let loss = |l: &[String]| l.iter().find(|l| l.starts_with("final_loss=")).cloned();
    assert!(loss(&plain).is_some(), "{plain:?}");
    assert_eq!(loss(&launched), loss(&plain), "{launched:?}");
    let ranks: Vec<&String> = launched
        .iter()
        .filter(|l| l.starts_with("rank ") && l.contains("/2 sharding=SHARD_GRAD_OP"))
        .collect();
    assert_eq!(ranks.len(), 2, "{launched:?}");
}

/// Each rank's weights of a `many_models` run under `out`.
fn scenario_weights(out: &Path, rank: usize) -> Vec<Vec<Vec<f32>>> {
    let text = std::fs::read_to_string(out.join(format!("rank{rank}.json")))
        .unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    serde_json::from_str(&text).unwrap()
}

/// The strategies the scenarios run under: `(processes, flags)`.
fn scenario_setups() -> Vec<(usize, Vec<&'static str>)> {
    let mut setups = Vec::new();
    for p in [2, 3] {
        setups.push((p, vec!["--sharding", "NO_SHARD"]));
        setups.push((p, vec!["--sharding", "NO_SHARD", "--blocks"]));
        setups.push((p, vec!["--sharding", "SHARD_GRAD_OP"]));
        setups.push((p, vec!["--sharding", "FULL_SHARD"]));
        setups.push((p, vec!["--sharding", "FULL_SHARD", "--blocks"]));
    }
    setups.push((
        4,
        vec!["--sharding", "HYBRID_SHARD", "--dp-shard-size", "2"],
    ));
    setups.push((
        4,
        vec!["--sharding", "_HYBRID_SHARD_ZERO2", "--dp-shard-size", "2"],
    ));
    setups
}

/// Two models with accumulation, a layer unfrozen after `prepare_model` beside a frozen teacher, and routing that
/// leaves ranks without some gradients or any, on 2, 3 and 4 MPI processes under every strategy: every rank ends
/// with the weights of the loop a Burn user writes by hand on one process (within 1e-5), and with those of the same
/// ranks in-process (within 1e-6).
#[test]
fn the_many_models_scenarios_train_under_mpirun_as_a_plain_burn_loop() {
    let program = examples::example("many_models");
    let dir = scratch("many-models");
    let start = scenarios::initial();
    for (scenario, name) in scenarios::Scenario::ALL {
        let Some(_) = scenario.reference(&start, 1) else {
            continue;
        };
        for (p, flags) in scenario_setups() {
            let expected = scenario.reference(&start, p).unwrap();
            let what = format!("{name} -np {p} {}", flags.join(" "));
            let mpi = dir.join(format!("{name}-mpi{p}-{}", flags.join("")));
            let out = mpi.to_str().unwrap();
            assert_success(&examples::mpirun(
                p,
                &program,
                &[&["--scenario", name, "--out", out], &flags[..]].concat(),
            ));
            let local = dir.join(format!("{name}-in{p}-{}", flags.join("")));
            let procs = p.to_string();
            let args = [
                &["--scenario", name, "--processes", &procs, "--out"][..],
                &[local.to_str().unwrap()],
                &flags[..],
            ]
            .concat();
            assert_success(&Command::new(&program).args(&args).output().unwrap());
            for rank in 0..p {
                let got = scenario_weights(&mpi, rank);
                assert_eq!(got.len(), expected.len(), "{what}");
                for (model, (got, want)) in got.iter().zip(&expected).enumerate() {
                    let diff = scenarios::max_abs_diff(got, want);
                    assert!(
                        diff <= 1e-5,
                        "{what}, rank {rank}, model {model}: {diff:e} vs plain Burn"
                    );
                }
                for (got, local) in got.iter().zip(&scenario_weights(&local, rank)) {
                    let diff = scenarios::max_abs_diff(got, local);
                    assert!(
                        diff <= 1e-6,
                        "{what}, rank {rank}: {diff:e} vs in-process ranks"
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Rank 1's own error under `mpirun` and under `burn-accelerate launch`, every strategy, on 2 and 3 processes with
/// a 60 s collective timeout: the job ends at once (not after the timeout), with the failing rank named and its
/// own error printed, and the others stopped; `launch` ends its message with what rank 1 last wrote (its status
/// file).
#[test]
fn a_ranks_own_error_under_mpirun_ends_the_job_naming_it() {
    let program = examples::example("many_models");
    let own = scenarios::own_error();
    for (p, flags) in scenario_setups().into_iter().filter(|(p, _)| *p <= 3) {
        let what = format!("-np {p} {}", flags.join(" "));
        let args = [&["--scenario", "rank-error"][..], &flags[..]].concat();
        let began = std::time::Instant::now();
        let out = examples::own_mpi_session(&mut Command::new("mpirun"))
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                &p.to_string(),
            ])
            .arg(&program)
            .args(&args)
            .env("ACCELERATE_COLLECTIVE_TIMEOUT", "60")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: {stderr}");
        assert!(
            stderr.contains(&own) && stderr.contains("rank 1 exits with status 1"),
            "{what}: the failing rank and its error are not named:\n{stderr}"
        );
        assert!(
            !stderr.contains("timed out"),
            "{what}: a timeout:\n{stderr}"
        );
        assert!(
            began.elapsed() < std::time::Duration::from_secs(45),
            "{what}: {:?} (the collective timeout is 60 s)",
            began.elapsed()
        );
    }
    let out = Command::new(examples::cli())
        .args(["launch", "--num-processes", "3"])
        .arg(&program)
        .args(["--scenario", "rank-error", "--sharding", "FULL_SHARD"])
        .env("ACCELERATE_COLLECTIVE_TIMEOUT", "60")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&own)
            && stderr.contains("rank 1 exited with status 1; the other ranks were stopped"),
        "launch: {stderr}"
    );
    // The launcher's own message ends with what rank 1 last wrote, read from its status file.
    let words = stderr
        .split("rank 1 exited with status 1; the other ranks were stopped")
        .nth(1);
    assert!(
        words.is_some_and(|w| w.starts_with("\n  rank 1 last wrote:") && w.contains(&own)),
        "launch: rank 1's own error does not follow the launcher's message:\n{stderr}"
    );
}
