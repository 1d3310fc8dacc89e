//! Telling an out-of-memory failure from every other failure, as Burn 0.22's backends report it.
//!
//! - cubecl backends (CUDA, ROCm, wgpu/Vulkan/Metal) do not fail at the allocation: the failure is attached to
//!   the buffer and surfaces on the next read of a tensor computed from it, as an execution error whose text
//!   says `out of device memory allocating N bytes`, `can't allocate buffer of size: N` or `An out-of-memory
//!   error happened during launch`. [`Accelerator::check_step`](crate::Accelerator::check_step) forces that
//!   read before the optimizer step.
//! - LibTorch (`tch`) panics with `CUDA out of memory` (caught by the batch-size search).
//! - A batch can also outgrow a kernel launch before it outgrows memory: cubecl then reports `Cube count too
//!   big`, which a smaller batch cures as well, so it counts here too.
//! - The CPU backends (flex, ndarray) allocate with Rust's allocator, which **aborts the process** on failure:
//!   no library can catch that. Estimate first (`burn-accelerate estimate-memory`), or probe in a child process.

use crate::error::Error;

/// Phrases by which backends report an out-of-memory failure (compared case-insensitively).
const OOM_PHRASES: &[&str] = &[
    "out of device memory",
    "can't allocate buffer of size",
    "out-of-memory error",
    "out of memory",
    "error_out_of_device_memory",
    "error_out_of_host_memory",
    "cuda_error_out_of_memory",
    "page sizes exhausted",
    "pagesizesexhausted",
    "defaultcpuallocator: can't allocate memory",
    // A kernel launch over the device's grid limit: a batch too big for one launch, met before memory runs out
    // (cubecl's matmul on an H100 at 2^28 rows), and cured by a smaller batch as an out-of-memory failure is.
    "cube count too big",
];

/// Whether a backend's error or panic message reports an out-of-memory failure.
///
/// ```
/// use burn_accelerate::memory::is_out_of_memory_message;
/// assert!(is_out_of_memory_message("... can't allocate buffer of size: 68719476736"));
/// assert!(is_out_of_memory_message("CUDA out of memory. Tried to allocate 2.00 GiB"));
/// assert!(!is_out_of_memory_message("shape mismatch: [2, 3] vs [3, 2]"));
/// ```
pub fn is_out_of_memory_message(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    OOM_PHRASES.iter().any(|phrase| message.contains(phrase))
}

/// Errors that can say whether they are an out-of-memory failure, which
/// [`find_executable_batch_size`](crate::memory::find_executable_batch_size) answers by retrying with a smaller batch.
/// Any other error ends the search and is returned unchanged.
pub trait OutOfMemory {
    /// Whether this error is an out-of-memory failure.
    fn is_out_of_memory(&self) -> bool;
}

impl OutOfMemory for Error {
    fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Execution { reason, .. } => is_out_of_memory_message(reason),
            // A rank that stopped because another ran out of memory (a pipeline stage): the step fails on every
            // rank, and a batch-size search shrinks the batch for all.
            Error::OtherRankFailed { message, .. } => is_out_of_memory_message(message),
            _ => false,
        }
    }
}

impl OutOfMemory for burn::tensor::TensorReadError {
    fn is_out_of_memory(&self) -> bool {
        is_out_of_memory_message(&self.to_string())
    }
}

impl OutOfMemory for String {
    fn is_out_of_memory(&self) -> bool {
        is_out_of_memory_message(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backends_messages_are_recognised_and_others_are_not() {
        for oom in [
            "out of device memory allocating 1073741824 bytes",
            "Several failures at once: The bytes were never written: can't allocate buffer of size: 68719476736",
            "An out-of-memory error happened during launch",
            "CUDA out of memory. Tried to allocate 20.00 MiB",
            "ERROR_OUT_OF_DEVICE_MEMORY",
            // As an H100 reported a batch of 2^28 rows.
            "the work writing it was skipped 8 operation(s) below a failure: Should run when selected by autotune.: \
             matmul_naive: An unknown error happened.\nUnable to launch matmul because a required feature is \
             unavailable: Cube count too big (8388608, 8, 1)",
        ] {
            assert!(is_out_of_memory_message(oom), "{oom}");
        }
        for other in [
            "shape mismatch",
            "the device was poisoned: restart the process",
            "collective timed out after 300 s",
            "memory layout of the record does not match",
        ] {
            assert!(!is_out_of_memory_message(other), "{other}");
        }
        let execution = Error::Execution {
            operation: "check_step",
            device: "Vulkan".into(),
            reason: "can't allocate buffer of size: 1".into(),
        };
        assert!(execution.is_out_of_memory());
        assert!(!Error::InvalidArgument("out of memory".into()).is_out_of_memory());
    }
}
