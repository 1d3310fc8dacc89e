//! The small regression MLP and synthetic data shared by the quicktour example, its tests and benchmarks.
//! Nothing is downloaded: the data is generated from a fixed seed.

#![allow(dead_code)]

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor};
use burn_accelerate::Blocks;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Number of input features.
pub const FEATURES: usize = 16;
/// Hidden width.
pub const HIDDEN: usize = 64;

/// A two-layer perceptron.
#[derive(Module, Debug)]
pub struct Mlp {
    input: Linear,
    output: Linear,
    activation: Relu,
}

impl Mlp {
    /// A new model with weights drawn on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            input: LinearConfig::new(FEATURES, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, 1).init(device),
            activation: Relu::new(),
        }
    }

    /// This model with its input layer frozen (`Module::no_grad`), as a fine-tuning run freezes lower layers.
    pub fn with_input_frozen(mut self) -> Self {
        self.input = self.input.no_grad();
        self
    }

    /// Predictions for a `[batch, FEATURES]` input.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.output
            .forward(self.activation.forward(self.input.forward(x)))
    }

    /// The hidden layer on `x`: the model's one block for block-wise passes (see [`Blocks`]).
    pub fn hidden(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
        Relu::new().forward(layer.forward(x))
    }

    /// The output layer on the hidden activation `h`.
    pub fn head(&self, h: Tensor<2>) -> Tensor<2> {
        self.output.forward(h)
    }

    /// Mean squared error of the predictions for `batch`.
    pub fn loss(&self, batch: Batch) -> Tensor<1> {
        MseLoss::new().forward(self.forward(batch.x), batch.y, Reduction::Mean)
    }
}

/// The input layer is the one block of a block-wise pass (`Accelerator::backward_blocks`); the output layer is
/// outside the blocks.
impl Blocks for Mlp {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        std::slice::from_ref(&self.input)
    }
}

/// One example: features and target.
#[derive(Debug, Clone)]
pub struct Sample {
    pub x: [f32; FEATURES],
    pub y: f32,
}

/// A batch of examples as tensors.
#[derive(Debug, Clone)]
pub struct Batch {
    pub x: Tensor<2>,
    pub y: Tensor<2>,
}
burn_accelerate::impl_to_device!(Batch { x, y });

/// A batch cuts into micro-batches of its samples (a pipeline's, `backward_batch`).
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
#[derive(Debug, Clone, Default)]
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

/// `n` samples of a smooth nonlinear function, reproducible from `seed`.
pub fn samples(n: usize, seed: u64) -> Vec<Sample> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let mut x = [0f32; FEATURES];
            for v in &mut x {
                *v = rng.random_range(-1.0..1.0);
            }
            let y =
                x[0].sin() + x[1] * x[2] - 0.5 * x[3] * x[3] + 0.25 * x[4..].iter().sum::<f32>();
            Sample { x, y }
        })
        .collect()
}

/// Every float parameter of a module, flattened and converted to f32 (whatever its dtype: an f16 or bf16
/// parameter is compared too, never skipped), in visiting order (to compare models in tests).
pub fn weights<M: Module>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0.push(param.val().into_data().iter::<f32>().collect());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// The synthetic dataset.
pub fn dataset(n: usize, seed: u64) -> InMemDataset<Sample> {
    InMemDataset::new(samples(n, seed))
}
