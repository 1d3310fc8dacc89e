//! `merge-weights`: one safetensors model from a training state saved by [`save_state`], whether its model is one
//! record (no sharding, `SHARD_GRAD_OP`) or one record per rank holding that rank's parameters (`FULL_SHARD`).
//! Accelerate's `accelerate merge-weights` does the same for FSDP's sharded state dicts.
//!
//! [`save_state`]: crate::Accelerator::save_state

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;

use super::load::resolve;
use super::manifest::{MANIFEST, Manifest, file, model_stem};
use super::repartition::{SavedSplits, whole_tensors};
use super::safetensors::layout::LAYOUT_KEY;
use super::safetensors::stream::safetensors_dtype;
use super::safetensors::{SINGLE_FILE, WeightLayout, corrupt};
use crate::error::{Error, Result};

/// One tensor of the merged model: its dtype, shape and bytes, from the rank that held it.
struct Merged {
    dtype: burn::tensor::DType,
    shape: Vec<usize>,
    bytes: burn::tensor::Bytes,
}

/// Writes model number `model` (0 for the first) of the training state in `state_dir` as one
/// `model.safetensors` in `out_dir`, keyed by module path (`encoder.layers.0.weight`) in Burn's layout (the
/// file records it, so [`load_checkpoint_in_model`](crate::Accelerator::load_checkpoint_in_model) reads it
/// back as is). Per-rank records are merged: each parameter is joined from the ranks that hold it (a
/// `FULL_SHARD` rank holds its dim-0 slice of each, joined here in rank order). Returns the file written.
///
/// # Errors
/// `state_dir` is not a complete checkpoint, holds fewer models, a record is unreadable, or a parameter is
/// held by no rank.
pub fn merge_weights(state_dir: &Path, out_dir: &Path, model: usize) -> Result<PathBuf> {
    let dir = resolve(state_dir)?;
    let manifest_path = dir.join(MANIFEST);
    let bytes =
        std::fs::read(&manifest_path).map_err(crate::error::io("reading", &manifest_path))?;
    let manifest: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(&manifest_path, format!("unreadable: {e}")))?;
    if model >= manifest.models {
        return Err(Error::InvalidArgument(format!(
            "merge-weights: {} holds {} model(s); asked for model #{model} (counting from 0)",
            dir.display(),
            manifest.models
        )));
    }
    let ranks = if manifest.model_per_rank {
        manifest.num_processes
    } else {
        1
    };
    let sources = (0..ranks).map(|rank| {
        let path = file(
            &dir,
            &model_stem(manifest.model_per_rank, rank),
            model,
            "bpk",
        );
        Ok((rank, path))
    });
    let saved = SavedSplits::new(&manifest.splits);
    let mut merged: BTreeMap<String, Merged> = BTreeMap::new();
    for tensor in whole_tensors(sources, &saved)? {
        let (name, dtype, shape, _, bytes) = tensor
            .into_parts()
            .map_err(|e| corrupt(&dir, format!("unreadable tensor: {e}")))?;
        merged.insert(
            name,
            Merged {
                dtype,
                shape: shape.to_vec(),
                bytes,
            },
        );
    }
    if merged.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "merge-weights: model #{model} of {} has no parameters",
            dir.display()
        )));
    }
    if manifest.model_per_rank
        && let Some((name, _)) = merged
            .iter()
            .find(|(_, m)| m.shape.iter().product::<usize>() == 0 && !m.shape.is_empty())
    {
        return Err(corrupt(
            &dir,
            format!("no rank's record holds `{name}` whole; the checkpoint is incomplete"),
        ));
    }
    let views = merged
        .iter()
        .map(|(name, m)| {
            let dtype = safetensors_dtype(m.dtype).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "merge-weights: `{name}` is {:?}, which safetensors cannot hold",
                    m.dtype
                ))
            })?;
            let view = TensorView::new(dtype, m.shape.clone(), &m.bytes)
                .map_err(|e| Error::InvalidArgument(format!("merge-weights: `{name}`: {e}")))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = std::collections::HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (LAYOUT_KEY.to_string(), WeightLayout::Burn.tag().to_string()),
    ]);
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| Error::InvalidArgument(format!("merge-weights: {e}")))?;
    std::fs::create_dir_all(out_dir).map_err(crate::error::io("creating", out_dir))?;
    let out = out_dir.join(SINGLE_FILE);
    crate::fs::write_atomic(&out, &bytes)?;
    Ok(out)
}
