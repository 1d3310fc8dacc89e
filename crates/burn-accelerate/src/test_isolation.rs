// The clean environment every test process of the workspace starts from (the library's unit tests, and every
// test binary through `tests/support/isolation.rs`, which includes this file): see that file for what it does.
// No inner attributes or `//!` comments here, so that `include!` can take the file as it is.

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

/// The variable that keeps each test process's folder after it exits.
const KEEP_VAR: &str = "BURN_ACCELERATE_KEEP_TEST_FILES";

/// This process's folder, removed at exit.
static SCRATCH: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

#[cfg(unix)]
extern "C" fn remove_scratch() {
    if let Some(dir) = SCRATCH.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[ctor::ctor(unsafe)]
fn isolate_from_the_developers_environment() {
    let remove: Vec<std::ffi::OsString> = std::env::vars_os()
        .map(|(key, _)| key)
        .filter(|key| {
            let key = key.to_string_lossy();
            PREFIXES.iter().any(|p| key.starts_with(p)) || NAMES.contains(&key.as_ref())
        })
        .collect();
    let scratch = std::env::temp_dir().join(format!("bat-{}", std::process::id()));
    let hf_home = scratch.join("hf-home");
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::create_dir_all(&hf_home);
    // SAFETY: this runs before `main`, while the process has a single thread.
    unsafe {
        for key in remove {
            std::env::remove_var(key);
        }
        std::env::set_var("HF_HOME", &hf_home);
        std::env::set_var("TMPDIR", &scratch);
    }
    let keep = std::env::var_os(KEEP_VAR).is_some_and(|v| !v.is_empty() && v != "0");
    #[cfg(unix)]
    if !keep && SCRATCH.set(scratch).is_ok() {
        // SAFETY: `remove_scratch` is an `extern "C" fn()` that does not unwind.
        unsafe {
            libc::atexit(remove_scratch);
        }
    }
    #[cfg(not(unix))]
    let _ = keep;
}
