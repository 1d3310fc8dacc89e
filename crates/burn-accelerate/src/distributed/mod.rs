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
//! | tensor interface (crate-private `tensor_comm`) | the one way a strategy reaches other ranks: all-reduce, reduce, reduce-scatter, all-gather and broadcast of flat tensors, started and waited on, checked in debug mode; host memory over the communicator, or the device's all-reduce; bucketing |
//! | [`comm`] | the [`Communicator`](comm::Communicator) trait and its engines |
//!
//! Every strategy (data parallelism and every sharded mode) reaches other ranks through the tensor interface
//! alone; everything else that crosses ranks goes through [`collectives`] (user collectives, the Learner's stop
//! flag, save and load agreement, seeds, triggers, batch-size search). Both end in the rank's communicator (or a
//! device library) after debug mode's check of the same kind, so debug mode, the engines' call headers and
//! timeouts see all of it. Sub-groups (a hybrid strategy's shard
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
pub(crate) mod tensor_comm;

pub use gatherable::{Gatherable, MetricsGather};
pub use group::{DistributedType, ProcessGroup, current, current_rank};
pub(crate) use in_process::launch_ranks;
pub use strategy::describe as describe_gradient_transport;
pub use strategy::{DtypeCheck, TransportCheck, rounding_bound};
