//! Tensor parallelism's step time and traffic on this machine: the byte-level transformer of `transformer_lm` on 2
//! in-process ranks, the same model and global batch, split over the two ranks (`tp` 2) or replicated on them
//! (`dp` 2, `NO_SHARD`, each rank half the batch).
//!
//! - `tp2_vs_dp2_step_ratio` = time per step with `tp` 2 / with `dp` 2; `tp2_sp_vs_dp2_step_ratio` the same with
//!   sequence parallelism (and loss parallelism) on;
//! - `values_per_step_<mode>`: the values each rank hands to the collectives in one step (through host memory,
//!   where the transport counts them), and `<mode>_values_ratio` = measured / the formula: with `n` = batch ×
//!   sequence × width, `tp` 2 all-reduces `n` twice per layer forward and twice backward (`4 n L`), the embedding's
//!   and the head's input `n` once each, and gathers the logits; sequence parallelism reduce-scatters `n` and
//!   all-gathers `n / tp` in their place (`4 n + 6 n / tp` per layer: its column-parallel layers gather their input
//!   again in the backward pass), plus the whole parameters' gradients, and loss parallelism three values per
//!   token instead of the logits; `dp` 2 all-reduces every gradient once.
//!
//! Each round runs the modes one after the other (paired rounds), each timing its steady steps; the figure is the
//! median of the rounds' ratios. `cargo bench -p burn-accelerate-examples --bench tensor_parallel` (`TP_LAYERS`,
//! `TP_WIDTH`, `TP_SEQ`, `TP_BATCH`, `TP_STEPS`, `TP_ROUNDS` to change the size).

#[path = "../examples/support/byte_lm.rs"]
mod byte_lm;
#[path = "../tests/support/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::optim::SgdConfig;
use burn_accelerate::{Accelerator, GradientTransport};
use byte_lm::{ByteLm, VOCAB, batch};
use stats::{median, paired_ratio};

/// How the two ranks share the model.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Dp2,
    Tp2,
    Tp2Sp,
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

/// The median step time and the values rank 0 handed to the collectives per step, under `mode`.
fn run(mode: Mode, initial: &ByteLm, size: &Size) -> (Duration, f64) {
    let tp = if mode == Mode::Dp2 { 1 } else { 2 };
    let results = Accelerator::builder()
        .tp_size(tp)
        .sequence_parallel(mode == Mode::Tp2Sp)
        // Through host memory, where every value is counted (the step times compare like with like).
        .gradient_transport(GradientTransport::Host)
        .launch(2, |acc| {
            let device = acc.device().clone();
            let layout = acc.pipeline_layout();
            let rows = size.batch / layout.replicas;
            let mut model = acc.prepare_tensor_parallel(initial.clone(), &byte_lm::plan())?;
            let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 1e-2);
            let mask = generate_autoregressive_mask(1, size.seq, &device);
            let (mut times, mut values) = (Vec::new(), Vec::new());
            for step in 0..=size.steps {
                let (inputs, targets) = batch(
                    (step * size.batch + layout.replica * rows, rows),
                    size.seq,
                    &device,
                );
                acc.wait_for_everyone()?;
                let (started, before) = (Instant::now(), acc.host_values());
                acc.backward_batch(
                    &model,
                    (inputs, targets),
                    |m, (inputs, _)| m.embed(inputs.clone()),
                    |layer, x| layer.forward(x, None, Some(mask.clone())),
                    |m, x, (_, targets)| match mode {
                        Mode::Tp2Sp => m.parallel_loss(x, targets.clone()),
                        _ => m.loss(x, targets.clone()),
                    },
                )?;
                model = optimizer.try_step(model)?;
                let after = acc.host_values();
                if step > 0 {
                    times.push(started.elapsed());
                    values.push(after - before);
                }
            }
            values.sort_unstable();
            Ok((median(times), values[values.len() / 2]))
        })
        .expect("the bench's ranks train");
    let (time, values) = results[0];
    (time, values as f64)
}

fn main() {
    let size = Size {
        layers: env("TP_LAYERS", 4),
        width: env("TP_WIDTH", 128),
        seq: env("TP_SEQ", 64),
        batch: env("TP_BATCH", 16),
        steps: env("TP_STEPS", 5),
    };
    let rounds = env("TP_ROUNDS", 5);
    let device = burn::tensor::Device::default();
    device.seed(5);
    let initial = ByteLm::new(size.layers, size.width, 4, size.seq, &device);
    let params = initial.num_params();
    println!(
        "model=byte_lm layers={} width={} seq={} global_batch={} params={params} steps={} rounds={rounds} ranks=2",
        size.layers, size.width, size.seq, size.batch, size.steps
    );
    let modes = [Mode::Dp2, Mode::Tp2, Mode::Tp2Sp];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); modes.len()];
    let mut values = vec![0.0; modes.len()];
    for _ in 0..rounds {
        for (i, mode) in modes.iter().enumerate() {
            let (time, moved) = run(*mode, &initial, &size);
            times[i].push(time);
            values[i] = moved;
        }
    }
    let ms = |d: &[Duration]| median(d.to_vec()).as_secs_f64() * 1e3;
    println!(
        "step_ms dp2={:.2} tp2={:.2} tp2_sp={:.2}",
        ms(&times[0]),
        ms(&times[1]),
        ms(&times[2])
    );
    println!(
        "tp2_vs_dp2_step_ratio={:.3}",
        paired_ratio(&times[1], &times[0])
    );
    println!(
        "tp2_sp_vs_dp2_step_ratio={:.3}",
        paired_ratio(&times[2], &times[0])
    );
    // The formulas, in values (f32 here: 4 bytes each).
    let (l, tp) = (size.layers as f64, 2.0);
    let n = (size.batch * size.seq * size.width) as f64;
    let logits_part = (size.batch * size.seq * VOCAB) as f64 / tp;
    let d = size.width as f64;
    // Parameters kept whole: each layer's two norms and two row-parallel biases, the final norm, the positions.
    let whole_params = l * (2.0 * 2.0 * d + 2.0 * d) + 2.0 * d + (size.seq as f64) * d;
    // Loss parallelism all-reduces three values per token: the maximum, the sum of exponentials, the target's
    // logit.
    let loss = 3.0 * (size.batch * size.seq) as f64;
    let formulas = [
        params as f64,
        (4.0 * l + 2.0) * n + logits_part,
        l * (4.0 * n + 6.0 * n / tp) + 2.0 * n + 2.0 * n / tp + whole_params + loss,
    ];
    for ((name, measured), formula) in ["dp2", "tp2", "tp2_sp"].iter().zip(&values).zip(formulas) {
        println!(
            "values_per_step_{name}={measured:.0} formula={formula:.0} {name}_values_ratio={:.3}",
            measured / formula
        );
    }
}
