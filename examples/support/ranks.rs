//! Running an example's training on the ranks asked for: `--processes N` in-process ranks, or once as this
//! process's rank when a launcher (`mpirun`, `burn-accelerate launch`) started it.

#![allow(dead_code)]

use burn_accelerate::{Accelerator, AcceleratorBuilder, Result};

/// Whether an MPI launcher started this process (then it is one rank of the job).
pub fn under_launcher() -> bool {
    #[cfg(feature = "mpi")]
    return burn_accelerate::distributed::cluster::launched_by_mpi();
    #[cfg(not(feature = "mpi"))]
    false
}

/// Runs `train` on every rank and returns the main rank's result, or `None` in a process that does not hold
/// the main rank (the other processes of an MPI job): `processes` in-process ranks unless a launcher started
/// this process.
pub fn run_ranks<T, F>(builder: AcceleratorBuilder, processes: usize, train: F) -> Result<Option<T>>
where
    T: Send,
    F: Fn(Accelerator) -> Result<T> + Send + Sync,
{
    if under_launcher() || processes <= 1 {
        let accelerator = builder.build()?;
        let main = accelerator.is_main_process();
        let result = train(accelerator)?;
        Ok(main.then_some(result))
    } else {
        Ok(builder.launch(processes, train)?.into_iter().next())
    }
}

/// Ends the example: on an error, prints it and exits with status 1.
pub fn exit_on_error(result: Result<()>) {
    if let Err(error) = result {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
