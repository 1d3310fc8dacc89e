//! Sequence parallelism (Megatron's `--sequence-parallel`, torchtitan's `SequenceParallel`): between the
//! tensor-parallel regions each rank holds its part of the sequence, `[batch, seq / tp, d_model]`, so that what
//! runs whole there (norms, dropout, residual adds) keeps 1/`tp` of the activations.
//!
//! - Into a region (the cut [`residual`](super::residual) and [`region`](super::region) make): the parts are
//!   all-gathered along the sequence; in the backward pass the gradient at the cut, a part on each rank, is
//!   reduce-scattered (Megatron's *g̅*), instead of all-reduced.
//! - Out of a row-parallel layer ([`row_parallel`]): the partial outputs are reduce-scattered, each rank keeping
//!   its part of the sum; in the backward pass the parts' gradients are all-gathered (*ḡ*). Without custom
//!   autograd this is a cut of its own: the part is a fresh leaf, and the backward pass computes the layer's
//!   gradients from the gathered gradient, as one pass more, before the region's input cut is finished.
//! - The crate's layers ([`columns`]) gather their input themselves and keep only the part between the passes,
//!   gathering it again for the weights' gradients (Megatron-LM's scheme).
//! - The first activation: a vocabulary-parallel [`ParallelEmbedding`](super::ParallelEmbedding) reduce-scatters
//!   its lookups ([`scatter_from_region`]); [`sequence_part`] cuts what the model adds whole (position
//!   embeddings).
//!
//! The sequence is the dimension before the features (`[batch, seq, d_model]`: 1; `[tokens, d_model]`: 0). A
//! length that does not divide by `tp` splits as evenly as it can (the first ranks one position more): the length
//! of this forward pass's sequence is kept from where it was cut.

use std::cell::Cell;
use std::sync::Arc;

use burn::tensor::Tensor;

use super::context::{TpContext, split_rows};
use super::cut::{
    Passes, PendingCut, Roots, constant, group, group_of_split, leaf, misused, record,
};
use crate::error::Result;

thread_local! {
    /// The whole length of the sequence this thread's forward pass last cut into parts.
    static LENGTH: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The group of this thread when sequence parallelism is on (and it has more than one rank).
pub(crate) fn active() -> Option<Arc<TpContext>> {
    group().filter(|c| c.sequence)
}

/// The sequence's dimension in a tensor of `D` dimensions: the one before the features.
pub(crate) const fn sequence_dim(d: usize) -> usize {
    d.saturating_sub(2)
}

/// Each rank's positions of a sequence `len` long, which this forward pass now cuts.
fn cut_rows(ctx: &TpContext, len: usize) -> Vec<usize> {
    if len < ctx.size {
        misused(format!(
            "tensor parallelism: sequence parallelism splits a sequence of {len} positions over {} ranks: each \
             needs at least one; use sequences of at least {} positions, or turn sequence parallelism off",
            ctx.size, ctx.size
        ));
    }
    LENGTH.with(|l| l.set(Some(len)));
    split_rows(len, ctx.size)
}

/// Each rank's positions where this rank holds `local` of them: from the length this forward pass cut, or `local`
/// on every rank where none was cut (or it does not fit).
fn rows_of(ctx: &TpContext, local: usize) -> Vec<usize> {
    match LENGTH.with(Cell::get).map(|len| split_rows(len, ctx.size)) {
        Some(rows) if rows[ctx.rank] == local => rows,
        _ => vec![local; ctx.size],
    }
}

/// Where this rank's part of a sequence split into `rows` begins.
fn offset(ctx: &TpContext, rows: &[usize]) -> usize {
    rows[..ctx.rank].iter().sum()
}

/// This rank's part of `x` along the sequence (the dimension before the features) under sequence parallelism;
/// `x` itself otherwise. For what a model adds whole to the first activation, which a vocabulary-parallel
/// [`ParallelEmbedding`](super::ParallelEmbedding) gives split: position embeddings, say. A parameter used on the
/// part gets its gradient from this rank's positions; the accelerator sums it over the tensor-parallel ranks.
///
/// ```
/// use burn::tensor::Tensor;
/// use burn_accelerate::tensor_parallel::sequence_part;
///
/// // Without sequence parallelism (one rank here), the whole.
/// let x = Tensor::<3>::ones([2, 8, 4], &Default::default());
/// assert_eq!(sequence_part(x).dims(), [2, 8, 4]);
/// ```
pub fn sequence_part<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let Some(ctx) = active() else {
        return x;
    };
    let dim = sequence_dim(D);
    let rows = cut_rows(&ctx, x.dims()[dim]);
    let start = offset(&ctx, &rows);
    x.narrow(dim, start, rows[ctx.rank])
}

/// The dropout split of an activation with `local` positions along `dim` between the regions: this rank's
/// positions of the whole sequence, so that its mask is its part of one process's.
pub(crate) fn dropout_split(local: usize, dim: usize) -> (usize, usize, usize) {
    match active() {
        None => (dim, 0, local),
        Some(ctx) => {
            let rows = rows_of(&ctx, local);
            (dim, offset(&ctx, &rows), rows.iter().sum())
        }
    }
}

/// `part` all-gathered along `dim` into the whole sequence, with every rank's positions.
pub(crate) fn gather_sequence<const D: usize>(
    ctx: &TpContext,
    part: Tensor<D>,
    dim: usize,
) -> (Tensor<D>, Vec<usize>) {
    let rows = rows_of(ctx, part.dims()[dim]);
    match ctx.all_gather_rows(
        part.clone(),
        dim,
        &rows,
        "sequence-parallel gather into a region",
    ) {
        Ok(whole) => (whole, rows),
        Err(e) => {
            misused(format!("tensor parallelism: {e}"));
            let zeros = |n: usize| {
                let mut dims = part.dims();
                dims[dim] = n;
                Tensor::<D>::zeros(dims, (&part.device(), part.dtype()))
            };
            let parts: Vec<Tensor<D>> = rows
                .iter()
                .enumerate()
                .map(|(r, n)| match r == ctx.rank {
                    true => part.clone(),
                    false => zeros(*n),
                })
                .collect();
            (Tensor::cat(parts, dim), rows)
        }
    }
}

/// This rank's positions of a region's output `y` (along `dim`): `y` where it is already a part (a row-parallel
/// layer reduce-scattered it), else its own rows of the whole.
pub(crate) fn own_part<const D: usize>(
    ctx: &TpContext,
    y: Tensor<D>,
    dim: usize,
    rows: &[usize],
) -> Tensor<D> {
    let len = y.dims()[dim];
    let whole: usize = rows.iter().sum();
    if len == whole && whole != rows[ctx.rank] {
        y.narrow(dim, offset(ctx, rows), rows[ctx.rank])
    } else {
        y
    }
}

/// A region's output `y` whose value is whole on every rank (a region of whole layers: a head a plan keeps
/// whole) with a gradient from this rank's positions only, so that the parameters in it, whole, get this rank's
/// part of their gradient, as the parameters between the regions do.
pub(crate) fn own_gradient<const D: usize>(
    ctx: &TpContext,
    y: Tensor<D>,
    rows: &[usize],
) -> Tensor<D> {
    let dim = sequence_dim(D);
    let whole: usize = rows.iter().sum();
    if y.dims()[dim] != whole {
        misused(format!(
            "tensor parallelism: a region of whole layers under sequence parallelism returned {:?}, whose \
             dimension {dim} is not the sequence of {whole} positions: keep the sequence there, or split a layer \
             of the region",
            y.dims()
        ));
        return y;
    }
    let (start, len) = (offset(ctx, rows), rows[ctx.rank]);
    let mut parts = Vec::with_capacity(3);
    if start > 0 {
        parts.push(constant(y.clone().narrow(dim, 0, start)));
    }
    parts.push(y.clone().narrow(dim, start, len));
    if start + len < whole {
        parts.push(constant(y.narrow(dim, start + len, whole - start - len)));
    }
    Tensor::cat(parts, dim)
}

/// *ḡ* of sequence parallelism: the partial results `y` of every rank (each the whole sequence) summed, this rank
/// keeping its positions along `dim`; in the backward pass every rank's gradient of its positions all-gathered
/// into the gradient of `y`.
pub(crate) fn scatter_from_region<const D: usize>(
    y: Tensor<D>,
    dim: usize,
    operation: &'static str,
) -> Tensor<D> {
    let ctx = group_of_split(operation);
    let rows = cut_rows(&ctx, y.dims()[dim]);
    let part = match ctx.reduce_scatter_rows(constant(y.clone()), dim, &rows, operation) {
        Ok(part) => part,
        Err(e) => {
            misused(format!("tensor parallelism: {operation} failed: {e}"));
            constant(y.clone()).narrow(dim, offset(&ctx, &rows), rows[ctx.rank])
        }
    };
    if !y.is_tracked() {
        return part;
    }
    let leaf = leaf(part);
    record(Box::new(ScatterCut {
        source: y,
        leaf: leaf.clone(),
        dim,
        rows,
    }));
    leaf
}

/// Column-parallel layers that read the same input, `part` (this rank's positions), under sequence parallelism, as
/// Megatron-LM runs them: `part` all-gathered once along the sequence and each layer's output computed from the
/// whole; in the backward pass the input gathered again, each weight's and bias's gradient computed from it, and
/// the input's gradient (every layer's summed) reduce-scattered back to this rank's positions. The gathered input
/// lives only while the layers compute: between the passes each rank keeps its part (where autodiff would keep
/// the whole for the weights' gradients).
///
/// Each of `layers` is `(weight, bias)` of a layer split by columns, `[d_input, cols]` and `[cols]`.
pub(crate) fn columns<const D: usize>(
    part: Tensor<D>,
    layers: Vec<(Tensor<2>, Option<Tensor<1>>)>,
    operation: &'static str,
) -> Vec<Tensor<D>> {
    let ctx = group_of_split(operation);
    let dim = sequence_dim(D);
    let (whole, rows) = gather_sequence(&ctx, constant(part.clone()), dim);
    let outputs: Vec<Tensor<D>> = layers
        .iter()
        .map(|(w, b)| {
            burn::tensor::module::linear(
                whole.clone(),
                constant(w.clone()),
                b.clone().map(constant),
            )
        })
        .collect();
    drop(whole);
    let tracked = part.is_tracked()
        || layers
            .iter()
            .any(|(w, b)| w.is_tracked() || b.as_ref().is_some_and(Tensor::is_tracked));
    if !tracked {
        return outputs;
    }
    let leaves: Vec<Tensor<D>> = outputs.into_iter().map(leaf).collect();
    record(Box::new(ColumnsCut {
        part,
        layers,
        leaves: leaves.clone(),
        dim,
        rows,
    }));
    leaves
}

/// The backward half of [`columns`].
struct ColumnsCut<const D: usize> {
    part: Tensor<D>,
    layers: Vec<(Tensor<2>, Option<Tensor<1>>)>,
    leaves: Vec<Tensor<D>>,
    dim: usize,
    rows: Vec<usize>,
}

impl<const D: usize> PendingCut for ColumnsCut<D> {
    fn split(&mut self, _split: bool) {}

    fn finish(self: Box<Self>, passes: &mut Passes, ctx: &TpContext) -> Result<()> {
        let grads: Vec<Option<Tensor<D>>> = self.leaves.iter().map(|l| passes.remove(l)).collect();
        if grads.iter().all(Option::is_none) {
            return Ok(());
        }
        // The input whole again (Megatron's all-gather in the backward pass).
        let whole = ctx.all_gather_rows(
            constant(self.part.clone()),
            self.dim,
            &self.rows,
            "sequence-parallel input gather for the weights' gradients",
        )?;
        let dims = whole.dims();
        let n = dims[..D - 1].iter().product::<usize>();
        let d_input = dims[D - 1];
        let input = whole.reshape([n, d_input]);
        let mut roots = Roots::default();
        let mut input_grad: Option<Tensor<2>> = None;
        for ((weight, bias), grad) in self.layers.into_iter().zip(grads) {
            let Some(grad) = grad else { continue };
            let cols = weight.dims()[1];
            let grad = grad.reshape([n, cols]);
            if weight.is_tracked() {
                let weight_grad = input.clone().transpose().matmul(grad.clone());
                roots.add(weight.clone(), weight_grad);
            }
            if let Some(bias) = bias.filter(Tensor::is_tracked) {
                roots.add(bias, grad.clone().sum_dim(0).reshape([cols]));
            }
            let term = grad.matmul(constant(weight).transpose());
            input_grad = Some(match input_grad {
                Some(g) => g + term,
                None => term,
            });
        }
        if self.part.is_tracked()
            && let Some(grad) = input_grad
        {
            // Each rank's columns' part of the input's gradient, summed over the group: this rank's positions.
            let part_grad = ctx.reduce_scatter_rows(
                grad.reshape(dims),
                self.dim,
                &self.rows,
                "sequence-parallel region input gradient",
            )?;
            roots.add(self.part, part_grad);
        }
        roots.backward_into(passes);
        Ok(())
    }
}

/// A row-parallel layer's `x · weight` under sequence parallelism: the partial products of every rank (each the
/// whole sequence) summed, this rank keeping its positions; in the backward pass every rank's gradient of its
/// positions all-gathered, and the gradients of `x` and `weight` computed from it as the matmul's backward pass
/// computes them. Nothing of the whole sequence is kept between the passes: the partial product goes once it is
/// reduce-scattered (where [`scatter_from_region`] keeps it, to back-propagate from it).
pub(crate) fn row_parallel<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    operation: &'static str,
) -> Tensor<D> {
    let ctx = group_of_split(operation);
    let dim = sequence_dim(D);
    let partial = burn::tensor::module::linear(constant(x.clone()), constant(weight.clone()), None);
    let rows = cut_rows(&ctx, partial.dims()[dim]);
    let part = match ctx.reduce_scatter_rows(partial.clone(), dim, &rows, operation) {
        Ok(part) => part,
        Err(e) => {
            misused(format!("tensor parallelism: {operation} failed: {e}"));
            partial.narrow(dim, offset(&ctx, &rows), rows[ctx.rank])
        }
    };
    if !x.is_tracked() && !weight.is_tracked() {
        return part;
    }
    let leaf = leaf(part);
    record(Box::new(RowCut {
        input: x,
        weight,
        leaf: leaf.clone(),
        dim,
        rows,
    }));
    leaf
}

/// The backward half of [`row_parallel`].
struct RowCut<const D: usize> {
    input: Tensor<D>,
    weight: Tensor<2>,
    leaf: Tensor<D>,
    dim: usize,
    rows: Vec<usize>,
}

impl<const D: usize> PendingCut for RowCut<D> {
    fn split(&mut self, _split: bool) {}

    fn finish(self: Box<Self>, passes: &mut Passes, ctx: &TpContext) -> Result<()> {
        let Some(whole) = gathered_grad(passes, &self.leaf, self.dim, &self.rows, ctx)? else {
            return Ok(());
        };
        let [d_input, d_output] = self.weight.dims();
        let dims = self.input.dims();
        let n = dims[..D - 1].iter().product::<usize>();
        let grad = whole.reshape([n, d_output]);
        let mut roots = Roots::default();
        if self.input.is_tracked() {
            let weight = constant(self.weight.clone());
            let input_grad = grad.clone().matmul(weight.transpose()).reshape(dims);
            roots.add(self.input.clone(), input_grad);
        }
        if self.weight.is_tracked() {
            let input = constant(self.input).reshape([n, d_input]);
            roots.add(self.weight, input.transpose().matmul(grad));
        }
        roots.backward_into(passes);
        Ok(())
    }
}

/// The backward half of [`scatter_from_region`]: the part's gradient gathered, back-propagated from the partial
/// output.
struct ScatterCut<const D: usize> {
    source: Tensor<D>,
    leaf: Tensor<D>,
    dim: usize,
    rows: Vec<usize>,
}

impl<const D: usize> PendingCut for ScatterCut<D> {
    fn split(&mut self, _split: bool) {}

    fn finish(self: Box<Self>, passes: &mut Passes, ctx: &TpContext) -> Result<()> {
        if let Some(whole) = gathered_grad(passes, &self.leaf, self.dim, &self.rows, ctx)? {
            let mut roots = Roots::default();
            roots.add(self.source, whole);
            roots.backward_into(passes);
        }
        Ok(())
    }
}

/// The gradient of every rank's part `leaf` (along `dim`, split into `rows`) gathered whole: the gradient of the
/// partial result that was reduce-scattered into it. `None` where no pass reached the part.
fn gathered_grad<const D: usize>(
    passes: &mut Passes,
    leaf: &Tensor<D>,
    dim: usize,
    rows: &[usize],
    ctx: &TpContext,
) -> Result<Option<Tensor<D>>> {
    match passes.remove(leaf) {
        Some(grad) => Ok(Some(ctx.all_gather_rows(
            grad,
            dim,
            rows,
            "sequence-parallel gradient gather",
        )?)),
        None => Ok(None),
    }
}
