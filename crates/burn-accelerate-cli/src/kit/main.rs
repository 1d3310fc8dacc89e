//! The GPU kit: one binary that holds every program a GPU check runs, so that one compressed file carries them
//! to a GPU machine that can build nothing.
//!
//! It is a multi-call binary: it runs the program its own name says (the name it was started under, through a
//! link) — `burn-accelerate` (the command: `env`, `test`, ...), the examples `quicktour`, `memory`,
//! `data_parallel`, `sharded_training`, `learner` (burn-train's Learner) and `transformer_lm` (tensor
//! parallelism), and the benches `overhead` and `throughput` — each exactly as its own
//! binary would, arguments included. `scripts/gpu/pack.sh` builds it with `cuda` and `vulkan`;
//! `scripts/gpu/run.sh` makes the links and runs the checks.

// Each program brings its own support modules (the quicktour and the memory example both load `mlp.rs`), as
// its own binary does: the same file is a module of each.
#![allow(clippy::duplicate_mod)]

use std::path::Path;

#[path = "../main.rs"]
mod cli;
// The command's modules name each other from the crate root (`crate::launch`, ...).
use cli::{config_file, launch, questionnaire, restart};

#[path = "../../../../examples/quicktour.rs"]
mod quicktour;

#[path = "../../../../examples/by_feature/memory.rs"]
mod memory;

#[path = "../../../../examples/data_parallel.rs"]
mod data_parallel;

#[path = "../../../../examples/by_feature/sharded_training.rs"]
mod sharded_training;

#[path = "../../../../examples/learner.rs"]
mod learner;

#[path = "../../../../examples/transformer_lm.rs"]
mod transformer_lm;

#[path = "../../../../benches/overhead.rs"]
mod overhead;

#[path = "../../../../benches/throughput.rs"]
mod throughput;

/// The programs this binary holds, by the name it runs them under.
const PROGRAMS: [&str; 9] = [
    "burn-accelerate",
    "quicktour",
    "memory",
    "data_parallel",
    "sharded_training",
    "learner",
    "transformer_lm",
    "overhead",
    "throughput",
];

fn main() {
    let invoked = std::env::args_os().next().unwrap_or_default();
    let name = Path::new(&invoked)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let bench = |result: burn_accelerate::Result<()>| {
        if let Err(error) = result {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    };
    match name.as_str() {
        "burn-accelerate" => cli::main(),
        "quicktour" => quicktour::main(),
        "memory" => memory::main(),
        "data_parallel" => data_parallel::main(),
        "sharded_training" => sharded_training::main(),
        "learner" => learner::main(),
        "transformer_lm" => transformer_lm::main(),
        "overhead" => bench(overhead::main()),
        "throughput" => bench(throughput::main()),
        _ => {
            eprintln!(
                "{name}: the GPU kit runs the program it is named after; link it as one of: {} (scripts/gpu/run.sh \
                 does)",
                PROGRAMS.join(", ")
            );
            std::process::exit(2);
        }
    }
}
