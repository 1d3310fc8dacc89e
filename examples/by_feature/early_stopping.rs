//! Early stopping across ranks with triggers: Accelerate's `by_feature/early_stopping.py`, in Burn.
//!
//! Any rank that meets the stopping condition raises its trigger (`set_trigger`); after every step all ranks
//! call `check_trigger`, which is true on every rank as soon as one raised it, so they all leave the loop at
//! the same step and none waits forever in the next collective. Here the condition is a training-batch loss
//! below `--threshold`.
//!
//! ```text
//! cargo run --release --example early_stopping
//! cargo run --release --example early_stopping -- --processes 2
//! ```
//!
//! Prints `stopped_at_step=<n>` (or `stopped_at_step=none`), `ranks_stopped_at=[...]` (the step each rank left
//! at: all equal), `final_loss=<x>` and `accuracy=<y>`.

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
    /// Stop once a rank sees a training-batch loss below this.
    #[arg(long, default_value_t = 0.45)]
    threshold: f64,
    /// Samples per batch and rank.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The most passes over the training data.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
}

struct Outcome {
    stopped_at: Option<usize>,
    every_rank: Vec<Option<usize>>,
    loss: f64,
    accuracy: f64,
}

fn train(acc: Accelerator, args: &Args, initial: Classifier) -> Result<Outcome> {
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let (train, eval) = classifier::prepared_loaders(&acc, args.batch, 4096, 1003)?;
    let (mut step, mut stopped_at) = (0usize, None);
    'training: for _ in 0..args.epochs {
        for batch in train.iter() {
            let loss = model.losses(&batch?).mean();
            if (loss.clone().into_scalar::<f32>() as f64) < args.threshold {
                acc.set_trigger();
            }
            acc.backward(loss, &model)?;
            model = optimizer.step(model);
            step += 1;
            if acc.check_trigger()? {
                stopped_at = Some(step);
                break 'training;
            }
        }
    }
    let every_rank = acc.gather_object(&stopped_at)?;
    let (loss, accuracy) = classifier::evaluate(&acc, &model, &eval)?;
    Ok(Outcome {
        stopped_at,
        every_rank,
        loss,
        accuracy,
    })
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let initial = classifier::initial_model(64, 17)?;
    let outcome = ranks::run_ranks(Accelerator::builder(), args.processes, |acc| {
        train(acc, &args, initial.clone())
    })?;
    if let Some(outcome) = outcome {
        let show = |s: Option<usize>| s.map_or("none".to_string(), |s| s.to_string());
        println!("stopped_at_step={}", show(outcome.stopped_at));
        let every: Vec<String> = outcome.every_rank.into_iter().map(show).collect();
        println!("ranks_stopped_at=[{}]", every.join(", "));
        println!("final_loss={:.5}", outcome.loss);
        println!("accuracy={:.4}", outcome.accuracy);
    }
    Ok(())
}
