//! One timed training step of the block stack on 2 in-process ranks, under a sharding mode, a way of running the
//! model and a gradient transport: what the `sharded` and `device_path` benches time.

use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, GradientTransport, ShardingStrategy};

use crate::stack::{self, Stack};
use crate::stats::median;

/// The benches' workload: the stack's initial weights and the sizes, from `SHARD_LAYERS`, `SHARD_WIDTH`,
/// `SHARD_BATCH`, `SHARD_STEPS` and the bench's own rounds variable.
pub struct Workload {
    pub initial: Stack,
    pub width: usize,
    pub batch: usize,
    pub steps: usize,
    pub rounds: usize,
}

/// The workload (printed as the bench's first line), with `rounds_key`'s rounds (`default_rounds` unset).
pub fn workload(rounds_key: &str, default_rounds: usize) -> Workload {
    let layers = env("SHARD_LAYERS", 8);
    let width = env("SHARD_WIDTH", 512);
    let batch = env("SHARD_BATCH", 32);
    let steps = env("SHARD_STEPS", 10);
    let rounds = env(rounds_key, default_rounds);
    let device = burn::tensor::Device::default();
    device.seed(3);
    let initial = Stack::new(layers, width, &device);
    println!(
        "model=stack layers={layers} width={width} params={} global_batch={batch} steps={steps} rounds={rounds} ranks=2",
        layers * (width * width + width)
    );
    Workload {
        initial,
        width,
        batch,
        steps,
        rounds,
    }
}

/// The number in the environment variable `key`, else `default` (the benches' size settings).
fn env(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median time of one training step (unshard, forward, backward, optimizer step) on 2 ranks under `sharding`,
/// through `transport`, after one warm-up step (Flex computes eagerly: the step is done when `try_step`
/// returns).
pub fn time_per_step(
    (sharding, mode): (ShardingStrategy, Mode),
    transport: GradientTransport,
    initial: &Stack,
    width: usize,
    batch: usize,
    steps: usize,
) -> Duration {
    let times = Accelerator::builder()
        .sharding(sharding)
        .activation_checkpointing(mode == Mode::Checkpointing)
        .gradient_transport(transport)
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
                if mode == Mode::Whole {
                    let whole = acc.unshard(&model)?;
                    let loss = (whole.forward(x) - y).powi_scalar(2).mean();
                    acc.backward(loss, &whole)?;
                    drop(whole);
                } else {
                    acc.backward_blocks(
                        &model,
                        |_| x.clone(),
                        |layer, h| layer.forward(h).tanh(),
                        |_, h| (h - y).powi_scalar(2).mean(),
                    )?;
                }
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

/// How a step runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `unshard`, the forward pass and `backward`.
    Whole,
    /// `backward_blocks`, each layer a block (block-wise under `FULL_SHARD`).
    Blocks,
    /// `backward_blocks` with activation checkpointing.
    Checkpointing,
}
