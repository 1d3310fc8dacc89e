//! Pipeline parallelism: where a rank sits in the pipeline × data mesh ([`PipelineLayout`]), what one
//! pipelined step did in time ([`StageTrace`], [`chrome_trace`], [`svg_trace`]), and stages cut by measured
//! compute ([`measure_block_costs`], [`stage_blocks_for`]). Inside the crate: how a model's blocks are cut
//! into stages (`partition`), the schedules that order each stage's micro-batches (`schedule`), a pipelined rank's
//! strategy (`stage_strategy`) and a save's fetches (`fetch`); the step itself runs in the step pipeline
//! (`crate::pipeline::staged`). See `docs/pipeline.md`.

mod balance;
pub(crate) mod fetch;
pub(crate) mod mesh;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod schedule;
mod stage_strategy;
mod trace;

pub use balance::{measure_block_costs, stage_blocks_for};
pub use mesh::PipelineLayout;
pub use trace::{SpanKind, StageTrace, TraceSpan, chrome_trace, svg_trace};
