//! How a checkpoint holds one parameter on a rank ([`CheckpointCut`]): the split its manifest records and this
//! rank's part of it, with a second split of each part where two parallelisms cut the same parameter (FSDP2 over
//! a tensor-parallel part: a 2-D split).

use super::Slicing;

/// One parameter as a checkpoint holds it on this rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CheckpointCut {
    /// The split over the ranks, its shape with `dim` first (a column-split 2-D weight's shape swapped).
    pub split: Slicing,
    /// This rank's part of `split`.
    pub part: usize,
    /// The dimension the parts are cut along: 0, or 1 for a 2-D weight split by columns.
    pub dim: usize,
    /// The ranks of `split` in the run: saving rank `k` holds part `(k / stride) % parts` (1 where the split's
    /// ranks are consecutive; `tp_size` for the data-parallel ranks of a tensor-parallel run).
    pub stride: usize,
    /// Each part split again, or `None`.
    pub within: Option<Within>,
}

/// The second split of a [`CheckpointCut`]'s parts: the data-parallel strategy's slices of a tensor-parallel part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Within {
    /// The split of one part (its own shape, Burn's layout) over the ranks that slice it.
    pub split: Slicing,
    /// This rank's piece of its part.
    pub piece: usize,
    /// Saving rank `k` holds piece `(k / stride) % parts` of its part.
    pub stride: usize,
}

impl CheckpointCut {
    /// One split, its ranks consecutive, cut along `dim`.
    pub fn of(split: Slicing, part: usize, dim: usize) -> Self {
        Self {
            split,
            part,
            dim,
            stride: 1,
            within: None,
        }
    }
}
