//! Training throughput of a wide MLP through the Accelerator, against the raw Burn loop in the same process, in
//! samples per second: the figure the GPU kit sets beside PyTorch + Accelerate, whose script
//! (`scripts/gpu/torch_throughput.py`) trains the same model (features → width → width → features, ReLU), on
//! the same shapes, with the same loss (mean squared error) and optimizer (Adam, lr 1e-4).
//!
//! The batch is made once on the device (no data loading is timed). Rounds of the two loops alternate, and the
//! median of the per-round ratios is the figure; each round ends by reading the loss, which waits for the device.
//! Prints `accelerate_samples_per_s`, `raw_burn_samples_per_s` and `throughput_overhead_ratio` (accelerated time
//! / raw time per step: above 1 means slower through the Accelerator); under mixed precision
//! (`ACCELERATE_MIXED_PRECISION=bf16` or `fp16`) the raw loop, which has none, is not run.
//!
//! `cargo bench -p burn-accelerate-examples --bench throughput` (small shapes suit a CPU: set `THROUGHPUT_FEATURES`,
//! `THROUGHPUT_WIDTH`, `THROUGHPUT_BATCH`, `THROUGHPUT_STEPS`, `THROUGHPUT_ROUNDS`; defaults 1024, 4096, 512,
//! 50, 5).

#[path = "support/relu_mlp.rs"]
mod relu_mlp;
#[path = "../tests/support/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::{Accelerator, MixedPrecision};
use relu_mlp::ReluMlp;
use stats::{median, paired_ratio};

const LR: f64 = 1e-4;

/// The mean squared error of `model` on `x` against `y`.
fn mse(model: &ReluMlp, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (model.forward(x) - y).powi_scalar(2).mean()
}

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn main() -> burn_accelerate::Result<()> {
    burn_accelerate::logging::init(None);
    let features = setting("THROUGHPUT_FEATURES", 1024);
    let width = setting("THROUGHPUT_WIDTH", 4096);
    let batch = setting("THROUGHPUT_BATCH", 512);
    let steps = setting("THROUGHPUT_STEPS", 50);
    let rounds = setting("THROUGHPUT_ROUNDS", 5);

    let accelerator = Accelerator::new()?;
    let device = accelerator.device().clone();
    let precision = accelerator.config().precision.mixed_precision;
    device.seed(0);
    let initial = ReluMlp::new(&[features, width, width, features], &device);
    let x = Tensor::<2>::random([batch, features], Distribution::Normal(0.0, 1.0), &device);
    let y = x.clone().sin();

    // Raw Burn, as a user writes it, on the accelerator's device (f32).
    let mut raw_model = initial.clone();
    let mut raw_optim = AdamConfig::new().init();
    let mut raw_round = |steps: usize| {
        let start = Instant::now();
        let mut loss = None;
        for _ in 0..steps {
            let l = mse(&raw_model, x.clone(), y.clone());
            let grads = GradientsParams::from_grads(l.backward(), &raw_model);
            raw_model = raw_optim.step(LR, raw_model.clone(), grads);
            loss = Some(l);
        }
        let last = loss.map_or(f32::NAN, |l| l.into_scalar::<f32>());
        (start.elapsed(), last)
    };

    // Through the Accelerator.
    let mut model = accelerator.prepare_model(initial)?;
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), LR);
    let mut acc_round = |steps: usize| -> burn_accelerate::Result<(Duration, f32)> {
        let start = Instant::now();
        let mut loss = None;
        for _ in 0..steps {
            // The forward in the run's precision, the loss in f32 (as torch.autocast does).
            let out = accelerator.autocast(&model, x.clone(), |m, x| m.forward(x));
            let l = (out - y.clone()).powi_scalar(2).mean();
            accelerator.backward(l.clone(), &model)?;
            model = optimizer.step(model.clone());
            loss = Some(l);
        }
        let last = loss.map_or(f32::NAN, |l| l.into_scalar::<f32>());
        Ok((start.elapsed(), last))
    };

    let raw_too = precision == MixedPrecision::No;
    // Warm up both paths (kernel compilation, autotuning, allocator pools).
    acc_round(steps.min(10))?;
    if raw_too {
        raw_round(steps.min(10));
    }
    let (mut acc, mut raw, mut last) = (Vec::new(), Vec::new(), f32::NAN);
    for round in 0..rounds {
        if raw_too && round % 2 == 1 {
            raw.push(raw_round(steps).0);
        }
        let (time, loss) = acc_round(steps)?;
        acc.push(time);
        last = loss;
        if raw_too && round % 2 == 0 {
            raw.push(raw_round(steps).0);
        }
    }
    let per_s = |d: Duration| (steps * batch) as f64 / d.as_secs_f64();
    let params = features * width * 2 + width * width + 2 * width + features;
    println!(
        "model=wide-mlp features={features} width={width} params={params} batch={batch} steps={steps} rounds={rounds} precision={precision} device={device:?}"
    );
    // Each round's pair (run back to back) cancels slow drift in the machine's speed.
    let ratio = raw_too.then(|| paired_ratio(&acc, &raw));
    println!("accelerate_samples_per_s={:.1}", per_s(median(acc)));
    if let Some(ratio) = ratio {
        println!("raw_burn_samples_per_s={:.1}", per_s(median(raw)));
        println!("throughput_overhead_ratio={ratio:.4}");
    }
    println!("final_loss={last:.6}");
    Ok(())
}
