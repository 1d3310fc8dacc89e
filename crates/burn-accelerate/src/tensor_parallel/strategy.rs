//! The strategy of a tensor-parallel rank ([`TensorParallel`]): its data-parallel group's strategy (the ranks that
//! hold the same slices and read different data) for gradients, with what tensor parallelism changes: the
//! initial weights come from rank 0 of the whole run and each rank keeps its slice of a split parameter as it
//! arrives; the gradient norm and the fp16 verdict are combined over the tensor-parallel group; a checkpoint holds
//! each rank's slices.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::Tensor;

use super::context::TpContext;
use crate::distributed::DistributedType;
use crate::distributed::strategy::{
    Arriving, BlockPass, CheckpointCut, FinishReduce, FinishUnshard, GradientSync, ModuleParams,
    ParamFetcher, ParamPlacement, Slicing, StateScope, StateScopes, Strategy, StrategyInfo, Within,
    any_over, norm_over,
};
use crate::distributed::tensor_comm::{TensorComm, bucket};
use crate::error::{Error, Result};
use crate::grad::{GradientBuffer, NormType};

/// The strategy of a rank of a tensor-parallel group.
#[derive(Debug)]
pub(crate) struct TensorParallel {
    /// The data-parallel group's strategy (over the ranks of the same tensor-parallel index): replicas, or a
    /// sharded strategy slicing each rank's tensor-parallel parts again (FSDP2 + TP).
    pub inner: Arc<dyn Strategy>,
    /// Every rank of the run: the initial weights come from its rank 0.
    pub world: Arc<dyn TensorComm>,
    /// The tensor-parallel group.
    pub context: Arc<TpContext>,
    /// The split parameters (rank 0's ids) and the dimension each is split along, set by
    /// `prepare_tensor_parallel` before the weights arrive.
    pub splits: Mutex<Option<HashMap<ParamId, usize>>>,
    /// Each split parameter's whole shape, as it arrived (for a checkpoint's manifest).
    pub whole_dims: Mutex<HashMap<ParamId, Vec<usize>>>,
}

/// A tensor-parallel split of a parameter whose whole shape is `dims`, cut along `dim` into `parts`, as a checkpoint
/// handles it: rows of the shape with `dim` first (a column-split 2-D weight's columns are its rows then), so that
/// each part is one range.
fn tp_slicing(dims: &[usize], dim: usize, parts: usize) -> Slicing {
    let mut moved = dims.to_vec();
    moved.swap(0, dim);
    Slicing::new(moved, parts, crate::distributed::strategy::SliceKind::Rows)
}

impl TensorParallel {
    /// Parameter `id`'s split dimension and whole shape, where it is split.
    fn split_and_dims(&self, id: ParamId) -> Option<(usize, Vec<usize>)> {
        let dim = self.split_dim(id)?;
        let whole = self
            .whole_dims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()?;
        Some((dim, whole))
    }

    fn split_dim(&self, id: ParamId) -> Option<usize> {
        self.splits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|s| s.get(&id).copied())
    }

    /// This rank's slice of parameter `id`: `(dim, rank, parts)`, or `None` where it holds it whole.
    pub fn slice_of_param(&self, id: ParamId) -> Option<(usize, usize, usize)> {
        self.split_dim(id)
            .map(|dim| (dim, self.context.rank, self.context.size))
    }

    /// Whether a plan was applied (a model prepared without one would train every rank's copy whole).
    pub fn planned(&self) -> bool {
        self.splits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Under sequence parallelism a parameter the plan keeps whole saw only this rank's positions (it runs between
    /// the regions, or in a region of whole layers whose output carries this rank's positions' gradient): its
    /// gradient, a part on each rank, is summed over the group before the data-parallel reduction. The ranks of
    /// a group run the same model on the same batch, so the same parameters have a gradient on each.
    fn sum_whole_over_group(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
    ) -> Result<()> {
        if !self.context.sequence || self.context.size == 1 {
            return Ok(());
        }
        let mut held = Vec::new();
        for (id, _) in params {
            if self.split_dim(*id).is_none()
                && let Some(flat) = grads.flat(&[*id]).pop()
            {
                held.push((*id, flat));
            }
        }
        let Some((_, first)) = held.first() else {
            return Ok(());
        };
        let place = (first.device(), first.dtype());
        // One bucket: these are the small parameters (norms, biases, position embeddings).
        let flat = bucket::concat(
            held.iter().map(|(_, f)| f.clone()).collect(),
            (&place.0, place.1),
        );
        let summed = self
            .context
            .all_reduce_sum(flat, "sequence-parallel gradients of whole parameters")?;
        let mut start = 0;
        for (id, flat) in held {
            let len = flat.dims()[0];
            let part = summed.clone().slice(start..start + len);
            grads.set_flat(id, bucket::in_dtype(part, flat.dtype()));
            start += len;
        }
        Ok(())
    }

    /// What this rank keeps of `value` (its tensor-parallel part of parameter `id`, of shape `dims`, the same on
    /// every rank of its data-parallel group): the data-parallel strategy's share of it. A sharded strategy keeps
    /// its slice of the part (FSDP2 over what TP split), from the group's rank 0; a replicating one all of it,
    /// with nothing sent.
    fn within_data_group(
        &self,
        id: ParamId,
        dims: &[usize],
        trains: bool,
        value: Tensor<1>,
    ) -> Result<(Tensor<1>, Vec<usize>)> {
        match self.inner.block_pass() {
            BlockPass::GatherEachBlock => {
                self.inner
                    .arrive(id, dims, trains, Arriving::Value(value), 0)
            }
            _ => Ok((value, dims.to_vec())),
        }
    }

    /// The data-parallel strategy's `cut` of a parameter kept whole by the plan, as the run's ranks hold it: the
    /// ranks of the data-parallel group are `tp_size` apart.
    fn strided(&self, cut: CheckpointCut) -> CheckpointCut {
        CheckpointCut {
            stride: cut.stride * self.context.size,
            ..cut
        }
    }

    /// Adds the split parameters of one prepared model.
    pub fn add_splits(&self, splits: HashMap<ParamId, usize>) {
        self.splits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .extend(splits);
    }
}

impl StrategyInfo for TensorParallel {
    fn name(&self) -> String {
        format!(
            "tensor parallel rank {} of {}, its data-parallel group by {}",
            self.context.rank,
            self.context.size,
            self.inner.name()
        )
    }

    /// The rank in the whole run: initial weights come from its rank 0.
    fn rank(&self) -> usize {
        self.world.rank()
    }

    fn distributed_type(&self, launched: DistributedType) -> DistributedType {
        self.inner.distributed_type(launched)
    }
}

impl GradientSync for TensorParallel {
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        self.sum_whole_over_group(grads, params)?;
        self.inner.reduce_gradients(grads, params, scale)
    }

    /// Not under sequence parallelism, whose whole parameters' gradients are summed over the group.
    fn reduces_to_itself(&self, scale: f32) -> bool {
        !(self.context.sequence && self.context.size > 1) && self.inner.reduces_to_itself(scale)
    }

    fn start_reduce(
        &self,
        mut grads: GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<FinishReduce> {
        self.sum_whole_over_group(&mut grads, params)?;
        self.inner.start_reduce(grads, params, scale)
    }

    /// Rank `root` of the whole run.
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

    /// The norm of what this rank counts (its slices; the whole parameters on tensor-parallel rank 0 only),
    /// combined over the group.
    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        // A data-parallel strategy whose ranks hold the same gradients has nothing to combine (and no norm of
        // nothing); a sharded one combines its ranks' slices, every rank taking part.
        let local = match self.inner.gradient_norm(norms, norm_type) {
            Err(Error::NoGradients { .. }) => 0.0,
            other => other?,
        };
        norm_over(self.context.comm.as_ref(), local, norm_type)
    }

    /// A split parameter's slice counts on every rank; a whole one (the same on every rank of the group) on the
    /// group's rank 0.
    fn counts_in_norm(&self, id: ParamId) -> bool {
        (self.split_dim(id).is_some() || self.context.rank == 0) && self.inner.counts_in_norm(id)
    }

    /// Any rank of the group (each checks its own slices).
    fn any_rank(&self, local: bool) -> Result<bool> {
        let here = self.inner.any_rank(local)?;
        any_over(self.context.comm.as_ref(), here)
    }

    fn any_rank_each(&self, flags: &[bool]) -> Result<Vec<bool>> {
        self.inner.any_rank_each(flags)
    }
}

impl ParamPlacement for TensorParallel {
    fn block_pass(&self) -> BlockPass {
        self.inner.block_pass()
    }

    fn forget(&self, ids: &HashSet<ParamId>) {
        self.inner.forget(ids);
    }

    fn params_renamed(&self, renamed: &[(ParamId, ParamId)]) {
        if let Some(splits) = self
            .splits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            for (old, new) in renamed {
                if let Some(dim) = splits.remove(old) {
                    splits.insert(*new, dim);
                }
            }
        }
        let mut whole = self.whole_dims.lock().unwrap_or_else(|e| e.into_inner());
        for (old, new) in renamed {
            if let Some(dims) = whole.remove(old) {
                whole.insert(*new, dims);
            }
        }
        drop(whole);
        self.inner.params_renamed(renamed);
    }

    fn slicing(&self, id: ParamId) -> Option<(Slicing, usize)> {
        self.inner.slicing(id)
    }

    fn slicings(&self) -> Vec<(ParamId, Slicing)> {
        self.inner.slicings()
    }

    /// A split parameter's part as this rank holds it: the group's parts, this rank's tensor-parallel index, the
    /// split dimension first (see [`tp_slicing`]), each part sliced again where the data-parallel strategy shards
    /// it (FSDP2 + TP: a 2-D split). A whole parameter as the data-parallel strategy holds it, its ranks `tp_size`
    /// apart.
    fn checkpoint_slicing(&self, id: ParamId) -> Option<CheckpointCut> {
        let size = self.context.size;
        let Some((split, dims)) = self.split_and_dims(id) else {
            return self
                .inner
                .checkpoint_slicing(id)
                .map(|cut| self.strided(cut));
        };
        let within = self.inner.slicing(id).map(|(split, piece)| Within {
            split,
            piece,
            stride: size,
        });
        Some(CheckpointCut {
            split: tp_slicing(&dims, split, size),
            part: self.context.rank,
            dim: split,
            stride: 1,
            within,
        })
    }

    fn checkpoint_slicings(&self) -> Vec<(ParamId, CheckpointCut)> {
        let splits = self
            .splits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        let whole = self
            .inner
            .checkpoint_slicings()
            .into_iter()
            .filter(|(id, _)| !splits.contains_key(id))
            .map(|(id, cut)| (id, self.strided(cut)));
        let mut out: Vec<(ParamId, CheckpointCut)> = splits
            .keys()
            .filter_map(|id| Some((*id, self.checkpoint_slicing(*id)?)))
            .chain(whole)
            .collect();
        out.sort_by_key(|(id, _)| id.val());
        out
    }

    /// Rank 0's value: a whole parameter broadcast to every rank; a split one scattered, each rank receiving only
    /// its slice (the split dimension moved first at rank 0, so that a slice is one range), so that no rank but
    /// rank 0 ever holds more than its share of it.
    fn arrive(
        &self,
        id: ParamId,
        dims: &[usize],
        trains: bool,
        value: Arriving,
        root: usize,
    ) -> Result<(Tensor<1>, Vec<usize>)> {
        let Some(dim) = self.split_dim(id) else {
            let whole = self.broadcast(value.into_buffer(), root)?;
            return self.within_data_group(id, dims, trains, whole);
        };
        self.whole_dims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, dims.to_vec());
        let (device, dtype) = value.place();
        let (me, size) = (self.world.rank(), self.context.size);
        let whole = match value {
            Arriving::Value(v) if me == root => Some(split_dimension_first(v, dims, dim)),
            // A value this rank drew itself is dropped before its slice arrives.
            _ => None,
        };
        let is_root = whole.is_some();
        let flat = whole.unwrap_or_else(|| Tensor::zeros([0], (&device, dtype)));
        let len = dims.iter().product::<usize>() / size;
        // Tensor parallelism is the mesh's innermost dimension: rank `w` holds slice `w % size`.
        let parts: Vec<_> = (0..self.world.world_size())
            .map(|w| (w % size) * len..(w % size + 1) * len)
            .collect();
        let part = self
            .world
            .scatter(flat, &parts, root, "tensor-parallel parameter arrival")?
            .wait()?;
        // The root's part is a view of the whole: copied into a buffer of its own, so that the whole is freed.
        let part = match is_root {
            true => Tensor::from_data(part.into_data(), (&device, dtype)),
            false => part,
        };
        let mut local = dims.to_vec();
        local[dim] /= size;
        let part = split_dimension_back(part, &local, dim);
        self.within_data_group(id, &local, trains, part)
    }

    fn setup(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.setup(params)
    }

    fn unshard(&self, params: &mut ModuleParams<'_>, kept: &HashSet<ParamId>) -> Result<()> {
        self.inner.unshard(params, kept)
    }

    fn start_unshard(&self, params: &mut ModuleParams<'_>) -> Result<FinishUnshard> {
        self.inner.start_unshard(params)
    }

    fn before_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.before_step(params)
    }

    fn after_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.after_step(params)
    }

    fn fetcher(&self, params: &mut ModuleParams<'_>) -> Option<ParamFetcher> {
        self.inner.fetcher(params)
    }
}

impl TensorParallel {
    /// `module` with every split parameter gathered whole from the group (ids and gradient settings kept): what
    /// `Accelerator::unshard` gives, for a digest, a save of the whole model, an evaluation on one rank.
    ///
    /// # Errors
    /// An all-gather's (a timeout, a peer that failed).
    pub fn gather_whole<M: burn::module::Module>(&self, module: M) -> Result<M> {
        struct Gather<'a> {
            strategy: &'a TensorParallel,
            error: Option<Error>,
        }
        impl burn::module::ModuleMapper for Gather<'_> {
            fn map_float<const D: usize>(
                &mut self,
                param: burn::module::Param<Tensor<D>>,
            ) -> burn::module::Param<Tensor<D>> {
                let Some(dim) = self.strategy.split_dim(param.id) else {
                    return param;
                };
                if self.error.is_some() {
                    return param;
                }
                let (id, value, mapper) = param.consume();
                let grad = value.is_require_grad();
                match self.strategy.context.all_gather(
                    value.clone().detach(),
                    dim,
                    "tensor-parallel gather",
                ) {
                    Ok(whole) => {
                        let whole = if grad { whole.require_grad() } else { whole };
                        burn::module::Param::from_mapped_value(id, whole, mapper)
                    }
                    Err(e) => {
                        self.error = Some(e);
                        burn::module::Param::from_mapped_value(id, value, mapper)
                    }
                }
            }
        }
        let mut gather = Gather {
            strategy: self,
            error: None,
        };
        let module = module.map(&mut gather);
        match gather.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }
}

/// The flat tensor `flat` of shape `dims` with dimension `dim` moved first (a 2-D weight's columns as rows), flat.
pub(crate) fn split_dimension_first(flat: Tensor<1>, dims: &[usize], dim: usize) -> Tensor<1> {
    match (dims.len(), dim) {
        (2, 1) => flat
            .reshape([dims[0], dims[1]])
            .swap_dims(0, 1)
            .reshape([dims[0] * dims[1]]),
        _ => flat,
    }
}

/// A slice as [`split_dimension_first`] laid it out, back in the shape `local` (flat).
pub(crate) fn split_dimension_back(part: Tensor<1>, local: &[usize], dim: usize) -> Tensor<1> {
    match (local.len(), dim) {
        (2, 1) => part
            .reshape([local[1], local[0]])
            .swap_dims(0, 1)
            .reshape([local[0] * local[1]]),
        _ => part,
    }
}

impl StateScopes for TensorParallel {
    /// Each rank writes its slices.
    fn optimizer_state(&self) -> StateScope {
        StateScope::PerRank
    }

    /// Each rank writes its slices.
    fn model_state(&self) -> StateScope {
        StateScope::PerRank
    }

    fn check_optimizer(&self, optimizer: &str) -> Result<()> {
        self.inner.check_optimizer(optimizer)
    }

    fn check_learner(&self) -> Result<()> {
        Err(Error::InvalidArgument(format!(
            "burn-train's Learner cannot train with tensor parallelism yet (tp_size {}): a TrainStep's gradients \
             come from `loss.backward()`, which does not cross the tensor-parallel regions' cuts; train with your \
             own loop (`accelerator.prepare_tensor_parallel`, then `backward` or `backward_blocks`), or set \
             tp_size to 1",
            self.context.size
        )))
    }
}
