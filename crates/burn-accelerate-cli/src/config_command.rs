//! `burn-accelerate config default | show`: the config file shared with Hugging Face Accelerate.

use std::path::{Path, PathBuf};

use burn_accelerate::config::{self, AcceleratorConfig};
use burn_accelerate::{Backend, MixedPrecision};
use clap::Subcommand;

/// What `config` does (without one: the questionnaire).
#[derive(Subcommand, Debug)]
pub enum Action {
    /// Write the file `accelerate config default` writes: one process on this machine.
    Default {
        /// Forward precision: no, fp16 or bf16.
        #[arg(
            long = "mixed-precision",
            visible_alias = "mixed_precision",
            default_value = "no"
        )]
        mixed_precision: MixedPrecision,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Print the file a run reads, and every setting a run resolves with where it came from.
    Show,
}

/// Whether this build has no GPU backend with a device, so the file should say `use_cpu: true`.
fn cpu_only() -> bool {
    Backend::compiled()
        .into_iter()
        .filter(|b| !b.is_cpu())
        .all(|b| burn_accelerate::backend::enumerate(b).is_empty())
}

/// The file to write: `--config-file`, else the default location.
fn target(file: Option<&Path>) -> burn_accelerate::Result<PathBuf> {
    match file {
        Some(p) => Ok(p.to_path_buf()),
        None => config::default_config_file().ok_or_else(|| {
            burn_accelerate::Error::InvalidArgument(
                "no default location for the config file: set HF_HOME, XDG_CACHE_HOME or HOME, or pass \
                 --config-file"
                    .into(),
            )
        }),
    }
}

/// Runs `action` (the questionnaire when `None`); `file` is `--config-file`, else the default location.
pub fn run(action: Option<Action>, file: Option<&Path>) -> burn_accelerate::Result<()> {
    let Some(action) = action else {
        return crate::questionnaire::run(&target(file)?);
    };
    match action {
        Action::Default {
            mixed_precision,
            force,
        } => {
            let path = target(file)?;
            crate::config_file::write_default_config(&path, mixed_precision, cpu_only(), force)?;
            println!("burn-accelerate configuration saved at {}", path.display());
        }
        Action::Show => {
            match config::config_file() {
                Some(path) => {
                    println!("config file: {}", path.display());
                    let text = std::fs::read_to_string(&path).map_err(|source| {
                        burn_accelerate::Error::Io {
                            operation: "reading the config file",
                            path: path.clone(),
                            source,
                        }
                    })?;
                    for line in text.lines() {
                        println!("  {line}");
                    }
                }
                None => println!(
                    "config file: none (the default would be {})",
                    config::default_config_file()
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "unknown".into())
                ),
            }
            let resolved = AcceleratorConfig::read_file_and_env()?;
            println!("settings:");
            for (key, value, source) in resolved.settings() {
                println!("  {key} = {value} ({source})");
            }
            let launch = &resolved.launch;
            println!(
                "launch: distributed_type={} num_processes={} num_machines={} machine_rank={}",
                launch.distributed_type.as_deref().unwrap_or("-"),
                launch.num_processes.map_or("-".into(), |n| n.to_string()),
                launch.num_machines.map_or("-".into(), |n| n.to_string()),
                launch.machine_rank.map_or("-".into(), |n| n.to_string()),
            );
            if let Err(refused) = resolved.validate() {
                println!("a run refuses these settings: {refused}");
            }
        }
    }
    Ok(())
}
