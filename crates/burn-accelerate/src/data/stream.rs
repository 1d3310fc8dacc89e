//! Streaming datasets, read in order without random access (a file line by line, a generator): each rank's
//! share of the stream, as Accelerate's `IterableDatasetShard` deals it.

use std::collections::VecDeque;

use super::shard::ShardSpec;
use crate::error::Result;

/// This rank's items of a stream that every rank reads whole. The stream is cut into chunks of
/// `batch_size × num_processes` items (`batch_size` with `split_batches`), and rank `r` keeps the `r`-th slice
/// of `batch_size` (`batch_size / num_processes`) items of every chunk, so consecutive batches of the ranks
/// together are consecutive items of the stream. A last partial chunk is dropped with `drop_last`, else completed
/// by cycling the items of the first chunk, so that every rank gets the same number of items (a multiple of its
/// batch size). Made by [`shard_stream`].
pub struct StreamShard<S: Iterator> {
    inner: S,
    /// Items of one chunk, over all ranks.
    chunk: usize,
    /// This rank's slice of every chunk.
    slice: std::ops::Range<usize>,
    drop_last: bool,
    current: Vec<S::Item>,
    first: Option<Vec<S::Item>>,
    ready: VecDeque<S::Item>,
    done: bool,
}

/// This rank's share of `items`, dealt by `spec` in batches of `batch_size` (see [`StreamShard`]).
///
/// ```
/// use burn_accelerate::data::{ShardSpec, shard_stream};
///
/// let spec = |rank| ShardSpec { num_processes: 2, rank, split_batches: false, even_batches: true };
/// let rank0: Vec<u32> = shard_stream(0..10, 2, false, spec(0))?.collect();
/// let rank1: Vec<u32> = shard_stream(0..10, 2, false, spec(1))?.collect();
/// assert_eq!(rank0, [0, 1, 4, 5, 8, 9]);
/// assert_eq!(rank1, [2, 3, 6, 7, 0, 1]); // the last chunk is completed from the first
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
///
/// # Errors
/// With `split_batches`, a `batch_size` that the ranks cannot divide.
pub fn shard_stream<I>(
    items: I,
    batch_size: usize,
    drop_last: bool,
    spec: ShardSpec,
) -> Result<StreamShard<I::IntoIter>>
where
    I: IntoIterator,
    I::Item: Clone,
{
    let batch_size = batch_size.max(1);
    spec.validate(batch_size)?;
    let processes = spec.num_processes.max(1);
    let (chunk, per_rank) = if spec.split_batches {
        (batch_size, batch_size / processes)
    } else {
        (batch_size * processes, batch_size)
    };
    let start = spec.rank.min(processes - 1) * per_rank;
    Ok(StreamShard {
        inner: items.into_iter(),
        chunk,
        slice: start..start + per_rank,
        drop_last,
        current: Vec::with_capacity(chunk),
        first: None,
        ready: VecDeque::new(),
        done: false,
    })
}

impl<S> StreamShard<S>
where
    S: Iterator,
    S::Item: Clone,
{
    /// Keeps this rank's slice of the full chunk in `current`.
    fn keep_slice(&mut self) {
        if self.first.is_none() {
            self.first = Some(self.current.clone());
        }
        let chunk = std::mem::take(&mut self.current);
        self.ready.extend(
            chunk
                .into_iter()
                .skip(self.slice.start)
                .take(self.slice.len()),
        );
    }
}

impl<S> Iterator for StreamShard<S>
where
    S: Iterator,
    S::Item: Clone,
{
    type Item = S::Item;

    fn next(&mut self) -> Option<S::Item> {
        while self.ready.is_empty() && !self.done {
            match self.inner.next() {
                Some(item) => {
                    self.current.push(item);
                    if self.current.len() == self.chunk {
                        self.keep_slice();
                    }
                }
                None => {
                    self.done = true;
                    if !self.drop_last && !self.current.is_empty() {
                        let first = self.first.clone().unwrap_or_else(|| self.current.clone());
                        while self.current.len() < self.chunk {
                            self.current.extend(first.iter().cloned());
                        }
                        self.current.truncate(self.chunk);
                        self.keep_slice();
                    }
                }
            }
        }
        self.ready.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Accelerate's `RandomIterableDataset`: items 0, 1, 2, ... until a 1% chance stops it, at most `max_length`.
    fn random_stream(seed: u64, max_length: usize) -> Vec<usize> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut items = Vec::new();
        while items.len() < max_length {
            items.push(items.len());
            if rng.random::<f64>() < 0.01 {
                break;
            }
        }
        items
    }

    /// Accelerate's `check_iterable_dataset_shards`: the ranks' lists have one length, a multiple of their
    /// batch size, and interleaved batch by batch they are the stream (cycled from its start when completed).
    fn check(items: &[usize], batch_size: usize, drop_last: bool, processes: usize, split: bool) {
        let lists: Vec<Vec<usize>> = (0..processes)
            .map(|rank| {
                let spec = ShardSpec {
                    num_processes: processes,
                    rank,
                    split_batches: split,
                    even_batches: true,
                };
                shard_stream(items.to_vec(), batch_size, drop_last, spec)
                    .unwrap()
                    .collect()
            })
            .collect();
        let per_rank = if split {
            batch_size / processes
        } else {
            batch_size
        };
        let case = format!(
            "{} items, batch {batch_size}, drop_last {drop_last}, {processes} ranks, split {split}",
            items.len()
        );
        for list in &lists {
            assert_eq!(list.len(), lists[0].len(), "{case}");
            assert_eq!(list.len() % per_rank, 0, "{case}");
        }
        let mut observed = Vec::new();
        for start in (0..lists[0].len()).step_by(per_rank) {
            for list in &lists {
                observed.extend_from_slice(&list[start..start + per_rank]);
            }
        }
        let mut reference = items.to_vec();
        if !drop_last {
            while reference.len() < observed.len() {
                reference.extend_from_slice(&reference.clone());
            }
        }
        assert_eq!(observed, reference[..observed.len()], "{case}");
        let chunk = per_rank * processes;
        let expected = if drop_last {
            items.len() / chunk * chunk
        } else {
            items.len().div_ceil(chunk) * chunk
        };
        assert_eq!(observed.len(), expected, "{case}");
    }

    #[test]
    fn the_ranks_shares_interleave_into_the_stream_as_accelerates_shards_do() {
        for seed in [42, 7, 1234] {
            for max_length in [1000, 2] {
                let items = random_stream(seed, max_length);
                for (batch_size, processes) in [(4, 2), (4, 4), (6, 3), (1, 2)] {
                    for drop_last in [false, true] {
                        check(&items, batch_size, drop_last, processes, false);
                        if batch_size % processes == 0 {
                            check(&items, batch_size, drop_last, processes, true);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_short_stream_is_completed_from_its_start_and_an_empty_one_yields_nothing() {
        let spec = |rank| ShardSpec {
            num_processes: 3,
            rank,
            split_batches: false,
            even_batches: true,
        };
        let share = |items: Vec<u8>, rank| -> Vec<u8> {
            shard_stream(items, 2, false, spec(rank)).unwrap().collect()
        };
        assert_eq!(share(vec![1, 2, 3], 0), [1, 2]);
        assert_eq!(share(vec![1, 2, 3], 1), [3, 1]);
        assert_eq!(share(vec![1, 2, 3], 2), [2, 3]);
        assert!(share(vec![], 1).is_empty());
        let split = ShardSpec {
            split_batches: true,
            ..spec(0)
        };
        assert!(
            shard_stream(0..10, 4, false, split).is_err(),
            "4 does not split 3 ways"
        );
    }
}
