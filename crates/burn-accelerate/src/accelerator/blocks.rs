//! Block-wise forward and backward passes: `FULL_SHARD` that holds one block's parameters at a time, and
//! activation checkpointing.

use burn::tensor::Tensor;

use super::Accelerator;
use crate::error::Result;
use crate::pipeline::Blocks;

impl Accelerator {
    /// One micro-batch's forward and backward pass through a model made of blocks ([`Blocks`]): `before` runs
    /// what precedes the blocks (embeddings) and returns the first activation, `block` runs one block on an
    /// activation, `after` runs what follows the blocks (the head) and returns the loss. Returns the loss
    /// (unscaled, detached) for logging; the gradients go where [`backward`](Self::backward) puts them, so the
    /// prepared optimizer steps as usual. Call it in place of `unshard`, the forward pass and `backward`: the same
    /// loop then runs in every mode.
    ///
    /// - **`FULL_SHARD`** (and `HYBRID_SHARD`): block by block. The forward pass gathers one block's parameters,
    ///   runs it without keeping a graph and drops them, keeping only the activations between blocks; the
    ///   backward pass walks the blocks in reverse, gathers each again, recomputes it with a graph,
    ///   back-propagates into it and reduce-scatters its gradients at once, so that this rank keeps only its own.
    ///   A rank never holds more than one block's gathered parameters and gradients, the activations between
    ///   blocks, and what is not in a block (gathered whole, as [`unshard`](Self::unshard) does), at the cost of
    ///   one more forward pass per step.
    /// - **Activation checkpointing** ([`activation_checkpointing`](crate::AcceleratorBuilder::activation_checkpointing),
    ///   any strategy): the same recompute, the gradients then reduced as `backward` reduces them.
    /// - Otherwise: `before`, every block and `after` on the whole model, then [`backward`](Self::backward).
    ///
    /// `before` and `after` are given the model with everything outside the blocks whole (under `FULL_SHARD` the
    /// blocks in it are this rank's slices: reach the blocks only through `block`). The device's random
    /// number generator is reseeded before each block, with the same value in its forward pass and its
    /// recompute, so that dropout draws the same masks in both. Burn's generators are process-wide, so while the
    /// blocks draw random numbers, ranks of one process ([`launch`](crate::launch)) take turns to run `before`,
    /// each block and `after` (the reseed and the draws after it); the closures therefore must not call collectives
    /// (`gather`, `reduce`, ...) themselves.
    /// Other threads of the process that draw random numbers at the same time (not ranks in `backward_blocks`)
    /// are not ordered with them.
    ///
    /// ```
    /// use burn::module::Module;
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn::optim::AdamConfig;
    /// use burn::tensor::Tensor;
    /// use burn_accelerate::{Accelerator, Blocks, ShardingStrategy};
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
    ///
    /// let losses = Accelerator::builder()
    ///     .sharding(ShardingStrategy::FullShard)
    ///     .launch(2, |acc| {
    ///         let device = acc.device().clone();
    ///         let stack = Stack {
    ///             layers: (0..4).map(|_| LinearConfig::new(8, 8).init(&device)).collect(),
    ///             head: LinearConfig::new(8, 1).init(&device),
    ///         };
    ///         let mut model = acc.prepare_model(stack)?;
    ///         let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
    ///         let mut losses = Vec::new();
    ///         for _ in 0..5 {
    ///             let x = Tensor::<2>::ones([4, 8], &device);
    ///             let loss = acc.backward_blocks(
    ///                 &model,
    ///                 |_| x.clone(),
    ///                 |layer, x| layer.forward(x).tanh(),
    ///                 |model, x| (model.head.forward(x) - 4.0).powi_scalar(2).mean(),
    ///             )?;
    ///             losses.push(loss.into_scalar::<f32>());
    ///             model = optimizer.try_step(model)?;
    ///         }
    ///         Ok(losses)
    ///     })?;
    /// assert!(losses[0][4] < losses[0][0], "{losses:?}");
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// The loss does not depend on the blocks' output or on any trainable parameter; a block's output does not
    /// depend on its input; a failed gather or reduction (a rank died, a timeout).
    pub fn backward_blocks<M, const D: usize>(
        &self,
        model: &M,
        before: impl FnOnce(&M) -> Tensor<D>,
        block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
        after: impl FnOnce(&M, Tensor<D>) -> Tensor<1>,
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
    {
        self.applied.check(self);
        self.pipeline.backward_blocks(
            model,
            before,
            block,
            after,
            self.config.memory.activation_checkpointing,
        )
    }
}
