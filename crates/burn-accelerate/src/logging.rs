//! Accelerate-style logging on the [`log`] facade.
//!
//! [`get_logger`] returns a [`MultiProcessLogger`]: messages are prefixed with `[RANK i] `, emitted by the main
//! process only unless asked otherwise, or by every rank in rank order (`in_order`). The level comes from the
//! explicit argument, else `ACCELERATE_LOG_LEVEL`, else whatever the installed logger allows. It works before
//! and without an [`Accelerator`](crate::Accelerator) (rank taken from the launcher's environment, else 0).
//!
//! Any `log` backend shows the messages (`env_logger`, `simplelog`, ...); [`init`] installs a small stderr one
//! for programs that have none.
//!
//! ```
//! use burn_accelerate::{acc_info, logging::get_logger};
//! let logger = get_logger("train", Some(log::LevelFilter::Info));
//! acc_info!(logger, "epoch {} done", 3);                          // main process only
//! acc_info!(logger, main_process_only = false, "on every rank");  // every rank
//! acc_info!(logger, in_order = true, "every rank, in rank order");
//! acc_info!(logger, main_process_only = false, in_order = true, "the same, as Accelerate spells it");
//! ```
//!
//! With `in_order`, every rank must reach the call with the same level enabled: it takes one barrier per rank.

use std::fmt;
use std::io::Write;
use std::str::FromStr;

use log::{Level, LevelFilter, Log, Metadata, Record};

use crate::distributed;

/// Where a message is emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogOptions {
    /// Emit on the main process only (default `true`). Ignored when `in_order` is set.
    pub main_process_only: bool,
    /// Emit on every rank, one rank after the other (default `false`).
    pub in_order: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            main_process_only: true,
            in_order: false,
        }
    }
}

/// A logger that knows about ranks: Accelerate's `MultiProcessAdapter`.
#[derive(Debug, Clone)]
pub struct MultiProcessLogger {
    name: String,
    level: Option<LevelFilter>,
}

/// Parses a level name as Python's logging spells it (`DEBUG`, `INFO`, `WARNING`/`WARN`, `ERROR`, `CRITICAL`),
/// plus `TRACE` and `OFF`, case-insensitively.
pub fn parse_level(name: &str) -> Option<LevelFilter> {
    match name.trim().to_ascii_uppercase().as_str() {
        "WARNING" => Some(LevelFilter::Warn),
        "CRITICAL" | "FATAL" => Some(LevelFilter::Error),
        other => LevelFilter::from_str(other).ok(),
    }
}

/// The level a logger gets: the explicit one, else the environment value; an unknown environment value is
/// reported and ignored.
pub fn resolve_level(
    explicit: Option<LevelFilter>,
    env_value: Option<&str>,
) -> Option<LevelFilter> {
    explicit.or_else(|| {
        let value = env_value?;
        let level = parse_level(value);
        if level.is_none() {
            log::warn!(
                "ACCELERATE_LOG_LEVEL={value:?} is not a log level; use one of TRACE, DEBUG, INFO, WARNING, ERROR, \
                 CRITICAL. Keeping the current level."
            );
        }
        level
    })
}

/// A logger named `name` (the `log` target of its records). `log_level` wins over `ACCELERATE_LOG_LEVEL`; when
/// either is set, the global `log` maximum level is raised to it if it was lower, so that the records pass.
pub fn get_logger(name: &str, log_level: Option<LevelFilter>) -> MultiProcessLogger {
    let env_value = std::env::var("ACCELERATE_LOG_LEVEL").ok();
    let level = resolve_level(log_level, env_value.as_deref());
    if let Some(level) = level
        && level > log::max_level()
    {
        log::set_max_level(level);
    }
    MultiProcessLogger {
        name: name.to_string(),
        level,
    }
}

impl MultiProcessLogger {
    /// The target of this logger's records.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The level set for this logger, if any.
    pub fn level(&self) -> Option<LevelFilter> {
        self.level
    }

    /// Whether a record of `level` would be emitted by this rank's logger backend.
    pub fn is_enabled(&self, level: Level) -> bool {
        if self.level.is_some_and(|l| level > l) {
            return false;
        }
        level <= log::max_level()
            && log::logger().enabled(&Metadata::builder().level(level).target(&self.name).build())
    }

    /// Emits `args` at `level` with `options`, from the call site `location` (`module_path`, `file`, `line`).
    /// The macros ([`acc_info!`](crate::acc_info) and friends) fill the location in.
    pub fn log(
        &self,
        level: Level,
        options: LogOptions,
        location: (&'static str, &'static str, u32),
        args: fmt::Arguments<'_>,
    ) {
        if !self.is_enabled(level) {
            return;
        }
        let current = distributed::current();
        let rank = distributed::current_rank();
        let world = current.as_ref().map_or(1, |s| s.num_processes());
        let emit = || {
            let (module_path, file, line) = location;
            log::logger().log(
                &Record::builder()
                    .level(level)
                    .target(&self.name)
                    .module_path_static(Some(module_path))
                    .file_static(Some(file))
                    .line(Some(line))
                    .args(format_args!("[RANK {rank}] {args}"))
                    .build(),
            );
        };
        if options.in_order && world > 1 {
            let state = current.expect("world > 1 implies an installed state");
            for turn in 0..world {
                if turn == rank {
                    emit();
                    log::logger().flush();
                }
                if let Err(e) = state.wait_for_everyone() {
                    log::error!(target: &self.name, "[RANK {rank}] in_order logging stopped: {e}");
                    return;
                }
            }
        } else if options.in_order || !options.main_process_only || rank == 0 {
            emit();
        }
    }
}

/// Logs through a [`MultiProcessLogger`] at a given level: `acc_log!(logger, Level::Info, "x={}", x)`, with the
/// optional `main_process_only = bool` and/or `in_order = bool` after the level (in either order, as Accelerate
/// takes them; `in_order = true` logs on every rank whatever `main_process_only` says, where Accelerate would
/// hang with `main_process_only=True`).
#[macro_export]
macro_rules! acc_log {
    ($logger:expr, $level:expr, main_process_only = $m:expr, in_order = $o:expr, $($arg:tt)+) => {
        $logger.log(
            $level,
            $crate::logging::LogOptions { main_process_only: $m, in_order: $o },
            (module_path!(), file!(), line!()),
            format_args!($($arg)+),
        )
    };
    ($logger:expr, $level:expr, in_order = $o:expr, main_process_only = $m:expr, $($arg:tt)+) => {
        $crate::acc_log!($logger, $level, main_process_only = $m, in_order = $o, $($arg)+)
    };
    ($logger:expr, $level:expr, main_process_only = $m:expr, $($arg:tt)+) => {
        $logger.log(
            $level,
            $crate::logging::LogOptions { main_process_only: $m, in_order: false },
            (module_path!(), file!(), line!()),
            format_args!($($arg)+),
        )
    };
    ($logger:expr, $level:expr, in_order = $o:expr, $($arg:tt)+) => {
        $logger.log(
            $level,
            $crate::logging::LogOptions { main_process_only: true, in_order: $o },
            (module_path!(), file!(), line!()),
            format_args!($($arg)+),
        )
    };
    ($logger:expr, $level:expr, $($arg:tt)+) => {
        $logger.log(
            $level,
            $crate::logging::LogOptions::default(),
            (module_path!(), file!(), line!()),
            format_args!($($arg)+),
        )
    };
}

/// `acc_log!` at error level.
#[macro_export]
macro_rules! acc_error { ($logger:expr, $($arg:tt)+) => { $crate::acc_log!($logger, $crate::log::Level::Error, $($arg)+) }; }
/// `acc_log!` at warn level.
#[macro_export]
macro_rules! acc_warn { ($logger:expr, $($arg:tt)+) => { $crate::acc_log!($logger, $crate::log::Level::Warn, $($arg)+) }; }
/// `acc_log!` at info level.
#[macro_export]
macro_rules! acc_info { ($logger:expr, $($arg:tt)+) => { $crate::acc_log!($logger, $crate::log::Level::Info, $($arg)+) }; }
/// `acc_log!` at debug level.
#[macro_export]
macro_rules! acc_debug { ($logger:expr, $($arg:tt)+) => { $crate::acc_log!($logger, $crate::log::Level::Debug, $($arg)+) }; }
/// `acc_log!` at trace level.
#[macro_export]
macro_rules! acc_trace { ($logger:expr, $($arg:tt)+) => { $crate::acc_log!($logger, $crate::log::Level::Trace, $($arg)+) }; }

/// A minimal `log` backend writing `LEVEL target: message` lines to stderr.
struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            let _ = writeln!(
                std::io::stderr().lock(),
                "{:<5} {}: {}",
                record.level(),
                record.target(),
                record.args()
            );
        }
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// Installs a stderr logger at `level` (else `ACCELERATE_LOG_LEVEL`, else `WARN`) if the program has none.
/// Returns `false` when another logger was already installed (it is kept).
pub fn init(level: Option<LevelFilter>) -> bool {
    let env_value = std::env::var("ACCELERATE_LOG_LEVEL").ok();
    let level = resolve_level(level, env_value.as_deref()).unwrap_or(LevelFilter::Warn);
    let installed = log::set_logger(&StderrLogger).is_ok();
    if installed || level > log::max_level() {
        log::set_max_level(level);
    }
    installed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex, OnceLock};

    use crate::distributed::ProcessGroup;
    use crate::distributed::comm::Communicator;

    #[derive(Default)]
    struct Capture(Mutex<Vec<(String, Level, String)>>);
    impl Log for Capture {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &Record<'_>) {
            self.0.lock().unwrap().push((
                record.target().to_string(),
                record.level(),
                record.args().to_string(),
            ));
        }
        fn flush(&self) {}
    }

    fn capture() -> &'static Capture {
        static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
        CAPTURE.get_or_init(|| {
            let c: &'static Capture = Box::leak(Box::default());
            log::set_logger(c).expect("the test logger is the only one");
            log::set_max_level(LevelFilter::Trace);
            c
        })
    }

    fn lines(target: &str) -> Vec<(Level, String)> {
        capture()
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, _, _)| t == target)
            .map(|(_, l, m)| (*l, m.clone()))
            .collect()
    }

    #[derive(Debug)]
    struct FakeRank(usize, usize);
    impl Communicator for FakeRank {
        fn rank(&self) -> usize {
            self.0
        }
        fn world_size(&self) -> usize {
            self.1
        }
        fn barrier(&self) -> crate::distributed::comm::CommResult<()> {
            Ok(())
        }
        fn engine(&self) -> &'static str {
            "fake"
        }
        fn all_reduce(
            &self,
            data: crate::distributed::comm::ReduceBuffer,
            _: crate::distributed::comm::ReduceOp,
        ) -> crate::distributed::comm::CommResult<crate::distributed::comm::ReduceBuffer> {
            Ok(data)
        }
        fn all_gather(&self, data: Vec<u8>) -> crate::distributed::comm::CommResult<Vec<Vec<u8>>> {
            Ok(vec![data; self.1])
        }
        fn broadcast(
            &self,
            data: Vec<u8>,
            _: usize,
        ) -> crate::distributed::comm::CommResult<Vec<u8>> {
            Ok(data)
        }
    }

    fn as_rank(rank: usize, world: usize) {
        let state = Arc::new(ProcessGroup::new(
            Arc::new(FakeRank(rank, world)),
            rank,
            burn::tensor::Device::default(),
            None,
        ));
        state.install_for_thread();
    }

    #[test]
    fn levels_parse_like_python() {
        assert_eq!(parse_level("warning"), Some(LevelFilter::Warn));
        assert_eq!(parse_level("INFO"), Some(LevelFilter::Info));
        assert_eq!(parse_level("Critical"), Some(LevelFilter::Error));
        assert_eq!(parse_level("loud"), None);
        assert_eq!(resolve_level(None, Some("DEBUG")), Some(LevelFilter::Debug));
        assert_eq!(
            resolve_level(Some(LevelFilter::Error), Some("DEBUG")),
            Some(LevelFilter::Error),
            "the explicit level wins over the environment"
        );
        assert_eq!(resolve_level(None, Some("loud")), None);
        assert_eq!(resolve_level(None, None), None);
    }

    #[test]
    fn prefix_and_level_filter_without_accelerator() {
        capture();
        let logger = get_logger("t_prefix", Some(LevelFilter::Info));
        acc_info!(logger, "hello {}", 1);
        acc_debug!(logger, "hidden");
        assert_eq!(
            lines("t_prefix"),
            vec![(Level::Info, "[RANK 0] hello 1".into())]
        );
    }

    #[test]
    fn main_process_filter_on_other_ranks() {
        capture();
        std::thread::spawn(|| {
            as_rank(1, 2);
            let logger = get_logger("t_rank1", Some(LevelFilter::Info));
            acc_info!(logger, "main only");
            acc_warn!(logger, main_process_only = false, "everyone");
            acc_info!(logger, in_order = true, "ordered");
        })
        .join()
        .unwrap();
        assert_eq!(
            lines("t_rank1"),
            vec![
                (Level::Warn, "[RANK 1] everyone".into()),
                (Level::Info, "[RANK 1] ordered".into())
            ]
        );
    }

    #[test]
    fn in_order_runs_in_rank_order_on_one_rank() {
        capture();
        std::thread::spawn(|| {
            as_rank(0, 1);
            let logger = get_logger("t_rank0", Some(LevelFilter::Info));
            acc_info!(logger, in_order = true, "a");
            acc_info!(logger, main_process_only = true, "b");
        })
        .join()
        .unwrap();
        assert_eq!(
            lines("t_rank0"),
            vec![
                (Level::Info, "[RANK 0] a".into()),
                (Level::Info, "[RANK 0] b".into())
            ]
        );
    }
}
