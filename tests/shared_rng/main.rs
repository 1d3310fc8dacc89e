//! Tests that draw from Burn's process-wide random generator and need no other test drawing beside them (a
//! model's initial weights would take draws in between a rank's reseed and its block). One binary, with no other
//! tests in it, and each test holds [`exclusive_rng`] for its whole run so that they take turns.

#[path = "../support/isolation.rs"]
mod isolation;

#[allow(dead_code)] // the stack and its data; not its parameter reader
#[path = "../support/deep.rs"]
mod deep;
#[path = "../support/dropout.rs"]
mod dropout;

/// Held by each test of this binary for its whole run: they take turns with the process-wide generator.
fn exclusive_rng() -> std::sync::MutexGuard<'static, ()> {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

mod blockwise_dropout;
mod pipeline_dropout;
mod same_start;
