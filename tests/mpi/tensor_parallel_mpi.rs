//! Tensor parallelism under `mpirun`: the transformer example and a pre-norm MLP stack of one's own (the
//! `tensor_parallel` example) split over 2 and 4 processes, and over 2 × 2 (tensor × data), end with one process's
//! weights; and each process holds its share of the training state, which
//! in-process ranks (one address space) cannot show: parameters, gradients and Adam's state within 1.05 × of the
//! replicated part plus 1/`tp` of the split part.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::examples;

use examples::{example, mpirun};

fn floats(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
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

#[test]
fn each_process_holds_the_replicated_part_and_its_share_of_the_split_part() {
    let lm = example("transformer_lm");
    let (layers, d) = (4, 256);
    let (replicated, split) = replicated_and_split(layers, d, 32);
    for tp in [1usize, 2, 4] {
        let args = [
            "--layers",
            "4",
            "--d-model",
            "256",
            "--heads",
            "4",
            "--steps",
            "2",
            "--tp-size",
            &tp.to_string(),
        ];
        let out = mpirun(tp, &lm, &args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let reports: Vec<BTreeMap<&str, u64>> = stdout
            .lines()
            .filter(|l| l.starts_with("rank ") && l.contains("params_at_rest="))
            .map(|l| {
                l.split_whitespace()
                    .filter_map(|kv| kv.split_once('='))
                    .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
                    .collect()
            })
            .collect();
        assert_eq!(reports.len(), tp, "{stdout}");
        // f32 parameters and gradients, Adam's two moments.
        let share = (replicated + split / tp) as f64;
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
                "tp {tp}: params {} grads {} adam {} = {held} B, {ratio:.4} × replicated + 1/tp split; peak RSS {} B",
                r["params_at_rest"], r["grads"], r["optimizer_state"], r["peak_rss"]
            );
            assert!(
                (0.99..=1.05).contains(&ratio),
                "tp {tp}: {ratio} of {expected} B: {r:?}"
            );
        }
    }
}
