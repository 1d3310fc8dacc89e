//! How training is distributed: the one home of every cross-rank call.
//!
//! Three rooms, lowest first:
//!
//! | room | part | owns |
//! |---|---|---|
//! | the cluster | [`cluster`] | who this rank is ([`ProcessGroup`]: rank, local rank, world size, device, the communicator, debug mode), how the process was started (single, in-process threads, MPI), the launcher's variables, and in-process launching (`n` ranks as threads: what [`launch`](crate::launch) and `AcceleratorBuilder::launch` run) |
//! | the interface and its checking | [`comm`] | the [`Communicator`](comm::Communicator) trait and its engines (in-process, MPI) |
//! | | tensor interface (crate-private `tensor_comm`) | the one way a strategy reaches other ranks: all-reduce, reduce, reduce-scatter, all-gather, broadcast and point-to-point batches of flat tensors, started and waited on, checked in debug mode; host memory over the communicator, or a device engine (`on_device`: NCCL, Burn's CUDA collective; chosen and described by [`describe_gradient_transport`]); bucketing |
//! | | [`collectives`] | tensor and object collectives for users and the facade, agreement on an outcome, triggers; debug-mode checks |
//! | | [`Gatherable`] | what `gather_for_metrics` takes, gathered through [`MetricsGather`] |
//! | the strategies | strategy (crate-private) | what a backward's gradients become, who steps which parameter, how a module's parameters are placed, what a checkpoint holds, what the Learner may do |
//! | | stages (crate-private) | pipeline parallelism's building blocks: a model's blocks cut into balanced contiguous stages, the GPipe and 1F1B schedules, their timeline and its Chrome trace (not yet driven by a stage runtime) |
//!
//! Every strategy (data parallelism and every sharded mode) reaches other ranks through the tensor interface
//! alone; everything else that crosses ranks goes through [`collectives`] (user collectives, the Learner's stop
//! flag, save and load agreement, seeds, triggers, batch-size search). Both end in the rank's communicator (or a
//! device library) after debug mode's check of the same kind, so debug mode, the engines' call headers and
//! timeouts see all of it. Sub-groups (a hybrid strategy's shard
//! and replica groups) are [`Communicator::split`](comm::Communicator::split) of the rank's communicator. Whether the ranks' calls match is decided in one place,
//! [`comm::check_calls`], for the engines and debug mode alike. Nothing here knows the [`Accelerator`](crate::Accelerator):
//! the facade composes these parts.

pub mod comm;
pub mod cluster;
pub mod collectives;
mod gatherable;
pub(crate) mod mesh;
pub(crate) mod tensor_comm;
pub(crate) mod strategy;
pub mod stages;

pub(crate) use cluster::launch_ranks;
pub use cluster::{DistributedType, ProcessGroup, current, current_rank};
pub use gatherable::{Gatherable, MetricsGather};
pub use mesh::{MeshCoords, ParallelDims};
pub use tensor_comm::on_device::describe as describe_gradient_transport;
pub use tensor_comm::on_device::describe_per_call as describe_transport_per_call;
pub use tensor_comm::on_device::{DtypeCheck, LifecycleCheck, TransportCheck, rounding_bound};
