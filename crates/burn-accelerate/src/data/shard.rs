//! Which batches each rank gets: Accelerate's `BatchSamplerShard`, index for index.

use crate::error::{Error, Result};

/// How the batches of one epoch are divided between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// Number of ranks.
    pub num_processes: usize,
    /// This rank.
    pub rank: usize,
    /// Cut every batch into `num_processes` slices (one per rank) instead of dealing whole batches round-robin.
    pub split_batches: bool,
    /// Complete the last round by cycling samples from the start of the epoch, so every rank gets the same
    /// number of full batches.
    pub even_batches: bool,
}

impl ShardSpec {
    /// One process: every batch as is.
    pub fn single() -> Self {
        Self {
            num_processes: 1,
            rank: 0,
            split_batches: false,
            even_batches: true,
        }
    }

    /// Checks that `batch_size` can be split.
    pub fn validate(&self, batch_size: usize) -> Result<()> {
        if self.split_batches && !batch_size.is_multiple_of(self.num_processes) {
            return Err(Error::InvalidArgument(format!(
                "split_batches: the batch size ({batch_size}) needs to be a round multiple of the number of \
                 processes ({}); change the batch size or turn split_batches off",
                self.num_processes
            )));
        }
        Ok(())
    }
}

/// This rank's batches, from the epoch's `batches` (made with `batch_size`, the last one partial unless
/// `drop_last`).
pub fn shard(
    batches: Vec<Vec<usize>>,
    batch_size: usize,
    drop_last: bool,
    spec: ShardSpec,
) -> Vec<Vec<usize>> {
    if spec.num_processes <= 1 {
        return batches;
    }
    if spec.split_batches {
        split(&batches, batch_size, drop_last, spec)
    } else {
        deal(&batches, batch_size, drop_last, spec)
    }
}

/// Whole batches, round-robin; a round is served only once its last batch is full.
fn deal(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    spec: ShardSpec,
) -> Vec<Vec<usize>> {
    let (p, r) = (spec.num_processes, spec.rank);
    let mut out = Vec::new();
    let mut initial: Vec<usize> = Vec::new();
    let mut to_yield: Vec<usize> = Vec::new();
    for (idx, batch) in batches.iter().enumerate() {
        if !drop_last && idx < p {
            initial.extend_from_slice(batch);
        }
        if idx % p == r {
            to_yield = batch.clone();
        }
        if idx % p == p - 1 && batch.len() == batch_size {
            out.push(std::mem::take(&mut to_yield));
        }
    }
    if drop_last || initial.is_empty() {
        return out;
    }
    if !spec.even_batches {
        if !to_yield.is_empty() {
            out.push(to_yield);
        }
        return out;
    }
    if to_yield.len() == batch_size {
        out.push(to_yield);
    }
    while initial.len() < p * batch_size {
        initial.extend_from_within(..);
    }
    let mut idx = batches.len() - 1;
    let mut batch = batches[idx].clone();
    if batch.len() == batch_size {
        batch.clear();
        idx += 1;
    }
    let mut cycle = 0;
    while !idx.is_multiple_of(p) || !batch.is_empty() {
        let end = cycle + batch_size - batch.len();
        batch.extend_from_slice(&initial[cycle..end]);
        if idx % p == r {
            out.push(std::mem::take(&mut batch));
        }
        batch.clear();
        cycle = end;
        idx += 1;
    }
    out
}

/// Every full batch cut into `num_processes` slices; a partial last batch is completed from the epoch's first.
fn split(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    spec: ShardSpec,
) -> Vec<Vec<usize>> {
    let (p, r) = (spec.num_processes, spec.rank);
    let len = batch_size / p;
    let part = |b: &[usize]| {
        b.get(len * r..(len * (r + 1)).min(b.len()))
            .map(<[usize]>::to_vec)
    };
    let mut out: Vec<Vec<usize>> = batches
        .iter()
        .filter(|b| b.len() == batch_size)
        .filter_map(|b| part(b))
        .collect();
    let (Some(first), Some(last)) = (batches.first(), batches.last()) else {
        return out;
    };
    if drop_last || last.len() >= batch_size {
        return out;
    }
    if !spec.even_batches {
        if last.len() > len * r {
            out.extend(part(last));
        }
        return out;
    }
    let mut initial = first.clone();
    while initial.len() < batch_size {
        initial.extend_from_within(..);
    }
    let mut padded = last.clone();
    padded.extend_from_slice(&initial);
    out.extend(part(&padded));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burn-style batches of `0..n`.
    fn batches(n: usize, bs: usize, drop_last: bool) -> Vec<Vec<usize>> {
        let mut b: Vec<Vec<usize>> = (0..n)
            .collect::<Vec<_>>()
            .chunks(bs)
            .map(<[usize]>::to_vec)
            .collect();
        if drop_last && b.last().is_some_and(|l| l.len() < bs) {
            b.pop();
        }
        b
    }

    fn check(
        n: usize,
        bs: usize,
        drop_last: bool,
        split: bool,
        even: bool,
        expected: [&[&[usize]]; 2],
    ) {
        let b = batches(n, bs, drop_last);
        for (rank, expected) in expected.iter().enumerate() {
            let spec = ShardSpec {
                num_processes: 2,
                rank,
                split_batches: split,
                even_batches: even,
            };
            let got = shard(b.clone(), bs, drop_last, spec);
            let want: Vec<Vec<usize>> = expected.iter().map(|x| x.to_vec()).collect();
            assert_eq!(
                got, want,
                "range({n}) bs={bs} drop_last={drop_last} split={split} even={even} rank={rank}"
            );
        }
    }

    // Tables of Accelerate's tests/test_data_loader.py.
    #[test]
    fn no_splits() {
        let full: [&[&[usize]]; 2] = [
            &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 20]],
            &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17], &[21, 22, 23]],
        ];
        check(24, 3, false, false, true, full);
        check(24, 3, true, false, true, full);
        check(
            21,
            3,
            false,
            false,
            true,
            [
                &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 20]],
                &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17], &[0, 1, 2]],
            ],
        );
        let three: [&[&[usize]]; 2] = [
            &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14]],
            &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17]],
        ];
        check(21, 3, true, false, true, three);
        check(
            22,
            3,
            false,
            false,
            true,
            [
                &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 20]],
                &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17], &[21, 0, 1]],
            ],
        );
        check(22, 3, true, false, true, three);
        check(
            20,
            3,
            false,
            false,
            true,
            [
                &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 0]],
                &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17], &[1, 2, 3]],
            ],
        );
        check(20, 3, true, false, true, three);
        check(2, 3, false, false, true, [&[&[0, 1, 0]], &[&[1, 0, 1]]]);
        check(2, 3, true, false, true, [&[], &[]]);
    }

    #[test]
    fn with_splits() {
        let full: [&[&[usize]]; 2] = [
            &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17], &[20, 21]],
            &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19], &[22, 23]],
        ];
        check(24, 4, false, true, true, full);
        check(24, 4, true, true, true, full);
        check(
            22,
            4,
            false,
            true,
            true,
            [
                &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17], &[20, 21]],
                &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19], &[0, 1]],
            ],
        );
        let five: [&[&[usize]]; 2] = [
            &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17]],
            &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19]],
        ];
        check(22, 4, true, true, true, five);
        check(
            21,
            4,
            false,
            true,
            true,
            [
                &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17], &[20, 0]],
                &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19], &[1, 2]],
            ],
        );
        check(21, 4, true, true, true, five);
        check(2, 4, false, true, true, [&[&[0, 1]], &[&[0, 1]]]);
        check(2, 4, true, true, true, [&[], &[]]);
    }

    #[test]
    fn no_splits_no_even() {
        let full: [&[&[usize]]; 2] = [
            &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 20]],
            &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17], &[21, 22, 23]],
        ];
        check(24, 3, false, false, false, full);
        check(24, 3, true, false, false, full);
        check(
            21,
            3,
            false,
            false,
            false,
            [
                &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 20]],
                &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17]],
            ],
        );
        let three: [&[&[usize]]; 2] = [
            &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14]],
            &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17]],
        ];
        check(21, 3, true, false, false, three);
        check(
            22,
            3,
            false,
            false,
            false,
            [
                &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19, 20]],
                &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17], &[21]],
            ],
        );
        check(22, 3, true, false, false, three);
        check(
            20,
            3,
            false,
            false,
            false,
            [
                &[&[0, 1, 2], &[6, 7, 8], &[12, 13, 14], &[18, 19]],
                &[&[3, 4, 5], &[9, 10, 11], &[15, 16, 17]],
            ],
        );
        check(20, 3, true, false, false, three);
        check(2, 3, false, false, false, [&[&[0, 1]], &[]]);
        check(2, 3, true, false, false, [&[], &[]]);
    }

    #[test]
    fn with_splits_no_even() {
        let full: [&[&[usize]]; 2] = [
            &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17], &[20, 21]],
            &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19], &[22, 23]],
        ];
        check(24, 4, false, true, false, full);
        check(24, 4, true, true, false, full);
        check(
            22,
            4,
            false,
            true,
            false,
            [
                &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17], &[20, 21]],
                &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19]],
            ],
        );
        let five: [&[&[usize]]; 2] = [
            &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17]],
            &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19]],
        ];
        check(22, 4, true, true, false, five);
        check(
            21,
            4,
            false,
            true,
            false,
            [
                &[&[0, 1], &[4, 5], &[8, 9], &[12, 13], &[16, 17], &[20]],
                &[&[2, 3], &[6, 7], &[10, 11], &[14, 15], &[18, 19]],
            ],
        );
        check(21, 4, true, true, false, five);
        check(2, 4, false, true, false, [&[&[0, 1]], &[]]);
        check(2, 4, true, true, false, [&[], &[]]);
    }

    #[test]
    fn split_needs_a_divisible_batch_size() {
        let spec = ShardSpec {
            num_processes: 3,
            rank: 0,
            split_batches: true,
            even_batches: true,
        };
        assert!(
            spec.validate(4)
                .unwrap_err()
                .to_string()
                .contains("round multiple")
        );
        assert!(spec.validate(6).is_ok());
    }
}
