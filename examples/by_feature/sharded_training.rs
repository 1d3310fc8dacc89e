//! Sharded training: Accelerate's FSDP (`SHARD_GRAD_OP`, `FULL_SHARD`), in Burn.
//!
//! With sharding each rank keeps the optimizer state and the reduced gradients of its own dim-0 slice of every
//! parameter only (FSDP2's even slices, the last padded); under `FULL_SHARD` it keeps only its slices of the
//! parameters between steps too, and `accelerator.unshard(&model)` gathers them for the forward and backward
//! pass. The loop is the same in every mode, so the same program trains unsharded, sharded, on one rank or many:
//!
//! ```text
//! let whole = accelerator.unshard(&model)?;          // a cheap clone unless FULL_SHARD
//! accelerator.backward(loss_of(&whole), &whole)?;    // gradients reduce-scattered: this rank keeps its slices
//! model = optimizer.try_step(model)?;                // steps this rank's slices, then gathers or keeps them
//! ```
//!
//! ```text
//! cargo run --release --example sharded_training -- --processes 2 --sharding SHARD_GRAD_OP
//! cargo run --release --example sharded_training -- --processes 2 --sharding FULL_SHARD
//! burn-accelerate launch --num-processes 2 --use_fsdp --fsdp_sharding_strategy 2 \
//!     target/release/examples/sharded_training                 # built with --features mpi
//! ```
//!
//! The model is a stack of `--layers` square linear layers of `--width` (`--layers 24 --width 2048` is 100.7 M
//! parameters). Every rank prints what it holds at the end, measured: `rank r/P sharding=... params_at_rest=B
//! grads=B optimizer_state=B peak_rss=B` (gradients as held after the last synchronising backward, optimizer
//! state tensors as a checkpoint saves them, peak RSS of the process from `/proc/self/status`, and `prepare_peak`:
//! what `prepare_model` added to the resident memory at its peak, meaningful with one rank per process, under a
//! launcher); `--input` widens the first layer (an embedding's share of the parameters). The main process prints
//! `final_loss=<x>`, the same with and without sharding, and `weights_digest=<x>`, a digest of the final weights' bits
//! (equal where two runs end with the same weights, bit for bit). `--bf16` runs the block-wise pass (`--blocks`) in bf16
//! (mixed precision, each layer under `autocast`), and `--param-dtype bf16` gathers the layers in bf16 (FSDP2's
//! `param_dtype`) instead of casting them after an f32 gather: the same loss.

#[path = "../support/held.rs"]
mod held;
#[path = "../support/ranks.rs"]
mod ranks;
#[path = "../support/stack.rs"]
mod stack;

use burn::optim::AdamConfig;
use burn_accelerate::{
    Accelerator, MixedPrecision, ReduceOp, Result, ShardDtype, ShardingStrategy,
};
use clap::Parser;
use stack::Stack;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// NO_SHARD, SHARD_GRAD_OP or FULL_SHARD (or Accelerate's 3, 2, 1); the config file's or the environment's
    /// setting when absent.
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// Square linear layers in the stack.
    #[arg(long, default_value_t = 6)]
    layers: usize,
    /// Width of every layer.
    #[arg(long, default_value_t = 48)]
    width: usize,
    /// Inputs of the first layer (default: the width); a larger input layer holds a larger share of the
    /// parameters, as an embedding does.
    #[arg(long)]
    input: Option<usize>,
    /// Each layer a block of a block-wise pass (`backward_blocks`: under `FULL_SHARD` one layer gathered at a
    /// time, the next prefetched, each layer's gradients reduce-scattered while the next one computes); tanh
    /// follows every layer, the last included.
    #[arg(long)]
    blocks: bool,
    /// The block-wise pass in bf16: mixed precision bf16, each layer computed under `autocast` (with `--blocks`).
    #[arg(long)]
    bf16: bool,
    /// The dtype the block-wise pass gathers each layer in (FSDP2's `param_dtype`: fp32, bf16, fp16; a half dtype
    /// with the same mixed precision, e.g. `--bf16`).
    #[arg(long)]
    param_dtype: Option<ShardDtype>,
    /// Pipeline stages (with `--blocks`): the layers cut into this many stages, one per group of ranks, the batch
    /// run through them as micro-batches (`backward_batch`).
    #[arg(long = "pp-size")]
    pp_size: Option<usize>,
    /// Micro-batches per batch under `--pp-size`.
    #[arg(long = "pp-microbatches")]
    pp_microbatches: Option<usize>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Samples per step over all ranks (divided between them).
    #[arg(long, default_value_t = 24)]
    batch: usize,
}

fn train(acc: Accelerator, args: &Args, initial: Stack) -> Result<f32> {
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    // Under a pipeline, the ranks of one stage are the replicas that read different data.
    let layout = acc.pipeline_layout();
    if !args.batch.is_multiple_of(layout.replicas) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--batch {} is not divisible by {} data-parallel replicas",
            args.batch, layout.replicas
        )));
    }
    if layout.stages > 1 && !args.blocks {
        return Err(burn_accelerate::Error::InvalidArgument(
            "--pp-size cuts the layers into stages: add --blocks".into(),
        ));
    }
    let device = acc.device().clone();
    // What `prepare_model` adds to the resident memory at its peak (one rank per process: under a launcher).
    held::reset_peak();
    let before_prepare = held::peak("VmRSS:");
    let mut model = acc.prepare_blocks(initial)?;
    let arrival = held::peak("VmHWM:").saturating_sub(before_prepare);
    let input = args.input.unwrap_or(args.width);
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
    let (mut last_loss, mut grads) = (None, 0);
    // What the steps pass through host memory (0 where in-process ranks share a device).
    let before = acc.host_values();
    for step in 0..args.steps {
        let rows = args.batch / layout.replicas;
        let samples = (step * args.batch + layout.replica * rows, rows);
        let (x, _) = stack::batch(input, samples, &device);
        let (_, y) = stack::batch(args.width, samples, &device);
        if args.blocks {
            // The same call in every mode: block by block, and through the stages under --pp-size.
            let loss = acc.backward_batch(
                &model,
                (x, y),
                |_, (x, _)| x.clone(),
                |layer, h| acc.autocast(layer, h, |l, h| l.forward(h).tanh()),
                |_, h, (_, y)| (h - y.clone()).powi_scalar(2).mean(),
            )?;
            last_loss = Some(loss);
        } else {
            let whole = acc.unshard(&model)?;
            let loss = (whole.forward(x) - y).powi_scalar(2).mean();
            last_loss = Some(loss.clone().detach());
            acc.backward(loss, &whole)?;
        }
        grads = held::grad_bytes(&acc, &model);
        model = optimizer.try_step(model)?;
    }
    let host_values = acc.host_values() - before;
    // The final weights' digest, bit for bit: each layer from a rank that trains it (gathered under FULL_SHARD).
    let whole = acc.unshard(&model)?;
    let parts = burn_accelerate::Blocks::blocks(&whole)
        .iter()
        .map(held::digest)
        .collect();
    drop(whole);
    if let Some(digest) = held::weights_digest(&acc, parts)? {
        println!("weights_digest={digest}");
    }
    let loss_value = match last_loss {
        Some(loss) => acc.reduce(loss, ReduceOp::Mean)?.into_scalar::<f32>(),
        None => 0.0,
    };
    // Measured before anything below copies the state.
    let peak = held::peak("VmHWM:");
    let at_rest = held::param_bytes(&model);
    let state = optimizer.state_bytes()?;
    println!(
        "rank {rank}/{ranks} sharding={} params_at_rest={at_rest} grads={grads} optimizer_state={state} peak_rss={peak} \
         prepare_peak={arrival} host_values={host_values} strategy=\"{}\"",
        acc.config().distributed.sharding,
        acc.strategy_name()
    );
    Ok(loss_value)
}

pub fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let device = ranks::default_device();
    device.seed(11);
    // Each rank builds its own model (its parameters lazy: nothing is drawn until `prepare_model`). A clone of one
    // model kept here would share the values the main process draws, and hold the whole model.
    let initial = || {
        Stack::with_input(
            args.layers,
            args.input.unwrap_or(args.width),
            args.width,
            &device,
        )
    };
    let mut builder = match args.sharding {
        Some(sharding) => Accelerator::builder().sharding(sharding),
        None => Accelerator::builder(),
    };
    if args.bf16 {
        builder = builder.mixed_precision(MixedPrecision::Bf16);
    }
    if let Some(dtype) = args.param_dtype {
        builder = builder.fsdp_param_dtype(dtype);
    }
    if let Some(stages) = args.pp_size {
        builder = builder.pp_size(stages);
    }
    if let Some(micro_batches) = args.pp_microbatches {
        builder = builder.pp_microbatches(micro_batches);
    }
    if let Some(loss) =
        ranks::run_ranks(builder, args.processes, |acc| train(acc, &args, initial()))?
    {
        println!("final_loss={loss:.6}");
    }
    Ok(())
}
