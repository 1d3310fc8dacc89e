//! One timed training step of the block stack on 2 in-process ranks, under a sharding mode, a way of running the
//! model and a gradient transport: what the `sharded` and `device_path` benches time.

use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, GradientTransport, ShardingStrategy};

use crate::stack::{self, Stack};
use crate::stats::median;

/// The number in the environment variable `key`, else `default` (the benches' size settings).
pub fn env(key: &str, default: usize) -> usize {
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
                        |_| x,
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
