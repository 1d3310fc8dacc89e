//! Out-of-memory handling and memory estimates: Accelerate's `find_executable_batch_size`, the classification
//! of out-of-memory failures as Burn 0.22's backends report them ([`oom`]), releasing cached device memory, and
//! the training-memory estimate behind `burn-accelerate estimate-memory` ([`estimate`]).
//!
//! The pattern of the Troubleshoot guide: build everything that holds device memory inside the function, free
//! memory first, and let the search pick the batch size.
//!
//! ```
//! use burn_accelerate::Accelerator;
//!
//! let accelerator = Accelerator::new()?;
//! let batch_size = accelerator.find_executable_batch_size(64, |batch_size| {
//!     accelerator.free_memory();
//!     // build the model, optimizer and dataloader with `batch_size` here, and train
//!     // (call `accelerator.check_step(&loss)?` before `optimizer.step` on GPU backends)
//!     Ok::<_, burn_accelerate::Error>(batch_size)
//! })?;
//! assert_eq!(batch_size, 64);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod batch_size;
pub mod estimate;
pub use crate::heap::oom;

use burn::tensor::Device;

pub use batch_size::{BatchSizeError, BatchSizeFinder, Shrink};
pub use estimate::{ModelSize, TrainingMemory};
pub use oom::{OutOfMemory, is_out_of_memory_message};

/// Runs `f(batch_size)` from `starting_batch_size`, and after each out-of-memory failure (a returned error
/// that [`OutOfMemory`] recognises, or a panic whose message reports one) retries with 90% of the size, down
/// to 1. Returns `f`'s first success. Other errors end the search unchanged. For halving or a floor use
/// [`BatchSizeFinder`]; with several ranks, use
/// [`Accelerator::find_executable_batch_size`](crate::Accelerator::find_executable_batch_size) (or its `_with`
/// form), which makes every rank try the same sizes.
///
/// ```
/// use burn_accelerate::memory::find_executable_batch_size;
///
/// let mut tried = Vec::new();
/// let fitted = find_executable_batch_size(128, |batch_size| {
///     tried.push(batch_size);
///     if batch_size > 100 { Err("out of device memory".to_string()) } else { Ok(batch_size) }
/// })?;
/// assert_eq!(tried, vec![128, 115, 103, 92]);
/// # Ok::<(), burn_accelerate::memory::BatchSizeError<String>>(())
/// ```
///
/// # Errors
/// See [`BatchSizeFinder::run`].
pub fn find_executable_batch_size<T, E: OutOfMemory + std::fmt::Display>(
    starting_batch_size: usize,
    f: impl FnMut(usize) -> Result<T, E>,
) -> Result<T, BatchSizeError<E>> {
    BatchSizeFinder::new(starting_batch_size).run(f)
}

/// Returns the memory a backend keeps cached for later allocations to the device (Burn's
/// `Device::memory_cleanup`; Accelerate's `release_memory` / `clear_device_cache`). Tensors still referenced
/// stay; drop them first.
pub fn release_memory(device: &Device) {
    device.memory_cleanup();
}
