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

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use super::Communicator;
use super::reduce::{self, ReduceBuffer, ReduceOp, check_shapes, reduce_range};
use crate::error::CommError as Error;
use crate::{CallSignature, check_calls};

type Result<T> = crate::CommResult<T>;

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
}

/// A rank's all-reduce buffer, shared with the other ranks for an in-place reduce-scatter and all-gather.
///
/// The element pointer is taken once, from the owning `Vec`, before the buffer is shared; every rank then
/// reads and writes through it only, following a protocol that keeps every element either read by any ranks
/// or written by one, never both, between two rounds (see [`InProcessComm::all_reduce_in_place`]). The `Arc`
/// keeps the memory alive even when a rank fails mid-way, so a slower rank never reads freed memory.
struct InPlaceBuffer {
    owner: std::cell::UnsafeCell<ReduceBuffer>,
    data: RawElements,
    len: usize,
}

/// The first element of a buffer, by kind.
#[derive(Clone, Copy)]
enum RawElements {
    F32(*mut f32),
    F64(*mut f64),
    I64(*mut i64),
}

// SAFETY: the pointers are only dereferenced under the all-reduce protocol described above.
unsafe impl Sync for InPlaceBuffer {}
unsafe impl Send for InPlaceBuffer {}

impl InPlaceBuffer {
    fn new(mut buffer: ReduceBuffer) -> Self {
        let len = buffer.len();
        let data = match &mut buffer {
            ReduceBuffer::F32(v) => RawElements::F32(v.as_mut_ptr()),
            ReduceBuffer::F64(v) => RawElements::F64(v.as_mut_ptr()),
            ReduceBuffer::I64(v) => RawElements::I64(v.as_mut_ptr()),
        };
        Self {
            owner: std::cell::UnsafeCell::new(buffer),
            data,
            len,
        }
    }

    fn kind(&self) -> &'static str {
        match self.data {
            RawElements::F32(_) => "f32",
            RawElements::F64(_) => "f64",
            RawElements::I64(_) => "i64",
        }
    }
}

impl fmt::Debug for InPlaceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InPlaceBuffer({} x {})", self.len, self.kind())
    }
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

/// Elements a slice is reduced in at a time, in a small scratch buffer that stays in cache.
const CHUNK: usize = 4096;

/// Reduces `range` of `inputs` (rank order) into the same range of `out`, chunk by chunk.
///
/// # Safety
/// Every pointer addresses at least `range.end` elements; during the call no other thread writes `range` of
/// any input, and no other thread reads or writes `range` of `out` (which may be one of the inputs).
unsafe fn reduce_raw<T: Copy + Default>(
    inputs: &[*mut T],
    out: *mut T,
    range: std::ops::Range<usize>,
    combine: impl Fn(&mut [T], &[T]),
    finish: impl Fn(&mut [T]),
) {
    let mut scratch = vec![T::default(); CHUNK.min(range.len())];
    let mut start = range.start;
    while start < range.end {
        let k = CHUNK.min(range.end - start);
        let acc = &mut scratch[..k];
        // SAFETY: in bounds, and not written by anyone during the call (the caller's contract).
        acc.copy_from_slice(unsafe { std::slice::from_raw_parts(inputs[0].add(start), k) });
        for input in &inputs[1..] {
            combine(acc, unsafe {
                std::slice::from_raw_parts(input.add(start), k)
            });
        }
        finish(acc);
        // SAFETY: this thread alone accesses `out`'s range now; the reads above have ended.
        unsafe { std::slice::from_raw_parts_mut(out.add(start), k) }.copy_from_slice(acc);
        start += k;
    }
}

/// Reduces `range` of every buffer of `buffers` (rank order) with `op` into the same range of `buffers[out]`,
/// dividing by the number of buffers for a mean.
///
/// # Safety
/// As [`reduce_raw`]: no other thread writes `range` of any buffer, nor reads or writes `range` of
/// `buffers[out]`, during the call; every buffer holds at least `range.end` elements of one kind.
unsafe fn reduce_buffers(
    buffers: &[Arc<InPlaceBuffer>],
    out: usize,
    range: std::ops::Range<usize>,
    op: ReduceOp,
) {
    let n = buffers.len();
    let mean = op == ReduceOp::Mean;
    macro_rules! kernel {
        ($variant:ident, $t:ty, $is_nan:expr, $divide:expr) => {{
            let is_nan: fn($t) -> bool = $is_nan;
            let divide: fn(&mut [$t], usize) = $divide;
            let inputs: Vec<*mut $t> = buffers
                .iter()
                .map(|b| match b.data {
                    RawElements::$variant(p) => p,
                    _ => unreachable!("the kinds were checked"),
                })
                .collect();
            let combine = |acc: &mut [$t], x: &[$t]| match op {
                ReduceOp::Sum | ReduceOp::Mean => acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b),
                ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| {
                    if *b > *a || is_nan(*b) {
                        *a = *b
                    }
                }),
                ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| {
                    if *b < *a || is_nan(*b) {
                        *a = *b
                    }
                }),
            };
            let finish = |acc: &mut [$t]| {
                if mean {
                    divide(acc, n)
                }
            };
            // SAFETY: the caller's contract.
            unsafe { reduce_raw(&inputs, inputs[out], range, combine, finish) };
        }};
    }
    match buffers[out].data {
        RawElements::F32(_) => kernel!(F32, f32, f32::is_nan, |v, n| v
            .iter_mut()
            .for_each(|x| *x /= n as f32)),
        RawElements::F64(_) => kernel!(F64, f64, f64::is_nan, |v, n| v
            .iter_mut()
            .for_each(|x| *x /= n as f64)),
        RawElements::I64(_) => kernel!(I64, i64, |_| false, |v, n| v
            .iter_mut()
            .for_each(|x| *x /= n as i64)),
    }
}

/// Copies `range` of `from` into the same range of `to` (buffers of one kind).
///
/// # Safety
/// Both hold at least `range.end` elements of one kind; during the call no other thread writes `range` of
/// `from`, nor reads or writes `range` of `to`.
unsafe fn copy_range(from: &InPlaceBuffer, to: &InPlaceBuffer, range: std::ops::Range<usize>) {
    let (bytes, width) = match (from.data, to.data) {
        (RawElements::F32(p), RawElements::F32(_)) => (p.cast::<u8>(), 4),
        (RawElements::F64(p), RawElements::F64(_)) => (p.cast::<u8>(), 8),
        (RawElements::I64(p), RawElements::I64(_)) => (p.cast::<u8>(), 8),
        _ => unreachable!("the kinds were checked"),
    };
    let target = match to.data {
        RawElements::F32(p) => p.cast::<u8>(),
        RawElements::F64(p) => p.cast::<u8>(),
        RawElements::I64(p) => p.cast::<u8>(),
    };
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.add(range.start * width),
            target.add(range.start * width),
            range.len() * width,
        )
    };
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
            round.outcome = Some(check_calls(seq, &calls).map(|()| {
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
                    failed_rank: group.members[r],
                    reason: format!("{how} without joining it"),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    operation: op.into(),
                    seq,
                    rank: group.members[self.rank],
                    missing: absent.iter().map(|r| group.members[*r]).collect(),
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
        check_calls(self.last_seq(), &calls)?;
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
        check_calls(self.last_seq(), &calls)?;
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
        check_calls(self.last_seq(), &calls)?;
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
    fn split_makes_sub_groups_by_color_ordered_by_key_that_name_world_ranks() {
        // 6 ranks: colors by rank % 2 (a replicate x shard mesh's columns), keys reversing the order.
        let out = run(6, Duration::from_secs(10), |c| {
            let rank = c.rank();
            let sub = c.split(rank % 2, 10 - rank).unwrap();
            let sum = sub
                .all_reduce(ReduceBuffer::I64(vec![rank as i64]), ReduceOp::Sum)
                .unwrap();
            // The world keeps its own sequence: a world collective after the sub-group's works.
            let world = c
                .all_reduce(ReduceBuffer::I64(vec![1]), ReduceOp::Sum)
                .unwrap();
            (sub.rank(), sub.world_size(), sum, world)
        });
        let expected_rank = [2, 2, 1, 1, 0, 0];
        for (rank, (sub_rank, size, sum, world)) in out.into_iter().enumerate() {
            assert_eq!((sub_rank, size), (expected_rank[rank], 3), "rank {rank}");
            let members_sum = if rank % 2 == 0 { 0 + 2 + 4 } else { 1 + 3 + 5 };
            assert_eq!(sum, ReduceBuffer::I64(vec![members_sum]), "rank {rank}");
            assert_eq!(world, ReduceBuffer::I64(vec![6]));
        }
        // A sub-group's timeout names the world ranks missing; a world rank's failure reaches the sub-groups.
        let out = run(4, Duration::from_millis(300), |c| {
            let rank = c.rank();
            let sub = c.split(rank / 2, rank).unwrap();
            if rank == 3 {
                return "absent".to_string();
            }
            match sub.barrier() {
                Ok(()) => "ok".to_string(),
                Err(e) => e.to_string(),
            }
        });
        assert_eq!(out[0], "ok", "ranks 0 and 1 form their own group");
        assert_eq!(out[1], "ok");
        assert!(
            out[2].contains("on rank 2") && out[2].contains("[3]"),
            "{}",
            out[2]
        );
    }

    #[test]
    fn large_all_reduces_match_the_reference_for_every_op_and_kind() {
        // Values that make the order of a float sum matter, so a rank reducing in another order would show.
        let value = |rank: usize, i: usize| {
            ((rank * 7919 + i * 104_729) % 1000) as f64 * 1.37e-3 + 1e4 * (i % 3) as f64
        };
        for n in [2, 3, 5] {
            let len = SPLIT_REDUCE_MIN * 2 + 7;
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                for kind in ["f32", "f64", "i64"] {
                    let make = move |rank: usize| match kind {
                        "f32" => {
                            ReduceBuffer::F32((0..len).map(|i| value(rank, i) as f32).collect())
                        }
                        "f64" => ReduceBuffer::F64((0..len).map(|i| value(rank, i)).collect()),
                        _ => ReduceBuffer::I64(
                            (0..len).map(|i| value(rank, i) as i64 - 500).collect(),
                        ),
                    };
                    let inputs: Vec<ReduceBuffer> = (0..n).map(make).collect();
                    let refs: Vec<&ReduceBuffer> = inputs.iter().collect();
                    let expected = reduce_range(&refs, 0..len, op);
                    let out = run(n, Duration::from_secs(10), move |c| {
                        c.all_reduce(make(c.rank()), op).unwrap()
                    });
                    for (rank, got) in out.iter().enumerate() {
                        // Bit for bit (NaN-free inputs), on every rank.
                        assert!(*got == expected, "n={n} {op} {kind}: rank {rank} differs");
                    }
                }
            }
        }
    }

    /// Rank `r`'s value at `i`: small integers, so that sums are exact whatever the order.
    fn value(r: usize, i: usize) -> f32 {
        ((i * 7 + r * 13) % 29) as f32 - 14.0
    }

    #[test]
    fn reduce_scatters_give_each_rank_its_part_of_the_all_reduce() {
        for n in [1, 2, 3, 4] {
            for counts in [vec![5; n], (0..n).map(|r| 3 * r + 1).collect(), {
                // One empty part, and one past the in-place all-reduce threshold.
                let mut c = vec![0; n];
                c[n - 1] = SPLIT_REDUCE_MIN + 3;
                c
            }] {
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                    let len: usize = counts.iter().sum();
                    let parts = counts.clone();
                    let out = run(n, Duration::from_secs(10), move |c| {
                        let mine: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                        let whole = c.all_reduce(ReduceBuffer::F32(mine.clone()), op).unwrap();
                        let part = c
                            .reduce_scatter(ReduceBuffer::F32(mine), &parts, op)
                            .unwrap();
                        let ints: Vec<i64> = (0..len).map(|i| value(c.rank(), i) as i64).collect();
                        let int_part = c
                            .reduce_scatter(ReduceBuffer::I64(ints), &parts, op)
                            .unwrap();
                        (whole, part, int_part)
                    });
                    let mut start = 0;
                    for (r, (whole, part, int_part)) in out.into_iter().enumerate() {
                        let range = start..start + counts[r];
                        start = range.end;
                        assert_eq!(
                            part,
                            whole.slice(range.clone()),
                            "n={n} {counts:?} {op} rank {r}"
                        );
                        let expected: Vec<i64> = match whole.slice(range) {
                            ReduceBuffer::F32(v) => v.iter().map(|x| *x as i64).collect(),
                            _ => unreachable!(),
                        };
                        if op != ReduceOp::Mean {
                            assert_eq!(
                                int_part,
                                ReduceBuffer::I64(expected),
                                "n={n} {op} rank {r}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn reduce_scatters_with_other_parts_or_a_wrong_split_fail_on_every_rank() {
        let out = run(3, Duration::from_secs(10), |c| {
            let counts = if c.rank() == 2 { [2, 2, 2] } else { [1, 2, 3] };
            c.reduce_scatter(ReduceBuffer::F32(vec![1.0; 6]), &counts, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        for message in &out {
            assert!(message.contains("incompatible inputs"), "{message}");
            assert!(
                message.contains("rank 2: reduce_scatter (sum) of 6 x f32 into [2, 2, 2]"),
                "{message}"
            );
        }
        let out = run(2, Duration::from_secs(10), |c| {
            c.reduce_scatter(ReduceBuffer::F32(vec![1.0; 6]), &[1, 2], ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        for message in &out {
            assert!(
                message.contains("2 part counts summing to 3 for 2 ranks and a buffer of 6"),
                "{message}"
            );
        }
        // Another collective on one rank is named as such.
        let out = run(2, Duration::from_secs(10), |c| {
            if c.rank() == 0 {
                c.barrier().map(|_| ()).unwrap_err().to_string()
            } else {
                c.reduce_scatter(ReduceBuffer::F32(vec![1.0; 2]), &[1, 1], ReduceOp::Sum)
                    .map(|_| ())
                    .unwrap_err()
                    .to_string()
            }
        });
        for message in &out {
            assert!(
                message.contains("ranks called different collectives"),
                "{message}"
            );
        }
    }

    #[test]
    fn all_gathers_of_parts_concatenate_every_ranks_part_in_rank_order() {
        for n in [1, 2, 3, 4] {
            for counts in [vec![4; n], (0..n).map(|r| 2 * r + 1).collect(), {
                let mut c = vec![0; n];
                c[n - 1] = 7;
                c
            }] {
                let parts = counts.clone();
                let out = run(n, Duration::from_secs(10), move |c| {
                    let mine: Vec<f32> = (0..parts[c.rank()]).map(|i| value(c.rank(), i)).collect();
                    let ints: Vec<i64> = mine.iter().map(|x| *x as i64).collect();
                    let f = c.all_gather_parts(ReduceBuffer::F32(mine), &parts).unwrap();
                    let i = c.all_gather_parts(ReduceBuffer::I64(ints), &parts).unwrap();
                    (f, i)
                });
                let expected: Vec<f32> = counts
                    .iter()
                    .enumerate()
                    .flat_map(|(r, c)| (0..*c).map(move |i| value(r, i)))
                    .collect();
                for (r, (f, i)) in out.into_iter().enumerate() {
                    assert_eq!(
                        f,
                        ReduceBuffer::F32(expected.clone()),
                        "n={n} {counts:?} rank {r}"
                    );
                    let ints = expected.iter().map(|x| *x as i64).collect();
                    assert_eq!(i, ReduceBuffer::I64(ints), "n={n} {counts:?} rank {r}");
                }
            }
        }
    }

    #[test]
    fn rooted_reduces_and_typed_broadcasts_match_the_all_reduce_and_the_root() {
        for n in [1, 2, 3, 4] {
            for len in [0, 5, SPLIT_REDUCE_MIN + 3] {
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                    let root = n - 1;
                    let out = run(n, Duration::from_secs(10), move |c| {
                        let mine: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                        let whole = c.all_reduce(ReduceBuffer::F32(mine.clone()), op).unwrap();
                        let reduced = c.reduce(ReduceBuffer::F32(mine.clone()), root, op).unwrap();
                        let sent = c.broadcast_buffer(ReduceBuffer::F32(mine), root).unwrap();
                        let ints: Vec<i64> = (0..len).map(|i| value(c.rank(), i) as i64).collect();
                        let int_sent = c.broadcast_buffer(ReduceBuffer::I64(ints), 0).unwrap();
                        (whole, reduced, sent, int_sent)
                    });
                    let root_values = ReduceBuffer::F32((0..len).map(|i| value(root, i)).collect());
                    let first_ints =
                        ReduceBuffer::I64((0..len).map(|i| value(0, i) as i64).collect());
                    for (r, (whole, reduced, sent, int_sent)) in out.into_iter().enumerate() {
                        let expected = (r == root).then(|| whole.clone());
                        assert_eq!(
                            reduced, expected,
                            "n={n} len={len} {op} rank {r}: the same bits"
                        );
                        assert_eq!(sent, root_values, "n={n} len={len} rank {r}");
                        assert_eq!(int_sent, first_ints, "n={n} len={len} rank {r}");
                    }
                }
            }
        }
        // Ranks that disagree on the root or the length all get an error naming each rank's call.
        let out = run(2, Duration::from_secs(10), |c| {
            let root = c.rank();
            c.reduce(ReduceBuffer::F32(vec![1.0; 4]), root, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        for message in &out {
            assert!(
                message.contains("rank 1: reduce of 4 x f32 from rank 1"),
                "{message}"
            );
        }
        let out = run(2, Duration::from_secs(10), |c| {
            let len = 3 + c.rank();
            c.broadcast_buffer(ReduceBuffer::F32(vec![1.0; len]), 0)
                .unwrap_err()
                .to_string()
        });
        for message in &out {
            assert!(
                message.contains("rank 1: broadcast_buffer of 4 x f32"),
                "{message}"
            );
        }
    }

    #[test]
    fn all_gathers_of_parts_that_disagree_fail_on_every_rank() {
        let out = run(3, Duration::from_secs(10), |c| {
            let counts = if c.rank() == 2 { [2, 2, 2] } else { [1, 2, 2] };
            c.all_gather_parts(ReduceBuffer::F32(vec![1.0; counts[c.rank()]]), &counts)
                .unwrap_err()
                .to_string()
        });
        for message in &out {
            assert!(message.contains("incompatible inputs"), "{message}");
            assert!(
                message.contains("rank 2: all_gather_parts of f32 parts [2, 2, 2]"),
                "{message}"
            );
        }
        let out = run(2, Duration::from_secs(10), |c| {
            let len = if c.rank() == 1 { 3 } else { 1 };
            c.all_gather_parts(ReduceBuffer::F32(vec![1.0; len]), &[1, 2])
                .unwrap_err()
                .to_string()
        });
        for message in &out {
            assert!(message.contains("rank 1 passed 3 elements"), "{message}");
        }
    }

    #[test]
    fn all_reduces_of_different_lengths_fail_on_every_rank() {
        // Both lengths large, and one on each side of the in-place threshold.
        for base in [SPLIT_REDUCE_MIN, SPLIT_REDUCE_MIN - 1] {
            let out = run(3, Duration::from_secs(10), move |c| {
                let len = base + if c.rank() == 1 { 1 } else { 0 };
                c.all_reduce(ReduceBuffer::F32(vec![1.0; len]), ReduceOp::Sum)
                    .unwrap_err()
                    .to_string()
            });
            for message in out {
                assert!(
                    message.contains(&format!("rank 1: {} x f32", base + 1)),
                    "{message}"
                );
            }
        }
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
        let timeout = Duration::from_millis(300);
        // The skipper stays away long enough that the others can only have been released by their timeout,
        // with room for a loaded machine.
        let away = Duration::from_secs(3);
        let out = run(3, timeout, move |c| {
            if c.rank() == 1 {
                thread::sleep(away);
                return None;
            }
            let start = Instant::now();
            let err = c.barrier().unwrap_err();
            Some((err, start.elapsed()))
        });
        let waited: Vec<_> = out.into_iter().flatten().collect();
        assert_eq!(waited.len(), 2, "ranks 0 and 2 both report");
        for (err, elapsed) in waited {
            match &err {
                Error::Timeout { missing, .. } => assert_eq!(missing, &vec![1]),
                other => panic!("unexpected {other}"),
            }
            assert!(
                err.to_string().contains("rank(s) [1] did not arrive"),
                "{err}"
            );
            assert!(elapsed >= timeout && elapsed < away, "{elapsed:?}");
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
