//! What every stage of a pipelined step must agree on: its settings (debug mode's check), the micro-batches a
//! batch is cut into, and the verdict on a failure, so that a stage that fails ends the step on every stage at
//! once instead of leaving its peers waiting in a collective.

use super::*;

/// What a stage of a pipeline runs a step with, which every stage must agree on (debug mode's check).
#[derive(serde::Serialize, serde::Deserialize, PartialEq, Clone)]
pub(super) struct StageStep {
    rank: usize,
    stage: usize,
    stages: usize,
    micro_batches: usize,
    schedule: String,
    blocks: std::ops::Range<usize>,
    model_blocks: usize,
    samples: Option<usize>,
}

/// Debug mode, before a pipelined step: the stages of this replica's pipeline compare their settings, their cut of
/// the blocks and the samples of their batch, so that a mismatch (a setting that differs between ranks, a batch
/// that is not the same on every stage) is an error on every stage naming each one's stage and rank, rather than
/// a hang in a transfer or a loss on the wrong targets.
pub(super) fn check_stages_agree(
    stages: &Stages,
    range: &std::ops::Range<usize>,
    model_blocks: usize,
    samples: Option<usize>,
) -> Result<()> {
    let layout = stages.layout;
    let mine = StageStep {
        rank: stages.world.rank(),
        stage: layout.stage,
        stages: layout.stages,
        micro_batches: stages.micro_batches,
        schedule: stages.schedule.name().to_string(),
        blocks: range.clone(),
        model_blocks,
        samples,
    };
    let all: Vec<StageStep> = crate::distributed::collectives::gather_object(&stages.pipe, &mine)?;
    let describe = |s: &StageStep| {
        format!(
            "stage {} (rank {}): {} stages, {} micro-batches, {}, blocks {}..{} of {}, {}",
            s.stage,
            s.rank,
            s.stages,
            s.micro_batches,
            s.schedule,
            s.blocks.start,
            s.blocks.end,
            s.model_blocks,
            s.samples
                .map_or("a batch of unknown size".to_string(), |n| format!(
                    "a batch of {n} samples"
                ))
        )
    };
    let first = &all[0];
    let mut problems: Vec<&str> = Vec::new();
    let mut note = |problem: &'static str| {
        if !problems.contains(&problem) {
            problems.push(problem);
        }
    };
    let mut end = 0;
    for step in &all {
        if (
            step.stages,
            step.micro_batches,
            &step.schedule,
            step.model_blocks,
        ) != (
            first.stages,
            first.micro_batches,
            &first.schedule,
            first.model_blocks,
        ) {
            note(
                "the pipeline's settings differ (pp_size, pp_microbatches, pp_schedule or the model's blocks)",
            );
        }
        if step.blocks.start != end {
            note("the stages' blocks do not follow each other (the cut differs: pp_stage_blocks?)");
        }
        end = step.blocks.end;
        if let (Some(a), Some(b)) = (step.samples, first.samples)
            && a != b
        {
            note(
                "the stages got batches of different sizes: every stage of a pipeline must get the same batch \
                 (prepare the dataloader with the accelerator: it shards by data-parallel replica, not by rank)",
            );
        }
    }
    if end != first.model_blocks {
        note("the stages' blocks do not cover the model");
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "debug mode: backward_batch: the stages of pipeline replica {} disagree: {}.\n{}",
        layout.replica,
        problems.join("; "),
        all.iter().map(describe).collect::<Vec<_>>().join("\n")
    )))
}

/// `batch` cut into `per_batch` micro-batches (`pp_microbatches`), or into one a sample where it holds fewer (a
/// short last batch under `even_batches = false`): how many, the parts, and why it could not be cut (no sample,
/// or members that disagree). Every stage of a replica gets the same batch, so its stages cut it alike; a cut that
/// fails does not return early, since the other replicas' ranks wait in the step's collectives: the step runs its
/// passes as failed and every rank learns of it at the verdict.
pub(super) fn micro_batches<B: Split>(
    batch: B,
    per_batch: usize,
    operation: &str,
) -> (usize, Vec<B>, Option<Error>) {
    let m = match batch.samples() {
        Some(n) if n > 0 && n < per_batch => {
            log::debug!(
                "{operation}: a batch of {n} sample(s) runs as {n} micro-batch(es) of one, fewer than \
                 pp_microbatches = {per_batch}"
            );
            n
        }
        _ => per_batch,
    };
    match batch.micro_batches(m) {
        Ok(parts) => (m, parts, None),
        Err(e) => (m, Vec::new(), Some(e)),
    }
}

/// Why a stage stopped computing a step.
pub(super) enum Failure {
    /// One of its own passes failed.
    Here(Caught),
    /// The stage before it had no activation to send.
    Upstream,
}

/// A pass's failure: its error, or the panic it raised (re-raised once every stage knows).
pub(super) enum Caught {
    Error(Error),
    Panic(Box<dyn std::any::Any + Send>),
}

impl Caught {
    /// Whether it reports an out-of-memory failure.
    fn is_out_of_memory(&self) -> bool {
        use crate::heap::oom::{OutOfMemory, is_out_of_memory_message};
        match self {
            Caught::Error(e) => e.is_out_of_memory(),
            Caught::Panic(payload) => payload
                .downcast_ref::<&str>()
                .map(|m| is_out_of_memory_message(m))
                .or_else(|| {
                    payload
                        .downcast_ref::<String>()
                        .map(|m| is_out_of_memory_message(m))
                })
                .unwrap_or(false),
        }
    }
}

/// `f`, its error or panic caught.
pub(super) fn guarded<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, Caught> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Caught::Error(e)),
        Err(payload) => Err(Caught::Panic(payload)),
    }
}

/// Every rank of the run learns whether a stage failed in `operation`'s passes (one small all-reduce, before any
/// other collective of the step): `Ok` when none did; else this rank's own error (its panic raised again), or
/// [`Error::OtherRankFailed`] naming the lowest rank that failed and whether it ran out of memory.
pub(super) fn verdict(
    stages: &Stages,
    failure: Option<Failure>,
    operation: &'static str,
) -> Result<()> {
    let verdict = stages.world.all_reduce_value(
        failure_code(&failure, stages.world.rank()),
        ReduceOp::Min,
        "pipeline step verdict",
    )?;
    if verdict >= HEALTHY {
        return Ok(());
    }
    Err(match failure {
        Some(Failure::Here(Caught::Panic(payload))) => std::panic::resume_unwind(payload),
        Some(Failure::Here(Caught::Error(e))) => e,
        _ => {
            let rank = (verdict / 2.0) as usize;
            let stage = rank / stages.stage_ranks.max(1);
            Error::OtherRankFailed {
                operation,
                rank,
                message: match verdict as usize % 2 {
                    0 => format!(
                        "a pass of pipeline stage {stage} ran out of memory (its rank reports the error)"
                    ),
                    _ => format!(
                        "a pass of pipeline stage {stage} failed (its rank reports the error)"
                    ),
                },
            }
        }
    })
}

/// A step's verdict on a rank that failed nowhere (the minimum over ranks is the failed rank's code).
const HEALTHY: f64 = f64::MAX;

/// This rank's part of a step's verdict: `2 × rank` when one of its passes ran out of memory, `2 × rank + 1` when
/// one failed otherwise, [`HEALTHY`] else (a stage stopped only by the stage before it reports nothing: that
/// stage does).
pub(super) fn failure_code(failure: &Option<Failure>, rank: usize) -> f64 {
    match failure {
        Some(Failure::Here(caught)) => (2 * rank + usize::from(!caught.is_out_of_memory())) as f64,
        _ => HEALTHY,
    }
}

/// `Ok` when the last stage's `loss` is connected to a parameter that requires a gradient.
pub(super) fn tracked(loss: &Tensor<1>) -> Result<()> {
    if loss.is_tracked() {
        return Ok(());
    }
    Err(Error::InvalidArgument(
        "backward_batch: the loss is not connected to any parameter that requires a gradient; prepare the model \
         with `accelerator.prepare_model(model)` and compute the loss in `after` from the activation it is given"
            .into(),
    ))
}

/// The gradient `grads` holds for `x`, the input of one of stage `s`'s blocks.
///
/// # Errors
/// None: the blocks' output does not depend on `x`.
pub(super) fn input_grad<const D: usize>(
    x: &Tensor<D>,
    grads: &mut crate::graph_cut::Passes,
    s: usize,
) -> Result<Tensor<D>> {
    grads.remove(x).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "backward_batch: stage {s}'s output does not depend on a block's input; `block` must compute each \
             block's output from the activation it is given"
        ))
    })
}

/// A span of kind `kind` of micro-batch `i` from `start` to now, timed from the step's start `step`.
pub(super) fn span(kind: SpanKind, i: usize, step: Instant, start: Instant) -> TraceSpan {
    TraceSpan {
        kind,
        micro_batch: i,
        start_us: micros(start - step),
        duration_us: micros(start.elapsed()),
    }
}
