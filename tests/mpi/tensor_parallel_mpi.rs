//! Tensor parallelism under `mpirun`: the transformer example and a pre-norm MLP stack of one's own (the
//! `tensor_parallel` example) split over 2 and 4 processes, over 2 × 2 (tensor × data) and over tensor × sharded
//! data (FSDP2 + TP: 2 × 2, and 2 × 2 × 2 hybrid), with and without sequence and loss parallelism, end with one
//! process's weights; and each process holds its share of the training state and of the activations, which
//! in-process ranks (one address space) cannot show: parameters, gradients and Adam's state within 1.05 × of the
//! replicated part plus 1/`tp` of the split part (divided by the shards under FSDP2 + TP), each layer's activations with
//! sequence parallelism within 1.15 × of 1/`tp` of one process's, the logits split with loss parallelism.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::examples;

use examples::{example, mpirun};

/// The little-endian f32 values of a `--weights` file.
pub(crate) fn floats(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The largest |a − b| of two equally long weight lists.
pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn succeeded(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("step  20 loss"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_transformer_example_split_over_processes_trains_to_one_process_weights() {
    let dir = std::env::temp_dir().join(format!("ba-tp-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lm = example("transformer_lm");
    for (optimizer, args, bound) in [
        ("sgd", &["--sgd", "--lr", "0.1"][..], 1e-6),
        ("adam", &[][..], 1e-5),
        // Loss parallelism: each process keeps its columns of the logits.
        (
            "sgd-loss-parallel",
            &["--sgd", "--lr", "0.1", "--loss-parallel"][..],
            1e-6,
        ),
        ("adam-loss-parallel", &["--loss-parallel"][..], 1e-5),
        // Sequence parallelism: between the regions each process holds its part of the sequence.
        (
            "sgd-sp-lp",
            &[
                "--sgd",
                "--lr",
                "0.1",
                "--sequence-parallel",
                "--loss-parallel",
            ][..],
            1e-6,
        ),
        ("adam-sp", &["--sequence-parallel"][..], 1e-5),
        (
            "fp16-clipped",
            &["--mixed-precision", "fp16", "--clip-norm", "0.5"][..],
            3.5e-2,
        ),
    ] {
        let one = dir.join(format!("{optimizer}-one.bin"));
        let common = |path: &Path| -> Vec<String> {
            ["--steps", "20", "--weights", path.to_str().unwrap()]
                .into_iter()
                .chain(args.iter().copied())
                .map(String::from)
                .collect()
        };
        succeeded(&Command::new(&lm).args(common(&one)).output().unwrap());
        // Tensor × data parallelism in fp16 rounds each replica's half batch on its own: compared in f32.
        let meshes: &[(usize, &str)] = match optimizer {
            "fp16-clipped" => &[(2, "2"), (4, "4")],
            _ => &[(2, "2"), (4, "4"), (4, "2")],
        };
        for &(np, tp) in meshes {
            let path = dir.join(format!("{optimizer}-{np}-{tp}.bin"));
            let mut run_args = common(&path);
            run_args.extend(["--tp-size".to_string(), tp.to_string()]);
            let run_args: Vec<&str> = run_args.iter().map(String::as_str).collect();
            succeeded(&mpirun(np, &lm, &run_args));
            let diff = max_abs_diff(&floats(&one), &floats(&path));
            println!("mpirun -np {np} tp {tp} {optimizer}: max |Δ| = {diff:e}");
            assert!(
                diff <= bound,
                "np {np} tp {tp} {optimizer}: max |Δ| = {diff:e} > {bound:e}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The global norm clipped: it moves the weights by 1e-2, so a norm counted wrong shows.
const CLIPPED: [&str; 2] = ["--clip-norm", "0.5"];
/// SGD with two micro-batches accumulated per step.
const ACCUMULATED: [&str; 5] = ["--sgd", "--lr", "0.1", "--accumulate", "2"];
/// fp16 with the loss scaled and the norm clipped, the loss in f32 (loss parallelism's, on one process too).
const FP16: [&str; 5] = [
    "--mixed-precision",
    "fp16",
    "--clip-norm",
    "0.5",
    "--loss-parallel",
];

/// The evaluation `transformer_lm --eval` printed: how many held-out sequences came back, their mean loss.
fn evaluation(stdout: &str) -> (usize, f64) {
    let value = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {stdout}"))
            .to_string()
    };
    (
        value("eval_samples=").parse().unwrap(),
        value("eval_loss=").parse().unwrap(),
    )
}

/// `transformer_lm` at [`SMALL`] with `args` for 20 steps on `np` processes (one: without a launcher), its final weights written
/// to `path` and 5 held-out sequences evaluated: its standard output.
fn evaluated_run(lm: &Path, np: usize, path: &Path, args: &[&str]) -> String {
    let run_args = [
        &SMALL[..],
        &[
            "--steps",
            "20",
            "--eval",
            "5",
            "--weights",
            path.to_str().unwrap(),
        ][..],
        args,
    ]
    .concat();
    match np {
        1 => succeeded(&Command::new(lm).args(&run_args).output().unwrap()),
        _ => succeeded(&mpirun(np, lm, &run_args)),
    }
}

/// The 2-D and 3-D meshes' model: the transformer example at 2 layers (one per pipeline stage) of width 32.
const SMALL: [&str; 6] = ["--layers", "2", "--d-model", "32", "--heads", "4"];

/// What [`references`] holds: by name, one process's final weights and its evaluation.
type References = BTreeMap<&'static str, (Vec<f32>, (usize, f64))>;

/// One process's weights after 20 steps, and its evaluation of 5 held-out sequences, for the 2-D and 3-D meshes to
/// be held against (run once for the tests that share them): Adam, clipped, accumulated, fp16.
fn references() -> &'static References {
    static REFERENCES: std::sync::OnceLock<References> = std::sync::OnceLock::new();
    REFERENCES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ba-tp-references-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lm = example("transformer_lm");
        let mut reference = BTreeMap::new();
        for (name, args) in [
            ("adam", &[][..]),
            ("clipped", &CLIPPED[..]),
            ("accumulated", &ACCUMULATED[..]),
            ("fp16", &FP16[..]),
        ] {
            let path = dir.join(format!("{name}-one.bin"));
            let stdout = evaluated_run(&lm, 1, &path, args);
            reference.insert(name, (floats(&path), evaluation(&stdout)));
        }
        std::fs::remove_dir_all(&dir).ok();
        reference
    })
}

/// FSDP2 + TP under `mpirun`: `tp` 2 × `FULL_SHARD` 2 (4 processes) and `tp` 2 × `dp_replicate` 2 × `dp_shard` 2
/// (`HYBRID_SHARD`, 8 processes; `SHARD_GRAD_OP` is checked in process), the data dimension sharding what the tensor
/// dimension split: 20 steps end at one process's weights with Adam, with the global norm clipped (each element
/// counted once over every dimension; the clip moves the weights by 1e-2, so a norm counted wrong shows), with 2
/// micro-batches accumulated per step, with sequence and loss parallelism; in fp16 (one overflow verdict over
/// every dimension) within the fp16 bound of one process. An evaluation after training (`forward_batch`, then
/// `gather_for_metrics` over the data dimension) returns every held-out sample once, at one process's loss.
#[test]
fn tensor_parallelism_over_sharded_data_parallelism_trains_to_one_process_weights() {
    let dir = std::env::temp_dir().join(format!("ba-tp-fsdp-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lm = example("transformer_lm");
    let sp_lp = ["--sequence-parallel", "--loss-parallel"];
    let (clipped, accumulated, fp16) = (CLIPPED, ACCUMULATED, FP16);
    let reference = references();
    assert!(max_abs_diff(&reference["adam"].0, &reference["clipped"].0) > 1e-3);
    let full = ["--tp-size", "2", "--sharding", "FULL_SHARD"];
    let hybrid = [
        "--tp-size",
        "2",
        "--sharding",
        "HYBRID_SHARD",
        "--dp-shard-size",
        "2",
    ];
    let cases: [(&str, usize, Vec<&str>, &str, f32); 5] = [
        ("tp 2 × FULL_SHARD 2, adam", 4, full.to_vec(), "adam", 1e-5),
        (
            "tp 2 × FULL_SHARD 2, clipped, sp lp",
            4,
            [&full[..], &clipped, &sp_lp].concat(),
            "clipped",
            1e-5,
        ),
        (
            "tp 2 × FULL_SHARD 2, sgd accumulated, sp",
            4,
            [&full[..], &accumulated, &["--sequence-parallel"]].concat(),
            "accumulated",
            1e-6,
        ),
        (
            "tp 2 × FULL_SHARD 2, fp16 clipped, sp lp",
            4,
            [&full[..], &fp16, &["--sequence-parallel"]].concat(),
            "fp16",
            3.5e-2,
        ),
        (
            "tp 2 × dp_replicate 2 × dp_shard 2, clipped, sp lp",
            8,
            [&hybrid[..], &clipped, &sp_lp].concat(),
            "clipped",
            1e-5,
        ),
    ];
    for (i, (case, np, args, one, bound)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("case-{i}.bin"));
        let stdout = evaluated_run(&lm, np, &path, &args);
        let (weights, (samples, loss)) = &reference[one];
        let diff = max_abs_diff(weights, &floats(&path));
        let (got_samples, got_loss) = evaluation(&stdout);
        println!(
            "mpirun -np {np} {case}: max |Δ| = {diff:e}; evaluation: {got_samples} samples, loss {got_loss} (one \
             process: {loss})"
        );
        assert!(diff <= bound, "{case}: max |Δ| = {diff:e} > {bound:e}");
        assert_eq!(got_samples, *samples, "{case}: every held-out sample once");
        assert!(
            (got_loss - loss).abs() <= f64::from(bound) * 10.0,
            "{case}: evaluation loss {got_loss} against {loss}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The weights `transformer_lm` (at [`SMALL`]) saved with `--save-model` into `dir`, read back whole on one process.
fn saved_weights(lm: &Path, dir: &Path) -> Vec<f32> {
    let path = dir.with_extension("bin");
    let out = Command::new(lm)
        .args(SMALL)
        .args(["--steps", "0", "--load-pretrained", dir.to_str().unwrap()])
        .args(["--weights", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    floats(&path)
}

/// A pipeline of tensor-parallel stages under `mpirun` (torchtitan's 3-D mesh): `pp` 2 × `tp` 2 (4 processes) and
/// `pp` 2 × `tp` 2 × `dp` 2 (8, replicated and `FULL_SHARD`), each stage's layers split over its tensor-parallel
/// ranks, each micro-batch's regions cut and finished within its stage: 20 steps end at one process's weights
/// with Adam and sequence and loss parallelism, with the global norm clipped over every dimension, with 2
/// micro-batches accumulated per step and activation checkpointing; the model is
/// saved whole from the stages' slices, and an evaluation through the stages returns every held-out sample once.
#[test]
fn a_pipeline_of_tensor_parallel_stages_trains_to_one_process_weights() {
    let dir = std::env::temp_dir().join(format!("ba-pp-tp-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lm = example("transformer_lm");
    let (clipped, accumulated) = (CLIPPED, ACCUMULATED);
    let reference = references();
    let pp_tp = ["--pp-size", "2", "--tp-size", "2"];
    let cases: [(&str, usize, Vec<&str>, &str, f32); 3] = [
        (
            "pp 2 × tp 2, adam, sp lp",
            4,
            [
                &pp_tp[..],
                &["--sequence-parallel", "--loss-parallel", "--eval", "5"],
            ]
            .concat(),
            "adam",
            1e-5,
        ),
        (
            "pp 2 × tp 2 × FULL_SHARD 2, clipped, sp",
            8,
            [
                &pp_tp[..],
                &clipped,
                &["--sharding", "FULL_SHARD", "--sequence-parallel"],
            ]
            .concat(),
            "clipped",
            1e-5,
        ),
        (
            "pp 2 × tp 2 × dp 2, sgd accumulated, checkpointed, gpipe",
            8,
            [
                &pp_tp[..],
                &accumulated,
                &["--checkpointing", "--pp-schedule", "gpipe"],
            ]
            .concat(),
            "accumulated",
            1e-6,
        ),
    ];
    for (i, (case, np, args, one, bound)) in cases.into_iter().enumerate() {
        let saved = dir.join(format!("case-{i}"));
        let run_args = [
            &SMALL[..],
            &["--steps", "20", "--save-model", saved.to_str().unwrap()],
            &args,
        ]
        .concat();
        let stdout = succeeded(&mpirun(np, &lm, &run_args));
        let diff = max_abs_diff(&reference[one].0, &saved_weights(&lm, &saved));
        println!("mpirun -np {np} {case}: max |Δ| = {diff:e}");
        assert!(diff <= bound, "{case}: max |Δ| = {diff:e} > {bound:e}");
        if args.contains(&"--eval") {
            assert!(stdout.contains("eval_samples=5\n"), "{stdout}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_model_of_ones_own_split_over_processes_trains_to_one_process_weights() {
    let dir = std::env::temp_dir().join(format!("ba-tp-stack-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stack = example("tensor_parallel");
    let run = |out: std::process::Output| {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && stdout.contains("final_loss="),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for (case, args, bound) in [
        ("sgd", &["--sgd", "--lr", "0.05"][..], 1e-6),
        ("adam", &[][..], 1e-5),
        (
            "sgd-sp",
            &["--sgd", "--lr", "0.05", "--sequence-parallel"][..],
            1e-6,
        ),
        (
            "fp16-clipped",
            &["--mixed-precision", "fp16", "--clip-norm", "0.05"][..],
            3.5e-2,
        ),
    ] {
        let one = dir.join(format!("{case}-one.bin"));
        let with = |path: &Path, tp: &str| -> Vec<String> {
            ["--weights", path.to_str().unwrap(), "--tp-size", tp]
                .into_iter()
                .chain(args.iter().copied())
                .map(String::from)
                .collect()
        };
        run(Command::new(&stack).args(with(&one, "1")).output().unwrap());
        // Tensor × data parallelism in fp16 rounds each replica's half batch on its own (as plain data parallelism
        // does, which the parity suite bounds apart): its comparison is in f32.
        let meshes: &[(usize, &str)] = match case {
            "fp16-clipped" => &[(2, "2"), (4, "4")],
            _ => &[(2, "2"), (4, "4"), (4, "2")],
        };
        for &(np, tp) in meshes {
            let path = dir.join(format!("{case}-{np}-{tp}.bin"));
            let run_args = with(&path, tp);
            let run_args: Vec<&str> = run_args.iter().map(String::as_str).collect();
            run(mpirun(np, &stack, &run_args));
            let diff = max_abs_diff(&floats(&one), &floats(&path));
            println!("stack under mpirun -np {np} tp {tp} {case}: max |Δ| = {diff:e}");
            assert!(
                diff <= bound,
                "np {np} tp {tp} {case}: max |Δ| = {diff:e} > {bound:e}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The `key=number` fields of each rank's line of `stdout` that has `key` (`rank r/P ... key=...`).
fn rank_reports<'a>(stdout: &'a str, key: &str) -> Vec<BTreeMap<&'a str, u64>> {
    stdout
        .lines()
        .filter(|l| l.starts_with("rank "))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
                .collect::<BTreeMap<&str, u64>>()
        })
        .filter(|fields| fields.contains_key(key))
        .collect()
}

/// The model's elements whole on every rank and split over the tensor-parallel ranks, as `byte_lm::plan` cuts the
/// example's model (`layers` layers of width `d`, sequences of `seq` bytes, 256 byte values).
fn replicated_and_split(layers: usize, d: usize, seq: usize) -> (usize, usize) {
    let (vocab, ff) = (256, 4 * d);
    // Positions, and in each layer the output projection's and the second feed-forward layer's biases (added
    // after the all-reduce) and both norms; the final norm.
    let replicated = seq * d + layers * (d + d + 4 * d) + 2 * d;
    // Tokens by vocabulary; query, key, value (weights and biases) and the first feed-forward layer by columns,
    // the output projection and the second feed-forward layer by rows; the head by columns.
    let split = vocab * d
        + layers * (3 * (d * d + d) + d * d + (d * ff + ff) + ff * d)
        + (d * vocab + vocab);
    (replicated, split)
}

/// The transformer example at 4 layers of width 256 with 4 heads (3.3 M parameters).
const LM_4X256: [&str; 6] = ["--layers", "4", "--d-model", "256", "--heads", "4"];

#[test]
fn each_process_holds_the_replicated_part_and_its_share_of_the_split_part() {
    let lm = example("transformer_lm");
    let (layers, d) = (4, 256);
    let (replicated, split) = replicated_and_split(layers, d, 32);
    // `tp` 1, 2 and 4 alone, and `tp` 2 × `FULL_SHARD` 2: the data dimension halves each process's share again.
    for (tp, shards) in [(1usize, 1usize), (2, 1), (4, 1), (2, 2)] {
        let tp_arg = tp.to_string();
        let sharding = if shards > 1 { "FULL_SHARD" } else { "NO_SHARD" };
        let args = [
            &LM_4X256[..],
            &["--steps", "2", "--tp-size", &tp_arg, "--sharding", sharding],
        ]
        .concat();
        let np = tp * shards;
        let out = mpirun(np, &lm, &args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let reports = rank_reports(&stdout, "params_at_rest");
        assert_eq!(reports.len(), np, "{stdout}");
        // f32 parameters and gradients, Adam's two moments.
        let share = (replicated + split / tp) as f64 / shards as f64;
        let expected = 4.0 * share * 4.0;
        for r in &reports {
            assert_eq!(
                r["params"] as usize,
                replicated + split,
                "the whole model's parameters"
            );
            let held = (r["params_at_rest"] + r["grads"] + r["optimizer_state"]) as f64;
            let ratio = held / expected;
            println!(
                "tp {tp} × {sharding} {shards}: params {} grads {} adam {} = {held} B, {ratio:.4} × (replicated + \
                 1/tp split) / shards; peak RSS {} B",
                r["params_at_rest"], r["grads"], r["optimizer_state"], r["peak_rss"]
            );
            assert!(
                (0.99..=1.05).contains(&ratio),
                "tp {tp} × {sharding} {shards}: {ratio} of {expected} B: {r:?}"
            );
        }
    }
}

/// Each rank's `step_peak_bytes` (the most a step allocated above what was live when it began, counted by the
/// example's allocator) for `transformer_lm` with `args` on `np` processes: the largest over the ranks.
fn step_peak(np: usize, args: &[&str]) -> u64 {
    let lm = example("transformer_lm");
    let args: Vec<&str> = ["--sgd", "--skip-state-bytes", "--steps", "2"]
        .iter()
        .chain(args)
        .copied()
        .collect();
    let out = match np {
        1 => Command::new(&lm).args(&args).output().unwrap(),
        _ => mpirun(np, &lm, &args),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let peaks: Vec<u64> = rank_reports(&stdout, "step_peak_bytes")
        .iter()
        .map(|r| r["step_peak_bytes"])
        .collect();
    assert_eq!(peaks.len(), np, "{stdout}");
    peaks.into_iter().max().unwrap()
}

/// Sequence parallelism under `mpirun`: the activations of each transformer layer (the step's peak at 6 layers less
/// at 2, over 4) on each rank within 1.15 × of 1/`tp` of one process's, where tensor parallelism alone keeps the
/// activations between the regions whole on every rank (and stays above it). Loss parallelism: the logits of a
/// large batch never whole on a rank, so the peak falls by more than the part of the whole logits another rank
/// would hold.
#[test]
fn sequence_parallelism_divides_each_layers_activations_and_loss_parallelism_keeps_the_logits_split()
 {
    let model = [
        "--d-model",
        "128",
        "--heads",
        "4",
        "--seq",
        "256",
        "--batch",
        "8",
    ];
    let per_layer = |np: usize, extra: &[&str]| -> f64 {
        let at = |layers: &str| {
            let args: Vec<&str> = model
                .iter()
                .chain(&["--layers", layers])
                .chain(extra)
                .copied()
                .collect();
            step_peak(np, &args) as f64
        };
        (at("6") - at("2")) / 4.0
    };
    let one = per_layer(1, &[]);
    for tp in [2usize, 4] {
        let t = tp.to_string();
        let tp_args = ["--tp-size", t.as_str()];
        let alone = per_layer(tp, &tp_args);
        let sp = per_layer(tp, &[&tp_args[..], &["--sequence-parallel"]].concat());
        let (alone_ratio, sp_ratio) = (alone * tp as f64 / one, sp * tp as f64 / one);
        println!(
            "activations per layer: one process {one:.0} B; tp {tp} {alone:.0} B ({alone_ratio:.3} × 1/tp), with \
             sequence parallelism {sp:.0} B ({sp_ratio:.3} × 1/tp)"
        );
        assert!(
            sp_ratio <= 1.15,
            "tp {tp}: {sp_ratio:.3} × 1/tp of one process's"
        );
        assert!(
            alone_ratio > sp_ratio,
            "tp {tp}: sequence parallelism saves nothing"
        );
    }
    // 32768 tokens of 256 logits: 33.5 MB whole in f32.
    let big = [
        "--d-model",
        "16",
        "--heads",
        "4",
        "--seq",
        "64",
        "--batch",
        "512",
        "--layers",
        "1",
    ];
    let whole_logits = (512 * 64 * 256 * 4) as f64;
    for tp in [2usize, 4] {
        let t = tp.to_string();
        let args = [&big[..], &["--tp-size", t.as_str(), "--sequence-parallel"]].concat();
        let gathered = step_peak(tp, &args) as f64;
        let split = step_peak(tp, &[&args[..], &["--loss-parallel"]].concat()) as f64;
        let others = whole_logits * (tp - 1) as f64 / tp as f64;
        println!(
            "tp {tp} logits: the step's peak {gathered:.0} B gathered, {split:.0} B with loss parallelism ({:.2} × \
             the whole logits less)",
            (gathered - split) / whole_logits
        );
        assert!(
            gathered - split > others,
            "tp {tp}: loss parallelism saved {} B, less than the other ranks' logits ({others} B)",
            gathered - split
        );
    }
}

/// `save_model` under `mpirun` with `tp` 4: the main process writes the whole model while each process holds its
/// share, the split parameters gathered one at a time; what the save allocates on any process stays under half
/// the whole model, and the share plus the save under the whole.
#[test]
fn save_model_under_tensor_parallelism_never_holds_the_whole_model_on_a_process() {
    let dir = std::env::temp_dir().join(format!("ba-tp-save-mpi-{}", std::process::id()));
    let saved = dir.join("model");
    let lm = example("transformer_lm");
    let saving = [
        "--steps",
        "1",
        "--sgd",
        "--skip-state-bytes",
        "--tp-size",
        "4",
        "--save-model",
        saved.to_str().unwrap(),
    ];
    let args = [&LM_4X256[..], &saving].concat();
    let out = mpirun(4, &lm, &args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && saved.join("model.safetensors").exists(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ranks = rank_reports(&stdout, "params_at_rest");
    let saves = rank_reports(&stdout, "save_peak_bytes");
    let whole = ranks.first().map(|r| r["params"]).expect("the rank lines") * 4;
    let held: Vec<u64> = ranks.iter().map(|r| r["params_at_rest"]).collect();
    let saves: Vec<u64> = saves.iter().map(|r| r["save_peak_bytes"]).collect();
    assert_eq!((held.len(), saves.len()), (4, 4), "{stdout}");
    for (held, save) in held.iter().zip(&saves) {
        println!(
            "tp 4 save_model: holds {held} B, the save allocated {save} B; the whole model {whole} B"
        );
        assert!(
            *save < whole / 2 && held + save < whole,
            "{held} + {save} of {whole}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A training state saved under `mpirun` by `tp` 2 × `dp` 2 (4 processes, the data dimension `FULL_SHARD`: each
/// process its rows of its tensor-parallel slices, 2-D splits in the manifest) resumes on one process, on `tp` 4
/// and on `FULL_SHARD` 4 under `mpirun`, each process re-cutting its slices from the saved files; one saved by
/// `pp` 2 × `tp` 2 × `FULL_SHARD` 2 (8 processes) resumes on one process: the 20 steps end within the parity bound
/// of a straight run (Adam, 1e-5).
#[test]
fn a_state_saved_by_tp2_dp2_processes_resumes_on_one_process_and_on_tp4() {
    let dir = std::env::temp_dir().join(format!("ba-tp-state-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lm = example("transformer_lm");
    let state = dir.join("state");
    let state_arg = state.to_str().unwrap();
    let straight = dir.join("straight.bin");
    succeeded(
        &Command::new(&lm)
            .args(["--steps", "20", "--weights", straight.to_str().unwrap()])
            .output()
            .unwrap(),
    );
    let saved = mpirun(
        4,
        &lm,
        &[
            "--tp-size",
            "2",
            "--sharding",
            "FULL_SHARD",
            "--steps",
            "10",
            "--state",
            state_arg,
            "--save-at",
            "10",
        ],
    );
    let manifest = std::fs::read_to_string(state.join("checkpoint.json")).unwrap();
    assert!(manifest.contains("\"within\""), "no 2-D split: {manifest}");
    assert!(
        saved.status.success() && state.join("checkpoint.json").exists(),
        "{}\n{}",
        String::from_utf8_lossy(&saved.stdout),
        String::from_utf8_lossy(&saved.stderr)
    );
    for (np, tp, sharding) in [
        (1usize, "1", "NO_SHARD"),
        (4, "4", "NO_SHARD"),
        (4, "1", "FULL_SHARD"),
    ] {
        let out_path = dir.join(format!("resumed-{np}-{tp}.bin"));
        let args = [
            "--steps",
            "20",
            "--state",
            state_arg,
            "--resume",
            "--tp-size",
            tp,
            "--sharding",
            sharding,
            "--weights",
            out_path.to_str().unwrap(),
        ];
        let out = match np {
            1 => Command::new(&lm).args(args).output().unwrap(),
            _ => mpirun(np, &lm, &args),
        };
        let stdout = succeeded(&out);
        assert!(stdout.contains("resumed after step 10"), "{stdout}");
        let diff = max_abs_diff(&floats(&straight), &floats(&out_path));
        println!(
            "tp 2 × FULL_SHARD 2 state resumed on {np} process(es), tp {tp}, {sharding}: max |Δ| = {diff:e}"
        );
        assert!(diff <= 1e-5, "np {np} tp {tp}: max |Δ| = {diff:e}");
    }
    // A pipeline of tensor-parallel stages sharded over the data dimension (8 processes, 3-D): resumed on one
    // process, each parameter's pieces taken from the stage that holds them.
    let state3d = dir.join("state-3d");
    let state3d_arg = state3d.to_str().unwrap();
    let saved = mpirun(
        8,
        &lm,
        &[
            "--pp-size",
            "2",
            "--tp-size",
            "2",
            "--sharding",
            "FULL_SHARD",
            "--steps",
            "10",
            "--state",
            state3d_arg,
            "--save-at",
            "10",
        ],
    );
    assert!(
        saved.status.success(),
        "{}",
        String::from_utf8_lossy(&saved.stderr)
    );
    let out_path = dir.join("resumed-3d.bin");
    let stdout = succeeded(
        &Command::new(&lm)
            .args([
                "--steps",
                "20",
                "--state",
                state3d_arg,
                "--resume",
                "--weights",
            ])
            .arg(&out_path)
            .output()
            .unwrap(),
    );
    assert!(stdout.contains("resumed after step 10"), "{stdout}");
    let diff = max_abs_diff(&floats(&straight), &floats(&out_path));
    println!("pp 2 × tp 2 × FULL_SHARD 2 state resumed on 1 process: max |Δ| = {diff:e}");
    assert!(
        diff <= 1e-5,
        "pp 2 × tp 2 × FULL_SHARD 2 on one process: max |Δ| = {diff:e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
