//! The library a device collective runs on, as the transport sees it: the float types that travel
//! ([`WireType`]), the library that mints ids and connects ([`DeviceCommLibrary`]), one call ([`DeviceCall`]) and
//! a connected group's communicator ([`DeviceComm`]). NCCL implements it in CUDA builds, a host-memory double in
//! the tests.

use std::fmt;

use burn::tensor::{DType, Tensor};

use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::Incoming;

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
    pub(crate) fn operation(&self) -> &'static str {
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
    pub(crate) fn check(&self, world: usize) -> std::result::Result<(), String> {
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
    pub(crate) fn for_library(self, world: usize) -> Self {
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
    pub(crate) fn empty_results(&self) -> Vec<Tensor<1>> {
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
    pub(crate) fn is_empty(&self) -> bool {
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
