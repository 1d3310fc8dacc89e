//! What the last stage keeps of a pipelined batch for a caller that runs the head once more on the whole batch
//! (burn-train's Learner reports one item per batch).

use burn::tensor::Tensor;

/// The last stage's output of the blocks for each micro-batch (by index, without a graph).
pub(crate) type Tops<const D: usize> = std::cell::RefCell<Vec<(usize, Tensor<D>)>>;

/// The micro-batches' outputs `tops` kept, in order, as one tensor of the whole batch.
#[cfg(feature = "train")]
pub(crate) fn whole_batch_top<const D: usize>(tops: &Tops<D>) -> Option<Tensor<D>> {
    let mut tops = tops.take();
    tops.sort_by_key(|(i, _)| *i);
    let tops: Vec<Tensor<D>> = tops.into_iter().map(|(_, y)| y).collect();
    (!tops.is_empty()).then(|| Tensor::cat(tops, 0))
}
