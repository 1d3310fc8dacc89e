//! Sharded training's step time on this machine: `SHARD_GRAD_OP` (and `FULL_SHARD`) against `NO_SHARD` on 2
//! in-process ranks, same model and batch.
//!
//! - `shard_grad_op_step_ratio` = time per step with `SHARD_GRAD_OP` / with `NO_SHARD` (reduce-scatter, half the
//!   Adam work, all-gather of the stepped parameters, against an all-reduce and the whole Adam step);
//! - `full_shard_step_ratio` = the same for `FULL_SHARD` (the parameters are all-gathered before every forward
//!   pass and dropped after the step);
//! - `block_wise_full_shard_step_ratio` = `FULL_SHARD` through `backward_blocks` (each layer gathered before its
//!   forward pass and again before its recompute, its gradients reduce-scattered at once) / `NO_SHARD`;
//! - `checkpointing_step_ratio` = `NO_SHARD` with activation checkpointing (every layer recomputed in backward)
//!   / without: the recompute's cost, whose theory is one more forward pass (a forward is about a third of a
//!   forward and backward, so about 1.33 of the compute, less of a step that also steps Adam).
//!
//! Each round runs the three modes one after the other (paired rounds), each timing its steady steps; the
//! figure is the median of the rounds' ratios. `cargo bench -p burn-accelerate-examples --bench sharded`
//! (`SHARD_LAYERS`, `SHARD_WIDTH`, `SHARD_BATCH`, `SHARD_STEPS`, `SHARD_ROUNDS` to change the size).

#[path = "../examples/support/stack.rs"]
mod stack;
#[path = "../tests/support/stats.rs"]
mod stats;
#[path = "support/step_timer.rs"]
mod step_timer;

use std::time::Duration;

use burn_accelerate::{GradientTransport, ShardingStrategy};
use stats::{median, paired_ratio};
use step_timer::{Mode, Workload, time_per_step, workload};

fn main() {
    let Workload {
        initial,
        width,
        batch,
        steps,
        rounds,
    } = workload("SHARD_ROUNDS", 7);
    let modes = [
        (ShardingStrategy::NoShard, Mode::Whole),
        (ShardingStrategy::ShardGradOp, Mode::Whole),
        (ShardingStrategy::FullShard, Mode::Whole),
        (ShardingStrategy::FullShard, Mode::Blocks),
        (ShardingStrategy::NoShard, Mode::Blocks),
        (ShardingStrategy::NoShard, Mode::Checkpointing),
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); modes.len()];
    for _ in 0..rounds {
        for (mode, times) in modes.iter().zip(&mut times) {
            times.push(time_per_step(
                *mode,
                GradientTransport::Auto,
                &initial,
                width,
                batch,
                steps,
            ));
        }
    }
    let ms = |d: &[Duration]| median(d.to_vec()).as_secs_f64() * 1e3;
    println!(
        "step_ms no_shard={:.2} shard_grad_op={:.2} full_shard={:.2} full_shard_blocks={:.2} no_shard_blocks={:.2} \
         no_shard_checkpointing={:.2}",
        ms(&times[0]),
        ms(&times[1]),
        ms(&times[2]),
        ms(&times[3]),
        ms(&times[4]),
        ms(&times[5])
    );
    println!(
        "shard_grad_op_step_ratio={:.3}",
        paired_ratio(&times[1], &times[0])
    );
    println!(
        "full_shard_step_ratio={:.3}",
        paired_ratio(&times[2], &times[0])
    );
    // Against NO_SHARD through the same closures (the last layer with tanh too).
    println!(
        "block_wise_full_shard_step_ratio={:.3}",
        paired_ratio(&times[3], &times[4])
    );
    println!(
        "checkpointing_step_ratio={:.3}",
        paired_ratio(&times[5], &times[4])
    );
}
