//! The pipeline's bubble on this machine: each stage's measured idle share of a step (from its trace: the step's
//! time less its forward and backward passes) against the schedule's `(pp − 1) / (m + pp − 1)`, for GPipe and 1F1B,
//! `pp_size` 2 and 4, 2, 4 and 8 micro-batches, in-process ranks each with its share of the cores (one compute
//! thread a rank on 2 cores). The model's stages
//! are balanced: equal square layers, the layers before and after them tiny. Writes each run's Chrome / Perfetto
//! trace to `target/pipeline-trace-pp<P>-m<M>-<schedule>-<memory>.json` (open it at ui.perfetto.dev) and its
//! picture beside it (`.svg`). The stages' compute
//! must dwarf a transfer's fixed cost for the formula to hold: 8 layers of 768 × 768 on 128 rows per micro-batch.
//! With `pp_size` 4 on a 2-core machine, 4 ranks share 2 cores: reported, not comparable to the formula.
//! Runs `pp_size` 2 twice: with glibc's default allocator, then keeping the memory it frees (see
//! `keep_freed_memory`), and `pp_size` 4 with the latter; the traces are named after the allocator
//! (`...-default.json`, `...-kept.json`).
//! `cargo bench -p burn-accelerate-examples --bench pipeline` (`PP_WIDTH`, `PP_ROWS`, `PP_STEPS` to change the size).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::Tensor;
use burn_accelerate::pipeline_parallel::{chrome_trace, svg_trace};
use burn_accelerate::{Accelerator, Blocks, PipelineSchedule, StageTrace};

#[derive(Module, Debug)]
struct Stack {
    input: Linear,
    layers: Vec<Linear>,
    head: Linear,
}

impl Blocks for Stack {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.layers
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Every stage's trace of each steady step.
fn run(stages: usize, micro_batches: usize, schedule: PipelineSchedule) -> Vec<Vec<StageTrace>> {
    let (width, rows, steps) = (
        env("PP_WIDTH", 768),
        env("PP_ROWS", 128),
        env("PP_STEPS", 16),
    );
    let layers = 8;
    let out = Accelerator::builder()
        .pp_size(stages)
        .pp_microbatches(micro_batches)
        .pp_schedule(schedule)
        .launch(stages, |acc| {
            let device = acc.device().clone();
            let model = Stack {
                input: LinearConfig::new(8, width).init(&device),
                layers: (0..layers)
                    .map(|_| LinearConfig::new(width, width).init(&device))
                    .collect(),
                head: LinearConfig::new(width, 1).init(&device),
            };
            let mut model = acc.prepare_blocks(model)?;
            let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 1e-3);
            let mut traces = Vec::new();
            for step in 0..steps + 2 {
                let x = Tensor::<2>::ones([rows * micro_batches, 8], &device);
                let y = Tensor::<2>::zeros([rows * micro_batches, 1], &device);
                acc.backward_batch(
                    &model,
                    (x, y),
                    |m, (x, _)| m.input.forward(x.clone()),
                    |layer, h| layer.forward(h).tanh(),
                    |m, h, (_, y)| (m.head.forward(h) - y.clone()).powi_scalar(2).mean(),
                )?;
                model = optimizer.try_step(model)?;
                if step >= 2 {
                    traces.extend(acc.pipeline_trace());
                }
            }
            Ok(traces)
        })
        .expect("the pipelined run");
    // Step by step, every stage's trace.
    (0..out[0].len())
        .map(|step| out.iter().map(|stage| stage[step].clone()).collect())
        .collect()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// glibc hands memory freed at a step's end back to the system and the next step's first passes fault it in anew,
/// which makes them slower than the rest (a first backward pass 20–30 % slower here, GPipe's growing forward passes
/// 15 %); the formula assumes equal passes. A process started with these variables keeps what its allocator frees
/// (glibc's tunables; other allocators ignore them), which makes the passes equal.
const KEEP_FREED_MEMORY: [(&str, &str); 2] = [
    ("MALLOC_TRIM_THRESHOLD_", "1073741824"),
    ("MALLOC_MMAP_THRESHOLD_", "33554432"),
];

/// Runs every case of `stage_counts` and prints its idle shares, with `allocator` in each line.
fn report(stage_counts: &[usize], allocator: &str) {
    for &stages in stage_counts {
        for micro_batches in [2, 4, 8] {
            for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
                let steps = run(stages, micro_batches, schedule);
                let ideal = steps[0][0].ideal_idle_fraction();
                let idle: Vec<f64> = (0..stages)
                    .map(|s| median(steps.iter().map(|t| t[s].idle_fraction()).collect()))
                    .collect();
                let worst = idle.iter().map(|i| (i - ideal).abs()).fold(0.0, f64::max);
                println!(
                    "{stages}  {micro_batches}  {:<8}  {allocator:<7}  {ideal:.3}   {}   {worst:.3}",
                    schedule.name(),
                    idle.iter()
                        .map(|i| format!("{i:.3}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                );
                let path = format!(
                    "target/pipeline-trace-pp{stages}-m{micro_batches}-{}-{allocator}.json",
                    schedule.name()
                );
                let last = steps.last().expect("a steady step");
                std::fs::write(&path, chrome_trace(last).to_string()).expect("the trace file");
                let picture = path.replace(".json", ".svg");
                std::fs::write(&picture, svg_trace(last)).expect("the trace's picture");
            }
        }
    }
}

fn main() {
    // In-process ranks compute in pools of their own, each its share of the cores (one thread a rank here): the
    // stages run side by side, as the bubble's formula assumes. (RAYON_NUM_THREADS would put them in one pool.)
    match std::env::var("PP_BENCH_MEMORY").as_deref() {
        Ok("default") => return report(&[2], "default"),
        Ok("kept") => return report(&[2, 4], "kept"),
        _ => {}
    }
    println!(
        "pp  m  schedule  memory   ideal   measured idle share per stage (median of steps)   worst |Δ|"
    );
    // Each allocator setting in a process of its own: first as glibc does by default, then keeping freed memory.
    let me = std::env::current_exe().expect("the bench's own path");
    for (memory, vars) in [("default", &[][..]), ("kept", &KEEP_FREED_MEMORY[..])] {
        let status = std::process::Command::new(&me)
            .env("PP_BENCH_MEMORY", memory)
            .envs(vars.iter().copied())
            .status()
            .expect("the bench's run");
        assert!(status.success(), "the run with {memory} memory failed");
    }
}
