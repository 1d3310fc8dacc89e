//! How training is distributed: the one home of every cross-rank call.
//!
//! | part | owns |
//! |---|---|
//! | [`ProcessGroup`] | who this rank is: rank, local rank, world size, device, the communicator, debug mode |
//! | [`cluster`] | how the process was started (single, in-process threads, MPI) and the launcher's variables |
//! | in-process launching | `n` ranks as threads (what [`launch`](crate::launch) and `AcceleratorBuilder::launch` run) |
//! | [`collectives`] | tensor and object collectives, agreement on an outcome, triggers; debug-mode checks |
//! | [`Gatherable`] | what `gather_for_metrics` takes, gathered through [`MetricsGather`] |
//! | strategy (crate-private) | how gradients are reduced (and through which transport: [`describe_gradient_transport`]), who steps which parameter, how its state is saved |
//! | [`comm`] | the [`Communicator`](comm::Communicator) trait and its engines |
//!
//! Everything that crosses ranks goes through [`collectives`] (user collectives, the gradient transport, the
//! Learner's stop flag, save and load agreement, seeds, triggers, batch-size search) or, for a sharded strategy's
//! buffers, through the communicator after debug mode's check of the same kind ([`collectives`]' `verify_call`),
//! so debug mode, the engines' call headers and timeouts see all of it. Sub-groups (a hybrid strategy's shard
//! and replica groups) are [`Communicator::split`](comm::Communicator::split) of the rank's communicator. Whether the ranks' calls match is decided in one place,
//! [`comm::check_calls`], for the engines and debug mode alike. Nothing here knows the [`Accelerator`](crate::Accelerator):
//! the facade composes these parts.

pub mod cluster;
pub mod collectives;
pub mod comm;
mod gatherable;
mod group;
mod in_process;
pub(crate) mod strategy;

pub use gatherable::{Gatherable, MetricsGather};
pub use group::{DistributedType, ProcessGroup, current, current_rank};
pub(crate) use in_process::launch_ranks;
pub use strategy::describe as describe_gradient_transport;
pub use strategy::{DtypeCheck, TransportCheck, rounding_bound};
