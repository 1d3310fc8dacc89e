//! Data-parallel scaling on this machine, for the data-parallel example's classifier.
//!
//! - `dp_scaling_efficiency` = throughput of 2 in-process ranks / (2 x throughput of 1 rank), each rank with the
//!   same per-rank batch (so 2 ranks process twice the samples per step).
//! - `no_sync_speedup` = time per micro-batch with accumulation 4 when gradients are all-reduced on every
//!   micro-batch (`sync_each_batch`) / when they are all-reduced only on sync steps (the default, DDP's
//!   `no_sync`), on 2 ranks.
//!
//! `cargo bench -p burn-accelerate-examples --bench data_parallel` (`DP_HIDDEN`, `DP_BATCH`, `DP_STEPS` to change the size).

#[path = "../examples/support/classifier.rs"]
mod classifier;

use std::time::{Duration, Instant};

use burn::data::dataset::InMemDataset;
use burn::optim::AdamConfig;
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{Accelerator, AcceleratorBuilder};
use classifier::{Classifier, SampleBatcher, blobs, initial_model};

fn env(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median time of one micro-batch (forward, backward, optimizer step) on each of `ranks` ranks.
fn time_per_micro_batch(
    builder: AcceleratorBuilder,
    ranks: usize,
    initial: &Classifier,
    batch: usize,
    steps: usize,
) -> Duration {
    let samples = batch * ranks * steps;
    let times = builder
        .launch(ranks, |acc| {
            let mut model = acc.prepare_model(initial.clone())?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
            let loader = acc.prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(batch)
                    .build(InMemDataset::new(blobs(samples, 3))),
            )?;
            let mut times = Vec::new();
            for _ in 0..3 {
                acc.wait_for_everyone()?;
                let start = Instant::now();
                for batch in loader.iter() {
                    acc.accumulate();
                    let loss = model.losses(&batch?).mean();
                    acc.backward(loss, &model)?;
                    model = optimizer.step(model);
                }
                acc.wait_for_everyone()?;
                times.push(start.elapsed() / loader.len() as u32);
            }
            times.sort();
            Ok(times[1])
        })
        .expect("benchmark run");
    times.into_iter().max().unwrap()
}

fn main() {
    let hidden = env("DP_HIDDEN", 512);
    let batch = env("DP_BATCH", 64);
    let steps = env("DP_STEPS", 200);
    let initial = initial_model(hidden, 1).expect("a device to draw the initial model on");
    let params = (classifier::FEATURES + 1) * hidden + (hidden + 1) * classifier::CLASSES;
    println!(
        "model=classifier hidden={hidden} params={params} per_rank_batch={batch} steps={steps}"
    );

    let one = time_per_micro_batch(Accelerator::builder(), 1, &initial, batch, steps);
    let two = time_per_micro_batch(Accelerator::builder(), 2, &initial, batch, steps);
    let throughput = |ranks: usize, t: Duration| (ranks * batch) as f64 / t.as_secs_f64();
    println!(
        "step_us_1_rank={:.1} step_us_2_ranks={:.1}",
        one.as_secs_f64() * 1e6,
        two.as_secs_f64() * 1e6
    );
    println!(
        "dp_scaling_efficiency={:.3}",
        throughput(2, two) / (2.0 * throughput(1, one))
    );

    let accumulate = Accelerator::builder().gradient_accumulation_steps(4);
    let no_sync = time_per_micro_batch(accumulate.clone(), 2, &initial, batch, steps);
    let every = time_per_micro_batch(accumulate.sync_each_batch(true), 2, &initial, batch, steps);
    println!(
        "micro_batch_us_no_sync={:.1} micro_batch_us_sync_each_batch={:.1}",
        no_sync.as_secs_f64() * 1e6,
        every.as_secs_f64() * 1e6
    );
    println!(
        "no_sync_speedup={:.3}",
        every.as_secs_f64() / no_sync.as_secs_f64()
    );
}
