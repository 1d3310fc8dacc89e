//! Reduction operators and the host buffers they combine.

use std::fmt;

use crate::error::CommResult;

/// How values are combined across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (sum divided by the number of ranks; integers round toward zero).
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// A host buffer to reduce. Half-precision floats travel as `F32` (and are reduced in f32, which is more
/// accurate than summing in f16); integers and booleans as `I64`.
#[derive(Debug, Clone, PartialEq)]
pub enum ReduceBuffer {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 64-bit floats.
    F64(Vec<f64>),
    /// 64-bit integers.
    I64(Vec<i64>),
}

impl ReduceBuffer {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ReduceBuffer::F32(v) => v.len(),
            ReduceBuffer::F64(v) => v.len(),
            ReduceBuffer::I64(v) => v.len(),
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Turns a sum over `ranks` ranks into the mean ([`ReduceOp::Mean`]; integers round toward zero). Every
    /// engine finishes a `Mean` reduction with this one function, so all engines agree bit for bit.
    pub fn divide_by_ranks(&mut self, ranks: usize) {
        match self {
            ReduceBuffer::F32(v) => v.iter_mut().for_each(|x| *x /= ranks as f32),
            ReduceBuffer::F64(v) => v.iter_mut().for_each(|x| *x /= ranks as f64),
            ReduceBuffer::I64(v) => v.iter_mut().for_each(|x| *x /= ranks as i64),
        }
    }

    /// The elements of `range`, as a new buffer of the same kind.
    pub fn slice(&self, range: std::ops::Range<usize>) -> ReduceBuffer {
        match self {
            ReduceBuffer::F32(v) => ReduceBuffer::F32(v[range].to_vec()),
            ReduceBuffer::F64(v) => ReduceBuffer::F64(v[range].to_vec()),
            ReduceBuffer::I64(v) => ReduceBuffer::I64(v[range].to_vec()),
        }
    }

    /// The element kind's name.
    pub fn kind(&self) -> &'static str {
        match self {
            ReduceBuffer::F32(_) => "f32",
            ReduceBuffer::F64(_) => "f64",
            ReduceBuffer::I64(_) => "i64",
        }
    }
}

/// Rank `rank`'s part of a reduce-scatter of `len` elements into `counts` (one count per rank of a group of
/// `world`), or the error every rank returns for counts that do not describe such a split. Engines use it to
/// check a [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter) call the same way.
///
/// # Errors
/// [`CommError::IncompatibleInputs`](crate::CommError::IncompatibleInputs) when `counts` has not one entry per
/// rank or does not sum to `len`.
pub fn part_of(
    counts: &[usize],
    rank: usize,
    world: usize,
    len: usize,
) -> CommResult<std::ops::Range<usize>> {
    let total: usize = counts.iter().sum();
    if counts.len() != world || total != len {
        return Err(crate::CommError::IncompatibleInputs {
            operation: "reduce_scatter".into(),
            reason: format!(
                "{} part counts summing to {total} for {world} ranks and a buffer of {len} elements; pass one \
                 count per rank, summing to the buffer's length",
                counts.len()
            ),
        });
    }
    let start: usize = counts[..rank].iter().sum();
    Ok(start..start + counts[rank])
}

/// Checks an [`all_gather_parts`](crate::Communicator::all_gather_parts) call on rank `rank` of `world`: one
/// count per rank, and this rank's part `counts[rank]` elements long. Returns the gathered length.
///
/// # Errors
/// [`CommError::IncompatibleInputs`](crate::CommError::IncompatibleInputs) otherwise.
pub fn gathered_len(counts: &[usize], rank: usize, world: usize, len: usize) -> CommResult<usize> {
    if counts.len() != world || counts.get(rank) != Some(&len) {
        return Err(crate::CommError::IncompatibleInputs {
            operation: "all_gather_parts".into(),
            reason: format!(
                "rank {rank} passed {len} elements and {} part counts {counts:?} for {world} ranks; pass one count \
                 per rank, this rank's being the length of its part",
                counts.len()
            ),
        });
    }
    Ok(counts.iter().sum())
}

/// What every rank of an all-gather of parts must pass alike, for the mismatch check: kind and parts.
pub(crate) fn all_gather_signature(kind: &str, counts: &[usize]) -> crate::CallSignature {
    crate::CallSignature {
        collective: "all_gather_parts".into(),
        must_agree: format!("{kind} {counts:?}"),
        described: format!("all_gather_parts of {kind} parts {counts:?}"),
    }
}

/// The parts in order, one after the other, as one buffer of their (common) kind; `None` when kinds differ.
pub fn concat_parts(parts: &[&ReduceBuffer]) -> Option<ReduceBuffer> {
    macro_rules! concat {
        ($variant:ident) => {{
            let total = parts.iter().map(|p| p.len()).sum();
            let mut out = Vec::with_capacity(total);
            for part in parts {
                match part {
                    ReduceBuffer::$variant(v) => out.extend_from_slice(v),
                    _ => return None,
                }
            }
            Some(ReduceBuffer::$variant(out))
        }};
    }
    match parts.first() {
        None => Some(ReduceBuffer::F32(Vec::new())),
        Some(ReduceBuffer::F32(_)) => concat!(F32),
        Some(ReduceBuffer::F64(_)) => concat!(F64),
        Some(ReduceBuffer::I64(_)) => concat!(I64),
    }
}

/// What every rank of a reduce-scatter must pass alike, for the mismatch check: kind, length and parts.
pub(crate) fn reduce_scatter_signature(
    kind: &str,
    len: usize,
    counts: &[usize],
    op: ReduceOp,
) -> crate::CallSignature {
    crate::CallSignature {
        collective: "reduce_scatter".into(),
        must_agree: format!("{len} x {kind} {op} {counts:?}"),
        described: format!("reduce_scatter ({op}) of {len} x {kind} into {counts:?}"),
    }
}

/// Each rank's element kind and length in an all-reduce, checked by [`check_calls`](crate::check_calls).
pub(crate) fn check_shapes(seq: u64, shapes: &[(&'static str, usize)]) -> CommResult<()> {
    let calls: Vec<_> = shapes
        .iter()
        .map(|(kind, len)| {
            Some(crate::CallSignature {
                collective: "all_reduce".into(),
                must_agree: format!("{len} x {kind}"),
                described: format!("{len} x {kind}"),
            })
        })
        .collect();
    crate::check_calls(seq, &calls)
}

/// Reduces `range` of every input into a new buffer, combining ranks in rank order (so every rank computes
/// bit-identical results).
pub fn reduce_range(
    inputs: &[&ReduceBuffer],
    range: std::ops::Range<usize>,
    op: ReduceOp,
) -> ReduceBuffer {
    let n = inputs.len();
    macro_rules! reduce {
        ($variant:ident, $t:ty, $is_nan:expr) => {{
            let is_nan: fn($t) -> bool = $is_nan;
            let slices: Vec<&[$t]> = inputs
                .iter()
                .map(|b| match b {
                    ReduceBuffer::$variant(v) => &v[range.clone()],
                    _ => unreachable!("kinds checked before"),
                })
                .collect();
            let mut out: Vec<$t> = slices[0].to_vec();
            for s in &slices[1..] {
                match op {
                    ReduceOp::Sum | ReduceOp::Mean => {
                        out.iter_mut().zip(*s).for_each(|(a, b)| *a += *b)
                    }
                    ReduceOp::Max => out.iter_mut().zip(*s).for_each(|(a, b)| {
                        if *b > *a || is_nan(*b) {
                            *a = *b
                        }
                    }),
                    ReduceOp::Min => out.iter_mut().zip(*s).for_each(|(a, b)| {
                        if *b < *a || is_nan(*b) {
                            *a = *b
                        }
                    }),
                }
            }
            let mut out = ReduceBuffer::$variant(out);
            if op == ReduceOp::Mean {
                out.divide_by_ranks(n);
            }
            out
        }};
    }
    match inputs[0] {
        ReduceBuffer::F32(_) => reduce!(F32, f32, f32::is_nan),
        ReduceBuffer::F64(_) => reduce!(F64, f64, f64::is_nan),
        ReduceBuffer::I64(_) => reduce!(I64, i64, |_| false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_in_rank_order() {
        let a = ReduceBuffer::F32(vec![1.0, 5.0, f32::NAN]);
        let b = ReduceBuffer::F32(vec![3.0, 2.0, 1.0]);
        let inputs = [&a, &b];
        assert_eq!(
            reduce_range(&inputs, 0..2, ReduceOp::Sum),
            ReduceBuffer::F32(vec![4.0, 7.0])
        );
        assert_eq!(
            reduce_range(&inputs, 0..2, ReduceOp::Mean),
            ReduceBuffer::F32(vec![2.0, 3.5])
        );
        assert_eq!(
            reduce_range(&inputs, 0..2, ReduceOp::Max),
            ReduceBuffer::F32(vec![3.0, 5.0])
        );
        assert_eq!(
            reduce_range(&inputs, 1..2, ReduceOp::Min),
            ReduceBuffer::F32(vec![2.0])
        );
        match reduce_range(&[&b, &a], 2..3, ReduceOp::Max) {
            ReduceBuffer::F32(v) => assert!(v[0].is_nan(), "NaN propagates through max"),
            _ => unreachable!(),
        }
        let i = ReduceBuffer::I64(vec![3, -3]);
        let j = ReduceBuffer::I64(vec![4, 0]);
        assert_eq!(
            reduce_range(&[&i, &j], 0..2, ReduceOp::Mean),
            ReduceBuffer::I64(vec![3, -1])
        );
        assert!(check_shapes(0, &[(i.kind(), i.len()), (a.kind(), a.len())]).is_err());
        assert!(check_shapes(0, &[(i.kind(), i.len()), (j.kind(), j.len())]).is_ok());
    }
}
