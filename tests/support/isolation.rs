//! Every test binary that includes this module starts from a clean environment, before `main` and before any
//! test thread: no `ACCELERATE_*` setting, launcher variable (MPI, SLURM, torchrun) or device choice of the
//! developer's shell reaches the code under test, and `HF_HOME` names an empty folder of this process, so a
//! developer's own Accelerate config file (`~/.cache/huggingface/accelerate/default_config.yaml`) is never read.
//! Tests that need a setting give it to the accelerator's builder or to the child process they start.
//!
//! Each test process also writes in a folder of its own: `TMPDIR` names it for the process and every child it
//! starts (examples, `mpirun` and its ranks, the CLI), so `std::env::temp_dir()` is that folder, and it is removed
//! when the process exits, whatever the tests left in it. Set `BURN_ACCELERATE_KEEP_TEST_FILES=1` to keep it
//! (its path is `bat-<pid>` in the system's temporary folder).

include!("../../crates/burn-accelerate/src/test_isolation.rs");
