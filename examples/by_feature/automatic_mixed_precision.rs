//! Mixed precision: Accelerate's `by_feature/automatic_mixed_precision.py`, in Burn.
//!
//! `--mixed-precision bf16|fp16|no` (or `ACCELERATE_MIXED_PRECISION`, or `burn-accelerate launch
//! --mixed-precision`). The forward pass runs in the low precision inside `autocast`; the weights, the gradients
//! handed to the optimizer and the optimizer state stay f32. With fp16 the loss is scaled before `backward`
//! and the gradients unscaled before the step; a step whose gradients overflowed is skipped on every rank and
//! the scale lowered, as PyTorch's `GradScaler` does.
//!
//! ```text
//! cargo run --release --example automatic_mixed_precision -- --mixed-precision bf16
//! cargo run --release --example automatic_mixed_precision -- --mixed-precision fp16 --processes 2
//! ```
//!
//! Prints `mixed_precision=<p>`, `skipped_steps=<n>`, `loss_scale=<s|none>`, `final_loss=<x>` and
//! `accuracy=<y>`.

#[path = "../support/classifier.rs"]
mod classifier;
#[path = "../support/ranks.rs"]
mod ranks;

use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, MixedPrecision, Result};
use clap::Parser;
use classifier::Classifier;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Forward precision: no, fp16 or bf16 (default: ACCELERATE_MIXED_PRECISION, else bf16).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// Passes over the training data.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
}

struct Outcome {
    precision: MixedPrecision,
    skipped: usize,
    scale: Option<f64>,
    loss: f64,
    accuracy: f64,
}

fn train(acc: Accelerator, args: &Args, initial: Classifier) -> Result<Outcome> {
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let (train, eval) = classifier::prepared_loaders(&acc, 32, 4096, 1003)?;
    let mut skipped = 0;
    for _ in 0..args.epochs {
        for batch in train.iter() {
            // The forward pass and the loss in the low precision; the loss comes back as f32.
            let loss = acc.autocast(&model, batch?, |model, batch| model.losses(&batch).mean());
            acc.backward(loss, &model)?;
            model = optimizer.step(model);
            if acc.optimizer_step_was_skipped() {
                skipped += 1;
            }
        }
    }
    let (loss, accuracy) = classifier::evaluate(&acc, &model, &eval)?;
    Ok(Outcome {
        precision: acc.mixed_precision(),
        skipped,
        scale: acc.loss_scale(),
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
    let mut builder = Accelerator::builder();
    let from_env = std::env::var_os("ACCELERATE_MIXED_PRECISION").is_some();
    match args.mixed_precision {
        Some(precision) => builder = builder.mixed_precision(precision),
        None if !from_env => builder = builder.mixed_precision(MixedPrecision::Bf16),
        None => {}
    }
    if let Some(outcome) = ranks::run_ranks(builder, args.processes, |acc| {
        train(acc, &args, initial.clone())
    })? {
        println!("mixed_precision={}", outcome.precision);
        println!("skipped_steps={}", outcome.skipped);
        let scale = outcome.scale.map_or("none".to_string(), |s| s.to_string());
        println!("loss_scale={scale}");
        println!("final_loss={:.5}", outcome.loss);
        println!("accuracy={:.4}", outcome.accuracy);
    }
    Ok(())
}
