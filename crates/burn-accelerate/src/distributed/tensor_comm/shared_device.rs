//! Ranks that share one device in one process (in-process ranks on one GPU, or on Flex): the tensor interface
//! with every value handed between the ranks' threads as the device tensor itself, by the communicator's
//! [`share`](crate::distributed::comm::Communicator::share) round and mailboxes — never copied through host
//! memory. Values combine as Burn tensor operations on the device, in rank order, half-precision ones in f32 (as
//! the host engines combine them), so the results are those of the host path, bit for bit wherever the
//! backend's element-wise arithmetic is the host's.
//!
//! Every rank combines what it needs itself (its part for a reduce-scatter, the whole for an all-reduce): one
//! round per call, and no rank waits on another's arithmetic. Each call completes when it is started.
//!
//! Backends that run work after it is asked for (cubecl's, with or without Burn's fusion: one queue per thread,
//! so per rank) need more: a tensor shared while its own rank's queue has not computed it, or dropped by its rank
//! while another rank's queue still has to read it, is lost (Burn's fusion panics with `Should have handle for
//! tensor`, as an H100 showed). There each rank runs its queue before sharing, copies what it keeps of another
//! rank's tensors, runs its queue again once it has read them, and a second round holds every rank until all have
//! read: two queue flushes and one more round per call. Flex and NdArray compute when asked and need none of it.

use std::sync::Arc;

use burn::tensor::{DType, Tensor};

use super::host::from_buffer;
use super::{Incoming, Pending, Reduction, TensorComm};
use crate::distributed::ProcessGroup;
use crate::distributed::comm::{
    CommError, ReduceBuffer, ReduceOp, SharedValue, part_of, reduce_range,
};
use crate::error::{Error, Result};

/// How [`SharedDevice`] is named in messages and `env`.
pub(crate) const NAME: &str = "device exchange (in-process ranks sharing one device)";

/// The tensor interface of one rank among in-process ranks on one device.
#[derive(Debug)]
pub(crate) struct SharedDevice {
    group: Arc<ProcessGroup>,
    /// Whether the backend runs work later than it is asked for (see the module documentation).
    deferred: bool,
}

impl SharedDevice {
    /// The implementation for `group`'s rank. Every rank of `group` must live in this process
    /// ([`shares_memory`](crate::distributed::comm::Communicator::shares_memory)) and compute on the same
    /// device; [`one_device`] says whether they do.
    pub fn new(group: Arc<ProcessGroup>) -> Self {
        let deferred = deferred(group.device());
        Self { group, deferred }
    }

    /// As [`new`](Self::new), with the protocol of deferred backends on or off whatever the backend (tests run
    /// it on Flex).
    #[cfg(test)]
    pub fn with_deferred(group: Arc<ProcessGroup>, deferred: bool) -> Self {
        Self { group, deferred }
    }

    /// On a deferred backend, runs this rank's queued work, so that what it shares, or has read, is computed.
    fn settle(&self, operation: &'static str) -> Result<()> {
        if !self.deferred {
            return Ok(());
        }
        self.group.device().sync().map_err(|e| Error::Execution {
            operation,
            device: format!("{:?}", self.group.device()),
            reason: format!("{e:?}"),
        })
    }

    /// A copy only this rank holds, where the backend defers work: of a tensor another rank made (its owner may
    /// drop it before this rank's queue reads it), or of one this rank sends away (so that the receiver alone
    /// reads and drops it).
    fn own(&self, t: Tensor<1>) -> Tensor<1> {
        if self.deferred { t.mul_scalar(1.0) } else { t }
    }

    /// After reading the other ranks' tensors, on a deferred backend: runs the reads and waits until every rank
    /// has run its own, then lets go of the references `round` held, so that no rank's queue frees (or writes in
    /// place) a tensor another rank's queue still has to read. Returns how to wrap the results.
    fn release(&self, operation: &'static str, round: Round) -> Result<Autodiff> {
        if self.deferred {
            self.settle(operation)?;
            self.group.comm().share(operation, Arc::new(()))?;
        }
        drop(round.keep);
        Ok(round.autodiff)
    }

    /// Every rank's `flat`, in rank order, without autodiff (see [`Autodiff`]), and the round to
    /// [`release`](Self::release) once they are read.
    fn share(&self, flat: Tensor<1>, operation: &'static str) -> Result<(Vec<Tensor<1>>, Round)> {
        let autodiff = Autodiff(flat.is_autodiff());
        self.settle(operation)?;
        let all = self
            .group
            .comm()
            .share(operation, Arc::new(flat.without_autodiff()))?;
        let all: Vec<Tensor<1>> = all
            .into_iter()
            .map(|v| tensor_of(v, operation))
            .collect::<Result<_>>()?;
        // On a deferred backend, an operation given the last reference to a tensor may free it or write into it
        // when its queue runs: holding one more reference until every rank has read keeps every read a read.
        let keep = if self.deferred {
            all.clone()
        } else {
            Vec::new()
        };
        Ok((all, Round { autodiff, keep }))
    }

    fn incompatible(operation: &'static str, reason: String) -> Error {
        Error::from(CommError::IncompatibleInputs {
            operation: operation.into(),
            reason,
        })
    }

    /// Every rank passed a tensor of the length and dtype of rank 0's: the same verdict on every rank.
    fn check_alike(all: &[Tensor<1>], operation: &'static str) -> Result<()> {
        let shape = |t: &Tensor<1>| (t.dims()[0], t.dtype());
        let first = shape(&all[0]);
        match all.iter().map(shape).enumerate().find(|(_, s)| *s != first) {
            Some((rank, (len, dtype))) => Err(Self::incompatible(
                operation,
                format!(
                    "rank {rank} passed {len} x {dtype:?}, rank 0 {} x {:?}; every rank must pass the same \
                     length and dtype",
                    first.0, first.1
                ),
            )),
            None => Ok(()),
        }
    }
}

/// Whether a rank's tensor was an autodiff tensor. Ranks hand each other inner tensors only, and every result is
/// a fresh leaf (as one made from host memory would be): a tensor of another rank's autodiff graph would tie the
/// ranks' graphs together, and their backward passes (each on its own thread) would lock each other.
#[derive(Debug, Clone, Copy)]
struct Autodiff(bool);

impl Autodiff {
    fn wrap(self, t: Tensor<1>) -> Tensor<1> {
        if self.0 { t.autodiff() } else { t }
    }
}

/// What a rank holds between sharing its tensor and releasing the round.
struct Round {
    autodiff: Autodiff,
    /// Every rank's tensor, held until every rank has read them (deferred backends only).
    keep: Vec<Tensor<1>>,
}

/// The tensor a rank shared, or an error naming what it shared instead.
fn tensor_of(value: SharedValue, operation: &'static str) -> Result<Tensor<1>> {
    value.downcast_ref::<Tensor<1>>().cloned().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{operation}: a rank shared something other than a flat tensor"
        ))
    })
}

/// Whether every rank of `group` lives in this process and computes on one device: what [`SharedDevice`]
/// needs. A collective where the engine shares memory (every rank of such a group calls it); `false` at once,
/// without communicating, elsewhere.
///
/// # Errors
/// The round's own (a timeout, a rank that failed).
pub(crate) fn one_device(group: &ProcessGroup) -> Result<bool> {
    if !group.comm().shares_memory() {
        return Ok(false);
    }
    let devices = group
        .comm()
        .share("device check", Arc::new(group.device().clone()))?;
    let mine = group.device();
    Ok(devices
        .iter()
        .all(|d| d.downcast_ref::<burn::tensor::Device>() == Some(mine)))
}

/// Whether `device`'s backend runs work later than it is asked for: every backend but the eager CPU ones.
fn deferred(device: &burn::tensor::Device) -> bool {
    use burn::backend::DispatchDevice;
    match device.clone().without_autodiff().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => false,
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => false,
        #[allow(unreachable_patterns)]
        _ => true,
    }
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// `parts` combined element-wise with `op` in rank order, then divided by the ranks (a mean) and multiplied by
/// `factor`; half-precision values in f32, the result in `dtype`.
fn combine(
    parts: Vec<Tensor<1>>,
    (op, factor): (ReduceOp, Option<f32>),
    ranks: usize,
    dtype: DType,
) -> Tensor<1> {
    let widen = is_half(dtype);
    let mut parts = parts
        .into_iter()
        .map(|t| if widen { t.cast(DType::F32) } else { t });
    let first = parts.next().expect("a group has at least one rank");
    let mut acc = parts.fold(first, |acc, t| match op {
        ReduceOp::Sum | ReduceOp::Mean => acc + t,
        ReduceOp::Max => acc.max_pair(t),
        ReduceOp::Min => acc.min_pair(t),
    });
    if op == ReduceOp::Mean {
        acc = acc.div_scalar(ranks as f32);
    }
    if let Some(factor) = factor {
        acc = acc.mul_scalar(factor);
    }
    if widen { acc.cast(dtype) } else { acc }
}

/// A flat tensor of no elements, in the dtype and on the device of `like`.
fn empty_like(like: &Tensor<1>, operation: &'static str) -> Result<Tensor<1>> {
    from_buffer(
        ReduceBuffer::F32(Vec::new()),
        None,
        (&like.device(), like.dtype()),
        operation,
    )
}

impl TensorComm for SharedDevice {
    fn name(&self) -> &'static str {
        NAME
    }

    fn rank(&self) -> usize {
        self.group.process_index()
    }

    fn world_size(&self) -> usize {
        self.group.num_processes()
    }

    fn all_reduce(
        &self,
        flat: Tensor<1>,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let dtype = flat.dtype();
        let (all, round) = self.share(flat, operation)?;
        Self::check_alike(&all, operation)?;
        let ranks = all.len();
        let combined = combine(all, how.split(ranks), ranks, dtype);
        let autodiff = self.release(operation, round)?;
        Ok(Pending::ready(autodiff.wrap(combined)))
    }

    fn reduce(
        &self,
        flat: Tensor<1>,
        root: usize,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Option<Tensor<1>>>> {
        crate::distributed::comm::check_root_public(operation, root, self.world_size())?;
        let dtype = flat.dtype();
        let (all, round) = self.share(flat, operation)?;
        Self::check_alike(&all, operation)?;
        let ranks = all.len();
        let combined = (self.rank() == root).then(|| combine(all, how.split(ranks), ranks, dtype));
        let autodiff = self.release(operation, round)?;
        Ok(Pending::ready(combined.map(|t| autodiff.wrap(t))))
    }

    fn reduce_scatter(
        &self,
        flat: Tensor<1>,
        counts: &[usize],
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let (dtype, len) = (flat.dtype(), flat.dims()[0]);
        let mine = part_of(counts, self.rank(), self.world_size(), len).map_err(Error::from)?;
        let (all, round) = self.share(flat, operation)?;
        Self::check_alike(&all, operation)?;
        let ranks = all.len();
        let part = if mine.is_empty() {
            empty_like(&all[0], operation)?
        } else {
            let parts = all.into_iter().map(|t| t.slice(mine.clone())).collect();
            combine(parts, how.split(ranks), ranks, dtype)
        };
        let autodiff = self.release(operation, round)?;
        Ok(Pending::ready(autodiff.wrap(part)))
    }

    fn all_gather(
        &self,
        part: Tensor<1>,
        counts: &[usize],
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let (world, rank) = (self.world_size(), self.rank());
        let total: usize = counts.iter().sum();
        // This rank's count is checked before the round, as the host engines check it.
        crate::distributed::comm::gathered_len(counts, rank, world, part.dims()[0])
            .map_err(Error::from)?;
        let dtype = part.dtype();
        let (all, round) = self.share(part, operation)?;
        if let Some((r, t)) = all
            .iter()
            .enumerate()
            .find(|(r, t)| t.dims()[0] != counts[*r] || t.dtype() != dtype)
        {
            return Err(Self::incompatible(
                operation,
                format!(
                    "rank {r} passed {} x {:?} where the counts {counts:?} give it {} x {dtype:?}",
                    t.dims()[0],
                    t.dtype(),
                    counts[r]
                ),
            ));
        }
        let gathered = if total == 0 {
            empty_like(&all[0], operation)?
        } else {
            let mut parts: Vec<(usize, Tensor<1>)> = all
                .into_iter()
                .enumerate()
                .filter(|(_, t)| t.dims()[0] > 0)
                .collect();
            if parts.len() == 1 {
                let (owner, part) = parts.pop().expect("one part");
                if owner == rank { part } else { self.own(part) }
            } else {
                Tensor::cat(parts.into_iter().map(|(_, t)| t).collect(), 0)
            }
        };
        let autodiff = self.release(operation, round)?;
        Ok(Pending::ready(autodiff.wrap(gathered)))
    }

    fn broadcast(
        &self,
        flat: Tensor<1>,
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        crate::distributed::comm::check_root_public(operation, root, self.world_size())?;
        let (all, round) = self.share(flat, operation)?;
        Self::check_alike(&all, operation)?;
        let root_values = all[root].clone();
        let mine = if self.rank() == root {
            root_values
        } else {
            self.own(root_values)
        };
        drop(all);
        let autodiff = self.release(operation, round)?;
        Ok(Pending::ready(autodiff.wrap(mine)))
    }

    /// Combined as the host engines combine it (`reduce_range`: rank order, a NaN kept), so a control value
    /// (an overflow verdict, a norm's part) is the same on every path.
    fn all_reduce_value(&self, value: f64, op: ReduceOp, operation: &'static str) -> Result<f64> {
        let all = self.group.comm().share(operation, Arc::new(value))?;
        let values = all
            .iter()
            .map(|v| {
                v.downcast_ref::<f64>()
                    .map(|&v| ReduceBuffer::F64(vec![v]))
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "{operation}: a rank shared something other than an f64"
                        ))
                    })
            })
            .collect::<Result<Vec<ReduceBuffer>>>()?;
        let refs: Vec<&ReduceBuffer> = values.iter().collect();
        match reduce_range(&refs, 0..1, op) {
            ReduceBuffer::F64(v) => Ok(v[0]),
            other => Err(Error::InvalidArgument(format!(
                "{operation}: {} values for one f64",
                other.kind()
            ))),
        }
    }

    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
        operation: &'static str,
    ) -> Result<Pending<Vec<Tensor<1>>>> {
        // A deferred backend sends copies it holds no other reference to, computed before they leave: the
        // receiver alone then reads them and drops them.
        let sends: Vec<(usize, SharedValue)> = sends
            .into_iter()
            .map(|(peer, t)| {
                (
                    peer,
                    Arc::new(self.own(t.without_autodiff())) as SharedValue,
                )
            })
            .collect();
        if !sends.is_empty() {
            self.settle(operation)?;
        }
        let peers = recvs.iter().map(|r| r.peer).collect();
        let received = self.group.comm().send_recv_shared(sends, peers)?;
        let rank = self.rank();
        let tensors = received
            .into_iter()
            .zip(&recvs)
            .map(|(value, r)| {
                let t = tensor_of(value, operation)?;
                if t.dims()[0] != r.len {
                    return Err(Self::incompatible(
                        operation,
                        format!(
                            "rank {} sent {} elements, rank {rank} expected {}; the two ranks must agree on every \
                             message's length",
                            r.peer,
                            t.dims()[0],
                            r.len
                        ),
                    ));
                }
                // Values arrive in the dtype and autodiff the receive asks for, as through host memory.
                let t = if t.dtype() == r.dtype { t } else { t.cast(r.dtype) };
                Ok(Autodiff(r.device.is_autodiff()).wrap(t))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Pending::ready(tensors))
    }

    fn on_group(&self, group: Arc<ProcessGroup>) -> Result<Arc<dyn TensorComm>> {
        Ok(Arc::new(Self::new(group)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::tensor_comm::HostTensorComm;

    #[test]
    fn control_values_combine_as_through_host_memory_a_nan_included() {
        let cases: [(f64, f64, f64); 3] = [
            (1.5, -2.25, 0.5),
            (f64::NAN, 1.0, 2.0),
            (3.0, f64::NAN, -1.0),
        ];
        let results = crate::launch(3, |acc| {
            let group = acc.group_arc();
            let (shared, host) = (SharedDevice::new(group.clone()), HostTensorComm::new(group));
            let mut out = Vec::new();
            for values in cases {
                let mine = [values.0, values.1, values.2][acc.process_index()];
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                    let a = shared.all_reduce_value(mine, op, "value")?;
                    let b = host.all_reduce_value(mine, op, "value")?;
                    out.push((op, a, b));
                }
            }
            Ok(out)
        })
        .unwrap();
        for rank in results {
            for (op, shared, host) in rank {
                assert!(
                    shared.to_bits() == host.to_bits() || (shared.is_nan() && host.is_nan()),
                    "{op}: {shared} vs {host}"
                );
            }
        }
    }
}
