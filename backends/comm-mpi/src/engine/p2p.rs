//! Point-to-point batches (`Communicator::send_recv`): every send posted at once (`MPI_Isend`), then every
//! receive matched as its message arrives (`MPI_Improbe`, then `MPI_Mrecv` into the receive's own buffer), all
//! polled against the timeout. Only the two ranks of a message take part: no call header, no sequence number.
//! The message's tag carries its element kind and MPI's status its length, so a receive that expects another
//! kind or length is an error on the receiving rank instead of a truncated message.

use mpi::datatype::Equivalence;
use mpi::point_to_point::Message;
use mpi::point_to_point::Status;

use super::*;

/// The tag of a point-to-point message of `f32`; `f64` and `i64` follow.
const P2P_TAG: i32 = 0x0b20;

/// The tag of `buffer`'s messages.
fn tag_of(buffer: &ReduceBuffer) -> i32 {
    match buffer {
        ReduceBuffer::F32(_) => P2P_TAG,
        ReduceBuffer::F64(_) => P2P_TAG + 1,
        ReduceBuffer::I64(_) => P2P_TAG + 2,
    }
}

/// The kind and length of a probed message, from its tag and status.
fn kind_and_len(status: &Status) -> (&'static str, usize) {
    let count = |n: mpi::Count| usize::try_from(n).unwrap_or(0);
    match status.tag() - P2P_TAG {
        0 => ("f32", count(status.count(f32::equivalent_datatype()))),
        1 => ("f64", count(status.count(f64::equivalent_datatype()))),
        2 => ("i64", count(status.count(i64::equivalent_datatype()))),
        _ => ("a message of another kind", 0),
    }
}

/// A posted send.
enum Sent {
    F32(Request<'static, [f32], StaticScope>),
    F64(Request<'static, [f64], StaticScope>),
    I64(Request<'static, [i64], StaticScope>),
}

impl Sent {
    /// `None` once complete, else the request again.
    fn test(self) -> Option<Self> {
        match self {
            Sent::F32(r) => r.test().err().map(Sent::F32),
            Sent::F64(r) => r.test().err().map(Sent::F64),
            Sent::I64(r) => r.test().err().map(Sent::I64),
        }
    }
}

/// Receives the matched `message` into `buffer`, which has its kind and length.
fn receive_into(message: Message, buffer: &mut ReduceBuffer) {
    match buffer {
        ReduceBuffer::F32(v) => {
            message.matched_receive_into(&mut v[..]);
        }
        ReduceBuffer::F64(v) => {
            message.matched_receive_into(&mut v[..]);
        }
        ReduceBuffer::I64(v) => {
            message.matched_receive_into(&mut v[..]);
        }
    }
}

/// Receives and drops the matched `message` (one that no receive of this batch can take).
fn drain(message: Message, status: Status) {
    let _ = match status.tag() - P2P_TAG {
        1 => (message, status).matched_receive_vec::<f64>().0.len(),
        2 => (message, status).matched_receive_vec::<i64>().0.len(),
        0 => (message, status).matched_receive_vec::<f32>().0.len(),
        _ => (message, status).matched_receive_vec::<u8>().0.len(),
    };
}

impl MpiComm {
    /// See `Communicator::send_recv`.
    pub(super) fn send_recv_batch(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        mut recvs: Vec<(usize, ReduceBuffer)>,
    ) -> CommResult<Vec<ReduceBuffer>> {
        const OPERATION: &str = "send_recv";
        burn_accelerate_comm::check_peers(&sends, &recvs, self.size)?;
        let _guard = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        self.check_usable(OPERATION)?;
        let outgoing: *mut Vec<(usize, ReduceBuffer)> = Box::into_raw(Box::new(sends));
        // SAFETY: `outgoing` comes from `Box::into_raw`; it is turned back into a box only after every send that
        // borrows it has completed, and never freed while one may still be in flight.
        let posted: &'static [(usize, ReduceBuffer)] = unsafe { &*outgoing };
        let mut pending: Vec<(usize, Sent)> = posted
            .iter()
            .map(|(peer, data)| {
                let to = self.world.process_at_rank(*peer as i32);
                let tag = tag_of(data);
                let sent = match data {
                    ReduceBuffer::F32(v) => {
                        Sent::F32(to.immediate_send_with_tag(StaticScope, &v[..], tag))
                    }
                    ReduceBuffer::F64(v) => {
                        Sent::F64(to.immediate_send_with_tag(StaticScope, &v[..], tag))
                    }
                    ReduceBuffer::I64(v) => {
                        Sent::I64(to.immediate_send_with_tag(StaticScope, &v[..], tag))
                    }
                };
                (*peer, sent)
            })
            .collect();
        let mut done = vec![false; recvs.len()];
        let start = Instant::now();
        let deadline = burn_accelerate_comm::deadline_after(self.timeout);
        let mut polls: u32 = 0;
        loop {
            pending = pending
                .into_iter()
                .filter_map(|(peer, sent)| sent.test().map(|s| (peer, s)))
                .collect();
            // In `recvs`' order; a peer whose earlier receive is still waiting keeps its later ones waiting (MPI
            // delivers one sender's messages in order).
            let mut silent: Vec<usize> = Vec::new();
            for (i, (peer, buffer)) in recvs.iter_mut().enumerate() {
                if done[i] || silent.contains(peer) {
                    continue;
                }
                let Some((message, status)) = self
                    .world
                    .process_at_rank(*peer as i32)
                    .immediate_matched_probe()
                else {
                    silent.push(*peer);
                    continue;
                };
                let arrived = kind_and_len(&status);
                if arrived != (buffer.kind(), buffer.len()) {
                    drain(message, status);
                    // Sends still in flight keep their buffers: leaked, never freed under MPI.
                    pending.into_iter().for_each(std::mem::forget);
                    return Err(burn_accelerate_comm::check_received(
                        self.world_rank(*peer),
                        self.world_rank(self.rank),
                        (buffer.kind(), buffer.len()),
                        arrived,
                    )
                    .err()
                    .unwrap_or_else(|| engine_error(OPERATION, "a message did not match")));
                }
                receive_into(message, buffer);
                done[i] = true;
            }
            if pending.is_empty() && done.iter().all(|d| *d) {
                // SAFETY: every send completed, so MPI no longer reads the buffers.
                drop(unsafe { Box::from_raw(outgoing) });
                return Ok(recvs.into_iter().map(|(_, buffer)| buffer).collect());
            }
            polls = polls.wrapping_add(1);
            let now = Instant::now();
            if now >= deadline {
                let mut waiting_for: Vec<usize> = recvs
                    .iter()
                    .zip(&done)
                    .filter(|(_, d)| !**d)
                    .map(|((peer, _), _)| *peer)
                    .chain(pending.iter().map(|(peer, _)| *peer))
                    .map(|peer| self.world_rank(peer))
                    .collect();
                waiting_for.sort_unstable();
                waiting_for.dedup();
                if !pending.is_empty() {
                    // Sends that can neither complete nor be cancelled: the job must end with MPI_Abort.
                    pending.into_iter().for_each(std::mem::forget);
                    self.broken.store(true, Ordering::Relaxed);
                    BROKEN.store(true, Ordering::Relaxed);
                } else {
                    // SAFETY: every send completed.
                    drop(unsafe { Box::from_raw(outgoing) });
                }
                return Err(CommError::PeerTimeout {
                    operation: OPERATION.into(),
                    rank: self.world_rank(self.rank),
                    waiting_for,
                    timeout: self.timeout,
                });
            }
            if now - start > Duration::from_millis(50) {
                std::thread::sleep(Duration::from_micros(200));
            } else if polls.is_multiple_of(64) {
                std::thread::yield_now();
            }
        }
    }
}
