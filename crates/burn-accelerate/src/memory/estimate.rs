//! `burn-accelerate estimate-memory`: parameter counts and bytes per dtype of a safetensors checkpoint, and the
//! memory that training it with Adam through the accelerator needs, read from the files' headers alone.
//!
//! Training memory per precision, for `P` float parameters (activations, which depend on the batch, are not
//! counted):
//!
//! | precision | weights | half copy (autocast) | gradients | Adam moments | total |
//! |---|---|---|---|---|---|
//! | f32 | 4P | — | 4P | 8P | 16P |
//! | bf16, fp16 | 4P (f32 master) | 2P | 4P (f32) | 8P | 18P |
//!
//! Non-float tensors (integer buffers) are added to every row as they are stored. Accelerate's own
//! `estimate-memory` reports the largest of those parts rather than their sum; the parts above are all alive at
//! the optimizer step, so their sum is what a device must hold.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::precision::MixedPrecision;

/// Parameters and bytes of one dtype.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DtypeCount {
    /// Number of elements.
    pub parameters: u64,
    /// Bytes as stored.
    pub bytes: u64,
}

/// The estimated training memory of one precision, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TrainingMemory {
    /// The precision.
    pub precision: MixedPrecision,
    /// f32 weights (the master weights under mixed precision), plus non-float tensors as stored.
    pub weights: u64,
    /// The half-precision copy used inside autocast (0 for f32).
    pub half_copy: u64,
    /// f32 gradients.
    pub gradients: u64,
    /// Adam's two f32 moments.
    pub optimizer: u64,
    /// The sum of the above.
    pub total: u64,
}

/// The size of a checkpoint's model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelSize {
    /// The files read.
    pub files: Vec<PathBuf>,
    /// Parameters and bytes per stored dtype (safetensors' names: `F32`, `BF16`, `I64`, …).
    pub per_dtype: BTreeMap<String, DtypeCount>,
    /// Elements of floating-point tensors (what training updates).
    pub float_parameters: u64,
    /// Bytes of non-float tensors, as stored.
    pub other_bytes: u64,
    /// The largest tensor: its name and number of elements.
    pub largest: Option<(String, u64)>,
}

#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
}

/// Safetensors headers larger than this are refused (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

impl ModelSize {
    /// Reads a `.safetensors` file, a folder of them (`model.safetensors` or the shards of
    /// `model.safetensors.index.json`), or an index file.
    ///
    /// # Errors
    /// A path that is none of those, an unreadable or malformed header (the error names the file).
    pub fn from_path(path: &Path) -> Result<Self> {
        let files = crate::checkpoint::safetensors::weight_files(path)?;
        let mut size = ModelSize {
            files: files.clone(),
            per_dtype: BTreeMap::new(),
            float_parameters: 0,
            other_bytes: 0,
            largest: None,
        };
        for file in &files {
            for (name, entry) in read_header(file)? {
                let (width, float) = crate::checkpoint::safetensors::stored_width(&entry.dtype)
                    .ok_or_else(|| Error::Checkpoint {
                        path: file.clone(),
                        reason: format!("tensor `{name}` has the unknown dtype `{}`", entry.dtype),
                    })?;
                let elements = entry
                    .shape
                    .iter()
                    .try_fold(1u64, |n, d| n.checked_mul(*d))
                    .ok_or_else(|| Error::Checkpoint {
                        path: file.clone(),
                        reason: format!(
                            "tensor `{name}` has an impossible shape {:?}",
                            entry.shape
                        ),
                    })?;
                let count = size.per_dtype.entry(entry.dtype.clone()).or_default();
                count.parameters += elements;
                count.bytes += elements * width;
                if float {
                    size.float_parameters += elements;
                } else {
                    size.other_bytes += elements * width;
                }
                if size.largest.as_ref().is_none_or(|(_, n)| elements > *n) {
                    size.largest = Some((name, elements));
                }
            }
        }
        Ok(size)
    }

    /// All parameters, of every dtype.
    pub fn parameters(&self) -> u64 {
        self.per_dtype.values().map(|c| c.parameters).sum()
    }

    /// The memory training needs in `precision` (see the module documentation for the formula).
    pub fn training(&self, precision: MixedPrecision) -> TrainingMemory {
        let p = self.float_parameters;
        let weights = 4 * p + self.other_bytes;
        let half_copy = if precision == MixedPrecision::No {
            0
        } else {
            2 * p
        };
        let (gradients, optimizer) = (4 * p, 8 * p);
        TrainingMemory {
            precision,
            weights,
            half_copy,
            gradients,
            optimizer,
            total: weights + half_copy + gradients + optimizer,
        }
    }
}

/// The tensors of one file's header (the `__metadata__` entry left out).
fn read_header(file: &Path) -> Result<Vec<(String, HeaderEntry)>> {
    let corrupt = |reason: String| Error::Checkpoint {
        path: file.to_path_buf(),
        reason,
    };
    let mut handle = std::fs::File::open(file).map_err(|source| Error::Io {
        operation: "opening",
        path: file.to_path_buf(),
        source,
    })?;
    let mut len = [0u8; 8];
    handle
        .read_exact(&mut len)
        .map_err(|e| corrupt(format!("too short for a safetensors header: {e}")))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(corrupt(format!(
            "declares a {len}-byte header, more than safetensors allows: not a safetensors file?"
        )));
    }
    let mut header = vec![0u8; len as usize];
    handle
        .read_exact(&mut header)
        .map_err(|e| corrupt(format!("truncated header: {e}")))?;
    let map: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("malformed header: {e}")))?;
    map.into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, value)| {
            let entry: HeaderEntry = serde_json::from_value(value)
                .map_err(|e| corrupt(format!("tensor `{name}`: {e}")))?;
            Ok((name, entry))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_memory_follows_the_documented_formula() {
        let size = ModelSize {
            files: vec![],
            per_dtype: BTreeMap::new(),
            float_parameters: 1000,
            other_bytes: 16,
            largest: None,
        };
        let f32 = size.training(MixedPrecision::No);
        assert_eq!(
            (
                f32.weights,
                f32.half_copy,
                f32.gradients,
                f32.optimizer,
                f32.total
            ),
            (4016, 0, 4000, 8000, 16016)
        );
        assert_eq!(size.training(MixedPrecision::Bf16).total, 18016);
    }
}
