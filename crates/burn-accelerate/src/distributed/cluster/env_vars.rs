//! The variables process launchers set (`mpirun`, `mpiexec`, `srun`, PMIx launchers, `torchrun`-style
//! `RANK`/`WORLD_SIZE`): the only place where burn-accelerate reads them.

use std::fmt;

use crate::config::env;
use crate::error::{Error, Result};

/// The launcher that started this process, told apart by the variables it sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun` / `mpiexec` (`OMPI_COMM_WORLD_*`), which `burn-accelerate launch` runs.
    OpenMpi,
    /// A PMIx launcher (`PMIX_RANK`): `srun --mpi=pmix`, `prterun`.
    Pmix,
    /// A PMI-1/PMI-2 launcher (`PMI_RANK`, `PMI_SIZE`): MPICH's and Intel MPI's `mpiexec`, `srun --mpi=pmi2`.
    Pmi,
    /// MVAPICH's launcher (`MV2_COMM_WORLD_*`).
    Mvapich,
    /// SLURM's `srun` without an MPI plugin, or a batch script (`SLURM_PROCID`, `SLURM_NTASKS`).
    Slurm,
    /// `torchrun`-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`).
    Torchrun,
}

impl Launcher {
    /// Whether the processes it starts can meet through MPI (then the `mpi` feature connects them).
    pub fn is_mpi(self) -> bool {
        matches!(
            self,
            Launcher::OpenMpi | Launcher::Pmix | Launcher::Pmi | Launcher::Mvapich
        )
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::OpenMpi => "Open MPI (mpirun)",
            Launcher::Pmix => "PMIx (srun --mpi=pmix, prterun)",
            Launcher::Pmi => "PMI (mpiexec, srun --mpi=pmi2)",
            Launcher::Mvapich => "MVAPICH",
            Launcher::Slurm => "SLURM (srun without an MPI plugin)",
            Launcher::Torchrun => "torchrun-style variables",
        })
    }
}

/// Which variables carry what, for one launcher, each list read in order.
struct Spec {
    launcher: Launcher,
    /// Variables whose presence means this launcher started the process.
    markers: &'static [&'static str],
    rank: &'static [&'static str],
    world_size: &'static [&'static str],
    local_rank: &'static [&'static str],
    local_world_size: &'static [&'static str],
    machine_rank: &'static [&'static str],
    num_machines: &'static [&'static str],
}

/// SLURM's own variables, which `srun` sets beside an MPI plugin's.
const SLURM_NODE: &[&str] = &["SLURM_NODEID"];
const SLURM_NODES: &[&str] = &["SLURM_JOB_NUM_NODES", "SLURM_NNODES"];

/// The launchers, highest precedence first (an MPI launcher inside a SLURM allocation is the MPI launcher).
const SPECS: &[Spec] = &[
    Spec {
        launcher: Launcher::OpenMpi,
        markers: &["OMPI_COMM_WORLD_SIZE"],
        rank: &["OMPI_COMM_WORLD_RANK"],
        world_size: &["OMPI_COMM_WORLD_SIZE"],
        local_rank: &["OMPI_COMM_WORLD_LOCAL_RANK"],
        local_world_size: &["OMPI_COMM_WORLD_LOCAL_SIZE"],
        machine_rank: &["OMPI_COMM_WORLD_NODE_RANK", "SLURM_NODEID"],
        num_machines: SLURM_NODES,
    },
    Spec {
        launcher: Launcher::Pmix,
        markers: &["PMIX_RANK"],
        rank: &["PMIX_RANK"],
        world_size: &["SLURM_NTASKS", "PMIX_SIZE"],
        local_rank: &["SLURM_LOCALID", "PMIX_LOCAL_RANK"],
        local_world_size: &["PMIX_LOCAL_SIZE"],
        machine_rank: SLURM_NODE,
        num_machines: SLURM_NODES,
    },
    Spec {
        launcher: Launcher::Pmi,
        markers: &["PMI_SIZE", "PMI_RANK"],
        rank: &["PMI_RANK"],
        world_size: &["PMI_SIZE"],
        local_rank: &["MPI_LOCALRANKID", "SLURM_LOCALID"],
        local_world_size: &["MPI_LOCALNRANKS"],
        machine_rank: SLURM_NODE,
        num_machines: SLURM_NODES,
    },
    Spec {
        launcher: Launcher::Mvapich,
        markers: &["MV2_COMM_WORLD_SIZE"],
        rank: &["MV2_COMM_WORLD_RANK"],
        world_size: &["MV2_COMM_WORLD_SIZE"],
        local_rank: &["MV2_COMM_WORLD_LOCAL_RANK"],
        local_world_size: &["MV2_COMM_WORLD_LOCAL_SIZE"],
        machine_rank: SLURM_NODE,
        num_machines: SLURM_NODES,
    },
    Spec {
        launcher: Launcher::Slurm,
        markers: &["SLURM_PROCID"],
        rank: &["SLURM_PROCID"],
        world_size: &["SLURM_NTASKS"],
        local_rank: &["SLURM_LOCALID"],
        local_world_size: &[],
        machine_rank: SLURM_NODE,
        num_machines: SLURM_NODES,
    },
    Spec {
        launcher: Launcher::Torchrun,
        markers: &["WORLD_SIZE", "RANK"],
        rank: &["RANK"],
        world_size: &["WORLD_SIZE"],
        local_rank: &["LOCAL_RANK"],
        local_world_size: &["LOCAL_WORLD_SIZE"],
        machine_rank: &["GROUP_RANK"],
        num_machines: &[],
    },
];

/// What the launcher of this process said about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LauncherVars {
    /// The launcher found, if any.
    pub launcher: Option<Launcher>,
    /// The global rank, if a launcher set one.
    pub rank: Option<usize>,
    /// The number of processes, if a launcher set it.
    pub world_size: Option<usize>,
    /// The rank on this machine, if a launcher set it.
    pub local_rank: Option<usize>,
    /// The number of processes on this machine, if a launcher set it.
    pub local_world_size: Option<usize>,
    /// This machine's index among the job's machines, if a launcher set it.
    pub machine_rank: Option<usize>,
    /// The number of machines, if a launcher set it.
    pub num_machines: Option<usize>,
    /// Whether an MPI launcher started this process.
    pub mpi: bool,
}

impl LauncherVars {
    /// Reads the environment of this process.
    ///
    /// # Errors
    /// A rank or size variable that is set but is not a non-negative integer (the error names it).
    pub fn read() -> Result<Self> {
        Self::from_lookup(env::var)
    }

    /// [`read`](Self::read), with unreadable values treated as unset (for logging, which must never fail).
    pub fn read_lenient() -> Self {
        Self::from_lookup_lenient(env::var)
    }

    /// The variables `lookup` returns (a name to its non-empty value), as [`read`](Self::read) reads the
    /// environment.
    ///
    /// ```
    /// use burn_accelerate::distributed::cluster::{Launcher, LauncherVars};
    ///
    /// let srun = |name: &str| match name {
    ///     "SLURM_PROCID" => Some("5".to_string()),
    ///     "SLURM_NTASKS" => Some("8".to_string()),
    ///     "SLURM_LOCALID" => Some("1".to_string()),
    ///     "SLURM_NODEID" => Some("2".to_string()),
    ///     "SLURM_JOB_NUM_NODES" => Some("4".to_string()),
    ///     _ => None,
    /// };
    /// let vars = LauncherVars::from_lookup(srun)?;
    /// assert_eq!(vars.launcher, Some(Launcher::Slurm));
    /// assert_eq!((vars.rank, vars.world_size, vars.local_rank), (Some(5), Some(8), Some(1)));
    /// assert_eq!((vars.machine_rank, vars.num_machines, vars.mpi), (Some(2), Some(4), false));
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`read`](Self::read).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::assemble(&lookup, |keys| first_usize(&lookup, keys))
    }

    fn from_lookup_lenient(lookup: impl Fn(&str) -> Option<String>) -> Self {
        Self::assemble(&lookup, |keys| {
            Ok(first_usize(&lookup, keys).ok().flatten())
        })
        .unwrap_or_default()
    }

    /// The variables of the launcher `lookup` finds, each read by `first` (strict or lenient).
    fn assemble(
        lookup: &impl Fn(&str) -> Option<String>,
        first: impl Fn(&[&str]) -> Result<Option<usize>>,
    ) -> Result<Self> {
        let Some(spec) = detect_spec(lookup) else {
            return Ok(Self::default());
        };
        Ok(Self {
            launcher: Some(spec.launcher),
            rank: first(spec.rank)?,
            world_size: first(spec.world_size)?,
            local_rank: first(spec.local_rank)?,
            local_world_size: first(spec.local_world_size)?,
            machine_rank: first(spec.machine_rank)?,
            num_machines: first(spec.num_machines)?,
            mpi: spec.launcher.is_mpi(),
        })
    }

    /// One line for `burn-accelerate env` and start-up messages, e.g. `SLURM (srun without an MPI plugin):
    /// rank 5 of 8, local rank 1, machine 2 of 4`.
    pub fn describe(&self) -> String {
        let Some(launcher) = self.launcher else {
            return "none (a single process, or in-process ranks)".into();
        };
        let known = |v: Option<usize>| v.map_or("?".to_string(), |v| v.to_string());
        let mut line = format!(
            "{launcher}: rank {} of {}",
            known(self.rank),
            known(self.world_size)
        );
        if let Some(local) = self.local_rank {
            line.push_str(&format!(", local rank {local}"));
        }
        if let Some(machine) = self.machine_rank {
            line.push_str(&format!(
                ", machine {machine} of {}",
                known(self.num_machines)
            ));
        }
        line
    }
}

/// The launcher whose marker variables `lookup` finds first, in precedence order.
fn detect_spec(lookup: &impl Fn(&str) -> Option<String>) -> Option<&'static Spec> {
    SPECS
        .iter()
        .find(|spec| spec.markers.iter().any(|k| lookup(k).is_some()))
}

/// The first of `keys` that `lookup` finds, as an unsigned integer.
fn first_usize(lookup: &impl Fn(&str) -> Option<String>, keys: &[&str]) -> Result<Option<usize>> {
    for key in keys {
        if let Some(value) = lookup(key) {
            return value
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| Error::config(*key, value, "environment", "a non-negative integer"));
        }
    }
    Ok(None)
}

/// Whether this process was started by an MPI launcher (`mpirun`, `mpiexec`, `srun --mpi`).
pub fn launched_by_mpi() -> bool {
    LauncherVars::read_lenient().mpi
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Result<LauncherVars> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LauncherVars::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn no_launcher_variables_is_no_launcher() {
        let v = vars(&[("HOME", "/root")]).unwrap();
        assert_eq!(v, LauncherVars::default());
        assert!(v.describe().starts_with("none"));
    }

    #[test]
    fn open_mpi_under_mpirun() {
        let v = vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_COMM_WORLD_NODE_RANK", "1"),
        ])
        .unwrap();
        assert_eq!(v.launcher, Some(Launcher::OpenMpi));
        assert!(v.mpi);
        assert_eq!(
            (
                v.rank,
                v.world_size,
                v.local_rank,
                v.local_world_size,
                v.machine_rank
            ),
            (Some(3), Some(4), Some(1), Some(2), Some(1))
        );
    }

    #[test]
    fn srun_with_pmix_takes_its_sizes_from_slurm() {
        let v = vars(&[
            ("PMIX_RANK", "6"),
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_NUM_NODES", "2"),
        ])
        .unwrap();
        assert_eq!(v.launcher, Some(Launcher::Pmix));
        assert!(v.mpi, "srun --mpi=pmix starts MPI processes");
        assert_eq!(
            (
                v.rank,
                v.world_size,
                v.local_rank,
                v.machine_rank,
                v.num_machines
            ),
            (Some(6), Some(8), Some(2), Some(1), Some(2))
        );
        assert_eq!(
            v.describe(),
            "PMIx (srun --mpi=pmix, prterun): rank 6 of 8, local rank 2, machine 1 of 2"
        );
    }

    #[test]
    fn mpich_and_mvapich() {
        let pmi = vars(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
        ])
        .unwrap();
        assert_eq!(pmi.launcher, Some(Launcher::Pmi));
        assert_eq!(
            (pmi.rank, pmi.world_size, pmi.local_rank),
            (Some(1), Some(2), Some(1))
        );
        let mv2 = vars(&[("MV2_COMM_WORLD_RANK", "0"), ("MV2_COMM_WORLD_SIZE", "3")]).unwrap();
        assert_eq!(mv2.launcher, Some(Launcher::Mvapich));
        assert!(pmi.mpi && mv2.mpi);
    }

    #[test]
    fn slurm_without_an_mpi_plugin_is_not_mpi() {
        let v = vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
        ])
        .unwrap();
        assert_eq!(v.launcher, Some(Launcher::Slurm));
        assert!(!v.mpi);
        assert_eq!(v.world_size, Some(4));
    }

    #[test]
    fn torchrun_style_variables() {
        let v = vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
        ])
        .unwrap();
        assert_eq!(v.launcher, Some(Launcher::Torchrun));
        assert!(!v.mpi);
        assert_eq!(
            (
                v.rank,
                v.world_size,
                v.local_rank,
                v.local_world_size,
                v.machine_rank
            ),
            (Some(2), Some(4), Some(0), Some(2), Some(1))
        );
    }

    #[test]
    fn an_mpi_launcher_inside_a_slurm_allocation_is_the_mpi_launcher() {
        let v = vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(v.launcher, Some(Launcher::OpenMpi));
        assert_eq!((v.rank, v.world_size), (Some(1), Some(2)));
    }

    #[test]
    fn a_malformed_value_is_an_error_naming_the_variable() {
        let err = vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "four")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("SLURM_NTASKS") && err.contains("four"),
            "{err}"
        );
        let lenient =
            LauncherVars::from_lookup_lenient(|k| (k == "SLURM_PROCID").then(|| "x".to_string()));
        assert_eq!(lenient.rank, None);
        assert_eq!(lenient.launcher, Some(Launcher::Slurm));
    }
}
