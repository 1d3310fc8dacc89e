//! Where a data-parallel training step spends its time on the CPU, phase by phase: the workload of the PyTorch +
//! Accelerate comparison (an MLP 256 → 1024 → 1024 → 10 with ReLU, cross-entropy, AdamW at lr 1e-3, batch 128 per
//! rank, synthetic data made up front) on in-process ranks (2 by default), with the fused AdamW
//! ([`FusedAdamWConfig`](burn_accelerate::optim::FusedAdamWConfig)).
//!
//! Each rank times what runs in its own loop (taking the next batch from the prepared dataloader, the forward
//! pass with the loss) and reads the rest from the accelerator's [`StepPhases`](burn_accelerate::StepPhases)
//! (backward, gradient sync, optimizer). Prints, for rank 0, each phase in ms per step and its share of the step
//! (`phase_<name>_ms=`, `phase_<name>_share=`), the step itself (`step_ms=`), and `overlap_bound_ratio`: the step
//! time if the whole gradient sync overlapped the backward pass (the most that DDP's bucketed all-reduce during
//! backward could win) over today's step time.
//!
//! `cargo bench -p burn-accelerate-examples --bench step_phases` (`STEP_PHASES_RANKS`, `STEP_PHASES_STEPS`: defaults
//! 2 and 40, after 5 warm-up steps; `STEP_PHASES_ADAMW=burn` for Burn's AdamW instead of the fused one). Built with `--features mpi` and run under `burn-accelerate launch
//! --num-processes 2` (or `mpirun`), each process is a rank: what `benches/vs_pytorch.sh` times against PyTorch +
//! Accelerate under `torchrun`.

#[path = "support/relu_mlp.rs"]
mod relu_mlp;

use std::time::{Duration, Instant};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::optim::FusedAdamWConfig;
use burn_accelerate::{Accelerator, StepPhases};
use relu_mlp::ReluMlp;

const FEATURES: usize = 256;
const WIDTH: usize = 1024;
const CLASSES: usize = 10;
const BATCH: usize = 128;
const WARM_UP: usize = 5;
const LR: f64 = 1e-3;

#[derive(Debug, Clone)]
struct Sample {
    x: Vec<f32>,
    y: i64,
}

#[derive(Debug, Clone)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}
burn_accelerate::impl_to_device!(Batch { x, y });

#[derive(Debug, Clone)]
struct Stack;

impl Batcher<Sample, Batch> for Stack {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> Batch {
        let n = items.len();
        let xs: Vec<f32> = items.iter().flat_map(|s| s.x.iter().copied()).collect();
        let ys: Vec<i64> = items.iter().map(|s| s.y).collect();
        Batch {
            x: Tensor::<1>::from_floats(xs.as_slice(), device).reshape([n, FEATURES]),
            y: Tensor::<1, Int>::from_ints(ys.as_slice(), device),
        }
    }
}

/// `n` samples whose class is the argmax of a fixed projection of their features, made up front.
fn samples(n: usize) -> Vec<Sample> {
    (0..n)
        .map(|i| {
            let x: Vec<f32> = (0..FEATURES)
                .map(|j| (((i * 131 + j * 17) % 97) as f32 / 48.5 - 1.0) * 0.5)
                .collect();
            let y = (0..CLASSES)
                .max_by(|&a, &b| {
                    let score = |c: usize| x.iter().skip(c).step_by(CLASSES).sum::<f32>();
                    score(a).total_cmp(&score(b))
                })
                .unwrap_or(0) as i64;
            Sample { x, y }
        })
        .collect()
}

/// One rank's phases over `steps` steps after the warm-up: (loader, forward, the accelerator's phases, wall time).
fn train(
    acc: &Accelerator,
    steps: usize,
) -> burn_accelerate::Result<(Duration, Duration, StepPhases, Duration)> {
    let device = acc.device().clone();
    device.seed(7);
    let mut model = acc.prepare_model(ReluMlp::new(&[FEATURES, WIDTH, WIDTH, CLASSES], &device))?;
    let adamw = match std::env::var("STEP_PHASES_ADAMW").as_deref() {
        Ok("burn") => AdamWConfig::new().init(),
        _ => FusedAdamWConfig::new().init(),
    };
    let mut optimizer = acc.prepare_optimizer(adamw, LR);
    let per_rank = (WARM_UP + steps) * BATCH;
    let loader = acc.prepare_dataloader(
        DataLoaderBuilder::new(Stack)
            .batch_size(BATCH)
            .build(InMemDataset::new(samples(per_rank * acc.num_processes()))),
    )?;
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let (mut loading, mut forward) = (Duration::ZERO, Duration::ZERO);
    let mut batches = loader.iter();
    let mut started = Instant::now();
    for step in 0..WARM_UP + steps {
        if step == WARM_UP {
            acc.reset_step_phases();
            (loading, forward) = (Duration::ZERO, Duration::ZERO);
            started = Instant::now();
        }
        let t = Instant::now();
        let Some(batch) = batches.next() else { break };
        let batch = batch?;
        loading += t.elapsed();
        let t = Instant::now();
        let loss = loss_fn.forward(model.forward(batch.x), batch.y);
        forward += t.elapsed();
        acc.backward(loss, &model)?;
        model = optimizer.step(model);
    }
    Ok((loading, forward, acc.step_phases(), started.elapsed()))
}

fn main() -> burn_accelerate::Result<()> {
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let steps = env("STEP_PHASES_STEPS", 40);
    // Under `mpirun` / `burn-accelerate launch` (feature `mpi`) each process is a rank; else in-process ranks.
    let (ranks, rank0) = if burn_accelerate::distributed::cluster::launched_by_mpi() {
        let acc = Accelerator::new()?;
        let result = train(&acc, steps)?;
        if !acc.is_main_process() {
            return Ok(());
        }
        (acc.num_processes(), result)
    } else {
        let ranks = env("STEP_PHASES_RANKS", 2);
        let results = Accelerator::builder().launch(ranks, move |acc| train(&acc, steps))?;
        (ranks, results[0])
    };
    report(ranks, rank0);
    Ok(())
}

/// Prints rank 0's phases (see the module's documentation).
fn report(
    ranks: usize,
    (loading, forward, phases, wall): (Duration, Duration, StepPhases, Duration),
) {
    let steps = phases.steps.max(1) as f64;
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps;
    let step = ms(wall);
    println!(
        "ranks={ranks} steps={} batch_per_rank={BATCH}",
        phases.steps
    );
    let all = [
        ("loader", loading),
        ("forward", forward),
        ("backward", phases.backward),
        ("gradient_sync", phases.gradient_sync),
        ("optimizer", phases.optimizer),
    ];
    for (name, d) in all {
        println!(
            "phase_{name}_ms={:.3} phase_{name}_share={:.3}",
            ms(d),
            ms(d) / step
        );
    }
    let other = step - all.iter().map(|(_, d)| ms(*d)).sum::<f64>();
    println!("phase_other_ms={other:.3}");
    println!(
        "step_ms={step:.3} samples_per_s={:.0}",
        ranks as f64 * BATCH as f64 * 1e3 / step
    );
    let hidden = ms(phases.gradient_sync).min(ms(phases.backward));
    println!("overlap_bound_ratio={:.3}", (step - hidden) / step);
}
