//! `save_model` under a pipeline: each parameter comes from the stage that trains it, one at a time, so that the
//! main process writes one file of the whole model without any rank holding more than its stage and one
//! parameter of another.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};

use super::stage::Stages;
use crate::distributed::ProcessGroup;
use crate::distributed::strategy::LazyParams;
use crate::distributed::tensor_comm::TensorComm;
use crate::error::Result;

/// Where each parameter of a pipelined model is fetched from, and its whole shape.
pub(crate) struct StageFetcher {
    world: Arc<dyn TensorComm>,
    params: HashMap<ParamId, Fetched>,
}

/// One parameter: the rank of the whole run that sends it, its whole shape, and what this rank holds of it.
struct Fetched {
    root: usize,
    dims: Vec<usize>,
    own: Tensor<1>,
    place: (Device, DType),
}

impl StageFetcher {
    /// The fetcher of `model` (this rank's stage gathered whole: `whole`): every rank of `group` (the whole run)
    /// calls it. Each block's parameters come from replica 0 of the stage that runs it, those outside the blocks
    /// from replica 0 of the first stage that trains them.
    ///
    /// # Errors
    /// The exchange of the parameters' shapes failed.
    pub fn new<M: crate::Blocks>(
        stages: &Stages,
        group: &ProcessGroup,
        world: Arc<dyn TensorComm>,
        whole: &M,
    ) -> Result<Self> {
        let ranges = stages.blocks_of(whole)?;
        let mut block_stage: HashMap<ParamId, usize> = HashMap::new();
        for (i, block) in whole.blocks().iter().enumerate() {
            let stage = ranges.iter().position(|r| r.contains(&i)).unwrap_or(0);
            for id in crate::grad::param_ids(block) {
                block_stage.insert(id, stage);
            }
        }
        let rest_owner = stages
            .rest_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        let mut held = Vec::new();
        crate::named_params::floats(whole, |p| {
            held.push((p.id(), p.dims(), p.value_handle(), p.placement()))
        });
        // Every rank's shapes: a placeholder's first dimension is 0, the stage that runs it has the whole.
        let shapes: Vec<Vec<usize>> = held.iter().map(|(_, dims, _, _)| dims.clone()).collect();
        let all = crate::distributed::collectives::gather_object(group, &shapes)?;
        let params = held
            .into_iter()
            .enumerate()
            .map(|(j, (id, _, value, place))| {
                let dims = all
                    .iter()
                    .filter_map(|ranks| ranks.get(j))
                    .max_by_key(|d| d.iter().product::<usize>())
                    .cloned()
                    .unwrap_or_default();
                let stage = block_stage
                    .get(&id)
                    .or_else(|| rest_owner.get(&id))
                    .copied()
                    .unwrap_or(0);
                let fetched = Fetched {
                    root: stage * stages.stage_ranks,
                    dims,
                    own: value(),
                    place,
                };
                (id, fetched)
            })
            .collect();
        Ok(Self { world, params })
    }
}

impl LazyParams for StageFetcher {
    fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>> {
        self.params.get(&id).map(|p| p.dims.clone())
    }

    fn fetch(&self, id: ParamId) -> Result<Tensor<1>> {
        let Some(p) = self.params.get(&id) else {
            return Err(crate::Error::InvalidArgument(format!(
                "save_model: parameter {id} is not one of the pipelined model's"
            )));
        };
        let len: usize = p.dims.iter().product();
        let value = match p.own.dims()[0] == len {
            true => p.own.clone(),
            false => Tensor::zeros([len], (&p.place.0, p.place.1)),
        };
        self.world
            .broadcast(value, p.root, "pipelined parameter fetch for a save")?
            .wait()
    }
}
