//! How tensors cross ranks: which implementation of the tensor-level interface ([`TensorComm`]) a run uses, and
//! the device engines behind it.
//!
//! The host implementation ([`HostTensorComm`](crate::distributed::tensor_comm::HostTensorComm)) copies buffers
//! to host memory and goes through the rank's communicator; [`OnDevice`] runs every call its [`DeviceEngine`] has
//! on the device — NCCL ([`DeviceCollectives`]: all-reduce, reduce, reduce-scatter, all-gather, broadcast,
//! point-to-point batches, split sub-groups), or Burn's CUDA collective between the devices of one process
//! (all-reduce only) — and the rest through host memory; in-process ranks on one device hand each other the
//! tensors themselves ([`shared_device`]). [`choose`] picks one from facts every rank gathers
//! ([`TransportFacts`]) and from what the group carries ([`Exchanges`]); bucketing is the strategy's business
//! ([`bucket`](crate::distributed::tensor_comm::bucket)), not the transport's.

// Driven by Burn's CUDA collective in CUDA builds, by a function in tests.
#[cfg_attr(not(any(test, feature = "cuda-bare")), allow(dead_code))]
mod burn_collective;
mod check;
mod choice;
// Driven by NCCL in CUDA builds, by its host-memory double in tests.
#[cfg_attr(not(any(test, feature = "cuda-bare")), allow(dead_code))]
mod device;
#[cfg(feature = "cuda-bare")]
mod nccl;

pub use check::{DtypeCheck, TransportCheck, rounding_bound};
pub(crate) use check::{check_collectives, check_transport, compare};
// `LifecycleCheck` is defined below, beside the entry point that fills it.
pub(crate) use choice::{Exchanges, TransportChoice, TransportFacts, TransportKind, choose};
#[cfg(test)]
pub(crate) use device::{DeviceCollectives, double};

use std::fmt;
use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor};

use crate::backend::{Backend, probe};
use crate::config::AcceleratorConfig;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::{ReduceBuffer, ReduceOp};
use crate::distributed::tensor_comm::host::{from_buffer, to_buffer};
use crate::distributed::tensor_comm::{
    Checked, HostTensorComm, Incoming, Pending, Reduction, TensorComm, shared_device,
};
use crate::error::{Error, Result};

/// A device engine: averages one flat gradient buffer across ranks on the device, and, where it has them, the
/// other calls of the tensor interface (`None`: the engine has no such call, and it goes through host memory —
/// the same answer on every rank, since every rank runs the same engine).
#[cfg_attr(not(any(test, feature = "cuda-bare")), allow(dead_code))]
pub(crate) trait DeviceEngine: Send + Sync + fmt::Debug {
    /// A short name for messages and `env` (`device collectives (NCCL)`, ...).
    fn name(&self) -> &'static str;

    /// The mean of `flat` over the ranks, times `scale`, in `flat`'s dtype and on its device.
    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>>;

    /// `flat` combined with `op` over the ranks, on every rank.
    fn all_reduce(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        let _ = (flat, op);
        None
    }

    /// `flat` combined with `op` over the ranks; the result is `root`'s alone (another rank's is unspecified).
    fn reduce(&self, flat: Tensor<1>, root: usize, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        let _ = (flat, root, op);
        None
    }

    /// `flat` combined with `op` over the ranks in as many equal parts as ranks; this rank's part.
    fn reduce_scatter(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        let _ = (flat, op);
        None
    }

    /// Every rank's `part` (all of one length) concatenated in rank order.
    fn all_gather(&self, part: Tensor<1>) -> Option<Result<Tensor<1>>> {
        let _ = part;
        None
    }

    /// `root`'s `flat` on every rank.
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Option<Result<Tensor<1>>> {
        let _ = (flat, root);
        None
    }

    /// A point-to-point batch: every send posted, then every receive, in order.
    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
    ) -> Option<Result<Vec<Tensor<1>>>> {
        let _ = (sends, recvs);
        None
    }

    /// The same engine over `group`, a sub-group just split from this engine's group (every rank of this
    /// group calls it, in the same order).
    fn on_group(&self, group: Arc<ProcessGroup>) -> Option<Result<Box<dyn DeviceEngine>>> {
        let _ = group;
        None
    }
}

/// Whether `counts` gives every one of `world` ranks the same number of elements (what a device reduce-scatter
/// or all-gather takes).
fn equal_parts(counts: &[usize], world: usize) -> bool {
    counts.len() == world && counts.windows(2).all(|w| w[0] == w[1])
}

/// `Ok` when `counts` names each of `world` ranks and this rank's buffer holds `len` elements, `expected` (the
/// counts' `what`); else the error that says which.
fn check_counts(
    operation: &str,
    counts: &[usize],
    world: usize,
    len: usize,
    expected: usize,
    what: &str,
) -> Result<()> {
    if counts.len() != world {
        return Err(Error::InvalidArgument(format!(
            "{operation}: {} counts for a group of {world} ranks (one count per rank)",
            counts.len()
        )));
    }
    if len != expected {
        return Err(Error::InvalidArgument(format!(
            "{operation}: this rank's buffer holds {len} elements, the {what} the counts {counts:?} is {expected}"
        )));
    }
    Ok(())
}

/// `flat`, the parts of `counts` one after the other, laid out as `counts.len()` parts of `width` elements each,
/// each part padded with zeros at its end: uneven parts in the equal ones a device reduce-scatter takes.
fn pad_parts(flat: Tensor<1>, counts: &[usize], width: usize) -> Tensor<1> {
    let like = (flat.device(), flat.dtype());
    let mut pieces = Vec::with_capacity(2 * counts.len());
    let mut start = 0;
    for &count in counts {
        if count > 0 {
            pieces.push(flat.clone().slice(start..start + count));
        }
        if width > count {
            pieces.push(Tensor::zeros([width - count], (&like.0, like.1)));
        }
        start += count;
    }
    Tensor::cat(pieces, 0)
}

/// `part` padded with zeros to `width` elements.
fn pad_to(part: Tensor<1>, width: usize) -> Tensor<1> {
    let len = part.dims()[0];
    if len == width {
        return part;
    }
    let zeros = Tensor::zeros([width - len], (&part.device(), part.dtype()));
    Tensor::cat(vec![part, zeros], 0)
}

/// The first `len` elements of `flat` (an empty tensor for 0).
fn head(flat: Tensor<1>, len: usize) -> Tensor<1> {
    if len == 0 {
        Tensor::zeros([0], (&flat.device(), flat.dtype()))
    } else if len == flat.dims()[0] {
        flat
    } else {
        flat.slice(0..len)
    }
}

/// The tensor interface on a device engine: every call the engine has runs on the device (uneven parts padded
/// to equal ones), the others through host memory.
#[derive(Debug)]
#[cfg_attr(not(any(test, feature = "cuda-bare")), allow(dead_code))]
pub(crate) struct OnDevice {
    engine: Box<dyn DeviceEngine>,
    host: HostTensorComm,
}

#[cfg_attr(not(any(test, feature = "cuda-bare")), allow(dead_code))]
impl OnDevice {
    /// `engine`'s calls, and host memory over `group` for the rest.
    pub fn new(engine: Box<dyn DeviceEngine>, group: Arc<ProcessGroup>) -> Self {
        Self {
            engine,
            host: HostTensorComm::new(group),
        }
    }

    /// `engine` behind the interface, checked over `group` (debug mode compares every call first).
    pub fn checked(
        engine: Box<dyn DeviceEngine>,
        group: &Arc<ProcessGroup>,
    ) -> Arc<dyn TensorComm> {
        Arc::new(Checked::new(
            Arc::new(Self::new(engine, group.clone())),
            group.clone(),
        ))
    }
}

/// `result` multiplied by `factor` where there is one.
fn scaled(result: Tensor<1>, factor: Option<f32>) -> Tensor<1> {
    match factor {
        Some(factor) => result.mul_scalar(factor),
        None => result,
    }
}

impl TensorComm for OnDevice {
    fn name(&self) -> &'static str {
        self.engine.name()
    }

    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn all_reduce(
        &self,
        flat: Tensor<1>,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        if let Reduction::Average(scale) = how {
            return Ok(Pending::ready(self.engine.average(flat, scale)?));
        }
        let (op, factor) = how.split(self.world_size());
        match self.engine.all_reduce(flat.clone(), op) {
            Some(result) => Ok(Pending::ready(scaled(result?, factor))),
            None => self.host.all_reduce(flat, how, operation),
        }
    }

    fn reduce(
        &self,
        flat: Tensor<1>,
        root: usize,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Option<Tensor<1>>>> {
        crate::distributed::comm::check_root_public(operation, root, self.world_size())?;
        let (op, factor) = how.split(self.world_size());
        match self.engine.reduce(flat.clone(), root, op) {
            Some(result) => {
                let result = result?;
                Ok(Pending::ready(
                    (self.rank() == root).then(|| scaled(result, factor)),
                ))
            }
            None => self.host.reduce(flat, root, how, operation),
        }
    }

    /// On the device where the engine has the call, uneven parts padded to the largest; through host memory
    /// otherwise.
    fn reduce_scatter(
        &self,
        flat: Tensor<1>,
        counts: &[usize],
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let world = self.world_size();
        // The path is chosen from what every rank passes alike (the counts, the engine), never from this rank's
        // own buffer: a buffer that disagrees with the counts is an error here, not a call through host memory
        // while the other ranks wait on the device.
        check_counts(
            operation,
            counts,
            world,
            flat.dims()[0],
            counts.iter().sum(),
            "sum of",
        )?;
        let width = counts.iter().copied().max().unwrap_or(0);
        if width == 0 {
            return Ok(Pending::ready(head(flat, 0)));
        }
        let (op, factor) = how.split(world);
        let mine = counts[self.rank()];
        let input = if equal_parts(counts, world) {
            flat.clone()
        } else {
            pad_parts(flat.clone(), counts, width)
        };
        if let Some(part) = self.engine.reduce_scatter(input, op) {
            return Ok(Pending::ready(scaled(head(part?, mine), factor)));
        }
        self.host.reduce_scatter(flat, counts, how, operation)
    }

    /// On the device where the engine has the call, uneven parts padded to the largest; through host memory
    /// otherwise.
    fn all_gather(
        &self,
        part: Tensor<1>,
        counts: &[usize],
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let world = self.world_size();
        // As in `reduce_scatter`: the path from the counts alone.
        let own = counts.get(self.rank()).copied().unwrap_or(0);
        check_counts(
            operation,
            counts,
            world,
            part.dims()[0],
            own,
            "this rank's count,",
        )?;
        let width = counts.iter().copied().max().unwrap_or(0);
        if width == 0 {
            return Ok(Pending::ready(head(part, 0)));
        }
        if let Some(all) = self.engine.all_gather(pad_to(part.clone(), width)) {
            let all = all?;
            if equal_parts(counts, world) {
                return Ok(Pending::ready(all));
            }
            let pieces: Vec<Tensor<1>> = counts
                .iter()
                .enumerate()
                .filter(|(_, count)| **count > 0)
                .map(|(r, count)| all.clone().slice(r * width..r * width + count))
                .collect();
            return Ok(Pending::ready(Tensor::cat(pieces, 0)));
        }
        self.host.all_gather(part, counts, operation)
    }

    /// On the device where the engine has the call; through host memory otherwise.
    fn broadcast(
        &self,
        flat: Tensor<1>,
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        crate::distributed::comm::check_root_public(operation, root, self.world_size())?;
        if let Some(all) = self.engine.broadcast(flat.clone(), root) {
            return Ok(Pending::ready(all?));
        }
        self.host.broadcast(flat, root, operation)
    }

    fn all_reduce_value(
        &self,
        value: f64,
        op: crate::distributed::comm::ReduceOp,
        operation: &'static str,
    ) -> Result<f64> {
        self.host.all_reduce_value(value, op, operation)
    }

    /// On the device where the engine has point-to-point batches (NCCL's group call); through host memory
    /// otherwise.
    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
        operation: &'static str,
    ) -> Result<Pending<Vec<Tensor<1>>>> {
        if let Some(received) = self.engine.send_recv(sends.clone(), recvs.clone()) {
            return Ok(Pending::ready(received?));
        }
        self.host.send_recv(sends, recvs, operation)
    }

    /// A communicator split from the engine's where it can split (NCCL's `ncclCommSplit`); host memory
    /// otherwise.
    fn on_group(&self, group: Arc<ProcessGroup>) -> Result<Arc<dyn TensorComm>> {
        match self.engine.on_group(group.clone()) {
            Some(engine) => Ok(Arc::new(Self::new(engine?, group))),
            None => self.host.on_group(group),
        }
    }
}

/// `flat`'s values in host memory, as f32 (half-precision values are widened exactly, f64 ones rounded).
pub(crate) fn to_host(flat: Tensor<1>, operation: &'static str) -> Result<Vec<f32>> {
    Ok(match to_buffer(flat, operation)? {
        ReduceBuffer::F64(values) => values.into_iter().map(|v| v as f32).collect(),
        ReduceBuffer::F32(values) => values,
        other => {
            return Err(Error::InvalidArgument(format!(
                "{operation}: {} values for a float tensor",
                other.kind()
            )));
        }
    })
}

/// A flat tensor of `values` in `dtype` on `device`.
pub(crate) fn from_host(
    values: Vec<f32>,
    place: (&Device, DType),
    operation: &'static str,
) -> Result<Tensor<1>> {
    from_buffer(ReduceBuffer::F32(values), None, place, operation)
}

/// The facts the transport choice rests on, for `group`'s rank. A collective where the ranks share memory (they
/// compare their devices): every rank of `group` calls it.
///
/// # Errors
/// The devices' comparison (a timeout, a rank that failed).
pub(crate) fn facts_for(group: &ProcessGroup, exchanges: Exchanges) -> Result<TransportFacts> {
    let world = group.num_processes();
    let in_process = group.comm().engine() == crate::distributed::comm::IN_PROCESS_ENGINE;
    let local_world = if in_process {
        world
    } else {
        crate::distributed::cluster::LauncherVars::read_lenient()
            .local_world_size
            .unwrap_or(world)
    };
    let shared_device = world > 1 && shared_device::one_device(group)?;
    Ok(TransportFacts {
        shared_device,
        ..facts_from(group.backend(), world, local_world, in_process, exchanges)
    })
}

/// [`TransportFacts`] for ranks on `backend`, probing CUDA when that is the backend; ranks that share no device
/// (set `shared_device` where they do).
pub(crate) fn facts_from(
    backend: Option<Backend>,
    world: usize,
    local_world: usize,
    in_process: bool,
    exchanges: Exchanges,
) -> TransportFacts {
    let probe = (backend == Some(Backend::Cuda)).then(|| probe::probe(Backend::Cuda));
    TransportFacts {
        world,
        local_world,
        in_process,
        backend: match backend {
            Some(Backend::Cuda) => Ok(()),
            Some(other) => Err(other.to_string()),
            None => Err("a device given to the builder".into()),
        },
        cuda_devices: probe.as_ref().map_or(0, probe::Probe::devices),
        nccl: probe.as_ref().is_some_and(|p| p.collectives),
        exchanges,
        shared_device: false,
    }
}

/// The implementation of the tensor interface `group`'s rank uses under `preference` (for sharded training's
/// exchanges when `sharded`, else for data parallelism's), and why. Ranks on CUDA agree first (one small
/// collective), so that every rank takes the same path even when a library loads on some machines only; a
/// device transport that cannot connect falls back to host memory under `auto` (every rank learns of the
/// failure together) and is an error under `device`.
///
/// # Errors
/// `preference` is `device` and the device path is not available, or fails to connect.
pub(crate) fn select_transport(
    group: &Arc<ProcessGroup>,
    preference: crate::config::GradientTransport,
    timeout: std::time::Duration,
    exchanges: Exchanges,
) -> Result<(Arc<dyn TensorComm>, TransportChoice)> {
    let facts = facts_for(group, exchanges)?;
    let mut local = choose(preference, &facts);
    if facts.backend.is_ok() && facts.world > 1 {
        // Every rank reaches this exchange, even one whose own choice failed, so none is left waiting.
        let on_device = matches!(&local, Ok(c) if c.kind.on_device());
        let anyone_not = collectives::any_rank(group, "gradient transport choice", !on_device)?;
        if anyone_not && on_device {
            let reason = "another rank cannot use the device path".to_string();
            local = match preference {
                crate::config::GradientTransport::Device => Err(Error::config(
                    "gradient_transport",
                    "device",
                    "configuration",
                    format!("auto or host: {reason}"),
                )),
                _ => Ok(TransportChoice {
                    kind: TransportKind::Host,
                    reason,
                }),
            };
        }
    }
    let choice = local?;
    let host = |choice: TransportChoice| -> (Arc<dyn TensorComm>, TransportChoice) {
        (Arc::new(Checked::host(group.clone())), choice)
    };
    if choice.kind == TransportKind::Host {
        return Ok(host(choice));
    }
    // A rank whose device transport cannot start stops (or moves to host memory) every rank with it.
    match group.agree(
        "gradient transport start",
        start_device(choice.kind, group, timeout),
    ) {
        Ok(transport) => Ok((transport, choice)),
        Err(e) if preference != crate::config::GradientTransport::Device => {
            crate::notice::warn_visibly(&format!(
                "{} could not start ({e}); gradients go through host memory",
                choice.kind.name()
            ));
            Ok(host(TransportChoice {
                kind: TransportKind::Host,
                reason: format!("{} failed to start: {e}", choice.kind.name()),
            }))
        }
        Err(e) => Err(e),
    }
}

/// The transport a multi-rank run of `config` would use on this machine, and why: what `burn-accelerate env`
/// prints. The ranks are the launcher's (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`, ...) when this process was started by
/// one, else 2 in-process ranks.
pub fn describe(config: &AcceleratorConfig) -> String {
    match described_choice(config) {
        Ok((choice, ranks)) => format!("{choice}, for {ranks}"),
        Err(e) => e,
    }
}

/// Where each call of the tensor interface goes (`device` or `host`, with how) on the path [`describe`] names:
/// `(call, path)` pairs, empty when no path can be chosen.
pub fn describe_per_call(config: &AcceleratorConfig) -> Vec<(&'static str, &'static str)> {
    described_choice(config)
        .map(|(choice, _)| choice.kind.per_call())
        .unwrap_or_default()
}

/// The choice [`describe`] reports and the ranks it is for, or what stops it, in words.
fn described_choice(
    config: &AcceleratorConfig,
) -> std::result::Result<(TransportChoice, String), String> {
    let vars = crate::distributed::cluster::LauncherVars::read_lenient();
    let in_process = vars.launcher.is_none();
    let world = vars.world_size.unwrap_or(2).max(2);
    let local_world = if in_process {
        world
    } else {
        vars.local_world_size.unwrap_or(world)
    };
    let request = crate::backend::DeviceRequest {
        cpu: config.device.cpu,
        ..Default::default()
    };
    let (first, backend) = crate::backend::select_device(&request, 0)
        .map_err(|_| "none: no compiled backend can run on this machine".to_string())?;
    // In-process ranks take their devices from the request, rank by rank: one device for all, or several.
    let shared_device = in_process
        && (1..world).all(|rank| {
            crate::backend::select_device(&request, rank).is_ok_and(|(device, _)| device == first)
        });
    let facts = TransportFacts {
        shared_device,
        ..facts_from(
            backend,
            world,
            local_world,
            in_process,
            if config.pipeline.pp_size > 1 {
                Exchanges::Messages
            } else if config.distributed.sharding.is_sharded() {
                Exchanges::Shards
            } else {
                Exchanges::Gradients
            },
        )
    };
    let ranks = if in_process {
        format!("{world} in-process ranks")
    } else {
        format!("{world} processes, {local_world} on this machine")
    };
    choose(config.distributed.gradient_transport, &facts)
        .map(|choice| (choice, ranks))
        .map_err(|e| format!("refused: {e}"))
}

/// Makes a device engine for a rank's group (a one-rank NCCL communicator, in the check).
pub(crate) type EngineFactory =
    Arc<dyn Fn(&Arc<ProcessGroup>) -> Result<Box<dyn DeviceEngine>> + Send + Sync>;

/// Starts the device transport `kind` on `group`'s rank.
#[cfg(feature = "cuda-bare")]
pub(crate) fn start_device(
    kind: TransportKind,
    group: &Arc<ProcessGroup>,
    timeout: std::time::Duration,
) -> Result<Arc<dyn TensorComm>> {
    Ok(match kind {
        TransportKind::Nccl => OnDevice::checked(
            Box::new(device::DeviceCollectives::connect(
                group.clone(),
                &nccl::Nccl::new(group.device()),
                timeout,
            )?),
            group,
        ),
        TransportKind::BurnCollective => OnDevice::checked(
            Box::new(burn_collective::BurnCollective::new(
                group.clone(),
                timeout,
            )?),
            group,
        ),
        TransportKind::SharedDevice => shared(group),
        TransportKind::Host => Arc::new(Checked::host(group.clone())),
    })
}

/// Engines on one-rank NCCL communicators, one per group asked (the one-rank check's sharded trainings).
#[cfg(feature = "cuda-bare")]
pub(crate) fn nccl_engines(timeout: std::time::Duration) -> Result<EngineFactory> {
    Ok(Arc::new(move |group: &Arc<ProcessGroup>| {
        let engine = device::DeviceCollectives::connect(
            group.clone(),
            &nccl::Nccl::new(group.device()),
            timeout,
        )?;
        Ok(Box::new(engine) as Box<dyn DeviceEngine>)
    }))
}

/// One of the GPU kit's checks of NCCL's communicator lifecycle (`Accelerator::check_nccl_lifecycle`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifecycleCheck {
    /// `split` or `failing-group`.
    pub name: &'static str,
    /// Whether NCCL behaved as the transport expects.
    pub passed: bool,
    /// What the check saw.
    pub seen: String,
}

/// The GPU kit's checks of NCCL's communicator lifecycle (see `nccl::lifecycle_check`): `None` where this rank's
/// device is not a CUDA device, or in a build without CUDA.
///
/// # Errors
/// NCCL cannot make a communicator on this rank's device.
pub(crate) fn nccl_lifecycle_check(
    group: &Arc<ProcessGroup>,
    timeout: std::time::Duration,
) -> Result<Option<Vec<LifecycleCheck>>> {
    #[cfg(feature = "cuda-bare")]
    if nccl::cuda_ordinal(group.device()).is_some() {
        return nccl::lifecycle_check(group, timeout).map(Some);
    }
    let _ = (group, timeout);
    Ok(None)
}

/// Without CUDA there is no NCCL to check.
#[cfg(not(feature = "cuda-bare"))]
pub(crate) fn nccl_engines(_timeout: std::time::Duration) -> Result<EngineFactory> {
    Err(Error::InvalidArgument(
        "NCCL needs the `cuda` feature of burn-accelerate".into(),
    ))
}

/// The shared-device implementation for `group`'s rank, checked.
fn shared(group: &Arc<ProcessGroup>) -> Arc<dyn TensorComm> {
    Arc::new(Checked::new(
        Arc::new(shared_device::SharedDevice::new(group.clone())),
        group.clone(),
    ))
}

/// Without CUDA the one device transport is the shared device's ([`choose`] picks no other: no rank runs on
/// CUDA).
#[cfg(not(feature = "cuda-bare"))]
pub(crate) fn start_device(
    kind: TransportKind,
    group: &Arc<ProcessGroup>,
    _timeout: std::time::Duration,
) -> Result<Arc<dyn TensorComm>> {
    if kind == TransportKind::SharedDevice {
        return Ok(shared(group));
    }
    Err(Error::InvalidArgument(format!(
        "{} needs the `cuda` feature of burn-accelerate",
        kind.name()
    )))
}
