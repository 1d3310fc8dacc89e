//! What a program written from the README alone runs into: the scheduler keeps the 1-rank schedule under the
//! README's data-parallel recipe, a setting whose applying call never comes is reported, a new run never
//! overwrites or prunes an earlier run's checkpoints, a rank's closure returns errors of its own kind, and a process
//! a launcher started with peers it cannot join never trains alone in silence.

#[path = "support/isolation.rs"]
mod isolation;

#[path = "support/examples.rs"]
mod examples;
#[path = "support/fixtures.rs"]
mod fixtures;
#[path = "../examples/support/mlp.rs"]
mod mlp;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::AdamConfig;
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{
    Accelerator, AcceleratorBuilder, Error, MixedPrecision, ProjectConfiguration, SchedulerRule,
    StateToSave, launch,
};
use fixtures::initial;
use log::{Log, Metadata, Record};
use mlp::{Mlp, SampleBatcher};

/// Every warning logged in this test binary.
struct Capture(Mutex<Vec<String>>);
impl Log for Capture {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }
    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            self.0.lock().unwrap().push(record.args().to_string());
        }
    }
    fn flush(&self) {}
}
static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-traps-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The README's data-parallel recipe: a global batch of 64 divided across the ranks, a linear schedule sized
/// in optimizer steps of the prepared dataloader (`epochs * train.len()`). Returns rank 0's learning rate
/// after each epoch.
fn learning_rates(builder: AcceleratorBuilder, ranks: usize, per_rank_batch: usize) -> Vec<f64> {
    const EPOCHS: usize = 3;
    let start = initial();
    let out = builder
        .launch(ranks, |acc| {
            let mut model = acc.prepare_model(start.clone())?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let train = acc.prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(per_rank_batch)
                    .shuffle(3)
                    .build(mlp::dataset(512, 9)),
            )?;
            // Sized as a 1-process program sizes it; under Accelerate's rule, `train.len()` of one process.
            let steps = EPOCHS * 512 / 64;
            let schedule = LinearLrSchedulerConfig::new(1e-2, 1e-3, steps)
                .init()
                .map_err(Error::other)?;
            let mut scheduler = acc.prepare_scheduler(schedule, &optimizer);
            let mut rates = Vec::new();
            for _ in 0..EPOCHS {
                for batch in train.iter() {
                    let loss = model.loss(batch?);
                    acc.backward(loss, &model)?;
                    model = optimizer.step(model);
                    scheduler.step();
                }
                rates.push(scheduler.lr());
            }
            Ok(rates)
        })
        .unwrap();
    assert!(out.iter().all(|r| *r == out[0]), "ranks disagree: {out:?}");
    out.into_iter().next().unwrap()
}

#[test]
fn the_readme_recipe_keeps_the_1_rank_schedule_on_2_and_4_ranks() {
    let one = learning_rates(Accelerator::builder(), 1, 64);
    assert!(one[0] > one[1] && one[1] > one[2], "{one:?}");
    for ranks in [2, 4] {
        let many = learning_rates(Accelerator::builder(), ranks, 64 / ranks);
        assert_eq!(many, one, "{ranks} ranks, global batch 64 divided");
    }
    // split_batches is the same recipe said by the accelerator.
    let split = learning_rates(Accelerator::builder().split_batches(true), 2, 64);
    assert_eq!(split, one);
}

#[test]
fn accelerates_rule_is_one_setting_away_for_programs_that_keep_the_1_rank_batch() {
    let one = learning_rates(Accelerator::builder(), 1, 64);
    // Every rank takes the 1-process batch: an epoch has half the steps, and the schedule advances twice each.
    let builder = Accelerator::builder().scheduler_rule(SchedulerRule::Accelerate);
    assert_eq!(learning_rates(builder, 2, 64), one);
    // The same program under the default rule ends the epoch half-way down its schedule.
    assert_ne!(learning_rates(Accelerator::builder(), 2, 64), one);
}

/// One short run of the quicktour loop on `ranks`, with or without the calls that apply accumulation and mixed
/// precision; returns the warnings it caused that name `setting`.
fn warnings_of(
    builder: AcceleratorBuilder,
    ranks: usize,
    apply: bool,
    setting: &str,
) -> Vec<String> {
    let start = initial();
    let before = CAPTURE.0.lock().unwrap().len();
    builder
        .launch(ranks, |acc| {
            let mut model = acc.prepare_model(start.clone())?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
            let train = acc.prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(16)
                    .build(mlp::dataset(128, 2)),
            )?;
            for batch in train.iter() {
                let batch = batch?;
                let loss = if apply {
                    acc.accumulate();
                    acc.autocast(&model, batch, |m: &Mlp, b| m.loss(b))
                } else {
                    model.loss(batch)
                };
                acc.backward(loss, &model)?;
                model = optimizer.step(model);
            }
            Ok(())
        })
        .unwrap();
    CAPTURE.0.lock().unwrap()[before..]
        .iter()
        .filter(|w| w.starts_with(setting))
        .cloned()
        .collect()
}

#[test]
fn a_setting_in_force_whose_call_never_comes_is_reported_once_by_the_main_process() {
    let _ = log::set_logger(&CAPTURE);
    log::set_max_level(log::LevelFilter::Warn);
    // One test drives every case, so that the captured warnings are this test's own.
    let accumulation = || Accelerator::builder().gradient_accumulation_steps(2);
    let missing = warnings_of(accumulation(), 2, false, "gradient_accumulation_steps is 2");
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(
        missing[0].contains("accelerator.accumulate()") && missing[0].contains("(from builder)"),
        "{missing:?}"
    );
    assert_eq!(
        warnings_of(accumulation(), 2, true, "gradient_accumulation_steps"),
        Vec::<String>::new()
    );
    let bf16 = || Accelerator::builder().mixed_precision(MixedPrecision::Bf16);
    let missing = warnings_of(bf16(), 1, false, "mixed_precision is bf16");
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(missing[0].contains("accelerator.autocast("), "{missing:?}");
    assert_eq!(
        warnings_of(bf16(), 1, true, "mixed_precision"),
        Vec::<String>::new()
    );

    // A model drawn on every rank before `prepare_model` under FULL_SHARD: the memory sharding saves is spent, and
    // a rank other than the main process says so once, with the bytes and the lazy way. A lazy model says nothing.
    let drawn_whole = |eager: bool| {
        let before = CAPTURE.0.lock().unwrap().len();
        Accelerator::builder()
            .sharding(burn_accelerate::ShardingStrategy::FullShard)
            .launch(2, |acc| {
                let model = Mlp::new(acc.device());
                if eager {
                    mlp::weights(&model);
                }
                acc.prepare_model(model).map(|_| ())
            })
            .unwrap();
        CAPTURE.0.lock().unwrap()[before..]
            .iter()
            .filter(|w| w.starts_with("prepare_model: rank"))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(drawn_whole(false), Vec::<String>::new());
    let bytes: usize = mlp::weights(&Mlp::new(&Default::default()))
        .iter()
        .map(|w| 4 * w.len())
        .sum();
    let said = drawn_whole(true);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].starts_with(&format!("prepare_model: rank 1 was handed {bytes} bytes"))
            && said[0].contains("Param::uninitialized")
            && said[0].contains("FULL_SHARD"),
        "{said:?}"
    );
}

/// Saves `count` automatic checkpoints of a 1-rank run into `project` (keeping at most 3).
fn save_checkpoints(project: &Path, count: usize) -> Result<(), Error> {
    let accelerator = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(project).total_limit(3))
        .build()?;
    let model = accelerator.prepare_model(initial())?;
    for _ in 0..count {
        accelerator.save_state(None, &StateToSave::new().model(&model)?)?;
    }
    Ok(())
}

fn checkpoint_names(project: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(project.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("checkpoint_"))
        .collect();
    names.sort();
    names
}

#[test]
fn a_new_run_in_an_old_project_folder_leaves_the_old_runs_checkpoints_alone() {
    let project = temp_dir("old-run");
    save_checkpoints(&project, 4).unwrap();
    let old = checkpoint_names(&project);
    assert_eq!(old, ["checkpoint_1", "checkpoint_2", "checkpoint_3"]);
    let modified = |name: &str| {
        std::fs::metadata(project.join("checkpoints").join(name))
            .unwrap()
            .modified()
            .unwrap()
    };
    let stamps: Vec<_> = old.iter().map(|n| modified(n)).collect();

    // A new run that starts numbering from 0 is refused before it writes anything.
    let error = save_checkpoints(&project, 1).unwrap_err().to_string();
    for expected in [
        "checkpoint_1..=checkpoint_3",
        "load_state(None)",
        "another project folder",
        "iteration: 4",
    ] {
        assert!(error.contains(expected), "{expected:?} not in: {error}");
    }
    assert_eq!(checkpoint_names(&project), old);
    assert_eq!(old.iter().map(|n| modified(n)).collect::<Vec<_>>(), stamps);

    // Continuing that run numbers after it, and prunes its oldest.
    let accelerator = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&project).total_limit(3))
        .build()
        .unwrap();
    let model = accelerator.prepare_model(initial()).unwrap();
    let mut state = accelerator.load_state(None).unwrap();
    let model = state.model(model).unwrap();
    state.finish().unwrap();
    let parts = StateToSave::new().model(&model).unwrap();
    accelerator.save_state(None, &parts).unwrap();
    assert_eq!(
        checkpoint_names(&project),
        ["checkpoint_2", "checkpoint_3", "checkpoint_4"]
    );
}

#[test]
fn a_ranks_closure_returns_errors_of_its_own_kind() {
    let parse = launch(2, |acc| {
        let steps: usize = "ten".parse().map_err(Error::other)?;
        Ok(steps + acc.process_index())
    })
    .unwrap_err();
    assert_eq!(parse.to_string(), "invalid digit found in string");
    let io = launch(2, |_| {
        std::fs::read("/nonexistent/burn-accelerate").map_err(Error::other)?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(io, Error::Other(_)), "{io:?}");
    let message = launch(1, |_| -> burn_accelerate::Result<()> {
        Err("the data folder is empty")?
    })
    .unwrap_err();
    assert_eq!(message.to_string(), "the data folder is empty");
}

/// A process a launcher started with peers it cannot join (this build has no `mpi` feature; SLURM tasks without an
/// MPI plugin; torchrun-style variables) refuses to train alone: building its accelerator fails saying why and how
/// to join them. With `ACCELERATE_INDEPENDENT_PROCESSES=1` it runs as an independent job and says so on standard
/// error, in a program that installed no logger (the checkpointing example).
#[test]
fn a_process_a_launcher_started_with_peers_never_trains_alone_in_silence() {
    let program = examples::example("checkpointing");
    let cases: [(&[(&str, &str)], &str); 3] = [
        (
            &[("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "0")],
            "--features burn-accelerate/mpi",
        ),
        (
            &[("SLURM_NTASKS", "2"), ("SLURM_PROCID", "0")],
            "srun --mpi=pmix",
        ),
        (
            &[("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")],
            "burn-accelerate launch --num-processes 2",
        ),
    ];
    for (n, (vars, fix)) in cases.into_iter().enumerate() {
        let dir = temp_dir(&format!("alone-{n}"));
        let run = |independent: bool| {
            let mut command = std::process::Command::new(&program);
            command
                .args(["--project-dir", &dir.to_string_lossy(), "--steps", "2"])
                .envs(vars.iter().copied());
            if independent {
                command.env("ACCELERATE_INDEPENDENT_PROCESSES", "1");
            }
            command.output().expect("the example runs")
        };
        let refused = run(false);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{vars:?}: it trained alone");
        assert!(
            stderr.contains("cannot join them")
                && stderr.contains(fix)
                && stderr.contains("ACCELERATE_INDEPENDENT_PROCESSES=1"),
            "{vars:?}: {stderr}"
        );
        let alone = run(true);
        let stderr = String::from_utf8_lossy(&alone.stderr);
        assert!(alone.status.success(), "{vars:?}: {stderr}");
        assert!(
            stderr.contains("[burn-accelerate] warning:")
                && stderr.contains("Running as an independent job")
                && stderr.contains(fix),
            "{vars:?}: the warning reaches standard error without a logger: {stderr}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
