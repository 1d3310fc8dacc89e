//! The `burn-accelerate` command.

mod env_report;
mod estimate;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Run Burn training programs on any device and any number of processes.
#[derive(Parser, Debug)]
#[command(name = "burn-accelerate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the version, compiled backends, devices found, platform and config file path (paste it into bug
    /// reports).
    Env,
    /// Print the parameters of a safetensors checkpoint (a file, a folder or an index) per dtype, and the memory
    /// training it with Adam needs in f32, bf16 and fp16.
    EstimateMemory {
        /// A `.safetensors` file, a folder written by `save_model`, or a `model.safetensors.index.json`.
        path: PathBuf,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Env => print!("{}", env_report::EnvReport::collect()),
        Command::EstimateMemory { path, json } => match estimate::report(&path, json) {
            Ok(report) => print!("{report}"),
            Err(error) => {
                eprintln!("error: {error}");
                std::process::exit(1);
            }
        },
    }
}
