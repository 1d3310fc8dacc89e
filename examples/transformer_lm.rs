//! A small causal transformer language model, trained byte by byte on `examples/data/corpus.txt`: the model people
//! shard. Its layers (Burn's `TransformerEncoderLayer` as the crate's `ParallelTransformerLayer`, the same record:
//! multi-head attention and a feed-forward network, with a causal mask) are the blocks that block-wise `FULL_SHARD` gathers one at a time and that activation
//! checkpointing recomputes (Accelerate's `transformer_layer_cls_to_wrap`); the embeddings and the head are
//! gathered whole. The loop is the same in every mode:
//!
//! ```text
//! let loss = accelerator.backward_blocks(
//!     &model,
//!     |m| m.embed(tokens.clone()),                      // before the blocks
//!     |layer, x| layer.forward(x, None, Some(mask.clone())), // one block
//!     |m, x| m.loss(x, targets.clone()),                // after them: the head and the loss
//! )?;
//! model = optimizer.try_step(model)?;
//! ```
//!
//! ```text
//! cargo run --release --example transformer_lm                                   # 4 layers, one process
//! cargo run --release --example transformer_lm -- --processes 2 --sharding FULL_SHARD
//! mpirun -np 4 target/release/examples/transformer_lm --sharding FULL_SHARD \
//!     --layers 24 --d-model 896 --steps 3                 # 231 M parameters; built with --features mpi
//! ```
//!
//! `--tp-size T` splits every layer, the token embedding and the head over groups of `T` ranks (tensor
//! parallelism, `byte_lm::plan`; the groups train data-parallel with each other), the loop unchanged:
//!
//! ```text
//! cargo run --release --example transformer_lm -- --processes 2 --tp-size 2
//! mpirun -np 4 target/release/examples/transformer_lm --tp-size 2       # tp 2 × dp 2
//! ```
//!
//! `--sequence-parallel` splits the activations between the regions along the sequence (each rank its part of
//! the norms', dropout's and residual adds' activations). `--loss-parallel` keeps the head's logits split (each rank its range of the 256 byte values) and computes the
//! cross-entropy over the ranks without gathering them (`tensor_parallel::cross_entropy`).
//!
//! `--whole` gathers the whole model for the forward pass instead (`unshard` and `backward`: today's `FULL_SHARD`
//! without blocks), `--checkpointing` turns activation checkpointing on, `--freeze-bottom K` freezes the embeddings
//! and the first K layers (fine-tuning the top). Every rank prints what it held:
//! `rank r/P mode=... params=N params_at_rest=B grads=B optimizer_state=B peak_rss=B peak_vm=B step_secs=S`; the main
//! process prints `final_loss=<x>` and `weights_digest=<x>` (a digest of the final weights' bits, each part from
//! the stage that trains it: equal where two runs end with the same weights), and `--weights <file>` writes the final weights (every float parameter in
//! visiting order, little-endian f32) for comparing runs (then every rank prints `final_peak_vm=B`). `--state <dir> --save-at K [--kill-after-save]` saves the
//! training state after step K (each rank its slices; the ranks then SIGKILL themselves), `--state <dir> --resume`
//! continues from it to `--steps`, on any number of ranks. `--load-pretrained <dir>` starts from weights that
//! `--save-model` wrote (PyTorch's layout): after `prepare_model`, each `FULL_SHARD` rank reads only its slices.

#[path = "support/byte_lm.rs"]
mod byte_lm;
#[path = "support/held.rs"]
mod held;
#[path = "support/live_bytes.rs"]
mod live_bytes;
#[path = "support/ranks.rs"]
mod ranks;

use std::path::PathBuf;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::attention::generate_autoregressive_mask;
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::{Bool, Tensor};
use burn_accelerate::{Accelerator, ReduceOp, Result, ShardingStrategy, StateToSave};
use byte_lm::{ByteLm, VOCAB, batch};
use clap::Parser;

/// Counts the live bytes, for `step_peak_bytes` (not in a test build of a binary that includes this example and
/// has an allocator of its own for its tests: the GPU kit's).
#[cfg(not(test))]
#[global_allocator]
static ALLOC: live_bytes::Counting = live_bytes::Counting;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, ... (or Accelerate's numbers); the config file's or the
    /// environment's setting when absent.
    #[arg(long)]
    sharding: Option<ShardingStrategy>,
    /// Ranks per shard group of a hybrid strategy (HYBRID_SHARD), within each pipeline stage's ranks under
    /// --pp-size.
    #[arg(long = "dp-shard-size")]
    dp_shard_size: Option<usize>,
    /// Gather the whole model for the forward pass (`unshard` + `backward`) instead of block by block.
    #[arg(long)]
    whole: bool,
    /// Tensor-parallel ranks: each layer, the token embedding and the head split over groups of this many ranks.
    #[arg(long = "tp-size")]
    tp_size: Option<usize>,
    /// Loss parallelism: under --tp-size each rank keeps its columns of the logits, and the cross-entropy
    /// combines their maxima, sums of exponentials and target logits over the ranks (`tensor_parallel::
    /// cross_entropy`) instead of gathering them.
    #[arg(long = "loss-parallel")]
    loss_parallel: bool,
    /// Sequence parallelism: under --tp-size the activations between the tensor-parallel regions (norms,
    /// dropout, residual adds) split along the sequence, each rank its part.
    #[arg(long = "sequence-parallel")]
    sequence_parallel: bool,
    /// Context-parallel ranks: each sequence cut over groups of this many ranks (head-tail balanced), the
    /// attention across them (`context_parallel::attention`).
    #[arg(long = "cp-size")]
    cp_size: Option<usize>,
    /// How the context group's attention reaches every rank's keys and values: allgather or ring.
    #[arg(long = "cp-mode")]
    cp_mode: Option<burn_accelerate::config::ContextAttention>,
    /// Cut each sequence into contiguous slices instead of the head-tail balance (the last rank then computes the
    /// most).
    #[arg(long = "cp-contiguous")]
    cp_contiguous: bool,
    /// Pipeline stages: the layers cut into this many stages, one per group of ranks (`backward_batch`).
    #[arg(long = "pp-size")]
    pp_size: Option<usize>,
    /// Micro-batches per batch under a pipeline (default: the stages).
    #[arg(long = "pp-microbatches")]
    pp_microbatches: Option<usize>,
    /// The pipeline's schedule: gpipe or 1f1b.
    #[arg(long = "pp-schedule")]
    pp_schedule: Option<burn_accelerate::PipelineSchedule>,
    /// Write the last step's pipeline trace (every stage's forward, backward and transfers) here, as a Chrome /
    /// Perfetto trace (open it at ui.perfetto.dev), or as a picture when the name ends in `.svg`.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Activation checkpointing: recompute each layer in backward instead of keeping its activations.
    #[arg(long)]
    checkpointing: bool,
    /// Fine-tune the top: the embeddings and the first K layers frozen (`Module::no_grad`), the rest trained.
    #[arg(long = "freeze-bottom")]
    freeze_bottom: Option<usize>,
    /// Transformer layers (the blocks).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Bytes per sequence.
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// Sequences per step over all ranks (divided between them).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// The learning rate (Adam's, or SGD's with --sgd).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Plain SGD instead of Adam (the parity tests compare weights after SGD steps to 1e-6).
    #[arg(long)]
    sgd: bool,
    /// After training, evaluate this many held-out sequences (divided between the data-parallel replicas) through
    /// `forward_batch` and `gather_for_metrics`: prints `eval_samples=` and `eval_loss=`.
    #[arg(long)]
    eval: Option<usize>,
    /// Micro-batches per step (`gradient_accumulation_steps`): each step's rows split into this many, their
    /// gradients accumulated and synchronised once.
    #[arg(long, default_value_t = 1)]
    accumulate: usize,
    /// Clip the gradients' global norm to this before each step (`clip_grad_norm`).
    #[arg(long = "clip-norm")]
    clip_norm: Option<f64>,
    /// no, fp16 or bf16 (the environment's or the config file's setting when absent).
    #[arg(long = "mixed-precision")]
    mixed_precision: Option<burn_accelerate::MixedPrecision>,
    /// Dropout in every layer (attention probabilities, the feed-forward network, each residual branch).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Write the final weights here (main process), gathered one layer at a time.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Save the trained model here with `save_model` (safetensors; under `FULL_SHARD` one parameter at a time).
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Do not measure the optimizer state by serialising it (a copy of the state: under a memory limit, more
    /// than training needs).
    #[arg(long)]
    skip_state_bytes: bool,
    /// The training state's folder, for `--save-at` and `--resume`.
    #[arg(long)]
    state: Option<PathBuf>,
    /// Save the training state (`save_state`, each rank its slices) after this many steps, into `--state`.
    #[arg(long)]
    save_at: Option<usize>,
    /// After saving, every rank kills itself (SIGKILL), as a preempted job ends.
    #[arg(long)]
    kill_after_save: bool,
    /// Continue from the state in `--state` (saved on any number of ranks) to `--steps`.
    #[arg(long)]
    resume: bool,
    /// Start from pretrained weights (a `--save-model` folder, a safetensors file or a Hugging Face index, in
    /// PyTorch's layout unless the file records Burn's), loaded after `prepare_model`: under `FULL_SHARD` each rank
    /// reads only its slices.
    #[arg(long)]
    load_pretrained: Option<PathBuf>,
}

fn mode(acc: &Accelerator, args: &Args) -> String {
    let sharding = acc.config().distributed.sharding;
    let how = if !sharding.reshards_parameters() {
        ""
    } else if args.whole {
        " (whole)"
    } else {
        " (block-wise)"
    };
    let checkpointing = if args.checkpointing {
        " + checkpointing"
    } else {
        ""
    };
    let tp = acc.parallel_dims().tp;
    let sp = match acc.config().distributed.sequence_parallel {
        true => " + sp",
        false => "",
    };
    let tp = if tp > 1 {
        format!(" + tp {tp}{sp}")
    } else {
        String::new()
    };
    let cp = match acc.parallel_dims().cp {
        1 => String::new(),
        cp => format!(" + cp {cp} {}", acc.config().distributed.cp_comm_strategy),
    };
    format!("{sharding}{how}{tp}{cp}{checkpointing}")
}

fn train(acc: Accelerator, args: &Args) -> Result<f32> {
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    // Under a pipeline, the ranks of one stage are the data-parallel replicas; without one, every rank is.
    let layout = acc.pipeline_layout();
    let (replica, replicas) = (layout.replica, layout.replicas);
    if !args.batch.is_multiple_of(replicas * args.accumulate) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--batch {} is not divisible by {replicas} data-parallel replicas × {} micro-batches",
            args.batch, args.accumulate
        )));
    }
    if layout.stages > 1 && (args.whole || args.weights.is_some()) {
        return Err(burn_accelerate::Error::InvalidArgument(
            "--pp-size runs the layers through `backward_batch`, each stage holding its own: leave out --whole \
             and --weights (--save-model writes the whole model)"
                .into(),
        ));
    }
    let device = acc.device().clone();
    let mut initial = ByteLm::with_dropout(
        args.layers,
        args.d_model,
        args.heads,
        args.seq,
        args.dropout,
        &device,
    );
    if let Some(k) = args.freeze_bottom {
        initial.tokens = initial.tokens.no_grad();
        initial.positions = initial.positions.no_grad();
        for layer in initial.layers.iter_mut().take(k) {
            *layer = layer.clone().no_grad();
        }
    }
    let params = initial.num_params();
    if acc.parallel_dims().tp > 1 && args.whole {
        return Err(burn_accelerate::Error::InvalidArgument(
            "--tp-size trains each rank's slices through `backward_batch`: leave out --whole"
                .into(),
        ));
    }
    // Under a pipeline each stage keeps its blocks; the plan splits the layers over the tensor-parallel ranks
    // (with one, every layer stays whole).
    let mut model = acc.prepare_tensor_parallel_blocks(initial, &byte_lm::plan())?;
    if let Some(path) = &args.load_pretrained {
        model = load_pretrained(&acc, model, path, args)?;
    }
    let mut optimizer = match args.sgd {
        true => acc.prepare_optimizer(SgdConfig::new().init(), args.lr),
        false => acc.prepare_optimizer(AdamConfig::new().init(), args.lr),
    };
    let mut first = 0;
    if args.resume {
        let dir = args.state.as_deref().ok_or_else(|| {
            burn_accelerate::Error::InvalidArgument("--resume needs --state <dir>".into())
        })?;
        let mut state = acc.load_state(Some(dir))?;
        model = state.model(model)?;
        state.optimizer(&mut optimizer)?;
        state.finish()?;
        first = optimizer.num_steps() as usize;
        if acc.is_main_process() {
            println!("resumed after step {first} on {ranks} ranks");
        }
    }
    // One sequence's causal mask, repeated for however many sequences a (micro-)batch holds.
    let one_mask: Tensor<3, Bool> = generate_autoregressive_mask(1, args.seq, &device);
    // Under --cp-size each rank's slice of every sequence (its tokens, targets and position ids); every
    // position otherwise.
    let split = acc.context_split(args.seq)?;
    let context = split.rank_and_size().1 > 1;
    if context && args.whole {
        return Err(burn_accelerate::Error::InvalidArgument(
            "--cp-size trains each rank's slice of the sequences through `backward_batch`: leave out --whole"
                .into(),
        ));
    }
    let positions = split.position_ids(&device);
    let rows = args.batch / replicas;
    let (mut loss_value, mut grads, mut step_secs) = (0.0, 0, 0.0);
    // What the backward passes and steps pass through host memory (0 where in-process ranks share a device).
    let mut host_values = 0;
    // The most a step's forward and backward passes allocated above what was live when it began (its activations,
    // its gradients and what the passes allocate meanwhile), over the steps.
    let mut step_peak = 0;
    for step in first..args.steps {
        let started = Instant::now();
        let before = acc.host_values();
        let resting = live_bytes::live();
        live_bytes::reset_peak();
        // Each step's rows in `--accumulate` micro-batches, their gradients accumulated and synchronised once.
        let mut losses = Vec::with_capacity(args.accumulate);
        for micro in 0..args.accumulate {
            if args.accumulate > 1 {
                acc.accumulate();
            }
            let rows = rows / args.accumulate;
            let (inputs, targets) = batch(
                (
                    step * args.batch + replica * rows * args.accumulate + micro * rows,
                    rows,
                ),
                args.seq,
                &device,
            );
            let (inputs, targets) = (split.part(inputs, 1)?, split.part(targets, 1)?);
            let mask = one_mask.clone().repeat_dim(0, rows);
            let loss = if args.whole {
                let whole = acc.unshard(&model)?;
                let mut x = whole.embed(inputs);
                for layer in &whole.layers {
                    x = layer.forward(x, None, Some(mask.clone()));
                }
                let loss = match args.loss_parallel {
                    true => whole.parallel_loss(x, targets),
                    false => whole.loss(x, targets),
                };
                acc.backward(loss.clone(), &whole)?;
                loss.detach()
            } else {
                // The same call in every mode: block by block, and through the stages under --pp-size.
                acc.backward_batch(
                    &model,
                    (inputs, targets),
                    |m, (inputs, _)| m.embed_at(inputs.clone(), positions.clone()),
                    // Each layer and the head under autocast (a no-op without --mixed-precision).
                    // One sequence's mask, broadcast over the batch: every layer shares its one buffer. Under
                    // --cp-size the causal attention across the context group.
                    |layer, x| match context {
                        true => acc.autocast(layer, x, |layer, x| layer.forward_causal(x)),
                        false => {
                            let mask = one_mask.clone();
                            acc.autocast(layer, x, |layer, x| layer.forward(x, None, Some(mask)))
                        }
                    },
                    |m, x, (_, targets)| {
                        acc.autocast(m, x, |m, x| match args.loss_parallel {
                            true => m.parallel_loss(x, targets.clone()),
                            false => m.loss(x, targets.clone()),
                        })
                    },
                )?
            };
            losses.push(loss);
        }
        let loss = Tensor::cat(losses, 0).mean();
        step_peak = step_peak.max(live_bytes::peak().saturating_sub(resting));
        grads = held::grad_bytes(&acc, &model);
        if let Some(max_norm) = args.clip_norm {
            acc.clip_grad_norm(&model, max_norm)?;
        }
        model = optimizer.try_step(model)?;
        host_values += acc.host_values() - before;
        loss_value = acc.reduce(loss, ReduceOp::Mean)?.into_scalar::<f32>();
        step_secs = started.elapsed().as_secs_f64();
        if acc.is_main_process() && (step == 0 || (step + 1) % 10 == 0) {
            println!(
                "step {:>3} loss {loss_value:.4} ({step_secs:.2} s)",
                step + 1
            );
        }
        if args.save_at == Some(step + 1) {
            // What training alone needed, before the save serialises the state.
            println!(
                "rank {rank}/{ranks} before_save_peak_vm={}",
                held::peak("VmPeak:")
            );
            let dir = args.state.as_deref().ok_or_else(|| {
                burn_accelerate::Error::InvalidArgument("--save-at needs --state <dir>".into())
            })?;
            acc.save_state(
                Some(dir),
                &StateToSave::new().model(&model)?.optimizer(&optimizer)?,
            )?;
            if acc.is_main_process() {
                println!(
                    "saved the state after step {} (peak RSS {} B)",
                    step + 1,
                    held::peak("VmHWM:")
                );
            }
            if args.kill_after_save {
                acc.wait_for_everyone()?;
                // SIGKILL: nothing is flushed or cleaned up, as when a job is preempted.
                let _ = std::process::Command::new("kill")
                    .args(["-9", &std::process::id().to_string()])
                    .status();
            }
        }
    }
    if layout.stages > 1 {
        let trace = acc.pipeline_trace();
        if let Some(trace) = &trace {
            println!(
                "rank {rank}/{ranks} stage={} idle_fraction={:.3} ideal_idle_fraction={:.3}",
                trace.stage,
                trace.idle_fraction(),
                trace.ideal_idle_fraction()
            );
        }
        if let Some(path) = &args.trace {
            let traces: Vec<burn_accelerate::StageTrace> =
                acc.gather_object(&trace)?.into_iter().flatten().collect();
            if acc.is_main_process() {
                // A picture for `.svg`, else the Chrome / Perfetto trace.
                let text = match path.extension().is_some_and(|e| e == "svg") {
                    true => burn_accelerate::pipeline_parallel::svg_trace(&traces),
                    false => burn_accelerate::pipeline_parallel::chrome_trace(&traces).to_string(),
                };
                std::fs::write(path, text).map_err(burn_accelerate::Error::other)?;
                println!("wrote the pipeline trace to {}", path.display());
            }
        }
    }
    if let Some(samples) = args.eval {
        evaluate(&acc, &model, samples, args)?;
    }
    let (peak_rss, peak_vm) = (held::peak("VmHWM:"), held::peak("VmPeak:"));
    let at_rest = held::param_bytes(&model);
    let state = if args.skip_state_bytes {
        0
    } else {
        optimizer
            .inner()
            .to_record()
            .into_bytes()
            .map_err(burn_accelerate::Error::other)?
            .len()
    };
    println!(
        "rank {rank}/{ranks} mode={} params={params} params_at_rest={at_rest} grads={grads} \
         optimizer_state={state} peak_rss={peak_rss} peak_vm={peak_vm} step_peak_bytes={step_peak} \
         step_secs={step_secs:.3} host_values={host_values}",
        mode(&acc, args).replace(' ', "_")
    );
    // The final weights' digest, bit for bit: each part from a rank that trains it (under a pipeline, the
    // embeddings from the first stage, each layer from its own, the norm and the head from the last).
    let whole = acc.unshard(&model)?;
    let (first, last) = (layout.is_first_stage(), layout.is_last_stage());
    let mut parts = vec![
        first.then(|| held::digest(&whole.tokens)).flatten(),
        first.then(|| held::digest(&whole.positions)).flatten(),
    ];
    parts.extend(whole.layers.iter().map(held::digest));
    parts.push(last.then(|| held::digest(&whole.norm)).flatten());
    parts.push(last.then(|| held::digest(&whole.head)).flatten());
    drop(whole);
    if let Some(digest) = held::weights_digest(&acc, parts)? {
        println!("weights_digest={digest}");
    }
    if let Some(path) = &args.weights {
        write_weights(&acc, &model, path)?;
    }
    if let Some(dir) = &args.save_model {
        // One file of the whole model in every mode (under --pp-size each stage's layers from that stage).
        let resting = live_bytes::live();
        live_bytes::reset_peak();
        let files = acc.save_blocks(&model, dir, "10GB")?;
        // What the save allocated above what the rank held: its share of the model and one tensor at a time.
        println!(
            "rank {rank}/{ranks} save_peak_bytes={}",
            live_bytes::peak().saturating_sub(resting)
        );
        if acc.is_main_process() {
            println!(
                "saved {} (peak RSS then {} B)",
                files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                held::peak("VmHWM:")
            );
        }
    }
    if args.weights.is_some() || args.save_model.is_some() {
        // What the whole run needed, writing the weights included.
        println!(
            "rank {rank}/{ranks} final_peak_vm={}",
            held::peak("VmPeak:")
        );
    }
    Ok(loss_value)
}

/// `model` (prepared) with the weights at `path`; prints what the rank holds and the peak of its memory: before
/// the load (from the start, through `prepare_model`) and during it alone, with the largest tensor's bytes.
fn load_pretrained(
    acc: &Accelerator,
    model: ByteLm,
    path: &std::path::Path,
    args: &Args,
) -> Result<ByteLm> {
    let before = held::peak("VmHWM:");
    let rss = held::peak("VmRSS:");
    held::reset_peak();
    let (model, _) = acc.load_checkpoint_in_model(
        model,
        path,
        &burn_accelerate::checkpoint::LoadOptions {
            strict: true,
            ..Default::default()
        },
    )?;
    // The embeddings (`VOCAB` or `seq` rows of `d_model`) or a feed-forward weight (`d_model` × 4 `d_model`),
    // in f32.
    let d = args.d_model;
    let largest = 4 * (VOCAB * d).max(args.seq * d).max(4 * d * d);
    println!(
        "rank {}/{} pretrained_loaded params_held={} largest_tensor={largest} rss_before_load={rss} \
         peak_rss_before_load={before} peak_rss_during_load={}",
        acc.process_index(),
        acc.num_processes(),
        held::param_bytes(&model),
        held::peak("VmHWM:")
    );
    Ok(model)
}

/// Evaluates `samples` held-out sequences (after the training data), each data-parallel replica its share,
/// through `forward_batch` (block by block, through the stages under a pipeline) and `gather_for_metrics` (over the
/// data dimension: the ranks of a tensor-parallel group hold the same values); the main process prints how many
/// came back and their mean loss.
fn evaluate(acc: &Accelerator, model: &ByteLm, samples: usize, args: &Args) -> Result<()> {
    let layout = acc.pipeline_layout();
    let (replica, replicas) = (layout.replica, layout.replicas);
    if samples < replicas {
        // Every rank runs the forward pass (its collectives), and Burn's CPU matmul fails on an empty batch.
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--eval {samples}: fewer held-out sequences than the {replicas} data-parallel replicas; evaluate at \
             least {replicas}"
        )));
    }
    // The first `samples % replicas` replicas one sequence more than the rest, none repeated.
    let rows = samples / replicas + usize::from(replica < samples % replicas);
    let first = 1_000_000 + replica * (samples / replicas) + replica.min(samples % replicas);
    let one_mask: Tensor<3, Bool> = generate_autoregressive_mask(1, args.seq, acc.device());
    // Under --cp-size each rank evaluates its slice of every sequence; its per-sample means are averaged over the
    // context group into the whole sequences'.
    let split = acc.context_split(args.seq)?;
    let context = split.rank_and_size().1 > 1;
    let positions = split.position_ids(acc.device());
    let (inputs, targets) = batch((first, rows), args.seq, acc.device());
    let losses = acc.forward_batch(
        model,
        (split.part(inputs, 1)?, split.part(targets, 1)?),
        |m, (inputs, _)| m.embed_at(inputs.clone(), positions.clone()),
        |layer, x| match context {
            true => layer.forward_causal(x),
            false => layer.forward(x, None, Some(one_mask.clone())),
        },
        |m, x, (_, targets)| m.sequence_losses(x, targets.clone()),
    )?;
    let losses = acc.reduce_context(losses, ReduceOp::Mean)?;
    let all = acc.gather_for_metrics(losses)?;
    if acc.is_main_process() {
        let n = all.dims()[0];
        println!(
            "eval_samples={n}\neval_loss={:.7}",
            all.mean().into_scalar::<f32>()
        );
    }
    Ok(())
}

/// Every float parameter of `model`, in visiting order, as little-endian f32, written by the main process; under
/// `FULL_SHARD` gathered one part (an embedding, a layer, the head) at a time.
fn write_weights(acc: &Accelerator, model: &ByteLm, path: &std::path::Path) -> Result<()> {
    let mut file = acc
        .is_main_process()
        .then(|| std::fs::File::create(path))
        .transpose()
        .map_err(burn_accelerate::Error::other)?;
    write_part(acc, &model.tokens, &mut file)?;
    write_part(acc, &model.positions, &mut file)?;
    for layer in &model.layers {
        write_part(acc, layer, &mut file)?;
    }
    write_part(acc, &model.norm, &mut file)?;
    write_part(acc, &model.head, &mut file)
}

/// Gathers `part` whole (every rank takes part) and appends its values to `file` (the main process's), one
/// parameter at a time.
fn write_part<M: Module>(
    acc: &Accelerator,
    part: &M,
    file: &mut Option<std::fs::File>,
) -> Result<()> {
    struct Values<'a>(&'a mut std::fs::File, std::io::Result<()>);
    impl ModuleVisitor for Values<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.1.is_err() {
                return;
            }
            let data = param.val().into_data().convert::<f32>();
            let bytes: Vec<u8> = data.iter::<f32>().flat_map(f32::to_le_bytes).collect();
            self.1 = std::io::Write::write_all(self.0, &bytes);
        }
    }
    let whole = acc.unshard(part)?;
    match file {
        Some(file) => {
            let mut values = Values(file, Ok(()));
            whole.visit(&mut values);
            values.1.map_err(burn_accelerate::Error::other)
        }
        None => Ok(()),
    }
}

pub fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    // The main process draws the initial weights (at `prepare_model`) from this seed.
    ranks::default_device().seed(42);
    let mut builder = Accelerator::builder()
        .activation_checkpointing(args.checkpointing)
        .gradient_accumulation_steps(args.accumulate);
    if let Some(ranks) = args.tp_size {
        builder = builder.tp_size(ranks);
    }
    if let Some(ranks) = args.cp_size {
        builder = builder.cp_size(ranks);
    }
    if let Some(mode) = args.cp_mode {
        builder = builder.cp_comm_strategy(mode);
    }
    if args.cp_contiguous {
        builder = builder.cp_load_balance(false);
    }
    if args.sequence_parallel {
        builder = builder.sequence_parallel(true);
    }
    if let Some(precision) = args.mixed_precision {
        builder = builder.mixed_precision(precision);
    }
    if let Some(stages) = args.pp_size {
        builder = builder.pp_size(stages);
    }
    if let Some(micro_batches) = args.pp_microbatches {
        builder = builder.pp_microbatches(micro_batches);
    }
    if let Some(schedule) = args.pp_schedule {
        builder = builder.pp_schedule(schedule);
    }
    if let Some(sharding) = args.sharding {
        builder = builder.sharding(sharding);
    }
    if let Some(size) = args.dp_shard_size {
        builder = builder.dp_shard_size(size);
    }
    if let Some(loss) = ranks::run_ranks(builder, args.processes, |acc| train(acc, &args))? {
        println!("final_loss={loss:.6}");
    }
    Ok(())
}
