//! The quicktour MLP as a burn-train model: its `TrainStep` and `InferenceStep`, written for the
//! Accelerator (`learner::unshard` for the whole model under `FULL_SHARD`, `learner::autocast` for the forward
//! pass, `learner::backward` for the fp16 loss scale), [`BlockWise`], the same model stepped block by block
//! (`learner::backward_blocks`), and [`DeepMlp`], an MLP of several hidden blocks that trains in every mode,
//! pipelines included (`learner::backward_batch`, `learner::forward_batch`).

#![allow(dead_code)]

use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor};
use burn_accelerate::learner::burn_train::{
    InferenceStep, RegressionOutput, TrainOutput, TrainStep,
};
use burn_accelerate::{Blocks, learner};

use super::mlp::{Batch, FEATURES, HIDDEN, Mlp};

/// The forward pass under the accelerator's mixed precision, the loss in f32.
pub fn regression(model: &Mlp, batch: Batch) -> RegressionOutput {
    let (output, targets) = learner::autocast(model, batch, |m, b| (m.forward(b.x), b.y));
    item(output, targets)
}

/// The step's item: the mean squared error of `output` against `targets`.
pub fn item(output: Tensor<2>, targets: Tensor<2>) -> RegressionOutput {
    let loss = MseLoss::new().forward(output.clone(), targets.clone(), Reduction::Mean);
    RegressionOutput {
        loss,
        output,
        targets,
    }
}

impl TrainStep for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
        // Under FULL_SHARD the Learner's model holds this rank's slices: the step runs on the gathered model.
        let model = learner::unshard(self);
        let item = regression(&model, batch);
        TrainOutput::new(&model, learner::backward(item.loss.clone()), item)
    }
}

impl InferenceStep for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        // Under FULL_SHARD every rank validates, on the gathered model.
        regression(&learner::unshard(self), batch)
    }
}

/// The MLP with a `TrainStep` that goes block by block (`learner::backward_blocks`): its input layer is the one
/// block, the head comes after it. Under block-wise `FULL_SHARD` each rank gathers one block at a time.
#[derive(burn::module::Module, Debug)]
pub struct BlockWise {
    pub mlp: Mlp,
}

impl Blocks for BlockWise {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        self.mlp.blocks()
    }
}

impl TrainStep for BlockWise {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
        learner::backward_blocks(
            self,
            |_| batch.x.clone(),
            Mlp::hidden,
            |model, h| item(model.mlp.head(h), batch.y.clone()),
            |out| out.loss.clone(),
        )
    }
}

impl InferenceStep for BlockWise {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        // Under block-wise FULL_SHARD validation gathers one block at a time too.
        learner::forward_batch(
            self,
            batch,
            |_, b| b.x.clone(),
            Mlp::hidden,
            |m, h, b| item(m.mlp.head(h), b.y.clone()),
        )
    }
}

/// An MLP with `depth` hidden layers of `HIDDEN` features as its blocks, between an input and an output layer:
/// enough blocks to cut into pipeline stages. Its steps take the whole batch through the blocks in every mode
/// (under a pipeline, through the stages).
#[derive(Module, Debug)]
pub struct DeepMlp {
    pub input: Linear,
    pub hidden: Vec<Linear>,
    pub output: Linear,
}

impl DeepMlp {
    /// A new model of `depth` hidden blocks, drawn on `device`.
    pub fn new(device: &Device, depth: usize) -> Self {
        Self {
            input: LinearConfig::new(FEATURES, HIDDEN).init(device),
            hidden: (0..depth)
                .map(|_| LinearConfig::new(HIDDEN, HIDDEN).init(device))
                .collect(),
            output: LinearConfig::new(HIDDEN, 1).init(device),
        }
    }

    /// The input layer (before the blocks).
    pub fn embed(&self, batch: &Batch) -> Tensor<2> {
        Relu::new().forward(self.input.forward(batch.x.clone()))
    }

    /// The output layer and the loss (after the blocks).
    pub fn regression(&self, h: Tensor<2>, batch: &Batch) -> RegressionOutput {
        item(self.output.forward(h), batch.y.clone())
    }

    /// The mean squared error on `batch` of the whole model (one process).
    pub fn loss(&self, batch: Batch) -> Tensor<1> {
        let h = self
            .hidden
            .iter()
            .fold(self.embed(&batch), |h, b| Mlp::hidden(b, h));
        self.regression(h, &batch).loss
    }
}

impl Blocks for DeepMlp {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.hidden
    }
}

impl TrainStep for DeepMlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
        learner::backward_batch(
            self,
            batch,
            DeepMlp::embed,
            Mlp::hidden,
            DeepMlp::regression,
            |out| out.loss.clone(),
        )
    }
}

impl InferenceStep for DeepMlp {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        learner::forward_batch(
            self,
            batch,
            DeepMlp::embed,
            Mlp::hidden,
            DeepMlp::regression,
        )
    }
}
