//! Tensor collectives: `gather`, `reduce`, `broadcast`, `pad_across_processes`, object gather and broadcast, and
//! `split_between_processes`, built on the [`Communicator`](crate::distributed::comm::Communicator) of a rank.
//!
//! They work for float, int and bool tensors of any rank and dtype (f16 and bf16 included). With one process
//! each returns its input. With debug mode on (`ACCELERATE_DEBUG_MODE=1`), every collective first exchanges the
//! operation and the shapes, so a mismatch is an error on every rank, in Accelerate's format, instead of a hang.

mod trigger;
mod wire;

use burn::tensor::kind::Basic;
use burn::tensor::{DType, Device, Tensor, TensorData};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::distributed::ProcessGroup;
use crate::distributed::comm::{CallSignature, CommError, ReduceBuffer, ReduceOp, check_calls};
use crate::error::{Error, Result};
pub(crate) use trigger::Trigger;
use wire::{decode, encode, shape_str};

const PREFIX: &str = "burn_accelerate::distributed::collectives::";

fn read<const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
    operation: &'static str,
) -> Result<TensorData> {
    let device = tensor.device();
    tensor.try_into_data().map_err(|e| Error::Execution {
        operation,
        device: format!("{device:?}"),
        reason: e.to_string(),
    })
}

fn to_tensor<const D: usize, K: Basic>(data: TensorData, device: &Device) -> Tensor<D, K> {
    let dtype = data.dtype();
    Tensor::from_data(data, (device, dtype))
}

fn data_error(operation: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{PREFIX}{operation}: {e}"))
}

/// Debug mode: every rank sends (operation, dtype, shape); a different operation or an incompatible shape is an
/// error on every rank. `compare_from` is the first dimension that must agree (1 for `gather`, which accepts
/// different first dimensions, 0 otherwise).
fn verify(
    group: &ProcessGroup,
    operation: &str,
    dtype: DType,
    shape: &[usize],
    compare_from: usize,
) -> Result<()> {
    if !group.debug() || group.num_processes() == 1 {
        return Ok(());
    }
    let mine =
        serde_json::to_vec(&(operation, dtype, shape)).map_err(|e| data_error(operation, e))?;
    let all = group.comm().all_gather(mine)?;
    let mut calls: Vec<(String, DType, Vec<usize>)> = Vec::with_capacity(all.len());
    for (rank, bytes) in all.iter().enumerate() {
        calls.push(serde_json::from_slice(bytes).map_err(|e| {
            data_error(
                operation,
                format!("malformed debug message from rank {rank}: {e}"),
            )
        })?);
    }
    // The one mismatch check of the engines, on what debug mode compares: the operation, then the dtype and
    // the dimensions from `compare_from` on. Inputs that differ get Accelerate's shape message.
    let tail = |s: &[usize]| s.get(compare_from..).map(<[usize]>::to_vec);
    let signatures: Vec<_> = calls
        .iter()
        .map(|(op, dtype, shape)| {
            Some(CallSignature {
                collective: format!("{PREFIX}{op}"),
                must_agree: format!("{dtype:?} {:?}", tail(shape)),
                described: format!("{PREFIX}{op}"),
            })
        })
        .collect();
    match check_calls(0, &signatures) {
        Ok(()) => Ok(()),
        Err(CommError::IncompatibleInputs { .. }) => Err(Error::ShapeMismatch {
            operation: format!("{PREFIX}{operation}"),
            shapes: calls.iter().map(|(_, _, s)| shape_str(s)).collect(),
        }),
        Err(other) => Err(other.into()),
    }
}

/// Debug mode's check before a collective that does not go through these tensor collectives (every call of the
/// strategies' tensor interface, through its checking wrapper): ranks compare `operation`, `dtype` and `shape`, and
/// a mismatch is an error on every rank instead of a hang.
pub(crate) fn verify_call(
    group: &ProcessGroup,
    operation: &str,
    dtype: DType,
    shape: &[usize],
) -> Result<()> {
    verify(group, operation, dtype, shape, 0)
}

/// The one way these collectives' host buffers reach the communicator's all-reduce — for [`reduce`], agreement
/// and the batch-size search alike: in debug mode, ranks first compare `operation` and `(dtype, shape)` of what they reduce, so a rank
/// reducing something else is an error on every rank rather than a hang or wrong data.
pub(crate) fn all_reduce_host(
    group: &ProcessGroup,
    operation: &str,
    (dtype, shape): (DType, &[usize]),
    buffer: ReduceBuffer,
    op: ReduceOp,
) -> Result<ReduceBuffer> {
    verify(group, operation, dtype, shape, 0)?;
    Ok(group.comm().all_reduce(buffer, op)?)
}

impl ProcessGroup {
    /// Blocks until every rank arrives (no-op for one process).
    pub fn wait_for_everyone(&self) -> Result<()> {
        if self.num_processes() == 1 {
            return Ok(());
        }
        verify(self, "wait_for_everyone", DType::U8, &[0], 0)?;
        Ok(self.comm().barrier()?)
    }

    /// Ends a step of `operation` that every rank takes part in and in which any rank may fail (a save, a load):
    /// every rank learns every rank's outcome in one collective, so a failure on one rank (often the main
    /// process, which writes most files) stops all of them at once instead of leaving the others waiting for
    /// it until the collective timeout. A rank that failed gets its own error back; the others get
    /// [`Error::OtherRankFailed`] quoting it.
    pub fn agree<T>(&self, operation: &'static str, local: Result<T>) -> Result<T> {
        if self.num_processes() == 1 {
            return local;
        }
        if let Err(e) = verify(self, operation, DType::U8, &[0], 0) {
            return local.and(Err(e));
        }
        let mine = match &local {
            Ok(_) => Vec::new(),
            Err(e) => {
                let text = e.to_string();
                if text.is_empty() {
                    b"(no message)".to_vec()
                } else {
                    text.into_bytes()
                }
            }
        };
        // A rank that failed reports its own error even when the exchange fails too (its peers may be gone).
        let all = match self.comm().all_gather(mine) {
            Ok(all) => all,
            Err(e) => return local.and(Err(e.into())),
        };
        let value = local?;
        match all.iter().position(|m| !m.is_empty()) {
            None => Ok(value),
            Some(rank) => Err(Error::OtherRankFailed {
                operation,
                rank,
                message: String::from_utf8_lossy(&all[rank]).into_owned(),
            }),
        }
    }
}

/// Whether any rank passed `true` (an early-stopping flag, a stop request): one small all-reduce every rank
/// calls at the same point.
pub fn any_rank(group: &ProcessGroup, operation: &str, flag: bool) -> Result<bool> {
    if group.num_processes() == 1 {
        return Ok(flag);
    }
    let all = all_reduce_host(
        group,
        operation,
        (DType::I64, &[1]),
        ReduceBuffer::I64(vec![i64::from(flag)]),
        ReduceOp::Max,
    )?;
    Ok(matches!(all, ReduceBuffer::I64(v) if v.first().copied().unwrap_or(0) > 0))
}

/// Concatenates every rank's tensor along dimension 0, in rank order. The first dimension may differ between
/// ranks (the result has no padding); the other dimensions and the dtype must agree.
pub fn gather<const D: usize, K: Basic>(
    group: &ProcessGroup,
    tensor: Tensor<D, K>,
) -> Result<Tensor<D, K>> {
    if group.num_processes() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let data = read(tensor, "gather")?;
    verify(group, "gather", data.dtype(), data.shape(), 1)?;
    let all = group.comm().all_gather(encode(&data)?)?;
    drop(data);
    let parts: Vec<_> = all
        .into_iter()
        .enumerate()
        .map(|(rank, m)| decode(m, rank))
        .collect::<Result<_>>()?;
    let first = &parts[0];
    let compatible = parts
        .iter()
        .all(|p| p.dtype == first.dtype && p.shape.get(1..) == first.shape.get(1..));
    if !compatible {
        return Err(Error::ShapeMismatch {
            operation: format!("{PREFIX}gather"),
            shapes: parts.iter().map(|p| shape_str(&p.shape)).collect(),
        });
    }
    let mut shape = first.shape.clone();
    shape[0] = parts.iter().map(|p| p.shape[0]).sum();
    let dtype = first.dtype;
    // Each part was checked against its shape when decoded, so together they fill the gathered shape.
    let data = crate::host_data::filled(shape, dtype, |out| {
        let mut at = 0;
        for part in &parts {
            out[at..at + part.bytes.len()].copy_from_slice(&part.bytes);
            at += part.bytes.len();
        }
    });
    Ok(to_tensor(data, &device))
}

/// Combines every rank's tensor element-wise with `op`; every rank gets the result, in the input's dtype.
/// Half-precision floats are combined in f32; for bool tensors `Sum` and `Max` are a logical or, `Min` a
/// logical and, and `Mean` is an error.
pub fn reduce<const D: usize, K: Basic>(
    group: &ProcessGroup,
    tensor: Tensor<D, K>,
    op: ReduceOp,
) -> Result<Tensor<D, K>> {
    let dtype = tensor.dtype();
    if matches!(dtype, DType::Bool(_)) && op == ReduceOp::Mean {
        return Err(Error::InvalidArgument(format!(
            "{PREFIX}reduce: the mean of bool tensors is not defined; use ReduceOp::Max (any) or ReduceOp::Min (all)"
        )));
    }
    if group.num_processes() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let data = read(tensor, "reduce")?;
    let shape = data.shape().to_vec();
    let err = |e| data_error("reduce", e);
    let buffer = match dtype {
        DType::F64 => ReduceBuffer::F64(data.try_into_vec::<f64>().map_err(err)?),
        DType::F32 | DType::Flex32 | DType::F16 | DType::BF16 => ReduceBuffer::F32(
            data.try_cast_as::<f32>()
                .map_err(err)?
                .try_into_vec::<f32>()
                .map_err(err)?,
        ),
        DType::Bool(_) => ReduceBuffer::I64(
            data.try_into_vec::<bool>()
                .map_err(err)?
                .into_iter()
                .map(i64::from)
                .collect(),
        ),
        DType::QFloat(_) => {
            return Err(Error::InvalidArgument(format!(
                "{PREFIX}reduce: quantized tensors are not supported; dequantize first"
            )));
        }
        _ => ReduceBuffer::I64(
            data.try_cast_as::<i64>()
                .map_err(err)?
                .try_into_vec::<i64>()
                .map_err(err)?,
        ),
    };
    let op = if matches!(dtype, DType::Bool(_)) && op == ReduceOp::Sum {
        ReduceOp::Max
    } else {
        op
    };
    let out = match all_reduce_host(group, "reduce", (dtype, &shape), buffer, op)? {
        ReduceBuffer::F64(v) => TensorData::new(v, shape),
        ReduceBuffer::F32(v) => TensorData::new(v, shape),
        ReduceBuffer::I64(v) if matches!(dtype, DType::Bool(_)) => {
            TensorData::new(v.into_iter().map(|x| x != 0).collect::<Vec<bool>>(), shape)
        }
        ReduceBuffer::I64(v) => TensorData::new(v, shape),
    };
    let out = out.try_cast(dtype).map_err(err)?;
    Ok(to_tensor(out, &device))
}

/// Returns rank `from`'s tensor on every rank (the other ranks' tensors only fix the rank and kind).
pub fn broadcast<const D: usize, K: Basic>(
    group: &ProcessGroup,
    tensor: Tensor<D, K>,
    from: usize,
) -> Result<Tensor<D, K>> {
    if from >= group.num_processes() {
        return Err(crate::distributed::comm::CommError::InvalidRoot {
            operation: "broadcast".into(),
            root: from,
            world_size: group.num_processes(),
        }
        .into());
    }
    if group.num_processes() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let data = read(tensor, "broadcast")?;
    verify(group, "broadcast", data.dtype(), data.shape(), 0)?;
    let message = if group.process_index() == from {
        encode(&data)?
    } else {
        Vec::new()
    };
    drop(data);
    let root = decode(group.comm().broadcast(message, from)?, from)?;
    Ok(to_tensor(root.into_data(), &device))
}

/// Pads `tensor` along `dim` with `pad_value` so that every rank's tensor has the largest size found across
/// ranks (padding after the data, or before it with `pad_first`). Use it before [`gather`] when ranks hold
/// batches of different lengths and an equal shape is needed (for instance to stack per-rank outputs).
pub fn pad_across_processes<const D: usize, K: Basic>(
    group: &ProcessGroup,
    tensor: Tensor<D, K>,
    dim: usize,
    pad_value: f64,
    pad_first: bool,
) -> Result<Tensor<D, K>> {
    if dim >= D {
        return Err(Error::InvalidArgument(format!(
            "{PREFIX}pad_across_processes: dim {dim} is out of range for a {D}-dimensional tensor"
        )));
    }
    if group.num_processes() == 1 {
        return Ok(tensor);
    }
    let dims = tensor.dims();
    let dtype = tensor.dtype();
    verify(group, "pad_across_processes", dtype, &dims, D)?;
    let size = dims[dim] as u64;
    let sizes = group.comm().all_gather(size.to_le_bytes().to_vec())?;
    let mut max = 0u64;
    for (rank, bytes) in sizes.iter().enumerate() {
        let bytes: [u8; 8] = bytes.as_slice().try_into().map_err(|_| {
            data_error(
                "pad_across_processes",
                format!("malformed size from rank {rank}"),
            )
        })?;
        max = max.max(u64::from_le_bytes(bytes));
    }
    let max = max as usize;
    if max == dims[dim] {
        return Ok(tensor);
    }
    let mut pad_shape = dims.to_vec();
    pad_shape[dim] = max - dims[dim];
    let pad = if matches!(dtype, DType::Bool(_)) {
        TensorData::full(pad_shape, pad_value != 0.0)
    } else {
        TensorData::full(pad_shape, pad_value)
    };
    let pad = pad
        .try_cast(dtype)
        .map_err(|e| data_error("pad_across_processes", e))?;
    let pad: Tensor<D, K> = to_tensor(pad, &tensor.device());
    let parts = if pad_first {
        vec![pad, tensor]
    } else {
        vec![tensor, pad]
    };
    Ok(Tensor::cat(parts, dim))
}

/// Gathers one serializable value from every rank, in rank order.
pub fn gather_object<T: Serialize + DeserializeOwned>(
    group: &ProcessGroup,
    value: &T,
) -> Result<Vec<T>> {
    gather_object_as(group, value)
}

/// Gathers `value` from every rank, read back as `D` (e.g. a slice sent, a `Vec` received).
pub fn gather_object_as<S: Serialize + ?Sized, D: DeserializeOwned>(
    group: &ProcessGroup,
    value: &S,
) -> Result<Vec<D>> {
    let bytes = serde_json::to_vec(value).map_err(|e| data_error("gather_object", e))?;
    let all = group.comm().all_gather(bytes)?;
    all.iter()
        .enumerate()
        .map(|(rank, b)| {
            serde_json::from_slice(b)
                .map_err(|e| data_error("gather_object", format!("value of rank {rank}: {e}")))
        })
        .collect()
}

/// Returns rank `from`'s value on every rank (`value` is only read on rank `from`).
pub fn broadcast_object<T: Serialize + DeserializeOwned>(
    group: &ProcessGroup,
    value: &T,
    from: usize,
) -> Result<T> {
    if from >= group.num_processes() {
        return Err(crate::distributed::comm::CommError::InvalidRoot {
            operation: "broadcast_object".into(),
            root: from,
            world_size: group.num_processes(),
        }
        .into());
    }
    let bytes = if group.process_index() == from {
        serde_json::to_vec(value).map_err(|e| data_error("broadcast_object", e))?
    } else {
        Vec::new()
    };
    let root = group.comm().broadcast(bytes, from)?;
    serde_json::from_slice(&root).map_err(|e| data_error("broadcast_object", e))
}

/// The part of `items` that rank `rank` of `world` handles: contiguous, the first `len % world` ranks taking
/// one item more (Accelerate's `split_between_processes`). With `apply_padding`, shorter parts are completed
/// with their last item so that every rank gets the same count.
pub fn split_between_processes<T: Clone>(
    items: &[T],
    rank: usize,
    world: usize,
    apply_padding: bool,
) -> Vec<T> {
    let world = world.max(1);
    let (per, extra) = (items.len() / world, items.len() % world);
    let start = rank * per + rank.min(extra);
    let end = (start + per + usize::from(rank < extra)).min(items.len());
    let mut part = items.get(start..end).map(<[T]>::to_vec).unwrap_or_default();
    if apply_padding
        && extra > 0
        && rank >= extra
        && let Some(last) = part.last().cloned().or_else(|| items.last().cloned())
    {
        part.push(last);
    }
    part
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_matches_accelerate() {
        let items: Vec<u32> = (0..10).collect();
        let parts: Vec<Vec<u32>> = (0..3)
            .map(|r| split_between_processes(&items, r, 3, false))
            .collect();
        assert_eq!(parts, vec![vec![0, 1, 2, 3], vec![4, 5, 6], vec![7, 8, 9]]);
        let padded: Vec<Vec<u32>> = (0..3)
            .map(|r| split_between_processes(&items, r, 3, true))
            .collect();
        assert_eq!(
            padded,
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 6], vec![7, 8, 9, 9]]
        );
        assert_eq!(
            split_between_processes(&items[..2], 3, 4, false),
            Vec::<u32>::new()
        );
        assert_eq!(split_between_processes(&items[..2], 3, 4, true), vec![1]);
    }
}
