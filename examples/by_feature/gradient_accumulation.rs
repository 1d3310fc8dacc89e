//! Gradient accumulation: Accelerate's `by_feature/gradient_accumulation.py`, in Burn.
//!
//! With `gradient_accumulation_steps(k)`, `accumulate()` marks each micro-batch; `backward` only adds up
//! gradients (no communication between ranks) until the k-th micro-batch, where they are averaged over the k
//! micro-batches and the ranks, and the optimizer steps. The window also closes on the dataloader's last batch.
//! `--accumulation 4 --micro-batch 16` therefore trains the same model as `--accumulation 1 --micro-batch 64`.
//!
//! ```text
//! cargo run --release --example gradient_accumulation -- --accumulation 4 --micro-batch 16
//! cargo run --release --example gradient_accumulation -- --accumulation 1 --micro-batch 64
//! cargo run --release --example gradient_accumulation -- --accumulation 2 --micro-batch 16 --processes 2
//! ```
//!
//! Prints `optimizer_steps=<n>`, `final_loss=<x>` and `accuracy=<y>`.

#[path = "../support/classifier.rs"]
mod classifier;
#[path = "../support/ranks.rs"]
mod ranks;

use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, Result};
use clap::Parser;
use classifier::Classifier;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    accumulation: usize,
    /// Samples per micro-batch and rank.
    #[arg(long, default_value_t = 16)]
    micro_batch: usize,
    /// Passes over the training data.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
}

fn train(acc: Accelerator, args: &Args, initial: Classifier) -> Result<(usize, f64, f64)> {
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let (train, eval) = classifier::prepared_loaders(&acc, args.micro_batch, 4096, 1003)?;
    let mut steps = 0;
    for _ in 0..args.epochs {
        for batch in train.iter() {
            // Accelerate's `with accelerator.accumulate(model):`.
            acc.accumulate();
            let loss = model.losses(&batch?).mean();
            acc.backward(loss, &model)?;
            // The optimizer only steps when the window closes; otherwise this is a no-op.
            model = optimizer.step(model);
            if acc.sync_gradients() {
                steps += 1;
            }
        }
    }
    let (loss, accuracy) = classifier::evaluate(&acc, &model, &eval)?;
    Ok((steps, loss, accuracy))
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let initial = classifier::initial_model(64, 17)?;
    let builder = Accelerator::builder().gradient_accumulation_steps(args.accumulation);
    if let Some((steps, loss, accuracy)) = ranks::run_ranks(builder, args.processes, |acc| {
        train(acc, &args, initial.clone())
    })? {
        println!("optimizer_steps={steps}");
        println!("final_loss={loss:.5}");
        println!("accuracy={accuracy:.4}");
    }
    Ok(())
}
