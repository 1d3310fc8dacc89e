//! The tensor-level collective interface: how a strategy reaches other ranks with the tensors it holds.
//!
//! A [`TensorComm`] all-reduces, reduces to a root, reduce-scatters and all-gathers (with per-rank counts) and
//! broadcasts flat tensors of any float dtype, on their device, among the ranks of one group; what comes back is
//! in the dtype and on the device of what went in. Half-precision values are combined in f32 (as the host engines
//! always have: more accurate than summing in f16). Every call is started and then waited on ([`Pending`]), so
//! that communication can overlap compute: [`HostTensorComm::asynchronous`] runs its calls on a communication
//! thread of its own over a copy of the group's communicator (where the engine allows it: in-process ranks, MPI
//! with `MPI_THREAD_MULTIPLE`); [`HostTensorComm::new`] and the device engines complete each call when
//! it is started, which is cheapest where nothing overlaps. Either way every rank's calls keep the order they
//! were started in.
//!
//! | implementation | where the values travel |
//! |---|---|
//! | [`HostTensorComm`] | host memory, through the rank's [`Communicator`](crate::distributed::comm::Communicator) (in-process, MPI) |
//! | a device engine ([`on_device`]) | the device: every call on NCCL (sub-groups split from the group's communicator), the mean all-reduce on Burn's CUDA collective; host memory for single values and for what an engine lacks |
//! | [`shared_device::SharedDevice`] | nowhere: in-process ranks on one device hand each other the tensors themselves, every call |
//!
//! Sub-groups (a hybrid strategy's shard and replica groups) come from [`TensorComm::on_group`] over a split of the
//! group. Point-to-point messages
//! go in batches ([`TensorComm::send_recv`], torch's `batch_isend_irecv`): every send is posted before any
//! receive waits, so two ranks that exchange activations and gradients (a pipeline's neighbours) never wait on
//! each other.
//!
//! [`Checked`] wraps every implementation once: in debug mode the ranks compare each call (operation, dtype,
//! layout) before making it, so a rank that calls something else is an error on every rank, naming each rank's
//! call, instead of a hang or wrong data. [`bucket`] groups many small tensors into fewer calls, for every
//! strategy alike.

pub(crate) mod along;
pub(crate) mod bucket;
pub(crate) mod host;
mod lane;
pub(crate) mod on_device;
pub(crate) mod shared_device;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor};

pub(crate) use host::HostTensorComm;
pub(crate) use on_device::select_transport;

use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::ReduceOp;
use crate::error::Result;

/// One receive of a point-to-point batch ([`TensorComm::send_recv`]): `len` elements from rank `peer`, which
/// arrive in `dtype` on `device`.
#[derive(Debug, Clone)]
pub(crate) struct Incoming {
    /// The rank that sends it (in the group's numbering).
    pub peer: usize,
    /// How many elements it holds.
    pub len: usize,
    /// Where it lands.
    pub device: Device,
    /// In which element type.
    pub dtype: DType,
}

impl Incoming {
    /// `len` elements from `peer`, in the dtype and on the device of `like`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn like(peer: usize, len: usize, like: &Tensor<1>) -> Self {
        Self {
            peer,
            len,
            device: like.device(),
            dtype: like.dtype(),
        }
    }
}

/// How values combine across ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Reduction {
    /// The element-wise operation, as the engine computes it.
    Op(ReduceOp),
    /// The sum, then multiplied by the factor (one pass over the result).
    ScaledSum(f32),
    /// The mean times `scale`: the engine's mean when `scale` is 1, else the sum times scale / ranks (the same
    /// bits as a sum, for every implementation that keeps them).
    Average(f32),
}

impl Reduction {
    /// The operation the engine runs, and the factor the result is multiplied by afterwards, over `ranks`.
    pub fn split(self, ranks: usize) -> (ReduceOp, Option<f32>) {
        match self {
            Reduction::Op(op) => (op, None),
            Reduction::ScaledSum(factor) => (ReduceOp::Sum, Some(factor)),
            Reduction::Average(1.0) => (ReduceOp::Mean, None),
            Reduction::Average(scale) => (ReduceOp::Sum, Some(scale / ranks as f32)),
        }
    }
}

impl fmt::Display for Reduction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reduction::Op(op) => write!(f, "{op}"),
            Reduction::ScaledSum(factor) => write!(f, "sum x {factor}"),
            Reduction::Average(scale) => write!(f, "mean x {scale}"),
        }
    }
}

/// A started collective call: [`wait`](Self::wait) for its result. Every rank must wait on its calls in the
/// order it started them.
#[must_use = "a started collective must be waited on"]
pub(crate) struct Pending<T> {
    finish: Box<dyn FnOnce() -> Result<T> + Send>,
}

impl<T: 'static> Pending<T> {
    /// A call that completed when it was started.
    pub fn ready(value: T) -> Self
    where
        T: Send,
    {
        Self {
            finish: Box::new(move || Ok(value)),
        }
    }

    /// A call still running: `finish` waits for it and returns its result.
    pub fn later(finish: impl FnOnce() -> Result<T> + Send + 'static) -> Self {
        Self {
            finish: Box::new(finish),
        }
    }

    /// The call's result, turned by `then` once it has completed (on the thread that waits).
    pub fn then<U: 'static>(
        self,
        then: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Pending<U> {
        Pending {
            finish: Box::new(move || then((self.finish)()?)),
        }
    }

    /// The call's result, once it has completed.
    ///
    /// # Errors
    /// The call's own: a timeout, a peer's failure, values the engine could not return.
    pub fn wait(self) -> Result<T> {
        (self.finish)()
    }
}

impl<T> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pending")
    }
}

/// The one way a strategy reaches other ranks: tensor collectives among the ranks of one group. `operation`
/// names the call in messages and in debug mode's comparison; every rank of the group makes the same calls in
/// the same order, whatever it holds.
pub(crate) trait TensorComm: Send + Sync + fmt::Debug {
    /// How its all-reduces travel, for messages (`host all-reduce`, `device collectives (NCCL)`).
    fn name(&self) -> &'static str;

    /// This rank's index in the group.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn world_size(&self) -> usize;

    /// The dtype `dtype`'s values travel in, which debug mode's check compares between ranks: their own where the
    /// values travel as they are, f32 for host memory (every float dtype is widened to it).
    fn wire_dtype(&self, dtype: DType) -> DType {
        dtype
    }

    /// `flat` combined element-wise over the ranks, on every rank.
    ///
    /// # Errors
    /// The engine's (timeouts, a peer's failure, ranks passing different lengths).
    fn all_reduce(
        &self,
        flat: Tensor<1>,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>>;

    /// `flat` combined over the ranks, on `root` only (`None` elsewhere).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn reduce(
        &self,
        flat: Tensor<1>,
        root: usize,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Option<Tensor<1>>>>;

    /// `flat` (every rank's the same length, the sum of `counts`) combined over the ranks; rank `r` gets only its
    /// part, the `counts[r]` elements after the first `counts[..r]`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); `counts` that do not name every rank or add up to the length.
    fn reduce_scatter(
        &self,
        flat: Tensor<1>,
        counts: &[usize],
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>>;

    /// Every rank's `part` (`counts[r]` elements from rank `r`, which may be none) concatenated in rank order, on
    /// every rank, in the dtype and on the device of `part`.
    ///
    /// # Errors
    /// As [`reduce_scatter`](Self::reduce_scatter).
    fn all_gather(
        &self,
        part: Tensor<1>,
        counts: &[usize],
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>>;

    /// `root`'s `flat` on every rank (the others pass a tensor of the same length, whose values are ignored).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn broadcast(
        &self,
        flat: Tensor<1>,
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>>;

    /// Rank `r`'s part of `root`'s `flat`: its elements `parts[r]` (one range per rank; ranges may be empty, and
    /// overlap where ranks hold the same part, as replicas do). The other ranks pass a tensor that gives only the
    /// part's dtype and device (an empty one will do): no rank but `root` ever holds more than its part. `root`'s
    /// own part may be a view of `flat`.
    ///
    /// By default `root` sends each rank its part point-to-point ([`send_recv`](Self::send_recv)), one rank at a
    /// time, so that `root` holds `flat` and one part in flight; an implementation with a scatter of its own
    /// replaces it.
    ///
    /// # Errors
    /// `parts` with another number of ranges than ranks, or a range beyond `root`'s `flat`; as
    /// [`send_recv`](Self::send_recv).
    fn scatter(
        &self,
        flat: Tensor<1>,
        parts: &[Range<usize>],
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let (me, world) = (self.rank(), self.world_size());
        if parts.len() != world || root >= world {
            return Err(crate::error::Error::InvalidArgument(format!(
                "{operation}: a scatter from rank {root} with {} parts, over ranks 0..{world} (one part per rank)",
                parts.len()
            )));
        }
        let like = (flat.device(), flat.dtype());
        let empty = || Tensor::<1>::zeros([0], (&like.0, like.1));
        // Only `root` knows its buffer's length: every rank learns whether the ranges fit it before any waits for
        // its part, so that a bad range is an error on every rank at once, not a receive that never completes.
        let len = flat.dims()[0];
        let outside = (me == root)
            .then(|| {
                parts
                    .iter()
                    .enumerate()
                    .find(|(_, p)| p.start > p.end || p.end > len)
            })
            .flatten();
        if world > 1 {
            let fits = self.all_reduce_value(
                f64::from(u8::from(outside.is_none())),
                ReduceOp::Min,
                operation,
            )?;
            if fits == 0.0 && outside.is_none() {
                return Err(crate::error::Error::InvalidArgument(format!(
                    "{operation}: rank {root}'s scatter has a part outside its buffer (its error names it); no \
                     part was sent"
                )));
            }
        }
        if let Some((r, part)) = outside {
            return Err(crate::error::Error::InvalidArgument(format!(
                "{operation}: rank {r}'s part {part:?} lies outside rank {root}'s {len} elements"
            )));
        }
        if me != root {
            let part = &parts[me];
            if part.is_empty() {
                return Ok(Pending::ready(empty()));
            }
            let incoming = Incoming {
                peer: root,
                len: part.len(),
                device: like.0.clone(),
                dtype: like.1,
            };
            return Ok(self.send_recv(Vec::new(), vec![incoming], operation)?.then(
                move |mut received| {
                    received.pop().ok_or_else(|| {
                        crate::error::Error::InvalidArgument(format!(
                            "{operation}: the engine returned no tensor for rank {me}'s part"
                        ))
                    })
                },
            ));
        }
        for (r, part) in parts.iter().enumerate() {
            if r != root && !part.is_empty() {
                let sent = flat.clone().slice(part.clone());
                self.send_recv(vec![(r, sent)], Vec::new(), operation)?
                    .wait()?;
            }
        }
        let own = &parts[root];
        Ok(Pending::ready(if own.is_empty() {
            empty()
        } else {
            flat.slice(own.clone())
        }))
    }

    /// One host value combined over the ranks, on every rank: a control value (an overflow verdict, a part of a
    /// gradient norm) that lives on the host and is combined in f64 on every backend, without a device tensor
    /// (some devices have no f64).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn all_reduce_value(&self, value: f64, op: ReduceOp, operation: &'static str) -> Result<f64>;

    /// A batch of point-to-point messages: each of `sends` (`(peer, tensor)`) goes to its peer, each of `recvs`
    /// comes from its own, and the received tensors come back in `recvs`' order. Only the ranks named take part.
    /// Every send is posted before any receive waits, so a pair of ranks that send to and receive from each other
    /// in one batch never wait on each other; one rank's messages to another arrive in the order it sent them.
    /// Values travel as the implementation carries them (host memory: f32, or f64 for f64 values; half-precision
    /// values are widened and narrowed back exactly).
    ///
    /// # Errors
    /// A peer outside the group; a message whose length differs from its receive's (an error on the receiving
    /// rank); nothing from a peer within the timeout, or a peer that failed.
    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
        operation: &'static str,
    ) -> Result<Pending<Vec<Tensor<1>>>>;

    /// The same implementation over `group`, a sub-group of the ranks this one connects (made by
    /// [`ProcessGroup::split`], which every rank of the group calls).
    ///
    /// # Errors
    /// An implementation that cannot connect the sub-group.
    fn on_group(&self, group: Arc<ProcessGroup>) -> Result<Arc<dyn TensorComm>>;
}

/// An implementation with debug mode's check wrapped around every call: before each collective, the ranks of
/// `group` (the group the implementation connects) compare the operation, the dtype and the layout (length,
/// counts, root), so a mismatch is an error on every rank instead of a hang. Without debug mode the check costs
/// nothing.
#[derive(Debug)]
pub(crate) struct Checked {
    inner: Arc<dyn TensorComm>,
    group: Arc<ProcessGroup>,
}

impl Checked {
    /// `inner`, checked over `group`'s communicator.
    pub fn new(inner: Arc<dyn TensorComm>, group: Arc<ProcessGroup>) -> Self {
        Self { inner, group }
    }

    /// Host memory over `group`'s communicator, checked: the implementation every strategy can use.
    pub fn host(group: Arc<ProcessGroup>) -> Self {
        Self::new(Arc::new(HostTensorComm::new(group.clone())), group)
    }

    fn check(&self, operation: &str, dtype: DType, layout: &[usize]) -> Result<()> {
        collectives::verify_call(&self.group, operation, self.inner.wire_dtype(dtype), layout)
    }
}

/// The layout debug mode compares for a call over `counts`: the counts, then whether this rank's buffer agrees
/// with them (1) or not (0).
fn layout(counts: &[usize], fits: bool) -> Vec<usize> {
    counts.iter().copied().chain([usize::from(fits)]).collect()
}

impl TensorComm for Checked {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn wire_dtype(&self, dtype: DType) -> DType {
        self.inner.wire_dtype(dtype)
    }

    fn all_reduce(
        &self,
        flat: Tensor<1>,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        self.check(operation, flat.dtype(), &flat.dims())?;
        self.inner.all_reduce(flat, how, operation)
    }

    fn reduce(
        &self,
        flat: Tensor<1>,
        root: usize,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Option<Tensor<1>>>> {
        self.check(operation, flat.dtype(), &[flat.dims()[0], root])?;
        self.inner.reduce(flat, root, how, operation)
    }

    fn reduce_scatter(
        &self,
        flat: Tensor<1>,
        counts: &[usize],
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        // The counts, and whether this rank's buffer agrees with them: a rank whose buffer does not is named on
        // every rank.
        let fits = flat.dims()[0] == counts.iter().sum::<usize>();
        self.check(operation, flat.dtype(), &layout(counts, fits))?;
        self.inner.reduce_scatter(flat, counts, how, operation)
    }

    fn all_gather(
        &self,
        part: Tensor<1>,
        counts: &[usize],
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let fits = counts.get(self.rank()) == Some(&part.dims()[0]);
        self.check(operation, part.dtype(), &layout(counts, fits))?;
        self.inner.all_gather(part, counts, operation)
    }

    fn broadcast(
        &self,
        flat: Tensor<1>,
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        self.check(operation, flat.dtype(), &[flat.dims()[0], root])?;
        self.inner.broadcast(flat, root, operation)
    }

    fn scatter(
        &self,
        flat: Tensor<1>,
        parts: &[Range<usize>],
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let layout: Vec<usize> = parts
            .iter()
            .flat_map(|p| [p.start, p.end])
            .chain([root])
            .collect();
        self.check(operation, flat.dtype(), &layout)?;
        self.inner.scatter(flat, parts, root, operation)
    }

    fn all_reduce_value(&self, value: f64, op: ReduceOp, operation: &'static str) -> Result<f64> {
        self.check(operation, DType::F64, &[1])?;
        self.inner.all_reduce_value(value, op, operation)
    }

    /// Only the peers take part, so there is no group-wide comparison: each message carries its kind and length,
    /// and the receiving rank checks them.
    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
        operation: &'static str,
    ) -> Result<Pending<Vec<Tensor<1>>>> {
        let world = self.world_size();
        if let Some(peer) = sends
            .iter()
            .map(|(peer, _)| *peer)
            .chain(recvs.iter().map(|r| r.peer))
            .find(|peer| *peer >= world)
        {
            return Err(crate::error::Error::InvalidArgument(format!(
                "{operation}: a message to or from rank {peer}, but the group has ranks 0..{world}"
            )));
        }
        self.inner.send_recv(sends, recvs, operation)
    }

    fn on_group(&self, group: Arc<ProcessGroup>) -> Result<Arc<dyn TensorComm>> {
        Ok(Arc::new(Self::new(
            self.inner.on_group(group.clone())?,
            group,
        )))
    }
}
