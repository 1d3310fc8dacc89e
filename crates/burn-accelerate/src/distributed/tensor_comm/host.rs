//! The host implementation of [`TensorComm`]: each tensor is copied to host memory (f32, or f64 for f64 values;
//! half-precision values are widened exactly), goes through the rank's
//! [`Communicator`](crate::distributed::comm::Communicator) (in-process or MPI, with its timeouts, call headers and
//! flight recorder), and comes back in its own dtype on its own device. Each call completes when it is started.

use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor, TensorData};

use super::lane::Lane;
use super::{Incoming, Pending, Reduction, TensorComm};
use crate::distributed::ProcessGroup;
use crate::distributed::comm::{ReduceBuffer, ReduceOp};
use crate::error::{Error, Result};

/// Host copies through the communicator of one group's rank.
#[derive(Debug)]
pub(crate) struct HostTensorComm {
    group: Arc<ProcessGroup>,
    lane: Lane,
}

impl HostTensorComm {
    /// The host implementation for `group`'s rank, whose calls complete when they are started.
    pub fn new(group: Arc<ProcessGroup>) -> Self {
        let lane = Lane::Inline(group.comm().clone());
        Self { group, lane }
    }

    /// The host implementation for `group`'s rank whose calls run on a communication thread of its own while
    /// the caller computes, where the engine lets a copy of the group's communicator run beside it (in-process
    /// ranks; MPI with `MPI_THREAD_MULTIPLE`); elsewhere as [`new`](Self::new). A collective: every rank of
    /// `group` makes it.
    ///
    /// # Errors
    /// The copy of the communicator could not be made; the thread could not be started.
    // Prefetching a sharded model's next block is its first caller; the tests drive it until then.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn asynchronous(group: Arc<ProcessGroup>) -> Result<Self> {
        let lane = Lane::threaded(group.comm())?;
        Ok(Self { group, lane })
    }
}

/// `flat`'s values in host memory: f64 values as they are, every other float dtype widened to f32 (exactly).
pub(crate) fn to_buffer(flat: Tensor<1>, operation: &'static str) -> Result<ReduceBuffer> {
    let device = flat.device();
    let data = flat.try_into_data().map_err(|e| Error::Execution {
        operation,
        device: format!("{device:?}"),
        reason: e.to_string(),
    })?;
    let wrong = |e: burn::tensor::DataError| Error::InvalidArgument(format!("{operation}: {e}"));
    Ok(match data.dtype() {
        DType::F32 => ReduceBuffer::F32(data.try_into_vec::<f32>().map_err(wrong)?),
        DType::F64 => ReduceBuffer::F64(data.try_into_vec::<f64>().map_err(wrong)?),
        _ => ReduceBuffer::F32(
            data.try_cast_as::<f32>()
                .and_then(|d| d.try_into_vec::<f32>())
                .map_err(wrong)?,
        ),
    })
}

/// A flat tensor of `buffer`'s values in `dtype` on `device`, after multiplying them by `factor`.
pub(crate) fn from_buffer(
    buffer: ReduceBuffer,
    factor: Option<f32>,
    (device, dtype): (&Device, DType),
    operation: &'static str,
) -> Result<Tensor<1>> {
    let len = buffer.len();
    let data = match buffer {
        ReduceBuffer::F32(mut values) => {
            if let Some(factor) = factor {
                values.iter_mut().for_each(|x| *x *= factor);
            }
            TensorData::new(values, [len])
        }
        ReduceBuffer::F64(mut values) => {
            if let Some(factor) = factor {
                values.iter_mut().for_each(|x| *x *= factor as f64);
            }
            TensorData::new(values, [len])
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "{operation}: the engine returned {} values for a float tensor",
                other.kind()
            )));
        }
    };
    let data = if data.dtype() == dtype {
        data
    } else {
        data.try_cast(dtype)
            .map_err(|e| Error::InvalidArgument(format!("{operation}: {e}")))?
    };
    Ok(Tensor::<1>::from_data(data, (device, dtype)))
}

impl TensorComm for HostTensorComm {
    fn name(&self) -> &'static str {
        "host all-reduce"
    }

    fn rank(&self) -> usize {
        self.group.process_index()
    }

    fn world_size(&self) -> usize {
        self.group.num_processes()
    }

    fn wire_dtype(&self, dtype: DType) -> DType {
        match dtype {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }

    fn all_reduce(
        &self,
        flat: Tensor<1>,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let place = (flat.device(), flat.dtype());
        let (op, factor) = how.split(self.world_size());
        let values = to_buffer(flat, operation)?;
        Ok(self
            .lane
            .start(move |comm| comm.all_reduce(values, op))?
            .then(move |reduced| from_buffer(reduced, factor, (&place.0, place.1), operation)))
    }

    fn reduce(
        &self,
        flat: Tensor<1>,
        root: usize,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Option<Tensor<1>>>> {
        let place = (flat.device(), flat.dtype());
        let (op, factor) = how.split(self.world_size());
        let values = to_buffer(flat, operation)?;
        Ok(self
            .lane
            .start(move |comm| comm.reduce(values, root, op))?
            .then(move |reduced| {
                reduced
                    .map(|values| from_buffer(values, factor, (&place.0, place.1), operation))
                    .transpose()
            }))
    }

    fn reduce_scatter(
        &self,
        flat: Tensor<1>,
        counts: &[usize],
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let place = (flat.device(), flat.dtype());
        let (op, factor) = how.split(self.world_size());
        let values = to_buffer(flat, operation)?;
        let counts = counts.to_vec();
        Ok(self
            .lane
            .start(move |comm| comm.reduce_scatter(values, &counts, op))?
            .then(move |mine| from_buffer(mine, factor, (&place.0, place.1), operation)))
    }

    fn all_gather(
        &self,
        part: Tensor<1>,
        counts: &[usize],
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let place = (part.device(), part.dtype());
        let values = to_buffer(part, operation)?;
        let counts = counts.to_vec();
        Ok(self
            .lane
            .start(move |comm| comm.all_gather_parts(values, &counts))?
            .then(move |all| from_buffer(all, None, (&place.0, place.1), operation)))
    }

    fn broadcast(
        &self,
        flat: Tensor<1>,
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let place = (flat.device(), flat.dtype());
        let values = to_buffer(flat, operation)?;
        Ok(self
            .lane
            .start(move |comm| comm.broadcast_buffer(values, root))?
            .then(move |values| from_buffer(values, None, (&place.0, place.1), operation)))
    }

    fn all_reduce_value(&self, value: f64, op: ReduceOp, operation: &'static str) -> Result<f64> {
        match self
            .lane
            .start(move |comm| comm.all_reduce(ReduceBuffer::F64(vec![value]), op))?
            .wait()?
        {
            ReduceBuffer::F64(v) if v.len() == 1 => Ok(v[0]),
            other => Err(Error::InvalidArgument(format!(
                "{operation}: the engine returned {} values for one f64",
                other.kind()
            ))),
        }
    }

    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
        operation: &'static str,
    ) -> Result<Pending<Vec<Tensor<1>>>> {
        let sends = sends
            .into_iter()
            .map(|(peer, flat)| Ok((peer, to_buffer(flat, operation)?)))
            .collect::<Result<Vec<_>>>()?;
        let buffers = recvs
            .iter()
            .map(|r| {
                let buffer = if r.dtype == DType::F64 {
                    ReduceBuffer::F64(vec![0.0; r.len])
                } else {
                    ReduceBuffer::F32(vec![0.0; r.len])
                };
                (r.peer, buffer)
            })
            .collect();
        Ok(self
            .lane
            .start(move |comm| comm.send_recv(sends, buffers))?
            .then(move |received| {
                received
                    .into_iter()
                    .zip(&recvs)
                    .map(|(buffer, r)| from_buffer(buffer, None, (&r.device, r.dtype), operation))
                    .collect()
            }))
    }

    fn on_group(&self, group: Arc<ProcessGroup>) -> Result<Arc<dyn TensorComm>> {
        Ok(Arc::new(match self.lane {
            Lane::Inline(_) => Self::new(group),
            Lane::Thread(_) => Self::asynchronous(group)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::tensor_comm::Checked;

    /// Runs `f` on `world` in-process ranks, each with the checked host implementation; returns each rank's
    /// result.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(&dyn TensorComm, &Device) -> Result<T> + Send + Sync + 'static,
    ) -> Vec<T> {
        crate::Accelerator::builder()
            .cpu(true)
            .launch(world, move |acc| {
                let group = acc.group_arc();
                let comm = Checked::host(group);
                f(&comm, acc.device())
            })
            .unwrap()
    }

    fn values(t: Tensor<1>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn every_collective_matches_its_definition_on_one_to_three_ranks_in_every_float_dtype() {
        for world in 1..=3usize {
            for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                let results = on_ranks(world, move |comm, device| {
                    let r = comm.rank() as f32;
                    let mine = |n: usize| {
                        let v: Vec<f32> = (0..n).map(|i| r * 10.0 + i as f32).collect();
                        Tensor::<1>::from_data(TensorData::new(v, [n]), (device, dtype))
                    };
                    let check_dtype = |t: &Tensor<1>| assert_eq!(t.dtype(), dtype);
                    let sum = comm
                        .all_reduce(mine(4), Reduction::Op(ReduceOp::Sum), "test sum")?
                        .wait()?;
                    check_dtype(&sum);
                    let avg = comm
                        .all_reduce(mine(4), Reduction::Average(2.0), "test average")?
                        .wait()?;
                    let max = comm
                        .all_reduce(mine(2), Reduction::Op(ReduceOp::Max), "test max")?
                        .wait()?;
                    let to_last = comm
                        .reduce(mine(3), world - 1, Reduction::ScaledSum(0.5), "test reduce")?
                        .wait()?;
                    // Rank r's part is r + 1 elements.
                    let counts: Vec<usize> = (1..=world).collect();
                    let total: usize = counts.iter().sum();
                    let scattered = comm
                        .reduce_scatter(
                            mine(total),
                            &counts,
                            Reduction::Op(ReduceOp::Sum),
                            "test rs",
                        )?
                        .wait()?;
                    check_dtype(&scattered);
                    let gathered = comm
                        .all_gather(mine(comm.rank() + 1), &counts, "test ag")?
                        .wait()?;
                    check_dtype(&gathered);
                    let from_first = comm.broadcast(mine(3), 0, "test broadcast")?.wait()?;
                    Ok((
                        values(sum),
                        values(avg),
                        values(max),
                        to_last.map(values),
                        values(scattered),
                        values(gathered),
                        values(from_first),
                    ))
                });
                let ranks: f32 = (0..world).map(|r| r as f32 * 10.0).sum();
                let w = world as f32;
                for (rank, (sum, avg, max, to_last, scattered, gathered, first)) in
                    results.into_iter().enumerate()
                {
                    let what = format!("{world} ranks, {dtype:?}, rank {rank}");
                    let sums: Vec<f32> = (0..4).map(|i| ranks + w * i as f32).collect();
                    assert_eq!(sum, sums, "{what}: sum");
                    let avgs: Vec<f32> = sums.iter().map(|s| s * 2.0 / w).collect();
                    for (a, b) in avg.iter().zip(&avgs) {
                        assert!(
                            (a - b).abs() <= b.abs() * 1e-2,
                            "{what}: average {avg:?} {avgs:?}"
                        );
                    }
                    let top = (world - 1) as f32 * 10.0;
                    assert_eq!(max, vec![top, top + 1.0], "{what}: max");
                    if rank == world - 1 {
                        let halves: Vec<f32> =
                            (0..3).map(|i| (ranks + w * i as f32) * 0.5).collect();
                        assert_eq!(to_last, Some(halves), "{what}: reduce");
                    } else {
                        assert_eq!(to_last, None, "{what}: reduce elsewhere");
                    }
                    let start: usize = (1..=rank).sum();
                    let part: Vec<f32> = (start..start + rank + 1)
                        .map(|i| ranks + w * i as f32)
                        .collect();
                    assert_eq!(scattered, part, "{what}: reduce-scatter");
                    let all: Vec<f32> = (0..world)
                        .flat_map(|q| (0..=q).map(move |i| q as f32 * 10.0 + i as f32))
                        .collect();
                    assert_eq!(gathered, all, "{what}: all-gather");
                    assert_eq!(first, vec![0.0, 1.0, 2.0], "{what}: broadcast");
                }
            }
        }
    }

    #[test]
    fn scatter_gives_each_rank_its_part_and_split_makes_checked_sub_groups() {
        let results = on_ranks(4, |comm, device| {
            let r = comm.rank();
            let mine: Vec<f32> = (0..10).map(|i| (r * 100 + i) as f32).collect();
            let flat = Tensor::<1>::from_data(TensorData::new(mine, [10]), (device, DType::F32));
            let part = comm
                .scatter(flat.clone(), &[0..1, 1..3, 3..6, 6..10], 2, "test scatter")?
                .wait()?;
            // Parts that overlap (replicas of one slice) or hold nothing; the other ranks pass no buffer.
            let sent = if r == 0 { flat } else { flat.slice(0..0) };
            let replicated = comm
                .scatter(sent, &[0..3, 0..3, 3..3, 5..10], 0, "test replicas")?
                .wait()?;
            // Rank 0 and 2 form one group, 1 and 3 the other, ordered by rank.
            let group = crate::distributed::current().expect("a rank's group");
            let host: Arc<dyn TensorComm> = Arc::new(Checked::host(group.clone()));
            let sub = host.on_group(Arc::new(group.split(r % 2, r)?))?;
            let t =
                Tensor::<1>::from_data(TensorData::new(vec![r as f32], [1]), (device, DType::F32));
            let sum = sub
                .all_reduce(t, Reduction::Op(ReduceOp::Sum), "test sub-group sum")?
                .wait()?;
            Ok((
                values(part),
                sub.rank(),
                sub.world_size(),
                values(sum),
                values(replicated),
            ))
        });
        let replicas: [Vec<f32>; 4] = [
            vec![0.0, 1.0, 2.0],
            vec![0.0, 1.0, 2.0],
            vec![],
            vec![5.0, 6.0, 7.0, 8.0, 9.0],
        ];
        for (rank, (part, sub_rank, sub_world, sum, replicated)) in results.into_iter().enumerate()
        {
            assert_eq!(
                replicated, replicas[rank],
                "rank {rank}: its part of rank 0's buffer"
            );
            let start: usize = (1..=rank).sum();
            let expected: Vec<f32> = (start..start + rank + 1)
                .map(|i| (200 + i) as f32)
                .collect();
            assert_eq!(part, expected, "rank {rank}: its part of rank 2's buffer");
            assert_eq!((sub_rank, sub_world), (rank / 2, 2), "rank {rank}");
            let other = if rank % 2 == 0 {
                [0.0, 2.0]
            } else {
                [1.0, 3.0]
            };
            assert_eq!(
                sum,
                vec![other[0] + other[1]],
                "rank {rank}: its sub-group's sum"
            );
        }
    }

    /// A part beyond the root's buffer is an error on every rank at once, not a receive that waits for the
    /// timeout: each rank then goes on to its next collective with its peers.
    #[test]
    fn a_scatter_part_outside_the_roots_buffer_fails_every_rank_at_once() {
        let results = on_ranks(3, |comm, device| {
            let flat = Tensor::<1>::zeros([4], (device, DType::F32));
            let refused = comm
                .scatter(flat.clone(), &[0..1, 1..2, 2..9], 0, "test scatter")
                .map(|_| ())
                .map_err(|e| e.to_string());
            let next = comm.all_reduce_value(1.0, ReduceOp::Sum, "test after the scatter")?;
            Ok((refused, next))
        });
        for (rank, (refused, next)) in results.into_iter().enumerate() {
            let err = refused.expect_err("the scatter is refused");
            assert!(
                err.contains("rank 0") && err.contains("outside") && !err.contains("timed out"),
                "rank {rank}: {err}"
            );
            assert_eq!(next, 3.0, "rank {rank}: the next collective");
        }
    }

    #[test]
    fn host_values_combine_in_f64() {
        let results = on_ranks(3, |comm, _| {
            let r = comm.rank() as f64;
            let sum = comm.all_reduce_value(1e-12 + r, ReduceOp::Sum, "test value sum")?;
            let max = comm.all_reduce_value(r, ReduceOp::Max, "test value max")?;
            Ok((sum, max))
        });
        for (sum, max) in results {
            // In rank order, in f64: 1e-12 survives next to 3 (it would not in f32).
            let expected = ((1e-12 + 0.0) + (1e-12 + 1.0)) + (1e-12 + 2.0);
            assert_eq!(sum, expected);
            assert_ne!(sum, 3.0);
            assert_eq!(max, 2.0);
        }
    }

    #[test]
    fn half_precision_sums_are_accumulated_in_f32() {
        // 2048 + 1 + 1 in f16 steps of 2 is 2048 again when summed pairwise in f16; in f32 it is 2050.
        let results = on_ranks(3, |comm, device| {
            let v = if comm.rank() == 0 { 2048.0 } else { 1.0 };
            let t = Tensor::<1>::from_data(
                TensorData::new(vec![v], [1]).convert_dtype(DType::F16),
                device,
            );
            Ok(values(
                comm.all_reduce(t, Reduction::Op(ReduceOp::Sum), "f16 sum")?
                    .wait()?,
            ))
        });
        for sum in results {
            assert_eq!(sum, vec![2050.0]);
        }
    }

    #[test]
    fn counts_that_do_not_fit_are_an_error_on_every_rank() {
        let results = on_ranks(2, |comm, device| {
            let t = Tensor::<1>::zeros([5], (device, DType::F32));
            Ok(comm
                .reduce_scatter(t, &[2, 2], Reduction::Op(ReduceOp::Sum), "bad counts")
                .map(|_| ())
                .map_err(|e| e.to_string()))
        });
        for result in results {
            let e = result.unwrap_err();
            assert!(e.contains('5') && e.contains('4'), "{e}");
        }
    }

    #[test]
    fn point_to_point_batches_pass_a_ring_in_every_float_dtype_and_refuse_strangers() {
        use crate::distributed::tensor_comm::Incoming;
        for world in 1..=3usize {
            for dtype in [DType::F32, DType::BF16, DType::F64] {
                let results = on_ranks(world, move |comm, device| {
                    let (r, n) = (comm.rank(), comm.world_size());
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let mine = |len: usize, salt: usize| {
                        let v: Vec<f32> = (0..len).map(|i| (salt * 100 + i) as f32 * 0.5).collect();
                        Tensor::<1>::from_data(TensorData::new(v, [len]), (device, dtype))
                    };
                    // Activations forward and gradients back, as a pipeline's neighbours exchange them.
                    let like = mine(0, 0);
                    let got = comm
                        .send_recv(
                            vec![(next, mine(3, r)), (prev, mine(2, r + 10))],
                            vec![
                                Incoming::like(prev, 3, &like),
                                Incoming::like(next, 2, &like),
                            ],
                            "test ring",
                        )?
                        .wait()?;
                    assert!(got.iter().all(|t| t.dtype() == dtype));
                    let got: Vec<Vec<f32>> = got.into_iter().map(values).collect();
                    let expected = vec![values(mine(3, prev)), values(mine(2, next + 10))];
                    Ok((got, expected))
                });
                for (rank, (got, expected)) in results.into_iter().enumerate() {
                    assert_eq!(got, expected, "{world} ranks, {dtype:?}, rank {rank}");
                }
            }
        }
        let refused = on_ranks(2, |comm, device| {
            let t = Tensor::<1>::zeros([2], device);
            Ok(comm
                .send_recv(vec![(5, t)], vec![], "test stranger")
                .err()
                .map(|e| e.to_string()))
        });
        let err = refused[0].clone().unwrap();
        assert!(
            err.contains("test stranger") && err.contains("rank 5") && err.contains("0..2"),
            "{err}"
        );
    }

    #[test]
    fn an_asynchronous_call_runs_while_its_rank_makes_other_collectives() {
        // Rank 0 starts its all-reduces before a barrier on the group's communicator, rank 1 after it: calls that
        // completed when started would wait for each other until the timeout.
        let results = crate::Accelerator::builder()
            .cpu(true)
            .collective_timeout(std::time::Duration::from_secs(20))
            .launch(2, |acc| {
                let group = acc.group_arc();
                let comm = HostTensorComm::asynchronous(group.clone())?;
                let device = acc.device().clone();
                let r = acc.process_index();
                let t = |v: f32| Tensor::<1>::from_floats([v, v + 1.0].as_slice(), &device);
                let start = |i: usize| {
                    comm.all_reduce(
                        t((r * 10 + i) as f32),
                        Reduction::Op(ReduceOp::Sum),
                        "test asynchronous sum",
                    )
                };
                let mut pending = Vec::new();
                if r == 0 {
                    for i in 0..3 {
                        pending.push(start(i)?);
                    }
                    group.comm().barrier()?;
                } else {
                    group.comm().barrier()?;
                    for i in 0..3 {
                        pending.push(start(i)?);
                    }
                }
                let sums = pending
                    .into_iter()
                    .map(|p| p.wait().map(values))
                    .collect::<Result<Vec<_>>>()?;
                let gathered = comm
                    .all_gather(t(r as f32), &[2, 2], "test asynchronous gather")?
                    .wait()?;
                let value = comm.all_reduce_value(r as f64, ReduceOp::Max, "test value")?;
                Ok((sums, values(gathered), value))
            })
            .unwrap();
        for (rank, (sums, gathered, value)) in results.into_iter().enumerate() {
            let expected: Vec<Vec<f32>> = (0..3)
                .map(|i| vec![(10 + 2 * i) as f32, (12 + 2 * i) as f32])
                .collect();
            assert_eq!(sums, expected, "rank {rank}");
            assert_eq!(gathered, vec![0.0, 1.0, 1.0, 2.0], "rank {rank}");
            assert_eq!(value, 1.0);
        }
    }
}
