//! The safetensors format, apart from any training state: model weights in Hugging Face's layout
//! (`model.safetensors`, or shards `model-00001-of-0000N.safetensors` with `model.safetensors.index.json`),
//! written atomically and streamed in bands ([`write`](mod@write)), and loaded back strictly or partially
//! from a file, a folder or an index ([`read`]); tensor layouts and key remapping
//! ([`layout`]). [`weight_files`] is the one place that decides which files a path names, for
//! loading and for `estimate-memory` alike.

pub mod layout;
pub mod read;
pub(crate) mod stream;
pub mod write;

use std::path::{Path, PathBuf};

use burn::tensor::DType;
use safetensors::tensor::Dtype;

use crate::error::{Error, Result};
use crate::fs::read as read_file;

pub use layout::{KeyRemap, WeightLayout};
pub use read::{LoadOptions, LoadReport, load_weights};
pub use write::{SaveOptions, write_burnpack, write_safetensors};
pub(crate) use write::{drain_planned, plan, write_planned};

/// Name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Parses a size such as `10GB` (decimal), `1GiB` (binary), `500MB`, `64KiB` or a plain number of bytes.
pub fn parse_size(size: &str) -> Result<u64> {
    let s = size.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: u64 = number.parse().map_err(|_| bad_size(size))?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return Err(bad_size(size)),
    };
    number
        .checked_mul(factor)
        .filter(|n| *n > 0)
        .ok_or_else(|| bad_size(size))
}

fn bad_size(size: &str) -> Error {
    Error::config(
        "max_shard_size",
        size,
        "save_model",
        "a positive size such as 10GB, 500MB, 1GiB or a number of bytes",
    )
}

pub(crate) fn corrupt(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

pub(crate) fn from_safetensors_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U64 => DType::U64,
        Dtype::U32 => DType::U32,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool(burn::tensor::BoolStore::Native),
        _ => return None,
    })
}

/// Bytes per element of a stored dtype, by its safetensors name (`F32`, `BF16`, ...), and whether it is a
/// float: the table `estimate-memory` counts with, beside [`from_safetensors_dtype`] which the loader maps with.
pub(crate) fn stored_width(name: &str) -> Option<(u64, bool)> {
    let dtype: Dtype = serde_json::from_value(serde_json::Value::String(name.into())).ok()?;
    Some(match dtype {
        Dtype::F64 => (8, true),
        Dtype::F32 => (4, true),
        Dtype::F16 | Dtype::BF16 => (2, true),
        Dtype::F8_E4M3 | Dtype::F8_E5M2 => (1, true),
        Dtype::I64 | Dtype::U64 => (8, false),
        Dtype::I32 | Dtype::U32 => (4, false),
        Dtype::I16 | Dtype::U16 => (2, false),
        Dtype::I8 | Dtype::U8 | Dtype::BOOL => (1, false),
        _ => return None,
    })
}

/// The safetensors files a path names, in a fixed order: a folder's index when it has one (its shards,
/// each once), else its `model.safetensors`; an index file's shards; any other file as it is.
///
/// # Errors
/// A folder holding neither file, an unreadable or malformed index, or an index naming a shard outside its
/// folder.
pub fn weight_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_dir() {
        if path.join(INDEX_FILE).exists() {
            return index_files(&path.join(INDEX_FILE));
        }
        if path.join(SINGLE_FILE).exists() {
            return Ok(vec![path.join(SINGLE_FILE)]);
        }
        return Err(corrupt(
            path,
            format!("no {SINGLE_FILE} or {INDEX_FILE} in this folder; is it a saved model?"),
        ));
    }
    if path.extension().is_some_and(|e| e == "json") {
        return index_files(path);
    }
    Ok(vec![path.to_path_buf()])
}

/// The shard files an index names (only plain file names beside the index are accepted), each once.
fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = read_file(index)?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| corrupt(index, format!("not a JSON index: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| corrupt(index, "no `weight_map` object"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        // Shards live beside the index: a path that leaves the folder (`..`, absolute) is refused.
        let name = file.as_str().filter(|f| {
            let mut parts = Path::new(f).components();
            matches!(parts.next(), Some(std::path::Component::Normal(_))) && parts.next().is_none()
        });
        let name = name.ok_or_else(|| {
            corrupt(
                index,
                format!(
                    "`weight_map` gives tensor {tensor:?} the file {file}: expected the name of a shard in \
                     the index's folder (no folders, no `..`, not absolute)"
                ),
            )
        })?;
        files.push(dir.join(name));
    }
    files.sort();
    files.dedup();
    Ok(files)
}
