//! A training state saved by N in-process ranks resumes on M, for every N, M in 1..=4 and every strategy
//! (`NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD`), in f32, with accumulation, and in fp16 (its loss scale
//! saved): the resumed run ends with the weights of one process trained straight through on the same global
//! batch, within the parity harness's bounds for that case (`tests/support/parity.rs`), and every sample of
//! every epoch is used exactly once across the switch. (Accumulation and fp16 are checked apart: together, 4
//! ranks trained straight through already differ from one process by 6.4e-2, past the fp16 bound, from
//! rounding alone.) The same under
//! `mpirun` is in `tests/parity_mpi.rs`.

#[path = "support/isolation.rs"]
mod isolation;

#[path = "support/examples.rs"]
mod examples;
#[path = "support/parity.rs"]
mod parity;

use parity::{
    bound, check_resumed, check_scaler_resumed, copy_dir, run_local, scratch, trained_ids,
};

/// Saves after step 10 on N ranks and resumes on M for every N, M in 1..=4 under every strategy, with the
/// harness `flags`; the resumed weights must be within the parity `case`'s bound of one process's.
fn resume_on_any_number_of_ranks(variant: &str, flags: &[&str], case: &str) {
    let dir = scratch(&format!("any-ranks-{variant}"));
    let reference = dir.join("one");
    run_local(&reference, &[&["--case", "resume"], flags].concat());
    for sharding in ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"] {
        let mut worst = 0.0f32;
        for n in 1..=4usize {
            let saved = dir.join(format!("{sharding}-n{n}"));
            let common = ["--sharding", sharding, "--case", "resume"];
            let procs = n.to_string();
            run_local(
                &saved,
                &[&["--processes", &procs], &common[..], flags].concat(),
            );
            let before = trained_ids(&saved, n);
            for m in 1..=4usize {
                let what = format!("{variant} {sharding} {n} -> {m} ranks");
                let resumed = dir.join(format!("{sharding}-n{n}-m{m}"));
                copy_dir(&saved.join("resume-state"), &resumed.join("resume-state"));
                let procs = m.to_string();
                run_local(
                    &resumed,
                    &[&["--processes", &procs, "--resume"], &common[..], flags].concat(),
                );
                let diff = check_resumed(
                    &reference,
                    &before,
                    (&resumed, m, sharding),
                    bound(case),
                    &what,
                );
                worst = worst.max(diff);
                if variant == "fp16" {
                    check_scaler_resumed(&reference, (&saved, n), (&resumed, m), &what);
                }
                std::fs::remove_dir_all(&resumed).ok();
            }
        }
        println!("{variant} {sharding}: max |Δ| of any N -> M resume vs one process = {worst:e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_state_saved_on_n_ranks_resumes_on_m_with_the_weights_of_one_process() {
    resume_on_any_number_of_ranks("f32", &[], "dp");
}

#[test]
fn with_accumulation_a_state_resumes_on_any_number_of_ranks() {
    resume_on_any_number_of_ranks("accumulation", &["--accumulation", "3"], "accumulation");
}

#[test]
fn in_fp16_a_state_resumes_on_any_number_of_ranks_with_its_loss_scale() {
    resume_on_any_number_of_ranks("fp16", &["--mixed-precision", "fp16"], "fp16");
}

/// A state moves between the hybrid strategies and the others: saved by 4 ranks as 2 replicas of 2 shards, it
/// resumes as the same mesh (each rank its own file), on 2 ranks under `FULL_SHARD`, on 3 under `NO_SHARD` and on
/// 1; saved by 2 `FULL_SHARD` ranks, it resumes on 4 and 6 ranks as hybrid meshes.
#[test]
fn a_state_moves_between_hybrid_and_other_strategies() {
    let dir = scratch("any-ranks-hybrid");
    let reference = dir.join("one");
    run_local(&reference, &["--case", "resume"]);
    let hybrid = |shard: usize| {
        vec![
            "--sharding".to_string(),
            "HYBRID_SHARD".into(),
            "--dp-shard-size".into(),
            shard.to_string(),
        ]
    };
    let plain = |sharding: &str| vec!["--sharding".to_string(), sharding.into()];
    /// A number of ranks and the harness's sharding flags.
    type Ranks = (usize, Vec<String>);
    let runs: [(Ranks, Vec<Ranks>); 2] = [
        (
            (4, hybrid(2)),
            vec![
                (4, hybrid(2)),
                (2, plain("FULL_SHARD")),
                (3, plain("NO_SHARD")),
                (1, plain("NO_SHARD")),
            ],
        ),
        (
            (2, plain("FULL_SHARD")),
            vec![(4, hybrid(2)), (6, hybrid(3))],
        ),
    ];
    for (i, ((n, saved_with), resumes)) in runs.into_iter().enumerate() {
        let saved = dir.join(format!("saved{i}"));
        let procs = n.to_string();
        let args: Vec<&str> = saved_with.iter().map(String::as_str).collect();
        run_local(
            &saved,
            &[&["--processes", &procs, "--case", "resume"][..], &args].concat(),
        );
        let before = trained_ids(&saved, n);
        for (m, resumed_with) in resumes {
            let what = format!("{n} ranks {saved_with:?} -> {m} ranks {resumed_with:?}");
            let resumed = dir.join(format!("saved{i}-m{m}"));
            copy_dir(&saved.join("resume-state"), &resumed.join("resume-state"));
            let procs = m.to_string();
            let args: Vec<&str> = resumed_with.iter().map(String::as_str).collect();
            run_local(
                &resumed,
                &[
                    &["--processes", &procs, "--case", "resume", "--resume"][..],
                    &args,
                ]
                .concat(),
            );
            let diff = check_resumed(
                &reference,
                &before,
                (&resumed, m, args[1]),
                bound("dp"),
                &what,
            );
            println!("{what}: max |Δ| vs one process {diff:e}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
