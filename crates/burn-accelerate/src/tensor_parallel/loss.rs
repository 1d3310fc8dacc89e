//! Loss parallelism (torchtitan's `loss_parallel`, Megatron's vocabulary-parallel cross-entropy): the mean
//! cross-entropy of a column-parallel head's logits without gathering them. Each rank holds the logits of its range
//! of the vocabulary, `[rows, vocab / tp]`; the row maxima are combined by an all-reduce (max), the sums of
//! exponentials and the target's logit (from the rank whose range holds the target, zero on the others) by
//! all-reduces (sum) with the identity gradient. Each rank's logits' gradient is then its columns of
//! `softmax - one_hot`, computed where the logits are: no rank ever holds `[rows, vocab]`.

use burn::tensor::{DType, Int, Tensor};

use super::cut::{constant, group, misused, reduce_from_region};
use crate::distributed::comm::ReduceOp;

/// The mean cross-entropy of `logits` `[rows, width]` against `targets` `[rows]` (class indices into the whole
/// vocabulary of `vocab` classes), the same as Burn's `CrossEntropyLoss` (without smoothing or padding), computed
/// in f32.
///
/// `logits` are either whole (`width == vocab`: one rank, or a head a plan keeps whole) or, under tensor
/// parallelism, this rank's columns of a column-parallel head ([`ParallelLinear::forward`] inside
/// [`region`](crate::tensor_parallel::region), `width == vocab / tp_size`): then the logits stay split and only
/// three `[rows]` vectors cross the group. Every rank returns the same loss. A width that is neither is a misuse
/// the next backward pass reports.
///
/// [`ParallelLinear::forward`]: crate::tensor_parallel::ParallelLinear::forward
///
/// ```
/// use burn::tensor::{Int, Tensor};
/// use burn_accelerate::tensor_parallel::cross_entropy;
///
/// let device = Default::default();
/// let logits = Tensor::<2>::from_floats([[0.0, 0.0], [0.0, 10.0]], &device);
/// let targets = Tensor::<1, Int>::from_ints([0, 1], &device);
/// let loss = cross_entropy(logits, targets, 2).into_scalar::<f32>();
/// // ln 2 for the first row, about e^-10 for the second, averaged.
/// assert!((loss - std::f32::consts::LN_2 / 2.0).abs() < 1e-4);
/// ```
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>, vocab: usize) -> Tensor<1> {
    let [rows, width] = logits.dims();
    let logits = match logits.dtype() {
        DType::F32 => logits,
        _ => logits.cast(DType::F32),
    };
    let ctx = group().filter(|_| width != vocab);
    if let Some(c) = &ctx
        && width * c.size != vocab
    {
        misused(format!(
            "tensor parallelism: cross_entropy got logits {width} wide for a vocabulary of {vocab} over {} \
             tensor-parallel ranks: pass this rank's columns of a head split by columns ({} wide), or the whole \
             logits",
            c.size,
            vocab / c.size.max(1)
        ));
    }
    let ctx = ctx.filter(|c| width * c.size == vocab);
    // The row maxima, only for stability: the loss does not depend on them, so they carry no gradient.
    let local_max = constant(logits.clone()).max_dim(1);
    let max = match &ctx {
        Some(c) => c
            .all_reduce(
                local_max.clone(),
                ReduceOp::Max,
                "vocabulary-parallel loss maxima",
            )
            .unwrap_or_else(|e| {
                misused(format!("tensor parallelism: the loss's maxima failed: {e}"));
                local_max
            }),
        None => local_max,
    };
    let shifted = logits - max;
    let sum_exp = shifted.clone().exp().sum_dim(1);
    let offset = ctx.as_ref().map_or(0, |c| c.rank * width) as i64;
    let local = targets.reshape([rows, 1]) - offset;
    let mine = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(width as i64));
    let picked =
        shifted.gather(1, local.clamp(0, width as i64 - 1)) * mine.float().cast(DType::F32);
    let (sum_exp, picked) = match ctx {
        Some(_) => (
            reduce_from_region(sum_exp, "vocabulary-parallel loss sums of exponentials"),
            reduce_from_region(picked, "vocabulary-parallel loss target logits"),
        ),
        None => (sum_exp, picked),
    };
    (sum_exp.log() - picked).mean()
}
