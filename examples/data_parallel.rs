//! Data-parallel training of a classifier, evaluated with `gather_for_metrics`.
//!
//! The global batch is fixed (`--global-batch`, default 64) and divided between the ranks, so every run sees
//! the same data in the same order and ends with the same model, whatever the number of ranks:
//!
//! ```text
//! cargo run --release --example data_parallel -- --processes 1   # one rank, batch 64
//! cargo run --release --example data_parallel -- --processes 2   # two in-process ranks, batch 32 each
//! mpirun -np 2 target/release/examples/data_parallel             # two processes (build with --features mpi)
//! ```
//!
//! Each prints `final_loss=<x>` and `accuracy=<y>` computed over every evaluation sample exactly once.

#[path = "support/classifier.rs"]
mod classifier;
#[path = "support/ranks.rs"]
mod ranks;

use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, Result};
use clap::Parser;
use classifier::Classifier;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under mpirun, where the launcher decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Samples per optimizer step over all ranks.
    #[arg(long, default_value_t = 64)]
    global_batch: usize,
    /// Passes over the training data.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Hidden width of the classifier.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Training samples.
    #[arg(long, default_value_t = 4096)]
    train_samples: usize,
    /// Evaluation samples (not a multiple of the batch, on purpose).
    #[arg(long, default_value_t = 1003)]
    eval_samples: usize,
    /// Make this rank fail with an error at the start of training (to see how a run ends when a rank fails).
    #[arg(long)]
    fail_rank: Option<usize>,
}

fn run(acc: Accelerator, args: &Args, initial: Classifier) -> Result<(f64, f64)> {
    let p = acc.num_processes();
    if !args.global_batch.is_multiple_of(p) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--global-batch {} is not divisible by {p} ranks",
            args.global_batch
        )));
    }
    if args.fail_rank == Some(acc.process_index()) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "rank {} fails on purpose (--fail-rank)",
            acc.process_index()
        )));
    }
    // prepare_model gives every rank rank 0's weights.
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let (train, eval) = classifier::prepared_loaders(
        &acc,
        args.global_batch / p,
        args.train_samples,
        args.eval_samples,
    )?;
    let (initial, _) = classifier::evaluate(&acc, &model, &eval)?;
    acc.print(format!(
        "processes={p} per_rank_batch={} initial_loss={initial:.5}",
        args.global_batch / p
    ));
    for _ in 0..args.epochs {
        for batch in train.iter() {
            let batch = batch?;
            let loss = model.losses(&batch).mean();
            acc.backward(loss, &model)?;
            model = optimizer.step(model);
        }
    }
    // Every rank, not only the one that prints, ends with the same model.
    ranks::check_ranks_agree(&acc, &model)?;
    classifier::evaluate(&acc, &model, &eval)
}

pub fn main() {
    if let Err(error) = run_example() {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run_example() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    #[cfg(feature = "mpi")]
    let under_mpi = burn_accelerate::distributed::cluster::launched_by_mpi();
    #[cfg(not(feature = "mpi"))]
    let under_mpi = false;
    // The same initial weights for every run. (In-process ranks share the device's random generator, so the
    // model is drawn once here rather than by each rank.)
    let initial = classifier::initial_model(args.hidden, 17)?;
    let results = if under_mpi || args.processes <= 1 {
        vec![run(Accelerator::new()?, &args, initial)?]
    } else {
        burn_accelerate::launch(args.processes, |acc| run(acc, &args, initial.clone()))?
    };
    let is_main = !under_mpi || Accelerator::new()?.is_main_process();
    if is_main {
        let (loss, accuracy) = results[0];
        println!("final_loss={loss:.5}");
        println!("accuracy={accuracy:.4}");
    }
    Ok(())
}
