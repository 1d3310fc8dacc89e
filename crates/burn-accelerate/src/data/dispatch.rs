//! `dispatch_batches` for streams: the main process alone reads the stream, cuts it into chunks of one round
//! (every rank's batch) exactly as [`shard_stream`] deals it, and sends every chunk to the ranks, each of which
//! keeps its slice. For a stream only the main process can open (a socket, a file on its machine alone).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::shard::ShardSpec;
use super::stream::shard_stream;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives::broadcast_object;
use crate::error::Error;

/// What the main process sends for each round.
#[derive(Serialize, Deserialize)]
enum Round<I> {
    /// The next chunk: every rank's items of one round, in rank order.
    Chunk(Vec<I>),
    /// The stream ended after `read` items.
    End { read: usize },
    /// Reading the stream failed.
    Failed(String),
}

/// The stream's state that the prepared iterator reads: items read, and the error that ended it (shared by
/// the reading adapter, the dispatcher and the iterator of one epoch).
#[derive(Clone, Default)]
pub(crate) struct Progress {
    pub read: Rc<Cell<usize>>,
    pub failed: Rc<RefCell<Option<Error>>>,
}

/// Sends this rank's items of a stream the main process reads: the stream on the main process, `None` on the
/// others (which never open it).
pub(crate) type Dispatcher<I> = fn(
    Option<Box<dyn Iterator<Item = I>>>,
    Arc<ProcessGroup>,
    (usize, bool, ShardSpec),
    Progress,
) -> Box<dyn Iterator<Item = I>>;

/// This rank's items of rounds dealt by the main process, with `(batch_size, drop_last, spec)` as
/// [`shard_stream`] takes them.
pub(crate) fn dispatched<I: Clone + Serialize + DeserializeOwned + 'static>(
    stream: Option<Box<dyn Iterator<Item = I>>>,
    group: Arc<ProcessGroup>,
    (batch_size, drop_last, spec): (usize, bool, ShardSpec),
    progress: Progress,
) -> Box<dyn Iterator<Item = I>> {
    let (chunk, per_rank) = if spec.split_batches {
        (batch_size, batch_size / spec.num_processes.max(1))
    } else {
        (batch_size * spec.num_processes, batch_size)
    };
    // On the main process, the stream as one rank would read it in batches of a whole round: the rounds of
    // every rank, completed (or dropped) at the end as the shards are.
    let whole = ShardSpec {
        num_processes: 1,
        rank: 0,
        split_batches: false,
        even_batches: spec.even_batches,
    };
    let rounds = stream.map(|s| {
        shard_stream(s, chunk, drop_last, whole).expect("one rank divides any batch size")
    });
    let start = spec.rank * per_rank;
    Box::new(Dispatched {
        rounds,
        group,
        chunk,
        slice: start..start + per_rank,
        progress,
        ready: VecDeque::new(),
        done: false,
    })
}

struct Dispatched<I, S> {
    rounds: Option<S>,
    group: Arc<ProcessGroup>,
    chunk: usize,
    slice: std::ops::Range<usize>,
    progress: Progress,
    ready: VecDeque<I>,
    done: bool,
}

impl<I, S> Dispatched<I, S>
where
    I: Clone + Serialize + DeserializeOwned,
    S: Iterator<Item = I>,
{
    /// On the main process: the next round to send.
    fn next_round(&mut self) -> Round<I> {
        let Some(rounds) = self.rounds.as_mut() else {
            return Round::End { read: 0 };
        };
        let items: Vec<I> = rounds.by_ref().take(self.chunk).collect();
        if let Some(error) = self.progress.failed.borrow().as_ref() {
            return Round::Failed(error.to_string());
        }
        if items.is_empty() {
            Round::End {
                read: self.progress.read.get(),
            }
        } else {
            Round::Chunk(items)
        }
    }
}

impl<I, S> Iterator for Dispatched<I, S>
where
    I: Clone + Serialize + DeserializeOwned,
    S: Iterator<Item = I>,
{
    type Item = I;

    fn next(&mut self) -> Option<I> {
        if self.ready.is_empty() && !self.done {
            let round = if self.rounds.is_some() {
                self.next_round()
            } else {
                Round::End { read: 0 }
            };
            match broadcast_object(&self.group, &round, 0) {
                Ok(Round::Chunk(items)) => self.ready.extend(
                    items
                        .into_iter()
                        .skip(self.slice.start)
                        .take(self.slice.len()),
                ),
                Ok(Round::End { read }) => {
                    self.done = true;
                    self.progress.read.set(read);
                }
                Ok(Round::Failed(message)) => {
                    self.done = true;
                    let mut failed = self.progress.failed.borrow_mut();
                    if failed.is_none() {
                        *failed = Some(Error::other(format!(
                            "the main process could not read the stream: {message}"
                        )));
                    }
                }
                Err(error) => {
                    self.done = true;
                    *self.progress.failed.borrow_mut() = Some(error);
                }
            }
        }
        self.ready.pop_front()
    }
}
