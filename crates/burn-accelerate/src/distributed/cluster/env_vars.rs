//! The variables process launchers set (`mpirun`, `mpiexec`, `srun --mpi`, `torchrun`-style `RANK`): the only
//! place where burn-accelerate reads them.

use crate::config::env;
use crate::error::Result;

/// Variables that carry the global rank, in the order they are read.
const RANK_VARS: &[&str] = &["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"];
/// Variables that carry the number of processes, in the order they are read.
const WORLD_SIZE_VARS: &[&str] = &["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"];
/// Variables that carry the rank on this machine, in the order they are read.
const LOCAL_RANK_VARS: &[&str] = &[
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
];
/// Variables whose presence means an MPI launcher started this process.
const MPI_MARKERS: &[&str] = &[
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
];

/// What the launcher of this process said about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LauncherVars {
    /// The global rank, if a launcher set one.
    pub rank: Option<usize>,
    /// The number of processes, if a launcher set it.
    pub world_size: Option<usize>,
    /// The rank on this machine, if a launcher set it.
    pub local_rank: Option<usize>,
    /// Whether an MPI launcher started this process.
    pub mpi: bool,
}

impl LauncherVars {
    /// Reads the environment of this process.
    ///
    /// # Errors
    /// A rank or size variable that is set but is not a non-negative integer (the error names it).
    pub fn read() -> Result<Self> {
        Ok(Self {
            rank: env::first_usize(RANK_VARS)?,
            world_size: env::first_usize(WORLD_SIZE_VARS)?,
            local_rank: env::first_usize(LOCAL_RANK_VARS)?,
            mpi: MPI_MARKERS.iter().any(|k| std::env::var_os(k).is_some()),
        })
    }

    /// [`read`](Self::read), with unreadable values treated as unset (for logging, which must never fail).
    pub fn read_lenient() -> Self {
        let ok = |keys: &[&str]| env::first_usize(keys).ok().flatten();
        Self {
            rank: ok(RANK_VARS),
            world_size: ok(WORLD_SIZE_VARS),
            local_rank: ok(LOCAL_RANK_VARS),
            mpi: MPI_MARKERS.iter().any(|k| std::env::var_os(k).is_some()),
        }
    }
}

/// Whether this process was started by an MPI launcher (`mpirun`, `mpiexec`, `srun --mpi`).
pub fn launched_by_mpi() -> bool {
    LauncherVars::read_lenient().mpi
}
