//! The state of one training step, shared by a rank's accelerator, prepared optimizers, schedulers and
//! dataloaders: Accelerate's `GradientState`, as a small state machine with named transitions, and the
//! gradients accumulated so far.
//!
//! ```text
//!             begin_micro_batch ──> record_backward ──> (sync step) record_overflow ──> take_verdict
//! dataloader: begin_epoch ──> batch_yielded ... (end_of_dataloader closes the window early)
//! ```
//!
//! [`Verdict`] is the one source of truth for what the optimizer does with the current micro-batch, and
//! `last_step_skipped` the one record of whether the latest optimizer step was skipped, read by the optimizer,
//! the scheduler and the accelerator alike.

use rustc_hash::FxHashMap as HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::ParamId;

use super::GradientBuffer;

/// Which model a `backward` was for: the id of its first parameter (two models never share one), or `None` for a
/// model without parameters. Each model's accumulation window is counted on its own, as Accelerate divides each
/// loss by the number of accumulation steps whichever model it trains.
pub(crate) type ModelKey = Option<ParamId>;

/// The [`ModelKey`] of `model`.
pub(crate) fn model_key<M: burn::module::Module>(model: &M) -> ModelKey {
    let mut first = None;
    crate::named_params::floats(model, |p| {
        first.get_or_insert(p.id());
    });
    first
}

/// The micro-batches one model's `backward` calls fell in since its gradients were last synchronised.
#[derive(Debug, Clone, Copy, Default)]
struct ModelWindow {
    /// The micro-batch (see [`StepState::micro_batch`]) of the model's latest `backward`.
    last_micro_batch: Option<u64>,
    /// Distinct micro-batches with a `backward` of this model.
    micro_batches: usize,
}

/// A snapshot of the gradient-synchronisation state of the current step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradientState {
    /// Whether this micro-batch ends an accumulation window: gradients are synchronised and the optimizer steps.
    pub sync_gradients: bool,
    /// Whether the batch just yielded by a prepared dataloader was its last one for this epoch.
    pub end_of_dataloader: bool,
    /// The configured number of micro-batches per optimizer step.
    pub num_steps: usize,
    /// Samples of the last round of the active dataloader that are not padding (`None` with `drop_last`).
    pub remainder: Option<usize>,
}

impl GradientState {
    /// How many gathered samples `gather_for_metrics` keeps: the real samples of the last round, on the last
    /// batch of an epoch only.
    pub(crate) fn samples_to_keep(&self) -> Option<usize> {
        match (self.end_of_dataloader, self.remainder) {
            (true, Some(r)) if r > 0 => Some(r),
            _ => None,
        }
    }
}

/// What the optimizer does with the current micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Inside an accumulation window: keep the gradients, leave the model as it is.
    Accumulate,
    /// The window ends: apply the gradients.
    Step,
    /// The window ends with an overflow (fp16) on some rank: drop the gradients on every rank.
    Skip,
}

/// How the gradients of a `backward` are treated, decided by [`StepState::record_backward`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackwardPlan {
    /// Keep accumulating locally, no communication.
    Local,
    /// Average across ranks without ending the window (`sync_each_batch`).
    SyncOnly,
    /// End the window: normalise over `micro_batches` (the `backward` calls of the window), sync, verdict.
    EndWindow { micro_batches: usize },
}

/// Accumulation window, end-of-epoch tracking and step verdict of one rank.
#[derive(Debug)]
pub(crate) struct StepState {
    num_steps: usize,
    /// Micro-batches counted by `begin_micro_batch` since the last sync (Accelerate's `step`).
    counted: usize,
    /// The serial number of the current micro-batch (every `begin_micro_batch` advances it).
    micro_batch: u64,
    /// Each model's window: the micro-batches its `backward` calls fell in since its last sync.
    windows: HashMap<ModelKey, ModelWindow>,
    sync_gradients: bool,
    end_of_dataloader: bool,
    remainder: Option<usize>,
    /// Each model's overflow verdict at the end of its window (fp16: its gradients overflowed on some rank), until
    /// its optimizer acts on it: two models (a GAN's halves) each skip or take their own step, as each optimizer
    /// of Accelerate's `GradScaler` checks its own gradients.
    overflow: HashMap<ModelKey, bool>,
    /// Whether the latest optimizer step was skipped.
    last_step_skipped: bool,
    /// Whether `begin_micro_batch` was ever called (accumulation is in force only through it).
    micro_batches_begun: bool,
}

impl StepState {
    fn new(num_steps: usize) -> Self {
        Self {
            num_steps,
            counted: 0,
            micro_batch: 0,
            windows: HashMap::default(),
            sync_gradients: true,
            end_of_dataloader: false,
            remainder: None,
            overflow: HashMap::default(),
            last_step_skipped: false,
            micro_batches_begun: false,
        }
    }

    /// A micro-batch starts (Accelerate's `accumulate`): decides whether it ends the window, which it does every
    /// `num_steps` micro-batches and on the last batch of a dataloader. Returns that decision.
    pub fn begin_micro_batch(&mut self) -> bool {
        self.micro_batches_begun = true;
        self.micro_batch += 1;
        if self.end_of_dataloader {
            self.counted = 0;
            self.sync_gradients = true;
        } else {
            self.counted += 1;
            self.sync_gradients = self.counted.is_multiple_of(self.num_steps);
        }
        self.sync_gradients
    }

    /// Forgets the current accumulation window (after `free_memory`, before a retry with another batch size).
    pub fn reset_window(&mut self) {
        self.counted = 0;
        self.windows.clear();
        self.sync_gradients = true;
        self.overflow.clear();
    }

    /// A prepared dataloader starts an epoch of `batches` batches on this rank, whose last round holds
    /// `remainder` real samples.
    pub fn begin_epoch(&mut self, batches: usize, remainder: Option<usize>) {
        self.end_of_dataloader = batches == 0;
        self.remainder = remainder;
    }

    /// A prepared dataloader yielded a batch (`last`: the epoch's last).
    pub fn batch_yielded(&mut self, last: bool) {
        self.end_of_dataloader = last;
    }

    /// The real samples of the last round, learnt only at the end of a stream.
    pub fn set_remainder(&mut self, remainder: Option<usize>) {
        self.remainder = remainder;
    }

    /// A `backward` of `model` added gradients; `sync_each_batch`: average across ranks even inside the window.
    ///
    /// Each model's window is its own: on a sync micro-batch, the `backward` of each model ends that model's
    /// window, normalised by the micro-batches in which that model had a `backward` (two losses of one model in
    /// one micro-batch count once, as Accelerate divides each of them by the accumulation steps).
    pub fn record_backward(&mut self, model: ModelKey, sync_each_batch: bool) -> BackwardPlan {
        let micro_batch = self.micro_batch;
        let window = self.windows.entry(model).or_default();
        if window.last_micro_batch != Some(micro_batch) {
            window.last_micro_batch = Some(micro_batch);
            window.micro_batches += 1;
        }
        if self.sync_gradients {
            let micro_batches = self.windows.remove(&model).map_or(1, |w| w.micro_batches);
            BackwardPlan::EndWindow { micro_batches }
        } else if sync_each_batch {
            BackwardPlan::SyncOnly
        } else {
            BackwardPlan::Local
        }
    }

    /// Whether the next `backward` of `model` is alone in its window and ends it (no accumulation in progress):
    /// its gradients are then the window's, and may be scaled as they are reduced.
    pub fn next_backward_is_whole_window(&self, model: ModelKey) -> bool {
        self.sync_gradients && !self.windows.contains_key(&model)
    }

    /// Whether an accumulation window holds gradients not yet reduced and applied: some model had a `backward`
    /// since its window last ended.
    pub fn window_open(&self) -> bool {
        !self.windows.is_empty()
    }

    /// The overflow check of `model`'s window end: `true` makes its optimizer skip this step.
    pub fn record_overflow(&mut self, model: ModelKey, overflow: bool) {
        self.overflow.insert(model, overflow);
    }

    /// What the optimizer of `model` does now.
    pub fn verdict(&self, model: ModelKey) -> Verdict {
        let overflow = self.overflow.get(&model).copied().unwrap_or(false);
        match (self.sync_gradients, overflow) {
            (false, _) => Verdict::Accumulate,
            (true, true) => Verdict::Skip,
            (true, false) => Verdict::Step,
        }
    }

    /// The optimizer of `model` acts on its verdict: records whether the step was skipped (unchanged on
    /// accumulation) and forgets the model's overflow check.
    pub fn take_verdict(&mut self, model: ModelKey) -> Verdict {
        let verdict = self.verdict(model);
        if verdict != Verdict::Accumulate {
            self.last_step_skipped = verdict == Verdict::Skip;
            self.overflow.remove(&model);
        }
        verdict
    }

    /// Whether accumulation is configured (more than one micro-batch per step) but no micro-batch was ever
    /// begun, so that every `backward` ends a window and the setting does nothing.
    pub fn accumulation_unused(&self) -> bool {
        self.num_steps > 1 && !self.micro_batches_begun
    }

    /// Whether the latest optimizer step was skipped (fp16 overflow).
    pub fn last_step_skipped(&self) -> bool {
        self.last_step_skipped
    }

    /// Whether the current micro-batch ends the window.
    pub fn sync_gradients(&self) -> bool {
        self.sync_gradients
    }

    /// The public snapshot.
    pub fn snapshot(&self) -> GradientState {
        GradientState {
            sync_gradients: self.sync_gradients,
            end_of_dataloader: self.end_of_dataloader,
            num_steps: self.num_steps,
            remainder: self.remainder,
        }
    }
}

/// The step state and gradients of one rank, behind one lock.
#[derive(Debug)]
pub(crate) struct StepCore {
    /// The window and verdict.
    pub state: StepState,
    /// The gradients accumulated since the last optimizer step.
    pub grads: GradientBuffer,
    /// The time spent in each phase of the steps so far.
    pub phases: super::StepPhases,
}

/// A handle to the step of one rank, cloned into every prepared object of that rank.
#[derive(Debug, Clone)]
pub(crate) struct SharedStep(Arc<Mutex<StepCore>>);

impl SharedStep {
    pub fn new(num_steps: usize) -> Self {
        Self(Arc::new(Mutex::new(StepCore {
            state: StepState::new(num_steps),
            grads: GradientBuffer::new(),
            phases: super::StepPhases::default(),
        })))
    }

    /// Locks the step. A rank's objects are used from one thread, so the lock is never contended; a poisoned
    /// lock (a panic while holding it) is recovered, since the state stays consistent between operations.
    pub fn lock(&self) -> MutexGuard<'_, StepCore> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn snapshot(&self) -> GradientState {
        self.lock().state.snapshot()
    }

    /// The optimizer's side of a step: [`StepOutcome::Apply`] with the gradients of `model` when the window
    /// ended with a step, [`StepOutcome::Accumulate`] when it only accumulated, [`StepOutcome::Skip`] when the
    /// step is skipped (fp16 overflow on some rank: the gradients are dropped then, on every rank alike).
    pub fn take_outcome<M: burn::module::Module>(&self, model: &M) -> StepOutcome {
        let mut core = self.lock();
        let verdict = core.state.take_verdict(model_key(model));
        let grads = match verdict {
            Verdict::Accumulate => return StepOutcome::Accumulate,
            Verdict::Skip | Verdict::Step => core.grads.take_for(model),
        };
        verdict.with(grads)
    }
}

/// What an optimizer does with the current micro-batch, with the gradients it applies: the one answer the
/// prepared optimizer and burn-train's Learner both act on.
#[derive(Debug)]
pub(crate) enum StepOutcome {
    /// Inside an accumulation window: the gradients stay in the window, the model is left as it is.
    Accumulate,
    /// The window ended: apply these gradients.
    Apply(burn::optim::GradientsParams),
    /// The window ended with an fp16 overflow on some rank: its gradients were dropped on every rank.
    Skip,
}

impl StepOutcome {
    /// Whether the window ended (a step was applied or skipped): every rank is at the same point then.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub fn ends_window(&self) -> bool {
        !matches!(self, StepOutcome::Accumulate)
    }
}

impl Verdict {
    /// The outcome of this verdict for gradients `grads` (dropped unless the verdict is a step).
    pub(crate) fn with(self, grads: burn::optim::GradientsParams) -> StepOutcome {
        match self {
            Verdict::Accumulate => StepOutcome::Accumulate,
            Verdict::Skip => {
                log::debug!("optimizer step skipped: gradients overflowed in fp16");
                StepOutcome::Skip
            }
            Verdict::Step => StepOutcome::Apply(grads),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_of_three_with_an_epoch_ending_early() {
        let mut s = StepState::new(3);
        s.begin_epoch(5, Some(1));
        let mut decisions = Vec::new();
        for batch in 0..5 {
            s.batch_yielded(batch == 4);
            decisions.push(s.begin_micro_batch());
            let plan = s.record_backward(None, false);
            assert_eq!(
                matches!(plan, BackwardPlan::EndWindow { .. }),
                decisions[batch]
            );
        }
        // Windows: 3 micro-batches, then 2 cut short by the end of the dataloader.
        assert_eq!(decisions, vec![false, false, true, false, true]);
    }

    #[test]
    fn end_window_counts_the_backward_calls_it_had() {
        let mut s = StepState::new(4);
        s.begin_micro_batch();
        assert_eq!(s.record_backward(None, false), BackwardPlan::Local);
        s.begin_micro_batch();
        assert_eq!(s.record_backward(None, true), BackwardPlan::SyncOnly);
        s.batch_yielded(true);
        s.begin_micro_batch();
        assert_eq!(
            s.record_backward(None, false),
            BackwardPlan::EndWindow { micro_batches: 3 }
        );
    }

    #[test]
    fn each_model_counts_its_own_window() {
        // Two models alternating (a GAN's discriminator and generator), two micro-batches per step: each model's
        // window holds its own two micro-batches, whatever the other did.
        let (a, b) = (Some(ParamId::new()), Some(ParamId::new()));
        let mut s = StepState::new(2);
        for _ in 0..2 {
            s.begin_micro_batch();
            assert_eq!(s.record_backward(a, false), BackwardPlan::Local);
            assert_eq!(s.record_backward(b, false), BackwardPlan::Local);
            s.begin_micro_batch();
            assert!(s.next_backward_is_whole_window(None));
            assert!(!s.next_backward_is_whole_window(a));
            assert_eq!(
                s.record_backward(a, false),
                BackwardPlan::EndWindow { micro_batches: 2 }
            );
            assert_eq!(
                s.record_backward(b, false),
                BackwardPlan::EndWindow { micro_batches: 2 }
            );
        }
        // Two losses of one model in one micro-batch count once, as Accelerate divides each by the steps.
        s.begin_micro_batch();
        s.record_backward(a, false);
        s.record_backward(a, false);
        s.begin_micro_batch();
        assert_eq!(
            s.record_backward(a, false),
            BackwardPlan::EndWindow { micro_batches: 2 }
        );
    }

    #[test]
    fn one_record_of_skipped_steps() {
        let mut s = StepState::new(2);
        s.begin_micro_batch();
        assert_eq!(s.take_verdict(None), Verdict::Accumulate);
        s.begin_micro_batch();
        s.record_overflow(None, true);
        assert_eq!(s.take_verdict(None), Verdict::Skip);
        assert!(s.last_step_skipped());
        s.begin_micro_batch();
        assert_eq!(s.take_verdict(None), Verdict::Accumulate);
        assert!(s.last_step_skipped(), "kept through the next window");
        s.begin_micro_batch();
        s.record_overflow(None, false);
        assert_eq!(s.take_verdict(None), Verdict::Step);
        assert!(!s.last_step_skipped());
    }

    #[test]
    fn each_model_takes_its_own_overflow_verdict() {
        let (a, b) = (Some(ParamId::new()), Some(ParamId::new()));
        let mut s = StepState::new(1);
        s.begin_micro_batch();
        // Model a's gradients overflowed, model b's did not; b's check came last.
        s.record_overflow(a, true);
        s.record_overflow(b, false);
        assert_eq!(s.take_verdict(a), Verdict::Skip);
        assert_eq!(s.take_verdict(b), Verdict::Step);
        s.begin_micro_batch();
        s.record_overflow(b, false);
        assert_eq!(
            s.take_verdict(a),
            Verdict::Step,
            "a's overflow was for its last window"
        );
    }
}
