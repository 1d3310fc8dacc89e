//! Every test binary that includes this module starts from a clean environment, before `main` and before any
//! test thread: no `ACCELERATE_*` setting, launcher variable (MPI, SLURM, torchrun) or device choice of the
//! developer's shell reaches the code under test, and `HF_HOME` names an empty folder of this process, so a
//! developer's own Accelerate config file (`~/.cache/huggingface/accelerate/default_config.yaml`) is never read.
//! Tests that need a setting give it to the accelerator's builder or to the child process they start.

/// Variables removed by name prefix.
const PREFIXES: [&str; 9] = [
    "ACCELERATE_",
    "FSDP_",
    "PARALLELISM_CONFIG_",
    "TORCHELASTIC_",
    "OMPI_COMM_WORLD_",
    "PMIX_",
    "PMI_",
    "MV2_",
    "SLURM_",
];

/// Variables removed by name.
const NAMES: [&str; 12] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPI_LOCALRANKID",
    "BURN_DEVICE",
    "RAYON_NUM_THREADS",
    "OMP_NUM_THREADS",
    "XDG_CACHE_HOME",
];

#[ctor::ctor(unsafe)]
fn isolate_from_the_developers_environment() {
    let remove: Vec<std::ffi::OsString> = std::env::vars_os()
        .map(|(key, _)| key)
        .filter(|key| {
            let key = key.to_string_lossy();
            PREFIXES.iter().any(|p| key.starts_with(p)) || NAMES.contains(&key.as_ref())
        })
        .collect();
    let hf_home = std::env::temp_dir().join(format!(
        "burn-accelerate-test-hf-home-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&hf_home);
    let _ = std::fs::create_dir_all(&hf_home);
    // SAFETY: this runs before `main`, while the process has a single thread.
    unsafe {
        for key in remove {
            std::env::remove_var(key);
        }
        std::env::set_var("HF_HOME", &hf_home);
    }
}
