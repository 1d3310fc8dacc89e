//! More than one model, and parameters that come and go, under every strategy (`examples/support/scenarios.rs`):
//! two models trained in alternation with gradient accumulation (a GAN's generator and discriminator: the second
//! model's loss runs through the first), a layer frozen at `prepare_model` and unfrozen later beside a frozen
//! teacher (a distillation), and data-dependent routing that leaves some parameters without a gradient on some
//! ranks, or a rank without any. Each run on 1–4 in-process ranks, every strategy (`NO_SHARD`, `SHARD_GRAD_OP`,
//! `FULL_SHARD` whole and block by block, `HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`), is compared with the loop a Burn
//! user writes by hand on one process, which sees the whole batch; and an error of one rank's own ends every rank
//! at once, naming it. The same under `mpirun` is in `tests/mpi/parity_mpi.rs`.

use crate::scenarios;

use burn_accelerate::{Accelerator, AcceleratorBuilder, ShardingStrategy};
use scenarios::{Scenario, initial, max_abs_diff};

/// How a run is distributed: a name for messages, the ranks, and the builder.
struct Setup {
    name: String,
    ranks: usize,
    builder: AcceleratorBuilder,
    /// Whether the passes run block by block (`backward_blocks`).
    blockwise: bool,
}

/// Every strategy on 1–4 ranks, whole and block by block.
fn setups() -> Vec<Setup> {
    let mut all = Vec::new();
    let builder = || Accelerator::builder().collective_timeout(std::time::Duration::from_secs(60));
    for ranks in [1, 2, 3] {
        all.push(Setup {
            name: format!("NO_SHARD P={ranks}"),
            ranks,
            builder: builder(),
            blockwise: false,
        });
    }
    all.push(Setup {
        name: "NO_SHARD P=2, activation checkpointing".into(),
        ranks: 2,
        builder: builder().activation_checkpointing(true),
        blockwise: true,
    });
    for ranks in [2, 3] {
        for mode in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
            all.push(Setup {
                name: format!("{mode} P={ranks}"),
                ranks,
                builder: builder().sharding(mode),
                blockwise: false,
            });
        }
        all.push(Setup {
            name: format!("FULL_SHARD block-wise P={ranks}"),
            ranks,
            builder: builder().sharding(ShardingStrategy::FullShard),
            blockwise: true,
        });
    }
    for mode in [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        all.push(Setup {
            name: format!("{mode} 2x2"),
            ranks: 4,
            builder: builder().sharding(mode).dp_shard_size(2),
            blockwise: false,
        });
    }
    all
}

/// Every scenario that trains, under every setup, against the plain Burn loop.
fn trains_as_a_plain_burn_loop(scenario: Scenario) {
    let start = initial();
    for Setup {
        name,
        ranks,
        builder,
        blockwise,
    } in setups()
    {
        let expected = scenario.reference(&start, ranks).unwrap();
        let out = builder
            .gradient_accumulation_steps(scenario.accumulation())
            .launch(ranks, |acc| scenario.train(&acc, &start, blockwise))
            .unwrap_or_else(|e| panic!("{scenario:?} {name}: {e}"));
        for (rank, got) in out.iter().enumerate() {
            for (model, (got, want)) in got.iter().zip(&expected).enumerate() {
                let diff = max_abs_diff(got, want);
                assert!(
                    diff <= 1e-5,
                    "{scenario:?} {name}, rank {rank}, model {model}: max |Δ| against the plain Burn loop = {diff:e}"
                );
            }
        }
    }
}

/// Two models, `a` and `b`, trained in alternation with 2 micro-batches per step and SGD: each model's gradients
/// must be the mean over its own 2 micro-batches, whatever the other model does in between (Accelerate divides
/// every loss by the accumulation steps).
#[test]
fn two_models_with_accumulation_train_as_a_plain_burn_loop() {
    trains_as_a_plain_burn_loop(Scenario::TwoModels);
}

/// A head frozen at `prepare_model` and unfrozen after two steps trains from then on, with Adam, as in a plain Burn
/// loop: a sharded strategy gives it an owner without moving any other parameter (and its optimizer state) to
/// another rank. The frozen teacher is never changed.
#[test]
fn a_layer_frozen_at_prepare_and_unfrozen_later_trains() {
    trains_as_a_plain_burn_loop(Scenario::Unfreeze);
}

/// Data-dependent routing (DDP's `find_unused_parameters` case): a rank may hold no gradient for a head, for every
/// block, or for anything. Every rank still takes part in every reduction, and the weights are those of a plain
/// Burn loop whose loss is the mean of the ranks' losses (with two or more ranks both heads and the blocks are used
/// somewhere in every step, so Adam steps every parameter in both loops).
#[test]
fn parameters_unused_on_some_ranks_train_as_a_plain_burn_loop() {
    trains_as_a_plain_burn_loop(Scenario::Routing);
}

/// An error returned by one rank's own code ends every rank at once: each peer's collective fails with an error
/// naming that rank and its error, not after the collective timeout (60 s here), and `launch` returns the failing
/// rank's own error.
#[test]
fn an_error_on_one_rank_ends_every_rank_naming_it() {
    let start = initial();
    for Setup {
        name,
        ranks,
        builder,
        blockwise,
    } in setups().into_iter().filter(|s| s.ranks > 1)
    {
        let own = scenarios::own_error();
        let peers = std::sync::Mutex::new(Vec::new());
        let began = std::time::Instant::now();
        let result = builder.launch(ranks, |acc| {
            let rank = acc.process_index();
            scenarios::rank_error(&acc, &start, blockwise).inspect_err(|error| {
                if rank != scenarios::FAILING_RANK {
                    peers.lock().unwrap().push((rank, error.to_string()));
                }
            })
        });
        let elapsed = began.elapsed();
        let error = result.expect_err(&name).to_string();
        assert!(error.contains(&own), "{name}: launch returned {error}");
        let peers = peers.into_inner().unwrap();
        assert_eq!(
            peers.len(),
            ranks - 1,
            "{name}: every peer stopped with an error: {peers:?}"
        );
        let bad = scenarios::FAILING_RANK;
        for (rank, message) in &peers {
            assert!(
                message.contains(&format!("rank {bad}")) && message.contains(&own),
                "{name}, rank {rank}: the error names neither the failing rank nor its error: {message}"
            );
            assert!(
                !message.contains("timed out") && !message.contains("timeout"),
                "{name}, rank {rank}: a timeout instead of the failure: {message}"
            );
            // The flight recorder: the peer's last collective calls, the one that could not complete marked.
            assert!(
                message.contains(&format!("the last collectives of rank {rank}"))
                    && message.contains("(did not complete)"),
                "{name}, rank {rank}: no record of the last collectives: {message}"
            );
        }
        assert!(
            elapsed < std::time::Duration::from_secs(30),
            "{name}: the ranks waited {elapsed:?} (the collective timeout is 60 s)"
        );
    }
}
