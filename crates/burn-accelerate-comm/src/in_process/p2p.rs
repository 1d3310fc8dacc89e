//! Point-to-point batches of in-process ranks: each send is moved into its peer's mailbox (no copy, never
//! blocking), each receive takes the oldest message from its peer, waiting for it on the group's condition until
//! the timeout, a failure or the peer's departure.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use super::{Error, InProcessComm, ReduceBuffer, Result, SharedValue, rank_failed};

/// A message in a mailbox: a buffer ([`send_recv`](crate::Communicator::send_recv)) or a value handed over as
/// it is ([`send_recv_shared`](crate::Communicator::send_recv_shared)).
#[derive(Debug)]
pub(super) enum Mail {
    Buffer(ReduceBuffer),
    Shared(SharedValue),
}

impl Mail {
    /// The element kind and length, as `check_received` compares them (a shared value has no length).
    fn shape(&self) -> (&'static str, usize) {
        match self {
            Mail::Buffer(b) => (b.kind(), b.len()),
            Mail::Shared(_) => ("shared value", 0),
        }
    }
}

impl InProcessComm {
    /// See [`Communicator::send_recv`](crate::Communicator::send_recv).
    pub(super) fn send_recv_mailboxes(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> Result<Vec<ReduceBuffer>> {
        crate::check_peers(&sends, &recvs, self.group.size)?;
        let sends = sends
            .into_iter()
            .map(|(p, b)| (p, Mail::Buffer(b)))
            .collect();
        let recvs = recvs
            .into_iter()
            .map(|(p, b)| (p, Mail::Buffer(b)))
            .collect();
        Ok(self
            .post_and_take("send_recv", sends, recvs)?
            .into_iter()
            .map(|mail| match mail {
                Mail::Buffer(b) => b,
                Mail::Shared(_) => unreachable!("the shapes were checked"),
            })
            .collect())
    }

    /// See [`Communicator::send_recv_shared`](crate::Communicator::send_recv_shared).
    pub(super) fn send_recv_shared_mailboxes(
        &self,
        sends: Vec<(usize, SharedValue)>,
        recvs: Vec<usize>,
    ) -> Result<Vec<SharedValue>> {
        let expected: Vec<(usize, ())> = recvs.iter().map(|p| (*p, ())).collect();
        crate::check_peers(&sends, &expected, self.group.size)?;
        let sends = sends
            .into_iter()
            .map(|(p, v)| (p, Mail::Shared(v)))
            .collect();
        let placeholder: SharedValue = std::sync::Arc::new(());
        let recvs = recvs
            .into_iter()
            .map(|p| (p, Mail::Shared(placeholder.clone())))
            .collect();
        Ok(self
            .post_and_take("send_recv_shared", sends, recvs)?
            .into_iter()
            .map(|mail| match mail {
                Mail::Shared(v) => v,
                Mail::Buffer(_) => unreachable!("the shapes were checked"),
            })
            .collect())
    }

    /// Posts `sends` to their peers' mailboxes, then takes one message from each peer of `recvs` (whose mail
    /// gives the shape expected), waiting until the timeout, a failure or the peer's departure.
    fn post_and_take(
        &self,
        op: &'static str,
        sends: Vec<(usize, Mail)>,
        recvs: Vec<(usize, Mail)>,
    ) -> Result<Vec<Mail>> {
        let group = &*self.group;
        let seq = self.seq.load(Ordering::Relaxed);
        let deadline = crate::deadline_after(group.timeout);
        let mut state = group.lock();
        if let Some(failed) = &state.failed {
            return Err(rank_failed(op, seq, failed));
        }
        if !sends.is_empty() {
            for (peer, data) in sends {
                state
                    .mail
                    .entry((self.rank, peer))
                    .or_default()
                    .push_back(data);
            }
            group.wake.notify_all();
        }
        let mut received: Vec<Option<Mail>> = recvs.iter().map(|_| None).collect();
        loop {
            // In `recvs`' order: a peer's messages go to its receives in the order it sent them.
            for ((peer, expected), slot) in recvs.iter().zip(received.iter_mut()) {
                if slot.is_some() {
                    continue;
                }
                let Some(message) = state
                    .mail
                    .get_mut(&(*peer, self.rank))
                    .and_then(VecDeque::pop_front)
                else {
                    continue;
                };
                crate::check_received(
                    group.members[*peer],
                    group.members[self.rank],
                    expected.shape(),
                    message.shape(),
                )?;
                *slot = Some(message);
            }
            let waiting_for: Vec<usize> = recvs
                .iter()
                .zip(&received)
                .filter(|(_, slot)| slot.is_none())
                .map(|((peer, _), _)| *peer)
                .collect();
            if waiting_for.is_empty() {
                return Ok(received.into_iter().flatten().collect());
            }
            let me = group.members[self.rank];
            if let Some(stopped) = state.stopped((op, seq), &waiting_for, &group.members, || {
                format!("without sending what rank {me} receives")
            }) {
                return Err(stopped);
            }
            state = match group.sleep_until(state, deadline) {
                Some(state) => state,
                None => {
                    let mut waiting_for: Vec<usize> =
                        waiting_for.iter().map(|p| group.members[*p]).collect();
                    waiting_for.dedup();
                    return Err(Error::PeerTimeout {
                        operation: op.into(),
                        rank: group.members[self.rank],
                        waiting_for,
                        timeout: group.timeout,
                    });
                }
            };
        }
    }
}
