//! Dropout in the blocks of a pipeline with activation checkpointing, on in-process stages. Burn's random
//! generators are process-wide, and each stage reseeds before every block of every micro-batch so that the block's
//! recompute draws its forward pass's masks: the stages must not reseed or draw in between each other's reseed and
//! block. This binary holds no other tests but those of the generator (taking turns), so that no other test's draws
//! (a model's initial weights) run beside it.

use crate::dropout;

use crate::deep;

use burn::optim::AdamConfig;
use burn_accelerate::{Accelerator, PipelineSchedule, ShardingStrategy};
use deep::{batch, model};
use dropout::dropout_block;

const BLOCKS: usize = 4;
/// Rows per step: micro-batches of 4 rows or more on every replica, so that two masks of 32 values or more never
/// come out equal by chance.
const BATCH: usize = 32;
const MICRO_BATCHES: usize = 4;
const STEPS: usize = 3;

/// Each block's recompute draws the masks its forward pass drew, on every stage and micro-batch, under both
/// schedules and with 2 data-parallel replicas of each stage: every mask a stage drew comes up exactly twice
/// (its forward pass and its recompute). A recompute with other masks would back-propagate through another
/// function than the one the loss saw.
#[test]
fn dropout_masks_of_a_pipelined_recompute_match_the_forward_pass() {
    let _turn = crate::exclusive_rng();
    for (replicas, schedule, sharding) in [
        (1, PipelineSchedule::OneFOneB, ShardingStrategy::NoShard),
        (1, PipelineSchedule::GPipe, ShardingStrategy::NoShard),
        (2, PipelineSchedule::OneFOneB, ShardingStrategy::FullShard),
    ] {
        let drawn = Accelerator::builder()
            .pp_size(2)
            .pp_microbatches(MICRO_BATCHES)
            .pp_schedule(schedule)
            .sharding(sharding)
            .activation_checkpointing(true)
            .launch(2 * replicas, |acc| {
                let device = acc.device().clone();
                let mut model = acc.prepare_blocks(model(BLOCKS, &device))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let rows = BATCH / replicas;
                let masks = std::sync::Mutex::new(Vec::new());
                for step in 0..STEPS {
                    let (x, y) = batch(
                        step * BATCH + acc.pipeline_layout().replica * rows,
                        rows,
                        &device,
                    );
                    acc.backward_batch(
                        &model,
                        (x, y),
                        |m, (x, _)| m.input.forward(x.clone()).tanh(),
                        |layer, h| dropout_block(layer, h, &masks),
                        |m, h, (_, y)| (m.head.forward(h) - y.clone()).powi_scalar(2).mean(),
                    )?;
                    model = optimizer.try_step(model)?;
                }
                Ok(masks.into_inner().unwrap())
            })
            .unwrap_or_else(|e| panic!("{schedule:?}, {sharding}: {e}"));
        for (rank, masks) in drawn.iter().enumerate() {
            let case = format!("{schedule:?}, {sharding}, rank {rank}");
            // Each stage runs half the blocks: forward and recompute of each, for every micro-batch and step.
            assert_eq!(
                masks.len(),
                2 * (BLOCKS / 2) * MICRO_BATCHES * STEPS,
                "{case}"
            );
            for mask in masks {
                let copies = masks.iter().filter(|m| *m == mask).count();
                assert_eq!(
                    copies, 2,
                    "{case}: a mask drawn {copies} time(s): a recompute drew other dropout masks than its forward pass"
                );
            }
        }
    }
}
