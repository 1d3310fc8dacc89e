//! NCCL between processes (or between the CUDA devices of one process), one CUDA device per rank: the
//! [`DeviceCommLibrary`] behind [`DeviceCollectives`] (see [`super::device`] for the id exchange, timeouts and
//! aborts, which are tested without a GPU).
//!
//! NCCL is loaded at run time through `cudarc` (the same library Burn's CUDA runtime uses). A tensor's device
//! memory is reached through its cubecl buffer: the flat tensor is resolved to its `CubeTensor` (draining Burn's
//! fusion queue), its buffer pinned with `get_resource`, the device synchronised (so every kernel that produced
//! it has finished: cubecl's own stream is private), and NCCL writes into a fresh tensor on this module's stream,
//! whose completion an event reports. Collectives are NCCL's (`ncclAllReduce`, `ncclReduce`,
//! `ncclReduceScatter`, `ncclAllGather`, `ncclBroadcast`); a point-to-point batch is one group call of
//! `ncclSend`s and `ncclRecv`s; a sub-group's communicator is split from the group's (`ncclCommSplit`).
//! Communicators are non-blocking, so a peer that never arrives leaves the call in progress until the
//! collective timeout, when the communicator is aborted.
//!
//! [`DeviceCollectives`]: super::device::DeviceCollectives

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use burn::backend::{Cube, CubeDevice, DispatchDevice};
use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;

use super::device::{DeviceCall, DeviceComm, DeviceCommLibrary};
use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::Incoming;

mod lifecycle;

pub(crate) use lifecycle::lifecycle_check;

type CudaServer = <CudaRuntime as Runtime>::Server;

/// The CUDA ordinal of `device`, when it is a CUDA device.
pub(crate) fn cuda_ordinal(device: &Device) -> Option<usize> {
    match device.clone().without_autodiff().as_dispatch() {
        DispatchDevice::Cube(CubeDevice::Cuda(cuda)) => Some(cuda.index),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// NCCL's element type for a gradient dtype.
fn nccl_type(dtype: DType) -> std::result::Result<sys::ncclDataType_t, String> {
    match super::device::wire_type(dtype)? {
        super::device::WireType::F32 => Ok(sys::ncclDataType_t::ncclFloat32),
        super::device::WireType::F16 => Ok(sys::ncclDataType_t::ncclFloat16),
        super::device::WireType::BF16 => Ok(sys::ncclDataType_t::ncclBfloat16),
        super::device::WireType::F64 => Ok(sys::ncclDataType_t::ncclFloat64),
    }
}

/// NCCL's reduction for `op` (`ncclAvg` for the mean).
fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// NCCL on the CUDA device of one rank.
pub(crate) struct Nccl {
    device: Device,
    /// For the GPU kit's check of a batch that fails part way: the call of each batch of messages (0 the first)
    /// posted with a peer outside the group, which NCCL refuses.
    refused_call: Option<usize>,
}

impl Nccl {
    /// NCCL on `device` (checked at [`connect`](DeviceCommLibrary::connect), where every rank learns of a
    /// failure).
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            refused_call: None,
        }
    }

    /// NCCL on `device`, whose communicators post call `k` of every batch of messages with a peer outside the
    /// group, which NCCL refuses: the failing batch of [`lifecycle_check`], never a training's.
    fn refusing_call(device: &Device, k: usize) -> Self {
        Self {
            refused_call: Some(k),
            ..Self::new(device)
        }
    }

    /// The CUDA context of the rank's device (the primary context, shared with Burn's CUDA runtime).
    fn context(&self) -> std::result::Result<Arc<CudaContext>, String> {
        let ordinal = cuda_ordinal(&self.device).ok_or_else(|| {
            format!(
                "NCCL needs a CUDA device, this rank runs on {:?}",
                self.device
            )
        })?;
        CudaContext::new(ordinal)
            .map_err(|e| format!("the CUDA context of device {ordinal}: {e:?}"))
    }
}

impl DeviceCommLibrary for Nccl {
    fn name(&self) -> &'static str {
        "NCCL"
    }

    fn new_id(&self) -> std::result::Result<Vec<u8>, String> {
        let id = nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    fn connect(
        &self,
        id: &[u8],
        rank: usize,
        world: usize,
    ) -> std::result::Result<Box<dyn DeviceComm>, String> {
        let internal: [std::ffi::c_char; 128] =
            super::device::group_id(id)?.map(|b| b as std::ffi::c_char);
        let id = sys::ncclUniqueId { internal };
        let context = self.context()?;
        context
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        let stream = context
            .new_stream()
            .map_err(|e| format!("creating a CUDA stream: {e:?}"))?;
        let mut config = nonblocking_config();
        let mut comm = CommHandle::empty();
        // SAFETY: the handle's slot (boxed, kept in the communicator) and `config` outlive the call; the id came
        // from ncclGetUniqueId on rank 0.
        unsafe {
            nccl::comm_init_rank_config(comm.slot(), world as c_int, id, rank as c_int, &mut config)
        }
        .map_err(|e| format!("ncclCommInitRankConfig (rank {rank} of {world}): {e:?}"))?;
        let mut comm = NcclComm::new(comm, world, stream);
        comm.refused_call = self.refused_call;
        Ok(Box::new(comm))
    }
}

/// NCCL_CONFIG_INITIALIZER, non-blocking: calls return at once and `ncclCommGetAsyncError` says when they are
/// done, so a missing peer is a timeout rather than a thread stuck inside NCCL.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: c_int = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 2 * 10000 + 30 * 100,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Where an NCCL communicator handle lives (a pointer NCCL allows from any thread, one call at a time: the
/// transport's calls are sequential on its rank). Boxed, so that its address stays put: a non-blocking
/// `ncclCommSplit` writes the child's handle there only when the parent leaves `ncclInProgress`, after the call
/// returned, and the slot must outlive that write.
struct CommHandle(Box<sys::ncclComm_t>);

impl CommHandle {
    /// An empty slot, for NCCL to write a handle into.
    fn empty() -> Self {
        Self(Box::new(std::ptr::null_mut()))
    }

    /// Where NCCL writes the handle.
    fn slot(&mut self) -> *mut sys::ncclComm_t {
        &mut *self.0
    }

    /// The handle, as NCCL last wrote it (read afresh: NCCL's own thread writes it).
    fn get(&self) -> sys::ncclComm_t {
        // SAFETY: the box is valid for reads for as long as `self`.
        unsafe { std::ptr::read_volatile(&*self.0) }
    }
}

// SAFETY: see `CommHandle`; NCCL communicators may be used from any thread when calls do not overlap.
unsafe impl Send for CommHandle {}
// SAFETY: as above; `abort` may run from any thread by NCCL's contract.
unsafe impl Sync for CommHandle {}

/// A call in flight: its outputs (with whether each goes back to autodiff), and every buffer it reads or writes,
/// kept alive (and pinned) until it finishes.
struct InFlight {
    outputs: Vec<(Tensor<1>, bool)>,
    /// Recorded on the stream once NCCL has enqueued its kernels (a non-blocking communicator may still be
    /// enqueuing when the call returns).
    done: Option<CudaEvent>,
    _pinned: Vec<Pinned>,
}

struct NcclComm {
    comm: CommHandle,
    /// The ranks of the group.
    world: usize,
    stream: Arc<CudaStream>,
    pending: Mutex<Option<InFlight>>,
    /// Freed: aborted, or destroyed after a normal end.
    aborted: std::sync::atomic::AtomicBool,
    /// See [`Nccl::refusing_call`].
    refused_call: Option<usize>,
}

impl NcclComm {
    fn new(comm: CommHandle, world: usize, stream: Arc<CudaStream>) -> Self {
        Self {
            comm,
            world,
            stream,
            pending: Mutex::new(None),
            aborted: std::sync::atomic::AtomicBool::new(false),
            refused_call: None,
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // A communicator that was neither destroyed after its finalize (the transport's normal end) nor aborted
        // is aborted: that frees it in any state (still forming, or with a call in flight after an error
        // elsewhere), where destroying one could wait for peers that are gone. Its buffers go after.
        self.abort();
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclComm")
    }
}

/// `flat`'s cubecl tensor (its fusion queue drained). Burn's `Cube` backend is the plain cubecl backend or, with
/// Burn's fusion, wrapped in it; which one is Burn's features' business, so the primitive is told apart at run
/// time.
fn to_cube(flat: Tensor<1>) -> std::result::Result<CubeTensor, String> {
    let primitive = flat
        .without_autodiff()
        .try_into_primitive::<Cube>()
        .map_err(|e| format!("the gradient is not a CUDA tensor: {e:?}"))?;
    let any: Box<dyn std::any::Any> = Box::new(primitive);
    match any.downcast::<CubeTensor>() {
        Ok(tensor) => Ok(*tensor),
        Err(any) => fused_to_cube(any),
    }
}

/// A fused tensor's cubecl tensor: Burn's fusion runs the tensor's queued operations and hands over its buffer.
#[cfg(feature = "fusion")]
fn fused_to_cube(any: Box<dyn std::any::Any>) -> std::result::Result<CubeTensor, String> {
    let tensor = any
        .downcast::<burn_fusion::FusionTensor<burn_cubecl::fusion::FusionCubeRuntime>>()
        .map_err(|_| "the gradient is neither a cubecl nor a fused cubecl tensor".to_string())?;
    let client = tensor.client.clone();
    Ok(client.resolve_tensor_float::<burn_cubecl::CubeBackend>(*tensor))
}

/// Without this crate's `fusion` feature a fused tensor cannot be named here.
#[cfg(not(feature = "fusion"))]
fn fused_to_cube(_: Box<dyn std::any::Any>) -> std::result::Result<CubeTensor, String> {
    Err("Burn's fusion is on (through another crate's features) but burn-accelerate's `fusion` feature is \
         off: enable it (`--features cuda` rather than `cuda-bare`)"
        .into())
}

/// A tensor's device buffer, pinned: its address and size stay valid while this is held (the cubecl tensor
/// and the allocator's binding are kept inside).
struct Pinned {
    ptr: u64,
    size: u64,
    elements: usize,
    _keep: Vec<Box<dyn Send>>,
}

/// Pins `flat`'s buffer (made contiguous first).
fn pin(flat: Tensor<1>) -> std::result::Result<Pinned, String> {
    let cube = to_cube(flat)?;
    let cube = if cube.is_contiguous() {
        cube
    } else {
        burn_cubecl::kernel::into_contiguous(cube)
    };
    let elements = cube.meta.shape().num_elements();
    let resource = cube
        .client
        .clone()
        .get_resource::<CudaServer>(cube.handle.clone())
        .map_err(|e| format!("a device buffer: {e:?}"))?;
    let (ptr, size) = (resource.resource().ptr, resource.resource().size);
    Ok(Pinned {
        ptr,
        size,
        elements,
        _keep: vec![Box::new(resource), Box::new(cube)],
    })
}

impl NcclComm {
    /// The communicator, unless it was aborted: `ncclCommAbort` frees it, so any later call would use freed
    /// memory (the transport's guard refuses such calls first; this is the library's own line of defence).
    fn live(&self) -> std::result::Result<sys::ncclComm_t, String> {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            return Err("the NCCL communicator was aborted".into());
        }
        let comm = self.comm.get();
        if comm.is_null() {
            // A split child polled before its parent completed the split (the transport polls the parent
            // first), or a split that NCCL reported done without making one.
            return Err("ncclCommSplit has not written this communicator's handle".into());
        }
        Ok(comm)
    }

    /// Binds the communicator's CUDA context to this thread and returns its stream.
    fn bound_stream(&self) -> std::result::Result<sys::cudaStream_t, String> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        Ok(self.stream.cu_stream() as _)
    }

    /// Starts a collective: its input pinned, a fresh output of the result's length, every kernel that made the
    /// input finished (cubecl's stream is private), then NCCL's call on this communicator's stream.
    fn start_collective(&self, call: DeviceCall) -> std::result::Result<InFlight, String> {
        let comm = self.live()?;
        let what = call.name();
        let out_len = call.output_len(self.world)?;
        let flat = call.input().ok_or("a collective without input")?.clone();
        let dtype = nccl_type(flat.dtype())?;
        let autodiff = flat.is_autodiff();
        let flat = flat.without_autodiff();
        let device = flat.device();
        let elt = super::device::wire_type(flat.dtype())?.bytes();
        let output = Tensor::<1>::empty([out_len], (&device, flat.dtype()));
        let read = pin(flat)?;
        // A clone: Burn keeps `output`'s handle, and the cubecl tensor shares its buffer.
        let write = pin(output.clone())?;
        device
            .sync()
            .map_err(|e| format!("waiting for the work that made the input: {e:?}"))?;
        let count = read.elements;
        super::device::check_range(count * elt, read.size, u64::MAX)?;
        super::device::check_range(out_len * elt, u64::MAX, write.size)?;
        let stream = self.bound_stream()?;
        let (from, to) = (read.ptr, write.ptr);
        // SAFETY: both pointers are pinned device buffers on this communicator's device, the input of `count`
        // elements of `dtype` and the output of `out_len` (checked above), kept alive in `InFlight` until the
        // event after the call completes.
        unsafe {
            match &call {
                DeviceCall::AllReduce { op, .. } => nccl::all_reduce(
                    from as *const _,
                    to as *mut _,
                    count,
                    dtype,
                    nccl_op(*op),
                    comm,
                    stream,
                ),
                DeviceCall::Reduce { op, root, .. } => nccl::reduce(
                    from as *const _,
                    to as *mut _,
                    count,
                    dtype,
                    nccl_op(*op),
                    *root as c_int,
                    comm,
                    stream,
                ),
                DeviceCall::ReduceScatter { op, .. } => nccl::reduce_scatter(
                    from as *const _,
                    to as *mut _,
                    out_len,
                    dtype,
                    nccl_op(*op),
                    comm,
                    stream,
                ),
                DeviceCall::AllGather { .. } => {
                    nccl::all_gather(from as *const _, to as *mut _, count, dtype, comm, stream)
                }
                DeviceCall::Broadcast { root, .. } => nccl::broadcast(
                    from as *const _,
                    to as *mut _,
                    count,
                    dtype,
                    *root as c_int,
                    comm,
                    stream,
                ),
                DeviceCall::SendRecv { .. } => return Err("a point-to-point batch".into()),
            }
        }
        .map_err(|e| format!("nccl {what} of {count} values: {e:?}"))?;
        Ok(InFlight {
            outputs: vec![(output, autodiff)],
            done: None,
            _pinned: vec![read, write],
        })
    }

    /// Starts a point-to-point batch in one NCCL group call: every send's buffer pinned, a fresh tensor per
    /// receive, the kernels that made the sends finished, then `ncclGroupStart`, an `ncclSend` or `ncclRecv`
    /// per message (empty ones skipped, on both sides), `ncclGroupEnd`.
    fn start_messages(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
    ) -> std::result::Result<InFlight, String> {
        let comm = self.live()?;
        let device = sends
            .first()
            .map(|(_, flat)| flat.device())
            .or_else(|| recvs.first().map(|r| r.device.clone()));
        let mut pinned = Vec::new();
        let mut posted = Vec::new();
        for (peer, flat) in sends {
            if flat.dims()[0] == 0 {
                continue;
            }
            let dtype = flat.dtype();
            let buffer = pin(flat)?;
            super::device::check_range(
                buffer.elements * super::device::wire_type(dtype)?.bytes(),
                buffer.size,
                u64::MAX,
            )?;
            posted.push((true, peer, buffer.ptr, buffer.elements, nccl_type(dtype)?));
            pinned.push(buffer);
        }
        let mut outputs = Vec::new();
        for r in &recvs {
            let device = r.device.clone().without_autodiff();
            let output = Tensor::<1>::empty([r.len], (&device, r.dtype));
            if r.len > 0 {
                let buffer = pin(output.clone())?;
                super::device::check_range(
                    r.len * super::device::wire_type(r.dtype)?.bytes(),
                    u64::MAX,
                    buffer.size,
                )?;
                posted.push((false, r.peer, buffer.ptr, r.len, nccl_type(r.dtype)?));
                pinned.push(buffer);
            }
            outputs.push((output, r.device.is_autodiff()));
        }
        if let Some(device) = device {
            device
                .sync()
                .map_err(|e| format!("waiting for the work that made the messages: {e:?}"))?;
        }
        let stream = self.bound_stream()?;
        nccl::group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
        let mut outcome: std::result::Result<(), String> = Ok(());
        for (k, (send, peer, ptr, count, dtype)) in posted.into_iter().enumerate() {
            // The kit's failing batch: a peer NCCL refuses, past every check of ours.
            let peer = match self.refused_call {
                Some(refused) if refused == k => self.world,
                _ => peer,
            };
            // SAFETY: a pinned device buffer of `count` elements of `dtype` on this communicator's device,
            // kept alive in `InFlight` until the event after the group completes.
            let result = unsafe {
                if send {
                    nccl::send(ptr as *const _, count, dtype, peer as c_int, comm, stream)
                } else {
                    nccl::recv(ptr as *mut _, count, dtype, peer as c_int, comm, stream)
                }
            };
            if let Err(e) = result {
                outcome = Err(format!(
                    "nccl {} of {count} values {} rank {peer}: {e:?}",
                    if send { "send" } else { "recv" },
                    if send { "to" } else { "from" }
                ));
                break;
            }
        }
        // The group is closed whatever happened inside it (NCCL requires every start to be ended).
        let ended = nccl::group_end().map_err(|e| format!("ncclGroupEnd: {e:?}"));
        let in_flight = InFlight {
            outputs,
            done: None,
            _pinned: pinned,
        };
        if let Err(e) = outcome.and(ended.map(|_| ())) {
            // What was posted may still run and write into these buffers: they stay with the communicator, which
            // the transport aborts now; they go only with it, after the abort returned.
            *self.pending.lock().map_err(|_| "poisoned")? = Some(in_flight);
            return Err(e);
        }
        Ok(in_flight)
    }
}

impl DeviceComm for NcclComm {
    fn start(&self, call: DeviceCall) -> std::result::Result<(), String> {
        let in_flight = match call {
            DeviceCall::SendRecv { sends, recvs } => self.start_messages(sends, recvs)?,
            collective => self.start_collective(collective)?,
        };
        *self.pending.lock().map_err(|_| "poisoned")? = Some(in_flight);
        Ok(())
    }

    fn poll(&self) -> std::result::Result<bool, String> {
        let comm = self.live()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live (not aborted) communicator; `state` outlives the call.
        unsafe { sys::ncclCommGetAsyncError(comm, &mut state) }
            .result()
            .map_err(|e| format!("ncclCommGetAsyncError: {e:?}"))?;
        match state {
            sys::ncclResult_t::ncclSuccess => {}
            sys::ncclResult_t::ncclInProgress => return Ok(false),
            other => return Err(format!("NCCL reports {other:?}")),
        }
        let mut pending = self.pending.lock().map_err(|_| "poisoned")?;
        let Some(in_flight) = pending.as_mut() else {
            return Ok(true);
        };
        if in_flight.done.is_none() {
            // NCCL's kernels are on the stream now: everything after this event is the call's completion.
            in_flight.done = Some(
                self.stream
                    .record_event(None)
                    .map_err(|e| format!("recording the completion event: {e:?}"))?,
            );
        }
        match &in_flight.done {
            Some(done) => done
                .try_is_complete()
                .map_err(|e| format!("the call failed on the device: {e:?}")),
            None => Ok(false),
        }
    }

    fn finish(&self) -> std::result::Result<Vec<Tensor<1>>, String> {
        self.live()?;
        let in_flight = self
            .pending
            .lock()
            .map_err(|_| "poisoned")?
            .take()
            .ok_or("no call was started")?;
        Ok(in_flight
            .outputs
            .into_iter()
            .map(|(output, autodiff)| if autodiff { output.autodiff() } else { output })
            .collect())
    }

    fn split(
        &self,
        color: usize,
        key: usize,
        world: usize,
    ) -> std::result::Result<Box<dyn DeviceComm>, String> {
        let comm = self.live()?;
        self.bound_stream()?;
        let stream = self
            .stream
            .context()
            .new_stream()
            .map_err(|e| format!("creating a CUDA stream: {e:?}"))?;
        let mut config = nonblocking_config();
        // NCCL writes the child's handle here when this communicator leaves `ncclInProgress` (NVIDIA/nccl issue
        // 1472): the slot is the child's own, boxed, so it outlives the write; the child is polled only after
        // this communicator's poll reported the split done (the transport's contract).
        let mut child = CommHandle::empty();
        // SAFETY: a live communicator; the child's slot and `config` outlive the call (and the write NCCL makes
        // into the slot later). Every rank of the group calls it (the caller's contract), so the collective split
        // completes.
        unsafe {
            sys::ncclCommSplit(
                comm,
                color as c_int,
                key as c_int,
                child.slot(),
                &mut config,
            )
        }
        .result()
        .map_err(|e| format!("ncclCommSplit (colour {color}, key {key}): {e:?}"))?;
        SPLIT_HANDLE_AT_RETURN.store(
            if child.get().is_null() { 2 } else { 1 },
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(Box::new(NcclComm::new(child, world, stream)))
    }

    fn finalize(&self) -> std::result::Result<(), String> {
        let comm = self.live()?;
        // SAFETY: a live communicator with nothing in flight (every call was waited for).
        unsafe { nccl::comm_finalize(comm) }
            .map(|_| ())
            .map_err(|e| format!("ncclCommFinalize: {e:?}"))
    }

    fn destroy(&self) -> std::result::Result<(), String> {
        let comm = self.live()?;
        // Freed either way: never aborted or destroyed again.
        self.aborted
            .store(true, std::sync::atomic::Ordering::Release);
        // SAFETY: a live communicator whose finalize completed.
        unsafe { nccl::comm_destroy(comm) }
            .map(|_| ())
            .map_err(|e| format!("ncclCommDestroy: {e:?}"))
    }

    fn abort(&self) {
        if !self.aborted.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let comm = self.comm.get();
            if !comm.is_null() {
                // SAFETY: a communicator NCCL made (a split child whose handle was never written has none);
                // aborting is allowed while calls are in progress.
                let _ = unsafe { nccl::comm_abort(comm) };
            }
        }
    }
}

/// Whether the last `ncclCommSplit` had written the child's handle when it returned (1) or only later, when the
/// parent left `ncclInProgress` (2); 0 before any split. What [`lifecycle_check`] reports of the NCCL it ran on.
static SPLIT_HANDLE_AT_RETURN: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
