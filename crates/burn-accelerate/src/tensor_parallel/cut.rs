//! Megatron's *f* and *g* without custom autograd: where a tensor-parallel region begins, the graph is cut by hand
//! and the gradient at the cut is all-reduced over the group in the backward pass; where it ends, the partial
//! results are all-reduced in the forward pass with an identity gradient.
//!
//! A cut detaches the tensor entering a region into fresh leaves, so that the backward pass from the loss stops
//! there: [`residual`](super::residual) gives the region one leaf and the residual path around it another (every
//! tensor that crosses the cut goes through it, the residual included, or the earlier graph would be walked twice,
//! which Burn cannot); [`region`](super::region) gives the region the only one. The forward pass records each cut
//! on this thread's tape; [`backward`](crate::graph_cut::backward) then back-propagates the loss, and the cuts in reverse order: each leaf's
//! gradient taken from the passes so far, the region's summed over the group (*f*: every rank's columns
//! contributed a part of it), the residual's kept as it is (every rank holds all of it), their sum
//! back-propagated from the tensor that entered, as one pass more. *g* needs no cut: `all_reduce(y) + (y - y)`,
//! the second `y` a constant, has the reduced value, bit for bit, and the identity gradient.

use burn::tensor::Tensor;

use super::context::{TpContext, current};
use crate::error::{Error, Result};
pub(crate) use crate::graph_cut::{
    Passes, Roots, constant, enter, in_region, leaf, misused, split_ran,
};

/// The tensor-parallel group of this thread when it has more than one rank.
pub(crate) fn group() -> Option<std::sync::Arc<TpContext>> {
    current().filter(|c| c.size > 1)
}

/// Records `cut` before its region runs, and after it whether the region's gradient is a part to sum: a region
/// of whole layers (a plan that keeps them whole) gives every rank the whole gradient already. See
/// [`crate::graph_cut::cut_around`].
pub(crate) fn cut_around<T>(cut: Box<dyn PendingCut>, f: impl FnOnce() -> T) -> (T, bool) {
    crate::graph_cut::cut_around(Box::new(OnGroup(cut)), f)
}

/// Records `cut` on this thread's tape, to be finished by the next backward pass (before the cuts recorded
/// earlier).
pub(crate) fn record(cut: Box<dyn PendingCut>) {
    crate::graph_cut::record(Box::new(OnGroup(cut)));
}

/// A tensor-parallel cut on the tape: finished over this thread's tensor-parallel group.
struct OnGroup(Box<dyn PendingCut>);

impl crate::graph_cut::Pending for OnGroup {
    fn split(&mut self, split: bool) {
        self.0.split(split);
    }

    fn finish(self: Box<Self>, passes: &mut Passes) -> Result<()> {
        let ctx = current().ok_or_else(|| {
            Error::InvalidArgument(
                "tensor parallelism: the forward pass cut tensor-parallel regions, but this thread has no \
                 tensor-parallel group: run the backward pass on the thread that created the Accelerator"
                    .into(),
            )
        })?;
        self.0.finish(passes, &ctx)
    }
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
