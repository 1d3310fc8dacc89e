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

/// A digest of `module`'s float parameters: FNV-1a over the bits of every value, in visiting order (f32 as
/// stored); `None` where this rank holds none of them (a pipeline stage's placeholders of another's part).
pub fn digest<M: Module>(module: &M) -> Option<u64> {
    struct Fnv(u64, bool);
    impl ModuleVisitor for Fnv {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data().convert::<f32>();
            for value in data.iter::<f32>() {
                self.1 = true;
                for byte in value.to_bits().to_le_bytes() {
                    self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
    }
    let mut fnv = Fnv(0xcbf2_9ce4_8422_2325, false);
    module.visit(&mut fnv);
    fnv.1.then_some(fnv.0)
}

/// The digest of a whole model from every rank's digests of its parts (`mine`: one per part, in order, `None`
/// where this rank does not train that part): each part's from the first rank that trains it, combined; on the
/// main process only, as 16 hex digits. Two runs that end with the same weights, bit for bit, print the same.
/// Every rank must call it.
pub fn weights_digest(
    acc: &Accelerator,
    mine: Vec<Option<u64>>,
) -> burn_accelerate::Result<Option<String>> {
    let all: Vec<Vec<Option<u64>>> = acc.gather_object(&mine)?;
    if !acc.is_main_process() {
        return Ok(None);
    }
    let mut combined: u64 = 0xcbf2_9ce4_8422_2325;
    for part in 0..mine.len() {
        let digest = all
            .iter()
            .find_map(|rank| rank.get(part).copied().flatten());
        for byte in digest.unwrap_or(0).to_le_bytes() {
            combined = (combined ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok(Some(format!("{combined:016x}")))
}
