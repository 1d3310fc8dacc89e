//! Megatron's *f* and *g* without custom autograd: where a tensor-parallel region begins, the graph is cut by hand
//! and the gradient at the cut is all-reduced over the group in the backward pass; where it ends, the partial
//! results are all-reduced in the forward pass with an identity gradient.
//!
//! A cut detaches the tensor entering a region into fresh leaves, so that the backward pass from the loss stops
//! there: [`residual`] gives the region one leaf and the residual path around it another (every tensor that
//! crosses the cut goes through it, the residual included, or the earlier graph would be walked twice, which
//! Burn cannot); [`region`] gives the region the only one. The forward pass records each cut on this thread's
//! tape; [`backward`] then back-propagates the loss, and the cuts in reverse order: each leaf's gradient taken
//! from the passes so far, the region's summed over the group (*f*: every rank's columns contributed a part of
//! it), the residual's kept as it is (every rank holds all of it), their sum back-propagated from the tensor that
//! entered, as one pass more. *g* needs no cut: `all_reduce(y).detach() + (y - y.detach())` has the reduced value,
//! bit for bit, and the identity gradient.

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

/// The tensor-parallel group of this thread when it has more than one rank.
fn group() -> Option<std::sync::Arc<TpContext>> {
    current().filter(|c| c.size > 1)
}

/// Whether this thread's forward pass is inside a tensor-parallel region ([`residual`] or [`region`]).
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
fn enter<T>(f: impl FnOnce() -> T) -> (T, bool) {
    REGIONS.with(|r| r.borrow_mut().push(false));
    let out = f();
    let split = REGIONS.with(|r| r.borrow_mut().pop().unwrap_or(false));
    (out, split)
}

/// Records `cut` before its region runs (a region inside it is then finished first in the backward pass), and
/// after it whether the region's gradient is a part to sum: a region of whole layers (a plan that keeps them
/// whole) gives every rank the whole gradient already.
fn cut_around<T>(cut: Box<dyn PendingCut>, f: impl FnOnce() -> T) -> T {
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
    out
}

/// `x + region(before(x))`: a transformer's sub-layer, `before` what the ranks compute whole (a norm) and
/// `region` the tensor-parallel region (column-parallel layers, then row-parallel ones, whose partial outputs it
/// sums). The cut goes between them: the residual and `before`'s output enter the region's pass as leaves, the
/// latter's gradient summed over the group; `before` and everything earlier run backward once, from both. With
/// one tensor-parallel rank this is exactly `x.clone() + region(before(x))`.
///
/// A region holds only what is split and what follows the sum: a parameter of the whole model used inside it
/// before the split layers (a norm) would get a part of its gradient on each rank; put it in `before`.
///
/// ```
/// use burn::tensor::Tensor;
/// use burn_accelerate::tensor_parallel::residual;
///
/// let x = Tensor::<2>::ones([2, 3], &Default::default());
/// let y = residual(x, |h| h.add_scalar(1.0), |h| h.mul_scalar(2.0));
/// assert_eq!(y.into_data().to_vec::<f32>().unwrap(), vec![5.0; 6]);
/// ```
pub fn residual<const D: usize>(
    x: Tensor<D>,
    before: impl FnOnce(Tensor<D>) -> Tensor<D>,
    region: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    match group().filter(|_| x.is_tracked()) {
        None => enter(|| x.clone() + region(before(x))).0,
        Some(_) => {
            let z = before(x.clone());
            let around = x.clone().detach().require_grad();
            let inside = z.clone().detach().require_grad();
            let cut = Cut {
                parts: vec![
                    Part {
                        source: x,
                        identity: vec![around.clone()],
                        reduced: Vec::new(),
                    },
                    Part {
                        source: z,
                        identity: Vec::new(),
                        reduced: vec![inside.clone()],
                    },
                ],
                split: true,
            };
            cut_around(Box::new(cut), || around + region(inside))
        }
    }
}

/// `region(x)`, a tensor-parallel region whose input nothing else uses (a column-parallel head after the final
/// norm): its input's gradient is summed over the group.
pub fn region<const D: usize, const E: usize>(
    x: Tensor<D>,
    region: impl FnOnce(Tensor<D>) -> Tensor<E>,
) -> Tensor<E> {
    match group().filter(|_| x.is_tracked()) {
        None => enter(|| region(x)).0,
        Some(_) => {
            let inside = x.clone().detach().require_grad();
            let cut = Cut {
                parts: vec![Part {
                    source: x,
                    identity: Vec::new(),
                    reduced: vec![inside.clone()],
                }],
                split: true,
            };
            cut_around(Box::new(cut), || region(inside))
        }
    }
}

/// The group of a split layer's forward pass. A split layer on a thread without its group (one that created no
/// accelerator, among several in-process ranks) would compute a part as if it were the whole: it stops there.
fn group_of_split(operation: &str) -> std::sync::Arc<TpContext> {
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
    match ctx.all_reduce_sum(y.clone().detach(), operation) {
        Ok(sum) if y.is_tracked() => sum + (y.clone() - y.detach()),
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
    let whole = match ctx.all_gather(y.clone().detach(), dim, operation) {
        Ok(whole) => whole,
        Err(e) => {
            misused(format!("tensor parallelism: {operation} failed: {e}"));
            let mut parts = vec![y.clone().detach().zeros_like(); ctx.size];
            parts[ctx.rank] = y.clone().detach();
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
            parts.push(y.clone() - y.clone().detach());
        } else {
            parts.push(y.clone().detach().zeros_like());
        }
    }
    whole + Tensor::cat(parts, dim)
}

trait PendingCut {
    /// Whether a split layer ran in the region.
    fn split(&mut self, split: bool);
    fn finish(self: Box<Self>, passes: &mut Passes, ctx: &TpContext) -> Result<()>;
}

/// One tensor that enters a region's pass: the leaves made of it, whose gradients are its own (`identity`) or a
/// part on each rank (`reduced`).
struct Part<const D: usize> {
    source: Tensor<D>,
    identity: Vec<Tensor<D>>,
    reduced: Vec<Tensor<D>>,
}

/// The tensors that enter one region's pass, back-propagated together in one pass.
struct Cut<const D: usize> {
    parts: Vec<Part<D>>,
    split: bool,
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
        let mut root: Option<Tensor<1>> = None;
        for part in self.parts {
            let around = sum_of(passes, part.identity);
            let inside = match sum_of(passes, part.reduced) {
                Some(g) if self.split => {
                    Some(ctx.all_reduce_sum(g, "tensor-parallel region input gradient")?)
                }
                other => other,
            };
            let grad = match (around, inside) {
                (Some(a), Some(b)) => a + b,
                (Some(g), None) | (None, Some(g)) => g,
                (None, None) => continue,
            };
            if part.source.is_tracked() {
                let term = (part.source * grad).sum();
                root = Some(match root {
                    Some(r) => r + term,
                    None => term,
                });
            }
        }
        if let Some(root) = root {
            passes.list.push(root.backward());
        }
        Ok(())
    }
}

/// The gradients of one backward pass and of each cut's pass after it; a parameter's gradient is the sum of its
/// gradients in each.
pub(crate) struct Passes {
    list: Vec<Gradients>,
}

impl Passes {
    /// The sum of `t`'s gradients in every pass (removed from them), if any pass reached it.
    pub fn remove<const D: usize>(&mut self, t: &Tensor<D>) -> Option<Tensor<D>> {
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
