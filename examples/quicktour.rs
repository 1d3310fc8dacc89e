//! Accelerate's Quicktour, in Burn.
//!
//! A plain Burn training loop with the Quicktour's four changes:
//! 1. create an `Accelerator`;
//! 2. drop the manual device moves (no `device` is passed around);
//! 3. pass the model, optimizer, dataloader and scheduler through `prepare_*`;
//! 4. replace `loss.backward()` with `accelerator.backward(loss, &model)`.
//!
//! and, for mixed precision, computes the loss inside `accelerator.autocast(...)` (Rust cannot patch a model's
//! `forward`, so the autocast scope is explicit; with `--mixed-precision no` it is a plain call). The global
//! batch is divided across the ranks and the evaluation gathers every rank's samples, so the program prints the
//! same losses on 1 rank, on `--processes N` in-process ranks and under `burn-accelerate launch`.
//!
//! Run: `cargo run --release --example quicktour` (add `-- --help` for the options).

#[path = "support/mlp.rs"]
mod mlp;
#[path = "support/ranks.rs"]
mod ranks;

use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::AdamConfig;
use burn_accelerate::data::{DataLoaderBuilder, PreparedDataLoader};
use burn_accelerate::{Accelerator, Backend, MixedPrecision};
use clap::Parser;
use mlp::{Batch, Mlp, Sample, SampleBatcher};

/// Trains a small MLP on synthetic regression data through burn-accelerate.
#[derive(Parser, Debug)]
struct Args {
    /// Passes over the training data.
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    /// Examples per optimizer step over all ranks (each rank takes its share).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Peak learning rate (decays linearly to a tenth).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Training examples.
    #[arg(long, default_value_t = 4096)]
    samples: usize,
    /// Seed for weights, data and shuffling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Backend to run on (default: the best compiled in; see `burn-accelerate env`).
    #[arg(long)]
    backend: Option<Backend>,
    /// Run on the CPU even when an accelerator is available.
    #[arg(long)]
    cpu: bool,
    /// Forward precision: no, fp16 or bf16 (default: ACCELERATE_MIXED_PRECISION, else no).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// In-process ranks (one thread each); ignored under `burn-accelerate launch` / `mpirun`.
    #[arg(long, default_value_t = 1)]
    processes: usize,
}

/// The mean squared error over every sample of `loader`, whichever rank evaluated it (`gather_for_metrics`
/// drops the samples repeated to even out the last round).
fn mean_loss(
    accelerator: &Accelerator,
    model: &Mlp,
    loader: &PreparedDataLoader<Sample, Batch>,
) -> burn_accelerate::Result<f64> {
    let (mut total, mut count) = (0.0, 0usize);
    for batch in loader.iter() {
        let batch = batch?;
        let n = batch.x.dims()[0];
        let errors = (model.forward(batch.x) - batch.y)
            .powi_scalar(2)
            .reshape([n]);
        let errors = accelerator.gather_for_metrics(errors)?;
        let errors: Vec<f32> = errors.into_data().try_to_vec().map_err(|e| {
            burn_accelerate::Error::InvalidArgument(format!("reading the losses: {e:?}"))
        })?;
        total += errors.iter().map(|&e| e as f64).sum::<f64>();
        count += errors.len();
    }
    Ok(total / count.max(1) as f64)
}

pub fn main() {
    if let Err(error) = run_quicktour() {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run_quicktour() -> burn_accelerate::Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();

    // 1. Create the accelerator: it picks the device and knows the ranks.
    let mut builder = Accelerator::builder().cpu(args.cpu);
    if let Some(precision) = args.mixed_precision {
        builder = builder.mixed_precision(precision);
    }
    if let Some(backend) = args.backend {
        builder = builder.backend(backend);
    }
    ranks::run_ranks(builder, args.processes, |accelerator| {
        train(&accelerator, &args)
    })?;
    Ok(())
}

/// The training loop, the same on every rank.
fn train(accelerator: &Accelerator, args: &Args) -> burn_accelerate::Result<()> {
    accelerator.set_seed(args.seed, false);
    let ranks = accelerator.num_processes();
    if !args.batch_size.is_multiple_of(ranks) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--batch-size {} cannot be divided between {ranks} ranks; use a multiple of {ranks}",
            args.batch_size
        )));
    }
    accelerator.print(format!(
        "device={:?} processes={} mixed_precision={}",
        accelerator.device(),
        accelerator.num_processes(),
        accelerator.mixed_precision()
    ));

    // 2. Build everything without a device: the accelerator places it.
    let model = Mlp::new(accelerator.device());
    let train = DataLoaderBuilder::new(SampleBatcher)
        .batch_size(args.batch_size / ranks)
        .shuffle(args.seed)
        .build(mlp::dataset(args.samples, args.seed));
    let eval = DataLoaderBuilder::new(SampleBatcher)
        .batch_size(256)
        .build(mlp::dataset(1024, args.seed + 1));

    // 3. Prepare.
    let mut model = accelerator.prepare_model(model)?;
    let train = accelerator.prepare_dataloader(train)?;
    let eval = accelerator.prepare_dataloader(eval)?;
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), args.lr);
    let total_steps = args.epochs * train.len();
    let schedule = LinearLrSchedulerConfig::new(args.lr, args.lr / 10.0, total_steps.max(1))
        .init()
        .map_err(burn_accelerate::Error::InvalidArgument)?;
    let mut scheduler = accelerator.prepare_scheduler(schedule, &optimizer);

    let initial = mean_loss(accelerator, &model, &eval)?;
    accelerator.print(format!("initial_loss={initial:.6}"));
    for epoch in 0..args.epochs {
        // Drawn on a terminal by the main process only.
        let bar = accelerator.progress_bar(train.len() as u64, "batches");
        for batch in train.iter() {
            let loss = accelerator.autocast(&model, batch?, |model, batch| model.loss(batch));
            // 4. Backward through the accelerator.
            accelerator.backward(loss, &model)?;
            model = optimizer.step(model);
            scheduler.step();
            bar.inc(1);
        }
        bar.finish_and_clear();
        let loss = mean_loss(accelerator, &model, &eval)?;
        accelerator.print(format!(
            "epoch={epoch} eval_loss={loss:.6} lr={:.2e}",
            scheduler.lr()
        ));
    }
    let final_loss = mean_loss(accelerator, &model, &eval)?;
    accelerator.print(format!("final_loss={final_loss:.6}"));
    Ok(())
}
