//! A training state saved by N in-process ranks resumes on M, for every N, M in 1..=4 and every strategy
//! (`NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD`), in f32, with accumulation, and in fp16 (its loss scale
//! saved): the resumed run ends with the weights of one process trained straight through on the same global
//! batch, within the parity harness's bounds for that case (`tests/support/parity.rs`), and every sample of
//! every epoch is used exactly once across the switch. (Accumulation and fp16 are checked apart: together, 4
//! ranks trained straight through already differ from one process by 6.4e-2, past the fp16 bound, from
//! rounding alone.) The same under
//! `mpirun` is in `tests/mpi/parity_mpi.rs`.

use crate::parity;

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

/// A number of ranks and the harness's flags.
type Ranks<'a> = (usize, &'a [&'a str]);

/// For each plan, a state saved by the first ranks and flags, then resumed by each of the others: every resumed
/// run within the `dp` bound of one process straight through (under `dir/one`), every sample used once.
fn resume_plans(dir: &std::path::Path, plans: &[(Ranks, Vec<Ranks>)]) {
    let reference = dir.join("one");
    run_local(&reference, &["--case", "resume"]);
    for (i, ((n, saved_with), resumes)) in plans.iter().enumerate() {
        let saved = dir.join(format!("saved{i}"));
        let procs = n.to_string();
        run_local(
            &saved,
            &[&["--processes", &procs, "--case", "resume"][..], saved_with].concat(),
        );
        let before = trained_ids(&saved, *n);
        for (m, resumed_with) in resumes {
            let what = format!("{n} ranks {saved_with:?} -> {m} ranks {resumed_with:?}");
            let resumed = dir.join(format!("saved{i}-m{m}"));
            copy_dir(&saved.join("resume-state"), &resumed.join("resume-state"));
            let procs = m.to_string();
            run_local(
                &resumed,
                &[
                    &["--processes", &procs, "--case", "resume", "--resume"][..],
                    resumed_with,
                ]
                .concat(),
            );
            let diff = check_resumed(
                &reference,
                &before,
                (&resumed, *m, resumed_with[1]),
                bound("dp"),
                &what,
            );
            println!("{what}: max |Δ| vs one process {diff:e}");
        }
    }
}

/// A state moves between the hybrid strategies and the others: saved by 4 ranks as 2 replicas of 2 shards, it
/// resumes as the same mesh (each rank its own file), on 2 ranks under `FULL_SHARD`, on 3 under `NO_SHARD` and on
/// 1; saved by 2 `FULL_SHARD` ranks, it resumes on 4 and 6 ranks as hybrid meshes.
#[test]
fn a_state_moves_between_hybrid_and_other_strategies() {
    let dir = scratch("any-ranks-hybrid");
    let hybrid2 = ["--sharding", "HYBRID_SHARD", "--dp-shard-size", "2"];
    let hybrid3 = ["--sharding", "HYBRID_SHARD", "--dp-shard-size", "3"];
    let full = ["--sharding", "FULL_SHARD"];
    let plain = ["--sharding", "NO_SHARD"];
    resume_plans(
        &dir,
        &[
            (
                (4, &hybrid2),
                vec![(4, &hybrid2), (2, &full), (3, &plain), (1, &plain)],
            ),
            ((2, &full), vec![(4, &hybrid2), (6, &hybrid3)]),
        ],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Block-wise passes and `_HYBRID_SHARD_ZERO2` resize too: a state saved by 2 block-wise `FULL_SHARD` ranks resumes
/// block-wise on 3 and with the plain pass on 1; one saved by 4 ranks as 2 replicas of 2 `_HYBRID_SHARD_ZERO2` shards
/// resumes on 2 `SHARD_GRAD_OP`, 3 `NO_SHARD` and 4 `_HYBRID_SHARD_ZERO2` ranks; each within the `dp` bound of one
/// process straight through, every sample used once.
#[test]
fn block_wise_and_zero2_states_resume_on_other_ranks() {
    let dir = scratch("any-ranks-blocks-zero2");
    let zero2 = ["--sharding", "_HYBRID_SHARD_ZERO2", "--dp-shard-size", "2"];
    let blocks = ["--sharding", "FULL_SHARD", "--blocks"];
    let plain = ["--sharding", "NO_SHARD"];
    let zero = ["--sharding", "SHARD_GRAD_OP"];
    resume_plans(
        &dir,
        &[
            ((2, &blocks), vec![(3, &blocks), (1, &plain)]),
            ((4, &zero2), vec![(2, &zero), (3, &plain), (4, &zero2)]),
        ],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A checkpoint holds no gradients, so a save inside an accumulation window (here after 2 of 3 micro-batches), or
/// between a window's last `backward` and its optimizer step, would resume without the gradients accumulated so far
/// (the harness measured 2.8e-2 away from one process straight through): it is refused on every rank, with a message
/// saying where to save, and the checkpoint saved at the window's end before it is left as it was.
#[test]
fn a_save_inside_an_accumulation_window_is_refused_on_every_rank() {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::SgdConfig;
    use burn::tensor::Tensor;
    use burn_accelerate::{Accelerator, StateToSave};

    let dir = scratch("mid-window");
    let errors = Accelerator::builder()
        .gradient_accumulation_steps(3)
        .launch(2, |acc| {
            let device = acc.device().clone();
            let mut model: Linear = acc.prepare_model(LinearConfig::new(3, 1).init(&device))?;
            let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 0.1);
            let step = |model: &Linear| {
                let loss = model.forward(Tensor::<2>::ones([2, 3], &device)).sum();
                acc.backward(loss, model)
            };
            let good = dir.join("good");
            let mut errors = Vec::new();
            for micro in 1..=5 {
                acc.accumulate();
                step(&model)?;
                if micro == 3 {
                    // The window's last backward, before its optimizer step.
                    let parts = StateToSave::new().model(&model)?.optimizer(&optimizer)?;
                    errors.push(acc.save_state(Some(&dir.join("late")), &parts).unwrap_err());
                }
                model = optimizer.try_step(model)?;
                let parts = StateToSave::new().model(&model)?.optimizer(&optimizer)?;
                match micro {
                    3 => {
                        acc.save_state(Some(&good), &parts)?;
                    }
                    4 => errors.push(acc.save_state(Some(&dir.join("mid")), &parts).unwrap_err()),
                    _ => {}
                }
            }
            let saved = acc.load_state(Some(&good))?;
            drop(saved);
            Ok(errors
                .into_iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>())
        })
        .unwrap();
    for (rank, errors) in errors.iter().enumerate() {
        assert_eq!(errors.len(), 2, "rank {rank}: {errors:?}");
        for error in errors {
            assert!(
                error.contains("save_state")
                    && error.contains("waiting for the optimizer step")
                    && error.contains("sync_gradients()"),
                "rank {rank}: {error}"
            );
        }
    }
    assert!(!dir.join("mid").exists() && !dir.join("late").exists());
    std::fs::remove_dir_all(&dir).ok();
}
