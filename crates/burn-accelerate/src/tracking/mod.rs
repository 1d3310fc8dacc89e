//! Experiment tracking: Accelerate's `log_with` / `init_trackers` / `log` / `end_training`.
//!
//! Ask for trackers when building the accelerator, start them once with the run's name and hyperparameters, log
//! values as training goes, and finish them at the end. Trackers run on the main process only (unless a custom
//! tracker says otherwise), so every rank can call [`Accelerator::log`](crate::Accelerator::log) unconditionally.
//!
//! Built in: [`JsonLinesTracker`] (`metrics.jsonl`), [`CsvTracker`] (`metrics.csv`) and [`TensorBoardTracker`]
//! (an `events.out.tfevents.*` file that TensorBoard opens). Each writes under
//! `<project_dir>/<project_name>/`, `project_dir` coming from the accelerator's
//! [`ProjectConfiguration`](crate::ProjectConfiguration).
//!
//! ```
//! use burn_accelerate::tracking::LogWith;
//! use burn_accelerate::{Accelerator, ProjectConfiguration};
//!
//! let dir = std::env::temp_dir().join(format!("tracking-doc-{}", std::process::id()));
//! let accelerator = Accelerator::builder()
//!     .project_configuration(ProjectConfiguration::new(&dir))
//!     .log_with(LogWith::JsonLines)
//!     .build()?;
//! accelerator.init_trackers("my_run", &serde_json::json!({"lr": 0.01, "epochs": 3}))?;
//! for step in 0..3u64 {
//!     accelerator.log([("loss", 1.0 / (step + 1) as f64)], Some(step))?;
//! }
//! accelerator.end_training()?;
//! let lines = std::fs::read_to_string(dir.join("my_run/metrics.jsonl")).unwrap();
//! assert_eq!(lines.lines().count(), 3);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), burn_accelerate::Error>(())
//! ```
//!
//! A tracker of your own implements [`Tracker`] and is added with
//! [`AcceleratorBuilder::log_with_tracker`](crate::AcceleratorBuilder::log_with_tracker).

mod csv_file;
mod jsonl;
pub mod progress;
pub mod tensorboard;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

pub use csv_file::CsvTracker;
pub use jsonl::JsonLinesTracker;
pub use tensorboard::TensorBoardTracker;

use crate::error::{Error, Result, io};

/// One logged value: a number or a text.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// An integer (a count, an epoch).
    Int(i64),
    /// A real number (a loss, an accuracy, a learning rate).
    Float(f64),
    /// A text (a sample prediction, a note).
    Text(String),
}

impl Value {
    /// The value as a number, when it is one.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(v) => Some(*v as f64),
            Value::Float(v) => Some(*v),
            Value::Text(_) => None,
        }
    }

    fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Int(v) => (*v).into(),
            // JSON has no NaN or infinity: those are written as strings, so a diverged run is still recorded.
            Value::Float(v) if v.is_finite() => (*v).into(),
            Value::Float(v) => v.to_string().into(),
            Value::Text(v) => v.clone().into(),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(v) => write!(f, "{v}"),
            Value::Float(v) => write!(f, "{v}"),
            Value::Text(v) => f.write_str(v),
        }
    }
}

macro_rules! value_from {
    ($variant:ident as $target:ty: $($t:ty),*) => {
        $(impl From<$t> for Value {
            fn from(v: $t) -> Self {
                Value::$variant(v as $target)
            }
        })*
    };
}
value_from!(Int as i64: i8, i16, i32, i64, u8, u16, u32, isize);
value_from!(Float as f64: f32, f64);

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        i64::try_from(v).map_or(Value::Float(v as f64), Value::Int)
    }
}

impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::from(v as u64)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}

/// One call to [`Accelerator::log`](crate::Accelerator::log), as every tracker receives it.
#[derive(Debug, Clone)]
pub struct Record<'a> {
    /// The step: the one given, else the number of earlier `log` calls.
    pub step: u64,
    /// Seconds since the Unix epoch when the values were logged.
    pub wall_time: f64,
    /// The values, in the order given.
    pub values: &'a [(String, Value)],
}

/// What a tracker is started with.
#[derive(Debug, Clone)]
pub struct TrackerInit {
    /// The run's name (`init_trackers`' `project_name`).
    pub project_name: String,
    /// The folder the built-in trackers write into: `<project_dir>/<project_name>`, or `None` when the
    /// accelerator has no `project_dir`.
    pub logging_dir: Option<PathBuf>,
    /// The rank this tracker runs on.
    pub process_index: usize,
}

impl TrackerInit {
    /// The logging folder, created; an error saying how to set one when there is none.
    pub fn require_logging_dir(&self, tracker: &str) -> Result<PathBuf> {
        let dir = self.logging_dir.clone().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the {tracker} tracker writes files but the accelerator has no project folder: build it with \
                 `.project_configuration(ProjectConfiguration::new(\"runs\"))`"
            ))
        })?;
        std::fs::create_dir_all(&dir).map_err(io("creating the logging folder", &dir))?;
        Ok(dir)
    }
}

/// An experiment tracker (Accelerate's `GeneralTracker`).
///
/// ```
/// use burn_accelerate::tracking::{Record, Tracker};
///
/// /// Keeps every value in memory.
/// #[derive(Default)]
/// struct InMemory(Vec<(u64, String, f64)>);
///
/// impl Tracker for InMemory {
///     fn name(&self) -> &str {
///         "in_memory"
///     }
///     fn log(&mut self, record: &Record<'_>) -> burn_accelerate::Result<()> {
///         for (key, value) in record.values {
///             self.0.push((record.step, key.clone(), value.as_f64().unwrap_or(f64::NAN)));
///         }
///         Ok(())
///     }
/// }
/// ```
pub trait Tracker: Send {
    /// A short name (`"tensorboard"`, `"jsonl"`, ...), used in error messages.
    fn name(&self) -> &str;

    /// Whether the tracker runs on the main process only (the default, as in Accelerate). When `false`, every
    /// rank starts its own.
    fn main_process_only(&self) -> bool {
        true
    }

    /// Records the run's hyperparameters, once, from [`init_trackers`](crate::Accelerator::init_trackers).
    fn store_init_configuration(&mut self, _config: &serde_json::Value) -> Result<()> {
        Ok(())
    }

    /// Records one call's values.
    fn log(&mut self, record: &Record<'_>) -> Result<()>;

    /// Flushes and closes, from [`end_training`](crate::Accelerator::end_training).
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Makes a custom tracker when the trackers start (once per rank that runs it).
pub type TrackerFactory = Arc<dyn Fn(&TrackerInit) -> Result<Box<dyn Tracker>> + Send + Sync>;

/// Which trackers an accelerator runs (Accelerate's `log_with`).
#[derive(Clone)]
pub enum LogWith {
    /// [`JsonLinesTracker`]: one JSON object a line in `metrics.jsonl`.
    JsonLines,
    /// [`CsvTracker`]: `step,wall_time,name,value` rows in `metrics.csv`.
    Csv,
    /// [`TensorBoardTracker`]: an event file TensorBoard opens.
    TensorBoard,
    /// Every built-in tracker.
    All,
    /// A tracker of your own.
    Custom(TrackerFactory),
}

impl fmt::Debug for LogWith {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LogWith::JsonLines => f.write_str("JsonLines"),
            LogWith::Csv => f.write_str("Csv"),
            LogWith::TensorBoard => f.write_str("TensorBoard"),
            LogWith::All => f.write_str("All"),
            LogWith::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl FromStr for LogWith {
    type Err = Error;

    /// `jsonl`, `csv`, `tensorboard` or `all` (any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "jsonl" | "json" | "jsonlines" => Ok(LogWith::JsonLines),
            "csv" => Ok(LogWith::Csv),
            "tensorboard" => Ok(LogWith::TensorBoard),
            "all" => Ok(LogWith::All),
            other => Err(Error::InvalidArgument(format!(
                "unknown tracker {other:?}: expected jsonl, csv, tensorboard or all"
            ))),
        }
    }
}

impl LogWith {
    fn start(&self, init: &TrackerInit) -> Result<Vec<Box<dyn Tracker>>> {
        Ok(match self {
            LogWith::JsonLines => vec![Box::new(JsonLinesTracker::new(init)?)],
            LogWith::Csv => vec![Box::new(CsvTracker::new(init)?)],
            LogWith::TensorBoard => vec![Box::new(TensorBoardTracker::new(init)?)],
            LogWith::All => {
                let mut all = LogWith::JsonLines.start(init)?;
                all.extend(LogWith::Csv.start(init)?);
                all.extend(LogWith::TensorBoard.start(init)?);
                all
            }
            LogWith::Custom(factory) => vec![factory(init)?],
        })
    }
}

/// The accelerator's trackers: what was asked for, and once started, the running ones.
#[derive(Default)]
pub(crate) struct Trackers {
    requested: Vec<LogWith>,
    project_dir: Option<PathBuf>,
    running: Vec<Box<dyn Tracker>>,
    started: bool,
    calls: u64,
}

impl Trackers {
    pub(crate) fn new(requested: Vec<LogWith>, project_dir: Option<&Path>) -> Self {
        Self {
            requested,
            project_dir: project_dir.map(Path::to_path_buf),
            ..Self::default()
        }
    }

    /// Starts the requested trackers that run on this rank and gives them the configuration.
    pub(crate) fn init(
        &mut self,
        project_name: &str,
        config: &serde_json::Value,
        process_index: usize,
    ) -> Result<()> {
        if self.started {
            return Err(Error::InvalidArgument(
                "init_trackers was already called: call it once per run (end_training closes the trackers)"
                    .into(),
            ));
        }
        if project_name.is_empty() || Path::new(project_name).components().count() != 1 {
            return Err(Error::InvalidArgument(format!(
                "init_trackers: project name {project_name:?} must be one folder name (no separators)"
            )));
        }
        let init = TrackerInit {
            project_name: project_name.to_string(),
            logging_dir: self.project_dir.as_ref().map(|d| d.join(project_name)),
            process_index,
        };
        let mut running = Vec::new();
        for request in &self.requested {
            // Built-in trackers run on the main process only: not even their files are created elsewhere.
            let builtin = !matches!(request, LogWith::Custom(_));
            if builtin && process_index != 0 {
                continue;
            }
            for tracker in request.start(&init)? {
                if tracker.main_process_only() && process_index != 0 {
                    continue;
                }
                running.push(tracker);
            }
        }
        if !config.is_null() {
            for tracker in &mut running {
                tracker.store_init_configuration(config)?;
            }
        }
        self.running = running;
        self.started = true;
        Ok(())
    }

    /// Gives every running tracker one record.
    pub(crate) fn log(&mut self, values: Vec<(String, Value)>, step: Option<u64>) -> Result<()> {
        let step = step.unwrap_or(self.calls);
        self.calls += 1;
        if self.running.is_empty() {
            return Ok(());
        }
        let record = Record {
            step,
            wall_time: now(),
            values: &values,
        };
        for tracker in &mut self.running {
            tracker.log(&record)?;
        }
        Ok(())
    }

    /// Finishes every running tracker; all are finished even when one fails (the first error is returned).
    pub(crate) fn finish(&mut self) -> Result<()> {
        let mut first = None;
        for mut tracker in self.running.drain(..) {
            if let Err(e) = tracker.finish() {
                first.get_or_insert(e);
            }
        }
        self.started = false;
        first.map_or(Ok(()), Err)
    }

    /// The names of the running trackers.
    pub(crate) fn names(&self) -> Vec<String> {
        self.running.iter().map(|t| t.name().to_string()).collect()
    }
}

/// The configuration as JSON, refusing values JSON cannot hold.
pub(crate) fn config_json(config: &impl Serialize) -> Result<serde_json::Value> {
    serde_json::to_value(config).map_err(|e| {
        Error::InvalidArgument(format!(
            "init_trackers: the configuration cannot be written as JSON: {e}"
        ))
    })
}

/// Seconds since the Unix epoch (0 on a clock set before it).
pub(crate) fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_convert_from_numbers_and_text() {
        assert_eq!(Value::from(3usize), Value::Int(3));
        assert_eq!(Value::from(u64::MAX), Value::Float(u64::MAX as f64));
        assert_eq!(Value::from(0.5f32), Value::Float(0.5));
        assert_eq!(Value::from("a"), Value::Text("a".into()));
        assert_eq!(Value::Float(f64::NAN).to_json(), serde_json::json!("NaN"));
    }

    #[test]
    fn log_with_parses_names_and_refuses_others() {
        assert!(matches!("TensorBoard".parse(), Ok(LogWith::TensorBoard)));
        assert!(matches!("jsonl".parse(), Ok(LogWith::JsonLines)));
        let err = "wandb".parse::<LogWith>().unwrap_err().to_string();
        assert!(
            err.contains("expected jsonl, csv, tensorboard or all"),
            "{err}"
        );
    }

    #[test]
    fn file_trackers_need_a_project_folder() {
        let mut trackers = Trackers::new(vec![LogWith::Csv], None);
        let err = trackers
            .init("run", &serde_json::Value::Null, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("ProjectConfiguration::new"), "{err}");
    }

    #[test]
    fn steps_default_to_the_call_count_and_other_ranks_start_no_builtin_tracker() {
        let dir = std::env::temp_dir().join(format!("trackers-unit-{}", std::process::id()));
        let mut rank1 = Trackers::new(vec![LogWith::All], Some(&dir));
        rank1.init("run", &serde_json::Value::Null, 1).unwrap();
        assert!(rank1.names().is_empty());
        assert!(!dir.join("run").exists());

        let mut rank0 = Trackers::new(vec![LogWith::JsonLines], Some(&dir));
        rank0.init("run", &serde_json::Value::Null, 0).unwrap();
        rank0.log(vec![("a".into(), 1.into())], None).unwrap();
        rank0.log(vec![("a".into(), 2.into())], Some(10)).unwrap();
        rank0.log(vec![("a".into(), 3.into())], None).unwrap();
        rank0.finish().unwrap();
        let steps: Vec<u64> = std::fs::read_to_string(dir.join("run/metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(steps, vec![0, 10, 2]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
