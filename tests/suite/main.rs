//! The integration tests that share a process: one binary, so that Burn and the support code are compiled and
//! linked once (each test binary links Burn). The tests that need a process to themselves (a process-wide random
//! generator, a global logger, environment changes) are in binaries of their own: `tests/README.md` says which
//! and why. Each module is one feature's tests; its doc comment says what they show.

#[path = "../support/isolation.rs"]
mod isolation;

#[path = "../support/deep.rs"]
mod deep;
#[path = "../support/examples.rs"]
mod examples;
#[path = "../support/fixtures.rs"]
mod fixtures;
#[path = "../../examples/support/mlp.rs"]
mod mlp;
#[path = "../support/parity.rs"]
mod parity;
#[path = "../support/python.rs"]
mod python;
#[path = "../../examples/support/ranks.rs"]
mod ranks;
#[path = "../../examples/support/scenarios.rs"]
mod scenarios;
#[path = "../support/collectives_suite.rs"]
mod suite;

mod blockwise;
mod checkpointing;
mod collectives;
mod context_parallel;
mod data_parallel;
mod examples_run;
mod faults;
mod faults_fs;
mod frozen;
mod fused_adamw;
mod many_models;
mod memory;
mod mixed_precision;
mod parity_in_process;
mod parity_single_process;
mod pipeline;
mod public_paths;
mod pytorch_layout;
mod resume_any_ranks;
mod sharded;
mod tensor_parallel;
mod tracking;
