//! `save_model` under `FULL_SHARD`: each parameter fetched from its owner when the writer reaches it, so that
//! no rank ever holds the whole model.

use super::*;

/// The parameters of a `FULL_SHARD` model fetched one at a time from their owners, for a save that never holds
/// the whole model on one rank (`save_model`): every rank of the shard group fetches the same parameters in
/// visiting order, each a broadcast from its owner.
pub(crate) struct ParamFetcher {
    comm: Arc<dyn TensorComm>,
    me: usize,
    /// Every trainable parameter's whole number of elements.
    sizes: HashMap<ParamId, usize>,
    owners: HashMap<ParamId, usize>,
    dims: HashMap<ParamId, Vec<usize>>,
    /// This rank's own parameters' values, flat (handles on the module's tensors: no copy).
    own: HashMap<ParamId, Tensor<1>>,
    /// Each parameter's device and dtype (a placeholder's are its parameter's).
    placement: HashMap<ParamId, (burn::tensor::Device, burn::tensor::DType)>,
}

impl std::fmt::Debug for ParamFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamFetcher")
            .field("params", &self.sizes.len())
            .finish()
    }
}

impl ParamFetcher {
    /// The whole shape of `id`, when it is one of the fetched parameters.
    pub fn whole_dims(&self, id: ParamId) -> Option<Vec<usize>> {
        self.dims.get(&id).cloned()
    }

    /// The whole value of `id`, flat, on every rank of the shard group (a collective: every rank fetches the same
    /// parameters in the same order).
    ///
    /// # Errors
    /// `id` is not a fetched parameter; the broadcast failed.
    pub fn fetch(&self, id: ParamId) -> Result<Tensor<1>> {
        let (Some(&owner), Some(&n), Some(placement)) = (
            self.owners.get(&id),
            self.sizes.get(&id),
            self.placement.get(&id),
        ) else {
            return Err(Error::InvalidArgument(format!(
                "save_model: parameter {id} is not one of the sharded model's"
            )));
        };
        let flat = match self.own.get(&id) {
            Some(value) if owner == self.me => value.clone(),
            _ => Tensor::zeros([n], (&placement.0, placement.1)),
        };
        self.comm
            .broadcast(flat, owner, "sharded parameter fetch for a save")?
            .wait()
    }
}

/// The fetcher of the parameters of `params` (see [`ParamFetcher`]), under `FULL_SHARD` / `HYBRID_SHARD`.
pub(super) fn fetcher(sharded: &Sharded, params: &ParamTable) -> ParamFetcher {
    let order = sharded.whole_params(params);
    let owners: HashMap<ParamId, usize> = order
        .iter()
        .map(|(id, _)| *id)
        .zip(sharded.owners(&order))
        .collect();
    let me = sharded.shard_rank();
    let mut own = HashMap::new();
    let mut placement = HashMap::new();
    let mut dims = HashMap::new();
    for entry in params.entries() {
        placement.insert(entry.id, (entry.device.clone(), entry.dtype));
        if let Some(&owner) = owners.get(&entry.id) {
            dims.insert(entry.id, sharded.whole_dims(entry));
            if owner == me {
                own.insert(entry.id, entry.value());
            }
        }
    }
    ParamFetcher {
        comm: sharded.shards.clone(),
        me,
        sizes: order.into_iter().collect(),
        owners,
        dims,
        own,
        placement,
    }
}
