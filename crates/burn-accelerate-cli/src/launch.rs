//! `burn-accelerate launch`: runs a program on one process, or on several through `mpirun` (one machine, or
//! several with a hostfile), with the settings resolved from the command line, the environment and the config
//! file, and a clear report of the rank that failed.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use burn_accelerate::MixedPrecision;
use burn_accelerate::config::{AcceleratorConfig, Source};
use clap::Args;

/// What `launch` takes; each flag also has Accelerate's underscore spelling.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Processes in all (on every machine together).
    #[arg(long = "num-processes", visible_alias = "num_processes")]
    pub num_processes: Option<usize>,
    /// Machines taking part (several need --hostfile).
    #[arg(long = "num-machines", visible_alias = "num_machines")]
    pub num_machines: Option<usize>,
    /// This machine's rank (launch runs on machine 0: mpirun starts the others).
    #[arg(long = "machine-rank", visible_alias = "machine_rank")]
    pub machine_rank: Option<usize>,
    /// Address of machine 0 (MPI finds it itself; accepted for Accelerate's command lines).
    #[arg(long = "main-process-ip", visible_alias = "main_process_ip")]
    pub main_process_ip: Option<String>,
    /// Port of machine 0 (accepted for Accelerate's command lines).
    #[arg(long = "main-process-port", visible_alias = "main_process_port")]
    pub main_process_port: Option<u16>,
    /// mpirun's hostfile: the machines and their slots.
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// Forward precision: no, fp16 or bf16.
    #[arg(long = "mixed-precision", visible_alias = "mixed_precision")]
    pub mixed_precision: Option<MixedPrecision>,
    /// Micro-batches per optimizer step.
    #[arg(
        long = "gradient-accumulation-steps",
        visible_alias = "gradient_accumulation_steps"
    )]
    pub gradient_accumulation_steps: Option<usize>,
    /// Check every collective across ranks (ACCELERATE_DEBUG_MODE).
    #[arg(long)]
    pub debug: bool,
    /// Run on the CPU even where a GPU backend is compiled in (ACCELERATE_USE_CPU).
    #[arg(long)]
    pub cpu: bool,
    /// Compute threads of each process (RAYON_NUM_THREADS and OMP_NUM_THREADS); default with several processes
    /// per machine: the machine's cores divided between them, unless those variables are already set.
    #[arg(
        long = "num-cpu-threads-per-process",
        visible_alias = "num_cpu_threads_per_process"
    )]
    pub num_cpu_threads_per_process: Option<usize>,
    /// The program, then its own arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]..."
    )]
    pub program: Vec<OsString>,
}

/// A launch failure, with what to do about it.
#[derive(Debug)]
pub struct LaunchError(pub String, pub i32);

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn fail(message: impl Into<String>) -> LaunchError {
    LaunchError(message.into(), 2)
}

/// One resolved setting with where it came from.
struct Setting {
    name: &'static str,
    value: String,
    source: String,
}

/// The launch settings: command line > environment > config file > default.
pub struct Plan {
    num_processes: usize,
    hostfile: Option<PathBuf>,
    env: Vec<(&'static str, String)>,
    settings: Vec<Setting>,
}

impl Plan {
    /// Resolves `args` over the environment and the config file.
    pub fn resolve(args: &LaunchArgs) -> Result<Self, LaunchError> {
        let config = AcceleratorConfig::read_file_and_env().map_err(|e| fail(e.to_string()))?;
        let cli = || "command line".to_string();
        let pick =
            |cli_value: Option<usize>, file: Option<usize>, default: usize| -> (usize, String) {
                match (cli_value, file) {
                    (Some(v), _) => (v, cli()),
                    (None, Some(v)) => (v, Source::File(file_name()).to_string()),
                    _ => (default, "default".into()),
                }
            };
        let (num_processes, np_source) = pick(args.num_processes, config.launch.num_processes, 1);
        let (num_machines, nm_source) = pick(args.num_machines, config.launch.num_machines, 1);
        let (machine_rank, _) = pick(args.machine_rank, config.launch.machine_rank, 0);
        if num_processes == 0 {
            return Err(fail("--num-processes must be at least 1"));
        }
        if machine_rank > 0 {
            return Err(fail(format!(
                "--machine-rank {machine_rank}: run `burn-accelerate launch` on machine 0 only, with --hostfile; mpirun \
                 starts the ranks of every machine from there"
            )));
        }
        if num_machines > 1 && args.hostfile.is_none() {
            return Err(fail(format!(
                "{num_machines} machines need --hostfile (one line per machine: `host slots=N`); mpirun starts the \
                 ranks on every machine from this one"
            )));
        }
        let mut resolved = config.clone();
        let setting = |name: &'static str, value: String, source: String| Setting {
            name,
            value,
            source,
        };
        let mut settings = vec![
            setting("num_processes", num_processes.to_string(), np_source),
            setting("num_machines", num_machines.to_string(), nm_source),
        ];
        let mp_source = match args.mixed_precision {
            Some(p) => {
                resolved.mixed_precision = p;
                resolved
                    .sources
                    .insert("mixed_precision".into(), Source::Builder);
                cli()
            }
            None => config.source("mixed_precision").to_string(),
        };
        settings.push(setting(
            "mixed_precision",
            resolved.mixed_precision.to_string(),
            mp_source,
        ));
        let gas_source = match args.gradient_accumulation_steps {
            Some(n) => {
                resolved.gradient_accumulation_steps = n;
                cli()
            }
            None => config.source("gradient_accumulation_steps").to_string(),
        };
        settings.push(setting(
            "gradient_accumulation_steps",
            resolved.gradient_accumulation_steps.to_string(),
            gas_source,
        ));
        let flag = |on: bool, value: bool, key: &str| -> (bool, String) {
            if on {
                (true, cli())
            } else {
                (value, config.source(key).to_string())
            }
        };
        let (debug, debug_source) = flag(args.debug, config.debug, "debug");
        let (cpu, cpu_source) = flag(args.cpu, config.cpu, "cpu");
        resolved.debug = debug;
        resolved.cpu = cpu;
        settings.push(setting("debug", debug.to_string(), debug_source));
        settings.push(setting("cpu", cpu.to_string(), cpu_source));
        // A value of the file this crate cannot honour, still in effect, stops the launch before it starts.
        resolved.validate().map_err(|e| fail(e.to_string()))?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = threads_per_process(
            args.num_cpu_threads_per_process,
            thread_variable(),
            (cores, num_processes, num_machines),
        )?;
        if let Some((n, source)) = &threads {
            settings.push(setting(
                "threads_per_process",
                n.to_string(),
                source.clone(),
            ));
        }
        let mut env = vec![
            (
                "ACCELERATE_MIXED_PRECISION",
                resolved.mixed_precision.to_string(),
            ),
            (
                "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                resolved.gradient_accumulation_steps.to_string(),
            ),
            ("ACCELERATE_DEBUG_MODE", debug.to_string()),
            ("ACCELERATE_USE_CPU", cpu.to_string()),
        ];
        if let Some((n, _)) = threads {
            env.push(("RAYON_NUM_THREADS", n.to_string()));
            env.push(("OMP_NUM_THREADS", n.to_string()));
        }
        Ok(Self {
            num_processes,
            hostfile: args.hostfile.clone(),
            env,
            settings,
        })
    }

    /// One line with every setting and its source.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .settings
            .iter()
            .map(|s| format!("{}={} ({})", s.name, s.value, s.source))
            .collect();
        format!("burn-accelerate launch: {}", parts.join(", "))
    }
}

/// The thread-count variable already set in the launcher's environment, if any (the user's choice wins).
fn thread_variable() -> Option<(&'static str, String)> {
    ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"]
        .into_iter()
        .find_map(|k| std::env::var(k).ok().map(|v| (k, v)))
}

/// The compute threads each process gets, with where the number came from: the flag; else nothing (a variable
/// the user set passes through as it is; one process per machine keeps every core); else `cores` divided between
/// the processes of one machine (torchrun sets one thread per process there; each of P ranks starting a pool as
/// wide as the machine oversubscribes it P times).
fn threads_per_process(
    flag: Option<usize>,
    set: Option<(&'static str, String)>,
    (cores, num_processes, num_machines): (usize, usize, usize),
) -> Result<Option<(usize, String)>, LaunchError> {
    match (flag, set) {
        (Some(0), _) => Err(fail(
            "--num-cpu-threads-per-process must be at least 1 (or leave it out to divide the cores)",
        )),
        (Some(n), _) => Ok(Some((n, "command line".into()))),
        (None, Some(_)) => Ok(None),
        (None, None) => {
            let per_machine = num_processes.div_ceil(num_machines.max(1));
            if per_machine <= 1 {
                return Ok(None);
            }
            let n = (cores / per_machine).max(1);
            Ok(Some((
                n,
                format!("{cores} cores / {per_machine} processes per machine"),
            )))
        }
    }
}

/// The config file's name for messages.
fn file_name() -> String {
    burn_accelerate::config::config_file()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "config file".into())
}

/// The program's path: as given when it names a folder, else found on `PATH`.
fn locate(program: &OsString) -> Option<PathBuf> {
    let path = Path::new(program);
    if path.components().count() > 1 {
        return path.is_file().then(|| path.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(path))
            .find(|candidate| candidate.is_file())
    })
}

/// Whether the program links an MPI library (what burn-accelerate's `mpi` feature adds).
fn links_mpi(program: &Path) -> bool {
    std::fs::read(program).is_ok_and(|bytes| bytes.windows(6).any(|w| w == b"libmpi"))
}

/// Runs the launch; returns the exit code for this process.
pub fn run(args: &LaunchArgs) -> Result<i32, LaunchError> {
    let plan = Plan::resolve(args)?;
    eprintln!("{}", plan.describe());
    let program = &args.program[0];
    let rest = &args.program[1..];
    let distributed = plan.num_processes > 1 || plan.hostfile.is_some();
    if !distributed {
        let status = Command::new(program)
            .args(rest)
            .envs(plan.env.iter().map(|(k, v)| (*k, v)))
            .status()
            .map_err(|e| fail(format!("cannot start {}: {e}", program.to_string_lossy())))?;
        return Ok(exit_code(status));
    }
    let path = locate(program).ok_or_else(|| {
        fail(format!(
            "{} not found (give a path, or put it on PATH)",
            program.to_string_lossy()
        ))
    })?;
    if !links_mpi(&path) {
        return Err(fail(format!(
            "{} was built without burn-accelerate's `mpi` feature, so its {} processes would each run alone; \
             rebuild it with `--features burn-accelerate/mpi` (Debian: apt-get install libopenmpi-dev openmpi-bin \
             libclang-dev pkg-config)",
            path.display(),
            plan.num_processes
        )));
    }
    mpirun(&plan, &path, rest)
}

/// Runs the job through `mpirun` and names the rank that failed.
fn mpirun(plan: &Plan, program: &Path, args: &[OsString]) -> Result<i32, LaunchError> {
    let open_mpi = Command::new("mpirun")
        .arg("--version")
        .output()
        .map_err(|e| {
            fail(format!(
                "cannot run mpirun ({e}); install an MPI launcher (Debian: apt-get install openmpi-bin)"
            ))
        })
        .map(|out| String::from_utf8_lossy(&out.stdout).contains("Open MPI"))?;
    let status_dir =
        std::env::temp_dir().join(format!("burn-accelerate-launch-{}", std::process::id()));
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
    let status_var = burn_accelerate::distributed::comm::STATUS_DIR_VAR;
    let mut env: Vec<(&str, String)> = plan.env.clone();
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
            let mut died = None;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(|l| l.ok())
            {
                let _ = writeln!(std::io::stderr(), "{line}");
                died = died.or_else(|| rank_death(&line));
            }
            died
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
    let died = watcher.join().ok().flatten();
    let failed = failed_ranks(&status_dir);
    let _ = std::fs::remove_dir_all(&status_dir);
    if status.success() {
        return Ok(0);
    }
    let code = exit_code(status);
    if failed.is_empty() {
        match died {
            Some((rank, how)) => eprintln!(
                "burn-accelerate launch: rank {rank} {how} (killed: out of memory, or a signal); the other ranks \
                 were stopped"
            ),
            None => eprintln!(
                "burn-accelerate launch: the job failed (mpirun exit status {code}); no rank reported its own \
                 failure: see mpirun's message above"
            ),
        }
        return Ok(code);
    }
    let names: Vec<String> = failed
        .iter()
        .map(|(rank, status)| format!("rank {rank} exited with status {status}"))
        .collect();
    eprintln!(
        "burn-accelerate launch: {}; the other ranks were stopped",
        names.join(", ")
    );
    Ok(failed
        .first()
        .map(|(_, s)| *s)
        .filter(|s| *s != 0)
        .unwrap_or(code))
}

/// The rank and the manner of death in Open MPI's report `... process rank 1 with PID 42 on node n exited on
/// signal 9 (Killed).`
fn rank_death(line: &str) -> Option<(usize, String)> {
    let rest = line.split("process rank ").nth(1)?;
    let rank = rest.split_whitespace().next()?.parse().ok()?;
    let how = rest.split(" exited ").nth(1)?.trim_end_matches('.');
    Some((rank, format!("exited {how}")))
}

/// The ranks that left a status file, with their status, in rank order.
fn failed_ranks(dir: &Path) -> Vec<(usize, i32)> {
    let mut failed: Vec<(usize, i32)> = std::fs::read_dir(dir)
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
            let status = std::fs::read_to_string(entry.path())
                .ok()?
                .trim()
                .parse()
                .ok()?;
            Some((rank, status))
        })
        .collect();
    failed.sort();
    failed
}

fn exit_code(status: ExitStatus) -> i32 {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return 128 + signal;
        }
    }
    status.code().unwrap_or(1)
}

/// Lets Open MPI's `mpirun` start ranks when this process runs as root (it refuses otherwise, as in containers).
pub(crate) fn allow_root(command: &mut Command) {
    if is_root() {
        command.env("OMPI_ALLOW_RUN_AS_ROOT", "1");
        command.env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
}

fn is_root() -> bool {
    #[cfg(unix)]
    {
        std::env::var("USER").is_ok_and(|u| u == "root")
            || std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .is_some_and(|l| l.split_whitespace().nth(1) == Some("0"))
            })
    }
    #[cfg(not(unix))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::threads_per_process;

    #[test]
    fn each_local_process_gets_its_share_of_the_cores_unless_told_otherwise() {
        let split = |flag, set: Option<(&'static str, String)>, np, nm| {
            threads_per_process(flag, set, (8, np, nm))
                .unwrap()
                .map(|(n, _)| n)
        };
        assert_eq!(split(None, None, 2, 1), Some(4));
        assert_eq!(split(None, None, 3, 1), Some(2), "8 cores / 3 rounds down");
        assert_eq!(split(None, None, 16, 1), Some(1), "never 0");
        assert_eq!(split(None, None, 8, 2), Some(2), "4 per machine");
        assert_eq!(
            split(None, None, 1, 1),
            None,
            "one process keeps every core"
        );
        assert_eq!(split(Some(3), None, 2, 1), Some(3), "the flag wins");
        let mine = Some(("OMP_NUM_THREADS", "6".to_string()));
        assert_eq!(
            split(None, mine.clone(), 2, 1),
            None,
            "the user's variable passes through"
        );
        assert_eq!(split(Some(2), mine, 2, 1), Some(2));
        let (_, source) = threads_per_process(None, None, (2, 2, 1)).unwrap().unwrap();
        assert_eq!(source, "2 cores / 2 processes per machine");
        assert!(threads_per_process(Some(0), None, (8, 2, 1)).is_err());
    }

    #[test]
    fn open_mpis_report_of_a_dead_rank_is_read() {
        let line =
            "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).";
        assert_eq!(
            super::rank_death(line),
            Some((1, "exited on signal 9 (Killed)".to_string()))
        );
        assert_eq!(super::rank_death("Primary job  terminated normally"), None);
    }
}
