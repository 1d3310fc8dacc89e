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

mod library;

pub(crate) use library::*;

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
