use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_accelerate_comm::{
    CallSignature, CommError, CommResult, Communicator, ReduceBuffer, ReduceOp, check_calls_of,
};
use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};

mod call;
mod exit;
mod p2p;
mod typed;

use call::{CALL_WORDS, Call, fingerprint, system_op};
use exit::{BROKEN, RANK, register_exit_handler, say};

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
    /// This communicator's calls, one at a time (and its spare buffers). With a library that offers
    /// `Threading::Multiple` each sub-group has a lock of its own, so sub-groups run their calls from threads of
    /// their own at once; with `Threading::Serialized` sub-groups share their world's lock, so that no two
    /// threads of the process are inside MPI at once.
    calls: Arc<Mutex<Spare>>,
    /// Whether the library offers `Threading::Multiple` (see [`Communicator::concurrent`]).
    concurrent: bool,
    /// The world rank of each rank of this communicator (`0..size` for the world; a sub-group's members), so
    /// that errors name the ranks `mpirun` started.
    members: Vec<usize>,
}

/// A receive buffer kept between all-reduces, so that a steady stream of equal-size reductions allocates
/// nothing (the previous call's send buffer becomes the next call's receive buffer).
#[derive(Default)]
struct Spare {
    f32: Vec<f32>,
    f64: Vec<f64>,
    i64: Vec<i64>,
}

// SAFETY: MPI is initialised with `Threading::Serialized` or `Threading::Multiple`, and every MPI call of this
// communicator happens while holding `calls`: at most one thread is inside MPI through it at a time, and under
// `Serialized` (one lock shared by every communicator of the process) at most one thread is inside MPI at all.
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

/// Open MPI's choice for a large `MPI_Reduce_scatter_block` (its default "basic linear" algorithm: a reduce of the
/// whole buffer to rank 0, then a scatter) gives rank 0 a temporary buffer as large as the whole bucket: under
/// sharded training the main process peaked 10-11 % above the other ranks with one large tensor. Recursive halving
/// gives every rank the same half-sized buffers (and measured 7 % faster on a 232 M-parameter step on 4 ranks).
/// Chosen through Open MPI's variables before MPI starts, unless the user set either; other MPI libraries ignore
/// them.
fn prefer_balanced_reduce_scatter() {
    const DYNAMIC: &str = "OMPI_MCA_coll_tuned_use_dynamic_rules";
    const ALGORITHM: &str = "OMPI_MCA_coll_tuned_reduce_scatter_block_algorithm";
    if std::env::var_os(DYNAMIC).is_some() || std::env::var_os(ALGORITHM).is_some() {
        return;
    }
    // SAFETY: called once, before MPI (which reads them) starts, from the thread creating the communicator; the
    // crate starts no thread before it, and no other thread of this crate reads the environment meanwhile.
    unsafe {
        std::env::set_var(DYNAMIC, "1");
        std::env::set_var(ALGORITHM, "3");
    }
}

impl MpiComm {
    /// Initialises MPI and returns this process's communicator, whose collectives give up after `timeout`.
    ///
    /// Asks for `Threading::Multiple` (sub-groups used from threads of their own at once) and accepts
    /// `Threading::Serialized`.
    ///
    /// # Errors
    /// When MPI was already initialised in this process, or the library lacks serialised threading.
    pub fn init(timeout: Duration) -> CommResult<Self> {
        prefer_balanced_reduce_scatter();
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
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
            concurrent: threading == Threading::Multiple,
            members: (0..size).collect(),
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

    /// The world rank of this communicator's rank `rank`.
    fn world_rank(&self, rank: usize) -> usize {
        self.members.get(rank).copied().unwrap_or(rank)
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
                    rank: self.world_rank(self.rank),
                    missing: missing.into_iter().map(|r| self.world_rank(r)).collect(),
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
        check_calls_of(seq, &signatures, &self.members)?;
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

    fn concurrent(&self) -> bool {
        self.concurrent
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
            calls: if self.concurrent {
                Arc::new(Mutex::new(Spare::default()))
            } else {
                self.calls.clone()
            },
            concurrent: self.concurrent,
            members: members.iter().map(|r| self.world_rank(*r)).collect(),
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

    fn send_recv(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> CommResult<Vec<ReduceBuffer>> {
        self.send_recv_batch(sends, recvs)
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
