//! burn-train's `Learner` training the byte-level transformer of `transformer_lm` through the Accelerator, with
//! validation every epoch, in every mode: `NO_SHARD`, `FULL_SHARD` block by block (the default `TrainStep`:
//! `learner::backward_batch`, one layer gathered at a time, validation through `learner::forward_batch` too) or
//! whole (`--whole`: `learner::unshard` for each step), activation checkpointing, pipelines (`--pp-size`).
//!
//! ```text
//! cargo run --release --features train --example transformer_learner -- --processes 2 --sharding FULL_SHARD
//! mpirun -np 4 target/release/examples/transformer_learner --sharding FULL_SHARD --layers 12 --d-model 512
//! ```
//!
//! Every rank prints what it held: `rank r/P mode=... params_at_rest=B peak_rss=B` (`params_at_rest`: the
//! Learner's parameters between steps; `peak_rss`: the peak of the process's resident memory over the Learner's
//! training and validation: each rank keeps its part of the trained model, `return_slices`), with `--state <dir>`
//! also the bytes of its saved model and optimizer state; the main process prints `final_loss=<x>`, the loss of
//! the validation split through the trained model (through the stages under a pipeline, block by block under
//! `FULL_SHARD`).

#[path = "support/byte_lm.rs"]
mod byte_lm;
#[path = "support/held.rs"]
mod held;
#[path = "support/ranks.rs"]
mod ranks;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::learner::burn_train::metric::LossMetric;
use burn_accelerate::learner::burn_train::{
    ClassificationOutput, InferenceStep, Learner, LearnerModel, SupervisedTraining, TrainOutput,
    TrainStep,
};
use burn_accelerate::learner::{self, LearnerLoader};
use burn_accelerate::tensor_parallel::ParallelTransformerLayer as TransformerEncoderLayer;
use burn_accelerate::{Accelerator, Blocks, Result, ShardingStrategy};
use byte_lm::ByteLm;
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, ... (default: the configuration's).
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// Ranks per shard group of a hybrid strategy.
    #[arg(long = "dp-shard-size")]
    dp_shard_size: Option<usize>,
    /// Gather the whole model for each step (`learner::unshard`) instead of one layer at a time.
    #[arg(long)]
    whole: bool,
    /// Pipeline stages (the layers cut into this many stages).
    #[arg(long = "pp-size")]
    pp_size: Option<usize>,
    /// Activation checkpointing: recompute each layer in the backward pass.
    #[arg(long)]
    checkpointing: bool,
    /// Transformer layers (the blocks).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Bytes per sequence.
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// Sequences per batch over all ranks (split between the data-parallel ranks).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Training sequences per epoch.
    #[arg(long, default_value_t = 64)]
    train_sequences: usize,
    /// Validation sequences.
    #[arg(long, default_value_t = 16)]
    valid_sequences: usize,
    /// Epochs.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Save the run at its last step into this project folder (`save_every`, each rank its part) and print the
    /// bytes each rank's saved model and optimizer state take: what it held between steps. (The save takes
    /// memory of its own: measure the peak in a run without it.)
    #[arg(long)]
    state: Option<std::path::PathBuf>,
}

/// A batch of sequences: the inputs and their next-byte targets, `[sequences, seq]` each.
#[derive(Debug, Clone)]
struct LmBatch {
    inputs: Tensor<2, Int>,
    targets: Tensor<2, Int>,
}
burn_accelerate::impl_to_device!(LmBatch { inputs, targets });

impl burn_accelerate::Split for LmBatch {
    fn micro_batches(self, parts: usize) -> Result<Vec<Self>> {
        let parts = (self.inputs, self.targets).micro_batches(parts)?;
        Ok(parts
            .into_iter()
            .map(|(inputs, targets)| LmBatch { inputs, targets })
            .collect())
    }

    fn samples(&self) -> Option<usize> {
        Some(self.inputs.dims()[0])
    }
}

/// Builds a batch of the corpus's sequences from their indices.
#[derive(Debug, Clone)]
struct SequenceBatcher {
    seq: usize,
}

impl Batcher<usize, LmBatch> for SequenceBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> LmBatch {
        let (inputs, targets) = byte_lm::sequences(&items, self.seq, device);
        LmBatch { inputs, targets }
    }
}

/// One layer on `x`, with the causal mask of its sequences.
fn layer(layer: &TransformerEncoderLayer, x: Tensor<3>) -> Tensor<3> {
    let [sequences, seq, _] = x.dims();
    let mask = generate_autoregressive_mask(sequences, seq, &x.device());
    layer.forward(x, None, Some(mask))
}

/// The step's item: the next byte's logits after the last layer's activation `x`, and their cross-entropy.
fn item(model: &ByteLm, x: Tensor<3>, batch: &LmBatch) -> ClassificationOutput {
    let logits = model.logits(x);
    let n = logits.dims()[0];
    let targets = batch.targets.clone().reshape([n]);
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.clone(), targets.clone());
    ClassificationOutput {
        loss,
        output: logits,
        targets,
    }
}

/// The Learner's parameters between steps (read by the first step).
static AT_REST: AtomicU64 = AtomicU64::new(0);

fn note_at_rest<M: Module>(model: &M) {
    let _ = AT_REST.compare_exchange(
        0,
        held::param_bytes(model) as u64,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
}

/// A Learner model holding the transformer.
trait HasLm {
    fn lm(&self) -> &ByteLm;
}

impl HasLm for Layered {
    fn lm(&self) -> &ByteLm {
        &self.lm
    }
}

impl HasLm for Whole {
    fn lm(&self) -> &ByteLm {
        &self.lm
    }
}

/// The model stepped layer by layer, training (`learner::backward_batch`) and validation
/// (`learner::forward_batch`): under `FULL_SHARD` one layer gathered at a time, under a pipeline through the
/// stages.
#[derive(Module, Debug)]
struct Layered {
    lm: ByteLm,
}

impl Blocks for Layered {
    type Block = TransformerEncoderLayer;
    fn blocks(&self) -> &[TransformerEncoderLayer] {
        self.lm.blocks()
    }
}

impl TrainStep for Layered {
    type Input = LmBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: LmBatch) -> TrainOutput<ClassificationOutput> {
        note_at_rest(self);
        learner::backward_batch(
            self,
            batch,
            |m, b| m.lm.embed(b.inputs.clone()),
            layer,
            |m, x, b| item(&m.lm, x, b),
            |out| out.loss.clone(),
        )
    }
}

impl InferenceStep for Layered {
    type Input = LmBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: LmBatch) -> ClassificationOutput {
        learner::forward_batch(
            self,
            batch,
            |m, b| m.lm.embed(b.inputs.clone()),
            layer,
            |m, x, b| item(&m.lm, x, b),
        )
    }
}

/// The model gathered whole for each step and each validation batch (`learner::unshard`).
#[derive(Module, Debug)]
struct Whole {
    lm: ByteLm,
}

impl Blocks for Whole {
    type Block = TransformerEncoderLayer;
    fn blocks(&self) -> &[TransformerEncoderLayer] {
        self.lm.blocks()
    }
}

impl Whole {
    fn item(&self, batch: &LmBatch) -> ClassificationOutput {
        let x = self.lm.embed(batch.inputs.clone());
        let x = self.lm.layers.iter().fold(x, |x, l| layer(l, x));
        item(&self.lm, x, batch)
    }
}

impl TrainStep for Whole {
    type Input = LmBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: LmBatch) -> TrainOutput<ClassificationOutput> {
        note_at_rest(self);
        let model = learner::unshard(self);
        let out = model.item(&batch);
        TrainOutput::new(&model, learner::backward(out.loss.clone()), out)
    }
}

impl InferenceStep for Whole {
    type Input = LmBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: LmBatch) -> ClassificationOutput {
        learner::unshard(self).item(&batch)
    }
}

/// Trains `start` with burn-train's Learner; returns the last validation's mean loss.
fn train<M>(acc: Accelerator, args: &Args, start: M) -> Result<f64>
where
    M: LearnerModel
        + Blocks<Block = TransformerEncoderLayer>
        + HasLm
        + TrainStep<Input = LmBatch, Output = ClassificationOutput>
        + InferenceStep<Input = LmBatch, Output = ClassificationOutput>,
{
    let acc = Arc::new(acc);
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let loader = |sequences: std::ops::Range<usize>| {
        acc.prepare_dataloader(
            DataLoaderBuilder::new(SequenceBatcher { seq: args.seq })
                .batch_size(args.batch)
                .build(InMemDataset::new(sequences.collect::<Vec<_>>())),
        )
    };
    let valid_start = args.train_sequences;
    let train = LearnerLoader::train(loader(0..args.train_sequences)?);
    let valid = LearnerLoader::valid(loader(valid_start..valid_start + args.valid_sequences)?);
    let artifacts = std::env::temp_dir().join(format!(
        "burn-accelerate-transformer-learner-{}-{rank}",
        std::process::id()
    ));
    let training = SupervisedTraining::new(&artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(args.epochs)
        .with_application_logger(None);
    // Each rank keeps its part of the trained model: under FULL_SHARD no rank ever holds it whole.
    let steps = args.epochs * args.train_sequences.div_ceil(args.batch);
    let training = acc.prepare_training_with(training, |s| match &args.state {
        Some(_) => s.return_slices(true).save_every(steps),
        None => s.return_slices(true),
    })?;
    let model = acc.prepare_blocks(start)?;
    let result = training.launch(Learner::new(model, AdamConfig::new().init(), args.lr));
    let _ = std::fs::remove_dir_all(&artifacts);
    if let Some(error) = result.error {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "training failed: {error}"
        )));
    }
    let sharding = acc.config().distributed.sharding;
    let how = match (sharding.reshards_parameters(), args.whole) {
        (false, _) => "",
        (true, true) => "_(whole)",
        (true, false) => "_(block-wise)",
    };
    let checkpointing = if args.checkpointing {
        "_+_checkpointing"
    } else {
        ""
    };
    let stages = args.pp_size.map_or(String::new(), |p| format!("_pp{p}"));
    let saved = match &args.state {
        Some(dir) => saved_bytes(dir, rank)?,
        None => String::new(),
    };
    println!(
        "rank {rank}/{ranks} mode=learner_{sharding}{how}{checkpointing}{stages} params_at_rest={} \
         peak_rss={}{saved}",
        AT_REST.load(Ordering::Relaxed),
        held::peak("VmHWM:")
    );
    // The last validation's loss, through the model as each rank holds it.
    let device = acc.device().clone().inner();
    let indices: Vec<usize> = (valid_start..valid_start + args.valid_sequences).collect();
    let (inputs, targets) = byte_lm::sequences(&indices, args.seq, &device);
    // One mean loss per (micro-)batch, of equal sizes: their mean is the split's.
    let losses = acc.forward_batch(
        &result.model,
        LmBatch { inputs, targets },
        |m: &M, b: &LmBatch| m.lm().embed(b.inputs.clone()),
        layer,
        |m, x, b| item(m.lm(), x, b).loss.reshape([1]),
    )?;
    Ok(losses.mean().into_scalar::<f32>() as f64)
}

/// ` saved_model=B saved_optimizer=B`: the bytes of rank `rank`'s model and optimizer state in the latest
/// checkpoint of the project folder `dir` (its own files where each rank saved its part, else the whole run's).
fn saved_bytes(dir: &std::path::Path, rank: usize) -> Result<String> {
    let (_, latest) = burn_accelerate::ProjectConfiguration::new(dir)
        .checkpoints()
        .into_iter()
        .last()
        .ok_or_else(|| burn_accelerate::Error::InvalidArgument("no checkpoint was saved".into()))?;
    let size = |kind: &str| {
        [format!("{kind}_rank{rank}.bpk"), format!("{kind}.bpk")]
            .iter()
            .find_map(|name| std::fs::metadata(latest.join(name)).ok())
            .map_or(0, |m| m.len())
    };
    Ok(format!(
        " saved_model={} saved_optimizer={}",
        size("model"),
        size("optimizer")
    ))
}

fn main() {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    // The main process draws the initial weights (at `prepare_model`) from this seed.
    ranks::default_device().seed(42);
    // The global batch is split between the ranks: every number of ranks trains the same model.
    let mut builder = Accelerator::builder()
        .activation_checkpointing(args.checkpointing)
        .split_batches(true);
    if let Some(sharding) = args.sharding {
        builder = builder.sharding(sharding);
    }
    if let Some(size) = args.dp_shard_size {
        builder = builder.dp_shard_size(size);
    }
    if let Some(stages) = args.pp_size {
        builder = builder.pp_size(stages);
    }
    if let Some(dir) = &args.state {
        builder = builder.project_configuration(burn_accelerate::ProjectConfiguration::new(dir));
    }
    let device = ranks::default_device().autodiff();
    let lm = ByteLm::new(args.layers, args.d_model, args.heads, args.seq, &device);
    let result = ranks::run_ranks(builder, args.processes, |acc| match args.whole {
        true => train(acc, &args, Whole { lm: lm.clone() }),
        false => train(acc, &args, Layered { lm: lm.clone() }),
    });
    ranks::exit_on_error(result.map(|loss| {
        if let Some(loss) = loss {
            println!("final_loss={loss:.6}");
        }
    }));
}
