//! burn-train renderers: [`QuietRenderer`] shows nothing (ranks other than the main process, benchmarks,
//! tests); [`LineRenderer`] prints one line per split of each epoch, for the main process when burn-train's
//! terminal UI is not compiled in (burn-train's fallback prints a debug dump of its progress for every batch).

use std::collections::HashMap;
use std::io::Write;

use burn_train::LearnerSummary;
use burn_train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn_train::metric::{MetricDefinition, MetricId};
use burn_train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// A renderer that draws and prints nothing (burn-train's CLI renderer prints every update).
#[derive(Debug, Default, Clone, Copy)]
pub struct QuietRenderer;

impl MetricsRendererTraining for QuietRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for QuietRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl TrainingProgressLogger for QuietRenderer {
    fn start(
        &mut self,
        _epochs: usize,
        _starting: usize,
        _items: Option<usize>,
        _label: Option<&str>,
    ) {
    }
    fn update_epoch(&mut self, _epoch: usize) {}
    fn start_split(&mut self, _split: &str, _total_items: usize) {}
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for QuietRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for QuietRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// Prints, on standard output, one line when training starts and one per split of each epoch with the latest
/// value of every metric (burn-train's epoch summary as its renderer formats it), e.g.
/// `epoch 2/3 valid: Loss 0.211 - Accuracy 91.000 %`. [`Accelerator::prepare_training`] gives it to the main
/// process unless the feature `train-tui` brings burn-train's terminal UI.
///
/// [`Accelerator::prepare_training`]: crate::Accelerator::prepare_training
#[derive(Debug, Default, Clone)]
pub struct LineRenderer {
    names: Vec<(MetricId, String)>,
    latest: HashMap<MetricId, String>,
    split: String,
    epoch: usize,
    epochs: usize,
}

impl LineRenderer {
    /// A renderer that has printed nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn record(&mut self, state: MetricState) {
        let (MetricState::Generic(entry) | MetricState::Numeric(entry, _)) = state;
        self.latest
            .insert(entry.metric_id, entry.serialized_entry.formatted);
    }

    /// The line for the split that just ended.
    fn summary(&self) -> String {
        let metrics: Vec<String> = self
            .names
            .iter()
            .filter_map(|(id, name)| Some(format!("{name} {}", self.latest.get(id)?)))
            .collect();
        let mut line = format!("epoch {}/{} {}", self.epoch, self.epochs, self.split);
        if !metrics.is_empty() {
            line.push_str(": ");
            line.push_str(&metrics.join(", "));
        }
        line
    }
}

impl MetricsRendererTraining for LineRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.record(state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.record(state);
    }
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for LineRenderer {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.record(state);
    }
}

impl TrainingProgressLogger for LineRenderer {
    fn start(
        &mut self,
        epochs: usize,
        starting: usize,
        _items: Option<usize>,
        label: Option<&str>,
    ) {
        self.epochs = epochs;
        self.epoch = starting;
        let _ = writeln!(
            std::io::stdout().lock(),
            "{}: epochs {starting} to {epochs}",
            label.unwrap_or("training")
        );
    }
    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }
    fn start_split(&mut self, split: &str, _total_items: usize) {
        self.split = split.to_string();
        self.latest.clear();
    }
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {
        let _ = writeln!(std::io::stdout().lock(), "{}", self.summary());
    }
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for LineRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, name: &str, _total_items: usize) {
        self.split = name.to_string();
        self.latest.clear();
    }
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {
        let _ = writeln!(std::io::stdout().lock(), "{}", self.summary());
    }
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for LineRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        if !self.names.iter().any(|(id, _)| *id == definition.metric_id) {
            self.names
                .push((definition.metric_id, definition.name.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn_train::metric::{MetricAttributes, MetricEntry, SerializedEntry};

    use super::*;

    fn loss_entry(formatted: &str) -> MetricState {
        MetricState::Generic(MetricEntry::new(
            MetricId::new(Arc::new("Loss".into())),
            SerializedEntry::new(formatted.into(), "0".into()),
        ))
    }

    #[test]
    fn one_line_per_split_with_the_latest_value_of_each_metric() {
        let mut r = LineRenderer::new();
        r.register_metric(MetricDefinition {
            metric_id: MetricId::new(Arc::new("Loss".into())),
            name: Arc::new("Loss".into()),
            description: None,
            attributes: MetricAttributes::None,
        });
        TrainingProgressLogger::start(&mut r, 3, 1, None, None);
        TrainingProgressLogger::start_split(&mut r, "train", 10);
        r.update_train(loss_entry("epoch 0.9 - batch 1.0"));
        r.update_train(loss_entry("epoch 0.5 - batch 0.4"));
        assert_eq!(r.summary(), "epoch 1/3 train: Loss epoch 0.5 - batch 0.4");
        TrainingProgressLogger::update_epoch(&mut r, 1);
        TrainingProgressLogger::start_split(&mut r, "valid", 10);
        assert_eq!(r.summary(), "epoch 2/3 valid", "a new split starts empty");
    }
}
