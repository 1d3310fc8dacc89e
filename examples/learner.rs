//! burn-train's `Learner` trained through the Accelerator: the same `SupervisedTraining` on one rank, on
//! `--processes N` in-process ranks, or under `mpirun` / `burn-accelerate launch`, with mixed precision,
//! gradient accumulation, sharding (`--sharding FULL_SHARD`: each rank holds its slices of the model between
//! steps; with `--block-wise` one block is gathered at a time), pipelines (`--pp-size 2`: a deeper MLP cut into
//! stages, the batch through them), and saving / resuming in the middle of an epoch.
//! Synthetic regression data.
//!
//! ```text
//! cargo run --release --features train --example learner -- --processes 2 --mixed-precision bf16
//! ```
//!
//! The changes to a plain burn-train program: the dataloaders and the model are prepared (`LearnerLoader`,
//! `accelerator.prepare_model`), the `SupervisedTraining` goes through `accelerator.prepare_training_with`, and
//! the `TrainStep` uses `learner::unshard`, `learner::autocast` and `learner::backward`. The global batch
//! (`--batch-size`) is split between the ranks, so every number of ranks trains the same model. Prints `final_loss=<x>` (the loss of the trained model on
//! held-out data).

#[path = "support/mlp.rs"]
mod mlp;
#[path = "support/mlp_train_step.rs"]
mod mlp_train_step;
#[path = "support/ranks.rs"]
mod ranks;

use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::optim::AdamConfig;
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::learner::LearnerLoader;
use burn_accelerate::learner::burn_train::metric::LossMetric;
use burn_accelerate::learner::burn_train::{
    InferenceStep, Learner, LearnerModel, RegressionOutput, SupervisedTraining, TrainStep,
};
use burn_accelerate::{
    Accelerator, Blocks, MixedPrecision, ProjectConfiguration, Result, ShardingStrategy,
};
use clap::Parser;
use mlp::{Mlp, SampleBatcher};
use mlp_train_step::{BlockWise, DeepMlp};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// `no`, `bf16` or `fp16`.
    #[arg(long, default_value = "no")]
    mixed_precision: MixedPrecision,
    /// Epochs.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// The global batch, split between the ranks.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    gradient_accumulation_steps: usize,
    /// Where automatic checkpoints go (with --save-every / --resume).
    #[arg(long)]
    project_dir: Option<PathBuf>,
    /// Save the whole run every n optimizer steps.
    #[arg(long)]
    save_every: Option<usize>,
    /// Stop after n optimizer steps.
    #[arg(long)]
    max_steps: Option<usize>,
    /// Continue from the latest checkpoint in --project-dir.
    #[arg(long)]
    resume: bool,
    /// Where burn-train writes its metrics (default: a folder in the temporary directory).
    #[arg(long)]
    artifact_dir: Option<PathBuf>,
    /// `NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD`, `HYBRID_SHARD`, ... (default: the configuration's).
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// Ranks per shard group of the hybrid strategies.
    #[arg(long)]
    dp_shard_size: Option<usize>,
    /// Step block by block (`learner::backward_blocks`): under FULL_SHARD one block gathered at a time.
    #[arg(long)]
    block_wise: bool,
    /// Recompute each block in the backward pass (with --block-wise, or a pipeline).
    #[arg(long)]
    activation_checkpointing: bool,
    /// Pipeline stages: trains a deeper MLP (4 hidden blocks) cut into this many stages, the batch through them
    /// (`learner::backward_batch`); 1 trains the same deeper MLP without a pipeline.
    #[arg(long)]
    pp_size: Option<usize>,
    /// Micro-batches per batch under a pipeline.
    #[arg(long, default_value_t = 4)]
    pp_microbatches: usize,
    /// The pipeline's schedule: gpipe or 1f1b.
    #[arg(long)]
    pp_schedule: Option<burn_accelerate::PipelineSchedule>,
    /// Fine-tune: the input layer frozen (`Module::no_grad`; under --block-wise, the one block; under a pipeline,
    /// what precedes the blocks and the first block), the rest trained.
    #[arg(long)]
    freeze_bottom: bool,
    /// Every rank kills itself (SIGKILL) as the training batch after this many is read: a job preempted in the
    /// middle of an epoch (save with --save-every, continue with --resume).
    #[arg(long)]
    kill_after_batches: Option<usize>,
}

/// The training batches, built as the loop reads them; the process kills itself (SIGKILL, nothing flushed) when
/// asked for batch `kill_at` (counted from 0 over the run).
#[derive(Clone)]
struct TrainBatcher {
    kill_at: Option<usize>,
    built: Arc<std::sync::atomic::AtomicUsize>,
    rank: usize,
}

impl Batcher<mlp::Sample, mlp::Batch> for TrainBatcher {
    fn batch(&self, items: Vec<mlp::Sample>, device: &burn::tensor::Device) -> mlp::Batch {
        let n = self
            .built
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.kill_at == Some(n) {
            ranks::kill_self(self.rank, &format!("as training batch {n} is read"));
        }
        SampleBatcher.batch(items, device)
    }
}

/// Trains `start` with burn-train's Learner through `accelerator`; returns what `held_out` says of the trained
/// model on held-out data.
fn train<M>(
    accelerator: Accelerator,
    args: &Args,
    start: M,
    held_out: impl Fn(&Accelerator, &M, mlp::Batch) -> Result<f64>,
) -> Result<f64>
where
    M: LearnerModel
        + Blocks
        + TrainStep<Input = mlp::Batch, Output = RegressionOutput>
        + InferenceStep<Input = mlp::Batch, Output = RegressionOutput>,
{
    let accelerator = Arc::new(accelerator);
    let train = LearnerLoader::train(
        accelerator.prepare_dataloader(
            DataLoaderBuilder::new(TrainBatcher {
                kill_at: args.kill_after_batches,
                built: Arc::default(),
                rank: accelerator.process_index(),
            })
            .batch_size(args.batch_size)
            .shuffle(7)
            .build(mlp::dataset(2048, 4)),
        )?,
    );
    let valid = LearnerLoader::valid(
        accelerator.prepare_dataloader(
            DataLoaderBuilder::new(SampleBatcher)
                .batch_size(256)
                .build(mlp::dataset(512, 5)),
        )?,
    );
    let artifacts = args.artifact_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("burn-accelerate-learner-{}", std::process::id()))
    });
    let training = SupervisedTraining::new(&artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(args.epochs)
        .with_application_logger(None);
    let training = accelerator.prepare_training_with(training, |strategy| {
        let mut strategy = strategy.resume(args.resume);
        if let Some(n) = args.save_every {
            strategy = strategy.save_every(n);
        }
        if let Some(n) = args.max_steps {
            strategy = strategy.max_steps(n);
        }
        strategy
    })?;
    // Prepared before the Learner takes it: under FULL_SHARD each rank's Learner holds its slices, under a
    // pipeline its stage's blocks.
    let model = accelerator.prepare_blocks(start)?;
    let result = training.launch(Learner::new(model, AdamConfig::new().init(), 3e-3));
    if let Some(error) = result.error {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "training failed: {error}"
        )));
    }
    // Held-out loss of the trained model (the same data on every rank).
    let device = accelerator.device().clone().inner();
    let eval = SampleBatcher.batch(mlp::samples(1024, 99), &device);
    held_out(&accelerator, &result.model, eval)
}

/// Trains, and prints the held-out loss of the trained model.
pub fn main() {
    let args = Args::parse();
    let mut builder = Accelerator::builder()
        .mixed_precision(args.mixed_precision)
        .gradient_accumulation_steps(args.gradient_accumulation_steps)
        .split_batches(true);
    if let Some(dir) = &args.project_dir {
        builder = builder.project_configuration(ProjectConfiguration::new(dir));
    }
    if let Some(sharding) = args.sharding {
        builder = builder.sharding(sharding);
    }
    if let Some(ranks) = args.dp_shard_size {
        builder = builder.dp_shard_size(ranks);
    }
    if args.activation_checkpointing {
        builder = builder.activation_checkpointing(true);
    }
    if let Some(schedule) = args.pp_schedule {
        builder = builder.pp_schedule(schedule);
    }
    if let Some(stages) = args.pp_size {
        builder = builder
            .pp_size(stages)
            .pp_microbatches(args.pp_microbatches);
    }
    // The same initial weights for any number of ranks, and for a resumed run.
    let device = ranks::default_device();
    device.seed(11);
    let device = device.autodiff();
    let mut start = Mlp::new(&device);
    let mut deep = DeepMlp::new(&device, 4);
    if args.freeze_bottom {
        start = start.with_input_frozen();
        deep.input = deep.input.no_grad();
        deep.hidden[0] = deep.hidden[0].clone().no_grad();
    }
    let loss = |mlp: &Mlp, eval| Ok(mlp.loss(eval).into_scalar::<f32>() as f64);
    let result = ranks::run_ranks(builder, args.processes, |accelerator| {
        if args.pp_size.is_some() {
            // Under a pipeline each rank holds its stage: the held-out loss through the stages.
            train(accelerator, &args, deep.clone(), |acc, model, eval| {
                let errors =
                    acc.forward_batch(model, eval, DeepMlp::embed, Mlp::hidden, |m, h, b| {
                        let d = m.output.forward(h) - b.y.clone();
                        let n = d.dims()[0];
                        (d.clone() * d).reshape([n])
                    })?;
                Ok(errors.mean().into_scalar::<f32>() as f64)
            })
        } else if args.block_wise {
            let start = BlockWise { mlp: start.clone() };
            train(accelerator, &args, start, |_, m, eval| loss(&m.mlp, eval))
        } else {
            train(accelerator, &args, start.clone(), |_, m, eval| {
                loss(m, eval)
            })
        }
    });
    ranks::exit_on_error(result.map(|loss| {
        if let Some(loss) = loss {
            println!("final_loss={loss:.6}");
        }
    }));
}
