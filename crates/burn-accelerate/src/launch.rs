//! In-process launching: `n` ranks as threads of this process, each with its own [`Accelerator`].

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::accelerator::Accelerator;
use crate::builder::AcceleratorBuilder;
use crate::cluster::InProcess;
use crate::comm::InProcessGroup;
use crate::error::{Error, Result};

impl AcceleratorBuilder {
    /// Runs `f` on `num_processes` ranks, one thread each, every one with its own accelerator (Accelerate's
    /// `notebook_launcher`/`debug_launcher`). Rank `i` gets device `i` when the backend has several devices,
    /// else the backend's device. Returns every rank's result in rank order, or the error that caused the
    /// failure (a panic, or the first rank's own error rather than the errors it caused on the others).
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// let ranks = Accelerator::builder().launch(3, |acc| Ok(acc.process_index()))?;
    /// assert_eq!(ranks, vec![0, 1, 2]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// `num_processes` is 0, a setting is invalid, a rank thread cannot be started, or a rank fails.
    pub fn launch<T, F>(self, num_processes: usize, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Accelerator) -> Result<T> + Send + Sync,
    {
        run(self, num_processes, f)
    }
}

/// Runs `f` on `num_processes` in-process ranks with the default settings; see
/// [`AcceleratorBuilder::launch`].
///
/// ```
/// use burn_accelerate::{ReduceOp, launch};
/// use burn::tensor::Tensor;
///
/// let sums = launch(2, |acc| {
///     let x = Tensor::<1>::from_floats([acc.process_index() as f32 + 1.0], acc.device());
///     Ok(acc.reduce(x, ReduceOp::Sum)?.into_scalar::<f32>())
/// })?;
/// assert_eq!(sums, vec![3.0, 3.0]);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
pub fn launch<T, F>(num_processes: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Accelerator) -> Result<T> + Send + Sync,
{
    Accelerator::builder().launch(num_processes, f)
}

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
        Error::Comm(crate::comm::CommError::RankFailed { .. }) => 2,
        _ => 1,
    }
}

fn run<T, F>(builder: AcceleratorBuilder, num_processes: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Accelerator) -> Result<T> + Send + Sync,
{
    if num_processes == 0 {
        return Err(Error::InvalidArgument(
            "launch: num_processes must be at least 1".into(),
        ));
    }
    let config = builder.resolve()?;
    let group = InProcessGroup::new(num_processes, config.collective_timeout());
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..num_processes)
            .map(|rank| {
                let (group, builder, config, f) = (&group, &builder, &config, &f);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            let cluster = InProcess::new(Arc::new(group.comm(rank)));
                            f(builder.build_rank(config.clone(), &cluster)?)
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
