//! The command line's tests, in one binary: `config`, `env`, `estimate-memory` and `launch`, each run as the user
//! runs it (the built `burn-accelerate` binary as a child process).

#[path = "../../../../tests/support/isolation.rs"]
mod isolation;

#[path = "../../../../tests/support/python.rs"]
mod python;

mod config_command;
mod env_command;
mod estimate_memory;
mod launch_command;
