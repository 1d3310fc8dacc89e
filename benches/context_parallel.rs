//! Context parallelism's step time and traffic on this machine: the byte-level transformer of `transformer_lm` on
//! 2 in-process ranks, the same model and global batch, each sequence cut over the two ranks (`cp` 2, all-gather
//! or ring attention) or the batch split between them (`dp` 2, `NO_SHARD`, each rank half the sequences).
//!
//! - `cp2_<mode>_vs_dp2_step_ratio` = time per step with `cp` 2 / with `dp` 2;
//! - `ring_bytes_per_step` on rank 0, counted as the ring sends them, and `ring_bytes_ratio` = counted / the
//!   formula: per layer and step, `(cp − 1)` key/value blocks forward, `(cp − 1)` blocks and `cp` gradient blocks
//!   back, a block `2 × batch × seq / cp × width` f32 values;
//! - `score_elements_per_rank`: the attention scores each rank computed in one step, head-tail balanced.
//!
//! Each round runs the modes one after the other (paired rounds), each timing its steady steps; the figure is the
//! median of the rounds' ratios. `cargo bench -p burn-accelerate-examples --bench context_parallel` (`CP_LAYERS`,
//! `CP_WIDTH`, `CP_SEQ`, `CP_BATCH`, `CP_STEPS`, `CP_ROUNDS` to change the size).

#[path = "../examples/support/byte_lm.rs"]
mod byte_lm;
#[path = "../tests/support/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::optim::SgdConfig;
use burn_accelerate::config::ContextAttention;
use burn_accelerate::context_parallel;
use burn_accelerate::{Accelerator, GradientTransport};
use byte_lm::{ByteLm, batch};
use stats::{median, paired_ratio};

/// How the two ranks share the work.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Dp2,
    Cp2(ContextAttention),
}

struct Size {
    layers: usize,
    width: usize,
    seq: usize,
    batch: usize,
    steps: usize,
}

fn env(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median step time under `mode`, and rank 0's attention counters of one step.
fn run(mode: Mode, initial: &ByteLm, size: &Size) -> (Duration, context_parallel::ContextStats) {
    let (cp, attention) = match mode {
        Mode::Dp2 => (1, ContextAttention::AllGather),
        Mode::Cp2(attention) => (2, attention),
    };
    let results = Accelerator::builder()
        .cp_size(cp)
        .cp_comm_strategy(attention)
        // Through host memory for both (the step times compare like with like).
        .gradient_transport(GradientTransport::Host)
        .launch(2, |acc| {
            let device = acc.device().clone();
            let layout = acc.pipeline_layout();
            let rows = size.batch / layout.replicas;
            let split = acc.context_split(size.seq)?;
            let positions = split.position_ids(&device);
            let mut model = acc.prepare_model(initial.clone())?;
            let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 1e-2);
            let mask = generate_autoregressive_mask(1, size.seq, &device);
            let (mut times, mut counted) = (Vec::new(), context_parallel::ContextStats::default());
            for step in 0..=size.steps {
                let (inputs, targets) = batch(
                    (step * size.batch + layout.replica * rows, rows),
                    size.seq,
                    &device,
                );
                let (inputs, targets) = (split.part(inputs, 1)?, split.part(targets, 1)?);
                acc.wait_for_everyone()?;
                context_parallel::reset_stats();
                let started = Instant::now();
                acc.backward_batch(
                    &model,
                    (inputs, targets),
                    |m, (inputs, _)| m.embed_at(inputs.clone(), positions.clone()),
                    |layer, x| match cp {
                        1 => layer.forward(x, None, Some(mask.clone())),
                        _ => layer.forward_causal(x),
                    },
                    |m, x, (_, targets)| m.loss(x, targets.clone()),
                )?;
                model = optimizer.try_step(model)?;
                if step > 0 {
                    times.push(started.elapsed());
                    counted = context_parallel::stats();
                }
            }
            Ok((median(times), counted))
        })
        .expect("the bench's ranks train");
    results[0]
}

fn main() {
    let size = Size {
        layers: env("CP_LAYERS", 4),
        width: env("CP_WIDTH", 128),
        seq: env("CP_SEQ", 256),
        batch: env("CP_BATCH", 4),
        steps: env("CP_STEPS", 5),
    };
    let rounds = env("CP_ROUNDS", 5);
    let device = burn::tensor::Device::default();
    device.seed(5);
    let initial = ByteLm::new(size.layers, size.width, 4, size.seq, &device);
    println!(
        "model=byte_lm layers={} width={} seq={} global_batch={} params={} steps={} rounds={rounds} ranks=2",
        size.layers,
        size.width,
        size.seq,
        size.batch,
        initial.num_params(),
        size.steps
    );
    let modes = [
        Mode::Dp2,
        Mode::Cp2(ContextAttention::AllGather),
        Mode::Cp2(ContextAttention::Ring),
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); modes.len()];
    let mut counted = vec![context_parallel::ContextStats::default(); modes.len()];
    for _ in 0..rounds {
        for (i, mode) in modes.iter().enumerate() {
            let (time, stats) = run(*mode, &initial, &size);
            times[i].push(time);
            counted[i] = stats;
        }
    }
    let ms = |d: &[Duration]| median(d.to_vec()).as_secs_f64() * 1e3;
    println!(
        "step_ms dp2={:.2} cp2_allgather={:.2} cp2_ring={:.2}",
        ms(&times[0]),
        ms(&times[1]),
        ms(&times[2])
    );
    println!(
        "cp2_allgather_vs_dp2_step_ratio={:.3}",
        paired_ratio(&times[1], &times[0])
    );
    println!(
        "cp2_ring_vs_dp2_step_ratio={:.3}",
        paired_ratio(&times[2], &times[0])
    );
    let cp = 2u64;
    let block = 2 * (size.batch * size.seq / 2 * size.width) as u64 * 4;
    let formula = size.layers as u64 * ((cp - 1) * block + (cp - 1) * block + cp * block);
    let ring = counted[2].ring_bytes_sent;
    println!(
        "ring_bytes_per_step={ring} formula={formula} ring_bytes_ratio={:.3}",
        ring as f64 / formula as f64
    );
    println!("score_elements_per_rank={}", counted[2].score_elements);
}
