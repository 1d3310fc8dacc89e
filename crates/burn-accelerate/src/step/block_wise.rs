//! Block-wise passes: a model made of a sequence of blocks ([`Blocks`]) runs its forward pass one block at a
//! time, keeping only the activations between blocks, and its backward pass recomputes each block in reverse
//! order (activation checkpointing). Under `FULL_SHARD` each block's parameters are gathered just before it
//! runs and dropped after, and its gradients are reduce-scattered as soon as its backward produced them, so a
//! rank never holds more than one block's gathered parameters or gradients (FSDP2's `fully_shard(block)`).
//!
//! ```text
//! forward (no graph):  rest = gather(all but the blocks) ─> h0 = before(rest)
//!                      x[i+1] = block_i(gather(block_i), x[i])          (x[0] = h0, each block dropped after)
//! head:                loss = after(rest, x[L]) ─> backward ─> the head's gradients, the gradient g of x[L]
//! blocks, in reverse:  gather(block_i) ─> y = block_i(x[i]) with a graph ─> backward of sum(y * g)
//!                      ─> block_i's gradients (reduce-scattered at once under FULL_SHARD), g = gradient of x[i]
//! before:              backward of sum(h0 * g) ─> the embedding's gradients; the rest's reduced last
//! ```
//!
//! Burn 0.22 has no hook that frees a gathered parameter inside a graph: its autodiff graph keeps every input a
//! step saved until backward reaches it. Recomputing each block in its own short graph is what lets a rank hold
//! one block at a time, at the cost of one more forward pass per step; a custom backward operation would need
//! backend primitives and would run the inner backward passes under the outer graph's lock. The device's random
//! number generator is reseeded with the same value before a block's forward and its recompute, so that dropout
//! draws the same masks in both.

use std::collections::HashSet;

use burn::module::{Module, ParamId};
use burn::tensor::{Distribution, Tensor};

use super::{Reduced, StepPipeline};
use crate::distributed::strategy::{
    BlockPass, FinishReduce, start_unshard, trainable_params, unshard, unshard_except,
};
use crate::error::{Error, Result};
use crate::grad::window::model_key;
use crate::grad::{GradientBuffer, param_ids};
use crate::model::Blocks;

/// The parameter ids of every block of `model`.
fn block_ids<M: Blocks>(model: &M) -> HashSet<ParamId> {
    model.blocks().iter().flat_map(param_ids).collect()
}

/// The device `model`'s parameters live on.
///
/// # Errors
/// A model without a float parameter.
fn model_device<M: Module>(model: &M) -> Result<burn::tensor::Device> {
    let mut device = None;
    crate::named_params::floats(model, |p| {
        device.get_or_insert_with(|| p.placement().0);
    });
    device.ok_or_else(|| {
        Error::InvalidArgument(
            "backward_blocks: the model has no float parameter; prepare a model with parameters to train".into(),
        )
    })
}

/// What a block-wise `FULL_SHARD` pass reduces of the parameters outside the blocks, and when: `after`'s part
/// (what the loss reached on some rank) as soon as the head's backward pass has run, the rest (what `before`
/// reached, and anything no rank's `after` did) once `before`'s recompute has. Learnt on a model's first pass
/// (one all-reduce of which ranks reached what), the same lists on every rank.
#[derive(Debug, Clone)]
pub(crate) struct RestParts {
    /// The parameters outside the blocks these parts cover, in visiting order.
    of: Vec<ParamId>,
    after: Vec<(ParamId, usize)>,
    before: Vec<(ParamId, usize)>,
}

impl StepPipeline {
    /// A forward pass for evaluation of a model made of blocks (see `Accelerator::forward_batch`): the whole
    /// batch through the whole model, without a graph. Under `FULL_SHARD` (a strategy that gathers each block)
    /// block by block, as the training pass: what is outside the blocks gathered for `before` and `after`, each
    /// block gathered as the one before it computes (prefetch) and dropped after it, so that evaluation holds at
    /// most two blocks whole beside this rank's slices.
    pub fn forward_whole<M: Blocks, B, const D: usize>(
        &self,
        model: &M,
        batch: B,
        (before, block, after): (
            impl Fn(&M, &B) -> Tensor<D>,
            impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
            impl Fn(&M, Tensor<D>, &B) -> Tensor<1>,
        ),
    ) -> Result<Tensor<1>> {
        let strategy = self.strategy.as_ref();
        if strategy.block_pass() != BlockPass::GatherEachBlock {
            let whole = unshard(strategy, model)?;
            let mut x = before(&whole, &batch);
            for b in whole.blocks() {
                x = block(b, x);
            }
            return Ok(after(&whole, x, &batch).detach());
        }
        let rest = unshard_except(strategy, model, &block_ids(model))?;
        // No graph: a model that tracks gradients would keep each gathered block alive in it.
        let mut x = before(&rest, &batch).detach();
        let mut next = None;
        for (i, b) in model.blocks().iter().enumerate() {
            let started = match next.take() {
                Some(started) => started,
                None => start_unshard(strategy, b)?,
            };
            let whole = started.finish()?;
            if let Some(b) = model.blocks().get(i + 1) {
                next = Some(start_unshard(strategy, b)?);
            }
            x = block(&whole, x).detach();
            drop(whole);
        }
        Ok(after(&rest, x, &batch).detach())
    }
}

impl StepPipeline {
    /// The parts learnt for `model` whose parameters outside the blocks are `rest` (none before its first pass,
    /// or when they changed: a layer unfrozen since).
    fn rest_parts<M: Module>(&self, model: &M, rest: &[(ParamId, usize)]) -> Option<RestParts> {
        let parts = self.rest_parts.lock().unwrap_or_else(|e| e.into_inner());
        parts
            .get(&model_key(model))
            .filter(|p| p.of.iter().eq(rest.iter().map(|(id, _)| id)))
            .cloned()
    }

    /// Learns `model`'s parts from what this rank's first pass reached, `after` and `before`, and every other
    /// rank's (one all-reduce over the ranks): `after`'s part, what some rank's `after` reached; `before`'s, what
    /// some rank's `before` reached and whatever `after`'s part lacks.
    fn learn_rest_parts<M: Module>(
        &self,
        model: &M,
        rest: &[(ParamId, usize)],
        after: &HashSet<ParamId>,
        before: &HashSet<ParamId>,
    ) -> Result<()> {
        let flags: Vec<bool> = rest
            .iter()
            .map(|(id, _)| after.contains(id))
            .chain(rest.iter().map(|(id, _)| before.contains(id)))
            .collect();
        let any = self.strategy.any_rank_each(&flags)?;
        let n = rest.len();
        let parts = RestParts {
            of: rest.iter().map(|(id, _)| *id).collect(),
            after: (0..n).filter(|&j| any[j]).map(|j| rest[j]).collect(),
            before: (0..n)
                .filter(|&j| any[n + j] || !any[j])
                .map(|j| rest[j])
                .collect(),
        };
        self.rest_parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(model_key(model), parts);
        Ok(())
    }
}

/// Where a block-wise pass puts each part's gradients.
enum Sink {
    /// Into one local buffer, reduced across ranks as a whole at the end of the pass, as `backward` does.
    Local(Box<GradientBuffer>),
    /// Reduced across ranks part by part (this rank keeps its own), times `scale`, and added to the accumulated
    /// gradients.
    ReducedPerPart { scale: f32, reduced: Reduced },
}

impl StepPipeline {
    /// One micro-batch's forward and backward pass through `model`'s blocks (see the module's documentation):
    /// `before` runs what precedes the blocks, `block` one block, `after` what follows them and the loss. Without
    /// `FULL_SHARD` and without `checkpoint` this is a plain forward pass and [`backward`](Self::backward).
    /// Returns the (unscaled) loss, detached.
    pub fn backward_blocks<M, const D: usize>(
        &self,
        model: &M,
        before: impl Fn(&M) -> Tensor<D>,
        block: impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
        after: impl FnOnce(&M, Tensor<D>) -> Tensor<1>,
        checkpoint: bool,
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
    {
        let strategy = self.strategy.as_ref();
        let gather_each_block = strategy.block_pass() == BlockPass::GatherEachBlock;
        if !gather_each_block && !checkpoint {
            let whole = unshard(strategy, model)?;
            let mut x = before(&whole);
            for b in whole.blocks() {
                x = block(b, x);
            }
            let loss = after(&whole, x);
            let value = loss.clone().detach();
            self.backward(loss, &whole)?;
            return Ok(value);
        }
        let started = std::time::Instant::now();
        let sync_before = self.shared.lock().phases.gradient_sync;
        let blocks = block_ids(model);
        // What is outside the blocks (embeddings, the head): where every rank holds it whole, held for the whole
        // pass; under FULL_SHARD gathered for each use and freed after it, as FSDP2 shards them as units of their
        // own (torchtitan's `tok_embeddings`, `norm` + `output`): for `before`'s forward, for `after` and the
        // loss, and for `before`'s recompute in the backward pass, each part's gradients reduce-scattered as soon
        // as they exist.
        let kept_rest = match gather_each_block {
            false => Some(unshard_except(strategy, model, &blocks)?),
            true => None,
        };
        let gather_rest = || -> Result<M> {
            match &kept_rest {
                Some(rest) => Ok(rest.clone()),
                None => unshard_except(strategy, model, &blocks),
            }
        };
        let rest = gather_rest()?;
        let rest_params: Vec<(ParamId, usize)> = trainable_params(&rest)
            .into_iter()
            .filter(|(id, _)| !blocks.contains(id))
            .collect();
        let parts = match gather_each_block {
            true => self.rest_parts(model, &rest_params),
            false => None,
        };
        let mut sink = if !gather_each_block {
            Sink::Local(Box::default())
        } else if self
            .shared
            .lock()
            .state
            .next_backward_is_whole_window(model_key(model))
        {
            // A pass that is its window (no accumulation) reduces with the window's normalisation and unscaling,
            // as `backward` does: the same bits.
            Sink::ReducedPerPart {
                scale: self.precision().unscaled(self.normalisation(1)),
                reduced: Reduced::Scaled,
            }
        } else {
            // Inside a window, each pass adds its mean over the ranks; the window's end scales the sum.
            Sink::ReducedPerPart {
                scale: 1.0,
                reduced: Reduced::Unscaled,
            }
        };

        // Forward, without a graph: only the activations between blocks are kept.
        // The generator is taken in turns only while the blocks draw random numbers (see `GENERATOR`): the last
        // pass's finding for `before`, this pass's (its first block's forward pass) for the rest. Where `before`
        // runs again in the backward pass (its part gathered anew), it is seeded alike both times.
        // Where `before`'s tensor-parallel dropout draws begin, to draw them again where it is recomputed.
        let before_sites = crate::tensor_parallel::dropout::site();
        let (h0, device, seeds) = if gather_each_block {
            let device = model_device(model)?;
            let seeds = self.pass_seeds(&device)?;
            let h0 = {
                let _generator = self.blocks_draw().then(generator);
                seeds.before_rest(&device);
                before(&rest)
            };
            (h0, device, seeds)
        } else {
            let h0 = {
                let _generator = self.blocks_draw().then(generator);
                before(&rest)
            };
            let device = h0.device();
            let seeds = self.pass_seeds(&device)?;
            (h0, device, seeds)
        };
        // The tensor-parallel cuts `before` made (a sequence-parallel embedding's scatter) wait for its own
        // backward pass: the loss's and the blocks' come first. Where `before` runs again, it cuts again.
        let before_cuts = crate::graph_cut::take_tape();
        // Whether `before` has parameters that train (a frozen embedding has none).
        let before_trains = h0.is_tracked();
        let h0 = match gather_each_block {
            // Its graph goes with the gathered part; `before` is recomputed with one in the backward pass.
            true => {
                drop(rest);
                h0.detach()
            }
            false => h0,
        };
        let mut boundaries: Vec<Tensor<D>> = Vec::with_capacity(model.blocks().len() + 1);
        let mut block_sites = Vec::with_capacity(model.blocks().len());
        boundaries.push(h0.clone().detach());
        let mut draws = true;
        // Which blocks train (a frozen block, `Module::no_grad`, has no parameter that does), from the gathered
        // blocks: the same on every rank.
        let mut trains = Vec::with_capacity(model.blocks().len());
        // Prefetch (FSDP's forward prefetch): block i + 1's gather is started before block i computes, so it
        // runs meanwhile; at most two blocks are gathered at once.
        let mut next = None;
        for (i, b) in model.blocks().iter().enumerate() {
            let started = match next.take() {
                Some(started) => started,
                None => start_unshard(strategy, b)?,
            };
            let whole = started.finish()?;
            trains.push(!trainable_params(&whole).is_empty());
            let whole = whole.no_grad();
            if let Some(b) = model.blocks().get(i + 1) {
                next = Some(start_unshard(strategy, b)?);
            }
            let x = boundaries[i].clone();
            // Where the block's tensor-parallel dropout draws begin, to draw them again in its recompute.
            block_sites.push(crate::tensor_parallel::dropout::site());
            let y = if i == 0 {
                let _generator = generator();
                seeds.before_block(&device, i);
                let y = block(&whole, x).detach();
                draws = seeds.block_drew(&device, i)?;
                self.set_blocks_draw(draws);
                y
            } else {
                let _generator = draws.then(generator);
                seeds.before_block(&device, i);
                block(&whole, x).detach()
            };
            drop(whole);
            boundaries.push(y);
        }

        // The head and the loss, with a graph from the last activation on.
        let top = boundaries
            .pop()
            .expect("the first activation is always there")
            .require_grad();
        let rest = gather_rest()?;
        let loss = {
            let _generator = draws.then(generator);
            after(&rest, top.clone())
        };
        if !loss.is_tracked() {
            return Err(Error::InvalidArgument(
                "backward_blocks: the loss is not connected to any parameter that requires a gradient; prepare \
                 the model with `accelerator.prepare_model(model)` and compute the loss in `after` from the \
                 activation it is given"
                    .into(),
            ));
        }
        let value = loss.clone().detach();
        let scaled = self.precision().scale_loss(loss);
        let mut grads = crate::graph_cut::backward(scaled)?;
        let mut upstream = grads.remove(&top).ok_or_else(|| {
            Error::InvalidArgument(
                "backward_blocks: the loss `after` returned does not depend on the activation it was given (the \
                 blocks' output); compute the loss from it"
                    .into(),
            )
        })?;
        let mut rest_grads = GradientBuffer::new();
        rest_grads.collect(&rest, &mut grads);
        drop(grads);
        let after_reached: HashSet<ParamId> = rest_grads.ids().into_iter().collect();
        // Where the parts are known (every pass but a model's first), `after`'s are reduced now, while the
        // blocks run backward; what it reached of `before`'s part waits for that part.
        let mut in_flight: Option<FinishReduce> = None;
        if let Some(parts) = &parts {
            let mut waiting = GradientBuffer::new();
            let own: HashSet<ParamId> = parts.after.iter().map(|(id, _)| *id).collect();
            for id in rest_grads.ids() {
                if !own.contains(&id)
                    && let Some((shape, flat)) = rest_grads.take(id)
                {
                    waiting.put(id, shape, flat);
                }
            }
            rest_grads.hold_one_of(&rest, &parts.after);
            self.add_part(&mut sink, rest_grads, &parts.after, &mut in_flight)?;
            rest_grads = waiting;
        }
        drop(rest);

        // The blocks in reverse: recompute with a graph, back-propagate the gradient from above; block i - 1's
        // gather is started before block i computes (FSDP's backward prefetch). Below the lowest block that trains
        // (the bottom of a model fine-tuned from its top, frozen with `Module::no_grad`) nothing needs a gradient:
        // those blocks are neither gathered again nor recomputed, on every rank alike.
        let lowest = match before_trains {
            true => 0,
            false => trains.iter().position(|t| *t).unwrap_or(trains.len()),
        };
        let mut next = None;
        // The last part's reduction runs while the next block computes.
        for (i, b) in model.blocks().iter().enumerate().skip(lowest).rev() {
            let started = match next.take() {
                Some(started) => started,
                None => start_unshard(strategy, b)?,
            };
            let whole = started.finish()?;
            if let Some(b) = i
                .checked_sub(1)
                .filter(|j| *j >= lowest)
                .and_then(|j| model.blocks().get(j))
            {
                next = Some(start_unshard(strategy, b)?);
            }
            let input = boundaries.pop().expect("one activation per block");
            // The lowest block's input needs a gradient only where `before` has parameters that train.
            let needs_input_grad = i > lowest || before_trains;
            let x = if needs_input_grad {
                input.require_grad()
            } else {
                input
            };
            let y = {
                let _generator = draws.then(generator);
                seeds.before_block(&device, i);
                crate::tensor_parallel::dropout::set_site(block_sites[i]);
                block(&whole, x.clone())
            };
            let mut grads = crate::graph_cut::backward((y * upstream).sum())?;
            upstream = if needs_input_grad {
                grads.remove(&x).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "backward_blocks: block {i}'s output does not depend on its input; `block` must compute \
                         the block's output from the activation it is given"
                    ))
                })?
            } else {
                Tensor::zeros([1; D], &device)
            };
            let mut part = GradientBuffer::new();
            part.collect(&whole, &mut grads);
            drop(grads);
            let params = trainable_params(&whole);
            if matches!(sink, Sink::ReducedPerPart { .. }) {
                // Every rank reduces every block, whether or not its part of the batch reached it.
                part.hold_one_of(&whole, &params);
            }
            self.add_part(&mut sink, part, &params, &mut in_flight)?;
        }
        seeds.after_pass(&device);

        // What precedes the blocks (embeddings): its part gathered again and recomputed with a graph under
        // FULL_SHARD, then its gradients (and what `after` reached of its part) as one part.
        let mut before_reached = HashSet::new();
        if before_trains {
            let rest = gather_rest()?;
            let h0 = match gather_each_block {
                true => {
                    let _generator = self.blocks_draw().then(generator);
                    seeds.before_rest(&device);
                    crate::tensor_parallel::dropout::set_site(before_sites);
                    drop(before_cuts);
                    before(&rest)
                }
                false => {
                    crate::graph_cut::restore_tape(before_cuts);
                    h0
                }
            };
            let mut grads = crate::graph_cut::backward((h0 * upstream).sum())?;
            let mut part = GradientBuffer::new();
            part.collect(&rest, &mut grads);
            drop(grads);
            before_reached.extend(part.ids());
            rest_grads.absorb(part);
            let list = parts.as_ref().map_or(&rest_params, |p| &p.before);
            if matches!(sink, Sink::ReducedPerPart { .. }) {
                rest_grads.hold_one_of(&rest, list);
            }
            // The gathered part goes before its gradients are reduced: under FULL_SHARD a rank then holds the
            // part's gradients and their reduction's buffers, not the part itself as well; and what the blocks'
            // gathers freed goes back to the system first (glibc keeps freed blocks of their size on its heap).
            drop(rest);
            if gather_each_block {
                crate::heap::release_free_heap();
            }
        }
        match &parts {
            Some(parts) => self.add_part(&mut sink, rest_grads, &parts.before, &mut in_flight)?,
            None => {
                self.add_part(&mut sink, rest_grads, &rest_params, &mut in_flight)?;
                if gather_each_block {
                    // The model's first pass: every rank learns what `after` and `before` reached, once.
                    self.learn_rest_parts(model, &rest_params, &after_reached, &before_reached)?;
                }
            }
        }
        self.finish_part(&mut in_flight)?;
        drop(kept_rest);
        {
            // The pass so far is back-propagation (with its recomputes), but for the parts' reductions.
            let mut core = self.shared.lock();
            let synced = core.phases.gradient_sync.saturating_sub(sync_before);
            core.phases.backward += started.elapsed().saturating_sub(synced);
        }

        match sink {
            Sink::Local(mut local) => self.process(&mut *local, model)?,
            Sink::ReducedPerPart { reduced, .. } => {
                let mut core = self.shared.lock();
                self.end_backward(&mut core, model, reduced)?;
            }
        }
        Ok(value)
    }

    /// Hands one part's gradients to `sink`: kept locally, or reduced across the ranks (each keeps its slices of
    /// the mean gradients) and added to the accumulated ones. The reduction is started here and finished when the
    /// next part is handed over (or by [`finish_part`](Self::finish_part)), so that it runs while the next block
    /// computes; at most one is in flight.
    fn add_part(
        &self,
        sink: &mut Sink,
        part: GradientBuffer,
        params: &[(ParamId, usize)],
        in_flight: &mut Option<FinishReduce>,
    ) -> Result<()> {
        match sink {
            Sink::Local(local) => local.absorb(part),
            Sink::ReducedPerPart { scale, .. } => {
                self.finish_part(in_flight)?;
                let started = std::time::Instant::now();
                *in_flight = Some(self.strategy.start_reduce(part, params, *scale)?);
                self.shared.lock().phases.gradient_sync += started.elapsed();
            }
        }
        Ok(())
    }

    /// Waits for the part's reduction in flight, if any, and adds its gradients to the accumulated ones.
    fn finish_part(&self, in_flight: &mut Option<FinishReduce>) -> Result<()> {
        if let Some(finish) = in_flight.take() {
            let started = std::time::Instant::now();
            let part = finish()?;
            let mut core = self.shared.lock();
            core.grads.absorb(part);
            core.phases.gradient_sync += started.elapsed();
        }
        Ok(())
    }
}

impl StepPipeline {
    /// The block seeds of a checkpointed pass (a whole block-wise pass, or one micro-batch of a pipeline): from a
    /// base drawn once from the device's generator (so that a run is reproducible from the user's seed), mixed
    /// with the rank and a count of passes. Drawing a base for each pass would not do: ranks of one process share
    /// the generator, and a rank's recompute puts it back in the state its forward pass left, so that a base
    /// another rank drew right after both would repeat, and with it a whole pass's dropout masks.
    pub(crate) fn pass_seeds(&self, device: &burn::tensor::Device) -> Result<BlockSeeds> {
        let mut seeds = self
            .recompute_seeds
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (base, count) = match *seeds {
            Some(state) => state,
            None => (BlockSeeds::draw(device)?.0, 0),
        };
        *seeds = Some((base, count + 1));
        let rank = self.strategy.rank() as u64;
        Ok(BlockSeeds(splitmix64(
            base ^ splitmix64(rank.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ count),
        )))
    }
}

/// SplitMix64's output function: a well-mixed 64-bit value of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Burn's random generators are process-wide (Flex keeps one behind a lock, not one per thread), so ranks of one
/// process share them: another rank reseeding or drawing between this rank's reseed before a block and the
/// block's draws would give a recompute other dropout masks than its forward pass. While the blocks draw random
/// numbers, each reseed and the user code that draws after it (`before`, each block, `after`) run under this lock,
/// never around a collective (a rank waiting here never holds up a peer inside a collective). Blocks that draw
/// nothing (no dropout) run side by side: whether they draw is found on each pass's first block, under the lock
/// ([`BlockSeeds::block_drew`]).
///
/// Under tensor and context parallelism the user code holds collectives (a row-parallel layer's all-reduce, the
/// attention's key/value exchange), so no lock is taken: the tensor-parallel modules draw their masks from a generator of each rank's own
/// ([`tensor_parallel::dropout`](crate::tensor_parallel::dropout())), never the device's.
static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn generator() -> Option<std::sync::MutexGuard<'static, ()>> {
    if crate::tensor_parallel::tp_rank_and_size().1 > 1
        || crate::context_parallel::cp_rank_and_size().1 > 1
    {
        return None;
    }
    Some(GENERATOR.lock().unwrap_or_else(|p| p.into_inner()))
}

/// One random number drawn from the device's generator.
fn probe(device: &burn::tensor::Device) -> Result<u32> {
    let draw: Tensor<1> = Tensor::random([1], Distribution::Uniform(0.0, 1.0), device);
    let values = draw
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| {
            Error::other(format!(
                "backward_blocks: reading a random number back: {e:?}"
            ))
        })?;
    values
        .first()
        .map(|v| v.to_bits())
        .ok_or_else(|| Error::other("backward_blocks: no random number read back"))
}

/// The seeds that make a block's recompute draw the same random numbers (dropout masks) as its forward pass.
pub(crate) struct BlockSeeds(u64);

impl BlockSeeds {
    /// A base seed drawn from the device's generator, so that runs stay reproducible from the user's seed.
    ///
    /// # Errors
    /// The device's random numbers cannot be read back (never on Burn's backends).
    pub(crate) fn draw(device: &burn::tensor::Device) -> Result<Self> {
        let _generator = generator();
        let draw: Tensor<1> = Tensor::random([2], Distribution::Uniform(0.0, 1.0), device);
        let values = draw
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| {
                Error::other(format!("backward_blocks: reading the block seeds: {e:?}"))
            })?;
        let [a, b] = values[..] else {
            return Err(Error::other(format!(
                "backward_blocks: {} random values read back for the block seeds, not 2",
                values.len()
            )));
        };
        Ok(Self(
            (u64::from(a.to_bits()) << 32) | u64::from(b.to_bits()),
        ))
    }

    /// Whether block `block`, just run after [`before_block`](Self::before_block), drew random numbers: the
    /// generator's next number differs from the first one after the block's seed. Call it under [`generator`],
    /// so that nothing else draws in between.
    pub(crate) fn block_drew(&self, device: &burn::tensor::Device, block: usize) -> Result<bool> {
        let next = probe(device)?;
        self.before_block(device, block);
        let first = probe(device)?;
        Ok(next != first)
    }

    pub(crate) fn before_block(&self, device: &burn::tensor::Device, block: usize) {
        device.seed(self.0.wrapping_add(block as u64 + 1));
    }

    /// Before `before` runs (its forward pass, and its recompute where it is gathered anew for the backward).
    pub(crate) fn before_rest(&self, device: &burn::tensor::Device) {
        device.seed(self.0 ^ 0x5bd1_e995_5bd1_e995);
    }

    /// Before `after` runs (a pipeline's last stage, where the head is gathered anew for the backward pass).
    pub(crate) fn before_after(&self, device: &burn::tensor::Device) {
        device.seed(self.0 ^ 0x27d4_eb2f_1656_67c5);
    }

    /// The generator continues from a seed of its own after the pass.
    pub(crate) fn after_pass(&self, device: &burn::tensor::Device) {
        let _generator = generator();
        device.seed(self.0.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15);
    }
}
