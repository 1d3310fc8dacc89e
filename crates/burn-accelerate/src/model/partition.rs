//! Cutting a model's blocks into pipeline stages: contiguous runs of blocks, one per stage, balanced by each
//! block's cost (its measured compute time, or its parameters when nothing was measured).

use std::ops::Range;

use super::Blocks;
use crate::error::{Error, Result};

/// The blocks of each of `stages` stages: contiguous, in order, every block in exactly one stage, each stage at
/// least one block, and the costliest stage as cheap as a contiguous cut allows (`costs[b]`: block `b`'s cost).
/// `None` when there are fewer blocks than stages.
pub(crate) fn balanced_stages(costs: &[f64], stages: usize) -> Option<Vec<Range<usize>>> {
    let n = costs.len();
    if stages == 0 || n < stages {
        return None;
    }
    // The least largest-stage cost for which a greedy cut needs at most `stages` stages, found by bisection on
    // the prefix sums' values (exact for the sums that can occur: the answer is one of the runs' sums).
    let mut prefix = vec![0.0; n + 1];
    for (b, c) in costs.iter().enumerate() {
        prefix[b + 1] = prefix[b] + c.max(0.0);
    }
    let run = |a: usize, b: usize| prefix[b] - prefix[a];
    let cuts_for = |limit: f64| -> Option<Vec<Range<usize>>> {
        let mut ranges = Vec::new();
        let mut start = 0;
        while start < n {
            // Leave at least one block for each stage still to come.
            let last_end = n - (stages - ranges.len() - 1);
            let mut end = start + 1;
            while end < last_end && run(start, end + 1) <= limit {
                end += 1;
            }
            if run(start, end) > limit {
                return None;
            }
            ranges.push(start..end);
            start = end;
            if ranges.len() == stages && start < n {
                return None;
            }
        }
        (ranges.len() == stages).then_some(ranges)
    };
    let mut candidates: Vec<f64> = (0..n)
        .flat_map(|a| (a + 1..=n).map(move |b| (a, b)))
        .map(|(a, b)| run(a, b))
        .collect();
    candidates.sort_by(f64::total_cmp);
    candidates.dedup();
    let (mut lo, mut hi) = (0, candidates.len() - 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if cuts_for(candidates[mid]).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    cuts_for(candidates[lo])
}

/// The contiguous runs of `model`'s blocks each of `stages` stages runs, balanced by their parameters.
///
/// # Errors
/// Fewer blocks than stages.
pub(crate) fn stage_blocks<M: Blocks>(
    model: &M,
    stages: usize,
) -> Result<Vec<std::ops::Range<usize>>> {
    let costs: Vec<f64> = model
        .blocks()
        .iter()
        .map(|b| {
            // Shapes only: a lazy parameter is not drawn.
            let mut n = 0;
            crate::named_params::floats(b, |p| n += p.num_elements());
            n.max(1) as f64
        })
        .collect();
    balanced_stages(&costs, stages).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "pp_size {stages}: the model has {} block(s), fewer than its stages; each stage runs at least one \
             block, so lower pp_size or give the model more blocks",
            costs.len()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The costliest stage of `ranges`.
    fn worst(costs: &[f64], ranges: &[Range<usize>]) -> f64 {
        ranges
            .iter()
            .map(|r| costs[r.clone()].iter().sum::<f64>())
            .fold(0.0, f64::max)
    }

    /// The best largest-stage cost over every contiguous cut (exhaustive, for small cases).
    fn best(costs: &[f64], stages: usize) -> f64 {
        fn go(costs: &[f64], stages: usize) -> f64 {
            if stages == 1 {
                return costs.iter().sum();
            }
            (1..=costs.len() - (stages - 1))
                .map(|k| {
                    costs[..k]
                        .iter()
                        .sum::<f64>()
                        .max(go(&costs[k..], stages - 1))
                })
                .fold(f64::INFINITY, f64::min)
        }
        go(costs, stages)
    }

    #[test]
    fn stages_are_contiguous_cover_every_block_and_are_as_balanced_as_a_cut_allows() {
        let cases: [&[f64]; 5] = [
            &[1.0, 1.0, 1.0, 1.0],
            &[4.0, 1.0, 1.0, 1.0, 1.0],
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
            &[0.0, 0.0, 5.0, 0.0],
            &[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0],
        ];
        for costs in cases {
            for stages in 1..=costs.len() {
                let ranges = balanced_stages(costs, stages).expect("enough blocks");
                assert_eq!(ranges.len(), stages, "{costs:?} into {stages}");
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[stages - 1].end, costs.len());
                for pair in ranges.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start, "{costs:?}: {ranges:?}");
                }
                assert!(
                    ranges.iter().all(|r| !r.is_empty()),
                    "{costs:?}: {ranges:?}"
                );
                let (got, want) = (worst(costs, &ranges), best(costs, stages));
                assert!(
                    (got - want).abs() < 1e-9,
                    "{costs:?} into {stages}: {ranges:?} costs {got}, best {want}"
                );
            }
        }
    }

    #[test]
    fn fewer_blocks_than_stages_cannot_be_cut() {
        assert_eq!(balanced_stages(&[1.0, 1.0], 3), None);
        assert_eq!(balanced_stages(&[1.0], 0), None);
        assert_eq!(balanced_stages(&[2.0, 2.0], 2), Some(vec![0..1, 1..2]));
    }
}
