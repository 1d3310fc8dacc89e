//! Statistics shared by the benchmarks: medians and paired ratios, which cancel slow drift in machine load.

#![allow(dead_code)]

use std::time::Duration;

/// The median of `times` (the upper one of an even count).
pub fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// The median over rounds of `numerator[i] / denominator[i]`, each pair measured back to back.
pub fn paired_ratio(numerator: &[Duration], denominator: &[Duration]) -> f64 {
    let mut ratios: Vec<f64> = numerator
        .iter()
        .zip(denominator)
        .map(|(n, d)| n.as_secs_f64() / d.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}
