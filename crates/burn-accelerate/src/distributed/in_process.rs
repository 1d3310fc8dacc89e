//! In-process launching: `n` ranks as threads of this process, each handed its [`InProcess`] cluster
//! environment (what [`AcceleratorBuilder::launch`](crate::AcceleratorBuilder::launch) builds an accelerator
//! from), with panics caught and the root cause of a failure reported.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use crate::distributed::cluster::InProcess;
use crate::distributed::comm::InProcessGroup;
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
        Error::Comm(crate::distributed::comm::CommError::RankFailed { .. }) => 2,
        _ => 1,
    }
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
    if num_processes == 0 {
        return Err(Error::InvalidArgument(
            "launch: num_processes must be at least 1".into(),
        ));
    }
    let group = InProcessGroup::new(num_processes, timeout);
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..num_processes)
            .map(|rank| {
                let (group, f) = (&group, &f);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            let cluster = InProcess::new(Arc::new(group.comm(rank)));
                            f(&cluster)
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
