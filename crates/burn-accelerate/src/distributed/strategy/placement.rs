//! A module's parameters as strategies place them: rank 0's weights on every rank at `prepare_model`, and the
//! hooks of [`Strategy`] (setup, unshard, after a step, a save's fetcher) over a parameter table read only when
//! the strategy asks for it.

use std::cell::{Cell, OnceCell};
use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor};

use super::{Arriving, ParamFetcher, ParamTable, Strategy};
use crate::error::{Error, Result};

/// Returns `module` with every float parameter replaced by rank 0's value (Accelerate's DDP wrapping does the
/// same), keeping ids and gradient settings. Called on several ranks only (`prepare_model`).
///
/// A parameter that is still lazy (Burn draws parameters at their first use) is drawn on rank 0 only, when the
/// walk reaches it: the other ranks receive its value without running its initializer, so they never draw from
/// a random generator they may share with rank 0 (in-process ranks share the device's). `ids` are rank 0's
/// parameter ids in visiting order: each parameter reaches the other ranks through the strategy, under its id
/// ([`Strategy::arrive`]), which scatters it where it shards parameters, so that rank 0 holds its slices and
/// the one whole parameter it drew, and every other rank its slices alone.
pub(crate) fn broadcast_module<M: Module>(
    strategy: &dyn Strategy,
    module: M,
    ids: &[u64],
) -> Result<M> {
    from_rank_0(strategy, module, ids)
}

/// `module` with its float parameters renamed to `ids` (visiting order), values and settings kept: every rank
/// takes rank 0's ids at `prepare_model`, so that a checkpoint's model and per-rank optimizer records, keyed by
/// id, match on every rank (separate processes draw different ids for the same parameter).
pub(crate) fn with_param_ids<M: Module>(module: M, ids: &[u64]) -> M {
    struct Rename<'a> {
        ids: &'a [u64],
        next: usize,
    }
    impl ModuleMapper for Rename<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&id) = self.ids.get(self.next) else {
                return param;
            };
            self.next += 1;
            let id = ParamId::from(id);
            if param.id == id {
                return param;
            }
            let (_, value, mapper) = param.consume();
            Param::from_mapped_value(id, value, mapper)
        }
    }
    module.map(&mut Rename { ids, next: 0 })
}

/// Draws every lazily initialised float parameter of `module` now, in the module's visiting order (the order a
/// 1-rank run draws them in [`Accelerator::prepare_model`](crate::Accelerator::prepare_model), whatever order
/// the forward pass would first use them in).
pub(crate) fn materialize<M: Module>(module: M) -> M {
    crate::named_params::floats(&module, |p| p.draw());
    module
}

/// Returns `module` with every float parameter replaced by rank 0's value (or the part of it the strategy keeps),
/// keeping ids and gradient settings.
fn from_rank_0<M: Module>(strategy: &dyn Strategy, module: M, ids: &[u64]) -> Result<M> {
    struct FromOwner<'a> {
        strategy: &'a dyn Strategy,
        ids: &'a [u64],
        next: usize,
        error: Option<Error>,
    }
    impl ModuleMapper for FromOwner<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let owner = 0;
            let id = self
                .ids
                .get(self.next)
                .map_or(param.id, |id| ParamId::from(*id));
            self.next += 1;
            if self.error.is_some() {
                return param;
            }
            if !param.is_initialized() && owner != self.strategy.rank() {
                return self.receive_lazy(param, owner, id);
            }
            let require_grad = param.is_require_grad();
            let trains = set_to_train(&param, &param.lazy_device());
            let bytes = param.lazy_shape().num_elements() * 4;
            let placed = param.map(|tensor| {
                let (device, dtype) = (tensor.device(), tensor.dtype());
                let dims = tensor.dims().to_vec();
                // The drawn value is moved to the broadcast (a clone kept here would make it copy the whole).
                let flat = tensor.inner().reshape([dims.iter().product::<usize>()]);
                let arrived = self
                    .strategy
                    .arrive(id, &dims, trains, Arriving::Value(flat), owner);
                match arrived {
                    // A new leaf of the autodiff graph, tracked again when the parameter trains.
                    Ok((value, dims)) => {
                        let value = Tensor::from_inner(value.reshape(dims_of::<D>(&dims)))
                            .to_device(&device);
                        if require_grad {
                            value.require_grad()
                        } else {
                            value
                        }
                    }
                    Err(e) => {
                        self.error = Some(e);
                        Tensor::zeros(dims_of::<D>(&dims), (&device, dtype))
                    }
                }
            });
            // The whole value drawn here is freed: its memory goes back to the system, not to a heap that
            // would keep it (and the next one) resident.
            crate::heap::release_after_freeing(bytes);
            placed
        }
    }
    impl FromOwner<'_> {
        /// `owner`'s value of a parameter this rank has not drawn (or the part of it the strategy keeps): received
        /// without a buffer of the whole, and loaded as Burn loads a record into a lazy parameter (its device and
        /// gradient setting, no draw).
        fn receive_lazy<const D: usize>(
            &mut self,
            param: Param<Tensor<D>>,
            owner: usize,
            id: ParamId,
        ) -> Param<Tensor<D>> {
            let shape = param.lazy_shape();
            let dims = shape.dims::<D>().to_vec();
            let device = param.lazy_device();
            let own = param.id;
            let dtype = Tensor::<1>::zeros([0], &device).dtype();
            let trains = set_to_train(&param, &device);
            let arriving = Arriving::Expected {
                len: shape.num_elements(),
                device,
                dtype,
            };
            match self.strategy.arrive(id, &dims, trains, arriving, owner) {
                Ok((local, local_dims)) => {
                    let local = Tensor::from_inner(local.reshape(dims_of::<D>(&local_dims)));
                    let loaded = param.transform_for_load(local, own);
                    // The buffers the part arrived in are freed.
                    crate::heap::release_after_freeing(local_dims.iter().product::<usize>() * 4);
                    loaded
                }
                Err(e) => {
                    self.error = Some(e);
                    param
                }
            }
        }
    }
    /// Whether `param` is set to train, as Burn keeps its setting (a value drawn on a device without autodiff
    /// does not show it), asked without drawing it: of the parameter loaded with an empty value. Every rank
    /// answers alike for the same model, whether it drew the parameter or not.
    fn set_to_train<const D: usize>(param: &Param<Tensor<D>>, device: &Device) -> bool {
        let empty = Tensor::from_inner(Tensor::<D>::zeros([0; D], device));
        param
            .clone()
            .transform_for_load(empty, param.id)
            .is_require_grad()
    }
    /// `dims` as a shape of `D` dimensions (a strategy keeps a parameter's number of dimensions).
    fn dims_of<const D: usize>(dims: &[usize]) -> [usize; D] {
        let mut out = [0; D];
        for (o, d) in out.iter_mut().zip(dims) {
            *o = *d;
        }
        out
    }
    let mut mapper = FromOwner {
        strategy,
        ids,
        next: 0,
        error: None,
    };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

/// The parameters of a module a strategy's hook may place: the table is read from the module the first time the
/// hook asks for it, and written back only then, so that a strategy with nothing to place costs nothing.
pub(crate) struct ModuleParams<'a> {
    read: &'a dyn Fn() -> ParamTable,
    table: Option<ParamTable>,
}

impl<'a> ModuleParams<'a> {
    /// The parameters `read` gives, read at the first [`table`](Self::table).
    pub fn new(read: &'a dyn Fn() -> ParamTable) -> Self {
        Self { read, table: None }
    }

    /// The module's parameter table, read now if it was not yet.
    pub fn table(&mut self) -> &mut ParamTable {
        let read = self.read;
        self.table.get_or_insert_with(read)
    }

    /// The table, if a hook read it.
    fn into_table(self) -> Option<ParamTable> {
        self.table
    }
}

/// A module after a strategy's hook: changed when the hook read its parameters, else `module` as it was.
pub(crate) enum Placed<M> {
    /// The hook placed parameters: the module was rebuilt from its table.
    Changed(M),
    /// The hook did not look at the parameters.
    Untouched(M),
}

impl<M> Placed<M> {
    /// The module, either way.
    pub fn into_inner(self) -> M {
        match self {
            Placed::Changed(m) | Placed::Untouched(m) => m,
        }
    }
}

/// The module `module` makes after `hook` placed its parameters (see [`ModuleParams`]): `None`, without making
/// the module, when the hook never read them.
fn placed_lazily<M: Module>(
    strategy: &dyn Strategy,
    module: impl FnOnce() -> M,
    hook: impl FnOnce(&dyn Strategy, &mut ModuleParams<'_>) -> Result<()>,
) -> Result<Option<M>> {
    let made = OnceCell::new();
    let make = Cell::new(Some(module));
    let read = || {
        ParamTable::of(made.get_or_init(|| match make.take() {
            Some(module) => module(),
            None => unreachable!("the module is made once, by the first read"),
        }))
    };
    let mut params = ModuleParams::new(&read);
    hook(strategy, &mut params)?;
    match (params.into_table(), made.into_inner()) {
        (Some(table), Some(module)) => table.apply(module).map(Some),
        _ => Ok(None),
    }
}

/// `module` after `hook` placed its parameters (see [`ModuleParams`]).
fn placed<M: Module>(
    strategy: &dyn Strategy,
    module: M,
    hook: impl FnOnce(&dyn Strategy, &mut ModuleParams<'_>) -> Result<()>,
) -> Result<Placed<M>> {
    let read = || ParamTable::of(&module);
    let mut params = ModuleParams::new(&read);
    hook(strategy, &mut params)?;
    match params.into_table() {
        Some(table) => table.apply(module).map(Placed::Changed),
        None => Ok(Placed::Untouched(module)),
    }
}

/// Tells `strategy` the new ids of `module`'s float parameters, which were `before` (in visiting order) until a
/// record restored the saved ones: a sharded strategy keys each parameter's slices by its id.
pub(crate) fn note_restored_ids<M: Module>(
    strategy: &dyn Strategy,
    before: Vec<ParamId>,
    module: &M,
) {
    let renamed: Vec<_> = before
        .into_iter()
        .zip(crate::grad::param_ids(module))
        .filter(|(a, b)| a != b)
        .collect();
    strategy.params_renamed(&renamed);
}

/// The last step of `prepare_model` (see [`Strategy::setup`]): under `FULL_SHARD` this rank keeps only its own
/// parameters.
pub(crate) fn after_prepare<M: Module>(strategy: &dyn Strategy, module: M) -> Result<M> {
    placed(strategy, module, |s, params| s.setup(params)).map(Placed::into_inner)
}

/// `module` whole on this rank (see [`Strategy::unshard`]): under `FULL_SHARD` the other ranks' parameters are
/// gathered; otherwise every rank holds them already and `module` comes back as it is (a cheap clone).
pub(crate) fn unshard<M: Module>(strategy: &dyn Strategy, module: &M) -> Result<M> {
    unshard_except(strategy, module, &HashSet::new())
}

/// [`unshard`] of every parameter of `module` but those in `kept` (a block-wise pass gathers its blocks one at a
/// time, and the rest of the model with this). Every rank must pass the same `kept`.
pub(crate) fn unshard_except<M: Module>(
    strategy: &dyn Strategy,
    module: &M,
    kept: &HashSet<ParamId>,
) -> Result<M> {
    placed(strategy, module.clone(), |s, params| {
        s.unshard(params, kept)
    })
    .map(Placed::into_inner)
}

/// A gather of a module's parameters started by [`start_unshard`]: [`finish`](Self::finish) gives the whole
/// module.
pub(crate) struct UnshardStarted<M> {
    module: M,
    table: Option<ParamTable>,
    finish: super::FinishUnshard,
}

/// Starts [`unshard`] of `module` (see [`Strategy::start_unshard`]): the gathers run while the caller computes
/// something else (a block-wise pass, the block before this one). Every rank must start the same modules in the
/// same order.
///
/// # Errors
/// A gather that failed to start (a rank died, a timeout of an earlier call).
pub(crate) fn start_unshard<M: Module>(
    strategy: &dyn Strategy,
    module: &M,
) -> Result<UnshardStarted<M>> {
    let module = module.clone();
    let read = || ParamTable::of(&module);
    let mut params = ModuleParams::new(&read);
    let finish = strategy.start_unshard(&mut params)?;
    let table = params.into_table();
    Ok(UnshardStarted {
        module,
        table,
        finish,
    })
}

impl<M: Module> UnshardStarted<M> {
    /// Waits for the gathers and returns the module whole on this rank.
    ///
    /// # Errors
    /// A failed gather (a rank died, a timeout).
    pub fn finish(self) -> Result<M> {
        let Self {
            module,
            table,
            finish,
        } = self;
        // The table the strategy read when it started, or the module's own where it read none.
        let mut table = table.unwrap_or_else(|| ParamTable::of(&module));
        finish(&mut table)?;
        table.apply(module)
    }
}

/// Before an optimizer steps `module` (see [`Strategy::before_step`]): under a sharded strategy whose ranks hold
/// whole parameters between steps (`SHARD_GRAD_OP`), each is cut to this rank's slice, the shape of its
/// gradient; under the others the module comes back untouched.
pub(crate) fn prepare_step<M: Module>(strategy: &dyn Strategy, module: M) -> Result<M> {
    placed(strategy, module, |s, params| s.before_step(params)).map(Placed::into_inner)
}

/// After an optimizer stepped `module` (see [`Strategy::after_step`]): under a sharded strategy, whose ranks step
/// only the parameters they own, the stepped parameters are shared (or dropped again under `FULL_SHARD`); under
/// a replicated strategy the module comes back untouched.
pub(crate) fn share_stepped<M: Module>(strategy: &dyn Strategy, module: M) -> Result<Placed<M>> {
    placed(strategy, module, |s, params| s.after_step(params))
}

/// [`share_stepped`] of the module `module` makes, made only when the strategy places its parameters (burn-train's
/// Learner holds its model: a copy is taken only then). `None` where the strategy left it as it was.
#[cfg_attr(not(feature = "train"), allow(dead_code))]
pub(crate) fn share_stepped_lazily<M: Module>(
    strategy: &dyn Strategy,
    module: impl FnOnce() -> M,
) -> Result<Option<M>> {
    placed_lazily(strategy, module, |s, params| s.after_step(params))
}

/// The fetcher of `module`'s parameters for a save that never holds the whole model (see
/// [`Strategy::fetcher`]); `None` where every rank holds the whole model.
pub(crate) fn param_fetcher<M: Module>(
    strategy: &dyn Strategy,
    module: &M,
) -> Option<ParamFetcher> {
    let read = || ParamTable::of(module);
    strategy.fetcher(&mut ModuleParams::new(&read))
}
