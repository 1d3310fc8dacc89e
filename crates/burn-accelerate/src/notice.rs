//! Warnings that must reach the user whether or not the program installed a logger: a run that goes on with less
//! than was asked (a backend or transport that fell back, fewer workers, an older checkpoint).

use log::{Level, LevelFilter};

/// Writes `message` as a warning where the user can see it: through the `log` crate where a logger takes
/// warnings, on standard error where the program installed no logger at all (the `log` crate would drop it),
/// nowhere where a logger was set to leave warnings out.
pub(crate) fn warn_visibly(message: &str) {
    if log::max_level() >= Level::Warn {
        log::warn!("{message}");
    } else if log::max_level() == LevelFilter::Off {
        eprintln!("[burn-accelerate] warning: {message}");
    }
}
