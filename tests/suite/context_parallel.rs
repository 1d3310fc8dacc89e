//! Context parallelism against one process, in-process ranks (the same under `mpirun` is
//! `tests/mpi/context_parallel_mpi.rs`): the transformer example (`transformer_lm --cp-size`: each sequence cut
//! head-tail over the context ranks, the causal attention across them) over 2 and 4 context ranks, in each mode
//! (all-gather, ring), ends with one process's weights: within 1e-6 after 20 SGD steps, within the parity suite's
//! bounds after 20 Adam steps (1e-5; fp16 with global-norm clipping 3.5e-2); so do frozen lower layers with
//! accumulation, the contiguous split, `cp` 2 × `FULL_SHARD` 2 (with activation checkpointing), `cp` 2 × `tp` 2 and
//! `cp` 2 × `dp` 2; a state saved on 2 context ranks resumes on one process and on 4; an evaluation over context
//! ranks (`forward_batch`, `reduce_context`, `gather_for_metrics`) gives one process's held-out loss. The attention's counters show
//! the head-tail split's balance against the contiguous one's imbalance, and the ring's bytes match its formula.
//! Each misuse (a sequence `2 × cp` does not divide, a mask, an attention not routed through the building block or
//! outside a region, dropout) fails before the first step, saying how to fix it.

use crate::fixtures::max_abs_diff;
use crate::tensor_parallel::{lm_weights, lm_weights_after, scratch};

use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use burn_accelerate::Accelerator;
use burn_accelerate::config::ContextAttention;
use burn_accelerate::context_parallel::{self, ContextSplit};
use burn_accelerate::tensor_parallel::ParallelTransformerLayer;

const SGD: [&str; 3] = ["--sgd", "--lr", "0.1"];

/// One comparison: its name, the split run's arguments, one process's weights, the bound.
type Case<'a> = (String, Vec<&'a str>, &'a Vec<Vec<f32>>, f32);

#[test]
fn the_transformer_example_over_2_and_4_context_ranks_trains_to_one_process_weights() {
    let dir = scratch("cp");
    let fp16 = ["--mixed-precision", "fp16", "--clip-norm", "0.5"];
    let frozen = [&SGD[..], &["--freeze-bottom", "2", "--accumulate", "2"]].concat();
    let one_sgd = lm_weights(&dir, "sgd-1", &SGD);
    let one_adam = lm_weights(&dir, "adam-1", &[]);
    let one_fp16 = lm_weights(&dir, "fp16-1", &fp16);
    let one_frozen = lm_weights(&dir, "frozen-1", &frozen);
    // Freezing changes the training (so its comparison can fail), and so does fp16.
    assert!(max_abs_diff(&one_sgd, &one_frozen) > 1e-4);
    assert!(max_abs_diff(&one_adam, &one_fp16) > 1e-4);
    let mut cases: Vec<Case<'_>> = Vec::new();
    for cp in ["2", "4"] {
        for mode in ["allgather", "ring"] {
            let split = ["--processes", cp, "--cp-size", cp, "--cp-mode", mode];
            let with = |extra: &[&'static str]| -> Vec<&str> { [&split[..], extra].concat() };
            cases.push((format!("cp {cp} {mode} sgd"), with(&SGD), &one_sgd, 1e-6));
            cases.push((format!("cp {cp} {mode} adam"), with(&[]), &one_adam, 1e-5));
        }
    }
    let ring2 = ["--processes", "2", "--cp-size", "2", "--cp-mode", "ring"];
    let with2 = |extra: &[&'static str]| -> Vec<&str> { [&ring2[..], extra].concat() };
    cases.push((
        "cp 2 ring fp16 clipped".into(),
        with2(&fp16),
        &one_fp16,
        3.5e-2,
    ));
    cases.push((
        "cp 2 ring frozen accumulated".into(),
        with2(&frozen),
        &one_frozen,
        1e-6,
    ));
    let four = ["--processes", "4", "--cp-size"];
    let mesh = |extra: &[&'static str]| -> Vec<&str> { [&four[..], extra].concat() };
    cases.extend([
        (
            "cp 4 ring contiguous sgd".to_string(),
            mesh(&[
                "4",
                "--cp-mode",
                "ring",
                "--cp-contiguous",
                "--sgd",
                "--lr",
                "0.1",
            ]),
            &one_sgd,
            1e-6,
        ),
        // FSDP2 + CP: the state sharded over the data and context ranks.
        (
            "cp 2 ring × FULL_SHARD 2 adam".to_string(),
            mesh(&["2", "--cp-mode", "ring", "--sharding", "FULL_SHARD"]),
            &one_adam,
            1e-5,
        ),
        (
            "cp 2 allgather × FULL_SHARD 2 checkpointed sgd".to_string(),
            mesh(&[
                "2",
                "--sharding",
                "FULL_SHARD",
                "--checkpointing",
                "--sgd",
                "--lr",
                "0.1",
            ]),
            &one_sgd,
            1e-6,
        ),
        (
            "cp 2 ring × tp 2 sgd".to_string(),
            mesh(&[
                "2",
                "--cp-mode",
                "ring",
                "--tp-size",
                "2",
                "--sgd",
                "--lr",
                "0.1",
            ]),
            &one_sgd,
            1e-6,
        ),
        (
            "cp 2 allgather × tp 2 adam".to_string(),
            mesh(&["2", "--tp-size", "2"]),
            &one_adam,
            1e-5,
        ),
        // Two data-parallel replicas, each a context group reading half of every batch.
        (
            "cp 2 ring × dp 2 adam".to_string(),
            mesh(&["2", "--cp-mode", "ring"]),
            &one_adam,
            1e-5,
        ),
    ]);
    for (case, args, one, bound) in cases {
        let split = lm_weights(&dir, &case.replace([' ', '×'], "-"), &args);
        let diff = max_abs_diff(one, &split);
        println!("transformer_lm {case}: max |Δ| = {diff:e}");
        assert!(diff <= bound, "{case}: max |Δ| = {diff:e} > {bound:e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The mean held-out loss `transformer_lm --eval 6` printed after 10 SGD steps with `args`.
fn evaluated(args: &[&str]) -> f64 {
    let out = std::process::Command::new(crate::examples::example("transformer_lm"))
        .args(["--steps", "10", "--eval", "6"])
        .args(SGD)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{args:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples = stdout.lines().find_map(|l| l.strip_prefix("eval_samples="));
    assert_eq!(samples, Some("6"), "{stdout}");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("eval_loss="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no eval_loss in {stdout}"))
}

#[test]
fn an_evaluation_over_context_ranks_gives_one_process_held_out_loss() {
    let one = evaluated(&[]);
    for args in [
        &["--processes", "2", "--cp-size", "2", "--cp-mode", "ring"][..],
        &["--processes", "4", "--cp-size", "4"][..],
        // Two replicas, each a context group evaluating half of the held-out sequences.
        &["--processes", "4", "--cp-size", "2", "--cp-mode", "ring"][..],
    ] {
        let split = evaluated(args);
        println!("eval loss {args:?}: {split} (one process {one})");
        assert!(
            (split - one).abs() <= 1e-5 * one.abs(),
            "{args:?}: {split} vs {one}"
        );
    }
}

#[test]
fn a_state_saved_on_context_ranks_resumes_on_one_process_and_on_another_cp_size() {
    let dir = scratch("cp-resume");
    let one = lm_weights(&dir, "one", &SGD);
    let state = dir.join("state");
    let state_arg = state.to_str().unwrap();
    let saved = [
        &SGD[..],
        &["--processes", "2", "--cp-size", "2", "--cp-mode", "ring"],
        &["--state", state_arg, "--save-at", "10"],
    ]
    .concat();
    lm_weights_after(&dir, "saved", 10, &saved);
    for (case, extra) in [
        ("one process", &[][..]),
        (
            "cp 4 ring",
            &["--processes", "4", "--cp-size", "4", "--cp-mode", "ring"][..],
        ),
    ] {
        let resumed = [&SGD[..], &["--state", state_arg, "--resume"], extra].concat();
        let weights = lm_weights(
            &dir,
            &format!("resumed-{}", case.replace(' ', "-")),
            &resumed,
        );
        let diff = max_abs_diff(&one, &weights);
        println!("cp 2 state resumed on {case}: max |Δ| = {diff:e}");
        assert!(diff <= 1e-6, "resumed on {case}: max |Δ| = {diff:e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// One forward and backward pass of a causal layer over `seq` positions on `cp` in-process ranks (ring mode,
/// `balanced` or contiguous): each rank's attention counters.
fn counted(cp: usize, seq: usize, balanced: bool) -> Vec<context_parallel::ContextStats> {
    Accelerator::builder()
        .cp_size(cp)
        .cp_comm_strategy(ContextAttention::Ring)
        .cp_load_balance(balanced)
        .launch(cp, move |acc| {
            let device = acc.device().clone();
            let config = TransformerEncoderConfig::new(8, 16, 2, 1)
                .with_norm_first(true)
                .with_dropout(0.0);
            let layer = acc.prepare_model(ParallelTransformerLayer::new(&config, &device))?;
            let split = acc.context_split(seq)?;
            let x = Tensor::<3>::ones([1, split.local_len(), 8], &device);
            context_parallel::reset_stats();
            let loss = layer.forward_causal(x).sum();
            acc.backward(loss, &layer)?;
            Ok(context_parallel::stats())
        })
        .unwrap()
}

#[test]
fn the_head_tail_split_balances_the_ring_s_scores_and_its_bytes_match_the_formula() {
    let (cp, seq, heads, width) = (4usize, 64usize, 2usize, 4usize);
    for balanced in [true, false] {
        let stats = counted(cp, seq, balanced);
        let scores: Vec<u64> = stats.iter().map(|s| s.score_elements).collect();
        let mean = scores.iter().sum::<u64>() as f64 / cp as f64;
        let spread = scores
            .iter()
            .map(|&s| (s as f64 - mean).abs() / mean)
            .fold(0.0, f64::max);
        let max_over_mean = *scores.iter().max().unwrap() as f64 / mean;
        println!(
            "cp {cp}, {seq} positions, {}: score elements per rank {scores:?}, max/mean {max_over_mean:.3}",
            if balanced { "head-tail" } else { "contiguous" }
        );
        for (rank, s) in stats.iter().enumerate() {
            // Counted as the ring ran: each chunk against the chunks at or before it.
            let split = ContextSplit::new(seq, rank, cp, balanced).unwrap();
            assert_eq!(
                s.score_elements,
                heads as u64 * split.causal_block_elements(rank)
            );
            assert_eq!(s.attention_calls, 1);
            // A key/value block of one rank: keys and values, f32. Forward: cp - 1 passes; backward: cp - 1
            // passes of the keys and values, cp of their gradients.
            let block = (2 * heads * (seq / cp) * width * 4) as u64;
            let formula = (cp as u64 - 1) * block + (cp as u64 - 1) * block + cp as u64 * block;
            assert_eq!(s.ring_bytes_sent, formula, "rank {rank}");
        }
        match balanced {
            true => assert!(spread <= 0.10, "head-tail spread {spread:.3}: {scores:?}"),
            // Contiguous: the last rank computes (4 cp − 1) / (2 cp) of the mean.
            false => assert!(
                max_over_mean > 1.5,
                "contiguous max/mean {max_over_mean:.3}"
            ),
        }
    }
}

fn backward_error(
    cp: usize,
    f: impl Fn(&Accelerator) -> burn_accelerate::Result<()> + Send + Sync,
) -> String {
    let errors = Accelerator::builder()
        .cp_size(cp)
        .launch(cp, |acc| Ok(f(&acc).map_err(|e| e.to_string()).err()))
        .unwrap();
    errors
        .into_iter()
        .next()
        .flatten()
        .expect("the backward pass fails")
}

#[test]
fn each_context_parallel_misuse_fails_before_the_first_step_saying_how_to_fix_it() {
    let config = TransformerEncoderConfig::new(8, 16, 2, 1)
        .with_norm_first(true)
        .with_dropout(0.0);
    // A sequence 2 × cp does not divide.
    let err = Accelerator::builder()
        .cp_size(2)
        .launch(2, |acc| acc.context_split(30).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 × cp_size = 4") && err.contains("multiple of 4"),
        "{err}"
    );
    // A mask of this rank's slice.
    let err = backward_error(2, |acc| {
        let layer = acc.prepare_model(ParallelTransformerLayer::new(&config, acc.device()))?;
        let x = Tensor::<3>::ones([1, 4, 8], acc.device());
        let mask = burn::nn::attention::generate_autoregressive_mask(1, 4, acc.device());
        acc.backward(layer.forward(x, None, Some(mask)).sum(), &layer)
    });
    assert!(
        err.contains("attention mask") && err.contains("forward_causal"),
        "{err}"
    );
    // Attention not routed through the building block: each rank would attend to its own slice only.
    let err = backward_error(2, |acc| {
        let model: Linear = acc.prepare_model(LinearConfig::new(8, 8).init(acc.device()))?;
        let y = model.forward(Tensor::<3>::ones([1, 4, 8], acc.device()));
        acc.backward(y.sum(), &model)
    });
    assert!(
        err.contains("ran no attention through `context_parallel::attention`"),
        "{err}"
    );
    // The building block outside a region.
    let err = backward_error(2, |acc| {
        let model: Linear = acc.prepare_model(LinearConfig::new(8, 8).init(acc.device()))?;
        let h = model
            .forward(Tensor::<3>::ones([1, 4, 8], acc.device()))
            .reshape([1, 1, 4, 8]);
        let y = context_parallel::attention(h.clone(), h.clone(), h, true);
        acc.backward(y.sum(), &model)
    });
    assert!(
        err.contains("outside a region") && err.contains("residual"),
        "{err}"
    );
    // Dropout: each rank's masks would not be one process's.
    let err = backward_error(2, |acc| {
        let config = config.clone().with_dropout(0.1);
        let layer = acc.prepare_model(ParallelTransformerLayer::new(&config, acc.device()))?;
        let x = Tensor::<3>::ones([1, 4, 8], acc.device());
        acc.backward(layer.forward_causal(x).sum(), &layer)
    });
    assert!(
        err.contains("dropout") && err.contains("dropout 0"),
        "{err}"
    );
    // The example says so before its first step too.
    let out = std::process::Command::new(crate::examples::example("transformer_lm"))
        .args([
            "--steps",
            "1",
            "--processes",
            "2",
            "--cp-size",
            "2",
            "--seq",
            "30",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("multiple of 4"),
        "{stderr}"
    );
}
