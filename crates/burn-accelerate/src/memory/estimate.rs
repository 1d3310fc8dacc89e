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

/// Bytes per element of a safetensors dtype name, and whether it is a float.
fn dtype_size(dtype: &str) -> Option<(u64, bool)> {
    Some(match dtype {
        "F64" => (8, true),
        "F32" => (4, true),
        "F16" | "BF16" => (2, true),
        "F8_E4M3" | "F8_E5M2" => (1, true),
        "I64" | "U64" => (8, false),
        "I32" | "U32" => (4, false),
        "I16" | "U16" => (2, false),
        "I8" | "U8" | "BOOL" => (1, false),
        _ => return None,
    })
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
        let files = files_of(path)?;
        let mut size = ModelSize {
            files: files.clone(),
            per_dtype: BTreeMap::new(),
            float_parameters: 0,
            other_bytes: 0,
            largest: None,
        };
        for file in &files {
            for (name, entry) in read_header(file)? {
                let (width, float) = dtype_size(&entry.dtype).ok_or_else(|| Error::Checkpoint {
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

/// The safetensors files behind `path`.
fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
    let index_in = |dir: &Path| dir.join("model.safetensors.index.json");
    if path.is_dir() {
        let single = path.join("model.safetensors");
        if single.is_file() {
            return Ok(vec![single]);
        }
        if index_in(path).is_file() {
            return files_of_index(&index_in(path));
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|source| Error::Io {
                operation: "listing",
                path: path.to_path_buf(),
                source,
            })?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        found.sort();
        if found.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "estimate-memory: {} holds no .safetensors file; pass a file, a folder written by save_model, \
                 or its model.safetensors.index.json",
                path.display()
            )));
        }
        return Ok(found);
    }
    if path.to_string_lossy().ends_with(".index.json") {
        return files_of_index(path);
    }
    Ok(vec![path.to_path_buf()])
}

/// The shard files an index names (only plain file names beside the index are accepted).
fn files_of_index(index: &Path) -> Result<Vec<PathBuf>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = std::fs::read(index).map_err(|source| Error::Io {
        operation: "reading",
        path: index.to_path_buf(),
        source,
    })?;
    let parsed: Index = serde_json::from_slice(&text).map_err(|e| Error::Checkpoint {
        path: index.to_path_buf(),
        reason: format!("not a safetensors index: {e}"),
    })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = parsed.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|name| {
            let plain = Path::new(&name)
                .file_name()
                .is_some_and(|f| f == name.as_str());
            if plain {
                Ok(dir.join(name))
            } else {
                Err(Error::Checkpoint {
                    path: index.to_path_buf(),
                    reason: format!(
                        "names the shard `{name}`, which is not a file beside the index"
                    ),
                })
            }
        })
        .collect()
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
