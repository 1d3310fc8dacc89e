//! Pipeline parallelism, in one home (torch's `pipelining`: a stage and the schedules that run it).
//!
//! - `stage`: one rank's stage ([`PipelineLayout`]: where it sits in the pipeline × data mesh; `Stages`: its
//!   communicators and what its steps learn and share);
//! - `schedule`: the order of each stage's forward and backward passes (GPipe, 1F1B);
//! - `balance`: stages cut by measured compute ([`measure_block_costs`], [`stage_blocks_for`]); the cut by
//!   parameters is the model's own (`crate::model`);
//! - `runtime`: one batch through the stages (`Accelerator::backward_batch`, `forward_batch`), its messages
//!   (`runtime::mailbox`) and tied parameters (`runtime::tied`);
//! - `stage_strategy`: a pipelined rank's strategy (`Staged`), wrapping its stage's data-parallel one;
//! - `fetch`: a save's parameters fetched from the stage that holds them;
//! - `trace`: what one pipelined step did in time ([`StageTrace`], [`chrome_trace`], [`svg_trace`]).
//!
//! `crate::parallelize` builds a rank's stage from the mesh; the facade keeps it and dispatches to it. See
//! `docs/pipeline.md`.

mod trace;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod schedule;
mod balance;
mod stage;
mod stage_strategy;
pub(crate) mod fetch;
pub(crate) mod runtime;

pub use balance::{measure_block_costs, stage_blocks_for};
pub use stage::PipelineLayout;
pub(crate) use stage::Stages;
pub(crate) use stage_strategy::Staged;
pub use trace::{SpanKind, StageTrace, TraceSpan, chrome_trace, svg_trace};
