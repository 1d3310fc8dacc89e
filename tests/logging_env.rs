//! `ACCELERATE_LOG_LEVEL` sets the level of loggers created without an explicit one; an explicit level wins.
//! One test function, so that the environment change is not raced.

#[path = "support/isolation.rs"]
mod isolation;

use std::sync::Mutex;

use burn_accelerate::logging::get_logger;
use burn_accelerate::{Accelerator, acc_debug, acc_info, acc_trace};
use log::{LevelFilter, Log, Metadata, Record};

struct Capture(Mutex<Vec<String>>);
impl Log for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &Record<'_>) {
        self.0
            .lock()
            .unwrap()
            .push(format!("{} {}", record.level(), record.args()));
    }
    fn flush(&self) {}
}
static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

#[test]
fn env_level_and_prefix() {
    log::set_logger(&CAPTURE).unwrap();
    // SAFETY: single test function in this binary.
    unsafe { std::env::set_var("ACCELERATE_LOG_LEVEL", "DEBUG") };
    assert_eq!(log::max_level(), LevelFilter::Off);

    // Before any Accelerator exists: no panic, rank 0.
    let logger = get_logger("env_test", None);
    assert_eq!(logger.level(), Some(LevelFilter::Debug));
    assert!(
        log::max_level() >= LevelFilter::Debug,
        "the global level was raised"
    );
    acc_debug!(logger, "before accelerator");
    acc_trace!(logger, "too verbose");

    let _accelerator = Accelerator::new().unwrap();
    acc_info!(logger, "with accelerator");
    let explicit = get_logger("env_test", Some(LevelFilter::Warn));
    acc_info!(explicit, "filtered by the explicit level");

    let lines = CAPTURE.0.lock().unwrap().clone();
    let ours: Vec<&String> = lines.iter().filter(|l| l.contains("[RANK")).collect();
    assert_eq!(
        ours,
        vec![
            "DEBUG [RANK 0] before accelerator",
            "INFO [RANK 0] with accelerator"
        ]
    );
}
