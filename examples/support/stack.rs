//! A stack of square linear layers and its synthetic regression data: the model of the sharded-training
//! example and bench (`--layers 24 --width 2048` is 100.7 M parameters).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

/// A stack of square linear layers with tanh between them.
#[derive(Module, Debug)]
pub struct Stack {
    layers: Vec<Linear>,
}

impl Stack {
    /// `layers` layers of `width` inputs and outputs, drawn lazily on `device`.
    #[allow(dead_code)] // The benches' model; the sharded-training example widens its input layer.
    pub fn new(layers: usize, width: usize, device: &Device) -> Self {
        Self::with_input(layers, width, width, device)
    }

    /// As [`new`](Self::new), with `input` inputs to the first layer (an input layer larger than the others holds
    /// a larger share of the parameters, as an embedding does).
    pub fn with_input(layers: usize, input: usize, width: usize, device: &Device) -> Self {
        Self {
            layers: (0..layers)
                .map(|i| LinearConfig::new(if i == 0 { input } else { width }, width).init(device))
                .collect(),
        }
    }

    /// The stack applied to `x` (`[batch, width]`).
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = x.tanh();
            }
        }
        x
    }
}

/// Each layer is a block of block-wise passes (`Accelerator::backward_blocks`).
impl burn_accelerate::Blocks for Stack {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.layers
    }
}

/// Samples `first..first + rows` of the endless synthetic set (the same for any number of ranks: rank `r` of
/// `P` takes its rows of a global batch) and their targets, of `width` features.
pub fn batch(
    width: usize,
    (first, rows): (usize, usize),
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let values: Vec<f32> = (0..rows * width)
        .map(|k| {
            let (i, j) = (first + k / width, k % width);
            (i as f32 * 0.37 + j as f32 * 0.11).sin()
        })
        .collect();
    let x = Tensor::<1>::from_floats(values.as_slice(), device).reshape([rows, width]);
    let y = x.clone().mul_scalar(0.5).flip([1]);
    (x, y)
}
