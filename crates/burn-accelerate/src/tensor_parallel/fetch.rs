//! The split parameters of a tensor-parallel model gathered whole one at a time ([`TpFetcher`]), for a
//! `save_model` that writes the whole model while no rank holds it: every rank of a group fetches the same
//! parameters in the same order, each one all-gather over the group, and the main process writes each as it comes.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::tensor::Tensor;

use super::context::TpContext;
use super::strategy::{TensorParallel, split_dimension_back, split_dimension_first};
use crate::distributed::strategy::{LazyParams, ParamTable};
use crate::error::{Error, Result};

/// A split parameter as this rank holds it: its slice (flat, a handle on the model's tensor), the slice's shape and
/// the dimension it is split along.
struct Held {
    part: Tensor<1>,
    local: Vec<usize>,
    dim: usize,
}

/// The whole values of a tensor-parallel model's split parameters, fetched one at a time.
pub(crate) struct TpFetcher {
    context: Arc<TpContext>,
    held: HashMap<ParamId, Held>,
}

impl TpFetcher {
    /// The fetcher of `module`'s split parameters under `strategy`.
    pub fn of<M: Module>(strategy: &TensorParallel, module: &M) -> Self {
        let table = ParamTable::of(module);
        let held = table
            .entries()
            .iter()
            .filter_map(|entry| {
                let (dim, _, _) = strategy.slice_of_param(entry.id)?;
                Some((
                    entry.id,
                    Held {
                        part: entry.value(),
                        local: entry.dims.clone(),
                        dim,
                    },
                ))
            })
            .collect();
        Self {
            context: strategy.context.clone(),
            held,
        }
    }
}

impl LazyParams for TpFetcher {
    fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>> {
        self.held.get(&id).map(|h| {
            let mut dims = h.local.clone();
            dims[h.dim] *= self.context.size;
            dims
        })
    }

    fn fetch(&self, id: ParamId) -> Result<Tensor<1>> {
        let (Some(held), Some(whole)) = (self.held.get(&id), self.whole_dims(id)) else {
            return Err(Error::InvalidArgument(format!(
                "save_model: parameter {id} is not one of the tensor-parallel model's split parameters"
            )));
        };
        // Each rank's slice with the split dimension first is one range of the whole laid out alike.
        let moved = split_dimension_first(held.part.clone(), &held.local, held.dim);
        let n = moved.dims()[0];
        let all = self
            .context
            .comm
            .all_gather(
                moved,
                &vec![n; self.context.size],
                "tensor-parallel fetch for a save",
            )?
            .wait()?;
        Ok(split_dimension_back(all, &whole, held.dim))
    }
}
