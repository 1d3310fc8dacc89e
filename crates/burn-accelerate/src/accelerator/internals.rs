//! Step internals for the benchmarks, which time them against raw baselines. Not part of the API: names and
//! signatures here change without notice.

use burn::tensor::Tensor;

use super::Accelerator;
use crate::error::Result;

/// The gradient reduction of a sync step, alone, on flat gradients (parameters of their own, bucketing
/// included): the `sync_overhead` benchmark compares it with the communicator's raw all-reduce.
///
/// # Errors
/// As the strategy's reduction.
pub fn sync_flat_gradients(
    accelerator: &Accelerator,
    grads: Vec<Tensor<1>>,
) -> Result<Vec<Tensor<1>>> {
    accelerator.step().sync_flat_for_bench(grads)
}
