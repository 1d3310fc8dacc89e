//! One batch through a pipeline: the rank runs its stage's blocks on each micro-batch in the order its schedule
//! gives, receiving each forward pass's input from the stage before it and each backward pass's gradient from the
//! stage after it.
//!
//! ```text
//! stage s, pass F(i):  x = before(micro-batch i)            (s = 0)   | x = receive from s - 1 (s > 0)
//!                      y = stage's blocks(x), kept with its graph
//!                      loss_i = after(y, micro-batch i)     (last)    | send y to s + 1 (not last)
//! stage s, pass B(i):  backward of loss_i × loss scale      (last)    | backward of sum(y * receive from s + 1)
//!                      gradients added to the window's, in micro-batch order; x's gradient sent to s - 1 (s > 0)
//! then:                the window's end as `backward`'s, over the stage's parameters and micro-batches × windows
//! ```
//!
//! A send goes out at once, unless the stage's next pass receives from the same neighbour: then both go in one
//! batch of the collective interface's `send_recv` (every send posted before the receive waits), so that a stage
//! that sends an activation forward while its neighbour sends a gradient back (1F1B's steady state) never waits
//! on it (Megatron's `send_forward_recv_backward` and `send_backward_recv_forward`). Gradients accumulate in the order one process accumulating the same
//! micro-batches would add them, so a pipelined step gives the same bits.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use burn::module::ParamId;
use burn::tensor::{DType, Tensor};

mod mailbox;
mod tied;
mod checks;
mod window;
mod forward;
mod tops;
mod recompute;

use checks::*;
pub(crate) use tops::Tops;
#[cfg(feature = "train")]
pub(crate) use tops::whole_batch_top;

use mailbox::{Mailbox, micros};
use tied::sum_tied;

use crate::distributed::comm::ReduceOp;
use crate::distributed::strategy::{BlockPass, unshard, unshard_except};
use crate::distributed::tensor_comm::Incoming;
use crate::error::{Error, Result};
use crate::grad::param_ids;
use crate::grad::window::{BackwardPlan, model_key};
use crate::graph_cut::{self as cut, Tape};
use crate::model::{Blocks, Split};
use crate::pipeline_parallel::Stages;
use crate::pipeline_parallel::schedule::{Pass, stage_passes};
use crate::pipeline_parallel::{SpanKind, StageTrace, TraceSpan};
use crate::step::StepPipeline;
use crate::step::block_wise::{BlockSeeds, generator};
use crate::tensor_parallel::dropout;

/// What a forward pass left for its backward pass: the graph of each of the stage's blocks apart, cut at every
/// block's input, so that a backward pass runs block by block from the last, adding each block's gradients to the
/// window's before the next block's are computed. (One graph for the stage would hold a whole second set of the
/// stage's gradients beside the window's until its backward pass ends: a stage accumulating micro-batches then
/// peaks at 4 more bytes a parameter than one process.)
struct Live<const D: usize> {
    /// The stage's input, received from the stage before (tracked, to send its gradient back; none on the first
    /// stage).
    input: Option<Tensor<D>>,
    /// Each inner cut, from the first: the output of the block before it (tracked in that block's graph) and the
    /// input of the block after it (the same values, tracked anew).
    cuts: Vec<(Tensor<D>, Tensor<D>)>,
    /// Under activation checkpointing, instead of the cuts: each block's input, the blocks run without a graph
    /// and recomputed with one in the backward pass.
    recompute: Option<Recompute<D>>,
    /// Where the last block's graph ends (none when this stage did not compute the micro-batch: a pass failed
    /// here or before).
    end: Option<End<D>>,
    /// Under a sharded stage, what `before` and `after` run again in the backward pass (see [`Deferred`]).
    deferred: Option<Deferred<D>>,
    /// The tensor-parallel cuts of each graph the backward pass runs (see `graph_cut`), taken off the
    /// tape as the forward pass made them: one per block, from the first (the first's holding `before`'s, the
    /// last's `after`'s); under activation checkpointing, `after`'s (`before`'s go with [`Recompute`], the blocks'
    /// are made again by their recompute). Empty without tensor parallelism.
    tapes: Vec<Tape>,
}

/// Under a sharded stage (`FULL_SHARD`, the hybrids), what is outside the blocks (the embeddings on the first
/// stage, the head on the last) is gathered for each use and freed after it, as FSDP2 shards them as units of
/// their own: for each micro-batch's `before` or `after`, and again for its backward pass, which runs them anew
/// (with the random numbers of their forward pass) instead of keeping them gathered for the whole step.
struct Deferred<const D: usize> {
    /// On the first stage, `before`'s output, tracked anew where `before` trains: its recompute's gradient.
    h0: Option<Tensor<D>>,
    /// On the last stage, the blocks' output, tracked anew: where the loss's recompute starts.
    top: Option<Tensor<D>>,
    /// The seeds of `before`'s and `after`'s draws.
    seeds: BlockSeeds,
    /// Where `before`'s and `after`'s tensor-parallel dropout draws began (see `tensor_parallel::dropout`), to
    /// draw the same masks when they run again.
    sites: [u64; 2],
}

/// What a checkpointed forward pass keeps for the backward pass's recompute.
struct Recompute<const D: usize> {
    /// Each block's input, from the first: on the first stage the first is `before`'s output with its graph (the
    /// embeddings'), on the others the received activation (tracked); the rest hold no graph.
    inputs: Vec<Tensor<D>>,
    /// The seeds that give each block's recompute the random numbers (dropout masks) of its forward pass.
    seeds: BlockSeeds,
    /// Whether the blocks draw random numbers (then each seed and block runs under the process's generator lock).
    draws: bool,
    /// On the last stage, the last block's output tracked anew: where the loss's graph starts.
    top: Option<Tensor<D>>,
    /// The tensor-parallel cuts of `before`'s graph (the first stage's), for its backward pass.
    before_cuts: Tape,
    /// Where each block's tensor-parallel dropout draws began, to draw its masks again in its recompute.
    sites: Vec<u64>,
}

/// Where a stage's last graph ends.
enum End<const D: usize> {
    /// An inner stage's output, sent to the next stage, whose gradient comes back from it.
    Output(Tensor<D>),
    /// The last stage's micro-batch loss.
    Loss(Tensor<1>),
    /// The last stage's micro-batch loss, its value only: the graph is made anew in the backward pass (see
    /// [`Deferred`]).
    Deferred(Tensor<1>),
}

impl StepPipeline {
    /// One batch's forward and backward pass on this rank's stage of `stages` (see `Accelerator::backward_batch`).
    /// On the last stage, `tops` (when given) receives each micro-batch's output of the blocks.
    pub(crate) fn backward_staged<M, B, const D: usize>(
        &self,
        stages: &Arc<Stages>,
        model: &M,
        batch: B,
        (before, block, after): (
            impl Fn(&M, &B) -> Tensor<D>,
            impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
            impl Fn(&M, Tensor<D>, &B) -> Tensor<1>,
        ),
        (checkpoint, tops): (bool, Option<&Tops<D>>),
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
        B: Split,
    {
        let started = Instant::now();
        let layout = stages.layout;
        let (s, p) = (layout.stage, layout.stages);
        let range = stages.blocks_of(model)?[s].clone();
        if stages.pipe.debug() {
            check_stages_agree(stages, &range, model.blocks().len(), batch.samples())?;
        }
        // A batch that cannot be cut stops this replica's stages computing, not their collectives: every rank
        // learns of it at the step's verdict (see `micro_batches`).
        let (m, parts, unsplit) = micro_batches(batch, stages.micro_batches, "backward_batch");
        let last = layout.is_last_stage();
        // Under a sharded stage the stage's blocks are gathered for the step and what is outside them for each use
        // (see `Deferred`); otherwise every rank of the stage holds it all already.
        let per_use = self.strategy.block_pass() == BlockPass::GatherEachBlock && (s == 0 || last);
        let all_blocks: HashSet<ParamId> = model.blocks().iter().flat_map(param_ids).collect();
        let whole = match per_use {
            true => {
                let rest: HashSet<ParamId> = param_ids(model)
                    .into_iter()
                    .filter(|id| !all_blocks.contains(id))
                    .collect();
                unshard_except(self.strategy.as_ref(), model, &rest)?
            }
            false => unshard(self.strategy.as_ref(), model)?,
        };
        let gather_rest = || -> Result<M> {
            match per_use {
                true => unshard_except(self.strategy.as_ref(), &whole, &all_blocks),
                false => Ok(whole.clone()),
            }
        };
        let blocks = &whole.blocks()[range.clone()];
        // Under activation checkpointing the forward passes run the blocks without a graph: frozen once a step.
        let frozen: Vec<M::Block> = match checkpoint {
            true => blocks
                .iter()
                .map(|b| burn::module::Module::no_grad(b.clone()))
                .collect(),
            false => Vec::new(),
        };
        let mut mail = Mailbox::new(stages, &whole, started, "backward_batch")?;
        let device = mail.device.clone();
        let mut live: HashMap<usize, Live<D>> = HashMap::new();
        let mut losses: Vec<Option<Tensor<1>>> = vec![None; m];
        let passes = stage_passes(stages.schedule, s, p, m);
        let keep_top = |i: usize, y: &Tensor<D>| {
            if let (true, Some(tops)) = (last, tops) {
                tops.borrow_mut().push((i, y.clone().detach()));
            }
        };
        // A pass that fails (an error, or a panic such as LibTorch's out-of-memory one) stops this stage computing
        // the step, but not its messages: it sends on what its neighbours wait for (a header marked failed for an
        // activation, zeros for a gradient), so every stage ends the step and learns of the failure together.
        let mut failure: Option<Failure> = unsplit.map(|e| Failure::Here(Caught::Error(e)));
        for (k, &pass) in passes.iter().enumerate() {
            let next = passes.get(k + 1).copied();
            match pass {
                Pass::Forward(i) => {
                    let input = match s {
                        0 => None,
                        _ => match mail.receive_activation::<D>(s - 1, i)? {
                            Some(x) => Some(x.require_grad()),
                            None => {
                                failure.get_or_insert(Failure::Upstream);
                                None
                            }
                        },
                    };
                    let start = Instant::now();
                    // `before` on its part gathered for it, then freed (see `Deferred`).
                    let deferred_before =
                        |seeds: &BlockSeeds| -> Result<(Tensor<D>, Option<Tensor<D>>)> {
                            let rest = gather_rest()?;
                            // Its graph is made anew in the backward pass, with its cuts.
                            let h = cut::without_cuts(|| {
                                let _generator = self.blocks_draw().then(generator);
                                seeds.before_rest(&device);
                                before(&rest, &parts[i])
                            });
                            let trains = h.is_tracked();
                            let h = match trains {
                                true => h.detach().require_grad(),
                                false => h.detach(),
                            };
                            Ok((h.clone(), trains.then_some(h)))
                        };
                    // The loss's value on the head gathered for it, then freed; the graph is made anew in the
                    // backward pass.
                    let deferred_after =
                        |top: &Tensor<D>, seeds: &BlockSeeds| -> Result<Tensor<1>> {
                            let rest = gather_rest()?;
                            let loss = cut::without_cuts(|| {
                                let _generator = self.blocks_draw().then(generator);
                                seeds.before_after(&device);
                                after(&rest, top.clone(), &parts[i])
                            });
                            tracked(&loss)?;
                            Ok(loss.detach())
                        };
                    let forward = || -> Result<Live<D>> {
                        let mut deferred = match per_use {
                            true => Some(Deferred {
                                h0: None,
                                top: None,
                                seeds: self.pass_seeds(&device)?,
                                sites: [0; 2],
                            }),
                            false => None,
                        };
                        let mut y = match (&input, &mut deferred) {
                            (Some(x), _) => x.clone(),
                            (None, Some(d)) => {
                                d.sites[0] = dropout::site();
                                let (h, h0) = deferred_before(&d.seeds)?;
                                d.h0 = h0;
                                h
                            }
                            (None, None) => before(&whole, &parts[i]),
                        };
                        let mut cuts = Vec::with_capacity(blocks.len().saturating_sub(1));
                        let mut tapes = Vec::with_capacity(blocks.len());
                        for (j, b) in blocks.iter().enumerate() {
                            if j > 0 {
                                tapes.push(cut::take_tape());
                                let next = y.clone().detach().require_grad();
                                cuts.push((y, next.clone()));
                                y = next;
                            }
                            y = block(b, y);
                        }
                        keep_top(i, &y);
                        let end = match (last, &mut deferred) {
                            (true, Some(d)) => {
                                tapes.push(cut::take_tape());
                                let top = y.clone().detach().require_grad();
                                cuts.push((y, top.clone()));
                                d.sites[1] = dropout::site();
                                let value = deferred_after(&top, &d.seeds)?;
                                d.top = Some(top);
                                End::Deferred(value)
                            }
                            (true, None) => {
                                let loss = after(&whole, y, &parts[i]);
                                tracked(&loss)?;
                                tapes.push(cut::take_tape());
                                End::Loss(loss)
                            }
                            (false, _) => {
                                tapes.push(cut::take_tape());
                                End::Output(y)
                            }
                        };
                        Ok(Live {
                            input: input.clone(),
                            cuts,
                            recompute: None,
                            end: Some(end),
                            deferred,
                            tapes,
                        })
                    };
                    // Activation checkpointing: the blocks run without a graph, keeping only their inputs.
                    let forward_checkpointed = || -> Result<Live<D>> {
                        let mut deferred = match per_use {
                            true => Some(Deferred {
                                h0: None,
                                top: None,
                                seeds: self.pass_seeds(&device)?,
                                sites: [0; 2],
                            }),
                            false => None,
                        };
                        let first = match (&input, &mut deferred) {
                            (Some(x), _) => x.clone(),
                            (None, Some(d)) => {
                                d.sites[0] = dropout::site();
                                let (h, h0) = deferred_before(&d.seeds)?;
                                d.h0 = h0;
                                h
                            }
                            (None, None) => {
                                let _generator = self.blocks_draw().then(generator);
                                before(&whole, &parts[i])
                            }
                        };
                        // `before`'s graph's cuts (the first stage's), for its backward pass.
                        let before_cuts = cut::take_tape();
                        let seeds = self.pass_seeds(&device)?;
                        let mut draws = self.blocks_draw();
                        let mut inputs = Vec::with_capacity(frozen.len());
                        let mut sites = Vec::with_capacity(frozen.len());
                        let mut y = first;
                        for (j, b) in frozen.iter().enumerate() {
                            inputs.push(y.clone());
                            sites.push(dropout::site());
                            let x = y.detach();
                            y = if k == 0 && j == 0 {
                                // Whether the blocks draw random numbers, found on the step's first block.
                                let _generator = generator();
                                seeds.before_block(&device, j);
                                let y = block(b, x).detach();
                                draws = seeds.block_drew(&device, j)?;
                                self.set_blocks_draw(draws);
                                y
                            } else {
                                let _generator = draws.then(generator);
                                seeds.before_block(&device, j);
                                block(b, x).detach()
                            };
                        }
                        keep_top(i, &y);
                        // The blocks ran without a graph: their recompute makes their cuts again.
                        drop(cut::take_tape());
                        let (end, top) = match (last, &mut deferred) {
                            (true, Some(d)) => {
                                let top = y.require_grad();
                                d.sites[1] = dropout::site();
                                let value = deferred_after(&top, &d.seeds)?;
                                d.top = Some(top.clone());
                                (End::Deferred(value), Some(top))
                            }
                            (true, None) => {
                                let top = y.require_grad();
                                let loss = {
                                    let _generator = draws.then(generator);
                                    after(&whole, top.clone(), &parts[i])
                                };
                                tracked(&loss)?;
                                (End::Loss(loss), Some(top))
                            }
                            (false, _) => (End::Output(y), None),
                        };
                        Ok(Live {
                            input: input.clone(),
                            cuts: Vec::new(),
                            recompute: Some(Recompute {
                                inputs,
                                seeds,
                                draws,
                                top,
                                before_cuts,
                                sites,
                            }),
                            end: Some(end),
                            deferred,
                            // `after`'s graph's cuts (the last stage's).
                            tapes: vec![cut::take_tape()],
                        })
                    };
                    let kept = match failure {
                        Some(_) => None,
                        None if checkpoint => guarded(forward_checkpointed)
                            .map_err(|e| failure = Some(Failure::Here(e)))
                            .ok(),
                        None => guarded(forward)
                            .map_err(|e| failure = Some(Failure::Here(e)))
                            .ok(),
                    };
                    if kept.is_some() {
                        mail.spans.push(span(SpanKind::Forward, i, started, start));
                    }
                    let mut kept = kept.unwrap_or(Live {
                        input,
                        cuts: Vec::new(),
                        recompute: None,
                        end: None,
                        deferred: None,
                        tapes: Vec::new(),
                    });
                    if !last {
                        let sent = match &kept.end {
                            Some(End::Output(y)) => mail.send_activation(s + 1, y),
                            _ => Err(Error::other("no activation")),
                        };
                        if let Err(e) = sent {
                            if kept.end.take().is_some() {
                                failure.get_or_insert(Failure::Here(Caught::Error(e)));
                            }
                            mail.send_failed::<D>(s + 1);
                        }
                        // Goes with the next receive when that comes from the same stage (a backward's
                        // gradient: Megatron's send_forward_recv_backward), else now.
                        if !matches!(next, Some(Pass::Backward(_))) {
                            mail.exchange(Vec::new(), i)?;
                        }
                    }
                    live.insert(i, kept);
                }
                Pass::Backward(i) => {
                    let Live {
                        input,
                        cuts,
                        recompute,
                        end,
                        deferred,
                        mut tapes,
                    } = live.remove(&i).ok_or_else(|| {
                        Error::other(format!(
                            "backward_batch: micro-batch {i} was not run forward"
                        ))
                    })?;
                    // The gradient of the activation this stage sent forward, if it sent one (a stage that had
                    // none sent a failed header, and its neighbour sends nothing back).
                    let g = match &end {
                        Some(End::Output(y)) => {
                            let incoming = Incoming {
                                peer: s + 1,
                                len: y.shape().num_elements(),
                                device: device.clone(),
                                dtype: y.dtype(),
                            };
                            Some(
                                mail.exchange(vec![incoming], i)?
                                    .remove(0)
                                    .reshape(y.dims()),
                            )
                        }
                        _ => None,
                    };
                    let start = Instant::now();
                    // The loss's graph made anew on the head gathered for it (see `Deferred`): its gradients
                    // collected, the head freed, the gradient of the blocks' output returned.
                    let deferred_loss = |d: &Deferred<D>| -> Result<cut::Passes> {
                        let top = d
                            .top
                            .as_ref()
                            .ok_or_else(|| Error::other("the last stage kept no output"))?;
                        let rest = gather_rest()?;
                        let loss = {
                            let _generator = self.blocks_draw().then(generator);
                            d.seeds.before_after(&device);
                            dropout::again_at(d.sites[1], || after(&rest, top.clone(), &parts[i]))
                        };
                        let mut grads = cut::backward(self.precision().scale_loss(loss))?;
                        self.shared.lock().grads.collect(&rest, &mut grads);
                        Ok(grads)
                    };
                    // `before` made anew on its part gathered for it, back-propagated from `g`, the gradient of
                    // its output; its gradients collected and the part freed.
                    let deferred_embed = |d: &Deferred<D>, g: Tensor<D>| -> Result<()> {
                        let rest = gather_rest()?;
                        let h = {
                            let _generator = self.blocks_draw().then(generator);
                            d.seeds.before_rest(&device);
                            dropout::again_at(d.sites[0], || before(&rest, &parts[i]))
                        };
                        let mut grads = cut::backward((h * g).sum())?;
                        self.shared.lock().grads.collect(&rest, &mut grads);
                        drop((grads, rest));
                        crate::heap::release_free_heap();
                        Ok(())
                    };
                    let backward = || -> Result<Option<Tensor<D>>> {
                        if let Some(recompute) = recompute {
                            let after_cuts = tapes.pop().unwrap_or_default();
                            let g = match end {
                                Some(End::Loss(loss)) => {
                                    losses[i] = Some(loss.clone().detach());
                                    cut::restore_tape(after_cuts);
                                    let mut grads =
                                        cut::backward(self.precision().scale_loss(loss))?;
                                    let top = recompute.top.as_ref().ok_or_else(|| {
                                        Error::other("the last stage kept no output")
                                    })?;
                                    let g = input_grad(top, &mut grads, s)?;
                                    self.shared.lock().grads.collect(&whole, &mut grads);
                                    g
                                }
                                Some(End::Deferred(value)) => {
                                    losses[i] = Some(value);
                                    let d = deferred.as_ref().ok_or_else(|| {
                                        Error::other("the last stage kept no deferred loss")
                                    })?;
                                    let mut grads = deferred_loss(d)?;
                                    let top = d.top.as_ref().ok_or_else(|| {
                                        Error::other("the last stage kept no output")
                                    })?;
                                    input_grad(top, &mut grads, s)?
                                }
                                Some(End::Output(_)) => {
                                    g.ok_or_else(|| Error::other("no gradient came back"))?
                                }
                                None => return Err(Error::other("the forward pass did not run")),
                            };
                            let embed = deferred.as_ref().filter(|d| d.h0.is_some());
                            let dx = self.recompute_backward(
                                &whole,
                                blocks,
                                &block,
                                recompute,
                                g,
                                (s, &device, embed.is_some()),
                            )?;
                            return match (embed, s) {
                                (Some(d), 0) => {
                                    let g = dx.ok_or_else(|| {
                                        Error::other("no gradient reached the embeddings")
                                    })?;
                                    deferred_embed(d, g)?;
                                    Ok(None)
                                }
                                _ => Ok(dx),
                            };
                        }
                        let mut grads = match end {
                            Some(End::Loss(loss)) => {
                                losses[i] = Some(loss.clone().detach());
                                cut::restore_tape(tapes.pop().unwrap_or_default());
                                cut::backward(self.precision().scale_loss(loss))?
                            }
                            Some(End::Deferred(value)) => {
                                losses[i] = Some(value);
                                deferred_loss(deferred.as_ref().ok_or_else(|| {
                                    Error::other("the last stage kept no deferred loss")
                                })?)?
                            }
                            // A first stage whose blocks and `before` are all frozen: nothing to back-propagate.
                            Some(End::Output(y)) if !y.is_tracked() => return Ok(None),
                            Some(End::Output(y)) => {
                                let g = g.ok_or_else(|| Error::other("no gradient came back"))?;
                                cut::restore_tape(tapes.pop().unwrap_or_default());
                                cut::backward((y * g).sum())?
                            }
                            None => return Err(Error::other("the forward pass did not run")),
                        };
                        // Block by block from the last: each block's gradients join the window's before the block
                        // before it runs backward (the same values as one graph's: the gradient crossing a cut is
                        // the one the graph would pass on, and `sum(y * g)` hands `g` on exactly).
                        for (output, next) in cuts.into_iter().rev() {
                            let g = input_grad(&next, &mut grads, s)?;
                            self.shared.lock().grads.collect(&whole, &mut grads);
                            drop((grads, next));
                            if !output.is_tracked() {
                                // The blocks below are frozen, and so is what feeds them (the first stage's
                                // `before`): nothing below needs a gradient.
                                return Ok(None);
                            }
                            // The block's graph, with the cuts its forward pass recorded.
                            cut::restore_tape(tapes.pop().unwrap_or_default());
                            grads = cut::backward((output * g).sum())?;
                        }
                        let dx = match &input {
                            Some(x) => Some(input_grad(x, &mut grads, s)?),
                            None => None,
                        };
                        let embed = match deferred.as_ref().and_then(|d| d.h0.as_ref()) {
                            Some(h0) => Some(input_grad(h0, &mut grads, s)?),
                            None => None,
                        };
                        self.shared.lock().grads.collect(&whole, &mut grads);
                        drop(grads);
                        if let (Some(d), Some(g)) = (deferred.as_ref(), embed) {
                            deferred_embed(d, g)?;
                        }
                        Ok(dx)
                    };
                    let dx = match failure {
                        Some(_) => None,
                        None => match guarded(backward) {
                            Ok(dx) => {
                                mail.spans.push(span(SpanKind::Backward, i, started, start));
                                dx
                            }
                            Err(e) => {
                                failure = Some(Failure::Here(e));
                                None
                            }
                        },
                    };
                    // The stage before waits for the gradient of every activation it sent: zeros once this
                    // stage has failed.
                    if let Some(x) = &input {
                        let n = x.shape().num_elements();
                        let dx =
                            dx.unwrap_or_else(|| Tensor::zeros(x.shape(), (&device, x.dtype())));
                        mail.send(s - 1, dx.reshape([n]));
                        // With the next forward's input from the same stage (send_backward_recv_forward), else now.
                        if !matches!(next, Some(Pass::Forward(_))) {
                            mail.exchange(Vec::new(), i)?;
                        }
                    }
                }
            }
        }
        if !mail.pending.is_empty() {
            mail.exchange(Vec::new(), m - 1)?;
        }
        // Every rank learns whether a stage failed before any other collective of the step.
        if let Err(e) = verdict(stages, failure, "backward_batch") {
            let mut core = self.shared.lock();
            core.grads.clear();
            core.state.reset_window();
            *self.window_splits.lock().unwrap_or_else(|e| e.into_inner()) = 0;
            return Err(e);
        }
        let busy: f64 = mail
            .spans
            .iter()
            .filter(|s| s.kind != SpanKind::Transfer)
            .map(|s| s.duration_us)
            .sum();
        self.shared.lock().phases.backward += std::time::Duration::from_secs_f64(busy / 1e6);

        // The loss, the mean over the micro-batches, from the last stage on every stage.
        let loss = if last {
            let losses: Vec<Tensor<1>> = losses.into_iter().flatten().collect();
            Tensor::cat(losses, 0).cast(DType::F32).mean()
        } else {
            Tensor::<1>::zeros([1], (&device, DType::F32))
        };
        let loss = stages
            .comm
            .broadcast(loss, p - 1, "pipeline loss")?
            .wait()?;

        let block_ids: HashSet<ParamId> = whole.blocks().iter().flat_map(param_ids).collect();
        let own: HashSet<ParamId> = blocks.iter().flat_map(param_ids).collect();
        self.end_stage_window(stages, model, &whole, (m, &device), (&own, &block_ids))?;
        *stages.last_trace.lock().unwrap_or_else(|e| e.into_inner()) = Some(StageTrace {
            stage: s,
            stages: p,
            replica: layout.replica,
            micro_batches: m,
            step_us: micros(started.elapsed()),
            spans: mail.spans,
        });
        Ok(loss)
    }
}
