//! Whether loader workers hide the cost of building batches: a batcher that spends about 2 ms of CPU per batch
//! (standing in for decoding or tokenising) against a model step of similar cost.
//!
//! Three loops train the same model on the same batches, one epoch each per round, in turn:
//! - `workers`: the accelerator's prepared loader with the costly batcher and `num_workers(1)`;
//! - `free`: the same loader with a batcher that costs nothing beyond building the tensors (the ceiling);
//! - `burn`: Burn's own `DataLoader` with the costly batcher and `num_workers(1)`, through the same loop.
//!
//! Printed, as medians of per-round paired ratios: `loader_overlap_ratio` = steps/s of `workers` ÷ steps/s of
//! `free` (1.0: the batcher's cost is entirely hidden), `vs_burn_ratio` = steps/s of `workers` ÷ steps/s of
//! `burn`, `inline_ratio` = the costly batcher without workers ÷ `free` (what workers save), and
//! `noise_floor` = `free` against a second `free` loop.
//!
//! `cargo bench -p burn-accelerate-examples --bench loader` (`LOADER_ROUNDS` rounds, default 15).

#[path = "../tests/support/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};
use burn_accelerate::Accelerator;
use burn_accelerate::data::DataLoaderBuilder;
use stats::{median, paired_ratio};

const FEATURES: usize = 256;
const HIDDEN: usize = 384;
const BATCH: usize = 64;
const STEPS: usize = 48;
/// CPU time the costly batcher spends per batch.
const BATCH_COST: Duration = Duration::from_millis(2);

#[derive(Module, Debug)]
struct Net {
    input: Linear,
    hidden: Linear,
    output: Linear,
    relu: Relu,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self {
            input: LinearConfig::new(FEATURES, HIDDEN).init(device),
            hidden: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, 1).init(device),
            relu: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<2>) -> Tensor<1> {
        let h = self.relu.forward(self.input.forward(x));
        let h = self.relu.forward(self.hidden.forward(h));
        self.output.forward(h).powi_scalar(2).mean()
    }
}

/// Stacks items into a batch, spending `cost` of CPU first.
#[derive(Clone)]
struct Stack {
    cost: Duration,
}

impl Batcher<Vec<f32>, Tensor<2>> for Stack {
    fn batch(&self, items: Vec<Vec<f32>>, device: &Device) -> Tensor<2> {
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < self.cost {
            for i in 0..1000u64 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
            }
        }
        std::hint::black_box(x);
        let n = items.len();
        let flat: Vec<f32> = items.into_iter().flatten().collect();
        Tensor::<1>::from_floats(flat.as_slice(), device).reshape([n, FEATURES])
    }
}

fn dataset() -> InMemDataset<Vec<f32>> {
    InMemDataset::new(
        (0..STEPS * BATCH)
            .map(|i| {
                (0..FEATURES)
                    .map(|j| ((i * 31 + j * 7) % 97) as f32 / 97.0)
                    .collect()
            })
            .collect(),
    )
}

fn main() -> burn_accelerate::Result<()> {
    let rounds: usize = std::env::var("LOADER_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let accelerator = Accelerator::new()?;
    let device = accelerator.device().clone();
    let costly = Stack { cost: BATCH_COST };
    let free = Stack {
        cost: Duration::ZERO,
    };
    let prepared = |batcher: Stack, workers: usize| {
        let builder = DataLoaderBuilder::new(batcher).batch_size(BATCH);
        let builder = if workers > 0 {
            builder.num_workers(workers)
        } else {
            builder
        };
        accelerator.prepare_dataloader(builder.build(dataset()))
    };
    let with_workers = prepared(costly.clone(), 1)?;
    let inline = prepared(costly.clone(), 0)?;
    let ceiling = prepared(free.clone(), 0)?;
    let burn_loader = burn::data::dataloader::DataLoaderBuilder::new(costly)
        .batch_size(BATCH)
        .num_workers(1)
        .set_device(device.clone())
        .build(dataset());

    let mut model = accelerator.prepare_model(Net::new(&device))?;
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), 1e-4);
    let mut epoch =
        |batches: &mut dyn Iterator<Item = Tensor<2>>| -> burn_accelerate::Result<Duration> {
            let start = Instant::now();
            for x in batches {
                let loss = model.loss(x);
                accelerator.backward(loss, &model)?;
                model = optimizer.step(model.clone());
            }
            Ok(start.elapsed())
        };

    let mut times: [Vec<Duration>; 5] = Default::default();
    for round in 0..=rounds {
        let measured = [
            epoch(&mut with_workers.iter().map(|b| b.expect("batch")))?,
            epoch(&mut ceiling.iter().map(|b| b.expect("batch")))?,
            epoch(&mut burn_loader.iter().map(|b| b.expect("batch")))?,
            epoch(&mut inline.iter().map(|b| b.expect("batch")))?,
            epoch(&mut ceiling.iter().map(|b| b.expect("batch")))?,
        ];
        // Round 0 warms every path up.
        if round > 0 {
            for (all, t) in times.iter_mut().zip(measured) {
                all.push(t);
            }
        }
    }
    let [workers, free_a, burn, inline, free_b] = times;
    let per_step = |t: &[Duration]| median(t.to_vec()).as_secs_f64() * 1e3 / STEPS as f64;
    println!(
        "model=mlp-{FEATURES}-{HIDDEN}-{HIDDEN}-1 batch={BATCH} steps={STEPS} batch_cost_ms={} rounds={rounds}",
        BATCH_COST.as_millis()
    );
    println!("workers_step_ms={:.3}", per_step(&workers));
    println!("free_step_ms={:.3}", per_step(&free_a));
    println!("burn_workers_step_ms={:.3}", per_step(&burn));
    println!("inline_step_ms={:.3}", per_step(&inline));
    println!(
        "loader_overlap_ratio={:.3}",
        paired_ratio(&free_a, &workers)
    );
    println!("vs_burn_ratio={:.3}", paired_ratio(&burn, &workers));
    println!("inline_ratio={:.3}", paired_ratio(&free_a, &inline));
    println!("noise_floor={:.3}", paired_ratio(&free_b, &free_a));
    Ok(())
}
