//! [`JsonLinesTracker`]: `metrics.jsonl`, one JSON object per `log` call.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use super::{Record, Tracker, TrackerInit};
use crate::error::{Result, io};

/// Writes `<logging_dir>/metrics.jsonl`: one line per [`log`](crate::Accelerator::log) call,
/// `{"step": 3, "wall_time": 1700000000.5, "values": {"loss": 0.25}}`, and the configuration to `config.json`.
/// A resumed run appends to the same file. Each line is flushed when logged.
pub struct JsonLinesTracker {
    path: PathBuf,
    file: BufWriter<File>,
    dir: PathBuf,
}

impl JsonLinesTracker {
    /// Opens (appending) `metrics.jsonl` in the logging folder.
    pub fn new(init: &TrackerInit) -> Result<Self> {
        let dir = init.require_logging_dir("jsonl")?;
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io("opening", &path))?;
        Ok(Self {
            path,
            file: BufWriter::new(file),
            dir,
        })
    }

    /// The metrics file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Tracker for JsonLinesTracker {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        let path = self.dir.join("config.json");
        let text = serde_json::to_string_pretty(config).unwrap_or_else(|_| "null".into());
        std::fs::write(&path, text + "\n").map_err(io("writing", &path))
    }

    fn log(&mut self, record: &Record<'_>) -> Result<()> {
        let values: serde_json::Map<String, serde_json::Value> = record
            .values
            .iter()
            .map(|(k, v)| (k.clone(), v.to_json()))
            .collect();
        let line = serde_json::json!({
            "step": record.step,
            "wall_time": record.wall_time,
            "values": values,
        });
        writeln!(self.file, "{line}")
            .and_then(|()| self.file.flush())
            .map_err(io("writing", &self.path))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.flush().map_err(io("writing", &self.path))
    }
}
