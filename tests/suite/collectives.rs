//! Collectives on 2, 3 and 4 in-process ranks (and 1, where each returns its input), plus the failure modes:
//! shape mismatch in debug mode, a rank that skips a collective, a rank that panics.

use crate::suite;

use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn_accelerate::{Accelerator, Error, ReduceOp, launch};

#[test]
fn suite_on_1_2_3_4_ranks() {
    for n in [1, 2, 3, 4] {
        launch(n, |acc| suite::run_all(&acc)).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
    }
}

#[test]
fn suite_in_debug_mode() {
    Accelerator::builder()
        .debug(true)
        .launch(3, |acc| suite::run_all(&acc))
        .unwrap();
}

#[test]
fn debug_mode_shape_mismatch_is_reported_on_every_rank() {
    let errors = Accelerator::builder()
        .debug(true)
        .launch(3, |acc| {
            let shape = if acc.process_index() == 0 {
                [1, 5]
            } else {
                [1, 6]
            };
            let t = Tensor::<2>::zeros(shape, acc.device());
            let errors = [
                acc.reduce(t.clone(), ReduceOp::Sum)
                    .unwrap_err()
                    .to_string(),
                acc.broadcast(t.clone(), 0).unwrap_err().to_string(),
                acc.gather(t).unwrap_err().to_string(),
            ];
            Ok(errors)
        })
        .unwrap();
    for rank_errors in errors {
        assert_eq!(
            rank_errors[0],
            "Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid.\n\n\
             Operation: `burn_accelerate::distributed::collectives::reduce`\nInput shapes:\n  - Process 0: [1, 5]\n  - Process 1: [1, 6]\n  \
             - Process 2: [1, 6]"
        );
        assert!(
            rank_errors[1]
                .contains("Operation: `burn_accelerate::distributed::collectives::broadcast`")
        );
        assert!(
            rank_errors[2]
                .contains("Operation: `burn_accelerate::distributed::collectives::gather`")
        );
    }
}

#[test]
fn gather_shape_mismatch_without_debug_mode_is_an_error_not_a_hang() {
    let errors = launch(2, |acc| {
        let t = Tensor::<2>::zeros([2, 3 + acc.process_index()], acc.device());
        Ok(acc.gather(t).unwrap_err().to_string())
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("Process 0: [2, 3]") && e.contains("Process 1: [2, 4]"),
            "{e}"
        );
    }
}

#[test]
fn a_rank_that_skips_a_collective_is_named_in_a_timeout() {
    let timeout = Duration::from_millis(500);
    let reported = std::sync::atomic::AtomicUsize::new(0);
    let results = Accelerator::builder()
        .collective_timeout(timeout)
        .launch(3, |acc| {
            if acc.process_index() == 2 {
                // Returns only once both others have their error: they can only have been released by their
                // timeout, however loaded the machine (the deadline only keeps a broken build from hanging).
                let deadline = Instant::now() + Duration::from_secs(120);
                while reported.load(std::sync::atomic::Ordering::SeqCst) < 2
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return Ok(None);
            }
            let start = Instant::now();
            let err = acc
                .reduce(Tensor::<1>::ones([4], acc.device()), ReduceOp::Sum)
                .unwrap_err();
            let elapsed = start.elapsed();
            reported.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Some((err, elapsed)))
        })
        .unwrap();
    let waited: Vec<_> = results.into_iter().flatten().collect();
    assert_eq!(waited.len(), 2, "ranks 0 and 1 both report");
    for (err, elapsed) in waited {
        let text = err.to_string();
        assert!(text.contains("rank(s) [2] did not arrive"), "{text}");
        assert!(text.contains("all_reduce"), "{text}");
        // Released by the timeout (never before it), while rank 2 was still away.
        assert!(elapsed >= timeout, "{elapsed:?}");
    }
}

#[test]
fn a_panicking_rank_does_not_hang_the_others() {
    let start = Instant::now();
    let others = std::sync::Mutex::new(Vec::new());
    let err = Accelerator::builder()
        .collective_timeout(Duration::from_secs(60))
        .launch(3, |acc| {
            if acc.process_index() == 1 {
                panic!("rank one gives up");
            }
            let waited = acc.wait_for_everyone();
            others.lock().unwrap().push((acc.process_index(), waited));
            Ok(())
        })
        .unwrap_err();
    // Ranks 0 and 2 were released with an error naming rank 1, not left waiting.
    let mut others = others.into_inner().unwrap();
    others.sort_by_key(|(rank, _)| *rank);
    assert_eq!(others.len(), 2);
    for (rank, waited) in others {
        let e = waited.expect_err("no barrier can pass without rank 1");
        assert!(e.to_string().contains("rank 1"), "rank {rank}: {e}");
    }
    // Released by the panic's notice, well before the 60 s collective timeout could have released them (a
    // bound no loaded machine comes near: these ranks take milliseconds).
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    match err {
        Error::RankPanicked { rank, message } => {
            assert_eq!(rank, 1);
            assert_eq!(message, "rank one gives up");
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn an_erroring_rank_is_the_reported_cause() {
    let other = std::sync::Mutex::new(None);
    let err = launch(2, |acc| {
        if acc.process_index() == 0 {
            return Err(Error::InvalidArgument("bad data on rank 0".into()));
        }
        let waited = acc.wait_for_everyone();
        *other.lock().unwrap() = Some(waited.as_ref().map_err(|e| e.to_string()).err());
        waited
    })
    .unwrap_err();
    assert_eq!(err.to_string(), "bad data on rank 0");
    // Rank 1 got an error of its own, naming rank 0, rather than waiting for it.
    let other = other.into_inner().unwrap().expect("rank 1 ran");
    let other = other.expect("rank 1's barrier fails without rank 0");
    assert!(other.contains("rank 0"), "rank 1: {other}");
}

#[test]
fn ranks_know_who_they_are() {
    let facts = launch(4, |acc| {
        Ok((
            acc.process_index(),
            acc.num_processes(),
            acc.is_main_process(),
            acc.is_last_process(),
            acc.distributed_type().as_str(),
        ))
    })
    .unwrap();
    let expected: Vec<_> = (0..4)
        .map(|rank| (rank, 4, rank == 0, rank == 3, "MULTI_CPU"))
        .collect();
    assert_eq!(facts, expected);
    let order = std::sync::Mutex::new(Vec::new());
    launch(3, |acc| {
        acc.main_process_first(|| order.lock().unwrap().push(acc.process_index()))
    })
    .unwrap();
    let order = order.into_inner().unwrap();
    assert_eq!(order.len(), 3, "{order:?}");
    assert_eq!(order[0], 0, "the main process runs first: {order:?}");
    let mut rest = order[1..].to_vec();
    rest.sort();
    assert_eq!(rest, vec![1, 2], "then every other rank once: {order:?}");
}

#[test]
fn broadcast_from_an_invalid_rank_is_an_error() {
    let errors = launch(2, |acc| {
        Ok(acc
            .broadcast(Tensor::<1>::ones([1], acc.device()), 5)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for (rank, error) in errors.iter().enumerate() {
        assert!(error.contains("rank 5"), "rank {rank}: {error}");
    }
}

#[test]
fn debug_mode_checks_gradient_all_reduces_too() {
    // Rank 0 averages its 4 gradients while rank 1 reduces a tensor of 4 floats: the engine alone cannot tell
    // them apart (same kind, same length); debug mode names both operations on both ranks.
    use burn::nn::{Linear, LinearConfig};
    let errors = Accelerator::builder()
        .debug(true)
        .launch(2, |acc| {
            let model: Linear = acc.prepare_model(LinearConfig::new(3, 1).init(acc.device()))?;
            let err = if acc.process_index() == 0 {
                let loss = model.forward(Tensor::<2>::ones([2, 3], acc.device())).sum();
                acc.backward(loss, &model).unwrap_err()
            } else {
                acc.reduce(Tensor::<1>::zeros([4], acc.device()), ReduceOp::Sum)
                    .unwrap_err()
            };
            Ok(err.to_string())
        })
        .unwrap();
    for error in errors {
        assert!(
            error
                .contains("rank 0: burn_accelerate::distributed::collectives::gradient_all_reduce")
                && error.contains("rank 1: burn_accelerate::distributed::collectives::reduce"),
            "{error}"
        );
    }
}
