//! The distribution strategy: the one seam through which training is spread over ranks (Lightning Fabric's
//! `Strategy`).
//!
//! A [`Strategy`] acts; nobody asks what it is. It reduces a backward's gradients across ranks, starts every
//! rank from the same weights, places a module's parameters (at `prepare_model`, before a forward pass, after an
//! optimizer step, for a save), steps (and so holds the optimizer state of) the parameters it owns, measures a
//! gradient norm, says what a checkpoint holds and whether burn-train's Learner can train through it. The step
//! pipeline (`crate::pipeline`), the prepared optimizer, the Learner and the checkpointer hand it the work; a new
//! way to distribute training is one new implementation here:
//!
//! | strategy | gradients | who steps what | optimizer state |
//! |---|---|---|---|
//! | [`SingleDevice`] | scaled in place | this rank, everything | one file |
//! | [`DataParallel`] over a [`TensorComm`](crate::distributed::tensor_comm::TensorComm) | bucketed all-reduce (mean) | every rank, everything | one file, from the main process |
//! | [`Sharded`] (`SHARD_GRAD_OP`, `FULL_SHARD`) | reduce-scatter, keep this rank's slices | each rank, its dim-0 slice of every parameter; then all-gathered (`SHARD_GRAD_OP`) or kept (`FULL_SHARD`) | 1/P of every tensor per rank |
//! | [`Sharded`], hybrid (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`) | reduce-scatter within the shard group, all-reduce across the replicas | as above, within the shard group (a sub-group of the communicator) | one slice per rank (replicas write the same) |
//!
//! Each strategy's implementation of the tensor interface is chosen per run (`tensor_comm::select_transport`, from the
//! `gradient_transport` setting, what the machine has and what the strategy exchanges): host copies through the
//! communicator on every backend, the device tensors themselves between in-process ranks sharing a device, or
//! NCCL on CUDA (every call; Burn's in-process collective for data parallelism's all-reduce between the GPUs of
//! one process). The tests
//! train through another transport, through the device path's test double, and through a strategy of their own
//! built from the trait's actions alone.

mod data_parallel;
mod params;
mod placement;
mod sharded;
mod cut;

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};

#[cfg(test)]
use crate::distributed::tensor_comm::on_device::{DeviceEngine, OnDevice};
use crate::distributed::tensor_comm::{self, on_device};
pub(crate) use cut::{CheckpointCut, Within};
pub(crate) use data_parallel::{DataParallel, SingleDevice};
pub(crate) use params::ParamTable;
pub(crate) use placement::{
    ModuleParams, Placed, after_prepare, broadcast_module, materialize, note_restored_ids,
    param_fetcher, prepare_step, share_stepped, share_stepped_lazily, start_unshard, unshard,
    unshard_except, with_param_ids,
};
pub(crate) use sharded::{LazyParams, ParamFetcher, Sharded, SliceKind, Slicing};

use crate::config::AcceleratorConfig;
use crate::distributed::DistributedType;
use crate::error::{Error, Result};
use crate::grad::{GradientBuffer, NormType};

/// What finishes an unshard started by [`Strategy::start_unshard`]: waits for the gathers and writes the whole
/// values into the table.
pub(crate) type FinishUnshard = Box<dyn FnOnce(&mut ParamTable) -> Result<()>>;

/// What finishes a reduction started by [`Strategy::start_reduce`]: waits for it and gives the buffer back.
pub(crate) type FinishReduce = Box<dyn FnOnce() -> Result<GradientBuffer>>;

/// Where a checkpoint's optimizer state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateScope {
    /// Every rank holds the same state: the main process writes it, every rank reads it.
    Replicated,
    /// Each rank holds a slice: each writes and reads its own.
    PerRank,
}

/// How a strategy runs a block-wise pass (`backward_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockPass {
    /// Every rank holds the blocks whole: without activation checkpointing the pass is a plain forward and
    /// backward; with it, the blocks' gradients stay on this rank until the pass ends and are then reduced
    /// together, as `backward` reduces them.
    Whole,
    /// Each block is gathered for its forward pass and again for its recompute, and its gradients are reduced
    /// across ranks as soon as they are produced: no rank ever holds the whole model's parameters or gradients.
    GatherEachBlock,
}

/// A parameter's value as it reaches [`Strategy::arrive`] at `prepare_model`.
pub(crate) enum Arriving {
    /// The root's value (flat); on another rank, a value of the same length this rank drew itself, whose values
    /// are ignored.
    Value(Tensor<1>),
    /// Nothing yet (a lazy parameter this rank does not draw): `len` elements to arrive in `dtype` on `device`.
    Expected {
        /// The whole number of elements.
        len: usize,
        /// Where the value lands.
        device: Device,
        /// In which element type.
        dtype: DType,
    },
}

impl Arriving {
    /// Where the value lands, and in which element type.
    pub fn place(&self) -> (Device, DType) {
        match self {
            Arriving::Value(v) => (v.device(), v.dtype()),
            Arriving::Expected { device, dtype, .. } => (device.clone(), *dtype),
        }
    }

    /// A buffer of the whole length: the value itself, or zeros where this rank has none.
    pub fn into_buffer(self) -> Tensor<1> {
        match self {
            Arriving::Value(v) => v,
            Arriving::Expected { len, device, dtype } => Tensor::zeros([len], (&device, dtype)),
        }
    }
}

/// How training is distributed over the ranks of a process group: what the pipeline, the optimizer, the
/// checkpointer and the Learner hand each piece of work to. Every method is an action or what the strategy does
/// with a kind of work; the defaults are those of a strategy whose ranks hold everything and reduce gradients
/// with [`reduce_gradients`](Self::reduce_gradients).
pub(crate) trait Strategy:
    StrategyInfo + GradientSync + ParamPlacement + StateScopes + Send + Sync + fmt::Debug
{
}

impl<T: StrategyInfo + GradientSync + ParamPlacement + StateScopes + Send + Sync + fmt::Debug>
    Strategy for T
{
}

/// What a strategy is: its name, this rank's index in its group, and the kind of run users see.
pub(crate) trait StrategyInfo {
    /// What runs, for messages and the start-up line (`data parallel over host all-reduce`, ...).
    fn name(&self) -> String;

    /// This rank's index in the group the strategy distributes over.
    fn rank(&self) -> usize;

    /// The kind of run users see (`Accelerator::distributed_type`), from the kind the launch gave (`launched`):
    /// a strategy that shards the training state says `FSDP`, as Accelerate does.
    fn distributed_type(&self, launched: DistributedType) -> DistributedType {
        launched
    }
}

/// What a strategy does with gradients and the values every rank must agree on: reductions (whole, started
/// early, without a buffer), broadcasts, the gradient norm and verdicts across ranks.
pub(crate) trait GradientSync {
    /// Replaces every stored gradient of `params` (`(id, number of elements)`, in the same order on every
    /// rank) with its mean over the ranks, times `scale`. A parameter without a gradient on this rank
    /// contributes zeros. A strategy whose ranks hold slices of the parameters keeps only this rank's slices.
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()>;

    /// Whether [`reduce_gradients`](Self::reduce_gradients) at `scale` leaves every gradient as it is (one device
    /// at scale 1): the step then neither lists the parameters nor calls it.
    fn reduces_to_itself(&self, scale: f32) -> bool {
        let _ = scale;
        false
    }

    /// Starts [`reduce_gradients`](Self::reduce_gradients) of `grads` (a block's, in a block-wise pass): the
    /// collectives run while the caller computes the next block; the returned call waits for them and gives the
    /// buffer back reduced. By default the reduction is done now. Every rank must start and finish the same
    /// reductions in the same order.
    ///
    /// # Errors
    /// As [`reduce_gradients`](Self::reduce_gradients).
    fn start_reduce(
        &self,
        mut grads: GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<FinishReduce> {
        self.reduce_gradients(&mut grads, params, scale)?;
        Ok(Box::new(move || Ok(grads)))
    }

    /// Rank `root`'s value of one flattened parameter on every rank.
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>>;

    /// [`reduce_gradients`](Self::reduce_gradients) at scale 1 of a whole window's gradients as burn-train hands
    /// them over, where the strategy needs no gradient buffer for it (a single device has nothing to do: `Ok`
    /// with the same gradients); `Err` hands them back, to be reduced through the buffer.
    fn reduce_unbuffered(
        &self,
        grads: GradientsParams,
    ) -> std::result::Result<GradientsParams, GradientsParams> {
        Err(grads)
    }

    /// A backward pass on this rank reached none of the model's parameters: where other ranks reduce with this
    /// one, it takes part with zeros (its part of the batch may route around them), and this says so once; a
    /// strategy without other ranks returns the error that names the mistake.
    fn backward_reached_nothing(&self) -> Result<()> {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::warn!(
                "backward: none of the model's parameters received a gradient on this rank, which takes part in \
                 the reduction with zeros (said once); if no rank's loss reaches them, pass the model the loss was \
                 computed with"
            )
        });
        Ok(())
    }

    /// `operation` (a clip) found none of the model's gradients on this rank: an error (no `backward` before it)
    /// where every rank holds every gradient, nothing to do where ranks hold only their own.
    fn no_gradients_held(&self, operation: &'static str) -> Result<()> {
        Err(Error::NoGradients { operation })
    }

    /// The total norm of the model's gradients from the norms of those this rank holds (`norms`, one element
    /// each: a sum of `|g|^p`, or a maximum for [`NormType::Inf`]): computed here where every rank holds every
    /// gradient (an error when there is none), combined across ranks where each holds its own.
    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        crate::grad::local_norm(norms, norm_type)
    }

    /// Whether this rank counts parameter `id`'s gradient in [`gradient_norm`](Self::gradient_norm)'s `norms`: all
    /// but a gradient another rank of the norm's combination holds the same copy of.
    fn counts_in_norm(&self, id: ParamId) -> bool {
        let _ = id;
        true
    }

    /// Whether `local` holds on any rank: the verdict every rank must share when each rank checks only its own
    /// part of the gradients (an fp16 overflow). Ranks that hold the same gradients answer `local`.
    fn any_rank(&self, local: bool) -> Result<bool> {
        Ok(local)
    }

    /// For each of `flags`, whether it holds on any rank the strategy distributes over (every rank of a hybrid
    /// strategy): the lists every rank must agree on before its collectives. Ranks that hold the same gradients
    /// answer `flags`.
    ///
    /// # Errors
    /// The all-reduce's (a timeout, a peer that failed).
    fn any_rank_each(&self, flags: &[bool]) -> Result<Vec<bool>> {
        Ok(flags.to_vec())
    }
}

/// Where a model's parameters live: what a rank keeps when they arrive at `prepare_model`, what it gathers for
/// a forward pass (whole or block by block) and cuts again after a step, and how each is split.
pub(crate) trait ParamPlacement: GradientSync {
    /// How this strategy runs a block-wise pass (see [`BlockPass`]).
    fn block_pass(&self) -> BlockPass {
        BlockPass::Whole
    }

    /// The parameters `ids` are no longer this rank's to hold (a pipeline stage drops what only other stages
    /// train, once it knows): the strategy stops gathering, cutting and reducing them.
    fn forget(&self, ids: &HashSet<ParamId>) {
        let _ = ids;
    }

    /// The parameters `(old, new)` now have new ids (a checkpoint restored the saved ones).
    fn params_renamed(&self, renamed: &[(ParamId, ParamId)]) {
        let _ = renamed;
    }

    /// How parameter `id` is split over the ranks of the shard group, and this rank's index among them; `None`
    /// where this rank holds it whole (every parameter, unless the strategy shards them).
    fn slicing(&self, id: ParamId) -> Option<(Slicing, usize)> {
        let _ = id;
        None
    }

    /// How every parameter the strategy splits is split (for a checkpoint's manifest); none where every rank
    /// holds every parameter whole.
    fn slicings(&self) -> Vec<(ParamId, Slicing)> {
        Vec::new()
    }

    /// How a checkpoint holds parameter `id` on this rank: [`slicing`](Self::slicing), cut along dimension 0 (see
    /// [`CheckpointCut`]; tensor parallelism cuts a 2-D weight split by columns along 1, whose parts a checkpoint
    /// handles with that dimension first, and slices each part again under a sharded strategy).
    fn checkpoint_slicing(&self, id: ParamId) -> Option<CheckpointCut> {
        self.slicing(id)
            .map(|(split, part)| CheckpointCut::of(split, part, 0))
    }

    /// [`slicings`](Self::slicings) as a checkpoint's manifest records them (see
    /// [`checkpoint_slicing`](Self::checkpoint_slicing)).
    fn checkpoint_slicings(&self) -> Vec<(ParamId, CheckpointCut)> {
        self.slicings()
            .into_iter()
            .map(|(id, split)| {
                let part = self.slicing(id).map_or(0, |(_, q)| q);
                (id, CheckpointCut::of(split, part, 0))
            })
            .collect()
    }

    /// A parameter arriving from rank `root` at `prepare_model` (`id`: `root`'s id, `dims`: its shape, `trains`:
    /// whether it tracks a gradient, `value`: `root`'s value, or what this rank has of it): what this rank keeps
    /// of it, flat, and in which shape. Every rank calls it for every float parameter, in visiting order. By
    /// default `root`'s value is broadcast and kept whole; a strategy that shards parameters scatters it, so
    /// that each rank receives only its slice and the model never arrives whole.
    ///
    /// # Errors
    /// The broadcast's or the scatter's (a timeout, a peer that failed).
    fn arrive(
        &self,
        id: ParamId,
        dims: &[usize],
        trains: bool,
        value: Arriving,
        root: usize,
    ) -> Result<(Tensor<1>, Vec<usize>)> {
        let _ = (id, trains);
        Ok((self.broadcast(value.into_buffer(), root)?, dims.to_vec()))
    }

    /// The last step of `prepare_model`: the strategy learns the model's parameters (owners, whole shapes) and
    /// drops from `params` what this rank does not hold between steps. A strategy that never reads `params`
    /// leaves the module untouched (the table is read only when asked for).
    fn setup(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Before a forward pass: gives `params` every parameter whole, but those in `kept` (a block-wise pass
    /// gathers its blocks one at a time). Every rank runs the same collectives, whatever it holds.
    fn unshard(&self, params: &mut ModuleParams<'_>, kept: &HashSet<ParamId>) -> Result<()> {
        let _ = (params, kept);
        Ok(())
    }

    /// Starts [`unshard`](Self::unshard) of every parameter of `params`: the gathers are issued and run while the
    /// caller computes (a block-wise pass gathers the next block meanwhile, FSDP's forward and backward
    /// prefetch); the returned call waits for them and writes the whole values into the table. By default the
    /// unshard is done now and the returned call has nothing left to do.
    ///
    /// # Errors
    /// As [`unshard`](Self::unshard).
    fn start_unshard(&self, params: &mut ModuleParams<'_>) -> Result<FinishUnshard> {
        self.unshard(params, &HashSet::new())?;
        Ok(Box::new(|_| Ok(())))
    }

    /// Before an optimizer steps `params` with the gradients this rank holds: gives each parameter the shape its
    /// gradient has (a strategy that keeps parameters whole but gradients in slices cuts them here).
    fn before_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// After an optimizer stepped this rank's parameters (every rank calls it, even one that stepped none): shares
    /// them with the other ranks, or drops again what this rank does not hold between steps.
    fn after_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// A fetcher of `params`' whole values, one at a time, for a save that never holds the whole model on one
    /// rank; `None` where every rank holds every parameter.
    fn fetcher(&self, params: &mut ModuleParams<'_>) -> Option<ParamFetcher> {
        let _ = params;
        None
    }
}

/// What a checkpoint holds of the training state (one copy, or one per rank), and which optimizers and trainers
/// can step what this rank holds.
pub(crate) trait StateScopes {
    /// Whether a checkpoint holds one optimizer state or one slice per rank.
    fn optimizer_state(&self) -> StateScope {
        StateScope::Replicated
    }

    /// Whether a checkpoint holds one model record or one per rank (each holding that rank's parameters).
    fn model_state(&self) -> StateScope {
        StateScope::Replicated
    }

    /// Whether an optimizer of kind `optimizer` (its type's name) can step what this rank holds; where it cannot
    /// (it needs whole tensors and the strategy cuts them), an error saying what to use instead.
    ///
    /// # Errors
    /// The optimizer needs whole tensors and the strategy cuts them into slices.
    fn check_optimizer(&self, optimizer: &str) -> Result<()> {
        let _ = optimizer;
        Ok(())
    }

    /// Whether burn-train's Learner can train through this strategy, which is then set up for it: its optimizer
    /// steps what the Learner's model holds (a sharded strategy that keeps parameters whole between steps gives
    /// each one owner instead of cutting it in rows; one that keeps slices lets the optimizer step the slices,
    /// the Learner strategy gathering the whole model for each step). Where it cannot, an error saying what to
    /// use instead.
    ///
    /// # Errors
    /// The strategy cannot run under the Learner (none of this crate's today).
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    fn check_learner(&self) -> Result<()> {
        Ok(())
    }
}

/// The data-parallel strategy of a rank of `mesh` under `config`, over the mesh's data-parallel group:
/// [`SingleDevice`] for one rank; for several, [`Sharded`] when `config.distributed.sharding` asks for it (a
/// hybrid one over the mesh's shard and replica groups), else [`DataParallel`] over the gradient transport
/// [`tensor_comm::select_transport`] picks; with buckets of at most `config.distributed.bucket_size_mb`. The main process logs
/// the transport and why.
///
/// # Errors
/// `gradient_transport = device` where the device path is not available.
pub(crate) fn for_data_parallel(
    mesh: &crate::distributed::mesh::Mesh,
    config: &AcceleratorConfig,
) -> Result<Arc<dyn Strategy>> {
    let group = &mesh.grad;
    let bucket_bytes = (config.distributed.bucket_size_mb * 1024.0 * 1024.0) as usize;
    let world = group.num_processes();
    if world > 1 && config.distributed.sharding.is_sharded() {
        let (comm, choice) = tensor_comm::select_transport(
            group,
            config.distributed.gradient_transport,
            config.collective_timeout(),
            on_device::Exchanges::Shards,
        )?;
        if group.is_main_process() {
            log::info!("sharded training's exchanges go through {choice}");
        }
        let (param_dtype, reduce_dtype) = (
            config.distributed.fsdp_param_dtype.map(|d| d.dtype()),
            config.distributed.fsdp_reduce_dtype.map(|d| d.dtype()),
        );
        if let Some(groups) = &mesh.hybrid {
            let strategy = Sharded::hybrid(
                group.clone(),
                comm,
                groups.clone(),
                config.distributed.sharding,
                bucket_bytes,
            )?;
            return Ok(Arc::new(
                strategy.with_mixed_precision(param_dtype, reduce_dtype),
            ));
        }
        return Ok(Arc::new(
            Sharded::new(
                group.clone(),
                comm,
                config.distributed.sharding,
                bucket_bytes,
            )
            .with_mixed_precision(param_dtype, reduce_dtype),
        ));
    }
    if world == 1 {
        return Ok(Arc::new(SingleDevice));
    }
    let (transport, choice) = tensor_comm::select_transport(
        group,
        config.distributed.gradient_transport,
        config.collective_timeout(),
        on_device::Exchanges::Gradients,
    )?;
    if group.is_main_process() {
        log::info!("gradients cross ranks through {choice}");
    }
    Ok(Arc::new(DataParallel::new(transport, bucket_bytes)))
}

/// Owners for `params` balanced by size over `world` ranks: the largest parameter first, each to the rank
/// holding the fewest elements so far (the lower rank on a tie). Deterministic from the sizes and order alone,
/// so every rank computes the same owners without communicating.
pub(crate) fn balanced_owners(params: &[(ParamId, usize)], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..params.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(params[i].1), i));
    let mut load = vec![0usize; world];
    let mut owners = vec![0; params.len()];
    for i in order {
        let rank = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += params[i].1;
        owners[i] = rank;
    }
    owners
}

/// A gradient norm of this rank's part (`local`) combined with those of the ranks `comm` connects, each holding
/// other gradients (a pipeline's stages, a tensor-parallel group's slices).
///
/// # Errors
/// The all-reduce's (a timeout, a peer that failed).
pub(crate) fn norm_over(
    comm: &dyn tensor_comm::TensorComm,
    local: f64,
    norm_type: NormType,
) -> Result<f64> {
    use crate::distributed::comm::ReduceOp;
    Ok(match norm_type {
        NormType::Inf => comm.all_reduce_value(local, ReduceOp::Max, "gradient norm")?,
        NormType::L2 => comm
            .all_reduce_value(local * local, ReduceOp::Sum, "gradient norm")?
            .sqrt(),
        NormType::P(p) => comm
            .all_reduce_value(local.powf(p), ReduceOp::Sum, "gradient norm")?
            .powf(1.0 / p),
    })
}

/// Whether `local` (this rank's fp16 overflow verdict) holds on any rank `comm` connects.
///
/// # Errors
/// The all-reduce's.
pub(crate) fn any_over(comm: &dyn tensor_comm::TensorComm, local: bool) -> Result<bool> {
    let any = comm.all_reduce_value(
        f64::from(u8::from(local)),
        crate::distributed::comm::ReduceOp::Max,
        "overflow verdict",
    )?;
    Ok(any > 0.0)
}

/// `(id, number of elements)` of every float parameter of `module` that requires a gradient, in visiting order
/// (the same on every rank for the same model).
pub(crate) fn trainable_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    let mut params = Vec::new();
    crate::named_params::floats(module, |p| {
        if p.require_grad() {
            params.push((p.id(), p.num_elements()));
        }
    });
    params
}

#[cfg(test)]
mod tests;
