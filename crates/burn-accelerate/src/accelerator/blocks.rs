//! Block-wise forward and backward passes: `FULL_SHARD` that holds one block's parameters at a time, and
//! activation checkpointing.

use burn::tensor::Tensor;

use super::Accelerator;
use crate::error::Result;
use crate::model::Blocks;

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
    /// blocks in it are this rank's slices: reach the blocks only through `block`). Under `FULL_SHARD` what is
    /// outside the blocks is gathered for each use and freed after it (FSDP2's units of their own): for `before`,
    /// for `after` and the loss, and for `before` again in the backward pass, which recomputes it (so `before` is
    /// a `Fn`, and draws the same random numbers both times); each part's gradients are reduce-scattered as soon
    /// as they exist. The device's random
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
        before: impl Fn(&M) -> Tensor<D>,
        block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
        after: impl FnOnce(&M, Tensor<D>) -> Tensor<1>,
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
    {
        self.applied.check(self);
        let loss = self.step.backward_blocks(
            model,
            before,
            block,
            after,
            self.config.memory.activation_checkpointing,
        );
        crate::tensor_parallel::dropout::next_pass();
        loss
    }
}

impl Accelerator {
    /// One batch's forward and backward pass through a model made of blocks, the call one loop makes in every
    /// mode: plain, data-parallel, `FULL_SHARD` block by block, and pipelined. `batch` is the whole batch and the
    /// closures see one micro-batch of it: `before(model, micro_batch)` returns the first activation,
    /// `block(block, x)` runs one block, `after(model, x, micro_batch)` returns the loss.
    ///
    /// - Without a pipeline (`pp_size` 1), this is [`backward_blocks`](Self::backward_blocks) on the whole batch.
    /// - With [`pp_size`](crate::AcceleratorBuilder::pp_size) `P` > 1, the blocks are cut into `P` contiguous
    ///   stages balanced by their parameters, and this rank runs its stage's: the batch is split
    ///   ([`Split`](crate::Split)) into [`pp_microbatches`](crate::AcceleratorBuilder::pp_microbatches)
    ///   micro-batches that flow through the stages in the order the [schedule](crate::PipelineSchedule) gives,
    ///   the first stage running `before`, the last `after`. Activations and their gradients cross the stages
    ///   through the collective interface's batched point-to-point messages. The gradients are the mean over the
    ///   micro-batches: the same bits as one process accumulating the same micro-batches in the same order
    ///   (`gradient_accumulation_steps` = micro-batches). Each stage's data-parallel group reduces its
    ///   gradients as [`backward`](Self::backward) does; the fp16 overflow verdict and
    ///   [`clip_grad_norm`](Self::clip_grad_norm)'s norm span every stage. The last stage's loss (the mean over
    ///   the micro-batches) comes back on every rank. With
    ///   [`activation_checkpointing`](crate::AcceleratorBuilder::activation_checkpointing) a stage keeps only
    ///   each block's input for each micro-batch in flight and recomputes the block in the backward pass (with
    ///   its forward pass's dropout masks): the same bits, less memory, one more forward pass.
    ///
    /// ```
    /// use burn::module::Module;
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn::optim::SgdConfig;
    /// use burn::tensor::Tensor;
    /// use burn_accelerate::{Accelerator, Blocks};
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
    /// // Two stages of two layers each, four micro-batches per batch.
    /// let losses = Accelerator::builder()
    ///     .pp_size(2)
    ///     .pp_microbatches(4)
    ///     .launch(2, |acc| {
    ///         let device = acc.device().clone();
    ///         let stack = Stack {
    ///             layers: (0..4).map(|_| LinearConfig::new(8, 8).init(&device)).collect(),
    ///             head: LinearConfig::new(8, 1).init(&device),
    ///         };
    ///         let mut model = acc.prepare_blocks(stack)?;
    ///         let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 1e-2);
    ///         let mut losses = Vec::new();
    ///         for _ in 0..5 {
    ///             let (x, y) = (Tensor::<2>::ones([8, 8], &device), Tensor::<2>::ones([8, 1], &device));
    ///             let loss = acc.backward_batch(
    ///                 &model,
    ///                 (x, y),
    ///                 |_, (x, _)| x.clone(),
    ///                 |layer, x| layer.forward(x).tanh(),
    ///                 |model, x, (_, y)| (model.head.forward(x) - y.clone()).powi_scalar(2).mean(),
    ///             )?;
    ///             losses.push(loss.into_scalar::<f32>());
    ///             model = optimizer.try_step(model)?;
    ///         }
    ///         Ok(losses)
    ///     })?;
    /// assert_eq!(losses[0], losses[1], "every stage gets the loss");
    /// assert!(losses[0][4] < losses[0][0], "{losses:?}");
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`backward_blocks`](Self::backward_blocks); under a pipeline, a batch with fewer samples than
    /// micro-batches, a model with fewer blocks than stages, a stage that failed or did not answer within the
    /// collective timeout.
    pub fn backward_batch<M, B, const D: usize>(
        &self,
        model: &M,
        batch: B,
        before: impl Fn(&M, &B) -> Tensor<D>,
        block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
        after: impl Fn(&M, Tensor<D>, &B) -> Tensor<1>,
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
        B: crate::Split,
    {
        let loss = self.backward_batch_keeping(model, batch, (before, block, after), None);
        crate::tensor_parallel::dropout::next_pass();
        loss
    }

    /// [`backward_batch`](Self::backward_batch), the last stage of a pipeline keeping each micro-batch's output
    /// of the blocks in `tops` (burn-train's Learner runs the head on them once more, for the batch's item).
    pub(crate) fn backward_batch_keeping<M, B, const D: usize>(
        &self,
        model: &M,
        batch: B,
        (before, block, after): (
            impl Fn(&M, &B) -> Tensor<D>,
            impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
            impl Fn(&M, Tensor<D>, &B) -> Tensor<1>,
        ),
        tops: Option<&crate::pipeline_parallel::runtime::Tops<D>>,
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
        B: crate::Split,
    {
        self.applied.check(self);
        let checkpoint = self.config.memory.activation_checkpointing;
        match &self.stage {
            Some(stage) => self.step.backward_staged(
                stage,
                model,
                batch,
                (before, block, after),
                (checkpoint, tops),
            ),
            None => self.step.backward_blocks(
                model,
                |m| before(m, &batch),
                block,
                |m, x| after(m, x, &batch),
                checkpoint,
            ),
        }
    }

    /// A forward pass for evaluation through a model made of blocks, with the closures of
    /// [`backward_batch`](Self::backward_batch): `after(model, x, micro_batch)` returns per-sample values (a loss
    /// per sample, a prediction, a count of correct answers) as one dimension. Returns them for the whole batch,
    /// in order, on every rank; no gradient is kept. Without a pipeline this is `before`, every block and `after`
    /// on the whole batch (under `FULL_SHARD` block by block, as the training pass: what is outside the blocks
    /// gathered for `before` and `after`, each block gathered in turn and dropped after it); under one, the
    /// micro-batches flow forward
    /// through the stages and the last stage's values come back on every stage, ready for
    /// [`gather_for_metrics`](Self::gather_for_metrics).
    ///
    /// # Errors
    /// As [`backward_batch`](Self::backward_batch).
    pub fn forward_batch<M, B, const D: usize>(
        &self,
        model: &M,
        batch: B,
        before: impl Fn(&M, &B) -> Tensor<D>,
        block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
        after: impl Fn(&M, Tensor<D>, &B) -> Tensor<1>,
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
        B: crate::Split,
    {
        // No backward pass follows: the tensor-parallel regions' cuts are dropped, the tape left as it was.
        crate::graph_cut::without_cuts(|| match &self.stage {
            Some(stage) => self
                .step
                .forward_staged(stage, model, batch, (before, block, after)),
            None => self
                .step
                .forward_whole(model, batch, (before, block, after)),
        })
    }

    /// [`prepare_model`](Self::prepare_model) for a model made of blocks: under a pipeline (`pp_size` > 1) this
    /// rank keeps only its stage's blocks. The main process draws each parameter and sends a block's only to the
    /// ranks of the stage that runs it; elsewhere it arrives as an empty placeholder, so that neither it nor its
    /// gradient or optimizer state ever takes memory there. What is outside the blocks (embeddings, the head) goes
    /// to the first and the last stage, where `before` and `after` run; the stages between never hold it (so
    /// `block` must reach nothing outside its block, as it is given only the block).
    /// Without a pipeline, the same as `prepare_model`.
    ///
    /// # Errors
    /// As [`prepare_model`](Self::prepare_model); under a pipeline, fewer blocks than stages.
    pub fn prepare_blocks<M: Blocks>(&self, model: M) -> Result<M> {
        let Some(stages) = self.stage() else {
            return self.prepare_model(model);
        };
        let ranges = stages.blocks_of(&model)?;
        let mut stage_of = std::collections::HashMap::new();
        for (i, block) in model.blocks().iter().enumerate() {
            if let Some(stage) = ranges.iter().position(|r| r.contains(&i)) {
                for id in crate::grad::param_ids(block) {
                    stage_of.insert(id, vec![stage]);
                }
            }
        }
        // What is outside the blocks only `before` (the first stage) and `after` (the last) can reach.
        let ends = vec![0, stages.layout.stages - 1];
        let owners = crate::grad::param_ids(&model)
            .iter()
            .map(|id| stage_of.get(id).cloned().unwrap_or_else(|| ends.clone()))
            .collect();
        // Each block's parameters arrive only on its stage's ranks, placeholders elsewhere (see `Staged::arrive`).
        *stages.arrivals.lock().unwrap_or_else(|e| e.into_inner()) = Some((owners, 0));
        let prepared = self.prepare_model(model);
        *stages.arrivals.lock().unwrap_or_else(|e| e.into_inner()) = None;
        prepared
    }

    /// Where this rank sits in the pipeline × data mesh (one stage, every rank a replica, without a pipeline).
    pub fn pipeline_layout(&self) -> crate::PipelineLayout {
        let (dims, coords) = (self.parallel_dims(), self.mesh_coords());
        crate::PipelineLayout {
            stage: coords.pp,
            stages: dims.pp,
            replica: coords.dp(&dims),
            replicas: dims.dp(),
        }
    }

    /// The device mesh this run trains on: the size of each parallelism's dimension (`pp`, `dp_replicate`,
    /// `dp_shard`, `cp`, `tp`), built once from the settings when the accelerator was.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, ParallelDims, ShardingStrategy};
    ///
    /// let dims = Accelerator::builder()
    ///     .sharding(ShardingStrategy::FullShard)
    ///     .launch(2, |acc| Ok(acc.parallel_dims()))?;
    /// assert_eq!(dims[0], ParallelDims { pp: 1, dp_replicate: 1, dp_shard: 2, cp: 1, tp: 1 });
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    pub fn parallel_dims(&self) -> crate::ParallelDims {
        self.mesh.dims
    }

    /// Where this rank sits on the mesh ([`parallel_dims`](Self::parallel_dims)): its index along each dimension.
    pub fn mesh_coords(&self) -> crate::MeshCoords {
        self.mesh.coords
    }

    /// This rank's slice of sequences of `seq_len` positions under context parallelism (`cp_size` > 1): which
    /// positions it holds, and its tokens, targets and position ids cut to them
    /// ([`ContextSplit::part`](crate::context_parallel::ContextSplit::part),
    /// [`position_ids`](crate::context_parallel::ContextSplit::position_ids)); every position with `cp_size` 1.
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// let positions = Accelerator::builder()
    ///     .cp_size(2)
    ///     .launch(2, |acc| Ok(acc.context_split(8)?.positions()))?;
    /// assert_eq!(positions, vec![vec![0, 1, 6, 7], vec![2, 3, 4, 5]]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// A `seq_len` that `2 × cp_size` does not divide, saying how to fix it.
    pub fn context_split(&self, seq_len: usize) -> Result<crate::context_parallel::ContextSplit> {
        match self.mesh.dims.cp {
            1 => Ok(crate::context_parallel::ContextSplit::whole(seq_len)),
            cp => crate::context_parallel::ContextSplit::new(
                seq_len,
                self.mesh.coords.cp,
                cp,
                self.config.distributed.cp_load_balance,
            ),
        }
    }

    /// This rank's last pipelined step ([`backward_batch`](Self::backward_batch) under `pp_size` > 1): each
    /// forward and backward pass and each transfer in time, and the stage's idle share. Gather every rank's
    /// (`gather_for_metrics_objects`) and write [`chrome_trace`](crate::pipeline_parallel::chrome_trace) of them
    /// to see the schedule in a browser. `None` before the first pipelined step.
    pub fn pipeline_trace(&self) -> Option<crate::StageTrace> {
        self.stage()?
            .last_trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
