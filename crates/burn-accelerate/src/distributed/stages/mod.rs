//! The former home of pipeline parallelism's public names, now in [`crate::pipeline_parallel`]; these aliases
//! keep programs written against the old paths compiling, with a deprecation warning.
#![allow(deprecated)]

use crate::error::Result;

/// Moved: [`crate::PipelineLayout`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::PipelineLayout (pipeline_parallel::PipelineLayout)"
)]
pub type PipelineLayout = crate::pipeline_parallel::PipelineLayout;
/// Moved: [`crate::pipeline_parallel::StageTrace`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::StageTrace"
)]
pub type StageTrace = crate::pipeline_parallel::StageTrace;
/// Moved: [`crate::pipeline_parallel::TraceSpan`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::TraceSpan"
)]
pub type TraceSpan = crate::pipeline_parallel::TraceSpan;
/// Moved: [`crate::pipeline_parallel::SpanKind`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::SpanKind"
)]
pub type SpanKind = crate::pipeline_parallel::SpanKind;

/// Moved: [`crate::pipeline_parallel::chrome_trace`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::chrome_trace"
)]
pub fn chrome_trace(stages: &[StageTrace]) -> serde_json::Value {
    crate::pipeline_parallel::chrome_trace(stages)
}

/// Moved: [`crate::pipeline_parallel::svg_trace`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::svg_trace"
)]
pub fn svg_trace(stages: &[StageTrace]) -> String {
    crate::pipeline_parallel::svg_trace(stages)
}

/// Moved: [`crate::pipeline_parallel::stage_blocks_for`].
///
/// # Errors
/// As [`crate::pipeline_parallel::stage_blocks_for`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::stage_blocks_for"
)]
pub fn stage_blocks_for(costs: &[f64], stages: usize) -> Result<Vec<usize>> {
    crate::pipeline_parallel::stage_blocks_for(costs, stages)
}

/// Moved: [`crate::pipeline_parallel::measure_block_costs`].
///
/// # Errors
/// As [`crate::pipeline_parallel::measure_block_costs`].
#[deprecated(
    since = "0.1.0",
    note = "use burn_accelerate::pipeline_parallel::measure_block_costs"
)]
pub fn measure_block_costs<B, const D: usize>(
    blocks: &[B],
    input: burn::tensor::Tensor<D>,
    block: impl Fn(&B, burn::tensor::Tensor<D>) -> burn::tensor::Tensor<D>,
    repeats: usize,
) -> Result<Vec<f64>> {
    crate::pipeline_parallel::measure_block_costs(blocks, input, block, repeats)
}
