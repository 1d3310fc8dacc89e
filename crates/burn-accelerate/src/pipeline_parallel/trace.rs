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
/// use burn_accelerate::pipeline_parallel::{chrome_trace, SpanKind, StageTrace, TraceSpan};
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

/// A picture of several ranks' steps as a self-contained SVG (open it in a browser, or put it in a page): one row
/// per stage (and replica), forward passes blue, backward passes orange, transfers grey, what is left of the step
/// blank (the bubble), each row ending with its idle share against the schedule's.
///
/// ```
/// use burn_accelerate::pipeline_parallel::{svg_trace, SpanKind, StageTrace, TraceSpan};
/// let stage = StageTrace {
///     stage: 0, stages: 2, replica: 0, micro_batches: 1, step_us: 10.0,
///     spans: vec![TraceSpan { kind: SpanKind::Forward, micro_batch: 0, start_us: 0.0, duration_us: 4.0 }],
/// };
/// let svg = svg_trace(&[stage]);
/// assert!(svg.starts_with("<svg") && svg.contains(">F0<") && svg.contains("idle 0.60"));
/// ```
pub fn svg_trace(stages: &[StageTrace]) -> String {
    use std::fmt::Write as _;
    const LEFT: f64 = 110.0;
    const PLOT: f64 = 760.0;
    const RIGHT: f64 = 170.0;
    const ROW: f64 = 34.0;
    const TOP: f64 = 10.0;
    let mut rows: Vec<&StageTrace> = stages.iter().collect();
    rows.sort_by_key(|t| (t.replica, t.stage));
    let end = rows
        .iter()
        .flat_map(|t| {
            std::iter::once(t.step_us).chain(t.spans.iter().map(|s| s.start_us + s.duration_us))
        })
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let x = |us: f64| LEFT + us / end * PLOT;
    let axis = TOP + ROW * rows.len() as f64 + 6.0;
    let (width, height) = (LEFT + PLOT + RIGHT, axis + 30.0);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(
        svg,
        r##"<rect width="{width}" height="{height}" fill="#ffffff"/>"##
    );
    let replicas = rows.iter().any(|t| t.replica > 0);
    for (row, trace) in rows.iter().enumerate() {
        let y = TOP + ROW * row as f64;
        let label = match replicas {
            true => format!("replica {} stage {}", trace.replica, trace.stage),
            false => format!("stage {}", trace.stage),
        };
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{label}</text><rect x="{LEFT}" y="{}" width="{}" height="{}" fill="#f2f2f2"/>"##,
            LEFT - 8.0,
            y + ROW / 2.0 + 4.0,
            y + 4.0,
            x(trace.step_us) - LEFT,
            ROW - 8.0,
        );
        for span in &trace.spans {
            let (fill, name, inset) = match span.kind {
                SpanKind::Forward => ("#4c78a8", format!("F{}", span.micro_batch), 4.0),
                SpanKind::Backward => ("#f58518", format!("B{}", span.micro_batch), 4.0),
                SpanKind::Transfer => ("#9d9d9d", String::new(), 13.0),
            };
            let (left, right) = (x(span.start_us), x(span.start_us + span.duration_us));
            let _ = write!(
                svg,
                r##"<rect x="{left:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{fill}"><title>{} {:.2} ms</title></rect>"##,
                y + inset,
                (right - left).max(0.5),
                ROW - 2.0 * inset,
                match name.is_empty() {
                    true => "send/recv",
                    false => &name,
                },
                span.duration_us / 1e3,
            );
            if !name.is_empty() && right - left >= 18.0 {
                let _ = write!(
                    svg,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#ffffff">{name}</text>"##,
                    (left + right) / 2.0,
                    y + ROW / 2.0 + 4.0,
                );
            }
        }
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}">idle {:.2} (schedule {:.2})</text>"#,
            LEFT + PLOT + 8.0,
            y + ROW / 2.0 + 4.0,
            trace.idle_fraction(),
            trace.ideal_idle_fraction(),
        );
    }
    let _ = write!(
        svg,
        r##"<line x1="{LEFT}" y1="{axis}" x2="{}" y2="{axis}" stroke="#666666"/>"##,
        LEFT + PLOT
    );
    let end_ms = end / 1e3;
    let tick = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4,
    ]
    .into_iter()
    .find(|t| end_ms / t <= 10.0)
    .unwrap_or(1e4);
    let mut t = 0.0;
    while t <= end_ms + 1e-9 {
        let at = x(t * 1e3);
        let _ = write!(
            svg,
            r##"<line x1="{at:.1}" y1="{axis}" x2="{at:.1}" y2="{}" stroke="#666666"/><text x="{at:.1}" y="{}" text-anchor="middle">{} ms</text>"##,
            axis + 4.0,
            axis + 16.0,
            format_ms(t),
        );
        t += tick;
    }
    svg.push_str("</svg>\n");
    svg
}

/// `ms` with as many decimals as a tick needs.
fn format_ms(ms: f64) -> String {
    if ms == ms.round() {
        format!("{ms:.0}")
    } else {
        format!("{ms:.1}")
    }
}
