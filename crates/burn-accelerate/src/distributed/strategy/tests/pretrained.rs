//! Pretrained weights into a sharded model: each rank reads only its dim-0 slices of the file.

use super::{Net, held_elements, net, weights};
use crate::accelerator::AcceleratorBuilder;
use crate::checkpoint::{LoadOptions, SaveOptions, WeightLayout};
use crate::config::ShardingStrategy;

/// A model of other values than `net`'s, to load into.
fn other(device: &burn::tensor::Device) -> Net {
    Net {
        a: super::linear(4, 8, 2.9, device),
        b: super::linear(8, 2, -0.7, device),
    }
}

/// `net`'s weights saved in PyTorch's layout (`[out, in]`: a Burn slice is a band of columns there) and in
/// Burn's (as a sharded checkpoint with its index) load into `FULL_SHARD` on 2, 3 and 5 ranks (5: more ranks than `b`'s bias has rows, so some hold
/// padding only) as the slices `prepare_model` cut: each rank holds its share, and the whole model gathered is
/// the saved one, bit for bit; `SHARD_GRAD_OP`, whose ranks hold whole parameters between steps, loads whole.
#[test]
fn pretrained_weights_load_into_each_ranks_slices() {
    let device = crate::backend::default_device().unwrap();
    let saved = net(&device);
    let whole_elements = held_elements(&saved);
    let dir = std::env::temp_dir().join(format!("pretrained-slices-{}", std::process::id()));
    for layout in [WeightLayout::PyTorch, WeightLayout::Burn] {
        let folder = dir.join(layout.tag());
        // Burn's layout written as a Hugging Face sharded checkpoint: one small file per tensor and the index.
        let options = SaveOptions {
            layout,
            max_shard_size: if layout == WeightLayout::Burn {
                "100B"
            } else {
                "10GB"
            }
            .into(),
            ..SaveOptions::default()
        };
        crate::Accelerator::new()
            .unwrap()
            .save_model_with(&saved, &folder, &options)
            .unwrap();
        if layout == WeightLayout::Burn {
            assert!(
                folder
                    .join(crate::checkpoint::safetensors::INDEX_FILE)
                    .exists()
            );
        }
        for (ranks, mode) in [
            (2, ShardingStrategy::FullShard),
            (3, ShardingStrategy::FullShard),
            (5, ShardingStrategy::FullShard),
            (3, ShardingStrategy::ShardGradOp),
        ] {
            let folder = folder.clone();
            let loaded = AcceleratorBuilder::default()
                .sharding(mode)
                .launch(ranks, move |acc| {
                    let device = acc.device().clone();
                    let model = acc.prepare_model(other(&device))?;
                    let (model, report) = acc.load_checkpoint_in_model(
                        model,
                        &folder,
                        &LoadOptions {
                            strict: true,
                            ..LoadOptions::default()
                        },
                    )?;
                    assert!(report.missing.is_empty() && report.unexpected.is_empty());
                    let held = held_elements(&model);
                    Ok((held, weights(&acc.unshard(&model)?)))
                })
                .unwrap();
            for (rank, (held, values)) in loaded.iter().enumerate() {
                assert_eq!(
                    values,
                    &weights(&saved),
                    "{layout:?} {mode} on {ranks} ranks, rank {rank}: the saved weights"
                );
                if mode == ShardingStrategy::FullShard {
                    // Each parameter's ⌈rows / P⌉ rows (zero rows padding the last slices).
                    let rows = |r: usize, cols: usize| r.div_ceil(ranks) * cols;
                    let share = rows(4, 8) + rows(8, 1) + rows(8, 2) + rows(2, 1);
                    assert_eq!(
                        *held, share,
                        "{layout:?} on {ranks} ranks: rank {rank}'s slices"
                    );
                } else {
                    assert_eq!(*held, whole_elements, "{mode}: whole between steps");
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A sharded load that one rank cannot do (its file is not there) fails on every rank, naming the file, rather
/// than leaving the others waiting in the next collective.
#[test]
fn a_sharded_load_that_fails_on_one_rank_fails_on_every_rank() {
    let dir = std::env::temp_dir().join(format!("pretrained-missing-{}", std::process::id()));
    let device = crate::backend::default_device().unwrap();
    crate::Accelerator::new()
        .unwrap()
        .save_model_with(&net(&device), &dir, &SaveOptions::default())
        .unwrap();
    let present = dir.clone();
    let outcomes = AcceleratorBuilder::default()
        .sharding(ShardingStrategy::FullShard)
        .launch(2, move |acc| {
            let device = acc.device().clone();
            let model = acc.prepare_model(other(&device))?;
            let path = if acc.process_index() == 1 {
                present.join("nowhere")
            } else {
                present.clone()
            };
            Ok(acc
                .load_checkpoint_in_model(model, &path, &LoadOptions::default())
                .map(|_| ())
                .map_err(|e| e.to_string()))
        })
        .unwrap();
    for (rank, outcome) in outcomes.iter().enumerate() {
        let message = outcome.as_ref().expect_err("every rank fails");
        assert!(message.contains("nowhere"), "rank {rank}: {message}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
