//! The quicktour MLP as a burn-train model: its `TrainStep` and `InferenceStep`, written for the
//! Accelerator (`learner::unshard` for the whole model under `FULL_SHARD`, `learner::autocast` for the forward
//! pass, `learner::backward` for the fp16 loss scale).

use burn::nn::loss::{MseLoss, Reduction};
use burn_accelerate::learner;
use burn_accelerate::learner::burn_train::{
    InferenceStep, RegressionOutput, TrainOutput, TrainStep,
};

use crate::mlp::{Batch, Mlp};

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
