//! Accelerate's `find_executable_batch_size`: run a training function, and on an out-of-memory failure free
//! memory and retry with a smaller batch, until it fits or the floor is reached.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use burn::tensor::DType;

use super::OutOfMemory;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::{ReduceBuffer, ReduceOp};

/// How the batch size shrinks after an out-of-memory failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Shrink {
    /// `floor(batch_size * 0.9)`, what Accelerate does since 1.9 (128, 115, 103, 92, …).
    #[default]
    NinetyPercent,
    /// `batch_size / 2`, as the Troubleshoot guide describes (128, 64, 32, …).
    Halve,
}

impl Shrink {
    /// The size to try after `batch_size` failed.
    pub fn next(self, batch_size: usize) -> usize {
        match self {
            // Integer arithmetic: `int(bs * 0.9)` in Python gives the same for every size below 2^52.
            Shrink::NinetyPercent => batch_size * 9 / 10,
            Shrink::Halve => batch_size / 2,
        }
    }
}

/// Why the search ended without a result.
#[derive(Debug)]
pub enum BatchSizeError<E> {
    /// The function failed with an error that is not an out-of-memory failure; it is returned unchanged.
    Failed(E),
    /// Another rank's function failed with such an error at `batch_size` (with several ranks every rank stops).
    FailedOnOtherRank {
        /// The batch size of the failed attempt.
        batch_size: usize,
    },
    /// Every size down to the floor ran out of memory.
    Exhausted {
        /// Every size tried, in order.
        tried: Vec<usize>,
        /// The smallest size allowed.
        floor: usize,
        /// The last out-of-memory message.
        last: String,
    },
}

impl<E: fmt::Display> fmt::Display for BatchSizeError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchSizeError::Failed(e) => write!(f, "{e}"),
            BatchSizeError::FailedOnOtherRank { batch_size } => write!(
                f,
                "find_executable_batch_size: another rank failed at batch size {batch_size} with an error other \
                 than out-of-memory; see that rank's output"
            ),
            BatchSizeError::Exhausted { tried, floor, last } => write!(
                f,
                "find_executable_batch_size: no executable batch size found down to the floor of {floor}; tried \
                 {tried:?}, all out of memory (last: {last}). Lower the floor, shrink the model or the sequence \
                 length, turn on mixed precision or gradient accumulation, or use a device with more memory"
            ),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for BatchSizeError<E> {}

/// The search: where it starts, where it stops and how it shrinks.
///
/// ```
/// use burn_accelerate::memory::{BatchSizeFinder, Shrink};
///
/// // A step that runs out of memory above 40 samples.
/// let mut tried = Vec::new();
/// let fitted = BatchSizeFinder::new(128).shrink(Shrink::Halve).run(|batch_size| {
///     tried.push(batch_size);
///     if batch_size > 40 { Err("out of device memory allocating 1 bytes".to_string()) } else { Ok(batch_size) }
/// })?;
/// assert_eq!((fitted, tried), (32, vec![128, 64, 32]));
/// # Ok::<(), burn_accelerate::memory::BatchSizeError<String>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSizeFinder {
    start: usize,
    floor: usize,
    shrink: Shrink,
}

/// What one attempt ended with (after the ranks agreed, with several).
enum Attempt<T, E> {
    Done(T),
    OutOfMemory(String),
    Failed(E),
    FailedOnOtherRank,
}

impl BatchSizeFinder {
    /// A search from `start` down to 1, shrinking by 10% each time.
    pub fn new(start: usize) -> Self {
        Self {
            start,
            floor: 1,
            shrink: Shrink::default(),
        }
    }

    /// The smallest batch size to try (default 1); below it the search fails, listing every size tried.
    pub fn floor(mut self, floor: usize) -> Self {
        self.floor = floor.max(1);
        self
    }

    /// How the size shrinks (default [`Shrink::NinetyPercent`]).
    pub fn shrink(mut self, shrink: Shrink) -> Self {
        self.shrink = shrink;
        self
    }

    /// Runs `f` on this process alone; see [`find_executable_batch_size`](super::find_executable_batch_size).
    ///
    /// # Errors
    /// [`BatchSizeError::Failed`] with `f`'s own error when it is not an out-of-memory failure;
    /// [`BatchSizeError::Exhausted`] when every size down to the floor ran out of memory.
    pub fn run<T, E: OutOfMemory + fmt::Display>(
        &self,
        mut f: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<T, BatchSizeError<E>> {
        self.search(|batch_size| attempt(&mut f, batch_size), || {})
    }

    /// Runs `f` on every rank of `group` in lockstep (see
    /// [`Accelerator::find_executable_batch_size_with`](crate::Accelerator::find_executable_batch_size_with)):
    /// after each attempt the ranks agree, so an out-of-memory failure on any rank shrinks the batch for all;
    /// `free` runs between attempts.
    pub(crate) fn run_across<T, E: OutOfMemory + fmt::Display + From<crate::error::Error>>(
        &self,
        group: &ProcessGroup,
        free: impl FnMut(),
        mut f: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<T, BatchSizeError<E>> {
        let agree = |batch_size: usize, mine: Attempt<T, E>| -> Attempt<T, E> {
            // 0: fitted, 1: out of memory, 2: another failure; the worst outcome on any rank wins.
            let code = match &mine {
                Attempt::Done(_) => 0,
                Attempt::OutOfMemory(_) => 1,
                Attempt::Failed(_) | Attempt::FailedOnOtherRank => 2,
            };
            let worst = match collectives::all_reduce_host(
                group,
                "find_executable_batch_size",
                (DType::I64, &[1]),
                ReduceBuffer::I64(vec![code]),
                ReduceOp::Max,
            ) {
                Ok(ReduceBuffer::I64(v)) => v.first().copied().unwrap_or(code),
                Ok(_) => code,
                Err(e) => return Attempt::Failed(E::from(e)),
            };
            match (worst, mine) {
                (_, Attempt::Failed(e)) => Attempt::Failed(e),
                (0, mine) | (1, mine @ Attempt::OutOfMemory(_)) => mine,
                (1, _) => Attempt::OutOfMemory(format!(
                    "another rank ran out of memory at batch size {batch_size}"
                )),
                _ => Attempt::FailedOnOtherRank,
            }
        };
        self.search(
            |batch_size| agree(batch_size, attempt(&mut f, batch_size)),
            free,
        )
    }

    /// The loop: try, shrink on out-of-memory, free memory between attempts.
    fn search<T, E>(
        &self,
        mut try_size: impl FnMut(usize) -> Attempt<T, E>,
        mut free: impl FnMut(),
    ) -> Result<T, BatchSizeError<E>> {
        let mut tried = Vec::new();
        let mut last = format!("the starting batch size {} is below the floor", self.start);
        let mut batch_size = self.start;
        while batch_size >= self.floor && batch_size > 0 {
            tried.push(batch_size);
            match try_size(batch_size) {
                Attempt::Done(value) => return Ok(value),
                Attempt::Failed(e) => return Err(BatchSizeError::Failed(e)),
                Attempt::FailedOnOtherRank => {
                    return Err(BatchSizeError::FailedOnOtherRank { batch_size });
                }
                Attempt::OutOfMemory(message) => {
                    let next = self.shrink.next(batch_size);
                    log::warn!(
                        "find_executable_batch_size: batch size {batch_size} ran out of memory ({message}); \
                         retrying with {next}"
                    );
                    last = message;
                    free();
                    batch_size = next;
                }
            }
        }
        Err(BatchSizeError::Exhausted {
            tried,
            floor: self.floor,
            last,
        })
    }
}

/// One call of `f`, with out-of-memory failures (returned or panicked) told apart from the rest.
fn attempt<T, E: OutOfMemory + fmt::Display>(
    f: &mut impl FnMut(usize) -> Result<T, E>,
    batch_size: usize,
) -> Attempt<T, E> {
    match catch_unwind(AssertUnwindSafe(|| f(batch_size))) {
        Ok(Ok(value)) => Attempt::Done(value),
        Ok(Err(e)) if e.is_out_of_memory() => Attempt::OutOfMemory(e.to_string()),
        Ok(Err(e)) => Attempt::Failed(e),
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned());
            match message {
                // LibTorch and Burn's non-`try` reads panic on out-of-memory.
                Some(m) if super::is_out_of_memory_message(&m) => Attempt::OutOfMemory(m),
                _ => resume_unwind(payload),
            }
        }
    }
}
