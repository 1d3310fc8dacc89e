//! The [`Accelerator`]'s memory calls: freeing memory between attempts, forcing a GPU backend to report a
//! failed allocation, and the batch-size search of [`memory`](crate::memory).

use std::fmt;

use burn::tensor::Tensor;

use super::Accelerator;
use crate::error::Result;
use crate::grad;
use crate::memory::{BatchSizeError, BatchSizeFinder, OutOfMemory};

impl Accelerator {
    /// Drops the stored gradients, forgets the current accumulation window and returns the device's cached
    /// memory (Accelerate's `free_memory`). Call it at the start of each attempt of a batch-size search, after
    /// dropping the previous attempt's model, optimizer and dataloader.
    pub fn free_memory(&self) {
        {
            let mut core = self.step.shared().lock();
            core.grads.clear();
            core.state.reset_window();
        }
        crate::memory::release_memory(self.device());
    }

    /// Forces the device to finish computing `loss` and the stored gradients, and reports a failure there — on
    /// GPU backends an out-of-memory failure surfaces only when a result is read — before the optimizer step,
    /// so that a failed step never reaches the parameters. Costs one small read; call it between `backward`
    /// and `optimizer.step` inside a batch-size search.
    ///
    /// # Errors
    /// [`Error::Execution`](crate::Error::Execution) with the backend's message (check it with
    /// [`OutOfMemory::is_out_of_memory`](crate::memory::OutOfMemory)).
    pub fn check_step<const D: usize>(&self, loss: &Tensor<D>) -> Result<()> {
        let mut core = self.step.shared().lock();
        let ids = core.grads.ids();
        grad::check_executed(&mut core.grads, &ids, loss.clone())
    }

    /// Runs `f` with a batch size from `starting_batch_size` down, shrinking it by 10% after each out-of-memory
    /// failure until `f` succeeds (Accelerate's `find_executable_batch_size`). With several ranks every rank tries
    /// the same sizes: an out-of-memory failure on any rank shrinks the batch for all. Every retry is logged.
    ///
    /// # Errors
    /// `f`'s own error when it is not an out-of-memory failure; an error listing every size tried when even
    /// a batch of 1 runs out of memory. A collective: every rank calls it.
    pub fn find_executable_batch_size<T, E>(
        &self,
        starting_batch_size: usize,
        f: impl FnMut(usize) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, BatchSizeError<E>>
    where
        E: OutOfMemory + fmt::Display + From<crate::error::Error>,
    {
        self.find_executable_batch_size_with(BatchSizeFinder::new(starting_batch_size), f)
    }

    /// [`find_executable_batch_size`](Self::find_executable_batch_size) with another search: halving, a floor.
    /// Between attempts the accelerator frees its gradients and the device's cached memory; after each attempt
    /// the ranks agree (with Accelerate, ranks may settle on different sizes and then hang in their
    /// collectives).
    ///
    /// ```
    /// use burn_accelerate::Accelerator;
    /// use burn_accelerate::memory::{BatchSizeFinder, Shrink};
    ///
    /// let accelerator = Accelerator::new()?;
    /// let search = BatchSizeFinder::new(128).shrink(Shrink::Halve).floor(8);
    /// let fitted = accelerator.find_executable_batch_size_with(search, |batch_size| {
    ///     Ok::<_, burn_accelerate::Error>(batch_size)
    /// })?;
    /// assert_eq!(fitted, 128);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`find_executable_batch_size`](Self::find_executable_batch_size); a rank whose peer failed otherwise
    /// gets [`BatchSizeError::FailedOnOtherRank`]; a failed agreement (a timeout, a dead rank) is
    /// [`BatchSizeError::Failed`] with the accelerator's error converted to `E`.
    pub fn find_executable_batch_size_with<T, E>(
        &self,
        search: BatchSizeFinder,
        f: impl FnMut(usize) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, BatchSizeError<E>>
    where
        E: OutOfMemory + fmt::Display + From<crate::error::Error>,
    {
        search.run_across(&self.group, || self.free_memory(), f)
    }
}
