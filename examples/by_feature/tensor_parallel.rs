//! Tensor parallelism for a model of your own: a pre-norm MLP stack whose blocks' two layers are the crate's
//! `ParallelLinear` (Burn's `Linear`, the same record), split by a plan of two rules over groups of `--tp-size`
//! ranks. Each block is `x + down(gelu(up(norm(x))))`, written with `tensor_parallel::residual`: the norm runs whole
//! on every rank, `up` by columns and `down` by rows (its partial outputs summed); the loop is a plain one.
//!
//! ```text
//! cargo run --release --example tensor_parallel                                   # one process
//! cargo run --release --example tensor_parallel -- --processes 2 --tp-size 2      # in-process ranks
//! mpirun -np 4 target/release/examples/tensor_parallel --tp-size 2                # tp 2 × dp 2 (--features mpi)
//! ```
//!
//! `--sequence-parallel` splits the activations between the regions (the norms' and the residual adds') along the
//! rows, each rank its part.
//!
//! Every rank prints `rank r/P tp_rank=t params_held=N` (the elements it holds); the main process prints
//! `final_loss=<x>`, and with `--weights <file>` writes the final weights, gathered whole (every float parameter in
//! visiting order, little-endian f32), for comparing runs.

#[path = "../support/ranks.rs"]
mod ranks;

use std::path::PathBuf;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::{Device, Tensor, activation::gelu};
use burn_accelerate::tensor_parallel::{
    ParallelLinear, Split, TensorParallelPlan, region, residual, sequence_part,
};
use burn_accelerate::{Accelerator, MixedPrecision, ReduceOp, Result};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Tensor-parallel ranks per group (the groups train data-parallel with each other).
    #[arg(long = "tp-size", default_value_t = 1)]
    tp_size: usize,
    /// Sequence parallelism: between the regions each rank holds its part of the rows.
    #[arg(long = "sequence-parallel")]
    sequence_parallel: bool,
    /// Blocks of the stack.
    #[arg(long, default_value_t = 3)]
    blocks: usize,
    /// The model width.
    #[arg(long, default_value_t = 16)]
    width: usize,
    /// Each block's inner width (split by columns and rows).
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Rows per step over all ranks.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Plain SGD instead of Adam.
    #[arg(long)]
    sgd: bool,
    /// The learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Clip the gradients' global norm to this before each step.
    #[arg(long = "clip-norm")]
    clip_norm: Option<f64>,
    /// no, fp16 or bf16.
    #[arg(long = "mixed-precision")]
    mixed_precision: Option<MixedPrecision>,
    /// Write the final weights here (main process).
    #[arg(long)]
    weights: Option<PathBuf>,
}

/// An input layer, pre-norm MLP blocks, a head.
#[derive(Module, Debug)]
struct Stack {
    input: Linear,
    blocks: Vec<Block>,
    head: Linear,
}

#[derive(Module, Debug)]
struct Block {
    norm: LayerNorm,
    up: ParallelLinear,
    down: ParallelLinear,
}

impl Stack {
    fn new(args: &Args, device: &Device) -> Self {
        Self {
            input: LinearConfig::new(4, args.width).init(device),
            blocks: (0..args.blocks)
                .map(|_| Block {
                    norm: LayerNormConfig::new(args.width).init(device),
                    up: LinearConfig::new(args.width, args.hidden)
                        .init(device)
                        .into(),
                    down: LinearConfig::new(args.hidden, args.width)
                        .init(device)
                        .into(),
                })
                .collect(),
            head: LinearConfig::new(args.width, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        // Under sequence parallelism each rank carries its part of the rows between the regions (the rows are
        // this model's sequence); `sequence_part` is the whole otherwise.
        let mut h = sequence_part(self.input.forward(x));
        for b in &self.blocks {
            // x + down(gelu(up(norm(x)))): the norm whole, then the region of the two split layers.
            h = residual(
                h,
                |h| b.norm.forward(h),
                |h| b.down.forward(gelu(b.up.forward(h))),
            );
        }
        // The head, whole, as a region of its own: its input gathered whole along the rows under sequence
        // parallelism (a plain call otherwise).
        region(h, |h| self.head.forward(h))
    }
}

/// The plan: each block's `up` by columns, `down` by rows; the rest whole.
fn plan() -> TensorParallelPlan {
    TensorParallelPlan::new()
        .split("blocks.*.up", Split::Columns)
        .split("blocks.*.down", Split::Rows)
}

/// Rows `first..first + rows` of a synthetic regression: inputs `[rows, 4]`, targets `[rows, 1]`.
fn batch(first: usize, rows: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (0..rows * 4)
        .map(|k| ((first + k / 4) as f32 * 0.37 + (k % 4) as f32 * 0.71).sin())
        .collect();
    let y: Vec<f32> = (0..rows)
        .map(|i| ((first + i) as f32 * 0.21).cos() * 0.5)
        .collect();
    (
        Tensor::<1>::from_floats(x.as_slice(), device).reshape([rows, 4]),
        Tensor::<1>::from_floats(y.as_slice(), device).reshape([rows, 1]),
    )
}

fn train(acc: Accelerator, args: &Args) -> Result<f32> {
    let layout = acc.pipeline_layout();
    if !args.batch.is_multiple_of(layout.replicas) {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "--batch {} is not divisible by {} data-parallel replicas",
            args.batch, layout.replicas
        )));
    }
    let mut model = acc.prepare_tensor_parallel(Stack::new(args, acc.device()), &plan())?;
    let mut optimizer = match args.sgd {
        true => acc.prepare_optimizer(SgdConfig::new().init(), args.lr),
        false => acc.prepare_optimizer(AdamConfig::new().init(), args.lr),
    };
    let rows = args.batch / layout.replicas;
    let mut loss_value = 0.0;
    for step in 0..args.steps {
        let (x, y) = batch(
            step * args.batch + layout.replica * rows,
            rows,
            acc.device(),
        );
        let out = acc.autocast(&model, x, |m, x| m.forward(x));
        let loss = (out - y).powi_scalar(2).mean();
        acc.backward(loss.clone(), &model)?;
        if let Some(max_norm) = args.clip_norm {
            acc.clip_grad_norm(&model, max_norm)?;
        }
        model = optimizer.try_step(model)?;
        loss_value = acc
            .reduce(loss.detach(), ReduceOp::Mean)?
            .into_scalar::<f32>();
        if acc.is_main_process() && (step == 0 || (step + 1) % 10 == 0) {
            println!("step {:>3} loss {loss_value:.6}", step + 1);
        }
    }
    println!(
        "rank {}/{} tp_rank={} params_held={}",
        acc.process_index(),
        acc.num_processes(),
        acc.mesh_coords().tp,
        model.num_params()
    );
    // The whole model, gathered from the tensor-parallel group.
    let whole = acc.unshard(&model)?;
    if let (Some(path), true) = (&args.weights, acc.is_main_process()) {
        struct Values(Vec<u8>);
        impl ModuleVisitor for Values {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let data = param.val().into_data().convert::<f32>();
                self.0.extend(data.iter::<f32>().flat_map(f32::to_le_bytes));
            }
        }
        let mut values = Values(Vec::new());
        whole.visit(&mut values);
        std::fs::write(path, values.0).map_err(burn_accelerate::Error::other)?;
    }
    Ok(loss_value)
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    // The main process draws the initial weights (at `prepare_tensor_parallel`) from this seed.
    ranks::default_device().seed(42);
    let mut builder = Accelerator::builder()
        .tp_size(args.tp_size)
        .sequence_parallel(args.sequence_parallel);
    if let Some(precision) = args.mixed_precision {
        builder = builder.mixed_precision(precision);
    }
    if let Some(loss) = ranks::run_ranks(builder, args.processes, |acc| train(acc, &args))? {
        println!("final_loss={loss:.6}");
    }
    Ok(())
}
