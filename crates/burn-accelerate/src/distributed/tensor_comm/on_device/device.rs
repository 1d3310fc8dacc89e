//! Gradients averaged in device memory by a collective library (NCCL) that one process drives on its own
//! device, with the guarantees host collectives give: the library's id travels over the rank's communicator,
//! every call has the collective timeout (a stuck call becomes [`CommError::Timeout`] naming the operation,
//! then the communicator is aborted so no rank waits forever), debug mode compares every rank's call first
//! (a mismatch is an error, not a hang), and a rank that cannot connect stops every rank.
//!
//! The library sits behind [`DeviceComm`] / [`DeviceCommLibrary`]: NCCL through `cudarc` in CUDA builds
//! ([`super::nccl`]), a host-memory double in the tests below, which run this whole path on every machine.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor};

use super::DeviceAverage;
use crate::distributed::ProcessGroup;
use crate::distributed::comm::{CommError, ReduceOp};
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

/// A collective call a [`DeviceComm`] runs on device memory. Every rank of the group makes the same call with
/// tensors of the same length and dtype.
#[derive(Debug, Clone)]
pub(crate) enum DeviceCall {
    /// `flat` combined element-wise over the group (`ncclAllReduce`), the whole on every rank.
    AllReduce { flat: Tensor<1>, op: ReduceOp },
    /// `flat` combined over the group in as many equal parts as ranks; this rank keeps its own
    /// (`ncclReduceScatter`).
    ReduceScatter { flat: Tensor<1>, op: ReduceOp },
    /// Every rank's `part` concatenated in rank order, on every rank (`ncclAllGather`).
    AllGather { part: Tensor<1> },
    /// `root`'s `flat` on every rank (`ncclBroadcast`).
    Broadcast { flat: Tensor<1>, root: usize },
}

impl DeviceCall {
    /// The tensor the call sends.
    pub fn input(&self) -> &Tensor<1> {
        match self {
            DeviceCall::AllReduce { flat, .. }
            | DeviceCall::ReduceScatter { flat, .. }
            | DeviceCall::Broadcast { flat, .. } => flat,
            DeviceCall::AllGather { part } => part,
        }
    }

    /// The call's name in messages.
    #[cfg_attr(not(feature = "cuda-bare"), allow(dead_code))]
    pub fn name(&self) -> &'static str {
        match self {
            DeviceCall::AllReduce { .. } => "all_reduce",
            DeviceCall::ReduceScatter { .. } => "reduce_scatter",
            DeviceCall::AllGather { .. } => "all_gather",
            DeviceCall::Broadcast { .. } => "broadcast",
        }
    }

    /// How many elements the result holds on each of `world` ranks, or why the input cannot be split.
    pub fn output_len(&self, world: usize) -> std::result::Result<usize, String> {
        let len = self.input().dims()[0];
        Ok(match self {
            DeviceCall::AllReduce { .. } | DeviceCall::Broadcast { .. } => len,
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
}

/// One rank's connection to a device collective group. Operations are asynchronous: they are enqueued, then
/// [`poll`](Self::poll) says whether the last one finished.
pub(crate) trait DeviceComm: Send + Sync + fmt::Debug {
    /// Starts `call` over the group, in device memory.
    fn start(&self, call: DeviceCall) -> std::result::Result<(), String>;

    /// The result of the last [`start`](Self::start), once [`poll`](Self::poll) has reported it done.
    fn finish(&self) -> std::result::Result<Tensor<1>, String>;

    /// `Ok(true)` when everything enqueued so far has finished, `Ok(false)` while it runs, or the library's
    /// error.
    fn poll(&self) -> std::result::Result<bool, String>;

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

    fn finish(&self) -> std::result::Result<Tensor<1>, String> {
        self.live()?.finish()
    }

    fn poll(&self) -> std::result::Result<bool, String> {
        self.live()?.poll()
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            self.inner.abort();
        }
    }
}

/// Runs collectives through a [`DeviceComm`], keeping the values on the device: gradient averages, and the
/// reduce-scatters, all-gathers and broadcasts of sharded training where the parts are equal.
pub(crate) struct DeviceAllReduce {
    group: Arc<ProcessGroup>,
    comm: Guarded,
    library: &'static str,
    timeout: Duration,
    seq: AtomicU64,
}

impl fmt::Debug for DeviceAllReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAllReduce")
            .field("library", &self.library)
            .field("rank", &self.group.process_index())
            .finish()
    }
}

impl DeviceAllReduce {
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

impl DeviceAllReduce {
    /// Runs `call` to completion: started, polled against the timeout (then the communicator is aborted), and
    /// its result returned.
    fn run(&self, call: DeviceCall) -> Result<Tensor<1>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let operation = match &call {
            DeviceCall::AllReduce { .. } => "gradient_all_reduce",
            DeviceCall::ReduceScatter { .. } => "device_reduce_scatter",
            DeviceCall::AllGather { .. } => "device_all_gather",
            DeviceCall::Broadcast { .. } => "device_broadcast",
        };
        // Debug mode's comparison of the ranks' calls wraps this engine (`Checked`).
        wire_type(call.input().dtype()).map_err(Error::InvalidArgument)?;
        call.output_len(self.group.num_processes())
            .map_err(Error::InvalidArgument)?;
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
}

impl DeviceAverage for DeviceAllReduce {
    fn name(&self) -> &'static str {
        match self.library {
            "NCCL" => "device all-reduce (NCCL)",
            _ => "device all-reduce",
        }
    }

    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let averaged = self.run(DeviceCall::AllReduce {
            flat,
            op: ReduceOp::Mean,
        })?;
        Ok(if scale == 1.0 {
            averaged
        } else {
            averaged.mul_scalar(scale)
        })
    }

    fn reduce_scatter(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Some(self.run(DeviceCall::ReduceScatter { flat, op }))
    }

    fn all_gather(&self, part: Tensor<1>) -> Option<Result<Tensor<1>>> {
        Some(self.run(DeviceCall::AllGather { part }))
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Option<Result<Tensor<1>>> {
        Some(self.run(DeviceCall::Broadcast { flat, root }))
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
        let results = std::sync::Mutex::new(Vec::new());
        Accelerator::builder()
            .debug(debug)
            .collective_timeout(timeout)
            .launch(world, |acc| {
                let group = acc.group_arc();
                let rank = group.process_index();
                let outcomes = match DeviceAllReduce::connect(group.clone(), &library, timeout) {
                    Err(e) => vec![Err(e)],
                    Ok(t) => {
                        // Behind the interface, as a run uses it (debug mode's check wraps it).
                        let t = super::super::OnDevice::checked(Box::new(t), &group);
                        (0..calls)
                            .map(|_| {
                                let flat =
                                    Tensor::<1>::from_floats(values(rank).as_slice(), acc.device());
                                let averaged = t
                                    .all_reduce(
                                        flat,
                                        Reduction::Average(0.5),
                                        "gradient_all_reduce",
                                    )?
                                    .wait()?;
                                assert_eq!(averaged.dtype(), DType::F32);
                                Ok(averaged.into_data().try_to_vec::<f32>().unwrap())
                            })
                            .collect()
                    }
                };
                results.lock().unwrap().push((rank, outcomes));
                Ok(())
            })
            .expect("every rank returns");
        let mut results = results.into_inner().unwrap();
        results.sort_by_key(|(rank, _)| *rank);
        assert_eq!(
            results.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(),
            (0..world).collect::<Vec<_>>(),
            "every rank reports"
        );
        results.into_iter().map(|(_, r)| r).collect()
    }

    #[test]
    fn sharded_trainings_equal_part_collectives_run_on_the_device_engine_and_uneven_ones_through_the_host()
     {
        let library = HostLibrary::default();
        let values = |rank: usize| -> Vec<f32> { (0..6).map(|i| (rank * 10 + i) as f32).collect() };
        let results = Accelerator::builder()
            .debug(true)
            .launch(3, |acc| {
                let group = acc.group_arc();
                let rank = group.process_index();
                let engine =
                    DeviceAllReduce::connect(group.clone(), &library, Duration::from_secs(30))?;
                let comm = super::super::OnDevice::checked(Box::new(engine), &group);
                let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
                let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
                // Equal parts: on the engine. The mean of the 6 values of 3 ranks, 2 per rank.
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
                // Uneven parts: through host memory, with the same answer a host run gives.
                let uneven = comm
                    .reduce_scatter(
                        tensor(values(rank)),
                        &[1, 2, 3],
                        Reduction::Op(ReduceOp::Sum),
                        "rs3",
                    )?
                    .wait()?;
                Ok((
                    read(mine),
                    read(gathered),
                    read(from_root),
                    read(summed),
                    read(uneven),
                ))
            })
            .unwrap();
        // Four calls on the engine on each of the 3 ranks; the uneven one went through host memory.
        assert_eq!(library.started.load(Ordering::Relaxed), 4 * 3);
        for (rank, (mine, gathered, from_root, summed, uneven)) in results.into_iter().enumerate() {
            let mean: Vec<f32> = (0..6)
                .map(|i| (10.0 + i as f32 * 3.0 + 20.0) / 3.0)
                .collect();
            assert_eq!(mine, mean[rank * 2..rank * 2 + 2].to_vec(), "rank {rank}");
            assert_eq!(gathered, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
            assert_eq!(from_root, values(2));
            let sum: Vec<f32> = (0..6).map(|i| (30 + i * 3) as f32).collect();
            assert_eq!(
                summed,
                sum[rank * 2..rank * 2 + 2]
                    .iter()
                    .map(|s| s * 0.5)
                    .collect::<Vec<_>>()
            );
            let start = [0, 1, 3][rank];
            assert_eq!(uneven, sum[start..start + rank + 1].to_vec(), "rank {rank}");
        }
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
                    DeviceAllReduce::connect(group.clone(), &library, Duration::from_secs(60))?;
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
                vec![
                    DType::F32,
                    DType::BF16,
                    DType::F16,
                    DType::F32,
                    DType::F32,
                    DType::F32
                ]
            );
            // Not equal by construction: the double sums in another order and precision (the all-reduce and the
            // reduce-scatter); the all-gather and the broadcast copy exactly.
            assert!(
                checks[0].max_error > 0.0 && checks[3].max_error > 0.0,
                "{checks:?}"
            );
            assert!(
                checks[4].max_error == 0.0 && checks[5].max_error == 0.0,
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
            sum_only: true,
            ..Default::default()
        };
        for checks in check_on_ranks(library) {
            // Every mean (the dtypes' all-reduces, the reduce-scatter) fails; the copies do not divide.
            assert!(checks[..4].iter().all(|c| !c.passed()), "{checks:?}");
            assert!(checks[4..].iter().all(|c| c.passed()), "{checks:?}");
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
