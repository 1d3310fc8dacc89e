//! The flight recorder (as torch's for NCCL): a communicator that remembers its rank's last collective calls —
//! operation, sizes, root and sequence number — and adds them to the error of any call that fails or times out,
//! so that a hang turned into a timeout, or a peer's failure, shows what this rank was doing and had just done.
//! Recording costs a few stores under an uncontended lock per call: no allocation, no communication.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::{CommError, CommResult, Communicator, ReduceBuffer, ReduceOp, SharedValue};

/// Calls kept per communicator.
pub const RECORDED_CALLS: usize = 16;

/// One recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedCall {
    /// Its number among this communicator's calls (0 for the first).
    pub seq: u64,
    /// The operation.
    pub operation: &'static str,
    /// The elements (or bytes, for byte buffers) this rank passed.
    pub elements: usize,
    /// The element kind (`f32`, `bytes`, ...).
    pub kind: &'static str,
    /// The parts (ranks' counts), for the operations that take them.
    pub parts: Option<usize>,
    /// The root, for rooted operations.
    pub root: Option<usize>,
    /// The reduction, for reducing operations.
    pub op: Option<ReduceOp>,
    /// Whether it completed.
    pub completed: bool,
}

impl fmt::Display for RecordedCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{} {} {} {}",
            self.seq, self.operation, self.elements, self.kind
        )?;
        if let Some(parts) = self.parts {
            write!(f, " in {parts} parts")?;
        }
        if let Some(root) = self.root {
            write!(f, " root {root}")?;
        }
        if let Some(op) = self.op {
            write!(f, " {op:?}")?;
        }
        if !self.completed {
            f.write_str(" (did not complete)")?;
        }
        Ok(())
    }
}

/// The last calls of one rank (`who`: `rank 2`, or `rank 2 (rank 1 of a sub-group)`), oldest first, as the text
/// an error carries.
pub fn describe_calls(who: &str, calls: &[RecordedCall]) -> String {
    let list: Vec<String> = calls.iter().map(ToString::to_string).collect();
    format!(
        "the last collectives of {who}, oldest first: {}",
        list.join("; ")
    )
}

/// A communicator that records its calls (see the module documentation).
pub struct Recorded {
    inner: Arc<dyn Communicator>,
    /// The rank in the group the first recorded communicator spoke for (a sub-group's calls name it too).
    world_rank: usize,
    /// Whether this is a sub-group's communicator (made by `split`).
    sub_group: bool,
    calls: Mutex<(u64, VecDeque<RecordedCall>)>,
    /// Values this rank's calls passed through host memory, its sub-groups' included.
    host_values: Arc<AtomicU64>,
}

impl fmt::Debug for Recorded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorded")
            .field("engine", &self.inner.engine())
            .field("rank", &self.inner.rank())
            .finish()
    }
}

impl Recorded {
    /// `inner`, recording its calls.
    pub fn wrap(inner: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
        Self::wrap_counted(inner).0
    }

    /// `inner`, recording its calls, and the count of values its calls (and its sub-groups') pass through host
    /// memory: the elements of every buffer this rank hands to a collective or a message, not the bytes of
    /// control messages, nor values shared as they are ([`Communicator::share`]).
    pub fn wrap_counted(inner: Arc<dyn Communicator>) -> (Arc<dyn Communicator>, HostValues) {
        let world_rank = inner.rank();
        let recorded = Self::new(inner, world_rank, false, Arc::default());
        let count = HostValues(recorded.host_values.clone());
        (Arc::new(recorded), count)
    }

    fn new(
        inner: Arc<dyn Communicator>,
        world_rank: usize,
        sub_group: bool,
        host_values: Arc<AtomicU64>,
    ) -> Self {
        Self {
            inner,
            world_rank,
            sub_group,
            calls: Mutex::new((0, VecDeque::with_capacity(RECORDED_CALLS))),
            host_values,
        }
    }

    /// Who the calls are of, for the error's text.
    fn who(&self) -> String {
        if self.sub_group {
            format!(
                "rank {} (rank {} of a sub-group)",
                self.world_rank,
                self.inner.rank()
            )
        } else {
            format!("rank {}", self.world_rank)
        }
    }

    /// The recorded calls, oldest first.
    pub fn calls(&self) -> Vec<RecordedCall> {
        self.lock().1.iter().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, VecDeque<RecordedCall>)> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the start of a call; returns its sequence number.
    fn begin(&self, call: RecordedCall) -> u64 {
        let mut guard = self.lock();
        let (next, calls) = &mut *guard;
        let seq = *next;
        *next += 1;
        if calls.len() == RECORDED_CALLS {
            calls.pop_front();
        }
        calls.push_back(RecordedCall {
            seq,
            completed: false,
            ..call
        });
        seq
    }

    /// Marks call `seq` completed, or adds the recorded calls to its error.
    fn end<T>(&self, seq: u64, result: CommResult<T>) -> CommResult<T> {
        match result {
            Ok(value) => {
                if let Some(call) = self.lock().1.iter_mut().rev().find(|c| c.seq == seq) {
                    call.completed = true;
                }
                Ok(value)
            }
            Err(error) => Err(CommError::WithRecentCalls {
                error: Box::new(error),
                calls: describe_calls(&self.who(), &self.calls()),
            }),
        }
    }

    fn run<T>(&self, call: RecordedCall, f: impl FnOnce() -> CommResult<T>) -> CommResult<T> {
        if matches!(call.kind, "f32" | "f64" | "i64") {
            self.host_values
                .fetch_add(call.elements as u64, Ordering::Relaxed);
        }
        let seq = self.begin(call);
        self.end(seq, f())
    }
}

/// The count of values one rank's communicator passed through host memory ([`Recorded::wrap_counted`]).
#[derive(Debug, Clone, Default)]
pub struct HostValues(Arc<AtomicU64>);

impl HostValues {
    /// The values so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A call of `operation` on `elements` of `kind`.
fn call(operation: &'static str, elements: usize, kind: &'static str) -> RecordedCall {
    RecordedCall {
        seq: 0,
        operation,
        elements,
        kind,
        parts: None,
        root: None,
        op: None,
        completed: false,
    }
}

impl Communicator for Recorded {
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn barrier(&self) -> CommResult<()> {
        self.run(call("barrier", 0, "-"), || self.inner.barrier())
    }

    fn concurrent(&self) -> bool {
        self.inner.concurrent()
    }

    fn all_reduce(&self, data: ReduceBuffer, op: ReduceOp) -> CommResult<ReduceBuffer> {
        let record = RecordedCall {
            op: Some(op),
            ..call("all_reduce", data.len(), data.kind())
        };
        self.run(record, || self.inner.all_reduce(data, op))
    }

    fn all_gather(&self, data: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
        self.run(call("all_gather", data.len(), "bytes"), || {
            self.inner.all_gather(data)
        })
    }

    fn broadcast(&self, data: Vec<u8>, root: usize) -> CommResult<Vec<u8>> {
        let record = RecordedCall {
            root: Some(root),
            ..call("broadcast", data.len(), "bytes")
        };
        self.run(record, || self.inner.broadcast(data, root))
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>> {
        let record = RecordedCall {
            root: Some(color),
            ..call("split", key, "key")
        };
        self.run(record, || self.inner.split(color, key))
            .map(|child| {
                Arc::new(Recorded::new(
                    child,
                    self.world_rank,
                    true,
                    self.host_values.clone(),
                )) as Arc<dyn Communicator>
            })
    }

    fn reduce_scatter(
        &self,
        data: ReduceBuffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<ReduceBuffer> {
        let record = RecordedCall {
            parts: Some(counts.len()),
            op: Some(op),
            ..call("reduce_scatter", data.len(), data.kind())
        };
        self.run(record, || self.inner.reduce_scatter(data, counts, op))
    }

    fn reduce(
        &self,
        data: ReduceBuffer,
        root: usize,
        op: ReduceOp,
    ) -> CommResult<Option<ReduceBuffer>> {
        let record = RecordedCall {
            root: Some(root),
            op: Some(op),
            ..call("reduce", data.len(), data.kind())
        };
        self.run(record, || self.inner.reduce(data, root, op))
    }

    fn broadcast_buffer(&self, data: ReduceBuffer, root: usize) -> CommResult<ReduceBuffer> {
        let record = RecordedCall {
            root: Some(root),
            ..call("broadcast_buffer", data.len(), data.kind())
        };
        self.run(record, || self.inner.broadcast_buffer(data, root))
    }

    fn all_gather_parts(&self, data: ReduceBuffer, counts: &[usize]) -> CommResult<ReduceBuffer> {
        let record = RecordedCall {
            parts: Some(counts.len()),
            ..call("all_gather_parts", data.len(), data.kind())
        };
        self.run(record, || self.inner.all_gather_parts(data, counts))
    }

    fn send_recv(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> CommResult<Vec<ReduceBuffer>> {
        let elements = sends.iter().chain(&recvs).map(|(_, b)| b.len()).sum();
        let kind = sends
            .iter()
            .chain(&recvs)
            .map(|(_, b)| b.kind())
            .next()
            .unwrap_or("-");
        let record = RecordedCall {
            parts: Some(sends.len() + recvs.len()),
            ..call("send_recv", elements, kind)
        };
        self.run(record, || self.inner.send_recv(sends, recvs))
    }

    fn shares_memory(&self) -> bool {
        self.inner.shares_memory()
    }

    fn share(&self, operation: &'static str, value: SharedValue) -> CommResult<Vec<SharedValue>> {
        self.run(call(operation, 1, "shared"), || {
            self.inner.share(operation, value)
        })
    }

    fn send_recv_shared(
        &self,
        sends: Vec<(usize, SharedValue)>,
        recvs: Vec<usize>,
    ) -> CommResult<Vec<SharedValue>> {
        let record = RecordedCall {
            parts: Some(sends.len() + recvs.len()),
            ..call("send_recv_shared", sends.len() + recvs.len(), "shared")
        };
        self.run(record, || self.inner.send_recv_shared(sends, recvs))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::InProcessGroup;

    /// Rank 1 skips the third collective: rank 0's timeout carries its last calls, the one that timed out marked.
    #[test]
    fn a_timeout_carries_the_ranks_last_calls() {
        let group = InProcessGroup::new(2, Duration::from_millis(300));
        let errors: Vec<Option<CommError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let group = group.clone();
                    scope.spawn(move || {
                        let comm = Recorded::wrap(Arc::new(group.comm(rank)));
                        comm.all_reduce(ReduceBuffer::F32(vec![1.0; 4]), ReduceOp::Sum)
                            .unwrap();
                        comm.broadcast(vec![7; 3], 1).unwrap();
                        if rank == 1 {
                            std::thread::sleep(Duration::from_secs(1));
                            return None;
                        }
                        comm.reduce_scatter(
                            ReduceBuffer::F32(vec![0.0; 6]),
                            &[3, 3],
                            ReduceOp::Mean,
                        )
                        .err()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let error = errors[0].as_ref().expect("rank 0 timed out");
        assert!(matches!(error.root(), CommError::Timeout { .. }), "{error}");
        let text = error.to_string();
        assert!(
            text.contains(
                "the last collectives of rank 0, oldest first: #0 all_reduce 4 f32 Sum; #1 broadcast 3 bytes root 1; \
                 #2 reduce_scatter 6 f32 in 2 parts Mean (did not complete)"
            ),
            "{text}"
        );
    }

    #[test]
    fn only_the_last_calls_are_kept() {
        let group = InProcessGroup::new(1, Duration::from_secs(1));
        let recorded = Recorded::new(Arc::new(group.comm(0)), 0, false, Arc::default());
        for _ in 0..RECORDED_CALLS + 5 {
            recorded.barrier().unwrap();
        }
        let calls = recorded.calls();
        assert_eq!(calls.len(), RECORDED_CALLS);
        assert_eq!(calls[0].seq, 5);
        assert!(
            calls
                .iter()
                .all(|c| c.completed && c.operation == "barrier")
        );
    }

    #[test]
    fn values_through_host_memory_are_counted_with_the_sub_groups_and_shared_values_are_not() {
        let group = InProcessGroup::new(2, Duration::from_secs(5));
        let counts: Vec<u64> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let group = &group;
                    scope.spawn(move || {
                        let (comm, values) = Recorded::wrap_counted(Arc::new(group.comm(rank)));
                        comm.all_reduce(ReduceBuffer::F32(vec![1.0; 5]), ReduceOp::Sum)
                            .unwrap();
                        comm.broadcast(vec![0; 100], 0).unwrap();
                        let sub = comm.split(0, rank).unwrap();
                        sub.reduce_scatter(ReduceBuffer::F64(vec![1.0; 4]), &[2, 2], ReduceOp::Sum)
                            .unwrap();
                        let shared = comm.share("share", Arc::new(vec![0f32; 1000])).unwrap();
                        assert_eq!(shared.len(), 2);
                        values.get()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // 5 f32 and 4 f64 values; neither the control bytes nor the shared value count.
        assert_eq!(counts, vec![9, 9]);
    }
}
