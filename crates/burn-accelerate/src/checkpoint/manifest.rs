//! What a checkpoint folder holds: `checkpoint.json` (the manifest, written last: a folder without it is not a
//! checkpoint), `model.bpk`, `model_1.bpk`, ... (Burn records, which keep parameter ids so the optimizer state
//! matches; one per rank as `model_rank<i>*.bpk` under `FULL_SHARD`, each holding that rank's dim-0 slices,
//! written in parallel without gathering), `optimizer*.bpk` (one set, or one per rank as
//! `optimizer_rank<i>*.bpk` under a sharded strategy; the manifest records how each parameter was split, so a
//! load on any number of ranks re-cuts the slices),
//! `scheduler*.bpk`, `objects.json` (registered objects) and one `rank_<i>.json` per rank (data positions).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::data::DataPosition;
use crate::precision::LossScaler;

/// The format tag of `checkpoint.json`.
pub const FORMAT: &str = "burn-accelerate-state/1";
/// The manifest's file name.
pub(crate) const MANIFEST: &str = "checkpoint.json";

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) format: String,
    pub(crate) iteration: usize,
    pub(crate) num_processes: usize,
    pub(crate) models: usize,
    pub(crate) optimizers: usize,
    pub(crate) schedulers: usize,
    pub(crate) objects: Vec<String>,
    pub(crate) scaler: Option<LossScaler>,
    /// Each optimizer's kind (`Adam`, ...), where known. Absent in older checkpoints.
    #[serde(default)]
    pub(crate) optimizer_kinds: Vec<Option<String>>,
    /// Whether each rank saved its own slice of the optimizer state (a sharded strategy). Absent in older
    /// checkpoints.
    #[serde(default)]
    pub(crate) optimizer_per_rank: bool,
    /// Whether each rank saved its own record of each model, holding its slices (`FULL_SHARD`). Absent
    /// in older checkpoints.
    #[serde(default)]
    pub(crate) model_per_rank: bool,
    /// The CRC-32C of each record the main process wrote (models, schedulers, and the optimizers when they are
    /// not per rank), by file name: a load refuses a file whose bytes changed after the save. Absent in older
    /// checkpoints, which load unchecked.
    #[serde(default)]
    pub(crate) checksums: std::collections::BTreeMap<String, u32>,
    /// How a sharded strategy split each trainable parameter over the ranks (rank `k`'s files hold part
    /// `k % parts`), so that a load on any number of ranks re-cuts the slices. Empty where every rank held every
    /// parameter whole, and in older checkpoints.
    #[serde(default)]
    pub(crate) splits: Vec<super::repartition::SavedSplit>,
    /// The saving run's pipeline stages, when it was pipelined: `splits` then lists every stage's parameters
    /// (each rank's splits, gathered), so that sharded stages re-cut for another number of data-parallel
    /// replicas. Absent in other and older checkpoints.
    #[serde(default)]
    pub(crate) pp_size: Option<usize>,
    /// The saving run's tensor-parallel ranks per group, when it had more than one: each rank's records hold its
    /// slices of the split layers, which `splits` lists (with the dimension each is cut along), so that another
    /// `tp_size` or number of ranks re-cuts them. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tp_size: Option<usize>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct RankState {
    pub(crate) dataloaders: Vec<DataPosition>,
    pub(crate) optimizer_steps: Vec<u64>,
    /// This rank's prepared dataloaders. Absent in older checkpoints.
    #[serde(default)]
    pub(crate) loaders: Vec<crate::data::LoaderFingerprint>,
}

/// The file stem of the optimizer states: one set for the run, or one per rank when each rank holds a slice.
pub(crate) fn optimizer_stem(per_rank: bool, rank: usize) -> String {
    if per_rank {
        format!("optimizer_rank{rank}")
    } else {
        "optimizer".into()
    }
}

/// The file stem of the model records: one set for the run, or one per rank when each rank holds its own
/// parameters (`model_rank<i>.bpk`).
pub(crate) fn model_stem(per_rank: bool, rank: usize) -> String {
    if per_rank {
        format!("model_rank{rank}")
    } else {
        "model".into()
    }
}

/// The file of part `i` named `stem` (`model.bpk`, `model_1.bpk`, ...).
pub(crate) fn file(dir: &Path, stem: &str, i: usize, ext: &str) -> PathBuf {
    if i == 0 {
        dir.join(format!("{stem}.{ext}"))
    } else {
        dir.join(format!("{stem}_{i}.{ext}"))
    }
}
