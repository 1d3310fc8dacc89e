//! Communication between ranks.
//!
//! One object-safe [`Communicator`] trait is the seam every engine implements (in-process threads, MPI, later
//! NCCL). A single process uses [`SingleProcess`], whose collectives return at once.

use std::fmt::Debug;

use crate::error::Result;

/// How ranks talk to each other. Implementations must be usable from the rank's own thread.
pub trait Communicator: Send + Sync + Debug {
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    /// How many ranks the group has.
    fn world_size(&self) -> usize;
    /// Blocks until every rank has called `barrier`.
    ///
    /// # Errors
    /// An engine error, or a timeout naming the ranks that did not arrive.
    fn barrier(&self) -> Result<()>;
}

/// The communicator of a run with one process and one device: every collective is immediate.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}
