//! Who this process is: rank, world size, device, and the kind of distributed run.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::distributed::comm::Communicator;

/// The kind of run, with Accelerate's names so config files are shared between both tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DistributedType {
    /// One process, one device.
    No,
    /// Several CPU ranks.
    MultiCpu,
    /// Several GPU ranks.
    MultiGpu,
    /// Several ranks that shard the training state ([`ShardingStrategy`](crate::ShardingStrategy) other than
    /// `NoShard`), on any device.
    Fsdp,
}

impl DistributedType {
    /// Accelerate's name for it: `NO`, `MULTI_CPU`, `MULTI_GPU` or `FSDP`.
    pub fn as_str(self) -> &'static str {
        match self {
            DistributedType::No => "NO",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::Fsdp => "FSDP",
        }
    }

    /// The type of a run with `world_size` ranks on `backend`, from the backend alone (a LibTorch run counts
    /// as GPU; [`for_device`](Self::for_device) looks at the device).
    pub fn for_run(world_size: usize, backend: Option<Backend>) -> Self {
        Self::for_device(world_size, backend.is_some_and(Backend::is_cpu))
    }

    /// The type of a run with `world_size` ranks whose devices are CPUs (`on_cpu`) or accelerators.
    pub fn for_device(world_size: usize, on_cpu: bool) -> Self {
        match (world_size, on_cpu) {
            (0 | 1, _) => DistributedType::No,
            (_, true) => DistributedType::MultiCpu,
            (_, false) => DistributedType::MultiGpu,
        }
    }
}

impl fmt::Display for DistributedType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The identity of one rank: what Accelerate keeps in `PartialState`, held per rank instead of per process so
/// that several ranks can live in one process as threads.
#[derive(Debug, Clone)]
pub struct ProcessGroup {
    process_index: usize,
    local_process_index: usize,
    num_processes: usize,
    device: Device,
    backend: Option<Backend>,
    distributed_type: DistributedType,
    comm: Arc<dyn Communicator>,
    host_values: crate::distributed::comm::HostValues,
    debug: bool,
}

impl ProcessGroup {
    /// A state for `comm`'s rank on `device`. `local_process_index` is the rank on this machine. The
    /// communicator's calls are recorded ([`Recorded`](crate::distributed::comm::Recorded)): an error of any of
    /// them carries this rank's last collective calls.
    pub fn new(
        comm: Arc<dyn Communicator>,
        local_process_index: usize,
        device: Device,
        backend: Option<Backend>,
    ) -> Self {
        let (comm, host_values) = crate::distributed::comm::Recorded::wrap_counted(comm);
        let num_processes = comm.world_size();
        Self {
            process_index: comm.rank(),
            local_process_index,
            num_processes,
            distributed_type: DistributedType::for_device(
                num_processes,
                crate::backend::runs_on_cpu(backend, &device),
            ),
            device,
            backend,
            comm,
            host_values,
            debug: false,
        }
    }

    /// Turns debug mode (shape checks before every collective) on or off.
    pub fn with_debug(mut self, debug: bool) -> Self {
        self.debug = debug;
        self
    }

    /// Whether collectives check operations and shapes across ranks first.
    pub fn debug(&self) -> bool {
        self.debug
    }

    /// The global rank.
    pub fn process_index(&self) -> usize {
        self.process_index
    }
    /// The rank on this machine.
    pub fn local_process_index(&self) -> usize {
        self.local_process_index
    }
    /// The number of ranks.
    pub fn num_processes(&self) -> usize {
        self.num_processes
    }
    /// The device of this rank (autodiff enabled).
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The backend of the device, when it was chosen by name.
    pub fn backend(&self) -> Option<Backend> {
        self.backend
    }
    /// The kind of run.
    pub fn distributed_type(&self) -> DistributedType {
        self.distributed_type
    }
    /// Whether this is global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.process_index == 0
    }
    /// Whether this is rank 0 on its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_process_index == 0
    }
    /// Whether this is the last rank.
    pub fn is_last_process(&self) -> bool {
        self.process_index + 1 == self.num_processes
    }
    /// The communicator of this rank.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// How many values (tensor elements) this rank's collectives and messages have passed through host memory
    /// since it started, its sub-groups' included: 0 where every exchange stays on the device.
    pub fn host_values(&self) -> u64 {
        self.host_values.get()
    }
    /// Makes this the state that logging on the current thread reports.
    /// The sub-group of the ranks that pass the same `color`, ordered by `key` (then rank): every rank calls it.
    /// It keeps this rank's device, backend and debug mode; its collectives have their own sequence.
    pub(crate) fn split(&self, color: usize, key: usize) -> crate::error::Result<Self> {
        let comm = self.comm.split(color, key)?;
        Ok(Self {
            process_index: comm.rank(),
            local_process_index: self.local_process_index,
            num_processes: comm.world_size(),
            device: self.device.clone(),
            backend: self.backend,
            distributed_type: self.distributed_type,
            comm,
            host_values: self.host_values.clone(),
            debug: self.debug,
        })
    }

    /// The processes on this machine: every rank for in-process ranks, else what the launcher says (the whole
    /// group when it says nothing).
    pub(crate) fn local_world_size(&self) -> usize {
        let world = self.num_processes;
        if self.comm.engine() == crate::distributed::comm::IN_PROCESS_ENGINE {
            return world;
        }
        crate::distributed::cluster::LauncherVars::read_lenient()
            .local_world_size
            .unwrap_or(world)
    }

    pub(crate) fn install_for_thread(self: &Arc<Self>) {
        CURRENT.with(|c| *c.borrow_mut() = Some(self.clone()));
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<ProcessGroup>>> = const { RefCell::new(None) };
}

/// The state of the rank running on this thread, if an [`Accelerator`](crate::Accelerator) was created on it.
pub fn current() -> Option<Arc<ProcessGroup>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// The global rank of this thread: the installed state's, else the launcher's environment (`RANK`,
/// `OMPI_COMM_WORLD_RANK`, `PMI_RANK`), else 0. Never fails.
pub fn current_rank() -> usize {
    current()
        .map(|s| s.process_index())
        .or_else(|| crate::distributed::cluster::LauncherVars::read_lenient().rank)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributed_type_names_match_accelerate() {
        assert_eq!(DistributedType::No.as_str(), "NO");
        let yaml_like = serde_json::to_string(&DistributedType::MultiCpu).unwrap();
        assert_eq!(yaml_like, "\"MULTI_CPU\"");
        assert_eq!(
            DistributedType::for_run(1, Some(Backend::Cuda)),
            DistributedType::No
        );
        assert_eq!(
            DistributedType::for_run(2, Some(Backend::Flex)),
            DistributedType::MultiCpu
        );
        assert_eq!(
            DistributedType::for_device(2, true),
            DistributedType::MultiCpu
        );
        assert_eq!(
            DistributedType::for_run(2, Some(Backend::Cuda)),
            DistributedType::MultiGpu
        );
    }
}
