//! The shared device path against host memory: in-process ranks on one device (Flex here) hand each other the
//! device tensors themselves (`gradient_transport = auto`), or copy every parameter and gradient through host
//! buffers (`gradient_transport = host`). Same model, batch and mode on both sides, 2 ranks.
//!
//! - `device_vs_host_<mode>_step_ratio` = time per step through the shared device / through host memory, for
//!   `NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD` and block-wise `FULL_SHARD` (below 1: the device path is faster).
//!
//! Each round times host then device for every mode (alternated pairs); the figure is the median of the rounds'
//! ratios, with their range. `cargo bench -p burn-accelerate-examples --bench device_path` (`SHARD_LAYERS`,
//! `SHARD_WIDTH`, `SHARD_BATCH`, `SHARD_STEPS`, `DEVICE_PATH_ROUNDS` to change the size).

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
    } = workload("DEVICE_PATH_ROUNDS", 8);
    let modes = [
        ("no_shard", (ShardingStrategy::NoShard, Mode::Whole)),
        (
            "shard_grad_op",
            (ShardingStrategy::ShardGradOp, Mode::Whole),
        ),
        ("full_shard", (ShardingStrategy::FullShard, Mode::Whole)),
        (
            "block_wise_full_shard",
            (ShardingStrategy::FullShard, Mode::Blocks),
        ),
    ];
    // (host, device) times of every round, per mode.
    let mut times: Vec<Vec<(Duration, Duration)>> = vec![Vec::new(); modes.len()];
    for _ in 0..rounds {
        for ((_, mode), times) in modes.iter().zip(&mut times) {
            let host = time_per_step(
                *mode,
                GradientTransport::Host,
                &initial,
                width,
                batch,
                steps,
            );
            let device = time_per_step(
                *mode,
                GradientTransport::Auto,
                &initial,
                width,
                batch,
                steps,
            );
            times.push((host, device));
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for ((name, _), times) in modes.iter().zip(&times) {
        let host: Vec<Duration> = times.iter().map(|t| t.0).collect();
        let device: Vec<Duration> = times.iter().map(|t| t.1).collect();
        let pairs = times.iter().map(|(h, d)| d.as_secs_f64() / h.as_secs_f64());
        let (low, high) = pairs.fold((f64::INFINITY, 0.0f64), |(lo, hi), r| {
            (lo.min(r), hi.max(r))
        });
        println!(
            "{name}: host_step_ms={:.2} device_step_ms={:.2} pair ratios {low:.3}..{high:.3}",
            ms(median(host.clone())),
            ms(median(device.clone())),
        );
        println!(
            "device_vs_host_{name}_step_ratio={:.3}",
            paired_ratio(&device, &host)
        );
    }
}
