//! The dropout block of the recompute tests: a pause (so that the other in-process ranks run between a reseed
//! and the draw), a Bernoulli mask recorded in `masks`, then the layer on the masked input.

use burn::nn::Linear;
use burn::tensor::{Distribution, Tensor};

/// `layer` on `h` under a fresh dropout mask of keep-probability one half, the mask's values pushed to `masks`.
pub fn dropout_block(
    layer: &Linear,
    h: Tensor<2>,
    masks: &std::sync::Mutex<Vec<Vec<f32>>>,
) -> Tensor<2> {
    std::thread::sleep(std::time::Duration::from_millis(2));
    let mask: Tensor<2> = Tensor::random(h.shape(), Distribution::Bernoulli(0.5), &h.device());
    masks
        .lock()
        .unwrap()
        .push(mask.to_data().convert::<f32>().try_to_vec::<f32>().unwrap());
    layer.forward(h * mask * 2.0).tanh()
}
