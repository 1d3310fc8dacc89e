//! Checking a device gradient transport against an independent reference: what `burn-accelerate test` runs on a
//! GPU (the trainings it adds sit above the facade, in `diagnostics`).
//!
//! Every rank averages about a million values through the transport in f32, bf16 and f16 (where the device has
//! them). The values of every rank are a known function of the rank, so each rank computes the exact mean of all
//! ranks' values (as rounded to the dtype) in f64 by itself, without any collective, and compares: the reference
//! shares no code and no summation order with any transport, so a transport that drops a rank, forgets the
//! division or garbles a buffer fails, while one that only rounds differently passes within its dtype's bound.

use std::sync::Arc;

use burn::tensor::{DType, bf16, f16};

use super::{from_host, to_host};
use crate::distributed::ProcessGroup;
use crate::distributed::tensor_comm::{Incoming, Reduction, TensorComm};
use crate::error::Result;

/// How a device transport compares with the exact mean in one dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct DtypeCheck {
    /// The gradient dtype averaged.
    pub dtype: DType,
    /// The largest absolute difference between the transport's mean and the f64 reference.
    pub max_error: f64,
    /// The largest difference the dtype's rounding allows (see [`rounding_bound`]).
    pub bound: f64,
    /// How many elements were beyond the bound (or NaN), of `checked`: where a transport garbles only part of a
    /// buffer (a tail, one rank's share), this and [`first_wrong`](Self::first_wrong) say which.
    pub wrong: usize,
    /// The index of the first element beyond the bound.
    pub first_wrong: Option<usize>,
    /// How many elements were averaged.
    pub checked: usize,
}

impl DtypeCheck {
    /// Whether the transport's mean is within the bound (a NaN fails).
    pub fn passed(&self) -> bool {
        self.max_error <= self.bound
    }
}

/// A device gradient transport checked against the f64 reference in every dtype the device supports, and its
/// other collectives (sharded training's) in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportCheck {
    /// The transport, with why it was chosen.
    pub transport: String,
    /// One result per dtype, f32 first.
    pub dtypes: Vec<DtypeCheck>,
    /// One result per other call: a mean's reduce-scatter, an all-gather, a broadcast, a sum onto one rank, a
    /// ring of messages and a split sub-group's sum, in parts of an odd length (so every part has an unaligned
    /// tail). The `dtype` field of each is f32.
    pub collectives: Vec<(&'static str, DtypeCheck)>,
    /// One result per sharded strategy trained through the transport on one rank (a one-rank NCCL
    /// communicator), against the same training on the device alone: the weights after a few Adam steps, within
    /// 1e-5 of their scale. Empty where the transport connects several ranks (their strategies are checked by
    /// training them, in the GPU kit).
    pub training: Vec<(&'static str, DtypeCheck)>,
    /// Where the ranks are threads of one process sharing a device (the shared device path): one result per
    /// strategy (`NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD` whole and block-wise, both hybrids) trained on fresh
    /// in-process ranks on this device over a communicator that refuses every buffer through host memory,
    /// against the same training through host memory: every rank's weights, within 1e-5 of their scale. A
    /// buffer through host memory fails the check with an error naming it. Filled on the main process (it
    /// trains for the group); empty elsewhere and on other paths.
    pub without_host_buffers: Vec<(&'static str, DtypeCheck)>,
    /// For each training of [`without_host_buffers`](Self::without_host_buffers), the control bytes (agreements,
    /// call checks, parameter ids) its ranks passed through host memory, together; each within
    /// [`control_budget`](Self::control_budget), past which the double refuses them too.
    pub control_bytes: Vec<(&'static str, usize)>,
    /// The control bytes each of those trainings may pass through host memory, all its ranks together: well under
    /// one step's gradients of the check's model.
    pub control_budget: usize,
}

impl TransportCheck {
    /// Whether every dtype, every collective and every training passed.
    pub fn passed(&self) -> bool {
        !self.dtypes.is_empty()
            && self.dtypes.iter().all(DtypeCheck::passed)
            && self.collectives.iter().all(|(_, c)| c.passed())
            && self.training.iter().all(|(_, c)| c.passed())
            && self.without_host_buffers.iter().all(|(_, c)| c.passed())
            && self
                .control_bytes
                .iter()
                .all(|(_, c)| *c <= self.control_budget)
    }
}

/// `got` (values of `dtype`, widened) against `exact`, element by element, within `bound`; a NaN, or a length of
/// its own, fails.
pub(crate) fn compare(got: &[f32], exact: &[f64], bound: f64, dtype: DType) -> DtypeCheck {
    let mut max_error = if got.len() == exact.len() {
        0.0
    } else {
        f64::NAN
    };
    let (mut wrong, mut first_wrong) = (0, None);
    for (i, (g, e)) in got.iter().zip(exact).enumerate() {
        let error = (*g as f64 - e).abs();
        if error.is_nan() || error > bound {
            wrong += 1;
            first_wrong.get_or_insert(i);
        }
        if error.is_nan() || error > max_error {
            max_error = error;
        }
    }
    DtypeCheck {
        dtype,
        max_error,
        bound,
        wrong,
        first_wrong,
        checked: got.len(),
    }
}

/// Checks `transport`'s reduce-scatter (mean), all-gather, broadcast, reduce (sum), point-to-point batch (a
/// ring) and a split sub-group's all-reduce (sum) in f32 on every rank of `group` against values each rank
/// computes by itself: parts of `(1 << 18) + 1` values per rank.
pub(crate) fn check_collectives(
    group: &Arc<ProcessGroup>,
    transport: &dyn TensorComm,
) -> Result<Vec<(&'static str, DtypeCheck)>> {
    let (rank, world) = (group.process_index(), group.num_processes());
    let part = (1 << 18) + 1;
    let device = group.device().clone().without_autodiff();
    let tensor = |values: Vec<f32>| from_host(values, (&device, DType::F32), "collective check");
    let counts = vec![part; world];
    let values = |r: usize, n: usize| -> Vec<f32> { (0..n).map(|i| check_value(r, i)).collect() };

    let mine = transport
        .reduce_scatter(
            tensor(values(rank, part * world))?,
            &counts,
            Reduction::Average(1.0),
            "collective check",
        )?
        .wait()?;
    let exact: Vec<f64> = (rank * part..(rank + 1) * part)
        .map(|i| (0..world).map(|r| check_value(r, i) as f64).sum::<f64>() / world as f64)
        .collect();
    let reduce_scatter = compare(
        &to_host(mine, "collective check")?,
        &exact,
        rounding_bound(DType::F32, world, 0.5),
        DType::F32,
    );

    let gathered = transport
        .all_gather(tensor(values(rank, part))?, &counts, "collective check")?
        .wait()?;
    let exact: Vec<f64> = (0..world)
        .flat_map(|r| values(r, part).into_iter().map(f64::from))
        .collect();
    let all_gather = compare(
        &to_host(gathered, "collective check")?,
        &exact,
        0.0,
        DType::F32,
    );

    let root = world - 1;
    let received = transport
        .broadcast(tensor(values(rank, part))?, root, "collective check")?
        .wait()?;
    let exact: Vec<f64> = values(root, part).into_iter().map(f64::from).collect();
    let broadcast = compare(
        &to_host(received, "collective check")?,
        &exact,
        0.0,
        DType::F32,
    );

    // A sum onto rank 0; the other ranks receive nothing.
    let reduced = transport
        .reduce(
            tensor(values(rank, part))?,
            0,
            Reduction::Op(crate::distributed::comm::ReduceOp::Sum),
            "collective check",
        )?
        .wait()?;
    let sum_bound = rounding_bound(DType::F32, world, 0.5 * world as f64);
    let reduce = match (rank, reduced) {
        (0, Some(sum)) => {
            let exact: Vec<f64> = (0..part)
                .map(|i| (0..world).map(|r| check_value(r, i) as f64).sum())
                .collect();
            compare(
                &to_host(sum, "collective check")?,
                &exact,
                sum_bound,
                DType::F32,
            )
        }
        (0, None) | (_, Some(_)) => compare(&[], &[f64::NAN], 0.0, DType::F32),
        (_, None) => compare(&[], &[], 0.0, DType::F32),
    };

    // A ring of messages in one batch: each rank sends to the next and receives from the one before (on one
    // rank, to itself).
    let (next, previous) = ((rank + 1) % world, (rank + world - 1) % world);
    let received = transport
        .send_recv(
            vec![(next, tensor(values(rank, part))?)],
            vec![Incoming {
                peer: previous,
                len: part,
                device: device.clone(),
                dtype: DType::F32,
            }],
            "collective check",
        )?
        .wait()?;
    let exact: Vec<f64> = values(previous, part).into_iter().map(f64::from).collect();
    let send_recv = match received.into_iter().next() {
        Some(message) => compare(
            &to_host(message, "collective check")?,
            &exact,
            0.0,
            DType::F32,
        ),
        None => compare(&[], &exact, 0.0, DType::F32),
    };

    // A sub-group of the ranks of one parity (on one rank, itself), split from the group's connection, sums.
    let sub = Arc::new(group.split(rank % 2, rank)?);
    let members: Vec<usize> = (0..world).filter(|r| r % 2 == rank % 2).collect();
    let sub_transport = transport.on_group(sub)?;
    let summed = sub_transport
        .all_reduce(
            tensor(values(rank, part))?,
            Reduction::Op(crate::distributed::comm::ReduceOp::Sum),
            "collective check",
        )?
        .wait()?;
    let exact: Vec<f64> = (0..part)
        .map(|i| members.iter().map(|&r| check_value(r, i) as f64).sum())
        .collect();
    let split = compare(
        &to_host(summed, "collective check")?,
        &exact,
        rounding_bound(DType::F32, members.len(), 0.5 * members.len() as f64),
        DType::F32,
    );

    Ok(vec![
        ("reduce-scatter (mean)", reduce_scatter),
        ("all-gather", all_gather),
        ("broadcast", broadcast),
        ("reduce (sum)", reduce),
        ("send/recv", send_recv),
        ("split sub-group all-reduce (sum)", split),
    ])
}

/// The values rank `rank` averages in the check: in [-0.5, 0.5], different on every rank.
fn check_value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 101) as f32 * 0.01 - 0.5
}

/// `value` rounded to `dtype` as the device holds it, widened exactly to f64.
fn as_stored(value: f32, dtype: DType) -> f64 {
    match dtype {
        DType::F16 => f16::from_f32(value).to_f64(),
        DType::BF16 => bf16::from_f32(value).to_f64(),
        _ => value as f64,
    }
}

/// The largest difference from the exact mean that a correct all-reduce of `world` ranks' values (at most
/// `max_abs` in magnitude) may show in `dtype`: one rounding per partial sum a ring or tree stores in the dtype,
/// and the final one — `(world + 1)` unit roundoffs of `max_abs`.
pub fn rounding_bound(dtype: DType, world: usize, max_abs: f64) -> f64 {
    let unit_roundoff = match dtype {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        DType::F64 => 2f64.powi(-53),
        _ => 2f64.powi(-24),
    };
    (world as f64 + 1.0) * unit_roundoff * max_abs
}

/// Averages the check's values through `transport` in `dtype` on every rank of `group`, and compares the result
/// with the exact mean of every rank's values, computed here in f64.
pub(crate) fn check_dtype(
    group: &Arc<ProcessGroup>,
    transport: &dyn TensorComm,
    dtype: DType,
) -> Result<DtypeCheck> {
    let (rank, world) = (group.process_index(), group.num_processes());
    let n = (1 << 20) + 3;
    let values: Vec<f32> = (0..n).map(|i| check_value(rank, i)).collect();
    let device = group.device().clone().without_autodiff();
    let flat = from_host(values, (&device, dtype), "transport check")?;
    let averaged = transport
        .all_reduce(flat, Reduction::Average(1.0), "transport check")?
        .wait()?;
    let averaged = to_host(averaged, "transport check")?;
    let exact: Vec<f64> = (0..n)
        .map(|i| {
            (0..world)
                .map(|r| as_stored(check_value(r, i), dtype))
                .sum::<f64>()
                / world as f64
        })
        .collect();
    Ok(compare(
        &averaged,
        &exact,
        rounding_bound(dtype, world, 0.5),
        dtype,
    ))
}

/// Checks `transport` in f32, then bf16 and f16 where `group`'s device supports them.
pub(crate) fn check_transport(
    group: &Arc<ProcessGroup>,
    transport: &dyn TensorComm,
) -> Result<Vec<DtypeCheck>> {
    let device = group.device().clone().without_autodiff();
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .filter(|&dtype| dtype == DType::F32 || device.supports_dtype(dtype))
        .map(|dtype| check_dtype(group, transport, dtype))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_grows_with_ranks_and_coarser_dtypes() {
        assert!(rounding_bound(DType::BF16, 2, 0.5) > rounding_bound(DType::F16, 2, 0.5));
        assert!(rounding_bound(DType::F16, 2, 0.5) > rounding_bound(DType::F32, 2, 0.5));
        assert!(rounding_bound(DType::F32, 8, 0.5) > rounding_bound(DType::F32, 2, 0.5));
        // bf16 near 0.5 is spaced 2^-8 apart: one rounding (half a spacing) of 2 ranks' mean fits three.
        assert_eq!(rounding_bound(DType::BF16, 2, 0.5), 3.0 * 2f64.powi(-9));
    }

    #[test]
    fn values_are_stored_as_the_dtype_rounds_them() {
        assert_eq!(as_stored(0.1, DType::F32), 0.1f32 as f64);
        assert_ne!(as_stored(0.1, DType::BF16), 0.1f32 as f64);
        assert!((as_stored(0.1, DType::BF16) - 0.1).abs() < 2f64.powi(-10));
        assert!((as_stored(0.1, DType::F16) - 0.1).abs() < 2f64.powi(-13));
    }

    #[test]
    fn a_failed_dtype_or_no_dtype_fails_the_check() {
        let ok = DtypeCheck {
            dtype: DType::F32,
            max_error: 0.0,
            bound: 1e-7,
            wrong: 0,
            first_wrong: None,
            checked: 10,
        };
        let nan = DtypeCheck {
            max_error: f64::NAN,
            ..ok.clone()
        };
        assert!(ok.passed() && !nan.passed());
        let check = |dtypes| TransportCheck {
            transport: "t".into(),
            dtypes,
            collectives: Vec::new(),
            training: Vec::new(),
            without_host_buffers: Vec::new(),
            control_bytes: Vec::new(),
            control_budget: 0,
        };
        assert!(check(vec![ok.clone()]).passed());
        assert!(!check(vec![ok, nan]).passed());
        assert!(!check(vec![]).passed());
    }
}
