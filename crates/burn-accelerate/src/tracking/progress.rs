//! Progress bars ([indicatif]) drawn by the local main process only, and only on a terminal.
//!
//! [`Accelerator::progress_bar`](crate::Accelerator::progress_bar) returns an [`indicatif::ProgressBar`] with a
//! bar, position, throughput and time left; on every other rank, and when standard error is not a terminal
//! (a log file, CI, a pipe), it is hidden, so a loop calls `inc` unconditionally and logs stay clean.
//!
//! ```
//! let accelerator = burn_accelerate::Accelerator::new()?;
//! let bar = accelerator.progress_bar(100, "samples");
//! for _ in 0..10 {
//!     bar.inc(10); // after each batch of 10 samples
//! }
//! bar.finish_and_clear();
//! # Ok::<(), burn_accelerate::Error>(())
//! ```

use std::io::IsTerminal;

pub use indicatif;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `len` steps counting `unit` (shown with the throughput, as `<n> <unit>/s`), drawn on standard
/// error when `visible` and standard error is a terminal, hidden otherwise.
pub fn bar(len: u64, unit: &str, visible: bool) -> ProgressBar {
    bar_on(len, unit, visible && std::io::stderr().is_terminal())
}

/// A bar drawn on standard error when `drawn`, else hidden.
fn bar_on(len: u64, unit: &str, drawn: bool) -> ProgressBar {
    if !drawn {
        return ProgressBar::hidden();
    }
    let template = format!(
        "{{msg}} [{{elapsed_precise}}] [{{wide_bar}}] {{pos}}/{{len}} {unit} ({{per_sec}}, eta {{eta}})"
    );
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr()).with_style(style)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_for_another_rank_is_hidden() {
        assert!(bar(10, "steps", false).is_hidden());
    }

    #[test]
    fn a_bar_is_drawn_only_on_a_terminal() {
        // Whatever this test's own standard error is: a hidden bar has no length, a drawn one counts `len`.
        let hidden = bar_on(10, "steps", false);
        assert!(hidden.is_hidden());
        assert_eq!(hidden.length(), None);
        assert_eq!(bar_on(10, "steps", true).length(), Some(10));
        // The public function asks the terminal question itself.
        let here = bar(10, "steps", true);
        assert_eq!(
            here.length().is_some(),
            std::io::stderr().is_terminal(),
            "drawn exactly when standard error is a terminal"
        );
    }
}
