//! Checkpointing and exact resumption.
//!
//! Trains the quicktour MLP with shuffling, saving the whole training state every `--save-every` steps into
//! `--project-dir/checkpoints/checkpoint_{i}` (keeping the last `--total-limit`). With `--resume`, it continues
//! from the latest checkpoint, in the middle of an epoch if that is where the save happened. A run killed at
//! any point after its first checkpoint and resumed prints the same `final_loss` as an uninterrupted run.
//!
//! ```text
//! cargo run --release --example checkpointing -- --project-dir /tmp/run
//! cargo run --release --example checkpointing -- --project-dir /tmp/run --resume
//! cargo run --release --example checkpointing -- --project-dir /tmp/run2 --processes 2   # in-process ranks
//! ```
//!
//! Every rank takes part in `save_state`/`load_state` (the main rank writes the shared files, each rank its own
//! random and data position), so a multi-rank run resumes the same way.

#[path = "../support/mlp.rs"]
mod mlp;
#[path = "../support/ranks.rs"]
mod ranks;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::AdamConfig;
use burn::tensor::Device;
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{Accelerator, ProjectConfiguration, Result, StateToSave};
use clap::Parser;
use mlp::{Mlp, SampleBatcher};
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
struct Args {
    /// Folder of the run; checkpoints go to its `checkpoints/` subfolder.
    #[arg(long)]
    project_dir: PathBuf,
    /// Continue from the latest checkpoint under the project folder.
    #[arg(long)]
    resume: bool,
    /// Optimizer steps in all.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Save every this many steps.
    #[arg(long, default_value_t = 25)]
    save_every: usize,
    /// Keep at most this many checkpoints.
    #[arg(long, default_value_t = 3)]
    total_limit: usize,
    /// Training examples (the epoch is 1000 / 32 = 32 batches, so saves fall mid-epoch).
    #[arg(long, default_value_t = 1000)]
    samples: usize,
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
}

/// Progress of the run, registered for checkpointing.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Progress {
    step: usize,
}

fn run(accelerator: Accelerator, args: &Args, initial: Mlp) -> Result<f64> {
    let progress = Arc::new(Mutex::new(Progress::default()));
    accelerator.register_for_checkpointing("progress", progress.clone())?;

    let mut model = accelerator.prepare_model(initial)?;
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), 3e-3);
    // Without split batches the scheduler advances once per rank and step (Accelerate's rule).
    let schedule_steps = args.steps * accelerator.num_processes();
    let schedule = LinearLrSchedulerConfig::new(3e-3, 3e-4, schedule_steps)
        .init()
        .map_err(burn_accelerate::Error::InvalidArgument)?;
    let mut scheduler = accelerator.prepare_scheduler(schedule, &optimizer);
    let train = accelerator.prepare_dataloader(
        DataLoaderBuilder::new(SampleBatcher)
            .batch_size(32)
            .shuffle(11)
            .build(mlp::dataset(args.samples, 3)),
    )?;

    if args.resume {
        let mut state = accelerator.load_state(None)?;
        model = state.model(model)?;
        state.optimizer(&mut optimizer)?;
        state.scheduler(&mut scheduler)?;
        accelerator.print(format!(
            "resumed from {} at step {}",
            state.dir().display(),
            progress.lock().unwrap().step
        ));
        state.finish()?;
    }

    let mut step = progress.lock().unwrap().step;
    'training: while step < args.steps {
        for batch in train.iter() {
            let loss = model.loss(batch?);
            accelerator.backward(loss, &model)?;
            model = optimizer.step(model);
            scheduler.step();
            step += 1;
            progress.lock().unwrap().step = step;
            if step % args.save_every == 0 {
                let parts = StateToSave::new()
                    .model(&model)?
                    .optimizer(&optimizer)?
                    .scheduler(&scheduler)?;
                let dir = accelerator.save_state(None, &parts)?;
                accelerator.print(format!("step={step} saved={}", dir.display()));
            }
            if step >= args.steps {
                break 'training;
            }
        }
    }
    let eval = SampleBatcher.batch(mlp::samples(512, 99), accelerator.device());
    Ok(model.loss(eval).into_scalar::<f32>() as f64)
}

fn main() {
    let args = Args::parse();
    let device = Device::default();
    device.seed(7);
    let initial = Mlp::new(&device);
    let builder = Accelerator::builder().project_configuration(
        ProjectConfiguration::new(&args.project_dir).total_limit(args.total_limit),
    );
    match ranks::run_ranks(builder, args.processes, |acc| {
        run(acc, &args, initial.clone())
    }) {
        Ok(Some(loss)) => println!("final_loss={loss:.9}"),
        Ok(None) => {}
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}
