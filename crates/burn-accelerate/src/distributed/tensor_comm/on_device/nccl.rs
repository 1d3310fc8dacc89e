//! NCCL between processes, one CUDA device each: the [`DeviceCommLibrary`] behind [`DeviceAllReduce`]
//! (see [`super::device`] for the id exchange, timeouts and aborts, which are tested without a GPU).
//!
//! NCCL is loaded at run time through `cudarc` (the same library Burn's CUDA runtime uses). A gradient's device
//! memory is reached through the tensor's cubecl buffer: the flat gradient is resolved to its `CubeTensor`
//! (draining Burn's fusion queue), both buffers are pinned with `get_resource`, the device is synchronised (so
//! every kernel that produced the gradient has finished: cubecl's own stream is private), and `ncclAllReduce`
//! (`ncclAvg`) writes into a fresh tensor on this module's stream, whose completion an event reports.
//! Communicators are non-blocking, so a peer that never arrives leaves the call in progress until the
//! collective timeout, when the communicator is aborted.
//!
//! [`DeviceAllReduce`]: super::DeviceAllReduce

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
}

impl Nccl {
    /// NCCL on `device` (checked at [`connect`](DeviceCommLibrary::connect), where every rank learns of a
    /// failure).
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
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
        // NCCL_CONFIG_INITIALIZER, non-blocking: calls return at once and `ncclCommGetAsyncError` says when
        // they are done, so a missing peer is a timeout rather than a thread stuck inside NCCL.
        const UNDEF: c_int = i32::MIN;
        let mut config = sys::ncclConfig_t {
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
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; the id came from ncclGetUniqueId on rank 0.
        unsafe {
            nccl::comm_init_rank_config(&mut comm, world as c_int, id, rank as c_int, &mut config)
        }
        .map_err(|e| format!("ncclCommInitRankConfig (rank {rank} of {world}): {e:?}"))?;
        Ok(Box::new(NcclComm {
            comm: CommHandle(comm),
            world,
            stream,
            pending: Mutex::new(None),
            aborted: std::sync::atomic::AtomicBool::new(false),
        }))
    }
}

/// An NCCL communicator handle (a pointer NCCL allows from any thread, one call at a time: the transport's
/// calls are sequential on its rank).
struct CommHandle(sys::ncclComm_t);

// SAFETY: see `CommHandle`; NCCL communicators may be used from any thread when calls do not overlap.
unsafe impl Send for CommHandle {}
// SAFETY: as above; `abort` may run from any thread by NCCL's contract.
unsafe impl Sync for CommHandle {}

/// A collective in flight: its output, and the input kept alive (and pinned) until it finishes.
struct InFlight {
    output: Tensor<1>,
    autodiff: bool,
    /// Recorded on the stream once NCCL has enqueued its kernel (a non-blocking communicator may still be
    /// enqueuing when `ncclAllReduce` returns).
    done: Option<CudaEvent>,
    _pinned: Vec<Box<dyn Send>>,
}

struct NcclComm {
    comm: CommHandle,
    /// The ranks of the group.
    world: usize,
    stream: Arc<CudaStream>,
    pending: Mutex<Option<InFlight>>,
    aborted: std::sync::atomic::AtomicBool,
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Aborting frees a communicator in any state (still forming, or with a call in flight after an error
        // elsewhere), where destroying one could wait for peers that are gone.
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

impl NcclComm {
    /// The communicator, unless it was aborted: `ncclCommAbort` frees it, so any later call would use freed
    /// memory (the transport's guard refuses such calls first; this is the library's own line of defence).
    fn live(&self) -> std::result::Result<sys::ncclComm_t, String> {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            Err("the NCCL communicator was aborted".into())
        } else {
            Ok(self.comm.0)
        }
    }
}

impl DeviceComm for NcclComm {
    fn start(&self, call: DeviceCall) -> std::result::Result<(), String> {
        let comm = self.live()?;
        let what = call.name();
        let world = self.world;
        let out_len = call.output_len(world)?;
        let flat = call.input().clone();
        let dtype = nccl_type(flat.dtype())?;
        let autodiff = flat.is_autodiff();
        let flat = flat.without_autodiff();
        let device = flat.device();
        let output = Tensor::<1>::empty([out_len], (&device, flat.dtype()));
        let src = to_cube(flat)?;
        // A clone: Burn keeps `output`'s handle, and the cubecl tensor shares its buffer.
        let dst = to_cube(output.clone())?;
        let src = if src.is_contiguous() {
            src
        } else {
            burn_cubecl::kernel::into_contiguous(src)
        };
        let count = src.meta.shape().num_elements();
        let client = src.client.clone();
        // Pin both buffers (their addresses stay valid while held), then wait for every kernel before NCCL reads.
        let read = client
            .get_resource::<CudaServer>(src.handle.clone())
            .map_err(|e| format!("the input's device buffer: {e:?}"))?;
        let write = client
            .get_resource::<CudaServer>(dst.handle.clone())
            .map_err(|e| format!("the output's device buffer: {e:?}"))?;
        device
            .sync()
            .map_err(|e| format!("waiting for the work that made the input: {e:?}"))?;
        let (from, to) = (read.resource().ptr, write.resource().ptr);
        let elt = super::device::wire_type(src.dtype)?.bytes();
        super::device::check_range(count * elt, read.resource().size, u64::MAX)?;
        super::device::check_range(out_len * elt, u64::MAX, write.resource().size)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        let stream = self.stream.cu_stream() as _;
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
            }
        }
        .map_err(|e| format!("nccl {what} of {count} values: {e:?}"))?;
        *self.pending.lock().map_err(|_| "poisoned")? = Some(InFlight {
            output,
            autodiff,
            done: None,
            _pinned: vec![
                Box::new(read),
                Box::new(write),
                Box::new(src),
                Box::new(dst),
            ],
        });
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
            // NCCL's kernel is on the stream now: everything after this event is the all-reduce's completion.
            in_flight.done = Some(
                self.stream
                    .record_event(None)
                    .map_err(|e| format!("recording the completion event: {e:?}"))?,
            );
        }
        match &in_flight.done {
            Some(done) => done
                .try_is_complete()
                .map_err(|e| format!("the all-reduce failed on the device: {e:?}")),
            None => Ok(false),
        }
    }

    fn finish(&self) -> std::result::Result<Tensor<1>, String> {
        self.live()?;
        let in_flight = self
            .pending
            .lock()
            .map_err(|_| "poisoned")?
            .take()
            .ok_or("no collective was started")?;
        let InFlight {
            output, autodiff, ..
        } = in_flight;
        Ok(if autodiff { output.autodiff() } else { output })
    }

    fn abort(&self) {
        if !self.aborted.swap(true, std::sync::atomic::Ordering::AcqRel) {
            // SAFETY: a live communicator; aborting is allowed while calls are in progress.
            let _ = unsafe { nccl::comm_abort(self.comm.0) };
        }
    }
}
