//! The fuzz harness of burn-accelerate's parsers of outside data (config files, environment values, checkpoint
//! manifests, safetensors headers, hostfiles, launch status files), on stable Rust and without a fuzzing engine:
//!
//! - [`Mutator`] turns valid seed files into broken ones: truncations, flipped and inserted bytes, numbers
//!   overwritten with huge or negative ones (lengths, offsets, shapes), tokens swapped for their neighbours (dtype
//!   names, booleans), a little-endian length prefix overwritten, chunks duplicated and spliced between seeds, and
//!   YAML alias bombs;
//! - [`LimitedAlloc`], installed as a test binary's global allocator, refuses any single allocation above a limit
//!   set for the input being parsed (max(64 MiB, 16 × the input)): an allocation driven by an untrusted length
//!   aborts the run, naming the input;
//! - [`run`] feeds a target `iterations` inputs (the `BURN_ACCELERATE_FUZZ_ITERATIONS` variable, else the caller's
//!   default), catches panics, and reports what it saw; a panic fails the run with the input that caused it written
//!   to a file.
//!
//! Each target is an ordinary `#[test]` of the crate that owns the parser, so the parsers need not be public.

#![forbid(unsafe_op_in_unsafe_fn)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

thread_local! {
    /// The largest single allocation this thread may make (`usize::MAX`: no limit).
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The input being parsed on this thread, for the report of a refused allocation.
    static CURRENT: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// A global allocator that refuses, on a thread inside [`with_limit`], any single allocation above the limit set
/// there: it writes what was asked and by which target to standard error, then returns null (the process aborts).
/// Elsewhere it is the system allocator.
pub struct LimitedAlloc;

// SAFETY: every call is forwarded to `System` with the same arguments, or refused with null (a valid answer).
unsafe impl GlobalAlloc for LimitedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refuses(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if refuses(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if refuses(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Whether an allocation of `size` bytes is refused on this thread; says so first (without allocating).
fn refuses(size: usize) -> bool {
    let limit = LIMIT.try_with(Cell::get).unwrap_or(usize::MAX);
    if size <= limit {
        return false;
    }
    let target = CURRENT.try_with(Cell::get).ok().flatten().unwrap_or("?");
    let mut line = [0u8; 160];
    let text = format_refusal(&mut line, target, size, limit);
    // SAFETY: writing a valid buffer to the standard error descriptor.
    unsafe { write_stderr(text) };
    true
}

/// `fuzz <target>: refused an allocation of <size> bytes (limit <limit>)`, formatted into `buf` without
/// allocating.
fn format_refusal<'a>(buf: &'a mut [u8], target: &str, size: usize, limit: usize) -> &'a [u8] {
    struct Cursor<'b> {
        buf: &'b mut [u8],
        len: usize,
    }
    impl std::fmt::Write for Cursor<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut cursor = Cursor { buf, len: 0 };
    let _ = std::fmt::write(
        &mut cursor,
        format_args!("fuzz {target}: refused an allocation of {size} bytes (limit {limit})\n"),
    );
    let len = cursor.len;
    &cursor.buf[..len]
}

/// Writes `bytes` to file descriptor 2 with the C library's `write` (no allocation, no lock).
///
/// # Safety
/// Always sound: `bytes` is a valid buffer for its length.
#[cfg(unix)]
unsafe fn write_stderr(bytes: &[u8]) {
    unsafe extern "C" {
        fn write(fd: i32, buf: *const u8, count: usize) -> isize;
    }
    // SAFETY: a valid pointer and length; a failed write is ignored.
    unsafe {
        write(2, bytes.as_ptr(), bytes.len());
    }
}

/// Elsewhere the refusal is not described (the process still aborts).
///
/// # Safety
/// Always sound.
#[cfg(not(unix))]
unsafe fn write_stderr(_bytes: &[u8]) {}

/// The limit of one input of `len` bytes: max(64 MiB, 16 × the input).
pub fn limit_for(len: usize) -> usize {
    (64usize << 20).max(len.saturating_mul(16))
}

/// Runs `f` with single allocations on this thread limited to `limit` bytes, naming `target` if one is refused.
pub fn with_limit<T>(target: &'static str, limit: usize, f: impl FnOnce() -> T) -> T {
    struct Reset(usize, Option<&'static str>);
    impl Drop for Reset {
        fn drop(&mut self) {
            LIMIT.with(|l| l.set(self.0));
            CURRENT.with(|c| c.set(self.1));
        }
    }
    let _reset = Reset(LIMIT.with(Cell::get), CURRENT.with(Cell::get));
    CURRENT.with(|c| c.set(Some(target)));
    LIMIT.with(|l| l.set(limit));
    f()
}

/// Numbers a mutation writes in place of a number: the edges a length or an offset is checked against.
const NUMBERS: [&str; 12] = [
    "0",
    "-1",
    "1",
    "255",
    "65535",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "99999999999999999999999999",
];

/// Words a mutation swaps for one another: dtypes, booleans, YAML and JSON structure.
const TOKENS: [&str; 24] = [
    "F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "true", "false", "null", "yes",
    "no", "~", "[", "]", "{", "}", ":", ",", "\"", "&a", "*a", "!!binary",
];

/// Turns seed inputs into broken ones, deterministically from a seed.
pub struct Mutator {
    rng: ChaCha8Rng,
}

impl Mutator {
    /// A mutator drawing from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// One to four mutations of `input` (another seed from `seeds` may be spliced in).
    pub fn mutate(&mut self, input: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
        let mut out = input.to_vec();
        for _ in 0..self.rng.random_range(1..=4) {
            self.once(&mut out, seeds);
            if out.len() > 1 << 20 {
                out.truncate(1 << 20);
            }
        }
        out
    }

    fn once(&mut self, out: &mut Vec<u8>, seeds: &[Vec<u8>]) {
        let len = out.len();
        let at = |rng: &mut ChaCha8Rng| {
            if len == 0 {
                0
            } else {
                rng.random_range(0..=len)
            }
        };
        match self.rng.random_range(0..11) {
            // Truncation.
            0 => {
                let cut = at(&mut self.rng);
                out.truncate(cut);
            }
            // Flipped bits.
            1 if len > 0 => {
                for _ in 0..self.rng.random_range(1..8) {
                    let i = self.rng.random_range(0..len);
                    out[i] ^= 1 << self.rng.random_range(0..8);
                }
            }
            // Random bytes inserted.
            2 => {
                let i = at(&mut self.rng);
                let n = self.rng.random_range(1..16);
                let bytes: Vec<u8> = (0..n).map(|_| self.rng.random()).collect();
                out.splice(i..i, bytes);
            }
            // A range deleted.
            3 if len > 0 => {
                let i = self.rng.random_range(0..len);
                let n = self.rng.random_range(1..=(len - i).min(64));
                out.drain(i..i + n);
            }
            // A number overwritten with an edge value (a length, an offset, a shape, a count).
            4 => {
                let digits: Vec<usize> = (0..len).filter(|&i| out[i].is_ascii_digit()).collect();
                if let Some(&start) = digits.get(self.rng.random_range(0..digits.len().max(1))) {
                    let end = (start..len)
                        .find(|&i| !out[i].is_ascii_digit())
                        .unwrap_or(len);
                    let number = NUMBERS[self.rng.random_range(0..NUMBERS.len())];
                    out.splice(start..end, number.bytes());
                }
            }
            // A token swapped for another (a dtype, a boolean, structure).
            5 => {
                let token = TOKENS[self.rng.random_range(0..TOKENS.len())];
                if let Some(found) = TOKENS
                    .iter()
                    .filter_map(|t| find(out, t.as_bytes()).map(|i| (i, t.len())))
                    .nth(self.rng.random_range(0..4))
                {
                    out.splice(found.0..found.0 + found.1, token.bytes());
                } else {
                    let i = at(&mut self.rng);
                    out.splice(i..i, token.bytes());
                }
            }
            // A little-endian length prefix overwritten (safetensors' header length).
            6 if len >= 8 => {
                let value: u64 = match self.rng.random_range(0..4) {
                    0 => self.rng.random(),
                    1 => u64::MAX,
                    2 => (len as u64).saturating_add(self.rng.random_range(0..64)),
                    _ => self.rng.random_range(0..len as u64),
                };
                out[..8].copy_from_slice(&value.to_le_bytes());
            }
            // A chunk duplicated.
            7 if len > 0 => {
                let i = self.rng.random_range(0..len);
                let n = self.rng.random_range(1..=(len - i).min(256));
                let chunk = out[i..i + n].to_vec();
                let to = at(&mut self.rng);
                out.splice(to..to, chunk);
            }
            // Spliced with another seed.
            8 if !seeds.is_empty() => {
                let other = &seeds[self.rng.random_range(0..seeds.len())];
                let cut = at(&mut self.rng);
                let from = if other.is_empty() {
                    0
                } else {
                    self.rng.random_range(0..other.len())
                };
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            // Line structure: a line repeated or removed.
            9 => {
                let lines: Vec<&[u8]> = out.split(|b| *b == b'\n').collect();
                if lines.len() > 1 {
                    let i = self.rng.random_range(0..lines.len());
                    let mut next: Vec<u8> = Vec::with_capacity(len + 64);
                    for (k, line) in lines.iter().enumerate() {
                        if k == i && self.rng.random() {
                            continue;
                        }
                        next.extend_from_slice(line);
                        next.push(b'\n');
                        if k == i {
                            next.extend_from_slice(line);
                            next.push(b'\n');
                        }
                    }
                    *out = next;
                }
            }
            // A YAML alias bomb in place of the input.
            _ => *out = alias_bomb(self.rng.random_range(2..12), self.rng.random_range(2..12)),
        }
    }
}

/// The first index of `needle` in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A YAML "billion laughs" document: `depth` levels of anchors, each a list of `width` aliases of the previous
/// level (`width^depth` nodes once expanded).
pub fn alias_bomb(depth: usize, width: usize) -> Vec<u8> {
    let mut text = String::from("a0: &a0 [\"lol\"]\n");
    for level in 1..=depth {
        let items = vec![format!("*a{}", level - 1); width].join(", ");
        text.push_str(&format!("a{level}: &a{level} [{items}]\n"));
    }
    text.push_str(&format!("mixed_precision: *a{depth}\n"));
    text.into_bytes()
}

/// What a fuzz run saw.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Inputs fed to the target.
    pub inputs: u64,
    /// Inputs the target accepted.
    pub accepted: u64,
    /// Inputs the target refused with an error (the expected answer to most).
    pub refused: u64,
    /// Inputs that made the target panic, or return a bad error (one that does not say what it should).
    pub failures: u64,
}

/// How many inputs a target runs: `BURN_ACCELERATE_FUZZ_ITERATIONS`, else `default`.
pub fn iterations(default: u64) -> u64 {
    std::env::var("BURN_ACCELERATE_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// What a target answered for one input.
pub enum Verdict {
    /// The input was accepted.
    Accepted,
    /// The input was refused with an error that says what it should (the file, the setting).
    Refused,
    /// The target's answer is wrong: the text says how.
    Wrong(String),
}

/// Feeds `target` the seeds, then `iterations` mutations of them, each under the allocation limit of its size,
/// catching panics. Panics and wrong answers are counted, and the first few written to files beside the test's
/// temporary folder; returns the report (a caller asserts `failures == 0`).
pub fn run(
    name: &'static str,
    seeds: &[Vec<u8>],
    iterations: u64,
    target: impl FnMut(&[u8]) -> Verdict,
) -> Report {
    run_keeping(name, seeds, iterations, Some(&failures_dir()), target)
}

/// Where [`run`] keeps failing inputs: `BURN_ACCELERATE_FUZZ_FAILURES`, else `fuzz-failures` in the system's
/// temporary folder.
pub fn failures_dir() -> PathBuf {
    std::env::var_os("BURN_ACCELERATE_FUZZ_FAILURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("fuzz-failures"))
}

/// [`run`], keeping the first failing inputs in `keep` (none with `None`).
pub fn run_keeping(
    name: &'static str,
    seeds: &[Vec<u8>],
    iterations: u64,
    keep: Option<&std::path::Path>,
    mut target: impl FnMut(&[u8]) -> Verdict,
) -> Report {
    let mut mutator = Mutator::new(0x5eed ^ name.len() as u64);
    let mut report = Report::default();
    let mut failures_kept = 0;
    let total = seeds.len() as u64 + iterations;
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for i in 0..total {
        let input = match seeds.get(i as usize) {
            Some(seed) => seed.clone(),
            None if seeds.is_empty() => mutator.mutate(&[], seeds),
            None => {
                let seed = &seeds[(i as usize) % seeds.len()];
                mutator.mutate(seed, seeds)
            }
        };
        let limit = limit_for(input.len());
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            with_limit(name, limit, || target(&input))
        }));
        report.inputs += 1;
        let problem = match outcome {
            Ok(Verdict::Accepted) => {
                report.accepted += 1;
                None
            }
            Ok(Verdict::Refused) => {
                report.refused += 1;
                None
            }
            Ok(Verdict::Wrong(why)) => Some(why),
            Err(payload) => Some(format!(
                "panicked: {}",
                payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default()
            )),
        };
        if let Some(problem) = problem {
            report.failures += 1;
            if failures_kept < 5 {
                failures_kept += 1;
                let kept = keep.map(|dir| keep_failure(dir, name, i, &input));
                eprintln!(
                    "fuzz {name}: input {i} ({} bytes{}): {problem}",
                    input.len(),
                    kept.map(|f| format!(", kept at {}", f.display()))
                        .unwrap_or_default()
                );
            }
        }
    }
    std::panic::set_hook(previous_hook);
    eprintln!(
        "fuzz {name}: {} inputs, {} accepted, {} refused with an error, {} failures",
        report.inputs, report.accepted, report.refused, report.failures
    );
    report
}

/// A folder for a target's files (`<temp>/<name>-<pid>`, emptied first), removed when dropped, also when the
/// target fails.
pub struct Scratch(PathBuf);

impl Scratch {
    /// The folder `name` of this process.
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary folder for the fuzz target");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

/// Writes a failing input to `<dir>/<target>-<i>`.
fn keep_failure(dir: &std::path::Path, name: &str, i: u64, input: &[u8]) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let file = dir.join(format!("{name}-{i}"));
    let _ = std::fs::write(&file, input);
    file
}

#[cfg(test)]
#[global_allocator]
static ALLOC: LimitedAlloc = LimitedAlloc;

#[cfg(test)]
mod tests {
    use super::*;

    /// The child of [`an_allocation_over_the_limit_aborts_naming_the_target`].
    #[test]
    fn allocation_child() {
        if std::env::var_os("FUZZ_ALLOCATION_CHILD").is_none() {
            return;
        }
        let small = with_limit("child", 1 << 20, || vec![1u8; 1 << 19]);
        assert_eq!(small.len(), 1 << 19);
        let large = with_limit("child", 1 << 20, || vec![1u8; 2 << 20]);
        unreachable!("{} bytes were allocated over the limit", large.len());
    }

    #[test]
    fn an_allocation_over_the_limit_aborts_naming_the_target() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["tests::allocation_child", "--exact", "--nocapture"])
            .env("FUZZ_ALLOCATION_CHILD", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "the child went on: {stderr}");
        assert!(
            stderr.contains("fuzz child: refused an allocation of 2097152 bytes (limit 1048576)"),
            "{stderr}"
        );
        // Outside `with_limit`, nothing is limited.
        assert_eq!(vec![0u8; 2 << 20].len(), 2 << 20);
    }

    #[test]
    fn mutations_are_deterministic_and_change_the_input() {
        let seed = b"mixed_precision: bf16\nnum_processes: 2\n".to_vec();
        let a: Vec<Vec<u8>> = {
            let mut m = Mutator::new(7);
            (0..50).map(|_| m.mutate(&seed, &[])).collect()
        };
        let b: Vec<Vec<u8>> = {
            let mut m = Mutator::new(7);
            (0..50).map(|_| m.mutate(&seed, &[])).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().filter(|m| **m != seed).count() > 40);
    }

    #[test]
    fn an_alias_bomb_is_small_and_nests() {
        let bomb = String::from_utf8(alias_bomb(9, 9)).unwrap();
        assert!(bomb.len() < 1000, "{}", bomb.len());
        assert!(bomb.contains("a9: &a9 [*a8"));
    }

    #[test]
    fn the_limit_is_64_mib_or_16_times_the_input() {
        assert_eq!(limit_for(10), 64 << 20);
        assert_eq!(limit_for(8 << 20), 128 << 20);
    }

    #[test]
    fn a_run_counts_panics_and_wrong_answers() {
        let report = run_keeping("selftest", &[b"ok".to_vec()], 20, None, |input| {
            if input.is_empty() {
                panic!("empty")
            } else if input == b"ok" {
                Verdict::Accepted
            } else {
                Verdict::Refused
            }
        });
        assert_eq!(report.inputs, 21);
        assert_eq!(report.accepted + report.refused + report.failures, 21);
    }
}
