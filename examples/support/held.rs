//! What a rank holds, measured: its parameters, its gradients and its peak memory (the sharding examples print
//! them).

#![allow(dead_code)]

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_accelerate::Accelerator;

/// Bytes of the float parameters of `model` this rank holds (under `FULL_SHARD`, its slices).
pub fn param_bytes<M: Module>(model: &M) -> usize {
    struct Bytes(usize);
    impl ModuleVisitor for Bytes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            self.0 += value.shape().num_elements() * value.dtype().size();
        }
    }
    let mut bytes = Bytes(0);
    model.visit(&mut bytes);
    bytes.0
}

/// Bytes of the gradients of `model`'s parameters this rank holds.
pub fn grad_bytes<M: Module>(acc: &Accelerator, model: &M) -> usize {
    struct Bytes<'a>(&'a Accelerator, usize);
    impl ModuleVisitor for Bytes<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.grad(param) {
                self.1 += grad.shape().num_elements() * grad.dtype().size();
            }
        }
    }
    let mut bytes = Bytes(acc, 0);
    model.visit(&mut bytes);
    bytes.1
}

/// The process's peak resident memory (`VmHWM`) or peak address space (`VmPeak`), in bytes (Linux; 0
/// elsewhere).
pub fn peak(what: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(what))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// Resets the process's peak resident memory (`VmHWM`) to its current resident memory (Linux; nothing elsewhere),
/// so that the next [`peak`] measures what comes after.
pub fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
