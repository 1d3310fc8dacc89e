//! # burn-accelerate-mpi
//!
//! The MPI engine of burn-accelerate, on [rsmpi](https://github.com/rsmpi/rsmpi): processes started by `mpirun`
//! (on one machine, or on several with a hostfile) become the ranks of a run. It implements
//! [`burn_accelerate_comm::Communicator`]; burn-accelerate uses it when built with its `mpi` feature and
//! launched by `mpirun` (its `cluster` module tells from the launcher's environment).
//!
//! Every collective is started as an MPI non-blocking operation and polled until it completes or the timeout
//! expires. On a timeout the waiting ranks tell each other which collective they are stuck in, so the error
//! names the ranks that never arrived; the engine is then unusable, and dropping it aborts the MPI job rather
//! than hanging in `MPI_Finalize`. A rank that exits with a non-zero status (an error returned from `main`)
//! aborts the job too (with glibc, whose `on_exit` tells the status), and a rank that dies makes `mpirun` end
//! the job.
//!
//! Debian packages: `libopenmpi-dev openmpi-bin libclang-dev pkg-config`.

#![warn(missing_docs)]

mod engine;

pub use engine::MpiComm;

/// The rsmpi crate this engine is built on, for programs that make MPI calls of their own.
pub use mpi;
