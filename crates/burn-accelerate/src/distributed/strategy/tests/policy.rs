//! FSDP2's mixed-precision policy: blocks gathered in bf16, gradients reduced in f32 or bf16.

use std::sync::Mutex;

use burn::optim::AdamConfig;
use burn::tensor::{DType, Device, Tensor};

use super::prefetch::Deep;
use super::*;
use crate::config::ShardDtype;
use crate::precision::MixedPrecision;

/// Each rank's whole weights after 5 block-wise bf16 steps on 2 ranks under `FULL_SHARD` with the policy `builder`
/// sets, and the dtypes the blocks' parameters were gathered in.
fn train(builder: AcceleratorBuilder) -> Vec<(Vec<f32>, Vec<DType>)> {
    builder
        .sharding(ShardingStrategy::FullShard)
        .mixed_precision(MixedPrecision::Bf16)
        .launch(2, |acc: Accelerator| {
            let device: Device = acc.device().clone();
            let deep = Deep {
                blocks: (0..4)
                    .map(|i| super::linear(6, 6, 0.3 * i as f32, &device))
                    .collect(),
                head: super::linear(6, 2, 0.9, &device),
            };
            let mut model = acc.prepare_model(deep)?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let seen = Mutex::new(Vec::new());
            let rank = acc.process_index() as f32;
            for step in 0..5 {
                let values: Vec<f32> = (0..18)
                    .map(|i| (i as f32 * 0.17 + rank + step as f32 * 0.3).sin())
                    .collect();
                let x = Tensor::<1>::from_floats(values.as_slice(), &device).reshape([3, 6]);
                acc.backward_blocks(
                    &model,
                    |_| x.clone(),
                    |layer, h| {
                        seen.lock().unwrap().push(layer.weight.val().dtype());
                        acc.autocast(layer, h, |l, h| l.forward(h).tanh())
                    },
                    |m, h| {
                        acc.autocast(&m.head, h, |head, h| head.forward(h))
                            .powi_scalar(2)
                            .mean()
                    },
                )?;
                model = optimizer.try_step(model)?;
            }
            let whole = acc.unshard(&model)?;
            let weights = whole
                .blocks
                .iter()
                .chain([&whole.head])
                .flat_map(|l| {
                    l.weight
                        .val()
                        .into_data()
                        .convert::<f32>()
                        .try_to_vec::<f32>()
                        .unwrap()
                })
                .collect();
            let mut dtypes = seen.into_inner().unwrap();
            dtypes.dedup();
            Ok((weights, dtypes))
        })
        .unwrap()
}

/// Gathering the blocks in bf16 (`fsdp_param_dtype`) under bf16 mixed precision trains the weights of gathering them
/// in f32 bit for bit (the forward casts to the same values; the bf16 gradients reduced in f32 are those the casts
/// gave back), with the blocks computing on bf16 parameters; reducing in bf16 as well (`fsdp_reduce_dtype`) rounds
/// the gradients, close to the same weights.
#[test]
fn blocks_gathered_in_bf16_train_the_weights_of_blocks_gathered_in_f32() {
    let plain = train(AcceleratorBuilder::default());
    let gathered = train(AcceleratorBuilder::default().fsdp_param_dtype(ShardDtype::Bf16));
    let reduced = train(
        AcceleratorBuilder::default()
            .fsdp_param_dtype(ShardDtype::Bf16)
            .fsdp_reduce_dtype(ShardDtype::Bf16),
    );
    for rank in 0..2 {
        assert_eq!(
            plain[rank].1,
            vec![DType::F32],
            "without the policy: gathered in f32"
        );
        assert_eq!(gathered[rank].1, vec![DType::BF16], "gathered in bf16");
        assert_eq!(
            gathered[rank].0, plain[rank].0,
            "rank {rank}: the same weights, bit for bit"
        );
        let diff = super::max_relative_difference(&reduced[rank].0, &plain[rank].0);
        assert!(
            diff < 0.05,
            "rank {rank}: reduced in bf16, relative difference {diff}"
        );
        assert!(reduced[rank].0.iter().all(|w| w.is_finite()));
    }
}

/// Blocks gathered in a half dtype compute in it: the forward pass must run in it too, so the setting without the
/// matching mixed precision is refused, naming both.
#[test]
fn a_half_gather_without_the_matching_mixed_precision_is_refused() {
    let err = AcceleratorBuilder::default()
        .sharding(ShardingStrategy::FullShard)
        .fsdp_param_dtype(ShardDtype::Bf16)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fsdp_param_dtype") && err.contains("mixed_precision bf16"),
        "{err}"
    );
    assert!(
        AcceleratorBuilder::default()
            .fsdp_param_dtype(ShardDtype::Fp32)
            .build()
            .is_ok()
    );
}
