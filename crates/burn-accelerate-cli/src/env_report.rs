//! `burn-accelerate env`: what a bug report needs to know about this machine and build.

use std::fmt;
use std::path::PathBuf;

use burn_accelerate::backend::{self, sys};
use burn_accelerate::distributed::cluster::LauncherVars;
use burn_accelerate::{Backend, config};

/// The facts `burn-accelerate env` prints.
pub struct EnvReport {
    version: &'static str,
    backends: Vec<(Backend, Vec<String>)>,
    /// What each GPU backend's run-time probe found (driver, devices, libraries).
    probes: Vec<backend::probe::Probe>,
    /// The gradient transport a multi-rank run would use here, and why.
    transport: String,
    /// Where each call goes on that path.
    per_call: Vec<(&'static str, &'static str)>,
    os: String,
    kernel: Option<String>,
    kernel_warning: Option<String>,
    config_file: Option<PathBuf>,
    launcher: String,
    variables: Vec<(String, String)>,
    /// The resolved settings with their sources, or why they cannot be read; and why a run would refuse them.
    settings: Result<Vec<(&'static str, String, config::Source)>, String>,
    /// The device mesh the settings ask of the launcher's ranks (or the config file's `num_processes`), or why
    /// they cannot make one.
    mesh: Option<String>,
    refused: Option<String>,
}

impl EnvReport {
    /// Gathers the facts of this process.
    pub fn collect() -> Self {
        let backends = Backend::compiled()
            .into_iter()
            .map(|b| {
                let devices = backend::enumerate(b)
                    .iter()
                    .map(|d| format!("{d:?}"))
                    .collect();
                (b, devices)
            })
            .collect();
        let probes = Backend::compiled()
            .into_iter()
            .map(backend::probe::probe)
            .filter(|p| !p.facts.is_empty() || !p.is_ready())
            .collect();
        let kernel = sys::kernel_release();
        // `vars_os`: a variable whose name or value is not UTF-8 is shown lossily instead of aborting the report.
        let mut variables: Vec<(String, String)> = std::env::vars_os()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.to_string_lossy().into_owned(),
                )
            })
            .filter(|(k, _)| {
                k.starts_with("ACCELERATE_")
                    || k == "BURN_DEVICE"
                    || k == "HF_HOME"
                    || k.starts_with("CUBECL_")
                    || k.starts_with("NCCL_")
                    || k == "CUDA_PATH"
                    || k == "CUDA_VISIBLE_DEVICES"
                    || k == "LD_LIBRARY_PATH"
            })
            .collect();
        variables.sort();
        let resolved = config::AcceleratorConfig::read_file_and_env();
        let refused = resolved
            .as_ref()
            .ok()
            .and_then(|c| c.validate().err())
            .map(|e| e.to_string());
        let transport = match &resolved {
            Ok(c) => burn_accelerate::distributed::describe_gradient_transport(c),
            Err(e) => format!("unknown (settings unreadable: {e})"),
        };
        let per_call = resolved
            .as_ref()
            .map(burn_accelerate::distributed::describe_transport_per_call)
            .unwrap_or_default();
        let launched = LauncherVars::read().ok();
        let mesh = resolved.as_ref().ok().map(|c| {
            let world = launched
                .as_ref()
                .and_then(|l| l.world_size)
                .or(c.launch.num_processes)
                .unwrap_or(1);
            let local = launched
                .as_ref()
                .and_then(|l| l.local_world_size)
                .unwrap_or(world);
            match burn_accelerate::ParallelDims::from_config(c, world, local) {
                Ok(dims) => format!("{dims} ({world} rank(s))"),
                Err(e) => format!("none on {world} rank(s): {e}"),
            }
        });
        let settings = resolved.map(|c| c.settings()).map_err(|e| e.to_string());
        Self {
            version: env!("CARGO_PKG_VERSION"),
            backends,
            probes,
            transport,
            per_call,
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
            kernel_warning: kernel.as_deref().and_then(sys::kernel_warning),
            kernel,
            config_file: config::config_file().or_else(config::default_config_file),
            launcher: match LauncherVars::read() {
                Ok(vars) => vars.describe(),
                Err(e) => format!("unreadable: {e}"),
            },
            variables,
            settings,
            mesh,
            refused,
        }
    }
}

impl fmt::Display for EnvReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Copy-and-paste the text below in your issue.")?;
        writeln!(f)?;
        writeln!(f, "- `burn-accelerate` version: {}", self.version)?;
        writeln!(f, "- Platform: {}", self.os)?;
        if let Some(kernel) = &self.kernel {
            writeln!(f, "- Kernel: {kernel}")?;
        }
        if let Some(warning) = &self.kernel_warning {
            writeln!(f, "- Warning: {warning}")?;
        }
        writeln!(f, "- Launcher: {}", self.launcher)?;
        let names: Vec<String> = self.backends.iter().map(|(b, _)| b.to_string()).collect();
        writeln!(f, "- Backend features: {}", names.join(", "))?;
        for (backend, devices) in &self.backends {
            if devices.is_empty() {
                writeln!(f, "- Devices ({backend}): none found")?;
            } else {
                writeln!(f, "- Devices ({backend}): {}", devices.join(", "))?;
            }
        }
        for probe in &self.probes {
            match &probe.status {
                backend::probe::Availability::Ready { devices } => {
                    writeln!(f, "- {} runtime: ready, {devices} device(s)", probe.backend)?
                }
                backend::probe::Availability::Unavailable { missing, fix } => writeln!(
                    f,
                    "- {} runtime: unavailable: {missing}; {fix}",
                    probe.backend
                )?,
            }
            for (what, finding) in &probe.facts {
                writeln!(f, "  - {what}: {finding}")?;
            }
        }
        writeln!(f, "- Gradient transport: {}", self.transport)?;
        for (call, path) in &self.per_call {
            writeln!(f, "  - {call}: {path}")?;
        }
        match &self.config_file {
            Some(path) => {
                let status = if path.exists() { "found" } else { "not found" };
                writeln!(f, "- Config file: {} ({status})", path.display())?;
            }
            None => writeln!(
                f,
                "- Config file: unknown (no HF_HOME, XDG_CACHE_HOME or HOME)"
            )?,
        }
        match &self.settings {
            Ok(settings) => {
                writeln!(f, "- Settings:")?;
                for (key, value, source) in settings {
                    writeln!(f, "  - {key} = {value} ({source})")?;
                }
            }
            Err(e) => writeln!(f, "- Settings: unreadable: {e}")?,
        }
        if let Ok(settings) = &self.settings
            && let Some((_, value, _)) = settings.iter().find(|(key, _, _)| *key == "sharding")
            && let Ok(sharding) = value.parse::<config::ShardingStrategy>()
        {
            writeln!(
                f,
                "- Peak memory under {sharding}: {}",
                sharding.peak_memory()
            )?;
        }
        if let Ok(settings) = &self.settings {
            let value = |name: &str| {
                settings
                    .iter()
                    .find(|(key, _, _)| *key == name)
                    .map(|(_, v, _)| v.clone())
            };
            let stages = value("pp_size").and_then(|v| v.parse::<usize>().ok());
            let micro_batches = value("pp_microbatches").and_then(|v| v.parse::<usize>().ok());
            if let (Some(p), Some(m)) = (stages, micro_batches)
                && p > 1
            {
                writeln!(
                    f,
                    "- Pipeline: {p} stages ({} schedule, {m} micro-batches per batch; each stage idle {:.0} % of a \
                     step); rank r of W runs stage r / (W / {p}) of data-parallel replica r % (W / {p})",
                    value("pp_schedule").unwrap_or_default(),
                    100.0 * (p - 1) as f64 / (m + p - 1) as f64
                )?;
            }
        }
        if let Some(mesh) = &self.mesh {
            writeln!(f, "- Mesh: {mesh}")?;
        }
        if let Some(refused) = &self.refused {
            writeln!(f, "- A run refuses these settings: {refused}")?;
        }
        if self.variables.is_empty() {
            writeln!(f, "- Environment: no ACCELERATE_*/BURN_DEVICE variable set")?;
        } else {
            writeln!(f, "- Environment:")?;
            for (k, v) in &self.variables {
                writeln!(f, "  - {k}={v}")?;
            }
        }
        Ok(())
    }
}
