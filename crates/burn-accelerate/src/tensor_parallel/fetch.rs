//! The split parameters of a tensor-parallel model gathered whole one at a time ([`TpFetcher`]), for a
//! `save_model` that writes the whole model while no rank holds it: every rank of a group fetches the same
//! parameters in the same order, each one all-gather over the group, and the main process writes each as it comes.
//! Under FSDP2 + TP each rank's tensor-parallel part is first joined from its data-parallel group's slices (the
//! sharded strategy's own fetcher), then the parts over the tensor-parallel group.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::tensor::Tensor;

use super::context::TpContext;
use super::strategy::{TensorParallel, split_dimension_back, split_dimension_first};
use crate::distributed::strategy::{LazyParams, ParamFetcher, ParamTable};
use crate::error::{Error, Result};

/// A split parameter as this rank holds it: its part (flat, a handle on the model's tensor; `None` where the
/// data-parallel strategy shards it, fetched from there), the part's shape and the dimension it is split along.
struct Held {
    part: Option<Tensor<1>>,
    local: Vec<usize>,
    dim: usize,
}

/// The whole values of a tensor-parallel model's split parameters, fetched one at a time.
pub(crate) struct TpFetcher {
    context: Arc<TpContext>,
    held: HashMap<ParamId, Held>,
    /// The data-parallel strategy's fetcher, where it shards the parameters (each rank holds a slice of its part).
    inner: Option<ParamFetcher>,
}

impl TpFetcher {
    /// The fetcher of `module`'s split parameters under `strategy`, its parts joined first by `inner` (the
    /// data-parallel strategy's fetcher, under a sharded one).
    pub fn of<M: Module>(
        strategy: &TensorParallel,
        module: &M,
        inner: Option<ParamFetcher>,
    ) -> Self {
        let table = ParamTable::of(module);
        let held = table
            .entries()
            .iter()
            .filter_map(|entry| {
                let (dim, _, _) = strategy.slice_of_param(entry.id)?;
                let sharded = inner.as_ref().and_then(|f| f.whole_dims(entry.id));
                Some((
                    entry.id,
                    Held {
                        part: sharded.is_none().then(|| entry.value()),
                        local: sharded.unwrap_or_else(|| entry.dims.clone()),
                        dim,
                    },
                ))
            })
            .collect();
        Self {
            context: strategy.context.clone(),
            held,
            inner,
        }
    }
}

impl LazyParams for TpFetcher {
    fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>> {
        match self.held.get(&id) {
            Some(h) => {
                let mut dims = h.local.clone();
                dims[h.dim] *= self.context.size;
                Some(dims)
            }
            None => self.inner.as_ref().and_then(|f| f.whole_dims(id)),
        }
    }

    fn fetch(&self, id: ParamId) -> Result<Tensor<1>> {
        let Some(held) = self.held.get(&id) else {
            return match &self.inner {
                Some(inner) if inner.whole_dims(id).is_some() => inner.fetch(id),
                _ => Err(Error::InvalidArgument(format!(
                    "save_model: parameter {id} is neither split by the tensor-parallel plan nor sharded"
                ))),
            };
        };
        let whole = self.whole_dims(id).unwrap_or_default();
        // A part the data-parallel strategy shards is joined from its slices first (`Held::part` is `None` only
        // where `inner` has it).
        let part = match (&held.part, &self.inner) {
            (Some(part), _) => part.clone(),
            (None, inner) => inner
                .as_ref()
                .ok_or_else(|| Error::other(format!("save_model: parameter {id} has no holder")))?
                .fetch(id)?,
        };
        // Each rank's part with the split dimension first is one range of the whole laid out alike.
        let moved = split_dimension_first(part, &held.local, held.dim);
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
