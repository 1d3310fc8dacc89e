//! The in-process engine: one rank per thread, exchanging buffers through shared memory.
//!
//! Every collective is one or two *rounds*: each rank deposits its contribution for the round's sequence number
//! and waits until all ranks have; the completed round is shared read-only (`Arc`) with everyone. Rounds are keyed
//! by sequence number, so a fast rank may already deposit into the next round while slow ones still read the
//! last. Waiting ranks wake up on completion, on the failure or exit of another rank, or at the timeout.
//!
//! A rank that arrives before the others first spins for a few microseconds on the group's count of completed
//! rounds (yielding its core between checks) and only then sleeps: waking a sleeping thread costs tens of
//! microseconds on a busy machine, more than a small all-reduce itself.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use super::reduce::{self, ReduceBuffer, ReduceOp, check_shapes, reduce_range};
use super::{Communicator, SharedValue};
use crate::error::CommError as Error;
use crate::{CallSignature, check_calls_of};

type Result<T> = crate::CommResult<T>;

mod kernels;
mod p2p;

use kernels::{InPlaceBuffer, copy_range, reduce_buffers};

/// The engine name of in-process ranks ([`Communicator::engine`](crate::Communicator::engine)).
pub const IN_PROCESS_ENGINE: &str = "in-process";
const ENGINE: &str = IN_PROCESS_ENGINE;

/// Buffers at least this long are reduced in two rounds (each rank reduces one slice, then slices are shared), so
/// the work is spread over the ranks' threads; shorter ones are reduced whole by every rank in one round.
const SPLIT_REDUCE_MIN: usize = 1 << 15;

/// How long a rank that arrived early spins, waiting for the round to complete, before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// What a rank contributes to a round.
#[derive(Debug)]
enum Payload {
    Unit,
    Bytes(Vec<u8>),
    Reduce(ReduceBuffer),
    InPlace(Arc<InPlaceBuffer>),
    /// A reduce-scatter's buffer and the call as every rank must make it alike.
    Scatter(ReduceBuffer, CallSignature),
    /// An all-gather's part and the call as every rank must make it alike.
    Parts(ReduceBuffer, CallSignature),
    /// A rank's buffer of a rooted in-place collective (reduce, typed broadcast) and the call as every rank must
    /// make it alike.
    Rooted(Arc<InPlaceBuffer>, CallSignature),
    /// A value handed over as it is ([`Communicator::share`]).
    Shared(SharedValue),
}

/// Each rank's element kind and length in an all-reduce round, whichever path (whole or in place) its length
/// sent it down, so that ranks disagreeing on the length get the same error on every rank.
fn reduce_shapes(all: &Shared) -> Vec<(&'static str, usize)> {
    all.iter()
        .map(|slot| match read(slot).as_ref() {
            Some(Payload::Reduce(b)) => (b.kind(), b.len()),
            Some(Payload::InPlace(b)) => (b.kind(), b.len),
            _ => unreachable!("the round checked that every rank called all_reduce"),
        })
        .collect()
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
    outcome: Option<std::result::Result<Shared, Error>>,
    taken: usize,
}

#[derive(Debug, Default)]
struct GroupState {
    rounds: HashMap<u64, Round>,
    /// The first rank that failed and why; every later wait errors with it.
    failed: Option<(usize, String)>,
    /// Ranks whose work has ended (`None` while running).
    left: Vec<Option<String>>,
    /// Point-to-point messages sent and not yet received, by `(from, to)`, oldest first.
    mail: HashMap<(usize, usize), VecDeque<p2p::Mail>>,
}

/// A group of in-process ranks. Create it once, then give [`InProcessGroup::comm`] of rank `i` to thread `i`.
#[derive(Debug)]
pub struct InProcessGroup {
    size: usize,
    /// The world rank of each of this group's ranks (`0..size` for a world; a sub-group's members), which
    /// errors name.
    members: Vec<usize>,
    timeout: Duration,
    /// Sub-groups made by `split`, by the splitting collective's sequence number and color, with the world
    /// ranks of their members: a failure or departure here reaches them too.
    children: Mutex<HashMap<(u64, usize), Arc<InProcessGroup>>>,
    state: Mutex<GroupState>,
    wake: Condvar,
    /// How many rounds have an outcome (rounds complete in sequence order): read without the lock by ranks
    /// spinning before they sleep.
    completed: AtomicU64,
}

impl InProcessGroup {
    /// A group of `size` ranks whose collectives give up after `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Self::with_members((0..size.max(1)).collect(), timeout)
    }

    /// A group of the world ranks `members` (in this group's rank order).
    fn with_members(members: Vec<usize>, timeout: Duration) -> Arc<Self> {
        let size = members.len().max(1);
        Arc::new(Self {
            size,
            members,
            children: Mutex::new(HashMap::new()),
            timeout,
            state: Mutex::new(GroupState {
                left: vec![None; size.max(1)],
                ..Default::default()
            }),
            wake: Condvar::new(),
            completed: AtomicU64::new(0),
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

    /// Sleeps on the group's condition until a rank wakes it or `deadline`; `None` once the deadline has passed
    /// (the caller then reports its own timeout).
    fn sleep_until<'a>(
        &self,
        state: MutexGuard<'a, GroupState>,
        deadline: Instant,
    ) -> Option<MutexGuard<'a, GroupState>> {
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        Some(
            self.wake
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0,
        )
    }

    /// Records that `rank` failed (`reason`, e.g. "panicked: ..."): every rank waiting now or later gets an error,
    /// in this group and in every sub-group split from it.
    pub fn fail(&self, rank: usize, reason: impl Into<String>) {
        self.fail_world_rank(
            self.members.get(rank).copied().unwrap_or(rank),
            reason.into(),
        );
    }

    fn fail_world_rank(&self, world_rank: usize, reason: String) {
        let mut state = self.lock();
        if state.failed.is_none() {
            state.failed = Some((world_rank, reason.clone()));
        }
        drop(state);
        self.wake.notify_all();
        for child in self.children().values() {
            child.fail_world_rank(world_rank, reason.clone());
        }
    }

    /// Records that `rank` finished its work; ranks waiting for it in a collective then fail fast (in the
    /// sub-groups split from this one too).
    pub fn leave(&self, rank: usize, how: impl Into<String>) {
        let world_rank = self.members.get(rank).copied().unwrap_or(rank);
        self.leave_world_rank(world_rank, how.into());
    }

    fn leave_world_rank(&self, world_rank: usize, how: String) {
        if let Some(rank) = self.members.iter().position(|m| *m == world_rank) {
            self.lock().left[rank] = Some(how.clone());
            self.wake.notify_all();
        }
        for child in self.children().values() {
            child.leave_world_rank(world_rank, how.clone());
        }
    }

    fn children(&self) -> MutexGuard<'_, HashMap<(u64, usize), Arc<InProcessGroup>>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl GroupState {
    /// The error of a wait for the ranks `waited` (of this group) in call `(op, seq)` that cannot complete any
    /// more: a rank of the group failed, or one of `waited` left (its reason followed by `left_without`).
    fn stopped(
        &self,
        (op, seq): (&str, u64),
        waited: &[usize],
        members: &[usize],
        left_without: impl FnOnce() -> String,
    ) -> Option<Error> {
        if let Some(failed) = &self.failed {
            return Some(rank_failed(op, seq, failed));
        }
        let (rank, how) = waited
            .iter()
            .find_map(|r| self.left[*r].as_ref().map(|how| (*r, how)))?;
        Some(Error::RankFailed {
            operation: op.into(),
            seq,
            failed_rank: members[rank],
            reason: format!("{how} {}", left_without()),
        })
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

    /// The sequence number of this rank's latest collective.
    fn last_seq(&self) -> u64 {
        self.seq.load(Ordering::Relaxed).saturating_sub(1)
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
            let calls: Vec<_> = round
                .ops
                .iter()
                .map(|o| Some(CallSignature::named(o.unwrap_or("?"))))
                .collect();
            round.outcome = Some(check_calls_of(seq, &calls, &group.members).map(|()| {
                Arc::new(
                    round
                        .payloads
                        .iter_mut()
                        .map(|p| RwLock::new(Some(p.take().unwrap_or(Payload::Unit))))
                        .collect(),
                )
            }));
            group.completed.fetch_max(seq + 1, Ordering::Release);
            group.wake.notify_all();
        } else {
            // Spin briefly, without the lock, for the last rank to arrive: cheaper than a sleep and a wake-up
            // when the ranks are close. Failures and timeouts are checked below, after the spin.
            drop(state);
            let start = Instant::now();
            'spin: while start.elapsed() < SPIN {
                for _ in 0..64 {
                    if group.completed.load(Ordering::Acquire) > seq {
                        break 'spin;
                    }
                    std::hint::spin_loop();
                }
                // Leave the core to a rank that shares it (more ranks than cores).
                std::thread::yield_now();
            }
            state = group.lock();
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
                return outcome;
            }
            let absent: Vec<usize> = round
                .payloads
                .iter()
                .zip(&round.ops)
                .enumerate()
                .filter(|(_, (_, op))| op.is_none())
                .map(|(r, _)| r)
                .collect();
            if let Some(stopped) = state.stopped((op, seq), &absent, &group.members, || {
                "without joining it".into()
            }) {
                return Err(stopped);
            }
            state = match group.sleep_until(state, deadline) {
                Some(state) => state,
                None => {
                    return Err(Error::Timeout {
                        operation: op.into(),
                        seq,
                        rank: group.members[self.rank],
                        missing: absent.iter().map(|r| group.members[*r]).collect(),
                        timeout: group.timeout,
                    });
                }
            };
        }
    }
}

impl InProcessComm {
    /// All-reduce of a large buffer without copies beyond the minimum: every rank shares its own buffer; rank
    /// `r` reduces slice `r` of all buffers into slice `r` of its own (reduce-scatter), then copies every other
    /// slice `q` from rank `q`'s buffer into its own (all-gather). Three rounds separate the phases:
    ///
    /// 1. *share*: every buffer is visible to every rank (kinds and lengths are checked here, identically on
    ///    every rank);
    /// 2. *reduced*: after the reduce-scatter, in which rank `r` reads slice `r` of every buffer and writes
    ///    slice `r` of its own — no other rank touches that slice of that buffer;
    /// 3. *gathered*: after the all-gather, in which rank `r` reads slice `q` of rank `q`'s buffer and writes
    ///    slice `q` of its own — rank `q` only writes other slices of its own buffer, and reads slice `r` of
    ///    rank `r`'s.
    ///
    /// After the third round no rank reads this rank's buffer any more, and it is returned. Nothing is
    /// allocated, and each slice is reduced once, in rank order, so every rank gets bit-identical results.
    fn all_reduce_in_place(&self, data: ReduceBuffer, op: ReduceOp) -> Result<ReduceBuffer> {
        let n = self.group.size;
        let own = Arc::new(InPlaceBuffer::new(data));
        let all = self.exchange("all_reduce", Payload::InPlace(own.clone()))?;
        check_shapes(self.last_seq(), &reduce_shapes(&all))?;
        let buffers: Vec<Arc<InPlaceBuffer>> = all
            .iter()
            .map(|slot| match read(slot).as_ref() {
                Some(Payload::InPlace(b)) => b.clone(),
                _ => unreachable!("equal lengths take the same path on every rank"),
            })
            .collect();
        drop(all);
        let len = own.len;
        let slice = |r: usize| (r * len / n)..((r + 1) * len / n);
        // Reduce-scatter. SAFETY: in this phase rank r reads slice r of every buffer and writes slice r of its
        // own; no other rank accesses slice r of any buffer.
        unsafe { reduce_buffers(&buffers, self.rank, slice(self.rank), op) };
        self.exchange("all_reduce", Payload::Unit)?;
        // All-gather. SAFETY: rank r reads slice q of rank q's buffer (reduced, now only read) and writes slice
        // q of its own, which no other rank reads in this phase.
        for (q, input) in buffers.iter().enumerate() {
            if q != self.rank {
                unsafe { copy_range(input, &own, slice(q)) };
            }
        }
        self.exchange("all_reduce", Payload::Unit)?;
        drop(buffers);
        // SAFETY: after the third round no other rank reads this buffer.
        Ok(unsafe { std::mem::replace(&mut *own.owner.get(), ReduceBuffer::F32(Vec::new())) })
    }
}

impl InProcessComm {
    /// Shares `own` with every rank for a rooted in-place collective and returns every rank's buffer, once
    /// every rank passed the same kind, length and root.
    fn share_rooted(
        &self,
        op: &'static str,
        own: &Arc<InPlaceBuffer>,
        root: usize,
    ) -> Result<Vec<Arc<InPlaceBuffer>>> {
        crate::check_root(op, root, self.group.size)?;
        let signature = CallSignature {
            collective: op.into(),
            must_agree: format!("{} x {} from {root}", own.len, own.kind()),
            described: format!("{op} of {} x {} from rank {root}", own.len, own.kind()),
        };
        let all = self.exchange(op, Payload::Rooted(own.clone(), signature))?;
        let (calls, buffers): (Vec<_>, Vec<_>) = all
            .iter()
            .map(|slot| match read(slot).as_ref() {
                Some(Payload::Rooted(b, s)) => (Some(s.clone()), b.clone()),
                _ => unreachable!("the round checked the operation"),
            })
            .unzip();
        check_calls_of(self.last_seq(), &calls, &self.group.members)?;
        Ok(buffers)
    }

    /// Takes this rank's buffer back once no other rank reads it any more.
    ///
    /// # Safety
    /// Every other rank has finished reading and writing `own` (a round has completed since).
    unsafe fn take_back(own: &InPlaceBuffer) -> ReduceBuffer {
        // SAFETY: the caller's contract.
        unsafe { std::mem::replace(&mut *own.owner.get(), ReduceBuffer::F32(Vec::new())) }
    }
}

impl Communicator for InProcessComm {
    fn engine(&self) -> &'static str {
        ENGINE
    }

    /// Every group keeps its own rounds under its own lock.
    fn concurrent(&self) -> bool {
        true
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
        if data.len() >= SPLIT_REDUCE_MIN && self.group.size > 1 {
            return self.all_reduce_in_place(data, op);
        }
        let all = self.exchange("all_reduce", Payload::Reduce(data))?;
        check_shapes(self.last_seq(), &reduce_shapes(&all))?;
        let guards: Vec<_> = all.iter().map(|slot| read(slot)).collect();
        let inputs: Vec<&ReduceBuffer> = guards
            .iter()
            .map(|g| match g.as_ref() {
                Some(Payload::Reduce(b)) => b,
                _ => unreachable!("equal lengths take the same path on every rank"),
            })
            .collect();
        Ok(reduce_range(&inputs, 0..inputs[0].len(), op))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let mine = [color as u64, key as u64]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let all = self.exchange("split", Payload::Bytes(mine))?;
        let pairs: Vec<(usize, usize)> = all
            .iter()
            .map(|slot| match read(slot).as_ref() {
                Some(Payload::Bytes(b)) if b.len() == 16 => {
                    let word = |i: usize| {
                        u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]))
                            as usize
                    };
                    (word(0), word(1))
                }
                _ => unreachable!("the round checked the operation"),
            })
            .collect();
        drop(all);
        let members = crate::split_members(&pairs, self.rank);
        let sub_rank = members.iter().position(|r| *r == self.rank).unwrap_or(0);
        let group = &self.group;
        let child = group
            .children()
            .entry((self.last_seq(), color))
            .or_insert_with(|| {
                let world: Vec<usize> = members.iter().map(|r| group.members[*r]).collect();
                InProcessGroup::with_members(world, group.timeout)
            })
            .clone();
        Ok(Arc::new(child.comm(sub_rank)))
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

    fn reduce_scatter(
        &self,
        data: ReduceBuffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<ReduceBuffer> {
        let signature = reduce::reduce_scatter_signature(data.kind(), data.len(), counts, op);
        let part = reduce::part_of(counts, self.rank, self.group.size, data.len());
        let all = self.exchange("reduce_scatter", Payload::Scatter(data, signature.clone()))?;
        let guards: Vec<_> = all.iter().map(|slot| read(slot)).collect();
        let calls: Vec<_> = guards
            .iter()
            .map(|g| match g.as_ref() {
                Some(Payload::Scatter(_, s)) => Some(s.clone()),
                _ => unreachable!("the round checked the operation"),
            })
            .collect();
        check_calls_of(self.last_seq(), &calls, &self.group.members)?;
        // Every rank passed the same counts and length, so every rank's split is valid or none is.
        let part = part?;
        let inputs: Vec<&ReduceBuffer> = guards
            .iter()
            .map(|g| match g.as_ref() {
                Some(Payload::Scatter(b, _)) => b,
                _ => unreachable!("the round checked the operation"),
            })
            .collect();
        // Each rank reduces its own part alone, in rank order: the same bits as that part of an all-reduce.
        Ok(reduce_range(&inputs, part, op))
    }

    fn all_gather_parts(&self, data: ReduceBuffer, counts: &[usize]) -> Result<ReduceBuffer> {
        let signature = reduce::all_gather_signature(data.kind(), counts);
        let total = reduce::gathered_len(counts, self.rank, self.group.size, data.len());
        let all = self.exchange("all_gather_parts", Payload::Parts(data, signature))?;
        let guards: Vec<_> = all.iter().map(|slot| read(slot)).collect();
        let (calls, parts): (Vec<_>, Vec<_>) = guards
            .iter()
            .map(|g| match g.as_ref() {
                Some(Payload::Parts(b, s)) => (Some(s.clone()), b),
                _ => unreachable!("the round checked the operation"),
            })
            .unzip();
        check_calls_of(self.last_seq(), &calls, &self.group.members)?;
        // Every rank passed the same counts, so every rank's own length is right or some rank's error names it;
        // the signatures agree, so the kinds do too.
        total?;
        if let Some((r, part)) = parts
            .iter()
            .enumerate()
            .find(|(r, p)| p.len() != counts[*r])
        {
            return Err(Error::IncompatibleInputs {
                operation: "all_gather_parts".into(),
                reason: format!(
                    "rank {r} passed {} elements where the counts {counts:?} say {}",
                    part.len(),
                    counts[r]
                ),
            });
        }
        Ok(reduce::concat_parts(&parts).expect("the signatures agree on the kind"))
    }

    fn reduce(
        &self,
        data: ReduceBuffer,
        root: usize,
        op: ReduceOp,
    ) -> Result<Option<ReduceBuffer>> {
        let n = self.group.size;
        let own = Arc::new(InPlaceBuffer::new(data));
        let buffers = self.share_rooted("reduce", &own, root)?;
        let len = own.len;
        let slice = |r: usize| (r * len / n)..((r + 1) * len / n);
        // Every rank reduces its slice of every buffer, in rank order, into the root's. SAFETY: rank r reads
        // slice r of every buffer and writes slice r of the root's; no other rank accesses slice r of any buffer
        // until the next round.
        unsafe { reduce_buffers(&buffers, root, slice(self.rank), op) };
        self.exchange("reduce", Payload::Unit)?;
        drop(buffers);
        // SAFETY: after the second round no other rank reads or writes this buffer.
        let own = unsafe { Self::take_back(&own) };
        Ok((self.rank == root).then_some(own))
    }

    fn broadcast_buffer(&self, data: ReduceBuffer, root: usize) -> Result<ReduceBuffer> {
        let own = Arc::new(InPlaceBuffer::new(data));
        let buffers = self.share_rooted("broadcast_buffer", &own, root)?;
        if self.rank != root {
            // SAFETY: the root's buffer is only read in this round, this rank's only written by this rank; both
            // hold `len` elements of the same kind (checked above).
            unsafe { copy_range(&buffers[root], &own, 0..own.len) };
        }
        self.exchange("broadcast_buffer", Payload::Unit)?;
        drop(buffers);
        // SAFETY: after the second round no other rank reads this buffer.
        Ok(unsafe { Self::take_back(&own) })
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

    /// Each send is moved into its peer's mailbox (no copy, never blocking); each receive takes the oldest message
    /// from its peer, waiting for it until the timeout.
    fn send_recv(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> Result<Vec<ReduceBuffer>> {
        self.send_recv_mailboxes(sends, recvs)
    }

    fn shares_memory(&self) -> bool {
        true
    }

    /// One round: every rank's value, shared by every rank.
    fn share(&self, operation: &'static str, value: SharedValue) -> Result<Vec<SharedValue>> {
        let all = self.exchange(operation, Payload::Shared(value))?;
        Ok(all
            .iter()
            .map(|slot| match read(slot).as_ref() {
                Some(Payload::Shared(v)) => v.clone(),
                _ => unreachable!("the round checked that every rank called {operation}"),
            })
            .collect())
    }

    /// As [`send_recv`](Communicator::send_recv), through the same mailboxes.
    fn send_recv_shared(
        &self,
        sends: Vec<(usize, SharedValue)>,
        recvs: Vec<usize>,
    ) -> Result<Vec<SharedValue>> {
        self.send_recv_shared_mailboxes(sends, recvs)
    }
}

#[cfg(test)]
mod tests;
