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
mod group;
mod in_process;

use std::sync::Arc;

use crate::config::AcceleratorConfig;
use crate::distributed::comm::{self, Communicator};
use crate::error::{Error, Result};

pub use env_vars::{Launcher, LauncherVars, launched_by_mpi};
pub use group::{DistributedType, ProcessGroup, current, current_rank};
pub(crate) use in_process::{launch_ranks, launch_ranks_over};

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
/// else a single process.
///
/// # Errors
/// A malformed launcher variable, or MPI failing to initialise; launcher variables that say this process is one
/// of several that it cannot join (a build without the `mpi` feature under `mpirun`, SLURM tasks without an MPI
/// plugin, torchrun-style variables), unless `independent_processes` lets it run alone (then it says so on
/// standard error, logger or not).
pub fn detect(config: &AcceleratorConfig) -> Result<Box<dyn ClusterEnvironment>> {
    let vars = LauncherVars::read()?;
    #[cfg(feature = "mpi")]
    if vars.mpi {
        return Ok(Box::new(Mpi::init(config, &vars)?));
    }
    if let Some(why) = alone_warning(&vars, cfg!(feature = "mpi")) {
        if !config.distributed.independent_processes {
            return Err(Error::InvalidArgument(format!(
                "this process is one of several a launcher started, and cannot join them: {why} Each would train \
                 alone, on the same data, writing the same files. To run them as independent jobs on purpose, set \
                 ACCELERATE_INDEPENDENT_PROCESSES=1 (AcceleratorBuilder::independent_processes)."
            )));
        }
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            crate::notice::warn_visibly(&format!(
                "{why} Running as an independent job (independent_processes)."
            ))
        });
    }
    Ok(Box::new(SingleProcess))
}

/// Why this process, one of several a launcher started, would train alone (`None` when it would not).
fn alone_warning(vars: &LauncherVars, mpi_built: bool) -> Option<String> {
    let world = vars.world_size.filter(|&w| w > 1)?;
    let launcher = vars.launcher?;
    Some(match launcher {
        _ if launcher.is_mpi() && !mpi_built => format!(
            "started by {launcher} with {world} processes, but burn-accelerate was built without its `mpi` feature: \
             every process runs alone. Rebuild with `--features burn-accelerate/mpi`."
        ),
        Launcher::Slurm => format!(
            "started by SLURM as one of {world} tasks without an MPI plugin: every task runs alone. Start the tasks \
             with `srun --mpi=pmix <program>` (a build with the `mpi` feature), or run `burn-accelerate launch` \
             once per allocation."
        ),
        Launcher::Torchrun => format!(
            "torchrun-style variables say {world} processes, but burn-accelerate's processes meet through MPI: \
             every process runs alone. Start them with `burn-accelerate launch --num-processes {world}` or \
             `mpirun -np {world}` (a build with the `mpi` feature)."
        ),
        _ => return None,
    })
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

    #[test]
    fn several_processes_that_would_train_alone_are_told_how_to_meet() {
        let with = |launcher, world| LauncherVars {
            launcher: Some(launcher),
            world_size: Some(world),
            mpi: Launcher::is_mpi(launcher),
            ..LauncherVars::default()
        };
        let slurm = alone_warning(&with(Launcher::Slurm, 4), true).unwrap();
        assert!(slurm.contains("srun --mpi=pmix"), "{slurm}");
        let torchrun = alone_warning(&with(Launcher::Torchrun, 2), true).unwrap();
        assert!(torchrun.contains("launch --num-processes 2"), "{torchrun}");
        let unbuilt = alone_warning(&with(Launcher::OpenMpi, 2), false).unwrap();
        assert!(
            unbuilt.contains("--features burn-accelerate/mpi"),
            "{unbuilt}"
        );
        assert_eq!(alone_warning(&with(Launcher::OpenMpi, 2), true), None);
        assert_eq!(
            alone_warning(&with(Launcher::Slurm, 1), true),
            None,
            "one task"
        );
        assert_eq!(alone_warning(&LauncherVars::default(), true), None);
    }
}
