//! burn-train's Learner through the Accelerator (feature `train`): two ranks train the model one rank trains
//! with the doubled batch, bf16 and gradient accumulation go through the step pipeline, only rank 0 writes,
//! and a run stopped in the middle of an epoch resumes to the uninterrupted weights.

#[path = "support/isolation.rs"]
mod isolation;

#[path = "support/examples.rs"]
mod examples;
#[path = "support/fixtures.rs"]
mod fixtures;
#[path = "../examples/support/mlp.rs"]
mod mlp;
#[path = "../examples/support/mlp_train_step.rs"]
mod mlp_train_step;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::{AdamConfig, SgdConfig};
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::learner::burn_train::metric::{LearningRateMetric, LossMetric};
use burn_accelerate::learner::burn_train::{Learner, SupervisedTraining};
use burn_accelerate::learner::{AcceleratedStrategy, LearnerLoader};
use burn_accelerate::{
    Accelerator, MixedPrecision, PipelineSchedule, ProjectConfiguration, Result, ShardingStrategy,
};
use fixtures::{initial, max_abs_diff};
use mlp::{Mlp, SampleBatcher};
use mlp_train_step::{BlockWise, DeepMlp};

/// One Learner run.
#[derive(Clone)]
struct Run {
    ranks: usize,
    /// Per rank.
    batch: usize,
    accumulation: usize,
    precision: MixedPrecision,
    epochs: usize,
    project: Option<PathBuf>,
    save_every: Option<usize>,
    max_steps: Option<usize>,
    resume: bool,
    /// Each rank's burn-train folder, and whether burn-train's own epoch checkpoints are on.
    artifacts: PathBuf,
    checkpoints: bool,
    /// A linear learning-rate schedule (from 0.1 to 0.01 over 3 epochs of 1024 items in batches of 64) instead of
    /// the constant 0.1, with the learning rate logged as a metric.
    schedule: bool,
    sharding: ShardingStrategy,
    /// Ranks per shard group of a hybrid strategy.
    dp_shard_size: Option<usize>,
    /// The `TrainStep` goes block by block (`learner::backward_blocks`).
    block_wise: bool,
    /// Activation checkpointing (with `block_wise`).
    checkpointing: bool,
}

impl Run {
    fn new(name: &str) -> Self {
        Self {
            ranks: 1,
            batch: 64,
            accumulation: 1,
            precision: MixedPrecision::No,
            epochs: 2,
            project: None,
            save_every: None,
            max_steps: None,
            resume: false,
            artifacts: temp_dir(name),
            checkpoints: false,
            schedule: false,
            sharding: ShardingStrategy::NoShard,
            dp_shard_size: None,
            block_wise: false,
            checkpointing: false,
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-learner-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Rank `rank`'s burn-train folder.
fn artifacts(run: &Run, rank: usize) -> PathBuf {
    run.artifacts.join(format!("rank{rank}"))
}

/// Trains `start` as `run` says; returns rank 0's trained weights and held-out loss.
fn fit(run: &Run, start: &Mlp) -> (Vec<Vec<f32>>, f32) {
    let mut builder = Accelerator::builder()
        .mixed_precision(run.precision)
        .gradient_accumulation_steps(run.accumulation)
        .sharding(run.sharding);
    if let Some(ranks) = run.dp_shard_size {
        builder = builder.dp_shard_size(ranks);
    }
    if run.checkpointing {
        builder = builder.activation_checkpointing(true);
    }
    if let Some(dir) = &run.project {
        builder = builder.project_configuration(ProjectConfiguration::new(dir));
    }
    let results = builder
        .launch(run.ranks, |acc| -> Result<(Vec<Vec<f32>>, f32)> {
            let acc = Arc::new(acc);
            if run.block_wise {
                rank_fit(&acc, run, start, |mlp| BlockWise { mlp }, |m| &m.mlp)
            } else {
                rank_fit(&acc, run, start, |mlp| mlp, |m| m)
            }
        })
        .unwrap();
    // Every rank ends with the same model; rank 0's stands for the run.
    for (rank, (weights, loss)) in results.iter().enumerate().skip(1) {
        assert_eq!(
            weights, &results[0].0,
            "rank {rank}'s weights differ from rank 0's"
        );
        assert_eq!(loss.to_bits(), results[0].1.to_bits(), "rank {rank}'s loss");
    }
    results.into_iter().next().unwrap()
}

/// A dataloader as burn-train reads it.
type Loader = Arc<dyn burn::data::dataloader::DataLoader<mlp::Batch>>;

/// The training split (1024 samples, shuffled, `batch` a rank) and the validation split (256 samples in batches of
/// 128, read whole), prepared by `acc`.
fn loaders(acc: &Accelerator, batch: usize) -> Result<(Loader, Loader)> {
    let train = LearnerLoader::train(
        acc.prepare_dataloader(
            DataLoaderBuilder::new(SampleBatcher)
                .batch_size(batch)
                .shuffle(7)
                .build(mlp::dataset(1024, 4)),
        )?,
    );
    let valid = LearnerLoader::valid(
        acc.prepare_dataloader(
            DataLoaderBuilder::new(SampleBatcher)
                .batch_size(128)
                .build(mlp::dataset(256, 5)),
        )?,
    );
    Ok((train, valid))
}

/// One rank's Learner run of `run`, on `start` wrapped by `wrap` (the model type the `TrainStep` belongs to);
/// returns the trained weights and held-out loss of the MLP `mlp_of` finds in it.
fn rank_fit<M>(
    acc: &Arc<Accelerator>,
    run: &Run,
    start: &Mlp,
    wrap: impl Fn(Mlp) -> M,
    mlp_of: impl Fn(&M) -> &Mlp,
) -> Result<(Vec<Vec<f32>>, f32)>
where
    M: burn_accelerate::learner::burn_train::LearnerModel
        + burn_accelerate::learner::burn_train::TrainStep<
            Input = mlp::Batch,
            Output = burn_accelerate::learner::burn_train::RegressionOutput,
        > + burn_accelerate::learner::burn_train::InferenceStep<
            Input = mlp::Batch,
            Output = burn_accelerate::learner::burn_train::RegressionOutput,
        >,
{
    let rank = acc.process_index();
    let (train, valid) = loaders(acc, run.batch)?;
    let mut training = SupervisedTraining::new(artifacts(run, rank), train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_train_numeric(LearningRateMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(run.epochs)
        .with_application_logger(None);
    if run.checkpoints {
        training = training.with_default_checkpointers();
    }
    let training = acc.prepare_training_with(training, |mut s| {
        s = s.resume(run.resume);
        if let Some(n) = run.save_every {
            s = s.save_every(n);
        }
        if let Some(n) = run.max_steps {
            s = s.max_steps(n);
        }
        s
    })?;
    // Under FULL_SHARD and HYBRID_SHARD the Learner holds this rank's slices: it starts from the prepared
    // model (under the other strategies the strategy prepares it if the caller did not).
    let start = wrap(start.clone());
    let start = if run.sharding.reshards_parameters() || run.ranks.is_multiple_of(2) {
        acc.prepare_model(start)?
    } else {
        start
    };
    // Plain SGD: weights move linearly with the gradients, so runs whose gradients differ only by float
    // rounding (2 ranks against 1, 4 micro-batches against 1 batch) stay within 1e-5; Adam divides by the
    // gradients' own size and turns rounding on near-zero gradients into steps of the learning rate.
    let result = if run.schedule {
        let schedule = LinearLrSchedulerConfig::new(0.1, 0.01, 3 * 1024 / 64)
            .init()
            .map_err(burn_accelerate::Error::other)?;
        training.launch(Learner::new(
            start.clone(),
            SgdConfig::new().init(),
            schedule,
        ))
    } else {
        training.launch(Learner::new(start.clone(), SgdConfig::new().init(), 0.1))
    };
    assert!(result.error.is_none(), "{:?}", result.error);
    let device = acc.device().clone().inner();
    let eval = burn::data::dataloader::batcher::Batcher::batch(
        &SampleBatcher,
        mlp::samples(512, 99),
        &device,
    );
    let trained = mlp_of(&result.model);
    let loss = trained.loss(eval).into_scalar::<f32>();
    Ok((mlp::weights(trained), loss))
}

#[test]
fn two_ranks_train_the_model_one_rank_trains_with_the_doubled_batch() {
    let start = initial();
    let one = fit(
        &Run {
            batch: 64,
            ..Run::new("one")
        },
        &start,
    );
    let two = fit(
        &Run {
            ranks: 2,
            batch: 32,
            ..Run::new("two")
        },
        &start,
    );
    let diff = max_abs_diff(&one.0, &two.0);
    assert!(diff <= 1e-5, "2 ranks differ from 1 by {diff}");
    assert!(one.1 < 0.3, "the model learns: {}", one.1);
}

#[test]
fn the_learner_trains_sharded_as_unsharded_under_every_sharding_strategy() {
    let start = initial();
    let run = |ranks: usize, sharding, name: &str| Run {
        ranks,
        batch: 64 / ranks,
        accumulation: 2,
        schedule: true,
        sharding,
        ..Run::new(name)
    };
    let one = fit(&run(1, ShardingStrategy::NoShard, "one"), &start);
    let plain = fit(&run(2, ShardingStrategy::NoShard, "no-shard"), &start);
    let zero2 = fit(
        &run(2, ShardingStrategy::ShardGradOp, "shard-grad-op"),
        &start,
    );
    assert_eq!(
        plain.0, zero2.0,
        "SHARD_GRAD_OP: the same reductions, the same weights bit for bit"
    );
    assert_eq!(plain.1.to_bits(), zero2.1.to_bits());
    let full = fit(&run(2, ShardingStrategy::FullShard, "full-shard"), &start);
    let hybrid = fit(
        &Run {
            dp_shard_size: Some(2),
            ..run(4, ShardingStrategy::HybridShard, "hybrid-shard")
        },
        &start,
    );
    let hybrid_zero2 = fit(
        &Run {
            dp_shard_size: Some(2),
            ..run(4, ShardingStrategy::HybridShardZero2, "hybrid-shard-zero2")
        },
        &start,
    );
    for (name, (weights, loss)) in [
        ("NO_SHARD on 2 ranks", &plain),
        ("FULL_SHARD on 2 ranks", &full),
        ("HYBRID_SHARD on 2 x 2 ranks", &hybrid),
        ("_HYBRID_SHARD_ZERO2 on 2 x 2 ranks", &hybrid_zero2),
    ] {
        let diff = max_abs_diff(&one.0, weights);
        assert!(diff <= 1e-5, "{name} differs from one process by {diff}");
        assert!(
            (loss - one.1).abs() <= 1e-5,
            "{name}: held-out loss {loss} against {}",
            one.1
        );
    }
    let moved = max_abs_diff(&mlp::weights(&start), &one.0);
    assert!(moved > 1e-2, "training moved the weights by {moved} only");
}

#[test]
fn under_full_shard_a_frozen_input_layer_stays_and_the_rest_trains_as_on_one_process() {
    let start = initial().with_input_frozen();
    let run = |ranks: usize, sharding, name: &str| Run {
        ranks,
        batch: 64 / ranks,
        sharding,
        ..Run::new(name)
    };
    let one = fit(&run(1, ShardingStrategy::NoShard, "frozen-one"), &start);
    let full = fit(
        &run(2, ShardingStrategy::FullShard, "frozen-full-shard"),
        &start,
    );
    let diff = max_abs_diff(&one.0, &full.0);
    assert!(
        diff <= 1e-5,
        "FULL_SHARD differs from one process by {diff}"
    );
    let before = mlp::weights(&start);
    // The input layer's weight and bias come first in visiting order: unchanged; the output layer moved.
    assert_eq!(full.0[..2], before[..2], "the frozen input layer changed");
    let moved = max_abs_diff(&before[2..], &full.0[2..]);
    assert!(moved > 1e-2, "the output layer moved by {moved} only");
}

#[test]
fn block_by_block_the_learner_trains_as_one_process_in_every_mode() {
    let start = initial();
    let run = |ranks: usize, sharding, name: &str| Run {
        ranks,
        batch: 64 / ranks,
        accumulation: 2,
        sharding,
        block_wise: true,
        ..Run::new(name)
    };
    let reference_run = Run {
        block_wise: false,
        ..run(1, ShardingStrategy::NoShard, "blocks-reference")
    };
    let one = fit(&reference_run, &start);
    let frozen_start = initial().with_input_frozen();
    let frozen_one = fit(
        &Run {
            block_wise: false,
            ..run(1, ShardingStrategy::NoShard, "blocks-frozen-reference")
        },
        &frozen_start,
    );
    for (name, case, reference, start) in [
        (
            "one process",
            run(1, ShardingStrategy::NoShard, "blocks-one"),
            &one,
            &start,
        ),
        (
            "NO_SHARD on 2 ranks",
            run(2, ShardingStrategy::NoShard, "blocks-no-shard"),
            &one,
            &start,
        ),
        (
            "block-wise FULL_SHARD on 2 ranks",
            run(2, ShardingStrategy::FullShard, "blocks-full-shard"),
            &one,
            &start,
        ),
        (
            "block-wise FULL_SHARD with activation checkpointing",
            Run {
                checkpointing: true,
                ..run(2, ShardingStrategy::FullShard, "blocks-checkpointing")
            },
            &one,
            &start,
        ),
        (
            "block-wise HYBRID_SHARD on 2 x 2 ranks",
            Run {
                dp_shard_size: Some(2),
                ..run(4, ShardingStrategy::HybridShard, "blocks-hybrid")
            },
            &one,
            &start,
        ),
        (
            "block-wise FULL_SHARD with the input block frozen",
            run(2, ShardingStrategy::FullShard, "blocks-frozen"),
            &frozen_one,
            &frozen_start,
        ),
    ] {
        let (weights, loss) = fit(&case, start);
        let diff = max_abs_diff(&reference.0, &weights);
        assert!(diff <= 1e-5, "{name} differs from one process by {diff}");
        if std::ptr::eq(reference, &one) {
            // Validated block by block on every rank (`learner::forward_batch`): one process's losses, logged by
            // the main process.
            let (a, b) = (
                metric_log(&reference_run, "valid", 2, "Loss"),
                metric_log(&case, "valid", 2, "Loss"),
            );
            assert_eq!(a.len(), b.len(), "{name}: {b:?} against {a:?}");
            for ((x, _), (y, _)) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5, "{name}: {b:?} against {a:?}");
            }
        }
        assert!(
            (loss - reference.1).abs() <= 1e-5,
            "{name}: held-out loss {loss} against {}",
            reference.1
        );
    }
    let frozen = fit(
        &run(2, ShardingStrategy::FullShard, "blocks-frozen-check"),
        &frozen_start,
    );
    assert_eq!(
        frozen.0[..2],
        mlp::weights(&frozen_start)[..2],
        "the frozen block changed"
    );
    let moved = max_abs_diff(&mlp::weights(&start), &one.0);
    assert!(moved > 1e-2, "training moved the weights by {moved} only");
}

/// One Learner run of the deep MLP ([`DeepMlp`], 4 hidden blocks), pipelined when `pp` > 1.
#[derive(Clone)]
struct Staged {
    ranks: usize,
    pp: usize,
    micro_batches: usize,
    schedule: PipelineSchedule,
    checkpointing: bool,
    /// Per replica (every stage of a pipeline reads the same batches).
    batch: usize,
    epochs: usize,
    project: Option<PathBuf>,
    save_every: Option<usize>,
    max_steps: Option<usize>,
    resume: bool,
    artifacts: PathBuf,
}

impl Staged {
    fn new(name: &str) -> Self {
        Self {
            ranks: 1,
            pp: 1,
            micro_batches: 1,
            schedule: PipelineSchedule::default(),
            checkpointing: false,
            batch: 64,
            epochs: 2,
            project: None,
            save_every: None,
            max_steps: None,
            resume: false,
            artifacts: temp_dir(name),
        }
    }

    /// The burn-train folder of the rank that reports (the last stage of the first replica).
    fn reporter(&self) -> PathBuf {
        let replicas = self.ranks / self.pp;
        self.artifacts
            .join(format!("rank{}", (self.pp - 1) * replicas))
    }
}

/// The deep MLP every pipelined case starts from.
fn deep_start() -> DeepMlp {
    DeepMlp::new(&burn::tensor::Device::default().autodiff(), 4)
}

/// Every rank's trained weights (a stage holds empty placeholders for the other stages' parameters) and
/// held-out loss (through the stages, the same on every rank).
fn fit_staged(run: &Staged, start: &DeepMlp) -> Vec<(Vec<Vec<f32>>, f32)> {
    let mut builder = Accelerator::builder()
        .pp_size(run.pp)
        .pp_microbatches(run.micro_batches)
        .pp_schedule(run.schedule)
        .activation_checkpointing(run.checkpointing);
    if let Some(dir) = &run.project {
        builder = builder.project_configuration(ProjectConfiguration::new(dir));
    }
    builder
        .launch(run.ranks, |acc| -> Result<(Vec<Vec<f32>>, f32)> {
            let acc = Arc::new(acc);
            let rank = acc.process_index();
            let (train, valid) = loaders(&acc, run.batch)?;
            let training =
                SupervisedTraining::new(run.artifacts.join(format!("rank{rank}")), train, valid)
                    .metric_train_numeric(LossMetric::new())
                    .metric_valid_numeric(LossMetric::new())
                    .num_epochs(run.epochs)
                    .with_application_logger(None);
            let training = acc.prepare_training_with(training, |mut s| {
                s = s.resume(run.resume);
                if let Some(n) = run.save_every {
                    s = s.save_every(n);
                }
                if let Some(n) = run.max_steps {
                    s = s.max_steps(n);
                }
                s
            })?;
            // Each rank's Learner holds its stage's blocks.
            let model = acc.prepare_blocks(start.clone())?;
            let result = training.launch(Learner::new(model, SgdConfig::new().init(), 0.1));
            assert!(result.error.is_none(), "{:?}", result.error);
            let device = acc.device().clone().inner();
            let eval = burn::data::dataloader::batcher::Batcher::batch(
                &SampleBatcher,
                mlp::samples(512, 99),
                &device,
            );
            let errors = acc.forward_batch(
                &result.model,
                eval,
                DeepMlp::embed,
                Mlp::hidden,
                |model, h, batch| {
                    let d = model.output.forward(h) - batch.y.clone();
                    let n = d.dims()[0];
                    (d.clone() * d).reshape([n])
                },
            )?;
            Ok((
                mlp::weights(&result.model),
                errors.mean().into_scalar::<f32>(),
            ))
        })
        .unwrap()
}

/// Every parameter of `reference` is held by some rank of `ranks`, each rank's equal to it within `bound`, and
/// every rank's held-out loss too.
fn assert_stages_match(
    name: &str,
    reference: &(Vec<Vec<f32>>, f32),
    ranks: &[(Vec<Vec<f32>>, f32)],
    bound: f32,
) {
    for (k, want) in reference.0.iter().enumerate() {
        let holders: Vec<&Vec<f32>> = ranks
            .iter()
            .map(|r| &r.0[k])
            .filter(|w| !w.is_empty())
            .collect();
        assert!(!holders.is_empty(), "{name}: no rank holds parameter {k}");
        for got in holders {
            let diff = max_abs_diff(std::slice::from_ref(want), std::slice::from_ref(got));
            assert!(
                diff <= bound,
                "{name}: parameter {k} differs from one process by {diff}"
            );
        }
    }
    for (rank, (_, loss)) in ranks.iter().enumerate() {
        assert!(
            (loss - reference.1).abs() <= bound,
            "{name}: rank {rank}'s held-out loss {loss} against {}",
            reference.1
        );
    }
}

/// A metric file of a burn-train folder (`split/epoch-N/Name.log`: `value,batch` lines, then `value,final`).
fn metric_file(dir: &Path, split: &str, epoch: usize, name: &str) -> Vec<(f64, String)> {
    let path = dir.join(format!("{split}/epoch-{epoch}/{name}.log"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|line| {
            let (value, tag) = line.split_once(',').unwrap();
            (value.parse().unwrap(), tag.to_string())
        })
        .collect()
}

#[test]
fn pipelined_the_learner_trains_as_one_process_under_both_schedules_and_with_replicas() {
    let start = deep_start();
    let one_run = Staged::new("pp-one");
    let one = fit_staged(&one_run, &start).remove(0);
    let piped = |name: &str| Staged {
        ranks: 2,
        pp: 2,
        micro_batches: 4,
        ..Staged::new(name)
    };
    for (name, run) in [
        (
            "pp 2, GPipe, 4 micro-batches",
            Staged {
                schedule: PipelineSchedule::GPipe,
                ..piped("pp-gpipe")
            },
        ),
        (
            "pp 2, 1F1B, 4 micro-batches",
            Staged {
                schedule: PipelineSchedule::OneFOneB,
                ..piped("pp-1f1b")
            },
        ),
        (
            "pp 2, activation checkpointing",
            Staged {
                checkpointing: true,
                ..piped("pp-ckpt")
            },
        ),
        // 2 replicas of 2 stages, each replica 32 samples a batch: the global batch of one process.
        (
            "pp 2 x dp 2",
            Staged {
                ranks: 4,
                batch: 32,
                ..piped("pp-dp")
            },
        ),
    ] {
        let ranks = fit_staged(&run, &start);
        // SGD: the micro-batches' gradients summed in another order than one batch's, within float rounding.
        assert_stages_match(name, &one, &ranks, 1e-5);
        // The reporting rank (the last stage) logged the validation loss of one process, batch by batch.
        for epoch in 1..=2 {
            let (a, b) = (
                metric_file(&one_run.artifacts.join("rank0"), "valid", epoch, "Loss"),
                metric_file(&run.reporter(), "valid", epoch, "Loss"),
            );
            assert_eq!(a.len(), 3, "2 batches and the epoch's value: {a:?}");
            assert_eq!(
                b.len(),
                a.len(),
                "{name}, epoch {epoch}: {b:?} against {a:?}"
            );
            for ((x, tag_x), (y, tag_y)) in a.iter().zip(&b) {
                assert_eq!(tag_x, tag_y);
                assert!(
                    (x - y).abs() <= 1e-5,
                    "{name}, epoch {epoch}: {b:?} against {a:?}"
                );
            }
            let train = metric_file(&run.reporter(), "train", epoch, "Loss");
            assert_eq!(
                train.len(),
                1024 / 64 + 1,
                "{name}: a training loss per batch: {train:?}"
            );
        }
        // Only the reporting rank writes burn-train's files.
        for rank in 0..run.ranks {
            let dir = run.artifacts.join(format!("rank{rank}"));
            if dir != run.reporter() {
                assert_eq!(
                    files(&dir),
                    Vec::<PathBuf>::new(),
                    "{name}: rank {rank} wrote"
                );
            }
        }
    }
    let moved = max_abs_diff(&mlp::weights(&start), &one.0);
    assert!(moved > 1e-2, "training moved the weights by {moved} only");
}

#[test]
fn a_pipelined_learner_run_stopped_mid_epoch_resumes_to_the_uninterrupted_weights() {
    let start = deep_start();
    let project = temp_dir("pp-resume-project");
    let base = Staged {
        ranks: 2,
        pp: 2,
        micro_batches: 2,
        ..Staged::new("pp-resume")
    };
    let uninterrupted = fit_staged(&base, &start);
    // 16 steps an epoch: stop at step 21, in the middle of the second epoch, saving every 7 steps.
    let stopped = Staged {
        project: Some(project.clone()),
        save_every: Some(7),
        max_steps: Some(21),
        ..base.clone()
    };
    fit_staged(&stopped, &start);
    assert_eq!(ProjectConfiguration::new(&project).checkpoints().len(), 3);
    // Resumed from a fresh start: everything comes from each stage's checkpoint.
    let resumed = fit_staged(
        &Staged {
            project: Some(project),
            save_every: Some(7),
            resume: true,
            ..base.clone()
        },
        &deep_start(),
    );
    for (rank, (a, b)) in uninterrupted.iter().zip(&resumed).enumerate() {
        assert_eq!(a.0, b.0, "rank {rank}: bit for bit on the CPU");
        assert_eq!(a.1.to_bits(), b.1.to_bits(), "rank {rank}'s held-out loss");
    }
}

/// The deep MLP with a `TrainStep` that runs the whole model (no `learner::backward_batch`).
#[derive(burn::module::Module, Debug)]
struct WholeDeep {
    deep: DeepMlp,
}

impl burn_accelerate::Blocks for WholeDeep {
    type Block = burn::nn::Linear;
    fn blocks(&self) -> &[burn::nn::Linear] {
        self.deep.blocks()
    }
}

impl burn_accelerate::learner::burn_train::TrainStep for WholeDeep {
    type Input = mlp::Batch;
    type Output = burn_accelerate::learner::burn_train::RegressionOutput;

    fn step(
        &self,
        batch: mlp::Batch,
    ) -> burn_accelerate::learner::burn_train::TrainOutput<Self::Output> {
        let h = self
            .deep
            .hidden
            .iter()
            .fold(self.deep.embed(&batch), |h, b| Mlp::hidden(b, h));
        let item = self.deep.regression(h, &batch);
        burn_accelerate::learner::burn_train::TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl burn_accelerate::learner::burn_train::InferenceStep for WholeDeep {
    type Input = mlp::Batch;
    type Output = burn_accelerate::learner::burn_train::RegressionOutput;

    fn step(&self, batch: mlp::Batch) -> Self::Output {
        let h = self
            .deep
            .hidden
            .iter()
            .fold(self.deep.embed(&batch), |h, b| Mlp::hidden(b, h));
        self.deep.regression(h, &batch)
    }
}

#[test]
fn under_a_pipeline_the_learner_says_what_to_change_instead_of_training_wrong() {
    let errors = |name: &str, prepared: bool, checkpoints: bool| -> Vec<String> {
        learner_errors(
            Accelerator::builder().pp_size(2),
            name,
            checkpoints,
            |acc| {
                let model = WholeDeep { deep: deep_start() };
                let model = if prepared {
                    acc.prepare_blocks(model)?
                } else {
                    model
                };
                Ok(Learner::new(model, SgdConfig::new().init(), 0.1))
            },
        )
    };
    for error in errors("pp-unprepared", false, false) {
        assert!(
            error.contains("pp_size 2")
                && error.contains("accelerator.prepare_blocks(model)?")
                && !error.contains("  "),
            "{error}"
        );
    }
    for error in errors("pp-epoch-checkpoints", true, true) {
        assert!(
            error.contains("save_every")
                && error.contains("with_default_checkpointers")
                && !error.contains("  "),
            "{error}"
        );
    }
    // The step runs the whole model on a stage that holds only its blocks.
    for error in errors("pp-whole-step", true, false) {
        assert!(
            error.contains("burn_accelerate::learner::backward_batch(self, batch")
                && !error.contains("  "),
            "{error}"
        );
    }
}

/// The values of one metric file of rank 0 (`split/epoch-N/Name.log`: `value,batch` lines, then
/// `value,final`).
fn metric_log(run: &Run, split: &str, epoch: usize, name: &str) -> Vec<(f64, String)> {
    metric_file(&artifacts(run, 0), split, epoch, name)
}

#[test]
fn validation_metrics_and_the_schedule_on_2_ranks_equal_1_rank() {
    let start = initial();
    let base = |name| Run {
        epochs: 3,
        schedule: true,
        ..Run::new(name)
    };
    let one = base("metrics-one");
    let two = Run {
        ranks: 2,
        batch: 32,
        ..base("metrics-two")
    };
    fit(&one, &start);
    fit(&two, &start);
    for epoch in 1..=3 {
        // The whole validation split (2 batches of 128), not rank 0's half; weights agree to 1e-5 (above).
        let (a, b) = (
            metric_log(&one, "valid", epoch, "Loss"),
            metric_log(&two, "valid", epoch, "Loss"),
        );
        assert_eq!(a.len(), 3, "2 batches and the epoch's value: {a:?}");
        assert_eq!(b.len(), a.len(), "epoch {epoch}: {b:?} against {a:?}");
        for ((x, tag_x), (y, tag_y)) in a.iter().zip(&b) {
            assert_eq!(tag_x, tag_y);
            assert!((x - y).abs() <= 1e-5, "epoch {epoch}: {a:?} against {b:?}");
        }
        // The learning rate of the last batch of each epoch: the same schedule on both.
        let lr = |run| metric_log(run, "train", epoch, "Learning_Rate");
        let (a, b) = (lr(&one), lr(&two));
        let last = |log: &[(f64, String)]| log.iter().rfind(|(_, t)| t != "final").unwrap().0;
        assert_eq!(last(&a), last(&b), "epoch {epoch}");
    }
}

#[test]
fn accumulation_and_bf16_go_through_the_step_pipeline() {
    let start = initial();
    let reference = fit(&Run::new("reference"), &start);
    // 4 micro-batches of 16 make the optimizer steps of one batch of 64 (gradients averaged over the window),
    // and so do 4 micro-batches of 8 on each of 2 ranks.
    let accumulated = fit(
        &Run {
            batch: 16,
            accumulation: 4,
            ..Run::new("accumulated")
        },
        &start,
    );
    let diff = max_abs_diff(&reference.0, &accumulated.0);
    assert!(diff <= 1e-5, "4 x 16 differs from 1 x 64 by {diff}");
    let accumulated_two = fit(
        &Run {
            ranks: 2,
            batch: 8,
            accumulation: 4,
            ..Run::new("accumulated-two")
        },
        &start,
    );
    let diff = max_abs_diff(&reference.0, &accumulated_two.0);
    assert!(diff <= 1e-5, "2 ranks x 4 x 8 differ from 1 x 64 by {diff}");
    for ranks in [1, 2] {
        let bf16 = fit(
            &Run {
                ranks,
                batch: 64 / ranks,
                precision: MixedPrecision::Bf16,
                ..Run::new(&format!("bf16-{ranks}"))
            },
            &start,
        );
        // Measured: within 0.04% of the f32 held-out loss on 1 and 2 ranks.
        assert!(
            (bf16.1 - reference.1).abs() <= 0.01 * reference.1,
            "bf16 on {ranks} rank(s): {} vs f32 {}",
            bf16.1,
            reference.1
        );
    }
}

/// The files under `dir` (empty when it does not exist).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

#[test]
fn only_rank_0_writes_metrics_and_checkpoints() {
    let run = Run {
        ranks: 2,
        batch: 32,
        epochs: 1,
        checkpoints: true,
        ..Run::new("writers")
    };
    fit(&run, &initial());
    let main = files(&artifacts(&run, 0));
    assert!(
        main.iter()
            .any(|f| f.to_string_lossy().contains("Loss.log")),
        "{main:?}"
    );
    assert!(
        main.iter()
            .any(|f| f.to_string_lossy().contains("checkpoint")),
        "{main:?}"
    );
    assert_eq!(files(&artifacts(&run, 1)), Vec::<PathBuf>::new());
}

#[test]
fn a_run_stopped_mid_epoch_resumes_to_the_uninterrupted_weights() {
    for sharding in [ShardingStrategy::NoShard, ShardingStrategy::FullShard] {
        let start = initial();
        let project = temp_dir(&format!("resume-project-{sharding}"));
        let base = Run {
            ranks: 2,
            batch: 32,
            sharding,
            ..Run::new(&format!("resume-{sharding}"))
        };
        let uninterrupted = fit(&base, &start);
        // 16 steps an epoch: stop at step 21, in the middle of the second epoch, saving every 7 steps.
        let stopped = Run {
            project: Some(project.clone()),
            save_every: Some(7),
            max_steps: Some(21),
            ..base.clone()
        };
        fit(&stopped, &start);
        let checkpoints = ProjectConfiguration::new(&project).checkpoints();
        assert_eq!(checkpoints.len(), 3, "{sharding}: {checkpoints:?}");
        // Resumed from a fresh start value: everything comes from the checkpoint.
        let resumed = fit(
            &Run {
                project: Some(project),
                save_every: Some(7),
                resume: true,
                ..base.clone()
            },
            &initial(),
        );
        assert_eq!(
            max_abs_diff(&uninterrupted.0, &resumed.0),
            0.0,
            "{sharding}: bit for bit on the CPU"
        );
    }
}

/// A sharded Learner run saved by 2 ranks of 32 samples a batch resumes on 4 ranks of 16 (the same global batch),
/// each taking its own optimizer slice from the 2 saved ones, and ends with the uninterrupted run's weights
/// (SGD: the same sums in another order, within 1e-5).
#[test]
fn a_learner_run_saved_on_two_ranks_resumes_on_four() {
    let start = initial();
    let project = temp_dir("any-ranks-project");
    let base = Run {
        ranks: 2,
        batch: 32,
        sharding: ShardingStrategy::ShardGradOp,
        ..Run::new("any-ranks")
    };
    let uninterrupted = fit(&base, &start);
    let stopped = Run {
        project: Some(project.clone()),
        save_every: Some(7),
        max_steps: Some(21),
        ..base.clone()
    };
    fit(&stopped, &start);
    let resumed = fit(
        &Run {
            ranks: 4,
            batch: 16,
            project: Some(project),
            save_every: Some(7),
            resume: true,
            ..base.clone()
        },
        &initial(),
    );
    let diff = max_abs_diff(&uninterrupted.0, &resumed.0);
    assert!(diff <= 1e-5, "max |Δ| {diff:e}");
    assert!((uninterrupted.1 - resumed.1).abs() <= 1e-5);
}

/// The example under `mpirun -np 2` prints what `--processes 2` and `--processes 1` print.
#[cfg(feature = "mpi")]
#[test]
fn the_example_under_mpirun_matches_in_process_ranks() {
    use std::process::Command;
    let program = examples::example("learner");
    let run =
        |command: &mut Command| examples::result_lines(command.output().unwrap(), &["final_loss="]);
    let mpirun = |np: usize, args: &[&str]| {
        run(examples::own_mpi_session(&mut Command::new("mpirun"))
            .args(["--allow-run-as-root", "--oversubscribe", "-np"])
            .arg(np.to_string())
            .arg(&program)
            .args(args)
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1"))
    };
    let one = run(Command::new(&program).args(["--processes", "1"]));
    assert_eq!(one.len(), 1, "{one:?}");
    let two = run(Command::new(&program).args(["--processes", "2"]));
    assert_eq!(two, one);
    assert_eq!(
        mpirun(2, &[]),
        one,
        "mpirun -np 2 prints the main process's final_loss once"
    );
    // FULL_SHARD on 2 and 4 processes, HYBRID_SHARD on 2 x 2, block-wise FULL_SHARD (with activation checkpointing
    // on 4): the in-process ranks' result, and within rounding of one process (Adam turns the reductions' other
    // order into differences in the last digits).
    let loss = |lines: &[String]| -> f64 { lines[0]["final_loss=".len()..].parse().unwrap() };
    for (np, args) in [
        (2, vec!["--sharding", "FULL_SHARD"]),
        (4, vec!["--sharding", "FULL_SHARD"]),
        (
            4,
            vec!["--sharding", "HYBRID_SHARD", "--dp-shard-size", "2"],
        ),
        (2, vec!["--sharding", "FULL_SHARD", "--block-wise"]),
        (
            4,
            vec![
                "--sharding",
                "FULL_SHARD",
                "--block-wise",
                "--activation-checkpointing",
            ],
        ),
    ] {
        let processes = np.to_string();
        let in_process = run(Command::new(&program)
            .args(["--processes", processes.as_str()])
            .args(&args));
        let launched = mpirun(np, &args);
        assert_eq!(launched, in_process, "{args:?} on {np} processes");
        let diff = (loss(&launched) - loss(&one)).abs();
        assert!(diff <= 1e-4, "{args:?}: {launched:?} against {one:?}");
    }
    // Pipelines of the deeper MLP (2 stages on 2 processes under both schedules, 2 stages x 2 replicas on 4) and
    // fine-tuning with the bottom frozen (block-wise FULL_SHARD, and 2 x 2 stages), each against the same model on
    // one process.
    let one_process = |extra: &[&str]| {
        run(Command::new(&program)
            .args(["--processes", "1"])
            .args(extra))
    };
    let deep = one_process(&["--pp-size", "1"]);
    let deep_frozen = one_process(&["--pp-size", "1", "--freeze-bottom"]);
    let frozen = one_process(&["--freeze-bottom"]);
    for (np, args, reference) in [
        (2, vec!["--pp-size", "2"], &deep),
        (2, vec!["--pp-size", "2", "--pp-schedule", "gpipe"], &deep),
        (
            4,
            vec!["--pp-size", "2", "--activation-checkpointing"],
            &deep,
        ),
        (4, vec!["--pp-size", "2", "--freeze-bottom"], &deep_frozen),
        (
            2,
            vec![
                "--sharding",
                "FULL_SHARD",
                "--block-wise",
                "--freeze-bottom",
            ],
            &frozen,
        ),
    ] {
        let processes = np.to_string();
        let in_process = run(Command::new(&program)
            .args(["--processes", processes.as_str()])
            .args(&args));
        let launched = mpirun(np, &args);
        assert_eq!(launched, in_process, "{args:?} on {np} processes");
        let diff = (loss(&launched) - loss(reference)).abs();
        assert!(diff <= 1e-4, "{args:?}: {launched:?} against {reference:?}");
    }
    assert_ne!(frozen, one, "freezing the bottom changed nothing");
}

/// A Learner job killed (SIGKILL, every rank) under `mpirun -np 2` in the middle of an epoch, after a save, resumes
/// to the uninterrupted job's final loss bit for bit: under `FULL_SHARD` (each rank its slices) and on 2 pipeline
/// stages (each its stage).
#[cfg(feature = "mpi")]
#[test]
fn a_learner_job_killed_under_mpirun_resumes_bit_for_bit() {
    let program = examples::example("learner");
    let final_loss = |out| examples::result_lines(out, &["final_loss="]);
    for args in [vec!["--sharding", "FULL_SHARD"], vec!["--pp-size", "2"]] {
        let uninterrupted = final_loss(examples::mpirun(2, &program, &args));
        assert_eq!(uninterrupted.len(), 1, "{args:?}: {uninterrupted:?}");
        let project = temp_dir(&format!("killed{}", args.join("")));
        let dir = project.to_str().unwrap();
        let saving = |extra: &[&'static str]| -> Vec<&str> {
            let mut all = args.clone();
            all.extend(["--project-dir", dir, "--save-every", "20"]);
            all.extend(extra);
            all
        };
        // 32 steps an epoch: killed as batch 25 is read, after the save at step 20.
        let killed = examples::mpirun(2, &program, &saving(&["--kill-after-batches", "25"]));
        assert!(!killed.status.success(), "{args:?}: the job was not killed");
        let saved = ProjectConfiguration::new(&project).checkpoints();
        assert_eq!(saved.len(), 1, "{args:?}: {saved:?}");
        let resumed = final_loss(examples::mpirun(2, &program, &saving(&["--resume"])));
        assert_eq!(resumed, uninterrupted, "{args:?}");
    }
}

/// The transformer through the Learner under `mpirun -np 2`: `FULL_SHARD` block by block and whole, and 2 pipeline
/// stages, end with one process's validation loss, and under `FULL_SHARD` each rank held half the parameters
/// between steps (its slices) and got its half back (`return_slices`).
#[cfg(feature = "mpi")]
#[test]
fn the_transformer_learner_under_mpirun_trains_one_processs_model_holding_its_slices() {
    use std::process::Command;
    let program = examples::example("transformer_learner");
    let lines = |out| examples::result_lines(out, &["final_loss=", "rank "]);
    let value = |lines: &[String], key: &str| -> Vec<f64> {
        lines
            .iter()
            .flat_map(|l| l.split(' '))
            .filter_map(|w| w.strip_prefix(key))
            .map(|v| v.parse().unwrap())
            .collect()
    };
    let one = lines(Command::new(&program).output().unwrap());
    let (loss, held) = (
        value(&one, "final_loss=")[0],
        value(&one, "params_at_rest=")[0],
    );
    for args in [
        vec!["--sharding", "FULL_SHARD"],
        vec!["--sharding", "FULL_SHARD", "--whole"],
        vec!["--pp-size", "2"],
    ] {
        let launched = lines(examples::mpirun(2, &program, &args));
        let got = value(&launched, "final_loss=");
        assert_eq!(got.len(), 1, "{args:?}: {launched:?}");
        assert!(
            (got[0] - loss).abs() <= 1e-4,
            "{args:?}: {launched:?} against {one:?}"
        );
        let at_rest = value(&launched, "params_at_rest=");
        assert_eq!(at_rest.len(), 2, "{args:?}: {launched:?}");
        if args[0] == "--sharding" {
            assert!(
                at_rest.iter().all(|b| *b == held / 2.0),
                "{args:?}: {launched:?} against {held}"
            );
        }
    }
}

/// A TrainStep that back-propagates with `loss.backward()`, missing the fp16 loss scale.
#[derive(burn::module::Module, Debug)]
struct Unscaled {
    mlp: Mlp,
}

impl burn_accelerate::learner::burn_train::TrainStep for Unscaled {
    type Input = mlp::Batch;
    type Output = burn_accelerate::learner::burn_train::RegressionOutput;

    fn step(
        &self,
        batch: mlp::Batch,
    ) -> burn_accelerate::learner::burn_train::TrainOutput<Self::Output> {
        let item = mlp_train_step::regression(&self.mlp, batch);
        burn_accelerate::learner::burn_train::TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl burn_accelerate::learner::burn_train::InferenceStep for Unscaled {
    type Input = mlp::Batch;
    type Output = burn_accelerate::learner::burn_train::RegressionOutput;

    fn step(&self, batch: mlp::Batch) -> Self::Output {
        mlp_train_step::regression(&self.mlp, batch)
    }
}

/// A TrainStep on the gathered model, and an InferenceStep on `self` (the Learner's slices under `FULL_SHARD`).
#[derive(burn::module::Module, Debug)]
struct SlicedValidation {
    mlp: Mlp,
}

impl burn_accelerate::learner::burn_train::TrainStep for SlicedValidation {
    type Input = mlp::Batch;
    type Output = burn_accelerate::learner::burn_train::RegressionOutput;

    fn step(
        &self,
        batch: mlp::Batch,
    ) -> burn_accelerate::learner::burn_train::TrainOutput<Self::Output> {
        let model = burn_accelerate::learner::unshard(self);
        let item = mlp_train_step::regression(&model.mlp, batch);
        let grads = burn_accelerate::learner::backward(item.loss.clone());
        burn_accelerate::learner::burn_train::TrainOutput::new(&model, grads, item)
    }
}

impl burn_accelerate::learner::burn_train::InferenceStep for SlicedValidation {
    type Input = mlp::Batch;
    type Output = burn_accelerate::learner::burn_train::RegressionOutput;

    fn step(&self, batch: mlp::Batch) -> Self::Output {
        mlp_train_step::regression(&self.mlp, batch)
    }
}

#[test]
fn fp16_without_the_loss_scale_is_refused_not_trained_wrong() {
    let acc = Arc::new(
        Accelerator::builder()
            .mixed_precision(MixedPrecision::Fp16)
            .build()
            .unwrap(),
    );
    let loader = |n, seed| {
        acc.prepare_dataloader(
            DataLoaderBuilder::new(SampleBatcher)
                .batch_size(32)
                .build(mlp::dataset(n, seed)),
        )
        .unwrap()
    };
    let training = SupervisedTraining::new(
        temp_dir("unscaled"),
        LearnerLoader::train(loader(128, 4)),
        LearnerLoader::valid(loader(32, 5)),
    )
    .with_application_logger(None);
    let training = acc
        .prepare_training(training)
        .unwrap()
        .renderer(Box::new(burn_accelerate::learner::QuietRenderer));
    let model = Unscaled { mlp: initial() };
    let result = training.launch(Learner::new(model, AdamConfig::new().init(), 1e-3));
    let error = result.error.expect("an error").to_string();
    assert!(
        error.contains("burn_accelerate::learner::backward"),
        "{error}"
    );
}

#[test]
fn saving_without_a_project_folder_is_refused_before_training() {
    for (option, configure) in [
        (
            "save_every(100)",
            (|s: AcceleratedStrategy| s.save_every(100))
                as fn(AcceleratedStrategy) -> AcceleratedStrategy,
        ),
        ("resume(true)", |s| s.resume(true)),
    ] {
        let acc = Arc::new(Accelerator::new().unwrap());
        let loader = || {
            LearnerLoader::train(
                acc.prepare_dataloader(
                    DataLoaderBuilder::new(SampleBatcher)
                        .batch_size(32)
                        .build(mlp::dataset(64, 1)),
                )
                .unwrap(),
            )
        };
        let training = SupervisedTraining::<Mlp>::new(temp_dir("no-project"), loader(), loader());
        let error = acc
            .prepare_training_with(training, configure)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            error.contains(option) && error.contains("project_configuration"),
            "{error}"
        );
    }
}

/// The error each of 2 ranks under `FULL_SHARD` ends a Learner run with, the Learner built by `learner` from the
/// prepared accelerator, with burn-train's epoch checkpoints when `checkpoints`.
fn full_shard_errors<M, F>(name: &str, checkpoints: bool, learner: F) -> Vec<String>
where
    M: burn_accelerate::learner::burn_train::LearnerModel
        + burn_accelerate::learner::burn_train::TrainStep<Input = mlp::Batch>
        + burn_accelerate::learner::burn_train::InferenceStep<Input = mlp::Batch>,
    F: Fn(&Accelerator) -> Result<Learner<M>> + Sync,
{
    let builder = Accelerator::builder().sharding(ShardingStrategy::FullShard);
    learner_errors(builder, name, checkpoints, learner)
}

/// The error each of 2 ranks of `builder` ends a Learner run with (see [`full_shard_errors`]).
fn learner_errors<M, F>(
    builder: burn_accelerate::AcceleratorBuilder,
    name: &str,
    checkpoints: bool,
    learner: F,
) -> Vec<String>
where
    M: burn_accelerate::learner::burn_train::LearnerModel
        + burn_accelerate::learner::burn_train::TrainStep<Input = mlp::Batch>
        + burn_accelerate::learner::burn_train::InferenceStep<Input = mlp::Batch>,
    F: Fn(&Accelerator) -> Result<Learner<M>> + Sync,
{
    builder
        .launch(2, |acc| {
            let acc = Arc::new(acc);
            let loader = |n, seed| {
                acc.prepare_dataloader(
                    DataLoaderBuilder::new(SampleBatcher)
                        .batch_size(32)
                        .build(mlp::dataset(n, seed)),
                )
            };
            let mut training = SupervisedTraining::new(
                temp_dir(name).join(format!("rank{}", acc.process_index())),
                LearnerLoader::train(loader(128, 4)?),
                LearnerLoader::valid(loader(32, 5)?),
            )
            .with_application_logger(None);
            if checkpoints {
                training = training.with_default_checkpointers();
            }
            let training = acc
                .prepare_training(training)?
                .renderer(Box::new(burn_accelerate::learner::QuietRenderer));
            let result = training.launch(learner(&acc)?);
            Ok(result.error.map(|e| e.to_string()).unwrap_or_default())
        })
        .unwrap()
}

#[test]
fn under_full_shard_the_learner_says_what_to_change_instead_of_training_wrong() {
    // The Learner built with the model as drawn: its record cannot become each rank's slices.
    for error in full_shard_errors("unprepared", false, |_| {
        Ok(Learner::new(initial(), SgdConfig::new().init(), 0.1))
    }) {
        assert!(
            error.contains("Learner::new(accelerator.prepare_model(model)?")
                && !error.contains("  "),
            "{error}"
        );
    }
    // burn-train's epoch checkpoints would hold the main process's slices only.
    for error in full_shard_errors("epoch-checkpoints", true, |acc| {
        Ok(Learner::new(
            acc.prepare_model(initial())?,
            SgdConfig::new().init(),
            0.1,
        ))
    }) {
        assert!(
            error.contains("save_every")
                && error.contains("with_default_checkpointers")
                && !error.contains("  "),
            "{error}"
        );
    }
    // An InferenceStep that runs on the Learner's slices: every rank validates, and says what to call.
    for error in full_shard_errors("sliced-validation", false, |acc| {
        let model = SlicedValidation { mlp: initial() };
        Ok(Learner::new(
            acc.prepare_model(model)?,
            SgdConfig::new().init(),
            0.1,
        ))
    }) {
        assert!(
            error.contains("InferenceStep")
                && error.contains("burn_accelerate::learner::unshard(self)")
                && error.contains("burn_accelerate::learner::forward_batch(self")
                && !error.contains("  "),
            "{error}"
        );
    }
    // A TrainStep that runs its forward pass on the Learner's slices instead of `learner::unshard(self)`.
    for error in full_shard_errors("no-unshard", false, |acc| {
        let model = Unscaled { mlp: initial() };
        Ok(Learner::new(
            acc.prepare_model(model)?,
            SgdConfig::new().init(),
            0.1,
        ))
    }) {
        assert!(
            error.contains("burn_accelerate::learner::unshard(self)") && !error.contains("  "),
            "{error}"
        );
    }
}

#[test]
fn the_learner_refuses_tensor_parallelism_with_a_message() {
    let errors = Accelerator::builder()
        .tp_size(2)
        .launch(2, |acc| {
            Ok(
                burn_accelerate::learner::AcceleratedStrategy::new(Arc::new(acc))
                    .map(|_| ())
                    .unwrap_err()
                    .to_string(),
            )
        })
        .unwrap();
    for error in errors {
        assert!(
            error.contains("Learner cannot train with tensor parallelism yet (tp_size 2)")
                && error.contains("prepare_tensor_parallel"),
            "{error}"
        );
    }
}
