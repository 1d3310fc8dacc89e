//! Overhead of training burn-train's `Learner` through the Accelerator on one process, against plain
//! burn-train (its default single-device strategy and Burn's own dataloader) in the same process.
//!
//! Both train the quicktour MLP for one epoch with Adam and a loss metric, nothing rendered. Runs alternate, and
//! the median of the per-round ratios is printed as `learner_overhead_ratio=<accelerated/plain>`;
//! `learner_noise_ratio` is plain against plain, the floor of what the ratio can tell, and
//! `learner_strategy_ratio` compares with burn-train's strategy reading the same prepared dataloader (the
//! strategy's cost alone).
//!
//! `cargo bench -p burn-accelerate-examples --features train --bench learner` (set `LEARNER_ROUNDS` for more rounds).

#[path = "../tests/support/stats.rs"]
mod stats;

#[path = "../examples/support/mlp.rs"]
mod mlp;
#[path = "../examples/support/mlp_train_step.rs"]
mod mlp_train_step;

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use burn::tensor::Device;
use burn_accelerate::Accelerator;
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::learner::burn_train::metric::LossMetric;
use burn_accelerate::learner::burn_train::{Learner, SupervisedTraining};
use burn_accelerate::learner::{LearnerLoader, QuietRenderer};
use mlp::{Mlp, SampleBatcher};
use stats::{median, paired_ratio};

const SAMPLES: usize = 16384;
const BATCH: usize = 32;

/// How long `training` takes to train `start` (Adam, learning rate 1e-3).
fn timed_launch(training: SupervisedTraining<Mlp>, start: &Mlp) -> Duration {
    let learner = Learner::new(start.clone(), AdamConfig::new().init(), 1e-3);
    let t = Instant::now();
    let result = training.launch(learner);
    let elapsed = t.elapsed();
    assert!(result.error.is_none(), "{:?}", result.error);
    elapsed
}

fn plain_epoch(start: &Mlp, dir: &std::path::Path) -> Duration {
    let device = Device::default().autodiff();
    let loader = |n, seed| {
        burn::data::dataloader::DataLoaderBuilder::new(SampleBatcher)
            .batch_size(BATCH)
            .shuffle(7)
            .set_device(device.clone())
            .build(mlp::dataset(n, seed))
    };
    let training = SupervisedTraining::new(dir, loader(SAMPLES, 4), loader(BATCH, 5))
        .metric_train_numeric(LossMetric::new())
        .num_epochs(1)
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None);
    timed_launch(training, start)
}

/// burn-train's own strategy reading the Accelerator's dataloader: separates the strategy's cost from the
/// dataloaders'.
fn plain_with_prepared_loader_epoch(start: &Mlp, dir: &std::path::Path) -> Duration {
    accelerated_epoch_with(start, dir, false)
}

fn accelerated_epoch(start: &Mlp, dir: &std::path::Path) -> Duration {
    accelerated_epoch_with(start, dir, true)
}

fn accelerated_epoch_with(start: &Mlp, dir: &std::path::Path, strategy: bool) -> Duration {
    let accelerator = Arc::new(Accelerator::new().expect("accelerator"));
    let loader = |n, seed| {
        accelerator
            .prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(BATCH)
                    .shuffle(7)
                    .build(mlp::dataset(n, seed)),
            )
            .expect("prepared")
    };
    let training = SupervisedTraining::new(
        dir,
        LearnerLoader::train(loader(SAMPLES, 4)),
        LearnerLoader::valid(loader(BATCH, 5)),
    )
    .metric_train_numeric(LossMetric::new())
    .num_epochs(1)
    .renderer(Box::new(QuietRenderer))
    .with_application_logger(None);
    let training = if strategy {
        accelerator.prepare_training(training).expect("strategy")
    } else {
        training
    };
    timed_launch(training, start)
}

fn main() {
    let rounds: usize = std::env::var("LEARNER_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let dir = std::env::temp_dir().join(format!("ba-bench-learner-{}", std::process::id()));
    let device = Device::default().autodiff();
    device.seed(0);
    let start = Mlp::new(&device);
    mlp::weights(&start);
    let (mut plain, mut ours, mut plain_again, mut plain_prepared) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds + 1 {
        // Rotate the order of the three runs, so that drift in machine load and position effects fall on all.
        let mut times = [Duration::ZERO; 4];
        for k in 0..4 {
            let which = (round + k) % 4;
            times[which] = match which {
                0 => plain_epoch(&start, &dir),
                1 => accelerated_epoch(&start, &dir),
                2 => plain_epoch(&start, &dir),
                _ => plain_with_prepared_loader_epoch(&start, &dir),
            };
        }
        // The first round warms up.
        if round > 0 {
            plain.push(times[0]);
            ours.push(times[1]);
            plain_again.push(times[2]);
            plain_prepared.push(times[3]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "epoch of {} steps: plain burn-train {:.1} ms, through the Accelerator {:.1} ms (medians of {rounds})",
        SAMPLES / BATCH,
        median(plain.clone()).as_secs_f64() * 1e3,
        median(ours.clone()).as_secs_f64() * 1e3,
    );
    println!("learner_overhead_ratio={:.3}", paired_ratio(&ours, &plain));
    println!(
        "learner_noise_ratio={:.3}",
        paired_ratio(&plain_again, &plain)
    );
    // The strategy alone: both read the Accelerator's dataloader.
    println!(
        "learner_strategy_ratio={:.3}",
        paired_ratio(&ours, &plain_prepared)
    );
}
