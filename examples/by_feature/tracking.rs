//! Experiment tracking: Accelerate's `by_feature/tracking.py`, in Burn.
//!
//! Ask for trackers when building the accelerator (`log_with`), start them with the run's hyperparameters
//! (`init_trackers`), log as training goes (`log`) and close them (`end_training`). Trackers run on the main
//! process only, so every rank makes the same calls. The built-in trackers write under
//! `<project-dir>/<run-name>/`: `metrics.jsonl`, `metrics.csv`, and an `events.out.tfevents.*` file for
//! `tensorboard --logdir <project-dir>`.
//!
//! ```text
//! cargo run --release --example tracking -- --project-dir runs
//! cargo run --release --example tracking -- --project-dir runs --log-with tensorboard --processes 2
//! ```
//!
//! Prints `logging_dir=<folder>`, `final_loss=<x>` and `accuracy=<y>`.

#[path = "../support/classifier.rs"]
mod classifier;
#[path = "../support/ranks.rs"]
mod ranks;

use std::path::PathBuf;

use burn::optim::AdamConfig;
use burn_accelerate::tracking::{LogWith, Value};
use burn_accelerate::{Accelerator, ProjectConfiguration, Result};
use clap::Parser;
use classifier::Classifier;
use serde::Serialize;

#[derive(Parser, Debug, Serialize)]
struct Args {
    /// Folder the trackers write into (one subfolder per run).
    #[arg(long)]
    project_dir: PathBuf,
    /// The run's name: its subfolder.
    #[arg(long, default_value = "tracking_example")]
    run_name: String,
    /// Trackers: jsonl, csv, tensorboard or all.
    #[arg(long, default_value = "all")]
    #[serde(skip)]
    log_with: String,
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Samples per batch and rank.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Passes over the training data.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
}

fn train(acc: Accelerator, args: &Args, initial: Classifier) -> Result<(f64, f64)> {
    // The hyperparameters go to every tracker once: config.json, hparams.yml and a TensorBoard text.
    acc.init_trackers(&args.run_name, args)?;
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), args.lr);
    let (train, eval) = classifier::prepared_loaders(&acc, args.batch, 4096, 1003)?;
    let mut step = 0u64;
    for epoch in 0..args.epochs {
        let bar = acc.progress_bar(train.len() as u64, "steps");
        for batch in train.iter() {
            let loss = model.losses(&batch?).mean();
            // The mean loss over the ranks, so the logged value describes the global batch.
            let global = acc.reduce(loss.clone().detach(), burn_accelerate::ReduceOp::Mean)?;
            acc.backward(loss, &model)?;
            model = optimizer.step(model);
            acc.log([("train_loss", global.into_scalar::<f32>())], Some(step))?;
            step += 1;
            bar.inc(1);
        }
        bar.finish_and_clear();
        let (loss, accuracy) = classifier::evaluate(&acc, &model, &eval)?;
        acc.log(
            [
                ("eval_loss", Value::from(loss)),
                ("accuracy", Value::from(accuracy)),
                ("epoch", Value::from(epoch)),
                (
                    "summary",
                    Value::from(format!("epoch {epoch}: accuracy {accuracy:.4}")),
                ),
            ],
            Some(step),
        )?;
    }
    let result = classifier::evaluate(&acc, &model, &eval)?;
    acc.end_training()?;
    Ok(result)
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let initial = classifier::initial_model(64, 17)?;
    let builder = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&args.project_dir))
        .log_with(args.log_with.parse::<LogWith>()?);
    if let Some((loss, accuracy)) = ranks::run_ranks(builder, args.processes, |acc| {
        train(acc, &args, initial.clone())
    })? {
        println!(
            "logging_dir={}",
            args.project_dir.join(&args.run_name).display()
        );
        println!("final_loss={loss:.5}");
        println!("accuracy={accuracy:.4}");
    }
    Ok(())
}
