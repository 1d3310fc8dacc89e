//! Running this package's examples from its tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `command` (an `mpirun`, or a program that starts one) with an Open MPI session folder of its own. Open MPI 4
/// keeps every job's session files under one folder per user (`/tmp/ompi.<host>.<uid>`), and the tests start and
/// end jobs at once, which race on creating and removing it ("A call to mkdir was unable to create the desired
/// directory ... File exists"). `burn-accelerate launch` does the same for the jobs it starts on one machine.
pub fn own_mpi_session(command: &mut Command) -> &mut Command {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ba-ompi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a session folder for mpirun");
    command.env("OMPI_MCA_orte_tmpdir_base", dir)
}

/// The features this test binary was compiled with, which the examples it runs must share (`default`
/// included: cargo keys builds by the exact feature set, so leaving it out would build the library again).
fn enabled_features() -> Vec<&'static str> {
    [
        ("default", cfg!(feature = "default")),
        ("flex", cfg!(feature = "flex")),
        ("ndarray", cfg!(feature = "ndarray")),
        ("wgpu", cfg!(feature = "wgpu")),
        ("wgpu-bare", cfg!(feature = "wgpu-bare")),
        ("vulkan", cfg!(feature = "vulkan")),
        ("vulkan-bare", cfg!(feature = "vulkan-bare")),
        ("metal", cfg!(feature = "metal")),
        ("metal-bare", cfg!(feature = "metal-bare")),
        ("webgpu", cfg!(feature = "webgpu")),
        ("webgpu-bare", cfg!(feature = "webgpu-bare")),
        ("cuda", cfg!(feature = "cuda")),
        ("cuda-bare", cfg!(feature = "cuda-bare")),
        ("rocm", cfg!(feature = "rocm")),
        ("rocm-bare", cfg!(feature = "rocm-bare")),
        ("tch", cfg!(feature = "tch")),
        ("fusion", cfg!(feature = "fusion")),
        ("autotune", cfg!(feature = "autotune")),
        ("mpi", cfg!(feature = "mpi")),
        ("train", cfg!(feature = "train")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect()
}

/// The cargo profile arguments matching the folder this test binary was built into (`target/<profile>/deps`).
fn profile_args() -> Vec<String> {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .and_then(|p| p.to_str())
        .expect("target/<profile>/deps")
        .to_string();
    match profile.as_str() {
        "debug" => vec![],
        "release" => vec!["--release".into()],
        other => vec!["--profile".into(), other.into()],
    }
}

/// Whether this test binary was built with the package's default features and nothing else: the case of a plain
/// `cargo test` in the workspace, whose builds are reused by asking for them the same way.
fn default_features_only() -> bool {
    enabled_features() == ["default", "flex"]
}

/// Builds `target` (`--example <name>` of this package, or `--bin <name>` of `package`) with this test binary's
/// profile and features, and returns the path of that exact build, read from cargo's JSON messages.
///
/// Cargo unifies features over the packages a command selects, so a build asked for with `-p` differs from the
/// one a plain `cargo test` of the workspace made (a dependency of another member, say the command's terminal
/// crate, adds features), and would rebuild the library and every example. With the default features the
/// request is made as `cargo test` made it (no `-p`, no features), so it finds that build; otherwise the
/// package and its features are named, as a `cargo test -p .. --features ..` run selects them.
///
/// Each target is built once per test process: later calls return the path the first one found (a test that
/// runs an example a hundred times asks cargo once, not a hundred times at a second each).
fn build(package: &str, kind: &str, name: &str) -> PathBuf {
    /// `(package kind name, its executable)` of every target built so far.
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let key = format!("{package} {kind} {name}");
    // Held across the build: concurrent tests asking for the same target wait for the one build.
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, path)) = built.iter().find(|(k, _)| *k == key) {
        return path.clone();
    }
    let path = build_now(package, kind, name);
    built.push((key, path.clone()));
    path
}

fn build_now(package: &str, kind: &str, name: &str) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "--message-format=json"])
        .args([kind, name])
        .args(profile_args());
    if !default_features_only() {
        command
            .args(["-p", package, "--no-default-features", "--features"])
            .arg(
                enabled_features()
                    .into_iter()
                    // The command has no burn-train part.
                    .filter(|f| package == env!("CARGO_PKG_NAME") || *f != "train")
                    .collect::<Vec<_>>()
                    .join(","),
            );
    }
    let out = command.output().expect("cargo runs");
    assert!(
        out.status.success(),
        "building {name} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| msg["reason"] == "compiler-artifact" && msg["target"]["name"] == name)
        .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reported no executable for {name}"))
}

/// Builds example `name` of this package with this test binary's profile and features, and returns the path
/// of that exact build.
///
/// `cargo test --test <one>` does not build examples, and the examples folder holds whichever feature set
/// was built last (say, `data_parallel` without `mpi` after a plain `cargo test`), so tests never rely on it:
/// the build is asked for here (a no-op when fresh) and its executable path read from cargo's JSON messages.
/// That path names the feature set's own build, so tests of different feature sets may run concurrently.
pub fn example(name: &str) -> PathBuf {
    build(env!("CARGO_PKG_NAME"), "--example", name)
}

/// Builds the `burn-accelerate` command (package `burn-accelerate-cli`, whose features have the same names) with
/// this test binary's profile and features, and returns the path of that build.
pub fn cli() -> PathBuf {
    build("burn-accelerate-cli", "--bin", "burn-accelerate")
}

/// The lines of a successful run's standard output that start with one of `prefixes`.
pub fn result_lines(out: Output, prefixes: &[&str]) -> Vec<String> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("UTF-8 output")
        .lines()
        .filter(|l| prefixes.iter().any(|p| l.starts_with(p)))
        .map(str::to_string)
        .collect()
}

/// `mpirun -np <np> <program> <args>` on this machine, as many ranks as asked whatever its cores.
pub fn mpirun(np: usize, program: &Path, args: &[&str]) -> Output {
    assert!(program.exists(), "{} is not built", program.display());
    own_mpi_session(&mut Command::new("mpirun"))
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .arg(program)
        .args(args)
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .expect("mpirun runs (install openmpi-bin)")
}
