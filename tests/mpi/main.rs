//! The tests under `mpirun` (feature `mpi`; needs Open MPI's `mpirun`), in one binary: the collectives suite and
//! the launcher across processes, parity of real processes against one, the fault matrix, and restarts.

#[path = "../support/isolation.rs"]
mod isolation;

#[path = "../support/examples.rs"]
mod examples;
#[path = "../support/parity.rs"]
mod parity;
#[path = "../../examples/support/scenarios.rs"]
mod scenarios;

mod mpi;
mod parity_mpi;
mod faults_mpi;
mod restarts_mpi;
mod tensor_parallel_mpi;
mod context_parallel_mpi;

// Every public path under the `mpi` and `train` features too (the suite builds it with the default ones).
#[path = "../suite/public_paths.rs"]
mod public_paths;
