//! Megatron's *f* and *g* without custom autograd: where a tensor-parallel region begins, the graph is cut by hand
//! and the gradient at the cut is all-reduced over the group in the backward pass; where it ends, the partial
//! results are all-reduced in the forward pass with an identity gradient.
//!
//! A cut detaches the tensor entering a region into fresh leaves, so that the backward pass from the loss stops
//! there: [`residual`](super::residual) gives the region one leaf and the residual path around it another (every
//! tensor that crosses the cut goes through it, the residual included, or the earlier graph would be walked twice,
//! which Burn cannot); [`region`](super::region) gives the region the only one. The forward pass records each cut
//! on this thread's tape; [`backward`] then back-propagates the loss, and the cuts in reverse order: each leaf's
//! gradient taken from the passes so far, the region's summed over the group (*f*: every rank's columns
//! contributed a part of it), the residual's kept as it is (every rank holds all of it), their sum
//! back-propagated from the tensor that entered, as one pass more. *g* needs no cut: `all_reduce(y) + (y - y)`,
//! the second `y` a constant, has the reduced value, bit for bit, and the identity gradient.

use std::cell::RefCell;

use burn::module::Param;
use burn::tensor::{Gradients, Tensor};

use super::context::{TpContext, current};
use crate::error::{Error, Result};
use crate::grad::GradSource;

thread_local! {
    static TAPE: RefCell<Vec<Box<dyn PendingCut>>> = const { RefCell::new(Vec::new()) };
    /// The regions the forward pass is inside, innermost last: whether a split layer ran in each.
    static REGIONS: RefCell<Vec<bool>> = const { RefCell::new(Vec::new()) };
    static MISUSE: RefCell<Option<String>> = const { RefCell::new(None) };
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

/// The tensor-parallel group of this thread when it has more than one rank.
pub(crate) fn group() -> Option<std::sync::Arc<TpContext>> {
    current().filter(|c| c.size > 1)
}

/// Whether this thread's forward pass is inside a tensor-parallel region ([`residual`](super::residual) or
/// [`region`](super::region)).
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

/// Says, at the next backward pass, that a module ran where it needs a region around it.
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

/// Records `cut` before its region runs (a region inside it is then finished first in the backward pass), and
/// after it whether the region's gradient is a part to sum: a region of whole layers (a plan that keeps them
/// whole) gives every rank the whole gradient already.
pub(crate) fn cut_around<T>(cut: Box<dyn PendingCut>, f: impl FnOnce() -> T) -> (T, bool) {
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
pub(crate) fn record(cut: Box<dyn PendingCut>) {
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
pub(crate) struct Tape(Vec<Box<dyn PendingCut>>);

/// Runs `f`, a pass no backward pass follows (an evaluation, a value-only pass whose graph is made anew later),
/// leaving the tape as it was: the cuts `f` records are dropped.
pub(crate) fn without_cuts<T>(f: impl FnOnce() -> T) -> T {
    let pending = take_tape();
    let out = f();
    drop(take_tape());
    restore_tape(pending);
    out
}

/// The group of a split layer's forward pass. A split layer on a thread without its group (one that created no
/// accelerator, among several in-process ranks) would compute a part as if it were the whole: it stops there.
pub(crate) fn group_of_split(operation: &str) -> std::sync::Arc<TpContext> {
    group().unwrap_or_else(|| {
        panic!(
            "tensor parallelism: {operation} of a split layer ran on a thread without its tensor-parallel group \
             (the thread that created the Accelerator has it): run the model there, or gather it whole first with \
             `accelerator.unshard(&model)`"
        )
    })
}

/// *g*: the partial results `y` of every rank of the group summed, with the identity gradient.
pub(crate) fn reduce_from_region<const D: usize>(
    y: Tensor<D>,
    operation: &'static str,
) -> Tensor<D> {
    let ctx = group_of_split(operation);
    match ctx.all_reduce_sum(constant(y.clone()), operation) {
        Ok(sum) if y.is_tracked() => sum + (y.clone() - constant(y)),
        Ok(sum) => sum,
        Err(e) => {
            // A forward pass cannot fail: the next backward pass does, with the collective's error.
            misused(format!("tensor parallelism: {operation} failed: {e}"));
            y
        }
    }
}

/// Every rank's columns `y` (split along `dim`) gathered whole, each rank's gradient its own columns'.
pub(crate) fn gather_from_region<const D: usize>(
    y: Tensor<D>,
    dim: usize,
    operation: &'static str,
) -> Tensor<D> {
    let ctx = group_of_split(operation);
    let whole = match ctx.all_gather(constant(y.clone()), dim, operation) {
        Ok(whole) => whole,
        Err(e) => {
            misused(format!("tensor parallelism: {operation} failed: {e}"));
            let mut parts = vec![constant(y.clone()).zeros_like(); ctx.size];
            parts[ctx.rank] = constant(y.clone());
            Tensor::cat(parts, dim)
        }
    };
    if !y.is_tracked() {
        return whole;
    }
    // The local columns' graph at their place, zeros elsewhere: the value is the gathered one, the gradient
    // of `y` its columns of the gradient above.
    let mut parts = Vec::with_capacity(ctx.size);
    for r in 0..ctx.size {
        if r == ctx.rank {
            parts.push(y.clone() - constant(y.clone()));
        } else {
            parts.push(constant(y.clone()).zeros_like());
        }
    }
    whole + Tensor::cat(parts, dim)
}

pub(crate) trait PendingCut {
    /// Whether a split layer ran in the region.
    fn split(&mut self, split: bool);
    fn finish(self: Box<Self>, passes: &mut Passes, ctx: &TpContext) -> Result<()>;
}

/// One tensor that enters a region's pass: the leaves made of it, whose gradients are its own (`identity`) or a
/// part on each rank (`reduced`).
pub(crate) struct Part<const D: usize> {
    source: Tensor<D>,
    identity: Vec<Tensor<D>>,
    reduced: Vec<Tensor<D>>,
    /// Under sequence parallelism, the dimension `reduced` was gathered along and every rank's positions: their
    /// gradient is reduce-scattered back.
    scatter: Option<(usize, Vec<usize>)>,
}

impl<const D: usize> Part<D> {
    /// `leaf`, made of `source`, whose gradient goes back to `source` as it is.
    pub fn kept(source: Tensor<D>, leaf: Tensor<D>) -> Self {
        Self {
            source,
            identity: vec![leaf],
            reduced: Vec::new(),
            scatter: None,
        }
    }

    /// `leaf`, made of `source`, whose gradient is a part on each rank: summed over the group where a split layer
    /// ran (reduce-scattered along `scatter`'s dimension under sequence parallelism) before it goes back.
    pub fn summed(
        source: Tensor<D>,
        leaf: Tensor<D>,
        scatter: Option<(usize, Vec<usize>)>,
    ) -> Self {
        Self {
            source,
            identity: Vec::new(),
            reduced: vec![leaf],
            scatter,
        }
    }
}

/// The tensors that enter one region's pass, back-propagated together in one pass.
pub(crate) struct Cut<const D: usize> {
    pub parts: Vec<Part<D>>,
    pub split: bool,
}

fn sum_of<const D: usize>(passes: &mut Passes, leaves: Vec<Tensor<D>>) -> Option<Tensor<D>> {
    leaves
        .into_iter()
        .filter_map(|leaf| passes.remove(&leaf))
        .reduce(|a, b| a + b)
}

impl<const D: usize> PendingCut for Cut<D> {
    fn split(&mut self, split: bool) {
        self.split = split;
    }

    fn finish(self: Box<Self>, passes: &mut Passes, ctx: &TpContext) -> Result<()> {
        let mut roots = Roots::default();
        for part in self.parts {
            let around = sum_of(passes, part.identity);
            let inside = match (sum_of(passes, part.reduced), &part.scatter) {
                // Each rank's part of the gathered input's gradient (its columns', or its positions') summed,
                // each rank keeping its positions.
                (Some(g), Some((dim, rows))) => Some(ctx.reduce_scatter_rows(
                    g,
                    *dim,
                    rows,
                    "sequence-parallel region input gradient",
                )?),
                (Some(g), None) if self.split => {
                    Some(ctx.all_reduce_sum(g, "tensor-parallel region input gradient")?)
                }
                (other, _) => other,
            };
            let grad = match (around, inside) {
                (Some(a), Some(b)) => a + b,
                (Some(g), None) | (None, Some(g)) => g,
                (None, None) => continue,
            };
            roots.add(part.source, grad);
        }
        roots.backward_into(passes);
        Ok(())
    }
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
}

impl GradSource for Passes {
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Option<Tensor<D>> {
        let value = param.val();
        self.remove(&value)
    }
}

/// Back-propagates `root`, then every cut this thread's forward pass recorded since the last backward, latest
/// first, as the module's documentation says. Without cuts (one tensor-parallel rank, or no region) this is
/// `root.backward()`.
///
/// # Errors
/// A column-parallel module that ran outside a region; a collective's failure.
pub(crate) fn backward<const D: usize>(root: Tensor<D>) -> Result<Passes> {
    let cuts = TAPE.with(|t| std::mem::take(&mut *t.borrow_mut()));
    if let Some(message) = MISUSE.with(|m| m.borrow_mut().take()) {
        return Err(Error::InvalidArgument(message));
    }
    let mut passes = Passes {
        list: vec![root.backward()],
    };
    if cuts.is_empty() {
        return Ok(passes);
    }
    let ctx = current().ok_or_else(|| {
        Error::InvalidArgument(
            "tensor parallelism: the forward pass cut tensor-parallel regions, but this thread has no tensor-parallel \
             group: run the backward pass on the thread that created the Accelerator"
                .into(),
        )
    })?;
    for cut in cuts.into_iter().rev() {
        cut.finish(&mut passes, &ctx)?;
    }
    Ok(passes)
}
