//! Errors of collectives.

use std::time::Duration;

/// What can go wrong in a collective.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A collective did not complete in time.
    #[error(
        "collective `{operation}` #{seq} on rank {rank} timed out after {timeout:?}: rank(s) {missing:?} did not \
         arrive. Every rank must call the same collectives in the same order; run with ACCELERATE_DEBUG_MODE=1 to \
         check shapes, or raise the timeout (`AcceleratorBuilder::collective_timeout`, \
         ACCELERATE_COLLECTIVE_TIMEOUT=<seconds>) if a rank is only slow"
    )]
    Timeout {
        /// The collective.
        operation: String,
        /// Its sequence number on this rank (0 for the first collective).
        seq: u64,
        /// The rank reporting.
        rank: usize,
        /// Ranks that had not reached it (empty when the engine cannot tell).
        missing: Vec<usize>,
        /// The configured timeout.
        timeout: Duration,
    },

    /// A point-to-point exchange did not complete in time: a receive whose peer never sent.
    #[error(
        "point-to-point `{operation}` on rank {rank} timed out after {timeout:?}: nothing arrived from rank(s) \
         {waiting_for:?}. Every receive needs a matching send on its peer, in the same order; post a pair's sends \
         and receives in one batch (`send_recv`) so that neither waits for the other, or raise the timeout \
         (`AcceleratorBuilder::collective_timeout`, ACCELERATE_COLLECTIVE_TIMEOUT=<seconds>) if a peer is only slow"
    )]
    PeerTimeout {
        /// The exchange.
        operation: String,
        /// The rank reporting.
        rank: usize,
        /// The peers whose messages had not arrived.
        waiting_for: Vec<usize>,
        /// The configured timeout.
        timeout: Duration,
    },

    /// Another rank failed (panicked, returned an error or exited), so this collective cannot complete.
    #[error("collective `{operation}` #{seq} aborted: rank {failed_rank} {reason}")]
    RankFailed {
        /// The collective that was waiting.
        operation: String,
        /// Its sequence number.
        seq: u64,
        /// The rank that failed.
        failed_rank: usize,
        /// What happened to it.
        reason: String,
    },

    /// Ranks called different collectives at the same point.
    #[error(
        "ranks called different collectives at step #{seq}: {calls}. Every rank must call the same collectives \
         in the same order (a collective inside `if accelerator.is_main_process()` is a common cause)"
    )]
    CollectiveMismatch {
        /// The sequence number where they diverged.
        seq: u64,
        /// What each rank called, e.g. `rank 0: all_reduce, rank 1: all_gather`.
        calls: String,
    },

    /// Ranks passed buffers that cannot be combined.
    #[error("`{operation}`: {reason}")]
    IncompatibleInputs {
        /// The collective.
        operation: String,
        /// What differs, per rank.
        reason: String,
    },

    /// A root rank outside the group.
    #[error("`{operation}` from rank {root}, but the group has ranks 0..{world_size}")]
    InvalidRoot {
        /// The collective.
        operation: String,
        /// The root asked for.
        root: usize,
        /// The group's size.
        world_size: usize,
    },

    /// A failed call, with the rank's last collective calls (the flight recorder, [`crate::Recorded`]).
    #[error("{error}. {calls}")]
    WithRecentCalls {
        /// The failure.
        error: Box<CommError>,
        /// The rank's last calls, as text.
        calls: String,
    },

    /// A failed call, with what its caller was doing (a pipeline stage's transfer names the stage, the replica
    /// and the rank, and the micro-batch it waited for).
    #[error("{context}: {error}")]
    During {
        /// What the caller was doing.
        context: String,
        /// The failure.
        error: Box<CommError>,
    },

    /// The engine itself failed.
    #[error("communication engine `{engine}` failed during {operation}: {reason}")]
    Engine {
        /// The engine (`in-process`, `mpi`).
        engine: &'static str,
        /// The operation.
        operation: String,
        /// The engine's message.
        reason: String,
    },
}

impl CommError {
    /// The error itself, without the recorded calls [`CommError::WithRecentCalls`] and the caller's context
    /// [`CommError::During`] add to it.
    pub fn root(&self) -> &CommError {
        match self {
            CommError::WithRecentCalls { error, .. } | CommError::During { error, .. } => {
                error.root()
            }
            other => other,
        }
    }
}

/// The result of a collective.
pub type CommResult<T> = Result<T, CommError>;
