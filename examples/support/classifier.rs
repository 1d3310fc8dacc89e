//! The classifier and synthetic data of the data-parallel example, shared with its tests and benchmarks.

#![allow(dead_code)]

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::{DataLoaderBuilder, PreparedDataLoader};
use burn_accelerate::{Accelerator, Result, impl_to_device};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const FEATURES: usize = 8;
pub const CLASSES: usize = 4;

#[derive(Module, Debug)]
pub struct Classifier {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl Classifier {
    pub fn new(hidden: usize, device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(FEATURES, hidden).init(device),
            out: LinearConfig::new(hidden, CLASSES).init(device),
            act: Relu::new(),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(self.act.forward(self.hidden.forward(x)))
    }

    /// Cross-entropy of every sample.
    pub fn losses(&self, batch: &Batch) -> Tensor<1> {
        let n = batch.y.dims()[0];
        let logp = log_softmax(self.forward(batch.x.clone()), 1);
        logp.gather(1, batch.y.clone().reshape([n, 1]))
            .reshape([n])
            .neg()
    }
}

#[derive(Clone, Debug)]
pub struct Sample {
    pub x: [f32; FEATURES],
    pub y: i64,
}

#[derive(Clone, Debug)]
pub struct Batch {
    pub x: Tensor<2>,
    pub y: Tensor<1, Int>,
}

impl_to_device!(Batch { x, y });

#[derive(Clone)]
pub struct SampleBatcher;

impl Batcher<Sample, Batch> for SampleBatcher {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> Batch {
        let n = items.len();
        let xs: Vec<f32> = items.iter().flat_map(|s| s.x).collect();
        let ys: Vec<i64> = items.iter().map(|s| s.y).collect();
        Batch {
            x: Tensor::<1>::from_floats(xs.as_slice(), device).reshape([n, FEATURES]),
            y: Tensor::from_data(ys.as_slice(), device),
        }
    }
}

/// Four overlapping Gaussian blobs.
pub fn blobs(n: usize, seed: u64) -> Vec<Sample> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let y = rng.random_range(0..CLASSES);
            let mut x = [0f32; FEATURES];
            for (i, v) in x.iter_mut().enumerate() {
                let center = if i % CLASSES == y { 1.5 } else { 0.0 };
                *v = center + rng.random_range(-1.0f32..1.0) + rng.random_range(-1.0f32..1.0);
            }
            Sample { x, y: y as i64 }
        })
        .collect()
}

/// Initialises every lazy parameter, so that clones share values instead of drawing them later.
pub struct Materialize;

impl ModuleVisitor for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let _ = param.val();
    }
}

/// A classifier with weights drawn from `seed`, every parameter initialised.
pub fn initial_model(hidden: usize, seed: u64) -> burn_accelerate::Result<Classifier> {
    // The device runs take (Burn's `Device::default()` would take CUDA even where no driver can run it).
    let device = burn_accelerate::backend::default_device()?;
    device.seed(seed);
    let model = Classifier::new(hidden, &device);
    model.visit(&mut Materialize);
    Ok(model)
}

/// Prepared training (shuffled) and evaluation loaders of `batch` samples per rank over blobs drawn from seeds
/// 1 and 2.
pub fn prepared_loaders(
    acc: &Accelerator,
    batch: usize,
    train_samples: usize,
    eval_samples: usize,
) -> Result<(
    PreparedDataLoader<Sample, Batch>,
    PreparedDataLoader<Sample, Batch>,
)> {
    let train = acc.prepare_dataloader(
        DataLoaderBuilder::new(SampleBatcher)
            .batch_size(batch)
            .shuffle(5)
            .build(InMemDataset::new(blobs(train_samples, 1))),
    )?;
    let eval = acc.prepare_dataloader(
        DataLoaderBuilder::new(SampleBatcher)
            .batch_size(batch)
            .build(InMemDataset::new(blobs(eval_samples, 2))),
    )?;
    Ok((train, eval))
}

/// Mean loss and accuracy over every evaluation sample, each counted once across ranks.
pub fn evaluate(
    acc: &Accelerator,
    model: &Classifier,
    eval: &PreparedDataLoader<Sample, Batch>,
) -> Result<(f64, f64)> {
    let (mut loss_sum, mut correct, mut count) = (0.0f64, 0usize, 0usize);
    let model = model.valid();
    for batch in eval.iter() {
        let batch = batch?;
        let batch = Batch {
            x: batch.x.inner(),
            y: batch.y.inner(),
        };
        let predictions = model.forward(batch.x.clone()).argmax(1).reshape([-1]);
        let (losses, predictions, labels) =
            acc.gather_for_metrics((model.losses(&batch), predictions, batch.y))?;
        count += labels.dims()[0];
        correct += predictions.equal(labels).int().sum().into_scalar::<i64>() as usize;
        loss_sum += losses.sum().into_scalar::<f32>() as f64;
    }
    Ok((
        loss_sum / count.max(1) as f64,
        correct as f64 / count.max(1) as f64,
    ))
}
