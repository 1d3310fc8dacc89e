//! The launcher's parsers of outside data, fuzzed (see `burn-accelerate-fuzz`): hostfiles (`host slots=N` lines)
//! and the status files ranks leave for the launcher. Each input is accepted, or refused with an error naming the
//! hostfile (a status file that cannot be read is left out, as a rank that left none); none may panic or allocate
//! by an untrusted length (the allocation limit is this test binary's global allocator, `main.rs`).

use burn_accelerate_fuzz::{Scratch, Verdict, iterations, run};

use super::attempt::rank_reports;
use super::hostfile_slots;

/// Mutated inputs per target unless `BURN_ACCELERATE_FUZZ_ITERATIONS` says otherwise.
const DEFAULT_ITERATIONS: u64 = 3_000;

/// A folder of this test's target, removed when dropped.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("ba-cli-fuzz-{name}"))
}

#[test]
fn hostfiles() {
    let seeds: Vec<Vec<u8>> = [
        "localhost slots=3\n",
        "# two machines\nnode-a slots=4 max_slots=8\nnode-b slots=4\n\n",
        "10.0.0.1 slots=2 # the first\n10.0.0.2 slots=18446744073709551615\n",
        "node-a\nnode-b slots=2\n",
    ]
    .map(|s| s.as_bytes().to_vec())
    .to_vec();
    let dir = scratch("hostfile");
    let file = dir.join("hosts");
    let report = run(
        "hostfiles",
        &seeds,
        iterations(DEFAULT_ITERATIONS),
        |input| {
            std::fs::write(&file, input).unwrap();
            match hostfile_slots(&file) {
                // The slots of every line, added without overflow: a total that wrapped around would start the
                // wrong number of processes.
                Ok(Some(total)) if Some(total as u128) != slots_in(input) => {
                    Verdict::Wrong(format!("{total} slots, expected {:?}", slots_in(input)))
                }
                Ok(_) => Verdict::Accepted,
                Err(e) if e.to_string().contains(&file.display().to_string()) => Verdict::Refused,
                Err(e) => Verdict::Wrong(format!("the error does not name the hostfile: {e}")),
            }
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");
}

/// The slots of a hostfile that gives every machine's, summed in 128 bits (`None` otherwise): the test's own
/// reading of the format.
fn slots_in(input: &[u8]) -> Option<u128> {
    let text = std::str::from_utf8(input).ok()?;
    let mut total = 0u128;
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let slots = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("slots="))?;
        total += slots.parse::<usize>().ok()? as u128;
    }
    Some(total)
}

#[test]
fn launch_status_files() {
    let timeout = burn_accelerate::distributed::comm::TIMEOUT_REASON;
    let seeds: Vec<Vec<u8>> = [
        "1".to_string(),
        "70 ".to_string() + timeout,
        "-9".to_string(),
    ]
    .map(String::into_bytes)
    .to_vec();
    let dir = scratch("status");
    let report = run(
        "launch_status_files",
        &seeds,
        iterations(DEFAULT_ITERATIONS),
        |input| {
            std::fs::write(dir.join("rank_3.status"), input).unwrap();
            match rank_reports(&dir).as_slice() {
                [] => Verdict::Refused,
                [one] if one.rank == 3 => Verdict::Accepted,
                other => Verdict::Wrong(format!("one status file read as {other:?}")),
            }
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");
}
