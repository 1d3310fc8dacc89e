//! Cutting an autodiff graph by hand, for the parallelisms whose collectives sit inside a model's forward pass
//! (tensor parallelism's regions, context parallelism's attention): Burn has no custom autograd, so a tensor that
//! enters such a segment is detached into fresh leaves, the backward pass from the loss stops there, and the
//! segment's backward half (a collective on the gradient, a hand-written backward) runs afterwards as one pass
//! more, from the tensors that entered.
//!
//! The forward pass records each cut on this thread's tape ([`record`]); [`backward`] back-propagates the loss,
//! then finishes the cuts in reverse order, each taking its leaves' gradients from the passes so far ([`Passes`])
//! and back-propagating from where it began ([`Roots`]). A parameter's gradient is the sum of its gradients in
//! every pass. The regions' stack ([`enter`], [`in_region`]) says whether the forward pass is inside a segment
//! whose residual was cut too: every tensor that crosses a cut must go through it, or the earlier graph would be
//! walked twice, which Burn cannot.

use std::cell::RefCell;

use burn::module::Param;
use burn::tensor::{Gradients, Tensor};

use crate::error::{Error, Result};
use crate::grad::GradSource;

thread_local! {
    static TAPE: RefCell<Vec<Box<dyn Pending>>> = const { RefCell::new(Vec::new()) };
    /// The regions the forward pass is inside, innermost last: whether a split layer ran in each.
    static REGIONS: RefCell<Vec<bool>> = const { RefCell::new(Vec::new()) };
    static MISUSE: RefCell<Option<String>> = const { RefCell::new(None) };
    /// A check of the forward pass before each backward pass: a parallelism that needs the model to route
    /// something through it says so when it did not.
    static CHECK: std::cell::Cell<Option<Check>> = const { std::cell::Cell::new(None) };
}

/// A check of the forward pass: what is wrong with it, if anything.
pub(crate) type Check = fn() -> Option<String>;

/// Sets the check [`backward`] runs first on this thread (`None`: none).
pub(crate) fn set_backward_check(check: Option<Check>) {
    CHECK.with(|c| c.set(check));
}

/// `t`'s values without any graph: a constant of the autodiff device. Unlike `detach`, which keeps a parameter's
/// (or a tracked result's) `require_grad` on the detached copy (so the operations on it are recorded, and keep
/// what they read until a backward pass), nothing computed from it is tracked unless it meets a tracked tensor.
pub(crate) fn constant<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    Tensor::from_inner(t.inner())
}

/// A fresh leaf of `t`'s values that requires a gradient: where a cut hands a tensor on.
pub(crate) fn leaf<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    constant(t).require_grad()
}

/// The backward half of one cut, finished by [`backward`].
pub(crate) trait Pending {
    /// Whether a split layer ran in the region the cut opened (see [`cut_around`]).
    fn split(&mut self, split: bool) {
        let _ = split;
    }

    /// Takes the gradients of the cut's leaves from `passes` and back-propagates from where the cut began, as one
    /// pass more of `passes`.
    ///
    /// # Errors
    /// A collective's failure.
    fn finish(self: Box<Self>, passes: &mut Passes) -> Result<()>;
}

/// Whether this thread's forward pass is inside a region ([`enter`]).
pub(crate) fn in_region() -> bool {
    REGIONS.with(|r| !r.borrow().is_empty())
}

/// A split layer ran: the innermost region's input gradient is a part on each rank, to be summed.
pub(crate) fn split_ran() {
    REGIONS.with(|r| {
        if let Some(top) = r.borrow_mut().last_mut() {
            *top = true;
        }
    });
}

/// Says, at the next backward pass, that something ran where it needs a region (or a setting) it lacks.
pub(crate) fn misused(message: String) {
    MISUSE.with(|m| {
        let mut m = m.borrow_mut();
        if m.is_none() {
            *m = Some(message);
        }
    });
}

/// Runs `f` as a region; returns its output and whether a split layer ran in it.
pub(crate) fn enter<T>(f: impl FnOnce() -> T) -> (T, bool) {
    REGIONS.with(|r| r.borrow_mut().push(false));
    let out = f();
    let split = REGIONS.with(|r| r.borrow_mut().pop().unwrap_or(false));
    (out, split)
}

/// Records `cut` before its region runs (a cut inside it is then finished first in the backward pass), and
/// after it whether a split layer ran in the region.
pub(crate) fn cut_around<T>(cut: Box<dyn Pending>, f: impl FnOnce() -> T) -> (T, bool) {
    let index = TAPE.with(|t| {
        let mut t = t.borrow_mut();
        t.push(cut);
        t.len() - 1
    });
    let (out, split) = enter(f);
    TAPE.with(|t| {
        if let Some(cut) = t.borrow_mut().get_mut(index) {
            cut.split(split);
        }
    });
    (out, split)
}

/// Records `cut` on this thread's tape, to be finished by the next [`backward`] (before the cuts recorded earlier).
pub(crate) fn record(cut: Box<dyn Pending>) {
    TAPE.with(|t| t.borrow_mut().push(cut));
}

/// The cuts recorded so far, taken off the tape: a backward pass of what came after them leaves them for the pass
/// that reaches them ([`restore_tape`]).
pub(crate) fn take_tape() -> Tape {
    Tape(TAPE.with(|t| std::mem::take(&mut *t.borrow_mut())))
}

/// Puts cuts [`take_tape`] took back on the tape, for the next [`backward`].
pub(crate) fn restore_tape(tape: Tape) {
    TAPE.with(|t| {
        let mut t = t.borrow_mut();
        let later = std::mem::replace(&mut *t, tape.0);
        t.extend(later);
    });
}

/// Cuts taken off the tape.
#[derive(Default)]
pub(crate) struct Tape(Vec<Box<dyn Pending>>);

/// Runs `f`, a pass no backward pass follows (an evaluation, a value-only pass whose graph is made anew later),
/// leaving the tape as it was: the cuts `f` records are dropped.
pub(crate) fn without_cuts<T>(f: impl FnOnce() -> T) -> T {
    let pending = take_tape();
    let out = f();
    drop(take_tape());
    restore_tape(pending);
    out
}

/// The terms one cut back-propagates together, as one pass: `(tensor * its gradient).sum()` of each tensor that
/// gets a gradient from the cut.
#[derive(Default)]
pub(crate) struct Roots(Option<Tensor<1>>);

impl Roots {
    /// Adds the term of `tensor` with the gradient `grad`, where `tensor` has a graph to back-propagate.
    pub fn add<const D: usize>(&mut self, tensor: Tensor<D>, grad: Tensor<D>) {
        if tensor.is_tracked() {
            let term = (tensor * grad).sum();
            self.0 = Some(match self.0.take() {
                Some(r) => r + term,
                None => term,
            });
        }
    }

    /// Back-propagates the terms, as one pass more of `passes`.
    pub fn backward_into(self, passes: &mut Passes) {
        if let Some(root) = self.0 {
            passes.list.push(root.backward());
        }
    }
}

/// The gradients of one backward pass and of each cut's pass after it; a parameter's gradient is the sum of its
/// gradients in each.
pub(crate) struct Passes {
    list: Vec<Gradients>,
}

impl Passes {
    /// The sum of `t`'s gradients in every pass (removed from them), if any pass reached it.
    pub(crate) fn remove<const D: usize>(&mut self, t: &Tensor<D>) -> Option<Tensor<D>> {
        self.list
            .iter_mut()
            .filter_map(|g| t.grad_remove(g))
            .reduce(|a, b| a + b)
    }

    /// [`remove`](Self::remove), zeros of `t`'s shape where no pass reached it: for a gradient a collective
    /// carries, which every rank of the group must take part in.
    pub(crate) fn remove_or_zeros<const D: usize>(&mut self, t: &Tensor<D>) -> Tensor<D> {
        self.remove(t)
            .unwrap_or_else(|| constant(t.clone()).zeros_like())
    }
}

impl GradSource for Passes {
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Option<Tensor<D>> {
        let value = param.val();
        self.remove(&value)
    }
}

/// Back-propagates `root`, then every cut this thread's forward pass recorded since the last backward, latest
/// first, as the module's documentation says. Without cuts this is `root.backward()`.
///
/// # Errors
/// Something that ran where it needs a region or a setting it lacks ([`misused`]); a cut's failure.
pub(crate) fn backward<const D: usize>(root: Tensor<D>) -> Result<Passes> {
    let cuts = TAPE.with(|t| std::mem::take(&mut *t.borrow_mut()));
    if let Some(message) = MISUSE.with(|m| m.borrow_mut().take()) {
        return Err(Error::InvalidArgument(message));
    }
    if let Some(message) = CHECK.with(std::cell::Cell::get).and_then(|check| check()) {
        return Err(Error::InvalidArgument(message));
    }
    let mut passes = Passes {
        list: vec![root.backward()],
    };
    for cut in cuts.into_iter().rev() {
        cut.finish(&mut passes)?;
    }
    Ok(passes)
}

/// A cut whose leaves' gradients go back as they are (no collective): the residual around a segment another cut
/// opens inside it, so that every tensor crossing into the later graph goes through a cut.
pub(crate) struct Kept<const D: usize> {
    /// Each tensor that crosses the cut, with the leaf made of it.
    pub parts: Vec<(Tensor<D>, Tensor<D>)>,
}

impl<const D: usize> Pending for Kept<D> {
    fn finish(self: Box<Self>, passes: &mut Passes) -> Result<()> {
        let mut roots = Roots::default();
        for (source, leaf) in self.parts {
            if let Some(grad) = passes.remove(&leaf) {
                roots.add(source, grad);
            }
        }
        roots.backward_into(passes);
        Ok(())
    }
}
