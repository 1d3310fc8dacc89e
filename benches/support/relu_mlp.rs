//! Linear layers with ReLU between them: the model of the CPU comparison (`step_phases`) and of the GPU throughput
//! bench, at their own sizes.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor};

/// Linear layers from `dims[0]` through each of `dims` to the last, ReLU between them (none after the last).
#[derive(Module, Debug)]
pub struct ReluMlp {
    layers: Vec<Linear>,
    activation: Relu,
}

impl ReluMlp {
    /// The layers `dims[0] → dims[1] → ...`, drawn on `device`.
    pub fn new(dims: &[usize], device: &Device) -> Self {
        Self {
            layers: dims
                .windows(2)
                .map(|d| LinearConfig::new(d[0], d[1]).init(device))
                .collect(),
            activation: Relu::new(),
        }
    }

    /// The layers in order, ReLU between them.
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = self.activation.forward(x);
            }
        }
        x
    }
}
