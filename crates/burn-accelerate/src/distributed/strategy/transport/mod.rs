//! How flat gradients cross ranks: the gradient-transport seam of data parallelism.
//!
//! A [`GradientTransport`] averages one flat buffer across ranks and broadcasts one from a root. [`HostAllReduce`]
//! copies the buffer to host memory and goes through [`collectives::all_reduce_host`] (so debug mode, call
//! headers and timeouts see every gradient all-reduce); [`DeviceAllReduce`] keeps the buffer on the device
//! (NCCL between processes, Burn's CUDA collective between the devices of one process). [`choose`] picks one
//! from facts every rank gathers ([`TransportFacts`]); bucketing is the strategy's business, not the
//! transport's.

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

pub(crate) use check::check_against_reference;
pub use check::{DtypeCheck, TransportCheck, rounding_bound};
pub(crate) use choice::{TransportChoice, TransportFacts, TransportKind, choose};
#[cfg(test)]
pub(crate) use device::{DeviceAllReduce, double};

use std::fmt;
use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::backend::{Backend, probe};
use crate::config::AcceleratorConfig;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::{ReduceBuffer, ReduceOp};
use crate::error::{Error, Result};

/// Moves flat gradient buffers between ranks.
pub(crate) trait GradientTransport: Send + Sync + fmt::Debug {
    /// A short name for messages and `env` (`host all-reduce`, ...).
    fn name(&self) -> &'static str;

    /// This rank's index in the group the transport connects.
    fn rank(&self) -> usize;

    /// The mean of `flat` over the ranks, times `scale`, in `flat`'s dtype and on its device.
    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>>;

    /// Rank `root`'s `flat` on every rank.
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>>;
}

/// `flat`'s values in host memory, as f32 (half-precision values are widened exactly).
pub(crate) fn to_host(flat: Tensor<1>, operation: &'static str) -> Result<Vec<f32>> {
    let device = flat.device();
    let data = flat.try_into_data().map_err(|e| Error::Execution {
        operation,
        device: format!("{device:?}"),
        reason: e.to_string(),
    })?;
    match data.dtype() {
        DType::F32 => data.try_into_vec::<f32>(),
        _ => data
            .try_cast_as::<f32>()
            .and_then(|d| d.try_into_vec::<f32>()),
    }
    .map_err(|e| Error::InvalidArgument(format!("{operation}: {e}")))
}

/// A flat tensor of `values` in `dtype` on `device`.
pub(crate) fn from_host(
    values: Vec<f32>,
    (device, dtype): (&Device, DType),
    operation: &'static str,
) -> Result<Tensor<1>> {
    let len = values.len();
    let data = TensorData::new(values, [len])
        .try_cast(dtype)
        .map_err(|e| Error::InvalidArgument(format!("{operation}: {e}")))?;
    Ok(Tensor::<1>::from_data(data, (device, dtype)))
}

/// Host copies of the gradients, all-reduced through the rank's communicator.
#[derive(Debug)]
pub(crate) struct HostAllReduce {
    group: Arc<ProcessGroup>,
}

impl HostAllReduce {
    /// The transport of `group`'s rank.
    pub fn new(group: Arc<ProcessGroup>) -> Self {
        Self { group }
    }
}

impl GradientTransport for HostAllReduce {
    fn name(&self) -> &'static str {
        "host all-reduce"
    }

    fn rank(&self) -> usize {
        self.group.process_index()
    }

    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let (device, dtype) = (flat.device(), flat.dtype());
        let host = to_host(flat, "gradient all-reduce")?;
        let len = host.len();
        // Unscaled: the engine's mean. Scaled: the engine's sum, then one pass multiplying by scale / ranks
        // (instead of a division pass and a multiplication pass).
        let op = if scale == 1.0 {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let reduced = collectives::all_reduce_host(
            &self.group,
            "gradient_all_reduce",
            (DType::F32, &[len]),
            ReduceBuffer::F32(host),
            op,
        )?;
        let ReduceBuffer::F32(mut reduced) = reduced else {
            return Err(Error::InvalidArgument(format!(
                "gradient all-reduce: the engine returned {} values",
                reduced.kind()
            )));
        };
        if scale != 1.0 {
            let factor = scale / self.group.num_processes() as f32;
            reduced.iter_mut().for_each(|x| *x *= factor);
        }
        from_host(reduced, (&device, dtype), "gradient all-reduce")
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        collectives::broadcast(&self.group, flat, root)
    }
}

/// The facts the transport choice rests on, for `group`'s rank.
pub(crate) fn facts_for(group: &ProcessGroup, sharded: bool) -> TransportFacts {
    let world = group.num_processes();
    let in_process = group.comm().engine() == crate::distributed::comm::IN_PROCESS_ENGINE;
    let local_world = if in_process {
        world
    } else {
        crate::distributed::cluster::LauncherVars::read_lenient()
            .local_world_size
            .unwrap_or(world)
    };
    facts_from(group.backend(), world, local_world, in_process, sharded)
}

/// [`TransportFacts`] for ranks on `backend`, probing CUDA when that is the backend.
pub(crate) fn facts_from(
    backend: Option<Backend>,
    world: usize,
    local_world: usize,
    in_process: bool,
    sharded: bool,
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
        sharded,
    }
}

/// The gradient transport of `group`'s rank under `preference`, and why. Ranks on CUDA agree first (one small
/// collective), so that every rank takes the same path even when a library loads on some machines only; a
/// device transport that cannot connect falls back to host memory under `auto` (every rank learns of the
/// failure together) and is an error under `device`.
///
/// # Errors
/// `preference` is `device` and the device path is not available, or fails to connect.
pub(crate) fn select(
    group: &Arc<ProcessGroup>,
    preference: crate::config::GradientTransport,
    timeout: std::time::Duration,
) -> Result<(Box<dyn GradientTransport>, TransportChoice)> {
    let facts = facts_for(group, false);
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
    let host = |choice: TransportChoice| -> (Box<dyn GradientTransport>, TransportChoice) {
        (Box::new(HostAllReduce::new(group.clone())), choice)
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
            log::warn!(
                "{} could not start ({e}); gradients go through host memory",
                choice.kind.name()
            );
            Ok(host(TransportChoice {
                kind: TransportKind::Host,
                reason: format!("{} failed to start: {e}", choice.kind.name()),
            }))
        }
        Err(e) => Err(e),
    }
}

/// The gradient transport a multi-rank run of `config` would use on this machine, and why: what
/// `burn-accelerate env` prints. The ranks are the launcher's (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`, ...) when this
/// process was started by one, else 2 in-process ranks.
pub fn describe(config: &AcceleratorConfig) -> String {
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
    let backend = match crate::backend::select_device(&request, 0) {
        Ok((_, backend)) => backend,
        Err(_) => return "none: no compiled backend can run on this machine".into(),
    };
    let facts = facts_from(
        backend,
        world,
        local_world,
        in_process,
        config.distributed.sharding.is_sharded(),
    );
    let ranks = if in_process {
        format!("{world} in-process ranks")
    } else {
        format!("{world} processes, {local_world} on this machine")
    };
    match choose(config.distributed.gradient_transport, &facts) {
        Ok(choice) => format!("{choice}, for {ranks}"),
        Err(e) => format!("refused: {e}"),
    }
}

/// Starts the device transport `kind` on `group`'s rank.
#[cfg(feature = "cuda-bare")]
fn start_device(
    kind: TransportKind,
    group: &Arc<ProcessGroup>,
    timeout: std::time::Duration,
) -> Result<Box<dyn GradientTransport>> {
    Ok(match kind {
        TransportKind::Nccl => Box::new(device::DeviceAllReduce::connect(
            group.clone(),
            &nccl::Nccl::new(group.device()),
            timeout,
        )?),
        TransportKind::BurnCollective => Box::new(burn_collective::BurnCollective::new(
            group.clone(),
            timeout,
        )?),
        TransportKind::Host => Box::new(HostAllReduce::new(group.clone())),
    })
}

/// Without CUDA there is no device transport ([`choose`] never picks one: no rank runs on CUDA).
#[cfg(not(feature = "cuda-bare"))]
fn start_device(
    kind: TransportKind,
    _group: &Arc<ProcessGroup>,
    _timeout: std::time::Duration,
) -> Result<Box<dyn GradientTransport>> {
    Err(Error::InvalidArgument(format!(
        "{} needs the `cuda` feature of burn-accelerate",
        kind.name()
    )))
}
