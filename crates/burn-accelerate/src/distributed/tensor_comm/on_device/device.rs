//! Collectives in device memory through a library (NCCL) that one process drives on its own device, with the
//! guarantees host collectives give: the library's id travels over the rank's communicator, every call has the
//! collective timeout (a stuck call becomes [`CommError::Timeout`] naming the operation, then the communicator is
//! aborted so no rank waits forever), debug mode compares every rank's call first (a mismatch is an error, not a
//! hang), and a rank that cannot connect stops every rank.
//!
//! The library sits behind [`DeviceComm`] / [`DeviceCommLibrary`]: NCCL through `cudarc` in CUDA builds
//! ([`super::nccl`]), a host-memory double in the tests below, which run this whole path on every machine.
//! [`DeviceCollectives`] runs every call of the tensor interface on it: all-reduce, reduce, reduce-scatter,
//! all-gather, broadcast, point-to-point batches (one group call), and the communicators of sub-groups (split
//! from the group's, as `ncclCommSplit` does).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor};

use super::DeviceEngine;
use crate::distributed::ProcessGroup;
use crate::distributed::comm::{CommError, ReduceBuffer, ReduceOp};
use crate::distributed::tensor_comm::Incoming;
use crate::error::{Error, Result};

/// How gradient values travel in a device collective: the float types NCCL reduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireType {
    F32,
    F16,
    BF16,
    F64,
}

impl WireType {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            WireType::F32 => 4,
            WireType::F16 | WireType::BF16 => 2,
            WireType::F64 => 8,
        }
    }
}

/// The wire type of a gradient dtype (`Flex32` is stored as f32), or why it cannot be reduced on the device.
pub(crate) fn wire_type(dtype: DType) -> std::result::Result<WireType, String> {
    match dtype {
        DType::F32 | DType::Flex32 => Ok(WireType::F32),
        DType::F16 => Ok(WireType::F16),
        DType::BF16 => Ok(WireType::BF16),
        DType::F64 => Ok(WireType::F64),
        other => Err(format!(
            "gradients of dtype {other:?} cannot be averaged on the device (f32, f16, bf16 and f64 can); set \
             ACCELERATE_GRADIENT_TRANSPORT=host"
        )),
    }
}

/// The 128-byte group id (NCCL's `ncclUniqueId`) in `bytes`, as received over the communicator.
pub(crate) fn group_id(bytes: &[u8]) -> std::result::Result<[u8; 128], String> {
    bytes.try_into().map_err(|_| {
        format!(
            "the group id from rank 0 has {} bytes, NCCL's has 128 (ranks built against different libraries?)",
            bytes.len()
        )
    })
}

/// Checks that `bytes` of values fit in the source and destination buffers (`read`, `write` bytes, as the
/// device allocator reports them; a buffer may be larger than the tensor, never smaller).
pub(crate) fn check_range(bytes: usize, read: u64, write: u64) -> std::result::Result<(), String> {
    for (what, size) in [("source", read), ("destination", write)] {
        if (size as u128) < bytes as u128 {
            return Err(format!(
                "the {what} buffer holds {size} bytes, the all-reduce needs {bytes}"
            ));
        }
    }
    Ok(())
}

/// The reduction a library runs for `op` over `world` ranks. On one rank a mean is a sum: NCCL's one-rank
/// kernel for `ncclAvg` (`oneRankReduce`, a grid of at most 32 blocks of `alignUp(n / blocks, 16 bytes)`
/// elements each) leaves the last `n mod blocks` elements unwritten whenever `n / blocks` is already a whole
/// number of 16-byte packs — the last 3 of 2^20 + 3 values on the first GPU run — while its one-rank sum is a
/// plain copy.
pub(crate) fn library_op(op: ReduceOp, world: usize) -> ReduceOp {
    if world == 1 && op == ReduceOp::Mean {
        ReduceOp::Sum
    } else {
        op
    }
}

/// A device collective library: mints the id a group of ranks connects with, and connects.
pub(crate) trait DeviceCommLibrary: Send + Sync {
    /// The library's name for messages (`NCCL`).
    fn name(&self) -> &'static str;

    /// A new group id (NCCL's `ncclUniqueId`), minted on rank 0 and sent to every rank.
    fn new_id(&self) -> std::result::Result<Vec<u8>, String>;

    /// Starts connecting `rank` of `world` to the group `id` on this rank's device. Connecting may finish
    /// later: [`DeviceComm::poll`] says when.
    fn connect(
        &self,
        id: &[u8],
        rank: usize,
        world: usize,
    ) -> std::result::Result<Box<dyn DeviceComm>, String>;
}

/// A call a [`DeviceComm`] runs on device memory. Every rank of the group makes the same collective call with
/// tensors of the same length and dtype; a point-to-point batch is made by the ranks it names.
#[derive(Debug, Clone)]
pub(crate) enum DeviceCall {
    /// `flat` combined element-wise over the group (`ncclAllReduce`), the whole on every rank.
    AllReduce { flat: Tensor<1>, op: ReduceOp },
    /// `flat` combined element-wise over the group onto `root` (`ncclReduce`); the other ranks' results are
    /// unspecified.
    Reduce {
        flat: Tensor<1>,
        op: ReduceOp,
        root: usize,
    },
    /// `flat` combined over the group in as many equal parts as ranks; this rank keeps its own
    /// (`ncclReduceScatter`).
    ReduceScatter { flat: Tensor<1>, op: ReduceOp },
    /// Every rank's `part` concatenated in rank order, on every rank (`ncclAllGather`).
    AllGather { part: Tensor<1> },
    /// `root`'s `flat` on every rank (`ncclBroadcast`).
    Broadcast { flat: Tensor<1>, root: usize },
    /// Point-to-point messages in one group call (`ncclGroupStart`, an `ncclSend` per send and an `ncclRecv`
    /// per receive, `ncclGroupEnd`): no message waits for another, so two ranks may send each other at once.
    /// The results are the receives, in order; a rank may send to and receive from itself.
    SendRecv {
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
    },
}

impl DeviceCall {
    /// The tensor a collective sends (`None` for a point-to-point batch).
    pub fn input(&self) -> Option<&Tensor<1>> {
        match self {
            DeviceCall::AllReduce { flat, .. }
            | DeviceCall::Reduce { flat, .. }
            | DeviceCall::ReduceScatter { flat, .. }
            | DeviceCall::Broadcast { flat, .. } => Some(flat),
            DeviceCall::AllGather { part } => Some(part),
            DeviceCall::SendRecv { .. } => None,
        }
    }

    /// The call's name in messages.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceCall::AllReduce { .. } => "all_reduce",
            DeviceCall::Reduce { .. } => "reduce",
            DeviceCall::ReduceScatter { .. } => "reduce_scatter",
            DeviceCall::AllGather { .. } => "all_gather",
            DeviceCall::Broadcast { .. } => "broadcast",
            DeviceCall::SendRecv { .. } => "send_recv",
        }
    }

    /// The operation a timeout or an error names.
    fn operation(&self) -> &'static str {
        match self {
            DeviceCall::AllReduce { .. } => "gradient_all_reduce",
            DeviceCall::Reduce { .. } => "device_reduce",
            DeviceCall::ReduceScatter { .. } => "device_reduce_scatter",
            DeviceCall::AllGather { .. } => "device_all_gather",
            DeviceCall::Broadcast { .. } => "device_broadcast",
            DeviceCall::SendRecv { .. } => "device_send_recv",
        }
    }

    /// How many elements a collective's result holds on each of `world` ranks, or why the input cannot be
    /// split; for a point-to-point batch, the elements it receives.
    pub fn output_len(&self, world: usize) -> std::result::Result<usize, String> {
        let Some(input) = self.input() else {
            return match self {
                DeviceCall::SendRecv { recvs, .. } => Ok(recvs.iter().map(|r| r.len).sum()),
                _ => Err("a collective without input".into()),
            };
        };
        let len = input.dims()[0];
        Ok(match self {
            DeviceCall::AllReduce { .. }
            | DeviceCall::Reduce { .. }
            | DeviceCall::Broadcast { .. }
            | DeviceCall::SendRecv { .. } => len,
            DeviceCall::ReduceScatter { .. } => {
                if world == 0 || !len.is_multiple_of(world) {
                    return Err(format!(
                        "a device reduce-scatter splits {len} values into {world} equal parts: it cannot"
                    ));
                }
                len / world
            }
            DeviceCall::AllGather { .. } => len * world,
        })
    }

    /// Checks the call for a group of `world` ranks: every dtype on the wire, roots and peers in the group, a
    /// reduce-scatter's input divisible.
    fn check(&self, world: usize) -> std::result::Result<(), String> {
        self.output_len(world)?;
        let in_group = |what: &str, rank: usize| {
            if rank < world {
                Ok(())
            } else {
                Err(format!(
                    "a {what} rank {rank}, but the group has ranks 0..{world}"
                ))
            }
        };
        match self {
            DeviceCall::Reduce { root, .. } | DeviceCall::Broadcast { root, .. } => {
                in_group("root", *root)?
            }
            DeviceCall::SendRecv { sends, recvs } => {
                for (peer, flat) in sends {
                    in_group("destination", *peer)?;
                    wire_type(flat.dtype())?;
                }
                for r in recvs {
                    in_group("source", r.peer)?;
                    wire_type(r.dtype)?;
                }
            }
            _ => {}
        }
        if let Some(input) = self.input() {
            wire_type(input.dtype())?;
        }
        Ok(())
    }

    /// The call as the library runs it on `world` ranks: each reduction through [`library_op`].
    fn for_library(self, world: usize) -> Self {
        match self {
            DeviceCall::AllReduce { flat, op } => DeviceCall::AllReduce {
                flat,
                op: library_op(op, world),
            },
            DeviceCall::Reduce { flat, op, root } => DeviceCall::Reduce {
                flat,
                op: library_op(op, world),
                root,
            },
            DeviceCall::ReduceScatter { flat, op } => DeviceCall::ReduceScatter {
                flat,
                op: library_op(op, world),
            },
            other => other,
        }
    }

    /// The results of a call that moves nothing ([`is_empty`](Self::is_empty)): empty tensors where the
    /// results would land.
    fn empty_results(&self) -> Vec<Tensor<1>> {
        match self {
            DeviceCall::SendRecv { recvs, .. } => recvs
                .iter()
                .map(|r| Tensor::zeros([0], (&r.device, r.dtype)))
                .collect(),
            collective => collective
                .input()
                .map(|input| Tensor::zeros([0], (&input.device(), input.dtype())))
                .into_iter()
                .collect(),
        }
    }

    /// Whether the call moves no value at all (every length 0: the same on every rank, so every rank skips it).
    fn is_empty(&self) -> bool {
        match self {
            DeviceCall::SendRecv { sends, recvs } => {
                sends.iter().all(|(_, t)| t.dims()[0] == 0) && recvs.iter().all(|r| r.len == 0)
            }
            other => other.input().is_some_and(|t| t.dims()[0] == 0),
        }
    }
}

/// One rank's connection to a device collective group. Operations are asynchronous: they are enqueued, then
/// [`poll`](Self::poll) says whether the last one finished. Its life, as NCCL's non-blocking communicators ask:
/// formed (polled), used, then [`finalize`](Self::finalize)d (polled) and [`destroy`](Self::destroy)ed on a
/// normal end, or [`abort`](Self::abort)ed after a failure or a timeout, and never used again after either.
pub(crate) trait DeviceComm: Send + Sync + fmt::Debug {
    /// Starts `call` over the group, in device memory. A start that fails part way (one send of a batch refused)
    /// keeps every buffer it was handed or made alive until [`abort`](Self::abort) has returned: the library may
    /// still write into them.
    fn start(&self, call: DeviceCall) -> std::result::Result<(), String>;

    /// The results of the last [`start`](Self::start), once [`poll`](Self::poll) has reported it done: one
    /// tensor for a collective (autodiff where its input was), the receives in order for a point-to-point batch
    /// (each on its [`Incoming`]'s device, autodiff included).
    fn finish(&self) -> std::result::Result<Vec<Tensor<1>>, String>;

    /// `Ok(true)` when everything enqueued so far has finished (or the connection has formed), `Ok(false)` while
    /// it runs, or the library's error.
    fn poll(&self) -> std::result::Result<bool, String>;

    /// Starts making the communicator of a sub-group (`ncclCommSplit`): every rank of this group calls it, the
    /// ranks passing the same `color` form one group of `world` ranks, numbered by `key`. On a non-blocking
    /// communicator the split is this connection's operation: the new one is not even there (NCCL writes its
    /// handle when this one leaves `ncclInProgress`) until this connection's [`poll`](Self::poll) reports it
    /// done; only then may the new one be polled until it has formed. Nothing else may be started on this one
    /// meanwhile.
    fn split(
        &self,
        color: usize,
        key: usize,
        world: usize,
    ) -> std::result::Result<Box<dyn DeviceComm>, String>;

    /// Starts ending the connection normally (`ncclCommFinalize`): what is still in flight is flushed;
    /// [`poll`](Self::poll) says when that is done, and then [`destroy`](Self::destroy) frees it.
    fn finalize(&self) -> std::result::Result<(), String>;

    /// Frees the connection once [`finalize`](Self::finalize) has completed (`ncclCommDestroy`).
    fn destroy(&self) -> std::result::Result<(), String>;

    /// Abandons the group's outstanding work (NCCL's `ncclCommAbort`) after a timeout or an error; the
    /// connection is unusable afterwards.
    fn abort(&self);
}

/// A [`DeviceComm`] that refuses every call once aborted. NCCL frees an aborted communicator
/// (`ncclCommAbort`), so a call after a timeout or an error would use freed memory; this guard makes it an error
/// whatever the library does.
#[derive(Debug)]
struct Guarded {
    inner: Box<dyn DeviceComm>,
    /// Aborted, or destroyed after a normal end: either way freed.
    aborted: AtomicBool,
}

impl Guarded {
    fn new(inner: Box<dyn DeviceComm>) -> Self {
        Self {
            inner,
            aborted: AtomicBool::new(false),
        }
    }

    /// Whether the connection is still there (neither aborted nor destroyed).
    fn is_live(&self) -> bool {
        !self.aborted.load(Ordering::Acquire)
    }

    fn live(&self) -> std::result::Result<&dyn DeviceComm, String> {
        if self.aborted.load(Ordering::Acquire) {
            Err("the device communicator was aborted after an earlier timeout or error and cannot be used \
                 again: restart the run (`burn-accelerate launch --max-restarts`), or set \
                 ACCELERATE_GRADIENT_TRANSPORT=host"
                .into())
        } else {
            Ok(&*self.inner)
        }
    }
}

impl DeviceComm for Guarded {
    fn start(&self, call: DeviceCall) -> std::result::Result<(), String> {
        self.live()?.start(call)
    }

    fn finish(&self) -> std::result::Result<Vec<Tensor<1>>, String> {
        self.live()?.finish()
    }

    fn poll(&self) -> std::result::Result<bool, String> {
        self.live()?.poll()
    }

    fn split(
        &self,
        color: usize,
        key: usize,
        world: usize,
    ) -> std::result::Result<Box<dyn DeviceComm>, String> {
        self.live()?.split(color, key, world)
    }

    fn finalize(&self) -> std::result::Result<(), String> {
        self.live()?.finalize()
    }

    fn destroy(&self) -> std::result::Result<(), String> {
        let inner = self.live()?;
        self.aborted.store(true, Ordering::Release);
        inner.destroy()
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            self.inner.abort();
        }
    }
}

/// Runs the tensor interface's calls through a [`DeviceComm`], keeping the values on the device: gradient
/// averages, every collective of sharded training, point-to-point batches, and sub-groups.
pub(crate) struct DeviceCollectives {
    group: Arc<ProcessGroup>,
    comm: Guarded,
    library: &'static str,
    timeout: Duration,
    seq: AtomicU64,
}

impl fmt::Debug for DeviceCollectives {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceCollectives")
            .field("library", &self.library)
            .field("rank", &self.group.process_index())
            .finish()
    }
}

impl DeviceCollectives {
    /// Connects `group`'s rank through `library`: rank 0 mints the id, the communicator broadcasts it, every
    /// rank connects and waits (at most `timeout`) until the group is formed. Every rank learns whether every
    /// rank connected, so a rank whose library fails stops them all with its reason.
    pub fn connect(
        group: Arc<ProcessGroup>,
        library: &dyn DeviceCommLibrary,
        timeout: Duration,
    ) -> Result<Self> {
        let name = library.name();
        let fail = |what: &str, e: String| Error::Execution {
            operation: "device all-reduce setup",
            device: format!("{:?}", group.device()),
            reason: format!("{name} {what}: {e}"),
        };
        let minted = if group.is_main_process() {
            library
                .new_id()
                .map_err(|e| fail("could not mint a group id", e))
        } else {
            Ok(Vec::new())
        };
        let minted = group.agree("device all-reduce id", minted)?;
        let id = group.comm().broadcast(minted, 0)?;
        // Every rank learns whether every rank could start connecting before any waits for the group to form
        // (a rank whose library failed would otherwise leave the others waiting until the timeout).
        let started = library
            .connect(&id, group.process_index(), group.num_processes())
            .map_err(|e| fail("could not connect", e));
        let comm = Guarded::new(group.agree("device all-reduce connect", started)?);
        let formed = wait(&comm, timeout, "device_all_reduce_connect", &group, 0);
        group.agree("device all-reduce group", formed)?;
        Ok(Self {
            group,
            comm,
            library: name,
            timeout,
            seq: AtomicU64::new(1),
        })
    }

    /// The collectives of `sub`, a sub-group of this group made by [`ProcessGroup::split`], over a communicator
    /// split from this one. Every rank of this group calls it, right after the same split. The sub-group's
    /// colour is its lowest rank in this group (its ranks learn it over the sub-group's communicator, as bytes);
    /// every rank of this group learns whether every split formed.
    pub(crate) fn split_for(&self, sub: Arc<ProcessGroup>) -> Result<Self> {
        let me = (self.group.process_index() as u64).to_le_bytes().to_vec();
        let color = sub
            .comm()
            .all_gather(me)?
            .iter()
            .filter_map(|bytes| <[u8; 8]>::try_from(bytes.as_slice()).ok())
            .map(u64::from_le_bytes)
            .min()
            .unwrap_or(self.group.process_index() as u64) as usize;
        let fail = |e: String| Error::Execution {
            operation: "device communicator split",
            device: format!("{:?}", self.group.device()),
            reason: format!("{} could not split its communicator: {e}", self.library),
        };
        // After a failure anywhere, each rank aborts its child, then the parent (NCCL's order: a child before
        // the communicator it was split from), and the parent is refused from then on.
        let abort_both = |child: Option<&Guarded>| {
            if let Some(child) = child {
                child.abort();
            }
            self.comm.abort();
        };
        // Every rank learns whether every rank could start its split before any waits for it to form.
        let started = self
            .comm
            .split(color, sub.process_index(), sub.num_processes())
            .map_err(fail)
            .map(Guarded::new);
        let outcome = match &started {
            Ok(_) => Ok(()),
            Err(e) => Err(Error::other(e.to_string())),
        };
        if let Err(e) = self.group.agree("device communicator split", outcome) {
            abort_both(started.as_ref().ok());
            return Err(started.err().unwrap_or(e));
        }
        let comm = started?;
        // One budget for both waits: the parent leaves `ncclInProgress` (NCCL has then written the child's
        // handle), then the child forms.
        let budget = (Instant::now() + self.timeout, self.timeout);
        let formed = poll_until(&self.comm, budget, "device_comm_split", &self.group, 0)
            .and_then(|()| poll_until(&comm, budget, "device_comm_split", &sub, 0));
        if let Err(e) = self.group.agree("device communicator split formed", formed) {
            abort_both(Some(&comm));
            return Err(e);
        }
        Ok(Self {
            group: sub,
            comm,
            library: self.library,
            timeout: self.timeout,
            seq: AtomicU64::new(1),
        })
    }

    /// Debug mode, point-to-point: each message's length and dtype travel ahead of it over the communicator
    /// (two host values per message), and the receiving rank compares them with what it expects, so a
    /// mismatch is an error naming both instead of a library call that reads past a buffer or waits for ever.
    fn check_messages(&self, sends: &[(usize, Tensor<1>)], recvs: &[Incoming]) -> Result<()> {
        let header = |len: usize, dtype: DType| -> Vec<f64> { vec![len as f64, dtype_code(dtype)] };
        let headers = sends
            .iter()
            .map(|(peer, t)| (*peer, ReduceBuffer::F64(header(t.dims()[0], t.dtype()))))
            .collect();
        let expected: Vec<(usize, ReduceBuffer)> = recvs
            .iter()
            .map(|r| (r.peer, ReduceBuffer::F64(vec![0.0; 2])))
            .collect();
        let received = self.group.comm().send_recv(headers, expected)?;
        for (r, got) in recvs.iter().zip(received) {
            let want = header(r.len, r.dtype);
            if !matches!(&got, ReduceBuffer::F64(v) if *v == want) {
                return Err(Error::InvalidArgument(format!(
                    "device_send_recv on rank {}: rank {} sent {got:?} (length, dtype code) where {want:?} was \
                     expected: the two ranks disagree on the message",
                    self.group.process_index(),
                    r.peer
                )));
            }
        }
        Ok(())
    }
}

/// A dtype's number in debug mode's message headers.
fn dtype_code(dtype: DType) -> f64 {
    match wire_type(dtype) {
        Ok(WireType::F32) => 1.0,
        Ok(WireType::F16) => 2.0,
        Ok(WireType::BF16) => 3.0,
        Ok(WireType::F64) => 4.0,
        Err(_) => 0.0,
    }
}

/// Polls `comm` until its work is done; past `timeout`, aborts it and returns the timeout error.
fn wait(
    comm: &dyn DeviceComm,
    timeout: Duration,
    operation: &str,
    group: &ProcessGroup,
    seq: u64,
) -> Result<()> {
    let outcome = poll_until(
        comm,
        (Instant::now() + timeout, timeout),
        operation,
        group,
        seq,
    );
    if outcome.is_err() {
        comm.abort();
    }
    outcome
}

/// Polls `comm` until its work is done, or returns the timeout error at `deadline` (the end of a budget of
/// `timeout`) or the library's error, the communicator left as it is: the caller aborts it, in the order its
/// communicators need.
fn poll_until(
    comm: &dyn DeviceComm,
    (deadline, timeout): (Instant, Duration),
    operation: &str,
    group: &ProcessGroup,
    seq: u64,
) -> Result<()> {
    let mut pause = Duration::from_micros(20);
    loop {
        match comm.poll() {
            Ok(true) => return Ok(()),
            Ok(false) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
            Ok(false) => {
                return Err(CommError::Timeout {
                    operation: operation.to_string(),
                    seq,
                    rank: group.process_index(),
                    missing: Vec::new(),
                    timeout,
                }
                .into());
            }
            Err(e) => {
                return Err(Error::Execution {
                    operation: "device all-reduce",
                    device: format!("{:?}", group.device()),
                    reason: format!("`{operation}` #{seq}: {e}"),
                });
            }
        }
    }
}

/// The longest a normal end waits for the library to flush its connection before aborting it: every call was
/// waited for already, so a finalize that takes longer has lost a peer.
const FINALIZE_WAIT: Duration = Duration::from_secs(30);

impl DeviceCollectives {
    /// Ends the connection normally: finalized (polled, as non-blocking communicators are), then destroyed, so
    /// that no peer's traffic still in flight is cut; aborted where the finalize fails or does not complete in
    /// time (then its error). A connection aborted already (after a failure) is left as it is.
    pub(crate) fn close(self) -> Result<()> {
        self.end()
    }

    fn end(&self) -> Result<()> {
        if !self.comm.is_live() {
            return Ok(());
        }
        let wait = self.timeout.min(FINALIZE_WAIT);
        let deadline = (Instant::now() + wait, wait);
        let ended = self
            .comm
            .finalize()
            .map_err(|e| Error::other(format!("{} finalize: {e}", self.library)))
            .and_then(|()| poll_until(&self.comm, deadline, "device_comm_finalize", &self.group, 0))
            .and_then(|()| {
                self.comm
                    .destroy()
                    .map_err(|e| Error::other(format!("{} destroy: {e}", self.library)))
            });
        if ended.is_err() {
            self.comm.abort();
        }
        ended
    }
}

impl Drop for DeviceCollectives {
    /// [`close`](Self::close), where the owner did not.
    fn drop(&mut self) {
        if let Err(e) = self.end() {
            log::debug!("ending the device communicator: {e}; it was aborted");
        }
    }
}

impl DeviceCollectives {
    /// Runs `call` to completion: checked, started, polled against the timeout (then the communicator is
    /// aborted), and its results returned. A call that moves nothing returns empty tensors without reaching
    /// the library.
    fn run(&self, call: DeviceCall) -> Result<Vec<Tensor<1>>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let operation = call.operation();
        let world = self.group.num_processes();
        // Debug mode's comparison of the ranks' collective calls wraps this engine (`Checked`).
        call.check(world).map_err(Error::InvalidArgument)?;
        if call.is_empty() {
            return Ok(call.empty_results());
        }
        let call = call.for_library(world);
        let failed = |e: String| {
            self.comm.abort();
            Error::Execution {
                operation: "device collective",
                device: format!("{:?}", self.group.device()),
                reason: format!("`{operation}` #{seq}: {e}"),
            }
        };
        self.comm.start(call).map_err(failed)?;
        wait(&self.comm, self.timeout, operation, &self.group, seq)?;
        self.comm.finish().map_err(failed)
    }

    /// [`run`](Self::run) for a collective: its one result.
    fn run_one(&self, call: DeviceCall) -> Result<Tensor<1>> {
        let name = call.name();
        self.run(call)?
            .pop()
            .ok_or_else(|| Error::InvalidArgument(format!("the device {name} returned no tensor")))
    }
}

impl DeviceEngine for DeviceCollectives {
    fn name(&self) -> &'static str {
        match self.library {
            "NCCL" => "device collectives (NCCL)",
            _ => "device collectives",
        }
    }

    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let averaged = self.run_one(DeviceCall::AllReduce {
            flat,
            op: ReduceOp::Mean,
        })?;
        Ok(if scale == 1.0 {
            averaged
        } else {
            averaged.mul_scalar(scale)
        })
    }

    fn all_reduce(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Some(self.run_one(DeviceCall::AllReduce { flat, op }))
    }

    fn reduce(&self, flat: Tensor<1>, root: usize, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Some(self.run_one(DeviceCall::Reduce { flat, op, root }))
    }

    fn reduce_scatter(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Some(self.run_one(DeviceCall::ReduceScatter { flat, op }))
    }

    fn all_gather(&self, part: Tensor<1>) -> Option<Result<Tensor<1>>> {
        Some(self.run_one(DeviceCall::AllGather { part }))
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Option<Result<Tensor<1>>> {
        Some(self.run_one(DeviceCall::Broadcast { flat, root }))
    }

    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
    ) -> Option<Result<Vec<Tensor<1>>>> {
        if self.group.debug()
            && let Err(e) = self.check_messages(&sends, &recvs)
        {
            return Some(Err(e));
        }
        Some(self.run(DeviceCall::SendRecv { sends, recvs }))
    }

    fn on_group(&self, group: Arc<ProcessGroup>) -> Option<Result<Box<dyn DeviceEngine>>> {
        Some(
            self.split_for(group)
                .map(|engine| Box::new(engine) as Box<dyn DeviceEngine>),
        )
    }
}

#[cfg(test)]
pub(crate) mod double;

#[cfg(test)]
mod tests;
