//! Training-step time of the quicktour MLP in f32, bf16 and fp16 (autocast, f32 master weights), as ratios to
//! f32 measured in the same run: `cargo bench -p burn-accelerate-examples --bench mixed_precision`.
//! Builds with `--no-default-features --features wgpu` measure the wgpu device the same way (bf16 is skipped
//! where the device cannot compute it).

#[path = "../examples/support/mlp.rs"]
mod mlp;

use std::time::{Duration, Instant};

use burn::data::dataloader::batcher::Batcher;
use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, MixedPrecision};
use mlp::{Mlp, SampleBatcher};

const STEPS: usize = 64;

fn epoch_time(precision: MixedPrecision) -> Option<Duration> {
    let accelerator = match Accelerator::builder().mixed_precision(precision).build() {
        Ok(a) => a,
        Err(e) => {
            println!("precision={precision} skipped: {e}");
            return None;
        }
    };
    let mut model = accelerator
        .prepare_model(Mlp::new(accelerator.device()))
        .ok()?;
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), 1e-3);
    let batches: Vec<mlp::Batch> = mlp::samples(32 * STEPS, 3)
        .chunks(32)
        .map(|c| SampleBatcher.batch(c.to_vec(), accelerator.device()))
        .collect();
    let mut times = Vec::new();
    for round in 0..12 {
        let start = Instant::now();
        for batch in &batches {
            let loss = accelerator.autocast(&model, batch.clone(), |m, b| m.loss(b));
            accelerator.backward(loss, &model).ok()?;
            model = optimizer.step(model);
        }
        // Wait for the device (asynchronous backends) before stopping the clock.
        let _ = accelerator.device().sync();
        if round >= 2 {
            times.push(start.elapsed());
        }
    }
    times.sort();
    Some(times[times.len() / 2])
}

fn main() {
    let f32_time = epoch_time(MixedPrecision::No).expect("f32 always runs");
    let step = |d: Duration| d.as_secs_f64() * 1e6 / STEPS as f64;
    println!(
        "model=quicktour-mlp batch=32 f32_step_us={:.1}",
        step(f32_time)
    );
    for precision in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        if let Some(t) = epoch_time(precision) {
            println!(
                "precision={precision} step_us={:.1} {precision}_vs_f32_time_ratio={:.3}",
                step(t),
                t.as_secs_f64() / f32_time.as_secs_f64()
            );
        }
    }
}
