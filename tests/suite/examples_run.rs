//! Every example, run briefly, reaches its stated metric (as Accelerate's `test_examples.py` runs its examples),
//! and the ones that run on several ranks give the same result on one and two.

use crate::python;

use crate::examples;

use std::collections::BTreeMap;
use std::process::Command;

/// The `key=value` lines an example printed (it must succeed).
fn run(name: &str, args: &[&str]) -> BTreeMap<String, String> {
    let out = Command::new(examples::example(name))
        .args(args)
        .env_remove("ACCELERATE_MIXED_PRECISION")
        .env_remove("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        .output()
        .expect("the example starts");
    let lines = examples::result_lines(out, &[""]);
    let mut results: BTreeMap<String, String> = lines
        .iter()
        .filter_map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    // The whole output too, for lines that are not `key=value`.
    results.insert("stdout".into(), lines.join("\n"));
    results
}

fn number(results: &BTreeMap<String, String>, key: &str) -> f64 {
    let value = results
        .get(key)
        .unwrap_or_else(|| panic!("no {key}= in {results:?}"));
    let value: f64 = value
        .parse()
        .unwrap_or_else(|e| panic!("{key}={value}: {e}"));
    assert!(value.is_finite(), "{key}={value} is not finite");
    value
}

#[test]
fn quicktour_loss_falls() {
    let r = run("quicktour", &["--epochs", "2", "--samples", "1024"]);
    assert!(
        number(&r, "final_loss") < 0.5 * number(&r, "initial_loss"),
        "{r:?}"
    );
}

#[test]
fn the_quicktour_prints_the_same_losses_on_1_2_and_4_ranks() {
    let args = ["--epochs", "2", "--samples", "1024"];
    let one = run("quicktour", &args);
    for ranks in ["2", "4"] {
        let many = run("quicktour", &[&args[..], &["--processes", ranks]].concat());
        for key in ["initial_loss", "final_loss"] {
            // Printed to 6 digits: equal as text.
            assert_eq!(many[key], one[key], "{key} on {ranks} ranks");
        }
    }
}

#[test]
fn nlp_example_reaches_90_percent_with_the_same_accuracy_on_1_and_2_ranks() {
    // Reviews read from the file by loader workers (the default, 2), or by the loop itself.
    let one = run("nlp_example", &["--epochs", "3", "--workers", "0"]);
    let two = run("nlp_example", &["--epochs", "3", "--processes", "2"]);
    let four_workers = run("nlp_example", &["--epochs", "3", "--workers", "4"]);
    assert!(number(&one, "accuracy") >= 0.9, "{one:?}");
    assert_eq!(one["accuracy"], two["accuracy"]);
    assert!((number(&one, "final_loss") - number(&two, "final_loss")).abs() <= 1e-4);
    assert_eq!(
        one["final_loss"], four_workers["final_loss"],
        "workers change nothing"
    );
    // A run that misreads a review shows one, as words, padding removed; only a perfect run shows none.
    let misread = one["stdout"]
        .lines()
        .find_map(|l| l.strip_prefix("misread: "));
    match misread {
        Some(review) => {
            assert!(number(&one, "accuracy") < 1.0, "{one:?}");
            assert!(!review.is_empty() && !review.contains("<unk>"), "{review}");
        }
        None => assert_eq!(number(&one, "accuracy"), 1.0, "{one:?}"),
    }
}

#[test]
fn nlp_example_reads_a_data_file_and_names_a_bad_line() {
    let dir = std::env::temp_dir().join(format!("nlp-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.tsv");
    std::fs::write(&bad, "label\ttext\n1\tgood\nno tab here\n").unwrap();
    let out = Command::new(examples::example("nlp_example"))
        .arg("--data")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.tsv:3: expected `label<TAB>text`"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cv_example_reaches_90_percent_with_the_same_result_on_1_and_2_ranks() {
    let args = ["--epochs", "3"];
    let one = run("cv_example", &args);
    let two = run("cv_example", &[&args[..], &["--processes", "2"]].concat());
    assert!(number(&one, "accuracy") >= 0.9, "{one:?}");
    assert_eq!(one["accuracy"], two["accuracy"]);
    assert!((number(&one, "final_loss") - number(&two, "final_loss")).abs() <= 1e-4);
}

#[test]
fn gradient_accumulation_matches_the_larger_batch() {
    let accumulated = run(
        "gradient_accumulation",
        &["--accumulation", "4", "--micro-batch", "16"],
    );
    let large = run(
        "gradient_accumulation",
        &["--accumulation", "1", "--micro-batch", "64"],
    );
    let two_ranks = run(
        "gradient_accumulation",
        &[
            "--accumulation",
            "2",
            "--micro-batch",
            "16",
            "--processes",
            "2",
        ],
    );
    for r in [&large, &two_ranks] {
        assert_eq!(r["optimizer_steps"], accumulated["optimizer_steps"]);
        assert!((number(r, "final_loss") - number(&accumulated, "final_loss")).abs() <= 1e-4);
    }
    assert!(number(&accumulated, "accuracy") >= 0.85, "{accumulated:?}");
}

#[test]
fn early_stopping_stops_every_rank_at_the_same_step() {
    for processes in ["1", "2"] {
        let r = run("early_stopping", &["--processes", processes]);
        let stopped = number(&r, "stopped_at_step");
        // 5 epochs of 4096 / 32 steps: stopping means well before the end.
        assert!(stopped < 640.0, "{r:?}");
        let every = format!(
            "[{}]",
            vec![r["stopped_at_step"].as_str(); processes.parse().unwrap()].join(", ")
        );
        assert_eq!(r["ranks_stopped_at"], every);
    }
    // A threshold no batch reaches: training runs to the end.
    let r = run("early_stopping", &["--threshold", "0", "--epochs", "1"]);
    assert_eq!(r["stopped_at_step"], "none");
}

#[test]
fn mixed_precision_example_trains_in_bf16_and_fp16_like_f32() {
    let f32_run = run(
        "automatic_mixed_precision",
        &["--mixed-precision", "no", "--epochs", "2"],
    );
    assert_eq!(f32_run["loss_scale"], "none");
    for precision in ["bf16", "fp16"] {
        let r = run(
            "automatic_mixed_precision",
            &["--mixed-precision", precision, "--epochs", "2"],
        );
        assert_eq!(r["mixed_precision"], precision);
        let (low, full) = (number(&r, "final_loss"), number(&f32_run, "final_loss"));
        // Measured: bf16 within 0.01% of the f32 loss, fp16 within 1.2%.
        assert!(
            (low - full).abs() <= 0.03 * full,
            "{precision}: {low} vs f32 {full}"
        );
        if precision == "fp16" {
            assert!(number(&r, "loss_scale") >= 1.0, "{r:?}");
        } else {
            assert_eq!(r["loss_scale"], "none");
        }
    }
}

#[test]
fn tracking_example_writes_every_tracker_on_the_main_rank_only() {
    let dir = std::env::temp_dir().join(format!("tracking-example-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let r = run(
        "tracking",
        &[
            "--project-dir",
            dir.to_str().unwrap(),
            "--processes",
            "2",
            "--epochs",
            "1",
        ],
    );
    let run_dir = dir.join("tracking_example");
    assert_eq!(r["logging_dir"], run_dir.display().to_string());
    let mut files: Vec<String> = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    // One event file: rank 1 started no tracker.
    assert_eq!(files.len(), 5, "{files:?}");
    assert!(files[1].starts_with("events.out.tfevents."), "{files:?}");
    assert_eq!(
        [&files[0], &files[2], &files[3], &files[4]],
        ["config.json", "hparams.yml", "metrics.csv", "metrics.jsonl"]
    );
    let lines = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    // 4096 samples / (2 ranks × 32) = 64 steps, then one evaluation record.
    assert_eq!(lines.lines().count(), 65);
    let last: serde_json::Value = serde_json::from_str(lines.lines().last().unwrap()).unwrap();
    assert_eq!(last["step"], 64);
    assert!((last["values"]["accuracy"].as_f64().unwrap() - number(&r, "accuracy")).abs() < 1e-4);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn progress_bars_draw_on_a_terminal_only() {
    // Not a terminal: nothing but the results.
    let out = Command::new(examples::example("nlp_example"))
        .args(["--epochs", "1"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("reviews ("));
    // A terminal (util-linux `script` gives the example a pseudo-terminal), two ranks: one bar per epoch.
    let program = examples::example("nlp_example");
    let command = format!("{} --epochs 2 --processes 2", program.display());
    let Ok(out) = Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .output()
    else {
        python::skipped("no `script` command: the terminal check is skipped");
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(
        screen.contains("/960 reviews ("),
        "no progress bar drawn:\n{screen}"
    );
    assert!(screen.contains("epoch 1"), "{screen}");
    assert!(screen.contains("accuracy="), "{screen}");
}

#[test]
fn memory_example_agrees_on_one_batch_size_across_ranks() {
    let one = run(
        "memory",
        &["--start", "4096", "--fits-up-to", "1000", "--steps", "3"],
    );
    let two = run(
        "memory",
        &[
            "--start",
            "4096",
            "--fits-up-to",
            "1000",
            "--steps",
            "3",
            "--processes",
            "2",
        ],
    );
    // 4096 shrinks by 0.9 to the first size at or below 1000 (Accelerate's rule), on every rank alike.
    assert_eq!(one["batch_size"], "933");
    assert_eq!(two["batch_size"], "933");
    number(&two, "final_loss");
}

#[test]
fn checkpointing_example_resumes_two_ranks_exactly() {
    let dir = std::env::temp_dir().join(format!("checkpointing-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let project = dir.to_str().unwrap();
    let args = [
        "--project-dir",
        project,
        "--steps",
        "60",
        "--processes",
        "2",
    ];
    let uninterrupted = run("checkpointing", &args);
    // Go back to the step-25 checkpoint (mid-epoch: 1000 samples / (2 × 32) = 16 steps an epoch) and resume.
    std::fs::remove_dir_all(dir.join("checkpoints/checkpoint_1")).unwrap();
    let resumed = run("checkpointing", &[&args[..], &["--resume"]].concat());
    assert!(
        resumed["stdout"].contains("checkpoint_0 at step 25"),
        "{}",
        resumed["stdout"]
    );
    assert_eq!(resumed["final_loss"], uninterrupted["final_loss"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// The `rank r/P ... key=value ...` lines of the sharded training example, as (rank, values by key).
fn rank_reports(results: &BTreeMap<String, String>) -> Vec<BTreeMap<String, String>> {
    let mut reports: Vec<BTreeMap<String, String>> = results["stdout"]
        .lines()
        .filter(|l| l.starts_with("rank "))
        .map(|l| {
            let mut fields: BTreeMap<String, String> = l
                .split_whitespace()
                .filter_map(|f| {
                    f.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect();
            let rank = l.split_whitespace().nth(1).unwrap_or_default().to_string();
            fields.insert("rank".into(), rank);
            fields
        })
        .collect();
    reports.sort_by(|a, b| a["rank"].cmp(&b["rank"]));
    reports
}

fn bytes(report: &BTreeMap<String, String>, key: &str) -> f64 {
    report[key]
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {e}: {report:?}"))
}

#[test]
fn sharded_training_matches_unsharded_and_each_rank_holds_its_share() {
    let one = run("sharded_training", &[]);
    let plain = run(
        "sharded_training",
        &["--processes", "2", "--sharding", "NO_SHARD"],
    );
    // Two ranks average the gradients of their halves of the batch: one process's loss within rounding.
    let (l1, l2) = (number(&one, "final_loss"), number(&plain, "final_loss"));
    assert!((l1 - l2).abs() <= 2e-6, "1 rank {l1}, 2 ranks {l2}");
    let whole = &rank_reports(&plain)[0];
    for sharding in ["SHARD_GRAD_OP", "FULL_SHARD"] {
        let sharded = run(
            "sharded_training",
            &["--processes", "2", "--sharding", sharding],
        );
        assert_eq!(sharded["final_loss"], plain["final_loss"], "{sharding}");
        let reports = rank_reports(&sharded);
        assert_eq!(reports.len(), 2, "{sharding}: {reports:?}");
        for report in &reports {
            assert_eq!(report["sharding"], sharding);
            // Each rank's share: half, within 5% (the per-record header of the optimizer state included).
            for key in ["grads", "optimizer_state"] {
                let (mine, all) = (bytes(report, key), bytes(whole, key));
                assert!(
                    mine <= all * 0.5 * 1.05,
                    "{sharding} {key}: {mine} of {all}: {report:?}"
                );
            }
            let (mine, all) = (
                bytes(report, "params_at_rest"),
                bytes(whole, "params_at_rest"),
            );
            if sharding == "FULL_SHARD" {
                assert!(
                    mine <= all * 0.5 * 1.05,
                    "{sharding} parameters: {mine} of {all}"
                );
            } else {
                assert_eq!(mine, all, "{sharding} keeps every parameter");
            }
        }
    }
}

/// `--blocks`: block-wise FULL_SHARD (one layer gathered at a time, the next prefetched) prints the loss of the
/// same block-wise pass unsharded (the GPU kit's `blockwise-cuda` step, here on the CPU).
#[test]
fn sharded_training_block_wise_prints_the_unsharded_loss() {
    let plain = run(
        "sharded_training",
        &["--processes", "2", "--sharding", "NO_SHARD", "--blocks"],
    );
    let sharded = run(
        "sharded_training",
        &["--processes", "2", "--sharding", "FULL_SHARD", "--blocks"],
    );
    assert!(plain.contains_key("final_loss"), "{plain:?}");
    assert_eq!(sharded["final_loss"], plain["final_loss"]);
}

/// `--pp-size 2`: the layers cut into two stages, the batch run through them as micro-batches, print one process's
/// loss (the GPU kit's `pipeline-cuda` steps, here on the CPU): exactly with one micro-batch, within float rounding
/// with four.
#[test]
fn sharded_training_in_two_pipeline_stages_prints_the_loss_of_one_process() {
    let one = run("sharded_training", &["--processes", "1", "--blocks"]);
    let staged = |micro_batches: &str| {
        run(
            "sharded_training",
            &[
                "--processes",
                "2",
                "--blocks",
                "--pp-size",
                "2",
                "--pp-microbatches",
                micro_batches,
            ],
        )
    };
    assert!(one.contains_key("final_loss"), "{one:?}");
    assert_eq!(staged("1")["final_loss"], one["final_loss"]);
    let four: f64 = staged("4")["final_loss"].parse().unwrap();
    let one: f64 = one["final_loss"].parse().unwrap();
    assert!((four - one).abs() <= 1e-3 * one.abs(), "{four} vs {one}");
}

/// `--bf16 --param-dtype bf16`: the block-wise pass in bf16 with each layer gathered in bf16 (FSDP2's
/// `param_dtype`) prints the loss of gathering in f32 and casting (the GPU kit's `blockwise-bf16-cuda` step, here
/// on the CPU), and a half gather without bf16 mixed precision is refused.
#[test]
fn sharded_training_gathering_in_bf16_prints_the_loss_of_gathering_in_f32() {
    let common = [
        "--processes",
        "2",
        "--sharding",
        "FULL_SHARD",
        "--blocks",
        "--bf16",
    ];
    let cast = run("sharded_training", &common);
    let gathered = run(
        "sharded_training",
        &[&common[..], &["--param-dtype", "bf16"]].concat(),
    );
    assert!(cast.contains_key("final_loss"), "{cast:?}");
    assert_eq!(gathered["final_loss"], cast["final_loss"]);
    let refused = Command::new(examples::example("sharded_training"))
        .args([
            "--processes",
            "2",
            "--sharding",
            "FULL_SHARD",
            "--blocks",
            "--param-dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("mixed_precision bf16"),
        "{stderr}"
    );
}

/// A config written by Python as Accelerate writes it, with `distributed_type: FSDP`, runs the example sharded.
#[test]
fn sharded_training_runs_from_an_fsdp_config_written_by_python() {
    let Some(python) = python::python_with(&["yaml"]) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("ba-fsdp-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("default_config.yaml");
    let script = "import sys, yaml\n\
        yaml.safe_dump({'compute_environment': 'LOCAL_MACHINE', 'distributed_type': 'FSDP', 'downcast_bf16': 'no',\n\
        'fsdp_config': {'fsdp_auto_wrap_policy': 'TRANSFORMER_BASED_WRAP', 'fsdp_backward_prefetch': 'BACKWARD_PRE',\n\
        'fsdp_offload_params': False, 'fsdp_sharding_strategy': 'SHARD_GRAD_OP',\n\
        'fsdp_state_dict_type': 'FULL_STATE_DICT', 'fsdp_sync_module_states': True, 'fsdp_use_orig_params': True},\n\
        'machine_rank': 0, 'main_training_function': 'main', 'mixed_precision': 'no', 'num_machines': 1,\n\
        'num_processes': 2, 'rdzv_backend': 'static', 'same_network': True, 'use_cpu': True},\n\
        open(sys.argv[1], 'w'))";
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(examples::example("sharded_training"))
        .args(["--processes", "2"])
        .env("ACCELERATE_CONFIG_FILE", &file)
        .output()
        .unwrap();
    let lines = examples::result_lines(out, &["rank ", "final_loss="]);
    let plain = run(
        "sharded_training",
        &["--processes", "2", "--sharding", "NO_SHARD"],
    );
    assert!(
        lines.contains(&format!("final_loss={}", plain["final_loss"])),
        "{lines:?}"
    );
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.contains("sharding=SHARD_GRAD_OP"))
            .count(),
        2,
        "{lines:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
