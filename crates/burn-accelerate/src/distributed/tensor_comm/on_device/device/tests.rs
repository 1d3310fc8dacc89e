//! The device collectives over the host-memory double of the library ([`super::double`]): every call, timeouts
//! and aborts, connection and split failures, and the lifecycle NCCL asks for.

use std::sync::atomic::Ordering;
use std::time::Duration;

use burn::tensor::{DType, Tensor};

use super::double::HostLibrary;
use super::*;
use crate::Accelerator;
use crate::distributed::tensor_comm::Reduction;
use crate::error::Error;

/// Each of `world` in-process ranks connects through `library`, then averages `values(rank)` `calls`
/// times; every rank's outcomes, in rank order. Fails the test unless every rank reported.
fn average_on_ranks(
    world: usize,
    library: HostLibrary,
    timeout: Duration,
    (debug, calls): (bool, usize),
    values: impl Fn(usize) -> Vec<f32> + Send + Sync,
) -> Vec<Vec<Result<Vec<f32>>>> {
    on_ranks(world, &library, (debug, timeout), |acc, t| {
        let rank = acc.process_index();
        Ok((0..calls)
            .map(|_| {
                let flat = Tensor::<1>::from_floats(values(rank).as_slice(), acc.device());
                let averaged = t
                    .all_reduce(flat, Reduction::Average(0.5), "gradient_all_reduce")?
                    .wait()?;
                assert_eq!(averaged.dtype(), DType::F32);
                Ok(averaged.into_data().try_to_vec::<f32>().unwrap())
            })
            .collect())
    })
    .into_iter()
    // A rank that could not connect has one outcome: the failure.
    .map(|outcomes| outcomes.unwrap_or_else(|e| vec![Err(e)]))
    .collect()
}

#[test]
fn every_collective_runs_on_the_device_engine_uneven_parts_padded_and_none_through_host_memory() {
    let library = HostLibrary::default();
    let values = |rank: usize| -> Vec<f32> { (0..6).map(|i| (rank * 10 + i) as f32).collect() };
    let results = Accelerator::builder()
        .debug(true)
        .launch(3, |acc| {
            let group = acc.group_arc();
            let rank = group.process_index();
            let engine =
                DeviceCollectives::connect(group.clone(), &library, Duration::from_secs(30))?;
            let comm = super::super::OnDevice::checked(Box::new(engine), &group);
            let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
            let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
            let before = acc.host_values();
            // Equal parts. The mean of the 6 values of 3 ranks, 2 per rank.
            let mine = comm
                .reduce_scatter(
                    tensor(values(rank)),
                    &[2, 2, 2],
                    Reduction::Average(1.0),
                    "rs",
                )?
                .wait()?;
            let gathered = comm
                .all_gather(tensor(vec![rank as f32; 2]), &[2, 2, 2], "ag")?
                .wait()?;
            let from_root = comm.broadcast(tensor(values(rank)), 2, "bc")?.wait()?;
            let summed = comm
                .reduce_scatter(
                    tensor(values(rank)),
                    &[2, 2, 2],
                    Reduction::ScaledSum(0.5),
                    "rs2",
                )?
                .wait()?;
            // Uneven parts (one empty): padded to the largest, on the engine too.
            let uneven = comm
                .reduce_scatter(
                    tensor(values(rank)),
                    &[1, 0, 5],
                    Reduction::Op(ReduceOp::Sum),
                    "rs3",
                )?
                .wait()?;
            let uneven_gathered = comm
                .all_gather(tensor(vec![rank as f32; rank]), &[0, 1, 2], "ag2")?
                .wait()?;
            let onto_root = comm
                .reduce(tensor(values(rank)), 1, Reduction::ScaledSum(2.0), "reduce")?
                .wait()?;
            let largest = comm
                .all_reduce(tensor(values(rank)), Reduction::Op(ReduceOp::Max), "max")?
                .wait()?;
            let through_host = acc.host_values() - before;
            Ok((
                [
                    read(mine),
                    read(gathered),
                    read(from_root),
                    read(summed),
                    read(uneven),
                    read(uneven_gathered),
                    read(largest),
                ],
                onto_root.map(read),
                through_host,
            ))
        })
        .unwrap();
    // Eight calls on the engine on each of the 3 ranks.
    assert_eq!(library.started.load(Ordering::Relaxed), 8 * 3);
    let sum: Vec<f32> = (0..6).map(|i| (30 + i * 3) as f32).collect();
    for (rank, (got, onto_root, through_host)) in results.into_iter().enumerate() {
        let [
            mine,
            gathered,
            from_root,
            summed,
            uneven,
            uneven_gathered,
            largest,
        ] = got;
        assert_eq!(through_host, 0, "rank {rank}: values through host memory");
        let mean: Vec<f32> = (0..6)
            .map(|i| (10.0 + i as f32 * 3.0 + 20.0) / 3.0)
            .collect();
        assert_eq!(mine, mean[rank * 2..rank * 2 + 2].to_vec(), "rank {rank}");
        assert_eq!(gathered, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        assert_eq!(from_root, values(2));
        assert_eq!(
            summed,
            sum[rank * 2..rank * 2 + 2]
                .iter()
                .map(|s| s * 0.5)
                .collect::<Vec<_>>()
        );
        let (start, len) = [(0, 1), (1, 0), (1, 5)][rank];
        assert_eq!(uneven, sum[start..start + len].to_vec(), "rank {rank}");
        assert_eq!(uneven_gathered, vec![1.0, 2.0, 2.0]);
        assert_eq!(largest, values(2));
        let doubled: Vec<f32> = sum.iter().map(|s| s * 2.0).collect();
        assert_eq!(onto_root, (rank == 1).then_some(doubled), "rank {rank}");
    }
}

/// Each of `world` ranks connects through `library` and runs `f` on the interface over it.
fn on_ranks<T: Send>(
    world: usize,
    library: &HostLibrary,
    (debug, timeout): (bool, Duration),
    f: impl Fn(&Accelerator, Arc<dyn super::super::TensorComm>) -> Result<T> + Send + Sync,
) -> Vec<Result<T>> {
    let results = std::sync::Mutex::new(Vec::new());
    Accelerator::builder()
        .debug(debug)
        .collective_timeout(timeout)
        .launch(world, |acc| {
            let group = acc.group_arc();
            let outcome =
                DeviceCollectives::connect(group.clone(), library, timeout).and_then(|engine| {
                    f(
                        &acc,
                        super::super::OnDevice::checked(Box::new(engine), &group),
                    )
                });
            results
                .lock()
                .unwrap()
                .push((group.process_index(), outcome));
            Ok(())
        })
        .expect("every rank returns");
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(rank, _)| *rank);
    assert_eq!(results.len(), world, "every rank reports");
    results.into_iter().map(|(_, r)| r).collect()
}

/// Where a call goes is chosen from what every rank passes alike: a rank whose buffer disagrees with the
/// counts once took host memory while its peers waited on the device until the timeout. Now debug mode names it
/// on every rank at once (and without debug mode that rank fails at once, without reaching host memory), and
/// the ranks go on to their next call together.
#[test]
fn a_buffer_that_disagrees_with_the_counts_fails_every_rank_and_never_takes_host_memory() {
    let library = HostLibrary::default();
    let results = on_ranks(2, &library, (true, Duration::from_secs(20)), |acc, comm| {
        let rank = acc.process_index();
        let tensor = |n: usize| Tensor::<1>::ones([n], acc.device());
        let before = acc.host_values();
        // Rank 1's buffer holds 5 values where the counts add up to 4.
        let scattered = comm
            .reduce_scatter(
                tensor(4 + rank),
                &[2, 2],
                Reduction::Op(ReduceOp::Sum),
                "rs",
            )
            .map(|_| ())
            .map_err(|e| e.to_string());
        // Rank 1 sends 3 values where its count is 2.
        let gathered = comm
            .all_gather(tensor(2 + rank), &[2, 2], "ag")
            .map(|_| ())
            .map_err(|e| e.to_string());
        let next = comm
            .all_reduce(tensor(2), Reduction::Op(ReduceOp::Sum), "next")?
            .wait()?;
        Ok((
            scattered,
            gathered,
            next.into_data().try_to_vec::<f32>().unwrap(),
            acc.host_values() - before,
        ))
    });
    for (rank, outcome) in results.into_iter().enumerate() {
        let (scattered, gathered, next, _) = outcome.unwrap();
        for err in [scattered.unwrap_err(), gathered.unwrap_err()] {
            assert!(!err.contains("timed out"), "rank {rank}: {err}");
            assert!(err.contains("Process 1: [2, 2, 0]"), "rank {rank}: {err}");
        }
        assert_eq!(next, vec![2.0, 2.0], "rank {rank}: the next call");
    }
    // Without debug mode: the rank whose buffer disagrees fails before any exchange, through neither path.
    let library = HostLibrary::default();
    let results = on_ranks(
        1,
        &library,
        (false, Duration::from_secs(20)),
        |acc, comm| {
            let before = acc.host_values();
            let err = comm
                .reduce_scatter(
                    Tensor::<1>::ones([3], acc.device()),
                    &[2],
                    Reduction::Op(ReduceOp::Sum),
                    "rs",
                )
                .map(|_| ())
                .unwrap_err()
                .to_string();
            Ok((err, acc.host_values() - before))
        },
    );
    let (err, through_host) = results.into_iter().next().unwrap().unwrap();
    assert!(err.contains("holds 3 elements"), "{err}");
    assert_eq!(through_host, 0);
}

#[test]
fn point_to_point_batches_run_on_the_engine_in_order_to_self_and_to_autodiff_devices() {
    let library = HostLibrary::default();
    let results = on_ranks(
        3,
        &library,
        (false, Duration::from_secs(30)),
        |acc, comm| {
            let rank = acc.process_index();
            let before = acc.host_values();
            let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
            let (next, previous) = ((rank + 1) % 3, (rank + 2) % 3);
            // Two messages to the next rank (in order), one to itself, an empty one to the previous.
            let sends = vec![
                (next, tensor(vec![rank as f32; 2])),
                (next, tensor(vec![10.0 + rank as f32; 3])),
                (rank, tensor(vec![100.0 + rank as f32])),
                (previous, tensor(Vec::new())),
            ];
            let like = tensor(vec![0.0]);
            let recvs = vec![
                Incoming::like(previous, 2, &like),
                Incoming::like(previous, 3, &like),
                Incoming::like(rank, 1, &like),
                Incoming::like(next, 0, &like),
            ];
            let received = comm.send_recv(sends, recvs, "messages")?.wait()?;
            let autodiff: Vec<bool> = received.iter().map(Tensor::is_autodiff).collect();
            let values: Vec<Vec<f32>> = received
                .into_iter()
                .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
                .collect();
            Ok((values, autodiff, acc.host_values() - before))
        },
    );
    // Three batches started; the empty message never reached the library.
    assert_eq!(library.started.load(Ordering::Relaxed), 3);
    for (rank, result) in results.into_iter().enumerate() {
        let (values, autodiff, through_host) = result.unwrap();
        let previous = ((rank + 2) % 3) as f32;
        assert_eq!(
            values,
            vec![
                vec![previous; 2],
                vec![10.0 + previous; 3],
                vec![100.0 + rank as f32],
                Vec::new()
            ],
            "rank {rank}"
        );
        assert!(
            autodiff.iter().all(|a| *a),
            "arrive on the autodiff device: {autodiff:?}"
        );
        assert_eq!(through_host, 0);
    }
}

#[test]
fn debug_mode_turns_a_message_length_mismatch_into_an_error_naming_both_lengths() {
    let library = HostLibrary::default();
    let started = std::time::Instant::now();
    let results = on_ranks(2, &library, (true, Duration::from_secs(5)), |acc, comm| {
        let rank = acc.process_index();
        let flat = Tensor::<1>::from_floats([1.0, 2.0, 3.0].as_slice(), acc.device());
        // Rank 0 sends 3 values where rank 1 expects 2.
        if rank == 0 {
            comm.send_recv(vec![(1, flat)], Vec::new(), "messages")?
                .wait()
        } else {
            comm.send_recv(Vec::new(), vec![Incoming::like(0, 2, &flat)], "messages")?
                .wait()
        }
    });
    let text = results[1].as_ref().unwrap_err().to_string();
    assert!(
        text.contains("[3.0, 1.0]") && text.contains("[2.0, 1.0]"),
        "{text}"
    );
    assert!(started.elapsed() < Duration::from_secs(60), "no hang");
}

#[test]
fn sub_groups_split_the_engines_connection_and_stay_on_the_device() {
    let library = HostLibrary::default();
    let results = on_ranks(
        4,
        &library,
        (false, Duration::from_secs(30)),
        |acc, comm| {
            let group = acc.group_arc();
            let rank = group.process_index();
            let before = acc.host_values();
            // As a hybrid strategy makes them: consecutive pairs, then the ranks of one parity.
            let pairs = comm.on_group(Arc::new(group.split(rank / 2, rank)?))?;
            let parity = comm.on_group(Arc::new(group.split(rank % 2, rank)?))?;
            let tensor = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), acc.device());
            let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
            let pair_sum = pairs
                .all_reduce(
                    tensor(vec![rank as f32]),
                    Reduction::Op(ReduceOp::Sum),
                    "pairs",
                )?
                .wait()?;
            let parity_part = parity
                .reduce_scatter(
                    tensor(vec![rank as f32, 10.0 * rank as f32]),
                    &[1, 1],
                    Reduction::Op(ReduceOp::Sum),
                    "parity",
                )?
                .wait()?;
            Ok((
                read(pair_sum),
                read(parity_part),
                pairs.name(),
                acc.host_values() - before,
            ))
        },
    );
    // Each of the 4 ranks split twice; both sub-groups' calls on the engine.
    assert_eq!(library.splits.load(Ordering::Relaxed), 8);
    assert_eq!(library.started.load(Ordering::Relaxed), 8);
    for (rank, result) in results.into_iter().enumerate() {
        let (pair_sum, parity_part, name, through_host) = result.unwrap();
        let pair = (rank / 2 * 2) as f32;
        assert_eq!(pair_sum, vec![2.0 * pair + 1.0], "rank {rank}");
        // Ranks 0 and 2 (or 1 and 3) sum (r, 10 r); the lower one keeps the first part.
        let (low, high) = ((rank % 2) as f32, (rank % 2 + 2) as f32);
        let whole = [low + high, 10.0 * (low + high)];
        assert_eq!(parity_part, vec![whole[rank / 2]], "rank {rank}");
        assert_eq!(name, "device collectives (NCCL)");
        assert_eq!(through_host, 0);
    }
}

#[test]
fn a_stuck_rank_in_a_sub_group_is_a_timeout_not_a_hang() {
    let library = HostLibrary {
        hang_rank: Some(3),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let results = on_ranks(
        4,
        &library,
        (false, Duration::from_millis(500)),
        |acc, comm| {
            let group = acc.group_arc();
            let rank = group.process_index();
            let pairs = comm.on_group(Arc::new(group.split(rank / 2, rank)?))?;
            let flat = Tensor::<1>::from_floats([1.0].as_slice(), acc.device());
            pairs
                .all_reduce(flat, Reduction::Op(ReduceOp::Sum), "pairs")?
                .wait()
                .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
        },
    );
    assert!(started.elapsed() < Duration::from_secs(60), "no hang");
    // The pair without the stuck rank sums; the other times out (or learns of the abort).
    assert_eq!(results[0].as_ref().unwrap(), &vec![2.0]);
    assert_eq!(results[1].as_ref().unwrap(), &vec![2.0]);
    for rank in [2, 3] {
        match results[rank].as_ref().unwrap_err() {
            Error::Comm(CommError::Timeout { operation, .. }) => {
                assert_eq!(operation, "gradient_all_reduce", "rank {rank}")
            }
            other => assert!(
                other.to_string().contains("aborted"),
                "rank {rank}: {other}"
            ),
        }
    }
}

#[test]
fn a_one_rank_mean_is_a_sum_so_nccls_one_rank_kernel_leaves_no_tail_unwritten() {
    let library = HostLibrary {
        defect: double::Defect::OneRankMeanTail,
        ..Default::default()
    };
    // The library's own one-rank mean, called directly, misses the tail, as NCCL's did on the first GPU.
    let results = on_ranks(1, &library, (false, Duration::from_secs(30)), |acc, _| {
        let n = (1 << 20) + 3;
        let flat = Tensor::<1>::ones([n], acc.device());
        let comm = library.connect(&library.new_id().unwrap(), 0, 1).unwrap();
        comm.start(DeviceCall::AllReduce {
            flat,
            op: ReduceOp::Mean,
        })
        .unwrap();
        assert!(comm.poll().unwrap());
        let raw = comm.finish().unwrap().pop().unwrap();
        let raw = raw.into_data().try_to_vec::<f32>().unwrap();
        Ok(raw.iter().filter(|v| v.is_nan()).count())
    });
    assert_eq!(results[0].as_ref().unwrap(), &3);
    // Through the engine, every check passes: the mean of one rank goes to the library as a sum.
    let results = on_ranks(
        1,
        &library,
        (false, Duration::from_secs(60)),
        |acc, comm| {
            let group = acc.group_arc();
            let mut checks = super::super::check::check_transport(&group, comm.as_ref())?;
            checks.extend(
                super::super::check::check_collectives(&group, comm.as_ref())?
                    .into_iter()
                    .map(|(_, c)| c),
            );
            Ok(checks)
        },
    );
    for check in results.into_iter().next().unwrap().unwrap() {
        assert!(check.passed(), "{check:?}");
    }
    assert_eq!(library_op(ReduceOp::Mean, 1), ReduceOp::Sum);
    assert_eq!(library_op(ReduceOp::Mean, 2), ReduceOp::Mean);
    assert_eq!(library_op(ReduceOp::Max, 1), ReduceOp::Max);
}

#[test]
fn the_id_travels_from_rank_0_and_every_rank_gets_the_scaled_mean() {
    let results = average_on_ranks(
        3,
        HostLibrary::default(),
        Duration::from_secs(20),
        (false, 2),
        |rank| vec![rank as f32, 2.0 * rank as f32, 6.0],
    );
    for outcomes in results {
        assert_eq!(outcomes.len(), 2);
        for result in outcomes {
            // mean (1, 2, 6) times 0.5
            assert_eq!(result.unwrap(), vec![0.5, 1.0, 3.0]);
        }
    }
}

#[test]
fn a_stuck_peer_is_a_timeout_naming_the_operation_then_an_abort_and_no_further_use() {
    let library = HostLibrary {
        hang_rank: Some(1),
        ..Default::default()
    };
    let uses_after_abort = library.uses_after_abort.clone();
    let started = std::time::Instant::now();
    let results = average_on_ranks(2, library, Duration::from_millis(300), (false, 2), |_| {
        vec![1.0; 4]
    });
    assert!(started.elapsed() < Duration::from_secs(60), "no hang");
    let mut timeouts = 0;
    for (rank, outcomes) in results.into_iter().enumerate() {
        let mut outcomes = outcomes.into_iter();
        // The first call: this rank's own timeout, or the abort of the peer that timed out first.
        match outcomes.next().unwrap().unwrap_err() {
            Error::Comm(CommError::Timeout { operation, .. }) => {
                assert_eq!(operation, "gradient_all_reduce", "rank {rank}");
                timeouts += 1;
            }
            other => assert!(
                other.to_string().contains("aborted"),
                "rank {rank}: {other}"
            ),
        }
        // The second call is refused before it reaches the freed communicator.
        let text = outcomes.next().unwrap().unwrap_err().to_string();
        assert!(
            text.contains("was aborted after an earlier timeout or error"),
            "rank {rank}: {text}"
        );
    }
    assert!(timeouts >= 1, "at least the waiting rank times out");
    assert_eq!(
        uses_after_abort.load(Ordering::Relaxed),
        0,
        "an aborted communicator was called again"
    );
}

#[test]
fn a_rank_that_cannot_connect_stops_every_rank_with_its_reason() {
    let library = HostLibrary {
        fail_connect: Some(2),
        ..Default::default()
    };
    let results = average_on_ranks(3, library, Duration::from_secs(20), (false, 1), |_| {
        vec![1.0]
    });
    for (rank, outcomes) in results.into_iter().enumerate() {
        let [result] = <[_; 1]>::try_from(outcomes).unwrap();
        let text = result.unwrap_err().to_string();
        assert!(text.contains("no route to peer"), "rank {rank}: {text}");
    }
}

#[test]
fn debug_mode_turns_a_size_mismatch_into_an_error_on_every_rank() {
    let results = average_on_ranks(
        2,
        HostLibrary::default(),
        Duration::from_secs(20),
        (true, 1),
        |rank| vec![1.0; 3 + rank],
    );
    for outcomes in results {
        let [result] = <[_; 1]>::try_from(outcomes).unwrap();
        let text = result.unwrap_err().to_string();
        assert!(
            text.contains("gradient_all_reduce") && text.contains("[3]") && text.contains("[4]"),
            "{text}"
        );
    }
}

/// Every rank's check of a device transport over `library` on 3 ranks.
fn check_on_ranks(library: HostLibrary) -> Vec<Vec<crate::distributed::DtypeCheck>> {
    let checks = Accelerator::builder()
        .launch(3, |acc| {
            let group = acc.group_arc();
            let transport =
                DeviceCollectives::connect(group.clone(), &library, Duration::from_secs(60))?;
            let transport = super::super::OnDevice::checked(Box::new(transport), &group);
            let mut checks = super::super::check::check_transport(&group, transport.as_ref())?;
            // Sharded training's collectives, on the engine (equal parts), after the dtypes.
            checks.extend(
                super::super::check::check_collectives(&group, transport.as_ref())?
                    .into_iter()
                    .map(|(_, c)| c),
            );
            Ok(checks)
        })
        .unwrap();
    assert_eq!(checks.len(), 3, "every rank reports");
    checks
}

#[test]
fn the_transport_check_passes_a_library_that_rounds_differently_in_every_dtype() {
    for checks in check_on_ranks(HostLibrary::default()) {
        let dtypes: Vec<DType> = checks.iter().map(|c| c.dtype).collect();
        assert_eq!(
            dtypes,
            [
                [DType::F32, DType::BF16, DType::F16].as_slice(),
                &[DType::F32; 6]
            ]
            .concat()
        );
        // Not equal by construction: the double sums in another order and precision (the all-reduce and the
        // reduce-scatter); the all-gather, the broadcast and the messages copy exactly.
        assert!(
            checks[0].max_error > 0.0 && checks[3].max_error > 0.0,
            "{checks:?}"
        );
        assert!(
            [4, 5, 7].iter().all(|&i| checks[i].max_error == 0.0),
            "{checks:?}"
        );
        for check in checks {
            assert!(check.passed(), "{check:?}");
        }
    }
}

#[test]
fn the_transport_check_fails_a_library_that_forgets_the_division() {
    let library = HostLibrary {
        defect: double::Defect::SumOnly,
        ..Default::default()
    };
    for checks in check_on_ranks(library) {
        // Every mean (the dtypes' all-reduces, the reduce-scatter) fails; the copies do not divide.
        assert!(checks[..4].iter().all(|c| !c.passed()), "{checks:?}");
        assert!(checks[4..].iter().all(|c| c.passed()), "{checks:?}");
    }
}

/// An engine whose results all come back shifted by 1e-3 (a library that garbles what it moves).
#[derive(Debug)]
struct Shifting(Box<dyn DeviceEngine>);

impl Shifting {
    fn shift(result: Option<Result<Tensor<1>>>) -> Option<Result<Tensor<1>>> {
        result.map(|r| r.map(|t| t.add_scalar(1e-3)))
    }
}

impl DeviceEngine for Shifting {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        Ok(self.0.average(flat, scale)?.add_scalar(1e-3))
    }
    fn all_reduce(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Self::shift(self.0.all_reduce(flat, op))
    }
    fn reduce(&self, flat: Tensor<1>, root: usize, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Self::shift(self.0.reduce(flat, root, op))
    }
    fn reduce_scatter(&self, flat: Tensor<1>, op: ReduceOp) -> Option<Result<Tensor<1>>> {
        Self::shift(self.0.reduce_scatter(flat, op))
    }
    fn all_gather(&self, part: Tensor<1>) -> Option<Result<Tensor<1>>> {
        Self::shift(self.0.all_gather(part))
    }
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Option<Result<Tensor<1>>> {
        Self::shift(self.0.broadcast(flat, root))
    }
    fn on_group(&self, group: Arc<ProcessGroup>) -> Option<Result<Box<dyn DeviceEngine>>> {
        self.0
            .on_group(group)
            .map(|e| e.map(|e| Box::new(Shifting(e)) as Box<dyn DeviceEngine>))
    }
}

#[test]
fn sharded_training_through_a_one_rank_library_matches_the_device_alone_and_a_garbling_one_does_not()
 {
    let library = HostLibrary::default();
    let timeout = Duration::from_secs(60);
    let engines = {
        let library = library.clone();
        Arc::new(move |group: &Arc<ProcessGroup>| {
            let engine = DeviceCollectives::connect(group.clone(), &library, timeout)?;
            Ok(Box::new(engine) as Box<dyn DeviceEngine>)
        })
    };
    let device = burn::tensor::Device::default();
    let checks = crate::diagnostics::check_training_on_one_rank(&device, timeout, engines).unwrap();
    let names: Vec<&str> = checks.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        names,
        [
            "SHARD_GRAD_OP training",
            "FULL_SHARD training",
            "HYBRID_SHARD training"
        ]
    );
    for (name, check) in &checks {
        assert!(check.passed() && check.checked == 150, "{name}: {check:?}");
    }
    assert!(
        library.started.load(Ordering::Relaxed) > 3 * 3,
        "every step went through the library"
    );
    // The hybrid strategy split its shard and replica groups from the library's connection.
    assert_eq!(library.splits.load(Ordering::Relaxed), 2);
    let garbling = Arc::new(move |group: &Arc<ProcessGroup>| {
        let engine = DeviceCollectives::connect(group.clone(), &HostLibrary::default(), timeout)?;
        Ok(Box::new(Shifting(Box::new(engine))) as Box<dyn DeviceEngine>)
    });
    let checks =
        crate::diagnostics::check_training_on_one_rank(&device, timeout, garbling).unwrap();
    for (name, check) in &checks {
        assert!(!check.passed(), "{name}: {check:?}");
    }
}

#[test]
fn wire_types_ids_and_buffer_ranges() {
    assert_eq!(wire_type(DType::F32), Ok(WireType::F32));
    assert_eq!(wire_type(DType::BF16).unwrap().bytes(), 2);
    assert_eq!(wire_type(DType::F16).unwrap().bytes(), 2);
    assert_eq!(wire_type(DType::F64).unwrap().bytes(), 8);
    let err = wire_type(DType::I32).unwrap_err();
    assert!(err.contains("ACCELERATE_GRADIENT_TRANSPORT=host"), "{err}");
    assert!(group_id(&[7u8; 128]).is_ok());
    assert!(group_id(&[7u8; 64]).unwrap_err().contains("64 bytes"));
    // 1000 f32 values: 4000 bytes; an allocator rounds buffers up, never down.
    assert!(check_range(4000, 4096, 4000).is_ok());
    let err = check_range(4000, 4096, 3996).unwrap_err();
    assert!(err.contains("destination buffer holds 3996 bytes"), "{err}");
}

/// What the library's lifecycle says of one rank's communicators, in order, `(which, what)`: 0 for its
/// connection to the group (rank `rank` there), 1 for its split child (rank `child` in its sub-group).
fn lifecycle_of(library: &HostLibrary, rank: usize, child: usize) -> Vec<(usize, &'static str)> {
    let log = library.lifecycle.lock().unwrap();
    // A group's id is 128 bytes; a child's adds which split and its colour.
    log.iter()
        .filter_map(|(id, r, what)| match id.len() > 128 {
            false if *r == rank => Some((0, *what)),
            true if *r == child => Some((1, *what)),
            _ => None,
        })
        .collect()
}

/// NCCL writes a non-blocking split's child handle only when the parent leaves `ncclInProgress` (NVIDIA/nccl
/// issue 1472): the double does too, and the split polls the parent, then the child, within one budget. Before,
/// it polled the child alone and met a null communicator.
#[test]
fn a_split_child_has_no_handle_until_its_parent_is_polled() {
    let library = HostLibrary::default();
    let parent = library.connect(&library.new_id().unwrap(), 0, 1).unwrap();
    assert_eq!(parent.poll(), Ok(true));
    let child = parent.split(0, 0, 1).unwrap();
    let early = child.poll().unwrap_err();
    assert!(early.contains("NULL communicator"), "{early}");
    let busy = parent
        .start(DeviceCall::Broadcast {
            flat: Tensor::<1>::ones([1], &Default::default()),
            root: 0,
        })
        .unwrap_err();
    assert!(busy.contains("still in progress"), "{busy}");
    assert_eq!(parent.poll(), Ok(true), "the parent completes the split");
    assert_eq!(child.poll(), Ok(true), "then the child has formed");

    // Through the transport, on 4 ranks split in two sub-groups: every sum is its sub-group's.
    let library = HostLibrary::default();
    let results = on_ranks(
        4,
        &library,
        (false, Duration::from_secs(20)),
        |acc, comm| {
            let rank = acc.process_index();
            let group = acc.group_arc();
            let sub = comm.on_group(Arc::new(group.split(rank % 2, rank)?))?;
            let t = Tensor::<1>::from_floats([rank as f32], acc.device());
            let sum = sub
                .all_reduce(t, Reduction::Op(ReduceOp::Sum), "sub sum")?
                .wait()?;
            Ok(sum.into_data().try_to_vec::<f32>().unwrap())
        },
    );
    for (rank, sum) in results.into_iter().enumerate() {
        let expected = if rank % 2 == 0 { 2.0 } else { 4.0 };
        assert_eq!(sum.unwrap(), vec![expected], "rank {rank}");
    }
}

/// A split that fails on one rank fails on every rank at once; each rank aborts its child, then the parent
/// (NCCL's order), and the parent is refused from then on, with no call on a freed communicator.
#[test]
fn a_failed_split_aborts_the_child_then_the_parent_on_every_rank() {
    let library = HostLibrary {
        fail_split: Some(1),
        ..Default::default()
    };
    let uses_after_abort = library.uses_after_abort.clone();
    let results = on_ranks(
        3,
        &library,
        (false, Duration::from_secs(20)),
        |acc, comm| {
            let rank = acc.process_index();
            let group = acc.group_arc();
            let split = comm
                .on_group(Arc::new(group.split(rank % 2, rank)?))
                .map(|_| ())
                .map_err(|e| e.to_string());
            let after = comm
                .all_reduce(
                    Tensor::<1>::ones([2], acc.device()),
                    Reduction::Op(ReduceOp::Sum),
                    "after",
                )
                .map(|_| ())
                .map_err(|e| e.to_string());
            Ok((split, after))
        },
    );
    for (rank, outcome) in results.into_iter().enumerate() {
        let (split, after) = outcome.unwrap();
        let split = split.unwrap_err();
        assert!(
            split.contains("could not split") || split.contains("rank 1"),
            "rank {rank}: {split}"
        );
        let after = after.unwrap_err();
        assert!(after.contains("aborted"), "rank {rank}: {after}");
        let expected = match rank {
            1 => vec![(0, "abort")],
            _ => vec![(1, "abort"), (0, "abort")],
        };
        // Rank 1 made no child; ranks 0 and 2 are ranks 0 and 1 of their sub-group.
        let child = if rank == 1 { usize::MAX } else { rank / 2 };
        assert_eq!(lifecycle_of(&library, rank, child), expected, "rank {rank}");
    }
    assert_eq!(uses_after_abort.load(Ordering::Relaxed), 0);
}

/// A normal end finalizes each connection (polled) and then destroys it, children and parents alike, with no
/// abort that could cut a peer's traffic; a connection that timed out is aborted and never finalized.
#[test]
fn a_normal_end_finalizes_then_destroys_and_a_failed_one_only_aborts() {
    let library = HostLibrary::default();
    let results = on_ranks(
        2,
        &library,
        (false, Duration::from_secs(20)),
        |acc, comm| {
            let group = acc.group_arc();
            let sub = comm.on_group(Arc::new(group.split(0, acc.process_index())?))?;
            for c in [&comm, &sub] {
                c.all_reduce(
                    Tensor::<1>::ones([3], acc.device()),
                    Reduction::Op(ReduceOp::Sum),
                    "sum",
                )?
                .wait()?;
            }
            Ok(())
        },
    );
    for (rank, outcome) in results.into_iter().enumerate() {
        outcome.unwrap();
        let mut ends = lifecycle_of(&library, rank, rank);
        ends.sort();
        assert_eq!(
            ends,
            vec![
                (0, "destroy"),
                (0, "finalize"),
                (1, "destroy"),
                (1, "finalize")
            ],
            "rank {rank}"
        );
        let log = lifecycle_of(&library, rank, rank);
        for which in [0, 1] {
            let at = |what| log.iter().position(|e| *e == (which, what));
            assert!(at("finalize") < at("destroy"), "rank {rank}: {log:?}");
        }
    }
    let library = HostLibrary {
        hang_rank: Some(1),
        ..Default::default()
    };
    let results = average_on_ranks(
        2,
        library.clone(),
        Duration::from_millis(300),
        (false, 1),
        |_| vec![1.0; 4],
    );
    assert!(results[0][0].is_err());
    assert_eq!(lifecycle_of(&library, 0, 0), vec![(0, "abort")]);
}

/// A batch of messages refused at its second call (an `ncclSend` NCCL rejects): the first went out, the batch's
/// buffers stay with the communicator until its abort returned (the library may still write them), the failing
/// rank names the call, and its peer ends with the abort's error rather than waiting for the timeout or reading
/// a mismatched batch.
#[test]
fn a_batch_refused_part_way_keeps_its_buffers_until_the_abort_and_every_rank_ends() {
    let library = HostLibrary {
        fail_message: Some((0, 1)),
        ..Default::default()
    };
    let uses_after_abort = library.uses_after_abort.clone();
    let started = std::time::Instant::now();
    let results = on_ranks(
        2,
        &library,
        (false, Duration::from_secs(20)),
        |acc, comm| {
            let peer = 1 - acc.process_index();
            let t = |v: f32| Tensor::<1>::from_floats([v, v], acc.device());
            let recvs = (0..2).map(|_| Incoming::like(peer, 2, &t(0.0))).collect();
            Ok(comm
                .send_recv(vec![(peer, t(1.0)), (peer, t(2.0))], recvs, "batch")
                .and_then(|p| p.wait())
                .map(|_| ())
                .map_err(|e| e.to_string()))
        },
    );
    let errors: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap().unwrap_err())
        .collect();
    assert!(
        errors[0].contains("ncclSend of 2 values to rank 1 (call 1 of the batch)"),
        "{errors:?}"
    );
    assert!(errors[1].contains("aborted"), "{errors:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "no rank waited for the timeout"
    );
    assert_eq!(
        lifecycle_of(&library, 0, 0),
        vec![(0, "abort"), (0, "released")]
    );
    assert_eq!(uses_after_abort.load(Ordering::Relaxed), 0);
}

/// `close` ends a connection as a drop does, and says how it went: finalized, then destroyed.
#[test]
fn close_reports_a_normal_end() {
    let library = HostLibrary::default();
    let results = on_ranks(1, &library, (false, Duration::from_secs(20)), |acc, _| {
        let engine =
            DeviceCollectives::connect(acc.group_arc(), &library, Duration::from_secs(20))?;
        engine.close()
    });
    results.into_iter().for_each(|r| r.unwrap());
    // The transport `on_ranks` made ends too: both connections of rank 0, each finalized before it is destroyed.
    let log = lifecycle_of(&library, 0, 0);
    assert_eq!(
        log.iter().filter(|e| e.1 == "finalize").count(),
        2,
        "{log:?}"
    );
    assert_eq!(
        log.iter().filter(|e| e.1 == "destroy").count(),
        2,
        "{log:?}"
    );
    assert!(!log.iter().any(|e| e.1 == "abort"), "{log:?}");
}
