//! The user guide's support: the small model and synthetic data that README.md and the guide's pages (`docs/`)
//! train, so that every Rust block of them compiles and runs as a doctest of this crate (`cargo test` runs
//! them). Not part of burn-accelerate's API: use your own model and data.

#![warn(missing_docs)]

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor};

/// Input features of a [`Sample`].
pub const FEATURES: usize = 4;

/// A two-layer perceptron for regression.
#[derive(Module, Debug)]
pub struct Mlp {
    input: Linear,
    output: Linear,
    activation: Relu,
}

impl Mlp {
    /// A model whose parameters Burn draws at their first use, on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            input: LinearConfig::new(FEATURES, 16).init(device),
            output: LinearConfig::new(16, 1).init(device),
            activation: Relu::new(),
        }
    }

    /// Predictions, `[batch, 1]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.output
            .forward(self.activation.forward(self.input.forward(x)))
    }

    /// Mean squared error on `batch`.
    pub fn loss(&self, batch: Batch) -> Tensor<1> {
        MseLoss::new().forward(self.forward(batch.x), batch.y, Reduction::Mean)
    }
}

/// One example: features and target (the target is the mean of the features).
#[derive(Debug, Clone)]
pub struct Sample {
    /// Features.
    pub x: [f32; FEATURES],
    /// Target.
    pub y: f32,
}

/// A batch, as tensors.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `[batch, FEATURES]`.
    pub x: Tensor<2>,
    /// `[batch, 1]`.
    pub y: Tensor<2>,
}
burn_accelerate::impl_batch!(Batch { x, y });

/// A batch cuts into micro-batches of its samples (a pipeline's).
impl burn_accelerate::Split for Batch {
    fn micro_batches(self, parts: usize) -> burn_accelerate::Result<Vec<Self>> {
        let parts = (self.x, self.y).micro_batches(parts)?;
        Ok(parts.into_iter().map(|(x, y)| Batch { x, y }).collect())
    }

    fn samples(&self) -> Option<usize> {
        Some(self.x.dims()[0])
    }
}

/// Stacks samples into a [`Batch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleBatcher;

impl Batcher<Sample, Batch> for SampleBatcher {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> Batch {
        let n = items.len();
        let xs: Vec<f32> = items.iter().flat_map(|s| s.x).collect();
        let ys: Vec<f32> = items.iter().map(|s| s.y).collect();
        Batch {
            x: Tensor::<1>::from_floats(xs.as_slice(), device).reshape([n, FEATURES]),
            y: Tensor::<1>::from_floats(ys.as_slice(), device).reshape([n, 1]),
        }
    }
}

/// `n` samples, the same for every call with the same `n` (no random generator involved).
pub fn dataset(n: usize) -> InMemDataset<Sample> {
    let samples = (0..n)
        .map(|i| {
            let x: [f32; FEATURES] =
                std::array::from_fn(|j| (((i * 7 + j * 13) % 17) as f32 / 8.0) - 1.0);
            Sample {
                x,
                y: x.iter().sum::<f32>() / FEATURES as f32,
            }
        })
        .collect();
    InMemDataset::new(samples)
}

/// The first `n` samples of [`dataset`] as one batch on `device`.
pub fn batch(n: usize, device: &Device) -> Batch {
    use burn::data::dataset::Dataset;
    let data = dataset(n);
    let samples: Vec<Sample> = (0..n).filter_map(|i| data.get(i).ok()).collect();
    SampleBatcher.batch(samples, device)
}

/// README.md and the guide's pages, compiled and run by `cargo test` so that they cannot rot. The burn-train page
/// needs the `train` feature.
#[cfg(doctest)]
mod pages {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("quicktour.md")]
    struct Quicktour;
    #[doc = include_str!("troubleshoot.md")]
    struct Troubleshoot;
    #[doc = include_str!("from-accelerate.md")]
    struct FromAccelerate;
    #[cfg(feature = "train")]
    #[doc = include_str!("from-burn-train.md")]
    struct FromBurnTrain;
    #[doc = include_str!("concepts.md")]
    struct Concepts;
    #[doc = include_str!("weights.md")]
    struct Weights;
    #[doc = include_str!("pipeline.md")]
    struct Pipeline;
    #[doc = include_str!("sharded.md")]
    struct Sharded;
    #[doc = include_str!("tensor-parallel.md")]
    struct TensorParallel;
    #[doc = include_str!("context-parallel.md")]
    struct ContextParallel;
}
