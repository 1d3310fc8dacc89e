//! What one pipelined step did on one rank, in time: each forward and backward pass, each wait for a
//! neighbouring stage's message, and so each stage's idle share of the step; and the Chrome / Perfetto trace of
//! every stage's step, to open in a browser.

use serde::{Deserialize, Serialize};

/// What a span of a stage's step was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpanKind {
    /// A micro-batch's forward pass through the stage's blocks (and, on the first stage, what precedes them; on
    /// the last, what follows them and the loss).
    Forward,
    /// A micro-batch's backward pass.
    Backward,
    /// Sending to and receiving from the neighbouring stages (waiting for them included).
    Transfer,
}

/// One span of a stage's step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceSpan {
    /// What it was spent on.
    pub kind: SpanKind,
    /// The micro-batch (for a transfer, the one whose message it waited for).
    pub micro_batch: usize,
    /// Its start, in microseconds from the step's start.
    pub start_us: f64,
    /// Its length, in microseconds.
    pub duration_us: f64,
}

/// One rank's last pipelined step ([`Accelerator::pipeline_trace`](crate::Accelerator::pipeline_trace)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTrace {
    /// The rank's stage.
    pub stage: usize,
    /// The pipeline's stages.
    pub stages: usize,
    /// The rank's data-parallel replica.
    pub replica: usize,
    /// Micro-batches in the step.
    pub micro_batches: usize,
    /// The step's length on this rank, in microseconds (from entering `backward_batch` to leaving it).
    pub step_us: f64,
    /// Its spans, in order.
    pub spans: Vec<TraceSpan>,
}

impl StageTrace {
    /// Microseconds spent computing (forward and backward passes).
    pub fn busy_us(&self) -> f64 {
        self.spans
            .iter()
            .filter(|s| s.kind != SpanKind::Transfer)
            .map(|s| s.duration_us)
            .sum()
    }

    /// The share of the step this stage did not compute: the pipeline's bubble, with the transfers (GPipe and
    /// 1F1B both give `(stages - 1) / (micro_batches + stages - 1)` when every stage takes as long and messages
    /// take no time).
    pub fn idle_fraction(&self) -> f64 {
        if self.step_us <= 0.0 {
            return 0.0;
        }
        (1.0 - self.busy_us() / self.step_us).max(0.0)
    }

    /// The idle share the schedule gives when every stage takes as long and messages take no time.
    pub fn ideal_idle_fraction(&self) -> f64 {
        let (p, m) = (self.stages as f64, self.micro_batches as f64);
        (p - 1.0) / (m + p - 1.0)
    }
}

/// The Chrome / Perfetto trace (open it at `ui.perfetto.dev` or `chrome://tracing`) of several ranks' steps: one
/// process per replica, one track per stage, one slice per forward pass, backward pass and transfer.
///
/// ```
/// use burn_accelerate::distributed::stages::{chrome_trace, SpanKind, StageTrace, TraceSpan};
/// let stage = StageTrace {
///     stage: 0, stages: 2, replica: 0, micro_batches: 1, step_us: 10.0,
///     spans: vec![TraceSpan { kind: SpanKind::Forward, micro_batch: 0, start_us: 0.0, duration_us: 4.0 }],
/// };
/// let trace = chrome_trace(&[stage]);
/// assert_eq!(trace["traceEvents"][1]["name"], "F0");
/// ```
pub fn chrome_trace(stages: &[StageTrace]) -> serde_json::Value {
    let mut events = Vec::new();
    for trace in stages {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": trace.replica, "tid": trace.stage,
            "args": { "name": format!("stage {}", trace.stage) },
        }));
        for span in &trace.spans {
            let (name, category) = match span.kind {
                SpanKind::Forward => (format!("F{}", span.micro_batch), "forward"),
                SpanKind::Backward => (format!("B{}", span.micro_batch), "backward"),
                SpanKind::Transfer => ("send/recv".to_string(), "transfer"),
            };
            events.push(serde_json::json!({
                "name": name, "cat": category, "ph": "X", "pid": trace.replica, "tid": trace.stage,
                "ts": span.start_us, "dur": span.duration_us,
                "args": { "micro_batch": span.micro_batch },
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
