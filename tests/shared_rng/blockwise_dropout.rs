//! Dropout in the blocks of a block-wise pass on several ranks of one process. Burn's random generators are
//! process-wide, and each rank reseeds before every block so that the block's recompute draws its forward pass's
//! masks: the ranks must not reseed or draw in between each other's reseed and block. This binary holds no other
//! tests but those of the generator (taking turns), so that no other test's draws (a model's initial weights) run
//! beside it: `backward_blocks` orders the ranks' draws among themselves, not those of unrelated threads.

use crate::dropout;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};
use burn_accelerate::{Accelerator, Blocks, ShardingStrategy};
use dropout::dropout_block;

const WIDTH: usize = 8;
const BLOCKS: usize = 4;
const GLOBAL_BATCH: usize = 12;

#[derive(Module, Debug)]
struct Deep {
    input: Linear,
    layers: Vec<Linear>,
    head: Linear,
}

impl Blocks for Deep {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.layers
    }
}

fn model(device: &Device) -> Deep {
    Deep {
        input: LinearConfig::new(6, WIDTH).init(device),
        layers: (0..BLOCKS)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
            .collect(),
        head: LinearConfig::new(WIDTH, 1).init(device),
    }
}

fn batch(first: usize, rows: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (first * 6..(first + rows) * 6)
        .map(|i| ((i as f32) * 0.31).sin())
        .collect();
    let y: Vec<f32> = (first..first + rows)
        .map(|i| ((i as f32) * 0.17).cos())
        .collect();
    (
        Tensor::<1>::from_floats(x.as_slice(), device).reshape([rows, 6]),
        Tensor::<1>::from_floats(y.as_slice(), device).reshape([rows, 1]),
    )
}

/// Dropout inside the blocks with activation checkpointing on several in-process ranks: each block's recompute
/// draws the masks its forward pass drew, although the ranks share the process's random generator and each
/// reseeds it before every block (a pause between the reseed and the draw lets the other ranks run there). A
/// recompute with other masks would back-propagate through another function than the one the loss saw. No
/// block of any pass repeats another's masks (a rank's recompute leaves the shared generator where its forward
/// pass did: seeds drawn from it after that would repeat).
#[test]
fn dropout_masks_of_a_recompute_match_the_forward_pass_on_concurrent_ranks() {
    let _turn = crate::exclusive_rng();
    for (processes, sharding) in [
        (3, ShardingStrategy::NoShard),
        (3, ShardingStrategy::FullShard),
    ] {
        let masks = Accelerator::builder()
            .sharding(sharding)
            .activation_checkpointing(true)
            .launch(processes, |acc| {
                let device = acc.device().clone();
                let mut model = acc.prepare_model(model(&device))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let rows = GLOBAL_BATCH / processes;
                let mut drawn: Vec<Vec<Vec<f32>>> = Vec::new();
                for step in 0..5 {
                    let (x, y) = batch(
                        step * GLOBAL_BATCH + acc.process_index() * rows,
                        rows,
                        &device,
                    );
                    let step_masks = std::sync::Mutex::new(Vec::new());
                    acc.backward_blocks(
                        &model,
                        |m| m.input.forward(x.clone()).tanh(),
                        |layer, h| dropout_block(layer, h, &step_masks),
                        |m, h| (m.head.forward(h) - y.clone()).powi_scalar(2).mean(),
                    )?;
                    model = optimizer.try_step(model)?;
                    drawn.push(step_masks.into_inner().unwrap());
                }
                Ok(drawn)
            })
            .unwrap_or_else(|e| panic!("{sharding}: {e}"));
        for (rank, steps) in masks.iter().enumerate() {
            // Every block of every pass draws masks of its own: no pass repeats another's.
            let forward: Vec<&Vec<f32>> = steps.iter().flat_map(|calls| &calls[..BLOCKS]).collect();
            for (a, mask) in forward.iter().enumerate() {
                assert!(
                    forward[a + 1..].iter().all(|other| other != mask),
                    "{sharding}, rank {rank}: a forward pass drew the masks of another block or step"
                );
            }
            for (step, calls) in steps.iter().enumerate() {
                // Forward: blocks 0..B; recompute: blocks B-1..0.
                assert_eq!(
                    calls.len(),
                    2 * BLOCKS,
                    "{sharding}: every block recomputed"
                );
                for block in 0..BLOCKS {
                    assert_eq!(
                        calls[block],
                        calls[2 * BLOCKS - 1 - block],
                        "{sharding}, rank {rank}, step {step}: block {block}'s recompute drew other dropout masks"
                    );
                }
            }
        }
    }
}
