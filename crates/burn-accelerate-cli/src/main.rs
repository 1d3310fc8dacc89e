//! The `burn-accelerate` command.

pub(crate) mod config_command;
pub(crate) mod config_file;
pub(crate) mod env_report;
pub(crate) mod estimate;
pub(crate) mod launch;
pub(crate) mod questionnaire;
pub(crate) mod restart;
pub(crate) mod selftest;

/// The fuzz targets' allocation limit (`launch::fuzz`); the system allocator elsewhere.
#[cfg(test)]
#[global_allocator]
static ALLOC: burn_accelerate_fuzz::LimitedAlloc = burn_accelerate_fuzz::LimitedAlloc;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Run Burn training programs on any device and any number of processes.
#[derive(Parser, Debug)]
#[command(name = "burn-accelerate", version, about)]
struct Cli {
    /// The config file to read (Accelerate's format, `.yaml` or `.json`) instead of the default one.
    #[arg(long = "config-file", visible_alias = "config_file", global = true)]
    config_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the version, compiled backends, devices found, platform and config file path (paste it into bug
    /// reports).
    Env,
    /// Answer a few questions and write the config file shared with Hugging Face Accelerate (or `default`,
    /// `show`).
    Config {
        #[command(subcommand)]
        action: Option<config_command::Action>,
    },
    /// Run a program on one process, or on several through mpirun (`--num-processes`, `--hostfile`), with the
    /// settings of the command line over the environment over the config file.
    Launch(Box<launch::LaunchArgs>),
    /// Check that distributed training works here: collectives, data sharding and a short parity training
    /// across `--num-processes` processes (through mpirun when built with the `mpi` feature).
    Test(selftest::TestArgs),
    /// The check `test` runs on every rank (started by `test` itself).
    #[command(hide = true)]
    TestWorker,
    /// Print the parameters of a safetensors checkpoint (a file, a folder or an index) per dtype, and the memory
    /// training it with Adam needs in f32, bf16 and fp16.
    EstimateMemory {
        /// A `.safetensors` file, a folder written by `save_model`, or a `model.safetensors.index.json`.
        path: PathBuf,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Write one safetensors model from a training state saved by `save_state`, merging the per-rank records of
    /// a sharded (FULL_SHARD) run (Accelerate's `merge-weights`).
    #[command(name = "merge-weights", visible_alias = "merge_weights")]
    MergeWeights {
        /// The checkpoint folder `save_state` wrote.
        state_dir: PathBuf,
        /// The folder to write `model.safetensors` into.
        output_dir: PathBuf,
        /// Which of the checkpoint's models (0: the first).
        #[arg(long, default_value_t = 0)]
        model: usize,
    },
}

pub(crate) fn main() {
    let cli = Cli::parse();
    if let Some(path) = &cli.config_file {
        // SAFETY: set before any thread is started; every part of this process reads the file through it.
        unsafe { std::env::set_var("ACCELERATE_CONFIG_FILE", path) };
    }
    burn_accelerate::logging::init(None);
    match cli.command {
        Command::Env => print!("{}", env_report::EnvReport::collect()),
        Command::Config { action } => {
            if let Err(error) = config_command::run(action, cli.config_file.as_deref()) {
                eprintln!("error: {error}");
                std::process::exit(1);
            }
        }
        Command::Launch(args) => exit_with(launch::run(&args)),
        Command::Test(args) => exit_with(selftest::run(&args)),
        Command::TestWorker => std::process::exit(selftest::run_worker()),
        Command::MergeWeights {
            state_dir,
            output_dir,
            model,
        } => match burn_accelerate::checkpoint::merge_weights(&state_dir, &output_dir, model) {
            Ok(file) => println!(
                "merged model #{model} of {} into {}",
                state_dir.display(),
                file.display()
            ),
            Err(error) => {
                eprintln!("error: {error}");
                std::process::exit(1);
            }
        },
        Command::EstimateMemory { path, json } => match estimate::report(&path, json) {
            Ok(report) => print!("{report}"),
            Err(error) => {
                eprintln!("error: {error}");
                std::process::exit(1);
            }
        },
    }
}

/// Ends the process with a command's exit code, or prints its error and ends with the error's code.
fn exit_with(outcome: Result<i32, launch::LaunchError>) -> ! {
    match outcome {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(error.1);
        }
    }
}
