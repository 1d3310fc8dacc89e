//! # burn-accelerate-comm
//!
//! Communication between ranks for burn-accelerate.
//!
//! One object-safe [`Communicator`] trait is the seam every engine implements: [`InProcessGroup`] (one rank per
//! thread, shared memory), the MPI engine of the `burn-accelerate-mpi` crate, and [`SingleProcess`]. Buffers are
//! passed by value so that an engine can move them instead of copying; tensor-level collectives
//! (`burn_accelerate::ops`) are built on these few calls.
//!
//! Every blocking call has a timeout, and a rank that fails makes the others return an error instead of hanging.

#![warn(missing_docs)]

mod calls;
mod error;
mod in_process;
mod recorder;
mod reduce;

use std::fmt::Debug;

pub use calls::{CallSignature, check_calls, check_calls_of};
pub use error::{CommError, CommResult};
pub use in_process::{IN_PROCESS_ENGINE, InProcessComm, InProcessGroup};
pub use recorder::{HostValues, RECORDED_CALLS, Recorded, RecordedCall, describe_calls};
pub use reduce::{ReduceBuffer, ReduceOp, concat_parts, gathered_len, part_of, reduce_range};

type Result<T> = CommResult<T>;

/// A value that ranks living in one process hand each other as it is, without a copy
/// ([`Communicator::share`]): a device tensor's handle, say. The engine never looks inside.
pub type SharedValue = std::sync::Arc<dyn std::any::Any + Send + Sync>;

/// The variable naming a folder where each rank of a multi-process run that exits unsuccessfully leaves
/// `rank_<i>.status` (its exit status), so that the launcher (`burn-accelerate launch`) can name the rank that
/// failed. Engines that start their own processes' exit handling honour it.
pub const STATUS_DIR_VAR: &str = "BURN_ACCELERATE_STATUS_DIR";

/// The reason a rank's status file gives when the job ended because one of its collectives timed out (a rank
/// that hangs, or a machine that stopped answering), as opposed to an error of the program's own.
pub const TIMEOUT_REASON: &str = "collective-timeout";

/// How ranks talk to each other. Each rank owns one communicator and calls it from its own thread; every rank
/// must call the same collectives in the same order.
pub trait Communicator: Send + Sync + Debug {
    /// A short name of the engine, for messages (`in-process`, `mpi`, `single`).
    fn engine(&self) -> &'static str;

    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn world_size(&self) -> usize;

    /// Blocks until every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;

    /// Combines `data` element-wise across ranks with `op`; every rank gets the result. All ranks must pass
    /// buffers of the same kind and length.
    fn all_reduce(&self, data: ReduceBuffer, op: ReduceOp) -> Result<ReduceBuffer>;

    /// Gathers every rank's bytes (lengths may differ); the result is in rank order.
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>>;

    /// Returns `root`'s bytes on every rank (`data` is ignored on the other ranks).
    fn broadcast(&self, data: Vec<u8>, root: usize) -> Result<Vec<u8>>;

    /// Whether a sub-group made by [`split`](Self::split) may run its calls from a thread of its own while this
    /// communicator (or another sub-group) runs calls from another thread: the engine then keeps no lock across
    /// communicators. Each communicator's own calls still come from one thread at a time, in the same order on
    /// every rank. `false` (the default) means: call every communicator of the rank from one thread, one call at
    /// a time.
    fn concurrent(&self) -> bool {
        false
    }

    /// A sub-group (MPI's `MPI_Comm_split`): every rank calls it; the ranks that pass the same `color` form one
    /// group, ordered by `key` (then by rank), with its own call sequence and the timeout of this one. Returns
    /// this rank's communicator in its group.
    ///
    /// # Errors
    /// An engine without sub-groups; the collective's own errors.
    fn split(&self, color: usize, key: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        let _ = (color, key);
        Err(CommError::Engine {
            engine: self.engine(),
            operation: "split".into(),
            reason: "this engine has no sub-groups".into(),
        })
    }

    /// Whether the ranks live in one process and can hand each other values as they are
    /// ([`share`](Self::share), [`send_recv_shared`](Self::send_recv_shared)): a device tensor's handle, with
    /// no copy through host memory. `false` (the default) for engines whose ranks are separate processes.
    fn shares_memory(&self) -> bool {
        false
    }

    /// Every rank's `value`, in rank order, on every rank: the values themselves (shared, not copied), where the
    /// ranks live in one process ([`shares_memory`](Self::shares_memory)). A collective like the others, with
    /// their timeout and failure handling: every rank calls it, under the same `operation` name.
    ///
    /// # Errors
    /// An engine whose ranks do not share memory (the default); ranks that called another collective; the
    /// timeout; a rank that failed or left.
    fn share(&self, operation: &'static str, value: SharedValue) -> Result<Vec<SharedValue>> {
        let _ = value;
        Err(CommError::Engine {
            engine: self.engine(),
            operation: operation.into(),
            reason: "this engine's ranks do not share memory".into(),
        })
    }

    /// A batch of point-to-point messages of shared values ([`send_recv`](Self::send_recv)'s rules, for
    /// values handed over as they are): each of `sends` (`(peer, value)`) goes to its peer, one value is received
    /// from each peer of `recvs`, in `recvs`' order. Checking what arrives is the caller's business.
    ///
    /// # Errors
    /// As [`send_recv`](Self::send_recv); an engine whose ranks do not share memory (the default); a peer that
    /// sent a buffer where a shared value was expected.
    fn send_recv_shared(
        &self,
        sends: Vec<(usize, SharedValue)>,
        recvs: Vec<usize>,
    ) -> Result<Vec<SharedValue>> {
        let _ = (sends, recvs);
        Err(CommError::Engine {
            engine: self.engine(),
            operation: "send_recv_shared".into(),
            reason: "this engine's ranks do not share memory".into(),
        })
    }

    /// Combines `data` element-wise across ranks with `op`, and gives rank `r` only its own part: the
    /// `counts[r]` elements that follow the first `counts[..r]` (MPI's `MPI_Reduce_scatter`; the parts may
    /// differ in length, and one may be empty). Every rank must pass a buffer of the same kind and length and the
    /// same `counts`, one per rank, summing to that length.
    ///
    /// The default all-reduces the whole buffer and keeps this rank's part: right, but every rank reduces and
    /// receives everything. Engines override it so that each rank reduces and receives its part alone.
    fn reduce_scatter(
        &self,
        data: ReduceBuffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<ReduceBuffer> {
        let part = reduce::part_of(counts, self.rank(), self.world_size(), data.len())?;
        Ok(self.all_reduce(data, op)?.slice(part))
    }

    /// Combines `data` element-wise across ranks with `op` into rank `root`'s buffer: `root` gets `Some` of the
    /// result, the other ranks `None` (MPI's `MPI_Reduce`). Every rank must pass a buffer of the same kind and
    /// length, and the same `root`.
    ///
    /// The default all-reduces and keeps the result on `root`; engines override it so that only `root`
    /// receives (and no rank allocates).
    fn reduce(
        &self,
        data: ReduceBuffer,
        root: usize,
        op: ReduceOp,
    ) -> Result<Option<ReduceBuffer>> {
        check_root("reduce", root, self.world_size())?;
        let all = self.all_reduce(data, op)?;
        Ok((self.rank() == root).then_some(all))
    }

    /// Rank `root`'s buffer on every rank, received into each rank's own `data` (of the same kind and length on
    /// every rank; its values are ignored on the other ranks), which is returned (MPI's `MPI_Bcast` of typed
    /// elements, in place).
    ///
    /// The default goes through the byte [`broadcast`](Self::broadcast); engines override it to receive into
    /// `data` itself.
    fn broadcast_buffer(&self, data: ReduceBuffer, root: usize) -> Result<ReduceBuffer> {
        check_root("broadcast_buffer", root, self.world_size())?;
        let bytes = if self.rank() == root {
            match &data {
                ReduceBuffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ReduceBuffer::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ReduceBuffer::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            }
        } else {
            Vec::new()
        };
        let bytes = self.broadcast(bytes, root)?;
        let wrong = |width: usize| CommError::IncompatibleInputs {
            operation: "broadcast_buffer".into(),
            reason: format!(
                "rank {root} sent {} bytes, rank {} expected {} elements of {width} bytes",
                bytes.len(),
                self.rank(),
                data.len()
            ),
        };
        Ok(match data {
            ReduceBuffer::F32(_) if bytes.len() == data.len() * 4 => ReduceBuffer::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            ReduceBuffer::F64(_) if bytes.len() == data.len() * 8 => ReduceBuffer::F64(
                bytes
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            ReduceBuffer::I64(_) if bytes.len() == data.len() * 8 => ReduceBuffer::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            ReduceBuffer::F32(_) => return Err(wrong(4)),
            _ => return Err(wrong(8)),
        })
    }

    /// A batch of point-to-point messages (torch's `batch_isend_irecv`): every send of `sends` (`(peer, buffer)`)
    /// is posted, then every receive of `recvs` (`(peer, buffer)`, the buffer giving the kind and length
    /// expected; its values are ignored), and the call returns once all have completed, with the received
    /// buffers in `recvs`' order. Only the ranks named take part (no other rank calls anything). Messages from one
    /// rank to another arrive in the order it sent them; a pair of ranks that each send to and receive from the
    /// other in one batch never waits on itself, whichever posts first. A peer may be this rank itself.
    ///
    /// # Errors
    /// A peer outside the group; a message of another kind or length than its receive expects (on the receiving
    /// rank); a receive with nothing from its peer within the timeout ([`CommError::PeerTimeout`]); a peer that
    /// failed or left; an engine without point-to-point messages (the default).
    fn send_recv(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> Result<Vec<ReduceBuffer>> {
        let _ = (sends, recvs);
        Err(CommError::Engine {
            engine: self.engine(),
            operation: "send_recv".into(),
            reason: "this engine has no point-to-point messages".into(),
        })
    }

    /// Gathers every rank's part into one buffer, in rank order: rank `r` passes `counts[r]` elements (parts
    /// may differ in length, and one may be empty) and every rank gets all `counts.iter().sum()` of them
    /// (MPI's `MPI_Allgatherv`). Every rank must pass parts of the same kind and the same `counts`.
    ///
    /// The default goes through the byte [`all_gather`](Self::all_gather), each part led by its kind and
    /// counts, so that ranks that disagree get an error; engines override it to move the elements directly.
    fn all_gather_parts(&self, data: ReduceBuffer, counts: &[usize]) -> Result<ReduceBuffer> {
        let checked = reduce::gathered_len(counts, self.rank(), self.world_size(), data.len());
        let signature = format!("{} {counts:?}", data.kind());
        let mut bytes = Vec::with_capacity(8 + signature.len() + data.len() * 8);
        bytes.extend_from_slice(&(signature.len() as u64).to_le_bytes());
        bytes.extend_from_slice(signature.as_bytes());
        match &data {
            ReduceBuffer::F32(v) => v
                .iter()
                .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
            ReduceBuffer::F64(v) => v
                .iter()
                .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
            ReduceBuffer::I64(v) => v
                .iter()
                .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
        }
        let all = self.all_gather(bytes)?;
        let mut calls = Vec::with_capacity(all.len());
        let mut payloads = Vec::with_capacity(all.len());
        for part in &all {
            let head = part
                .get(..8)
                .and_then(|h| h.try_into().ok())
                .map(|h| u64::from_le_bytes(h) as usize);
            let text = head
                .and_then(|n| part.get(8..8 + n))
                .map(String::from_utf8_lossy);
            calls.push(text.as_ref().map(|t| CallSignature {
                collective: "all_gather_parts".into(),
                must_agree: t.to_string(),
                described: format!("all_gather_parts of {t}"),
            }));
            payloads.push(head.map_or(&[][..], |n| &part[(8 + n).min(part.len())..]));
        }
        check_calls(0, &calls)?;
        let _total = checked?;
        fn decode<const N: usize, T>(bytes: &[&[u8]], from: fn([u8; N]) -> T) -> Vec<T> {
            bytes
                .iter()
                .flat_map(|b| b.chunks_exact(N))
                .map(|c| from(c.try_into().expect("chunks of N bytes")))
                .collect()
        }
        Ok(match data {
            ReduceBuffer::F32(_) => ReduceBuffer::F32(decode(&payloads, f32::from_le_bytes)),
            ReduceBuffer::F64(_) => ReduceBuffer::F64(decode(&payloads, f64::from_le_bytes)),
            ReduceBuffer::I64(_) => ReduceBuffer::I64(decode(&payloads, i64::from_le_bytes)),
        })
    }
}

/// The error of a collective from `root` in a group of `world` ranks, when there is no such rank (for engines:
/// every engine words it alike).
///
/// # Errors
/// [`CommError::InvalidRoot`] when `root >= world`.
pub fn check_root_public(operation: &str, root: usize, world: usize) -> Result<()> {
    check_root(operation, root, world)
}

/// [`check_root_public`], for this crate.
pub(crate) fn check_root(operation: &str, root: usize, world: usize) -> Result<()> {
    if root >= world {
        return Err(CommError::InvalidRoot {
            operation: operation.into(),
            root,
            world_size: world,
        });
    }
    Ok(())
}

/// Checks the peers of a [`Communicator::send_recv`] batch against a group of `world` ranks (for engines: every
/// engine words it alike).
///
/// # Errors
/// [`CommError::InvalidRoot`] naming the first peer outside the group.
pub fn check_peers<S, R>(sends: &[(usize, S)], recvs: &[(usize, R)], world: usize) -> Result<()> {
    match sends
        .iter()
        .map(|(peer, _)| peer)
        .chain(recvs.iter().map(|(peer, _)| peer))
        .find(|peer| **peer >= world)
    {
        Some(peer) => Err(CommError::InvalidRoot {
            operation: "send_recv (peer)".into(),
            root: *peer,
            world_size: world,
        }),
        None => Ok(()),
    }
}

/// The message `received` from `peer` for a receive that expects `expected`'s kind and length: the error on a
/// mismatch (for engines: every engine words it alike).
///
/// # Errors
/// [`CommError::IncompatibleInputs`] when the kinds or lengths differ.
pub fn check_received(
    peer: usize,
    rank: usize,
    expected: (&'static str, usize),
    received: (&'static str, usize),
) -> Result<()> {
    if expected == received {
        return Ok(());
    }
    Err(CommError::IncompatibleInputs {
        operation: "send_recv".into(),
        reason: format!(
            "rank {peer} sent {} x {}, rank {rank} expected {} x {}; the two ranks must agree on every message's \
             kind and length, in order",
            received.1, received.0, expected.1, expected.0
        ),
    })
}

/// The communicator of a run with one process and one device: every collective returns its input.
#[derive(Debug, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn engine(&self) -> &'static str {
        "single"
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn all_reduce(&self, data: ReduceBuffer, _op: ReduceOp) -> Result<ReduceBuffer> {
        Ok(data)
    }

    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        Ok(vec![data])
    }

    fn split(&self, _color: usize, _key: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(SingleProcess))
    }

    fn concurrent(&self) -> bool {
        true
    }

    fn broadcast(&self, data: Vec<u8>, _root: usize) -> Result<Vec<u8>> {
        Ok(data)
    }

    fn reduce_scatter(
        &self,
        data: ReduceBuffer,
        counts: &[usize],
        _op: ReduceOp,
    ) -> Result<ReduceBuffer> {
        reduce::part_of(counts, 0, 1, data.len())?;
        Ok(data)
    }

    fn all_gather_parts(&self, data: ReduceBuffer, counts: &[usize]) -> Result<ReduceBuffer> {
        reduce::gathered_len(counts, 0, 1, data.len())?;
        Ok(data)
    }

    fn reduce(
        &self,
        data: ReduceBuffer,
        root: usize,
        _op: ReduceOp,
    ) -> Result<Option<ReduceBuffer>> {
        check_root("reduce", root, 1)?;
        Ok(Some(data))
    }

    fn broadcast_buffer(&self, data: ReduceBuffer, root: usize) -> Result<ReduceBuffer> {
        check_root("broadcast_buffer", root, 1)?;
        Ok(data)
    }

    /// Messages to itself, received in the order they were sent.
    fn send_recv(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> Result<Vec<ReduceBuffer>> {
        check_peers(&sends, &recvs, 1)?;
        let mut sent = sends.into_iter().map(|(_, data)| data);
        recvs
            .into_iter()
            .map(|(_, expected)| {
                let message = sent.next().ok_or(CommError::PeerTimeout {
                    operation: "send_recv".into(),
                    rank: 0,
                    waiting_for: vec![0],
                    timeout: std::time::Duration::ZERO,
                })?;
                check_received(
                    0,
                    0,
                    (expected.kind(), expected.len()),
                    (message.kind(), message.len()),
                )?;
                Ok(message)
            })
            .collect()
    }
}

/// The longest time any collective waits: 30 days. Longer timeouts (`Duration::MAX` included) are cut to it,
/// so that deadlines never overflow.
pub const MAX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 60 * 60);

/// The instant `timeout` (at most [`MAX_TIMEOUT`]) from now: when an engine gives up waiting.
pub fn deadline_after(timeout: std::time::Duration) -> std::time::Instant {
    std::time::Instant::now() + timeout.min(MAX_TIMEOUT)
}

/// The members of this rank's group after a split, in their new order, from every rank's `(color, key)` in rank
/// order: the ranks sharing this rank's color, ordered by key, then by rank.
pub fn split_members(all: &[(usize, usize)], rank: usize) -> Vec<usize> {
    let color = all[rank].0;
    let mut members: Vec<usize> = (0..all.len()).filter(|r| all[*r].0 == color).collect();
    members.sort_by_key(|r| (all[*r].1, *r));
    members
}
