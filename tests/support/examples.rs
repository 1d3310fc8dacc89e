//! Running this package's built examples from its tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Output;

/// The path of a built example of this package (tests and examples share the profile's folder).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps");
    dir.join("examples").join(name)
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
