//! Experiment tracking across ranks: the built-in trackers write on the main process only, hold every logged
//! value, and TensorBoard's own loader reads the event file (the Python cross-check, required in CI).

use crate::python;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn_accelerate::tracking::tensorboard::read_events;
use burn_accelerate::tracking::{LogWith, Record, Tracker, Value};
use burn_accelerate::{Accelerator, ProjectConfiguration, Result};

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tracking-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A custom tracker running on every rank, recording what it received.
struct Recording {
    rank: usize,
    seen: Arc<Mutex<Vec<(usize, u64, String)>>>,
}

impl Tracker for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn main_process_only(&self) -> bool {
        false
    }
    fn log(&mut self, record: &Record<'_>) -> Result<()> {
        let mut seen = self.seen.lock().unwrap();
        for (key, _) in record.values {
            seen.push((self.rank, record.step, key.clone()));
        }
        Ok(())
    }
}

fn the_event_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

#[test]
fn two_ranks_log_through_every_tracker_and_only_the_main_rank_writes_files() {
    let dir = fresh_dir("ranks");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = seen.clone();
    let builder = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&dir))
        .log_with(LogWith::All)
        .log_with_tracker(move |init| {
            Ok(Box::new(Recording {
                rank: init.process_index,
                seen: recorded.clone(),
            }))
        });
    let names = builder
        .launch(2, |acc| {
            acc.init_trackers("run", &serde_json::json!({"lr": 0.5, "name": "two ranks"}))?;
            for step in 0..5u64 {
                let loss = 1.0 / (step + 1) as f64 + acc.process_index() as f64;
                acc.log([("loss", loss), ("lr", 0.5)], Some(step * 10))?;
            }
            acc.log(
                [
                    ("note", Value::from("done")),
                    ("nan", Value::from(f64::NAN)),
                ],
                None,
            )?;
            let names = acc.tracker_names();
            acc.end_training()?;
            Ok(names)
        })
        .unwrap();
    assert_eq!(names[0], ["jsonl", "csv", "tensorboard", "recording"]);
    assert_eq!(names[1], ["recording"]);
    // The custom tracker ran on both ranks and saw every call; the unstepped call got the call count (5).
    let seen = seen.lock().unwrap();
    for rank in 0..2 {
        let steps: Vec<u64> = seen.iter().filter(|s| s.0 == rank).map(|s| s.1).collect();
        assert_eq!(steps, [0, 0, 10, 10, 20, 20, 30, 30, 40, 40, 5, 5]);
    }

    let run = dir.join("run");
    // JSON lines: rank 0's values only (rank 1's loss is 1 higher).
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    assert_eq!(lines[3]["step"], 30);
    assert_eq!(lines[3]["values"]["loss"], 0.25);
    assert_eq!(lines[5]["values"]["note"], "done");
    assert_eq!(lines[5]["values"]["nan"], "NaN");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["lr"], 0.5);
    // CSV in long form: a header and one row per value.
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows[0], "step,wall_time,name,value");
    assert_eq!(rows.len(), 1 + 5 * 2 + 2);
    assert!(
        rows[1].starts_with("0,") && rows[1].ends_with(",loss,1"),
        "{}",
        rows[1]
    );
    assert!(rows[3].ends_with(",loss,0.5"), "{}", rows[3]);
    // TensorBoard: the version record, the hyperparameters' text, five steps of two scalars, and the texts.
    let events = read_events(the_event_file(&run)).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let scalars: Vec<(u64, String, f64)> = events
        .iter()
        .flat_map(|e| {
            e.values.iter().filter_map(move |(tag, v)| match v {
                Value::Float(x) if tag == "loss" => Some((e.step, tag.clone(), *x)),
                _ => None,
            })
        })
        .collect();
    let expected: Vec<(u64, String, f64)> = (0..5u64)
        .map(|s| (s * 10, "loss".to_string(), (1.0 / (s + 1) as f32) as f64))
        .collect();
    assert_eq!(scalars, expected);
    let texts: Vec<&(String, Value)> = events
        .iter()
        .flat_map(|e| &e.values)
        .filter(|(_, v)| matches!(v, Value::Text(_)))
        .collect();
    assert_eq!(texts.len(), 2);
    assert!(matches!(&texts[0].1, Value::Text(t) if t.contains("| lr | 0.5 |")));
    assert_eq!(texts[1], &("note".to_string(), Value::Text("done".into())));
    assert_eq!(
        std::fs::read_to_string(run.join("hparams.yml")).unwrap(),
        "lr: 0.5\nname: two ranks\n"
    );

    // TensorBoard's own reader sees the same scalars and texts.
    if let Some(python) = python::python_with(&["tensorboard"]) {
        let out = python::run(&python, "read_tensorboard.py", &[&run]);
        let read: serde_json::Value = serde_json::from_str(&out).unwrap();
        let loss: Vec<(u64, f64)> = read["scalars"]["loss"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect();
        let want: Vec<(u64, f64)> = expected.iter().map(|(s, _, v)| (*s, *v)).collect();
        assert_eq!(loss, want);
        assert_eq!(read["scalars"]["lr"].as_array().unwrap().len(), 5);
        assert_eq!(read["scalars"]["nan"][0], serde_json::json!([5, "nan"]));
        assert_eq!(read["texts"]["note/text_summary"][0][1], "done");
        assert_eq!(read["texts"]["note/text_summary"][0][0], 5);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_resumed_run_appends_and_starts_a_new_event_file() {
    let dir = fresh_dir("resume");
    for (first, count) in [(0u64, 3u64), (3, 2)] {
        let acc = Accelerator::builder()
            .project_configuration(ProjectConfiguration::new(&dir))
            .log_with(LogWith::All)
            .build()
            .unwrap();
        acc.init_trackers("run", &()).unwrap();
        for step in first..first + count {
            acc.log([("loss", step as f64)], Some(step)).unwrap();
        }
        acc.end_training().unwrap();
        // A new event file per start (same second, same process: the counter keeps names apart).
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let run = dir.join("run");
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 5);
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().filter(|l| l.starts_with("step,")).count(), 1);
    assert_eq!(csv.lines().count(), 6);
    let events = std::fs::read_dir(&run)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("tfevents")
        })
        .count();
    assert_eq!(events, 2);
    // No configuration was given: no config files.
    assert!(!run.join("config.json").exists() && !run.join("hparams.yml").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tracking_mistakes_are_refused_with_what_to_do() {
    let acc = Accelerator::builder()
        .log_with(LogWith::TensorBoard)
        .build()
        .unwrap();
    let err = acc.init_trackers("run", &()).unwrap_err().to_string();
    assert!(
        err.contains("tensorboard tracker writes files but the accelerator has no project folder"),
        "{err}"
    );

    let dir = fresh_dir("mistakes");
    let acc = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&dir))
        .log_with(LogWith::JsonLines)
        .build()
        .unwrap();
    let err = acc.init_trackers("a/b", &()).unwrap_err().to_string();
    assert!(err.contains("must be one folder name"), "{err}");
    acc.init_trackers("run", &()).unwrap();
    let err = acc.init_trackers("run", &()).unwrap_err().to_string();
    assert!(err.contains("already called"), "{err}");
    // Logging without trackers (or before init) is a no-op, not an error.
    let plain = Accelerator::new().unwrap();
    plain.log([("loss", 1.0)], None).unwrap();
    plain.end_training().unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_tracker_that_cannot_write_reports_the_file() {
    let dir = fresh_dir("unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    // The run folder's name is taken by a file: the tracker cannot create its folder.
    std::fs::write(dir.join("run"), b"not a folder").unwrap();
    let acc = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&dir))
        .log_with(LogWith::Csv)
        .build()
        .unwrap();
    let err = acc.init_trackers("run", &()).unwrap_err().to_string();
    assert!(
        err.contains("creating the logging folder") && err.contains("run"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
