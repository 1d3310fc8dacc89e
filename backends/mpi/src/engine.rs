use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_accelerate_comm::{
    CallSignature, CommError, CommResult, Communicator, ReduceBuffer, ReduceOp, check_calls,
};
use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};

const ENGINE: &str = "mpi";
/// All-reduces of at least this many bytes use MPI's blocking call, once every rank's call header has shown that
/// all of them are in this same all-reduce.
const BLOCKING_MIN_BYTES: usize = 256 << 10;
/// Tag of the messages ranks exchange after a timeout to find out who is missing.
const DIAGNOSE_TAG: i32 = 0x0bac;

/// One rank's MPI communicator (`MPI_COMM_WORLD`).
pub struct MpiComm {
    universe: Option<Universe>,
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    seq: AtomicU64,
    broken: AtomicBool,
    /// MPI calls are serialised: the library is initialised with `Threading::Serialized`. Sub-groups share
    /// their world's lock, so that no two threads of the process are inside MPI at once.
    calls: Arc<Mutex<Spare>>,
}

/// A receive buffer kept between all-reduces, so that a steady stream of equal-size reductions allocates
/// nothing (the previous call's send buffer becomes the next call's receive buffer).
#[derive(Default)]
struct Spare {
    f32: Vec<f32>,
    f64: Vec<f64>,
    i64: Vec<i64>,
}

// SAFETY: MPI is initialised with `Threading::Serialized` (or more) and every MPI call of this communicator
// happens while holding `calls`, so at most one thread is inside MPI through it at a time.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn engine_error(operation: &str, reason: impl Into<String>) -> CommError {
    CommError::Engine {
        engine: ENGINE,
        operation: operation.into(),
        reason: reason.into(),
    }
}

/// What a rank is about to do. Every collective starts with a fixed-size, timed all-gather of these headers, so
/// headers always match each other in MPI's eyes whatever the ranks do next: ranks that called different
/// collectives, or an all-reduce of different lengths, all get the same error at once instead of a hang, mixed data
/// or a blocking call that waits for a rank doing something else. The headers also carry the all-gather lengths
/// and the broadcast length, so those collectives need no exchange of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Barrier,
    AllReduce {
        kind: u64,
        op: u64,
        len: u64,
    },
    AllGather {
        len: u64,
    },
    Broadcast {
        root: u64,
        len: u64,
    },
    /// `kind_op` is `kind * 4 + op`; `parts` a fingerprint of the per-rank counts, which must agree.
    ReduceScatter {
        kind_op: u64,
        len: u64,
        parts: u64,
    },
    /// `len` is this rank's part; `parts` a fingerprint of the per-rank counts, which must agree.
    AllGatherParts {
        kind: u64,
        len: u64,
        parts: u64,
    },
    /// `kind_op` is `kind * 4 + op`, as for the reduce-scatter.
    Reduce {
        kind_op: u64,
        len: u64,
        root: u64,
    },
    BroadcastBuffer {
        kind: u64,
        len: u64,
        root: u64,
    },
}

const CALL_WORDS: usize = 4;
const KINDS: [&str; 3] = ["f32", "f64", "i64"];
const OPS: [&str; 3] = ["sum", "max", "min"];

impl Call {
    fn encode(self) -> [u64; CALL_WORDS] {
        match self {
            Call::Barrier => [1, 0, 0, 0],
            Call::AllReduce { kind, op, len } => [2, kind, op, len],
            Call::AllGather { len } => [3, 0, 0, len],
            Call::Broadcast { root, len } => [4, root, 0, len],
            Call::ReduceScatter {
                kind_op,
                len,
                parts,
            } => [5, kind_op, len, parts],
            Call::AllGatherParts { kind, len, parts } => [6, kind, len, parts],
            Call::Reduce { kind_op, len, root } => [7, kind_op, len, root],
            Call::BroadcastBuffer { kind, len, root } => [8, kind, len, root],
        }
    }

    fn decode(words: &[u64]) -> Option<Self> {
        match *words {
            [1, _, _, _] => Some(Call::Barrier),
            [2, kind, op, len] if (kind as usize) < KINDS.len() && (op as usize) < OPS.len() => {
                Some(Call::AllReduce { kind, op, len })
            }
            [3, _, _, len] => Some(Call::AllGather { len }),
            [4, root, _, len] => Some(Call::Broadcast { root, len }),
            [5, kind_op, len, parts]
                if ((kind_op / 4) as usize) < KINDS.len()
                    && ((kind_op % 4) as usize) < OPS.len() =>
            {
                Some(Call::ReduceScatter {
                    kind_op,
                    len,
                    parts,
                })
            }
            [6, kind, len, parts] if (kind as usize) < KINDS.len() => {
                Some(Call::AllGatherParts { kind, len, parts })
            }
            [7, kind_op, len, root]
                if ((kind_op / 4) as usize) < KINDS.len()
                    && ((kind_op % 4) as usize) < OPS.len() =>
            {
                Some(Call::Reduce { kind_op, len, root })
            }
            [8, kind, len, root] if (kind as usize) < KINDS.len() => {
                Some(Call::BroadcastBuffer { kind, len, root })
            }
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Call::Barrier => "barrier",
            Call::AllReduce { .. } => "all_reduce",
            Call::AllGather { .. } => "all_gather",
            Call::Broadcast { .. } => "broadcast",
            Call::ReduceScatter { .. } => "reduce_scatter",
            Call::AllGatherParts { .. } => "all_gather_parts",
            Call::Reduce { .. } => "reduce",
            Call::BroadcastBuffer { .. } => "broadcast_buffer",
        }
    }

    fn describe(self) -> String {
        match self {
            Call::Barrier => "barrier".into(),
            Call::AllReduce { kind, op, len } => format!(
                "all_reduce ({}) of {len} x {}",
                OPS[op as usize], KINDS[kind as usize]
            ),
            Call::AllGather { len } => format!("all_gather of {len} bytes"),
            Call::Broadcast { root, .. } => format!("broadcast from rank {root}"),
            Call::ReduceScatter {
                kind_op,
                len,
                parts,
            } => format!(
                "reduce_scatter ({}) of {len} x {} into parts {parts:#x}",
                OPS[(kind_op % 4) as usize],
                KINDS[(kind_op / 4) as usize]
            ),
            Call::AllGatherParts { kind, len, parts } => format!(
                "all_gather_parts of {len} x {} into parts {parts:#x}",
                KINDS[kind as usize]
            ),
            Call::Reduce { kind_op, len, root } => format!(
                "reduce ({}) of {len} x {} to rank {root}",
                OPS[(kind_op % 4) as usize],
                KINDS[(kind_op / 4) as usize]
            ),
            Call::BroadcastBuffer { kind, len, root } => format!(
                "broadcast_buffer of {len} x {} from rank {root}",
                KINDS[kind as usize]
            ),
        }
    }

    /// The call as the one mismatch check compares it: the same collective, and for an all-reduce the same
    /// element kind, operation and length, for a broadcast the same root (only the root's length counts).
    fn signature(self) -> CallSignature {
        let must_agree = match self {
            Call::Barrier | Call::AllGather { .. } => String::new(),
            Call::AllReduce { kind, op, len } => format!("{kind} {op} {len}"),
            Call::Broadcast { root, .. } => root.to_string(),
            Call::ReduceScatter {
                kind_op,
                len,
                parts,
            } => format!("{kind_op} {len} {parts}"),
            // Each rank's own length is checked against the counts once the headers are in.
            Call::AllGatherParts { kind, parts, .. } => format!("{kind} {parts}"),
            Call::Reduce { kind_op, len, root } => format!("{kind_op} {len} {root}"),
            Call::BroadcastBuffer { kind, len, root } => format!("{kind} {len} {root}"),
        };
        CallSignature {
            collective: self.name().into(),
            must_agree,
            described: self.describe(),
        }
    }
}

impl MpiComm {
    /// Initialises MPI and returns this process's communicator, whose collectives give up after `timeout`.
    ///
    /// # Errors
    /// When MPI was already initialised in this process, or the library lacks serialised threading.
    pub fn init(timeout: Duration) -> CommResult<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                engine_error(
                    "init",
                    "MPI is already initialised in this process; create one MpiComm per process",
                )
            })?;
        if threading < Threading::Serialized {
            return Err(engine_error(
                "init",
                format!(
                    "the MPI library offers {threading:?} threading; burn-accelerate needs Serialized"
                ),
            ));
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        RANK.store(rank, Ordering::Relaxed);
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        AT_EXIT.call_once(register_exit_handler);
        let size = world.size() as usize;
        Ok(Self {
            universe: Some(universe),
            world,
            rank,
            size,
            timeout,
            seq: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            calls: Arc::new(Mutex::new(Spare::default())),
        })
    }

    /// The raw rsmpi communicator, for code that needs MPI calls of its own (the benchmarks compare against
    /// it). Collectives called on it are not covered by the timeout.
    pub fn raw(&self) -> &SimpleCommunicator {
        &self.world
    }

    fn check_usable(&self, operation: &str) -> CommResult<()> {
        if self.broken.load(Ordering::Relaxed) || BROKEN.load(Ordering::Relaxed) {
            return Err(engine_error(
                operation,
                "an earlier collective timed out; the MPI communicator cannot be used any more",
            ));
        }
        Ok(())
    }

    /// Polls `request` until it completes or the timeout expires.
    fn wait<D: ?Sized>(
        &self,
        operation: &str,
        seq: u64,
        mut request: Request<'static, D, StaticScope>,
    ) -> CommResult<()> {
        let start = Instant::now();
        let deadline = burn_accelerate_comm::deadline_after(self.timeout);
        let mut polls: u32 = 0;
        loop {
            match request.test() {
                Ok(_) => return Ok(()),
                Err(pending) => request = pending,
            }
            polls = polls.wrapping_add(1);
            let now = Instant::now();
            if now >= deadline {
                // The operation can neither complete nor be cancelled: keep its buffers alive forever and
                // make sure the process ends with MPI_Abort instead of hanging in MPI_Finalize.
                std::mem::forget(request);
                self.broken.store(true, Ordering::Relaxed);
                BROKEN.store(true, Ordering::Relaxed);
                let missing = self.diagnose(seq);
                return Err(CommError::Timeout {
                    operation: operation.into(),
                    seq,
                    rank: self.rank,
                    missing,
                    timeout: self.timeout,
                });
            }
            // Spin while the operation is young (MPI progresses inside `test`), then back off.
            let waited = now - start;
            if waited > Duration::from_millis(50) {
                std::thread::sleep(Duration::from_micros(200));
            } else if polls.is_multiple_of(64) {
                std::thread::yield_now();
            }
        }
    }

    /// After a timeout at `seq`: tells every other rank where this one is stuck and listens for their word for
    /// a short while; ranks that stay silent (or are elsewhere) are reported missing.
    fn diagnose(&self, seq: u64) -> Vec<usize> {
        let me = self.rank as u64;
        let message: &'static [u64] = Box::leak(vec![me, seq].into_boxed_slice());
        for r in (0..self.size).filter(|r| *r != self.rank) {
            let request = self
                .world
                .process_at_rank(r as i32)
                .immediate_send_with_tag(StaticScope, message, DIAGNOSE_TAG);
            std::mem::forget(request);
        }
        let mut stuck_here = vec![false; self.size];
        stuck_here[self.rank] = true;
        let grace = (self.timeout / 4).clamp(Duration::from_millis(200), Duration::from_secs(5));
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && stuck_here.iter().any(|s| !s) {
            while let Some(probe) = self
                .world
                .any_process()
                .immediate_matched_probe_with_tag(DIAGNOSE_TAG)
            {
                let (words, _) = probe.matched_receive_vec::<u64>();
                if let [rank, their_seq] = words[..]
                    && their_seq == seq
                    && (rank as usize) < self.size
                {
                    stuck_here[rank as usize] = true;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        stuck_here
            .iter()
            .enumerate()
            .filter(|(_, s)| !**s)
            .map(|(r, _)| r)
            .collect()
    }

    /// Runs an operation on heap buffers that MPI may keep using after a timeout: the buffers are leaked while
    /// the request is in flight and reclaimed when it completes.
    fn run<B: 'static, D: ?Sized + 'static>(
        &self,
        operation: &str,
        seq: u64,
        buffers: B,
        start: impl FnOnce(&SimpleCommunicator, &'static mut B) -> Request<'static, D, StaticScope>,
    ) -> CommResult<B> {
        self.check_usable(operation)?;
        let ptr: *mut B = Box::into_raw(Box::new(buffers));
        // SAFETY: `ptr` comes from `Box::into_raw` and is only turned back into a box after the request that
        // borrows it has completed; on a timeout it is never freed.
        let request = start(&self.world, unsafe { &mut *ptr });
        self.wait(operation, seq, request)?;
        // SAFETY: the request completed, so MPI no longer touches the buffers, and the `&'static mut` handed to
        // `start` is not used after this point.
        Ok(*unsafe { Box::from_raw(ptr) })
    }

    /// Starts collective number `seq` on this rank: exchanges call headers with every rank (timed) and returns
    /// every rank's call, or the error all ranks return when they disagree.
    fn agree(&self, call: Call) -> CommResult<(u64, Vec<Call>)> {
        let operation = call.name();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (_, words) = self.run(
            operation,
            seq,
            (call.encode(), vec![0u64; CALL_WORDS * self.size]),
            |world, (send, recv)| {
                world.immediate_all_gather_into(StaticScope, &send[..], &mut recv[..])
            },
        )?;
        let calls: Vec<Option<Call>> = words.chunks(CALL_WORDS).map(Call::decode).collect();
        let signatures: Vec<_> = calls.iter().map(|c| c.map(Call::signature)).collect();
        check_calls(seq, &signatures)?;
        Ok((seq, calls.into_iter().flatten().collect()))
    }

    fn reduce_typed<T>(
        &self,
        spare: &mut Vec<T>,
        data: Vec<T>,
        kind: u64,
        op: ReduceOp,
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let (system, op_code) = system_op(op);
        let (seq, _) = self.agree(Call::AllReduce {
            kind,
            op: op_code,
            len: data.len() as u64,
        })?;
        let mut recv = std::mem::take(spare);
        recv.resize(data.len(), T::default());
        let (send, recv) = if data.len() * std::mem::size_of::<T>() < BLOCKING_MIN_BYTES {
            self.run("all_reduce", seq, (data, recv), |world, (send, recv)| {
                world.immediate_all_reduce_into(StaticScope, &send[..], &mut recv[..], system)
            })?
        } else {
            // Large buffers: MPI's blocking all-reduce is markedly faster than its non-blocking one. The headers
            // just showed, within the timeout, that every rank is alive and in this very all-reduce with the same
            // length, so the blocking call cannot wait for a rank that does something else; a rank that dies
            // now ends the whole job through `mpirun`.
            let mut recv = recv;
            self.world.all_reduce_into(&data[..], &mut recv[..], system);
            (data, recv)
        };
        *spare = send;
        Ok(recv)
    }
}

impl MpiComm {
    /// Reduce-scatter of one element type: each rank's part is padded to the largest part, so that MPI's
    /// `MPI_Reduce_scatter_block` (equal blocks) serves uneven parts too; the padding is cut off again.
    fn reduce_scatter_typed<T>(
        &self,
        spare: &mut Vec<T>,
        data: Vec<T>,
        counts: &[usize],
        kind: u64,
        op: ReduceOp,
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let (system, op_code) = system_op(op);
        let part = burn_accelerate_comm::part_of(counts, self.rank, self.size, data.len());
        let (seq, _) = self.agree(Call::ReduceScatter {
            kind_op: kind * 4 + op_code,
            len: data.len() as u64,
            parts: fingerprint(counts),
        })?;
        // Every rank passed the same length and counts (the headers agree), so the split is valid on every
        // rank or on none.
        let part = part?;
        let block = counts.iter().copied().max().unwrap_or(0);
        if block == 0 {
            return Ok(Vec::new());
        }
        let send = if counts.iter().all(|c| *c == block) {
            // Equal parts: the buffer is already laid out in blocks.
            data
        } else {
            let mut send = vec![T::default(); block * self.size];
            let mut start = 0;
            for (r, count) in counts.iter().enumerate() {
                send[r * block..r * block + count].clone_from_slice(&data[start..start + count]);
                start += count;
            }
            send
        };
        // The previous call's send buffer receives this one's part: a steady stream of equal reduce-scatters
        // allocates (and faults in) nothing.
        // (Its old values are overwritten by MPI: only its length matters.)
        let mut recv = std::mem::take(spare);
        recv.resize(block, T::default());
        let (send, mut recv) = if send.len() * std::mem::size_of::<T>() < BLOCKING_MIN_BYTES {
            self.run(
                "reduce_scatter",
                seq,
                (send, recv),
                |world, (send, recv)| {
                    world.immediate_reduce_scatter_block_into(
                        StaticScope,
                        &send[..],
                        &mut recv[..],
                        system,
                    )
                },
            )?
        } else {
            // Large buffers take MPI's blocking call, as all-reduces do, once the headers showed every rank in
            // this very reduce-scatter.
            let mut recv = recv;
            self.world
                .reduce_scatter_block_into(&send[..], &mut recv[..], system);
            (send, recv)
        };
        *spare = send;
        recv.truncate(part.len());
        Ok(recv)
    }
}

impl MpiComm {
    /// All-gather of one element type's parts (`MPI_Allgatherv`).
    fn all_gather_parts_typed<T>(
        &self,
        data: Vec<T>,
        counts: &[usize],
        kind: u64,
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let total = burn_accelerate_comm::gathered_len(counts, self.rank, self.size, data.len());
        let (seq, calls) = self.agree(Call::AllGatherParts {
            kind,
            len: data.len() as u64,
            parts: fingerprint(counts),
        })?;
        // The headers agree on the counts; each rank's own length is in its header, so every rank finds the
        // same rank whose part does not fit.
        for (r, call) in calls.iter().enumerate() {
            if let Call::AllGatherParts { len, .. } = call
                && Some(&(*len as usize)) != counts.get(r)
            {
                return Err(CommError::IncompatibleInputs {
                    operation: "all_gather_parts".into(),
                    reason: format!(
                        "rank {r} passed {len} elements where the counts {counts:?} say otherwise"
                    ),
                });
            }
        }
        total?;
        let counts: Vec<u64> = counts.iter().map(|c| *c as u64).collect();
        self.gather_varcount("all_gather_parts", seq, data, &counts)
    }

    /// The all-gather of collective `seq` once its headers agreed: every rank's `data` (`counts[r]` elements
    /// for rank `r`) concatenated in rank order (`MPI_Allgatherv`; MPI's blocking call from 256 KiB, as the
    /// all-reduce).
    fn gather_varcount<T>(
        &self,
        operation: &str,
        seq: u64,
        data: Vec<T>,
        counts: &[u64],
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            // Nothing to move (MPI refuses a zero-sized varcount gather with MPI_ERR_ARG).
            return Ok(Vec::new());
        }
        if total > i32::MAX as u64 {
            return Err(engine_error(
                operation,
                "more than 2^31 elements gathered in one call; split the data",
            ));
        }
        let counts: Vec<i32> = counts.iter().map(|c| *c as i32).collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0i32, |acc, c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let recv = vec![T::default(); total as usize];
        if total as usize * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
            // Large buffers take MPI's blocking call once the headers showed every rank in this very
            // all-gather.
            let mut recv = recv;
            let mut partition = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
            self.world
                .all_gather_varcount_into(&data[..], &mut partition);
            return Ok(recv);
        }
        type Part<T> = PartitionMut<'static, [T], &'static [i32], &'static [i32]>;
        let mut partition: *mut Part<T> = std::ptr::null_mut();
        let (_, recv, _, _) = self.run(
            operation,
            seq,
            (data, recv, counts, displs),
            |world, (send, recv, counts, displs)| {
                partition = Box::into_raw(Box::new(PartitionMut::new(
                    &mut recv[..],
                    &counts[..],
                    &displs[..],
                )));
                // SAFETY: freed below only once the request has completed.
                world.immediate_all_gather_varcount_into(StaticScope, &send[..], unsafe {
                    &mut *partition
                })
            },
        )?;
        // SAFETY: the request completed; nothing refers to the partition any more.
        drop(unsafe { Box::from_raw(partition) });
        Ok(recv)
    }
}

impl MpiComm {
    /// Reduce of one element type to `root`: the root receives into the previous call's send buffer, as the
    /// all-reduce does.
    fn reduce_to_root_typed<T>(
        &self,
        spare: &mut Vec<T>,
        data: Vec<T>,
        (kind, op, root): (u64, ReduceOp, usize),
    ) -> CommResult<Option<Vec<T>>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        burn_accelerate_comm::check_root_public("reduce", root, self.size)?;
        let (system, op_code) = system_op(op);
        let (seq, _) = self.agree(Call::Reduce {
            kind_op: kind * 4 + op_code,
            len: data.len() as u64,
            root: root as u64,
        })?;
        if data.is_empty() {
            return Ok((self.rank == root).then_some(data));
        }
        let target = self.world.process_at_rank(root as i32);
        if self.rank != root {
            if data.len() * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
                target.reduce_into(&data[..], system);
            } else {
                self.run("reduce", seq, data, |_, send| {
                    target.immediate_reduce_into(StaticScope, &send[..], system)
                })?;
            }
            return Ok(None);
        }
        let mut recv = std::mem::take(spare);
        recv.resize(data.len(), T::default());
        let (send, recv) = if data.len() * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
            // As the all-reduce: MPI's blocking call once the headers showed every rank in this very reduce.
            let mut recv = recv;
            target.reduce_into_root(&data[..], &mut recv[..], system);
            (data, recv)
        } else {
            self.run("reduce", seq, (data, recv), |_, (send, recv)| {
                target.immediate_reduce_into_root(StaticScope, &send[..], &mut recv[..], system)
            })?
        };
        *spare = send;
        Ok(Some(recv))
    }

    /// Broadcast of one element type from `root`, into every rank's own buffer.
    fn broadcast_typed<T>(&self, mut data: Vec<T>, kind: u64, root: usize) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + 'static,
    {
        burn_accelerate_comm::check_root_public("broadcast_buffer", root, self.size)?;
        let (seq, _) = self.agree(Call::BroadcastBuffer {
            kind,
            len: data.len() as u64,
            root: root as u64,
        })?;
        if data.is_empty() {
            return Ok(data);
        }
        let from = self.world.process_at_rank(root as i32);
        if data.len() * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
            from.broadcast_into(&mut data[..]);
            return Ok(data);
        }
        self.run("broadcast_buffer", seq, data, |_, buffer| {
            from.immediate_broadcast_into(StaticScope, &mut buffer[..])
        })
    }
}

/// MPI's operation for `op` (a mean is a sum, divided afterwards) and its code in the call headers.
fn system_op(op: ReduceOp) -> (SystemOperation, u64) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => (SystemOperation::sum(), 0),
        ReduceOp::Max => (SystemOperation::max(), 1),
        ReduceOp::Min => (SystemOperation::min(), 2),
    }
}

/// A fingerprint of a reduce-scatter's counts (FNV-1a), compared across ranks in the call headers.
fn fingerprint(counts: &[usize]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for byte in counts.iter().flat_map(|c| (*c as u64).to_le_bytes()) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Set once any collective of this process timed out: MPI cannot be finalized cleanly any more.
static BROKEN: AtomicBool = AtomicBool::new(false);

/// This process's rank, for the exit handler.
static RANK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

use burn_accelerate_comm::{STATUS_DIR_VAR, TIMEOUT_REASON};

/// Registers [`finish_at_exit`]: with glibc through `on_exit`, which hands the handler the exit status, so that an
/// unsuccessful exit aborts the job instead of waiting in `MPI_Finalize` for ranks that wait for this one.
fn register_exit_handler() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn on_exit(
                function: extern "C" fn(std::ffi::c_int, *mut std::ffi::c_void),
                arg: *mut std::ffi::c_void,
            ) -> std::ffi::c_int;
        }
        extern "C" fn with_status(status: std::ffi::c_int, _: *mut std::ffi::c_void) {
            finish_at_exit(status);
        }
        // SAFETY: registers a plain `extern "C"` function without captured state.
        unsafe { on_exit(with_status, std::ptr::null_mut()) };
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        extern "C" fn without_status() {
            finish_at_exit(0);
        }
        // SAFETY: as above; the exit status is not known here, so only timeouts abort.
        unsafe { libc::atexit(without_status) };
    }
}

/// Ends MPI when the process exits. `MPI_Finalize` waits for every rank, so it is called only on a successful
/// exit; after a timeout, or when the process exits with a non-zero status (an error returned from `main`, a
/// `process::exit(1)`), `MPI_Abort` ends the whole job at once instead of leaving the other ranks waiting for
/// this one. A communicator kept in a `static` is never dropped, so this is what lets `mpirun` see the exit.
fn finish_at_exit(status: std::ffi::c_int) {
    // SAFETY: plain MPI calls with valid out-pointers; MPI_Finalized may be called at any time.
    unsafe {
        let mut finalized: std::ffi::c_int = 0;
        mpi::ffi::MPI_Finalized(&mut finalized);
        if finalized != 0 {
            return;
        }
        let rank = RANK.load(Ordering::Relaxed);
        if BROKEN.load(Ordering::Relaxed) {
            say(format!(
                "burn-accelerate: rank {rank} aborts the MPI job because a collective timed out"
            ));
            record_status(rank, 70, Some(TIMEOUT_REASON));
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 70);
        } else if status != 0 {
            say(format!(
                "burn-accelerate: rank {rank} exits with status {status}; aborting the MPI job"
            ));
            record_status(rank, status, None);
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, status);
        } else {
            mpi::ffi::MPI_Finalize();
        }
    }
}

/// Writes `message` and a line end to standard error in one write: `eprintln!` writes the pieces of its format
/// one by one, and `mpirun`, which forwards each rank's output as it comes, could put its own abort notice in the
/// middle of the line.
fn say(message: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{message}\n").as_bytes());
}

/// Leaves `rank_<rank>.status` in the folder [`STATUS_DIR_VAR`] names, if any (best effort: the job is ending):
/// the exit status, then the reason when the library ended the job itself (`launch` restarts a job whose
/// collective timed out, not one that failed with an error of its own).
fn record_status(rank: usize, status: std::ffi::c_int, reason: Option<&str>) {
    if let Some(dir) = std::env::var_os(STATUS_DIR_VAR) {
        let text = match reason {
            Some(reason) => format!("{status} {reason}"),
            None => status.to_string(),
        };
        let _ = std::fs::write(
            std::path::Path::new(&dir).join(format!("rank_{rank}.status")),
            text,
        );
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.broken.load(Ordering::Relaxed) {
            say(format!(
                "burn-accelerate: rank {} aborts the MPI job because a collective timed out (finalizing would hang)",
                self.rank
            ));
            self.world.abort(70);
        }
        drop(self.universe.take());
    }
}

impl Communicator for MpiComm {
    fn engine(&self) -> &'static str {
        ENGINE
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn barrier(&self) -> CommResult<()> {
        let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        // The header exchange is itself a barrier: every rank has arrived once it completes.
        self.agree(Call::Barrier).map(|_| ())
    }

    fn all_reduce(&self, data: ReduceBuffer, op: ReduceOp) -> CommResult<ReduceBuffer> {
        let n = self.size;
        let mut spare = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = match data {
            ReduceBuffer::F32(v) => {
                ReduceBuffer::F32(self.reduce_typed(&mut spare.f32, v, 0, op)?)
            }
            ReduceBuffer::F64(v) => {
                ReduceBuffer::F64(self.reduce_typed(&mut spare.f64, v, 1, op)?)
            }
            ReduceBuffer::I64(v) => {
                ReduceBuffer::I64(self.reduce_typed(&mut spare.i64, v, 2, op)?)
            }
        };
        if op == ReduceOp::Mean {
            out.divide_by_ranks(n);
        }
        Ok(out)
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>> {
        // Every rank's (color, key) through a timed collective first: a rank that never arrives is a timeout
        // here, not a hang in MPI_Comm_split.
        let mine = [color as u64, key as u64]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let all = self.all_gather(mine)?;
        let pairs: Vec<(usize, usize)> = all
            .iter()
            .map(|b| {
                let word = |i: usize| {
                    b.get(i * 8..i * 8 + 8)
                        .and_then(|w| w.try_into().ok())
                        .map_or(0, u64::from_le_bytes) as usize
                };
                (word(0), word(1))
            })
            .collect();
        let members = burn_accelerate_comm::split_members(&pairs, self.rank);
        let sub_rank = members.iter().position(|r| *r == self.rank).unwrap_or(0);
        let too_large = |what: &str, v: usize| {
            engine_error("split", format!("the {what} {v} does not fit MPI's int"))
        };
        let color = mpi::topology::Color::with_value(
            i32::try_from(color).map_err(|_| too_large("color", color))?,
        );
        let key = i32::try_from(sub_rank).map_err(|_| too_large("key", sub_rank))?;
        let sub = {
            let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            self.world.split_by_color_with_key(color, key)
        }
        .ok_or_else(|| engine_error("split", "MPI_Comm_split gave this rank no communicator"))?;
        let (rank, size) = (sub.rank() as usize, sub.size() as usize);
        Ok(Arc::new(Self {
            universe: None,
            world: sub,
            rank,
            size,
            timeout: self.timeout,
            seq: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            calls: self.calls.clone(),
        }))
    }

    fn all_gather(&self, data: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
        let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let (seq, calls) = self.agree(Call::AllGather {
            len: data.len() as u64,
        })?;
        let counts: Vec<u64> = calls
            .iter()
            .map(|c| match c {
                Call::AllGather { len } => *len,
                _ => 0,
            })
            .collect();
        let recv = self.gather_varcount("all_gather", seq, data, &counts)?;
        let mut out = Vec::with_capacity(self.size);
        let mut offset = 0usize;
        for c in counts {
            out.push(recv[offset..offset + c as usize].to_vec());
            offset += c as usize;
        }
        Ok(out)
    }

    fn reduce_scatter(
        &self,
        data: ReduceBuffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> CommResult<ReduceBuffer> {
        let mut spare = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = match data {
            ReduceBuffer::F32(v) => {
                ReduceBuffer::F32(self.reduce_scatter_typed(&mut spare.f32, v, counts, 0, op)?)
            }
            ReduceBuffer::F64(v) => {
                ReduceBuffer::F64(self.reduce_scatter_typed(&mut spare.f64, v, counts, 1, op)?)
            }
            ReduceBuffer::I64(v) => {
                ReduceBuffer::I64(self.reduce_scatter_typed(&mut spare.i64, v, counts, 2, op)?)
            }
        };
        if op == ReduceOp::Mean {
            out.divide_by_ranks(self.size);
        }
        Ok(out)
    }

    fn all_gather_parts(&self, data: ReduceBuffer, counts: &[usize]) -> CommResult<ReduceBuffer> {
        let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        Ok(match data {
            ReduceBuffer::F32(v) => ReduceBuffer::F32(self.all_gather_parts_typed(v, counts, 0)?),
            ReduceBuffer::F64(v) => ReduceBuffer::F64(self.all_gather_parts_typed(v, counts, 1)?),
            ReduceBuffer::I64(v) => ReduceBuffer::I64(self.all_gather_parts_typed(v, counts, 2)?),
        })
    }

    fn reduce(
        &self,
        data: ReduceBuffer,
        root: usize,
        op: ReduceOp,
    ) -> CommResult<Option<ReduceBuffer>> {
        let mut spare = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let out = match data {
            ReduceBuffer::F32(v) => self
                .reduce_to_root_typed(&mut spare.f32, v, (0, op, root))?
                .map(ReduceBuffer::F32),
            ReduceBuffer::F64(v) => self
                .reduce_to_root_typed(&mut spare.f64, v, (1, op, root))?
                .map(ReduceBuffer::F64),
            ReduceBuffer::I64(v) => self
                .reduce_to_root_typed(&mut spare.i64, v, (2, op, root))?
                .map(ReduceBuffer::I64),
        };
        Ok(out.map(|mut out| {
            if op == ReduceOp::Mean {
                out.divide_by_ranks(self.size);
            }
            out
        }))
    }

    fn broadcast_buffer(&self, data: ReduceBuffer, root: usize) -> CommResult<ReduceBuffer> {
        let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        Ok(match data {
            ReduceBuffer::F32(v) => ReduceBuffer::F32(self.broadcast_typed(v, 0, root)?),
            ReduceBuffer::F64(v) => ReduceBuffer::F64(self.broadcast_typed(v, 1, root)?),
            ReduceBuffer::I64(v) => ReduceBuffer::I64(self.broadcast_typed(v, 2, root)?),
        })
    }

    fn broadcast(&self, data: Vec<u8>, root: usize) -> CommResult<Vec<u8>> {
        if root >= self.size {
            return Err(CommError::InvalidRoot {
                operation: "broadcast".into(),
                root,
                world_size: self.size,
            });
        }
        let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let (seq, calls) = self.agree(Call::Broadcast {
            root: root as u64,
            len: if self.rank == root {
                data.len() as u64
            } else {
                0
            },
        })?;
        let buffer = if self.rank == root {
            data
        } else {
            match calls[root] {
                Call::Broadcast { len, .. } => vec![0u8; len as usize],
                _ => Vec::new(),
            }
        };
        if buffer.is_empty() {
            // Every rank knows from the headers that there is nothing to send.
            return Ok(buffer);
        }
        self.run("broadcast", seq, buffer, |world, buffer| {
            world
                .process_at_rank(root as i32)
                .immediate_broadcast_into(StaticScope, &mut buffer[..])
        })
    }
}
