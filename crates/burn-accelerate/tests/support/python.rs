//! The Python interpreter of the tests that write or read Accelerate's files as Python does.

#![allow(dead_code)]

use std::process::Command;

/// The interpreter (`BURN_ACCELERATE_PYTHON`, else `python3`) when it can import PyYAML; `None` (the test is
/// skipped, and says so) when it cannot, unless `BURN_ACCELERATE_REQUIRE_PYTHON=1` (CI) makes that a failure.
pub fn with_yaml() -> Option<String> {
    let python = std::env::var("BURN_ACCELERATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_yaml = Command::new(&python)
        .args(["-c", "import yaml"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_yaml {
        return Some(python);
    }
    assert_ne!(
        std::env::var("BURN_ACCELERATE_REQUIRE_PYTHON").as_deref(),
        Ok("1"),
        "{python} cannot import yaml"
    );
    eprintln!("no PyYAML: skipped");
    None
}
