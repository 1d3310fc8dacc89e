//! Point-to-point batches of in-process ranks: each send is moved into its peer's mailbox (no copy, never
//! blocking), each receive takes the oldest message from its peer, waiting for it on the group's condition until
//! the timeout, a failure or the peer's departure.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Error, InProcessComm, ReduceBuffer, Result, rank_failed};

impl InProcessComm {
    /// See [`Communicator::send_recv`](crate::Communicator::send_recv).
    pub(super) fn send_recv_mailboxes(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> Result<Vec<ReduceBuffer>> {
        const OP: &str = "send_recv";
        let group = &*self.group;
        crate::check_peers(&sends, &recvs, group.size)?;
        let seq = self.seq.load(Ordering::Relaxed);
        let deadline = crate::deadline_after(group.timeout);
        let mut state = group.lock();
        if let Some(failed) = &state.failed {
            return Err(rank_failed(OP, seq, failed));
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
        let mut received: Vec<Option<ReduceBuffer>> = recvs.iter().map(|_| None).collect();
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
                    (expected.kind(), expected.len()),
                    (message.kind(), message.len()),
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
            if let Some(stopped) = state.stopped((OP, seq), &waiting_for, &group.members, || {
                format!("without sending what rank {me} receives")
            }) {
                return Err(stopped);
            }
            let now = Instant::now();
            if now >= deadline {
                let mut waiting_for: Vec<usize> =
                    waiting_for.iter().map(|p| group.members[*p]).collect();
                waiting_for.dedup();
                return Err(Error::PeerTimeout {
                    operation: OP.into(),
                    rank: group.members[self.rank],
                    waiting_for,
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
