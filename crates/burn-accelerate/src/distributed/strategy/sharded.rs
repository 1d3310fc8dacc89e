//! Sharded data parallelism: `SHARD_GRAD_OP` (ZeRO-2) and `FULL_SHARD` (ZeRO-3), as PyTorch's
//! `ZeroRedundancyOptimizer` partitions: every trainable parameter is owned *whole* by one rank, balanced by size
//! ([`balanced_owners`]), the same on every rank without communication.
//!
//! One sync step:
//!
//! ```text
//! reduce_gradients: each large gradient reduced into its owner's own buffer; the smaller ones reduce-scattered in
//!                   rounds of at most one bucket ─> each rank keeps its own parameters' mean gradients only
//! optimizer step:   Burn's optimizer steps only the parameters it has gradients for: this rank's, whose
//!                   state is all it ever holds
//! after_step:       SHARD_GRAD_OP: each large parameter broadcast from its owner; the smaller ones all-gathered
//!                   in rounds
//!                   FULL_SHARD:    drop the other ranks' parameters again (empty placeholders)
//! unshard:          FULL_SHARD: gather the other ranks' parameters (as above) for forward and backward
//! ```
//!
//! Burn's optimizers step only the parameters present in the gradients they are given, so nothing of Burn
//! changes. Large parameters and their gradients (1 MiB and up) move in place, nothing allocated or copied for
//! them where the model or the gradient buffer alone holds them, as data parallelism's large buckets; the rounds of
//! the smaller ones bound the host buffers: round `k` carries, from every rank, its `k`-th group of own parameters
//! of at most one bucket divided by the number of ranks. Every reduction combines the ranks in rank order, so a sharded run has the bits of an
//! unsharded one.
//!
//! The strategy never sees the model's type: the pipeline hands its lifecycle hooks (`setup`, `unshard`,
//! `after_step`, `fetcher`) the model's parameters ([`ModuleParams`]), whose [`ParamTable`] they read and whose
//! replaced values are written back.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};

use super::params::{ParamEntry, ParamTable};
use super::{BlockPass, ModuleParams, StateScope, Strategy, balanced_owners};
use crate::config::ShardingStrategy;
use crate::distributed::DistributedType;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::{Reduction, TensorComm, bucket};
use crate::error::{Error, Result};
use crate::grad::GradientBuffer;
use crate::grad::NormType;

mod fetch;
mod gather;

pub(crate) use fetch::ParamFetcher;
use gather::gather;

/// What a sharded strategy remembers of a parameter it has seen whole (at `prepare_model`): its owner and
/// shape, which a `FULL_SHARD` placeholder no longer shows, and where it lives (a rank that holds none of the
/// gradients still takes part in their reduction with zeros of the right kind).
#[derive(Debug, Clone)]
struct Known {
    owner: usize,
    dims: Vec<usize>,
    device: Device,
    dtype: DType,
}

impl Known {
    /// What `entry` (seen whole) shows, owned by `owner`.
    fn of(owner: usize, entry: &ParamEntry) -> Self {
        Self {
            owner,
            dims: entry.dims.clone(),
            device: entry.device.clone(),
            dtype: entry.dtype,
        }
    }
}

/// Sharded data parallelism over the host reduce-scatter and all-gather of the rank's communicator. Under a
/// hybrid strategy the state is sharded within `group` (this rank's shard group) and each reduced gradient is then
/// averaged across `replicas` (the ranks holding the same shard in the other groups).
#[derive(Debug)]
pub(crate) struct Sharded {
    /// Every rank: the initial weights come from its rank 0.
    world: Arc<ProcessGroup>,
    /// The tensor interface, the only way the strategy reaches other ranks: over the ranks the state is sharded
    /// over (every rank, or this rank's shard group), over every rank, and over the ranks holding this rank's
    /// shard in the other shard groups (hybrid strategies only).
    shards: Arc<dyn TensorComm>,
    everyone: Arc<dyn TensorComm>,
    replica_comm: Option<Arc<dyn TensorComm>>,
    mode: ShardingStrategy,
    bucket_elems: usize,
    known: Mutex<HashMap<ParamId, Known>>,
    /// The owners given to trainable parameters first met after `prepare_model` (a layer frozen then and unfrozen
    /// since, or replaced), before their shape and placement are learnt from the model ([`Self::adopt`]).
    adopted: Mutex<HashMap<ParamId, usize>>,
}

impl Sharded {
    /// The strategy of `group`'s rank, reaching the other ranks through `comm` (over `group`); `mode` is
    /// `ShardGradOp` or `FullShard`.
    pub fn new(
        group: Arc<ProcessGroup>,
        comm: Arc<dyn TensorComm>,
        mode: ShardingStrategy,
        bucket_bytes: usize,
    ) -> Self {
        Self {
            world: group,
            shards: comm.clone(),
            everyone: comm,
            replica_comm: None,
            mode,
            bucket_elems: bucket::max_elements(bucket_bytes),
            known: Mutex::new(HashMap::new()),
            adopted: Mutex::new(HashMap::new()),
        }
    }

    /// A hybrid strategy of `world`'s rank, reaching the other ranks through `everyone` (over `world`) and its
    /// sub-groups: sharded within consecutive groups of `shard_size` ranks, replicated across them. Every rank
    /// takes part in making both sub-groups.
    ///
    /// # Errors
    /// A shard size that does not divide the ranks; the sub-groups' collectives.
    pub fn hybrid(
        world: Arc<ProcessGroup>,
        everyone: Arc<dyn TensorComm>,
        shard_size: usize,
        mode: ShardingStrategy,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let (rank, ranks) = (world.process_index(), world.num_processes());
        if shard_size == 0 || !ranks.is_multiple_of(shard_size) {
            return Err(Error::config(
                "dp_shard_size",
                shard_size.to_string(),
                "configuration",
                format!(
                    "a number of ranks per shard group that divides the {ranks} ranks (set it with \
                     AcceleratorBuilder::dp_shard_size or PARALLELISM_CONFIG_DP_SHARD_SIZE)"
                ),
            ));
        }
        let shards = everyone.on_group(Arc::new(world.split(rank / shard_size, rank)?))?;
        let replicas = everyone.on_group(Arc::new(world.split(rank % shard_size, rank)?))?;
        Ok(Self {
            shards,
            everyone,
            replica_comm: Some(replicas),
            world,
            mode,
            bucket_elems: bucket::max_elements(bucket_bytes),
            known: Mutex::new(HashMap::new()),
            adopted: Mutex::new(HashMap::new()),
        })
    }

    /// How the strategy's exchanges travel, for its name.
    fn exchanges(&self) -> &'static str {
        match self.everyone.name() {
            "host all-reduce" => "host reduce and broadcast",
            other => other,
        }
    }

    /// Ranks the state is sharded over (a shard group's, under a hybrid strategy).
    fn world(&self) -> usize {
        self.shards.world_size()
    }

    /// This rank's index among the ranks the state is sharded over: the owner index of its parameters.
    fn shard_rank(&self) -> usize {
        self.shards.rank()
    }

    /// Debug mode, hybrid strategies: every rank of the world first checks that all are in the same step, since a
    /// rank calling something else outside its sub-groups would leave its group waiting for the timeout.
    fn check_world(&self, operation: &str, layout: usize) -> Result<()> {
        if self.replica_comm.is_some() {
            collectives::verify_call(&self.world, operation, DType::F32, &[layout])?;
        }
        Ok(())
    }

    /// How a gradient combines within the shard group: the mean times `scale`, or under a hybrid strategy the sum
    /// (the replicas' sum and the factor follow in [`across_replicas`](Self::across_replicas)).
    fn within_shards(&self, scale: f32) -> Reduction {
        match self.replica_comm {
            Some(_) => Reduction::Op(ReduceOp::Sum),
            None => Reduction::Average(scale),
        }
    }

    /// Under a hybrid strategy, this rank's reduced values summed over the replicas (every replica holds the same
    /// shard, so every member of a replica group makes the same calls), times scale / every rank; `values` as
    /// they are otherwise.
    fn across_replicas(&self, values: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        match &self.replica_comm {
            Some(replicas) if values.dims()[0] > 0 => {
                let factor = scale / self.world.num_processes() as f32;
                replicas
                    .all_reduce(
                        values,
                        Reduction::ScaledSum(factor),
                        "hybrid gradient all-reduce across replicas",
                    )?
                    .wait()
            }
            _ => Ok(values),
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<ParamId, Known>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn adopted(&self) -> std::sync::MutexGuard<'_, HashMap<ParamId, usize>> {
        self.adopted.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The owner of each of `params`: the one remembered for it. A parameter met for the first time (frozen at
    /// `prepare_model` and unfrozen since, or replaced) gets an owner of its own, balanced over the new ones
    /// alone, so that no known parameter changes hands (its optimizer state stays where it is). Every rank meets
    /// the same parameters in the same calls, so every rank gives the same owners.
    fn owners(&self, params: &[(ParamId, usize)]) -> Vec<usize> {
        let known = self.known();
        let mut adopted = self.adopted();
        let new: Vec<(ParamId, usize)> = params
            .iter()
            .filter(|(id, _)| !known.contains_key(id) && !adopted.contains_key(id))
            .copied()
            .collect();
        if !new.is_empty() {
            log::debug!(
                "sharded: {} parameter(s) first met after prepare_model get owners of their own",
                new.len()
            );
            for ((id, _), owner) in new.iter().zip(balanced_owners(&new, self.world())) {
                adopted.insert(*id, owner);
            }
        }
        params
            .iter()
            .map(|(id, _)| known.get(id).map_or_else(|| adopted[id], |k| k.owner))
            .collect()
    }

    /// Learns the shape and placement of every trainable parameter of `params` met after `prepare_model` while it
    /// is still whole on every rank, so that it can be dropped and gathered again as the others are.
    fn adopt(&self, params: &ParamTable) {
        let whole = self.whole_params(params);
        let owners = self.owners(&whole);
        let mut known = self.known();
        let mut adopted = self.adopted();
        for ((id, _), owner) in whole.iter().zip(owners) {
            if known.contains_key(id) {
                continue;
            }
            if let Some(entry) = params.get(*id).filter(|e| !e.is_placeholder()) {
                adopted.remove(id);
                known.insert(*id, Known::of(owner, entry));
            }
        }
    }

    /// The indices into `params` of the parameters that cross ranks alone: [`bucket::ALONE_ELEMENTS`] or more (or past
    /// a round's size). Each is reduced into its owner's own buffer and broadcast from it, in place: no buffer is
    /// allocated or copied for it where the model or the gradient buffer alone holds it (as data parallelism's
    /// all-reduce of a large gradient).
    fn large(&self, params: &[(ParamId, usize)]) -> Vec<usize> {
        let alone = self.alone_elements();
        (0..params.len())
            .filter(|i| params[*i].1 >= alone)
            .collect()
    }

    fn alone_elements(&self) -> usize {
        bucket::ALONE_ELEMENTS.min((self.bucket_elems / self.world()).max(1))
    }

    /// `rounds[k][q]`: the indices into `params` of rank `q`'s own smaller parameters (not [`large`](Self::large))
    /// that cross ranks in round `k`. Each rank's own, in order, fill groups of at most `bucket / world` elements;
    /// round `k` holds every rank's `k`-th group (or none).
    fn rounds(&self, params: &[(ParamId, usize)], owners: &[usize]) -> Vec<Vec<Vec<usize>>> {
        let world = self.world();
        let cap = (self.bucket_elems / world).max(1);
        let alone = self.alone_elements();
        let mut groups: Vec<Vec<Vec<usize>>> = vec![Vec::new(); world];
        for (q, rank_groups) in groups.iter_mut().enumerate() {
            let (mut group, mut elems) = (Vec::new(), 0);
            let small = |(i, (_, n)): &(usize, &(ParamId, usize))| owners[*i] == q && *n < alone;
            for (i, (_, n)) in params.iter().enumerate().filter(small) {
                if !group.is_empty() && elems + n > cap {
                    rank_groups.push(std::mem::take(&mut group));
                    elems = 0;
                }
                group.push(i);
                elems += n;
            }
            if !group.is_empty() {
                rank_groups.push(group);
            }
        }
        let count = groups.iter().map(Vec::len).max().unwrap_or(0);
        (0..count)
            .map(|k| {
                groups
                    .iter()
                    .map(|g| g.get(k).cloned().unwrap_or_default())
                    .collect()
            })
            .collect()
    }

    /// Remembers the owner, shape and placement of every trainable parameter of `params` (seen whole).
    fn remember(&self, params: &ParamTable) {
        let trainable = params.trainable();
        let owners = balanced_owners(&trainable, self.world());
        let mut known = self.known();
        for ((id, _), owner) in trainable.iter().zip(owners) {
            if let Some(entry) = params.get(*id) {
                known.insert(*id, Known::of(owner, entry));
            }
        }
    }

    /// The trainable parameters of `params` with their whole sizes, in visiting order: a placeholder (which
    /// tracks no gradient) counts as the parameter it stands for.
    fn whole_params(&self, params: &ParamTable) -> Vec<(ParamId, usize)> {
        let known = self.known();
        params
            .entries()
            .iter()
            .filter_map(|entry| match known.get(&entry.id) {
                Some(k) => Some((entry.id, k.dims.iter().product())),
                None => entry.trainable.then(|| (entry.id, entry.num_elements())),
            })
            .collect()
    }

    /// The whole shape of `entry`: the one remembered for it (a placeholder's is empty), else its own.
    fn whole_dims(&self, entry: &ParamEntry) -> Vec<usize> {
        self.known()
            .get(&entry.id)
            .map_or_else(|| entry.dims.clone(), |k| k.dims.clone())
    }

    /// Drops from `params` every trainable parameter owned by another rank (an empty placeholder of its kind
    /// takes its place, keeping its id and gradient setting).
    fn reshard(&self, params: &mut ParamTable) {
        let whole = self.whole_params(params);
        let me = self.shard_rank();
        for ((id, _), owner) in whole.iter().zip(self.owners(&whole)) {
            if owner != me {
                params.drop_value(*id);
            }
        }
    }

    /// Where the gradients of `ids` live, from the first remembered one (for a rank that holds none of them).
    fn placement_of(&self, ids: impl IntoIterator<Item = ParamId>) -> Option<(Device, DType)> {
        let known = self.known();
        ids.into_iter()
            .find_map(|id| known.get(&id).map(|k| (k.device.clone(), k.dtype)))
    }
}

impl Strategy for Sharded {
    fn name(&self) -> String {
        match &self.replica_comm {
            Some(replicas) => format!(
                "hybrid sharded data parallel ({}: {} replicas of {} shards) over {}",
                self.mode,
                replicas.world_size(),
                self.world(),
                self.exchanges()
            ),
            None => format!(
                "sharded data parallel ({}) over {}",
                self.mode,
                self.exchanges()
            ),
        }
    }

    fn rank(&self) -> usize {
        self.world.process_index()
    }

    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        // A rank that holds none of these gradients (its part of the batch used none of them) still takes part,
        // with zeros where the model keeps them.
        let Some((device, dtype)) = grads
            .device_and_dtype(params.iter().map(|(id, _)| *id))
            .or_else(|| self.placement_of(params.iter().map(|(id, _)| *id)))
        else {
            return Ok(());
        };
        let me = self.shard_rank();
        self.check_world("hybrid sharded gradient sync", params.len())?;
        let owners = self.owners(params);
        // A gradient this rank lacks (its parameter was unused here) takes part as zeros.
        let zeros = |n: usize| Tensor::<1>::zeros([n], (&device, dtype));
        // Large gradients: each reduced into its owner's own buffer.
        for i in self.large(params) {
            let (id, n) = params[i];
            let (shape, flat) = match grads.take(id) {
                Some((shape, grad)) => (Some(shape), grad),
                None => (None, zeros(n)),
            };
            let own = flat.dtype();
            let reduced = self
                .shards
                .reduce(
                    flat,
                    owners[i],
                    self.within_shards(scale),
                    "sharded gradient reduce to its owner",
                )?
                .wait()?;
            if let Some(reduced) = reduced {
                let flat = bucket::in_dtype(self.across_replicas(reduced, scale)?, own);
                match shape {
                    Some(shape) => grads.put(id, shape, flat),
                    None => grads.set_flat(id, flat),
                }
            }
        }
        for round in self.rounds(params, &owners) {
            let counts: Vec<usize> = round
                .iter()
                .map(|group| group.iter().map(|i| params[*i].1).sum())
                .collect();
            let mut parts = Vec::with_capacity(round.iter().map(Vec::len).sum());
            let mut shapes = HashMap::new();
            // Each gradient comes back in its own dtype (a model may mix f32 and half-precision parameters); one
            // this rank lacked takes the first gradient's.
            let mut dtypes: HashMap<ParamId, DType> = HashMap::new();
            for &i in round.iter().flatten() {
                let (id, n) = params[i];
                // Taken out of the buffer (an owner's comes back reduced): moved, not copied, when it is alone in
                // the round.
                let grad = match grads.take(id) {
                    Some((shape, grad)) => {
                        if owners[i] == me {
                            shapes.insert(id, shape);
                            dtypes.insert(id, grad.dtype());
                        }
                        grad
                    }
                    None => zeros(n),
                };
                parts.push(grad);
            }
            let mine = self
                .shards
                .reduce_scatter(
                    bucket::concat(parts, (&device, dtype)),
                    &counts,
                    self.within_shards(scale),
                    "sharded gradient reduce-scatter",
                )?
                .wait()?;
            let mine = self.across_replicas(mine, scale)?;
            let sizes: Vec<usize> = round[me].iter().map(|&i| params[i].1).collect();
            let values = if sizes.len() == 1 {
                vec![mine]
            } else {
                mine.split_with_sizes(sizes, 0)
            };
            for (&i, flat) in round[me].iter().zip(values) {
                let id = params[i].0;
                let flat = bucket::in_dtype(flat, dtypes.get(&id).copied().unwrap_or(dtype));
                match shapes.remove(&id) {
                    Some(shape) => grads.put(id, shape, flat),
                    // Unused on this rank: it gets its shape when the optimizer takes it.
                    None => grads.set_flat(id, flat),
                }
            }
        }
        Ok(())
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.everyone
            .broadcast(flat, root, "parameter broadcast")?
            .wait()
    }

    fn optimizer_state(&self) -> StateScope {
        StateScope::PerRank
    }

    fn model_state(&self) -> StateScope {
        if self.mode.reshards_parameters() {
            // Between steps each rank holds only its own parameters: each writes and reads its own record.
            StateScope::PerRank
        } else {
            StateScope::Replicated
        }
    }

    fn setup(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        let params = params.table();
        self.remember(params);
        if self.mode.reshards_parameters() {
            self.reshard(params);
        }
        Ok(())
    }

    fn unshard(&self, params: &mut ModuleParams<'_>, kept: &HashSet<ParamId>) -> Result<()> {
        let params = params.table();
        self.adopt(params);
        if self.mode.reshards_parameters() {
            gather(self, params, kept)?;
        }
        Ok(())
    }

    fn after_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        let params = params.table();
        self.adopt(params);
        if self.mode.reshards_parameters() {
            self.reshard(params);
            Ok(())
        } else {
            gather(self, params, &HashSet::new())
        }
    }

    fn fetcher(&self, params: &mut ModuleParams<'_>) -> Option<ParamFetcher> {
        if !self.mode.reshards_parameters() {
            // Every rank holds the whole model: nothing to fetch, and no table to read.
            return None;
        }
        let params = params.table();
        self.adopt(params);
        Some(fetch::fetcher(self, params))
    }

    fn block_pass(&self) -> BlockPass {
        if self.mode.reshards_parameters() {
            BlockPass::GatherEachBlock
        } else {
            BlockPass::Whole
        }
    }

    fn distributed_type(&self, _launched: DistributedType) -> DistributedType {
        DistributedType::Fsdp
    }

    fn no_gradients_held(&self, _operation: &'static str) -> Result<()> {
        // Each rank holds only its own parameters' gradients, and may own none.
        Ok(())
    }

    fn owns(&self, id: ParamId) -> bool {
        let owner = match self.known().get(&id) {
            Some(known) => Some(known.owner),
            None => self.adopted().get(&id).copied(),
        };
        owner.is_none_or(|owner| owner == self.shard_rank())
    }

    fn params_renamed(&self, renamed: &[(ParamId, ParamId)]) {
        let mut known = self.known();
        let moved: Vec<(ParamId, Known)> = renamed
            .iter()
            .filter_map(|(old, new)| known.remove(old).map(|k| (*new, k)))
            .collect();
        known.extend(moved);
        drop(known);
        let mut adopted = self.adopted();
        let moved: Vec<(ParamId, usize)> = renamed
            .iter()
            .filter_map(|(old, new)| adopted.remove(old).map(|owner| (*new, owner)))
            .collect();
        adopted.extend(moved);
    }

    fn check_learner(&self) -> Result<()> {
        if !self.mode.reshards_parameters() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "AcceleratedStrategy::new: {} keeps only each rank's own parameters between steps, and burn-train's \
             Learner runs the forward pass on its model without gathering them; use SHARD_GRAD_OP with the \
             Learner (gradients and optimizer state sharded), or {} in a loop of your own with \
             `accelerator.unshard(&model)`",
            self.mode, self.mode
        )))
    }

    fn any_rank(&self, local: bool) -> Result<bool> {
        let any = self.shards.all_reduce_value(
            f64::from(u8::from(local)),
            ReduceOp::Max,
            "sharded overflow verdict",
        )?;
        Ok(any != 0.0)
    }

    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        crate::grad::combined_norm(norms, norm_type, |partial, op| {
            self.shards
                .all_reduce_value(partial, op, "sharded gradient norm")
        })
    }
}
