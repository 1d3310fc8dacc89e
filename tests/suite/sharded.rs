//! Sharded training (`SHARD_GRAD_OP`, `FULL_SHARD`) on 2, 3, 4, 6 and 8 in-process ranks against the unsharded run
//! of the same ranks, value by value, in every case of the parity harness (accumulation, clipping, bf16, fp16 and,
//! up to 4 ranks, uneven batches included), and a sharded save / resume bit for bit (on another number of ranks:
//! `tests/suite/resume_any_ranks.rs`). The same under `mpirun`, with a SIGKILL in
//! the middle, is in `tests/mpi/parity_mpi.rs`.

use crate::examples;
use crate::parity;

use parity::{CASES, compare_sharded, copy_dir, report, run_local, scratch, weights};

/// The harness's cases on `p` ranks, and the flags that ask for them: `uneven` leaves ranks without a last batch
/// beyond 4 ranks, for `NO_SHARD` too, so it is left out there.
fn cases_on(p: usize) -> (Vec<&'static str>, Vec<&'static str>) {
    let cases: Vec<&str> = CASES
        .iter()
        .map(|(case, _)| *case)
        .filter(|case| p <= 4 || *case != "uneven")
        .collect();
    let args = cases.iter().flat_map(|c| ["--case", *c]).collect();
    (cases, args)
}

#[test]
fn sharded_ranks_train_the_weights_of_unsharded_ranks_in_every_case() {
    let dir = scratch("sharded");
    for p in [2, 3, 4, 6, 8] {
        let procs = p.to_string();
        let (cases, case_args) = cases_on(p);
        let unsharded = dir.join(format!("p{p}"));
        run_local(
            &unsharded,
            &[&["--processes", &procs][..], &case_args].concat(),
        );
        // The default bucket sends the harness's parameters in grouped rounds; a 4 KiB one sends most alone
        // (reduced into the owner's buffer and broadcast from it).
        for (sharding, bucket) in [
            ("SHARD_GRAD_OP", None),
            ("FULL_SHARD", None),
            ("SHARD_GRAD_OP", Some("0.004")),
            ("FULL_SHARD", Some("0.004")),
        ] {
            let sharded = dir.join(format!("p{p}-{sharding}-{}", bucket.unwrap_or("default")));
            let mut args = vec!["--processes", &procs, "--sharding", sharding];
            if let Some(mib) = bucket {
                args.extend(["--bucket-size-mb", mib]);
            }
            args.extend(&case_args);
            run_local(&sharded, &args);
            for &case in &cases {
                let diff = compare_sharded(&unsharded, &sharded, p, case);
                println!(
                    "in-process P={p} {sharding} bucket {bucket:?} {case}: max |Δ| vs NO_SHARD = {diff:e}"
                );
                assert_eq!(report(&sharded, case, 0)["sharding"], sharding);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The hybrid strategies (sharded within groups of `--dp-shard-size` ranks, replicated across them) on 2×2, 3×2,
/// 2×3, 4×2 and 2×4 meshes (replicas × shards) train the weights of `NO_SHARD` on the same ranks: the sums are
/// taken in another order (within the group, then across), measured ≤ 9e-8, bound 1e-6. Each rank holds less
/// optimizer state than an unsharded one. (`uneven` leaves ranks without a last batch beyond 4 ranks, for
/// `NO_SHARD` too, so it is left out there.)
#[test]
fn hybrid_strategies_train_the_weights_of_unsharded_ranks() {
    let dir = scratch("hybrid");
    for (p, shard) in [(4, 2), (6, 2), (6, 3), (8, 4), (8, 2)] {
        let procs = p.to_string();
        let (cases, case_args) = cases_on(p);
        let unsharded = dir.join(format!("p{p}"));
        run_local(
            &unsharded,
            &[&["--processes", &procs][..], &case_args].concat(),
        );
        for mode in ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] {
            let hybrid = dir.join(format!("p{p}-s{shard}-{mode}"));
            let size = shard.to_string();
            let args = [
                "--processes",
                &procs,
                "--sharding",
                mode,
                "--dp-shard-size",
                &size,
            ];
            run_local(&hybrid, &[&args[..], &case_args].concat());
            for case in &cases {
                let diff = parity::compare_case(&unsharded, &hybrid, p, case, 1e-6);
                println!(
                    "P={p}, {} x {shard} {mode} {case}: max |Δ| vs NO_SHARD = {diff:e}",
                    p / shard
                );
                let bytes = |dir: &std::path::Path, rank: usize| {
                    report(dir, case, rank)["optimizer_state_bytes"]
                        .as_u64()
                        .unwrap()
                };
                for rank in 0..p {
                    assert!(
                        bytes(&hybrid, rank) < bytes(&unsharded, 0),
                        "{mode} P={p} {case}, rank {rank}: as much optimizer state as unsharded"
                    );
                }
                assert_eq!(report(&hybrid, case, 0)["sharding"], mode);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_sharded_state_saved_mid_run_resumes_bit_for_bit() {
    let dir = scratch("sharded-resume");
    for sharding in ["SHARD_GRAD_OP", "FULL_SHARD"] {
        let whole = dir.join(format!("whole-{sharding}"));
        let args = [
            "--processes",
            "3",
            "--sharding",
            sharding,
            "--case",
            "resume",
        ];
        // Saves after step 10 and trains on to step 21.
        run_local(&whole, &args);
        let state = whole.join("resume-state");
        for rank in 0..3 {
            assert!(
                state.join(format!("optimizer_rank{rank}.bpk")).is_file(),
                "{sharding}"
            );
            let model = state.join(format!("model_rank{rank}.bpk"));
            assert_eq!(
                model.is_file(),
                sharding == "FULL_SHARD",
                "{sharding}: {}",
                model.display()
            );
        }
        // Resumed from that state, in a new process.
        let resumed = dir.join(format!("resumed-{sharding}"));
        std::fs::create_dir_all(&resumed).unwrap();
        copy_dir(&state, &resumed.join("resume-state"));
        run_local(&resumed, &[&args[..], &["--resume"]].concat());
        for rank in 0..3 {
            let file = format!("rank{rank}.safetensors");
            assert_eq!(
                weights(&resumed.join("resume").join(&file)),
                weights(&whole.join("resume").join(&file)),
                "{sharding}, rank {rank}: resumed weights differ from the uninterrupted run"
            );
            let counted = report(&resumed, "resume", rank);
            assert_eq!(counted["resumed_at"], 10, "{sharding}, rank {rank}");
            assert_eq!(
                counted["steps"], 11,
                "{sharding}, rank {rank}: steps 11 to 21"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

mod checkpoints {
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::AdamConfig;
    use burn::tensor::Tensor;
    use burn_accelerate::checkpoint::{LoadOptions, WeightLayout, merge_weights};
    use burn_accelerate::{Accelerator, ShardingStrategy, StateToSave};

    #[derive(Module, Debug)]
    struct Net {
        first: Linear,
        second: Linear,
        third: Linear,
    }

    fn net(device: &burn::tensor::Device) -> Net {
        Net {
            first: LinearConfig::new(6, 16).init(device),
            second: LinearConfig::new(16, 16).init(device),
            third: LinearConfig::new(16, 2).init(device),
        }
    }

    fn values(net: &Net) -> Vec<Vec<f32>> {
        let flat = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        let mut out = Vec::new();
        for layer in [&net.first, &net.second, &net.third] {
            out.push(flat(layer.weight.val()));
            if let Some(bias) = &layer.bias {
                out.push(bias.val().into_data().try_to_vec::<f32>().unwrap());
            }
        }
        out
    }

    /// A FULL_SHARD run on 3 ranks saves its state (one model record per rank, each holding that rank's
    /// parameters) and its model (gathered): `merge_weights` and the `merge-weights` command rebuild the whole
    /// model from the state, and both equal the gathered model.
    #[test]
    fn merge_weights_rebuilds_the_whole_model_from_a_full_shard_state() {
        let dir = super::parity::scratch("merge");
        let (state, saved) = (dir.join("state"), dir.join("saved"));
        let (s, m) = (state.clone(), saved.clone());
        let whole = Accelerator::builder()
            .sharding(ShardingStrategy::FullShard)
            .launch(3, move |acc| {
                acc.set_seed(3, false);
                let device = acc.device().clone();
                let mut model = acc.prepare_model(net(&device))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                for step in 0..3 {
                    let x = Tensor::<2>::ones([4, 6], &device).mul_scalar(step as f32 + 1.0);
                    let whole = acc.unshard(&model)?;
                    let y = whole
                        .third
                        .forward(whole.second.forward(whole.first.forward(x)));
                    acc.backward(y.powi_scalar(2).mean(), &whole)?;
                    model = optimizer.try_step(model)?;
                }
                let parts = StateToSave::new().model(&model)?.optimizer(&optimizer)?;
                acc.save_state(Some(&s), &parts)?;
                acc.save_model_with(
                    &model,
                    &m,
                    &burn_accelerate::checkpoint::SaveOptions {
                        layout: WeightLayout::Burn,
                        ..Default::default()
                    },
                )?;
                Ok(values(&acc.unshard(&model)?))
            })
            .unwrap();
        assert_eq!(whole[0], whole[1]);
        assert_eq!(whole[0], whole[2]);
        for rank in 0..3 {
            assert!(state.join(format!("model_rank{rank}.bpk")).is_file());
        }
        let load = |file: &std::path::Path| {
            let acc = Accelerator::builder().cpu(true).build().unwrap();
            let fresh = net(acc.device());
            let options = LoadOptions {
                strict: true,
                ..Default::default()
            };
            let (loaded, _) = acc.load_checkpoint_in_model(fresh, file, &options).unwrap();
            values(&loaded)
        };
        let merged = dir.join("merged");
        let file = merge_weights(&state, &merged, 0).unwrap();
        assert_eq!(load(&file), whole[0], "merge_weights");
        assert_eq!(load(&saved), whole[0], "save_model under FULL_SHARD");
        let cli = dir.join("cli");
        let out = std::process::Command::new(super::examples::cli())
            .arg("merge-weights")
            .arg(&state)
            .arg(&cli)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            load(&cli.join("model.safetensors")),
            whole[0],
            "merge-weights command"
        );
        // Asked for a model the state does not hold: the error says how many it holds.
        let err = merge_weights(&state, &merged, 1).unwrap_err().to_string();
        assert!(err.contains("holds 1 model(s)"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Fewer parameters than ranks: one `Linear` (a weight and a bias) on 3 and 4 in-process ranks, so that some ranks
/// own no parameter. Every strategy trains the weights `NO_SHARD` trains (bit for bit: the same reductions).
mod fewer_parameters_than_ranks {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::AdamConfig;
    use burn::tensor::Tensor;
    use burn_accelerate::{Accelerator, ReduceOp, ShardingStrategy};

    /// The model's weight and bias after 6 Adam steps of `sharding` on `ranks` ranks (global batch 12).
    fn train(sharding: ShardingStrategy, ranks: usize, initial: &Linear) -> Vec<f32> {
        let results = Accelerator::builder()
            .sharding(sharding)
            .launch(ranks, |acc| {
                let (rank, rows) = (acc.process_index(), 12 / ranks);
                let device = acc.device().clone();
                let mut model = acc.prepare_model(initial.clone())?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                for step in 0..6 {
                    let x: Vec<f32> = (0..rows * 3)
                        .map(|i| ((step * 31 + rank * rows * 3 + i) % 17) as f32 * 0.1 - 0.8)
                        .collect();
                    let x = Tensor::<1>::from_floats(x.as_slice(), &device).reshape([rows, 3]);
                    let y = x.clone().sum_dim(1).mul_scalar(0.5);
                    let whole = acc.unshard(&model)?;
                    let loss = (whole.forward(x) - y).powi_scalar(2).mean();
                    acc.reduce(loss.clone().detach(), ReduceOp::Mean)?;
                    acc.backward(loss, &whole)?;
                    drop(whole);
                    model = optimizer.try_step(model)?;
                }
                let whole = acc.unshard(&model)?;
                let mut values = whole.weight.val().into_data().try_to_vec::<f32>().unwrap();
                values.extend(
                    whole
                        .bias
                        .unwrap()
                        .val()
                        .into_data()
                        .try_to_vec::<f32>()
                        .unwrap(),
                );
                Ok(values)
            })
            .unwrap_or_else(|e| panic!("{sharding} on {ranks} ranks: {e}"));
        assert_eq!(results.len(), ranks);
        for other in &results[1..] {
            assert_eq!(
                other, &results[0],
                "{sharding} on {ranks} ranks: ranks differ"
            );
        }
        results.into_iter().next().unwrap()
    }

    #[test]
    fn every_strategy_trains_the_unsharded_weights() {
        let device = burn_accelerate::backend::default_device().unwrap();
        device.seed(5);
        let initial: Linear = LinearConfig::new(3, 1).init(&device);
        for ranks in [3, 4, 6, 8] {
            let unsharded = train(ShardingStrategy::NoShard, ranks, &initial);
            assert_eq!(unsharded.len(), 4);
            for sharding in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
                assert_eq!(
                    train(sharding, ranks, &initial),
                    unsharded,
                    "{sharding} on {ranks} ranks"
                );
            }
        }
    }
}

/// Debug mode checks a sharded step's collectives as it checks every other: a rank that calls something else in
/// the middle of a `FULL_SHARD` or `HYBRID_SHARD` step (here a `reduce` of its own, where the others reduce-scatter
/// gradients) is an error on every rank naming each rank's call, instead of a hang or wrong data.
#[test]
fn debug_mode_names_every_ranks_call_inside_a_sharded_and_a_hybrid_step() {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::AdamConfig;
    use burn::tensor::Tensor;
    use burn_accelerate::{Accelerator, ReduceOp, ShardingStrategy};
    for (sharding, ranks) in [
        (ShardingStrategy::FullShard, 3),
        (ShardingStrategy::HybridShard, 4),
    ] {
        let device = burn_accelerate::backend::default_device().unwrap();
        let initial: Linear = LinearConfig::new(3, 2).init(&device);
        let result = Accelerator::builder()
            .sharding(sharding)
            .dp_shard_size(2)
            .debug(true)
            // A failure of this test must not wait for the default five minutes.
            .collective_timeout(std::time::Duration::from_secs(20))
            .launch(ranks, |acc| {
                let model = acc.prepare_model(initial.clone())?;
                let _optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let x = Tensor::<2>::ones([4, 3], acc.device());
                let whole = acc.unshard(&model)?;
                let loss = whole.forward(x).sum();
                if acc.process_index() == 1 {
                    // The odd one out: a collective of its own where the others sync gradients.
                    acc.reduce(loss.clone().detach(), ReduceOp::Sum)?;
                }
                acc.backward(loss, &whole)?;
                Ok(())
            });
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains("ranks called different collectives")
                && err.contains("rank 0: ")
                && err.contains("rank 1: ")
                && err.contains("sharded gradient")
                && err.contains("::reduce"),
            "{sharding}: {err}"
        );
        println!("{sharding}: {err}");
    }
}

/// Block-wise `FULL_SHARD` (`--blocks`: the harness trains through `backward_blocks`, its input layer the one
/// block) on 2, 3 and 4 in-process ranks trains the weights of `NO_SHARD` with the plain `backward` in every case
/// (accumulation, both clippings, bf16, fp16, uneven batches), and `NO_SHARD` with activation checkpointing the
/// same: block-wise bit for bit but with accumulation (each micro-batch is reduced as it ends, so the sums are
/// taken in another order) and the clipped norm (combined across ranks), both within 1e-6, each rank holding
/// less than an unsharded rank's optimizer state and all of them together about as much; checkpointing alone bit
/// for bit.
#[test]
fn block_wise_passes_train_the_weights_of_the_plain_backward_in_every_case() {
    let dir = scratch("blockwise");
    for p in [2, 3, 4] {
        let procs = p.to_string();
        let unsharded = dir.join(format!("p{p}"));
        run_local(&unsharded, &["--processes", &procs]);
        for (name, args) in [
            (
                "FULL_SHARD-blocks",
                &["--sharding", "FULL_SHARD", "--blocks"][..],
            ),
            (
                "NO_SHARD-checkpointing",
                &["--sharding", "NO_SHARD", "--blocks", "--checkpointing"][..],
            ),
        ] {
            let blockwise = dir.join(format!("p{p}-{name}"));
            run_local(&blockwise, &[&["--processes", &procs][..], args].concat());
            for (case, _) in CASES {
                // Block-wise FULL_SHARD: the same bits as unsharded but where the sums are taken in another order
                // (accumulation, the clipped norm), and each rank holds only its share of the optimizer state.
                let diff = match name.starts_with("FULL_SHARD") {
                    true => parity::compare_sharded_within(
                        &unsharded,
                        &blockwise,
                        p,
                        case,
                        parity::blockwise_bound(case),
                    ),
                    false => parity::compare_case(&unsharded, &blockwise, p, case, 0.0),
                };
                println!("in-process P={p} {name} {case}: max |Δ| vs NO_SHARD = {diff:e}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
