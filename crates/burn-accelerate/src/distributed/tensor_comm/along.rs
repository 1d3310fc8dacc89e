//! Collectives of tensors of any shape along one of their dimensions, over a [`TensorComm`]: what the
//! parallelisms inside a model's forward pass (tensor, sequence and context parallelism) exchange.

use burn::tensor::Tensor;

use super::{Reduction, TensorComm};
use crate::distributed::comm::ReduceOp;
use crate::error::Result;

/// `t` combined element-wise by `op` over the group, in its shape, dtype and device.
///
/// # Errors
/// The collective's (a timeout, a peer that failed).
pub(crate) fn all_reduce<const D: usize>(
    comm: &dyn TensorComm,
    t: Tensor<D>,
    op: ReduceOp,
    operation: &'static str,
) -> Result<Tensor<D>> {
    let shape = t.shape();
    let n = shape.num_elements();
    let flat = reshaped(t, [n]);
    let combined = comm
        .all_reduce(flat, Reduction::Op(op), operation)?
        .wait()?;
    Ok(reshaped(combined, shape.dims()))
}

/// Every rank's `part` (the same shape on each) concatenated along `dim`, in rank order.
///
/// # Errors
/// The collective's.
pub(crate) fn all_gather<const D: usize>(
    comm: &dyn TensorComm,
    part: Tensor<D>,
    dim: usize,
    operation: &'static str,
) -> Result<Tensor<D>> {
    let rows = vec![part.dims()[dim]; comm.world_size()];
    all_gather_rows(comm, part, dim, &rows, operation)
}

/// Every rank's `part` (rank `r`'s `rows[r]` long along `dim`, the other dimensions alike) concatenated along
/// `dim`, in rank order.
///
/// # Errors
/// The collective's.
pub(crate) fn all_gather_rows<const D: usize>(
    comm: &dyn TensorComm,
    part: Tensor<D>,
    dim: usize,
    rows: &[usize],
    operation: &'static str,
) -> Result<Tensor<D>> {
    // Gathered flat in rank order: each rank's part whole, so the split dimension goes first and back.
    let (flat, mut whole, counts) = rows_first(part, dim, rows);
    let all = comm.all_gather(flat, &counts, operation)?.wait()?;
    whole[0] = rows.iter().sum();
    Ok(reshaped(all, whole).swap_dims(0, dim))
}

/// `whole` summed over the group, this rank's rows `rows[rank]` of it along `dim` only (the rows before it
/// belong to the ranks before).
///
/// # Errors
/// The collective's.
pub(crate) fn reduce_scatter_rows<const D: usize>(
    comm: &dyn TensorComm,
    whole: Tensor<D>,
    dim: usize,
    rows: &[usize],
    operation: &'static str,
) -> Result<Tensor<D>> {
    let (flat, mut part, counts) = rows_first(whole, dim, rows);
    let mine = comm
        .reduce_scatter(flat, &counts, Reduction::Op(ReduceOp::Sum), operation)?
        .wait()?;
    part[0] = rows[comm.rank()];
    Ok(reshaped(mine, part).swap_dims(0, dim))
}

/// `t` flat with dimension `dim` first (so that rows of it are ranges), its shape so moved, and the elements of
/// each rank's `rows`.
fn rows_first<const D: usize>(
    t: Tensor<D>,
    dim: usize,
    rows: &[usize],
) -> (Tensor<1>, [usize; D], Vec<usize>) {
    let moved = t.swap_dims(0, dim);
    let dims = moved.dims();
    let per_row: usize = dims[1..].iter().product();
    let counts = rows.iter().map(|r| r * per_row).collect();
    (reshaped(moved, [dims[0] * per_row]), dims, counts)
}

/// `t` in the shape `dims`, an empty one included: Burn's `reshape` reads a 0 as "keep this dimension", so an
/// empty tensor (a rank's empty batch, an empty part) is made anew, empty.
pub(crate) fn reshaped<const D: usize, const D2: usize>(
    t: Tensor<D>,
    dims: [usize; D2],
) -> Tensor<D2> {
    let from = t.dims();
    // A 0 Burn keeps from `t`'s own dimension at its index is a 0 already there.
    let kept = (0..D2).all(|i| dims[i] != 0 || from.get(i) == Some(&0));
    match kept {
        true => t.reshape(dims),
        false => Tensor::zeros(dims, (&t.device(), t.dtype())),
    }
}
