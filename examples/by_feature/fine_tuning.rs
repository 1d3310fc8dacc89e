//! Fine-tuning the top of a model whose largest tensor lies outside its blocks: a tower of an input projection
//! (`--input` × `--width`: an embedding's share of the parameters), `--blocks` feed-forward blocks (`--width` →
//! `--hidden` → `--width`) and a head, trained with its bottom frozen (`--freeze-bottom K`: the input projection
//! and the first K blocks, `Module::no_grad`, the usual fine-tuning recipe) or whole. The same loop runs in every
//! mode: one process, `FULL_SHARD` block by block (the input projection and the head gathered only while they run,
//! as FSDP2 shards them as units of their own), with activation checkpointing, or through pipeline stages.
//!
//! ```text
//! let loss = accelerator.backward_batch(
//!     &model,
//!     (x, y),
//!     |m, (x, _)| m.input.forward(x.clone()).tanh(),   // before the blocks
//!     |block, h| block.forward(h),                       // one block
//!     |m, h, (_, y)| mse(m.head.forward(h), y),          // after them: the head and the loss
//! )?;
//! model = optimizer.try_step(model)?;
//! ```
//!
//! ```text
//! cargo run --release --example fine_tuning -- --freeze-bottom 4
//! cargo run --release --example fine_tuning -- --processes 2 --sharding FULL_SHARD --freeze-bottom 4
//! mpirun -np 4 target/release/examples/fine_tuning --sharding FULL_SHARD \
//!     --input 32768 --width 1024 --hidden 4096 --blocks 8      # 101 M parameters; built with --features mpi
//! ```
//!
//! Every rank prints what it held, measured: `rank r/P sharding=... params_at_rest=B grads=B optimizer_state=B
//! peak_rss=B`; the main process prints `final_loss=<x>` and `weights_digest=<x>` (a digest of the final weights'
//! bits, each part from a rank that trains it).

#[path = "../support/held.rs"]
mod held;
#[path = "../support/ranks.rs"]
mod ranks;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};
use burn_accelerate::{Accelerator, Blocks, ReduceOp, Result, ShardingStrategy};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, ... (the config file's or the environment's when absent).
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// Inputs of the input projection.
    #[arg(long, default_value_t = 512)]
    input: usize,
    /// Width of the blocks.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Hidden width of each block's feed-forward network.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Blocks.
    #[arg(long, default_value_t = 4)]
    blocks: usize,
    /// Outputs of the head.
    #[arg(long, default_value_t = 8)]
    outputs: usize,
    /// The input projection and the first K blocks frozen.
    #[arg(long = "freeze-bottom")]
    freeze_bottom: Option<usize>,
    /// Activation checkpointing: each block recomputed in the backward pass.
    #[arg(long)]
    checkpointing: bool,
    /// Pipeline stages: the blocks cut into this many stages, one per group of ranks.
    #[arg(long = "pp-size")]
    pp_size: Option<usize>,
    /// Micro-batches per batch under `--pp-size`.
    #[arg(long = "pp-microbatches")]
    pp_microbatches: Option<usize>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Samples per step over all data-parallel replicas (divided between them).
    #[arg(long, default_value_t = 8)]
    batch: usize,
}

/// One block: a feed-forward network with tanh, `width` → `hidden` → `width`.
#[derive(Module, Debug)]
struct Ffn {
    up: Linear,
    down: Linear,
}

impl Ffn {
    fn forward(&self, h: Tensor<2>) -> Tensor<2> {
        self.down.forward(self.up.forward(h).tanh()).tanh()
    }
}

/// An input projection, blocks and a head.
#[derive(Module, Debug)]
struct Tower {
    input: Linear,
    blocks: Vec<Ffn>,
    head: Linear,
}

impl Blocks for Tower {
    type Block = Ffn;
    fn blocks(&self) -> &[Ffn] {
        &self.blocks
    }
}

impl Tower {
    /// The tower, drawn lazily (nothing is drawn before `prepare_blocks`), its bottom frozen as asked.
    fn new(args: &Args, device: &Device) -> Self {
        let linear = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
        let mut tower = Self {
            input: linear(args.input, args.width),
            blocks: (0..args.blocks)
                .map(|_| Ffn {
                    up: linear(args.width, args.hidden),
                    down: linear(args.hidden, args.width),
                })
                .collect(),
            head: linear(args.width, args.outputs),
        };
        if let Some(k) = args.freeze_bottom {
            tower.input = tower.input.no_grad();
            for block in tower.blocks.iter_mut().take(k) {
                *block = block.clone().no_grad();
            }
        }
        tower
    }
}

/// Samples `first..first + rows` of the synthetic set: inputs of `input` features and targets of `outputs`.
fn batch(args: &Args, (first, rows): (usize, usize), device: &Device) -> (Tensor<2>, Tensor<2>) {
    let value = |i: usize, k: usize, salt: f32| ((i * 31 + k) as f32 * 0.013 + salt).sin();
    let x: Vec<f32> = (0..rows * args.input)
        .map(|k| value(first + k / args.input, k % args.input, 0.3))
        .collect();
    let y: Vec<f32> = (0..rows * args.outputs)
        .map(|k| 0.5 * value(first + k / args.outputs, k % args.outputs, 1.7))
        .collect();
    (
        Tensor::<1>::from_floats(x.as_slice(), device).reshape([rows, args.input]),
        Tensor::<1>::from_floats(y.as_slice(), device).reshape([rows, args.outputs]),
    )
}

fn train(acc: Accelerator, args: &Args) -> Result<f32> {
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let layout = acc.pipeline_layout();
    if !args.batch.is_multiple_of(layout.replicas) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--batch {} is not divisible by {} data-parallel replicas",
            args.batch, layout.replicas
        )));
    }
    let device = acc.device().clone();
    let mut model = acc.prepare_blocks(Tower::new(args, &device))?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
    let rows = args.batch / layout.replicas;
    let (mut loss, mut grads) = (0.0, 0);
    for step in 0..args.steps {
        let data = batch(
            args,
            (step * args.batch + layout.replica * rows, rows),
            &device,
        );
        let value = acc.backward_batch(
            &model,
            data,
            |m, (x, _)| m.input.forward(x.clone()).tanh(),
            |block, h| block.forward(h),
            |m, h, (_, y)| (m.head.forward(h) - y.clone()).powi_scalar(2).mean(),
        )?;
        grads = held::grad_bytes(&acc, &model);
        model = optimizer.try_step(model)?;
        loss = acc.reduce(value, ReduceOp::Mean)?.into_scalar::<f32>();
    }
    let peak = held::peak("VmHWM:");
    println!(
        "rank {rank}/{ranks} sharding={} params_at_rest={} grads={grads} optimizer_state={} peak_rss={peak}",
        acc.config().distributed.sharding,
        held::param_bytes(&model),
        optimizer.state_bytes()?,
    );
    // The final weights' digest: the input projection from the first stage, each block from its own, the head
    // from the last.
    let whole = acc.unshard(&model)?;
    let mut parts = vec![
        layout
            .is_first_stage()
            .then(|| held::digest(&whole.input))
            .flatten(),
    ];
    parts.extend(whole.blocks.iter().map(held::digest));
    parts.push(
        layout
            .is_last_stage()
            .then(|| held::digest(&whole.head))
            .flatten(),
    );
    drop(whole);
    if let Some(digest) = held::weights_digest(&acc, parts)? {
        println!("weights_digest={digest}");
    }
    Ok(loss)
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    // The main process draws the initial weights (at `prepare_blocks`) from this seed.
    ranks::default_device().seed(7);
    let mut builder = Accelerator::builder().activation_checkpointing(args.checkpointing);
    if let Some(sharding) = args.sharding {
        builder = builder.sharding(sharding);
    }
    if let Some(stages) = args.pp_size {
        builder = builder.pp_size(stages);
    }
    if let Some(micro_batches) = args.pp_microbatches {
        builder = builder.pp_microbatches(micro_batches);
    }
    if let Some(loss) = ranks::run_ranks(builder, args.processes, |acc| train(acc, &args))? {
        println!("final_loss={loss:.6}");
    }
    Ok(())
}
