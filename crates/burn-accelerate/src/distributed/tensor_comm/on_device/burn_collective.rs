//! Burn's own collective between the CUDA devices of one process (`burn::tensor::distributed::all_reduce`,
//! NCCL underneath, its group formed inside the process): the device transport of in-process ranks.
//!
//! Every rank thread calls the all-reduce with the same list of devices, in the same order of buckets (the
//! data-parallel strategy guarantees it); the first call forms the NCCL group of those devices.
//!
//! Burn's call has no timeout, and a rank that fails between the communicator's barrier and the all-reduce
//! would leave the others inside NCCL for ever. So each rank hands its calls to a worker thread of its own and
//! waits for the answer at most the collective timeout: past it the call is a [`CommError::Timeout`] naming the
//! operation, and the transport refuses every later call (the worker may still be inside Burn's collective).
//! The reduction itself is a function, so that this path runs in the tests of every machine.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::Tensor;

use super::DeviceEngine;
use super::device::wire_type;
use crate::distributed::ProcessGroup;
use crate::distributed::comm::CommError;
use crate::error::{Error, Result};

/// The all-reduce (mean) of one flat tensor over the in-process ranks.
pub(crate) type MeanFn = Arc<dyn Fn(Tensor<1>) -> Tensor<1> + Send + Sync>;

/// One call handed to the worker: the tensor, and where its mean goes.
type Job = (Tensor<1>, Sender<Tensor<1>>);

/// Averages gradients with an in-process device collective (Burn's, in CUDA builds), each call bounded by the
/// collective timeout.
pub(crate) struct BurnCollective {
    group: Arc<ProcessGroup>,
    jobs: Mutex<Option<Sender<Job>>>,
    timeout: Duration,
    seq: AtomicU64,
    broken: AtomicBool,
}

impl fmt::Debug for BurnCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BurnCollective")
            .field("rank", &self.group.process_index())
            .finish()
    }
}

impl BurnCollective {
    /// The transport of `group`'s rank, whose ranks are threads of this process on CUDA devices `0..world`
    /// (rank `i` on device `i`, as in-process launching places them).
    ///
    /// # Errors
    /// This rank's device is not CUDA device `rank`.
    #[cfg(feature = "cuda-bare")]
    pub fn new(group: Arc<ProcessGroup>, timeout: Duration) -> Result<Self> {
        use burn::tensor::Device;
        use burn::tensor::distributed::{ReduceOperation, all_reduce};

        let rank = group.process_index();
        if super::nccl::cuda_ordinal(group.device()) != Some(rank) {
            return Err(Error::InvalidArgument(format!(
                "Burn's CUDA collective needs in-process rank {rank} on CUDA device {rank}, it runs on {:?}",
                group.device()
            )));
        }
        let devices: Vec<Device> = (0..group.num_processes()).map(Device::cuda).collect();
        let mean: MeanFn = Arc::new(move |flat| {
            all_reduce(flat, ReduceOperation::Mean, devices.clone()).resolve()
        });
        Self::with_mean(group, timeout, mean)
    }

    /// The transport of `group`'s rank over `mean`, run on a worker thread of this rank.
    ///
    /// # Errors
    /// The worker thread cannot be started.
    pub fn with_mean(group: Arc<ProcessGroup>, timeout: Duration, mean: MeanFn) -> Result<Self> {
        let (jobs, queue): (Sender<Job>, Receiver<Job>) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("device-collective-{}", group.process_index()))
            .spawn(move || {
                // Ends when the transport drops its sender.
                for (flat, reply) in queue {
                    let _ = reply.send(mean(flat));
                }
            })
            .map_err(|e| Error::Execution {
                operation: "device all-reduce setup",
                device: format!("{:?}", group.device()),
                reason: format!("could not start the collective's thread: {e}"),
            })?;
        Ok(Self {
            group,
            jobs: Mutex::new(Some(jobs)),
            timeout,
            seq: AtomicU64::new(1),
            broken: AtomicBool::new(false),
        })
    }

    /// The mean of `flat` from the worker, at most the timeout after the call.
    fn mean(&self, flat: Tensor<1>, seq: u64) -> Result<Tensor<1>> {
        let failed = |reason: String| Error::Execution {
            operation: "device all-reduce",
            device: format!("{:?}", self.group.device()),
            reason: format!("`gradient_all_reduce` #{seq}: {reason}"),
        };
        let (reply, answer) = mpsc::channel();
        let sent = self
            .jobs
            .lock()
            .map_err(|_| failed("the transport's lock is poisoned".into()))?
            .as_ref()
            .map(|jobs| jobs.send((flat, reply)).is_ok());
        if sent != Some(true) {
            return Err(failed("the collective's thread has stopped".into()));
        }
        match answer.recv_timeout(self.timeout) {
            Ok(mean) => Ok(mean),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.broken.store(true, Ordering::Release);
                Err(CommError::Timeout {
                    operation: "gradient_all_reduce".into(),
                    seq,
                    rank: self.group.process_index(),
                    missing: Vec::new(),
                    timeout: self.timeout,
                }
                .into())
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.broken.store(true, Ordering::Release);
                Err(failed("the collective panicked".into()))
            }
        }
    }
}

impl Drop for BurnCollective {
    fn drop(&mut self) {
        // Closing the queue ends the worker (unless it is stuck in a collective that timed out).
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.take();
        }
    }
}

impl DeviceEngine for BurnCollective {
    fn name(&self) -> &'static str {
        "device all-reduce (Burn's CUDA collective)"
    }

    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        if self.broken.load(Ordering::Acquire) {
            return Err(Error::Execution {
                operation: "device all-reduce",
                device: format!("{:?}", self.group.device()),
                reason: format!(
                    "`gradient_all_reduce` #{seq}: an earlier device all-reduce timed out or failed and may still \
                     hold the devices: restart the run (`burn-accelerate launch --max-restarts`), or set \
                     ACCELERATE_GRADIENT_TRANSPORT=host"
                ),
            });
        }
        // Debug mode's comparison of the ranks' calls wraps this engine (`Checked`).
        wire_type(flat.dtype()).map_err(Error::InvalidArgument)?;
        // Every rank first meets at the communicator's barrier, which has a timeout (and learns there of a rank
        // that failed); the collective itself is bounded by `mean`'s wait.
        self.group.comm().barrier()?;
        let autodiff = flat.is_autodiff();
        let averaged = self.mean(flat.without_autodiff(), seq)?;
        let averaged = if scale == 1.0 {
            averaged
        } else {
            averaged.mul_scalar(scale)
        };
        Ok(if autodiff {
            averaged.autodiff()
        } else {
            averaged
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::time::Instant;

    use super::*;
    use crate::Accelerator;

    /// Each of `world` ranks averages `[rank]` twice through `mean`; every rank's two outcomes, in rank order.
    fn run(world: usize, timeout: Duration, mean: MeanFn) -> Vec<Vec<Result<Vec<f32>>>> {
        let mut results = Accelerator::builder()
            .collective_timeout(Duration::from_secs(60))
            .launch(world, |acc| {
                let group = acc.group_arc();
                let transport = BurnCollective::with_mean(group.clone(), timeout, mean.clone())?;
                let outcomes = (0..2)
                    .map(|_| {
                        let flat =
                            Tensor::<1>::from_floats([group.process_index() as f32], acc.device());
                        transport
                            .average(flat, 1.0)
                            .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
                    })
                    .collect::<Vec<_>>();
                Ok((group.process_index(), outcomes))
            })
            .expect("every rank returns");
        results.sort_by_key(|(rank, _)| *rank);
        assert_eq!(results.len(), world, "every rank reports");
        results.into_iter().map(|(_, outcomes)| outcomes).collect()
    }

    #[test]
    fn every_call_goes_through_the_collective() {
        let calls = Arc::new(AtomicU64::new(0));
        let counted = calls.clone();
        let mean: MeanFn = Arc::new(move |flat| {
            counted.fetch_add(1, Ordering::Relaxed);
            flat.mul_scalar(0.5)
        });
        for (rank, outcomes) in run(2, Duration::from_secs(60), mean)
            .into_iter()
            .enumerate()
        {
            for outcome in outcomes {
                assert_eq!(outcome.unwrap(), vec![rank as f32 * 0.5]);
            }
        }
        assert_eq!(calls.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_collective_that_never_completes_is_a_timeout_on_every_rank_then_refused() {
        // A rendezvous one rank more than the world: like NCCL waiting for a rank that failed after the barrier.
        let never = Arc::new(Barrier::new(3));
        let mean: MeanFn = Arc::new(move |flat| {
            never.wait();
            flat
        });
        let started = Instant::now();
        let results = run(2, Duration::from_millis(300), mean);
        assert!(started.elapsed() < Duration::from_secs(30), "no hang");
        for (rank, outcomes) in results.into_iter().enumerate() {
            match &outcomes[0] {
                Err(Error::Comm(CommError::Timeout { operation, .. })) => {
                    assert_eq!(operation, "gradient_all_reduce", "rank {rank}")
                }
                other => panic!("rank {rank}: {other:?}"),
            }
            let text = outcomes[1].as_ref().unwrap_err().to_string();
            assert!(text.contains("timed out or failed"), "rank {rank}: {text}");
        }
    }
}
