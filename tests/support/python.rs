//! Running the Python cross-checks: `BURN_ACCELERATE_PYTHON` names the interpreter (default `python3`); with
//! `BURN_ACCELERATE_REQUIRE_PYTHON=1` (as CI sets it) a missing interpreter or module fails the test instead of
//! skipping the check.

#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// The interpreter to run, if it can import every module of `modules`; `None` means skip the check.
pub fn python_with(modules: &[&str]) -> Option<String> {
    let python = std::env::var("BURN_ACCELERATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let imports = format!("import {}", modules.join(", "));
    let ok = Command::new(&python)
        .args(["-c", &imports])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(python);
    }
    let required = std::env::var("BURN_ACCELERATE_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "BURN_ACCELERATE_REQUIRE_PYTHON=1 but `{python}` cannot `{imports}` (set BURN_ACCELERATE_PYTHON to a venv's python)"
    );
    skipped(&format!(
        "`{python}` cannot `{imports}`: the Python cross-check is skipped (BURN_ACCELERATE_REQUIRE_PYTHON=1 makes \
         this a failure)"
    ));
    None
}

/// Says that a check was skipped, and why, where the test runner shows it: written to the process's standard
/// error directly, past the capture that hides a passing test's `eprintln!`.
pub fn skipped(why: &str) {
    use std::io::Write;
    let line = format!(
        "SKIPPED in {}: {why}\n",
        std::thread::current().name().unwrap_or("a test")
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Runs `script` (a path under `tests/python/`) with `args`; panics with its output when it fails.
pub fn run(python: &str, script: &str, args: &[&Path]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let out = Command::new(python).arg(&path).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{script} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
