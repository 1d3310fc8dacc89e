//! A training run through the Accelerator (one process, default backend) ends with the same weights as the
//! hand-written Burn loop on the same seed and data.

use crate::fixtures;
use crate::mlp;

use burn::data::dataloader::batcher::Batcher;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use burn_accelerate::Accelerator;
use burn_accelerate::data::DataLoaderBuilder;
use fixtures::max_abs_diff;
use mlp::{Mlp, SampleBatcher, weights};

const SAMPLES: usize = 200;
const BATCH: usize = 16;
const EPOCHS: usize = 3;
const LR: f64 = 1e-2;

fn schedule_len() -> usize {
    EPOCHS * SAMPLES.div_ceil(BATCH)
}

/// The loop a Burn user writes by hand.
fn raw_burn(initial: Mlp, device: &Device) -> Mlp {
    let data = mlp::samples(SAMPLES, 5);
    let mut model = initial;
    let mut optim = AdamConfig::new().init();
    let mut sched = LinearLrSchedulerConfig::new(LR, LR / 10.0, schedule_len())
        .init()
        .unwrap();
    for _ in 0..EPOCHS {
        for chunk in data.chunks(BATCH) {
            let batch = SampleBatcher.batch(chunk.to_vec(), device);
            let loss = model.loss(batch);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(sched.step(), model, grads);
        }
    }
    model
}

/// The same loop with the Quicktour's changes.
fn accelerated(initial: Mlp) -> Mlp {
    let accelerator = Accelerator::new().unwrap();
    let mut model = accelerator.prepare_model(initial).unwrap();
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), LR);
    let schedule = LinearLrSchedulerConfig::new(LR, LR / 10.0, schedule_len())
        .init()
        .unwrap();
    let mut scheduler = accelerator.prepare_scheduler(schedule, &optimizer);
    let loader = accelerator
        .prepare_dataloader(
            DataLoaderBuilder::new(SampleBatcher)
                .batch_size(BATCH)
                .build(mlp::dataset(SAMPLES, 5)),
        )
        .unwrap();
    for _ in 0..EPOCHS {
        for batch in loader.iter() {
            let loss = model.loss(batch.unwrap());
            accelerator.backward(loss, &model).unwrap();
            model = optimizer.step(model);
            scheduler.step();
        }
    }
    model
}

#[test]
fn accelerated_training_matches_raw_burn_loop() {
    let device = Device::default().autodiff();
    device.seed(1234);
    let initial = Mlp::new(&device);
    let start = weights(&initial);
    let raw = weights(&raw_burn(initial.clone(), &device));
    let acc = weights(&accelerated(initial));
    let moved = max_abs_diff(&start, &raw);
    assert!(moved > 1e-3, "training changed the weights ({moved})");
    let diff = max_abs_diff(&raw, &acc);
    assert_eq!(
        diff, 0.0,
        "accelerated and raw weights must be bitwise equal"
    );
}

#[test]
fn global_norm_clipping_through_the_accelerator() {
    let accelerator = Accelerator::new().unwrap();
    let model = accelerator
        .prepare_model(Mlp::new(accelerator.device()))
        .unwrap();
    let batch = SampleBatcher.batch(mlp::samples(32, 9), accelerator.device());

    // Reference: Burn's raw gradients and their global L2 norm.
    let grads = GradientsParams::from_grads(model.loss(batch.clone()).backward(), &model);
    struct Norm<'a>(&'a GradientsParams, f64, Vec<Vec<f32>>);
    impl ModuleVisitor for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let g = self
                .0
                .get::<D>(param.id)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            self.1 += g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
            self.2.push(g);
        }
    }
    let mut reference = Norm(&grads, 0.0, Vec::new());
    model.visit(&mut reference);
    let manual = reference.1.sqrt();

    accelerator.backward(model.loss(batch), &model).unwrap();
    let max_norm = manual / 4.0;
    let total = accelerator.clip_grad_norm(&model, max_norm).unwrap();
    assert!(
        (total - manual).abs() / manual < 1e-5,
        "{total} vs {manual}"
    );

    struct Clipped<'a>(&'a Accelerator, Vec<Vec<f32>>);
    impl ModuleVisitor for Clipped<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1.push(
                self.0
                    .grad(param)
                    .unwrap()
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut clipped = Clipped(&accelerator, Vec::new());
    model.visit(&mut clipped);
    let coef = (max_norm / (manual + 1e-6)) as f32;
    assert_eq!(reference.2.len(), clipped.1.len());
    for (raw, clip) in reference.2.iter().zip(&clipped.1) {
        assert_eq!(raw.len(), clip.len());
        // A NaN fails the comparison below.
        for (r, c) in raw.iter().zip(clip) {
            assert!(
                (r * coef - c).abs() <= 1e-6 + 1e-5 * c.abs(),
                "{r} * {coef} != {c}"
            );
        }
    }
    let after: f64 = clipped
        .1
        .iter()
        .flatten()
        .map(|x| (*x as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(
        (after - max_norm).abs() / max_norm < 1e-4,
        "norm after clipping {after}, wanted {max_norm}"
    );
}

#[test]
fn backward_on_an_unprepared_model_is_an_error() {
    let accelerator = Accelerator::new().unwrap();
    let plain = Device::default();
    let model = Mlp::new(&plain);
    let loss = model.loss(SampleBatcher.batch(mlp::samples(4, 1), &plain));
    let err = accelerator.backward(loss, &model).unwrap_err().to_string();
    assert!(err.contains("prepare_model"), "{err}");
}

#[test]
fn end_of_dataloader_is_reported_on_the_last_batch() {
    let accelerator = Accelerator::new().unwrap();
    let loader = accelerator
        .prepare_dataloader(
            DataLoaderBuilder::new(SampleBatcher)
                .batch_size(4)
                .build(mlp::dataset(10, 0)),
        )
        .unwrap();
    let flags: Vec<bool> = loader
        .iter()
        .map(|b| {
            b.unwrap();
            accelerator.gradient_state().end_of_dataloader
        })
        .collect();
    assert_eq!(flags, vec![false, false, true]);
}

#[test]
fn device_placement_off_leaves_the_model_alone() {
    let accelerator = Accelerator::builder()
        .device_placement(false)
        .build()
        .unwrap();
    let plain = Device::default();
    let model = accelerator.prepare_model(Mlp::new(&plain)).unwrap();
    let loss = model.loss(SampleBatcher.batch(mlp::samples(4, 1), &plain));
    assert!(
        !loss.is_tracked(),
        "an unplaced model keeps its plain device"
    );
}
