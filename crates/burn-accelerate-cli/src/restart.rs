//! `launch --max-restarts`: how a failed job is told apart (killed, hung, or an error of the program's own),
//! whether it is started again, and how long `launch` waits first.

use std::fmt;
use std::time::Duration;

/// The variable a restarted job reads its restart count from (0 on the first run); the library resumes from
/// the latest checkpoint when it is above 0.
pub const RESTART_COUNT_VAR: &str = burn_accelerate::config::RESTART_COUNT_VARS[0];

/// The longest wait between two restarts, however many there were.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Why one run of the job ended unsuccessfully.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// A process was ended by a signal: SIGKILL, the out-of-memory killer, a segmentation fault.
    Killed {
        /// The rank, when the launcher named it.
        rank: Option<usize>,
        /// The launcher's words for it, e.g. `exited on signal 9 (Killed)`.
        how: String,
        /// The exit code `launch` passes on.
        code: i32,
    },
    /// A collective of `rank` timed out: another rank hung, or its machine stopped answering.
    Timeout {
        /// The rank whose collective timed out.
        rank: usize,
        /// The exit code `launch` passes on.
        code: i32,
    },
    /// A process exited with an error status of its own (an `Err` from `main`, a panic, bad input).
    Error {
        /// The rank, in a multi-process job (the first of several that failed so).
        rank: Option<usize>,
        /// Its exit status.
        status: i32,
        /// Other ranks that exited with an error of their own, with their statuses.
        others: Vec<(usize, i32)>,
        /// The last lines the rank wrote to its standard error (its own error), when its status file kept them.
        said: Option<String>,
    },
    /// The job failed and no process said why (mpirun could not start the ranks, say).
    Unexplained {
        /// mpirun's exit code.
        code: i32,
    },
}

impl Failure {
    /// The exit code `launch` ends with when it gives up after this failure.
    pub fn code(&self) -> i32 {
        match self {
            Self::Killed { code, .. } | Self::Timeout { code, .. } | Self::Unexplained { code } => {
                *code
            }
            Self::Error { status, .. } => *status,
        }
    }

    /// Whether a restart can help: a killed or hung process, or an unexplained failure, can succeed on a new
    /// run; an error of the program's own would happen again, unless the user says otherwise.
    pub fn restartable(&self, restart_on_error: bool) -> bool {
        match self {
            Self::Killed { .. } | Self::Timeout { .. } | Self::Unexplained { .. } => true,
            Self::Error { .. } => restart_on_error,
        }
    }

    /// What the failing rank last wrote to its standard error, as lines to follow the launcher's message (empty
    /// when its status file kept nothing).
    pub fn last_words(&self) -> String {
        match self {
            Self::Error {
                rank,
                said: Some(said),
                ..
            } => {
                let who = rank.map_or("the program".to_string(), |r| format!("rank {r}"));
                let mut text = format!("\n  {who} last wrote:");
                for line in said.lines() {
                    text.push_str("\n    ");
                    text.push_str(line);
                }
                text
            }
            _ => String::new(),
        }
    }

    /// What the job's failure was, for one process.
    pub fn of_process(status: std::process::ExitStatus) -> Option<Self> {
        if status.success() {
            return None;
        }
        let code = exit_code(status);
        Some(match signal(status) {
            Some(signal) => Self::Killed {
                rank: None,
                how: format!("was ended by signal {signal}"),
                code,
            },
            None => Self::Error {
                rank: None,
                status: code,
                others: Vec::new(),
                said: None,
            },
        })
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = |rank: &Option<usize>| match rank {
            Some(r) => format!("rank {r}"),
            None => "the program".to_string(),
        };
        match self {
            Self::Killed { rank, how, .. } => write!(
                f,
                "{} {how} (killed: out of memory, or a signal)",
                who(rank)
            ),
            Self::Timeout { rank, .. } => write!(
                f,
                "a collective of rank {rank} timed out (another rank hung, or its machine stopped answering)"
            ),
            Self::Error {
                rank,
                status,
                others,
                said: _,
            } => {
                // What the rank wrote follows the launcher's whole message: `last_words`.
                write!(f, "{} exited with status {status}", who(rank))?;
                for (rank, status) in others {
                    write!(f, ", rank {rank} exited with status {status}")?;
                }
                Ok(())
            }
            Self::Unexplained { code } => write!(
                f,
                "the job failed (mpirun exit status {code}); no rank reported its own failure: see mpirun's \
                 message above"
            ),
        }
    }
}

/// When a failed job is started again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestartPolicy {
    /// Restarts allowed in all (`--max-restarts`).
    pub max_restarts: usize,
    /// Whether an error of the program's own is restarted too (`--restart-on-error`).
    pub on_error: bool,
    /// The wait before the first restart, doubled before each next one up to a minute (`--restart-backoff`).
    pub backoff: Duration,
}

/// What `launch` does after a failure.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Starts the job again after the wait, as restart number `restart`.
    Restart {
        /// The restart's number, from 1.
        restart: usize,
        /// The wait before it.
        delay: Duration,
    },
    /// Ends `launch` with the failure's exit code, for the reason given.
    GiveUp(String),
}

impl RestartPolicy {
    /// What to do after `failure`, when `done` restarts have already happened.
    pub fn decide(&self, failure: &Failure, done: usize) -> Decision {
        if !failure.restartable(self.on_error) {
            let why = if self.max_restarts > 0 {
                "an error of the program's own, not restarted (--restart-on-error restarts those too)"
            } else {
                "no restarts were asked for (--max-restarts N restarts the job from its latest checkpoint)"
            };
            return Decision::GiveUp(why.into());
        }
        if done >= self.max_restarts {
            let why = match self.max_restarts {
                0 => "no restarts were asked for (--max-restarts N restarts the job from its latest checkpoint)"
                    .to_string(),
                n => format!(
                    "gave up after {n} restart{} (--max-restarts {n})",
                    if n == 1 { "" } else { "s" }
                ),
            };
            return Decision::GiveUp(why);
        }
        let doublings = u32::try_from(done).unwrap_or(u32::MAX).min(16);
        let delay = self
            .backoff
            .saturating_mul(1 << doublings)
            .min(MAX_BACKOFF.max(self.backoff));
        Decision::Restart {
            restart: done + 1,
            delay,
        }
    }
}

/// The exit code of a process: its status, or 128 + the signal that ended it (as shells report it).
pub fn exit_code(status: std::process::ExitStatus) -> i32 {
    signal(status).map_or_else(|| status.code().unwrap_or(1), |s| 128 + s)
}

fn signal(status: std::process::ExitStatus) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max_restarts: usize, on_error: bool) -> RestartPolicy {
        RestartPolicy {
            max_restarts,
            on_error,
            backoff: Duration::from_secs(2),
        }
    }

    const KILLED: Failure = Failure::Unexplained { code: 137 };

    #[test]
    fn killed_and_hung_jobs_restart_with_a_doubling_wait_until_the_limit() {
        let killed = Failure::Killed {
            rank: Some(1),
            how: "exited on signal 9 (Killed)".into(),
            code: 137,
        };
        let hung = Failure::Timeout { rank: 0, code: 70 };
        let p = policy(3, false);
        let delays: Vec<Decision> = (0..3).map(|done| p.decide(&killed, done)).collect();
        let expected = [(1, 2), (2, 4), (3, 8)].map(|(restart, secs)| Decision::Restart {
            restart,
            delay: Duration::from_secs(secs),
        });
        assert_eq!(delays, expected);
        assert_eq!(p.decide(&hung, 0), expected[0].clone());
        assert_eq!(p.decide(&KILLED, 2), expected[2].clone());
        match p.decide(&killed, 3) {
            Decision::GiveUp(why) => assert!(why.contains("gave up after 3 restarts"), "{why}"),
            other => panic!("{other:?}"),
        }
        let long = policy(100, false).decide(&killed, 40);
        assert_eq!(
            long,
            Decision::Restart {
                restart: 41,
                delay: MAX_BACKOFF
            },
            "the wait is capped"
        );
    }

    #[test]
    fn an_error_of_the_programs_own_restarts_only_when_asked() {
        let error = Failure::Error {
            rank: Some(1),
            status: 1,
            others: vec![(2, 3)],
            said: None,
        };
        match policy(3, false).decide(&error, 0) {
            Decision::GiveUp(why) => assert!(why.contains("--restart-on-error"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            policy(3, true).decide(&error, 0),
            Decision::Restart { restart: 1, .. }
        ));
        match policy(0, false).decide(&KILLED, 0) {
            Decision::GiveUp(why) => assert!(why.contains("--max-restarts N"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(error.code(), 1);
        assert_eq!(
            error.to_string(),
            "rank 1 exited with status 1, rank 2 exited with status 3"
        );
        let said = Failure::Error {
            rank: Some(1),
            status: 1,
            others: Vec::new(),
            said: Some("loading\nError: the file is truncated".into()),
        };
        assert_eq!(said.to_string(), "rank 1 exited with status 1");
        assert_eq!(
            said.last_words(),
            "\n  rank 1 last wrote:\n    loading\n    Error: the file is truncated"
        );
        assert_eq!(error.last_words(), "");
    }

    #[cfg(unix)]
    #[test]
    fn a_process_ended_by_a_signal_is_told_from_one_that_exited_with_an_error() {
        use std::os::unix::process::ExitStatusExt;
        let killed = Failure::of_process(std::process::ExitStatus::from_raw(9)).unwrap();
        assert!(
            matches!(killed, Failure::Killed { code: 137, .. }),
            "{killed:?}"
        );
        assert!(killed.restartable(false));
        let error = Failure::of_process(std::process::ExitStatus::from_raw(3 << 8)).unwrap();
        assert_eq!(
            error,
            Failure::Error {
                rank: None,
                status: 3,
                others: Vec::new(),
                said: None,
            }
        );
        assert!(!error.restartable(false));
        assert_eq!(
            Failure::of_process(std::process::ExitStatus::from_raw(0)),
            None
        );
    }
}
