//! A checkpointed micro-batch's backward pass on one stage: its blocks recomputed with a graph, one at a time from
//! the last (each block's tensor-parallel cuts made again by its recompute).

use burn::tensor::Tensor;

use super::Recompute;
use super::checks::input_grad;
use crate::distributed::strategy::trainable_params;
use crate::error::Result;
use crate::graph_cut as cut;
use crate::model::Blocks;
use crate::step::StepPipeline;
use crate::step::block_wise::generator;

impl StepPipeline {
    /// A checkpointed micro-batch's backward pass on stage `s`: each block recomputed with a graph, from the last,
    /// with the seeds of its forward pass, its gradients added to the window's before the block before it runs,
    /// from `g`, the gradient of the stage's output; returns the gradient of the stage's input (none on the first
    /// stage, where it goes on into `before`'s graph, the embeddings'; but the gradient of `before`'s output where
    /// `embed_deferred`: the caller runs `before` anew).
    pub(super) fn recompute_backward<M: Blocks, const D: usize>(
        &self,
        whole: &M,
        blocks: &[M::Block],
        block: &impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
        recompute: Recompute<D>,
        mut g: Tensor<D>,
        (s, device, embed_deferred): (usize, &burn::tensor::Device, bool),
    ) -> Result<Option<Tensor<D>>> {
        let Recompute {
            inputs,
            seeds,
            draws,
            before_cuts,
            sites,
            ..
        } = recompute;
        let first = inputs.first().cloned();
        // On the first stage, below the lowest block that trains nothing needs a gradient when `before` is frozen
        // too: those blocks are not recomputed. A later stage sends its input's gradient back, so recomputes all.
        let lowest = match (s, &first) {
            (0, Some(h0)) if !h0.is_tracked() => blocks
                .iter()
                .position(|b| !trainable_params(b).is_empty())
                .unwrap_or(blocks.len()),
            _ => 0,
        };
        for (j, (b, stored)) in blocks.iter().zip(inputs).enumerate().skip(lowest).rev() {
            let needs_input_grad =
                s > 0 || j > lowest || first.as_ref().is_some_and(|h| h.is_tracked());
            // A received activation is the leaf its gradient is read from; any other input starts a graph anew.
            let x = match (j, s) {
                (0, 1..) => stored,
                _ if needs_input_grad => stored.detach().require_grad(),
                _ => stored.detach(),
            };
            let y = {
                let _generator = draws.then(generator);
                seeds.before_block(device, j);
                // The block's tensor-parallel dropout masks drawn again where its forward pass drew them.
                let site = sites.get(j).copied().unwrap_or_default();
                crate::tensor_parallel::dropout::again_at(site, || block(b, x.clone()))
            };
            let mut grads = cut::backward((y * g.clone()).sum())?;
            if needs_input_grad {
                g = input_grad(&x, &mut grads, s)?;
            }
            self.shared.lock().grads.collect(whole, &mut grads);
        }
        if lowest > 0 {
            return Ok(None);
        }
        if embed_deferred && s == 0 {
            // The embeddings are made anew by the caller (see `Deferred`): the gradient of their output.
            return Ok(Some(g));
        }
        match first {
            Some(h0) if s == 0 && h0.is_tracked() => {
                // `before`'s graph, with the tensor-parallel cuts its forward pass recorded.
                cut::restore_tape(before_cuts);
                let mut grads = cut::backward((h0 * g).sum())?;
                self.shared.lock().grads.collect(whole, &mut grads);
                Ok(None)
            }
            _ if s == 0 => Ok(None),
            _ => Ok(Some(g)),
        }
    }
}
