//! One run of a launched job (`mpirun`, or the program alone), and what its end says: which rank failed and
//! how, read from the ranks' status files and `mpirun`'s own report, for the restart policy to decide on.

use super::*;

/// Open MPI 4's setting of the folder under which a job keeps its session files.
const SESSION_DIR_VAR: &str = "OMPI_MCA_orte_tmpdir_base";

/// One run of the job: restart number `restart` of `plan`.
pub(super) struct Attempt<'a> {
    pub(super) plan: &'a Plan,
    pub(super) restart: usize,
}

impl Attempt<'_> {
    /// The variables every process of this run gets: the plan's, and the restart count.
    pub(super) fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = self.plan.env.clone();
        env.push((RESTART_COUNT_VAR, self.restart.to_string()));
        env
    }

    /// Runs the program as one process; returns how it failed, if it did.
    pub(super) fn single(
        &self,
        program: &OsString,
        args: &[OsString],
    ) -> Result<Option<Failure>, LaunchError> {
        let status = Command::new(program)
            .args(args)
            .envs(self.env().iter().map(|(k, v)| (*k, v)))
            .status()
            .map_err(|e| fail(format!("cannot start {}: {e}", program.to_string_lossy())))?;
        Ok(Failure::of_process(status))
    }
}

impl Attempt<'_> {
    /// Runs the job through `mpirun`; returns how it failed, if it did, naming the rank.
    pub(super) fn mpirun(
        &self,
        program: &Path,
        args: &[OsString],
    ) -> Result<Option<Failure>, LaunchError> {
        let plan = self.plan;
        let version = Command::new("mpirun")
            .arg("--version")
            .output()
            .map_err(|e| {
                fail(format!(
                    "cannot run mpirun ({e}); install an MPI launcher (Debian: apt-get install openmpi-bin)"
                ))
            })
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())?;
        let open_mpi = version.contains("Open MPI");
        let status_dir = std::env::temp_dir().join(format!(
            "burn-accelerate-launch-{}-{}",
            std::process::id(),
            self.restart
        ));
        let _ = std::fs::remove_dir_all(&status_dir);
        std::fs::create_dir_all(&status_dir)
            .map_err(|e| fail(format!("creating {}: {e}", status_dir.display())))?;
        let mut command = Command::new("mpirun");
        command.arg("-np").arg(plan.num_processes.to_string());
        match &plan.hostfile {
            Some(hostfile) => {
                command.arg("--hostfile").arg(hostfile);
            }
            None if open_mpi => {
                // One machine: as many ranks as asked, whatever the number of cores (as torchrun does).
                command.arg("--oversubscribe");
            }
            None => {}
        }
        // A copy of each rank's output, to name what a failed rank last wrote.
        let output_dir = status_dir.join("output");
        if let Some(flag) = rank_output::output_flag(&version, &output_dir) {
            command.args(flag);
        }
        let status_var = burn_accelerate::distributed::comm::STATUS_DIR_VAR;
        let mut env = self.env();
        env.push((status_var, status_dir.display().to_string()));
        if let Some(file) = burn_accelerate::config::config_file() {
            env.push(("ACCELERATE_CONFIG_FILE", file.display().to_string()));
        }
        if open_mpi {
            // Open MPI passes only the variables named with -x to ranks on other machines.
            for (key, _) in &env {
                command.arg("-x").arg(key);
            }
            allow_root(&mut command);
            if plan.hostfile.is_none() && std::env::var_os(SESSION_DIR_VAR).is_none() {
                // Open MPI 4 keeps every job's session files under one folder per user
                // (`/tmp/ompi.<host>.<uid>`), and jobs that start and end at once race on creating and removing
                // it ("A call to mkdir was unable to create the desired directory ... File exists"): on one
                // machine, this launch's own folder, removed with the status files.
                command.env(SESSION_DIR_VAR, &status_dir);
            }
        }
        command.envs(env.iter().map(|(k, v)| (*k, v)));
        command.arg(program).args(args);
        command.stderr(std::process::Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|e| fail(format!("cannot start mpirun: {e}")))?;
        // mpirun's messages pass through unchanged; its report of a rank that died is kept to name it.
        let Some(stderr) = child.stderr.take() else {
            return Err(fail("mpirun's error stream was not captured"));
        };
        let watcher = std::thread::Builder::new()
            .name("mpirun-stderr".into())
            .spawn(move || {
                use std::io::{BufRead, Write};
                let mut seen = MpirunSaw::default();
                for line in std::io::BufReader::new(stderr)
                    .lines()
                    .map_while(|l| l.ok())
                {
                    let _ = writeln!(std::io::stderr(), "{line}");
                    seen.died = seen.died.or_else(|| rank_death(&line));
                    seen.returned_non_zero |= returned_non_zero(&line);
                }
                seen
            });
        let watcher = match watcher {
            Ok(w) => w,
            Err(e) => {
                // mpirun is running with a pipe nobody reads: stop it rather than leave it blocked.
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "cannot start a thread to read mpirun's messages: {e}"
                )));
            }
        };
        let status = child
            .wait()
            .map_err(|e| fail(format!("waiting for mpirun: {e}")))?;
        let seen = watcher.join().unwrap_or_default();
        let mut reports = rank_reports(&status_dir);
        for report in &mut reports {
            report.said = rank_output::last_words(&output_dir, report.rank);
        }
        let _ = std::fs::remove_dir_all(&status_dir);
        if status.success() {
            return Ok(None);
        }
        Ok(Some(classify(&reports, &seen, restart::exit_code(status))))
    }
}

/// What a rank's status file says: its exit status, and the library's reason when it ended the job itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RankReport {
    pub(super) rank: usize,
    pub(super) status: i32,
    pub(super) timed_out: bool,
    /// The last lines the rank wrote to its standard error, where `mpirun` kept a copy
    /// ([`rank_output::last_words`]).
    pub(super) said: Option<String>,
}

/// What mpirun said about the job's processes on its error stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct MpirunSaw {
    /// A rank it saw die of a signal, and how.
    pub(super) died: Option<(usize, String)>,
    /// Whether it said a process returned a non-zero exit code (ended by itself, not by a signal).
    pub(super) returned_non_zero: bool,
}

/// Why the job failed: a rank's error of its own first (the cause; the others were stopped because of it),
/// then a collective that timed out (a rank hung), then a rank mpirun saw die of a signal, then a process that
/// returned an error status by itself before this library could report it (a program's own early failure: bad
/// arguments, a missing file), and only then a failure nobody explained.
pub(super) fn classify(reports: &[RankReport], seen: &MpirunSaw, code: i32) -> Failure {
    let mut own = reports.iter().filter(|r| !r.timed_out);
    if let Some(first) = own.next() {
        return Failure::Error {
            rank: Some(first.rank),
            status: if first.status != 0 {
                first.status
            } else {
                code
            },
            said: first.said.clone(),
            others: own.map(|r| (r.rank, r.status)).collect(),
        };
    }
    if let Some(timeout) = reports.first() {
        return Failure::Timeout {
            rank: timeout.rank,
            code: timeout.status,
        };
    }
    match &seen.died {
        Some((rank, how)) => Failure::Killed {
            rank: Some(*rank),
            how: how.clone(),
            code,
        },
        // Statuses from 128 on are a shell's report of a signal: not the program's own doing.
        None if seen.returned_non_zero && (1..128).contains(&code) => Failure::Error {
            rank: None,
            status: code,
            others: Vec::new(),
            said: None,
        },
        None => Failure::Unexplained { code },
    }
}

/// Whether `line` is Open MPI's report that a process ended by itself with an error status (`Primary job
/// terminated normally, but 1 process returned` / `a non-zero exit code.`).
pub(super) fn returned_non_zero(line: &str) -> bool {
    line.contains("process returned") || line.contains("processes returned")
}

/// The rank and the manner of death in Open MPI's report `... process rank 1 with PID 42 on node n exited on
/// signal 9 (Killed).`
pub(super) fn rank_death(line: &str) -> Option<(usize, String)> {
    let rest = line.split("process rank ").nth(1)?;
    let rank = rest.split_whitespace().next()?.parse().ok()?;
    let how = rest.split(" exited ").nth(1)?.trim_end_matches('.');
    Some((rank, format!("exited {how}")))
}

/// The ranks that left a status file, in rank order.
pub(super) fn rank_reports(dir: &Path) -> Vec<RankReport> {
    let mut reports: Vec<RankReport> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().to_string();
            let rank = name
                .strip_prefix("rank_")?
                .strip_suffix(".status")?
                .parse()
                .ok()?;
            parse_report(rank, &read_report(&entry.path())?)
        })
        .collect();
    reports.sort_by_key(|r| r.rank);
    reports
}

/// The text of a status file, at most [`REPORT_BYTES`] of it (a rank writes a few lines; a larger file is not
/// one of ours, and its length decides nothing here).
fn read_report(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(REPORT_BYTES)
        .read_to_end(&mut bytes)
        .ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The most of a status file read.
const REPORT_BYTES: u64 = 16 << 10;

/// Reads `<status>[ <reason>]` (the first line; what follows is not the library's).
pub(super) fn parse_report(rank: usize, text: &str) -> Option<RankReport> {
    let first = text.lines().next()?;
    let mut words = first.split_whitespace();
    let status = words.next()?.parse().ok()?;
    let timed_out = words.next() == Some(burn_accelerate::distributed::comm::TIMEOUT_REASON);
    Some(RankReport {
        rank,
        status,
        timed_out,
        said: None,
    })
}
