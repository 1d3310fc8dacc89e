//! The parity harness: one small training run under each setting users combine with data parallelism, on one
//! rank, on in-process ranks (`--processes N`) or as one rank of an MPI job (`mpirun`, `burn-accelerate
//! launch`). Every rank writes what it ended with, so that `tests/suite/parity_in_process.rs` and `tests/mpi/parity_mpi.rs` compare
//! runs value by value rather than by printed losses:
//!
//! - `<out>/<case>/rank<r>.safetensors`: rank `r`'s final weights (every float parameter, in visiting order);
//! - `<out>/<case>/rank<r>.json`: what the run counted (optimizer steps, clipped and skipped steps, the loss
//!   scale, the settings the rank saw), the id of every training sample it used with its micro-step, and, for
//!   `eval`, the ids and losses `gather_for_metrics` returned.
//!
//! The global batch is fixed (`--global-batch`, 24) and divided between the ranks, and the loss of a batch is
//! its summed squared error over the *nominal* per-rank batch, so that P ranks compute the gradient of one
//! process with the combined batch even where the ranks' last batches differ in size (`uneven`).
//!
//! ```text
//! cargo run --release --example parity_harness -- --out /tmp/parity/one
//! cargo run --release --example parity_harness -- --out /tmp/parity/two --processes 2
//! mpirun -np 3 target/release/examples/parity_harness --out /tmp/parity/three   # built with --features mpi
//! ```
//!
//! Cases (`--case`, repeatable; all of the first seven by default): `dp` (plain data parallelism, 21 steps a
//! run), `accumulation` (3 micro-batches a step, 7 rounds an epoch: every last window is short), `clip-norm`
//! and `clip-value` (clipping that bites on most steps), `bf16` and `fp16` (mixed precision; fp16 scales the
//! loss), `uneven` (`even_batches(false)` and a short last round), `eval` (`gather_for_metrics` of an
//! evaluation set that the ranks do not divide), `stream` (`gather_for_metrics` of a stream of 103 ids, read by
//! every rank or, with `--dispatch-batches`, by the main process alone), `resume` (`dp` saved at `--save-at`, killed by SIGKILL at
//! `--kill-at` on `--kill-rank`, and resumed with `--resume`), `env` (only writes the settings the rank sees),
//! `initial` (the weights every case starts from; run by default too).
//!
//! `--accumulation K` and `--mixed-precision fp16` apply to any case (the `resume` case with both is how a
//! resume on another number of ranks is checked). `--sharding SHARD_GRAD_OP` or `FULL_SHARD` shards the training state (the loop gathers the model with
//! `unshard` for every forward pass, as a sharded loop does; the weights written are the whole model); each
//! report then also says how many bytes of optimizer state the rank held.

#[path = "support/mlp.rs"]
mod mlp;
#[path = "support/ranks.rs"]
mod ranks;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{
    Accelerator, AcceleratorBuilder, LossScaler, MixedPrecision, Result, ShardingStrategy,
    StateToSave,
};
use clap::{Parser, ValueEnum};
use mlp::{Mlp, Sample, SampleBatcher};
use serde::{Deserialize, Serialize};

/// Samples per optimizer step over all ranks.
const GLOBAL_BATCH: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Case {
    Dp,
    Accumulation,
    ClipNorm,
    ClipValue,
    Bf16,
    Fp16,
    Uneven,
    Eval,
    Stream,
    Resume,
    Env,
    Initial,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Dp => "dp",
            Case::Accumulation => "accumulation",
            Case::ClipNorm => "clip-norm",
            Case::ClipValue => "clip-value",
            Case::Bf16 => "bf16",
            Case::Fp16 => "fp16",
            Case::Uneven => "uneven",
            Case::Eval => "eval",
            Case::Stream => "stream",
            Case::Resume => "resume",
            Case::Env => "env",
            Case::Initial => "initial",
        }
    }
}

#[derive(Parser, Debug)]
struct Args {
    /// Folder the ranks write their results into (`<out>/<case>/rank<r>.*`).
    #[arg(long)]
    out: PathBuf,
    /// The cases to run, in this order (default: dp, accumulation, clip-norm, clip-value, bf16, fp16, uneven,
    /// initial).
    #[arg(long = "case", value_enum)]
    cases: Vec<Case>,
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// `resume`: save the training state after this optimizer step.
    #[arg(long, default_value_t = 10)]
    save_at: usize,
    /// `resume`: SIGKILL `--kill-rank` after this optimizer step (0: never).
    #[arg(long, default_value_t = 0)]
    kill_at: usize,
    /// `resume`: the rank that `--kill-at` kills.
    #[arg(long, default_value_t = 0)]
    kill_rank: usize,
    /// `resume`: continue from the state saved at `--save-at` (as a job restarted by `launch --max-restarts`
    /// does; a resumed run neither saves nor is killed).
    #[arg(long)]
    resume: bool,
    /// Shard the training state (`NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD`, or Accelerate's numbers); the
    /// environment's setting when absent.
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// The gradient bucket in MiB (small buckets make sharded ranks exchange most parameters alone).
    #[arg(long)]
    bucket_size_mb: Option<f64>,
    /// Ranks per shard group of a hybrid `--sharding` (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`).
    #[arg(long)]
    dp_shard_size: Option<usize>,
    /// `stream`: only the main process reads the stream and sends each rank its batches (`dispatch_batches`).
    #[arg(long)]
    dispatch_batches: bool,
    /// `stream`: read this many rounds of 24 ids (24 / P a rank), save the state in `<out>/stream-state` and
    /// stop; with `--resume`, load that state and read the rest of the epoch, then one whole epoch.
    #[arg(long)]
    stream_save_rounds: Option<usize>,
    /// Micro-batches per optimizer step, whatever the case (`resume` with accumulation).
    #[arg(long)]
    accumulation: Option<usize>,
    /// Mixed precision (`no`, `fp16`, `bf16`), whatever the case (`resume` in fp16).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// Train through `backward_blocks` (the input layer is the model's one block): block-wise under
    /// `FULL_SHARD`, recomputed with `--checkpointing`.
    #[arg(long)]
    blocks: bool,
    /// Activation checkpointing (with `--blocks`).
    #[arg(long)]
    checkpointing: bool,
}

/// What a rank counted, written beside its weights.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Report {
    rank: usize,
    num_processes: usize,
    steps: usize,
    clipped_steps: usize,
    skipped_steps: usize,
    loss_scale: Option<f64>,
    /// fp16: the whole loss scaler (scale and growth tracker) when the state was saved, and right after a resume
    /// loaded it: the two must be equal.
    scaler_at_save: Option<LossScaler>,
    scaler_at_resume: Option<LossScaler>,
    /// Optimizer steps taken (and skipped) before the save.
    steps_at_save: Option<usize>,
    skipped_at_save: Option<usize>,
    mixed_precision: String,
    gradient_accumulation_steps: usize,
    resumed_at: Option<usize>,
    sharding: String,
    optimizer_state_bytes: usize,
    gathered_ids: Vec<i64>,
    gathered_losses: Vec<f32>,
    /// `(micro-step, sample id)` of every training sample this rank used, in order.
    trained_ids: Vec<(usize, i64)>,
    /// `stream`: how many times this process opened the stream.
    stream_opened: usize,
    env: BTreeMap<String, String>,
}

/// The builder of each case, on top of the settings the launcher or the environment gave.
fn builder(case: Case, args: &Args) -> AcceleratorBuilder {
    let mut builder = Accelerator::builder();
    if let Some(sharding) = args.sharding {
        builder = builder.sharding(sharding);
    }
    if let Some(mib) = args.bucket_size_mb {
        builder = builder.bucket_size_mb(mib);
    }
    if let Some(size) = args.dp_shard_size {
        builder = builder.dp_shard_size(size);
    }
    builder = match case {
        Case::Accumulation => builder.gradient_accumulation_steps(3),
        Case::Bf16 => builder.mixed_precision(MixedPrecision::Bf16),
        Case::Fp16 => builder.mixed_precision(MixedPrecision::Fp16),
        Case::Uneven => builder.even_batches(false),
        _ => builder,
    };
    if let Some(steps) = args.accumulation {
        builder = builder.gradient_accumulation_steps(steps);
    }
    if let Some(precision) = args.mixed_precision {
        builder = builder.mixed_precision(precision);
    }
    builder.activation_checkpointing(args.checkpointing)
}

/// Samples in the training set and passes over it, per case.
fn schedule(case: Case) -> (usize, usize) {
    match case {
        // 21 steps.
        Case::Dp | Case::ClipNorm | Case::ClipValue | Case::Bf16 | Case::Fp16 | Case::Resume => {
            (GLOBAL_BATCH * 7, 3)
        }
        // 7 rounds an epoch in windows of 3, 3 and 1: 21 steps over 7 epochs.
        Case::Accumulation => (GLOBAL_BATCH * 7, 7),
        // 140 samples: 5 full rounds and one of 20 (12 + 8 on 2 ranks, 8 + 8 + 4 on 3): 24 steps.
        Case::Uneven => (140, 4),
        Case::Eval | Case::Stream | Case::Env | Case::Initial => (0, 0),
    }
}

/// The loss of a batch: its summed squared error over the nominal per-rank batch.
fn loss(model: &Mlp, batch: mlp::Batch, nominal: usize) -> Tensor<1> {
    (model.forward(batch.x) - batch.y)
        .powi_scalar(2)
        .sum()
        .div_scalar(nominal as f32)
}

/// Progress of the run, registered for checkpointing.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Progress {
    step: usize,
}

fn train(acc: &Accelerator, case: Case, args: &Args, initial: Mlp) -> Result<(Mlp, Report)> {
    let p = acc.num_processes();
    if !GLOBAL_BATCH.is_multiple_of(p) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "the global batch {GLOBAL_BATCH} is not divisible by {p} ranks"
        )));
    }
    let per_rank = GLOBAL_BATCH / p;
    let progress = Arc::new(Mutex::new(Progress::default()));
    acc.register_for_checkpointing("progress", progress.clone())?;
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let (samples, epochs) = schedule(case);
    let train = acc.prepare_dataloader(
        DataLoaderBuilder::new(EvalBatcher)
            .batch_size(per_rank)
            .shuffle(5)
            .build(indexed(mlp::samples(samples, 3))),
    )?;
    let mut report = Report::default();
    let checkpoint = args.out.join("resume-state");
    // With `--resume`, or when `burn-accelerate launch --max-restarts` restarted the job.
    let resuming = args.resume || acc.restart_count() > 0;
    if case == Case::Resume && resuming {
        let mut state = acc.load_state(Some(&checkpoint))?;
        model = state.model(model)?;
        state.optimizer(&mut optimizer)?;
        state.finish()?;
        report.resumed_at = Some(progress.lock().unwrap().step);
        report.scaler_at_resume = acc.loss_scaler();
    }
    let total = train.len() * epochs;
    let mut micro = progress.lock().unwrap().step;
    'training: while micro < total {
        for batch in train.iter() {
            let EvalBatch { batch, ids } = batch?;
            let ids = ids.into_data();
            report
                .trained_ids
                .extend(ids.iter::<i64>().map(|id| (micro + 1, id)));
            acc.accumulate();
            let mixed = matches!(case, Case::Bf16 | Case::Fp16) || args.mixed_precision.is_some();
            if args.blocks {
                // Block by block: the input layer is gathered (FULL_SHARD) and recomputed on its own, each part
                // under autocast as the whole model would be.
                let mlp::Batch { x, y } = batch;
                acc.backward_blocks(
                    &model,
                    |_| x.clone(),
                    |layer, x| acc.autocast(layer, x, Mlp::hidden),
                    |model, h| {
                        acc.autocast(model, (h, y), |model, (h, y)| {
                            (model.head(h) - y)
                                .powi_scalar(2)
                                .sum()
                                .div_scalar(per_rank as f32)
                        })
                    },
                )?;
            } else {
                // Under FULL_SHARD the model holds this rank's parameters only; elsewhere this is a clone.
                let whole = acc.unshard(&model)?;
                let loss = if mixed {
                    acc.autocast(&whole, batch, |model, batch| loss(model, batch, per_rank))
                } else {
                    loss(&whole, batch, per_rank)
                };
                acc.backward(loss, &whole)?;
            }
            if acc.sync_gradients() {
                let clipped = match case {
                    Case::ClipNorm => acc.clip_grad_norm(&model, 0.5)? > 0.5,
                    Case::ClipValue => {
                        let largest = max_abs_grad(acc, &model)?;
                        acc.clip_grad_value(&model, 0.05)?;
                        largest > 0.05
                    }
                    _ => false,
                };
                report.clipped_steps += usize::from(clipped);
            }
            model = optimizer.try_step(model)?;
            if acc.sync_gradients() {
                report.steps += 1;
                if acc.optimizer_step_was_skipped() {
                    report.skipped_steps += 1;
                }
            }
            micro += 1;
            progress.lock().unwrap().step = micro;
            if case == Case::Resume {
                if micro == args.save_at && !resuming {
                    let parts = StateToSave::new().model(&model)?.optimizer(&optimizer)?;
                    acc.save_state(Some(&checkpoint), &parts)?;
                    report.scaler_at_save = acc.loss_scaler();
                    report.steps_at_save = Some(report.steps);
                    report.skipped_at_save = Some(report.skipped_steps);
                }
                if micro == args.kill_at && acc.process_index() == args.kill_rank && !resuming {
                    ranks::kill_self(args.kill_rank, &format!("after step {micro}"));
                }
            }
            if micro >= total {
                break 'training;
            }
        }
    }
    report.loss_scale = acc.loss_scale();
    report.optimizer_state_bytes = optimizer.state_bytes()?;
    Ok((model, report))
}

/// The largest absolute gradient of `model` on any rank (to see whether value clipping had anything to clip;
/// a sharded rank holds only its own parameters' gradients).
///
/// # Errors
/// The reduction over the ranks failed.
fn max_abs_grad(acc: &Accelerator, model: &Mlp) -> Result<f32> {
    struct Largest<'a>(&'a Accelerator, f32);
    impl ModuleVisitor for Largest<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.grad(param) {
                self.1 = self.1.max(grad.abs().max().into_scalar::<f32>());
            }
        }
    }
    let mut largest = Largest(acc, 0.0);
    model.visit(&mut largest);
    let local = Tensor::<1>::from_floats([largest.1], acc.device());
    acc.reduce(local, burn_accelerate::ReduceOp::Max)
        .map(|t| t.into_scalar::<f32>())
}

/// A sample with its index, so that a rank can say which samples it used.
#[derive(Debug, Clone)]
struct Indexed(i64, Sample);

/// `samples` numbered in order.
fn indexed(samples: Vec<Sample>) -> InMemDataset<Indexed> {
    InMemDataset::new(
        samples
            .into_iter()
            .enumerate()
            .map(|(i, s)| Indexed(i as i64, s))
            .collect(),
    )
}

#[derive(Debug, Clone)]
struct EvalBatch {
    batch: mlp::Batch,
    ids: Tensor<1, Int>,
}
burn_accelerate::impl_to_device!(EvalBatch { batch, ids });

#[derive(Debug, Clone, Default)]
struct EvalBatcher;

impl Batcher<Indexed, EvalBatch> for EvalBatcher {
    fn batch(&self, items: Vec<Indexed>, device: &Device) -> EvalBatch {
        let ids: Vec<i64> = items.iter().map(|s| s.0).collect();
        EvalBatch {
            batch: SampleBatcher.batch(items.into_iter().map(|s| s.1).collect(), device),
            ids: Tensor::from_data(ids.as_slice(), device),
        }
    }
}

/// `gather_for_metrics` over an evaluation set of 103 samples in batches of 8 per rank (no number of ranks
/// divides it): the ids and per-sample losses every rank gets back.
fn evaluate(acc: &Accelerator, initial: Mlp, report: &mut Report) -> Result<()> {
    let model = acc.prepare_model(initial)?;
    let model = acc.unshard(&model)?;
    let eval = acc.prepare_dataloader(
        DataLoaderBuilder::new(EvalBatcher)
            .batch_size(8)
            .build(indexed(mlp::samples(103, 41))),
    )?;
    for batch in eval.iter() {
        let EvalBatch { batch, ids } = batch?;
        let losses = (model.forward(batch.x) - batch.y)
            .powi_scalar(2)
            .squeeze_dim::<1>(1);
        let (ids, losses) = acc.gather_for_metrics((ids, losses))?;
        report.gathered_ids.extend(ids.into_data().iter::<i64>());
        report
            .gathered_losses
            .extend(losses.into_data().iter::<f32>());
    }
    Ok(())
}

/// A stream of the ids 0..103 (no number of ranks divides it) read by every rank or, with `--dispatch-batches`,
/// by the main process alone: the ids `gather_for_metrics` returns on this rank, and how many times this process
/// opened the stream. Batches of 8 a rank; with `--stream-save-rounds`, 24 ids a round (24 / P a rank) so that
/// the saved position means the same on any number of ranks, saved after that many rounds or, with `--resume`,
/// continued from there (the rest of the epoch, then one whole epoch).
fn read_stream(acc: &Accelerator, args: &Args, report: &mut Report) -> Result<()> {
    #[derive(Clone)]
    struct Ids;
    impl Batcher<i64, Tensor<1, Int>> for Ids {
        fn batch(&self, items: Vec<i64>, device: &Device) -> Tensor<1, Int> {
            Tensor::from_data(items.as_slice(), device)
        }
    }
    let per_rank = match args.stream_save_rounds {
        Some(_) => GLOBAL_BATCH / acc.num_processes(),
        None => 8,
    };
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = opened.clone();
    let stream = burn_accelerate::data::StreamLoader::new(Ids, per_rank, false, move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        (0..103i64).map(Ok)
    })
    .dispatch_batches(args.dispatch_batches);
    let prepared = acc.prepare_stream(stream)?;
    let state = args.out.join("stream-state");
    let (rounds, epochs) = match args.stream_save_rounds {
        Some(rounds) if !args.resume => (Some(rounds), 1),
        Some(_) => {
            acc.load_state(Some(&state))?.finish()?;
            (None, 2)
        }
        None => (None, 1),
    };
    for _ in 0..epochs {
        for batch in prepared.iter().take(rounds.unwrap_or(usize::MAX)) {
            let ids = acc.gather_for_metrics(batch?)?;
            report.gathered_ids.extend(ids.into_data().iter::<i64>());
        }
    }
    if rounds.is_some() {
        acc.save_state(Some(&state), &StateToSave::new())?;
    }
    report.stream_opened = opened.load(std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// Runs `case` on `acc`'s rank and writes the rank's weights and report.
fn run_case(acc: &Accelerator, case: Case, args: &Args, initial: Mlp) -> Result<()> {
    let mut report = Report::default();
    let model = match case {
        Case::Env => None,
        Case::Initial => Some(acc.prepare_model(initial)?),
        Case::Eval => {
            evaluate(acc, initial, &mut report)?;
            None
        }
        Case::Stream => {
            read_stream(acc, args, &mut report)?;
            None
        }
        _ => {
            let (model, counted) = train(acc, case, args, initial)?;
            report = counted;
            Some(model)
        }
    };
    // The whole model (every rank takes part in gathering it under FULL_SHARD).
    let model = model.map(|m| acc.unshard(&m)).transpose()?;
    report.rank = acc.process_index();
    report.num_processes = acc.num_processes();
    report.sharding = acc.config().distributed.sharding.to_string();
    report.mixed_precision = acc.mixed_precision().to_string();
    report.gradient_accumulation_steps = acc.config().accumulation.gradient_accumulation_steps;
    report.env = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with("ACCELERATE_")
                || k.starts_with("PARALLELISM_CONFIG_")
                || k == "RAYON_NUM_THREADS"
        })
        .collect();
    let dir = args.out.join(case.name());
    std::fs::create_dir_all(&dir).map_err(burn_accelerate::Error::other)?;
    let rank = acc.process_index();
    if let Some(model) = model {
        write_weights(&model, &dir.join(format!("rank{rank}.safetensors")))?;
    }
    let json = serde_json::to_vec_pretty(&report).map_err(burn_accelerate::Error::other)?;
    std::fs::write(dir.join(format!("rank{rank}.json")), json)
        .map_err(burn_accelerate::Error::other)?;
    Ok(())
}

/// Writes every float parameter of `model` as f32, named by its position in visiting order.
fn write_weights(model: &Mlp, path: &Path) -> Result<()> {
    let params: Vec<Vec<u8>> = mlp::weights(model)
        .iter()
        .map(|values| le_bytes(values))
        .collect();
    let views = params
        .iter()
        .enumerate()
        .map(|(i, bytes)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![bytes.len() / 4],
                bytes,
            )
            .map_err(burn_accelerate::Error::other)?;
            Ok((format!("param_{i:02}"), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None).map_err(burn_accelerate::Error::other)?;
    std::fs::write(path, bytes).map_err(burn_accelerate::Error::other)?;
    Ok(())
}

/// The little-endian bytes of `values`.
fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let mut args = Args::parse();
    if args.cases.is_empty() {
        args.cases = vec![
            Case::Dp,
            Case::Accumulation,
            Case::ClipNorm,
            Case::ClipValue,
            Case::Bf16,
            Case::Fp16,
            Case::Uneven,
            Case::Initial,
        ];
    }
    let device = ranks::default_device();
    device.seed(7);
    let initial = Mlp::new(&device);
    for &case in &args.cases {
        let result = ranks::run_ranks(builder(case, &args), args.processes, |acc| {
            let rank = acc.process_index();
            run_case(&acc, case, &args, initial.clone()).map_err(|e| {
                // Every rank says what it met, so that a test can check each one's error; then waits for the
                // others to have said theirs, since under MPI the first rank to exit with an error ends the job.
                println!("rank {rank} error: {e}");
                let _ = acc.wait_for_everyone();
                e
            })
        });
        result?;
    }
    Ok(())
}
