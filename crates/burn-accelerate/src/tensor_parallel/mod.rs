//! Tensor parallelism (Megatron-LM's `--tensor-model-parallel-size`, torchtitan's TP, Accelerate's `tp_size`):
//! layers wider than one rank, each rank holding a slice of every split layer, the training loop unchanged.
//!
//! - **A plan** ([`TensorParallelPlan`]) names how modules are split: by path (`layers.*.mha.query`) or, with
//!   [`TensorParallelPlan::megatron`], by type. It splits the crate's own modules, which are Burn's with the same
//!   records ([`ParallelLinear`] for `Linear`, [`ParallelEmbedding`] for `Embedding`, [`ParallelAttention`],
//!   [`ParallelFeedForward`], [`ParallelTransformerLayer`] for `TransformerEncoderLayer`), whole on one rank:
//!   Burn's forward passes have no place for the collectives a split needs.
//! - **Regions** ([`residual`], [`region`]): a region's input is cut, and the gradient at the cut summed over the
//!   group in the backward pass (Megatron's *f*); a row-parallel layer's partial outputs are summed in the forward
//!   pass (*g*). See the `cut` module.
//! - **Loss parallelism** ([`cross_entropy`]): the cross-entropy of a column-parallel head's logits, each rank
//!   its range of the vocabulary, without gathering them.
//! - **Randomness** ([`dropout()`]): replicated parts draw the same mask on every rank of a group, split parts each
//!   rank its own, and a recomputed block the same again.
//! - **Placement**: `Accelerator::prepare_tensor_parallel` resolves the plan (its errors come before the first
//!   step), then each rank keeps its slice of a split parameter as it arrives from rank 0; the ranks of one
//!   tensor-parallel group read the same data, the data-parallel ranks different data; a sharded data-parallel
//!   strategy then keeps each rank's rows of its slice (FSDP2 + TP).
//!
//! ```text
//! let model = accelerator.prepare_tensor_parallel(ByteLm::new(...), &TensorParallelPlan::megatron())?;
//! let loss = accelerator.backward_blocks(&model, before, |layer, x| layer.forward(x, None, mask), after)?;
//! ```

pub(crate) mod context;
pub(crate) mod cut;
pub(crate) mod dropout;
mod loss;
pub(crate) mod sequence;
pub(crate) mod regions;
mod modules;
mod plan;
pub(crate) mod strategy;
pub(crate) mod fetch;

pub use context::tp_rank_and_size;
pub use dropout::{dropout, manual_seed};
pub use loss::cross_entropy;
pub use modules::{
    LinearLayout, ParallelAttention, ParallelEmbedding, ParallelFeedForward, ParallelLinear,
    ParallelTransformerLayer,
};
pub use plan::{Split, TensorParallelPlan};
pub use regions::{region, residual};
pub use sequence::sequence_part;
