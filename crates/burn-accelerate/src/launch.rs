//! In-process launching: `n` ranks as threads of this process, each with its own [`Accelerator`].

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::accelerator::{Accelerator, AcceleratorBuilder};
use crate::comm::{Communicator, InProcessGroup, SingleProcess};
use crate::config::AcceleratorConfig;
use crate::error::{Error, Result};

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

/// The communicator of this process and its local rank: MPI when built with the `mpi` feature and started by
/// an MPI launcher, else a single process.
pub(crate) fn process_comm(config: &AcceleratorConfig) -> Result<(Arc<dyn Communicator>, usize)> {
    #[cfg(feature = "mpi")]
    if burn_accelerate_mpi::launched_by_mpi() {
        use std::sync::OnceLock;
        static MPI: OnceLock<Arc<burn_accelerate_mpi::MpiComm>> = OnceLock::new();
        let comm = match MPI.get() {
            Some(comm) => comm.clone(),
            None => {
                let comm = Arc::new(burn_accelerate_mpi::MpiComm::init(
                    config.collective_timeout(),
                )?);
                MPI.get_or_init(|| comm).clone()
            }
        };
        let local_rank = comm.local_rank();
        return Ok((comm, local_rank));
    }
    let _ = config;
    let launched_world =
        crate::env::first_usize(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"])
            .ok()
            .flatten()
            .unwrap_or(1);
    if launched_world > 1 && !cfg!(feature = "mpi") {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            log::warn!(
                "started by an MPI launcher with {launched_world} processes, but burn-accelerate was built without \
                 its `mpi` feature: every process runs alone. Rebuild with `--features burn-accelerate/mpi`."
            )
        });
    }
    Ok((Arc::new(SingleProcess::default()), 0))
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

pub(crate) fn run<T, F>(builder: AcceleratorBuilder, num_processes: usize, f: F) -> Result<Vec<T>>
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
                            let comm = Arc::new(group.comm(rank));
                            f(builder.build_rank(config.clone(), comm, rank)?)
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
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|payload| {
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
