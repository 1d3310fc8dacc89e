//! Where automatic checkpoints go, and what else a checkpoint may carry: the project configuration and
//! [`Checkpointable`] objects.

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::manifest::MANIFEST;
use crate::error::{Error, Result};

/// Where automatic checkpoints go (Accelerate's `ProjectConfiguration`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectConfiguration {
    /// The project folder.
    pub project_dir: Option<PathBuf>,
    /// Name checkpoints `project_dir/checkpoints/checkpoint_{iteration}` when `save_state` gets no folder.
    pub automatic_checkpoint_naming: bool,
    /// Keep at most this many automatic checkpoints (the oldest are removed).
    pub total_limit: Option<usize>,
    /// The number of the next automatic checkpoint. Unlike Accelerate, `load_state` restores it, so the next
    /// save does not overwrite an existing checkpoint.
    pub iteration: usize,
}

impl ProjectConfiguration {
    /// Automatic naming under `project_dir`.
    pub fn new(project_dir: impl Into<PathBuf>) -> Self {
        Self {
            project_dir: Some(project_dir.into()),
            automatic_checkpoint_naming: true,
            total_limit: None,
            iteration: 0,
        }
    }

    /// Keeps at most `limit` automatic checkpoints.
    pub fn total_limit(mut self, limit: usize) -> Self {
        self.total_limit = Some(limit);
        self
    }

    /// The folder of automatic checkpoints.
    pub fn checkpoints_dir(&self) -> Option<PathBuf> {
        self.project_dir.as_ref().map(|d| d.join("checkpoints"))
    }

    /// Complete automatic checkpoints, oldest first, as (iteration, folder).
    pub fn checkpoints(&self) -> Vec<(usize, PathBuf)> {
        let Some(dir) = self.checkpoints_dir() else {
            return Vec::new();
        };
        let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                let i = name.strip_prefix("checkpoint_")?.parse().ok()?;
                e.path().join(MANIFEST).exists().then(|| (i, e.path()))
            })
            .collect();
        found.sort();
        found
    }
}

/// A value that can be saved in and restored from a checkpoint. Implemented for every serde type.
pub trait Checkpointable: Send {
    /// The value's state.
    fn state_dict(&self) -> Result<serde_json::Value>;
    /// Restores the value from `state`.
    fn load_state_dict(&mut self, state: serde_json::Value) -> Result<()>;
}

impl<T: Serialize + DeserializeOwned + Send> Checkpointable for T {
    fn state_dict(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self)
            .map_err(|e| Error::InvalidArgument(format!("checkpoint object: {e}")))
    }

    fn load_state_dict(&mut self, state: serde_json::Value) -> Result<()> {
        *self = serde_json::from_value(state).map_err(|e| {
            Error::InvalidArgument(format!("checkpoint object does not match its type: {e}"))
        })?;
        Ok(())
    }
}
