//! The strategy of a pipelined rank ([`Staged`]): the data-parallel strategy of its stage's group for everything a
//! stage does alone, with what a step shares across the stages widened to them (the fp16 overflow verdict, the
//! gradient norm, the initial weights, which parameters a stage keeps).

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::Tensor;

use super::stage::Stages;
use crate::distributed::DistributedType;
use crate::distributed::strategy::{
    Arriving, BlockPass, CheckpointCut, FinishReduce, FinishUnshard, GradientSync, ModuleParams,
    ParamFetcher, ParamPlacement, Slicing, StateScope, StateScopes, Strategy, StrategyInfo,
};
use crate::distributed::tensor_comm::TensorComm;
use crate::error::Result;
use crate::grad::{GradientBuffer, NormType};

/// The strategy of a pipelined rank: `inner`, its stage's data-parallel strategy, for everything a stage does
/// alone; across the stages, the fp16 verdict and the gradient norm are combined over the rank's pipeline, and
/// the initial weights come from rank 0 of the whole run.
#[derive(Debug)]
pub(crate) struct Staged {
    pub inner: Arc<dyn Strategy>,
    pub stages: Arc<Stages>,
    pub world: Arc<dyn TensorComm>,
}

impl Staged {
    /// The parameters outside the blocks that only other stages train (known from the first window's end).
    fn elsewhere(&self) -> HashSet<ParamId> {
        self.stages
            .rest_elsewhere
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }
}

impl StrategyInfo for Staged {
    fn name(&self) -> String {
        let l = self.stages.layout;
        format!(
            "pipeline stage {} of {} ({} schedule, {} micro-batches), its group by {}",
            l.stage,
            l.stages,
            self.stages.schedule,
            self.stages.micro_batches,
            self.inner.name()
        )
    }

    /// The rank in the whole run: initial weights come from its rank 0 (see [`broadcast`](Self::broadcast)).
    fn rank(&self) -> usize {
        self.world.rank()
    }

    fn distributed_type(&self, launched: DistributedType) -> DistributedType {
        self.inner.distributed_type(launched)
    }
}

impl GradientSync for Staged {
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        self.inner.reduce_gradients(grads, params, scale)
    }

    fn reduces_to_itself(&self, scale: f32) -> bool {
        self.inner.reduces_to_itself(scale)
    }

    fn start_reduce(
        &self,
        grads: GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<FinishReduce> {
        self.inner.start_reduce(grads, params, scale)
    }

    /// Rank `root` of the whole run (every stage starts from its weights).
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.world
            .broadcast(flat, root, "parameter broadcast")?
            .wait()
    }

    fn backward_reached_nothing(&self) -> Result<()> {
        self.inner.backward_reached_nothing()
    }

    fn no_gradients_held(&self, operation: &'static str) -> Result<()> {
        self.inner.no_gradients_held(operation)
    }

    /// The stage's norm, combined over the pipeline's stages.
    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        let stage = if norms.is_empty() {
            0.0
        } else {
            self.inner.gradient_norm(norms, norm_type)?
        };
        crate::distributed::strategy::norm_over(self.stages.comm.as_ref(), stage, norm_type)
    }

    /// A tied parameter's gradient (the same on every stage that uses it) counts on the first of them.
    fn counts_in_norm(&self, id: ParamId) -> bool {
        let tied = self.stages.tied.lock().unwrap_or_else(|e| e.into_inner());
        if !tied
            .as_ref()
            .is_some_and(|t| t.iter().any(|(t, _)| *t == id))
        {
            return self.inner.counts_in_norm(id);
        }
        let owners = self
            .stages
            .rest_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        owners
            .as_ref()
            .and_then(|o| o.get(&id))
            .is_none_or(|owner| *owner == self.stages.layout.stage)
    }

    fn any_rank(&self, local: bool) -> Result<bool> {
        let stage = self.inner.any_rank(local)?;
        crate::distributed::strategy::any_over(self.stages.comm.as_ref(), stage)
    }

    fn any_rank_each(&self, flags: &[bool]) -> Result<Vec<bool>> {
        self.inner.any_rank_each(flags)
    }
}

impl ParamPlacement for Staged {
    fn block_pass(&self) -> BlockPass {
        self.inner.block_pass()
    }

    /// The stage's strategy's, and what the stage learnt by id (a restored record brings its saved ids).
    fn params_renamed(&self, renamed: &[(ParamId, ParamId)]) {
        self.inner.params_renamed(renamed);
        let rename = |id: ParamId| {
            renamed
                .iter()
                .find(|(from, _)| *from == id)
                .map_or(id, |(_, to)| *to)
        };
        let s = &self.stages;
        let mut lens = s.rest_lens.lock().unwrap_or_else(|e| e.into_inner());
        *lens = lens.drain().map(|(id, n)| (rename(id), n)).collect();
        if let Some(tied) = s.tied.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            for (id, _) in tied.iter_mut() {
                *id = rename(*id);
            }
        }
        if let Some(owners) = s
            .rest_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            *owners = owners.drain().map(|(id, o)| (rename(id), o)).collect();
        }
        for set in [&s.rest_reached, &s.rest_elsewhere] {
            if let Some(ids) = set.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                *ids = ids.drain().map(rename).collect();
            }
        }
    }

    fn slicing(&self, id: ParamId) -> Option<(Slicing, usize)> {
        self.inner.slicing(id)
    }

    fn slicings(&self) -> Vec<(ParamId, Slicing)> {
        self.inner.slicings()
    }

    /// The stage's strategy's (a tensor-parallel stage's splits).
    fn checkpoint_slicing(&self, id: ParamId) -> Option<CheckpointCut> {
        self.inner.checkpoint_slicing(id)
    }

    fn checkpoint_slicings(&self) -> Vec<(ParamId, CheckpointCut)> {
        self.inner.checkpoint_slicings()
    }

    /// Rank 0's value (the run's initial weights) on the ranks that keep it, then kept as the stage's strategy
    /// keeps it: a block's parameter is sent only to the ranks of the stage that runs it, one outside the blocks
    /// to those of the first and the last stage, and each arrives elsewhere as an empty placeholder (no rank
    /// receives another stage's blocks).
    fn arrive(
        &self,
        id: ParamId,
        dims: &[usize],
        trains: bool,
        value: Arriving,
        root: usize,
    ) -> Result<(Tensor<1>, Vec<usize>)> {
        let keepers = self
            .stages
            .arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .and_then(|(owners, next)| {
                *next += 1;
                owners.get(*next - 1).cloned()
            })
            .unwrap_or_default();
        if keepers.is_empty() {
            let whole = self.broadcast(value.into_buffer(), root)?;
            return self
                .inner
                .arrive(id, dims, trains, Arriving::Value(whole), 0);
        }
        let ranks = self.stages.stage_ranks;
        let mut holders: Vec<usize> = keepers
            .iter()
            .flat_map(|stage| stage * ranks..(stage + 1) * ranks)
            .collect();
        holders.dedup();
        let me = self.world.rank();
        let (device, dtype) = value.place();
        // An empty placeholder, its length kept for a sum over the stages of its gradient (zeros of it here).
        let placeholder = || {
            self.stages
                .rest_lens
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, dims.iter().product());
            let mut dims = dims.to_vec();
            if let Some(first) = dims.first_mut() {
                *first = 0;
            }
            (Tensor::<1>::zeros([0], (&device, dtype)), dims)
        };
        let whole = if me == root {
            let whole = value.into_buffer();
            let sends: Vec<(usize, Tensor<1>)> = holders
                .iter()
                .filter(|r| **r != me)
                .map(|r| (*r, whole.clone()))
                .collect();
            if !sends.is_empty() {
                self.world
                    .send_recv(sends, Vec::new(), "stage parameter arrival")?
                    .wait()?;
            }
            whole
        } else if holders.contains(&me) {
            let incoming = crate::distributed::tensor_comm::Incoming {
                peer: root,
                len: dims.iter().product(),
                device: device.clone(),
                dtype,
            };
            self.world
                .send_recv(Vec::new(), vec![incoming], "stage parameter arrival")?
                .wait()?
                .remove(0)
        } else {
            drop(value);
            return Ok(placeholder());
        };
        if !holders.contains(&me) {
            // The main process, sender of another stage's parameter.
            drop(whole);
            return Ok(placeholder());
        }
        self.inner
            .arrive(id, dims, trains, Arriving::Value(whole), 0)
    }

    fn setup(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.setup(params)
    }

    /// The stage's strategy's, but for the parameters outside the blocks that only other stages train: their
    /// copy here is a placeholder (or, before the first step's end, stale), never gathered.
    fn unshard(&self, params: &mut ModuleParams<'_>, kept: &HashSet<ParamId>) -> Result<()> {
        let elsewhere = self.elsewhere();
        if elsewhere.is_empty() {
            return self.inner.unshard(params, kept);
        }
        let kept: HashSet<ParamId> = kept.union(&elsewhere).copied().collect();
        self.inner.unshard(params, &kept)
    }

    fn start_unshard(&self, params: &mut ModuleParams<'_>) -> Result<FinishUnshard> {
        self.inner.start_unshard(params)
    }

    fn before_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.before_step(params)
    }

    /// The stage's strategy's, then (once) the parameters outside the blocks that only other stages train become
    /// placeholders here: their copy on this stage would go stale, and take memory (under a sharded stage, their
    /// slices: [`unshard`](Self::unshard) never gathers them). Where the stage keeps its copy
    /// ([`Stages::keeps_rest`]), the stage's strategy only forgets them.
    fn after_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.after_step(params)?;
        let elsewhere = self.elsewhere();
        if elsewhere.is_empty()
            || self
                .stages
                .dropped_rest
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        if self
            .stages
            .keeps_rest
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.inner.forget(&elsewhere);
            return Ok(());
        }
        let table = params.table();
        let placeholders: Vec<_> = table
            .entries()
            .iter()
            .filter(|e| elsewhere.contains(&e.id) && e.num_elements() > 0)
            .map(|e| {
                let mut dims = e.dims.clone();
                if let Some(first) = dims.first_mut() {
                    *first = 0;
                }
                // One the stage's strategy split: it forgets it (no more gathers, cuts or reductions of it here),
                // and the placeholder trains no longer.
                let split = self.inner.slicing(e.id).is_some();
                (e.id, dims, e.device.clone(), e.dtype, e.trainable && !split)
            })
            .collect();
        self.inner.forget(&elsewhere);
        for (id, dims, device, dtype, trains) in placeholders {
            table.replace(id, Tensor::<1>::zeros([0], (&device, dtype)), dims, trains);
        }
        Ok(())
    }

    /// None: a pipelined save fetches each parameter from its stage (`StageFetcher`), not from one group's
    /// slices.
    fn fetcher(&self, _params: &mut ModuleParams<'_>) -> Option<ParamFetcher> {
        None
    }
}

impl StateScopes for Staged {
    /// Each rank writes its stage's (and, under sharding, its slices').
    fn optimizer_state(&self) -> StateScope {
        StateScope::PerRank
    }

    /// Each rank writes its stage's blocks (the others are placeholders there).
    fn model_state(&self) -> StateScope {
        StateScope::PerRank
    }

    fn check_optimizer(&self, optimizer: &str) -> Result<()> {
        self.inner.check_optimizer(optimizer)
    }

    /// The stage's strategy's: the Learner trains a pipeline through `learner::backward_batch` (each stage its
    /// blocks, the last stage's items reported). burn-train's Learner cannot change its model's shapes, so the
    /// stage keeps its copy of what only other stages train (see [`Stages::keeps_rest`]).
    fn check_learner(&self) -> Result<()> {
        self.stages
            .keeps_rest
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.inner.check_learner()
    }
}
