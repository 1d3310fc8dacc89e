//! Records re-cut for another partition of the parameters: what lets a state saved by N ranks (or under another
//! strategy) load on M. A checkpoint's records are Burn's burnpack files, keyed by parameter id (optimizer
//! state) or module path (models); each rank reads the saved files one at a time and keeps only what it holds
//! under its own partition, so no rank ever holds more optimizer state than it trains with.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ParamId};
use burn::tensor::Bytes;
use burn_pack::{Reader, Writer};

use crate::error::{Error, Result};
use crate::named_params::Kind;

fn corrupt(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// One saved record file and the bytes `read` gave for it (checked against its checksum where one was recorded).
pub(crate) type Source = (PathBuf, Bytes);

fn reader(path: &Path, bytes: Bytes, what: &str) -> Result<Reader> {
    Reader::from_bytes(bytes).map_err(|e| {
        corrupt(
            path,
            format!("not a {what} record (truncated or corrupt?): {e}"),
        )
    })
}

/// The parameter id a key of an optimizer record belongs to: records key each parameter's state
/// `"{id}.{field}"` (scalars) and `"{id}"` (its module path).
fn key_id(key: &str) -> Option<u64> {
    key.split('.').next().and_then(|id| id.parse().ok())
}

/// The optimizer state of the parameters `keep` accepts, taken from every file of `sources` in turn: the
/// slices N ranks saved re-cut for this rank's partition (or joined, when this rank steps every parameter).
/// Returns the record's burnpack bytes.
pub(crate) fn optimizer_bytes(
    sources: impl IntoIterator<Item = Result<Source>>,
    keep: impl Fn(ParamId) -> bool,
) -> Result<Bytes> {
    let kept = |id: u64| keep(ParamId::from(id));
    let mut tensors = Vec::new();
    let mut scalars = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    let mut names = std::collections::HashSet::new();
    for source in sources {
        let (path, bytes) = source?;
        let reader = reader(&path, bytes, "optimizer")?;
        for (key, value) in reader.scalars() {
            if key_id(key).is_none_or(kept) {
                scalars.insert(key.clone(), *value);
            }
        }
        for (key, value) in reader.metadata() {
            if key_id(key).is_none_or(kept) {
                metadata.insert(key.clone(), value.clone());
            }
        }
        let read = reader
            .into_tensors()
            .map_err(|e| corrupt(&path, format!("unreadable optimizer record: {e}")))?;
        // Ranks that hold the same parameters (the replicas of a hybrid strategy) saved the same state: the
        // first copy is kept.
        tensors.extend(
            read.into_iter()
                .filter(|t| t.param_id.is_none_or(kept) && names.insert(t.name.clone())),
        );
    }
    let mut writer = Writer::new(tensors);
    for (key, value) in &scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in &metadata {
        writer = writer.with_metadata(key, value);
    }
    writer
        .into_bytes()
        .map_err(|e| Error::other(format!("re-cutting the optimizer state: {e}")))
}

/// What `target` needs of each parameter, by module path (the path Burn's records use): whether this rank holds
/// it whole or as an empty placeholder (`FULL_SHARD`'s parameters of other ranks), with the placeholder's shape
/// as a record stores it.
fn wanted<M: Module>(target: &M) -> HashMap<String, Option<Vec<usize>>> {
    let mut wanted = HashMap::new();
    crate::named_params::walk(target, |p| {
        let empty = match p.kind {
            Kind::Float(param) if param.num_elements() == 0 => Some(param.saved_dims()),
            _ => None,
        };
        wanted.insert(p.name(), empty);
    });
    wanted
}

/// A model record for `target` assembled from `sources` (each a saved record of the same model): every
/// parameter `target` holds whole is taken from the file that holds it whole (its owner's under `FULL_SHARD`,
/// or the one replicated record), every placeholder stays a placeholder. Returns the record's burnpack bytes.
pub(crate) fn model_bytes<M: Module>(
    sources: impl IntoIterator<Item = Result<Source>>,
    target: &M,
) -> Result<Bytes> {
    let mut wanted = wanted(target);
    let mut chosen: BTreeMap<String, burn_pack::Tensor> = BTreeMap::new();
    // A placeholder's id and dtype, from any file, for a placeholder no file holds.
    let mut seen: HashMap<String, (burn_pack::DType, Option<u64>)> = HashMap::new();
    let mut last = PathBuf::new();
    for source in sources {
        let (path, bytes) = source?;
        let read = reader(&path, bytes, "model")?
            .into_tensors()
            .map_err(|e| corrupt(&path, format!("unreadable model record: {e}")))?;
        for tensor in read {
            let Some(empty) = wanted.get(&tensor.name) else {
                return Err(corrupt(
                    &path,
                    format!(
                        "holds `{}`, which the model has no parameter for: it was saved from another model",
                        tensor.name
                    ),
                ));
            };
            seen.entry(tensor.name.clone())
                .or_insert((tensor.dtype, tensor.param_id));
            let held_empty = tensor.shape.num_elements() == 0;
            if held_empty == empty.is_some() && !chosen.contains_key(&tensor.name) {
                chosen.insert(tensor.name.clone(), tensor);
            }
        }
        last = path;
    }
    let mut tensors = Vec::with_capacity(wanted.len());
    for (name, empty) in wanted.drain() {
        match (chosen.remove(&name), empty, seen.get(&name)) {
            (Some(tensor), _, _) => tensors.push(tensor),
            (None, Some(dims), Some((dtype, id))) => tensors.push(burn_pack::Tensor::new(
                name,
                *dtype,
                dims,
                *id,
                Bytes::from_bytes_vec(Vec::new()),
            )),
            (None, _, Some(_)) => {
                return Err(corrupt(
                    &last,
                    format!(
                        "no saved record holds `{name}` whole: the checkpoint is missing a rank's file"
                    ),
                ));
            }
            (None, _, None) => {
                return Err(corrupt(
                    &last,
                    format!(
                        "holds nothing for the model's `{name}`: it was saved from another model"
                    ),
                ));
            }
        }
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Writer::new(tensors)
        .into_bytes()
        .map_err(|e| Error::other(format!("re-cutting the model record: {e}")))
}
