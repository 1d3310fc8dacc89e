//! What a failed rank last wrote to its standard error. Open MPI 4's `mpirun --output-filename <dir>` keeps a copy
//! of each rank's output in `<dir>/<job>/rank.<r>/stderr` while still forwarding it to the terminal unchanged; the
//! copy is written by `mpirun`'s daemon, so the lines a rank wrote just before it was killed are there too. The
//! launcher ends its closing message with the last of them: the rank's own error (`main`'s `Err`, a panic's
//! message) beside its exit status.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// How many bytes of the end of a rank's standard error are read.
const TAIL_BYTES: u64 = 4096;
/// At most this many lines, and about this many bytes, are kept.
const KEPT_LINES: usize = 10;
const KEPT_BYTES: usize = 2048;

/// The flag that makes `mpirun` keep each rank's output under `dir`, for the `mpirun --version` text given; `None`
/// for a launcher whose flag this is not known to be (another MPI, Open MPI 3 writes elsewhere and stops
/// forwarding, Open MPI 5 renamed it).
pub(super) fn output_flag(version: &str, dir: &Path) -> Option<[std::ffi::OsString; 2]> {
    let rest = version.split("(Open MPI)").nth(1)?;
    let major: u32 = rest.trim().split('.').next()?.parse().ok()?;
    (major == 4).then(|| ["--output-filename".into(), dir.as_os_str().to_owned()])
}

/// The last lines `rank` wrote to its standard error, from the copy `mpirun` kept under `dir`.
pub(super) fn last_words(dir: &Path, rank: usize) -> Option<String> {
    let path = stderr_file(dir, rank)?;
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let start = len.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(start)).ok()?;
    let mut tail = Vec::new();
    file.take(TAIL_BYTES).read_to_end(&mut tail).ok()?;
    last_lines(&tail, start > 0)
}

/// `<dir>/<job>/rank.<rank>/stderr` (the job's folder is named by `mpirun`).
fn stderr_file(dir: &Path, rank: usize) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|job| job.path().join(format!("rank.{rank}")).join("stderr"))
        .find(|path| path.is_file())
}

/// The last non-empty lines of `tail` (at most [`KEPT_LINES`], about [`KEPT_BYTES`]); its first line is dropped
/// when the tail was `cut` from a longer text (unless it is the only one).
pub(super) fn last_lines(tail: &[u8], cut: bool) -> Option<String> {
    let text = String::from_utf8_lossy(tail);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let whole = if cut && lines.len() > 1 {
        &lines[1..]
    } else {
        &lines[..]
    };
    let mut kept: Vec<&str> = Vec::new();
    let mut bytes = 0;
    for line in whole.iter().rev().take(KEPT_LINES) {
        if bytes + line.len() > KEPT_BYTES && !kept.is_empty() {
            break;
        }
        bytes += line.len() + 1;
        kept.push(line);
    }
    kept.reverse();
    (!kept.is_empty()).then(|| kept.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_lines_are_kept_without_blank_ones_or_a_cut_first_line() {
        assert_eq!(last_lines(b"", false), None);
        assert_eq!(last_lines(b"\n  \n", false), None);
        assert_eq!(
            last_lines(b"warming up\n\nError: rank 1 failed\n", false).as_deref(),
            Some("warming up\nError: rank 1 failed")
        );
        let many: String = (0..30).map(|i| format!("line {i}\n")).collect();
        let kept = last_lines(many.as_bytes(), false).unwrap();
        assert_eq!(kept.lines().count(), KEPT_LINES);
        assert!(
            kept.starts_with("line 20") && kept.ends_with("line 29"),
            "{kept}"
        );
        assert_eq!(
            last_lines(b"ine cut\nlast\n", true).as_deref(),
            Some("last")
        );
        assert_eq!(last_lines(b"only one\n", true).as_deref(), Some("only one"));
        let long = format!("{}\nend\n", "x".repeat(3000));
        assert_eq!(last_lines(long.as_bytes(), false).as_deref(), Some("end"));
    }

    #[test]
    fn the_flag_is_open_mpi_4s() {
        let dir = Path::new("/out");
        assert!(output_flag("mpirun (Open MPI) 4.1.4\n\nReport bugs", dir).is_some());
        assert!(output_flag("mpirun (Open MPI) 5.0.7", dir).is_none());
        assert!(output_flag("HYDRA build details:", dir).is_none());
        assert!(output_flag("mpirun (Open MPI) garbage", dir).is_none());
    }

    #[test]
    fn a_ranks_words_are_read_from_the_end_of_its_copy() {
        let dir = std::env::temp_dir().join(format!("ba-rank-output-{}", std::process::id()));
        let rank1 = dir.join("1").join("rank.1");
        std::fs::create_dir_all(&rank1).unwrap();
        let mut text = "x".repeat(10_000);
        text.push_str("\nloading\nError: the file is truncated\n");
        std::fs::write(rank1.join("stderr"), text).unwrap();
        assert_eq!(
            last_words(&dir, 1).as_deref(),
            Some("loading\nError: the file is truncated")
        );
        assert_eq!(last_words(&dir, 0), None);
        assert_eq!(last_words(&dir.join("missing"), 1), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
