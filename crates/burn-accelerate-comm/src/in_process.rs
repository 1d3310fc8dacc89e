//! The in-process engine: one rank per thread, exchanging buffers through shared memory.
//!
//! Every collective is one or two *rounds*: each rank deposits its contribution for the round's sequence number
//! and waits until all ranks have; the completed round is shared read-only (`Arc`) with everyone. Rounds are keyed
//! by sequence number, so a fast rank may already deposit into the next round while slow ones still read the
//! last. Waiting ranks wake up on completion, on the failure or exit of another rank, or at the timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use super::Communicator;
use super::reduce::{ReduceBuffer, ReduceOp, check_compatible, reduce_range};
use crate::error::CommError as Error;

type Result<T> = crate::CommResult<T>;

const ENGINE: &str = "in-process";

/// Buffers at least this long are reduced in two rounds (each rank reduces one slice, then slices are shared), so
/// the work is spread over the ranks' threads; shorter ones are reduced whole by every rank in one round.
const SPLIT_REDUCE_MIN: usize = 1 << 15;

/// What a rank contributes to a round.
#[derive(Debug)]
enum Payload {
    Unit,
    Bytes(Vec<u8>),
    Reduce(ReduceBuffer),
}

/// The payloads of a completed round, in rank order. Ranks read them concurrently; a rank may take its own
/// payload back once no other rank reads it any more (after the next round of the same collective).
type Shared = Arc<Vec<RwLock<Option<Payload>>>>;

fn read(slot: &RwLock<Option<Payload>>) -> std::sync::RwLockReadGuard<'_, Option<Payload>> {
    slot.read().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct Round {
    ops: Vec<Option<&'static str>>,
    payloads: Vec<Option<Payload>>,
    arrived: usize,
    outcome: Option<std::result::Result<Shared, String>>,
    taken: usize,
}

#[derive(Debug, Default)]
struct GroupState {
    rounds: HashMap<u64, Round>,
    /// The first rank that failed and why; every later wait errors with it.
    failed: Option<(usize, String)>,
    /// Ranks whose work has ended (`None` while running).
    left: Vec<Option<String>>,
}

/// A group of in-process ranks. Create it once, then give [`InProcessGroup::comm`] of rank `i` to thread `i`.
#[derive(Debug)]
pub struct InProcessGroup {
    size: usize,
    timeout: Duration,
    state: Mutex<GroupState>,
    wake: Condvar,
}

impl InProcessGroup {
    /// A group of `size` ranks whose collectives give up after `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            size: size.max(1),
            timeout,
            state: Mutex::new(GroupState {
                left: vec![None; size.max(1)],
                ..Default::default()
            }),
            wake: Condvar::new(),
        })
    }

    /// The communicator of rank `rank`.
    pub fn comm(self: &Arc<Self>, rank: usize) -> InProcessComm {
        assert!(
            rank < self.size,
            "rank {rank} outside a group of {}",
            self.size
        );
        InProcessComm {
            group: self.clone(),
            rank,
            seq: AtomicU64::new(0),
        }
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn lock(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `rank` failed (`reason`, e.g. "panicked: ..."): every rank waiting now or later gets an error.
    pub fn fail(&self, rank: usize, reason: impl Into<String>) {
        let mut state = self.lock();
        if state.failed.is_none() {
            state.failed = Some((rank, reason.into()));
        }
        drop(state);
        self.wake.notify_all();
    }

    /// Records that `rank` finished its work; ranks waiting for it in a collective then fail fast.
    pub fn leave(&self, rank: usize, how: impl Into<String>) {
        self.lock().left[rank] = Some(how.into());
        self.wake.notify_all();
    }
}

/// The error of a collective that cannot complete because `failed` (rank, what happened) failed.
fn rank_failed(op: &str, seq: u64, failed: &(usize, String)) -> Error {
    Error::RankFailed {
        operation: op.into(),
        seq,
        failed_rank: failed.0,
        reason: failed.1.clone(),
    }
}

/// Rank `i`'s handle on an [`InProcessGroup`].
#[derive(Debug)]
pub struct InProcessComm {
    group: Arc<InProcessGroup>,
    rank: usize,
    seq: AtomicU64,
}

impl InProcessComm {
    /// The group this communicator belongs to.
    pub fn group(&self) -> &Arc<InProcessGroup> {
        &self.group
    }

    /// Deposits `payload` for the next round and returns every rank's payload once all have arrived.
    fn exchange(&self, op: &'static str, payload: Payload) -> Result<Shared> {
        let group = &*self.group;
        let n = group.size;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let deadline = crate::deadline_after(group.timeout);
        let mut state = group.lock();
        if let Some(failed) = &state.failed {
            return Err(rank_failed(op, seq, failed));
        }
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            ops: vec![None; n],
            payloads: (0..n).map(|_| None).collect(),
            arrived: 0,
            outcome: None,
            taken: 0,
        });
        round.ops[self.rank] = Some(op);
        round.payloads[self.rank] = Some(payload);
        round.arrived += 1;
        if round.arrived == n {
            let ops: Vec<&str> = round.ops.iter().map(|o| o.unwrap_or("?")).collect();
            round.outcome = Some(if ops.iter().all(|o| *o == ops[0]) {
                Ok(Arc::new(
                    round
                        .payloads
                        .iter_mut()
                        .map(|p| RwLock::new(Some(p.take().unwrap_or(Payload::Unit))))
                        .collect(),
                ))
            } else {
                Err(ops
                    .iter()
                    .enumerate()
                    .map(|(r, o)| format!("rank {r}: {o}"))
                    .collect::<Vec<_>>()
                    .join(", "))
            });
            group.wake.notify_all();
        }
        loop {
            let round = state
                .rounds
                .get_mut(&seq)
                .expect("a round lives until every rank took it");
            if let Some(outcome) = &round.outcome {
                let outcome = outcome.clone();
                round.taken += 1;
                if round.taken == n {
                    state.rounds.remove(&seq);
                }
                return outcome.map_err(|calls| Error::CollectiveMismatch { seq, calls });
            }
            let absent: Vec<usize> = round
                .payloads
                .iter()
                .zip(&round.ops)
                .enumerate()
                .filter(|(_, (_, op))| op.is_none())
                .map(|(r, _)| r)
                .collect();
            if let Some(failed) = &state.failed {
                return Err(rank_failed(op, seq, failed));
            }
            if let Some((r, how)) = absent
                .iter()
                .find_map(|r| state.left[*r].as_ref().map(|how| (*r, how.clone())))
            {
                return Err(Error::RankFailed {
                    operation: op.into(),
                    seq,
                    failed_rank: r,
                    reason: format!("{how} without joining it"),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    operation: op.into(),
                    seq,
                    rank: self.rank,
                    missing: absent,
                    timeout: group.timeout,
                });
            }
            state = group
                .wake
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Communicator for InProcessComm {
    fn engine(&self) -> &'static str {
        ENGINE
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.size
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Payload::Unit).map(|_| ())
    }

    fn all_reduce(&self, data: ReduceBuffer, op: ReduceOp) -> Result<ReduceBuffer> {
        let n = self.group.size;
        let len = data.len();
        let all = self.exchange("all_reduce", Payload::Reduce(data))?;
        let reduce = |range: std::ops::Range<usize>| -> Result<ReduceBuffer> {
            let guards: Vec<_> = all.iter().map(|slot| read(slot)).collect();
            let inputs: Vec<&ReduceBuffer> = guards
                .iter()
                .map(|g| match g.as_ref() {
                    Some(Payload::Reduce(b)) => b,
                    _ => unreachable!("the round checked that every rank called all_reduce"),
                })
                .collect();
            check_compatible(&inputs)?;
            Ok(reduce_range(&inputs, range, op))
        };
        let out = if len < SPLIT_REDUCE_MIN || n == 1 {
            reduce(0..len)?
        } else {
            // Reduce-scatter then all-gather: rank r reduces slice r, then the slices are exchanged and copied
            // into this rank's own input buffer, which no other rank reads any more by then.
            let slice = |r: usize| (r * len / n)..((r + 1) * len / n);
            let mine = reduce(slice(self.rank))?;
            let slices = self.exchange("all_reduce", Payload::Reduce(mine))?;
            let own = all[self.rank]
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            drop(all);
            let Some(Payload::Reduce(mut out)) = own else {
                unreachable!("this rank deposited a reduce buffer")
            };
            for (r, slot) in slices.iter().enumerate() {
                let guard = read(slot);
                let Some(Payload::Reduce(part)) = guard.as_ref() else {
                    unreachable!("the round checked the operation")
                };
                out.copy_from(slice(r).start, part);
            }
            out
        };
        Ok(out)
    }

    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let all = self.exchange("all_gather", Payload::Bytes(data))?;
        Ok(all
            .iter()
            .map(|slot| match read(slot).as_ref() {
                Some(Payload::Bytes(b)) => b.clone(),
                _ => unreachable!("the round checked the operation"),
            })
            .collect())
    }

    fn broadcast(&self, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        if root >= self.group.size {
            return Err(Error::InvalidRoot {
                operation: "broadcast".into(),
                root,
                world_size: self.group.size,
            });
        }
        let mine = if self.rank == root { data } else { Vec::new() };
        let all = self.exchange("broadcast", Payload::Bytes(mine))?;
        match read(&all[root]).as_ref() {
            Some(Payload::Bytes(b)) => Ok(b.clone()),
            _ => unreachable!("the round checked the operation"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn run<T: Send + 'static>(
        n: usize,
        timeout: Duration,
        f: impl Fn(InProcessComm) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let group = InProcessGroup::new(n, timeout);
        let f = Arc::new(f);
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (comm, f) = (group.comm(r), f.clone());
                thread::spawn(move || f(comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn a_group_without_a_time_limit_still_exchanges() {
        // Duration::MAX used to overflow the deadline computation.
        let out = run(2, Duration::MAX, |c| {
            c.all_gather(vec![c.rank() as u8]).unwrap()
        });
        assert_eq!(out, vec![vec![vec![0], vec![1]]; 2]);
    }

    #[test]
    fn all_reduce_small_and_split() {
        for n in [2, 3, 4] {
            for len in [5, SPLIT_REDUCE_MIN + 3] {
                let out = run(n, Duration::from_secs(10), move |c| {
                    let r = c.rank() as f32;
                    let data = (0..len).map(|i| r + i as f32).collect();
                    c.all_reduce(ReduceBuffer::F32(data), ReduceOp::Sum)
                        .unwrap()
                });
                let ranks: f32 = (0..n).map(|r| r as f32).sum();
                for b in out {
                    let ReduceBuffer::F32(v) = b else { panic!() };
                    assert_eq!(v.len(), len);
                    for (i, x) in v.iter().enumerate() {
                        assert_eq!(*x, ranks + n as f32 * i as f32);
                    }
                }
            }
        }
    }

    #[test]
    fn gather_and_broadcast_bytes() {
        let out = run(3, Duration::from_secs(10), |c| {
            let mine = vec![c.rank() as u8; c.rank() + 1];
            let gathered = c.all_gather(mine).unwrap();
            let b = c.broadcast(vec![9, c.rank() as u8], 2).unwrap();
            (gathered, b)
        });
        for (gathered, b) in out {
            assert_eq!(gathered, vec![vec![0], vec![1, 1], vec![2, 2, 2]]);
            assert_eq!(b, vec![9, 2]);
        }
    }

    #[test]
    fn skipped_collective_times_out_naming_the_rank() {
        let out = run(3, Duration::from_millis(300), |c| {
            if c.rank() == 1 {
                thread::sleep(Duration::from_millis(600));
                return None;
            }
            let start = Instant::now();
            let err = c.barrier().unwrap_err();
            Some((err, start.elapsed()))
        });
        for (err, elapsed) in out.into_iter().flatten() {
            match &err {
                Error::Timeout { missing, .. } => assert_eq!(missing, &vec![1]),
                other => panic!("unexpected {other}"),
            }
            assert!(
                err.to_string().contains("rank(s) [1] did not arrive"),
                "{err}"
            );
            assert!(elapsed < Duration::from_millis(550), "{elapsed:?}");
        }
    }

    #[test]
    fn different_collectives_are_an_error_on_every_rank() {
        let out = run(2, Duration::from_secs(5), |c| {
            if c.rank() == 0 {
                c.barrier().map(|_| ())
            } else {
                c.all_gather(vec![1]).map(|_| ())
            }
        });
        for r in out {
            let err = r.unwrap_err().to_string();
            assert!(err.contains("rank 0: barrier, rank 1: all_gather"), "{err}");
        }
    }

    #[test]
    fn failed_and_departed_ranks_release_the_others() {
        let group = InProcessGroup::new(3, Duration::from_secs(30));
        let waiter = {
            let comm = group.comm(0);
            thread::spawn(move || comm.barrier())
        };
        thread::sleep(Duration::from_millis(50));
        group.leave(2, "finished");
        let err = waiter.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("rank 2 finished without joining it"), "{err}");

        let group = InProcessGroup::new(2, Duration::from_secs(30));
        let waiter = {
            let comm = group.comm(0);
            thread::spawn(move || comm.all_gather(vec![]))
        };
        thread::sleep(Duration::from_millis(50));
        group.fail(1, "panicked: boom");
        let err = waiter.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("rank 1 panicked: boom"), "{err}");
    }
}
