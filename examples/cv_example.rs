//! Image classification with a small CNN: Accelerate's `cv_example.py`, in Burn, on generated images.
//!
//! 16×16 grey images of four shapes (horizontal bar, vertical bar, diagonal, square outline) at random places,
//! with noise, drawn from a seed so that every run and every rank sees the same data. Two convolutions, max
//! pooling, global average pooling and a linear head; Adam with a linear learning-rate decay.
//!
//! The global batch stays the same for any number of ranks with `split_batches`: each batch of
//! `--global-batch` images is split between the ranks, and the scheduler steps once per optimizer step, so the
//! schedule written for one process holds on any number (without `split_batches`, Accelerate steps it once
//! per rank, expecting each rank's dataloader to be that many times shorter).
//!
//! ```text
//! cargo run --release --example cv_example                          # one process
//! cargo run --release --example cv_example -- --processes 2         # two in-process ranks
//! cargo run --release --example cv_example -- --mixed-precision bf16
//! ```
//!
//! Prints `accuracy=<x>` and `final_loss=<y>` over the held-out images.

#[path = "support/ranks.rs"]
mod ranks;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::AdamConfig;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::{DataLoaderBuilder, PreparedDataLoader};
use burn_accelerate::{Accelerator, Error, MixedPrecision, Result, impl_to_device};
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SIDE: usize = 16;
const CLASSES: usize = 4;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Images per optimizer step over all ranks.
    #[arg(long, default_value_t = 64)]
    global_batch: usize,
    /// Passes over the training images.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Training images (a multiple of the global batch).
    #[arg(long, default_value_t = 2048)]
    train_images: usize,
    /// Held-out images.
    #[arg(long, default_value_t = 500)]
    eval_images: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Forward precision: no, fp16 or bf16 (default: ACCELERATE_MIXED_PRECISION, else no).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
}

#[derive(Clone, Debug)]
struct Image {
    pixels: Vec<f32>,
    label: i64,
}

/// `n` images of random shapes at random places, with noise.
fn images(n: usize, seed: u64) -> Vec<Image> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let label = rng.random_range(0..CLASSES);
            let mut pixels: Vec<f32> = (0..SIDE * SIDE)
                .map(|_| rng.random_range(-0.3f32..0.3))
                .collect();
            let (len, row, col) = (
                rng.random_range(6..11),
                rng.random_range(0..SIDE - 10),
                rng.random_range(0..SIDE - 10),
            );
            let mut ink = |r: usize, c: usize| pixels[r * SIDE + c] += 1.0;
            for i in 0..len {
                match label {
                    0 => ink(row + len / 2, col + i),
                    1 => ink(row + i, col + len / 2),
                    2 => ink(row + i, col + i),
                    _ => {
                        ink(row, col + i);
                        ink(row + len - 1, col + i);
                        ink(row + i, col);
                        ink(row + i, col + len - 1);
                    }
                }
            }
            Image {
                pixels,
                label: label as i64,
            }
        })
        .collect()
}

#[derive(Clone, Debug)]
struct Batch {
    images: Tensor<4>,
    labels: Tensor<1, Int>,
}
impl_to_device!(Batch { images, labels });

#[derive(Clone)]
struct ImageBatcher;

impl Batcher<Image, Batch> for ImageBatcher {
    fn batch(&self, items: Vec<Image>, device: &Device) -> Batch {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label).collect();
        Batch {
            images: Tensor::<1>::from_floats(pixels.as_slice(), device).reshape([n, 1, SIDE, SIDE]),
            labels: Tensor::from_data(labels.as_slice(), device),
        }
    }
}

#[derive(Module, Debug)]
struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    global: AdaptiveAvgPool2d,
    head: Linear,
    act: Relu,
}

impl Cnn {
    fn new(device: &Device) -> Self {
        let conv = |channels| {
            Conv2dConfig::new(channels, [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        Self {
            conv1: conv([1, 8]),
            conv2: conv([8, 16]),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            global: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(16, CLASSES).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self
            .pool
            .forward(self.act.forward(self.conv1.forward(images)));
        let x = self.act.forward(self.conv2.forward(x));
        let [n, channels, _, _] = x.dims();
        self.head
            .forward(self.global.forward(x).reshape([n, channels]))
    }

    fn losses(&self, batch: &Batch) -> Tensor<1> {
        let n = batch.labels.dims()[0];
        log_softmax(self.forward(batch.images.clone()), 1)
            .gather(1, batch.labels.clone().reshape([n, 1]))
            .reshape([n])
            .neg()
    }
}

/// Accuracy and mean loss over every held-out image, each counted once across ranks.
fn evaluate(
    acc: &Accelerator,
    model: &Cnn,
    eval: &PreparedDataLoader<Image, Batch>,
) -> Result<(f64, f64)> {
    let model = model.valid();
    let (mut correct, mut count, mut loss_sum) = (0usize, 0usize, 0.0f64);
    for batch in eval.iter() {
        let batch = batch?;
        let batch = Batch {
            images: batch.images.inner(),
            labels: batch.labels.inner(),
        };
        let losses = model.losses(&batch);
        let predictions = model.forward(batch.images).argmax(1).reshape([-1]);
        let (predictions, labels, losses) =
            acc.gather_for_metrics((predictions, batch.labels, losses))?;
        count += labels.dims()[0];
        correct += predictions.equal(labels).int().sum().into_scalar::<i64>() as usize;
        loss_sum += losses.sum().into_scalar::<f32>() as f64;
    }
    Ok((
        correct as f64 / count.max(1) as f64,
        loss_sum / count.max(1) as f64,
    ))
}

fn train(acc: Accelerator, args: &Args, initial: Cnn) -> Result<(f64, f64)> {
    let p = acc.num_processes();
    if !args.global_batch.is_multiple_of(p) || !args.train_images.is_multiple_of(args.global_batch)
    {
        return Err(Error::InvalidArgument(format!(
            "--global-batch {} must divide --train-images {} and be divisible by {p} ranks",
            args.global_batch, args.train_images
        )));
    }
    // With split_batches, the dataloader's batch size is the global one.
    let batch = args.global_batch;
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), args.lr);
    let train = acc.prepare_dataloader(
        DataLoaderBuilder::new(ImageBatcher)
            .batch_size(batch)
            .shuffle(21)
            .build(InMemDataset::new(images(args.train_images, 1))),
    )?;
    let eval = acc.prepare_dataloader(
        DataLoaderBuilder::new(ImageBatcher)
            .batch_size(batch)
            .build(InMemDataset::new(images(args.eval_images, 2))),
    )?;
    let total = (args.epochs * train.len()).max(1);
    let schedule = LinearLrSchedulerConfig::new(args.lr, args.lr / 20.0, total)
        .init()
        .map_err(Error::InvalidArgument)?;
    let mut scheduler = acc.prepare_scheduler(schedule, &optimizer);
    for epoch in 0..args.epochs {
        let bar = acc.progress_bar(args.train_images as u64, "images");
        bar.set_message(format!("epoch {epoch}"));
        for batch in train.iter() {
            let loss = acc.autocast(&model, batch?, |model, batch| model.losses(&batch).mean());
            acc.backward(loss, &model)?;
            model = optimizer.step(model);
            scheduler.step();
            bar.inc(args.global_batch as u64);
        }
        bar.finish_and_clear();
        let (accuracy, loss) = evaluate(&acc, &model, &eval)?;
        acc.print(format!(
            "epoch={epoch} eval_accuracy={accuracy:.4} eval_loss={loss:.5}"
        ));
    }
    // Every rank, not only the one that prints, ends with the same model.
    ranks::check_ranks_agree(&acc, &model)?;
    evaluate(&acc, &model, &eval)
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let device = ranks::default_device();
    device.seed(5);
    let initial = Cnn::new(&device);
    let mut builder = Accelerator::builder().split_batches(true);
    if let Some(precision) = args.mixed_precision {
        builder = builder.mixed_precision(precision);
    }
    if let Some((accuracy, loss)) = ranks::run_ranks(builder, args.processes, |acc| {
        train(acc, &args, initial.clone())
    })? {
        println!("accuracy={accuracy:.4}");
        println!("final_loss={loss:.5}");
    }
    Ok(())
}
