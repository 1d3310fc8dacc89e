//! Sharded data parallelism: `SHARD_GRAD_OP` (ZeRO-2) and `FULL_SHARD` (ZeRO-3), as FSDP2 shards: every
//! trainable parameter is split along its first dimension into one even slice per rank of the shard group (the
//! last padded; FSDP2's `Shard(0)`, [`Slicing`]), so that every rank holds the same share of every tensor, however
//! unequal the tensors are. burn-train's Learner, whose optimizer steps its own model's whole parameters, has
//! each parameter owned whole by one rank instead, balanced by size ([`balanced_owners`]).
//!
//! One sync step:
//!
//! ```text
//! reduce_gradients: the whole gradients reduce-scattered in buckets ─> each rank keeps its slices' mean
//! before the step: SHARD_GRAD_OP: each parameter cut to this rank's slice (FULL_SHARD holds only that already)
//! optimizer step:   Burn's optimizer steps the slices with their gradients: its state is 1/P of every tensor
//! after_step:       SHARD_GRAD_OP: the slices all-gathered in buckets into whole parameters
//!                   FULL_SHARD:    nothing (each rank keeps its slices)
//! unshard:          FULL_SHARD: the slices all-gathered for forward and backward
//! ```
//!
//! A bucket's slices travel as one flat collective ([`exchange`]). Every reduction combines the ranks in rank
//! order and every optimizer Burn ships steps element by element, so a sharded run has the bits of an unsharded
//! one. The padding rows take part as zeros and are dropped when the slices are joined.
//!
//! The strategy never sees the model's type: the pipeline hands its lifecycle hooks (`setup`, `unshard`,
//! `before_step`, `after_step`, `fetcher`) the model's parameters ([`ModuleParams`]), whose [`ParamTable`] they
//! read and whose replaced values are written back.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::{DType, Device, Shape, Tensor};

use super::params::{ParamEntry, ParamTable};
use super::{
    Arriving, BlockPass, GradientSync, ModuleParams, ParamPlacement, StateScope, StateScopes,
    StrategyInfo, balanced_owners,
};
use crate::config::ShardingStrategy;
use crate::distributed::DistributedType;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::{Pending, Reduction, TensorComm, bucket};
use crate::error::{Error, Result};
use crate::grad::GradientBuffer;
use crate::grad::NormType;

mod exchange;
mod fetch;
mod gather;
mod reduce;
mod scopes;
pub(crate) mod slicing;

pub(crate) use fetch::{LazyParams, ParamFetcher};
use gather::gather;
pub(crate) use slicing::{SliceKind, Slicing};

/// What a sharded strategy remembers of a parameter it has seen whole (at `prepare_model`): how it is split
/// (whole shape included, which a rank's slice no longer shows), and where it lives (a rank that holds none of
/// the gradients still takes part in their reduction with zeros of the right kind).
#[derive(Debug, Clone)]
struct Known {
    slicing: Slicing,
    device: Device,
    dtype: DType,
}

/// Sharded data parallelism over the tensor interface's reduce-scatter and all-gather. Under a hybrid strategy
/// the state is sharded within `group` (this rank's shard group) and each reduced gradient is then averaged across
/// `replicas` (the ranks holding the same shard in the other groups).
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
    /// The owners given to trainable parameters whose gradients were reduced before the strategy saw them whole
    /// (a layer frozen at `prepare_model` and unfrozen since): each is owned whole by one rank, balanced over
    /// the new ones alone, so that no known parameter changes hands.
    adopted: Mutex<HashMap<ParamId, usize>>,
    /// Whether parameters are owned whole (burn-train's Learner) rather than cut in rows.
    whole_tensors: AtomicBool,
    /// FSDP2's mixed-precision policy: the dtype block-wise passes gather blocks in, and the dtype gradients are
    /// reduced in (`None`: the parameters' own).
    param_dtype: Option<DType>,
    reduce_dtype: Option<DType>,
}

impl Sharded {
    /// This strategy with FSDP2's mixed-precision policy: block-wise passes gather each block in `param_dtype`
    /// and gradients are reduce-scattered in `reduce_dtype` (`None`: the parameters' own dtype); each rank keeps
    /// its slices in their own dtype.
    pub fn with_mixed_precision(
        mut self,
        param_dtype: Option<DType>,
        reduce_dtype: Option<DType>,
    ) -> Self {
        self.param_dtype = param_dtype;
        self.reduce_dtype = reduce_dtype;
        self
    }

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
            whole_tensors: AtomicBool::new(false),
            param_dtype: None,
            reduce_dtype: None,
        }
    }

    /// A hybrid strategy of `world`'s rank, reaching the other ranks through `everyone` (over `world`) and its
    /// sub-groups `groups` (the mesh's shard and replica groups of `world`): sharded within the shard group,
    /// replicated across the replica group.
    ///
    /// # Errors
    /// The sub-groups' collectives.
    pub fn hybrid(
        world: Arc<ProcessGroup>,
        everyone: Arc<dyn TensorComm>,
        groups: (Arc<ProcessGroup>, Arc<ProcessGroup>),
        mode: ShardingStrategy,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let shards = everyone.on_group(groups.0)?;
        let replicas = everyone.on_group(groups.1)?;
        Ok(Self {
            shards,
            everyone,
            replica_comm: Some(replicas),
            world,
            mode,
            bucket_elems: bucket::max_elements(bucket_bytes),
            known: Mutex::new(HashMap::new()),
            adopted: Mutex::new(HashMap::new()),
            whole_tensors: AtomicBool::new(false),
            param_dtype: None,
            reduce_dtype: None,
        })
    }

    /// How the strategy's exchanges travel, for its name.
    fn exchanges(&self) -> &'static str {
        match self.everyone.name() {
            "host all-reduce" => "host reduce-scatter and all-gather",
            other => other,
        }
    }

    /// Ranks the state is sharded over (a shard group's, under a hybrid strategy).
    fn world(&self) -> usize {
        self.shards.world_size()
    }

    /// This rank's index among the ranks the state is sharded over: which slice of every parameter it holds.
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

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<ParamId, Known>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn adopted(&self) -> std::sync::MutexGuard<'_, HashMap<ParamId, usize>> {
        self.adopted.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The splits of `whole` (`(id, whole number of elements)`, in visiting order, seen whole on every rank) for
    /// parameters met for the first time: cut in rows, or owned whole (balanced over them alone) when parameters
    /// are owned whole.
    fn new_kinds(&self, whole: &[(ParamId, usize)]) -> Vec<SliceKind> {
        if self.whole_tensors.load(Ordering::Relaxed) {
            balanced_owners(whole, self.world())
                .into_iter()
                .map(|owner| SliceKind::Whole { owner })
                .collect()
        } else {
            vec![SliceKind::Rows; whole.len()]
        }
    }

    /// Remembers the split, shape and placement of every trainable parameter of `params` (seen whole), but those
    /// cut as they arrived ([`Strategy::arrive`]).
    fn remember(&self, params: &ParamTable) {
        let trainable: Vec<(ParamId, usize)> = {
            let known = self.known();
            params
                .trainable()
                .into_iter()
                .filter(|(id, _)| !known.contains_key(id))
                .collect()
        };
        let kinds = self.new_kinds(&trainable);
        let world = self.world();
        let mut known = self.known();
        for ((id, _), kind) in trainable.iter().zip(kinds) {
            if let Some(entry) = params.get(*id) {
                let split = Slicing::new(entry.dims.clone(), world, kind);
                known.insert(*id, Known::of(split, entry));
            }
        }
    }

    /// Learns the split of every trainable parameter of `params` met after `prepare_model` while it is still
    /// whole on every rank, so that it is cut and gathered as the others are: a parameter whose gradients were
    /// already reduced keeps the owner it was given then.
    fn adopt(&self, params: &ParamTable) {
        let new: Vec<(ParamId, usize)> = {
            let known = self.known();
            params
                .entries()
                .iter()
                .filter(|e| e.trainable && !known.contains_key(&e.id) && !e.is_placeholder())
                .map(|e| (e.id, e.num_elements()))
                .collect()
        };
        if new.is_empty() {
            return;
        }
        log::debug!(
            "sharded: {} parameter(s) first met after prepare_model are sharded from now on",
            new.len()
        );
        let kinds = self.new_kinds(&new);
        let world = self.world();
        let mut adopted = self.adopted();
        let mut known = self.known();
        for ((id, _), kind) in new.iter().zip(kinds) {
            let kind = adopted
                .remove(id)
                .map_or(kind, |owner| SliceKind::Whole { owner });
            if let Some(entry) = params.get(*id) {
                known.insert(
                    *id,
                    Known::of(Slicing::new(entry.dims.clone(), world, kind), entry),
                );
            }
        }
    }

    /// The split of each of `params` (`(id, whole number of elements)`): the one remembered for it. A parameter
    /// whose gradient arrives before the strategy saw it whole (frozen at `prepare_model` and unfrozen since) is
    /// owned whole by one rank, balanced over the new ones alone, so that no known parameter changes hands; its
    /// shape is learnt when it is next seen whole ([`adopt`](Self::adopt)). Every rank meets the same
    /// parameters in the same calls, so every rank gives the same splits.
    fn slicings_for(&self, params: &[(ParamId, usize)]) -> Vec<Slicing> {
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
            .map(|(id, n)| match known.get(id) {
                Some(k) => k.slicing.clone(),
                None => Slicing::new(
                    vec![*n],
                    self.world(),
                    SliceKind::Whole { owner: adopted[id] },
                ),
            })
            .collect()
    }

    /// The largest number of elements one bucket carries over every rank, and the size from which a parameter
    /// travels alone.
    fn bucket_limits(&self) -> (usize, usize) {
        let cap = self.bucket_elems.max(1);
        (cap, bucket::ALONE_ELEMENTS.min(cap))
    }

    /// The trainable parameters of `params` with their whole sizes, in visiting order: a slice or placeholder
    /// counts as the parameter it stands for.
    fn whole_params(&self, params: &ParamTable) -> Vec<(ParamId, usize)> {
        let known = self.known();
        params
            .entries()
            .iter()
            .filter_map(|entry| match known.get(&entry.id) {
                Some(k) => Some((entry.id, k.slicing.len())),
                None => entry.trainable.then(|| (entry.id, entry.num_elements())),
            })
            .collect()
    }

    /// The split of `id`, when the strategy knows its shape.
    fn slicing_of(&self, id: ParamId) -> Option<Slicing> {
        self.known().get(&id).map(|k| k.slicing.clone())
    }

    /// This rank's buffer of `entry` (split as `split`): its value where it holds the slice already, else the
    /// slice cut from the whole value it holds.
    fn local_value(&self, entry: &ParamEntry, split: &Slicing) -> Tensor<1> {
        let me = self.shard_rank();
        let value = entry.value();
        if entry.dims == split.local_dims(me) {
            value
        } else {
            split.local_of(value, me)
        }
    }

    /// Cuts every trainable parameter of `params` held whole to this rank's slice (or placeholder); one held as a
    /// slice already stays as it is.
    fn reshard(&self, params: &mut ParamTable) {
        let me = self.shard_rank();
        let order = self.whole_params(params);
        for (id, _) in order {
            let (Some(split), Some(entry)) = (self.slicing_of(id), params.get(id)) else {
                continue;
            };
            let local = split.local_dims(me);
            if entry.dims == local || entry.dims != split.dims() {
                continue;
            }
            let flat = split.local_of(entry.value(), me);
            let trains = split.local_len(me) > 0;
            params.replace(id, flat, local, trains);
        }
    }

    /// Where the gradients of `ids` live, from the first remembered one (for a rank that holds none of them).
    fn placement_of(&self, ids: impl IntoIterator<Item = ParamId>) -> Option<(Device, DType)> {
        let known = self.known();
        ids.into_iter()
            .find_map(|id| known.get(&id).map(|k| (k.device.clone(), k.dtype)))
    }

    /// The dtype each of `ids` travels and is stored in: the remembered one, else `fallback`.
    fn dtypes(&self, ids: impl IntoIterator<Item = ParamId>, fallback: DType) -> Vec<DType> {
        let known = self.known();
        ids.into_iter()
            .map(|id| known.get(&id).map_or(fallback, |k| k.dtype))
            .collect()
    }
}

impl Known {
    /// What `entry` (seen whole) shows, split as `split`.
    fn of(split: Slicing, entry: &ParamEntry) -> Self {
        Self {
            slicing: split,
            device: entry.device.clone(),
            dtype: entry.dtype,
        }
    }
}

impl StrategyInfo for Sharded {
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

    fn distributed_type(&self, _launched: DistributedType) -> DistributedType {
        DistributedType::Fsdp
    }
}

impl GradientSync for Sharded {
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        let started = self.start_reducing(std::mem::take(grads), params, scale)?;
        *grads = started.finish()?;
        Ok(())
    }

    fn start_reduce(
        &self,
        grads: GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<super::FinishReduce> {
        let started = self.start_reducing(grads, params, scale)?;
        Ok(Box::new(move || started.finish()))
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.everyone
            .broadcast(flat, root, "parameter broadcast")?
            .wait()
    }

    fn no_gradients_held(&self, _operation: &'static str) -> Result<()> {
        // Each rank holds only its slices' gradients (a rank of a Learner's whole-tensor split may own none).
        Ok(())
    }

    fn any_rank(&self, local: bool) -> Result<bool> {
        let any = self.shards.all_reduce_value(
            f64::from(u8::from(local)),
            ReduceOp::Max,
            "sharded overflow verdict",
        )?;
        Ok(any != 0.0)
    }

    fn any_rank_each(&self, flags: &[bool]) -> Result<Vec<bool>> {
        if flags.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<f32> = flags.iter().map(|f| f32::from(u8::from(*f))).collect();
        let any = self
            .everyone
            .all_reduce(
                Tensor::<1>::from_floats(values.as_slice(), self.world.device()),
                crate::distributed::tensor_comm::Reduction::Op(ReduceOp::Max),
                "sharded agreement",
            )?
            .wait()?
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| Error::other(format!("reading the ranks' agreement: {e:?}")))?;
        Ok(any.into_iter().map(|v| v > 0.5).collect())
    }

    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        crate::grad::combined_norm(norms, norm_type, |partial, op| {
            self.shards
                .all_reduce_value(partial, op, "sharded gradient norm")
        })
    }
}

impl ParamPlacement for Sharded {
    fn arrive(
        &self,
        id: ParamId,
        dims: &[usize],
        trains: bool,
        value: Arriving,
        root: usize,
    ) -> Result<(Tensor<1>, Vec<usize>)> {
        if !trains || !self.mode.reshards_parameters() || self.whole_tensors.load(Ordering::Relaxed)
        {
            return Ok((self.broadcast(value.into_buffer(), root)?, dims.to_vec()));
        }
        let (device, dtype) = value.place();
        let split = Slicing::new(dims.to_vec(), self.world(), SliceKind::Rows);
        // Every rank of the world receives its slice: rank r holds slice r mod P (a hybrid strategy's shard
        // groups are consecutive ranks, so the replicas of a slice receive the same part).
        let shards = self.world();
        let parts: Vec<_> = (0..self.everyone.world_size())
            .map(|r| split.held(r % shards))
            .collect();
        let whole = match value {
            Arriving::Value(v) if self.everyone.rank() == root => Some(v),
            // A value this rank drew itself is dropped before its slice arrives.
            _ => None,
        };
        let flat = whole
            .clone()
            .unwrap_or_else(|| Tensor::zeros([0], (&device, dtype)));
        let part = self
            .everyone
            .scatter(flat, &parts, root, "parameter arrival")?
            .wait()?;
        let me = self.shard_rank();
        let len = split.local_len(me);
        let local = match whole {
            // The root's part is a view of the whole: cut into a buffer of its own, so that the whole is freed.
            Some(whole) => {
                drop(part);
                split.local_of(whole, me)
            }
            None if part.dims()[0] == 0 => slicing::padded(None, len, (&device, dtype)),
            None => slicing::padded(Some(part), len, (&device, dtype)),
        };
        let known = Known {
            slicing: split.clone(),
            device,
            dtype,
        };
        self.known().insert(id, known);
        Ok((local, split.local_dims(me)))
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

    fn start_unshard(&self, params: &mut ModuleParams<'_>) -> Result<super::FinishUnshard> {
        let params = params.table();
        self.adopt(params);
        if !self.mode.reshards_parameters() {
            return Ok(Box::new(|_| Ok(())));
        }
        // A block gathered for a pass: in the policy's parameter dtype.
        let started = gather::start_gather(self, params, &HashSet::new(), self.param_dtype)?;
        Ok(Box::new(move |table| started.finish(table)))
    }

    fn before_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        let params = params.table();
        self.adopt(params);
        self.reshard(params);
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

    fn slicings(&self) -> Vec<(ParamId, Slicing)> {
        let mut splits: Vec<(ParamId, Slicing)> = self
            .known()
            .iter()
            .map(|(id, k)| (*id, k.slicing.clone()))
            .collect();
        splits.sort_by_key(|(id, _)| id.val());
        splits
    }

    fn slicing(&self, id: ParamId) -> Option<(Slicing, usize)> {
        self.slicing_of(id).map(|split| (split, self.shard_rank()))
    }

    fn forget(&self, ids: &HashSet<ParamId>) {
        self.known().retain(|id, _| !ids.contains(id));
        self.adopted().retain(|id, _| !ids.contains(id));
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
}
