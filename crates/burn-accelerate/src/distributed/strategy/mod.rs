//! The distribution strategy: the one seam through which training is spread over ranks (Lightning Fabric's
//! `Strategy`).
//!
//! A [`Strategy`] decides how gradients are reduced across ranks, how every rank starts from the same weights,
//! which rank steps (and so holds the optimizer state of) which parameter, how the stepped parameters reach the
//! other ranks, and whether a checkpoint's optimizer state is one file or one slice per rank. The step pipeline
//! (`crate::pipeline`), the prepared optimizer, burn-train's Learner and the checkpointer only ask it; a new way
//! to distribute training is one new implementation here:
//!
//! | strategy | gradients | who steps what | optimizer state |
//! |---|---|---|---|
//! | [`SingleDevice`] | scaled in place | this rank, everything | one file |
//! | [`DataParallel`] over a [`TensorComm`](crate::distributed::tensor_comm::TensorComm) | bucketed all-reduce (mean) | every rank, everything | one file, from the main process |
//! | [`Sharded`] (`SHARD_GRAD_OP`, `FULL_SHARD`) | reduce-scatter, keep this rank's | each rank, its own parameters; then all-gathered (or dropped: `FULL_SHARD`) | one slice per rank |
//! | [`Sharded`], hybrid (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`) | reduce-scatter within the shard group, all-reduce across the replicas | as above, within the shard group (a sub-group of the communicator) | one slice per rank (replicas write the same) |
//!
//! Data parallelism's implementation of the tensor interface is chosen per run (`transport::select`, from the `gradient_transport` setting and
//! what the machine has): host copies through the communicator on every backend, or a device all-reduce on CUDA
//! (Burn's in-process collective, NCCL between processes). The tests below train through another transport
//! and through the device path's test double, end to end.

mod data_parallel;
mod params;
mod sharded;
mod transport;

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

pub(crate) use data_parallel::{DataParallel, SingleDevice};
pub(crate) use params::ParamTable;
pub(crate) use sharded::{ParamFetcher, Sharded};
pub(crate) use transport::check_against_reference as check_transport;
#[cfg(test)]
use transport::{DeviceAverage, OnDevice};
pub use transport::{DtypeCheck, TransportCheck, describe, rounding_bound};

use crate::config::{AcceleratorConfig, GradientTransport};
use crate::distributed::ProcessGroup;
use crate::distributed::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::grad::GradientBuffer;

/// Where a checkpoint's optimizer state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateScope {
    /// Every rank holds the same state: the main process writes it, every rank reads it.
    Replicated,
    /// Each rank holds a slice: each writes and reads its own.
    PerRank,
}

/// How training is distributed over the ranks of a process group.
pub(crate) trait Strategy: Send + Sync + fmt::Debug {
    /// What runs, for messages and the start-up line (`data parallel over host all-reduce`, ...).
    fn name(&self) -> String;

    /// Whether other ranks take part (a single rank never communicates).
    fn is_distributed(&self) -> bool;

    /// This rank's index in the group the strategy distributes over.
    fn rank(&self) -> usize;

    /// Replaces every stored gradient of `params` (`(id, number of elements)`, in the same order on every
    /// rank) with its mean over the ranks, times `scale`. A parameter without a gradient on this rank
    /// contributes zeros. A strategy whose ranks own parameters keeps only the gradients this rank owns.
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()>;

    /// Rank `root`'s value of one flattened parameter on every rank.
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>>;

    /// Whether a checkpoint holds one optimizer state or one slice per rank.
    fn optimizer_state(&self) -> StateScope {
        StateScope::Replicated
    }

    /// Whether a checkpoint holds one model record or one per rank (each holding that rank's parameters).
    fn model_state(&self) -> StateScope {
        StateScope::Replicated
    }

    /// The parameters `(old, new)` now have new ids (a checkpoint restored the saved ones).
    fn params_renamed(&self, renamed: &[(ParamId, ParamId)]) {
        let _ = renamed;
    }

    /// Whether this rank steps parameter `id` (and so holds its optimizer state): every parameter, unless the
    /// strategy partitions them between ranks.
    fn owns(&self, id: ParamId) -> bool {
        let _ = id;
        true
    }

    /// Whether each rank holds only part of the training state (its own parameters' gradients and optimizer
    /// state): its stepped parameters then reach the other ranks after every step, every rank taking part even
    /// when it owns none, and a gradient norm combines every rank's part.
    fn shards_state(&self) -> bool {
        false
    }

    /// Whether each rank holds only its own parameters between steps (`FULL_SHARD`, `HYBRID_SHARD`): a forward
    /// pass must gather the others first ([`unshard`], or block by block with [`unshard_except`]).
    fn reshards_parameters(&self) -> bool {
        false
    }

    /// Whether the lifecycle hooks below place parameters ([`setup`](Self::setup), [`unshard`](Self::unshard),
    /// [`after_step`](Self::after_step), [`fetcher`](Self::fetcher)): the pipeline reads the model's parameter
    /// table for them only then. A strategy whose every rank holds every parameter, stepped by itself, has nothing
    /// to place.
    fn places_parameters(&self) -> bool {
        false
    }

    /// The last step of `prepare_model`: the strategy learns the model's parameters (owners, whole shapes) and
    /// drops from `params` what this rank does not hold between steps.
    fn setup(&self, params: &mut ParamTable) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Before a forward pass: gives `params` every parameter whole, but those in `kept` (a block-wise pass
    /// gathers its blocks one at a time). Every rank runs the same collectives, whatever it holds.
    fn unshard(&self, params: &mut ParamTable, kept: &HashSet<ParamId>) -> Result<()> {
        let _ = (params, kept);
        Ok(())
    }

    /// After an optimizer stepped this rank's parameters: shares them with the other ranks, or drops again what
    /// this rank does not hold between steps.
    fn after_step(&self, params: &mut ParamTable) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// A fetcher of `params`' whole values, one at a time, for a save that never holds the whole model on one
    /// rank; `None` where every rank holds every parameter.
    fn fetcher(&self, params: &ParamTable) -> Option<ParamFetcher> {
        let _ = params;
        None
    }

    /// Whether `local` holds on any rank: the verdict every rank must share when each rank checks only its own
    /// part of the gradients (an fp16 overflow). Ranks that hold the same gradients answer `local`.
    fn any_rank(&self, local: bool) -> Result<bool> {
        Ok(local)
    }

    /// Whether burn-train's Learner can train through this strategy: it runs the forward pass on its own model,
    /// without gathering parameters this rank does not hold between steps. Where it cannot, an error saying what
    /// to use instead.
    ///
    /// # Errors
    /// The strategy keeps only this rank's parameters between steps.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    fn check_learner(&self) -> Result<()> {
        Ok(())
    }

    /// Combines the part of a gradient norm computed on this rank's gradients (a sum of powers with
    /// [`ReduceOp::Sum`], a maximum with [`ReduceOp::Max`]) with the other ranks' parts, when each rank holds only
    /// its own gradients; ranks that hold the same gradients return `partial`.
    fn combine_norm_parts(&self, partial: f64, op: ReduceOp) -> Result<f64> {
        let _ = op;
        Ok(partial)
    }
}

/// The strategy of `group`'s rank under `config`: [`SingleDevice`] for one rank; for several, [`Sharded`] when
/// `config.distributed.sharding` asks for it, else [`DataParallel`] over the gradient transport
/// [`transport::select`] picks; with buckets of at most `config.distributed.bucket_size_mb`. The main process logs
/// the transport and why.
///
/// # Errors
/// `gradient_transport = device` where the device path is not available.
pub(crate) fn for_group(
    group: &Arc<ProcessGroup>,
    config: &AcceleratorConfig,
) -> Result<Arc<dyn Strategy>> {
    let bucket_bytes = (config.distributed.bucket_size_mb * 1024.0 * 1024.0) as usize;
    let world = group.num_processes();
    if world > 1 && config.distributed.sharding.is_sharded() {
        if config.distributed.gradient_transport == GradientTransport::Device {
            transport::choose(
                GradientTransport::Device,
                &transport::facts_for(group, true),
            )?;
        }
        if config.distributed.sharding.is_hybrid() {
            let shard_size = config
                .distributed
                .dp_shard_size
                .unwrap_or_else(|| group.local_world_size());
            let strategy = Sharded::hybrid(
                group.clone(),
                shard_size,
                config.distributed.sharding,
                bucket_bytes,
            )?;
            return Ok(Arc::new(strategy));
        }
        return Ok(Arc::new(Sharded::new(
            group.clone(),
            config.distributed.sharding,
            bucket_bytes,
        )));
    }
    if world == 1 {
        return Ok(Arc::new(SingleDevice));
    }
    let (transport, choice) = transport::select(
        group,
        config.distributed.gradient_transport,
        config.collective_timeout(),
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

/// `(id, number of elements)` of every float parameter of `module` that requires a gradient, in visiting order
/// (the same on every rank for the same model).
pub(crate) fn trainable_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Params(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Params {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.push((param.id, param.shape().num_elements()));
            }
        }
    }
    let mut params = Params(Vec::new());
    module.visit(&mut params);
    params.0
}

/// Returns `module` with every float parameter replaced by rank 0's value (Accelerate's DDP wrapping does the
/// same), keeping ids and gradient settings. A single rank gets its module back untouched.
///
/// A parameter that is still lazy (Burn draws parameters at their first use) is drawn on rank 0 only: the other
/// ranks receive its value without running its initializer, so they never draw from a random generator they may
/// share with rank 0 (in-process ranks share the device's).
pub(crate) fn broadcast_module<M: Module>(strategy: &dyn Strategy, module: M) -> Result<M> {
    if !strategy.is_distributed() {
        return Ok(module);
    }
    from_rank_0(strategy, module)
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
    struct Draw;
    impl ModuleVisitor for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_initialized() {
                let _ = param.base();
            }
        }
    }
    module.visit(&mut Draw);
    module
}

/// Returns `module` with every float parameter replaced by rank 0's value, keeping ids and gradient settings.
fn from_rank_0<M: Module>(strategy: &dyn Strategy, module: M) -> Result<M> {
    struct FromOwner<'a> {
        strategy: &'a dyn Strategy,
        error: Option<Error>,
    }
    impl ModuleMapper for FromOwner<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let owner = 0;
            if self.error.is_some() {
                return param;
            }
            if !param.is_initialized() && owner != self.strategy.rank() {
                return self.receive_lazy(param, owner);
            }
            let require_grad = param.is_require_grad();
            param.map(|tensor| {
                let device = tensor.device();
                let shape = tensor.shape();
                let fallback = tensor.clone();
                let flat = tensor.inner().reshape([shape.num_elements()]);
                match self.strategy.broadcast(flat, owner) {
                    // A new leaf of the autodiff graph, tracked again when the parameter trains.
                    Ok(value) => {
                        let value = Tensor::from_inner(value.reshape(shape)).to_device(&device);
                        if require_grad {
                            value.require_grad()
                        } else {
                            value
                        }
                    }
                    Err(e) => {
                        self.error = Some(e);
                        fallback
                    }
                }
            })
        }
    }
    impl FromOwner<'_> {
        /// `owner`'s value of a parameter this rank has not drawn: received into a buffer of its shape and
        /// loaded as Burn loads a record into a lazy parameter (its device and gradient setting, no draw).
        fn receive_lazy<const D: usize>(
            &mut self,
            param: Param<Tensor<D>>,
            owner: usize,
        ) -> Param<Tensor<D>> {
            let shape = param.lazy_shape();
            let device = param.lazy_device();
            let buffer = Tensor::<1>::zeros([shape.num_elements()], &device).inner();
            match self.strategy.broadcast(buffer, owner) {
                Ok(value) => {
                    let id = param.id;
                    param.transform_for_load(Tensor::from_inner(value.reshape(shape)), id)
                }
                Err(e) => {
                    self.error = Some(e);
                    param
                }
            }
        }
    }
    let mut mapper = FromOwner {
        strategy,
        error: None,
    };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

/// `module` after `hook` placed its parameters: the parameter table is read, handed to the strategy's hook and
/// written back. A strategy that places no parameters gets nothing to do.
fn placed<M: Module>(
    strategy: &dyn Strategy,
    module: M,
    hook: impl FnOnce(&dyn Strategy, &mut ParamTable) -> Result<()>,
) -> Result<M> {
    if !strategy.places_parameters() {
        return Ok(module);
    }
    let mut params = ParamTable::of(&module);
    hook(strategy, &mut params)?;
    params.apply(module)
}

/// The last step of `prepare_model` (see [`Strategy::setup`]): under `FULL_SHARD` this rank keeps only its own
/// parameters.
pub(crate) fn after_prepare<M: Module>(strategy: &dyn Strategy, module: M) -> Result<M> {
    placed(strategy, module, |s, params| s.setup(params))
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
}

/// After an optimizer stepped `module` (see [`Strategy::after_step`]): under a sharded strategy, whose ranks step
/// only the parameters they own, the stepped parameters are shared (or dropped again under `FULL_SHARD`); under
/// a replicated strategy the module comes back as it is.
pub(crate) fn share_stepped<M: Module>(strategy: &dyn Strategy, module: M) -> Result<M> {
    placed(strategy, module, |s, params| s.after_step(params))
}

/// The fetcher of `module`'s parameters for a save that never holds the whole model (see
/// [`Strategy::fetcher`]); `None` where every rank holds the whole model.
pub(crate) fn param_fetcher<M: Module>(
    strategy: &dyn Strategy,
    module: &M,
) -> Option<ParamFetcher> {
    if !strategy.places_parameters() {
        return None;
    }
    strategy.fetcher(&ParamTable::of(module))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::AdamConfig;
    use burn::tensor::Device;

    use super::*;
    use crate::accelerator::AcceleratorBuilder;
    use crate::config::ShardingStrategy;
    use crate::distributed::collectives;
    use crate::distributed::comm::ReduceOp;
    use crate::{Accelerator, StateToSave};

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    /// Another gradient transport, in the shape of a device all-reduce: the flat buffer is averaged by a tensor
    /// collective and scaled as a tensor (no host buffer of the transport's own), and its calls are counted.
    #[derive(Debug)]
    struct DeviceDouble {
        group: Arc<ProcessGroup>,
        calls: Arc<AtomicUsize>,
    }

    impl DeviceAverage for DeviceDouble {
        fn name(&self) -> &'static str {
            "device double"
        }
        fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let sum = collectives::reduce(&self.group, flat, ReduceOp::Sum)?;
            Ok(sum.mul_scalar(scale / self.group.num_processes() as f32))
        }
    }

    /// A linear layer with fixed, uneven weights: the device's random generator is shared by the tests that
    /// run beside this one, and Burn draws parameters lazily, so drawn weights would differ between runs.
    fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
        let mut layer = LinearConfig::new(d_in, d_out).init(device);
        let values: Vec<f32> = (0..d_in * d_out)
            .map(|i| (i as f32 * 0.37 + salt).sin() * 0.5)
            .collect();
        let weight = Tensor::<1>::from_floats(values.as_slice(), device).reshape([d_in, d_out]);
        layer.weight = Param::from_tensor(weight);
        layer.bias = Some(Param::from_tensor(Tensor::zeros([d_out], device)));
        layer
    }

    fn net(device: &Device) -> Net {
        Net {
            a: linear(4, 8, 0.1, device),
            b: linear(8, 2, 1.3, device),
        }
    }

    fn weights(net: &Net) -> Vec<f32> {
        [
            net.a.weight.val().into_data(),
            net.b.weight.val().into_data(),
        ]
        .into_iter()
        .flat_map(|d| d.try_to_vec::<f32>().unwrap())
        .collect()
    }

    /// Trains `Net` with Adam for `steps` steps on 2 ranks (each rank its own data) and returns each rank's
    /// weights and the number of optimizer state records it holds.
    fn train(builder: AcceleratorBuilder, steps: usize) -> Vec<(Vec<f32>, usize)> {
        builder
            .launch(2, move |acc: Accelerator| {
                let device = acc.device().clone();
                let mut net = acc.prepare_model(net(&device))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let rank = acc.process_index() as f32;
                for step in 0..steps {
                    let values: Vec<f32> = (0..24)
                        .map(|i| i as f32 * (0.05 * (rank + 1.0) + step as f32 * 0.01))
                        .collect();
                    let x = Tensor::<1>::from_floats(values.as_slice(), &device).reshape([6, 4]);
                    let whole = acc.unshard(&net)?;
                    let loss = whole
                        .b
                        .forward(whole.a.forward(x).tanh())
                        .powi_scalar(2)
                        .mean();
                    acc.backward(loss, &whole)?;
                    net = optimizer.try_step(net)?;
                }
                // FULL_SHARD holds only this rank's parameters between steps: compare the whole model.
                Ok((
                    weights(&acc.unshard(&net)?),
                    optimizer.inner().to_record().len(),
                ))
            })
            .unwrap()
    }

    fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-6))
            .fold(0.0, f32::max)
    }

    #[test]
    fn another_gradient_transport_trains_the_same_model_as_the_host_all_reduce() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let device = AcceleratorBuilder::default().strategy(Arc::new(move |group| {
            let transport = DeviceDouble {
                group: group.clone(),
                calls: counted.clone(),
            };
            Arc::new(DataParallel::new(
                OnDevice::checked(Box::new(transport), group),
                25 << 20,
            ))
        }));
        let host = train(AcceleratorBuilder::default(), 20);
        let other = train(device, 20);
        // One bucket per step on each of the 2 ranks (the initial broadcast is not an average).
        assert_eq!(calls.load(Ordering::Relaxed), 2 * 20);
        for ((h, _), (o, _)) in host.iter().zip(&other) {
            let diff = max_relative_difference(h, o);
            assert!(diff < 1e-5, "device double vs host all-reduce: {diff}");
        }
        assert_eq!(other[0].0, other[1].0, "ranks agree");
    }

    #[test]
    fn the_device_all_reduce_path_trains_the_same_model_as_the_host_all_reduce() {
        // DeviceAllReduce as NCCL drives it (id from rank 0 over the communicator, asynchronous calls polled
        // against the timeout), over the host-memory double of the library.
        let device = AcceleratorBuilder::default().strategy(Arc::new(|group| {
            let transport = transport::DeviceAllReduce::connect(
                group.clone(),
                &transport::double::HostLibrary::default(),
                std::time::Duration::from_secs(30),
            )
            .unwrap();
            Arc::new(DataParallel::new(
                OnDevice::checked(Box::new(transport), group),
                25 << 20,
            ))
        }));
        let host = train(AcceleratorBuilder::default(), 20);
        let other = train(device, 20);
        for ((h, _), (o, _)) in host.iter().zip(&other) {
            let diff = max_relative_difference(h, o);
            assert!(diff < 1e-5, "device all-reduce vs host all-reduce: {diff}");
        }
        assert_eq!(other[0].0, other[1].0, "ranks agree");
    }

    #[test]
    fn the_transport_is_chosen_from_the_setting_and_named() {
        use crate::config::GradientTransport;
        for preference in [GradientTransport::Auto, GradientTransport::Host] {
            let names = AcceleratorBuilder::default()
                .gradient_transport(preference)
                .launch(2, |acc| Ok(acc.strategy_name()))
                .unwrap();
            assert_eq!(names, vec!["data parallel over host all-reduce"; 2]);
        }
        // Flex ranks have no device path: asking for one is refused with the reason.
        let err = AcceleratorBuilder::default()
            .gradient_transport(GradientTransport::Device)
            .launch(2, |acc| Ok(acc.strategy_name()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gradient_transport") && err.contains("device collectives on CUDA only"),
            "{err}"
        );
        // One rank needs no transport, whatever the setting.
        let single = AcceleratorBuilder::default()
            .gradient_transport(GradientTransport::Device)
            .launch(1, |acc| Ok(acc.strategy_name()))
            .unwrap();
        assert_eq!(single, vec!["single device"]);
    }

    #[test]
    fn sharded_strategies_step_each_parameter_on_its_owner_and_match_data_parallelism() {
        let replicated = train(AcceleratorBuilder::default(), 20);
        // Four parameters (32, 16, 8 and 2 elements): rank 0 owns the largest, rank 1 the other three.
        let per_param = replicated[0].1 / 4;
        assert_eq!(
            replicated[0].1, replicated[1].1,
            "data parallelism: every rank holds all state"
        );
        for mode in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
            // Small buckets: several reduce-scatter and all-gather rounds per step.
            let sharded = AcceleratorBuilder::default()
                .sharding(mode)
                .bucket_size_mb(40.0 / (1 << 20) as f64);
            let shards = train(sharded, 20);
            for rank in 0..2 {
                assert_eq!(
                    shards[rank].0, replicated[rank].0,
                    "{mode} rank {rank}: the same reduction, so the same weights bit for bit"
                );
            }
            assert_eq!(
                (shards[0].1, shards[1].1),
                (per_param, 3 * per_param),
                "{mode}: each rank holds its slice"
            );
        }
    }

    #[test]
    fn a_sharded_strategy_saves_and_restores_each_ranks_optimizer_slice() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-sharded-state-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let sharded = AcceleratorBuilder::default().sharding(ShardingStrategy::ShardGradOp);
        let target = dir.clone();
        let restored = sharded
            .launch(2, move |acc: Accelerator| {
                let device = acc.device().clone();
                let net = acc.prepare_model(net(&device))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let x = Tensor::<2>::ones([3, 4], &device);
                acc.backward(net.b.forward(net.a.forward(x)).sum(), &net)?;
                let net = optimizer.try_step(net)?;
                let parts = StateToSave::new().model(&net)?.optimizer(&optimizer)?;
                acc.save_state(Some(&target), &parts)?;
                let mut fresh = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let mut state = acc.load_state(Some(&target))?;
                let _ = state.model(net)?;
                state.optimizer(&mut fresh)?;
                state.finish()?;
                Ok(fresh.inner().to_record().len())
            })
            .unwrap();
        assert!(dir.join("optimizer_rank0.bpk").is_file());
        assert!(dir.join("optimizer_rank1.bpk").is_file());
        assert!(!dir.join("optimizer.bpk").exists());
        assert_eq!(
            restored[1],
            3 * restored[0],
            "each rank read back its own slice"
        );
        assert!(restored[0] > 0);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = Device::default();
    }

    #[test]
    fn a_sharded_run_says_fsdp_and_refuses_what_sharding_cannot_honour() {
        let sharded = || AcceleratorBuilder::default().sharding(ShardingStrategy::ShardGradOp);
        let kinds = sharded()
            .launch(2, |acc| Ok(acc.distributed_type()))
            .unwrap();
        assert_eq!(kinds, vec![crate::DistributedType::Fsdp; 2]);
        let alone = sharded()
            .launch(1, |acc| Ok(acc.distributed_type()))
            .unwrap();
        assert_eq!(alone, vec![crate::DistributedType::No]);
        let err = sharded()
            .sync_each_batch(true)
            .launch(2, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sync_each_batch") && err.contains("SHARD_GRAD_OP"),
            "{err}"
        );
    }

    #[test]
    fn owners_are_balanced_by_size_and_deterministic() {
        let ids: Vec<ParamId> = (0..5).map(|_| ParamId::new()).collect();
        let params: Vec<(ParamId, usize)> = ids.iter().copied().zip([10, 40, 10, 20, 20]).collect();
        assert_eq!(balanced_owners(&params, 2), vec![0, 0, 1, 1, 1]);
        assert_eq!(balanced_owners(&params, 3), vec![1, 0, 2, 1, 2]);
        assert_eq!(balanced_owners(&params, 1), vec![0; 5]);
    }
}
