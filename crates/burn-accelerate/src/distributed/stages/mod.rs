//! Pipeline parallelism: how a model's blocks are cut into stages ([`partition`]), the schedules that order each
//! stage's micro-batches ([`schedule`]), the pipeline × data mesh and a pipelined rank's strategy ([`mesh`]), and
//! each step's trace ([`trace`]). The step itself runs in the step pipeline (`crate::pipeline::staged`).

pub(crate) mod fetch;
pub(crate) mod mesh;
pub(crate) mod partition;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod schedule;
mod trace;

pub use mesh::PipelineLayout;
pub use trace::{SpanKind, StageTrace, TraceSpan, chrome_trace};
