//! Writing an Accelerate config file: what `burn-accelerate config` asks and writes, with Accelerate's keys,
//! values and order, as YAML that PyYAML reads back unchanged (or JSON). Reading config files is the library's
//! (`burn_accelerate::config`), since every program reads them; only this command writes them.

use std::path::Path;

use burn_accelerate::MixedPrecision;

/// What a config file says, as `burn-accelerate config` asks it (Accelerate's keys of the same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigAnswers {
    /// `NO`, `MULTI_CPU` or `MULTI_GPU`.
    pub distributed_type: String,
    /// Processes in all.
    pub num_processes: usize,
    /// Machines taking part.
    pub num_machines: usize,
    /// This machine's rank.
    pub machine_rank: usize,
    /// Address of machine 0 (several machines).
    pub main_process_ip: Option<String>,
    /// Port of machine 0 (several machines).
    pub main_process_port: Option<u16>,
    /// Run on the CPU.
    pub use_cpu: bool,
    /// Check collectives across ranks.
    pub debug: bool,
    /// Forward precision.
    pub mixed_precision: MixedPrecision,
}

impl Default for ConfigAnswers {
    fn default() -> Self {
        Self {
            distributed_type: "NO".into(),
            num_processes: 1,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: None,
            main_process_port: None,
            use_cpu: false,
            debug: false,
            mixed_precision: MixedPrecision::No,
        }
    }
}

/// Writes a config file for `answers` to `path` in Accelerate's format (YAML quoted as PyYAML needs, or JSON
/// for a `.json` name), so that Python Accelerate reads it too. An existing file is kept unless `force`.
///
/// # Errors
/// The file exists (without `force`), or cannot be written.
pub fn write_config(
    path: &Path,
    answers: &ConfigAnswers,
    force: bool,
) -> burn_accelerate::Result<()> {
    if path.exists() && !force {
        return Err(burn_accelerate::Error::InvalidArgument(format!(
            "a configuration already exists at {}; pass --force to overwrite it, or --config-file to write \
             another",
            path.display()
        )));
    }
    let entries = entries(answers);
    let text = if path.extension().is_some_and(|e| e == "json") {
        let map: serde_json::Map<String, serde_json::Value> = entries
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        serde_json::to_string_pretty(&map)
            .map(|t| t + "\n")
            .map_err(|e| {
                burn_accelerate::Error::InvalidArgument(format!("writing the config: {e}"))
            })?
    } else {
        to_yaml(&entries)
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| burn_accelerate::Error::Io {
            operation: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    write_atomic(path, text.as_bytes())
}

/// Writes the file Accelerate's `accelerate config default` writes (one process on this machine); see
/// [`write_config`].
///
/// # Errors
/// As [`write_config`].
pub fn write_default_config(
    path: &Path,
    mixed_precision: MixedPrecision,
    use_cpu: bool,
    force: bool,
) -> burn_accelerate::Result<()> {
    let answers = ConfigAnswers {
        use_cpu,
        mixed_precision,
        ..ConfigAnswers::default()
    };
    write_config(path, &answers, force)
}

/// Writes `bytes` to `path` through a temporary file in the same folder, synced and renamed into place, so a
/// crash never leaves a half-written config.
fn write_atomic(path: &Path, bytes: &[u8]) -> burn_accelerate::Result<()> {
    use std::io::Write;
    let io = |operation: &'static str, at: &Path| {
        let at = at.to_path_buf();
        move |source| burn_accelerate::Error::Io {
            operation,
            path: at,
            source,
        }
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "config".into());
    let temporary = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let mut file = std::fs::File::create(&temporary).map_err(io("creating", &temporary))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(io("writing", &temporary))?;
    std::fs::rename(&temporary, path).map_err(io("renaming into place", path))
}

/// A scalar as YAML that PyYAML (YAML 1.1) and YAML 1.2 readers both read back as the same string: words YAML
/// 1.1 takes for booleans or null (`NO`, `no`, `on`, …) and numbers are quoted, as `yaml.safe_dump` does.
fn yaml_scalar(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => {
            let lower = s.to_ascii_lowercase();
            let ambiguous = matches!(
                lower.as_str(),
                "y" | "yes" | "n" | "no" | "true" | "false" | "on" | "off" | "null" | "~" | ""
            ) || s.parse::<f64>().is_ok()
                || s.contains([':', '#', '\'', '"', '[', ']', '{', '}', ',']);
            if ambiguous {
                format!("'{}'", s.replace('\'', "''"))
            } else {
                s.clone()
            }
        }
        serde_json::Value::Array(items) if items.is_empty() => "[]".into(),
        other => other.to_string(),
    }
}

/// `entries` as a YAML mapping that Python Accelerate reads back unchanged.
fn to_yaml(entries: &[(&'static str, serde_json::Value)]) -> String {
    entries
        .iter()
        .map(|(k, v)| format!("{k}: {}\n", yaml_scalar(v)))
        .collect()
}

/// The entries of a config file for `answers`, with Accelerate's keys, values and order.
fn entries(answers: &ConfigAnswers) -> Vec<(&'static str, serde_json::Value)> {
    use serde_json::json;
    let mut entries = vec![
        ("compute_environment", json!("LOCAL_MACHINE")),
        ("debug", json!(answers.debug)),
        ("distributed_type", json!(answers.distributed_type)),
        ("downcast_bf16", json!("no")),
        ("enable_cpu_affinity", json!(false)),
        ("machine_rank", json!(answers.machine_rank)),
    ];
    if let Some(ip) = &answers.main_process_ip {
        entries.push(("main_process_ip", json!(ip)));
    }
    if let Some(port) = answers.main_process_port {
        entries.push(("main_process_port", json!(port)));
    }
    entries.extend([
        ("main_training_function", json!("main")),
        ("mixed_precision", json!(answers.mixed_precision.as_str())),
        ("num_machines", json!(answers.num_machines)),
        ("num_processes", json!(answers.num_processes)),
        ("rdzv_backend", json!("static")),
        ("same_network", json!(true)),
        ("tpu_env", json!([])),
        ("tpu_use_cluster", json!(false)),
        ("tpu_use_sudo", json!(false)),
        ("use_cpu", json!(answers.use_cpu)),
    ]);
    entries
}
