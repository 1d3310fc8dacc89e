//! The quicktour MLP as a burn-train model: its `TrainStep` and `InferenceStep`, written for the
//! Accelerator (`learner::unshard` for the whole model under `FULL_SHARD`, `learner::autocast` for the forward
//! pass, `learner::backward` for the fp16 loss scale), and [`BlockWise`], the same model stepped block by block
//! (`learner::backward_blocks`).

#![allow(dead_code)]

use burn::nn::Linear;
use burn::nn::loss::{MseLoss, Reduction};
use burn_accelerate::learner::burn_train::{
    InferenceStep, RegressionOutput, TrainOutput, TrainStep,
};
use burn_accelerate::{Blocks, learner};

use super::mlp::{Batch, Mlp};

/// The forward pass under the accelerator's mixed precision, the loss in f32.
pub fn regression(model: &Mlp, batch: Batch) -> RegressionOutput {
    let (output, targets) = learner::autocast(model, batch, |m, b| (m.forward(b.x), b.y));
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
        regression(self, batch)
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
            |model, h| {
                let output = model.mlp.head(h);
                let loss = MseLoss::new().forward(output.clone(), batch.y.clone(), Reduction::Mean);
                RegressionOutput {
                    loss,
                    output,
                    targets: batch.y.clone(),
                }
            },
            |out| out.loss.clone(),
        )
    }
}

impl InferenceStep for BlockWise {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        regression(&self.mlp, batch)
    }
}
