//! How one parameter is split over the ranks of a shard group ([`Slicing`]): FSDP2's `Shard(0)` (even slices
//! along the first dimension, the last padded) or one rank owning it whole, with the flat element ranges each
//! rank holds and the conversions between a whole value and a rank's slice.

use std::ops::Range;

use burn::tensor::{DType, Device, Tensor};

/// How a parameter's elements are split over `parts` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SliceKind {
    /// Even slices of the first dimension: rank `q` holds rows `[q·c, (q+1)·c)` of the whole, `c` = ⌈rows / P⌉,
    /// padded with zero rows where the whole ends first (more ranks than rows included: some hold padding only).
    Rows,
    /// One rank holds it whole; the others hold an empty placeholder (first dimension 0). For optimizers that need
    /// a whole tensor, and for burn-train's Learner, whose optimizer steps its own model's whole parameters.
    Whole {
        /// The rank holding it.
        owner: usize,
    },
}

/// A parameter's whole shape and how it is split over the ranks of a shard group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slicing {
    dims: Vec<usize>,
    parts: usize,
    kind: SliceKind,
}

impl Slicing {
    /// A parameter of whole shape `dims` split over `parts` ranks as `kind` says. A parameter without dimensions
    /// (a scalar) is owned whole by rank 0 whatever `kind` asks.
    pub fn new(dims: Vec<usize>, parts: usize, kind: SliceKind) -> Self {
        let kind = if dims.is_empty() {
            SliceKind::Whole { owner: 0 }
        } else {
            kind
        };
        Self {
            dims,
            parts: parts.max(1),
            kind,
        }
    }

    /// The whole shape.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// How it is split.
    pub fn kind(&self) -> SliceKind {
        self.kind
    }

    /// The number of ranks it is split over.
    pub fn parts(&self) -> usize {
        self.parts
    }

    /// The whole number of elements.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Elements per row (the product of every dimension but the first).
    fn row_len(&self) -> usize {
        self.dims.iter().skip(1).product()
    }

    /// Rows per slice (`Rows` only): ⌈rows / parts⌉.
    fn rows_per_part(&self) -> usize {
        self.dims.first().copied().unwrap_or(1).div_ceil(self.parts)
    }

    /// The rows of the whole rank `q` holds (`Rows`), or every row / none (`Whole`).
    pub fn held_rows(&self, q: usize) -> Range<usize> {
        let rows = self.dims.first().copied().unwrap_or(1);
        match self.kind {
            SliceKind::Rows => {
                let c = self.rows_per_part();
                (q * c).min(rows)..((q + 1) * c).min(rows)
            }
            SliceKind::Whole { owner } if owner == q => 0..rows,
            SliceKind::Whole { .. } => 0..0,
        }
    }

    /// The flat elements of the whole rank `q` holds.
    pub fn held(&self, q: usize) -> Range<usize> {
        let rows = self.held_rows(q);
        let row = self.row_len();
        rows.start * row..rows.end * row
    }

    /// The number of elements rank `q`'s buffer has: its held elements and their padding.
    pub fn local_len(&self, q: usize) -> usize {
        self.local_dims(q).iter().product()
    }

    /// The shape of rank `q`'s buffer: `[c, ...]` for `Rows`; the whole shape on the owner and a placeholder
    /// (first dimension 0) elsewhere for `Whole`.
    pub fn local_dims(&self, q: usize) -> Vec<usize> {
        let mut dims = self.dims.clone();
        match self.kind {
            SliceKind::Rows => dims[0] = self.rows_per_part(),
            SliceKind::Whole { owner } if owner == q => {}
            SliceKind::Whole { .. } => {
                if let Some(first) = dims.first_mut() {
                    *first = 0;
                }
            }
        }
        dims
    }

    /// Rank `q`'s buffer cut from `whole` (flat): its held elements, padded with zeros, in a buffer of its own
    /// (a slice of a tensor may be a view that keeps the whole alive: the whole must be freed once cut).
    pub fn local_of(&self, whole: Tensor<1>, q: usize) -> Tensor<1> {
        let held = self.held(q);
        let len = self.local_len(q);
        if held.len() == whole.dims()[0] && held.len() == len {
            return whole;
        }
        let (device, dtype) = (whole.device(), whole.dtype());
        let local = Tensor::<1>::zeros([len], (&device, dtype));
        if held.is_empty() {
            return local;
        }
        let n = held.len();
        local.slice_assign(0..n, whole.slice(held))
    }

    /// The whole value (flat) from every rank's buffer, in rank order (`Whole`: only the owner's is read).
    #[cfg(test)]
    pub fn whole_of(&self, locals: impl IntoIterator<Item = Tensor<1>>) -> Tensor<1> {
        let mut parts = Vec::new();
        let mut placement = None;
        for (q, local) in locals.into_iter().enumerate() {
            placement.get_or_insert_with(|| (local.device(), local.dtype()));
            let held = self.held(q).len();
            if held == 0 {
                continue;
            }
            parts.push(if held == local.dims()[0] {
                local
            } else {
                local.slice(0..held)
            });
        }
        match (parts.len(), placement) {
            (1, _) => parts.pop().expect("one part"),
            (0, Some((device, dtype))) => Tensor::zeros([0], (&device, dtype)),
            (0, None) => panic!("whole_of: no rank's buffer given"),
            _ => Tensor::cat(parts, 0),
        }
    }
}

/// `part` (or nothing) followed by zeros up to `len` elements.
pub(crate) fn padded(part: Option<Tensor<1>>, len: usize, like: (&Device, DType)) -> Tensor<1> {
    match part {
        Some(part) if part.dims()[0] == len => part,
        Some(part) => {
            let n = part.dims()[0];
            Tensor::<1>::zeros([len], like).slice_assign(0..n, part)
        }
        None => Tensor::zeros([len], like),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: Tensor<1>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn rows_are_split_evenly_with_the_last_padded_and_more_ranks_than_rows_hold_padding() {
        let split = Slicing::new(vec![5, 2], 3, SliceKind::Rows);
        assert_eq!(split.local_dims(0), vec![2, 2]);
        assert_eq!(
            (0..3).map(|q| split.held(q)).collect::<Vec<_>>(),
            vec![0..4, 4..8, 8..10]
        );
        assert!((0..3).all(|q| split.local_len(q) == 4));

        let few = Slicing::new(vec![2, 3], 4, SliceKind::Rows);
        assert_eq!(few.local_dims(3), vec![1, 3]);
        assert_eq!(
            (0..4).map(|q| few.held(q).len()).collect::<Vec<_>>(),
            vec![3, 3, 0, 0]
        );
    }

    #[test]
    fn a_whole_split_is_held_by_its_owner_and_placeholders_elsewhere() {
        let split = Slicing::new(vec![4, 2], 3, SliceKind::Whole { owner: 1 });
        assert_eq!(split.local_dims(1), vec![4, 2]);
        assert_eq!(split.local_dims(0), vec![0, 2]);
        assert_eq!(split.held(1), 0..8);
        assert!(split.held(2).is_empty());
        let scalar = Slicing::new(Vec::new(), 4, SliceKind::Rows);
        assert_eq!(scalar.kind(), SliceKind::Whole { owner: 0 });
    }

    #[test]
    fn cutting_a_whole_value_and_joining_the_slices_gives_it_back() {
        let device = crate::backend::default_device().unwrap();
        let whole: Vec<f32> = (0..10).map(|x| x as f32).collect();
        for (parts, kind) in [
            (3, SliceKind::Rows),
            (4, SliceKind::Rows),
            (7, SliceKind::Rows),
            (1, SliceKind::Rows),
            (3, SliceKind::Whole { owner: 2 }),
        ] {
            let split = Slicing::new(vec![5, 2], parts, kind);
            let locals: Vec<Tensor<1>> = (0..parts)
                .map(|q| {
                    let local =
                        split.local_of(Tensor::<1>::from_floats(whole.as_slice(), &device), q);
                    assert_eq!(local.dims()[0], split.local_len(q), "{parts} {kind:?}");
                    local
                })
                .collect();
            if kind == SliceKind::Rows && parts == 3 {
                assert_eq!(values(locals[2].clone()), vec![8.0, 9.0, 0.0, 0.0]);
            }
            assert_eq!(values(split.whole_of(locals)), whole, "{parts} {kind:?}");
        }
    }
}
