//! The two exchanges of sharded training over [`Slicing`]s, each a bucket of parameters travelling as one flat
//! collective: the reduce-scatter of whole gradients into each rank's slices, and the all-gather of every rank's
//! slices into whole values (FSDP2's flat copy-in / copy-out). Rank `q`'s segment of a bucket is its slice of
//! every member, in order, padded; a bucket of `Rows` members alone has equal segments on every rank.

use burn::tensor::{DType, Device, Tensor};

use super::slicing::{SliceKind, Slicing, padded};
use crate::distributed::tensor_comm::{Pending, Reduction, TensorComm, bucket};
use crate::error::Result;

/// `splits` (in order) grouped into buckets of consecutive members whose buffers over every rank add up to at
/// most `cap` elements; a member of `alone` elements or more travels alone.
pub(super) fn buckets(splits: &[Slicing], cap: usize, alone: usize) -> Vec<Vec<usize>> {
    let size = |s: &Slicing| (0..s.parts()).map(|q| s.local_len(q)).sum::<usize>();
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut elems = 0;
    for (i, split) in splits.iter().enumerate() {
        let n = size(split);
        if n >= alone {
            out.push(vec![i]);
            continue;
        }
        if !current.is_empty() && elems + n > cap {
            out.push(std::mem::take(&mut current));
            elems = 0;
        }
        current.push(i);
        elems += n;
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Each rank's number of elements in a bucket of `members`.
fn counts(members: &[&Slicing], parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|q| members.iter().map(|s| s.local_len(q)).sum())
        .collect()
}

/// This rank's slices of the element-wise combination over the ranks of `wholes` (each member's whole gradient,
/// flat), as one flat tensor in `dtype` (the members' slices in order; split it with [`pieces`]), started: the
/// collective runs while the caller computes. A member owned whole by one rank and alone in its bucket is reduced
/// into that rank's buffer.
pub(super) fn start_reduce_scatter(
    comm: &dyn TensorComm,
    members: &[&Slicing],
    wholes: Vec<Tensor<1>>,
    (how, operation): (Reduction, &'static str),
    (device, dtype): (&Device, DType),
) -> Result<Pending<Tensor<1>>> {
    let parts = comm.world_size();
    if let ([split], [_]) = (members, wholes.as_slice())
        && let SliceKind::Whole { owner } = split.kind()
    {
        let whole = bucket::in_dtype(wholes.into_iter().next().expect("one"), dtype);
        let empty = (device.clone(), dtype);
        return Ok(comm
            .reduce(whole, owner, how, operation)?
            .then(move |reduced| {
                Ok(reduced.unwrap_or_else(|| Tensor::zeros([0], (&empty.0, empty.1))))
            }));
    }
    let counts = counts(members, parts);
    let total: usize = counts.iter().sum();
    let input = match (members, wholes.len()) {
        // One member cut in rows: its segments follow each other as the rows do, the padding at the end.
        ([split], 1) if split.kind() == SliceKind::Rows => padded(
            wholes
                .into_iter()
                .next()
                .map(|w| bucket::in_dtype(w, dtype)),
            total,
            (device, dtype),
        ),
        _ => {
            let wholes: Vec<Tensor<1>> = wholes
                .into_iter()
                .map(|w| bucket::in_dtype(w, dtype))
                .collect();
            let mut segments = Vec::new();
            for q in 0..parts {
                for (split, whole) in members.iter().zip(&wholes) {
                    if split.local_len(q) > 0 {
                        segments.push(split.local_of(whole.clone(), q));
                    }
                }
            }
            drop(wholes);
            bucket::concat(segments, (device, dtype))
        }
    };
    comm.reduce_scatter(input, &counts, how, operation)
}

/// Every member's whole value (flat, in `dtype`) from each rank's slices; `locals` are this rank's, one per
/// member, of [`Slicing::local_len`] elements each. A member owned whole by one rank and alone in its bucket is
/// broadcast from it.
pub(super) fn all_gather(
    comm: &dyn TensorComm,
    members: &[&Slicing],
    locals: Vec<Tensor<1>>,
    operation: &'static str,
    placement: (&Device, DType),
) -> Result<Vec<Tensor<1>>> {
    start_all_gather(comm, members, locals, operation, placement)?.finish()
}

/// An all-gather of a bucket started ([`start_all_gather`]): the collective runs while the caller computes, and
/// [`finish`](Self::finish) waits for it and joins the members' whole values.
pub(super) struct Gathering {
    pending: Pending<Tensor<1>>,
    members: Vec<Slicing>,
    counts: Vec<usize>,
    /// A member owned whole and broadcast from its owner: the gathered buffer is its value.
    broadcast: bool,
    placement: (Device, DType),
}

/// Starts [`all_gather`] and returns without waiting for it.
pub(super) fn start_all_gather(
    comm: &dyn TensorComm,
    members: &[&Slicing],
    locals: Vec<Tensor<1>>,
    operation: &'static str,
    (device, dtype): (&Device, DType),
) -> Result<Gathering> {
    let (me, parts) = (comm.rank(), comm.world_size());
    let locals: Vec<Tensor<1>> = locals
        .into_iter()
        .map(|l| bucket::in_dtype(l, dtype))
        .collect();
    let placement = (device.clone(), dtype);
    let owned: Vec<Slicing> = members.iter().map(|s| (*s).clone()).collect();
    if let [split] = members
        && let SliceKind::Whole { owner } = split.kind()
    {
        let flat = match locals.into_iter().next() {
            Some(own) if me == owner => own,
            _ => Tensor::zeros([split.len()], (device, dtype)),
        };
        return Ok(Gathering {
            pending: comm.broadcast(flat, owner, operation)?,
            members: owned,
            counts: Vec::new(),
            broadcast: true,
            placement,
        });
    }
    let counts = counts(members, parts);
    let part = bucket::concat(
        locals.into_iter().filter(|l| l.dims()[0] > 0).collect(),
        (device, dtype),
    );
    Ok(Gathering {
        pending: comm.all_gather(part, &counts, operation)?,
        members: owned,
        counts,
        broadcast: false,
        placement,
    })
}

impl Gathering {
    /// Waits for the collective and returns every member's whole value (flat).
    pub fn finish(self) -> Result<Vec<Tensor<1>>> {
        let all = self.pending.wait()?;
        if self.broadcast {
            return Ok(vec![all]);
        }
        if let [split] = self.members.as_slice() {
            // One member: the gathered segments are its rows in order, then the padding.
            let n = split.len();
            return Ok(vec![if all.dims()[0] == n {
                all
            } else {
                all.slice(0..n)
            }]);
        }
        let (device, dtype) = (&self.placement.0, self.placement.1);
        let mut offsets: Vec<usize> = self
            .counts
            .iter()
            .scan(0, |at, c| {
                let start = *at;
                *at += c;
                Some(start)
            })
            .collect();
        let mut wholes = Vec::with_capacity(self.members.len());
        for split in &self.members {
            let mut pieces = Vec::new();
            for (q, offset) in offsets.iter_mut().enumerate() {
                let held = split.held(q).len();
                if held > 0 {
                    pieces.push(all.clone().slice(*offset..*offset + held));
                }
                *offset += split.local_len(q);
            }
            wholes.push(bucket::concat(pieces, (device, dtype)));
        }
        Ok(wholes)
    }
}

/// `flat` cut into consecutive pieces of `lens` elements (one tensor where there is one piece).
pub(super) fn pieces(flat: Tensor<1>, lens: Vec<usize>) -> Vec<Tensor<1>> {
    match lens.len() {
        0 => Vec::new(),
        1 => vec![flat],
        _ => {
            let mut out = Vec::with_capacity(lens.len());
            let mut start = 0;
            for n in lens {
                out.push(if n == 0 {
                    Tensor::zeros([0], (&flat.device(), flat.dtype()))
                } else {
                    flat.clone().slice(start..start + n)
                });
                start += n;
            }
            out
        }
    }
}
