//! Logging across in-process ranks: `main_process_only` keeps rank 0's lines, `in_order` emits every rank's
//! line in rank order.

#[path = "support/isolation.rs"]
mod isolation;

use std::sync::Mutex;

use burn_accelerate::logging::get_logger;
use burn_accelerate::{acc_info, launch};
use log::{LevelFilter, Log, Metadata, Record};

struct Capture(Mutex<Vec<String>>);
impl Log for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &Record<'_>) {
        self.0.lock().unwrap().push(record.args().to_string());
    }
    fn flush(&self) {}
}
static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

#[test]
fn main_process_only_and_in_order_across_ranks() {
    log::set_logger(&CAPTURE).unwrap();
    for _ in 0..3 {
        CAPTURE.0.lock().unwrap().clear();
        launch(4, |acc| {
            let logger = get_logger("ranks", Some(LevelFilter::Info));
            // Stagger the ranks so that an unordered emission would show.
            std::thread::sleep(std::time::Duration::from_millis(
                5 * (4 - acc.process_index() as u64),
            ));
            acc_info!(logger, "main only from {}", acc.process_index());
            acc_info!(logger, in_order = true, "ordered {}", acc.process_index());
            acc_info!(logger, main_process_only = false, "everyone");
            // Accelerate's spelling: both options, in either order.
            acc_info!(
                logger,
                main_process_only = false,
                in_order = true,
                "both {}",
                acc.process_index()
            );
            acc_info!(
                logger,
                in_order = true,
                main_process_only = false,
                "both {}",
                acc.process_index()
            );
            Ok(())
        })
        .unwrap();
        let lines = CAPTURE.0.lock().unwrap().clone();
        let main_only: Vec<&String> = lines.iter().filter(|l| l.contains("main only")).collect();
        assert_eq!(main_only, vec!["[RANK 0] main only from 0"]);
        let ordered: Vec<&String> = lines.iter().filter(|l| l.contains("ordered")).collect();
        assert_eq!(
            ordered,
            vec![
                "[RANK 0] ordered 0",
                "[RANK 1] ordered 1",
                "[RANK 2] ordered 2",
                "[RANK 3] ordered 3"
            ]
        );
        assert_eq!(lines.iter().filter(|l| l.ends_with("everyone")).count(), 4);
        let both: Vec<&String> = lines.iter().filter(|l| l.contains("both")).collect();
        let expected: Vec<String> = (0..4)
            .chain(0..4)
            .map(|r| format!("[RANK {r}] both {r}"))
            .collect();
        assert_eq!(both, expected.iter().collect::<Vec<_>>());
    }
}
