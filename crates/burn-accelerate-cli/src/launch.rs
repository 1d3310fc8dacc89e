//! `burn-accelerate launch`: runs a program on one process, or on several through `mpirun` (one machine, or
//! several with a hostfile), with the settings resolved from the command line, the environment and the config
//! file, and a clear report of the rank that failed.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use burn_accelerate::config::{AcceleratorConfig, Key, Source};
use burn_accelerate::{MixedPrecision, ShardingStrategy};
use clap::Args;

use crate::restart::{self, Decision, Failure, RESTART_COUNT_VAR, RestartPolicy};

mod attempt;
mod rank_output;

use attempt::*;

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
    /// Shard the training state across the processes (Accelerate's FSDP; ACCELERATE_USE_FSDP): FULL_SHARD
    /// unless --fsdp-sharding-strategy or the config file says otherwise.
    #[arg(long = "use-fsdp", visible_alias = "use_fsdp")]
    pub use_fsdp: bool,
    /// How much each process holds: FULL_SHARD (1), SHARD_GRAD_OP (2), NO_SHARD (3), HYBRID_SHARD (4) or
    /// _HYBRID_SHARD_ZERO2 (5) (FSDP_SHARDING_STRATEGY).
    #[arg(
        long = "fsdp-sharding-strategy",
        visible_alias = "fsdp_sharding_strategy"
    )]
    pub fsdp_sharding_strategy: Option<ShardingStrategy>,
    /// Processes per shard group of a hybrid strategy (PARALLELISM_CONFIG_DP_SHARD_SIZE); default: the
    /// processes of one machine.
    #[arg(
        long = "parallelism-config-dp-shard-size",
        visible_alias = "parallelism_config_dp_shard_size"
    )]
    pub parallelism_config_dp_shard_size: Option<usize>,
    /// Pipeline stages the model's blocks are cut into (ACCELERATE_PP_SIZE); it must divide the number of
    /// processes. Default 1: no pipeline.
    #[arg(long = "pp-size", visible_alias = "pp_size")]
    pub pp_size: Option<usize>,
    /// Micro-batches each batch is split into under a pipeline (ACCELERATE_PP_MICROBATCHES); default: pp_size.
    #[arg(long = "pp-microbatches", visible_alias = "pp_microbatches")]
    pub pp_microbatches: Option<usize>,
    /// The pipeline's schedule: gpipe or 1f1b (ACCELERATE_PP_SCHEDULE); default 1f1b.
    #[arg(long = "pp-schedule", visible_alias = "pp_schedule")]
    pub pp_schedule: Option<burn_accelerate::PipelineSchedule>,
    /// Blocks per pipeline stage, first stage first, e.g. 3,5 (ACCELERATE_PP_STAGE_BLOCKS); default: cut by the
    /// blocks' parameters.
    #[arg(long = "pp-stage-blocks", visible_alias = "pp_stage_blocks")]
    pub pp_stage_blocks: Option<String>,
    /// The dtype blocks are gathered in under FULL_SHARD / HYBRID_SHARD: fp32, bf16 or fp16 (FSDP2's
    /// param_dtype; FSDP_PARAM_DTYPE); bf16 and fp16 need the same --mixed_precision. Default: the parameters'.
    #[arg(long = "fsdp-param-dtype", visible_alias = "fsdp_param_dtype")]
    pub fsdp_param_dtype: Option<burn_accelerate::ShardDtype>,
    /// The dtype gradients are reduce-scattered in under a sharded strategy: fp32, bf16 or fp16 (FSDP2's
    /// reduce_dtype; FSDP_REDUCE_DTYPE). Default: the parameters'.
    #[arg(long = "fsdp-reduce-dtype", visible_alias = "fsdp_reduce_dtype")]
    pub fsdp_reduce_dtype: Option<burn_accelerate::ShardDtype>,
    /// Recompute each block in backward instead of keeping its activations, in programs that train with
    /// `backward_blocks`: true or false, as Accelerate's flag (FSDP_ACTIVATION_CHECKPOINTING).
    #[arg(
        long = "fsdp-activation-checkpointing",
        visible_alias = "fsdp_activation_checkpointing"
    )]
    pub fsdp_activation_checkpointing: Option<bool>,
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
    /// Restarts of the whole job allowed after a rank is killed, hangs (its collective times out) or mpirun
    /// fails; the restarted job resumes from its latest complete checkpoint (`Accelerator::resume`) and reads
    /// its restart count from ACCELERATE_RESTART_COUNT.
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        default_value_t = 0
    )]
    pub max_restarts: usize,
    /// Restarts a job whose process exited with an error of its own (an `Err` from `main`, a panic) too; such
    /// errors usually happen again, so by default they end the launch.
    #[arg(long = "restart-on-error", visible_alias = "restart_on_error")]
    pub restart_on_error: bool,
    /// Seconds to wait before the first restart, doubled before each next one (up to 60).
    #[arg(
        long = "restart-backoff",
        visible_alias = "restart_backoff",
        default_value_t = 1.0
    )]
    pub restart_backoff: f64,
    /// With --max-restarts and --hostfile: a restart reads the hostfile again, and when it offers fewer slots
    /// than the job asked for (a machine was lost), the job continues on the slots left, down to this many
    /// processes (torchrun's `--nnodes MIN:MAX`; back up to --num-processes when slots return). The program
    /// resumes its latest checkpoint on the new number of ranks, which needs the same global batch (give each
    /// rank `global / ranks` samples a batch, or use split_batches).
    #[arg(long = "min-processes", visible_alias = "min_processes")]
    pub min_processes: Option<usize>,
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

impl Setting {
    fn new(name: &'static str, value: impl ToString, source: String) -> Self {
        Self {
            name,
            value: value.to_string(),
            source,
        }
    }
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
        let cli = || Source::CommandLine.to_string();
        let pick =
            |cli_value: Option<usize>, file: Option<usize>, default: usize| -> (usize, String) {
                match (cli_value, file) {
                    (Some(v), _) => (v, cli()),
                    (None, Some(v)) => (v, Source::File(file_name()).to_string()),
                    _ => (default, Source::Default.to_string()),
                }
            };
        let (num_processes, np_source) = pick(args.num_processes, config.launch.num_processes, 1);
        let (num_machines, nm_source) = pick(args.num_machines, config.launch.num_machines, 1);
        let (machine_rank, _) = pick(args.machine_rank, config.launch.machine_rank, 0);
        if num_processes == 0 {
            return Err(fail("--num-processes must be at least 1"));
        }
        if machine_rank > 0 {
            let program: Vec<String> = args
                .program
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            return Err(fail(format!(
                "--machine-rank {machine_rank}: mpirun starts the ranks of every machine from machine 0, so nothing \
                 runs here; on machine 0 alone run `burn-accelerate launch --num-machines {num_machines} \
                 --num-processes {num_processes} --hostfile hosts {}`, with `hosts` holding one line per machine \
                 (`<host> slots=<processes>`); under SLURM, `srun --mpi=pmix {}` instead",
                program.join(" "),
                program.join(" ")
            )));
        }
        if num_machines > 1 && args.hostfile.is_none() {
            return Err(fail(format!(
                "{num_machines} machines need --hostfile (one line per machine: `host slots=N`); mpirun starts the \
                 ranks on every machine from this one"
            )));
        }
        let mut settings = vec![
            Setting::new("num_processes", num_processes, np_source),
            Setting::new("num_machines", num_machines, nm_source),
        ];
        // The flags override what the library resolved from the environment and the config file; each process
        // then resolves the same settings from the variables the library writes for it.
        let mut resolved = config;
        let flag =
            |key: Key, config: &mut AcceleratorConfig| config.set_source(key, Source::CommandLine);
        if let Some(precision) = args.mixed_precision {
            resolved.precision.mixed_precision = precision;
            flag(Key::MixedPrecision, &mut resolved);
        }
        if let Some(steps) = args.gradient_accumulation_steps {
            resolved.accumulation.gradient_accumulation_steps = steps;
            flag(Key::GradientAccumulationSteps, &mut resolved);
        }
        match (args.fsdp_sharding_strategy, args.use_fsdp) {
            (Some(strategy), _) => {
                resolved.distributed.sharding = strategy;
                flag(Key::Sharding, &mut resolved);
            }
            // `--use_fsdp` alone shards fully, unless the environment or the file already chose a sharding.
            (None, true) if !resolved.distributed.sharding.is_sharded() => {
                resolved.distributed.sharding = ShardingStrategy::FullShard;
                flag(Key::Sharding, &mut resolved);
            }
            _ => {}
        }
        if let Some(size) = args.parallelism_config_dp_shard_size {
            resolved.distributed.dp_shard_size = Some(size);
            flag(Key::DpShardSize, &mut resolved);
        }
        if let Some(stages) = args.pp_size {
            resolved.pipeline.pp_size = stages;
            flag(Key::PpSize, &mut resolved);
        }
        if let Some(micro_batches) = args.pp_microbatches {
            resolved.pipeline.pp_microbatches = Some(micro_batches);
            flag(Key::PpMicrobatches, &mut resolved);
        }
        if let Some(schedule) = args.pp_schedule {
            resolved.pipeline.pp_schedule = schedule;
            flag(Key::PpSchedule, &mut resolved);
        }
        if let Some(text) = &args.pp_stage_blocks {
            let counts = burn_accelerate::PipelineSettings::parse_stage_blocks(text)
                .map_err(|e| fail(format!("--pp-stage-blocks: {e}")))?;
            resolved.pipeline.pp_stage_blocks = Some(counts);
            flag(Key::PpStageBlocks, &mut resolved);
        }
        if let Some(dtype) = args.fsdp_param_dtype {
            resolved.distributed.fsdp_param_dtype = Some(dtype);
            flag(Key::FsdpParamDtype, &mut resolved);
        }
        if let Some(dtype) = args.fsdp_reduce_dtype {
            resolved.distributed.fsdp_reduce_dtype = Some(dtype);
            flag(Key::FsdpReduceDtype, &mut resolved);
        }
        if let Some(on) = args.fsdp_activation_checkpointing {
            resolved.memory.activation_checkpointing = on;
            flag(Key::ActivationCheckpointing, &mut resolved);
        }
        if args.debug {
            resolved.distributed.debug = true;
            flag(Key::Debug, &mut resolved);
        }
        if args.cpu {
            resolved.device.cpu = true;
            flag(Key::Cpu, &mut resolved);
        }
        settings.extend(
            resolved
                .launch_settings()
                .into_iter()
                .map(|(name, value, source)| Setting {
                    name,
                    value,
                    source: source.to_string(),
                }),
        );
        // A value of the file this crate cannot honour, still in effect, stops the launch before it starts.
        resolved.validate().map_err(|e| fail(e.to_string()))?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = threads_per_process(
            args.num_cpu_threads_per_process,
            thread_variable(),
            (cores, num_processes, num_machines),
        )?;
        if let Some((n, source)) = &threads {
            settings.push(Setting::new("threads_per_process", n, source.clone()));
        }
        let mut env = resolved.launch_env();
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

/// The restart rule the flags ask for.
fn restart_policy(args: &LaunchArgs) -> Result<RestartPolicy, LaunchError> {
    if !(args.restart_backoff.is_finite() && args.restart_backoff >= 0.0) {
        return Err(fail(format!(
            "--restart-backoff {}: give the seconds to wait before a restart as a number of 0 or more",
            args.restart_backoff
        )));
    }
    Ok(RestartPolicy {
        max_restarts: args.max_restarts,
        on_error: args.restart_on_error,
        backoff: Duration::from_secs_f64(args.restart_backoff.min(3600.0)),
    })
}

/// The slots a hostfile offers in all (`host slots=N` lines; blank lines and `#` comments skipped), or `None`
/// when a line gives no `slots=` (Open MPI then counts the machine's cores, which this machine cannot see).
fn hostfile_slots(hostfile: &Path) -> Result<Option<usize>, LaunchError> {
    let text = std::fs::read_to_string(hostfile)
        .map_err(|e| fail(format!("reading the hostfile {}: {e}", hostfile.display())))?;
    let mut total = 0;
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let slots = line
            .split_whitespace()
            .find_map(|word| word.strip_prefix("slots="))
            .map(|n| {
                n.parse::<usize>().map_err(|_| {
                    fail(format!(
                        "{}: `{line}`: slots= takes a whole number",
                        hostfile.display()
                    ))
                })
            })
            .transpose()?;
        match slots {
            Some(n) => {
                total = usize::checked_add(total, n).ok_or_else(|| {
                    fail(format!(
                        "{}: the slots add up to more than this machine can count",
                        hostfile.display()
                    ))
                })?
            }
            None => return Ok(None),
        }
    }
    Ok(Some(total))
}

/// The number of processes a restart runs on under `--min-processes`: as many as the hostfile's slots allow, up
/// to the number asked for; an error when fewer than the minimum are left.
fn processes_for_restart(
    asked: usize,
    now: usize,
    min: usize,
    hostfile: &Path,
) -> Result<usize, String> {
    let Some(slots) = hostfile_slots(hostfile).map_err(|e| e.to_string())? else {
        return Ok(now);
    };
    let next = slots.min(asked);
    if next < min {
        return Err(format!(
            "the hostfile {} offers {slots} slot(s), fewer than --min-processes {min}",
            hostfile.display()
        ));
    }
    if next != now {
        eprintln!(
            "burn-accelerate launch: the hostfile offers {slots} slot(s); the job continues on {next} processes \
             (it ran on {now}; --min-processes {min}, --num-processes {asked}), resuming its checkpoint on the new \
             number of ranks"
        );
    }
    Ok(next)
}

/// Runs the launch, restarting the job as `--max-restarts` allows; returns the exit code for this process.
pub fn run(args: &LaunchArgs) -> Result<i32, LaunchError> {
    let mut plan = Plan::resolve(args)?;
    let policy = restart_policy(args)?;
    let asked = plan.num_processes;
    if let Some(min) = args.min_processes {
        if min == 0 || min > asked {
            return Err(fail(format!(
                "--min-processes {min}: give a number from 1 to --num-processes ({asked})"
            )));
        }
        if plan.hostfile.is_none() || policy.max_restarts == 0 {
            return Err(fail(
                "--min-processes takes effect when a restart finds fewer slots in the hostfile: give it with \
                 --hostfile and --max-restarts",
            ));
        }
    }
    eprintln!("{}", plan.describe());
    let program = &args.program[0];
    let rest = &args.program[1..];
    let distributed = plan.num_processes > 1 || plan.hostfile.is_some();
    let path = if distributed {
        let path = locate(program).ok_or_else(|| {
            fail(format!(
                "{} not found (give a path, or put it on PATH)",
                program.to_string_lossy()
            ))
        })?;
        if !links_mpi(&path) {
            return Err(fail(format!(
                "{} was built without burn-accelerate's `mpi` feature, so its {} processes would each run alone; \
                 rebuild it with `--features burn-accelerate/mpi` (Debian: apt-get install libopenmpi-dev \
                 openmpi-bin libclang-dev pkg-config)",
                path.display(),
                plan.num_processes
            )));
        }
        Some(path)
    } else {
        None
    };
    let mut restarts = 0;
    loop {
        let attempt = Attempt {
            plan: &plan,
            restart: restarts,
        };
        let failure = match &path {
            Some(path) => attempt.mpirun(path, rest)?,
            None => attempt.single(program, rest)?,
        };
        let Some(failure) = failure else {
            if restarts > 0 {
                eprintln!(
                    "burn-accelerate launch: the job completed after {restarts} restart{}",
                    if restarts == 1 { "" } else { "s" }
                );
            }
            return Ok(0);
        };
        let stopped = if distributed {
            "; the other ranks were stopped"
        } else {
            ""
        };
        let words = failure.last_words();
        match policy.decide(&failure, restarts) {
            Decision::Restart { restart, delay } => {
                eprintln!(
                    "burn-accelerate launch: {failure}{stopped}; restart {restart} of {} in {:.1} s, resuming from \
                     the latest complete checkpoint{words}",
                    policy.max_restarts,
                    delay.as_secs_f64()
                );
                std::thread::sleep(delay);
                restarts = restart;
                if let (Some(min), Some(hostfile)) = (args.min_processes, &plan.hostfile) {
                    match processes_for_restart(asked, plan.num_processes, min, hostfile) {
                        Ok(next) => plan.num_processes = next,
                        Err(why) => {
                            eprintln!(
                                "burn-accelerate launch: {failure}{stopped}; {why}: giving up{words}"
                            );
                            return Ok(failure.code());
                        }
                    }
                }
            }
            Decision::GiveUp(why) => {
                // Without --max-restarts the failure is the whole story, as before restarts existed.
                if policy.max_restarts == 0 {
                    eprintln!("burn-accelerate launch: {failure}{stopped}{words}");
                } else {
                    eprintln!("burn-accelerate launch: {failure}{stopped}; {why}{words}");
                }
                return Ok(failure.code());
            }
        }
    }
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
mod fuzz;
#[cfg(test)]
mod tests;
