//! Overhead of the Accelerator on a training step, against the hand-written Burn loop in the same process.
//!
//! Both loops train the quicktour MLP on the same data with Adam (forward, loss, backward, optimizer step,
//! batch building): the raw loop as a Burn user writes it (Burn's `DataLoaderBuilder`, `loss.backward()`,
//! `GradientsParams::from_grads`, `optimizer.step`), the other through the Accelerator and its dataloader. Epochs of the two loops alternate, and the median of the per-round ratios is printed as
//! `overhead_ratio=<accelerated/raw>`.
//!
//! `cargo bench -p burn-accelerate-examples --bench overhead` (set `OVERHEAD_ROUNDS` for more or fewer rounds).

#[path = "../tests/support/stats.rs"]
mod stats;

#[path = "../examples/support/mlp.rs"]
mod mlp;

use std::time::{Duration, Instant};

use stats::{median, paired_ratio};

use burn::optim::{AdamConfig, GradientsParams};
use burn_accelerate::Accelerator;
use burn_accelerate::data::DataLoaderBuilder;
use mlp::{Mlp, SampleBatcher};

const SAMPLES: usize = 2048;
const BATCH: usize = 32;
const LR: f64 = 1e-3;

pub fn main() -> burn_accelerate::Result<()> {
    let rounds: usize = std::env::var("OVERHEAD_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(41);
    let steps_per_epoch = SAMPLES.div_ceil(BATCH);

    // Raw Burn, on the device the Accelerator takes (`BURN_DEVICE` included; Burn's `Device::default()` would
    // take CUDA wherever it is compiled in).
    let device = burn_accelerate::backend::default_device()?.autodiff();
    device.seed(0);
    let raw_loader = burn::data::dataloader::DataLoaderBuilder::new(SampleBatcher)
        .batch_size(BATCH)
        .set_device(device.clone())
        .build(mlp::dataset(SAMPLES, 3));
    let mut raw_model = Mlp::new(&device);
    let mut raw_optim = AdamConfig::new().init();

    // Accelerated.
    let accelerator = Accelerator::new()?;
    let mut acc_model = accelerator.prepare_model(raw_model.clone())?;
    let mut acc_optim = accelerator.prepare_optimizer(AdamConfig::new().init(), LR);
    let loader = accelerator.prepare_dataloader(
        DataLoaderBuilder::new(SampleBatcher)
            .batch_size(BATCH)
            .build(mlp::dataset(SAMPLES, 3)),
    )?;

    let mut raw_epoch = || {
        let start = Instant::now();
        for batch in raw_loader.iter() {
            let loss = raw_model.loss(batch.expect("batch"));
            let grads = GradientsParams::from_grads(loss.backward(), &raw_model);
            raw_model = raw_optim.step(LR, raw_model.clone(), grads);
        }
        start.elapsed()
    };
    let mut acc_epoch = || -> burn_accelerate::Result<Duration> {
        let start = Instant::now();
        for batch in loader.iter() {
            let loss = acc_model.loss(batch?);
            accelerator.backward(loss, &acc_model)?;
            acc_model = acc_optim.step(acc_model.clone());
        }
        Ok(start.elapsed())
    };

    // Warm up both paths (allocator pools, lazy initialisation).
    raw_epoch();
    acc_epoch()?;

    let (mut raw, mut acc) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which loop goes first so drift in machine load falls on both.
        if round % 2 == 0 {
            raw.push(raw_epoch());
            acc.push(acc_epoch()?);
        } else {
            acc.push(acc_epoch()?);
            raw.push(raw_epoch());
        }
    }
    // The ratio of each round's pair (run back to back) cancels slow drift in machine load.
    let ratio = paired_ratio(&acc, &raw);
    let (raw, acc) = (median(raw), median(acc));
    let per_step = |d: Duration| d.as_secs_f64() * 1e6 / steps_per_epoch as f64;
    println!("model=quicktour-mlp batch={BATCH} steps_per_epoch={steps_per_epoch} rounds={rounds}");
    println!("raw_step_us={:.1}", per_step(raw));
    println!("accelerated_step_us={:.1}", per_step(acc));
    println!("overhead_ratio={ratio:.4}");
    Ok(())
}
