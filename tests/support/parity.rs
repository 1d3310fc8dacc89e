//! Running the parity harness (`examples/parity_harness.rs`) and comparing what its ranks wrote, value by value.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::examples::example;

/// The training cases every comparison covers, with the largest |Δ| allowed between a P-rank run and one
/// process with the combined batch. f32 cases differ only in the order of a few sums (measured: ≤ 9e-7 for
/// P = 2, 3, 4; the bound is ten times that). Half-precision forwards round each rank's smaller batch on its
/// own, and Adam turns such differences into steps of up to its learning rate (1e-2) where a gradient is near
/// zero: measured ≤ 4.4e-3 (bf16) and ≤ 1.7e-2 (fp16) after 21 steps, the same in-process and under mpirun;
/// the bounds are about twice that, below the weights' own movement.
pub const CASES: [(&str, f32); 7] = [
    ("dp", 1e-5),
    ("accumulation", 1e-5),
    ("clip-norm", 1e-5),
    ("clip-value", 1e-5),
    ("bf16", 1e-2),
    ("fp16", 3.5e-2),
    ("uneven", 1e-5),
];

/// A fresh, empty folder for one test's runs.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-parity-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The harness binary, built with this test binary's profile and features.
pub fn harness() -> PathBuf {
    example("parity_harness")
}

/// Runs the harness as one process with `args` (`--processes N` for in-process ranks), asserting success.
pub fn run_local(out: &Path, args: &[&str]) -> Output {
    let out = Command::new(harness())
        .arg("--out")
        .arg(out)
        .args(args)
        .output()
        .unwrap();
    assert_success(&out);
    out
}

/// Asserts that a run succeeded, printing its output otherwise.
pub fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The tensors of a safetensors file written by the harness, by name, as f32.
pub fn weights(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = file.names().into_iter().map(str::to_string).collect();
    names.sort();
    assert!(!names.is_empty(), "{}: no tensors", path.display());
    names
        .into_iter()
        .map(|name| {
            let view = file.tensor(&name).unwrap();
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

/// The largest |a - b| over every value of two weight sets with the same names and sizes.
pub fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len(), "different numbers of tensors");
    let mut max = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len(), "{na}: different sizes");
        for (x, y) in va.iter().zip(vb) {
            assert!(x.is_finite() && y.is_finite(), "{na}: {x} vs {y}");
            max = max.max((x - y).abs());
        }
    }
    max
}

/// The report rank `rank` wrote for `case` under `dir`.
pub fn report(dir: &Path, case: &str, rank: usize) -> serde_json::Value {
    let path = dir.join(case).join(format!("rank{rank}.json"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap()
}

/// What must be the same on every run of a case, whatever the number of ranks: the steps counted, clipped and
/// skipped, and the loss scale.
fn counts(report: &serde_json::Value) -> [serde_json::Value; 4] {
    [
        report["steps"].clone(),
        report["clipped_steps"].clone(),
        report["skipped_steps"].clone(),
        report["loss_scale"].clone(),
    ]
}

/// Compares the `p` ranks of `case` under `dir` with the one-process run under `one`: every rank wrote the same
/// weights bit for bit, within the case's bound of one process, with the same counts; returns the largest |Δ|.
pub fn compare_case(one: &Path, dir: &Path, p: usize, case: &str, bound: f32) -> f32 {
    let reference = weights(&one.join(case).join("rank0.safetensors"));
    let first = weights(&dir.join(case).join("rank0.safetensors"));
    for rank in 0..p {
        let report = report(dir, case, rank);
        assert_eq!(report["rank"], rank, "{case}: {report}");
        assert_eq!(report["num_processes"], p, "{case}: {report}");
        assert_eq!(
            counts(&report),
            counts(&self::report(one, case, 0)),
            "{case}, P={p}, rank {rank}: steps, clipped and skipped steps, loss scale"
        );
        if rank > 0 {
            let mine = weights(&dir.join(case).join(format!("rank{rank}.safetensors")));
            assert_eq!(
                mine, first,
                "{case}, P={p}: rank {rank}'s weights differ from rank 0's"
            );
        }
    }
    let diff = max_abs_diff(&reference, &first);
    assert!(
        diff <= bound,
        "{case}, P={p}: max |Δ| against one process is {diff:e} (bound {bound:e})"
    );
    diff
}

/// The cases' own checks on the one-process run: clipping bit on most steps, fp16 skipped an overflowing step
/// and kept a loss scale, each case made its number of optimizer steps. Without these a comparison could pass
/// on cases that did nothing.
pub fn check_cases_did_something(one: &Path) {
    let get = |case: &str, key: &str| report(one, case, 0)[key].as_u64().unwrap();
    assert_eq!(get("dp", "steps"), 21);
    assert_eq!(get("accumulation", "steps"), 21, "windows of 3, 3 and 1");
    assert_eq!(get("uneven", "steps"), 24);
    assert!(get("clip-norm", "clipped_steps") >= 10);
    assert!(get("clip-value", "clipped_steps") >= 10);
    assert!(get("fp16", "skipped_steps") >= 1);
    assert!(report(one, "fp16", 0)["loss_scale"].as_f64().unwrap() > 1.0);
    assert_eq!(report(one, "bf16", 0)["mixed_precision"], "bf16");
    // Weights that moved from where every case started: the cases are compared after training.
    let start = weights(&one.join("initial").join("rank0.safetensors"));
    for (case, _) in CASES {
        let end = weights(&one.join(case).join("rank0.safetensors"));
        assert!(
            max_abs_diff(&start, &end) > 1e-2,
            "{case}: the weights hardly moved"
        );
    }
    let plain = weights(&one.join("dp").join("rank0.safetensors"));
    let clipped = weights(&one.join("clip-norm").join("rank0.safetensors"));
    assert!(
        max_abs_diff(&plain, &clipped) > 1e-3,
        "clipping changed training"
    );
}

/// The bound of a sharded run against the unsharded run of the same ranks, per case: the same reductions in
/// the same order, so the same bits, except the global norm of `clip-norm`, whose shard parts are summed in
/// another order (measured ≤ 9e-8).
pub fn sharded_bound(case: &str) -> f32 {
    if case == "clip-norm" { 1e-6 } else { 0.0 }
}

/// Compares the sharded run of `case` under `sharded` with the unsharded run under `unsharded` (both on `p`
/// ranks): every rank wrote the same whole weights, within [`sharded_bound`] of the unsharded ones, with the
/// same counts; each rank held less optimizer state than an unsharded rank, and all of them together about as
/// much. Returns the largest |Δ|.
pub fn compare_sharded(unsharded: &Path, sharded: &Path, p: usize, case: &str) -> f32 {
    compare_sharded_within(unsharded, sharded, p, case, sharded_bound(case))
}

/// The bound of a block-wise `FULL_SHARD` run (`--blocks`) against the unsharded run of the same ranks: the
/// sharded bound, but with accumulation each micro-batch is reduced as it ends, so the window's sum is taken in
/// another order (measured ≤ 9e-8).
pub fn blockwise_bound(case: &str) -> f32 {
    if case == "accumulation" {
        1e-6
    } else {
        sharded_bound(case)
    }
}

/// [`compare_sharded`] within `bound`.
pub fn compare_sharded_within(
    unsharded: &Path,
    sharded: &Path,
    p: usize,
    case: &str,
    bound: f32,
) -> f32 {
    let diff = compare_case(unsharded, sharded, p, case, bound);
    let bytes = |dir: &Path, rank: usize| {
        report(dir, case, rank)["optimizer_state_bytes"]
            .as_u64()
            .unwrap()
    };
    let whole = bytes(unsharded, 0);
    let mut sum = 0;
    for rank in 0..p {
        let mine = bytes(sharded, rank);
        assert!(
            mine < whole,
            "{case}, P={p}, rank {rank}: {mine} B of optimizer state, unsharded {whole} B"
        );
        sum += mine;
    }
    // Each record has its own header (a few hundred bytes).
    assert!(
        sum <= whole + 1024 * p as u64,
        "{case}, P={p}: {sum} B of optimizer state over all ranks, unsharded {whole} B"
    );
    diff
}

/// Copies the files of folder `from` into `to` (a saved training state into another run's folder).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// The bound of `case` in [`CASES`].
pub fn bound(case: &str) -> f32 {
    CASES.iter().find(|(c, _)| *c == case).unwrap().1
}

/// Samples in the harness's `resume` case (7 steps of 24 an epoch), its epochs, and the micro-step it saves
/// after (the resumed run goes on to the 21st).
const RESUME_SAMPLES: i64 = 24 * 7;
const RESUME_EPOCHS: usize = 3;
pub const SAVE_AT: usize = 10;

/// `(micro-step, sample id)` of every sample the ranks of the `resume` run in `out` used, from every rank's
/// report.
pub fn trained_ids(out: &Path, ranks: usize) -> Vec<(usize, i64)> {
    (0..ranks)
        .flat_map(|rank| {
            let ids = report(out, "resume", rank)["trained_ids"].clone();
            serde_json::from_value::<Vec<(usize, i64)>>(ids).unwrap()
        })
        .collect()
}

/// Asserts that the samples used up to the save (`before`, by a run that saved) and after it (`after`, by the
/// resumed run) cover every epoch once: each sample id exactly once per epoch.
pub fn assert_each_sample_once(before: &[(usize, i64)], after: &[(usize, i64)], what: &str) {
    let steps_per_epoch = 7;
    let mut used: std::collections::BTreeMap<(usize, i64), usize> = Default::default();
    let before = before.iter().filter(|(micro, _)| *micro <= SAVE_AT);
    for (micro, id) in before.chain(after) {
        *used
            .entry(((micro - 1) / steps_per_epoch, *id))
            .or_default() += 1;
    }
    assert!(
        after.iter().all(|(micro, _)| *micro > SAVE_AT),
        "{what}: the resumed run used a sample of a step before the save"
    );
    for epoch in 0..RESUME_EPOCHS {
        for id in 0..RESUME_SAMPLES {
            let n = used.get(&(epoch, id)).copied().unwrap_or(0);
            assert_eq!(n, 1, "{what}: sample {id} used {n} times in epoch {epoch}");
        }
    }
    assert_eq!(
        used.len(),
        RESUME_EPOCHS * RESUME_SAMPLES as usize,
        "{what}"
    );
}

/// Checks a `resume` run under `resumed` on `m` ranks that continued a state saved by another run, whose
/// samples up to the save were `before`, against one process straight through under `reference`: every rank
/// ends within `bound` of its weights and resumed at [`SAVE_AT`]; every sample of every epoch was used once; a
/// sharded rank holds only its own parameters' optimizer state (a replicated one all of it). Returns the
/// largest |Δ|.
pub fn check_resumed(
    reference: &Path,
    before: &[(usize, i64)],
    (resumed, m, sharding): (&Path, usize, &str),
    bound: f32,
    what: &str,
) -> f32 {
    let expected = weights(&reference.join("resume").join("rank0.safetensors"));
    let whole_state = report(reference, "resume", 0)["optimizer_state_bytes"]
        .as_u64()
        .unwrap();
    let mut worst = 0f32;
    for rank in 0..m {
        let file = format!("rank{rank}.safetensors");
        let diff = max_abs_diff(&weights(&resumed.join("resume").join(file)), &expected);
        assert!(
            diff <= bound,
            "{what}, rank {rank}: max |Δ| {diff:e} vs one process, over the bound {bound:e}"
        );
        worst = worst.max(diff);
        let report = report(resumed, "resume", rank);
        assert_eq!(report["resumed_at"], SAVE_AT, "{what}, rank {rank}");
        assert_eq!(report["num_processes"], m, "{what}, rank {rank}");
    }
    assert_each_sample_once(before, &trained_ids(resumed, m), what);
    let held: Vec<u64> = (0..m)
        .map(|rank| {
            report(resumed, "resume", rank)["optimizer_state_bytes"]
                .as_u64()
                .unwrap()
        })
        .collect();
    // The state tensors' bytes (no record headers): the same on every replica; a sharded rank's slices add up to
    // the whole and its padding rows (at most one per tensor and rank).
    let near = |b: u64| b.abs_diff(whole_state) * 20 <= whole_state;
    if sharding.contains("HYBRID") && m > 1 {
        // Replicated across the shard groups: each rank holds less than the whole.
        assert!(
            held.iter().all(|b| *b < whole_state),
            "{what}: {held:?} B of optimizer state, one process {whole_state} B"
        );
    } else if sharding == "NO_SHARD" || m == 1 {
        assert!(
            held.iter().all(|b| near(*b)),
            "{what}: {held:?} B of optimizer state, one process {whole_state} B"
        );
    } else {
        let total: u64 = held.iter().sum();
        assert!(
            total <= whole_state * 21 / 20 + 512 * m as u64,
            "{what}: the ranks hold {held:?} B of optimizer state, one process {whole_state} B"
        );
    }
    worst
}

/// fp16: the loss scaler a resume on `m` ranks (under `resumed`) loaded is the one the `n` ranks that saved the
/// state (under `saved`) had at the save, scale and growth tracker alike, and the scaler had left its initial
/// state by then (so that a resume that lost it would show); the optimizer steps before the save and after the
/// resume add up to those of one process straight through (under `reference`).
pub fn check_scaler_resumed(
    reference: &Path,
    (saved, n): (&Path, usize),
    (resumed, m): (&Path, usize),
    what: &str,
) {
    let at_save = report(saved, "resume", 0)["scaler_at_save"].clone();
    assert!(
        at_save.is_object(),
        "{what}: the saving run recorded no loss scaler: {at_save}"
    );
    assert!(
        at_save["growth_tracker"].as_u64().unwrap_or(0) > 0 || at_save["scale"] != 65536.0,
        "{what}: the scaler never left its initial state before the save, so a lost one would not show: {at_save}"
    );
    for rank in 1..n {
        assert_eq!(
            report(saved, "resume", rank)["scaler_at_save"],
            at_save,
            "{what}: saving rank {rank}"
        );
    }
    let steps_before = report(saved, "resume", 0)["steps_at_save"]
        .as_u64()
        .unwrap();
    let total = report(reference, "resume", 0)["steps"].as_u64().unwrap();
    for rank in 0..m {
        let report = report(resumed, "resume", rank);
        assert_eq!(
            report["scaler_at_resume"], at_save,
            "{what}, rank {rank}: the resumed loss scaler differs from the saved one"
        );
        assert_eq!(
            steps_before + report["steps"].as_u64().unwrap(),
            total,
            "{what}, rank {rank}: optimizer steps before the save and after the resume"
        );
    }
}
