//! The [`Accelerator`]'s experiment tracking and progress bars, forwarded to [`tracking`](crate::tracking) and
//! [`progress`].

use std::sync::MutexGuard;

use serde::Serialize;

use super::Accelerator;
use crate::error::Result;
use crate::tracking::progress;
use crate::tracking::{self, Trackers, Value};

impl Accelerator {
    fn trackers(&self) -> MutexGuard<'_, Trackers> {
        // A tracker that panicked leaves nothing half-updated that matters here: keep going.
        self.trackers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the trackers asked for with [`log_with`](crate::AcceleratorBuilder::log_with), in
    /// `<project_dir>/<project_name>/`, and records `config` (the run's hyperparameters; anything serde can
    /// write as JSON, `&()` for none). Call it on every rank: trackers start on the main process only, unless
    /// a custom tracker says otherwise.
    ///
    /// # Errors
    /// Called twice, a name that is not one folder name, no `project_dir` for a tracker that writes files, or
    /// a tracker that cannot start.
    pub fn init_trackers(&self, project_name: &str, config: &impl Serialize) -> Result<()> {
        let config = tracking::config_json(config)?;
        self.trackers()
            .init(project_name, &config, self.process_index())
    }

    /// Logs values at `step` (default: the number of earlier `log` calls) to every running tracker. Call it
    /// on every rank; ranks without trackers return at once. Values are numbers or texts:
    ///
    /// ```
    /// # let accelerator = burn_accelerate::Accelerator::new()?;
    /// use burn_accelerate::tracking::Value;
    /// accelerator.log([("loss", 0.25), ("lr", 1e-3)], Some(10))?;
    /// accelerator.log([("epoch", Value::from(1)), ("note", Value::from("warm-up done"))], None)?;
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// A tracker fails to write.
    pub fn log<I, K, V>(&self, values: I, step: Option<u64>) -> Result<()>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<Value>,
    {
        let values = values
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        self.trackers().log(values, step)
    }

    /// Finishes every tracker (flushing and closing its files), then waits for every rank, as Accelerate's
    /// `end_training` does. Call it on every rank at the end of training.
    ///
    /// # Errors
    /// A tracker fails to finish (all are still finished), or a rank does not arrive.
    pub fn end_training(&self) -> Result<()> {
        let finished = self.trackers().finish();
        self.wait_for_everyone()?;
        finished
    }

    /// The names of the trackers running on this rank (empty on other ranks than the main one, and before
    /// [`init_trackers`](Self::init_trackers)).
    pub fn tracker_names(&self) -> Vec<String> {
        self.trackers().names()
    }

    /// A progress bar of `len` steps counting `unit` (`"steps"`, `"samples"`, ...), with throughput and time
    /// left, drawn by the local main process on a terminal and hidden everywhere else (so every rank can call
    /// `inc`). See [`progress`].
    pub fn progress_bar(&self, len: u64, unit: &str) -> progress::indicatif::ProgressBar {
        progress::bar(len, unit, self.is_local_main_process())
    }
}
