//! More than one model, and parameters that come and go (`examples/support/scenarios.rs`), on in-process ranks
//! or as one rank of an MPI job: two models trained in alternation with accumulation (`two-models`), a head frozen
//! at `prepare_model` and unfrozen later beside a frozen teacher (`unfreeze`), data-dependent routing that leaves
//! ranks without some gradients or any (`routing`), and rank 1 failing with an error of its own (`rank-error`).
//! Each rank writes the weights it ends with to `<out>/rank<r>.json`, so that `tests/mpi/parity_mpi.rs` compares an
//! MPI job with in-process ranks and with the loop a Burn user writes by hand.
//!
//! ```text
//! cargo run --release --example many_models -- --scenario two-models --processes 2 --sharding FULL_SHARD
//! mpirun -np 3 target/release/examples/many_models --scenario routing   # built with --features mpi
//! ```

#[path = "support/ranks.rs"]
mod ranks;
#[path = "support/scenarios.rs"]
mod scenarios;

use std::path::PathBuf;

use burn_accelerate::{Accelerator, Result, ShardingStrategy};
use clap::Parser;
use scenarios::Scenario;

#[derive(Parser, Debug)]
struct Args {
    /// `two-models`, `unfreeze`, `routing` or `rank-error`.
    #[arg(long)]
    scenario: String,
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// The sharding strategy (`NO_SHARD` by default).
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// Ranks per shard group of a hybrid `--sharding`.
    #[arg(long)]
    dp_shard_size: Option<usize>,
    /// Run each pass block by block (`backward_blocks`); with `NO_SHARD`, with activation checkpointing.
    #[arg(long)]
    blocks: bool,
    /// Folder each rank writes its weights into (`rank<r>.json`).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let scenario = Scenario::named(&args.scenario).ok_or_else(|| {
        burn_accelerate::Error::InvalidArgument(format!(
            "--scenario {}: one of {}",
            args.scenario,
            Scenario::ALL.map(|(_, n)| n).join(", ")
        ))
    })?;
    let sharding = args.sharding.unwrap_or_default();
    let mut builder = Accelerator::builder()
        .sharding(sharding)
        .gradient_accumulation_steps(scenario.accumulation())
        .activation_checkpointing(args.blocks && !sharding.is_sharded());
    if let Some(size) = args.dp_shard_size {
        builder = builder.dp_shard_size(size);
    }
    // The same initial weights on every rank and run (in-process ranks share the device's generator, so the models
    // are drawn once here).
    let start = scenarios::initial();
    let out = args.out.clone();
    let main = ranks::run_ranks(builder, args.processes, |acc| {
        let weights = scenario.train(&acc, &start, args.blocks)?;
        if let Some(out) = &out {
            std::fs::create_dir_all(out).map_err(burn_accelerate::Error::other)?;
            let json = serde_json::to_string(&weights).map_err(burn_accelerate::Error::other)?;
            std::fs::write(out.join(format!("rank{}.json", acc.process_index())), json)
                .map_err(burn_accelerate::Error::other)?;
        }
        Ok(weights.len())
    })?;
    if let Some(models) = main {
        println!("scenario={} models={models}", args.scenario);
    }
    Ok(())
}
