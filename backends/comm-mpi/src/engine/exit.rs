//! What happens when a rank's process ends: a rank that exits with an error, or whose collective timed out,
//! leaves its status for the launcher and aborts the MPI job instead of hanging in `MPI_Finalize`.

use super::*;

/// Set once any collective of this process timed out: MPI cannot be finalized cleanly any more.
pub(super) static BROKEN: AtomicBool = AtomicBool::new(false);

/// This process's rank, for the exit handler.
pub(super) static RANK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

use burn_accelerate_comm::{STATUS_DIR_VAR, TIMEOUT_REASON};

/// Registers [`finish_at_exit`]: with glibc through `on_exit`, which hands the handler the exit status, so that an
/// unsuccessful exit aborts the job instead of waiting in `MPI_Finalize` for ranks that wait for this one.
pub(super) fn register_exit_handler() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn on_exit(
                function: extern "C" fn(std::ffi::c_int, *mut std::ffi::c_void),
                arg: *mut std::ffi::c_void,
            ) -> std::ffi::c_int;
        }
        extern "C" fn with_status(status: std::ffi::c_int, _: *mut std::ffi::c_void) {
            finish_at_exit(status);
        }
        // SAFETY: registers a plain `extern "C"` function without captured state.
        unsafe { on_exit(with_status, std::ptr::null_mut()) };
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        extern "C" fn without_status() {
            finish_at_exit(0);
        }
        // SAFETY: as above; the exit status is not known here, so only timeouts abort.
        unsafe { libc::atexit(without_status) };
    }
}

/// Ends MPI when the process exits. `MPI_Finalize` waits for every rank, so it is called only on a successful
/// exit; after a timeout, or when the process exits with a non-zero status (an error returned from `main`, a
/// `process::exit(1)`), `MPI_Abort` ends the whole job at once instead of leaving the other ranks waiting for
/// this one. A communicator kept in a `static` is never dropped, so this is what lets `mpirun` see the exit.
pub(super) fn finish_at_exit(status: std::ffi::c_int) {
    // SAFETY: plain MPI calls with valid out-pointers; MPI_Finalized may be called at any time.
    unsafe {
        let mut finalized: std::ffi::c_int = 0;
        mpi::ffi::MPI_Finalized(&mut finalized);
        if finalized != 0 {
            return;
        }
        let rank = RANK.load(Ordering::Relaxed);
        if BROKEN.load(Ordering::Relaxed) {
            say(format!(
                "burn-accelerate: rank {rank} aborts the MPI job because a collective timed out"
            ));
            record_status(rank, 70, Some(TIMEOUT_REASON));
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 70);
        } else if status != 0 {
            say(format!(
                "burn-accelerate: rank {rank} exits with status {status}; aborting the MPI job"
            ));
            record_status(rank, status, None);
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, status);
        } else {
            mpi::ffi::MPI_Finalize();
        }
    }
}

/// Writes `message` and a line end to standard error in one write: `eprintln!` writes the pieces of its format
/// one by one, and `mpirun`, which forwards each rank's output as it comes, could put its own abort notice in the
/// middle of the line.
pub(super) fn say(message: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{message}\n").as_bytes());
}

/// Leaves `rank_<rank>.status` in the folder [`STATUS_DIR_VAR`] names, if any (best effort: the job is ending):
/// the exit status, then the reason when the library ended the job itself (`launch` restarts a job whose
/// collective timed out, not one that failed with an error of its own).
pub(super) fn record_status(rank: usize, status: std::ffi::c_int, reason: Option<&str>) {
    if let Some(dir) = std::env::var_os(STATUS_DIR_VAR) {
        let text = match reason {
            Some(reason) => format!("{status} {reason}"),
            None => status.to_string(),
        };
        let _ = std::fs::write(
            std::path::Path::new(&dir).join(format!("rank_{rank}.status")),
            text,
        );
    }
}
