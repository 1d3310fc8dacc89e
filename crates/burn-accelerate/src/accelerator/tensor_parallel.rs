//! `prepare_tensor_parallel`: a model split over the tensor-parallel ranks by a plan.

use std::collections::HashMap;

use burn::module::{Module, ParamId};

use super::Accelerator;
use crate::error::{Error, Result};
use crate::tensor_parallel::TensorParallelPlan;

impl Accelerator {
    /// Prepares `model` as [`prepare_model`](Self::prepare_model) does, with the modules `plan` names split over
    /// the tensor-parallel ranks ([`tp_size`](crate::AcceleratorBuilder::tp_size)): the plan is resolved against
    /// the model first, on every rank alike, so that a rule naming no module, a size the ranks do not divide or a
    /// module the plan cannot split is an error before anything is sent; then every rank receives rank 0's
    /// weights one parameter at a time and keeps its slice of each split one. With `tp_size` 1 the plan is
    /// checked and the model kept whole: the same program runs on one rank.
    ///
    /// ```
    /// use burn::nn::transformer::TransformerEncoderConfig;
    /// use burn_accelerate::Accelerator;
    /// use burn_accelerate::tensor_parallel::{ParallelTransformerLayer, TensorParallelPlan};
    ///
    /// let accelerator = Accelerator::new()?;
    /// let config = TransformerEncoderConfig::new(16, 32, 4, 1);
    /// let layer = ParallelTransformerLayer::new(&config, accelerator.device());
    /// let layer = accelerator.prepare_tensor_parallel(layer, &TensorParallelPlan::megatron())?;
    /// # let _ = layer;
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// The plan's (see [`TensorParallelPlan`]); as [`prepare_model`](Self::prepare_model).
    pub fn prepare_tensor_parallel<M: Module>(
        &self,
        model: M,
        plan: &TensorParallelPlan,
    ) -> Result<M> {
        if self.stage().is_some() {
            return Err(Error::InvalidArgument(
                "prepare_tensor_parallel under a pipeline (pp_size > 1): each stage keeps its own blocks; prepare \
                 the model with `accelerator.prepare_tensor_parallel_blocks(model, &plan)`"
                    .into(),
            ));
        }
        self.apply_plan(&model, plan)?;
        self.prepare_model(model)
    }

    /// [`prepare_tensor_parallel`](Self::prepare_tensor_parallel) for a model made of blocks, under a pipeline
    /// too: each stage keeps only its blocks, as [`prepare_blocks`](Self::prepare_blocks) does, each split by
    /// `plan` over the stage's tensor-parallel ranks (`pp` × `tp` × `dp`: torchtitan's 3-D mesh). Without a
    /// pipeline, the same as `prepare_tensor_parallel`; with `tp_size` 1, the same as `prepare_blocks`.
    ///
    /// # Errors
    /// As [`prepare_tensor_parallel`](Self::prepare_tensor_parallel) and
    /// [`prepare_blocks`](Self::prepare_blocks).
    pub fn prepare_tensor_parallel_blocks<M: crate::Blocks>(
        &self,
        model: M,
        plan: &TensorParallelPlan,
    ) -> Result<M> {
        self.apply_plan(&model, plan)?;
        self.prepare_blocks(model)
    }

    /// Resolves `plan` against `model` (on every rank alike) and, under tensor parallelism, tells the strategy
    /// which parameters it splits, under rank 0's ids.
    fn apply_plan<M: Module>(&self, model: &M, plan: &TensorParallelPlan) -> Result<()> {
        let tp = self.parallel_dims().tp;
        let resolved = plan.resolve(model, tp)?;
        let Some(tensor) = &self.tensor else {
            return Ok(());
        };
        // The plan resolved alike on every rank (the same model); the split parameters under rank 0's ids, which
        // every rank's parameters take on arrival.
        let ids: Vec<u64> = crate::grad::param_ids(model)
            .iter()
            .map(|id| id.val())
            .collect();
        let ids = self.broadcast_object(&ids, 0)?;
        let mut floats = Vec::new();
        crate::named_params::floats(model, |p| floats.push(p.id()));
        if floats.len() != resolved.dims.len() || floats.len() != ids.len() {
            return Err(Error::InvalidArgument(format!(
                "prepare_tensor_parallel: the model has {} float parameters here and {} on rank 0: every rank \
                 must build the same model",
                floats.len(),
                ids.len()
            )));
        }
        let splits: HashMap<ParamId, usize> = ids
            .iter()
            .zip(&resolved.dims)
            .filter_map(|(id, dim)| dim.map(|d| (ParamId::from(*id), d)))
            .collect();
        if splits.is_empty() && self.is_main_process() {
            crate::notice::warn_visibly(&format!(
                "prepare_tensor_parallel: the plan splits none of the model's parameters, so each of the {tp} ranks \
                 of a tensor-parallel group trains the whole model on the same data; name the layers to split (or \
                 use TensorParallelPlan::megatron() with the crate's transformer modules)"
            ));
        } else if self.is_main_process() {
            let (split, whole) = resolved.elements;
            log::info!(
                "tensor-parallel plan: {} parameters split ({split} of {whole} elements), each rank keeping 1/{tp} \
                 of them",
                splits.len()
            );
        }
        tensor.add_splits(splits);
        Ok(())
    }

    /// Under tensor parallelism, a model prepared without a plan would train whole on every rank of a group, each
    /// computing the same thing: an error that says to use
    /// [`prepare_tensor_parallel`](Self::prepare_tensor_parallel).
    pub(crate) fn check_tensor_parallel_planned(&self) -> Result<()> {
        match &self.tensor {
            Some(t) if !t.planned() => Err(Error::InvalidArgument(format!(
                "prepare_model under tensor parallelism (tp_size {}): prepare the model with \
                 `accelerator.prepare_tensor_parallel(model, &plan)` (TensorParallelPlan::megatron() for the \
                 crate's transformer modules), which says how its layers are split",
                t.context.size
            ))),
            _ => Ok(()),
        }
    }
}
