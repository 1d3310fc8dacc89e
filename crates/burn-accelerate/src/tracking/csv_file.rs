//! [`CsvTracker`]: `metrics.csv` in long form, one row per logged value.

use std::fs::{File, OpenOptions};
use std::path::PathBuf;

use super::{Record, Tracker, TrackerInit};
use crate::error::{Error, Result, io};

/// Writes `<logging_dir>/metrics.csv` with the columns `step,wall_time,name,value`, one row per value, so that
/// values first logged late in a run never change the columns (pivot on `name` for one column per value). A
/// resumed run appends to the same file; rows are flushed when logged.
pub struct CsvTracker {
    path: PathBuf,
    writer: csv::Writer<File>,
}

impl CsvTracker {
    /// Opens (appending) `metrics.csv` in the logging folder, writing the header when the file is new.
    pub fn new(init: &TrackerInit) -> Result<Self> {
        let dir = init.require_logging_dir("csv")?;
        let path = dir.join("metrics.csv");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io("opening", &path))?;
        let empty = file.metadata().map_err(io("reading", &path))?.len() == 0;
        let mut tracker = Self {
            writer: csv::Writer::from_writer(file),
            path,
        };
        if empty {
            tracker.write_row(["step", "wall_time", "name", "value"])?;
        }
        Ok(tracker)
    }

    /// The metrics file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn write_row<I, T>(&mut self, row: I) -> Result<()>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<[u8]>,
    {
        self.writer.write_record(row).map_err(|e| self.error(e))
    }

    fn error(&self, e: csv::Error) -> Error {
        let source = match e.into_kind() {
            csv::ErrorKind::Io(io) => io,
            other => std::io::Error::other(format!("{other:?}")),
        };
        Error::Io {
            operation: "writing",
            path: self.path.clone(),
            source,
        }
    }
}

impl Tracker for CsvTracker {
    fn name(&self) -> &str {
        "csv"
    }

    fn log(&mut self, record: &Record<'_>) -> Result<()> {
        let (step, time) = (record.step.to_string(), format!("{:.3}", record.wall_time));
        for (name, value) in record.values {
            self.write_row([step.as_str(), time.as_str(), name, &value.to_string()])?;
        }
        self.writer.flush().map_err(io("writing", &self.path))
    }

    fn finish(&mut self) -> Result<()> {
        self.writer.flush().map_err(io("writing", &self.path))
    }
}
