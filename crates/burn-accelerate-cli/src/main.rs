//! The `burn-accelerate` command.

mod env_report;

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
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Env => print!("{}", env_report::EnvReport::collect()),
    }
}
