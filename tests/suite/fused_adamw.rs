//! The fused AdamW against Burn's AdamW: the same bits in a plain Burn loop, through every strategy (with fp16,
//! clipping and accumulation), and across a checkpoint written by one and resumed by the other.

use crate::fixtures;
use crate::mlp;

use std::path::PathBuf;

use burn::data::dataloader::batcher::Batcher;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn_accelerate::optim::{FusedAdamWConfig, FusedAdamWUpdates};
use burn_accelerate::{Accelerator, MixedPrecision, Result, ShardingStrategy, StateToSave};
use fixtures::initial;
use mlp::{Mlp, SampleBatcher, weights};

/// Which AdamW.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Which {
    Burn,
    Fused,
}

/// The optimizer, and for the fused one the count of its updates each way.
fn counted(which: Which, weight_decay: f32) -> (ModuleOptimizer, Option<FusedAdamWUpdates>) {
    match which {
        Which::Burn => (
            AdamWConfig::new().with_weight_decay(weight_decay).init(),
            None,
        ),
        Which::Fused => {
            let (optimizer, updates) = FusedAdamWConfig::new()
                .with_weight_decay(weight_decay)
                .init_counted();
            (optimizer, Some(updates))
        }
    }
}

fn optimizer(which: Which, weight_decay: f32) -> ModuleOptimizer {
    counted(which, weight_decay).0
}

/// Every update of `updates` went through the fused loop: `expected` of them, none through Burn's AdamW (so that
/// the comparison with Burn's AdamW compares two implementations, not one with itself).
fn all_fused(updates: &FusedAdamWUpdates, expected: u64, what: &str) {
    assert_eq!(
        (updates.fused(), updates.fallback()),
        (expected, 0),
        "{what}: updates by the fused loop and by Burn's AdamW"
    );
}

/// `steps` steps of a plain Burn loop (no accelerator) from the fixed initial model.
fn plain(which: Which, weight_decay: f32, steps: usize) -> Vec<Vec<f32>> {
    let mut model = initial();
    let device = burn::tensor::Device::default().autodiff();
    let (mut optim, updates) = counted(which, weight_decay);
    for step in 0..steps {
        let batch = SampleBatcher.batch(mlp::samples(32, step as u64), &device);
        let grads = GradientsParams::from_grads(model.loss(batch).backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    let weights = weights(&model);
    if let Some(updates) = updates {
        all_fused(&updates, (steps * weights.len()) as u64, "a plain loop");
    }
    weights
}

#[test]
fn a_plain_burn_loop_gets_the_same_bits() {
    for weight_decay in [0.0, 1e-4, 0.05] {
        assert_eq!(
            plain(Which::Fused, weight_decay, 12),
            plain(Which::Burn, weight_decay, 12),
            "weight decay {weight_decay}"
        );
    }
    assert_ne!(
        plain(Which::Fused, 0.0, 12),
        weights(&initial()),
        "it trains"
    );
}

/// `steps` micro-batches on `ranks` ranks through the accelerator, clipping each synchronising step to a norm of
/// 0.5; each rank's weights.
fn accelerated(
    which: Which,
    ranks: usize,
    sharding: ShardingStrategy,
    precision: MixedPrecision,
    accumulation: usize,
    steps: usize,
) -> Vec<Vec<Vec<f32>>> {
    Accelerator::builder()
        .sharding(sharding)
        .mixed_precision(precision)
        .gradient_accumulation_steps(accumulation)
        .launch(ranks, move |acc| -> Result<Vec<Vec<f32>>> {
            let device = acc.device().clone();
            let mut model = acc.prepare_model(initial())?;
            let (optim, updates) = counted(which, 0.01);
            let mut optim = acc.prepare_optimizer(optim, 1e-2);
            for step in 0..steps {
                let seed = (step * ranks + acc.process_index()) as u64;
                let batch = SampleBatcher.batch(mlp::samples(16, seed), &device);
                let _ = acc.accumulate();
                let whole = acc.unshard(&model)?;
                acc.backward(whole.loss(batch), &whole)?;
                if acc.sync_gradients() {
                    acc.clip_grad_norm(&whole, 0.5)?;
                }
                drop(whole);
                model = optim.try_step(model)?;
            }
            // Every parameter this rank steps (its slices, under sharding), on every step that applied, went
            // through the fused loop (none skipped here: fp16's first steps may overflow and skip).
            if let Some(updates) = updates {
                assert!(updates.fused() > 0, "{sharding}: no fused update");
                assert_eq!(
                    updates.fallback(),
                    0,
                    "{sharding} {precision:?} accumulation {accumulation}: updates through Burn's AdamW ({} \
                     fused)",
                    updates.fused()
                );
            }
            Ok(weights(&acc.unshard(&model)?))
        })
        .unwrap()
}

#[test]
fn every_strategy_gets_the_same_bits_with_fp16_clipping_and_accumulation() {
    let cases = [
        (1, ShardingStrategy::NoShard, MixedPrecision::No, 1),
        (2, ShardingStrategy::NoShard, MixedPrecision::No, 2),
        (2, ShardingStrategy::ShardGradOp, MixedPrecision::No, 1),
        (2, ShardingStrategy::FullShard, MixedPrecision::No, 2),
        (2, ShardingStrategy::NoShard, MixedPrecision::Fp16, 2),
        (2, ShardingStrategy::ShardGradOp, MixedPrecision::Bf16, 1),
    ];
    for (ranks, sharding, precision, accumulation) in cases {
        let fused = accelerated(Which::Fused, ranks, sharding, precision, accumulation, 8);
        let burn = accelerated(Which::Burn, ranks, sharding, precision, accumulation, 8);
        assert_eq!(
            fused, burn,
            "{ranks} ranks, {sharding}, {precision:?}, accumulation {accumulation}"
        );
        assert_ne!(fused[0], weights(&initial()), "it trains");
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-fused-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// 4 steps with `first`, a save, then a fresh optimizer `then` resumed from it for 4 more steps (2 ranks,
/// `sharding`); rank 0's weights.
fn resumed(first: Which, then: Which, sharding: ShardingStrategy, dir: PathBuf) -> Vec<Vec<f32>> {
    let out = Accelerator::builder()
        .sharding(sharding)
        .launch(2, move |acc| -> Result<Vec<Vec<f32>>> {
            let device = acc.device().clone();
            let mut model = acc.prepare_model(initial())?;
            let mut optim = acc.prepare_optimizer(optimizer(first, 0.01), 1e-2);
            let train = |model: Mlp,
                         optim: &mut burn_accelerate::optim::AcceleratedOptimizer,
                         range: std::ops::Range<usize>|
             -> Result<Mlp> {
                let mut model = model;
                for step in range {
                    let seed = (step * 2 + acc.process_index()) as u64;
                    let batch = SampleBatcher.batch(mlp::samples(16, seed), &device);
                    let whole = acc.unshard(&model)?;
                    acc.backward(whole.loss(batch), &whole)?;
                    drop(whole);
                    model = optim.try_step(model)?;
                }
                Ok(model)
            };
            model = train(model, &mut optim, 0..4)?;
            let parts = StateToSave::new().model(&model)?.optimizer(&optim)?;
            acc.save_state(Some(&dir), &parts)?;
            let mut resumed = acc.prepare_optimizer(optimizer(then, 0.01), 1e-2);
            let mut state = acc.load_state(Some(&dir))?;
            let model = state.model(model)?;
            state.optimizer(&mut resumed)?;
            state.finish()?;
            let model = train(model, &mut resumed, 4..8)?;
            Ok(weights(&acc.unshard(&model)?))
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn a_checkpoint_of_either_resumes_in_the_other() {
    for sharding in [ShardingStrategy::NoShard, ShardingStrategy::ShardGradOp] {
        let straight = resumed(Which::Burn, Which::Burn, sharding, temp_dir("bb"));
        let burn_then_fused = resumed(Which::Burn, Which::Fused, sharding, temp_dir("bf"));
        let fused_then_burn = resumed(Which::Fused, Which::Burn, sharding, temp_dir("fb"));
        assert_eq!(
            burn_then_fused, straight,
            "{sharding}: Burn's state resumed by the fused AdamW"
        );
        assert_eq!(
            fused_then_burn, straight,
            "{sharding}: the fused state resumed by Burn's AdamW"
        );
        for name in ["bb", "bf", "fb"] {
            let _ = std::fs::remove_dir_all(temp_dir(name));
        }
    }
}

#[test]
fn tensors_the_loop_cannot_take_step_through_burns_adamw() {
    // f64 parameters: not the fused loop's f32, so both optimizers run Burn's AdamW, to the same bits.
    use burn::module::Param;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{DType, Tensor, TensorData};
    let run = |which: Which| {
        let device = burn::tensor::Device::default().autodiff();
        let mut layer: Linear = LinearConfig::new(3, 2).init(&device);
        let values: Vec<f64> = (0..6).map(|i| (i as f64 * 0.7).sin()).collect();
        layer.weight = Param::from_tensor(Tensor::from_data(
            TensorData::new(values, [3, 2]),
            (&device, DType::F64),
        ));
        layer.bias = None;
        let (mut optim, updates) = counted(which, 0.01);
        for step in 0..5 {
            let x = Tensor::<2>::from_data(
                TensorData::new(vec![step as f64 * 0.1 + 0.3; 12], [4, 3]),
                (&device, DType::F64),
            );
            let grads = GradientsParams::from_grads(
                layer.forward(x).powi_scalar(2).sum().backward(),
                &layer,
            );
            layer = optim.step(1e-2, layer, grads);
        }
        assert_eq!(layer.weight.val().dtype(), DType::F64);
        if let Some(updates) = updates {
            // The fallback, as documented: every update through Burn's AdamW, none through the loop.
            assert_eq!((updates.fused(), updates.fallback()), (0, 5));
        }
        layer.weight.val().into_data().try_to_vec::<f64>().unwrap()
    };
    assert_eq!(run(Which::Fused), run(Which::Burn));
}
