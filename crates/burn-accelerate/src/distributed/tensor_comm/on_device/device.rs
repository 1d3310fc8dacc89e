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
/// [`poll`](Self::poll) says whether the last one finished.
pub(crate) trait DeviceComm: Send + Sync + fmt::Debug {
    /// Starts `call` over the group, in device memory.
    fn start(&self, call: DeviceCall) -> std::result::Result<(), String>;

    /// The results of the last [`start`](Self::start), once [`poll`](Self::poll) has reported it done: one
    /// tensor for a collective (autodiff where its input was), the receives in order for a point-to-point batch
    /// (each on its [`Incoming`]'s device, autodiff included).
    fn finish(&self) -> std::result::Result<Vec<Tensor<1>>, String>;

    /// `Ok(true)` when everything enqueued so far has finished (or the connection has formed), `Ok(false)` while
    /// it runs, or the library's error.
    fn poll(&self) -> std::result::Result<bool, String>;

    /// Starts making the communicator of a sub-group (`ncclCommSplit`): every rank of this group calls it, the
    /// ranks passing the same `color` form one group of `world` ranks, numbered by `key`. The new connection
    /// may still be forming: poll it.
    fn split(
        &self,
        color: usize,
        key: usize,
        world: usize,
    ) -> std::result::Result<Box<dyn DeviceComm>, String>;

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
    aborted: AtomicBool,
}

impl Guarded {
    fn new(inner: Box<dyn DeviceComm>) -> Self {
        Self {
            inner,
            aborted: AtomicBool::new(false),
        }
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
    fn split_for(&self, sub: Arc<ProcessGroup>) -> Result<Self> {
        let me = (self.group.process_index() as u64).to_le_bytes().to_vec();
        let color = sub
            .comm()
            .all_gather(me)?
            .iter()
            .filter_map(|bytes| <[u8; 8]>::try_from(bytes.as_slice()).ok())
            .map(u64::from_le_bytes)
            .min()
            .unwrap_or(self.group.process_index() as u64) as usize;
        let started = self
            .comm
            .split(color, sub.process_index(), sub.num_processes())
            .map_err(|e| Error::Execution {
                operation: "device communicator split",
                device: format!("{:?}", self.group.device()),
                reason: format!("{} could not split its communicator: {e}", self.library),
            });
        let comm = Guarded::new(self.group.agree("device communicator split", started)?);
        let formed = wait(&comm, self.timeout, "device_comm_split", &sub, 0);
        self.group
            .agree("device communicator split formed", formed)?;
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
    let start = Instant::now();
    let mut pause = Duration::from_micros(20);
    loop {
        match comm.poll() {
            Ok(true) => return Ok(()),
            Ok(false) if start.elapsed() < timeout => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
            Ok(false) => {
                comm.abort();
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
                comm.abort();
                return Err(Error::Execution {
                    operation: "device all-reduce",
                    device: format!("{:?}", group.device()),
                    reason: format!("`{operation}` #{seq}: {e}"),
                });
            }
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
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use burn::tensor::{DType, Tensor};

    use super::double::HostLibrary;
    use super::*;
    use crate::Accelerator;
    use crate::distributed::tensor_comm::Reduction;
    use crate::error::Error;

    /// Each of `world` in-process ranks connects through `library`, then averages `values(rank)` `calls`
    /// times; every rank's outcomes, in rank order. Fails the test unless every rank reported.
    fn average_on_ranks(
        world: usize,
        library: HostLibrary,
        timeout: Duration,
        (debug, calls): (bool, usize),
        values: impl Fn(usize) -> Vec<f32> + Send + Sync,
    ) -> Vec<Vec<Result<Vec<f32>>>> {
        on_ranks(world, &library, (debug, timeout), |acc, t| {
            let rank = acc.process_index();
            Ok((0..calls)
                .map(|_| {
                    let flat = Tensor::<1>::from_floats(values(rank).as_slice(), acc.device());
                    let averaged = t
                        .all_reduce(flat, Reduction::Average(0.5), "gradient_all_reduce")?
                        .wait()?;
                    assert_eq!(averaged.dtype(), DType::F32);
                    Ok(averaged.into_data().try_to_vec::<f32>().unwrap())
                })
                .collect())
        })
        .into_iter()
        // A rank that could not connect has one outcome: the failure.
        .map(|outcomes| outcomes.unwrap_or_else(|e| vec![Err(e)]))
        .collect()
    }

    #[test]
    fn every_collective_runs_on_the_device_engine_uneven_parts_padded_and_none_through_host_memory()
    {
        let library = HostLibrary::default();
        let values = |rank: usize| -> Vec<f32> { (0..6).map(|i| (rank * 10 + i) as f32).collect() };
        let results = Accelerator::builder()
            .debug(true)
            .launch(3, |acc| {
                let group = acc.group_arc();
                let rank = group.process_index();
                let engine =
                    DeviceCollectives::connect(group.clone(), &library, Duration::from_secs(30))?;
                let comm = super::super::OnDevice::checked(Box::new(engine), &group);
                let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
                let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
                let before = acc.host_values();
                // Equal parts. The mean of the 6 values of 3 ranks, 2 per rank.
                let mine = comm
                    .reduce_scatter(
                        tensor(values(rank)),
                        &[2, 2, 2],
                        Reduction::Average(1.0),
                        "rs",
                    )?
                    .wait()?;
                let gathered = comm
                    .all_gather(tensor(vec![rank as f32; 2]), &[2, 2, 2], "ag")?
                    .wait()?;
                let from_root = comm.broadcast(tensor(values(rank)), 2, "bc")?.wait()?;
                let summed = comm
                    .reduce_scatter(
                        tensor(values(rank)),
                        &[2, 2, 2],
                        Reduction::ScaledSum(0.5),
                        "rs2",
                    )?
                    .wait()?;
                // Uneven parts (one empty): padded to the largest, on the engine too.
                let uneven = comm
                    .reduce_scatter(
                        tensor(values(rank)),
                        &[1, 0, 5],
                        Reduction::Op(ReduceOp::Sum),
                        "rs3",
                    )?
                    .wait()?;
                let uneven_gathered = comm
                    .all_gather(tensor(vec![rank as f32; rank]), &[0, 1, 2], "ag2")?
                    .wait()?;
                let onto_root = comm
                    .reduce(tensor(values(rank)), 1, Reduction::ScaledSum(2.0), "reduce")?
                    .wait()?;
                let largest = comm
                    .all_reduce(tensor(values(rank)), Reduction::Op(ReduceOp::Max), "max")?
                    .wait()?;
                let through_host = acc.host_values() - before;
                Ok((
                    [
                        read(mine),
                        read(gathered),
                        read(from_root),
                        read(summed),
                        read(uneven),
                        read(uneven_gathered),
                        read(largest),
                    ],
                    onto_root.map(read),
                    through_host,
                ))
            })
            .unwrap();
        // Eight calls on the engine on each of the 3 ranks.
        assert_eq!(library.started.load(Ordering::Relaxed), 8 * 3);
        let sum: Vec<f32> = (0..6).map(|i| (30 + i * 3) as f32).collect();
        for (rank, (got, onto_root, through_host)) in results.into_iter().enumerate() {
            let [
                mine,
                gathered,
                from_root,
                summed,
                uneven,
                uneven_gathered,
                largest,
            ] = got;
            assert_eq!(through_host, 0, "rank {rank}: values through host memory");
            let mean: Vec<f32> = (0..6)
                .map(|i| (10.0 + i as f32 * 3.0 + 20.0) / 3.0)
                .collect();
            assert_eq!(mine, mean[rank * 2..rank * 2 + 2].to_vec(), "rank {rank}");
            assert_eq!(gathered, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
            assert_eq!(from_root, values(2));
            assert_eq!(
                summed,
                sum[rank * 2..rank * 2 + 2]
                    .iter()
                    .map(|s| s * 0.5)
                    .collect::<Vec<_>>()
            );
            let (start, len) = [(0, 1), (1, 0), (1, 5)][rank];
            assert_eq!(uneven, sum[start..start + len].to_vec(), "rank {rank}");
            assert_eq!(uneven_gathered, vec![1.0, 2.0, 2.0]);
            assert_eq!(largest, values(2));
            let doubled: Vec<f32> = sum.iter().map(|s| s * 2.0).collect();
            assert_eq!(onto_root, (rank == 1).then_some(doubled), "rank {rank}");
        }
    }

    /// Each of `world` ranks connects through `library` and runs `f` on the interface over it.
    fn on_ranks<T: Send>(
        world: usize,
        library: &HostLibrary,
        (debug, timeout): (bool, Duration),
        f: impl Fn(&Accelerator, Arc<dyn super::super::TensorComm>) -> Result<T> + Send + Sync,
    ) -> Vec<Result<T>> {
        let results = std::sync::Mutex::new(Vec::new());
        Accelerator::builder()
            .debug(debug)
            .collective_timeout(timeout)
            .launch(world, |acc| {
                let group = acc.group_arc();
                let outcome = DeviceCollectives::connect(group.clone(), library, timeout).and_then(
                    |engine| {
                        f(
                            &acc,
                            super::super::OnDevice::checked(Box::new(engine), &group),
                        )
                    },
                );
                results
                    .lock()
                    .unwrap()
                    .push((group.process_index(), outcome));
                Ok(())
            })
            .expect("every rank returns");
        let mut results = results.into_inner().unwrap();
        results.sort_by_key(|(rank, _)| *rank);
        assert_eq!(results.len(), world, "every rank reports");
        results.into_iter().map(|(_, r)| r).collect()
    }

    /// Where a call goes is chosen from what every rank passes alike: a rank whose buffer disagrees with the
    /// counts once took host memory while its peers waited on the device until the timeout. Now debug mode names it
    /// on every rank at once (and without debug mode that rank fails at once, without reaching host memory), and
    /// the ranks go on to their next call together.
    #[test]
    fn a_buffer_that_disagrees_with_the_counts_fails_every_rank_and_never_takes_host_memory() {
        let library = HostLibrary::default();
        let results = on_ranks(2, &library, (true, Duration::from_secs(20)), |acc, comm| {
            let rank = acc.process_index();
            let tensor = |n: usize| Tensor::<1>::ones([n], acc.device());
            let before = acc.host_values();
            // Rank 1's buffer holds 5 values where the counts add up to 4.
            let scattered = comm
                .reduce_scatter(
                    tensor(4 + rank),
                    &[2, 2],
                    Reduction::Op(ReduceOp::Sum),
                    "rs",
                )
                .map(|_| ())
                .map_err(|e| e.to_string());
            // Rank 1 sends 3 values where its count is 2.
            let gathered = comm
                .all_gather(tensor(2 + rank), &[2, 2], "ag")
                .map(|_| ())
                .map_err(|e| e.to_string());
            let next = comm
                .all_reduce(tensor(2), Reduction::Op(ReduceOp::Sum), "next")?
                .wait()?;
            Ok((
                scattered,
                gathered,
                next.into_data().try_to_vec::<f32>().unwrap(),
                acc.host_values() - before,
            ))
        });
        for (rank, outcome) in results.into_iter().enumerate() {
            let (scattered, gathered, next, _) = outcome.unwrap();
            for err in [scattered.unwrap_err(), gathered.unwrap_err()] {
                assert!(!err.contains("timed out"), "rank {rank}: {err}");
                assert!(err.contains("Process 1: [2, 2, 0]"), "rank {rank}: {err}");
            }
            assert_eq!(next, vec![2.0, 2.0], "rank {rank}: the next call");
        }
        // Without debug mode: the rank whose buffer disagrees fails before any exchange, through neither path.
        let library = HostLibrary::default();
        let results = on_ranks(
            1,
            &library,
            (false, Duration::from_secs(20)),
            |acc, comm| {
                let before = acc.host_values();
                let err = comm
                    .reduce_scatter(
                        Tensor::<1>::ones([3], acc.device()),
                        &[2],
                        Reduction::Op(ReduceOp::Sum),
                        "rs",
                    )
                    .map(|_| ())
                    .unwrap_err()
                    .to_string();
                Ok((err, acc.host_values() - before))
            },
        );
        let (err, through_host) = results.into_iter().next().unwrap().unwrap();
        assert!(err.contains("holds 3 elements"), "{err}");
        assert_eq!(through_host, 0);
    }

    #[test]
    fn point_to_point_batches_run_on_the_engine_in_order_to_self_and_to_autodiff_devices() {
        let library = HostLibrary::default();
        let results = on_ranks(
            3,
            &library,
            (false, Duration::from_secs(30)),
            |acc, comm| {
                let rank = acc.process_index();
                let before = acc.host_values();
                let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
                let (next, previous) = ((rank + 1) % 3, (rank + 2) % 3);
                // Two messages to the next rank (in order), one to itself, an empty one to the previous.
                let sends = vec![
                    (next, tensor(vec![rank as f32; 2])),
                    (next, tensor(vec![10.0 + rank as f32; 3])),
                    (rank, tensor(vec![100.0 + rank as f32])),
                    (previous, tensor(Vec::new())),
                ];
                let like = tensor(vec![0.0]);
                let recvs = vec![
                    Incoming::like(previous, 2, &like),
                    Incoming::like(previous, 3, &like),
                    Incoming::like(rank, 1, &like),
                    Incoming::like(next, 0, &like),
                ];
                let received = comm.send_recv(sends, recvs, "messages")?.wait()?;
                let autodiff: Vec<bool> = received.iter().map(Tensor::is_autodiff).collect();
                let values: Vec<Vec<f32>> = received
                    .into_iter()
                    .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
                    .collect();
                Ok((values, autodiff, acc.host_values() - before))
            },
        );
        // Three batches started; the empty message never reached the library.
        assert_eq!(library.started.load(Ordering::Relaxed), 3);
        for (rank, result) in results.into_iter().enumerate() {
            let (values, autodiff, through_host) = result.unwrap();
            let previous = ((rank + 2) % 3) as f32;
            assert_eq!(
                values,
                vec![
                    vec![previous; 2],
                    vec![10.0 + previous; 3],
                    vec![100.0 + rank as f32],
                    Vec::new()
                ],
                "rank {rank}"
            );
            assert!(
                autodiff.iter().all(|a| *a),
                "arrive on the autodiff device: {autodiff:?}"
            );
            assert_eq!(through_host, 0);
        }
    }

    #[test]
    fn debug_mode_turns_a_message_length_mismatch_into_an_error_naming_both_lengths() {
        let library = HostLibrary::default();
        let started = std::time::Instant::now();
        let results = on_ranks(2, &library, (true, Duration::from_secs(5)), |acc, comm| {
            let rank = acc.process_index();
            let flat = Tensor::<1>::from_floats([1.0, 2.0, 3.0].as_slice(), acc.device());
            // Rank 0 sends 3 values where rank 1 expects 2.
            if rank == 0 {
                comm.send_recv(vec![(1, flat)], Vec::new(), "messages")?
                    .wait()
            } else {
                comm.send_recv(Vec::new(), vec![Incoming::like(0, 2, &flat)], "messages")?
                    .wait()
            }
        });
        let text = results[1].as_ref().unwrap_err().to_string();
        assert!(
            text.contains("[3.0, 1.0]") && text.contains("[2.0, 1.0]"),
            "{text}"
        );
        assert!(started.elapsed() < Duration::from_secs(60), "no hang");
    }

    #[test]
    fn sub_groups_split_the_engines_connection_and_stay_on_the_device() {
        let library = HostLibrary::default();
        let results = on_ranks(
            4,
            &library,
            (false, Duration::from_secs(30)),
            |acc, comm| {
                let group = acc.group_arc();
                let rank = group.process_index();
                let before = acc.host_values();
                // As a hybrid strategy makes them: consecutive pairs, then the ranks of one parity.
                let pairs = comm.on_group(Arc::new(group.split(rank / 2, rank)?))?;
                let parity = comm.on_group(Arc::new(group.split(rank % 2, rank)?))?;
                let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
                let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
                let pair_sum = pairs
                    .all_reduce(
                        tensor(vec![rank as f32]),
                        Reduction::Op(ReduceOp::Sum),
                        "pairs",
                    )?
                    .wait()?;
                let parity_part = parity
                    .reduce_scatter(
                        tensor(vec![rank as f32, 10.0 * rank as f32]),
                        &[1, 1],
                        Reduction::Op(ReduceOp::Sum),
                        "parity",
                    )?
                    .wait()?;
                Ok((
                    read(pair_sum),
                    read(parity_part),
                    pairs.name(),
                    acc.host_values() - before,
                ))
            },
        );
        // Each of the 4 ranks split twice; both sub-groups' calls on the engine.
        assert_eq!(library.splits.load(Ordering::Relaxed), 8);
        assert_eq!(library.started.load(Ordering::Relaxed), 8);
        for (rank, result) in results.into_iter().enumerate() {
            let (pair_sum, parity_part, name, through_host) = result.unwrap();
            let pair = (rank / 2 * 2) as f32;
            assert_eq!(pair_sum, vec![2.0 * pair + 1.0], "rank {rank}");
            // Ranks 0 and 2 (or 1 and 3) sum (r, 10 r); the lower one keeps the first part.
            let (low, high) = ((rank % 2) as f32, (rank % 2 + 2) as f32);
            let whole = [low + high, 10.0 * (low + high)];
            assert_eq!(parity_part, vec![whole[rank / 2]], "rank {rank}");
            assert_eq!(name, "device collectives (NCCL)");
            assert_eq!(through_host, 0);
        }
    }

    #[test]
    fn a_stuck_rank_in_a_sub_group_is_a_timeout_not_a_hang() {
        let library = HostLibrary {
            hang_rank: Some(3),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let results = on_ranks(
            4,
            &library,
            (false, Duration::from_millis(500)),
            |acc, comm| {
                let group = acc.group_arc();
                let rank = group.process_index();
                let pairs = comm.on_group(Arc::new(group.split(rank / 2, rank)?))?;
                let flat = Tensor::<1>::from_floats([1.0].as_slice(), acc.device());
                pairs
                    .all_reduce(flat, Reduction::Op(ReduceOp::Sum), "pairs")?
                    .wait()
                    .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
            },
        );
        assert!(started.elapsed() < Duration::from_secs(60), "no hang");
        // The pair without the stuck rank sums; the other times out (or learns of the abort).
        assert_eq!(results[0].as_ref().unwrap(), &vec![2.0]);
        assert_eq!(results[1].as_ref().unwrap(), &vec![2.0]);
        for rank in [2, 3] {
            match results[rank].as_ref().unwrap_err() {
                Error::Comm(CommError::Timeout { operation, .. }) => {
                    assert_eq!(operation, "gradient_all_reduce", "rank {rank}")
                }
                other => assert!(
                    other.to_string().contains("aborted"),
                    "rank {rank}: {other}"
                ),
            }
        }
    }

    #[test]
    fn a_one_rank_mean_is_a_sum_so_nccls_one_rank_kernel_leaves_no_tail_unwritten() {
        let library = HostLibrary {
            defect: double::Defect::OneRankMeanTail,
            ..Default::default()
        };
        // The library's own one-rank mean, called directly, misses the tail, as NCCL's did on the first GPU.
        let results = on_ranks(1, &library, (false, Duration::from_secs(30)), |acc, _| {
            let n = (1 << 20) + 3;
            let flat = Tensor::<1>::ones([n], acc.device());
            let comm = library.connect(&library.new_id().unwrap(), 0, 1).unwrap();
            comm.start(DeviceCall::AllReduce {
                flat,
                op: ReduceOp::Mean,
            })
            .unwrap();
            assert!(comm.poll().unwrap());
            let raw = comm.finish().unwrap().pop().unwrap();
            let raw = raw.into_data().try_to_vec::<f32>().unwrap();
            Ok(raw.iter().filter(|v| v.is_nan()).count())
        });
        assert_eq!(results[0].as_ref().unwrap(), &3);
        // Through the engine, every check passes: the mean of one rank goes to the library as a sum.
        let results = on_ranks(
            1,
            &library,
            (false, Duration::from_secs(60)),
            |acc, comm| {
                let group = acc.group_arc();
                let mut checks = super::super::check::check_transport(&group, comm.as_ref())?;
                checks.extend(
                    super::super::check::check_collectives(&group, comm.as_ref())?
                        .into_iter()
                        .map(|(_, c)| c),
                );
                Ok(checks)
            },
        );
        for check in results.into_iter().next().unwrap().unwrap() {
            assert!(check.passed(), "{check:?}");
        }
        assert_eq!(library_op(ReduceOp::Mean, 1), ReduceOp::Sum);
        assert_eq!(library_op(ReduceOp::Mean, 2), ReduceOp::Mean);
        assert_eq!(library_op(ReduceOp::Max, 1), ReduceOp::Max);
    }

    #[test]
    fn the_id_travels_from_rank_0_and_every_rank_gets_the_scaled_mean() {
        let results = average_on_ranks(
            3,
            HostLibrary::default(),
            Duration::from_secs(20),
            (false, 2),
            |rank| vec![rank as f32, 2.0 * rank as f32, 6.0],
        );
        for outcomes in results {
            assert_eq!(outcomes.len(), 2);
            for result in outcomes {
                // mean (1, 2, 6) times 0.5
                assert_eq!(result.unwrap(), vec![0.5, 1.0, 3.0]);
            }
        }
    }

    #[test]
    fn a_stuck_peer_is_a_timeout_naming_the_operation_then_an_abort_and_no_further_use() {
        let library = HostLibrary {
            hang_rank: Some(1),
            ..Default::default()
        };
        let uses_after_abort = library.uses_after_abort.clone();
        let started = std::time::Instant::now();
        let results = average_on_ranks(2, library, Duration::from_millis(300), (false, 2), |_| {
            vec![1.0; 4]
        });
        assert!(started.elapsed() < Duration::from_secs(60), "no hang");
        let mut timeouts = 0;
        for (rank, outcomes) in results.into_iter().enumerate() {
            let mut outcomes = outcomes.into_iter();
            // The first call: this rank's own timeout, or the abort of the peer that timed out first.
            match outcomes.next().unwrap().unwrap_err() {
                Error::Comm(CommError::Timeout { operation, .. }) => {
                    assert_eq!(operation, "gradient_all_reduce", "rank {rank}");
                    timeouts += 1;
                }
                other => assert!(
                    other.to_string().contains("aborted"),
                    "rank {rank}: {other}"
                ),
            }
            // The second call is refused before it reaches the freed communicator.
            let text = outcomes.next().unwrap().unwrap_err().to_string();
            assert!(
                text.contains("was aborted after an earlier timeout or error"),
                "rank {rank}: {text}"
            );
        }
        assert!(timeouts >= 1, "at least the waiting rank times out");
        assert_eq!(
            uses_after_abort.load(Ordering::Relaxed),
            0,
            "an aborted communicator was called again"
        );
    }

    #[test]
    fn a_rank_that_cannot_connect_stops_every_rank_with_its_reason() {
        let library = HostLibrary {
            fail_connect: Some(2),
            ..Default::default()
        };
        let results = average_on_ranks(3, library, Duration::from_secs(20), (false, 1), |_| {
            vec![1.0]
        });
        for (rank, outcomes) in results.into_iter().enumerate() {
            let [result] = <[_; 1]>::try_from(outcomes).unwrap();
            let text = result.unwrap_err().to_string();
            assert!(text.contains("no route to peer"), "rank {rank}: {text}");
        }
    }

    #[test]
    fn debug_mode_turns_a_size_mismatch_into_an_error_on_every_rank() {
        let results = average_on_ranks(
            2,
            HostLibrary::default(),
            Duration::from_secs(20),
            (true, 1),
            |rank| vec![1.0; 3 + rank],
        );
        for outcomes in results {
            let [result] = <[_; 1]>::try_from(outcomes).unwrap();
            let text = result.unwrap_err().to_string();
            assert!(
                text.contains("gradient_all_reduce")
                    && text.contains("[3]")
                    && text.contains("[4]"),
                "{text}"
            );
        }
    }

    /// Every rank's check of a device transport over `library` on 3 ranks.
    fn check_on_ranks(library: HostLibrary) -> Vec<Vec<crate::distributed::DtypeCheck>> {
        let checks = Accelerator::builder()
            .launch(3, |acc| {
                let group = acc.group_arc();
                let transport =
                    DeviceCollectives::connect(group.clone(), &library, Duration::from_secs(60))?;
                let transport = super::super::OnDevice::checked(Box::new(transport), &group);
                let mut checks = super::super::check::check_transport(&group, transport.as_ref())?;
                // Sharded training's collectives, on the engine (equal parts), after the dtypes.
                checks.extend(
                    super::super::check::check_collectives(&group, transport.as_ref())?
                        .into_iter()
                        .map(|(_, c)| c),
                );
                Ok(checks)
            })
            .unwrap();
        assert_eq!(checks.len(), 3, "every rank reports");
        checks
    }

    #[test]
    fn the_transport_check_passes_a_library_that_rounds_differently_in_every_dtype() {
        for checks in check_on_ranks(HostLibrary::default()) {
            let dtypes: Vec<DType> = checks.iter().map(|c| c.dtype).collect();
            assert_eq!(
                dtypes,
                [
                    [DType::F32, DType::BF16, DType::F16].as_slice(),
                    &[DType::F32; 6]
                ]
                .concat()
            );
            // Not equal by construction: the double sums in another order and precision (the all-reduce and the
            // reduce-scatter); the all-gather, the broadcast and the messages copy exactly.
            assert!(
                checks[0].max_error > 0.0 && checks[3].max_error > 0.0,
                "{checks:?}"
            );
            assert!(
                [4, 5, 7].iter().all(|&i| checks[i].max_error == 0.0),
                "{checks:?}"
            );
            for check in checks {
                assert!(check.passed(), "{check:?}");
            }
        }
    }

    #[test]
    fn the_transport_check_fails_a_library_that_forgets_the_division() {
        let library = HostLibrary {
            defect: double::Defect::SumOnly,
            ..Default::default()
        };
        for checks in check_on_ranks(library) {
            // Every mean (the dtypes' all-reduces, the reduce-scatter) fails; the copies do not divide.
            assert!(checks[..4].iter().all(|c| !c.passed()), "{checks:?}");
            assert!(checks[4..].iter().all(|c| c.passed()), "{checks:?}");
        }
    }

    /// An engine whose results all come back shifted by 1e-3 (a library that garbles what it moves).
    #[derive(Debug)]
    struct Shifting(Box<dyn DeviceEngine>);

    impl Shifting {
        fn shift(result: Option<Result<Tensor<1>>>) -> Option<Result<Tensor<1>>> {
            result.map(|r| r.map(|t| t.add_scalar(1e-3)))
        }
    }

    impl DeviceEngine for Shifting {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
            Ok(self.0.average(flat, scale)?.add_scalar(1e-3))
        }
        fn all_reduce(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
            Self::shift(self.0.all_reduce(flat, op))
        }
        fn reduce(&self, flat: Tensor<1>, root: usize, op: ReduceOp) -> Option<Result<Tensor<1>>> {
            Self::shift(self.0.reduce(flat, root, op))
        }
        fn reduce_scatter(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
            Self::shift(self.0.reduce_scatter(flat, op))
        }
        fn all_gather(&self, part: Tensor<1>) -> Option<Result<Tensor<1>>> {
            Self::shift(self.0.all_gather(part))
        }
        fn broadcast(&self, flat: Tensor<1>, root: usize) -> Option<Result<Tensor<1>>> {
            Self::shift(self.0.broadcast(flat, root))
        }
        fn on_group(&self, group: Arc<ProcessGroup>) -> Option<Result<Box<dyn DeviceEngine>>> {
            self.0
                .on_group(group)
                .map(|e| e.map(|e| Box::new(Shifting(e)) as Box<dyn DeviceEngine>))
        }
    }

    #[test]
    fn sharded_training_through_a_one_rank_library_matches_the_device_alone_and_a_garbling_one_does_not()
     {
        let library = HostLibrary::default();
        let timeout = Duration::from_secs(60);
        let engines = {
            let library = library.clone();
            Arc::new(move |group: &Arc<ProcessGroup>| {
                let engine = DeviceCollectives::connect(group.clone(), &library, timeout)?;
                Ok(Box::new(engine) as Box<dyn DeviceEngine>)
            })
        };
        let device = burn::tensor::Device::default();
        let checks =
            super::super::check::check_training_on_one_rank(&device, timeout, engines).unwrap();
        let names: Vec<&str> = checks.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            [
                "SHARD_GRAD_OP training",
                "FULL_SHARD training",
                "HYBRID_SHARD training"
            ]
        );
        for (name, check) in &checks {
            assert!(check.passed() && check.checked == 150, "{name}: {check:?}");
        }
        assert!(
            library.started.load(Ordering::Relaxed) > 3 * 3,
            "every step went through the library"
        );
        // The hybrid strategy split its shard and replica groups from the library's connection.
        assert_eq!(library.splits.load(Ordering::Relaxed), 2);
        let garbling = Arc::new(move |group: &Arc<ProcessGroup>| {
            let engine =
                DeviceCollectives::connect(group.clone(), &HostLibrary::default(), timeout)?;
            Ok(Box::new(Shifting(Box::new(engine))) as Box<dyn DeviceEngine>)
        });
        let checks =
            super::super::check::check_training_on_one_rank(&device, timeout, garbling).unwrap();
        for (name, check) in &checks {
            assert!(!check.passed(), "{name}: {check:?}");
        }
    }

    #[test]
    fn wire_types_ids_and_buffer_ranges() {
        assert_eq!(wire_type(DType::F32), Ok(WireType::F32));
        assert_eq!(wire_type(DType::BF16).unwrap().bytes(), 2);
        assert_eq!(wire_type(DType::F16).unwrap().bytes(), 2);
        assert_eq!(wire_type(DType::F64).unwrap().bytes(), 8);
        let err = wire_type(DType::I32).unwrap_err();
        assert!(err.contains("ACCELERATE_GRADIENT_TRANSPORT=host"), "{err}");
        assert!(group_id(&[7u8; 128]).is_ok());
        assert!(group_id(&[7u8; 64]).unwrap_err().contains("64 bytes"));
        // 1000 f32 values: 4000 bytes; an allocator rounds buffers up, never down.
        assert!(check_range(4000, 4096, 4000).is_ok());
        let err = check_range(4000, 4096, 3996).unwrap_err();
        assert!(err.contains("destination buffer holds 3996 bytes"), "{err}");
    }
}
