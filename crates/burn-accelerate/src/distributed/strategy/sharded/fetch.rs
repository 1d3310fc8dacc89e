//! `save_model` under `FULL_SHARD`: each parameter joined from every rank's slices when the writer reaches it,
//! so that no rank ever holds more than one whole parameter beyond its slices.

use super::*;

/// Parameters a rank does not hold whole (`FULL_SHARD`), fetched one at a time while the file is written: every
/// rank fetches the same parameters in visiting order, the writer's one when it reaches each.
pub(crate) trait LazyParams {
    /// The whole shape of `id` when it is fetched rather than read from the module.
    fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>>;
    /// The whole value of `id`, flat (a collective: every rank fetches the same parameters in the same order).
    fn fetch(&self, id: ParamId) -> Result<Tensor<1>>;
}

impl LazyParams for ParamFetcher {
    fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>> {
        ParamFetcher::whole_dims(self, id)
    }
    fn fetch(&self, id: ParamId) -> Result<Tensor<1>> {
        ParamFetcher::fetch(self, id)
    }
}

/// The parameters of a `FULL_SHARD` model joined one at a time from every rank's slices, for a save that never
/// holds the whole model on one rank (`save_model`): every rank of the shard group fetches the same parameters
/// in visiting order, each one all-gather.
pub(crate) struct ParamFetcher {
    comm: Arc<dyn TensorComm>,
    /// Every sharded parameter's split.
    splits: HashMap<ParamId, Slicing>,
    /// This rank's slices, flat (handles on the module's tensors: no copy).
    own: HashMap<ParamId, Tensor<1>>,
    /// Each parameter's device and dtype.
    placement: HashMap<ParamId, (Device, DType)>,
}

impl std::fmt::Debug for ParamFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamFetcher")
            .field("params", &self.splits.len())
            .finish()
    }
}

impl ParamFetcher {
    /// The whole shape of `id`, when it is one of the fetched parameters.
    pub fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>> {
        self.splits.get(&id).map(|s| s.dims().to_vec())
    }

    /// The whole value of `id`, flat, on every rank of the shard group (a collective: every rank fetches the same
    /// parameters in the same order).
    ///
    /// # Errors
    /// `id` is not a fetched parameter; the all-gather failed.
    pub fn fetch(&self, id: ParamId) -> Result<Tensor<1>> {
        let (Some(split), Some(own), Some((device, dtype))) = (
            self.splits.get(&id),
            self.own.get(&id),
            self.placement.get(&id),
        ) else {
            return Err(Error::InvalidArgument(format!(
                "save_model: parameter {id} is not one of the sharded model's"
            )));
        };
        let mut whole = exchange::all_gather(
            self.comm.as_ref(),
            &[split],
            vec![own.clone()],
            "sharded parameter fetch for a save",
            (device, *dtype),
        )?;
        Ok(whole.pop().expect("one parameter fetched"))
    }
}

/// The fetcher of the parameters of `params` (see [`ParamFetcher`]), under `FULL_SHARD` / `HYBRID_SHARD`.
pub(super) fn fetcher(sharded: &Sharded, params: &ParamTable) -> ParamFetcher {
    let order = sharded.whole_params(params);
    let splits = sharded.slicings_for(&order);
    let mut own = HashMap::new();
    let mut placement = HashMap::new();
    let mut by_id = HashMap::new();
    for ((id, _), split) in order.into_iter().zip(splits) {
        let Some(entry) = params.get(id) else {
            continue;
        };
        placement.insert(id, (entry.device.clone(), entry.dtype));
        own.insert(id, sharded.local_value(entry, &split));
        by_id.insert(id, split);
    }
    ParamFetcher {
        comm: sharded.shards.clone(),
        splits: by_id,
        own,
        placement,
    }
}
