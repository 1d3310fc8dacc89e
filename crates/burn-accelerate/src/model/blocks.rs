//! A model made of a sequence of blocks of one type ([`Blocks`]): the unit block-wise passes gather and recompute,
//! and pipeline stages cut.

use burn::module::Module;

/// A model whose forward pass runs through a sequence of blocks of one type — a transformer's layers — so that
/// [`Accelerator::backward_blocks`](crate::Accelerator::backward_blocks) can gather (under `FULL_SHARD`) and
/// recompute (with activation checkpointing) one block at a time: FSDP2's `fully_shard(block)` and Accelerate's
/// `transformer_layer_cls_to_wrap`, as a trait. What is not in a block (embeddings, the head) is gathered whole.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn_accelerate::Blocks;
///
/// #[derive(Module, Debug)]
/// struct Stack {
///     layers: Vec<Linear>,
///     head: Linear,
/// }
///
/// impl Blocks for Stack {
///     type Block = Linear;
///     fn blocks(&self) -> &[Linear] {
///         &self.layers
///     }
/// }
/// # let device = Default::default();
/// # let stack = Stack { layers: vec![LinearConfig::new(2, 2).init(&device)], head: LinearConfig::new(2, 1).init(&device) };
/// # assert_eq!(stack.blocks().len(), 1);
/// ```
pub trait Blocks: Module {
    /// One block (a transformer layer).
    type Block: Module;

    /// The blocks, in the order the forward pass runs them.
    fn blocks(&self) -> &[Self::Block];
}
