//! Pipeline schedules: the order in which one stage runs its micro-batches' forward and backward passes, as
//! `torch.distributed.pipelining`'s `ScheduleGPipe` and `Schedule1F1B` order them.
//!
//! ```text
//! GPipe, 3 stages, 4 micro-batches (time →; F = forward, B = backward, . = idle)
//!   stage 0  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
//!   stage 1  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
//!   stage 2  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
//! 1F1B: after `stages - 1 - stage` warm-up forwards, each forward is followed by the oldest backward, so a
//! stage holds at most `stages - stage` micro-batches' activations (GPipe: all of them).
//! ```
//!
//! A stage receives a forward's input from the stage before it and sends its output to the stage after it, and a
//! backward's gradient the other way. Both schedules send and receive in increasing micro-batch order on every
//! pair of neighbours, so the receives of one stage match its neighbour's sends in order (what MPI's
//! per-pair ordering needs: no message overtakes another, whatever the transfer protocol).

use std::fmt;

/// How a stage orders its passes (the setting's type).
pub(crate) use crate::config::PipelineSchedule as ScheduleKind;

/// One pass of one micro-batch on a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pass {
    /// The forward pass of micro-batch `i`.
    Forward(usize),
    /// The backward pass of micro-batch `i`.
    Backward(usize),
}

impl Pass {
    /// The micro-batch it works on.
    pub fn micro_batch(self) -> usize {
        match self {
            Pass::Forward(i) | Pass::Backward(i) => i,
        }
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pass::Forward(i) => write!(f, "F{i}"),
            Pass::Backward(i) => write!(f, "B{i}"),
        }
    }
}

/// The passes stage `stage` of `stages` runs for `micro_batches` micro-batches, in order.
pub(crate) fn stage_passes(
    kind: ScheduleKind,
    stage: usize,
    stages: usize,
    micro_batches: usize,
) -> Vec<Pass> {
    let m = micro_batches;
    match kind {
        ScheduleKind::GPipe => (0..m)
            .map(Pass::Forward)
            .chain((0..m).map(Pass::Backward))
            .collect(),
        ScheduleKind::OneFOneB => {
            let warm_up = stages.saturating_sub(stage + 1).min(m);
            let mut passes: Vec<Pass> = (0..warm_up).map(Pass::Forward).collect();
            for i in 0..m - warm_up {
                passes.push(Pass::Forward(warm_up + i));
                passes.push(Pass::Backward(i));
            }
            passes.extend((m - warm_up..m).map(Pass::Backward));
            passes
        }
    }
}

/// One pass on a stage's timeline: when it started and how long it ran (any unit: the simulation's or
/// microseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Span {
    /// The pass.
    pub pass: Pass,
    /// Its start.
    pub start: f64,
    /// Its duration.
    pub duration: f64,
}

/// Every stage's passes laid out in time, stage 0 first.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Timeline {
    /// Each stage's spans, in the order it ran them.
    pub stages: Vec<Vec<Span>>,
}

impl Timeline {
    /// From the first pass's start to the last pass's end.
    pub fn makespan(&self) -> f64 {
        let spans = || self.stages.iter().flatten();
        let start = spans().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let end = spans()
            .map(|s| s.start + s.duration)
            .fold(f64::NEG_INFINITY, f64::max);
        if start.is_finite() { end - start } else { 0.0 }
    }

    /// The share of the makespan stage `stage` spent idle (the pipeline's bubble on that stage).
    pub fn idle_fraction(&self, stage: usize) -> f64 {
        let makespan = self.makespan();
        if makespan == 0.0 {
            return 0.0;
        }
        let busy: f64 = self.stages[stage].iter().map(|s| s.duration).sum();
        1.0 - busy / makespan
    }

    /// The timeline as a Chrome / Perfetto trace (open it at `ui.perfetto.dev` or `chrome://tracing`): one
    /// track per stage, one slice per pass, times in microseconds (`unit_us` microseconds per unit of the
    /// timeline).
    pub fn chrome_trace(&self, unit_us: f64) -> serde_json::Value {
        let mut events = Vec::new();
        for (stage, spans) in self.stages.iter().enumerate() {
            events.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
                "args": { "name": format!("stage {stage}") },
            }));
            for span in spans {
                let category = match span.pass {
                    Pass::Forward(_) => "forward",
                    Pass::Backward(_) => "backward",
                };
                events.push(serde_json::json!({
                    "name": span.pass.to_string(), "cat": category, "ph": "X", "pid": 0, "tid": stage,
                    "ts": span.start * unit_us, "dur": span.duration * unit_us,
                    "args": { "micro_batch": span.pass.micro_batch() },
                }));
            }
        }
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}

/// The schedule run on `stages` stages as if every forward took `forward` and every backward `backward` and
/// messages took no time: each stage runs its passes in order, a forward once the stage before finished it, a
/// backward once the stage after finished it. `None` if the stages' orders wait on each other forever.
pub(crate) fn simulate(
    kind: ScheduleKind,
    stages: usize,
    micro_batches: usize,
    (forward, backward): (f64, f64),
) -> Option<Timeline> {
    let orders: Vec<Vec<Pass>> = (0..stages)
        .map(|s| stage_passes(kind, s, stages, micro_batches))
        .collect();
    run_orders(&orders, (forward, backward))
}

/// [`simulate`] of the stages' own orders (`orders[s]`: stage `s`'s passes).
fn run_orders(orders: &[Vec<Pass>], (forward, backward): (f64, f64)) -> Option<Timeline> {
    let stages = orders.len();
    let mut next = vec![0usize; stages];
    let mut free_at = vec![0.0f64; stages];
    // When each stage finished each pass.
    let mut done: Vec<std::collections::HashMap<Pass, f64>> = vec![Default::default(); stages];
    let mut timeline = Timeline {
        stages: vec![Vec::new(); stages],
    };
    let total: usize = orders.iter().map(Vec::len).sum();
    let mut ran = 0;
    while ran < total {
        let mut progressed = false;
        for s in 0..stages {
            let Some(&pass) = orders[s].get(next[s]) else {
                continue;
            };
            // What the pass waits for: its input from a neighbour (and, for a backward, its own forward).
            let ready = match pass {
                Pass::Forward(i) if s > 0 => done[s - 1].get(&Pass::Forward(i)).copied(),
                Pass::Forward(_) => Some(0.0),
                Pass::Backward(i) => {
                    let own = done[s].get(&Pass::Forward(i)).copied();
                    let from_next = if s + 1 < stages {
                        done[s + 1].get(&Pass::Backward(i)).copied()
                    } else {
                        Some(0.0)
                    };
                    own.zip(from_next).map(|(a, b)| a.max(b))
                }
            };
            let Some(ready) = ready else { continue };
            let start = ready.max(free_at[s]);
            let duration = match pass {
                Pass::Forward(_) => forward,
                Pass::Backward(_) => backward,
            };
            free_at[s] = start + duration;
            done[s].insert(pass, start + duration);
            timeline.stages[s].push(Span {
                pass,
                start,
                duration,
            });
            next[s] += 1;
            ran += 1;
            progressed = true;
        }
        if !progressed {
            return None;
        }
    }
    Some(timeline)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ScheduleKind; 2] = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];

    /// The micro-batches whose activations a stage holds at most: forwards run and not yet backed.
    fn most_alive(passes: &[Pass]) -> usize {
        let (mut alive, mut most) = (0usize, 0usize);
        for pass in passes {
            match pass {
                Pass::Forward(_) => alive += 1,
                Pass::Backward(_) => alive -= 1,
            }
            most = most.max(alive);
        }
        most
    }

    #[test]
    fn every_stage_runs_each_forward_once_before_its_backward() {
        for kind in KINDS {
            for stages in 1..=5 {
                for m in 1..=9 {
                    for s in 0..stages {
                        let passes = stage_passes(kind, s, stages, m);
                        assert_eq!(passes.len(), 2 * m, "{kind:?} {s}/{stages} m={m}");
                        for i in 0..m {
                            let f = passes.iter().position(|p| *p == Pass::Forward(i));
                            let b = passes.iter().position(|p| *p == Pass::Backward(i));
                            assert!(
                                matches!((f, b), (Some(f), Some(b)) if f < b),
                                "{kind:?} stage {s}/{stages}, m={m}: {passes:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_at_most_the_stages_ahead_and_gpipe_everything() {
        for stages in 1..=5 {
            for m in 1..=9 {
                for s in 0..stages {
                    let one = stage_passes(ScheduleKind::OneFOneB, s, stages, m);
                    assert_eq!(
                        most_alive(&one),
                        (stages - s).min(m),
                        "{s}/{stages} m={m}: {one:?}"
                    );
                    let gpipe = stage_passes(ScheduleKind::GPipe, s, stages, m);
                    assert_eq!(most_alive(&gpipe), m);
                }
            }
        }
    }

    #[test]
    fn neighbours_send_and_receive_in_the_same_order() {
        for kind in KINDS {
            for stages in 2..=5 {
                for m in 1..=9 {
                    for s in 0..stages - 1 {
                        let order = |stage: usize, forward: bool| -> Vec<usize> {
                            stage_passes(kind, stage, stages, m)
                                .into_iter()
                                .filter(|p| matches!(p, Pass::Forward(_)) == forward)
                                .map(Pass::micro_batch)
                                .collect()
                        };
                        // Activations: stage s sends in its forward order, s + 1 receives in its own.
                        assert_eq!(order(s, true), order(s + 1, true), "{kind:?} {s}/{stages}");
                        // Gradients: s + 1 sends in its backward order, s receives in its own.
                        assert_eq!(
                            order(s + 1, false),
                            order(s, false),
                            "{kind:?} {s}/{stages}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_bubble_is_stages_less_one_over_micro_batches_plus_stages_less_one() {
        for kind in KINDS {
            for stages in 1..=4 {
                for m in [1, 2, 4, 8] {
                    for times in [(1.0, 1.0), (1.0, 2.0)] {
                        let timeline = simulate(kind, stages, m, times)
                            .unwrap_or_else(|| panic!("{kind:?} {stages} stages, m={m}: stuck"));
                        let (f, b) = times;
                        let expected = (m + stages - 1) as f64 * (f + b);
                        assert!(
                            (timeline.makespan() - expected).abs() < 1e-9,
                            "{kind:?} {stages} m={m}"
                        );
                        let bubble = (stages - 1) as f64 / (m + stages - 1) as f64;
                        for s in 0..stages {
                            let idle = timeline.idle_fraction(s);
                            assert!(
                                (idle - bubble).abs() < 1e-9,
                                "{kind:?} stage {s}/{stages} m={m}: {idle}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn orders_that_wait_on_each_other_are_found_stuck() {
        use Pass::{Backward as B, Forward as F};
        // Stage 0 waits for B1 before running F1, which stage 1 needs before it can run B1.
        let stuck = vec![vec![F(0), B(1), F(1), B(0)], vec![F(0), F(1), B(1), B(0)]];
        assert_eq!(run_orders(&stuck, (1.0, 1.0)), None);
        let fine = vec![vec![F(0), F(1), B(1), B(0)], vec![F(0), F(1), B(1), B(0)]];
        assert!(run_orders(&fine, (1.0, 1.0)).is_some());
        // No micro-batch: nothing to run, nothing stuck.
        assert_eq!(
            simulate(ScheduleKind::OneFOneB, 3, 0, (1.0, 1.0)).map(|t| t.makespan()),
            Some(0.0)
        );
    }

    #[test]
    fn the_trace_has_a_track_per_stage_and_a_slice_per_pass() {
        let timeline = simulate(ScheduleKind::OneFOneB, 2, 3, (1.0, 2.0)).expect("runs");
        let trace = timeline.chrome_trace(1000.0);
        let events = trace["traceEvents"].as_array().expect("events");
        let slices: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(slices.len(), 2 * 2 * 3);
        assert_eq!(events.iter().filter(|e| e["ph"] == "M").count(), 2);
        let first_backward = slices
            .iter()
            .find(|e| e["tid"] == 1 && e["name"] == "B0")
            .expect("stage 1's B0");
        // Stage 1 runs F0 at [1, 2) and then B0 at once: 2 ms, for 2 ms.
        assert_eq!(first_backward["ts"], 2000.0);
        assert_eq!(first_backward["dur"], 2000.0);
    }
}
