//! Sharded training's step time on this machine: `SHARD_GRAD_OP` (and `FULL_SHARD`) against `NO_SHARD` on 2
//! in-process ranks, same model and batch.
//!
//! - `shard_grad_op_step_ratio` = time per step with `SHARD_GRAD_OP` / with `NO_SHARD` (reduce-scatter, half the
//!   Adam work, all-gather of the stepped parameters, against an all-reduce and the whole Adam step);
//! - `full_shard_step_ratio` = the same for `FULL_SHARD` (the parameters are all-gathered before every forward
//!   pass and dropped after the step).
//!
//! Each round runs the three modes one after the other (paired rounds), each timing its steady steps; the
//! figure is the median of the rounds' ratios. `cargo bench -p burn-accelerate-examples --bench sharded`
//! (`SHARD_LAYERS`, `SHARD_WIDTH`, `SHARD_BATCH`, `SHARD_STEPS`, `SHARD_ROUNDS` to change the size).

#[path = "../examples/support/stack.rs"]
mod stack;
#[path = "../tests/support/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use burn::tensor::Device;
use burn_accelerate::{Accelerator, ShardingStrategy};
use stack::Stack;
use stats::{median, paired_ratio};

fn env(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median time of one training step (unshard, forward, backward, optimizer step) on 2 ranks under `sharding`,
/// after one warm-up step (Flex computes eagerly: the step is done when `try_step` returns).
fn time_per_step(
    sharding: ShardingStrategy,
    initial: &Stack,
    width: usize,
    batch: usize,
    steps: usize,
) -> Duration {
    let times = Accelerator::builder()
        .sharding(sharding)
        .launch(2, |acc| {
            let device = acc.device().clone();
            let rows = batch / 2;
            let mut model = acc.prepare_model(initial.clone())?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
            let mut times = Vec::new();
            for step in 0..=steps {
                let (x, y) = stack::batch(
                    width,
                    (step * batch + acc.process_index() * rows, rows),
                    &device,
                );
                acc.wait_for_everyone()?;
                let start = Instant::now();
                let whole = acc.unshard(&model)?;
                let loss = (whole.forward(x) - y).powi_scalar(2).mean();
                acc.backward(loss, &whole)?;
                drop(whole);
                model = optimizer.try_step(model)?;
                if step > 0 {
                    times.push(start.elapsed());
                }
            }
            Ok(median(times))
        })
        .expect("benchmark run");
    times.into_iter().max().unwrap()
}

fn main() {
    let layers = env("SHARD_LAYERS", 8);
    let width = env("SHARD_WIDTH", 512);
    let batch = env("SHARD_BATCH", 32);
    let steps = env("SHARD_STEPS", 10);
    let rounds = env("SHARD_ROUNDS", 7);
    let device = Device::default();
    device.seed(3);
    let initial = Stack::new(layers, width, &device);
    println!(
        "model=stack layers={layers} width={width} params={} global_batch={batch} steps={steps} rounds={rounds} ranks=2",
        layers * (width * width + width)
    );
    let (mut plain, mut grad_op, mut full) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(time_per_step(
            ShardingStrategy::NoShard,
            &initial,
            width,
            batch,
            steps,
        ));
        grad_op.push(time_per_step(
            ShardingStrategy::ShardGradOp,
            &initial,
            width,
            batch,
            steps,
        ));
        full.push(time_per_step(
            ShardingStrategy::FullShard,
            &initial,
            width,
            batch,
            steps,
        ));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "step_ms no_shard={:.2} shard_grad_op={:.2} full_shard={:.2}",
        ms(median(plain.clone())),
        ms(median(grad_op.clone())),
        ms(median(full.clone()))
    );
    println!(
        "shard_grad_op_step_ratio={:.3}",
        paired_ratio(&grad_op, &plain)
    );
    println!("full_shard_step_ratio={:.3}", paired_ratio(&full, &plain));
}
