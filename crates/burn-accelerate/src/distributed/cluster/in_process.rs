//! In-process launching: `n` ranks as threads of this process, each handed its [`InProcess`] cluster
//! environment (what [`AcceleratorBuilder::launch`](crate::AcceleratorBuilder::launch) builds an accelerator
//! from), with panics caught and the root cause of a failure reported.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use super::InProcess;
use crate::distributed::comm::{Communicator, InProcessGroup};
use crate::error::{Error, Result};

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// How much an error explains a failed launch: a panic first, then a rank's own error, then errors a rank
/// only received because another one failed.
fn root_cause_rank(error: &Error) -> u8 {
    match error {
        Error::RankPanicked { .. } => 0,
        Error::Comm(e)
            if matches!(
                e.root(),
                crate::distributed::comm::CommError::RankFailed { .. }
            ) =>
        {
            2
        }
        _ => 1,
    }
}

/// One compute thread pool per rank, each with its share of the cores (the CPU backends' parallel kernels run
/// in the pool of the thread that calls them), unless the user sized the pools (`RAYON_NUM_THREADS`) or there
/// is one rank.
fn rank_pools(num_processes: usize) -> Option<Vec<rayon::ThreadPool>> {
    if num_processes <= 1 || std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads_per_rank(cores, num_processes);
    log::debug!(
        "{num_processes} in-process ranks on {cores} cores: {threads} compute thread(s) each"
    );
    (0..num_processes)
        .map(|rank| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("rank-{rank}-compute-{i}"))
                .build()
                .ok()
        })
        .collect()
}

/// Each of `ranks` ranks' share of `cores` compute threads (at least one).
fn threads_per_rank(cores: usize, ranks: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

/// Runs `f` on `num_processes` ranks, one thread each, every one given its rank's cluster environment over one
/// in-process group whose collectives give up after `timeout`. Returns every rank's result in rank order, or
/// the error that caused the failure (a panic, or the first rank's own error rather than the errors it caused
/// on the others).
///
/// # Errors
/// `num_processes` is 0, a rank thread cannot be started, or a rank fails.
pub(crate) fn launch_ranks<T, F>(num_processes: usize, timeout: Duration, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(&InProcess) -> Result<T> + Send + Sync,
{
    launch_ranks_over(num_processes, timeout, |comm| comm, f)
}

/// [`launch_ranks`], each rank's communicator passed through `wrap` first (a test double around it, or the
/// transport check's communicator that refuses host buffers).
pub(crate) fn launch_ranks_over<T, F, W>(
    num_processes: usize,
    timeout: Duration,
    wrap: W,
    f: F,
) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(&InProcess) -> Result<T> + Send + Sync,
    W: Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Send + Sync,
{
    if num_processes == 0 {
        return Err(Error::InvalidArgument(
            "launch: num_processes must be at least 1".into(),
        ));
    }
    let group = InProcessGroup::new(num_processes, timeout);
    let pools = rank_pools(num_processes);
    let pools = &pools;
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..num_processes)
            .map(|rank| {
                let (group, f, wrap) = (&group, &f, &wrap);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            let cluster = InProcess::new(wrap(Arc::new(group.comm(rank))));
                            match &pools {
                                Some(pools) => pools[rank].install(|| f(&cluster)),
                                None => f(&cluster),
                            }
                        }));
                        match outcome {
                            Ok(Ok(value)) => {
                                group.leave(rank, "finished");
                                Ok(value)
                            }
                            Ok(Err(error)) => {
                                group.leave(rank, format!("returned an error ({error})"));
                                Err(error)
                            }
                            Err(payload) => {
                                let message = panic_message(payload);
                                group.fail(rank, format!("panicked: {message}"));
                                Err(Error::RankPanicked { rank, message })
                            }
                        }
                    })
                    .map_err(|e| {
                        // The ranks already running would wait for this one: release them now.
                        group.fail(rank, format!("could not start its thread: {e}"));
                        Error::RankPanicked {
                            rank,
                            message: format!("could not start the rank's thread: {e}"),
                        }
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h?.join().unwrap_or_else(|payload| {
                    Err(Error::RankPanicked {
                        rank,
                        message: panic_message(payload),
                    })
                })
            })
            .collect()
    });
    let mut values = Vec::with_capacity(num_processes);
    let mut first_error: Option<Error> = None;
    for result in results {
        match result {
            Ok(v) => values.push(v),
            Err(e) => {
                if first_error
                    .as_ref()
                    .is_none_or(|current| root_cause_rank(&e) < root_cause_rank(current))
                {
                    first_error = Some(e);
                }
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(values),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_computes_on_its_share_of_the_cores() {
        assert_eq!(threads_per_rank(8, 2), 4);
        assert_eq!(threads_per_rank(8, 3), 2);
        assert_eq!(threads_per_rank(2, 4), 1, "never 0");
        let threads = launch_ranks(2, Duration::from_secs(30), |_| {
            Ok(rayon::current_num_threads())
        })
        .unwrap();
        // The unit tests run without RAYON_NUM_THREADS (`tests/support/isolation.rs`).
        assert!(std::env::var_os("RAYON_NUM_THREADS").is_none());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads, vec![threads_per_rank(cores, 2); 2]);
        // One rank keeps the process's own pool.
        let one = launch_ranks(1, Duration::from_secs(30), |_| {
            Ok(rayon::current_num_threads())
        })
        .unwrap();
        assert_eq!(one, vec![rayon::current_num_threads()]);
    }
}
