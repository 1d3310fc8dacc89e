//! The prepared optimizer and learning-rate scheduler.
//!
//! [`AcceleratedOptimizer`] takes its gradients from the accelerator (filled by
//! [`Accelerator::backward`](crate::Accelerator::backward)) and does nothing on steps that do not synchronise
//! gradients. [`AcceleratedScheduler`] follows Accelerate's `step_scheduler_with_optimizer` rule: it advances only
//! when the optimizer really stepped, as many times per step as the [`SchedulerRule`](crate::SchedulerRule) says (once by default;
//! `num_processes` times unless batches are split under [`SchedulerRule::Accelerate`](crate::SchedulerRule::Accelerate)).
//!
//! [`FusedAdamWConfig`] makes an AdamW that steps each parameter in one pass on the CPU (Flex), with the results
//! and checkpoints of Burn's.

mod fused_adamw;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::LearningRate;
use burn::optim::ModuleOptimizer;

use crate::distributed::strategy::{Placed, Strategy, prepare_step, share_stepped};
use crate::error::Result;
use crate::grad::window::{SharedStep, StepOutcome};

pub use fused_adamw::{FusedAdamW, FusedAdamWConfig, FusedAdamWUpdates};

/// The learning rate an optimizer uses, shared with the scheduler that drives it.
#[derive(Clone)]
struct LrCell(Arc<Mutex<ModuleLearningRate>>);

impl LrCell {
    fn get(&self) -> ModuleLearningRate {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn set(&self, lr: ModuleLearningRate) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = lr;
    }
}

/// A Burn optimizer prepared by the [`Accelerator`](crate::Accelerator).
///
/// Call [`step`](Self::step) once per micro-batch, after `accelerator.backward(...)`: on steps that synchronise
/// gradients it applies the stored gradients and clears them; on accumulation steps it returns the model
/// unchanged.
pub struct AcceleratedOptimizer {
    inner: ModuleOptimizer,
    lr: LrCell,
    shared: SharedStep,
    strategy: Arc<dyn Strategy>,
    steps: u64,
    kind: Option<String>,
    /// The kind of an optimizer that needs each parameter whole (LAMB, Adafactor, Muon, L-BFGS), checked against
    /// the strategy at each step.
    whole_tensor_kind: Option<String>,
    /// The files a restored state is read from as each tensor is first used (a CPU backend adopts a record's
    /// file-backed bytes as they are): kept while this optimizer may still read them.
    backing: Vec<crate::fs::Scratch>,
}

/// Burn's optimizers whose update needs a parameter whole: a trust ratio over the tensor (LAMB), factored second
/// moments (Adafactor), an orthogonalised update (Muon), a line search over every parameter (L-BFGS).
const WHOLE_TENSOR_OPTIMIZERS: [&str; 4] = ["Lamb", "Adafactor", "Muon", "Lbfgs"];

/// The name of the optimizer type `type_name` when it is one of [`WHOLE_TENSOR_OPTIMIZERS`].
pub(crate) fn whole_tensor_kind(type_name: &str) -> Option<String> {
    WHOLE_TENSOR_OPTIMIZERS
        .iter()
        .find(|k| type_name.contains(*k))
        .map(|k| k.to_string())
}

/// The optimizer's kind from the type handed to `prepare_optimizer` (`Adam`, `Sgd`, ...), or `None` for an
/// already type-erased `ModuleOptimizer`.
pub(crate) fn optimizer_kind(type_name: &str) -> Option<String> {
    let base = type_name.split('<').next().unwrap_or(type_name);
    let kind = base.rsplit("::").next().unwrap_or(base);
    (kind != "ModuleOptimizer" && !kind.is_empty()).then(|| kind.to_string())
}

impl AcceleratedOptimizer {
    pub(crate) fn new(
        inner: ModuleOptimizer,
        lr: ModuleLearningRate,
        shared: SharedStep,
        strategy: Arc<dyn Strategy>,
        (kind, whole_tensor_kind): (Option<String>, Option<String>),
    ) -> Self {
        Self {
            inner,
            lr: LrCell(Arc::new(Mutex::new(lr))),
            shared,
            strategy,
            steps: 0,
            kind,
            whole_tensor_kind,
            backing: Vec::new(),
        }
    }

    /// The optimizer's kind (`Adam`, `Sgd`, ...), when `prepare_optimizer` was given a typed optimizer; a
    /// checkpoint records it, and `load_state` refuses to restore one kind's state into another.
    pub fn kind(&self) -> Option<&str> {
        self.kind.as_deref()
    }

    /// Applies the accumulated gradients of `model` and returns the updated model; on a step that does not
    /// synchronise gradients, returns `model` unchanged and keeps the gradients for later.
    ///
    /// A model without stored gradients (no `backward` since the last step) is returned unchanged, like
    /// `torch.optim.Optimizer.step` with no `.grad`.
    ///
    /// # Panics
    /// Only under a strategy whose ranks step their slices of the parameters and then exchange them, when that exchange
    /// fails (a rank died, a timeout); [`try_step`](Self::try_step) returns that error instead. Data-parallel
    /// and single-device runs exchange nothing after the step.
    pub fn step<M: Module>(&mut self, model: M) -> M {
        self.try_step(model)
            .unwrap_or_else(|e| panic!("optimizer step: {e}; use `try_step` to handle this error"))
    }

    /// [`step`](Self::step), returning the error of a failed parameter exchange instead of panicking.
    ///
    /// # Errors
    /// The exchange of stepped parameters between ranks failed (sharded strategies only).
    pub fn try_step<M: Module>(&mut self, model: M) -> Result<M> {
        let grads = match self.shared.take_outcome(&model) {
            StepOutcome::Apply(grads) => grads,
            StepOutcome::Accumulate | StepOutcome::Skip => return Ok(model),
        };
        let started = Instant::now();
        let stepped = !grads.is_empty();
        if let Some(kind) = &self.whole_tensor_kind {
            self.strategy.check_optimizer(kind)?;
        }
        // Each parameter in the shape of its gradient (a rank's slice, under a sharded strategy).
        let model = prepare_step(self.strategy.as_ref(), model)?;
        let model = if stepped {
            self.inner.step(self.lr.get(), model, grads)
        } else {
            model
        };
        // Every rank hands its model to the strategy, even one that stepped nothing: a sharded rank that owns no
        // parameter (fewer parameters than ranks) takes part in its peers' exchange of stepped parameters.
        let (model, counted) = match share_stepped(self.strategy.as_ref(), model)? {
            Placed::Changed(model) => (model, true),
            Placed::Untouched(model) => {
                if !stepped {
                    log::debug!("optimizer step without gradients: the model is unchanged");
                }
                (model, stepped)
            }
        };
        if counted {
            self.steps += 1;
            let mut core = self.shared.lock();
            core.phases.steps += 1;
            core.phases.optimizer += started.elapsed();
        }
        Ok(model)
    }

    /// Drops every stored gradient (Burn's optimizer consumes them at each step, so this is only needed to
    /// discard gradients on purpose). The same as [`Accelerator::zero_grad`](crate::Accelerator::zero_grad),
    /// where Accelerate users expect it.
    pub fn zero_grad(&mut self) {
        self.shared.lock().grads.clear();
    }

    /// The learning rate the next step uses (the base rate when there are parameter groups).
    pub fn lr(&self) -> LearningRate {
        self.lr.get().base()
    }

    /// Sets the learning rate used by the next steps (a prepared scheduler overwrites it when it steps).
    pub fn set_lr(&mut self, lr: impl Into<ModuleLearningRate>) {
        self.lr.set(lr.into());
    }

    /// Whether the latest synchronising step was skipped (fp16 overflow).
    pub fn step_was_skipped(&self) -> bool {
        self.shared.lock().state.last_step_skipped()
    }

    /// How many times the optimizer really updated the model.
    pub fn num_steps(&self) -> u64 {
        self.steps
    }

    /// Restores a saved optimizer state (see [`LoadedState::optimizer`](crate::checkpoint::LoadedState)), whose
    /// tensors may be read from `backing` as they are first used: the file is kept with the optimizer, so that
    /// restoring costs no copy of the state.
    ///
    /// # Panics
    /// Burn's `load_record` panics on some malformed records; the caller catches that.
    pub(crate) fn restore(
        &mut self,
        record: burn::optim::OptimizerRecord,
        steps: u64,
        backing: Option<crate::fs::Scratch>,
    ) {
        self.inner = self.inner.clone().load_record(record);
        self.steps = steps;
        self.backing.extend(backing);
    }

    /// How many state tensors this optimizer takes of `record` (Burn drops, without a word, the states it cannot
    /// rebuild: another kind of optimizer's), tried on a copy of it.
    ///
    /// # Panics
    /// Burn's `load_record` panics on some malformed records; the caller catches that.
    pub(crate) fn takes(&self, record: burn::optim::OptimizerRecord) -> usize {
        self.inner.clone().load_record(record).to_record().len()
    }

    /// Bytes of the optimizer state tensors this rank holds (Adam's two moments of every slice it steps, ...), as
    /// a checkpoint saves them, without the records' headers: under a sharded strategy, this rank's share.
    /// It serialises the state to count it: a measurement, not something to call every step.
    ///
    /// # Errors
    /// Burn could not serialise the state.
    pub fn state_bytes(&self) -> Result<usize> {
        let bytes = self
            .inner
            .to_record()
            .into_bytes()
            .map_err(crate::error::Error::other)?;
        let tensors = burn_pack::Reader::from_bytes(bytes)
            .and_then(|reader| reader.into_tensors())
            .map_err(crate::error::Error::other)?;
        Ok(tensors.iter().map(burn_pack::Tensor::byte_len).sum())
    }

    /// The parameters this rank holds optimizer state for (Adam's moments, SGD's momentum), each once, in id
    /// order: a frozen parameter (`Module::no_grad`) is never among them, and under a sharded strategy only the
    /// parameters whose slices this rank steps are. Like [`state_bytes`](Self::state_bytes), it serialises the
    /// state: a check, not something to call every step.
    ///
    /// # Errors
    /// Burn could not serialise the state.
    pub fn state_params(&self) -> Result<Vec<burn::module::ParamId>> {
        let bytes = self
            .inner
            .to_record()
            .into_bytes()
            .map_err(crate::error::Error::other)?;
        let tensors = burn_pack::Reader::from_bytes(bytes)
            .and_then(|reader| reader.into_tensors())
            .map_err(crate::error::Error::other)?;
        let mut ids = Vec::with_capacity(tensors.len());
        for tensor in tensors {
            let (_, _, _, id, _) = tensor.into_parts().map_err(crate::error::Error::other)?;
            ids.extend(id);
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(ids.into_iter().map(burn::module::ParamId::from).collect())
    }

    /// The wrapped Burn optimizer.
    pub fn inner(&self) -> &ModuleOptimizer {
        &self.inner
    }

    /// Gives the wrapped Burn optimizer back.
    pub fn into_inner(self) -> ModuleOptimizer {
        if !self.backing.is_empty() {
            // A restored state's tensors not yet used are read in before their file goes.
            let _ = self.inner.to_record();
        }
        self.inner
    }
}

/// How a prepared scheduler advances.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SchedulerPolicy {
    /// Advance only when the optimizer really stepped (`step_scheduler_with_optimizer`).
    pub step_with_optimizer: bool,
    /// Scheduler steps per optimizer step ([`SchedulerRule::steps_per_optimizer_step`](crate::SchedulerRule::steps_per_optimizer_step)).
    pub steps_per_optimizer_step: usize,
}

/// A Burn learning-rate scheduler prepared by the [`Accelerator`](crate::Accelerator) and tied to one optimizer.
///
/// Call [`step`](Self::step) after each `optimizer.step(...)`, as with Accelerate. When
/// `step_scheduler_with_optimizer` is on (the default) it advances only on steps where the optimizer really
/// stepped (not on accumulation steps, not on skipped fp16 steps), as many times per step as the
/// [`SchedulerRule`](crate::SchedulerRule) says: once by default, `num_processes` times unless `split_batches` is on under
/// [`SchedulerRule::Accelerate`](crate::SchedulerRule::Accelerate). When it is off, every call advances it once.
pub struct AcceleratedScheduler {
    inner: ModuleLrScheduler,
    /// The scheduler as it was before it produced `last`: what a checkpoint saves, so that a restore
    /// recomputes `last` exactly.
    before_last: ModuleLrScheduler,
    lr: LrCell,
    shared: SharedStep,
    rule: SchedulerPolicy,
    last: ModuleLearningRate,
}

impl AcceleratedScheduler {
    pub(crate) fn new(
        mut inner: ModuleLrScheduler,
        optimizer: &AcceleratedOptimizer,
        shared: SharedStep,
        rule: SchedulerPolicy,
    ) -> Self {
        // Burn's schedulers return the rate of the coming step; the first value is the initial rate, which a
        // torch scheduler sets on its optimizer when it is created.
        let before_last = inner.clone();
        let last = inner.step();
        optimizer.lr.set(last.clone());
        Self {
            before_last,
            inner,
            lr: optimizer.lr.clone(),
            shared,
            rule,
            last,
        }
    }

    /// Advances the schedule according to the rule above and hands the new rate to the optimizer.
    pub fn step(&mut self) {
        let times = if !self.rule.step_with_optimizer {
            1
        } else {
            let core = self.shared.lock();
            if !core.state.sync_gradients() || core.state.last_step_skipped() {
                return;
            }
            self.rule.steps_per_optimizer_step
        };
        for _ in 0..times {
            self.before_last = self.inner.clone();
            self.last = self.inner.step();
        }
        self.lr.set(self.last.clone());
    }

    /// The state a checkpoint saves.
    pub fn record(&self) -> burn::lr_scheduler::LrSchedulerRecord {
        self.before_last.to_record()
    }

    /// Restores a saved state and hands the restored rate to the optimizer.
    pub(crate) fn restore(&mut self, record: burn::lr_scheduler::LrSchedulerRecord) {
        self.before_last = self.before_last.clone().load_record(record);
        self.inner = self.before_last.clone();
        self.last = self.inner.step();
        self.lr.set(self.last.clone());
    }

    /// The current learning rate (Accelerate's `get_last_lr()[0]`).
    pub fn lr(&self) -> LearningRate {
        self.last.base()
    }

    /// The wrapped Burn scheduler.
    pub fn inner(&self) -> &ModuleLrScheduler {
        &self.inner
    }

    /// Gives the wrapped Burn scheduler back.
    pub fn into_inner(self) -> ModuleLrScheduler {
        self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulerRule;
    use crate::grad::window::Verdict;
    use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
    use burn::optim::SgdConfig;

    /// Accelerate's `test_scheduler.py` schedule: lr = 1 - n/10, a linear decay from 1 to 0 over 10 steps.
    /// The step state accumulates over 2 micro-batches, so that tests can drive accumulation steps.
    fn setup(rule: SchedulerPolicy) -> (SharedStep, AcceleratedOptimizer, AcceleratedScheduler) {
        let shared = SharedStep::new(2);
        let optimizer = AcceleratedOptimizer::new(
            SgdConfig::new().init(),
            123.0.into(),
            shared.clone(),
            std::sync::Arc::new(crate::distributed::strategy::SingleDevice),
            (None, None),
        );
        let schedule = LinearLrSchedulerConfig::new(1.0, 0.0, 10).init().unwrap();
        let scheduler = AcceleratedScheduler::new(schedule, &optimizer, shared.clone(), rule);
        (shared, optimizer, scheduler)
    }

    /// Accelerate's rule on `num_processes` ranks.
    fn rule(
        num_processes: usize,
        split_batches: bool,
        step_with_optimizer: bool,
    ) -> SchedulerPolicy {
        SchedulerPolicy {
            step_with_optimizer,
            steps_per_optimizer_step: SchedulerRule::Accelerate
                .steps_per_optimizer_step(num_processes, split_batches),
        }
    }

    #[test]
    fn the_default_rule_steps_once_per_optimizer_step_on_any_number_of_ranks() {
        for p in [1, 2, 4] {
            let steps = SchedulerRule::default().steps_per_optimizer_step(p, false);
            let (_, optimizer, mut scheduler) = setup(SchedulerPolicy {
                step_with_optimizer: true,
                steps_per_optimizer_step: steps,
            });
            scheduler.step();
            assert!(close(scheduler.lr(), 0.9), "P={p}: {}", scheduler.lr());
            assert!(close(optimizer.lr(), 0.9), "the optimizer follows");
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn preparing_sets_the_initial_rate_on_the_optimizer() {
        let (_, optimizer, scheduler) = setup(rule(1, false, true));
        assert!(close(optimizer.lr(), 1.0));
        assert!(close(scheduler.lr(), 1.0));
    }

    #[test]
    fn accelerates_rule_steps_num_processes_times_per_optimizer_step() {
        for p in [1, 2, 4] {
            let (_, optimizer, mut scheduler) = setup(rule(p, false, true));
            scheduler.step();
            let expected = 1.0 - p as f64 / 10.0;
            assert!(close(scheduler.lr(), expected), "P={p}: {}", scheduler.lr());
            assert!(close(optimizer.lr(), expected), "the optimizer follows");
        }
    }

    #[test]
    fn split_batches_steps_once() {
        let (_, _, mut scheduler) = setup(rule(4, true, true));
        scheduler.step();
        assert!(close(scheduler.lr(), 0.9));
    }

    #[test]
    fn not_stepping_with_optimizer_steps_every_call() {
        let (shared, _, mut scheduler) = setup(rule(4, false, false));
        assert!(
            !shared.lock().state.begin_micro_batch(),
            "an accumulation step"
        );
        scheduler.step();
        scheduler.step();
        assert!(close(scheduler.lr(), 0.8));
    }

    #[test]
    fn no_step_on_accumulation_or_skipped_steps() {
        let (shared, optimizer, mut scheduler) = setup(rule(2, false, true));
        assert!(!shared.lock().state.begin_micro_batch());
        scheduler.step();
        assert!(close(scheduler.lr(), 1.0), "accumulation step");
        let verdict = |overflow: bool| {
            let state = &mut shared.lock().state;
            state.record_overflow(None, overflow);
            state.take_verdict(None)
        };
        assert!(shared.lock().state.begin_micro_batch());
        assert_eq!(verdict(true), Verdict::Skip);
        assert!(optimizer.step_was_skipped());
        scheduler.step();
        assert!(close(scheduler.lr(), 1.0), "skipped optimizer step");
        assert_eq!(verdict(false), Verdict::Step);
        scheduler.step();
        assert!(close(scheduler.lr(), 0.8));
    }

    #[test]
    fn schedule_sized_for_single_process_ends_after_fewer_steps() {
        // Accelerate's accumulation_test: a 10-step schedule on P=2 reaches its end after 5 optimizer steps.
        let (_, _, mut scheduler) = setup(rule(2, false, true));
        for _ in 0..4 {
            scheduler.step();
            assert!(scheduler.lr() > 0.0);
        }
        scheduler.step();
        assert!(close(scheduler.lr(), 0.0));
    }

    #[test]
    fn optimizer_does_nothing_on_accumulation_steps() {
        use burn::nn::LinearConfig;
        use burn::tensor::{Device, Tensor};
        let device = Device::default().autodiff();
        let model = LinearConfig::new(2, 1).init(&device);
        let shared = SharedStep::new(2);
        let mut optimizer = AcceleratedOptimizer::new(
            SgdConfig::new().init(),
            0.5.into(),
            shared.clone(),
            std::sync::Arc::new(crate::distributed::strategy::SingleDevice),
            (None, None),
        );
        let loss = model.forward(Tensor::<2>::ones([1, 2], &device)).sum();
        let mut grads = loss.backward();
        shared.lock().grads.collect(&model, &mut grads);
        assert!(!shared.lock().state.begin_micro_batch());
        let before = model.weight.val().into_data();
        let model = optimizer.step(model);
        assert_eq!(model.weight.val().into_data(), before);
        assert_eq!(
            shared.lock().grads.len(),
            2,
            "gradients are kept for the sync step"
        );
        assert!(shared.lock().state.begin_micro_batch());
        let model = optimizer.step(model);
        assert_ne!(model.weight.val().into_data(), before);
        assert!(shared.lock().grads.is_empty());
        assert_eq!(optimizer.num_steps(), 1);
    }
}
