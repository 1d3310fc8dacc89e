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
//!
//! Under `burn-accelerate launch --max-restarts N`, a job whose rank is killed or hangs is started again and
//! `accelerator.resume()` continues it from the latest complete checkpoint, with no `--resume`. `--fault`
//! makes one rank fail on the first run, to see it happen:
//!
//! ```text
//! burn-accelerate launch --num-processes 2 --max-restarts 3 target/release/examples/checkpointing \
//!     --project-dir /tmp/run3 --fault kill --fault-at 130
//! ```

#[path = "../support/mlp.rs"]
mod mlp;
#[path = "../support/ranks.rs"]
mod ranks;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::AdamConfig;
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
    /// Saves the final weights (`model.safetensors`) into this folder.
    #[arg(long)]
    save_final: Option<PathBuf>,
    /// A failure to inject, to try `launch --max-restarts`: `kill` (SIGKILL), `kill-in-save` (SIGKILL while
    /// the first save at or after `--fault-at` is being written), `hang` (stops answering) or `error` (returns
    /// an error of its own).
    #[arg(long)]
    fault: Option<Fault>,
    /// The step after which the fault happens.
    #[arg(long, default_value_t = 100)]
    fault_at: usize,
    /// The rank that fails.
    #[arg(long, default_value_t = 1)]
    fault_rank: usize,
    /// The fault happens on the first this-many runs of the job (restarts included).
    #[arg(long, default_value_t = 1)]
    fault_runs: usize,
}

/// A failure `--fault` injects.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    KillInSave,
    Hang,
    Error,
}

/// Kills this process once a save into `checkpoints` is under way (its `.partial` folder exists), from a
/// thread that watches for it.
fn kill_during_next_save(rank: usize, checkpoints: PathBuf) {
    std::thread::spawn(move || {
        loop {
            let saving = std::fs::read_dir(&checkpoints)
                .into_iter()
                .flatten()
                .flatten()
                .find(|e| e.file_name().to_string_lossy().ends_with(".partial"));
            if let Some(entry) = saving {
                let name = entry.file_name().to_string_lossy().into_owned();
                ranks::kill_self(
                    rank,
                    &format!("during save_state ({name} is being written)"),
                );
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    });
}

/// Injects `--fault` after `step`, on the rank and in the runs it names.
fn inject(args: &Args, accelerator: &Accelerator, step: usize) -> Result<()> {
    let rank = accelerator.process_index();
    let Some(fault) = args.fault else {
        return Ok(());
    };
    if rank != args.fault_rank || accelerator.restart_count() >= args.fault_runs {
        return Ok(());
    }
    let saves = step.is_multiple_of(args.save_every);
    match fault {
        Fault::Kill if step == args.fault_at => {
            ranks::kill_self(rank, &format!("after step {step}"))
        }
        Fault::KillInSave if step >= args.fault_at && saves => {
            kill_during_next_save(rank, args.project_dir.join("checkpoints"))
        }
        Fault::Hang if step == args.fault_at => {
            eprintln!("fault: rank {rank} hangs after step {step}");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(60));
            }
        }
        Fault::Error if step == args.fault_at => {
            return Err(burn_accelerate::Error::other(format!(
                "rank {rank} fails on purpose after step {step}"
            )));
        }
        _ => {}
    }
    Ok(())
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

    // With `--resume`, or when `launch --max-restarts` restarted the job: the latest complete checkpoint, if any.
    if let Some(mut state) = accelerator.resume()? {
        model = state.model(model)?;
        state.optimizer(&mut optimizer)?;
        state.scheduler(&mut scheduler)?;
        accelerator.print(format!(
            "resumed from {} at step {} (restart {})",
            state.dir().display(),
            progress.lock().unwrap().step,
            accelerator.restart_count()
        ));
        state.finish()?;
    } else if accelerator.restart_count() > 0 {
        accelerator.print(format!(
            "no complete checkpoint: starting from scratch (restart {})",
            accelerator.restart_count()
        ));
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
            inject(args, &accelerator, step)?;
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
    if let Some(dir) = &args.save_final {
        accelerator.save_model(&model, dir, "10GB", true)?;
    }
    let eval = SampleBatcher.batch(mlp::samples(512, 99), accelerator.device());
    Ok(model.loss(eval).into_scalar::<f32>() as f64)
}

fn main() {
    let args = Args::parse();
    let device = ranks::default_device();
    device.seed(7);
    let initial = Mlp::new(&device);
    let builder = Accelerator::builder()
        .project_configuration(
            ProjectConfiguration::new(&args.project_dir).total_limit(args.total_limit),
        )
        .resume_from_latest(args.resume);
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
