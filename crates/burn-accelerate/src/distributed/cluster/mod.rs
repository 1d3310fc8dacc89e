//! Who this process is in the run: the cluster-environment seam (Lightning Fabric's `ClusterEnvironment`).
//!
//! A [`ClusterEnvironment`] answers how the run was started: its world size, this rank's global and local
//! index, and the [`Communicator`] that connects the ranks. There is one implementation per way of starting:
//! [`SingleProcess`] (one rank), [`InProcess`] (one thread per rank, `launch`), and `Mpi` (feature `mpi`,
//! processes started by `mpirun`). [`detect`] picks the right one from the launcher's environment, which is
//! read only in [`env_vars`].
//!
//! Pass your own environment to [`AcceleratorBuilder::build_in`](crate::AcceleratorBuilder::build_in) to run on
//! a communicator of your own (a test double, or an engine this crate does not ship).

pub mod env_vars;

use std::sync::Arc;

use crate::config::AcceleratorConfig;
use crate::distributed::comm::{self, Communicator};
use crate::error::Result;

pub use env_vars::{LauncherVars, launched_by_mpi};

/// How the ranks of a run were started and how they talk.
pub trait ClusterEnvironment: std::fmt::Debug {
    /// A short name for messages (`single`, `in-process`, `mpi`).
    fn name(&self) -> &'static str;

    /// The communicator of this rank.
    fn communicator(&self) -> Arc<dyn Communicator>;

    /// The number of ranks.
    fn world_size(&self) -> usize {
        self.communicator().world_size()
    }

    /// This rank's global index, `0..world_size()`.
    fn global_rank(&self) -> usize {
        self.communicator().rank()
    }

    /// This rank's index on its machine (picks the device when a machine has several).
    fn local_rank(&self) -> usize;
}

/// A run with one process and one rank.
#[derive(Debug, Default)]
pub struct SingleProcess;

impl ClusterEnvironment for SingleProcess {
    fn name(&self) -> &'static str {
        "single"
    }
    fn communicator(&self) -> Arc<dyn Communicator> {
        Arc::new(comm::SingleProcess)
    }
    fn local_rank(&self) -> usize {
        0
    }
}

/// One rank of a run whose ranks are threads of this process (what [`launch`](crate::launch) creates). All
/// ranks are on this machine, so the local rank is the global rank.
#[derive(Debug, Clone)]
pub struct InProcess {
    comm: Arc<dyn Communicator>,
}

impl InProcess {
    /// The rank `comm` speaks for (usually an [`InProcessComm`](crate::distributed::comm::InProcessComm), possibly wrapped).
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm }
    }
}

impl ClusterEnvironment for InProcess {
    fn name(&self) -> &'static str {
        "in-process"
    }
    fn communicator(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }
    fn local_rank(&self) -> usize {
        self.comm.rank()
    }
}

/// One process of a run started by an MPI launcher (feature `mpi`).
#[cfg(feature = "mpi")]
#[derive(Debug, Clone)]
pub struct Mpi {
    comm: Arc<burn_accelerate_mpi::MpiComm>,
    local_rank: usize,
}

#[cfg(feature = "mpi")]
impl Mpi {
    /// Joins the MPI job (MPI is initialised once per process; later calls share the communicator).
    ///
    /// # Errors
    /// MPI fails to initialise, or offers too little thread support.
    pub fn init(config: &AcceleratorConfig, vars: &LauncherVars) -> Result<Self> {
        use std::sync::OnceLock;
        static MPI: OnceLock<Arc<burn_accelerate_mpi::MpiComm>> = OnceLock::new();
        let comm = match MPI.get() {
            Some(comm) => comm.clone(),
            None => {
                let comm = Arc::new(burn_accelerate_mpi::MpiComm::init(
                    config.collective_timeout(),
                )?);
                MPI.get_or_init(|| comm).clone()
            }
        };
        let local_rank = vars.local_rank.unwrap_or_else(|| comm.rank());
        Ok(Self { comm, local_rank })
    }
}

#[cfg(feature = "mpi")]
impl ClusterEnvironment for Mpi {
    fn name(&self) -> &'static str {
        "mpi"
    }
    fn communicator(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
}

/// The environment of this process: MPI when built with the `mpi` feature and started by an MPI launcher,
/// else a single process (with a warning when an MPI launcher started a build without the `mpi` feature).
///
/// # Errors
/// A malformed launcher variable, or MPI failing to initialise.
pub fn detect(config: &AcceleratorConfig) -> Result<Box<dyn ClusterEnvironment>> {
    let vars = LauncherVars::read()?;
    #[cfg(feature = "mpi")]
    if vars.mpi {
        return Ok(Box::new(Mpi::init(config, &vars)?));
    }
    let _ = config;
    let launched_world = vars.world_size.unwrap_or(1);
    if launched_world > 1 && !cfg!(feature = "mpi") {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            log::warn!(
                "started by an MPI launcher with {launched_world} processes, but burn-accelerate was built without \
                 its `mpi` feature: every process runs alone. Rebuild with `--features burn-accelerate/mpi`."
            )
        });
    }
    Ok(Box::new(SingleProcess))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::comm::InProcessGroup;
    use std::time::Duration;

    #[test]
    fn environments_report_rank_world_and_local_rank() {
        let single = SingleProcess;
        assert_eq!(
            (
                single.world_size(),
                single.global_rank(),
                single.local_rank()
            ),
            (1, 0, 0)
        );
        let group = InProcessGroup::new(3, Duration::from_secs(1));
        let rank2 = InProcess::new(Arc::new(group.comm(2)));
        assert_eq!(
            (rank2.world_size(), rank2.global_rank(), rank2.local_rank()),
            (3, 2, 2)
        );
        assert_eq!(rank2.name(), "in-process");
    }
}
