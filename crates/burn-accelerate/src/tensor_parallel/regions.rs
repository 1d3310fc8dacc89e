//! The regions of a model's forward pass: [`residual`] (a sub-layer with its residual around it) and [`region`]
//! (a region nothing else reads the input of), each cutting the graph where the region begins (see the `cut`
//! module), with and without sequence parallelism (see the `sequence` module).

use burn::tensor::Tensor;

use super::context::TpContext;
use super::cut::{Cut, Part, constant, cut_around, enter, group, leaf};
use super::sequence;

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
    if let Some(ctx) = sequence::active() {
        return sequence_residual(&ctx, x, before, region);
    }
    if group().is_none() {
        if crate::context_parallel::group::active().is_some() {
            return residual_of_parts(x, before, region);
        }
        return enter(|| x.clone() + region(before(x))).0;
    }
    let z = before(x.clone());
    // A cut wherever a gradient crosses it: from the residual, or from `before` alone (a norm that trains
    // after frozen layers, whose output carries no gradient).
    match x.is_tracked() || z.is_tracked() {
        false => enter(|| x + region(z)).0,
        true => {
            let inside = leaf(z.clone());
            behind_cut(x, Part::summed(z, inside.clone(), None), || region(inside))
        }
    }
}

/// `x + region()` behind the cut of the residual `x` (its gradient kept as it is) and of what enters the region
/// (`entering`, the leaf `region` reads).
fn behind_cut<const D: usize>(
    x: Tensor<D>,
    entering: Part<D>,
    region: impl FnOnce() -> Tensor<D>,
) -> Tensor<D> {
    let around = leaf(x.clone());
    let cut = Cut {
        parts: vec![Part::kept(x, around.clone()), entering],
        split: true,
    };
    cut_around(Box::new(cut), || around + region()).0
}

/// [`residual`] under sequence parallelism: `x` and `before`'s output are this rank's positions; the latter is
/// gathered whole into the region, whose output (reduce-scattered by its row-parallel layers, or whole) comes back
/// as this rank's positions. The gradient at the cut is reduce-scattered.
fn sequence_residual<const D: usize>(
    ctx: &TpContext,
    x: Tensor<D>,
    before: impl FnOnce(Tensor<D>) -> Tensor<D>,
    region: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    let dim = sequence::sequence_dim(D);
    let z = before(x.clone());
    let tracked = x.is_tracked() || z.is_tracked();
    let (whole, rows) = sequence::gather_sequence(ctx, constant(z.clone()), dim);
    if !tracked {
        let (y, _) = enter(|| region(whole));
        return x + sequence::own_part(ctx, y, dim, &rows);
    }
    let inside = leaf(whole);
    let entering = Part::summed(z, inside.clone(), Some((dim, rows.clone())));
    behind_cut(x, entering, || {
        sequence::own_part(ctx, region(inside), dim, &rows)
    })
}

/// `region(x)`, a tensor-parallel region whose input nothing else uses (a column-parallel head after the final
/// norm): its input's gradient is summed over the group.
pub fn region<const D: usize, const E: usize>(
    x: Tensor<D>,
    region: impl FnOnce(Tensor<D>) -> Tensor<E>,
) -> Tensor<E> {
    if let Some(ctx) = sequence::active() {
        return sequence_region(&ctx, x, region);
    }
    match group().filter(|_| x.is_tracked()) {
        None => enter(|| region(x)).0,
        Some(_) => {
            let inside = leaf(x.clone());
            let cut = Cut {
                parts: vec![Part::summed(x, inside.clone(), None)],
                split: true,
            };
            cut_around(Box::new(cut), || region(inside)).0
        }
    }
}

/// `x + region(before(x))` behind a cut whose gradients come back as they are (no collective at the cut): under
/// sequence parallelism for a region that takes this rank's positions and gathers them itself (the crate's layers,
/// through `sequence::columns`, whose column cut reduce-scatters the gradient already), and under context
/// parallelism without a tensor-parallel group, so that the attention's own cut inside the region back-propagates
/// to a leaf, not into the graph before it.
pub(crate) fn residual_of_parts<const D: usize>(
    x: Tensor<D>,
    before: impl FnOnce(Tensor<D>) -> Tensor<D>,
    region: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    let z = before(x.clone());
    if !(x.is_tracked() || z.is_tracked()) {
        return enter(|| x + region(z)).0;
    }
    let (around, inside) = (leaf(x.clone()), leaf(z.clone()));
    let cut = crate::graph_cut::Kept {
        parts: vec![(x, around.clone()), (z, inside.clone())],
    };
    crate::graph_cut::cut_around(Box::new(cut), || around + region(inside)).0
}

/// [`region`] under sequence parallelism: `x`, this rank's positions, gathered whole into the region; the
/// gradient at the cut reduce-scattered. A region of whole layers gives every rank the whole output, with a
/// gradient from this rank's positions only (see [`sequence::own_gradient`]).
fn sequence_region<const D: usize, const E: usize>(
    ctx: &TpContext,
    x: Tensor<D>,
    region: impl FnOnce(Tensor<D>) -> Tensor<E>,
) -> Tensor<E> {
    let dim = sequence::sequence_dim(D);
    let (whole, rows) = sequence::gather_sequence(ctx, constant(x.clone()), dim);
    if !x.is_tracked() {
        return enter(|| region(whole)).0;
    }
    let inside = leaf(whole);
    let cut = Cut {
        parts: vec![Part::summed(x, inside.clone(), Some((dim, rows.clone())))],
        split: true,
    };
    let (y, split) = cut_around(Box::new(cut), || region(inside));
    match split {
        true => y,
        false => sequence::own_gradient(ctx, y, &rows),
    }
}
