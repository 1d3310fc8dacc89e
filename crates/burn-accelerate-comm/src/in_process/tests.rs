//! Tests of the in-process engine.

use super::*;
use std::thread;

fn run<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(InProcessComm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let group = InProcessGroup::new(n, timeout);
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (comm, f) = (group.comm(r), f.clone());
            thread::spawn(move || f(comm))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn split_makes_sub_groups_by_color_ordered_by_key_that_name_world_ranks() {
    // 6 ranks: colors by rank % 2 (a replicate x shard mesh's columns), keys reversing the order.
    let out = run(6, Duration::from_secs(10), |c| {
        let rank = c.rank();
        let sub = c.split(rank % 2, 10 - rank).unwrap();
        let sum = sub
            .all_reduce(ReduceBuffer::I64(vec![rank as i64]), ReduceOp::Sum)
            .unwrap();
        // The world keeps its own sequence: a world collective after the sub-group's works.
        let world = c
            .all_reduce(ReduceBuffer::I64(vec![1]), ReduceOp::Sum)
            .unwrap();
        (sub.rank(), sub.world_size(), sum, world)
    });
    let expected_rank = [2, 2, 1, 1, 0, 0];
    for (rank, (sub_rank, size, sum, world)) in out.into_iter().enumerate() {
        assert_eq!((sub_rank, size), (expected_rank[rank], 3), "rank {rank}");
        // Ranks 0, 2, 4 and ranks 1, 3, 5.
        let members_sum = if rank % 2 == 0 { 6 } else { 9 };
        assert_eq!(sum, ReduceBuffer::I64(vec![members_sum]), "rank {rank}");
        assert_eq!(world, ReduceBuffer::I64(vec![6]));
    }
    // A sub-group's timeout names the world ranks missing; a world rank's failure reaches the sub-groups.
    let out = run(4, Duration::from_millis(300), |c| {
        let rank = c.rank();
        let sub = c.split(rank / 2, rank).unwrap();
        if rank == 3 {
            return "absent".to_string();
        }
        match sub.barrier() {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        }
    });
    assert_eq!(out[0], "ok", "ranks 0 and 1 form their own group");
    assert_eq!(out[1], "ok");
    assert!(
        out[2].contains("on rank 2") && out[2].contains("[3]"),
        "{}",
        out[2]
    );
}

#[test]
fn large_all_reduces_match_the_reference_for_every_op_and_kind() {
    // Values that make the order of a float sum matter, so a rank reducing in another order would show.
    let value = |rank: usize, i: usize| {
        ((rank * 7919 + i * 104_729) % 1000) as f64 * 1.37e-3 + 1e4 * (i % 3) as f64
    };
    for n in [2, 3, 5] {
        let len = SPLIT_REDUCE_MIN * 2 + 7;
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            for kind in ["f32", "f64", "i64"] {
                let make = move |rank: usize| match kind {
                    "f32" => ReduceBuffer::F32((0..len).map(|i| value(rank, i) as f32).collect()),
                    "f64" => ReduceBuffer::F64((0..len).map(|i| value(rank, i)).collect()),
                    _ => ReduceBuffer::I64((0..len).map(|i| value(rank, i) as i64 - 500).collect()),
                };
                let inputs: Vec<ReduceBuffer> = (0..n).map(make).collect();
                let refs: Vec<&ReduceBuffer> = inputs.iter().collect();
                let expected = reduce_range(&refs, 0..len, op);
                let out = run(n, Duration::from_secs(10), move |c| {
                    c.all_reduce(make(c.rank()), op).unwrap()
                });
                for (rank, got) in out.iter().enumerate() {
                    // Bit for bit (NaN-free inputs), on every rank.
                    assert!(*got == expected, "n={n} {op} {kind}: rank {rank} differs");
                }
            }
        }
    }
}

/// Rank `r`'s value at `i`: small integers, so that sums are exact whatever the order.
fn value(r: usize, i: usize) -> f32 {
    ((i * 7 + r * 13) % 29) as f32 - 14.0
}

#[test]
fn reduce_scatters_give_each_rank_its_part_of_the_all_reduce() {
    for n in [1, 2, 3, 4] {
        for counts in [vec![5; n], (0..n).map(|r| 3 * r + 1).collect(), {
            // One empty part, and one past the in-place all-reduce threshold.
            let mut c = vec![0; n];
            c[n - 1] = SPLIT_REDUCE_MIN + 3;
            c
        }] {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                let len: usize = counts.iter().sum();
                let parts = counts.clone();
                let out = run(n, Duration::from_secs(10), move |c| {
                    let mine: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                    let whole = c.all_reduce(ReduceBuffer::F32(mine.clone()), op).unwrap();
                    let part = c
                        .reduce_scatter(ReduceBuffer::F32(mine), &parts, op)
                        .unwrap();
                    let ints: Vec<i64> = (0..len).map(|i| value(c.rank(), i) as i64).collect();
                    let int_part = c
                        .reduce_scatter(ReduceBuffer::I64(ints), &parts, op)
                        .unwrap();
                    (whole, part, int_part)
                });
                let mut start = 0;
                for (r, (whole, part, int_part)) in out.into_iter().enumerate() {
                    let range = start..start + counts[r];
                    start = range.end;
                    assert_eq!(
                        part,
                        whole.slice(range.clone()),
                        "n={n} {counts:?} {op} rank {r}"
                    );
                    let expected: Vec<i64> = match whole.slice(range) {
                        ReduceBuffer::F32(v) => v.iter().map(|x| *x as i64).collect(),
                        _ => unreachable!(),
                    };
                    if op != ReduceOp::Mean {
                        assert_eq!(int_part, ReduceBuffer::I64(expected), "n={n} {op} rank {r}");
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatters_with_other_parts_or_a_wrong_split_fail_on_every_rank() {
    let out = run(3, Duration::from_secs(10), |c| {
        let counts = if c.rank() == 2 { [2, 2, 2] } else { [1, 2, 3] };
        c.reduce_scatter(ReduceBuffer::F32(vec![1.0; 6]), &counts, ReduceOp::Sum)
            .unwrap_err()
            .to_string()
    });
    for message in &out {
        assert!(message.contains("incompatible inputs"), "{message}");
        assert!(
            message.contains("rank 2: reduce_scatter (sum) of 6 x f32 into [2, 2, 2]"),
            "{message}"
        );
    }
    let out = run(2, Duration::from_secs(10), |c| {
        c.reduce_scatter(ReduceBuffer::F32(vec![1.0; 6]), &[1, 2], ReduceOp::Sum)
            .unwrap_err()
            .to_string()
    });
    for message in &out {
        assert!(
            message.contains("2 part counts summing to 3 for 2 ranks and a buffer of 6"),
            "{message}"
        );
    }
    // Another collective on one rank is named as such.
    let out = run(2, Duration::from_secs(10), |c| {
        if c.rank() == 0 {
            c.barrier().map(|_| ()).unwrap_err().to_string()
        } else {
            c.reduce_scatter(ReduceBuffer::F32(vec![1.0; 2]), &[1, 1], ReduceOp::Sum)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        }
    });
    for message in &out {
        assert!(
            message.contains("ranks called different collectives"),
            "{message}"
        );
    }
}

#[test]
fn all_gathers_of_parts_concatenate_every_ranks_part_in_rank_order() {
    for n in [1, 2, 3, 4] {
        for counts in [vec![4; n], (0..n).map(|r| 2 * r + 1).collect(), {
            let mut c = vec![0; n];
            c[n - 1] = 7;
            c
        }] {
            let parts = counts.clone();
            let out = run(n, Duration::from_secs(10), move |c| {
                let mine: Vec<f32> = (0..parts[c.rank()]).map(|i| value(c.rank(), i)).collect();
                let ints: Vec<i64> = mine.iter().map(|x| *x as i64).collect();
                let f = c.all_gather_parts(ReduceBuffer::F32(mine), &parts).unwrap();
                let i = c.all_gather_parts(ReduceBuffer::I64(ints), &parts).unwrap();
                (f, i)
            });
            let expected: Vec<f32> = counts
                .iter()
                .enumerate()
                .flat_map(|(r, c)| (0..*c).map(move |i| value(r, i)))
                .collect();
            for (r, (f, i)) in out.into_iter().enumerate() {
                assert_eq!(
                    f,
                    ReduceBuffer::F32(expected.clone()),
                    "n={n} {counts:?} rank {r}"
                );
                let ints = expected.iter().map(|x| *x as i64).collect();
                assert_eq!(i, ReduceBuffer::I64(ints), "n={n} {counts:?} rank {r}");
            }
        }
    }
}

#[test]
fn rooted_reduces_and_typed_broadcasts_match_the_all_reduce_and_the_root() {
    for n in [1, 2, 3, 4] {
        for len in [0, 5, SPLIT_REDUCE_MIN + 3] {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                let root = n - 1;
                let out = run(n, Duration::from_secs(10), move |c| {
                    let mine: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                    let whole = c.all_reduce(ReduceBuffer::F32(mine.clone()), op).unwrap();
                    let reduced = c.reduce(ReduceBuffer::F32(mine.clone()), root, op).unwrap();
                    let sent = c.broadcast_buffer(ReduceBuffer::F32(mine), root).unwrap();
                    let ints: Vec<i64> = (0..len).map(|i| value(c.rank(), i) as i64).collect();
                    let int_sent = c.broadcast_buffer(ReduceBuffer::I64(ints), 0).unwrap();
                    (whole, reduced, sent, int_sent)
                });
                let root_values = ReduceBuffer::F32((0..len).map(|i| value(root, i)).collect());
                let first_ints = ReduceBuffer::I64((0..len).map(|i| value(0, i) as i64).collect());
                for (r, (whole, reduced, sent, int_sent)) in out.into_iter().enumerate() {
                    let expected = (r == root).then(|| whole.clone());
                    assert_eq!(
                        reduced, expected,
                        "n={n} len={len} {op} rank {r}: the same bits"
                    );
                    assert_eq!(sent, root_values, "n={n} len={len} rank {r}");
                    assert_eq!(int_sent, first_ints, "n={n} len={len} rank {r}");
                }
            }
        }
    }
    // Ranks that disagree on the root or the length all get an error naming each rank's call.
    let out = run(2, Duration::from_secs(10), |c| {
        let root = c.rank();
        c.reduce(ReduceBuffer::F32(vec![1.0; 4]), root, ReduceOp::Sum)
            .unwrap_err()
            .to_string()
    });
    for message in &out {
        assert!(
            message.contains("rank 1: reduce of 4 x f32 from rank 1"),
            "{message}"
        );
    }
    let out = run(2, Duration::from_secs(10), |c| {
        let len = 3 + c.rank();
        c.broadcast_buffer(ReduceBuffer::F32(vec![1.0; len]), 0)
            .unwrap_err()
            .to_string()
    });
    for message in &out {
        assert!(
            message.contains("rank 1: broadcast_buffer of 4 x f32"),
            "{message}"
        );
    }
}

#[test]
fn all_gathers_of_parts_that_disagree_fail_on_every_rank() {
    let out = run(3, Duration::from_secs(10), |c| {
        let counts = if c.rank() == 2 { [2, 2, 2] } else { [1, 2, 2] };
        c.all_gather_parts(ReduceBuffer::F32(vec![1.0; counts[c.rank()]]), &counts)
            .unwrap_err()
            .to_string()
    });
    for message in &out {
        assert!(message.contains("incompatible inputs"), "{message}");
        assert!(
            message.contains("rank 2: all_gather_parts of f32 parts [2, 2, 2]"),
            "{message}"
        );
    }
    let out = run(2, Duration::from_secs(10), |c| {
        let len = if c.rank() == 1 { 3 } else { 1 };
        c.all_gather_parts(ReduceBuffer::F32(vec![1.0; len]), &[1, 2])
            .unwrap_err()
            .to_string()
    });
    for message in &out {
        assert!(message.contains("rank 1 passed 3 elements"), "{message}");
    }
}

#[test]
fn all_reduces_of_different_lengths_fail_on_every_rank() {
    // Both lengths large, and one on each side of the in-place threshold.
    for base in [SPLIT_REDUCE_MIN, SPLIT_REDUCE_MIN - 1] {
        let out = run(3, Duration::from_secs(10), move |c| {
            let len = base + if c.rank() == 1 { 1 } else { 0 };
            c.all_reduce(ReduceBuffer::F32(vec![1.0; len]), ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        for message in out {
            assert!(
                message.contains(&format!("rank 1: {} x f32", base + 1)),
                "{message}"
            );
        }
    }
}

#[test]
fn a_group_without_a_time_limit_still_exchanges() {
    // Duration::MAX used to overflow the deadline computation.
    let out = run(2, Duration::MAX, |c| {
        c.all_gather(vec![c.rank() as u8]).unwrap()
    });
    assert_eq!(out, vec![vec![vec![0], vec![1]]; 2]);
}

#[test]
fn all_reduce_small_and_split() {
    for n in [2, 3, 4] {
        for len in [5, SPLIT_REDUCE_MIN + 3] {
            let out = run(n, Duration::from_secs(10), move |c| {
                let r = c.rank() as f32;
                let data = (0..len).map(|i| r + i as f32).collect();
                c.all_reduce(ReduceBuffer::F32(data), ReduceOp::Sum)
                    .unwrap()
            });
            let ranks: f32 = (0..n).map(|r| r as f32).sum();
            for b in out {
                let ReduceBuffer::F32(v) = b else { panic!() };
                assert_eq!(v.len(), len);
                for (i, x) in v.iter().enumerate() {
                    assert_eq!(*x, ranks + n as f32 * i as f32);
                }
            }
        }
    }
}

#[test]
fn gather_and_broadcast_bytes() {
    let out = run(3, Duration::from_secs(10), |c| {
        let mine = vec![c.rank() as u8; c.rank() + 1];
        let gathered = c.all_gather(mine).unwrap();
        let b = c.broadcast(vec![9, c.rank() as u8], 2).unwrap();
        (gathered, b)
    });
    for (gathered, b) in out {
        assert_eq!(gathered, vec![vec![0], vec![1, 1], vec![2, 2, 2]]);
        assert_eq!(b, vec![9, 2]);
    }
}

#[test]
fn skipped_collective_times_out_naming_the_rank() {
    let timeout = Duration::from_millis(300);
    // The skipper stays away long enough that the others can only have been released by their timeout,
    // with room for a loaded machine.
    let away = Duration::from_secs(3);
    let out = run(3, timeout, move |c| {
        if c.rank() == 1 {
            thread::sleep(away);
            return None;
        }
        let start = Instant::now();
        let err = c.barrier().unwrap_err();
        Some((err, start.elapsed()))
    });
    let waited: Vec<_> = out.into_iter().flatten().collect();
    assert_eq!(waited.len(), 2, "ranks 0 and 2 both report");
    for (err, elapsed) in waited {
        match &err {
            Error::Timeout { missing, .. } => assert_eq!(missing, &vec![1]),
            other => panic!("unexpected {other}"),
        }
        assert!(
            err.to_string().contains("rank(s) [1] did not arrive"),
            "{err}"
        );
        assert!(elapsed >= timeout && elapsed < away, "{elapsed:?}");
    }
}

#[test]
fn different_collectives_are_an_error_on_every_rank() {
    let out = run(2, Duration::from_secs(5), |c| {
        if c.rank() == 0 {
            c.barrier().map(|_| ())
        } else {
            c.all_gather(vec![1]).map(|_| ())
        }
    });
    for r in out {
        let err = r.unwrap_err().to_string();
        assert!(err.contains("rank 0: barrier, rank 1: all_gather"), "{err}");
    }
}

#[test]
fn failed_and_departed_ranks_release_the_others() {
    let group = InProcessGroup::new(3, Duration::from_secs(30));
    let waiter = {
        let comm = group.comm(0);
        thread::spawn(move || comm.barrier())
    };
    thread::sleep(Duration::from_millis(50));
    group.leave(2, "finished");
    let err = waiter.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("rank 2 finished without joining it"), "{err}");

    let group = InProcessGroup::new(2, Duration::from_secs(30));
    let waiter = {
        let comm = group.comm(0);
        thread::spawn(move || comm.all_gather(vec![]))
    };
    thread::sleep(Duration::from_millis(50));
    group.fail(1, "panicked: boom");
    let err = waiter.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("rank 1 panicked: boom"), "{err}");
}

#[test]
fn a_receive_without_a_send_times_out_naming_the_peer_and_a_departed_peer_releases_it() {
    let timeout = Duration::from_millis(300);
    let out = run(3, timeout, |c| {
        // Rank 2 sends to rank 0 only; rank 0 also waits for rank 1, which never sends.
        match c.rank() {
            0 => {
                let start = Instant::now();
                let err = c
                    .send_recv(
                        vec![],
                        vec![
                            (2, ReduceBuffer::F32(vec![0.0; 2])),
                            (1, ReduceBuffer::F32(vec![0.0; 2])),
                        ],
                    )
                    .unwrap_err();
                Some((err, start.elapsed()))
            }
            2 => {
                c.send_recv(vec![(0, ReduceBuffer::F32(vec![1.0; 2]))], vec![])
                    .unwrap();
                None
            }
            _ => None,
        }
    });
    let (err, elapsed) = out.into_iter().flatten().next().unwrap();
    match &err {
        Error::PeerTimeout { waiting_for, .. } => assert_eq!(waiting_for, &vec![1]),
        other => panic!("unexpected {other}"),
    }
    assert!(
        err.to_string().contains("nothing arrived from rank(s) [1]"),
        "{err}"
    );
    assert!(elapsed >= timeout, "{elapsed:?}");

    let group = InProcessGroup::new(2, Duration::from_secs(30));
    let waiter = {
        let comm = group.comm(0);
        thread::spawn(move || comm.send_recv(vec![], vec![(1, ReduceBuffer::I64(vec![0]))]))
    };
    thread::sleep(Duration::from_millis(50));
    group.leave(1, "finished");
    let err = waiter.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("rank 1 finished without sending"), "{err}");
}

#[test]
fn sends_never_wait_and_peers_outside_the_group_are_refused() {
    // Every rank sends to every rank before anyone receives: no rendezvous, no deadlock.
    let out = run(4, Duration::from_secs(10), |c| {
        let r = c.rank();
        let sends = (0..4)
            .map(|p| (p, ReduceBuffer::I64(vec![(r * 10 + p) as i64])))
            .collect();
        let recvs = (0..4).map(|p| (p, ReduceBuffer::I64(vec![0]))).collect();
        c.send_recv(sends, recvs).unwrap()
    });
    for (r, got) in out.into_iter().enumerate() {
        let expected: Vec<ReduceBuffer> = (0..4)
            .map(|p| ReduceBuffer::I64(vec![(p * 10 + r) as i64]))
            .collect();
        assert_eq!(got, expected, "rank {r}");
    }
    let group = InProcessGroup::new(2, Duration::from_secs(1));
    let err = group
        .comm(0)
        .send_recv(vec![(2, ReduceBuffer::F32(vec![]))], vec![])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 2, but the group has ranks 0..2"),
        "{err}"
    );
}

#[test]
fn shared_values_pass_as_they_are_in_rounds_and_mailboxes_and_a_departed_peer_stops_the_wait() {
    let out = run(3, Duration::from_secs(10), |c| {
        let rank = c.rank();
        assert!(c.shares_memory());
        let mine: SharedValue = Arc::new(vec![rank as f32; 4]);
        let all = c.share("share", mine.clone()).unwrap();
        // The very values, not copies.
        assert!(Arc::ptr_eq(&all[rank], &mine));
        let sums: Vec<f32> = all
            .iter()
            .map(|v| v.downcast_ref::<Vec<f32>>().unwrap()[0])
            .collect();
        // A ring: each sends to the next and receives from the previous, in one batch.
        let (next, previous) = ((rank + 1) % 3, (rank + 2) % 3);
        let got = c
            .send_recv_shared(vec![(next, Arc::new(rank))], vec![previous])
            .unwrap();
        let from = *got[0].downcast_ref::<usize>().unwrap();
        // A buffer where a shared value is expected is an error on the receiving rank.
        let mismatch = if rank == 0 {
            c.send_recv(vec![(1, ReduceBuffer::F32(vec![1.0]))], vec![])
                .map(|_| String::new())
                .unwrap_or_else(|e| e.to_string())
        } else if rank == 1 {
            c.send_recv_shared(vec![], vec![0])
                .map(|_| String::new())
                .unwrap_or_else(|e| e.to_string())
        } else {
            String::new()
        };
        (sums, from, mismatch)
    });
    for (rank, (sums, from, mismatch)) in out.into_iter().enumerate() {
        assert_eq!(sums, vec![0.0, 1.0, 2.0]);
        assert_eq!(from, (rank + 2) % 3);
        if rank == 1 {
            assert!(mismatch.contains("rank 0 sent 1 x f32"), "{mismatch}");
        } else {
            assert!(mismatch.is_empty(), "{mismatch}");
        }
    }
    // A rank that leaves without sharing releases the others with its reason, well before the timeout.
    let group = InProcessGroup::new(2, Duration::from_secs(30));
    let start = Instant::now();
    let waiter = {
        let comm = group.comm(0);
        thread::spawn(move || comm.share("share", Arc::new(())).map(|_| ()))
    };
    thread::sleep(Duration::from_millis(50));
    group.leave(1, "finished");
    let err = waiter.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("rank 1 finished"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}
